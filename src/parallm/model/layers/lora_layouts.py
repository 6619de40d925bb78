"""The TP layouts of LoRA factors that no weight has: :class:`KVRows` (a k / v adapter's B rows as the fused QKV
holds them) and :class:`Stacked` (a rank's experts' factors stacked). Read by :mod:`.lora_plan`."""

from __future__ import annotations

import torch

from ..sharding import Block, TPLayout, _as_source, kv_heads_of_rank

__all__ = ["KVRows", "Stacked"]


class KVRows(TPLayout):
    """Rows of a ``k_proj`` / ``v_proj``-shaped tensor (``[nkv * d, ...]``) as the fused QKV holds its k (or v)
    part: rank r's KV heads (:func:`kv_heads_of_rank`), replicated over ``tp / nkv`` ranks when nkv < tp (the
    first of them is the primary holder; the others' gradient rows are partial sums: ``replica_rows``)."""
    name = "kv"
    tp_dim = 0

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.nkv, self.d = num_kv_heads, head_dim
        # read by finalize_grads / the grad buckets: which KV-head count's replica group sums these rows (Gemma 4's
        # global layers have their own count)
        self.num_kv_heads = num_kv_heads

    def _rows(self, rank, tp):
        kv = kv_heads_of_rank(rank, tp, self.nkv)
        first = self.nkv >= tp or rank % (tp // self.nkv) == 0
        return kv.start * self.d, kv.stop * self.d, first

    def shard(self, sources, rank, tp):
        a, b, _ = self._rows(rank, tp)
        return _as_source(sources[0]).read(0, a, b)

    def merge(self, shards):
        tp = len(shards)
        return [torch.cat([s for r, s in enumerate(shards) if self._rows(r, tp)[2]], dim=0)]

    def blocks(self, rank, tp, hf_shapes):
        a, b, first = self._rows(rank, tp)
        return [Block(0, 0, a, b, 0, b - a, primary=first)]

    def primary_slices(self, rank, tp, local_shape):
        return [(0, 0, local_shape[0])] if self._rows(rank, tp)[2] else []

    def replica_rows(self, rank, tp):
        if self.nkv >= tp:
            return None
        a, b, _ = self._rows(rank, tp)
        return 0, b - a


class Stacked(TPLayout):
    """A rank's experts' factors stacked along a new dim 0 (``shard[x]``: local expert x's factor in the
    per-expert layout ``inner``); unlike the weights' ``ExpertStack`` the inner layout may be replicated over TP
    (then only TP rank 0 counts it in norms)."""
    name = "stacked"

    def __init__(self, inner: TPLayout, count: int):
        self.inner, self.count = inner, count
        self.sources = inner.sources * count
        self.tp_dim = None if inner.tp_dim is None else inner.tp_dim + 1
        self.stride = inner.stride

    def shard(self, sources, rank, tp):
        n = self.inner.sources
        return torch.stack([self.inner.shard(sources[x * n:(x + 1) * n], rank, tp) for x in range(self.count)])

    def merge(self, shards):
        return [t for x in range(self.count) for t in self.inner.merge([s[x] for s in shards])]

    def blocks(self, rank, tp, hf_shapes):
        n = self.inner.sources
        return [b._replace(source=x * n + b.source) for x in range(self.count)
                for b in self.inner.blocks(rank, tp, hf_shapes[x * n:(x + 1) * n])]

    def primary_slices(self, rank, tp, local_shape):
        whole = self.inner.primary_slices(rank, tp, tuple(local_shape[1:]))
        return [(0, 0, local_shape[0])] if whole and local_shape else []
