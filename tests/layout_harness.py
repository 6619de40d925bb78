"""One family's layouts against transformers, the harness the family tests share (MiniMax-M2, Gemma 3,
DeepSeek-V4).

A *case* is one layout (``tp`` / ``pp`` / ``cp`` / ``ep``, ``nmb`` microbatches), the build keywords (packed, SP,
recompute) and what the step's loss reads (``"logits"``: next-token cross entropy; ``"stats"``: the vocab-parallel
log-probs + entropy, :func:`rl_loss`). :func:`make_case` computes transformers' side in the parent process:
logits, log-probs, entropy, the checkpoint's tensors, and one SGD step (the loss averaged over the data-parallel
pieces as parallm's data parallelism averages it, the gradient norm, every weight and the logits after it).
:func:`rank_cases` runs the parallm side on every spawned rank: build, load (over NaN-filled parameters), logits,
log-probs and entropy, a bit-exact save and export stream (every tensor once), the same step; a family's
``breaks`` function (module level, so the spawn can pickle it) reports how far each deliberate break moves the
logits. :func:`check` prints one line per case and asserts the tolerances.
"""

from __future__ import annotations

import collections
import copy

import torch

import helpers
from parallm.verify.reference import causal_lm_loss, hf_output

LR = 0.5
TOL = 2e-5
ENT_COEF = 0.1
KEYS = ("fwd", "logprobs", "entropy", "loss", "norm", "after")


def rl_loss(out, ids, mask):
    """-mean log-prob of the next real tokens - ENT_COEF * mean entropy over real tokens (reads TokenStats)."""
    lp, ent = out
    keep = (mask[:, 1:] * mask[:, :-1]).float()
    real = mask.float()
    return -(lp[:, :-1] * keep).sum() / keep.sum() - ENT_COEF * (ent * real).sum() / real.sum()


def stats_of(logits, ids):
    """Next-token log-probs ``[B, S]`` (0 in the last column) and entropy ``[B, S]`` of ``logits``."""
    lsm = logits.float().log_softmax(-1)
    lp = torch.cat([lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), lsm.new_zeros(ids.shape[0], 1)], 1)
    return lp, -(lsm.exp() * lsm).sum(-1)


def sgd_step(model, ids, mask, pieces: int, loss_on: str, lr: float, *, rl=None, attn_impl: str | None = None):
    """transformers' side of one SGD step on a copy of ``model``: the loss averaged over ``pieces`` equal slices
    of the batch (``loss_on`` ``"logits"``: next-token cross entropy; ``"stats"``: ``rl`` (default
    :func:`rl_loss`) of the log-probs + entropy), then ``(stepped model, loss, gradient norm, its output)``.
    ``attn_impl``: the copy's attention implementation (transformers' ``_attn_implementation``)."""
    rl = rl or rl_loss
    model = copy.deepcopy(model)
    if attn_impl is not None:
        model.config._attn_implementation = attn_impl
    model.zero_grad()
    size = ids.shape[0] // pieces
    losses = []
    for a in range(0, ids.shape[0], size):
        out = hf_output(model, ids[a:a + size], mask[a:a + size])
        losses.append(causal_lm_loss(out, ids[a:a + size], mask[a:a + size]) if loss_on == "logits"
                      else rl(stats_of(out, ids[a:a + size]), ids[a:a + size], mask[a:a + size]))
    loss = torch.stack(losses).mean()
    loss.backward()
    with torch.no_grad():
        norm = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum().sqrt()
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
        after = hf_output(model, ids, mask)
    return model, loss.item(), norm.item(), after


def make_case(name: str, model, tmp, index: int, ids, mask, *, layout: dict, build: dict | None = None,
              loss_on: str = "logits", world: int = 2, lr: float = LR, breaks: bool = False, **extra) -> dict:
    """Transformers' side of one case (checkpoint written under ``tmp/m{index}``). ``layout``: init_parallel's
    keywords plus ``nmb``; the step splits the batch into data-parallel x microbatch pieces."""
    layout = dict(layout)
    nmb = layout.pop("nmb", 1)
    ckpt = str(tmp / f"m{index}")
    ckpt_sd = helpers.hub_state_dict(model, ckpt)
    with torch.no_grad():
        ref = hf_output(model, ids, mask)
    lp, ent = stats_of(ref, ids)
    model_parallel = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    stepped, loss, norm, after = sgd_step(model, ids, mask, (world // model_parallel) * nmb, loss_on, lr)
    new_sd = helpers.hub_state_dict(stepped, str(tmp / f"s{index}"))
    return dict(name=name, layout=layout, nmb=nmb, ckpt=ckpt, ids=ids, mask=mask, build=build or {},
                loss_on=loss_on, lr=lr, breaks=breaks, ref=ref, ref_sd=ckpt_sd, ref_lp=lp, ref_ent=ent,
                ref_loss=loss, ref_norm=norm, ref_after=after, ref_new_sd=new_sd, **extra)


def _outputs(chunks, case, breaks) -> dict:
    import parallm
    ids, mask = case["ids"], case["mask"]
    res = dict(fwd=helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask))
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    lp, ent = tuple(parallm.forward(chunks, ids, mask, output="logprobs+entropy"))
    res.update(logprobs=(lp[:, :-1][keep] - case["ref_lp"][:, :-1][keep]).abs().max().item(),
               entropy=(ent[mask.bool()] - case["ref_ent"][mask.bool()]).abs().max().item())
    if case["breaks"] and breaks is not None:
        res.update({f"break_{k}": v for k, v in breaks(chunks, case).items()})
    return res


def _save_and_export(rank, chunks, case) -> None:
    """A bit-exact save, and an export stream with every tensor once; a family whose saves stack the experts
    (``save_fused`` rows: gpt-oss, Gemma 4) streams each expert's slab under its per-expert name, compared with
    that slab of the stacked tensor."""
    import parallm
    from parallm.model.table import all_entries, stacked_saves
    sd = parallm.save_hf_weights(chunks)
    if rank == 0:
        helpers.assert_same_state(sd, case["ref_sd"])
    stacked = stacked_saves(all_entries(chunks[0].table, chunks[0].spec, task=chunks[0].task,
                                        pp=max(c.dims.pp for c in chunks)))
    names, slabs = [], collections.Counter()
    for name, t in parallm.export_hf_tensors(chunks):
        names.append(name)
        if name in stacked:
            fused, e = stacked[name]
            slabs[fused] += 1
            assert torch.equal(t, case["ref_sd"][fused][e]), (case["name"], name)
        else:
            assert torch.equal(t, case["ref_sd"][name]), (case["name"], name)
    dup = [n for n, k in collections.Counter(names).items() if k > 1]
    plain = {n for n in names if n not in stacked} | set(slabs)
    assert not dup and plain == set(case["ref_sd"]), (case["name"], dup, plain ^ set(case["ref_sd"]))
    assert all(k == case["ref_sd"][n].shape[0] for n, k in slabs.items()), (case["name"], slabs)


def _train_step(rank, chunks, case) -> dict:
    import parallm
    from parallm.parallel.state import current_dims
    lay = current_dims()
    ids, mask = case["ids"], case["mask"]
    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    kw = dict(loss_fn=causal_lm_loss) if case["loss_on"] == "logits" else \
        dict(loss_fn=rl_loss, output="logprobs+entropy")
    loss = parallm.forward_backward(chunks, ids[sl], mask[sl], num_microbatches=case["nmb"], **kw)
    parallm.finalize_grads(chunks)
    norm = parallm.clip_grad_norm_(chunks, float("inf"))
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                if p.requires_grad:
                    p -= case["lr"] * p.grad
    res = dict(loss=abs(loss.item() - case["ref_loss"]), norm=abs(norm.item() - case["ref_norm"]) / case["ref_norm"],
               after=helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref_after"], mask))
    new_sd = parallm.save_hf_weights(chunks)
    if rank == 0:
        ref_new = case["ref_new_sd"]
        assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
        res["weights"] = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
        res["worst"] = max(ref_new, key=lambda k: (new_sd[k] - ref_new[k]).abs().max().item())
    return res


def rank_cases(rank, world, cases, breaks=None):
    """Every case on this rank (``breaks(chunks, case) -> {name: max logit difference}`` on the cases that ask
    for it)."""
    import parallm
    out = []
    for case in cases:
        parallm.init_parallel(**case["layout"])
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, case["ckpt"])
        res = _outputs(chunks, case, breaks)
        _save_and_export(rank, chunks, case)
        res.update(_train_step(rank, chunks, case))
        out.append(res)
        parallm.destroy_parallel()
    return out


def check(cases, results, *, tol: float = TOL, after_tol: float = 1e-4, break_min: float = 1e-3) -> None:
    """Print each case's worst differences over the ranks and assert them (breaks: each must move the logits by
    more than ``break_min``)."""
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        worst = {k: max(r[k] for r in per_rank) for k in KEYS}
        broken = {k: min(r[k] for r in per_rank) for k in per_rank[0] if k.startswith("break_")}
        print(f"{case['name']:<56} " + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
              + f" weights {per_rank[0]['weights']:.1e} ({per_rank[0]['worst']})"
              + (" breaks: " + ", ".join(f"{k[6:]} {v:.1e}" for k, v in broken.items()) if broken else ""))
        assert worst["fwd"] < tol and worst["logprobs"] < tol and worst["entropy"] < tol, (case["name"], worst)
        assert worst["loss"] < tol and worst["norm"] < 1e-5 and per_rank[0]["weights"] < tol, (case["name"], worst)
        assert worst["after"] < after_tol, (case["name"], worst)
        assert not case["breaks"] or broken, (case["name"], "no break was measured")
        for key, moved in broken.items():
            assert moved > break_min, (case["name"], key, moved)
