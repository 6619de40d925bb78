"""The pure transforms between full HF tensors and one tensor-parallel rank's shard: :class:`Source` (read access
to one full HF tensor, in memory or in a safetensors file), ``shard_*`` (cut a shard reading only its slice) and
``merge_*`` (rebuild the HF tensors bit-exactly from every rank's shard: ``merge(split(x)) == x``). The layout kinds
that name them are :mod:`parallm.model.sharding`. No torch.distributed here."""

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
        if not self.shape:                  # a 0-d tensor: read(0, 0, 1) is its one element as [1]
            return self.read(0, 0, 1).reshape(())
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
        t = self.tensor if self.tensor.dim() else self.tensor.reshape(1)     # 0-d: one element, as [1]
        return t.narrow(dim, start, stop - start)

    def full(self):
        return self.tensor


class SlabSource(Source):
    """Rows block ``part`` of ``parts`` equal blocks of ``base[index]`` (one expert's slab of a fused
    ``[E, rows, cols]`` tensor), read through ``base`` without copying: only the bytes a reader copies are
    touched."""

    def __init__(self, base: Source, index: int, part: int = 0, parts: int = 1):
        rows = base.shape[1] // parts
        self.base, self.index, self.start, self.rows = base, index, part * rows, rows
        self.shape = (rows,) + tuple(base.shape[2:])
        self.dtype = getattr(base, "dtype", None)

    @property
    def is_floating(self) -> bool:
        return self.base.is_floating

    def read(self, dim, start, stop):
        if self.start == 0 and self.rows == self.base.shape[1] and hasattr(self.base, "read_slab"):
            return self.base.read_slab(self.index, dim, start, stop)     # only those rows / columns (MXFP4)
        slab = self.base.read(0, self.index, self.index + 1)[0].narrow(0, self.start, self.rows)
        return slab.narrow(dim, start, stop - start)


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


def shard_qkv(q, k, v, rank: int, tp: int, *, num_heads: int, num_kv_heads: int, head_dim: int,
              q_head_dim: int | None = None) -> torch.Tensor:
    """``[q_r; k_r; v_r]`` along dim 0 (weights ``[out, in]`` and biases ``[out]`` alike). ``q_head_dim``: q's
    rows per head when not ``head_dim`` (an output-gated q_proj's ``[q_h; gate_h]``: 2 head_dim)."""
    q, k, v = _as_source(q), _as_source(k), _as_source(v)
    qa, qb = _split_range(num_heads, rank, tp, "query heads")
    kv = kv_heads_of_rank(rank, tp, num_kv_heads)
    qd = q_head_dim or head_dim
    parts = [q.read(0, qa * qd, qb * qd),
             k.read(0, kv.start * head_dim, kv.stop * head_dim),
             v.read(0, kv.start * head_dim, kv.stop * head_dim)]
    return torch.cat(parts, dim=0)


def merge_qkv(shards: list[torch.Tensor], *, num_heads: int, num_kv_heads: int, head_dim: int,
              q_head_dim: int | None = None):
    """Inverse of :func:`shard_qkv`: (q, k, v). Replicated KV heads are taken from the first rank holding them."""
    tp = len(shards)
    hq = num_heads // tp * (q_head_dim or head_dim)
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
