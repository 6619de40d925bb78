"""Pure layout transforms between full HF tensors and one TP rank's shard (no torch.distributed here).

``shard_*`` functions read their inputs only through :class:`Source` (``shape`` and ``read(dim, start, stop)``),
so the same code cuts a shard from an in-memory tensor or reads just that slice from a safetensors file.
``merge_*`` functions take the list of every TP rank's shard (in TP-rank order) and rebuild the HF tensors
bit-exactly: ``merge(split(x)) == x``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Source(ABC):
    """Read access to one full HF tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @abstractmethod
    def read(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows/columns ``[start, stop)`` along ``dim`` (all of every other dim)."""

    @property
    @abstractmethod
    def is_floating(self) -> bool:
        """Whether the stored dtype is a floating-point type (read from metadata, no data touched)."""

    def full(self) -> torch.Tensor:
        return self.read(0, 0, self.shape[0])


class TensorSource(Source):
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    @property
    def is_floating(self) -> bool:
        return self.tensor.is_floating_point()

    def read(self, dim, start, stop):
        return self.tensor.narrow(dim, start, stop - start)

    def full(self):
        return self.tensor


def _as_source(x) -> Source:
    return x if isinstance(x, Source) else TensorSource(x)


def _split_range(n: int, rank: int, tp: int, what: str) -> tuple[int, int]:
    if n % tp:
        raise ValueError(f"{what}: size {n} is not divisible by tp={tp}")
    per = n // tp
    return rank * per, (rank + 1) * per


# -- copy / column / row ---------------------------------------------------------------------------------------

def shard_copy(src, rank: int, tp: int) -> torch.Tensor:
    return _as_source(src).full()


def shard_dim(src, dim: int, rank: int, tp: int) -> torch.Tensor:
    src = _as_source(src)
    a, b = _split_range(src.shape[dim], rank, tp, f"split along dim {dim}")
    return src.read(dim, a, b)


def merge_dim(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(shards, dim=dim)


# -- vocab ----------------------------------------------------------------------------------------------------

def shard_vocab(src, rank: int, tp: int, padded_vocab: int) -> torch.Tensor:
    """Rows ``[rank*Vp/tp, (rank+1)*Vp/tp)`` of the vocabulary padded with zero rows to ``padded_vocab``."""
    src = _as_source(src)
    vocab = src.shape[0]
    if padded_vocab < vocab or padded_vocab % tp:
        raise ValueError(f"padded vocab {padded_vocab} must be >= {vocab} and divisible by tp={tp}")
    a, b = _split_range(padded_vocab, rank, tp, "padded vocab")
    real = src.read(0, min(a, vocab), min(b, vocab))
    if real.shape[0] == b - a:
        return real
    pad = torch.zeros((b - a - real.shape[0],) + tuple(src.shape[1:]), dtype=real.dtype, device=real.device)
    return torch.cat([real, pad], dim=0)


def merge_vocab(shards: list[torch.Tensor], vocab: int) -> torch.Tensor:
    return torch.cat(shards, dim=0)[:vocab]


# -- qkv ------------------------------------------------------------------------------------------------------

def kv_heads_of_rank(rank: int, tp: int, num_kv_heads: int) -> range:
    """KV heads held by TP rank ``rank``: a contiguous block when nkv >= tp, else the one head
    ``floor(rank * nkv / tp)`` (replicated over ``tp / nkv`` ranks)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


def shard_qkv(q, k, v, rank: int, tp: int, *, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[q_r; k_r; v_r]`` along dim 0 (weights ``[out, in]`` and biases ``[out]`` alike)."""
    q, k, v = _as_source(q), _as_source(k), _as_source(v)
    qa, qb = _split_range(num_heads, rank, tp, "query heads")
    kv = kv_heads_of_rank(rank, tp, num_kv_heads)
    parts = [q.read(0, qa * head_dim, qb * head_dim),
             k.read(0, kv.start * head_dim, kv.stop * head_dim),
             v.read(0, kv.start * head_dim, kv.stop * head_dim)]
    return torch.cat(parts, dim=0)


def merge_qkv(shards: list[torch.Tensor], *, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of :func:`shard_qkv`: (q, k, v). Replicated KV heads are taken from the first rank holding them."""
    tp = len(shards)
    hq = num_heads // tp * head_dim
    hkv = len(kv_heads_of_rank(0, tp, num_kv_heads)) * head_dim
    qs, ks, vs, seen = [], [], [], set()
    for rank, s in enumerate(shards):
        q, k, v = s.split([hq, hkv, hkv], dim=0)
        qs.append(q)
        heads = kv_heads_of_rank(rank, tp, num_kv_heads)
        if heads.start not in seen:
            seen.add(heads.start)
            ks.append(k)
            vs.append(v)
    return torch.cat(qs, 0), torch.cat(ks, 0), torch.cat(vs, 0)


# -- gate / up ------------------------------------------------------------------------------------------------

def shard_gate_up(gate, up, rank: int, tp: int) -> torch.Tensor:
    return torch.cat([shard_dim(gate, 0, rank, tp), shard_dim(up, 0, rank, tp)], dim=0)


def merge_gate_up(shards: list[torch.Tensor]):
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return torch.cat(gates, 0), torch.cat(ups, 0)


# -- dispatch by a row's kind ---------------------------------------------------------------------------------

def make_shard(kind: str, sources: list, rank: int, tp: int, spec, padded_vocab: int) -> torch.Tensor:
    if kind == "copy":
        return shard_copy(sources[0], rank, tp)
    if kind == "vocab":
        return shard_vocab(sources[0], rank, tp, padded_vocab)
    if kind == "column":
        return shard_dim(sources[0], 0, rank, tp)
    if kind == "row":
        return shard_dim(sources[0], 1, rank, tp)
    if kind == "qkv":
        return shard_qkv(*sources, rank, tp, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim)
    if kind == "gate_up":
        return shard_gate_up(*sources, rank, tp)
    raise ValueError(f"unknown kind {kind!r}")


def merge_shards(kind: str, shards: list[torch.Tensor], spec) -> list[torch.Tensor]:
    """Every TP rank's shard -> the HF tensors of the row (one per source name)."""
    if kind == "copy":
        return [shards[0]]
    if kind == "vocab":
        return [merge_vocab(shards, spec.vocab_size)]
    if kind == "column":
        return [merge_dim(shards, 0)]
    if kind == "row":
        return [merge_dim(shards, 1)]
    if kind == "qkv":
        return list(merge_qkv(shards, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                              head_dim=spec.head_dim))
    if kind == "gate_up":
        return list(merge_gate_up(shards))
    raise ValueError(f"unknown kind {kind!r}")


# -- where each piece of a shard lives in the HF tensors ------------------------------------------------------

class Block(tuple):
    """``(source, dim, hf_start, hf_stop, local_start, local_stop, primary)``: rows (dim 0) or columns (dim 1)
    ``[hf_start, hf_stop)`` of HF source ``source`` are rows / columns ``[local_start, local_stop)`` of this
    rank's shard (along the same dim). ``primary`` is False for a replica another rank also holds (replicated
    tensors, replicated KV heads), so exactly one rank writes each HF element."""

    __slots__ = ()

    def __new__(cls, source, dim, hf_start, hf_stop, local_start, local_stop, primary=True):
        return super().__new__(cls, (source, dim, hf_start, hf_stop, local_start, local_stop, primary))


def shard_blocks(kind: str, rank: int, tp: int, spec, hf_shapes: list[tuple[int, ...]],
                 padded_vocab: int) -> list[Block]:
    """The layout of :func:`make_shard` as data: which HF slices make up TP rank ``rank``'s shard."""
    if kind == "copy":
        n = hf_shapes[0][0]
        return [Block(0, 0, 0, n, 0, n, primary=rank == 0)]
    if kind == "vocab":
        per = padded_vocab // tp
        a = rank * per
        real = max(0, min(per, hf_shapes[0][0] - a))
        return [Block(0, 0, a, a + real, 0, real)] if real else []
    if kind in ("column", "row"):
        dim = 0 if kind == "column" else 1
        a, b = _split_range(hf_shapes[0][dim], rank, tp, f"split along dim {dim}")
        return [Block(0, dim, a, b, 0, b - a)]
    if kind == "gate_up":
        a, b = _split_range(hf_shapes[0][0], rank, tp, "gate/up")
        return [Block(0, 0, a, b, 0, b - a), Block(1, 0, a, b, b - a, 2 * (b - a))]
    if kind == "qkv":
        d = spec.head_dim
        qa, qb = _split_range(spec.num_heads, rank, tp, "query heads")
        kv = kv_heads_of_rank(rank, tp, spec.num_kv_heads)
        first_holder = spec.num_kv_heads >= tp or rank % (tp // spec.num_kv_heads) == 0
        nq, nkv = (qb - qa) * d, len(kv) * d
        return [Block(0, 0, qa * d, qb * d, 0, nq),
                Block(1, 0, kv.start * d, kv.stop * d, nq, nq + nkv, primary=first_holder),
                Block(2, 0, kv.start * d, kv.stop * d, nq + nkv, nq + 2 * nkv, primary=first_holder)]
    raise ValueError(f"unknown kind {kind!r}")
