"""Which keys each query of the DSA lightning indexer may see (:class:`KeyRanges`, made once per batch), and the
plan of its blocked top-k (:func:`plan_blocks`): which blocks of queries are scored at once against which window
of keys, sized by the memory a block may take (:func:`score_budget`: half of what the device has free, or a
fixed size). Pure planning: nothing here allocates the scores, so the plan for a 128k-token sequence can be
counted on any machine (:func:`plan_launches`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from .attention import Packing, PaddedRows

BUDGET_ENV = "PARALLM_INDEXER_MEMORY"     # bytes one indexer block may take (or with a K / M / G suffix)
CPU_BUDGET = 1 << 28      # bytes of one block on CPU
MIN_BUDGET = 1 << 24
# kernels one block of select_topk launches at most (its block body; a bf16 padded batch, 26, the most; counted by
# tests/test_dsa_memory.py), and once a layer (the index filled with -1, the key positions, ...)
LAUNCHES_PER_BLOCK = 26
LAUNCHES_PER_LAYER = 8


def pair_bytes(heads: int) -> int:
    """Bytes one (query, key) pair of a block holds at its peak: the per-head fp32 scores, their fp32 sum and
    the mask; after the scores are freed, the tie keys (fp32 copy, int32 bits, int64 key) fit in that."""
    return max(4 * heads + 8, 32)


@dataclass
class KeyRanges:
    """Which keys each query may see. Queries are ``rows x width`` activation rows (``[rows, width, ..]``: padded
    ``[S, B]``, packed ``[T, 1]``, a rank's ``[rows, width]`` under context parallelism), keys ``key_rows x width``
    likewise (the whole sequence's under context parallelism, in global order). Query ``(r, w)`` sees key ``(g, w)``
    iff ``lo[r] <= g <= hi[r]`` and ``real[g, w]`` (None: every key real). ``lo`` / ``hi``: int64 CPU tensors
    ``[rows]`` (:meth:`bounds`: their device copies, made once). ``longest``: the most keys any query can see, an
    upper bound (a batch with ``longest <= topk`` selects every visible key: dense attention)."""
    width: int
    lo: torch.Tensor
    hi: torch.Tensor
    key_rows: int
    real: torch.Tensor | None
    longest: int
    _on: dict = field(default_factory=dict, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    def unreal(self, device) -> torch.Tensor | None:
        """``~real`` ``[width, key_rows]`` on ``device`` (the keys no query sees), made once; None: every key
        real."""
        if self.real is None:
            return None
        key = ("unreal", str(device))
        if key not in self._on:
            self._on[key] = (~self.real).transpose(0, 1).contiguous().to(device)
        return self._on[key]

    @property
    def rows(self) -> int:
        return int(self.lo.numel())

    def bounds(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` on ``device``, copied there once per batch."""
        key = str(device)
        if key not in self._on:
            self._on[key] = (self.lo.to(device), self.hi.to(device))
        return self._on[key]

    def budget(self, device, fixed: int | None = None) -> int:
        """:func:`score_budget` of ``device``, measured once per batch (every layer then plans alike)."""
        if fixed is not None:
            return score_budget(device, fixed)
        key = ("budget", str(device))
        if key not in self._on:
            self._on[key] = score_budget(device)
        return self._on[key]

    def plan(self, row0: int, rows: int, pair_bytes: int, budget: int) -> list[tuple[int, int, int, int]]:
        """:func:`plan_blocks` of queries ``row0 .. row0 + rows - 1``, made once per batch (every layer of the
        batch uses it)."""
        key = (row0, rows, pair_bytes, budget)
        if key not in self._plans:
            self._plans[key] = plan_blocks(self.lo[row0:row0 + rows].numpy(), self.hi[row0:row0 + rows].numpy(),
                                           pair_bytes * self.width, budget)
        return self._plans[key]


def _ranges_of_pieces(split) -> tuple[torch.Tensor, torch.Tensor]:
    """Per local row of a :class:`ContextSplit`: the first and last key row (global order) it sees, from its
    pieces (full pieces: every key; the causal diagonal: up to the query's own). Rows that see nothing: lo 0,
    hi -1."""
    lo = torch.full((split.rows,), torch.iinfo(torch.long).max, dtype=torch.long)
    hi = torch.full((split.rows,), -1, dtype=torch.long)
    for p in split.pieces:
        last = (p.k0 + torch.arange(p.q1 - p.q0) + p.diag).clamp(max=p.k1 - 1)
        sees = last >= p.k0
        lo[p.q0:p.q1] = torch.where(sees, lo[p.q0:p.q1].clamp(max=p.k0), lo[p.q0:p.q1])
        hi[p.q0:p.q1] = torch.where(sees, torch.maximum(hi[p.q0:p.q1], last), hi[p.q0:p.q1])
    return lo.masked_fill(hi < 0, 0), hi


def key_ranges(ctx) -> KeyRanges:
    """The :class:`KeyRanges` of a layer context (made once per batch and kept on it): a :class:`PaddedRows`
    (causal within each row, real keys only), a :class:`Packing` (causal within each document of the stream) or
    a :class:`parallm.model.context_parallel.ContextSplit`."""
    cached = getattr(ctx, "_dsa_ranges", None)
    if cached is not None:
        return cached
    if isinstance(ctx, PaddedRows):
        b, s = ctx.keep.shape
        real = None if ctx.full else ctx.keep.transpose(0, 1).contiguous()
        out = KeyRanges(width=b, lo=torch.zeros(s, dtype=torch.long), hi=torch.arange(s), key_rows=s, real=real,
                        longest=s)
    elif isinstance(ctx, Packing):
        cu = ctx.cu_seqlens.to(device="cpu", dtype=torch.long)
        lo = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        out = KeyRanges(width=1, lo=lo, hi=torch.arange(ctx.total), key_rows=ctx.total, real=None,
                        longest=ctx.max_seqlen)
    elif hasattr(ctx, "pieces") and hasattr(ctx, "order"):        # a ContextSplit
        lo, hi = _ranges_of_pieces(ctx)
        longest = max((2 * ctx.cp * c for _, c in ctx.segments), default=0)
        out = KeyRanges(width=ctx.width, lo=lo, hi=hi, key_rows=ctx.cp * ctx.rows, real=None, longest=longest)
    else:
        raise TypeError(f"sparse attention needs a PaddedRows, Packing or ContextSplit context, got "
                        f"{type(ctx).__name__}")
    ctx._dsa_ranges = out
    return out


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, IndexError):
        raise ValueError(f"{BUDGET_ENV}={text!r}: give bytes, e.g. 8G, 512M or 1073741824") from None


def score_budget(device, fixed: int | None = None, *, free: int | None = None) -> int:
    """Bytes one block of the indexer may take: ``fixed`` if given, else ``PARALLM_INDEXER_MEMORY``, else on CUDA
    half of the device's free memory (``free``: that amount, else ``cudaMemGetInfo`` plus what PyTorch's
    allocator holds unused) and :data:`CPU_BUDGET` elsewhere; at least :data:`MIN_BUDGET`."""
    if fixed is not None:
        return int(fixed)
    if os.environ.get(BUDGET_ENV):
        return _parse_bytes(os.environ[BUDGET_ENV])
    dev = torch.device(device)
    if free is None and dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return max(MIN_BUDGET, free // 2 if free is not None else CPU_BUDGET)


def plan_blocks(lo: np.ndarray, hi: np.ndarray, pair_bytes: int, budget: int) -> list[tuple[int, int, int, int]]:
    """Blocks ``(a, e, k0, k1)`` of consecutive queries ``[a, e)`` (indices into ``lo`` / ``hi``) and the window of
    keys ``[k0, k1)`` they see together, each at most ``budget`` bytes at ``pair_bytes`` a (query, key) pair
    (at least one query a block). Greedy, one step per block: each block's end is found by a search doubling
    its look-ahead over the running min of ``lo`` and max of ``hi``, not query by query."""
    n = len(lo)
    blocks = []
    a, ahead = 0, 64
    while a < n:
        while True:
            end = min(n, a + ahead)
            k0 = np.minimum.accumulate(lo[a:end])
            top = np.maximum.accumulate(hi[a:end])
            cost = np.arange(1, end - a + 1) * np.maximum(top + 1 - k0, 0) * pair_bytes
            fits = int(np.searchsorted(cost > budget, True))       # cost is non-decreasing: the first over
            if fits < end - a or end == n:
                break
            ahead *= 2
        m = max(1, fits)
        blocks.append((a, a + m, int(k0[m - 1]), int(top[m - 1]) + 1))
        a += m
        ahead = max(64, 2 * m)
    return blocks


def plan_launches(blocks) -> int:
    """The kernels the indexer launches for one layer with this plan (see :data:`LAUNCHES_PER_BLOCK`)."""
    return LAUNCHES_PER_LAYER + LAUNCHES_PER_BLOCK * len(blocks)
