"""A call's batch: the positional form or a batch mapping, its extra entries, default positions, and how it
splits into microbatches (equal rows, or bins of a token budget)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..model.logprobs import TokenStats
from ..train.batching import bin_order, inverse, token_bins


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(attention_mask) - 1`` clipped at 0: every sequence counts from its first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")


def is_batch_mapping(x) -> bool:
    """A dict of tensors, or a mapping-like batch (``tensordict.TensorDict``: ``keys()`` and ``[key]``)."""
    return isinstance(x, Mapping) or (not torch.is_tensor(x) and hasattr(x, "keys") and hasattr(x, "__getitem__")
                                      and hasattr(x, "batch_size"))


def unpack_batch(input_ids, attention_mask, position_ids):
    """The positional form ``(input_ids, attention_mask, position_ids)`` or a batch mapping in ``input_ids``'s
    place -> ``(input_ids, attention_mask, position_ids, extras)``: ``extras`` None for the positional form,
    else a dict of the mapping's other entries (checked by :func:`check_extras`)."""
    if not is_batch_mapping(input_ids):
        return input_ids, attention_mask, position_ids, None
    batch = input_ids
    if attention_mask is not None or position_ids is not None:
        raise ValueError("a batch mapping carries attention_mask and position_ids itself; do not pass them beside "
                         "it")
    keys = [str(k) for k in batch.keys()]
    if "input_ids" not in keys:
        raise ValueError(f"the batch mapping has no 'input_ids' (keys: {keys})")
    if any(k in keys for k in ("cu_seqlens", "cu_seqlens_q")):
        raise ValueError("packed cu_seqlens-style batches are not supported: pass padded [B, S] input_ids with an "
                         "attention_mask (build_model(packed=True) removes the padding inside the model)")
    get = (lambda k: batch[k] if k in keys else None)
    return get("input_ids"), get("attention_mask"), get("position_ids"), \
        {k: batch[k] for k in keys if k not in BATCH_KEYS}


def check_extras(extras, input_ids):
    """The batch mapping's other entries on the model's device: each a tensor whose first dimension is the
    batch (per sample ``[B, ...]`` or per token ``[B, S, ...]``), else a ValueError naming it. None stays None
    (the positional form)."""
    if extras is None:
        return None
    b = input_ids.shape[0]
    out = {}
    for k, v in extras.items():
        if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] != b:
            shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
            raise ValueError(f"batch[{k!r}] must be a tensor whose first dimension is the batch ({b}), got {shape}")
        out[k] = v.to(input_ids.device)
    return out


def split_extras(extras, m: int, sizes=None):
    """``extras`` split along dim 0 as the microbatches are (:func:`microbatches`): a list of ``m`` dicts, or
    None for the positional form."""
    if extras is None:
        return None
    if not extras:
        return [{} for _ in range(m)]
    parts = [t.split(sizes) if sizes is not None else t.tensor_split(m) for t in extras.values()]
    return [dict(zip(extras, piece)) for piece in zip(*parts)]


# Fewest tokens a microbatch of forward's default count holds beyond pp microbatches, by device type (others:
# the CUDA figure). CPU: about where the per-microbatch cost (a send per stage, the Python of every layer) stays
# under a few percent of the work on this project's 2-core machine; CUDA: a guess sized for kernel launches,
# not measured on a GPU.
MIN_FORWARD_MICROBATCH_TOKENS = {"cpu": 128, "cuda": 4096}


def default_forward_microbatches(batch: int, pp: int, tokens: int | None = None, device="cpu") -> int:
    """``forward``'s microbatch count at ``pp > 1`` when none is given: ``pp`` (at most one per sequence), and
    up to ``4 pp`` while each microbatch keeps :data:`MIN_FORWARD_MICROBATCH_TOKENS` of the batch's ``tokens``
    (``batch x seq``; None: no floor) on ``device``'s type. With ``m`` microbatches a pipeline of equal stages
    idles ``(pp - 1) / (m + pp - 1)`` of the time: 1/3 at ``m = pp = 2``, 1/9 at ``m = 4 pp``. A forward keeps
    nothing of a microbatch once it has passed, so more of them cost no memory, only smaller matrix products
    and one more message per stage each."""
    if tokens is None:
        more = 4 * pp
    else:
        floor = MIN_FORWARD_MICROBATCH_TOKENS.get(torch.device(device).type, MIN_FORWARD_MICROBATCH_TOKENS["cuda"])
        more = min(4 * pp, tokens // floor)
    return max(1, min(batch, max(pp, more)))


def real_lengths(attention_mask) -> list[int]:
    return attention_mask.sum(-1).tolist() if attention_mask.numel() else [0] * attention_mask.shape[0]


def token_budget_bins(layout, attention_mask, fewest: int) -> tuple[list[int], list[int]]:
    """``max_tokens_per_microbatch``'s microbatches: the bin count agreed over the data-parallel replicas (the
    largest ``fewest``: one MAX all-reduce over the data-parallel group), then :func:`token_bins` of this
    replica's real lengths. Returns ``(order, sizes)`` (:func:`parallm.train.batching.bin_order`)."""
    k = fewest
    if layout.dp > 1:
        t = torch.tensor([k], dtype=torch.long, device=attention_mask.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=layout.dp_group)
        k = int(t.item())
    return bin_order(token_bins(real_lengths(attention_mask), k))


def caller_order(outs, order, request):
    """Outputs of the token-budget microbatches (in bin order, TokenStats stacked) -> the caller's order."""
    entropy = request is not None and request.entropy
    joined = torch.cat(outs, dim=1 if entropy else 0)
    back = torch.tensor(inverse(order), dtype=torch.long, device=joined.device)
    joined = joined.index_select(1 if entropy else 0, back)
    return TokenStats(joined[0], joined[1]) if entropy else joined


def microbatches(chunks, input_ids, position_ids, attention_mask, m: int, sizes=None) -> list[tuple]:
    """The batch as ``m`` microbatches along dim 0 (sizes differing by at most one, the larger first; equal when
    ``m`` divides the batch; an empty batch gives ``m`` empty ones, so that every data-parallel replica runs the
    same schedule): ``(input_ids, position_ids, attention_mask)``, with this rank's context-parallel
    split of each as a fourth element under context parallelism (computed once per microbatch here; it travels
    through the pipeline with its microbatch). ``sizes``: the microbatches' sizes instead (a token budget's bins,
    the batch already in bin order)."""
    split = (lambda t: t.split(sizes)) if sizes is not None else (lambda t: t.tensor_split(m))
    mbs = list(zip(*(split(t) for t in (input_ids, position_ids, attention_mask))))
    if chunks[0].dims.cp > 1:
        mbs = [mb + (chunks[0].context_split(*mb),) for mb in mbs]
    return mbs
