"""Pieces of attention and the plans kernels run them from: a :class:`Piece` is a run of queries against a run of
keys with a band of visible pairs (context parallelism, sliding windows), clipped to a window; a
:class:`PiecePlan` holds the pieces of one kernel call over flat token tensors and what kernels derive from it
(the square tiles of :meth:`PiecePlan.tiles`), cached per microbatch and window. The kernels are
:mod:`parallm.model.layers.blocks`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Query rows ``[q0, q1)`` against key rows ``[k0, k1)``; query ``q0`` sits ``diag`` positions after key ``k0``
    in their sequence, so query ``q0 + i`` sees key ``k0 + j`` iff ``0 <= i + diag - j < window`` (causal, and
    within the sliding window: ``window`` keys, the query's own included, as transformers' sliding_window_overlay;
    no upper bound without a window). ``diag == 0`` with a square piece is the causal diagonal; ``diag >= k1 - k0``
    without a window: every key is visible."""
    q0: int
    q1: int
    k0: int
    k1: int
    diag: int

    @property
    def causal(self) -> bool:
        """The square causal diagonal (else, for the pieces of context parallelism without a window, every key of
        the piece is visible)."""
        return self.diag == 0


def clip_piece(p: Piece, window: int | None) -> Piece | None:
    """``p`` without the queries that see none of its keys and the keys no query sees (under ``window``); None
    when nothing is left: a piece wholly outside the window is dropped, not masked."""
    lq, lk = p.q1 - p.q0, p.k1 - p.k0
    i_lo = max(0, -p.diag)
    i_hi = lq if window is None else min(lq, lk - 1 + window - p.diag)
    if i_lo >= i_hi or lk <= 0:
        return None
    diag, n = p.diag + i_lo, i_hi - i_lo
    j_lo = 0 if window is None else max(0, diag - window + 1)
    j_hi = min(lk, diag + n)
    if j_lo >= j_hi:
        return None
    return Piece(p.q0 + i_lo, p.q0 + i_hi, p.k0 + j_lo, p.k0 + j_hi, diag - j_lo)


def _coalesce(pieces) -> list[Piece]:
    """Consecutive pieces of the same queries over adjacent keys of one run (a chunk's keys before it and its
    causal diagonal) as one piece: its band then ends at the bottom-right corner, where flash-attention's causal
    mask and window sit."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (last is not None and (last.q0, last.q1) == (p.q0, p.q1) and last.k1 == p.k0
                and last.diag == p.diag + (last.k1 - last.k0)):
            out[-1] = Piece(p.q0, p.q1, last.k0, p.k1, last.diag)
        else:
            out.append(p)
    return out


def _every_pair_visible(p: Piece, window: int | None) -> bool:
    return p.diag >= p.k1 - p.k0 - 1 and (window is None or p.q1 - p.q0 - 1 + p.diag < window)


MAX_TILE = 256                 # rows of a tile of the tile kernels (queries and keys)
TILE_BUDGET = 1 << 25          # score elements (tiles x heads x tile^2) one call of a tile kernel computes at most


@dataclass
class _Tiles:
    """A plan cut into square tiles of ``size`` rows: one row of ``specs`` per tile, ``[N, 6]`` long (first query
    row, first key row, query rows, key rows, the first query's position after the first key's, sequence index
    under ``width``); the first ``full`` tiles see every pair (no mask), the others a band. Indices and masks are
    made per call from these rows, so a long plan costs ``6 N`` integers, not ``N`` masks."""
    size: int
    specs: torch.Tensor
    full: int
    width: int
    window: int | None

    def groups(self, heads: int):
        """``(tiles, masked)`` slices of at most :data:`TILE_BUDGET` scores, full and banded tiles apart."""
        per = max(1, TILE_BUDGET // (self.size * self.size * heads))
        n = self.specs.shape[0]
        for lo, hi, masked in ((0, self.full, False), (self.full, n, True)):
            for a in range(lo, hi, per):
                yield slice(a, min(hi, a + per)), masked

    def build(self, g: slice, masked: bool):
        """Tiles ``g``: ``(q_index [m, T], k_index [m, T], mask, any_key [m, T])``: flat query / key rows (-1: none),
        the additive fp32 band ``[m, 1, T, T]`` (None for full tiles), whether each tile row sees a key."""
        qa, ka, tq, tk, d, w = self.specs[g].unbind(1)
        i = torch.arange(self.size, device=self.specs.device)
        q_in, k_in = i < tq[:, None], i < tk[:, None]
        q_index = torch.where(q_in, (qa[:, None] + i) * self.width + w[:, None], -1)
        k_index = torch.where(k_in, (ka[:, None] + i) * self.width + w[:, None], -1)
        if not masked:
            return q_index, k_index, None, q_in
        rel = d[:, None, None] + i[None, :, None] - i[None, None, :]
        visible = (rel >= 0) & q_in[:, :, None] & k_in[:, None, :]
        if self.window is not None:
            visible &= rel < self.window
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(
            ~visible, float("-inf")).unsqueeze(1)
        return q_index, k_index, mask, visible.any(-1)


class PiecePlan:
    """The pieces one kernel call covers, clipped to ``window`` (:func:`clip_piece`), over flat token tensors:
    ``width`` sequences side by side (the padded layout's batch rows: row ``r`` of sequence ``w`` is flat row
    ``r * width + w``; packed: 1). Kernels derive what they need from it once and keep it here (a plan is made
    once per microbatch and window, and read by every layer of that window, forward and backward)."""

    def __init__(self, pieces, *, width: int = 1, window: int | None = None):
        self.window = window
        self.width = width
        self.pieces = tuple(c for c in (clip_piece(p, window) for p in _coalesce(pieces)) if c is not None)
        self._cache: dict = {}

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def tiles(self, device) -> _Tiles:
        """Every piece cut into square tiles of at most :data:`MAX_TILE` rows (and no longer than the window,
        rounded up to a power of two), the tiles that see nothing left out (outside the window or after the
        queries): their area a small multiple of the pairs the pieces see (never the square of a sequence longer
        than the window). Tiles that see every pair run without a mask."""
        return self.cached(("tiles", str(device)), lambda: self._make_tiles(device))

    def _make_tiles(self, device) -> _Tiles:
        w = self.window
        longest = max((max(p.q1 - p.q0, p.k1 - p.k0) for p in self.pieces), default=1)
        # tiles no longer than the longest piece, nor than the window (a band of w keys then spans two tiles)
        t = min(MAX_TILE, 1 << (longest - 1).bit_length(), 1 << ((w or MAX_TILE) - 1).bit_length())
        full, banded = [], []
        for p in self.pieces:
            lq, lk = p.q1 - p.q0, p.k1 - p.k0
            for qa in range(0, lq, t):
                tq = min(t, lq - qa)
                for ka in range(0, lk, t):
                    tk = min(t, lk - ka)
                    d = p.diag + qa - ka
                    if d + tq - 1 < 0:          # every key after every query (and so for the keys further on)
                        break
                    if w is not None and d - (tk - 1) >= w:     # every key before the window
                        continue
                    every = tk == t and d - (tk - 1) >= 0 and (w is None or d + tq - 1 < w)
                    (full if every else banded).append((p.q0 + qa, p.k0 + ka, tq, tk, d))

        def per_sequence(rows):      # the tiles of each of the width sequences, the sequence as a sixth column
            x = torch.tensor(rows, dtype=torch.long).view(-1, 5)
            seq = torch.arange(self.width).repeat_interleave(x.shape[0])[:, None]
            return torch.cat([x.repeat(self.width, 1), seq], dim=1)

        specs = torch.cat([per_sequence(full), per_sequence(banded)])      # full tiles first
        return _Tiles(t, specs.to(device), len(full) * self.width, self.width, w)
