"""The checks of every ``forward`` / ``forward_backward`` call, agreed over the ranks before any model collective:
the batch itself, rows a layout cannot run as transformers does, the same batch on every rank of a replica, the
same microbatch count over an expert-parallel group."""

from __future__ import annotations

import torch

from ..model.decoder import DecoderChunk
from ..parallel.errors import exchange_rows
from .batch import default_position_ids


def check_batch(chunks, input_ids, attention_mask, position_ids):
    """Validate the batch locally (callers then agree across ranks, checked_call: a bad batch on one rank is an
    error on every rank) and return it on the model's device, position_ids defaulted."""
    if not torch.is_tensor(input_ids) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be an integer tensor [batch, seq], got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    device = next(chunks[0].parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    position_ids = position_ids.to(device)
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    _check_holed_rows(chunks[0], attention_mask)
    vocab = chunks[0].spec.vocab_size
    low, high = (int(input_ids.min()), int(input_ids.max())) if input_ids.numel() else (0, 0)
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}); got values in [{low}, {high}] (on global rank "
                         f"{chunks[0].dims.rank})")
    return input_ids.long(), attention_mask, position_ids


def _check_holed_rows(chunk: DecoderChunk, attention_mask: torch.Tensor) -> None:
    """Rows with padding between their real tokens (a hole), in the layouts that remove padding (packed, and
    context parallelism, which compacts rows): transformers runs a hole's positions, and two layer kinds see the
    difference. Sliding windows count keys by index in the padded row (the packed and context-parallel layouts
    count real tokens: the same unless the row spans more than the window); recurrent layers (Gated DeltaNet,
    Mamba-2) convolve across the hole and decays its state there (the padded layout runs holes as transformers does).
    Such rows are refused there, naming the row and saying why (the padded layout takes them)."""
    spec = chunk.spec
    window, linear = spec.sliding_window, spec.linear_attn is not None or spec.mamba is not None
    if (window is None and not linear) or not (chunk.packed or chunk.dims.cp > 1) or not attention_mask.numel():
        return
    mask = attention_mask.bool()
    s = mask.shape[1]
    idx = torch.arange(s, device=mask.device)
    first = torch.where(mask, idx, s).min(-1).values
    last = torch.where(mask, idx, -1).max(-1).values
    span = (last - first + 1).clamp(min=0)
    holed = span > mask.sum(-1)
    bad = (holed if linear else holed & (span > window)).nonzero().squeeze(-1).tolist()
    if bad:
        row = bad[0]
        why = ("the model has linear-attention (Gated DeltaNet) or Mamba-2 layers, which transformers runs "
               "through the hole (its convolution reads across it, its state decays there) and the packed and "
               "context-parallel layouts remove it" if linear else
               f"the model has a sliding window of {window}: the packed and context-parallel layouts count the "
               "window over real tokens, transformers over positions in the row")
        raise ValueError(f"row {row} of the batch has padding between its real tokens ({int(mask[row].sum())} "
                         f"real tokens spread over {int(span[row])} positions) and {why}; pass rows padded only "
                         "at their ends, or use the padded layout (packed=False, cp=1)")


def call_fingerprint(layout, batch, num_microbatches: int, request, given=None, *, extras=None,
                      temperature=1.0, token_chunk=None, budget=None) -> list[int] | None:
    """:func:`parallm.parallel.batch_check.batch_fingerprint` of a checked ``(input_ids, attention_mask,
    position_ids)`` with the batch mapping's ``extras`` and the call's arguments that shape the work
    (:data:`SETTINGS`; router replay's ``given`` experts ``[B, S, L, k]`` at the real positions, padding values
    ignored, -1 without replay), or None when the replica is this rank alone (nothing to compare)."""
    from ..parallel.batch_check import batch_fingerprint, weighted_sum
    if layout.tp * layout.cp * layout.pp == 1:
        return None
    ids, mask, pos = batch
    kind = 0 if request is None else 2 if request.entropy else 1
    replay = -1 if given is None else weighted_sum(given * mask.bool()[:, :, None, None])
    bits = torch.tensor([float(temperature)], dtype=torch.float64).view(torch.int64).item()
    return batch_fingerprint(ids, pos, mask, extras=extras, settings=(
        num_microbatches, kind, replay, bits, -1 if token_chunk is None else token_chunk,
        -1 if budget is None else budget))


SETTINGS = ("num_microbatches", "output", "routed_experts", "temperature", "token_chunk",
            "max_tokens_per_microbatch")      # call_fingerprint's settings, as errors name them


def checked_call(layout, check, *, what: str, count_moe: bool, default: bool = False):
    """The checks every ``forward`` / ``forward_backward`` call makes before any model collective.

    ``check()`` (local work, no collectives) returns ``(result, fingerprint or None, microbatch count)``. Then,
    with ``count_moe``, the microbatch count over the expert-parallel group (:func:`same_microbatches`); then
    ONE agreement over the world (:func:`parallm.parallel.batch_check.agree_on_batch`: an all-reduce of ``1 + 2
    dp`` integers on the gloo control group; messages are exchanged only on failure) that also compares the
    batch fingerprints of the ranks of each model replica, so that an error of any of them on any rank, or
    ranks of one replica passing different batches, is an error on every rank before anything waits. A rank
    whose own check failed still takes part (its row marked failed, left out of the comparisons).
    Returns ``(result, the microbatch count to run)``."""
    from ..parallel.batch_check import agree_on_batch
    try:
        result, fingerprint, count = check()
        error = None
    except Exception as e:  # noqa: BLE001 - agreed on by every rank below
        result, fingerprint, count, error = None, None, 0, e
    failed = error is not None
    if count_moe:
        count, problem = same_microbatches(count, layout, what, default=default, failed=failed)
        error = error or problem
    agree_on_batch(error, fingerprint, layout, what=what, setting_names=SETTINGS)
    return result, count


def same_microbatches(num_microbatches: int, layout, what: str = "forward_backward", *,
                       default: bool = False, failed: bool = False) -> tuple[int, ValueError | None]:
    """Under expert parallelism the ranks of an expert-parallel group exchange tokens in every MoE layer, so they
    must run the same number of microbatches (batch sizes may differ): one all-gather over that group. A
    mismatch is a ValueError (returned, the same on every rank of the group), not a hang. ``default``: no rank
    was given a count (``num_microbatches`` is this rank's default); every rank then runs the smallest default
    of any rank. ``failed``: this rank's own check failed (its row is left out). Returns ``(the count to run,
    error or None)``. (The group is the same set of replicas at every pipeline stage and TP / CP position, so
    a pipeline's stages all choose the same count.)"""
    import torch.distributed as dist
    rows = exchange_rows([int(failed), num_microbatches, int(default)], what=what, group=layout.ep_group)
    ranks = [r for r, row in zip(dist.get_process_group_ranks(layout.ep_group), rows.tolist()) if not row[0]]
    rows = rows[rows[:, 0] == 0]
    if not len(rows):
        return num_microbatches, None
    counts, defaults = rows[:, 1].tolist(), rows[:, 2].tolist()
    if all(defaults):
        return min(counts), None
    if len(set(counts)) > 1 or any(defaults):
        given = [c if not d else "default" for c, d in zip(counts, defaults)]
        return num_microbatches, ValueError(
            f"{what}: with expert parallelism (ep={layout.ep}) every rank must pass the same num_microbatches; got "
            f"{given} on global ranks {ranks} (one expert-parallel group)")
    return num_microbatches, None
