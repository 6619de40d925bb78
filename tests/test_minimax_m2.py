"""MiniMax-M2 against transformers 5.25 in fp32 (docs/families.md).

The tiny model switches every feature on: q / k RMSNorms over the whole projection (weights ``[4 * 16]`` /
``[2 * 16]``, non-trivial), partial RoPE given as the legacy ``rotary_dim`` (8 of 16 channels), the sigmoid router
with a non-zero ``e_score_correction_bias`` (N(0, 0.3): it changes which experts win), 4 experts top-2, every weight
non-trivial.

Without a process group: the config (4.x-style ``rotary_dim`` + ``rope_theta`` config.json read as transformers
reads it, transformers' class defaults, the refusals), the table against ``save_pretrained``'s names, the new
``kv_heads`` layout, ``inspect_checkpoint``.

One spawn of 4 ranks runs CASES (``init_parallel`` per case): fp32 logits vs transformers, log-probs (and entropy
under packed + SP), ``save_hf_weights`` bit-exact against the checkpoint, the export stream, one SGD step (loss,
gradient norm, every weight after it, output after). On the tp2 case two breaks on purpose must move the output:
the q / k norm computed per rank (no all-reduce) and the correction bias left out of the selection. LoRA vs PEFT
at tp2 (attention and the experts' w1 / w2 / w3) in a 2-rank spawn.
"""

from __future__ import annotations

import collections
import copy
import json
import os

import pytest
import torch

import helpers
from parallm.verify.reference import causal_lm_loss, hf_output

LR = 0.5
WORLD = 4
TOL = 2e-5
SEQ = 14
MINIMAX = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, rotary_dim=8, rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2,
               vocab_size=101, bos_token_id=None, eos_token_id=None)


def minimax_config(**overrides):
    return helpers.tiny_config("minimax_m2", **dict(MINIMAX, **overrides))


def make_model(cfg, *, seed: int):
    """:func:`helpers.make_hf_model` with a correction bias N(0, 0.3) per layer (transformers' buffer is zeros)."""
    model = helpers.make_hf_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


# -- no process group ----------------------------------------------------------------------------------------

def test_config_table_and_refusals(tmp_path):
    import transformers

    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    cfg = minimax_config()
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5       # transformers reads rotary_dim so
    spec, family = spec_from_config(cfg)
    assert family.name == "minimax_m2" and spec.qk_norm_whole and not spec.qk_norm
    assert spec.rotary_dim == 8 and spec.rope.theta == 10000.0
    assert spec.moe.router == "sigmoid_grouped" and spec.moe.score_bias and spec.moe.n_group == 1
    assert spec.moe.norm_topk_prob and spec.moe.routed_scaling_factor == 1.0 and spec.moe.layers == (0, 1)
    hub = helpers.hub_state_dict(make_model(cfg, seed=0), str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hub      # the Hub's per-expert names
    assert hub["model.layers.1.self_attn.q_norm.weight"].shape == (64,)
    # a released-style config.json (transformers 4.x: rope_theta and rotary_dim at the top, no head_dim): the
    # same rotary channels and theta as transformers 5.25 reads from it, head_dim its class default 128
    raw = json.loads(open(os.path.join(tmp_path, "m", "config.json")).read())
    for key in ("rope_parameters", "head_dim", "rope_theta"):
        raw.pop(key, None)
    raw.update(rope_scaling=None, rotary_dim=64, hidden_size=96, num_attention_heads=2, num_key_value_heads=1,
               use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
               use_mtp=True, num_mtp_modules=3, mtp_transformer_layers=1, shared_intermediate_size=0,
               attn_type_list=[1, 1], sliding_window=None, routed_scaling_factor=1.0)
    helpers.write_config(tmp_path / "old", raw)
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path / "old"))
    old, _ = spec_from_config(str(tmp_path / "old"))
    assert old.head_dim == hf.head_dim == 128 and old.rotary_dim == int(128 * hf.rope_parameters["partial_rotary_factor"])
    assert old.rotary_dim == 64 and old.rope.theta == hf.rope_parameters["rope_theta"] == 5e6
    # rope_parameters' factor wins over rotary_dim (transformers' setdefault order)
    both, _ = spec_from_config(dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.25}))
    assert both.rotary_dim == 32 and both.rope.theta == 1e4
    for bad, match in ((dict(use_qk_norm=False), "use_qk_norm=False"), (dict(qk_norm_type="per_head"), "per_head"),
                       (dict(scoring_func="softmax"), "scoring_func"), (dict(use_routing_bias=False), "use_routing"),
                       (dict(shared_intermediate_size=64), "shared"), (dict(attn_type_list=[0, 1]), "linear-attention"),
                       (dict(router_jitter_noise=0.1), "jitter"), (dict(sliding_window=8), "sliding_window"),
                       (dict(output_router_logits=True, router_aux_loss_coef=0.01), "load-balancing"),
                       (dict(rotary_dim=7), "7 rotary channels")):
        with pytest.raises(ValueError, match=match):
            spec_from_config(dict(raw, **bad))


def test_kv_heads_layout_round_trip_and_replicas():
    from parallm.model.sharding import KVHeadSplit, TensorSource
    x = torch.randn(2 * 3)                       # 2 KV heads of 3
    layout = KVHeadSplit(2, 3)
    for tp in (1, 2, 4):
        shards = [layout.shard([TensorSource(x)], r, tp) for r in range(tp)]
        assert torch.equal(layout.merge(shards)[0], x)
        owners = torch.zeros(6)
        for r, s in enumerate(shards):
            for blk in layout.blocks(r, tp, [(6,)]):
                assert torch.equal(s[blk.local_start:blk.local_stop], x[blk.hf_start:blk.hf_stop])
                owners[blk.hf_start:blk.hf_stop] += blk.primary
            assert bool(layout.primary_slices(r, tp, s.shape)) == (tp < 4 or r % 2 == 0)
            assert layout.replica_rows(r, tp) == ((0, 3) if tp == 4 else None)
        assert torch.equal(owners, torch.ones(6)), tp          # every element written by exactly one rank


def test_inspect_describes_qk_norm_and_partial_rotary(tmp_path, capsys):
    import parallm
    from parallm.cli import main
    ckpt = str(tmp_path / "m")
    make_model(minimax_config(), seed=1).save_pretrained(ckpt)
    report = parallm.inspect_checkpoint(ckpt, tp=2, ep=2)
    c = report["config"]
    assert c["qk_norm"] == "whole projection" and c["rotary_dim"] == 8 and c["head_dim"] == 16
    assert report["moe"]["router"] == "sigmoid_grouped" and report["moe"]["experts"] == 4
    assert main(["inspect", ckpt]) == 0
    text = capsys.readouterr().out
    assert "rotary 8 of 16 channels" in text and "qk norm over the whole projection" in text, text


# -- distributed -----------------------------------------------------------------------------------------------

# name, layout (tp, pp, cp, ep, nmb), build kwargs, options
CASES = [
    ("tp2 dp2 padded, logprobs, breaks", dict(tp=2), {}, dict(logprobs=True, breaks=True)),
    ("tp2 ep2 packed+SP, logprobs+entropy", dict(tp=2, ep=2), {"packed": True, "sequence_parallel": True},
     dict(entropy=True)),
    ("pp2 dp2 mb2", dict(pp=2, nmb=2), {}, {}),
    ("cp2 dp2 ep2 packed", dict(cp=2, ep=2), {"packed": True}, dict(logprobs=True)),
    ("tp4 (2 KV heads on 2 ranks each: the k norm counts each once)", dict(tp=4), {}, {}),
]


def reference_step(model, ids, mask, pieces, tmp):
    model = copy.deepcopy(model)
    model.zero_grad()
    size = ids.shape[0] // pieces
    loss = torch.stack([causal_lm_loss(hf_output(model, ids[i:i + size], mask[i:i + size]), ids[i:i + size],
                                       mask[i:i + size]) for i in range(0, ids.shape[0], size)]).mean()
    loss.backward()
    with torch.no_grad():
        norm = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum().sqrt()
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = hf_output(model, ids, mask)
    return loss.item(), helpers.hub_state_dict(model, tmp), after, norm.item()


def make_cases(tmp_path):
    cases = []
    for i, (name, layout, build, opts) in enumerate(CASES):
        layout = dict(dict(tp=1, pp=1, cp=1, ep=1, nmb=1), **layout)
        model = make_model(minimax_config(), seed=70 + i)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = helpers.hub_state_dict(model, ckpt)
        ids, mask = helpers.padded_batch(101, batch=8, seq=SEQ, seed=i)
        dp = WORLD // (layout["tp"] * layout["pp"] * layout["cp"])
        loss, new_sd, after, norm = reference_step(model, ids, mask, dp * layout["nmb"], str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref = hf_output(model, ids, mask)
        lsm = ref.log_softmax(-1)
        lp = lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        cases.append(dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, ref=ref, ref_sd=ckpt_sd,
                          ref_loss=loss, ref_new_sd=new_sd, ref_after=after, ref_norm=norm, opts=opts,
                          ref_logprobs=lp, ref_entropy=-(lsm.exp() * lsm).sum(-1), **layout))
    return cases


def _breaks(chunks, case) -> dict:
    """The output with the q / k norm per rank and with the correction bias left out of the selection."""
    import parallm
    from parallm.model.layers import qk_norm, routing
    ids, mask, out = case["ids"], case["mask"], {}
    saved = qk_norm.tp_mean
    qk_norm.tp_mean = lambda x, group: x                  # each rank's own heads' mean
    try:
        out["break_qk_norm"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
    finally:
        qk_norm.tp_mean = saved
    route = routing.sigmoid_route
    routing.sigmoid_route = lambda h, w, bias, **kw: route(h, w, None, **kw)
    try:
        out["break_bias"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
    finally:
        routing.sigmoid_route = route
    return out


def _outputs(chunks, case) -> dict:
    import parallm
    ids, mask, opts = case["ids"], case["mask"], case["opts"]
    got = parallm.forward(chunks, ids, mask)
    res = dict(fwd=helpers.max_diff_real(got, case["ref"], mask))
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    if opts.get("logprobs"):
        lp = parallm.forward(chunks, ids, mask, output="logprobs")
        res["logprobs"] = (lp[:, :-1][keep] - case["ref_logprobs"][keep]).abs().max().item()
    if opts.get("entropy"):
        lp, ent = tuple(parallm.forward(chunks, ids, mask, output="logprobs+entropy"))
        res["logprobs"] = (lp[:, :-1][keep] - case["ref_logprobs"][keep]).abs().max().item()
        real = mask.bool()
        res["entropy"] = (ent[real] - case["ref_entropy"][real]).abs().max().item()
    if opts.get("breaks"):
        res.update(_breaks(chunks, case))
    return res


def _save_and_export(rank, chunks, case) -> None:
    import parallm
    sd = parallm.save_hf_weights(chunks)
    if rank == 0:
        helpers.assert_same_state(sd, case["ref_sd"])
    names = []
    for name, t in parallm.export_hf_tensors(chunks):
        names.append(name)
        assert torch.equal(t, case["ref_sd"][name]), (case["name"], name)
    dup = [n for n, k in collections.Counter(names).items() if k > 1]
    assert not dup and set(names) == set(case["ref_sd"]), (case["name"], dup)


def rank_cases(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], cp=case["cp"], ep=case["ep"])
        lay = current_dims()
        ids, mask = case["ids"], case["mask"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, case["ckpt"])
        res = _outputs(chunks, case)
        _save_and_export(rank, chunks, case)
        per = ids.shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=causal_lm_loss,
                                        num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        norm = parallm.clip_grad_norm_(chunks, float("inf"))
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            res["weights"] = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
            res["worst"] = max(ref_new, key=lambda k: (new_sd[k] - ref_new[k]).abs().max().item())
        res.update(loss=abs(loss.item() - case["ref_loss"]), norm=abs(norm.item() - case["ref_norm"]) / case["ref_norm"],
                   after=helpers.max_diff_real(after, case["ref_after"], mask))
        out.append(res)
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_minimax_m2_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, WORLD, cases)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        worst = {k: max(r.get(k, 0.0) for r in per_rank) for k in ("fwd", "loss", "norm", "after", "logprobs",
                                                                   "entropy")}
        print(f"{case['name']:<64} " + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
              + f" weights {per_rank[0]['weights']:.1e} ({per_rank[0]['worst']})"
              + (f" breaks: qk norm per rank {per_rank[0]['break_qk_norm']:.1e}, bias ignored "
                 f"{per_rank[0]['break_bias']:.1e}" if "break_bias" in per_rank[0] else ""))
        assert worst["fwd"] < TOL and worst["logprobs"] < TOL and worst["entropy"] < TOL, case["name"]
        assert worst["loss"] < TOL and worst["norm"] < 1e-5 and per_rank[0]["weights"] < TOL, case["name"]
        assert worst["after"] < 1e-4, case["name"]
        if case["opts"].get("breaks"):      # each break on purpose moves the output far past the tolerance
            assert min(r["break_qk_norm"] for r in per_rank) > 1e-3, case["name"]
            assert min(r["break_bias"] for r in per_rank) > 1e-3, case["name"]


@pytest.mark.timeout(600)
def test_lora_against_peft_tp2(tmp_path):
    """Attention and the routed experts (w1 / w3 / w2, which PEFT 0.21 retargets to transformers' stacked
    gate_up_proj / down_proj through mixtral's pattern) at tp2: logits, base logits, one AdamW step."""
    import test_lora
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3")
    ckpt, adapter, batch, ref, _ = test_lora._reference("minimax_m2", tmp_path, overrides=MINIMAX, targets=targets)
    res = helpers.run_ranks(test_lora._family_cases, 2, {"minimax_m2": (ckpt, adapter, batch)})[0]
    test_lora._assert_case(res["minimax_m2"], ref, batch[1], "minimax_m2")
    assert any(".mlp.experts.base_layer.lora_B" in k for k in ref["after"])
    assert any(".self_attn.q_proj.lora_A" in k for k in ref["after"])
