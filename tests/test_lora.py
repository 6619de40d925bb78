"""LoRA adapters against transformers + PEFT (peft.get_peft_model with the same config and the same A / B).

The reference: a tiny seeded transformers model (every weight non-trivial) wrapped by PEFT, its A and B set from a
seed (B non-zero: PEFT's zero B would hide any mapping of B's rows), saved with ``save_pretrained`` and read by
``parallm.load_hf_adapter`` (each rank its slices). Then per layout: logits (adapters on, and off under
``adapters_disabled`` against the bare transformers model), one token-mean AdamW step (the updated factors, read
back by ``export_adapter_tensors`` in PEFT's names, against PEFT's after ``torch.optim.AdamW``), the frozen base
bit-identical after the step, optimizer state on adapters only. One 2-rank spawn runs tp2, pp2, packed + SP (tp2)
and cp2 on Qwen3 (tp2 also: merged export / save against PEFT's ``merge_and_unload``, ``save_hf_adapter`` loaded
by ``PeftModel.from_pretrained``, a training checkpoint saved at tp2 and loaded at tp1 x dp2), then DeepSeek-V3
(multi-head latent attention: every MLA projection adapted, the replicated down-projections' factors partial over
TP under SP; routed experts) at tp2 + SP and pp2 and Moonlight's shape (no q LoRA) at tp2; one 4-rank spawn runs
Qwen3-MoE at tp2 x ep2 (dp2, each replica its half of the batch), DeepSeek-V3 at tp2 x ep2 + SP and Qwen3 at tp4
(fewer KV heads than ranks: k / v adapters replicated).
"""

from __future__ import annotations

import copy
import os

import peft         # the test extra installs it (pyproject.toml)
import pytest
import torch

import helpers


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# DeepSeek-V3: every MLA projection (q_proj where there is no q LoRA) and the MLP names (PEFT: routed experts)
MLA_TARGETS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj")
# 2 layers: layer 0 dense, layer 1 MoE (4 experts in 2 groups, a shared expert); v 10 != nope 12 + rope 8; biases
MLA_CONFIG = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                  v_head_dim=10, attention_bias=True, n_routed_experts=4, n_group=2, topk_group=1,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, intermediate_size=48,
                  first_k_dense_replace=1)
# Moonlight's shape: no q LoRA (q_proj), rotate_half RoPE, no biases
MLA_NO_Q_LORA = dict(MLA_CONFIG, q_lora_rank=None, rope_interleave=False, attention_bias=False)
R, ALPHA = 4, 8
LR, EPS, WD = 1e-3, 1e-4, 0.1
LOGIT_TOL = 2e-5
STEP_TOL = 1e-5      # 1% of the step (lr 1e-3); with eps 1e-4 a gradient's rounding moves an update by ~10x itself.
#                      Wrong layouts move factors by ~lr (2e-3 in the break-on-purpose runs)


def token_nll(logits, ids, mask):
    """(sum of next-token NLL over real positions, their count): a token-mean loss."""
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum(), m.sum()


def _randomize_adapter(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _peft_state(model) -> dict[str, torch.Tensor]:
    """The adapter in the names save_pretrained writes."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def _reference(family: str, tmp, *, overrides=None, targets=TARGETS, tag=""):
    """(checkpoint dir, adapter dir, batch, reference dict)."""
    cfg = helpers.tiny_config(family, **(overrides or {}))
    base = helpers.make_hf_model(cfg, seed=0)
    ckpt = helpers.save_checkpoint(base, str(tmp / f"{family}{tag}_ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                      target_modules=list(targets),
                                                                      lora_dropout=0.0))
    _randomize_adapter(model, 7)
    adapter = str(tmp / f"{family}{tag}_adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=4, seq=12)
    with torch.no_grad():
        merged = {k: v.clone() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    ref = dict(peft_step(model, base, ids, mask), merged=merged)
    return ckpt, adapter, (ids, mask), ref, base


def peft_step(model, base, ids, mask) -> dict:
    """The reference every LoRA test compares with: PEFT ``model``'s logits (and ``base``'s), its factors, one
    AdamW step (LR / EPS / WD) on the mean next-token NLL, the factors after it, the loss and the gradient norm."""
    import parallm
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        base_logits = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    before = _peft_state(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)
    total, count = token_nll(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids, mask)
    (total / count).backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9).item()
    opt.step()
    return dict(logits=logits, base_logits=base_logits, before=before, after=_peft_state(model),
                loss=(total / count).item(), norm=norm)


def dp_rows(batch) -> slice:
    """This data-parallel rank's rows of ``batch`` (``(ids, mask)``), split evenly over the current layout's dp."""
    from parallm.parallel.state import current_dims
    dims = current_dims()
    per = batch[0].shape[0] // dims.dp
    return slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)


def _check_run(rank, chunks, batch, *, dp_slice=None, extra=None, opt_kw=None):
    """On every rank: logits with / without adapters, one step; returns what rank 0 reports."""
    import parallm
    from parallm.model.layers.lora import chunk_lora_entries
    ids, mask = batch
    out = {}
    with torch.no_grad():
        out["logits"] = parallm.forward(chunks, ids, mask)
        with parallm.adapters_disabled(chunks):
            out["base_logits"] = parallm.forward(chunks, ids, mask)
        out["logits_again"] = parallm.forward(chunks, ids, mask)
    lora = {id(c.get_parameter(e.local)) for e, c in chunk_lora_entries(chunks)}
    frozen = {f"{c.vpp_rank}.{n}": p.detach().clone() for c in chunks for n, p in c.named_parameters()
              if id(p) not in lora}
    out["trainable_is_lora"] = {id(p) for c in chunks for p in c.parameters() if p.requires_grad} == lora
    opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=WD, **(opt_kw or {}))
    out["state_on_lora_only"] = all(id(p) in lora for p, _ in opt.owned()) and len(list(opt.owned())) > 0
    b_ids, b_mask = (ids, mask) if dp_slice is None else (ids[dp_slice], mask[dp_slice])
    out["loss"] = parallm.forward_backward(chunks, b_ids, b_mask, loss_fn=token_nll).item()
    parallm.finalize_grads(chunks)
    out["norm"] = parallm.clip_grad_norm_(chunks, 1e9).item()
    out["base_grads_none"] = all(p.grad is None and getattr(p, "main_grad", None) is None
                                 for c in chunks for p in c.parameters() if id(p) not in lora)
    opt.step()
    out["base_unchanged"] = all(torch.equal(p.detach(), frozen[f"{c.vpp_rank}.{n}"])
                                for c in chunks for n, p in c.named_parameters() if id(p) not in lora)
    out["after"] = dict(parallm.export_adapter_tensors(chunks))
    if extra is not None:
        out.update(extra(chunks, opt))
    return out if rank == 0 else None


def _merged_state(chunks, opt, key):
    """Checkpoint name -> optimizer state ``key`` of every factor, whole (TP shards merged) on every rank."""
    import torch.distributed as dist
    from parallm.model.layers.lora import chunk_lora_entries
    from parallm.model.placement import placement_of
    out = {}
    for entry, chunk in chunk_lora_entries(chunks):
        p = chunk.get_parameter(entry.local)
        t, lay = opt.state[p][key], placement_of(p).layout
        if entry.index is not None:
            t, lay = t[entry.index], lay.inner
        dims = chunk.dims
        shards = [torch.empty_like(t) for _ in range(dims.tp)]
        dist.all_gather(shards, t.contiguous(), group=dims.tp_group)
        out[entry.hf[0]] = lay.merge(shards)[0].clone()
    return out


def _hf_logits(model, batch):
    """A transformers (or PEFT) model's logits of ``batch`` = (ids, mask), parallm's position ids."""
    import parallm
    ids, mask = batch
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits


def _adapted(ckpt, adapter, build):
    """This rank's chunks of ``ckpt`` (``build_model`` options ``build``) with PEFT's ``adapter`` loaded."""
    import parallm
    chunks = parallm.build_model(ckpt, **build)
    parallm.load_hf_weights(chunks, ckpt)
    parallm.load_hf_adapter(chunks, adapter)
    return chunks


def _merged_and_saved(chunks, out, directory):
    """The merged export (into rank 0's report ``out``) and ``save_hf_adapter`` into ``directory``."""
    import parallm
    merged = dict(parallm.export_hf_tensors(chunks, merged=True, copy=True))
    parallm.save_hf_adapter(chunks, directory, overwrite=True)
    if out is not None:
        out["merged"] = merged


def _dense_cases(rank, world, ckpt, adapter, batch, tmp):
    import parallm
    from parallm.model.layers.lora import lora_config_of
    results = {}
    for name, kw, build in (("tp2", dict(tp=2), {}), ("pp2", dict(pp=2), {}),
                            ("sp", dict(tp=2), dict(packed=True, sequence_parallel=True)),
                            ("cp2", dict(cp=2), {})):
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, build)
        out = _check_run(rank, chunks, batch)
        if name == "tp2":       # after the step: the ways out, then a training checkpoint of a second step
            extra = {"merged": dict(parallm.export_hf_tensors(chunks, merged=True, copy=True)),
                     "merged_saved": parallm.save_hf_weights(chunks, merged=True),
                     "unmerged": dict(parallm.export_hf_tensors(chunks, copy=True))}
            parallm.save_hf_adapter(chunks, os.path.join(tmp, "saved_adapter"), overwrite=True)
            opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=WD)
            opt.zero_grad()
            for _ in range(2):
                parallm.forward_backward(chunks, *batch, loss_fn=token_nll)
                parallm.finalize_grads(chunks)
                opt.step()
                opt.zero_grad()
            parallm.save_checkpoint(os.path.join(tmp, "lora_ckpt"), chunks, opt, step=3, overwrite=True)
            extra["ckpt_adapter"] = dict(parallm.export_adapter_tensors(chunks))
            extra["ckpt_moments"] = {k: _merged_state(chunks, opt, k) for k in ("exp_avg", "exp_avg_sq")}
            if out is not None:
                out.update(extra)
        results[name] = out
        parallm.destroy_parallel()
    # tp2's training checkpoint at tp1 x dp2: adapters and their optimizer state; the base from the HF checkpoint
    parallm.init_parallel(tp=1)
    chunks = parallm.build_model(ckpt, lora=lora_config_of_file(adapter))
    parallm.load_hf_weights(chunks, ckpt)
    opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=WD)
    info = parallm.load_checkpoint(os.path.join(tmp, "lora_ckpt"), chunks, opt)
    resumed = dict(adapter=dict(parallm.export_adapter_tensors(chunks)), step=info["step"],
                   moments={k: _merged_state(chunks, opt, k) for k in ("exp_avg", "exp_avg_sq")},
                   config=lora_config_of(chunks).to_dict())
    # the PEFT directory save_hf_adapter wrote at tp2, back into a fresh model at tp1 x dp2 (its sidecar's seed)
    fresh = parallm.build_model(ckpt)
    parallm.load_hf_weights(fresh, ckpt)
    resumed["reloaded_seed"] = parallm.load_hf_adapter(fresh, os.path.join(tmp, "saved_adapter")).seed
    resumed["reloaded"] = dict(parallm.export_adapter_tensors(fresh))
    del fresh
    # a checkpoint of adapters into a model without them, and a full checkpoint into one with them: errors
    plain = parallm.build_model(ckpt)
    parallm.load_hf_weights(plain, ckpt)
    try:
        parallm.load_checkpoint(os.path.join(tmp, "lora_ckpt"), plain)
    except parallm.CheckpointError as e:
        resumed["into_plain"] = str(e)
    parallm.save_checkpoint(os.path.join(tmp, "full_ckpt"), plain, step=0, overwrite=True)
    try:
        parallm.load_checkpoint(os.path.join(tmp, "full_ckpt"), chunks)
    except parallm.CheckpointError as e:
        resumed["full_into_lora"] = str(e)
    parallm.destroy_parallel()
    results["resume"] = resumed
    return results if rank == 0 else None


def _mla_cases(rank, world, mla, moonlight, tmp):
    """DeepSeek-V3 at tp2 with sequence parallelism (packed: the replicated down-projections' factors see half the
    tokens each) and at pp2; Moonlight's shape (no q LoRA) at tp2; the ways out after the SP step, and its
    adapters-only training checkpoint loaded into the pp2 model after that one's step."""
    import parallm
    results, saved = {}, os.path.join(tmp, "mla_lora_ckpt")

    def save(chunks, opt):
        parallm.save_checkpoint(saved, chunks, opt, step=1, overwrite=True)
        return {"ckpt_adapter": dict(parallm.export_adapter_tensors(chunks)),
                "ckpt_moments": {k: _merged_state(chunks, opt, k) for k in ("exp_avg", "exp_avg_sq")}}

    def load(chunks, _):
        opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=WD)
        parallm.load_checkpoint(saved, chunks, opt)
        import torch.distributed as dist
        stages = [None] * world           # each pipeline stage holds its layers' moments
        dist.all_gather_object(stages, {k: _merged_state(chunks, opt, k) for k in ("exp_avg", "exp_avg_sq")})
        return {"resumed_adapter": dict(parallm.export_adapter_tensors(chunks)),
                "resumed_moments": {k: {n: t for st in stages for n, t in st[k].items()} for k in stages[0]}}

    for name, (ckpt, adapter, batch), kw, build, extra in (
            ("mla_sp", mla, dict(tp=2), dict(packed=True, sequence_parallel=True), save),
            ("mla_pp2", mla, dict(pp=2), {}, load),
            ("mla_no_q_lora_tp2", moonlight, dict(tp=2), {}, None)):
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, build)
        out = _check_run(rank, chunks, batch, extra=extra)
        if name == "mla_sp":
            _merged_and_saved(chunks, out, os.path.join(tmp, "mla_saved"))
        results[name] = out
        parallm.destroy_parallel()
    return results if rank == 0 else None


def _two_rank_cases(rank, world, dense, mla, moonlight, tmp):
    out = _dense_cases(rank, world, *dense, tmp)
    more = _mla_cases(rank, world, mla, moonlight, tmp)
    return None if out is None else dict(out, **more)


def _peft_after(base, adapter_tensors, targets):
    """A PEFT model of ``base`` holding ``adapter_tensors`` (PEFT names)."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                      target_modules=list(targets)))
    peft.set_peft_model_state_dict(model, adapter_tensors)
    return model


def lora_config_of_file(adapter):
    import json
    from parallm.checkpoint.lora_io import CONFIG_NAME
    from parallm.model.layers.lora import LoraConfig
    with open(os.path.join(adapter, CONFIG_NAME)) as f:
        cfg = json.load(f)
    return LoraConfig(cfg["r"], cfg["lora_alpha"], tuple(cfg["target_modules"]))


def _assert_close_dict(got, want, tol, what):
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:6]}"
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k} {tuple(got[k].shape)} vs {tuple(want[k].shape)}"
        diff = (got[k].float() - want[k].float()).abs().max().item()
        assert diff <= tol, f"{what}: {k} differs by {diff:.3g}"


def _assert_case(out, ref, mask, name):
    assert helpers.max_diff_real(out["logits"], ref["logits"], mask) < LOGIT_TOL, name
    assert torch.equal(out["logits"], out["logits_again"]), f"{name}: adapters not restored"
    assert helpers.max_diff_real(out["base_logits"], ref["base_logits"], mask) < LOGIT_TOL, name
    assert helpers.max_diff_real(out["logits"], ref["base_logits"], mask) > 1e-2, f"{name}: adapters do nothing"
    assert out["trainable_is_lora"] and out["state_on_lora_only"], name
    assert out["base_grads_none"] and out["base_unchanged"], name
    assert abs(out["loss"] - ref["loss"]) < 1e-5, (name, out["loss"], ref["loss"])
    assert abs(out["norm"] - ref["norm"]) < 1e-5 * ref["norm"], (name, out["norm"], ref["norm"])
    _assert_close_dict(out["after"], ref["after"], STEP_TOL, f"{name} step")
    moved = max((ref["after"][k] - ref["before"][k]).abs().max().item() for k in ref["after"])
    assert moved > 10 * STEP_TOL


@pytest.mark.timeout(900)
def test_lora_dense_layouts(tmp_path):
    """Qwen3 at tp2, pp2, packed + SP, cp2 against PEFT; merged / adapter export, PEFT directory round trip,
    adapters-only training checkpoint resharded tp2 -> tp1 x dp2. DeepSeek-V3 (MLA + MoE) at tp2 + SP and pp2,
    no-q-LoRA at tp2, against PEFT; its merged export, saved adapter and tp2 + SP -> pp2 training checkpoint."""
    ckpt, adapter, batch, ref, base = _reference("qwen3", tmp_path)
    mla = _reference("deepseek_v3", tmp_path, overrides=MLA_CONFIG, targets=MLA_TARGETS)
    moonlight = _reference("deepseek_v3", tmp_path, overrides=MLA_NO_Q_LORA, targets=MLA_TARGETS, tag="_noq")
    res = helpers.run_ranks(_two_rank_cases, 2, (ckpt, adapter, batch), mla[:3], moonlight[:3], str(tmp_path))[0]
    mask = batch[1]
    for name in ("tp2", "pp2", "sp", "cp2"):
        _assert_case(res[name], ref, mask, name)
    _check_mla(res, mla, moonlight, tmp_path)
    tp2 = res["tp2"]
    # merged weights after the step: PEFT's merge of the stepped adapter on the same base
    stepped = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                        target_modules=list(TARGETS)))
    peft.set_peft_model_state_dict(stepped, tp2["after"])
    merged_ref = copy.deepcopy(stepped).merge_and_unload().state_dict()
    merged_ref = {k: v for k, v in merged_ref.items() if k in tp2["merged"]}
    _assert_close_dict(tp2["merged"], merged_ref, 1e-6, "merged export")
    _assert_close_dict(tp2["merged_saved"], merged_ref, 1e-6, "merged save")
    base_sd = base.state_dict()
    for k, v in tp2["unmerged"].items():
        assert torch.equal(v, base_sd[k]), f"{k}: the export after a merged one is not the base"
    # PEFT loads what save_hf_adapter wrote, with equal logits and without a warning (parallm's own fields are in
    # a sidecar: a key PEFT does not know in adapter_config.json makes it warn "Unexpected keyword arguments")
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "saved_adapter"))
    peft_said = [str(w.message) for w in caught if any(k in str(w.message) for k in ("Unexpected keyword", "parallm",
                                                                                       "upgrade the PEFT"))]
    assert not peft_said, peft_said     # (transformers' own deprecation notices aside)
    assert torch.equal(_hf_logits(loaded, batch), _hf_logits(stepped, batch))
    import json
    saved_cfg = json.load(open(tmp_path / "saved_adapter" / "adapter_config.json"))
    sidecar = json.load(open(tmp_path / "saved_adapter" / "parallm_adapter.json"))
    assert "parallm" not in saved_cfg and sidecar["seed"] == 0 and sorted(sidecar["target_modules"]) == \
        sorted(TARGETS), sidecar
    # ... and parallm reads it back bit for bit at another layout
    assert res["resume"]["reloaded_seed"] == 0 and set(res["resume"]["reloaded"]) == set(tp2["after"])
    for k, v in tp2["after"].items():
        assert torch.equal(res["resume"]["reloaded"][k], v), k
    import parallm
    # the checkpoint holds adapters only (and their optimizer state) and resumes bit-exactly at tp1 x dp2
    import json
    record = json.load(open(tmp_path / "lora_ckpt" / "parallm.json"))
    assert record["lora"]["base"] == ckpt and record["lora"]["config"]["r"] == R
    assert all(".lora_" in n for n, _ in record["tensors"]), record["tensors"][:3]
    with pytest.raises(parallm.CheckpointError, match="LoRA adapters only"):
        parallm.checkpoint_to_hf(str(tmp_path / "lora_ckpt"), str(tmp_path / "not_a_model"))
    resume = res["resume"]
    assert resume["step"] == 3
    assert "holds LoRA adapters only" in resume["into_plain"], resume.get("into_plain")
    assert "full training checkpoint" in resume["full_into_lora"], resume.get("full_into_lora")
    assert set(resume["adapter"]) == set(tp2["ckpt_adapter"])
    for k, v in tp2["ckpt_adapter"].items():
        assert torch.equal(resume["adapter"][k], v), k
    for key, moments in tp2["ckpt_moments"].items():
        assert set(moments) == set(resume["moments"][key])
        for k, v in moments.items():
            assert torch.equal(resume["moments"][key][k], v), (key, k)


def _check_mla(res, mla, moonlight, tmp_path):
    """The DeepSeek-V3 cases against PEFT: every MLA projection and the routed experts adapted (PEFT retargets
    deepseek_v3's MLP names to the stacked experts: its dense MLP and shared expert keep none); the merged export
    equals PEFT's merge_and_unload and the saved adapter runs in PEFT with PEFT's logits."""
    import parallm
    for name, (_, _, batch, ref, _) in (("mla_sp", mla), ("mla_pp2", mla), ("mla_no_q_lora_tp2", moonlight)):
        _assert_case(res[name], ref, batch[1], name)
    for (_, _, _, ref, _), present, absent in (
            (mla, ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.experts.base_layer"),
             ("q_proj", "shared_experts", "layers.0.mlp")),
            (moonlight, ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.experts.base_layer"),
             ("q_a_proj", "q_b_proj", "shared_experts", "layers.0.mlp"))):
        names = set(ref["after"])
        assert all(any(f".{p}." in k for k in names) for p in present), sorted(names)
        assert not any(f".{a}." in k for a in absent for k in names), sorted(names)
    # the tp2 + SP training checkpoint (adapters and moments) resumed bit-exactly at pp2
    sp, pp2 = res["mla_sp"], res["mla_pp2"]
    assert set(sp["ckpt_adapter"]) == set(pp2["resumed_adapter"]) == set(mla[3]["after"])
    for k, v in sp["ckpt_adapter"].items():
        assert torch.equal(pp2["resumed_adapter"][k], v), k
    for key, moments in sp["ckpt_moments"].items():
        assert set(moments) == set(pp2["resumed_moments"][key]) and len(moments) > 0
        for k, v in moments.items():
            assert torch.equal(pp2["resumed_moments"][key][k], v), (key, k)
    ckpt, _, batch, ref, base = mla
    stepped = _peft_after(base, res["mla_sp"]["after"], MLA_TARGETS)
    merged_ref = helpers.hub_state_dict(copy.deepcopy(stepped).merge_and_unload(), str(tmp_path / "mla_merged_ref"))
    _assert_close_dict(res["mla_sp"]["merged"], merged_ref, 1e-6, "MLA merged export")
    base_hub = helpers.hub_state_dict(base, str(tmp_path / "mla_base_hub"))
    adapted = [k for k in merged_ref if not torch.equal(merged_ref[k], base_hub[k])]
    assert any("kv_a_proj_with_mqa" in k for k in adapted) and any("experts" in k for k in adapted), adapted
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "mla_saved"))
    assert torch.equal(_hf_logits(loaded, batch), _hf_logits(stepped, batch))


def _four_rank_cases(rank, world, moe, dense, deep, mla, tmp):
    import parallm
    results = {}
    zero = dict(shard_over_dp=True, overlap_grad_reduce=True)
    sp = dict(packed=True, sequence_parallel=True)
    for name, (ckpt, adapter, batch), kw, env, opt_kw, build in (
            ("moe_tp2_ep2", moe, dict(tp=2, ep=2), "auto", None, {}),
            ("moe_tp2_ep2_loop", moe, dict(tp=2, ep=2), "loop", None, {}),
            ("mla_moe_tp2_ep2_sp", mla, dict(tp=2, ep=2), "auto", None, sp),
            ("dense_tp4", dense, dict(tp=4), "auto", None, {}),
            ("dense_pp2_vpp2_zero", deep, dict(pp=2, vpp=2), "auto", zero, {})):
        os.environ["PARALLM_MOE_EXPERTS"] = env
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, build)
        out = _check_run(rank, chunks, batch, dp_slice=dp_rows(batch), opt_kw=opt_kw)
        if name == "moe_tp2_ep2":
            _merged_and_saved(chunks, out, os.path.join(tmp, "moe_saved"))
        results[name] = out
        parallm.destroy_parallel()
    return results if rank == 0 else None


@pytest.mark.timeout(900)
def test_lora_moe_and_replicated_kv(tmp_path):
    """Qwen3-MoE at tp2 x ep2 (dp2: each replica half the batch, token-mean), experts' adapters through the
    grouped GEMM and through the loop; Qwen3 at tp4 (2 KV heads: k / v factors replicated over 2 ranks each);
    a 4-layer Qwen3 at pp2 x vpp2 x dp2 with ZeRO and gradient buckets (two chunks per rank); DeepSeek-V3 (MLA,
    routed experts) at tp2 x ep2 (dp2) with packed + SP; against PEFT. The
    MoE adapter saved by parallm loads into PEFT with equal logits; its merged export equals PEFT's
    merge_and_unload."""
    import parallm
    from parallm.checkpoint.lora_io import WEIGHTS_NAME
    from safetensors.torch import load_file
    moe_ckpt, moe_adapter, moe_batch, moe_ref, moe_base = _reference(
        "qwen3_moe", tmp_path, overrides=dict(decoder_sparse_step=1, mlp_only_layers=[]))
    ckpt, adapter, batch, ref, _ = _reference("qwen3", tmp_path)
    deep = _reference("qwen3", tmp_path, overrides=dict(num_hidden_layers=4), tag="_deep")
    mla = _reference("deepseek_v3", tmp_path, overrides=MLA_CONFIG, targets=MLA_TARGETS)
    res = helpers.run_ranks(_four_rank_cases, 4, (moe_ckpt, moe_adapter, moe_batch), (ckpt, adapter, batch),
                            deep[:3], mla[:3], str(tmp_path))[0]
    _assert_case(res["mla_moe_tp2_ep2_sp"], mla[3], mla[2][1], "mla_moe_tp2_ep2_sp")
    for name in ("moe_tp2_ep2", "moe_tp2_ep2_loop"):
        _assert_case(res[name], moe_ref, moe_batch[1], name)
    _assert_case(res["dense_tp4"], ref, batch[1], "dense_tp4")
    _assert_case(res["dense_pp2_vpp2_zero"], deep[3], deep[2][1], "dense_pp2_vpp2_zero")
    # expert factors exist and moved (PEFT's stacked names)
    assert any(".mlp.experts.base_layer.lora_B" in k for k in moe_ref["after"])
    # the saved MoE adapter: the same names and shapes as PEFT's own file, and PEFT runs it
    ours = load_file(str(tmp_path / "moe_saved" / WEIGHTS_NAME))
    theirs = load_file(os.path.join(moe_adapter, WEIGHTS_NAME))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    _assert_close_dict(ours, moe_ref["after"], STEP_TOL, "saved MoE adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(moe_base), str(tmp_path / "moe_saved"))
    stepped = peft.get_peft_model(copy.deepcopy(moe_base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                            target_modules=list(TARGETS)))
    peft.set_peft_model_state_dict(stepped, ours)
    assert torch.equal(_hf_logits(loaded, moe_batch), _hf_logits(stepped, moe_batch))
    merged_ref = copy.deepcopy(stepped).merge_and_unload()
    merged_hub = helpers.hub_state_dict(merged_ref, str(tmp_path / "moe_merged_ref"))
    _assert_close_dict(res["moe_tp2_ep2"]["merged"], merged_hub, 1e-6, "MoE merged export")


def test_lora_config_and_refusals():
    """No process group: the config's checks, PEFT's target / pattern rules, and the modules refused by name."""
    import parallm
    from parallm.families import spec_from_config, family_of
    from parallm.model.layers.lora import LoraConfig, layer_slots
    from parallm.model.table import all_entries
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(4, 8, TARGETS, dropout=0.1)
    with pytest.raises(ValueError, match="r must be"):
        LoraConfig(0, 8, TARGETS)
    cfg = LoraConfig(4, 8, ("q_proj", "mlp.down_proj"), rank_pattern={"q_proj": 2},
                     alpha_pattern={"layers.1.q_proj": 3})
    assert cfg.targets("model.layers.0.self_attn.q_proj") and not cfg.targets("model.layers.0.self_attn.k_proj")
    assert cfg.targets("model.layers.0.mlp.down_proj") and not cfg.targets("model.layers.0.mlp.up_proj")
    assert cfg.rank_alpha("model.layers.0.self_attn.q_proj") == (2, 8.0)
    assert cfg.rank_alpha("model.layers.1.q_proj") == (2, 3.0)
    assert parallm.LoraConfig is LoraConfig
    # the seed: from parallm_adapter.json, else the "parallm" key older saves wrote into adapter_config.json
    from parallm.checkpoint.lora_io import config_from_peft

    class _NoExperts:
        table = ()
    peft_cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    assert config_from_peft(peft_cfg, _NoExperts()).seed == 0
    assert config_from_peft(peft_cfg, _NoExperts(), {"seed": 7, "target_modules": "all-linear"}).seed == 7
    assert config_from_peft(dict(peft_cfg, parallm={"seed": 5}), _NoExperts()).seed == 5
    # Gated DeltaNet's depthwise conv (parallm adapts its projections, tests/test_qwen35_lora.py, not the conv)
    # and Qwen3-MoE's gate without up: refused, naming the module
    import transformers
    next_cfg = dict(num_hidden_layers=2, full_attention_interval=2, head_dim=32, num_attention_heads=4,
                    num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    for family, kw, targets, match in (
            ("qwen3_next", next_cfg, ("conv1d",), "conv1d is not supported"),
            ("qwen3_moe", dict(decoder_sparse_step=1, mlp_only_layers=[]), ("gate_proj",), "without up_proj")):
        spec, fam = spec_from_config(helpers.tiny_config(family, **kw))
        with pytest.raises(ValueError, match=match):
            for e in all_entries(fam.table, spec, task="causal_lm", pp=1):
                layer_slots(spec, e, LoraConfig(4, 8, targets), tp=1, sp=False)
    # DeepSeek-V3: MLA projections adapted (the down-projections replicated, both factors' gradients partial sums
    # under SP only), its MLP names on the routed experts only; "all-linear" takes the MLA projections too
    spec, fam = spec_from_config(helpers.tiny_config("deepseek_v3", **MLA_CONFIG))
    kinds = {}
    for sp in (False, True):
        for e in all_entries(fam.table, spec, task="causal_lm", pp=1):
            found = layer_slots(spec, e, LoraConfig(4, 8, "all-linear"), tp=2, sp=sp)
            if found is not None and e.layer == 1:
                kinds[(e.local.split(".", 2)[-1], sp)] = (found[0], [(s.part, s.rows, s.cols, s.a_tp_sum,
                                                                       s.b_tp_sum) for s in found[1]])
    down = "self_attention.linear_kv_down_proj.weight"
    assert kinds[(down, True)] == ("replicated", [("kv_a_proj_with_mqa", 24, 64, True, True)])
    assert kinds[(down, False)] == ("replicated", [("kv_a_proj_with_mqa", 24, 64, False, False)])
    assert kinds[("self_attention.linear_kv_up_proj.weight", True)] == ("column", [("kv_b_proj", 88, 16, True,
                                                                                     False)])
    assert kinds[("self_attention.linear_proj.weight", True)] == ("row", [("o_proj", 64, 40, False, True)])
    assert {k for k, _ in kinds if ".mlp." in k or k.startswith("mlp.")} == {"mlp.experts.linear_fc1.weight",
                                                                            "mlp.experts.linear_fc2.weight"}


def _family_cases(rank, world, cases):
    import parallm
    results = {}
    for name, (ckpt, adapter, batch) in cases.items():
        parallm.init_parallel(tp=2)
        chunks = _adapted(ckpt, adapter, {})
        results[name] = _check_run(rank, chunks, batch)
        parallm.destroy_parallel()
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.build_optimizer(chunks, lr=LR)
    try:
        parallm.add_lora(chunks, parallm.LoraConfig(R, ALPHA, TARGETS))
    except ValueError as e:
        results["after_optimizer"] = str(e)
    parallm.destroy_parallel()
    return results if rank == 0 else None


@pytest.mark.timeout(900)
def test_lora_other_moe_families(tmp_path):
    """Qwen2-MoE (PEFT 0.21 adapts its shared expert and dense layers, not its stacked routed experts; so does
    parallm) and Mixtral (experts targeted as w1 / w3 / w2, retargeted by PEFT to the stacked experts) at tp2
    against PEFT; add_lora after build_optimizer is refused."""
    cases, refs = {}, {}
    for family, overrides, targets in (
            ("qwen2_moe", dict(decoder_sparse_step=1, mlp_only_layers=[1]), TARGETS),
            ("mixtral", {}, ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"))):
        ckpt, adapter, batch, ref, _ = _reference(family, tmp_path, overrides=overrides, targets=targets)
        cases[family], refs[family] = (ckpt, adapter, batch), ref
    res = helpers.run_ranks(_family_cases, 2, cases)[0]
    for family, ref in refs.items():
        _assert_case(res[family], ref, cases[family][2][1], family)
    # PEFT 0.21 has no conversion for qwen2_moe: its shared expert and dense layer adapted, its routed experts not
    names = set(refs["qwen2_moe"]["after"])
    assert any(".shared_expert.gate_proj." in k for k in names) and any(".layers.1.mlp.up_proj." in k for k in names)
    assert not any(".experts." in k for k in names)
    assert any(".mlp.experts.base_layer.lora_B" in k for k in refs["mixtral"]["after"])
    assert "add_lora after build_optimizer" in res["after_optimizer"]


@pytest.mark.timeout(300)
def test_grpo_example_lora_transformers_rollouts(tmp_path):
    """``examples/grpo.py --lora 8`` with transformers rollouts (3 steps at tp2): the warmed-up model becomes the
    frozen base, GRPO trains adapters, the engine gets the merged weights every step: its log-probs equal the
    trainer's (the vLLM run, adapter pushes and learning: tests/test_vllm_lora.py)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLM_PROGRESS="0")
    env.pop("RANK", None)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, os.path.join(root, "examples", "grpo.py"), "--rollout", "transformers", "--steps", "3",
           "--prompts", "8", "--lora", "8", "--lr", "5e-3", "--jsonl", str(log)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["lora"] == 8 and r["logprob_mismatch_max"] < 1e-4, r
