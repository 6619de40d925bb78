"""The Mamba-2 mixer (Nemotron-H / Nemotron-3: transformers' ``NemotronHMamba2Mixer``) on megatron-core's parallel
linears, with the SSD scan behind a small kernel registry.

What one layer computes (per token of one sequence; ``nh`` heads of ``p`` channels, ``d = nh p``; ``ng`` groups
of B / C of ``n`` channels each, head ``h`` reading group ``h // (nh / ng)``)::

    [z; xBC; dt] = in_proj(x)                              z [d], xBC = [x [d]; B [ng n]; C [ng n]], dt [nh]
    [x; B; C] = silu(causal depthwise conv1d (kernel K, bias) of xBC)                 per channel, window K
    dt <- clamp(softplus(dt + dt_bias), time_step_limit); A = -exp(A_log)                      (fp32)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T     S: [p, n] per head, S_0 = 0
    y_t = S_t C_t + D x_t
    out = out_proj(w * groupRMSNorm(y * silu(z)))       the gated norm: gate first, RMS over each of ng groups

Tensor parallelism over heads: ``nh`` and ``ng`` divisible by tp (``check_tp``), so TP rank r holds heads
``[r nh/tp, (r+1) nh/tp)`` and the groups ``[r ng/tp, (r+1) ng/tp)`` they read, as megatron-core's Mamba layer
does. Its column-parallel ``in_proj`` computes ``[z_r; x_r; B_r; C_r; dt_r]`` (the one HF tensor's five parts,
each split over TP: :class:`parallm.model.sharding.PartsSplit`); the conv's channels ``[x_r; B_r; C_r]`` (weight
and bias), ``A_log``, ``D``, ``dt_bias`` (by head) and the gated norm's weight (``[d]``, whole groups per rank)
are split alike; ``out_proj`` is row parallel. ``A_log``, ``D`` and ``dt_bias`` are fp32 parameters in a model of
any dtype (the table's ``keep_fp32``): the decay ``exp(dt A)`` and the skip ``D x`` are computed in fp32 from
them. Under sequence parallelism the layer takes ``[T/tp, 1, H]``: ``in_proj`` all-gathers the tokens,
``out_proj`` reduce-scatters them.

Sequences. Padded batches ``[S, B, H]``: as transformers, the input at padded positions is zeroed before
``in_proj`` and the conv's output at padded positions is zeroed too, then every row is scanned whole (left
padding is a run of zeros: the state stays 0), so each row is exactly transformers' result. Packed streams
``[T, 1, H]``: every document of :class:`parallm.model.layers.attention.Packing` starts afresh: the conv window
never reaches into the previous document (its taps there are dropped) and the SSD state is zero at each
document's first token (documents laid out chunk-aligned, the inter-chunk recurrence cut at document starts).

Kernels (:data:`KERNELS`; ``PARALLM_MAMBA_KERNEL`` = ``auto`` (default), ``torch`` or ``mamba_ssm``):

    torch      the chunked SSD scan in torch (transformers' ``mamba2_chunk_scan`` math: intra-chunk by the
               masked ``C B^T`` "attention", chunk states, then the state passed from chunk to chunk, zeroed
               where a document starts; groups of chunks under a memory budget, linear in the length), and the
               conv by ``conv1d`` (padded) or a K-tap
               shifted sum masked at document starts (packed). Any device, any dtype (the scan in fp32).
    mamba_ssm  mamba-ssm's ``mamba_chunk_scan_combined`` (``seq_idx`` marks the documents) and causal-conv1d's
               ``causal_conv1d_fn`` (``seq_idx`` too) on packed streams; padded batches by the torch kernel.
               Needs the ``mamba_ssm`` and ``causal_conv1d`` packages and CUDA: written, not run on a GPU here.

Context parallelism (cp > 1, :mod:`parallm.model.context_parallel`): a rank holds two zigzag chunks of every
sequence, and the scan needs each sequence whole and in order. The layer goes head-parallel over the CP group, as
the Gated DeltaNet layers do: after ``in_proj`` one all-to-all sends each CP rank every rank's tokens for its
``1 / cp`` share of this TP rank's heads and groups (x, B, C, dt); the rank puts them in sequence order, runs the
conv and the scan on whole sequences (padded rows: compacted, real tokens first; packed: every document from a
zero state), and a second all-to-all brings each token's outputs of every head back to the rank that holds it
(the gated norm and ``out_proj`` stay local). Needs the heads and the groups per TP rank divisible by cp
(:func:`check_mamba_layout`, a clear error with the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.megatron_import import import_megatron
from ...parallel.state import as_device
from .attention import Packing, PaddedRows
from .gated_deltanet import DepthwiseConv, _AllToAll, chunk_layout, document_positions
from ..context_parallel import ContextSplit
from ..kernels import choose_kernel
from .mlp import no_init

mtp = import_megatron().tensor_parallel

KERNEL_ENV = "PARALLM_MAMBA_KERNEL"

try:  # optional CUDA kernels
    from causal_conv1d import causal_conv1d_fn as _cc_conv
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as _ms_scan
except Exception:  # noqa: BLE001 - not installed / no CUDA
    _cc_conv = _ms_scan = None


# -- the math -------------------------------------------------------------------------------------------------

def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` -> ``[..., T, T]``: ``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``j <= i``, -inf above the
    diagonal (transformers' stable form: a masked cumulative sum, no differences of cumulative sums)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    strict = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    out = torch.cumsum(x.masked_fill(~strict, 0), dim=-2)
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~causal, float("-inf"))


# fp32 elements of the largest per-group temporary of :func:`ssd_scan` (``[R, h, chunks, l, l]``)
SCAN_BUDGET = 1 << 24


def ssd_scan(x, dt, a, b, c, *, chunk: int, d=None, reset: torch.Tensor | None = None,
             initial: torch.Tensor | None = None, budget: int | None = None) -> torch.Tensor:
    """The SSD scan over rows, by chunks: ``x [R, L, h, p]``, ``dt [R, L, h]`` (after softplus and clamp), ``a
    [h]`` (negative), ``b`` / ``c`` ``[R, L, g, n]``, ``d [h]`` (the skip; None: none). Every row starts from
    ``initial`` ``[R, h, p, n]`` (None: a zero state); ``reset``: bool ``[ceil(L / chunk)]``, the chunks at
    whose start the state is zeroed again (a packed document's first chunk; chunk 0's entry is ignored, the row
    starting from ``initial``). Returns fp32 ``[R, L, h, p]``
    (``y``, skip included).

    Linear in the number of chunks: groups of chunks whose ``[R, h, chunks, l, l]`` intra-chunk temporaries hold
    at most ``budget`` elements (None: :data:`SCAN_BUDGET`) are taken one after the other, and the state passes
    from chunk to chunk (``start_{t+1} = keep_{t+1} (exp(sum of chunk t's dt A) start_t + chunk t's own end
    state)``). transformers' torch path builds one decay matrix over every pair of chunks instead; the same
    products, summed in another order."""
    rows, length, heads, _ = x.shape
    groups = b.shape[2]
    x, dt = x.float(), dt.float()
    b = b.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    c = c.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    pad = (-length) % chunk
    skip = d.float()[:, None] * x if d is not None else None
    xs = x * dt[..., None]
    ad = a.float() * dt                                                    # [R, L, h]
    if pad:
        xs, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xs, b, c))
        ad = F.pad(ad, (0, 0, 0, pad))
    n = (length + pad) // chunk
    xs, b, c = (t.reshape(rows, n, chunk, heads, -1) for t in (xs, b, c))   # [R, n, l, h, .]
    ad = ad.reshape(rows, n, chunk, heads).permute(0, 3, 1, 2)            # [R, h, n, l]
    keep = None if reset is None else (~reset.to(device=x.device, dtype=torch.bool)).float()
    state = (x.new_zeros(rows, heads, xs.shape[-1], b.shape[-1]) if initial is None
             else initial.float().clone())
    step = max(1, (SCAN_BUDGET if budget is None else budget) // max(1, rows * heads * chunk * chunk))
    y = x.new_empty(rows, n, chunk, heads, xs.shape[-1])
    for g0 in range(0, n, step):
        g1 = min(n, g0 + step)
        y[:, g0:g1], state = _scan_group(xs[:, g0:g1], ad[:, :, g0:g1], b[:, g0:g1], c[:, g0:g1], state,
                                         None if keep is None else keep[g0:g1], first=g0 == 0)
    y = y.reshape(rows, n * chunk, heads, -1)[:, :length]
    return y + skip if skip is not None else y


def _scan_group(xs, ad, b, c, state, keep, *, first: bool):
    """One group of chunks of :func:`ssd_scan`: ``xs [R, G, l, h, p]`` (x dt), ``ad [R, h, G, l]`` (dt A),
    ``b`` / ``c`` ``[R, G, l, h, n]``, ``state [R, h, p, n]`` at the group's start, ``keep [G]`` (0: the state
    is zeroed at that chunk's start; None: never). Returns (``y [R, G, l, h, p]``, the state after the group)."""
    cum = torch.cumsum(ad, dim=-1)                                         # [R, h, G, l]
    # 1. within each chunk: the causal C B^T scores times the decay between the two positions
    decay_in = torch.exp(segment_sum(ad))                                  # [R, h, G, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay_in.permute(0, 2, 3, 4, 1)
    del decay_in
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xs)
    del scores
    # 2. each chunk's own end state (from a zero start)
    to_end = torch.exp(cum[..., -1:] - cum)                                # [R, h, G, l]
    own = torch.einsum("bclhn,bclhp->bchpn", b * to_end.permute(0, 2, 3, 1)[..., None], xs)   # [R, G, h, p, n]
    # 3. the state at each chunk's start, passed from chunk to chunk
    total = torch.exp(cum[..., -1]).permute(0, 2, 1)[..., None, None]      # [R, G, h, 1, 1]
    starts = []
    for t in range(own.shape[1]):
        if keep is not None and not (first and t == 0):
            state = state * keep[t]
        starts.append(state)
        state = state * total[:, t] + own[:, t]
    start = torch.stack(starts, dim=1)                                     # [R, G, h, p, n]
    # 4. the start state read by each position, decayed to it
    y = y + torch.einsum("bclhn,bchpn->bclhp", c, start) * torch.exp(cum).permute(0, 2, 3, 1)[..., None]
    return y, state


def conv_padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu`` of the causal depthwise conv of ``x [B, C, S]`` (zeros before each row) with ``weight [C, 1, K]``
    and ``bias [C]``: transformers' ``causal_conv1d_fn``."""
    k = weight.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight, bias, padding=k - 1, groups=x.shape[1])[..., :x.shape[-1]]
    return F.silu(out).to(x.dtype)


def conv_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``silu`` of the causal depthwise conv over a packed stream ``x [T, C]`` whose documents start at
    ``cu_seqlens``: tap ``j`` (``weight[:, 0, j]``, reading ``K - 1 - j`` tokens back) is dropped where that token
    lies in an earlier document, so no window crosses a document boundary; ``bias`` added once per token."""
    k = weight.shape[-1]
    total = x.shape[0]
    pos = document_positions(cu_seqlens, total).unsqueeze(-1)             # [T, 1]
    xp = F.pad(x.to(weight.dtype), (0, 0, k - 1, 0))
    w = weight[:, 0]                                                        # [C, K]
    out = xp[k - 1:] * w[:, k - 1]
    for j in range(k - 1):
        back = k - 1 - j
        out = out + torch.where(pos >= back, xp[j:j + total], 0.0) * w[:, j]
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype)


def scan_packed(x, dt, a, b, c, d, cu_seqlens, *, chunk: int) -> torch.Tensor:
    """:func:`ssd_scan` over a packed stream (``x [T, h, p]``, ``dt [T, h]``, ``b`` / ``c`` ``[T, g, n]``), each
    document from a zero state: documents laid out chunk-aligned, the state cut at each one's first chunk."""
    idx, length, reset = chunk_layout(cu_seqlens, x.shape[0], chunk)

    def spread(t):
        out = t.new_zeros((length,) + tuple(t.shape[1:]))
        return out.index_copy(0, idx, t)[None]

    out = ssd_scan(spread(x), spread(dt), a, spread(b), spread(c), chunk=chunk, d=d, reset=reset)
    return out[0].index_select(0, idx)


# -- kernels --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MambaKernel:
    """One implementation of the conv and the scan on packed streams: ``conv(xBC [T, C], weight [C, 1, K], bias,
    cu_seqlens)`` and ``scan(x [T, h, p], dt [T, h], A [h], B [T, g, n], C [T, g, n], D [h], cu_seqlens, chunk=)``
    (fp32 out). Padded batches always take the torch path. ``unavailable(device, dtype)``: why it cannot run
    there, or None."""
    name: str
    conv: Callable
    scan: Callable
    unavailable: Callable[[torch.device, torch.dtype], str | None] = lambda device, dtype: None


def _seq_idx(cu_seqlens, total, device):
    """mamba-ssm's / causal-conv1d's document index per token ``[1, T]`` int32."""
    t = torch.arange(total, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return torch.searchsorted(cu[1:], t, right=True).to(torch.int32)[None]


def _ms_conv_packed(x, weight, bias, cu_seqlens):
    seq = _seq_idx(cu_seqlens, x.shape[0], x.device)
    # causal-conv1d wants channel-last memory for seq_idx: [1, C, T] as the transpose of a [1, T, C] tensor
    out = _cc_conv(x[None].transpose(1, 2), weight[:, 0], bias, seq_idx=seq, activation="silu")
    return out.transpose(1, 2)[0]


def _ms_scan_packed(x, dt, a, b, c, d, cu_seqlens, *, chunk):
    seq = _seq_idx(cu_seqlens, x.shape[0], x.device)
    out = _ms_scan(x[None], dt[None], a, b[None], c[None], chunk, D=d, z=None, dt_bias=None, dt_softplus=False,
                   seq_idx=seq)
    return out[0].float()


def _ms_unavailable(device, dtype):
    if _ms_scan is None or _cc_conv is None:
        return "the mamba-ssm and causal-conv1d packages are not installed"
    if as_device(device).type != "cuda":
        return f"it needs CUDA tensors (the model is on {device})"
    return None


KERNELS: dict[str, MambaKernel] = {k.name: k for k in (
    MambaKernel("torch", conv=conv_packed, scan=scan_packed),
    MambaKernel("mamba_ssm", conv=_ms_conv_packed, scan=_ms_scan_packed, unavailable=_ms_unavailable),
)}


def resolve_kernel(name: str | None = None, *, device, dtype) -> MambaKernel:
    """The kernel for ``name`` (default: ``$PARALLM_MAMBA_KERNEL``, else "auto": mamba_ssm where it can run on a
    bf16 / fp16 model, else torch: :func:`parallm.model.kernels.choose_kernel`)."""
    return choose_kernel(KERNELS, name, env=KERNEL_ENV, fast="mamba_ssm", what="Mamba-2", device=device,
                         dtype=dtype)


def check_mamba_layout(spec, *, tp: int, cp: int) -> None:
    """Raise ValueError when a TP rank's Mamba-2 heads or B / C groups do not split over ``cp`` ranks."""
    mb = spec.mamba
    if mb is None or cp == 1:
        return
    bad = [f"{name}={n} / tp={tp} = {n // tp}" for name, n in (("mamba_num_heads", mb.num_heads),
                                                                ("n_groups", mb.n_groups)) if (n // tp) % cp]
    if bad:
        raise ValueError(f"{spec.architecture} cannot run its Mamba-2 layers with tp={tp} x cp={cp}: they split "
                         f"each TP rank's heads and B / C groups over the CP ranks, and {'; '.join(bad)} is not "
                         f"divisible by cp={cp} (mamba_num_heads and n_groups must be multiples of tp x cp)")


# -- the layer ------------------------------------------------------------------------------------------------

class GatedGroupNorm(nn.Module):
    """transformers' ``NemotronHRMSNormGated`` (mamba-ssm's ``norm_before_gate=False``): ``y * silu(z)`` in fp32,
    RMS-normalised over each group of ``group`` channels, times ``weight``; the input's dtype kept (fp32 from
    the scan)."""

    def __init__(self, width: int, group: int, eps: float, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))
        self.group, self.eps = group, eps

    def forward(self, y, z):
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        lead = tuple(h.shape[:-1])
        h = h.view(lead + (-1, self.group))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.view(lead + (-1,)).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer on this TP rank (module doc). ``forward(x, cos, sin, ctx)`` as attention's (RoPE
    unused): ``ctx`` a :class:`Packing` (packed), a :class:`PaddedRows` / bool ``[B, S]`` real-token mask, or
    None (padded, no padding)."""

    def __init__(self, spec, config, tp: int, device=None, *, kernel: MambaKernel, cp_group=None):
        super().__init__()
        mb = spec.mamba
        self.kernel = kernel
        self.cp_group = cp_group
        self.cp = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
        check_mamba_layout(spec, tp=tp, cp=self.cp)
        self.nh, self.ng, self.p, self.n = mb.num_heads // tp, mb.n_groups // tp, mb.head_dim, mb.state_size
        self.chunk = mb.chunk_size
        self.limit = tuple(float(v) for v in mb.time_step_limit)
        inner, bc = self.nh * self.p, self.ng * self.n
        self.sizes = (inner, inner, bc, bc, self.nh)                    # z, x, B, C, dt
        self.in_proj = mtp.ColumnParallelLinear(spec.hidden_size, sum(self.sizes) * tp, config=config,
                                                init_method=no_init, bias=mb.proj_bias, gather_output=False)
        dtype = config.params_dtype
        self.conv1d = DepthwiseConv(inner + 2 * bc, mb.conv_kernel, dtype, device)
        if mb.conv_bias:
            self.conv1d.bias = nn.Parameter(torch.empty(inner + 2 * bc, dtype=dtype, device=device))
        else:
            self.conv1d.bias = None
        # fp32 in a model of any dtype (the table rows are keep_fp32)
        self.A_log = nn.Parameter(torch.empty(self.nh, dtype=torch.float32, device=device))
        self.D = nn.Parameter(torch.empty(self.nh, dtype=torch.float32, device=device))
        self.dt_bias = nn.Parameter(torch.empty(self.nh, dtype=torch.float32, device=device))
        self.norm = GatedGroupNorm(inner, mb.inner // mb.n_groups, mb.norm_eps, dtype, device)
        self.out_proj = mtp.RowParallelLinear(mb.inner, spec.hidden_size, config=config, init_method=no_init,
                                              bias=mb.proj_bias, input_is_parallel=True, skip_bias_add=False)

    def _dt(self, dt):
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return dt.clamp(min=self.limit[0], max=self.limit[1])

    def _context_parallel(self, xs, bb, cc, dt, split: ContextSplit):
        """The conv and the scan under context parallelism (module doc): this rank's slots ``[rows, width, ...]``
        of every local head and group in, ``[rows, width, nh, p]`` (fp32) out."""
        cp, rows, width = self.cp, split.rows, split.width
        nhc, ngc, p, n = self.nh // cp, self.ng // cp, self.p, self.n
        parts = (xs.reshape(rows, width, cp, nhc * p), bb.reshape(rows, width, cp, ngc * n),
                 cc.reshape(rows, width, cp, ngc * n), dt.reshape(rows, width, cp, nhc))
        sizes = [t.shape[-1] for t in parts]
        send = torch.cat(parts, dim=-1).permute(2, 0, 1, 3)                  # [cp (head group), rows, width, F]
        got = _AllToAll.apply(send, self.cp_group)                            # [cp (source rank), rows, width, F]
        seq = got.reshape(cp * rows, width, -1).index_select(0, split.order)  # [G, width, F] in sequence order
        xs, bb, cc, dt = seq.split(sizes, dim=-1)
        g = torch.distributed.get_rank(self.cp_group)
        heads = slice(g * nhc, (g + 1) * nhc)                                 # this rank's heads
        inner, bc = self.nh * p, self.ng * n
        dev = xs.device
        channels = torch.cat([torch.arange(g * nhc * p, (g + 1) * nhc * p, device=dev),
                              inner + torch.arange(g * ngc * n, (g + 1) * ngc * n, device=dev),
                              inner + bc + torch.arange(g * ngc * n, (g + 1) * ngc * n, device=dev)])
        weight = self.conv1d.weight.index_select(0, channels)
        bias = self.conv1d.bias.index_select(0, channels) if self.conv1d.bias is not None else None
        a = -torch.exp(self.A_log[heads].float())
        d = self.D[heads]
        dt = F.softplus(dt.float() + self.dt_bias[heads].float()).clamp(min=self.limit[0], max=self.limit[1])
        xbc = torch.cat([xs, bb, cc], dim=-1)
        split_sizes = [nhc * p, ngc * n, ngc * n]
        total = seq.shape[0]
        if split.packed:     # the documents in turn, each 2 cp c rows (real tokens first)
            cu = split.documents_cu()
            xbc = self.kernel.conv(xbc[:, 0], weight, bias, cu)
            xs, bb, cc = xbc.split(split_sizes, dim=-1)
            y = self.kernel.scan(xs.reshape(total, nhc, p), dt[:, 0], a, bb.reshape(total, ngc, n),
                                 cc.reshape(total, ngc, n), d, cu, chunk=self.chunk)[:, None]
        else:                # [G, B]: every row compacted, real tokens first
            xbc = conv_padded(xbc.permute(1, 2, 0), weight, bias).permute(2, 0, 1)
            xs, bb, cc = (t.transpose(0, 1) for t in xbc.split(split_sizes, dim=-1))
            y = ssd_scan(xs.reshape(width, total, nhc, p), dt.transpose(0, 1), a, bb.reshape(width, total, ngc, n),
                         cc.reshape(width, total, ngc, n), chunk=self.chunk, d=d).transpose(0, 1)
        back = y.new_zeros((cp * rows, width) + tuple(y.shape[2:]))
        back = back.index_copy(0, split.order, y)                             # rank-major slots
        back = _AllToAll.apply(back.reshape(cp, rows, width, nhc * p), self.cp_group)   # [cp (head group), ...]
        return back.permute(1, 2, 0, 3).reshape(rows, width, self.nh, p)

    def forward(self, x, cos=None, sin=None, ctx=None):
        if isinstance(ctx, ContextSplit):
            proj, _ = self.in_proj(x)
            s, b = proj.shape[:2]
            z, xs, bb, cc, dt = proj.split(self.sizes, dim=-1)
            y = self._context_parallel(xs, bb, cc, dt, ctx)
            out, _ = self.out_proj(self.norm(y.reshape(s, b, -1), z).to(x.dtype))
            return out
        packed = isinstance(ctx, Packing)
        rows = None if packed or ctx is None else ctx if isinstance(ctx, PaddedRows) else PaddedRows(ctx)
        keep = None
        if rows is not None and not rows.full:          # padded: zero the padding (transformers does the same)
            keep = rows.keep.transpose(0, 1).unsqueeze(-1)                  # [S, B, 1]
            x = x * keep.to(x.dtype)
        proj, _ = self.in_proj(x)                        # [S, B, in_local] ([T, 1, ...] under sequence parallelism)
        s, b = proj.shape[:2]
        z, xs, bb, cc, dt = proj.split(self.sizes, dim=-1)
        xbc = torch.cat([xs, bb, cc], dim=-1)
        a = -torch.exp(self.A_log.float())
        split = [self.sizes[1], self.sizes[2], self.sizes[3]]
        if packed:
            cu = ctx.cu_long()
            xbc = self.kernel.conv(xbc[:, 0], self.conv1d.weight, self.conv1d.bias, cu)
            xs, bb, cc = xbc.split(split, dim=-1)
            t = xs.shape[0]
            y = self.kernel.scan(xs.reshape(t, self.nh, self.p), self._dt(dt[:, 0]), a,
                                 bb.reshape(t, self.ng, self.n), cc.reshape(t, self.ng, self.n), self.D, cu,
                                 chunk=self.chunk)[:, None]                 # [T, 1, nh, p]
        else:
            xbc = conv_padded(xbc.permute(1, 2, 0), self.conv1d.weight, self.conv1d.bias).permute(2, 0, 1)
            if keep is not None:
                xbc = xbc * keep.to(xbc.dtype)
            xs, bb, cc = (t.transpose(0, 1) for t in xbc.split(split, dim=-1))   # [B, S, .]
            y = ssd_scan(xs.reshape(b, s, self.nh, self.p), self._dt(dt.transpose(0, 1)), a,
                         bb.reshape(b, s, self.ng, self.n), cc.reshape(b, s, self.ng, self.n), chunk=self.chunk,
                         d=self.D).transpose(0, 1)                          # [S, B, nh, p]
        y = self.norm(y.reshape(s, b, -1), z)
        out, _ = self.out_proj(y.to(x.dtype))
        return out
