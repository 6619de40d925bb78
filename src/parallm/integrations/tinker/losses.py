"""The Tinker API's built-in losses, each written from its definition in Tinker's documentation
(tinker-docs.thinkingmachines.ai, "Loss Functions" and its pages per loss), on one datum's per-token log-probs.

Notation (Tinker's): ``tl`` the training model's log-prob of each target token (``target_logprobs``, computed by
parallm, differentiable), ``lp`` the sampler's (``loss_fn_inputs["logprobs"]``), ``A`` the advantages, ``w`` the
weights. Every loss is a **sum** over the datum's tokens (never a mean: Tinker leaves the aggregation to the
advantages / weights the client sends), and a request's objective is the sum over its datums:

    cross_entropy        -sum(tl * w)
    importance_sampling  -sum(exp(tl - lp) * A)
    ppo                  -sum(min(r A, clip(r, lo, hi) A)),          r = exp(tl - lp)
    cispo                -sum(sg(clip(r, lo, hi)) * tl * A)
    dro                  -sum(tl A - beta / 2 (tl - lp)^2)
    gspo                 -sum(min(s_t A, clip(s_t, lo, hi) A)),      s_t = exp(mean_M(sg(tl) - lp) + tl - sg(tl))

``lo`` / ``hi`` are ratio bounds (``clip_low_threshold`` / ``clip_high_threshold``, default 0.8 / 1.2: Tinker's
epsilon of 0.2), from ``loss_fn_config`` or per token from ``loss_fn_inputs`` (not both). ``gspo``'s M is the set of
tokens its ``sequence_ratio_mask`` marks (required, at least one token). ``dro`` takes ``beta`` from
``loss_fn_config`` (required: the documentation names no default).

Not offered (a :class:`LossInputError` naming why): ``stable_reinforce`` (the SDK 0.38 and Tinker's documentation
give its inputs: samples recorded with ``record_stability_info=True``, provenance spans naming their
``sequence_id``, a ``kl_coeff`` config; but not its objective, nor what the recorded "stability information" is:
docs/tinker.md quotes them; the protocol around it is in place, :mod:`.stability`) and ``custom`` with a server-side
loss id (the SDK runs ``forward_backward_custom`` on the client when the server does not announce server-side
losses, which this server does not). ``forward_backward_custom`` itself works: the SDK turns the client's loss into
a ``cross_entropy`` request whose weights are ``-dC/dlogprobs``.

Everything here is pure torch on one datum: :mod:`.batch` packs datums into parallm batches and calls
:func:`datum_loss` per row. The checks (:func:`check_inputs`) run on rank 0 before any work is dispatched, so a
malformed request fails alone and leaves the model untouched.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LOSSES", "LossInputError", "check_config", "check_inputs", "datum_loss"]

DEFAULT_CLIP = (0.8, 1.2)
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")

# loss -> (required inputs, optional inputs, config keys)
LOSSES = {
    "cross_entropy": (("target_tokens", "weights"), (), ()),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), (), ()),
    "ppo": (("target_tokens", "logprobs", "advantages"), CLIP_KEYS, CLIP_KEYS),
    "cispo": (("target_tokens", "logprobs", "advantages"), CLIP_KEYS, CLIP_KEYS),
    "dro": (("target_tokens", "logprobs", "advantages"), (), ("beta",)),
    "gspo": (("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"), CLIP_KEYS, CLIP_KEYS),
}
REFUSED = {
    "stable_reinforce": "stable_reinforce is not offered by parallm's Tinker server: its objective is unpublished "
                        "(the tinker SDK 0.38 and Tinker's documentation define its inputs, not the loss). In "
                        "place: sampling with record_stability_info=True records each sample under a "
                        "server-assigned sequence_id, and datums' provenance spans naming them are checked "
                        "(session, offsets, tokens, one-day expiry renewed by use); the loss is what is missing "
                        "(train these datums with ppo, cispo, gspo or importance_sampling)",
    "custom": "server-side custom losses (loss_fn='custom' with a loss_id) are not offered by parallm's Tinker "
              "server; forward_backward_custom with a Python loss runs on the client and works",
}


class LossInputError(ValueError):
    """A request whose loss, inputs or config do not fit the loss's definition (a user error)."""


def check_config(loss_fn: str, config: dict | None) -> dict:
    """The loss's numeric config, checked: known loss, known keys, finite numbers, required keys present."""
    if loss_fn in REFUSED:
        raise LossInputError(REFUSED[loss_fn])
    if loss_fn not in LOSSES:
        raise LossInputError(f"unknown loss_fn {loss_fn!r}; parallm's Tinker server offers "
                             f"{', '.join(LOSSES)}")
    keys = LOSSES[loss_fn][2]
    out = {}
    for k, v in (config or {}).items():
        if k not in keys:
            raise LossInputError(f"{loss_fn}: unknown loss_fn_config key {k!r} (it takes "
                                 f"{', '.join(keys) if keys else 'none'})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise LossInputError(f"{loss_fn}: loss_fn_config[{k!r}] must be a finite number, got {v!r}")
        out[k] = float(v)
    if loss_fn == "dro" and "beta" not in out:
        raise LossInputError("dro needs loss_fn_config['beta'] (the weight of its quadratic penalty)")
    if "clip_low_threshold" in out and "clip_high_threshold" in out and \
            out["clip_low_threshold"] > out["clip_high_threshold"]:
        raise LossInputError(f"{loss_fn}: clip_low_threshold {out['clip_low_threshold']} is above "
                             f"clip_high_threshold {out['clip_high_threshold']}")
    return out


def check_inputs(loss_fn: str, config: dict, inputs: dict, *, length: int, vocab: int, index: int) -> None:
    """One datum's ``loss_fn_inputs`` (name -> numpy / torch array) against the loss: the required names, no
    unknown ones, one row per input position (``length``), target ids in ``[0, vocab)``, finite values.
    ``index`` names the datum in messages."""
    required, optional, _ = LOSSES[loss_fn]
    where = f"datum {index}"
    missing = [k for k in required if k not in inputs]
    if missing:
        raise LossInputError(f"{loss_fn}: {where} lacks loss_fn_inputs {missing} (it takes "
                             f"{', '.join(required + optional)})")
    unknown = sorted(set(inputs) - set(required) - set(optional))
    if unknown:
        raise LossInputError(f"{loss_fn}: {where} has loss_fn_inputs {unknown} this loss does not take "
                             f"(it takes {', '.join(required + optional)})")
    for k in CLIP_KEYS:
        if k in inputs and k in config:
            raise LossInputError(f"{loss_fn}: {k} given both per token (loss_fn_inputs) and in loss_fn_config")
    two_d = loss_fn == "cross_entropy" and torch.as_tensor(inputs["target_tokens"]).dim() == 2
    for k, v in inputs.items():
        t = torch.as_tensor(v)
        want = (length, t.shape[1]) if two_d and k in ("target_tokens", "weights") and t.dim() == 2 else (length,)
        if tuple(t.shape) != want:
            raise LossInputError(f"{loss_fn}: {where}: loss_fn_inputs[{k!r}] has shape {tuple(t.shape)}, the "
                                 f"model input has {length} tokens (expected {want})")
        if k == "target_tokens":
            if t.is_floating_point():
                raise LossInputError(f"{loss_fn}: {where}: target_tokens must be integers, got {t.dtype}")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
                raise LossInputError(f"{loss_fn}: {where}: target token {bad} is outside the vocabulary "
                                     f"[0, {vocab})")
        elif not torch.isfinite(t.double()).all():
            raise LossInputError(f"{loss_fn}: {where}: loss_fn_inputs[{k!r}] holds a non-finite value")
    if two_d and tuple(torch.as_tensor(inputs["weights"]).shape) != tuple(torch.as_tensor(
            inputs["target_tokens"]).shape):
        raise LossInputError(f"cross_entropy: {where}: 2-D target_tokens and weights must have the same shape")
    if loss_fn == "gspo" and not bool((torch.as_tensor(inputs["sequence_ratio_mask"]) != 0).any()):
        raise LossInputError(f"gspo: {where}: sequence_ratio_mask marks no token (the sequence ratio is a mean "
                             "over the marked tokens)")
    lo, hi = _bounds(config, inputs, dtype=torch.float64)
    if bool((torch.as_tensor(lo) > torch.as_tensor(hi)).any()):
        raise LossInputError(f"{loss_fn}: {where}: clip_low_threshold above clip_high_threshold")


def _bounds(config: dict, inputs: dict, *, dtype, device=None):
    out = []
    for k, d in zip(CLIP_KEYS, DEFAULT_CLIP):
        if k in inputs:
            out.append(torch.as_tensor(inputs[k], dtype=dtype, device=device))
        else:
            out.append(torch.tensor(config.get(k, d), dtype=dtype, device=device))
    return out


def datum_loss(loss_fn: str, config: dict, tl: torch.Tensor, inputs: dict) -> torch.Tensor:
    """One datum's loss (a scalar, differentiable through ``tl``): ``tl`` its target log-probs ``[N]`` (``[N, K]``
    for a 2-D cross-entropy target), ``inputs`` its loss_fn_inputs as tensors on ``tl``'s device."""
    f = lambda k: inputs[k].to(tl.dtype)   # noqa: E731
    if loss_fn == "cross_entropy":
        return -(tl * f("weights")).sum()
    lp, adv = f("logprobs"), f("advantages")
    if loss_fn == "importance_sampling":
        return -(torch.exp(tl - lp) * adv).sum()
    if loss_fn == "dro":
        return -(tl * adv - 0.5 * config["beta"] * (tl - lp) ** 2).sum()
    lo, hi = _bounds(config, inputs, dtype=tl.dtype, device=tl.device)
    if loss_fn == "gspo":
        marked = inputs["sequence_ratio_mask"] != 0
        log_ratio = (tl.detach() - lp)[marked].mean()
        ratio = torch.exp(log_ratio + tl - tl.detach())
    else:
        ratio = torch.exp(tl - lp)
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)
    if loss_fn == "cispo":
        return -(clipped.detach() * tl * adv).sum()
    return -torch.minimum(ratio * adv, clipped * adv).sum()
