"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: hybrid Gated DeltaNet + gated-attention decoders against transformers.

Without a process group: the chunked gated delta rule, the packed recurrence and the packed conv against
transformers' torch functions run per document (several documents, longer than a chunk); the new TP layouts
(``PartsSplit``, ``FusedSplit``, an output-gated ``QKVSplit``): ``merge(shard(x)) == x`` and blocks that say
what the shard holds; the layer kinds and table coverage of each family.

One spawn of 4 ranks runs every case of CASES in turn (``init_parallel(tp, pp, ep=...)`` per case). Per case:
fp32 logits (and log-probs) against transformers, a bit-exact save (``save_hf_weights``) and export stream
against the Hub checkpoint, a broadcast load giving the same outputs, one SGD step (loss, stepped weights, output
after) against transformers' step on the same microbatches.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import helpers
from parallm.verify.reference import causal_lm_loss, hf_output, value_loss

LR = 0.1   # a smaller step than the dense tests: the stepped hybrid model stays well conditioned
WORLD = 4
TOL = 2e-5

# hidden 64, 4 layers: [linear, full, linear, full]; 2 key heads / 4 value heads of 8; attention: 4 heads of 16,
# 2 KV heads, rotary on the first 4 channels (factor 0.25)
HYBRID = dict(num_hidden_layers=4, full_attention_interval=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)


def hybrid_config(model_type: str, **overrides):
    """A tiny config of ``model_type``; ``qwen3_5`` / ``qwen3_5_moe``: the vision-language config (its
    ``text_config`` the tiny text model, a 2-block vision tower)."""
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        import transformers
        text = hybrid_config(model_type + "_text", **overrides).to_dict()
        return transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=dict(VISION))
    extra = MOE if model_type in ("qwen3_5_moe_text", "qwen3_next") else {}
    cfg = helpers.tiny_config(model_type, **dict(HYBRID, **extra, **overrides))
    if model_type == "qwen3_5_moe_text":      # as transformers' config has it: no dense MLP width at all
        del cfg.intermediate_size
    return cfg


def make_model(cfg, *, seed: int, task: str = "causal_lm"):
    """:func:`helpers.make_hf_model`, its zero-centred norms (``x * (1 + w)``) re-centred to ``w ~ 0.2 N(0, 1)``
    (the shared randomiser's ``1 + 0.2 N`` would double every norm's scale); the gated norm keeps ``1 + 0.2 N``."""
    if getattr(cfg, "vision_config", None) is not None:       # *ForConditionalGeneration
        import transformers
        torch.manual_seed(seed)
        if task == "value":
            cfg.num_labels = 1
            model = transformers.AutoModelForSequenceClassification.from_config(cfg).float().eval()
        else:
            model = transformers.AutoModelForImageTextToText.from_config(cfg).float().eval()
        helpers.randomize_(model, seed)
    else:
        model = helpers.make_hf_model(cfg, seed=seed, task=task)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and ".linear_attn." not in name:
                p.sub_(1.0)
    return model


# -- no process group ----------------------------------------------------------------------------------------

def _qkvgb(length, *, hk=2, hv=4, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(length, hv, dv, generator=g)
    decay = -torch.rand(length, hv, generator=g) * 0.5
    beta = torch.rand(length, hv, generator=g)
    return q, k, v, decay, beta


def test_recurrence_and_conv_match_transformers_per_document():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from parallm.model.layers import gated_deltanet as gdn
    docs = [(0, 70), (70, 75), (75, 150), (150, 151)]           # several chunks, a 5- and a 1-token document
    cu = torch.tensor([0] + [b for _, b in docs], dtype=torch.int32)
    q, k, v, decay, beta = _qkvgb(151)
    # padded rows (batch of 2, grouped values, 3 chunks): transformers' chunked and recurrent forms
    rows = [t[None].expand(2, *t.shape).clone() for t in (q, k, v, decay, beta)]
    rows[2][1] *= 0.5
    ref, _ = hf.torch_chunk_gated_delta_rule(*rows, use_qk_l2norm_in_kernel=True)
    rec, _ = hf.torch_recurrent_gated_delta_rule(*rows, use_qk_l2norm_in_kernel=True)
    mine = gdn.chunk_gated_delta_rule(*rows)
    assert torch.equal(mine, ref)
    assert (mine - rec).abs().max() < 1e-5
    # a packed stream: every document from a zero state, as transformers run on it alone
    packed = gdn.torch_packed_rule(q, k, v, decay, beta, cu)
    alone = torch.cat([hf.torch_chunk_gated_delta_rule(*(t[a:b][None] for t in (q, k, v, decay, beta)),
                                                       use_qk_l2norm_in_kernel=True)[0][0] for a, b in docs])
    assert (packed - alone).abs().max() < 1e-6
    whole = hf.torch_chunk_gated_delta_rule(*(t[None] for t in (q, k, v, decay, beta)),
                                            use_qk_l2norm_in_kernel=True)[0][0]
    assert (whole[70:] - alone[70:]).abs().max() > 1e-2       # without the resets the documents would leak
    # the conv: windows never reach into an earlier document
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(151, 10, generator=g), torch.randn(10, 1, 4, generator=g)
    conv = gdn.causal_conv_packed(x, w, cu)
    alone = torch.cat([hf.causal_conv1d_fn(x[a:b].T[None], w[:, 0], None, activation="silu")[0].T for a, b in docs])
    assert (conv - alone).abs().max() < 1e-5
    whole = hf.causal_conv1d_fn(x.T[None], w[:, 0], None, activation="silu")[0].T
    assert (whole[70:73] - alone[70:73]).abs().max() > 1e-2
    padded = gdn.causal_conv_padded(x.T[None], w)[0].T
    assert torch.equal(padded, whole)


def test_layouts_round_trip_and_blocks():
    from parallm.model.sharding import FusedSplit, PartsSplit, QKVSplit, Split, TensorSource
    g = torch.Generator().manual_seed(0)
    kd, vd, h, hidden = 16, 32, 4, 5
    layouts = {
        "parts": (PartsSplit((kd, kd, vd)), [(2 * kd + vd, 1, 4)]),
        "qwen3.5 in_proj": (FusedSplit([(PartsSplit((kd, kd, vd)), 2 * kd + vd), (Split(0), vd), (Split(0), h),
                                        (Split(0), h)]), [(2 * kd + vd, hidden), (vd, hidden), (h, hidden),
                                                          (h, hidden)]),
        "qwen3-next in_proj": (FusedSplit([(Split(0), 2 * kd + 2 * vd), (Split(0), 2 * h)]),
                               [(2 * kd + 2 * vd, hidden), (2 * h, hidden)]),
        "gated qkv": (QKVSplit(4, 2, 3, q_head_dim=6), [(24, hidden), (6, hidden), (6, hidden)]),
        "gated qkv nkv<tp": (QKVSplit(4, 1, 3, q_head_dim=6), [(24, hidden), (3, hidden), (3, hidden)]),
    }
    for name, (layout, shapes) in layouts.items():
        srcs = [torch.randn(s, generator=g) for s in shapes]
        for tp in (1, 2, 4):
            if name == "gated qkv nkv<tp" and tp == 1:
                continue
            shards = [layout.shard([TensorSource(s) for s in srcs], r, tp) for r in range(tp)]
            back = layout.merge(shards)
            assert all(torch.equal(a, b) for a, b in zip(back, srcs)), (name, tp)
            for r, shard in enumerate(shards):
                assert layout.shard_shape(r, tp, shapes) == tuple(shard.shape), (name, tp)
                covered = torch.zeros(shard.shape[0], dtype=torch.bool)
                for blk in layout.blocks(r, tp, shapes):
                    assert torch.equal(shard[blk.local_start:blk.local_stop], srcs[blk.source][blk.hf_start:blk.hf_stop])
                    covered[blk.local_start:blk.local_stop] = True
                assert covered.all(), (name, tp, r)
    # Qwen3.5's [q; k; v] by heads: rank 1 of 2 holds the second half of each part
    parts = PartsSplit((kd, kd, vd)).shard([torch.arange(2 * kd + vd)], 1, 2)
    assert parts.tolist() == (list(range(8, 16)) + list(range(24, 32)) + list(range(48, 64)))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_spec_and_table_cover_the_checkpoint(model_type, tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    cfg = hybrid_config(model_type, num_hidden_layers=5, layer_types=["linear_attention", "full_attention",
                                                                      "linear_attention", "linear_attention",
                                                                      "full_attention"])
    model = make_model(cfg, seed=0)
    spec, family = spec_from_config(cfg)
    assert spec.linear_attn.layers == (0, 2, 3) and spec.attn_output_gate and spec.zero_centered_norm
    assert spec.rotary_dim == 4 and spec.qk_norm
    assert bool(spec.carried) == (model_type in ("qwen3_5", "qwen3_5_moe"))     # the vision tower
    hub = helpers.hub_state_dict(model, str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    # divisibility by heads is checked with the numbers
    from parallm.model.spec import check_tp
    with pytest.raises(ValueError, match="linear_num_key_heads=2 is not divisible by tp=4"):
        check_tp(spec, 4)
    with pytest.raises(ValueError, match=r"layer_types \['sliding_attention'\] are not supported"):
        spec_from_config(hybrid_config(model_type, layer_types=["sliding_attention", "full_attention"] * 2))


def test_vision_config_named_after_the_vl_model_still_lists_the_tower():
    """Early Qwen3.5 checkpoints say ``vision_config.model_type: qwen3_5`` (transformers corrects it to
    ``qwen3_5_vision`` on load): the carried tensors are the same."""
    from parallm.families import spec_from_config
    raw = hybrid_config("qwen3_5").to_dict()
    want, _ = spec_from_config(raw)
    raw["vision_config"] = dict(raw["vision_config"], model_type="qwen3_5")
    got, family = spec_from_config(raw)
    assert family.name == "qwen3_5_vl" and got.carried == want.carried and len(got.carried) == 2 * 12 + 9


def test_context_parallel_needs_heads_divisible_by_tp_times_cp():
    from parallm.families import spec_from_config
    from parallm.model.layers.gated_deltanet import check_cp_heads
    spec, _ = spec_from_config(hybrid_config("qwen3_5_text", linear_num_key_heads=2, linear_num_value_heads=8))
    check_cp_heads(spec, 1, 2)
    with pytest.raises(ValueError, match=r"tp=2 x cp=2: .*linear_num_key_heads=2 / tp=2 = 1 is not divisible by cp=2"):
        check_cp_heads(spec, 2, 2)


def test_inspect_shows_the_hybrid_layers_and_refuses_tp_by_heads(tmp_path, capsys):
    import json

    from parallm.cli import main
    ckpt = str(tmp_path / "next")
    make_model(hybrid_config("qwen3_next"), seed=1).save_pretrained(ckpt)

    def run(*args):
        try:
            code = main(["inspect", ckpt, *args])
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out + out.err

    code, text = run("--tp", "2", "--pp", "2", "--layers-per-stage", "balanced")
    assert code == 0, text
    assert "hybrid        Gated DeltaNet layers [0, 2] (2 key heads x 8, 4 value heads x 8, conv 4)" in text
    assert "ok: every tensor the model needs is present" in text
    code, text = run("--json")
    assert code == 0 and json.loads(text)["valid_tp"] == [1, 2] and json.loads(text)["config"]["linear_layers"] == [0, 2]
    code, text = run("--tp", "4")
    assert code != 0 and "linear_num_key_heads=2 is not divisible by tp=4" in text


# -- distributed: parity, round trip, one step -----------------------------------------------------------------

def long_batch(vocab: int, *, batch: int, seq: int, seed: int):
    """Rows of ``seq`` tokens, padded like :func:`helpers.padded_batch` but longer than one 64-token chunk."""
    return helpers.padded_batch(vocab, batch=batch, seq=seq, seed=seed)


# name, model_type, config overrides, layout (tp, pp, ep, nmb), build kwargs, options
CASES = [
    ("qwen3.5 dense tp2 dp2 padded, recompute", "qwen3_5_text", {}, dict(tp=2, pp=1, ep=1, nmb=1),
     {"recompute": "full"}, dict(logprobs=True)),
    ("qwen3.5 dense packed+SP tp2 dp2, 8 docs of up to 80 tokens", "qwen3_5_text", {},
     dict(tp=2, pp=1, ep=1, nmb=2), {"packed": True, "sequence_parallel": True}, dict(seq=80, logprobs=True)),
    ("qwen3.5 value tp2 dp2 packed", "qwen3_5_text", {}, dict(tp=2, pp=1, ep=1, nmb=1),
     {"task": "value", "packed": True}, {}),
    ("qwen3-next tp2 pp2 uneven [0] [1 2 3] mb2", "qwen3_next", {}, dict(tp=2, pp=2, ep=1, nmb=2),
     {"num_layers_in_first_pipeline_stage": 1}, dict(split=[[0], [1, 2, 3]])),
    ("qwen3.5 pp2 vpp2 dp2 tied mb2", "qwen3_5_text", dict(tie_word_embeddings=True),
     dict(tp=1, pp=2, vpp=2, ep=1, nmb=2), {}, {}),
    ("qwen3.5-moe tp2 ep2", "qwen3_5_moe_text", {}, dict(tp=2, pp=1, ep=2, nmb=1), {}, {}),
    # context parallelism: Gated DeltaNet layers head-parallel over the CP group (all-to-all), attention as ever
    ("qwen3.5 cp2 dp2 packed, docs of up to 80 tokens", "qwen3_5_text", {}, dict(tp=1, pp=1, cp=2, ep=1, nmb=1),
     {"packed": True}, dict(seq=80, logprobs=True)),
    ("qwen3-next tp2 cp2 padded, 4 / 8 linear heads", "qwen3_next",
     dict(linear_num_key_heads=4, linear_num_value_heads=8), dict(tp=2, pp=1, cp=2, ep=1, nmb=1), {},
     dict(logprobs=True)),
    ("qwen3.5 tp2 cp2 packed+SP ring, 4 / 8 linear heads", "qwen3_5_text",
     dict(linear_num_key_heads=4, linear_num_value_heads=8), dict(tp=2, pp=1, cp=2, ep=1, nmb=1),
     {"packed": True, "sequence_parallel": True, "cp_attn": "ring"}, {}),
    # the published vision-language checkpoints: language model under model.language_model.*, vision carried
    ("qwen3.5 VL checkpoint tp2 pp2 packed", "qwen3_5", {}, dict(tp=2, pp=2, ep=1, nmb=2), {"packed": True},
     dict(vision=True)),
    ("qwen3.5-moe VL checkpoint tp2 ep2", "qwen3_5_moe", {}, dict(tp=2, pp=1, ep=2, nmb=1), {}, dict(vision=True)),
    ("qwen3.5 VL value (Qwen3_5ForSequenceClassification) tp2 dp2", "qwen3_5", {}, dict(tp=2, pp=1, ep=1, nmb=1),
     {"task": "value"}, dict(vision=True)),
]


def reference_step(model, ids, mask, pieces, task, tmp):
    """Mean over ``pieces`` equal slices of the batch of the task loss; SGD step; (loss, Hub state dict after,
    output after)."""
    import copy
    model = copy.deepcopy(model)
    model.zero_grad()
    loss_fn = value_loss if task == "value" else causal_lm_loss
    size = ids.shape[0] // pieces
    loss = torch.stack([loss_fn(hf_output(model, ids[i:i + size], mask[i:i + size], task=task), ids[i:i + size],
                                mask[i:i + size]) for i in range(0, ids.shape[0], size)]).mean()
    loss.backward()
    with torch.no_grad():
        norm = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum().sqrt()
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = hf_output(model, ids, mask, task=task)
    return loss.item(), helpers.hub_state_dict(model, tmp), after, norm.item()


def make_cases(tmp_path, specs=CASES):
    cases = []
    for i, (name, model_type, overrides, layout, build, opts) in enumerate(specs):
        task = build.get("task", "causal_lm")
        cfg = hybrid_config(model_type, **overrides)
        model = make_model(cfg, seed=60 + i, task=task)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = helpers.hub_state_dict(model, ckpt)
        vocab = cfg.get_text_config().vocab_size
        ids, mask = long_batch(vocab, batch=8, seq=opts.get("seq", 9), seed=i)
        dp = WORLD // (layout["tp"] * layout["pp"] * layout.get("cp", 1))
        loss, new_sd, after, norm = reference_step(model, ids, mask, dp * layout["nmb"], task, str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref = hf_output(model, ids, mask, task=task)
        case = dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, task=task, ref=ref, ref_sd=ckpt_sd,
                    spread=recurrent_spread(model, ids, mask, task),
                    ref_loss=loss, ref_new_sd=new_sd, ref_after=after, ref_norm=norm, opts=opts, **layout)
        if opts.get("logprobs"):
            lp = ref[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            case["ref_logprobs"] = torch.cat([lp, torch.zeros(ids.shape[0], 1)], dim=1)
        cases.append(case)
    return cases


def _load(chunks, ckpt, mode):
    import parallm
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, ckpt, mode=mode)


def rank_cases(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), cp=case.get("cp", 1), ep=case["ep"])
        lay = current_dims()
        opts, ids, mask = case["opts"], case["ids"], case["mask"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        assert len(chunks) == (case.get("vpp") or 1)
        if "split" in opts:
            assert [list(c.layer_range) for c in chunks] == [opts["split"][lay.pp_rank]], case["name"]
        assert all(c.gdn_kernel == "torch" for c in chunks)
        _load(chunks, case["ckpt"], "slice")
        got = parallm.forward(chunks, ids, mask)
        res = dict(fwd=helpers.max_diff_real(got, case["ref"], mask))
        if case["build"].get("packed"):
            assert torch.all(got[mask == 0] == 0)
        if opts.get("logprobs"):
            lp = parallm.forward(chunks, ids, mask, output="logprobs")
            keep = (mask[:, 1:] * mask[:, :-1]).bool()
            res["logprobs"] = (lp[:, :-1][keep] - case["ref_logprobs"][:, :-1][keep]).abs().max().item()
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            helpers.assert_same_state(sd, case["ref_sd"])
        else:
            assert sd == {}
        names = []
        for name, t in parallm.export_hf_tensors(chunks):
            names.append(name)
            assert torch.equal(t, case["ref_sd"][name]), (case["name"], name)
        dup = [n for n, k in collections.Counter(names).items() if k > 1]
        assert not dup and set(names) == set(case["ref_sd"]), (case["name"], dup,
                                                                 sorted(set(names) ^ set(case["ref_sd"]))[:5])
        other = parallm.build_model(case["ckpt"], **case["build"])
        _load(other, case["ckpt"], "broadcast")
        assert torch.equal(parallm.forward(other, ids, mask), got), case["name"]
        del other
        per = ids.shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        loss_fn = value_loss if case["task"] == "value" else causal_lm_loss
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_fn, num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        norm = parallm.clip_grad_norm_(chunks, float("inf"))      # the unsharded model's gradient norm
        res["norm"] = abs(norm.item() - case["ref_norm"]) / case["ref_norm"]
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
                    else:       # the carried vision tower: no gradient, nothing to step
                        assert opts.get("vision") and p.grad is None, case["name"]
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            res["weights"] = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
            res["worst"] = max(ref_new, key=lambda k: (new_sd[k] - ref_new[k]).abs().max().item())
            vision = [k for k in new_sd if k.startswith("model.visual.")]
            assert bool(vision) == bool(opts.get("vision")), case["name"]
            # carried bit for bit through load, training and save
            assert all(torch.equal(new_sd[k], case["ref_sd"][k]) for k in vision), case["name"]
        res.update(loss=abs(loss.item() - case["ref_loss"]),
                   after=helpers.max_diff_real(after, case["ref_after"], mask))
        out.append(res)
        parallm.destroy_parallel()
    return out


def recurrent_spread(model, ids, mask, task) -> float:
    """How far transformers' two exact forms of the recurrence (chunked, token by token) put its own output
    apart on this batch: the floor of any fp32 comparison here."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35moe
    from transformers.models.qwen3_next import modeling_qwen3_next as mnext
    mods = (m35, m35moe, mnext)
    saved = [m.torch_chunk_gated_delta_rule for m in mods]
    with torch.no_grad():
        chunked = hf_output(model, ids, mask, task=task)
        try:
            for m in mods:
                m.torch_chunk_gated_delta_rule = (lambda rec: lambda *a, chunk_size=64, **kw: rec(*a, **kw))(
                    m.torch_recurrent_gated_delta_rule)
            recurrent = hf_output(model, ids, mask, task=task)
        finally:
            for m, f in zip(mods, saved):
                m.torch_chunk_gated_delta_rule = f
    return helpers.max_diff_real(chunked, recurrent, mask)


def check(cases, results):
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd, loss = max(r["fwd"] for r in per_rank), max(r["loss"] for r in per_rank)
        after, wdiff = max(r["after"] for r in per_rank), per_rank[0]["weights"]
        lp = max(r.get("logprobs", 0.0) for r in per_rank)
        print(f"{case['name']:<60} fwd {fwd:.1e} (transformers' own spread {case['spread']:.1e}) loss {loss:.1e} "
              f"weights {wdiff:.1e} ({per_rank[0]['worst']}) after {after:.1e} logprobs {lp:.1e}")
        # Rows longer than a chunk: parallm starts every packed document at a chunk boundary, transformers runs
        # the padded row, so the chunks' float order differs; transformers' chunked and token-by-token forms
        # differ by about as much (``spread``). These hybrid models are sensitive to their weights (1e-6 relative
        # noise on the weights moved transformers' own output by ~1e-4 on 80-token rows), so the output after the
        # step is held to 1e-4 while the stepped weights themselves stay within TOL (all < 1e-6 here).
        assert fwd < max(TOL, 2 * case["spread"]), case["name"]
        assert loss < TOL, case["name"]
        assert wdiff < TOL, case["name"]
        assert after < 1e-4, case["name"]
        assert max(r["norm"] for r in per_rank) < 1e-5, (case["name"], [r["norm"] for r in per_rank])
        assert lp < max(TOL, 2 * case["spread"]), case["name"]


@pytest.mark.timeout(600)
def test_qwen3_5_families_parity_round_trip_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path)
    check(cases, helpers.run_ranks(rank_cases, WORLD, cases, timeout=580))


# -- training checkpoints: saved at one layout, loaded at another -------------------------------------------------

def rank_train_checkpoint(rank, world, ckpt, path, steps):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    for name, layout in (("save", dict(tp=2, ep=2)), ("load", dict(tp=1, pp=2, ep=2))):
        parallm.init_parallel(**layout)
        dims = current_dims()
        chunks = parallm.build_model(ckpt, packed=True)
        opt = parallm.build_optimizer(chunks, lr=1e-3)
        if name == "save":
            parallm.load_hf_weights(chunks, ckpt)
        else:
            parallm.load_checkpoint(path, chunks, opt)
        todo = steps[:1] if name == "save" else []
        for ids in todo + steps[1:]:
            if name == "save" and ids is steps[1]:
                parallm.save_checkpoint(path, chunks, opt, step=1)
                out["at-save"] = parallm.save_hf_weights(chunks)
            if name == "load" and ids is steps[1]:
                out["loaded"] = parallm.save_hf_weights(chunks)
            per = ids.shape[0] // dims.dp
            parallm.forward_backward(chunks, ids[dims.dp_rank * per:(dims.dp_rank + 1) * per],
                                     torch.ones_like(ids[:per]), loss_fn=causal_lm_loss)
            parallm.finalize_grads(chunks)
            opt.step()
            opt.zero_grad()
        out[name] = parallm.save_hf_weights(chunks)
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(400)
def test_training_checkpoint_reshards_a_vl_moe_model(tmp_path):
    """A Qwen3.5-MoE vision-language model: AdamW steps at tp2 x ep2, a training checkpoint, loaded at pp2 x ep2:
    the weights come back bit for bit (the carried vision tower too), and the next step matches the uninterrupted
    run's."""
    cfg = hybrid_config("qwen3_5_moe")
    model = make_model(cfg, seed=7)
    ckpt = str(tmp_path / "hf")
    hub = helpers.hub_state_dict(model, ckpt)
    g = torch.Generator().manual_seed(3)
    steps = [torch.randint(0, cfg.get_text_config().vocab_size, (4, 12), generator=g) for _ in range(2)]
    res = helpers.run_ranks(rank_train_checkpoint, WORLD, ckpt, str(tmp_path / "train"), steps)[0]
    helpers.assert_same_state(res["loaded"], res["at-save"])
    vision = [k for k in hub if k.startswith("model.visual.")]
    assert vision and all(torch.equal(res[k][v], hub[v]) for k in ("at-save", "save", "load") for v in vision)
    moved = max((res["at-save"][k] - hub[k]).abs().max().item() for k in hub)
    assert moved > 1e-4                                   # the first step changed the language model
    diff = max((res["load"][k] - res["save"][k]).abs().max().item() for k in hub)
    assert diff < 1e-6, diff


# -- multi-token prediction: mtp.* carried bit for bit -------------------------------------------------------------

def add_mtp(ckpt: str, hub: dict, *, seed: int, layers: int = 1) -> dict:
    """Write multi-token-prediction tensors into ``ckpt``'s safetensors as the published checkpoints hold them
    (``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm`` [H], ``mtp.layers.{j}.*``:
    a full-attention decoder layer, named and shaped as the model's last full-attention layer, experts included)
    with random values; returns them. A sharded checkpoint gets them as a shard of its own in the index."""
    import json
    import os

    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(seed)
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in hub) else "model."
    full = max(int(k.split(".")[-4 if ".mlp.experts." not in k else -6]) for k in hub
               if k.startswith(prefix + "layers.") and ".self_attn.q_proj." in k)
    h = hub[prefix + "norm.weight"].shape[0]
    mtp = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for j in range(layers):
        src = f"{prefix}layers.{full}."
        mtp.update({f"mtp.layers.{j}." + k[len(src):]: tuple(v.shape) for k, v in hub.items() if k.startswith(src)})
    tensors = {k: torch.randn(shape, generator=g) for k, shape in mtp.items()}
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(index):
        save_file(tensors, os.path.join(ckpt, "model-mtp.safetensors"), metadata={"format": "pt"})
        data = json.load(open(index))
        data["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        json.dump(data, open(index, "w"))
    else:
        path = os.path.join(ckpt, "model.safetensors")
        save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5_moe"])
def test_mtp_tensors_listed_from_the_headers(model_type, tmp_path):
    """The family lists the checkpoint's mtp.* tensors (names and shapes from the safetensors headers) and the
    table then expects exactly them; mtp=False drops them, mtp=True needs them."""
    from parallm.api import with_mtp
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    cfg = hybrid_config(model_type)
    ckpt = str(tmp_path / "m")
    hub = helpers.hub_state_dict(make_model(cfg, seed=0), ckpt)
    spec, family = spec_from_config(cfg)
    assert with_mtp(spec, ckpt, None).carried_mtp == ()                   # none in the checkpoint yet
    with pytest.raises(ValueError, match="holds no multi-token-prediction tensors"):
        with_mtp(spec, ckpt, True)
    mtp = add_mtp(ckpt, hub, seed=1)
    assert any(".mlp.experts.0." in k for k in mtp) == (model_type != "qwen3_5_text")
    carried = with_mtp(spec, ckpt, None)
    assert carried.carried_mtp == tuple((k, tuple(mtp[k].shape)) for k in sorted(mtp))
    assert with_mtp(spec, ckpt, True) == carried and with_mtp(spec, ckpt, False).carried_mtp == ()
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        with_mtp(spec, cfg, True)
    shapes = expected_hf_shapes(family.table, carried, task="causal_lm", pp=2)
    assert set(shapes) == set(hub) | set(mtp) and all(shapes[k] == tuple(v.shape) for k, v in mtp.items())
    from parallm import inspect_checkpoint
    from parallm.cli.inspect import render
    report = inspect_checkpoint(ckpt)
    assert report["problem"] is None and report["config"]["mtp_tensors"] == len(mtp), report["problem"]
    assert f"mtp           {len(mtp)} multi-token-prediction tensors" in render(report)


def rank_mtp(rank, world, ckpt, mtp, out, plain):
    import os

    import parallm
    from parallm.errors import CheckpointError
    from parallm.parallel.state import current_dims
    from safetensors.torch import load_file
    res = {}
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 101, (4, 10), generator=g)
    for name, layout in (("tp2", dict(tp=2)), ("pp2", dict(tp=2, pp=2))):
        parallm.init_parallel(**layout)
        dims = current_dims()
        chunks = parallm.build_model(ckpt)
        holds = [hasattr(c, "carried_mtp") for c in chunks]
        assert holds == [c.post_process for c in chunks], holds       # the last stage holds them
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, ckpt, mode="broadcast" if name == "pp2" else "auto")
        sd = parallm.save_hf_weights(chunks)
        exported = {k: v.clone() for k, v in parallm.export_hf_tensors(chunks, bucket_bytes=4096)}
        meta = {m.name: tuple(m.shape) for m in parallm.export_metadata(chunks)}
        if rank == 0:
            for k, v in mtp.items():
                assert torch.equal(sd[k], v) and torch.equal(exported[k], v), (name, k)
                assert meta[k] == tuple(v.shape)
        out_dir = os.path.join(out, f"saved-{name}")
        parallm.save_hf_weights(chunks, out_dir)
        if rank == 0:
            files = {}
            for f in os.listdir(out_dir):
                if f.endswith(".safetensors"):
                    files.update(load_file(os.path.join(out_dir, f)))
            assert all(torch.equal(files[k], v) for k, v in mtp.items())
        # never trained: an optimizer step moves the model, not the mtp tensors; a training checkpoint keeps them
        opt = parallm.build_optimizer(chunks, lr=1e-2)
        parallm.forward_backward(chunks, ids[dims.dp_rank * 2:(dims.dp_rank + 1) * 2] if dims.dp > 1 else ids,
                                 loss_fn=causal_lm_loss)
        parallm.finalize_grads(chunks)
        opt.step()
        stepped = parallm.save_hf_weights(chunks)
        if name == "tp2":
            parallm.save_checkpoint(os.path.join(out, "train"), chunks, opt, step=1)
            res["stepped"] = stepped
        else:
            chunks2 = parallm.build_model(ckpt)
            helpers.nan_fill(chunks2)
            opt2 = parallm.build_optimizer(chunks2, lr=1e-2)
            parallm.load_checkpoint(os.path.join(out, "train"), chunks2, opt2)
            res["resumed"] = parallm.save_hf_weights(chunks2)
        if rank == 0:
            assert all(torch.equal(stepped[k], v) for k, v in mtp.items())
            assert max((stepped[k] - sd[k]).abs().max().item() for k in sd) > 1e-4
        # built without them: a strict load names them; strict=False drops them
        bare = parallm.build_model(ckpt, mtp=False)
        assert not any(hasattr(c, "carried_mtp") for c in bare)
        with pytest.raises(CheckpointError, match=r"multi-token-prediction tensors \(mtp\.fc\.weight"):
            parallm.load_hf_weights(bare, ckpt)
        parallm.load_hf_weights(bare, ckpt, strict=False)
        if name == "pp2":       # a rank seeing another directory (mtp=None decides per rank): refused everywhere
            want = r"ranks disagree .*rank 0: 0 MTP layers / 29 MTP tensors, rank 3: 0 / 0"
            with pytest.raises(ValueError, match=want):
                parallm.build_model(ckpt if rank != 3 else plain)
        parallm.destroy_parallel()
    return res


@pytest.mark.timeout(400)
def test_mtp_tensors_carried_through_load_save_export_and_checkpoints(tmp_path):
    """A Qwen3-Next checkpoint (MoE) with mtp.* tensors written into its safetensors: loaded at tp2 (dp2) and
    pp2 (tp2; the last stage holds them), saved as a dict and a directory, exported, stepped by AdamW (they do not
    move), stored in a training checkpoint at tp2 and resumed at pp2: every mtp tensor bit-identical."""
    cfg = hybrid_config("qwen3_next")
    model = make_model(cfg, seed=11)
    ckpt = str(tmp_path / "hf")
    hub = helpers.hub_state_dict(model, ckpt)
    plain = helpers.save_checkpoint(model, str(tmp_path / "plain"))
    mtp = add_mtp(ckpt, hub, seed=12)
    assert len(mtp) == 29
    res = helpers.run_ranks(rank_mtp, WORLD, ckpt, mtp, str(tmp_path), plain)[0]
    for k, v in mtp.items():
        assert torch.equal(res["resumed"][k], v)
    helpers.assert_same_state(res["resumed"], res["stepped"])
    # the training checkpoint exported offline (parallm convert) keeps them too
    import os

    import parallm
    from safetensors.torch import load_file
    out = str(tmp_path / "converted")
    parallm.checkpoint_to_hf(str(tmp_path / "train"), out)
    files = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            files.update(load_file(os.path.join(out, f)))
    helpers.assert_same_state(files, res["stepped"])


# -- layers_per_stage="balanced" costs Gated DeltaNet and attention layers by their work ---------------------------

def test_balanced_split_costs_the_two_layer_kinds():
    """Qwen3-Next's shapes (hidden 2048, 16 heads x 256 gated attention, 32 value heads x 128 Gated DeltaNet, 512
    experts top-10) with an uneven pattern (attention layers gathering at the end): per token at 8k tokens an
    attention layer's scores cost 11x a Gated DeltaNet layer's recurrence; the split over 3 stages then differs
    from the split that equal layer costs give (or the weights alone), and its dearest stage is cheaper."""
    from parallm.api import balanced_layers_per_stage
    from parallm.families import spec_from_config
    from parallm.model.stage_costs import balance_costs, forward_costs, mixing_costs
    from parallm.parallel.stages import balanced_sizes
    lin, full = "linear_attention", "full_attention"
    types = [lin, lin, lin, full] * 2 + [lin, full, full, full]
    cfg = helpers.tiny_config("qwen3_next", **dict(
        HYBRID, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_hidden_layers=len(types), layer_types=types, vocab_size=151936, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        intermediate_size=5120, max_position_embeddings=262144))
    spec, family = spec_from_config(cfg)
    # the mixing work: attention 16 x (256 + 256) x (n + 1) / 2; the recurrence per value head 3 dk dv + chunk
    # terms, plus the conv; neither in the weights
    mix = mixing_costs(spec, seq_len=8192)
    assert mix[3] == 16 * 512 * 8193 // 2 and mix[0] == mix[1] == mix[8]
    assert mix[0] == 32 * (3 * 128 * 128 + 64 * (5 * 128) + 64 * 64 // 3) + (2 * 16 * 128 + 32 * 128) * 4
    assert mixing_costs(spec, seq_len=64)[0] == mix[0] and mixing_costs(spec, seq_len=64)[3] < mix[3] / 100
    windowed = mixing_costs(dataclasses.replace(spec, layer_windows=(None,) * 3 + (128,) + (None,) * 8),
                            seq_len=8192)
    assert windowed[3] == round(16 * 512 * (128 * 129 / 2 + (8192 - 128) * 128) / 8192) and windowed[7] == mix[7]
    weights, head = forward_costs(family.table, spec, task="causal_lm")
    assert weights[0] > weights[3] and weights[0] + mix[0] < weights[3] + mix[3]     # the kinds swap places
    costs, _ = balance_costs(family.table, spec, task="causal_lm", seq_len=8192)

    def dearest(sizes):
        ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
        stages = [sum(costs[a:b]) for a, b in zip([0] + ends, ends)]
        stages[-1] += head
        return max(stages)

    split = balanced_layers_per_stage(spec, task="causal_lm", pp=3, seq_len=8192)
    equal = list(balanced_sizes([sum(costs) // len(costs)] * len(costs), head, 3))
    by_weights = list(balanced_sizes(weights, head, 3))
    assert split == [6, 5, 1] and equal == [5, 5, 2] and by_weights == [5, 6, 1], (split, equal, by_weights)
    assert dearest(split) < 0.91 * min(dearest(equal), dearest(by_weights))
    # build_model's default length: 4096 tokens, at most max_position_embeddings
    assert balanced_layers_per_stage(spec, task="causal_lm", pp=3) == \
        balanced_layers_per_stage(spec, task="causal_lm", pp=3, seq_len=4096)
    small = dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, max_position_embeddings=64))
    assert balance_costs(family.table, small, task="causal_lm")[0] == \
        balance_costs(family.table, spec, task="causal_lm", seq_len=64)[0]
    with pytest.raises(ValueError, match="seq_len must be a positive whole number"):
        balance_costs(family.table, spec, task="causal_lm", seq_len=0)
