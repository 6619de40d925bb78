"""LoRA on the output head (``lm_head``) against transformers + PEFT (``peft.LoraConfig(target_modules=[...,
"lm_head"])``), fp32, on tiny Qwen3 models (vocab 101: at tp2 the head is padded to 102 rows, rank 1 holding one
padding row) with every weight non-trivial and the adapters' A and B random (B non-zero).

One 2-rank spawn: untied at tp2 (padded batch), tp2 with packed + sequence parallelism (from parallm's own save of
PEFT's adapter: a round trip) and cp2; tied at tp2 (one shared weight) and pp2 (the last stage's head copy). Each:
logits, ``output="logprobs"`` / ``"logprobs+entropy"``, the same under ``adapters_disabled`` against the bare
model, one token-mean step (loss through the log-prob head or through the logits) whose loss, gradient norm, every
factor's gradient (the head's B without its padding rows, which get exactly 0) and AdamW update match PEFT's; the
adapter saved by parallm loads into PEFT with the same logits; merged export (untied: PEFT's merge_and_unload;
tied: refused); a PEFT file whose saved head base weight is not the model's is refused; a value model targeting
lm_head is refused; tp2's training checkpoint resumes at tp1 x cp2 bit for bit.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import NamedTuple

import peft
import pytest
import torch

import helpers

TARGETS = ("q_proj", "down_proj", "lm_head")
R, ALPHA = 4, 8
LR, EPS, WD = 1e-3, 1e-4, 0.1
TOL = 1e-5          # logits / log-probs / entropy, the loss and gradient norm (relative), fp32 (measured <= 3.3e-6)
GRAD_TOL = 2e-6     # every factor's gradient (measured <= 1.9e-7)
STEP_TOL = 2e-6     # the factors after one AdamW step (lr 1e-3; measured <= 6.1e-7)
HEAD_PEFT = "base_model.model.lm_head."


class Stats(NamedTuple):
    logprobs: torch.Tensor
    entropy: torch.Tensor


def stats_loss(out, ids, mask):
    """Token-mean of ``-logprob + 0.3 entropy`` over next-token pairs of real tokens: both gradients."""
    m = torch.zeros_like(out.logprobs)
    m[:, :-1] = (mask[:, 1:] * mask[:, :-1]).float()
    return ((0.3 * out.entropy - out.logprobs) * m).sum(), m.sum()


def logits_loss(logits, ids, mask):
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return (-lp.gather(-1, ids[:, 1:, None])[..., 0] * m).sum(), m.sum()


def stats_of(logits, ids) -> Stats:
    """transformers' logits -> parallm's [B, S] log-probs of the next token and entropies (0 at the last slot)."""
    lp = logits.float().log_softmax(-1)
    out = torch.zeros(ids.shape)
    out[:, :-1] = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return Stats(out, -(lp.exp() * lp).sum(-1))


def _peft_model(base):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # tied: "a tied layer is part of the adapter" (PEFT adapts lm_head only)
        return peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                         target_modules=list(TARGETS)))


def _factors(model) -> dict:
    """The adapter's factors as save_pretrained names them (without the head's base weight PEFT adds)."""
    return {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()
            if not k.endswith("base_layer.weight")}


def _reference(tmp, *, tied: bool):
    """(ckpt, PEFT's adapter dir, batch, reference, base)."""
    import parallm
    tag = "tied" if tied else "untied"
    cfg = helpers.tiny_config("qwen3", tie_word_embeddings=tied)
    base = helpers.make_hf_model(cfg, seed=0)
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == tied
    ckpt = helpers.save_checkpoint(base, str(tmp / f"{tag}_ckpt"))
    model = _peft_model(base)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = str(tmp / f"{tag}_peft")
    model.save_pretrained(adapter)          # with the head's base weight (PEFT's save_embedding_layers="auto")
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=4, seq=12)
    pos = parallm.default_position_ids(mask)
    run = lambda m: m(input_ids=ids, attention_mask=mask, position_ids=pos).logits    # noqa: E731
    with torch.no_grad():
        ref = dict(logits=run(model), base_logits=run(base))
    ref["stats"], ref["base_stats"] = stats_of(ref["logits"], ids), stats_of(ref["base_logits"], ids)
    ref["before"] = _factors(model)
    for kind in ("stats", "logits"):
        stepped = copy.deepcopy(model)
        params = {n.replace(".default", ""): p for n, p in stepped.named_parameters() if p.requires_grad}
        opt = torch.optim.AdamW(params.values(), lr=LR, eps=EPS, weight_decay=WD)
        logits = run(stepped)
        total, count = stats_loss(stats_of(logits, ids), ids, mask) if kind == "stats" else \
            logits_loss(logits, ids, mask)
        (total / count).backward()
        grads = {n.removeprefix("base_model.model."): p.grad.clone() for n, p in params.items()}
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 1e9).item()
        opt.step()
        ref["step_" + kind] = dict(loss=(total / count).item(), norm=norm, grads=grads,
                         after=_factors(stepped))
    return ckpt, adapter, (ids, mask), ref, base


# -- on the ranks ---------------------------------------------------------------------------------------------

def _gathered_grads(chunks):
    """Checkpoint name -> whole gradient of every factor (TP shards merged: the head's B without its padding
    rows), on every rank, and whether every B padding row's gradient and value is exactly 0."""
    import torch.distributed as dist
    from parallm.model.layers.lora import chunk_lora_entries
    from parallm.model.params import grad_of
    from parallm.model.placement import placement_of
    mine, pad_zero = {}, True
    for entry, chunk in chunk_lora_entries(chunks):
        p = chunk.get_parameter(entry.local)
        g, lay, dims = grad_of(p), placement_of(p).layout, chunk.dims
        if entry.hf[0] == "lm_head.lora_B.weight":
            real = chunk.real_vocab_columns if chunk.real_vocab_columns is not None else p.shape[0]
            pad_zero = pad_zero and not g[real:].any() and not p.detach()[real:].any()
            pad_zero = pad_zero and p.shape[0] == chunk.padded_vocab_size // dims.tp
        shards = [torch.empty_like(g) for _ in range(dims.tp)]
        dist.all_gather(shards, g.contiguous(), group=dims.tp_group)
        mine[entry.hf[0]] = lay.merge(shards)[0].clone()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, pad_zero))
    return {k: v for m, _ in every for k, v in m.items()}, all(z for _, z in every)


def _run(rank, chunks, batch, loss):
    """Forward outputs with and without adapters, one step with ``loss`` ("stats" or "logits")."""
    import parallm
    ids, mask = batch
    out = {}
    with torch.no_grad():
        out["logits"] = parallm.forward(chunks, ids, mask)
        out["stats"] = tuple(parallm.forward(chunks, ids, mask, output="logprobs+entropy"))
        out["logprobs"] = parallm.forward(chunks, ids, mask, output="logprobs")
        with parallm.adapters_disabled(chunks):
            out["base_logits"] = parallm.forward(chunks, ids, mask)
            out["base_stats"] = tuple(parallm.forward(chunks, ids, mask, output="logprobs+entropy"))
    out["before"] = dict(parallm.export_adapter_tensors(chunks))
    opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=WD)
    if loss == "stats":
        out["loss"] = parallm.forward_backward(chunks, ids, mask, loss_fn=stats_loss,
                                               output="logprobs+entropy").item()
    else:
        out["loss"] = parallm.forward_backward(chunks, ids, mask, loss_fn=logits_loss).item()
    parallm.finalize_grads(chunks)
    out["grads"], out["pad_zero"] = _gathered_grads(chunks)
    out["norm"] = parallm.clip_grad_norm_(chunks, 1e9).item()
    opt.step()
    out["after"] = dict(parallm.export_adapter_tensors(chunks))
    out["pad_zero_after"] = _gathered_grads(chunks)[1]
    return out, opt


def _adapted(ckpt, adapter, build):
    import parallm
    chunks = parallm.build_model(ckpt, **build)
    parallm.load_hf_weights(chunks, ckpt)
    parallm.load_hf_adapter(chunks, adapter)
    return chunks


def _untied_extras(chunks, untied, tmp, out):
    """After the tp2 step: merged export, parallm's save of the stepped adapter, a PEFT file whose head base weight
    is another one refused (on every rank before any writes)."""
    import parallm
    from safetensors.torch import load_file, save_file
    out["merged"] = dict(parallm.export_hf_tensors(chunks, merged=True, copy=True))
    parallm.save_hf_adapter(chunks, os.path.join(tmp, "untied_saved"), overwrite=True)
    bad = os.path.join(tmp, "untied_bad_head")
    if chunks[0].dims.rank == 0:
        import shutil
        shutil.copytree(untied[1], bad, dirs_exist_ok=True)
        tensors = load_file(os.path.join(bad, "adapter_model.safetensors"))
        tensors[HEAD_PEFT + "base_layer.weight"][5, 3] += 1.0          # row 5: TP rank 0's slice
        save_file(tensors, os.path.join(bad, "adapter_model.safetensors"))
    import torch.distributed as dist
    dist.barrier()
    try:
        parallm.load_hf_adapter(chunks, bad)
    except parallm.CheckpointError as e:
        out["bad_head"] = str(e)
    out["after_failed_load"] = dict(parallm.export_adapter_tensors(chunks))   # agreed before any rank wrote


def _cases(rank, world, untied, tied, tmp):
    import parallm
    results = {}
    rt = os.path.join(tmp, "untied_roundtrip")
    for name, (ckpt, adapter, batch), kw, build, loss in (
            ("tp2", untied, dict(tp=2), {}, "stats"),
            ("sp", (untied[0], rt, untied[2]), dict(tp=2), dict(packed=True, sequence_parallel=True), "stats"),
            ("cp2", untied, dict(cp=2), {}, "stats"),
            ("tied_tp2", tied, dict(tp=2), {}, "logits"),
            ("tied_pp2", tied, dict(pp=2), {}, "stats")):
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, build)
        if name == "tp2":                   # PEFT's adapter, saved by parallm before any step: the SP case's
            parallm.save_hf_adapter(chunks, rt, overwrite=True)
        out, opt = _run(rank, chunks, batch, loss)
        if name == "tp2":
            _untied_extras(chunks, untied, tmp, out)
            parallm.save_checkpoint(os.path.join(tmp, "tp2_ckpt"), chunks, opt, step=1, overwrite=True)
        if name == "cp2":               # tp2's training checkpoint (B padded over 2 ranks) at tp1 x cp2
            parallm.load_checkpoint(os.path.join(tmp, "tp2_ckpt"), chunks,
                                    parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=WD))
            out["resumed"] = dict(parallm.export_adapter_tensors(chunks))
        if name == "tied_tp2":
            try:
                dict(parallm.export_hf_tensors(chunks, merged=True))
            except ValueError as e:
                out["merged_refused"] = str(e)
            parallm.save_hf_adapter(chunks, os.path.join(tmp, "tied_saved"), overwrite=True)
        results[name] = out
        parallm.destroy_parallel()
    parallm.init_parallel(tp=2)
    try:
        parallm.build_model(untied[0], task="value", lora=parallm.LoraConfig(R, ALPHA, ("q_proj", "lm_head")))
    except ValueError as e:
        results["value"] = str(e)
    parallm.destroy_parallel()
    return results if rank == 0 else None


# -- the checks -----------------------------------------------------------------------------------------------

def _diff_real(a, b, mask):
    return helpers.max_diff_real(a, b, mask)


def _close(got: dict, want: dict, tol: float, what: str) -> float:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    worst = 0.0
    for k in want:
        assert got[k].shape == want[k].shape, f"{what}: {k} {tuple(got[k].shape)} vs {tuple(want[k].shape)}"
        worst = max(worst, (got[k] - want[k]).abs().max().item())
        assert worst <= tol, f"{what}: {k} differs by {worst:.3g}"
    return worst


def _check(out, ref, batch, name, loss) -> dict:
    """Every comparison of one case against PEFT; returns the measured errors."""
    ids, mask = batch
    stat_mask = mask.clone()
    stat_mask[:, -1] = 0            # parallm's log-prob of the last slot is 0 (no next token)
    err = {"logits": _diff_real(out["logits"], ref["logits"], mask),
           "base_logits": _diff_real(out["base_logits"], ref["base_logits"], mask)}
    for key, want in (("stats", ref["stats"]), ("base_stats", ref["base_stats"])):
        got = Stats(*out[key])
        err[key + ".logprobs"] = _diff_real(got.logprobs, want.logprobs, stat_mask)
        err[key + ".entropy"] = _diff_real(got.entropy, want.entropy, mask)
    err["logprobs_only"] = _diff_real(out["logprobs"], ref["stats"].logprobs, stat_mask)
    for k, v in err.items():
        assert v < TOL, (name, k, v)
    # the head adapter changes the outputs (not only the other adapters): checked by the break runs, and here by
    # the head's B mattering to the reference at all
    assert _diff_real(out["logits"], ref["base_logits"], mask) > 1e-2, name
    for k, v in ref["before"].items():          # PEFT's adapter read bit-exactly (the SP case: parallm's save)
        assert torch.equal(out["before"][k], v), (name, k)
    assert set(out["before"]) == set(ref["before"]) and HEAD_PEFT + "lora_B.weight" in out["before"]
    step = ref["step_" + loss]
    err["loss"] = abs(out["loss"] - step["loss"])
    err["norm"] = abs(out["norm"] - step["norm"]) / step["norm"]
    assert err["loss"] < TOL and err["norm"] < TOL, (name, err)
    err["grads"] = _close(out["grads"], step["grads"], GRAD_TOL, f"{name} gradients")
    err["step"] = _close(out["after"], step["after"], STEP_TOL, f"{name} step")
    assert out["pad_zero"] and out["pad_zero_after"], f"{name}: the head B's padding rows are not 0"
    head_grad = step["grads"]["lm_head.lora_A.weight"].abs().max().item()
    assert head_grad > 1e-3, head_grad          # the head's gradients are not trivially 0
    return err


@pytest.mark.timeout(900)
def test_lora_head_against_peft(tmp_path):
    import parallm
    untied = _reference(tmp_path, tied=False)
    tied = _reference(tmp_path, tied=True)
    res = helpers.run_ranks(_cases, 2, untied[:3], tied[:3], str(tmp_path))[0]
    errors = {}
    for name, case, loss in (("tp2", untied, "stats"), ("sp", untied, "stats"), ("cp2", untied, "stats"),
                             ("tied_tp2", tied, "logits"), ("tied_pp2", tied, "stats")):
        errors[name] = _check(res[name], case[3], case[2], name, loss)
    print({n: {k: f"{v:.2g}" for k, v in e.items()} for n, e in errors.items()})
    # the adapters-only training checkpoint saved at tp2, resumed at tp1 x cp2: bit for bit
    assert set(res["cp2"]["resumed"]) == set(res["tp2"]["after"])
    for k, v in res["tp2"]["after"].items():
        assert torch.equal(res["cp2"]["resumed"][k], v), k
    # PEFT's file holds the head's base weight too; parallm's save does not (PEFT then keeps its own base head)
    from safetensors.torch import load_file
    theirs = load_file(os.path.join(untied[1], "adapter_model.safetensors"))
    assert HEAD_PEFT + "base_layer.weight" in theirs
    for tag, case, name in (("untied", untied, "tp2"), ("tied", tied, "tied_tp2")):
        ours = load_file(str(tmp_path / f"{tag}_saved" / "adapter_model.safetensors"))
        want = {k: v for k, v in theirs.items() if "base_layer" not in k}
        assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in want.items()}
        for k, v in res[name]["after"].items():
            assert torch.equal(ours[k], v), (tag, k)
        # PEFT loads parallm's save: the same logits as PEFT holding the stepped tensors
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = peft.PeftModel.from_pretrained(copy.deepcopy(case[4]), str(tmp_path / f"{tag}_saved"))
        stepped = _peft_model(case[4])
        peft.set_peft_model_state_dict(stepped, res[name]["after"])
        ids, mask = case[2]
        pos = parallm.default_position_ids(mask)
        with torch.no_grad():
            a = loaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            b = stepped(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(a, b), tag
    # the untied merged export after the step: PEFT's merge_and_unload, lm_head.weight included
    stepped = _peft_model(untied[4])
    peft.set_peft_model_state_dict(stepped, res["tp2"]["after"])
    merged_ref = copy.deepcopy(stepped).merge_and_unload().state_dict()
    merged = res["tp2"]["merged"]
    assert "lm_head.weight" in merged
    assert not torch.equal(merged["lm_head.weight"], untied[4].lm_head.weight)
    _close(merged, {k: v for k, v in merged_ref.items() if k in merged}, 1e-6, "merged export")
    assert "tied embeddings" in res["tied_tp2"]["merged_refused"], res["tied_tp2"].get("merged_refused")
    assert "differs from this model's lm_head" in res["tp2"]["bad_head"], res["tp2"].get("bad_head")
    for k, v in res["tp2"]["after"].items():        # the refused load wrote nothing on any rank
        assert torch.equal(res["tp2"]["after_failed_load"][k], v), k
    assert "value model has no lm_head" in res["value"], res.get("value")


def test_lora_head_config():
    """No process group: lm_head is not in "all-linear" (PEFT's meaning), is taken by name or beside
    "all-linear"; the head's slot and factor entries (A replicated, B split over the padded vocabulary)."""
    from parallm.families import spec_from_config
    from parallm.model.layers.lora import LoraConfig
    from parallm.model.layers.lora_plan import global_entries, head_slot
    from parallm.model.sharding import Replicated, VocabSplit
    assert not LoraConfig(4, 8, "all-linear").targets("lm_head")
    assert LoraConfig(4, 8, ("all-linear", "lm_head")).targets("lm_head")
    assert LoraConfig(4, 8, ("all-linear", "lm_head")).targets("model.layers.1.mlp.up_proj")
    assert not LoraConfig(4, 8, ("q_proj",)).targets("lm_head")
    spec, fam = spec_from_config(helpers.tiny_config("qwen3"))
    cfg = LoraConfig(4, 8, ("lm_head",), rank_pattern={"lm_head": 2}, alpha_pattern={"lm_head": 6})
    for sp in (False, True):
        s = head_slot(spec, "causal_lm", cfg, padded_vocab=102, sp=sp)
        assert (s.module, s.rows, s.cols, s.r, s.scaling, s.a_tp_sum, s.b_tp_sum) == \
            ("lm_head", 101, 64, 2, 3.0, sp, False)
        assert isinstance(s.a_layout, Replicated) and isinstance(s.b_layout, VocabSplit)
        assert s.b_layout.padded == 102 and s.b_layout.vocab == 101
    for task in ("value", "hidden"):
        with pytest.raises(ValueError, match=f"a {task} model has no lm_head"):
            head_slot(spec, task, cfg, padded_vocab=102, sp=False)

    class Dims:
        tp, pp = 2, 1
    entries = global_entries(spec, fam.table, "causal_lm", Dims, cfg)
    assert [(e.hf[0], e.local, e.shape) for e, _, _ in entries] == [
        ("lm_head.lora_A.weight", "output_layer.lora.lora_A.lm_head", (2, 64)),
        ("lm_head.lora_B.weight", "output_layer.lora.lora_B.lm_head", (101, 2))]
    assert not global_entries(spec, fam.table, "causal_lm", Dims, cfg, layers=range(2))
