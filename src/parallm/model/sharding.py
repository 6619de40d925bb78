"""How a weight is laid out over tensor-parallel ranks: the layout kinds (:data:`KINDS`) that map a parameter's
HF source tensors onto each TP rank's shard, built on the pure transforms of :mod:`parallm.model.shard_ops`
(re-exported here) (no torch.distributed here).

``shard_*`` functions read their inputs only through :class:`Source` (``shape`` and ``read(dim, start, stop)``),
so the same code cuts a shard from an in-memory tensor or reads just that slice from a safetensors file.
``merge_*`` functions take the list of every TP rank's shard (in TP-rank order) and rebuild the HF tensors
bit-exactly: ``merge(split(x)) == x``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from .shard_ops import (SlabSource, Source, TensorSource, _as_source, _split_range, kv_heads_of_rank,  # noqa: F401
                        merge_dim, merge_gate_up, merge_qkv, merge_vocab, shard_copy, shard_dim, shard_gate_up,
                        shard_qkv, shard_vocab)


# -- where each piece of a shard lives in the HF tensors ------------------------------------------------------

class Block(NamedTuple):
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[hf_start, hf_stop)`` of HF source ``source`` (an index into the
    layout's sources) are rows / columns ``[local_start, local_stop)`` of this rank's shard (along the same dim).
    ``primary`` is False for a replica another rank also holds (replicated tensors, replicated KV heads), so
    exactly one rank writes each HF element."""

    source: int
    dim: int
    hf_start: int
    hf_stop: int
    local_start: int
    local_stop: int
    primary: bool = True



# -- layout kinds ---------------------------------------------------------------------------------------------

class TPLayout(ABC):
    """One layout kind: how a parameter's HF source tensors map onto the shard of each TP rank.

    ``shard`` cuts TP rank ``rank``'s shard from the sources, ``merge`` rebuilds the sources from every rank's
    shard (``merge(shard(x)) == x`` bit for bit), ``blocks`` says the same as data (which HF slices make up the
    shard: what slice loading and the parallel save read and write), ``primary_slices`` which parts of the
    shard this rank is the one owner of (each element of the unsharded model counted once: grad norms), and
    ``replica_rows`` which rows of the shard other TP ranks hold too as partial-gradient copies (replicated KV
    heads). ``tp_dim`` / ``stride`` are megatron-core's ``partition_dim`` / ``partition_stride`` (None:
    replicated over TP).
    """

    name = ""
    sources = 1
    tp_dim: int | None = None
    stride = 1

    @abstractmethod
    def shard(self, sources: list, rank: int, tp: int) -> torch.Tensor:
        """Every layout kind states this (abstract)."""

    @abstractmethod
    def merge(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layout kind states this (abstract)."""

    @abstractmethod
    def blocks(self, rank: int, tp: int, hf_shapes: list[tuple[int, ...]]) -> list[Block]:
        """Every layout kind states this (abstract)."""

    def shard_shape(self, rank: int, tp: int, hf_shapes) -> tuple[int, ...]:
        """The shape of TP rank ``rank``'s shard, from HF shapes alone (cut on the meta device: no data)."""
        metas = [TensorSource(torch.empty(s, device="meta")) for s in hf_shapes]
        return tuple(self.shard(metas, rank, tp).shape)

    def primary_slices(self, rank: int, tp: int, local_shape) -> list[tuple[int, int, int]]:
        """``(dim, start, stop)`` slices of this rank's shard that no other TP rank also counts."""
        return [(0, 0, local_shape[0])] if local_shape else []

    def replica_rows(self, rank: int, tp: int) -> tuple[int, int] | None:
        return None

    def __repr__(self):
        return f"{type(self).__name__}()"


class Replicated(TPLayout):
    """The same full tensor on every TP rank (norms, biases of row-parallel layers, the value head)."""
    name = "copy"

    def shard(self, sources, rank, tp):
        return _as_source(sources[0]).full()

    def merge(self, shards):
        return [shards[0]]

    def blocks(self, rank, tp, hf_shapes):
        n = hf_shapes[0][0] if hf_shapes[0] else 1         # a 0-d tensor: one element (read / written as [1])
        return [Block(0, 0, 0, n, 0, n, primary=rank == 0)]

    def primary_slices(self, rank, tp, local_shape):
        return [(0, 0, local_shape[0])] if rank == 0 and local_shape else []


class Split(TPLayout):
    """Equal contiguous pieces along ``dim``: 0 for column-parallel outputs, 1 for row-parallel inputs."""

    def __init__(self, dim: int):
        self.tp_dim = dim
        self.name = "column" if dim == 0 else "row"

    def shard(self, sources, rank, tp):
        return shard_dim(sources[0], self.tp_dim, rank, tp)

    def merge(self, shards):
        return [merge_dim(shards, self.tp_dim)]

    def blocks(self, rank, tp, hf_shapes):
        dim = self.tp_dim
        a, b = _split_range(hf_shapes[0][dim], rank, tp, f"split along dim {dim}")
        return [Block(0, dim, a, b, 0, b - a)]

    def __repr__(self):
        return f"Split(dim={self.tp_dim})"


class VocabSplit(TPLayout):
    """Rows of the vocabulary padded with zero rows to ``padded`` (a multiple of tp), split along dim 0. The
    padding rows belong to no HF tensor: never written, never counted."""
    name = "vocab"
    tp_dim = 0

    def __init__(self, vocab: int, padded: int):
        self.vocab, self.padded = vocab, padded

    def shard(self, sources, rank, tp):
        return shard_vocab(sources[0], rank, tp, self.padded)

    def merge(self, shards):
        return [merge_vocab(shards, self.vocab)]

    def _real_rows(self, rank, tp):
        per = self.padded // tp
        return rank * per, max(0, min(per, self.vocab - rank * per))

    def blocks(self, rank, tp, hf_shapes):
        a, real = self._real_rows(rank, tp)
        return [Block(0, 0, a, a + real, 0, real)] if real else []

    def primary_slices(self, rank, tp, local_shape):
        _, real = self._real_rows(rank, tp)
        return [(0, 0, real)] if real else []

    def __repr__(self):
        return f"VocabSplit(vocab={self.vocab}, padded={self.padded})"


class QKVSplit(TPLayout):
    """Three HF tensors (q, k, v) fused per rank as ``[q_r; k_r; v_r]`` along dim 0: rank r's query heads, then
    the KV heads they use. With fewer KV heads than ranks each rank holds one KV head, replicated over
    ``tp / nkv`` ranks (the first of them is its primary holder)."""
    name = "qkv"
    sources = 3
    tp_dim = 0

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, q_head_dim: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_head_dim = q_head_dim or head_dim     # q's rows per head (2 head_dim with an output gate)

    def _kw(self):
        return dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    q_head_dim=self.q_head_dim)

    def shard(self, sources, rank, tp):
        return shard_qkv(*sources, rank, tp, **self._kw())

    def merge(self, shards):
        return list(merge_qkv(shards, **self._kw()))

    def _rows(self, rank, tp):
        qa, qb = _split_range(self.num_heads, rank, tp, "query heads")
        kv = kv_heads_of_rank(rank, tp, self.num_kv_heads)
        first_holder = self.num_kv_heads >= tp or rank % (tp // self.num_kv_heads) == 0
        return qa, qb, kv, first_holder

    def blocks(self, rank, tp, hf_shapes):
        d, qd = self.head_dim, self.q_head_dim
        qa, qb, kv, first = self._rows(rank, tp)
        nq, nkv = (qb - qa) * qd, len(kv) * d
        return [Block(0, 0, qa * qd, qb * qd, 0, nq),
                Block(1, 0, kv.start * d, kv.stop * d, nq, nq + nkv, primary=first),
                Block(2, 0, kv.start * d, kv.stop * d, nq + nkv, nq + 2 * nkv, primary=first)]

    def primary_slices(self, rank, tp, local_shape):
        qa, qb, _, first = self._rows(rank, tp)
        return [(0, 0, local_shape[0] if first else (qb - qa) * self.q_head_dim)]

    def replica_rows(self, rank, tp):
        if self.num_kv_heads >= tp:
            return None
        nq = self.num_heads // tp * self.q_head_dim
        return nq, nq + 2 * self.head_dim

    def __repr__(self):
        gate = f", q_head_dim={self.q_head_dim}" if self.q_head_dim != self.head_dim else ""
        return f"QKVSplit(heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{gate})"


class QKSplit(QKVSplit):
    """K = V (Gemma 4's full layers with ``attention_k_eq_v``): two HF tensors (q, k) fused per rank as
    ``[q_r; k_r]``, the KV heads split (or replicated) as :class:`QKVSplit`'s; the values are the keys'
    projection, so there is no v block."""
    name = "qk"
    sources = 2

    def shard(self, sources, rank, tp):
        q, k = sources
        full = shard_qkv(q, k, k, rank, tp, **self._kw())
        return full[:full.shape[0] - len(kv_heads_of_rank(rank, tp, self.num_kv_heads)) * self.head_dim]

    def merge(self, shards):
        tp = len(shards)
        rows = len(kv_heads_of_rank(0, tp, self.num_kv_heads)) * self.head_dim
        q, k, _ = merge_qkv([torch.cat([s, s[s.shape[0] - rows:]]) for s in shards], **self._kw())
        return [q, k]

    def blocks(self, rank, tp, hf_shapes):
        return super().blocks(rank, tp, hf_shapes)[:2]

    def replica_rows(self, rank, tp):
        if self.num_kv_heads >= tp:
            return None
        nq = self.num_heads // tp * self.q_head_dim
        return nq, nq + self.head_dim

    def __repr__(self):
        return f"QKSplit(heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"


class KVHeadSplit(TPLayout):
    """One HF tensor whose rows are the KV heads (``[num_kv_heads * head_dim, ...]``), split as the fused QKV's k
    rows: rank r holds the KV heads its query heads use; with fewer KV heads than ranks each rank holds one,
    replicated over ``tp / nkv`` ranks (the first of them its primary holder; the others' gradient is a partial
    sum: ``replica_rows``). MiniMax-M2's projection-wide ``k_norm.weight``."""
    name = "kv_heads"
    tp_dim = 0

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def _first(self, rank, tp):
        return self.num_kv_heads >= tp or rank % (tp // self.num_kv_heads) == 0

    def shard(self, sources, rank, tp):
        kv, d = kv_heads_of_rank(rank, tp, self.num_kv_heads), self.head_dim
        return _as_source(sources[0]).read(0, kv.start * d, kv.stop * d)

    def merge(self, shards):
        tp, out, seen = len(shards), [], set()
        for rank, s in enumerate(shards):
            heads = kv_heads_of_rank(rank, tp, self.num_kv_heads)
            if heads.start not in seen:
                seen.add(heads.start)
                out.append(s)
        return [torch.cat(out, 0)]

    def blocks(self, rank, tp, hf_shapes):
        kv, d = kv_heads_of_rank(rank, tp, self.num_kv_heads), self.head_dim
        return [Block(0, 0, kv.start * d, kv.stop * d, 0, len(kv) * d, primary=self._first(rank, tp))]

    def primary_slices(self, rank, tp, local_shape):
        return [(0, 0, local_shape[0])] if self._first(rank, tp) and local_shape else []

    def replica_rows(self, rank, tp):
        return None if self.num_kv_heads >= tp else (0, self.head_dim)

    def __repr__(self):
        return f"KVHeadSplit(kv_heads={self.num_kv_heads}, head_dim={self.head_dim})"


class GateUpSplit(TPLayout):
    """Two HF tensors (gate, up) fused per rank as ``[gate_r; up_r]`` along dim 0 (megatron-core's stride 2)."""
    name = "gate_up"
    sources = 2
    tp_dim = 0
    stride = 2

    def shard(self, sources, rank, tp):
        return shard_gate_up(*sources, rank, tp)

    def merge(self, shards):
        return list(merge_gate_up(shards))

    def blocks(self, rank, tp, hf_shapes):
        a, b = _split_range(hf_shapes[0][0], rank, tp, "gate/up")
        return [Block(0, 0, a, b, 0, b - a), Block(1, 0, a, b, b - a, 2 * (b - a))]


class PartsSplit(TPLayout):
    """One HF tensor whose dim 0 is consecutive parts (``sizes``), each split evenly over TP, fused per rank as
    ``[part0_r; part1_r; ...]``: a Gated DeltaNet's ``[q; k; v]`` (``in_proj_qkv``, the conv's channels) split by
    heads. The caller makes each part a whole number of heads per rank (``check_tp``)."""
    name = "parts"
    tp_dim = 0

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = tuple(sizes)

    def _ranges(self, rank, tp):
        out, at = [], 0
        for size in self.sizes:
            a, b = _split_range(size, rank, tp, f"part of {size} rows")
            out.append((at + a, at + b))
            at += size
        return out

    def shard(self, sources, rank, tp):
        src = _as_source(sources[0])
        return torch.cat([src.read(0, a, b) for a, b in self._ranges(rank, tp)], dim=0)

    def merge(self, shards):
        tp = len(shards)
        pieces = [s.split([size // tp for size in self.sizes], dim=0) for s in shards]
        return [torch.cat([p[j] for j in range(len(self.sizes)) for p in pieces], dim=0)]

    def blocks(self, rank, tp, hf_shapes):
        out, local = [], 0
        for a, b in self._ranges(rank, tp):
            out.append(Block(0, 0, a, b, local, local + b - a))
            local += b - a
        return out

    def __repr__(self):
        return f"PartsSplit(sizes={self.sizes})"


class FusedSplit(TPLayout):
    """Several HF tensors, each split along dim 0 by its own layout (``parts``: ``(layout, hf_rows)`` per source,
    layouts without replicas), fused per rank as ``[s0_r; s1_r; ...]``: a Gated DeltaNet's one column-parallel
    input projection (Qwen3.5: ``in_proj_qkv`` by heads, ``in_proj_z`` / ``_b`` / ``_a``; Qwen3-Next:
    ``in_proj_qkvz`` / ``in_proj_ba``, plain splits of rows grouped by key head)."""
    name = "fused"
    tp_dim = 0

    def __init__(self, parts):
        self.parts = tuple(parts)
        self.sources = len(self.parts)

    def shard(self, sources, rank, tp):
        return torch.cat([layout.shard([src], rank, tp) for (layout, _), src in zip(self.parts, sources)], dim=0)

    def merge(self, shards):
        tp = len(shards)
        pieces = [s.split([rows // tp for _, rows in self.parts], dim=0) for s in shards]
        return [layout.merge([p[j] for p in pieces])[0] for j, (layout, _) in enumerate(self.parts)]

    def blocks(self, rank, tp, hf_shapes):
        out, local = [], 0
        for j, ((layout, rows), shape) in enumerate(zip(self.parts, hf_shapes)):
            for blk in layout.blocks(rank, tp, [shape]):
                out.append(blk._replace(source=j, local_start=local + blk.local_start,
                                        local_stop=local + blk.local_stop))
            local += rows // tp
        return out

    def __repr__(self):
        return f"FusedSplit({[layout for layout, _ in self.parts]!r})"


def _gdn_in(spec):
    """A Gated DeltaNet's fused input projection: Qwen3.5's four tensors or Qwen3-Next's two."""
    h = spec.gdn_value_heads
    if spec.linear_attn is not None and spec.linear_attn.interleaved:
        return FusedSplit([(Split(0), spec.gdn_qkvz_size), (Split(0), spec.gdn_ba_size)])
    qkv = PartsSplit((spec.gdn_key_dim, spec.gdn_key_dim, spec.gdn_value_dim))
    return FusedSplit([(qkv, spec.gdn_conv_dim), (Split(0), spec.gdn_value_dim), (Split(0), h), (Split(0), h)])


class ExpertStack(TPLayout):
    """Routed experts stacked along a new leading dim: ``shard[x]`` is local expert x's shard in the per-expert
    layout ``inner`` (``GateUpSplit`` for ``[gate_r; up_r]``: ``[E_local, 2 I / tp, H]``; ``Split(1)`` for
    down: ``[E_local, H, I / tp]``). The sources are the experts' HF tensors one expert after the other:
    source ``k`` is source ``k % inner.sources`` of local expert ``k // inner.sources``, and each of the
    :meth:`blocks` of that source lies in ``shard[k // inner.sources]`` (its dim and local range are those of
    the expert's own 2-D shard). With a TP-split ``inner`` no piece is replicated over TP, so every rank is the
    one owner of its whole shard; a :class:`Replicated` ``inner`` (gpt-oss's per-expert down-projection bias
    ``[E_local, H]``, added once after the row-parallel sum) is held whole on every TP rank and TP rank 0 owns it.
    megatron-core's ``partition_dim`` is the inner split's, one further out (None: not split)."""
    name = "experts"

    def __init__(self, inner: TPLayout, count: int):
        if inner.tp_dim is None and not isinstance(inner, Replicated):
            raise ValueError(f"stacked experts need a TP-split or replicated per-expert layout, got {inner!r}")
        self.inner, self.count = inner, count
        self.sources = inner.sources * count
        self.tp_dim = None if inner.tp_dim is None else inner.tp_dim + 1
        self.stride = inner.stride

    def _per_expert(self, items) -> list[list]:
        n = self.inner.sources
        if len(items) != self.sources:
            raise ValueError(f"{self!r}: {self.sources} sources expected, got {len(items)}")
        return [list(items[x * n:(x + 1) * n]) for x in range(self.count)]

    def shard(self, sources, rank, tp):
        return torch.stack([self.inner.shard(s, rank, tp) for s in self._per_expert(sources)])

    def merge(self, shards):
        return [t for x in range(self.count) for t in self.inner.merge([s[x] for s in shards])]

    def blocks(self, rank, tp, hf_shapes):
        n = self.inner.sources
        return [b._replace(source=x * n + b.source)
                for x, shapes in enumerate(self._per_expert(list(hf_shapes)))
                for b in self.inner.blocks(rank, tp, shapes)]

    def primary_slices(self, rank, tp, local_shape):
        if self.tp_dim is None and rank != 0:
            return []
        return [(0, 0, local_shape[0])] if local_shape else []

    def __repr__(self):
        return f"ExpertStack({self.inner!r}, count={self.count})"


# Layout kind names (as weight-table rows write them) -> constructor from the model spec and padded vocab.
KINDS = {
    "copy": lambda spec, padded_vocab: Replicated(),
    "column": lambda spec, padded_vocab: Split(0),
    "row": lambda spec, padded_vocab: Split(1),
    "vocab": lambda spec, padded_vocab: VocabSplit(spec.vocab_size, padded_vocab),
    "qkv": lambda spec, padded_vocab: QKVSplit(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                               spec.head_dim * (2 if getattr(spec, "attn_output_gate", False)
                                                                else 1)),
    # Gemma 4's full-attention layers: their own head dim and KV-head count (spec.global_layers)
    "qkv_global": lambda spec, padded_vocab: QKVSplit(spec.num_heads, spec.global_kv_heads, spec.global_head_dim),
    # and with K = V (attention_k_eq_v) only q and k
    "qk_global": lambda spec, padded_vocab: QKSplit(spec.num_heads, spec.global_kv_heads, spec.global_head_dim),
    "gate_up": lambda spec, padded_vocab: GateUpSplit(),
    # one HF tensor [gate; up] (a routed expert's slab of Gemma 4's experts.gate_up_proj), per rank [gate_r; up_r]
    "gate_up_rows": lambda spec, padded_vocab: PartsSplit((spec.moe.expert_intermediate_size,) * 2),
    "kv_heads": lambda spec, padded_vocab: KVHeadSplit(spec.num_kv_heads, spec.head_dim),
    # Gated DeltaNet: the conv's [q; k; v] channels split by heads, the fused input projection
    "gdn_conv": lambda spec, padded_vocab: PartsSplit((spec.gdn_key_dim, spec.gdn_key_dim, spec.gdn_value_dim)),
    "gdn_in": lambda spec, padded_vocab: _gdn_in(spec),
    # Mamba-2: in_proj's [z; x; B; C; dt] and the conv's [x; B; C] channels, each part split by heads / groups
    "mamba_in": lambda spec, padded_vocab: PartsSplit((spec.mamba.inner, spec.mamba.inner, spec.mamba.bc_size,
                                                       spec.mamba.bc_size, spec.mamba.num_heads)),
    "mamba_conv": lambda spec, padded_vocab: PartsSplit((spec.mamba.inner, spec.mamba.bc_size,
                                                         spec.mamba.bc_size)),
}


def make_layout(kind: str, spec, padded_vocab: int) -> TPLayout:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    return KINDS[kind](spec, padded_vocab)


def make_shard(kind: str, sources: list, rank: int, tp: int, spec, padded_vocab: int) -> torch.Tensor:
    return make_layout(kind, spec, padded_vocab).shard(sources, rank, tp)


def merge_shards(kind: str, shards: list[torch.Tensor], spec) -> list[torch.Tensor]:
    """Every TP rank's shard -> the HF tensors of the row (one per source name)."""
    return make_layout(kind, spec, 0).merge(shards)


def shard_blocks(kind: str, rank: int, tp: int, spec, hf_shapes: list[tuple[int, ...]],
                 padded_vocab: int) -> list[Block]:
    """The layout of :func:`make_shard` as data: which HF slices make up TP rank ``rank``'s shard."""
    return make_layout(kind, spec, padded_vocab).blocks(rank, tp, hf_shapes)
