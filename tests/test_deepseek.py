"""DeepSeek-V3 (with and without q LoRA: Moonlight; ``kimi_k2``) and GLM-4.5 (-Air) end to end, against
transformers 5 in fp32 (docs/families.md).

One spawn of 4 ranks runs every case of CASES in turn (``init_parallel(tp, pp, ep=...)`` per case). Every model's
selection bias (``e_score_correction_bias``) is set to non-zero random values, and the parent checks that
transformers' own output changes when the bias is zeroed: the bias only chooses experts, so the routing differs
from plain top-k. Per case:

* load (every parameter pre-filled with NaN, so a skipped tensor shows) -> ``forward`` vs transformers at real
  positions < 2e-5;
* ``save_hf_weights`` on rank 0 == the files ``save_pretrained`` wrote (per-expert Hub names, the fp32 selection
  bias included), bit for bit; ``export_hf_tensors`` yields every tensor (every expert of every layer) exactly
  once, bit-exact;
* a load in the other mode (slice / broadcast) gives identical outputs;
* one SGD step (``forward_backward`` + ``finalize_grads`` + ``p -= lr * p.grad``) vs the same step in transformers:
  loss, every weight after the step (the bias has no gradient and stays bit-exact), outputs after the step;
* the router weight and bias are fp32, the bias ``requires_grad=False``; the uneven split's layers; log-probs.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import helpers
from test_deepseek_parts import deepseek_config, glm_config, moonlight_config

LR = 0.5
WORLD = 4
from parallm.verify.reference import causal_lm_loss, hf_output, value_loss  # noqa: E402


def set_selection_bias(model, seed: int) -> None:
    """Every MoE layer's ``e_score_correction_bias`` (a buffer, zero in transformers' init) to random values of
    the sigmoid scores' size, so that it changes which experts win."""
    g = torch.Generator().manual_seed(seed)
    found = 0
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
                found += 1
    assert found, "no selection bias in the model"


def zeroed_bias_output(model, ids, mask, task):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
        return hf_output(model, ids, mask, task=task)


def reference_step(model, ids, mask, pieces, task, tmp):
    """Mean over ``pieces`` equal slices of the batch of the task loss; SGD step; (loss, Hub state dict after,
    output after)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    loss_fn = value_loss if task == "value" else causal_lm_loss
    size = ids.shape[0] // pieces
    loss = torch.stack([loss_fn(hf_output(model, ids[i:i + size], mask[i:i + size], task=task), ids[i:i + size],
                                mask[i:i + size]) for i in range(0, ids.shape[0], size)]).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = hf_output(model, ids, mask, task=task)
    return loss.item(), helpers.hub_state_dict(model, tmp), after


def to_kimi_k2(ckpt: str) -> None:
    """Kimi-K2's config.json: model_type ``kimi_k2`` (transformers has no class of its own for it) and the 4.x
    RoPE keys (``rope_theta`` / ``rope_scaling`` with ``type``)."""
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    cfg["model_type"] = "kimi_k2"
    with open(path, "w") as f:
        json.dump(cfg, f)


FP8_BLOCK = [16, 16]     # the tiny model's tensors then have several blocks, ragged ones among them (24 = 16 + 8)


def fp8_quantize(sd: dict) -> dict:
    """An FP8 block checkpoint of ``sd`` as DeepSeek-V3 ships one: every linear weight of the decoder layers as
    float8_e4m3fn plus ``weight_scale_inv`` (fp32, one per block: amax / 448); embeddings, norms, the router
    and the head kept as they are."""
    from parallm.checkpoint.fp8 import scale_grid
    br, bc = FP8_BLOCK
    out = {}
    for name, w in sd.items():
        if not (".layers." in name and name.endswith("proj.weight") and w.dim() == 2):
            out[name] = w
            continue
        grid = scale_grid(tuple(w.shape), tuple(FP8_BLOCK))
        scale = torch.empty(grid)
        for i in range(grid[0]):
            for j in range(grid[1]):
                blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(br, 0)[:w.shape[0]].repeat_interleave(bc, 1)[:, :w.shape[1]]
        out[name] = (w / full).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale
    return out


def fp8_checkpoint(model, tmp, ckpt: str):
    """(the transformers model holding what transformers' own dequantisation makes of the FP8 checkpoint written
    to ``ckpt``, and its Hub state dict): the reference of an FP8 load."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from parallm.verify.reference import load_transformers
    hub = helpers.hub_state_dict(model, str(tmp / "hub"))
    quantized = fp8_quantize(hub)
    deq = {k: (_dequantize_fp8_weight(v, quantized[k + "_scale_inv"], FP8_BLOCK, torch.float32)
               if v.dtype == torch.float8_e4m3fn else v) for k, v in quantized.items() if not k.endswith("_scale_inv")}
    config = model.config.to_dict()
    helpers.write_ckpt(str(tmp / "deq"), deq, config)
    ref_model, _ = load_transformers(str(tmp / "deq"), task="causal_lm")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": FP8_BLOCK}
    helpers.write_ckpt(ckpt, quantized, config)
    return ref_model, helpers.hub_state_dict(ref_model, str(tmp / "ref"))


# name, config, layout (tp, pp, ep, nmb), build kwargs, options
CASES = [
    ("deepseek-v3 q-lora yarn biases tp2 ep2 (sharded ckpt)", lambda: deepseek_config(),
     dict(tp=2, pp=1, ep=2, nmb=1), {}, dict(shard=True)),
    ("moonlight no-q-lora 5 layers pp2 ep2 first=2 mb2", lambda: moonlight_config(num_hidden_layers=5,
                                                                                 first_k_dense_replace=2),
     dict(tp=1, pp=2, ep=2, nmb=2), {"num_layers_in_first_pipeline_stage": 2}, dict(split=[[0, 1], [2, 3, 4]])),
    ("kimi_k2 config tied packed+SP tp2 ep2 logprobs", lambda: deepseek_config(tie_word_embeddings=True),
     dict(tp=2, pp=1, ep=2, nmb=1), {"packed": True, "sequence_parallel": True}, dict(kimi=True, logprobs=True)),
    ("deepseek-v3 value ep4 broadcast load", lambda: deepseek_config(num_hidden_layers=2),
     dict(tp=1, pp=1, ep=4, nmb=1), {"task": "value"}, dict(mode="broadcast")),
    ("glm-4.5 qk-norm partial rotary tp2 ep2", lambda: glm_config(),
     dict(tp=2, pp=1, ep=2, nmb=1), {}, {}),
    ("glm-4.5-air tp4 nkv2 (kv replicated) scaling 1", lambda: glm_config(use_qk_norm=False, routed_scaling_factor=1.0,
                                                                          num_key_value_heads=2, vocab_size=98),
     dict(tp=4, pp=1, ep=1, nmb=1), {}, {}),
    ("deepseek-v3 FP8 block checkpoint (16x16, ragged) tp2 ep2", lambda: deepseek_config(),
     dict(tp=2, pp=1, ep=2, nmb=1), {}, dict(fp8=True)),
    ("deepseek-v3 cp2 dp2 ep2 ring", lambda: deepseek_config(),
     dict(tp=1, pp=1, cp=2, ep=2, nmb=1), {"cp_attn": "ring"}, {}),
    ("moonlight tp2 cp2 packed+SP all-gather ep2", lambda: moonlight_config(),
     dict(tp=2, pp=1, cp=2, ep=2, nmb=1), {"packed": True, "sequence_parallel": True, "cp_attn": "allgather"},
     dict(logprobs=True)),
]


def make_cases(tmp_path):
    cases = []
    for i, (name, make_config, layout, build, opts) in enumerate(CASES):
        task = build.get("task", "causal_lm")
        cfg = make_config()
        model = helpers.make_hf_model(cfg, seed=40 + i, task=task)
        set_selection_bias(model, seed=100 + i)
        ckpt = str(tmp_path / f"m{i}")
        if opts.get("fp8"):
            model, ckpt_sd = fp8_checkpoint(model, tmp_path / f"fp8-{i}", ckpt)
        else:
            ckpt_sd = helpers.hub_state_dict(model, ckpt)
        if opts.get("shard"):
            helpers.save_checkpoint(model, ckpt, max_shard_size="60KB")
        if opts.get("kimi"):
            to_kimi_k2(ckpt)
        ids, mask = helpers.padded_batch(cfg.vocab_size, seed=i, batch=8, seq=9)
        dp = WORLD // (layout["tp"] * layout["pp"] * layout.get("cp", 1))
        loss, new_sd, after = reference_step(model, ids, mask, dp * layout["nmb"], task, str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref = hf_output(model, ids, mask, task=task)
        unbiased = helpers.max_diff_real(zeroed_bias_output(model, ids, mask, task), ref, mask)
        case = dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, task=task, ref=ref, ref_sd=ckpt_sd,
                    ref_loss=loss, ref_new_sd=new_sd, ref_after=after, unbiased=unbiased, opts=opts, **layout)
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
    import collections

    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], cp=case.get("cp", 1), ep=case["ep"])
        lay = current_dims()
        opts, ids, mask = case["opts"], case["ids"], case["mask"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        if "split" in opts:
            assert [list(c.layer_range) for c in chunks] == [opts["split"][lay.pp_rank]], case["name"]
        routers = [m for c in chunks for m in c.modules() if type(m).__name__ == "GroupLimitedRouter"]
        moe_layers = [i for c in chunks for i in c.layer_range if c.spec.is_moe_layer(i)]
        assert len(routers) == len(moe_layers) and all(r.weight.dtype == torch.float32 and r.e_score_correction_bias.dtype == torch.float32
                               and not r.e_score_correction_bias.requires_grad for r in routers), case["name"]
        _check_attributes(chunks)
        mode = opts.get("mode", "slice")
        _load(chunks, case["ckpt"], mode)
        got = parallm.forward(chunks, ids, mask)
        fwd = helpers.max_diff_real(got, case["ref"], mask)
        res = dict(fwd=fwd)
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
        res["exported"] = len(names)
        other = parallm.build_model(case["ckpt"], **case["build"])
        _load(other, case["ckpt"], "slice" if mode == "broadcast" else "broadcast")
        assert torch.equal(parallm.forward(other, ids, mask), got), case["name"]
        del other
        per = ids.shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        loss_fn = value_loss if case["task"] == "value" else causal_lm_loss
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_fn, num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        assert all(r.e_score_correction_bias.grad is None for r in routers), case["name"]
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
            biases = [k for k in ref_new if k.endswith("e_score_correction_bias")]
            assert biases and all(torch.equal(new_sd[k], case["ref_sd"][k]) for k in biases), case["name"]
        res.update(loss=abs(loss.item() - case["ref_loss"]), after=helpers.max_diff_real(after, case["ref_after"],
                                                                                          mask))
        out.append(res)
        parallm.destroy_parallel()
    return out


def _check_attributes(chunks):
    """megatron-core's marks on the new parameters: MLA's replicated down-projections as its duplicated linears
    (``allreduce``, ``sequence_parallel`` as configured, not TP-split, gradients summed over TP under sequence
    parallelism), its up-projections column-parallel, the router's weight and bias replicated (the bias's
    gradient never summed: it has none)."""
    from parallm.model.placement import placement_of
    for c in chunks:
        for name, p in c.named_parameters():
            pl = placement_of(p)
            if "_down_proj." in name:
                assert p.allreduce is True and p.sequence_parallel is c.sequence_parallel, name
                assert not p.tensor_model_parallel and pl.tp_sum is c.sequence_parallel, name
            elif name.endswith(("linear_q_up_proj.weight", "linear_q_proj.weight", "linear_kv_up_proj.weight")):
                assert p.tensor_model_parallel and p.partition_dim == 0 and p.allreduce is True, name
            elif name.endswith("router.e_score_correction_bias"):
                assert not p.requires_grad and not p.tensor_model_parallel and pl.tp_sum is False, name
            elif name.endswith("router.weight"):
                assert p.sequence_parallel is c.sequence_parallel and pl.tp_sum is c.sequence_parallel, name


@pytest.mark.timeout(600)
def test_deepseek_glm_parity_round_trip_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, WORLD, cases, timeout=580)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd, loss = max(r["fwd"] for r in per_rank), max(r["loss"] for r in per_rank)
        after, wdiff = max(r["after"] for r in per_rank), per_rank[0]["weights"]
        lp = max(r.get("logprobs", 0.0) for r in per_rank)
        print(f"{case['name']:<55} bias effect {case['unbiased']:.1e} fwd {fwd:.1e} loss {loss:.1e} "
              f"weights {wdiff:.1e} after {after:.1e} logprobs {lp:.1e}")
        assert case["unbiased"] > 1e-3, case["name"]      # the selection bias changes the routing
        assert fwd < 2e-5, case["name"]
        assert loss < 2e-5, case["name"]
        assert wdiff < 2e-5, case["name"]
        assert after < 5e-5, case["name"]
        assert lp < 2e-5, case["name"]
        assert all(r["exported"] == len(case["ref_sd"]) for r in per_rank), case["name"]


# -- MTP layers carried, training in bf16 with fp32 router tensors, refusals ------------------------------------

MTP_EXTRAS = (("embed_tokens.weight", "V H"), ("enorm.weight", "H"), ("hnorm.weight", "H"),
              ("eh_proj.weight", "H 2H"), ("shared_head.norm.weight", "H"), ("shared_head.head.weight", "V H"))


def mtp_checkpoint(model, path: str) -> tuple[dict, dict]:
    """A checkpoint of ``model`` plus one multi-token-prediction layer ``model.layers.{L}.*`` (DeepSeek-V3's
    names: a decoder layer like the last one, here a perturbed copy of it, and the MTP layer's own tensors,
    random), as DeepSeek-V3 ships them; transformers drops them on load. Returns (the checkpoint's state dict,
    its MTP tensors)."""
    hub = helpers.hub_state_dict(model, path)
    cfg = model.config
    last, mtp_layer = f"model.layers.{cfg.num_hidden_layers - 1}.", f"model.layers.{cfg.num_hidden_layers}."
    g = torch.Generator().manual_seed(11)
    mtp = {k.replace(last, mtp_layer): v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hub.items()
           if k.startswith(last)}
    sizes = {"V": cfg.vocab_size, "H": cfg.hidden_size, "2H": 2 * cfg.hidden_size}
    for name, dims in MTP_EXTRAS:
        mtp[mtp_layer + name] = torch.randn([sizes[d] for d in dims.split()], generator=g)
    full = dict(hub, **mtp)
    helpers.write_ckpt(path, full, cfg.to_dict())
    return full, mtp


def rank_training(rank, world, ckpt, full, mtp_names, ref, ids, mask, ref_new, tmp, fp8_bad, fp8_unconfigured):
    import collections

    import parallm
    from parallm.errors import CheckpointError
    from parallm.parallel.state import current_dims
    out = {}
    # 1. MTP carried at pp2 x ep2: on the last stage, not run, not trained, every tensor saved / exported once
    parallm.init_parallel(tp=1, pp=2, ep=2)
    lay = current_dims()
    chunks = parallm.build_model(ckpt)
    carried = [p for c in chunks for n, p in c.named_parameters() if n.startswith("mtp_layers.")]
    assert bool(carried) == (lay.pp_rank == 1) and not any(p.requires_grad for p in carried)
    _load(chunks, ckpt, "slice")
    out["fwd"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), ref, mask)
    sd = parallm.save_hf_weights(chunks)
    if rank == 0:
        helpers.assert_same_state(sd, full)
    names = [n for n, t in parallm.export_hf_tensors(chunks) if torch.equal(t, full[n])]
    assert collections.Counter(names) == collections.Counter(list(full)), sorted(set(full) - set(names))[:5]
    saved = os.path.join(tmp, "saved")
    parallm.save_hf_weights(chunks, saved)
    again = parallm.build_model(saved)            # from parallm's own directory: carried again
    _load(again, saved, "broadcast")
    sd_again = parallm.save_hf_weights(again)
    if rank == 0:
        helpers.assert_same_state(sd_again, full)
    del again
    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=causal_lm_loss, num_microbatches=2)
    parallm.finalize_grads(chunks)
    assert all(p.grad is None for p in carried)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                if p.requires_grad:
                    p -= LR * p.grad
    sd = parallm.save_hf_weights(chunks)
    if rank == 0:
        assert all(torch.equal(sd[k], full[k]) for k in mtp_names)             # MTP tensors untouched
        out["weights"] = max((sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
    # built without MTP: a strict load names them; strict=False drops them
    plain = parallm.build_model(ckpt, mtp=False)
    for mode in ("slice", "broadcast"):
        with pytest.raises(CheckpointError, match=r"multi-token-prediction layer tensors \(model\.layers\.4\."):
            parallm.load_hf_weights(plain, ckpt, mode=mode)
    parallm.load_hf_weights(plain, ckpt, strict=False)
    sd = parallm.save_hf_weights(plain)
    if rank == 0:
        assert set(sd) == set(full) - set(mtp_names)
    del plain, chunks
    # an impossible split, named on every rank
    with pytest.raises(ValueError, match=r"layers_per_stage=\[3, 2\] adds up to 5 layers; the model has 4"):
        parallm.build_model(ckpt, layers_per_stage=[3, 2])
    with pytest.raises(ValueError, match=r"4 layers at pp=2 x vpp=1: 4 \(first\) leaves 0 layers for 1 middle"):
        parallm.build_model(ckpt, num_layers_in_first_pipeline_stage=4)

    # 2. bf16 at tp2 x ep2: fp32 router weight and selection bias beside bf16 weights; AdamW unsharded vs ZeRO
    #    with overlapped gradient buckets, clipping, two steps: the same bits; the bias and MTP never change
    parallm.init_parallel(tp=2, pp=1, ep=2)
    lay = current_dims()
    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    runs = {}
    for kind, kw in (("plain", {}), ("zero", dict(shard_over_dp=True, overlap_grad_reduce=True, bucket_bytes=4096))):
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
        parallm.load_hf_weights(chunks, ckpt)
        dtypes = {n: p.dtype for c in chunks for n, p in c.named_parameters()}
        assert all(d == torch.float32 for n, d in dtypes.items() if ".router." in n)
        assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".router." not in n)
        opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1, **kw)
        norms = []
        for step in range(2):
            opt.zero_grad()
            parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=causal_lm_loss)
            parallm.finalize_grads(chunks)
            norms.append(parallm.clip_grad_norm_(chunks, 0.5).item())
            opt.step()
            if step == 0 and kind == "zero":
                parallm.save_checkpoint(os.path.join(tmp, "train"), chunks, opt, step=1)
                after_one = parallm.save_hf_weights(chunks)
        runs[kind] = (parallm.save_hf_weights(chunks), norms)
    # the fp32 router tensors stay fp32 on every way out of a bf16 model (a bf16 selection bias changes which
    # experts win): the export stream in bf16 and fp16 (their bits travel in pairs of wire elements), its
    # metadata, the directory save
    dict_save = parallm.save_hf_weights(chunks)
    dict_save = {k: v for k, v in dict_save.items()} if rank == 0 else None
    for wire in (None, torch.float16):
        meta = {m.name: m.dtype for m in parallm.export_metadata(chunks, dtype=wire)}
        got = {n: t.clone() for n, t in parallm.export_hf_tensors(chunks, dtype=wire, bucket_bytes=2048)}
        assert {n: t.dtype for n, t in got.items()} == meta
        kept = [n for n in got if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))]
        assert kept and all(got[n].dtype == torch.float32 for n in kept)
        assert all(t.dtype == (wire or torch.bfloat16) for n, t in got.items() if n not in kept)
        if rank == 0:
            assert all(torch.equal(got[n], dict_save[n]) for n in kept)
            assert all(torch.equal(got[n], dict_save[n].to(got[n].dtype)) for n in got)
    parallm.save_hf_weights(chunks, os.path.join(tmp, "bf16-dir"))
    if rank == 0:
        from safetensors.torch import load_file

        from parallm.checkpoint.training import checkpoint_to_hf
        on_disk = load_file(os.path.join(tmp, "bf16-dir", "model.safetensors"))
        helpers.assert_same_state(on_disk, dict_save)
        # the training checkpoint exported offline, in its own dtype: the fp32 router tensors stay fp32 too
        checkpoint_to_hf(os.path.join(tmp, "train"), os.path.join(tmp, "offline"))
        helpers.assert_same_state(load_file(os.path.join(tmp, "offline", "model.safetensors")), after_one)
    if rank == 0:
        (a, na), (b, nb) = runs["plain"], runs["zero"]
        assert na == nb, (na, nb)
        helpers.assert_same_state(a, b)
        routers = [k for k in a if k.endswith("mlp.gate.weight") and k not in mtp_names]
        assert routers and all(a[k].dtype == torch.float32 and not torch.equal(a[k], full[k]) for k in routers)
        biases = [k for k in a if k.endswith("e_score_correction_bias")]
        assert biases and all(a[k].dtype == torch.float32 and torch.equal(a[k], full[k]) for k in biases)
        assert all(torch.equal(a[k], full[k].to(a[k].dtype)) for k in mtp_names)
        out["norms"] = na
    # the training checkpoint (step 1) resumed at another layout: every tensor, the fp32 ones and MTP included
    parallm.init_parallel(tp=1, pp=2, ep=2)
    chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
    opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1, shard_over_dp=True)
    assert parallm.load_checkpoint(os.path.join(tmp, "train"), chunks, opt)["step"] == 1
    resumed = parallm.save_hf_weights(chunks)
    if rank == 0:
        helpers.assert_same_state(resumed, after_one)
    # ... and at the layout that saved it, the second step equal bit for bit to the uninterrupted run's (fp32
    # masters of the bf16 weights, moments of the fp32 router weights, no state for the bias or MTP)
    parallm.init_parallel(tp=2, pp=1, ep=2)
    chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
    opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1, shard_over_dp=True, overlap_grad_reduce=True,
                                  bucket_bytes=4096)
    parallm.load_checkpoint(os.path.join(tmp, "train"), chunks, opt)
    opt.zero_grad()
    parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=causal_lm_loss)
    parallm.finalize_grads(chunks)
    parallm.clip_grad_norm_(chunks, 0.5)
    opt.step()
    resumed = parallm.save_hf_weights(chunks)
    if rank == 0:
        helpers.assert_same_state(resumed, runs["zero"][0])

    # 3. FP8 checkpoints that cannot be dequantised, refused by name on every rank
    parallm.init_parallel(tp=2, pp=1, ep=2)
    for bad, pattern in ((fp8_bad, r"self_attn\.kv_b_proj\.weight is float8 but the checkpoint has no "
                                   r"model\.layers\.0\.self_attn\.kv_b_proj\.weight_scale_inv"),
                         (fp8_unconfigured, r"float8 tensors / block scales .* but the config has no "
                                            r"quantization_config")):
        chunks = parallm.build_model(bad)
        for mode in ("slice", "broadcast"):
            with pytest.raises(CheckpointError, match=pattern):
                parallm.load_hf_weights(chunks, bad, mode=mode)
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(400)
def test_mtp_bf16_training_and_refusals(tmp_path):
    cfg = deepseek_config(num_hidden_layers=4)
    model = helpers.make_hf_model(cfg, seed=7)
    set_selection_bias(model, seed=8)
    ckpt = str(tmp_path / "mtp")
    full, mtp = mtp_checkpoint(model, ckpt)
    assert cfg.num_nextn_predict_layers == 1 and len(mtp) > 40
    ids, mask = helpers.padded_batch(cfg.vocab_size, seed=5, batch=8, seq=9)
    with torch.no_grad():
        ref = hf_output(model, ids, mask)
    _, ref_new, _ = reference_step(model, ids, mask, 4, "causal_lm", str(tmp_path / "step"))
    # FP8 checkpoints: one weight's scale missing; float8 weights without a quantization_config
    fp8_model = helpers.make_hf_model(deepseek_config(), seed=9)
    set_selection_bias(fp8_model, seed=10)
    fp8_bad, fp8_unconfigured = str(tmp_path / "fp8-bad"), str(tmp_path / "fp8-unconfigured")
    fp8_checkpoint(fp8_model, tmp_path / "fp8-ref", fp8_bad)
    from safetensors.torch import load_file, save_file
    quantized = load_file(os.path.join(fp8_bad, "model.safetensors"))
    del quantized["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(quantized, os.path.join(fp8_bad, "model.safetensors"))
    with open(os.path.join(fp8_bad, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    helpers.write_ckpt(fp8_unconfigured, load_file(os.path.join(fp8_bad, "model.safetensors")), config)
    results = helpers.run_ranks(rank_training, WORLD, ckpt, full, sorted(mtp), ref, ids, mask, ref_new,
                                str(tmp_path / "work"), fp8_bad, fp8_unconfigured, timeout=380)
    print(results[0])
    assert max(r["fwd"] for r in results) < 2e-5
    assert results[0]["weights"] < 2e-5
    assert len(results[0]["norms"]) == 2 and all(n > 0 for n in results[0]["norms"])


def test_inspect_deepseek_uneven_split_and_mtp(tmp_path):
    """`parallm inspect` (no process group) on an MTP-carrying DeepSeek-V3 checkpoint: the check passes with the
    MTP layer carried, yarn and latent attention reported, 6 parameter tensors per MoE layer (the selection bias
    among them), an uneven split's layers and memory per stage (the MTP layer on the last stage), and an even split
    that does not divide refused with a suggestion."""
    from parallm.api.inspect import InspectError
    from parallm import inspect_checkpoint
    from parallm.cli.inspect import render
    model = helpers.make_hf_model(deepseek_config(num_hidden_layers=5), seed=2)
    ckpt = str(tmp_path / "mtp")
    full, mtp = mtp_checkpoint(model, ckpt)
    report = inspect_checkpoint(ckpt, pp=2, dp=2, ep=2, split={"layers_per_stage": [2, 3]})
    assert report["problem"] is None, report["problem"]
    c = report["config"]
    assert (c["rope"], c["latent_attention"], c["mtp_layers"]) == ("yarn", True, 1), c
    assert report["moe"]["tensors_per_layer"] == 6 and report["parameters"] == sum(t.numel() for t in full.values())
    stages = report["layout"]["stages"]
    assert [s["layers"] for s in stages] == ["0-1", "2-4"] and report["layout"]["split"] == [2, 3]
    mtp_params = sum(t.numel() for n, t in mtp.items() if ".experts." not in n) + sum(
        t.numel() for n, t in mtp.items() if ".experts." in n) // 2
    plain = inspect_checkpoint(helpers.save_checkpoint(model, str(tmp_path / "plain")), pp=2, dp=2, ep=2,
                               split={"layers_per_stage": [2, 3]})
    assert plain["config"]["mtp_layers"] == 0 and plain["layout"]["stages"][0] == stages[0]
    assert stages[1]["params"] - plain["layout"]["stages"][1]["params"] == mtp_params    # half the MTP experts
    assert "--layers-per-stage" in render(report)
    with pytest.raises(InspectError, match=r"layers_per_stage=\[2, 3\]"):
        inspect_checkpoint(ckpt, pp=2)
