"""Microbatches by a token budget (``max_tokens_per_microbatch=``), as verl's dynamic batch size and Megatron's
sequence packing form them: pure functions, no torch.distributed.

:func:`token_bins` spreads the sequences over the fewest bins whose real tokens stay within the budget, balanced:
longest first, each onto the least loaded bin (LPT, deterministic: ties go to the lowest index). The caller
agrees on one bin count over the data-parallel replicas (the largest of their smallest counts) and forms that
many bins on every replica; :func:`bin_order` gives the permutation of the batch that makes the bins
contiguous, and its inverse restores the caller's order of the outputs.
"""

from __future__ import annotations

import math


def fewest_bins(lengths: list[int], budget: int) -> int:
    """The fewest bins :func:`token_bins` fills within ``budget`` (at least 1). A sequence longer than the budget
    is a ValueError naming it."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"max_tokens_per_microbatch must be a whole number >= 1, got {budget!r}")
    if lengths and max(lengths) > budget:
        i = max(range(len(lengths)), key=lambda j: lengths[j])
        raise ValueError(f"sequence {i} holds {lengths[i]} real tokens, more than max_tokens_per_microbatch="
                         f"{budget}; raise the budget to at least {lengths[i]}")
    k = max(1, math.ceil(sum(lengths) / budget))
    while max(sum(lengths[i] for i in b) for b in token_bins(lengths, k)) > budget:
        k += 1
    return k


def token_bins(lengths: list[int], k: int) -> list[list[int]]:
    """``k`` bins of sequence indices (each bin's indices ascending; bins may be empty), longest sequence first
    onto the least loaded bin."""
    loads = [0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        b = min(range(k), key=lambda j: (loads[j], len(bins[j]), j))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def bin_order(bins: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(order, sizes)``: the batch indices bin after bin (``batch[order]`` makes the bins contiguous) and each
    bin's size."""
    return [i for b in bins for i in b], [len(b) for b in bins]


def inverse(order: list[int]) -> list[int]:
    """The permutation that puts ``x[order]`` back in the caller's order."""
    inv = [0] * len(order)
    for pos, i in enumerate(order):
        inv[i] = pos
    return inv
