"""Attention kernels behind one small registry: padded (a boolean mask over ``[B, S]``) and packed / varlen
(causal within each sequence of a packed token stream).

Backends (``build_model(..., attn_impl=...)``):

    sdpa        padded batches: ``scaled_dot_product_attention`` with a boolean mask; any device, any dtype.
    sdpa-loop   packed streams: SDPA (``is_causal=True``) per sequence; any device, any dtype (the CPU path).
    flash-attn  packed streams: ``flash_attn_varlen_func``; needs the flash-attn package, CUDA tensors and
                fp16 / bf16.

``attn_impl="auto"`` picks ``sdpa`` for padded models, and for packed ones ``flash-attn`` where it can run
(package importable, CUDA, half precision) and ``sdpa-loop`` otherwise. The choice is made once, at build,
kept as ``chunk.attn_impl``, logged, and shown by ``parallm inspect``. A new kernel is one :class:`AttnBackend`
entry in :data:`BACKENDS`.

Every backend takes the layer's sliding window (``window=``: query ``i`` sees keys ``i - window < j <= i``, as
transformers' masks). Attention that is not one causal run per sequence (context parallelism; a packed stream
under a window) goes through :class:`PiecePlan` and a :class:`BlockKernel` (:func:`block_kernel`: the CPU's fused
flash kernel over tiles, an explicit fp32 one, aten's varlen flash attention on CUDA), one call per plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ...parallel.state import as_device
from .blocks import BlockKernel, Piece, PiecePlan, attend_plan, block_kernel

try:  # optional CUDA kernel
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except Exception:  # noqa: BLE001 - not installed / no CUDA
    _flash_varlen = None


@dataclass
class Packing:
    """How a padded ``[B, S]`` batch maps to the packed token stream ``[T]``.

    ``indices``: flat positions (into B*S) of the real tokens, row by row; ``nnz`` of them. The stream is padded
    to ``total`` tokens (a multiple of tp under sequence parallelism); the padding forms its own segment.
    ``cu_seqlens``: segment boundaries in the stream (int32, starts with 0, ends with ``total``).
    """
    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    nnz: int
    total: int
    batch: int
    seq: int
    _plans: dict = field(default_factory=dict, repr=False)
    _cu_long: torch.Tensor | None = field(default=None, repr=False)

    def cu_long(self) -> torch.Tensor:
        """``cu_seqlens`` as int64, made once per batch: varlen kernels (fla) that cache their metadata by the
        tensor they are given then hit their cache in every layer."""
        if self._cu_long is None:
            self._cu_long = self.cu_seqlens.to(torch.long)
        return self._cu_long

    def window_plan(self, window: int) -> "PiecePlan":
        """Each segment attending to itself, causally within ``window`` (one piece per segment, cut to the
        window by the kernels' tiles: nothing outside it is computed); kept for the other layers."""
        if window not in self._plans:
            bounds = self.cu_seqlens.tolist()
            pieces = [Piece(a, b, a, b, 0) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            self._plans[window] = PiecePlan(pieces, window=window)
        return self._plans[window]


def make_packing(attention_mask: torch.Tensor, multiple: int = 1) -> Packing:
    b, s = attention_mask.shape
    flat = attention_mask.reshape(-1).bool()
    indices = flat.nonzero(as_tuple=False).squeeze(-1)
    lengths = attention_mask.bool().sum(-1)
    lengths = lengths[lengths > 0]
    nnz = int(indices.numel())
    total = -(-max(nnz, 1) // multiple) * multiple
    seg = lengths.tolist() + ([total - nnz] if total > nnz else [])
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32, device=attention_mask.device)
    cu[1:] = torch.tensor(seg, dtype=torch.int32, device=attention_mask.device).cumsum(0)
    return Packing(indices=indices, cu_seqlens=cu, max_seqlen=max(seg) if seg else 0, nnz=nnz, total=total,
                   batch=b, seq=s)


def pack_tokens(x: torch.Tensor, packing: Packing, fill=0) -> torch.Tensor:
    """``[B, S]`` -> ``[T]`` (real tokens in order, then ``fill`` up to ``total``)."""
    flat = x.reshape(-1)[packing.indices]
    if packing.total > packing.nnz:
        flat = torch.cat([flat, flat.new_full((packing.total - packing.nnz,), fill)])
    return flat


def unpack_tokens(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """``[T, ...]`` -> ``[S, B, ...]`` with zeros at padded positions (differentiable)."""
    rest = tuple(x.shape[1:])
    out = x.new_zeros((packing.batch * packing.seq,) + rest)
    out = out.index_put((packing.indices,), x[:packing.nnz])
    return out.reshape((packing.batch, packing.seq) + rest).transpose(0, 1)


class PaddedRows:
    """A padded batch's attention context: ``keep``, the ``[B, S]`` boolean real-token mask, from which each layer
    kind takes what it needs, built once per batch on first use: full causal attention the boolean
    ``[B, 1, S, S]`` mask (:meth:`mask`; None for a batch without padding: plain causal attention), sliding
    windows a :class:`PiecePlan` over the real tokens of each row (:meth:`window_plan`: no ``[S, S]`` tensor),
    linear attention ``keep`` and, on varlen kernels, each row's span of real tokens as one document
    (:meth:`spans`)."""

    def __init__(self, keep: torch.Tensor):
        self.keep = keep
        self.full = bool(keep.all())
        self._mask: torch.Tensor | None = None
        self._plans: dict[int, PiecePlan] = {}
        self._spans: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def mask(self) -> torch.Tensor | None:
        if self._mask is None and not self.full:
            self._mask = padded_attention_mask(self.keep)
        return self._mask

    def spans(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each row's tokens from its first real one to its last (holes included: transformers runs them) as the
        documents of a packed stream: ``(index [T] long, cu_seqlens [docs + 1] long, longest)``, ``index`` the
        stream's places in the ``[S, B]`` (s-major) activations, rows without real tokens left out. Made once per
        batch: every linear-attention layer reads the same tensors (fla's metadata caches hit)."""
        if self._spans is None:
            b, s = self.keep.shape
            pos = torch.arange(s, device=self.keep.device)
            real = self.keep.any(-1)
            first = torch.where(self.keep, pos, s).amin(-1)
            last = torch.where(self.keep, pos, -1).amax(-1)
            lengths = torch.where(real, last - first + 1, 0)
            rows = real.nonzero().squeeze(-1)
            within = torch.arange(int(lengths.max()) if b else 0, device=self.keep.device)
            take = within[None, :] < lengths[rows, None]                     # [docs, longest]
            index = ((first[rows, None] + within[None, :]) * b + rows[:, None])[take]
            cu = torch.cat([lengths.new_zeros(1), lengths[rows].cumsum(0)])
            self._spans = (index, cu, int(within.numel()))
        return self._spans

    def window_plan(self, window: int) -> "PiecePlan":
        if window not in self._plans:
            self._plans[window] = PiecePlan(_row_pieces(self.keep), window=window)
        return self._plans[window]


def padded_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` mask: causal, real keys only, and every query may see itself.

    The diagonal keeps rows of padded queries from being fully masked (which would give NaN that then leaks
    through 0 * NaN into real tokens); outputs at padded positions are meaningless and callers mask them.
    """
    b, s = attention_mask.shape
    device = attention_mask.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    allowed = allowed | torch.eye(s, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def _row_pieces(keep: torch.Tensor) -> list["Piece"]:
    """The pieces of a padded batch flattened row by row (``[B * S]``): every run of real tokens of a row against
    itself and the runs before it, ``diag`` their distance in the padded row (transformers counts a window by
    index in the padded row, holes included). A row without padding is one causal piece."""
    b, s = keep.shape
    flat = torch.cat([keep.new_zeros(b, 1), keep, keep.new_zeros(b, 1)], dim=1).to(torch.int8)
    edges = (flat[:, 1:] - flat[:, :-1]).nonzero().tolist()        # (row, start) on +1, (row, end) on -1
    runs: list[list[tuple[int, int]]] = [[] for _ in range(b)]
    for (row, a), (_, e) in zip(edges[0::2], edges[1::2]):
        runs[row].append((a, e))
    pieces = []
    for row, spans in enumerate(runs):
        base = row * s
        for i, (qa, qb) in enumerate(spans):
            for ka, kb in spans[:i + 1]:
                pieces.append(Piece(base + qa, base + qb, base + ka, base + kb, qa - ka))
    return pieces


@functools.lru_cache(maxsize=32)
def _full_rows_plan(b: int, s: int, window: int | None) -> "PiecePlan":
    """The window plan of ``b`` rows of ``s`` real tokens each (a batch without padding)."""
    return PiecePlan([Piece(r * s, (r + 1) * s, r * s, (r + 1) * s, 0) for r in range(b)], window=window)


def padded_attention(q, k, v, ctx, *, window: int | None = None, sink: torch.Tensor | None = None):
    """q: [B, hq, S, d]; k, v: [B, hkv, S, d] (grouped-query: hq a multiple of hkv); ``ctx``: a
    :class:`PaddedRows` (or its boolean ``[B, 1, S, S]`` mask), or None for a batch without padding: plain causal
    attention (``is_causal``), no S x S mask, which lets SDPA pick its flash / memory-efficient kernels.
    ``window``: sliding-window attention (query ``i`` sees keys ``i - window < j <= i``, by index in the padded
    row as transformers counts them). A window shorter than the row runs the real tokens of each row through a
    :class:`PiecePlan` (:func:`attend_plan`): memory linear in S, no ``[S, S]`` mask or band, only the band's
    tiles computed; queries at padded positions then give zeros (callers mask them). ``sink``: each head's
    attention-sink logit ``[hq]`` (gpt-oss; :func:`parallm.model.layers.blocks.add_sink`): always the plan
    path (SDPA has no sink)."""
    b, hq, s, d = q.shape
    windowed = window is not None and window < s
    if (windowed or sink is not None) and not isinstance(ctx, torch.Tensor):
        w = window if windowed else None
        plan = _full_rows_plan(b, s, w) if ctx is None or ctx.full else ctx.window_plan(w)
        flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
        return attend_plan(*flat, plan, sink=sink).view(b, s, hq, d).transpose(1, 2)
    if sink is not None:
        raise ValueError("attention sinks need a PaddedRows context (the plan path), not a [B, 1, S, S] mask")
    mask = ctx.mask() if isinstance(ctx, PaddedRows) else ctx       # None: no padding
    if window is not None and window < s:      # a caller's own [B, 1, S, S] mask: the band joins it
        band = window_band(s, window, q.device)
        mask = band if mask is None else mask & band
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=1.0 / math.sqrt(d), enable_gqa=k.shape[1] != q.shape[1])


def sdpa_loop_varlen(q, k, v, packing: Packing, *, window: int | None = None, sink: torch.Tensor | None = None):
    """q: [T, hq, d]; k, v: [T, hkv, d]. Causal attention within each segment of ``packing.cu_seqlens``: SDPA
    (``is_causal``) per segment. With a ``window`` shorter than the longest segment: every segment in one
    :class:`PiecePlan` through the device's block kernel (:func:`attend_plan`), its tiles covering the band
    only. With attention ``sink``s: always the plan (SDPA has none)."""
    if sink is not None or (window is not None and packing.max_seqlen > window):
        return attend_plan(q, k, v, packing.window_plan(window), sink=sink)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    bounds = packing.cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, L, d]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=1.0 / math.sqrt(d),
                                           enable_gqa=hkv != hq)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def flash_varlen(q, k, v, packing: Packing, *, window: int | None = None, sink: torch.Tensor | None = None):
    """flash-attn's varlen kernel; ``window``: its ``window_size=(window - 1, 0)`` (keys ``i - window < j <= i``).
    flash-attn's varlen kernel takes no attention sinks: with ``sink`` the plan through the device's block
    kernel (aten's flash attention, which returns the log-sum-exp the sink is merged with)."""
    if sink is not None:
        return attend_plan(q, k, v, packing.window_plan(window), sink=sink)
    cu = packing.cu_seqlens.to(device=q.device, dtype=torch.int32)
    extra = {} if window is None else {"window_size": (window - 1, 0)}
    return _flash_varlen(q, k, v, cu, cu, packing.max_seqlen, packing.max_seqlen, causal=True, **extra)


def window_band(s: int, window: int, device=None) -> torch.Tensor:
    """Boolean ``[s, s]``: query ``i`` sees key ``j`` iff ``i - window < j <= i`` (transformers' sliding-window
    causal mask)."""
    ones = torch.ones(s, s, dtype=torch.bool, device=device)
    return ones.tril() & ~ones.tril(-window)


@dataclass(frozen=True)
class AttnBackend:
    """One attention kernel: ``packed`` says which input it takes (a :class:`Packing` stream or a padded batch
    with a boolean mask) as ``fn(q, k, v, ctx, window=None, sink=None)`` (``window``: the layer's sliding
    window; ``sink``: per-head attention-sink logits); ``unavailable(device, dtype)`` returns why it cannot run
    there, or None; ``block``: its
    :class:`BlockKernel` for context parallelism (None: :func:`block_kernel`'s default for the device;
    a fused GPU kernel returning the log-sum-exp, such as flash-attn's, plugs in here)."""
    name: str
    packed: bool
    fn: Callable
    unavailable: Callable[[torch.device, torch.dtype], str | None] = lambda device, dtype: None
    block: BlockKernel | None = None
    kernels: tuple = ()     # a :func:`both_layouts` backend: its (padded, packed) pair

    def for_ctx(self, ctx) -> "AttnBackend":
        """The backend whose kernel runs for ``ctx``: this one, or the half of a :func:`both_layouts` pair that
        takes ``ctx``'s layout."""
        return self.kernels[isinstance(ctx, Packing)] if self.kernels else self


def _flash_unavailable(device, dtype):
    if _flash_varlen is None:
        return "the flash-attn package is not installed"
    if as_device(device).type != "cuda":
        return f"it needs CUDA tensors (the model is on {device})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it needs float16 / bfloat16 (the model is {dtype})"
    return None


BACKENDS: dict[str, AttnBackend] = {b.name: b for b in (
    AttnBackend("sdpa", packed=False, fn=padded_attention),
    AttnBackend("sdpa-loop", packed=True, fn=sdpa_loop_varlen),
    AttnBackend("flash-attn", packed=True, fn=flash_varlen, unavailable=_flash_unavailable),
)}
AUTO_ORDER = {False: ("sdpa",), True: ("flash-attn", "sdpa-loop")}


def both_layouts(padded: AttnBackend, packed: AttnBackend) -> AttnBackend:
    """One backend for a padded model that runs some batches through the packed path inside (the recurrent
    hybrids: :meth:`parallm.model.decoder.DecoderChunk.packs_inside`): ``fn`` calls ``packed``'s kernel for a
    :class:`Packing` and ``padded``'s otherwise; its ``name`` is ``"<padded>+<packed>"``."""
    def fn(q, k, v, ctx, **kw):
        return pair.for_ctx(ctx).fn(q, k, v, ctx, **kw)
    pair = AttnBackend(f"{padded.name}+{packed.name}", packed=False, fn=fn, block=packed.block,
                       kernels=(padded, packed))
    return pair


def resolve_attn_impl(attn_impl: str, *, packed: bool, device, dtype) -> AttnBackend:
    """The backend a model built with ``attn_impl`` (a name in :data:`BACKENDS` or "auto") runs; a name that
    does not fit the model (padded vs packed) or cannot run on its device / dtype is a ValueError saying why."""
    if attn_impl == "auto":
        for name in AUTO_ORDER[packed]:
            if BACKENDS[name].unavailable(device, dtype) is None:
                return BACKENDS[name]
    if attn_impl not in BACKENDS:
        raise ValueError(f"attn_impl must be 'auto' or one of {sorted(BACKENDS)}, got {attn_impl!r}")
    backend = BACKENDS[attn_impl]
    if backend.packed != packed:
        fits = sorted(n for n, b in BACKENDS.items() if b.packed == packed)
        raise ValueError(f"attn_impl={attn_impl!r} is a {'packed' if backend.packed else 'padded'} kernel; a "
                         f"{'packed' if packed else 'padded'} model runs one of {fits}")
    why = backend.unavailable(device, dtype)
    if why is not None:
        raise ValueError(f"attn_impl={attn_impl!r} cannot run here: {why}")
    return backend
