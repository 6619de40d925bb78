"""The Gated DeltaNet layer (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: transformers' ``*GatedDeltaNet``) on megatron-core's
parallel linears, with the recurrence behind a small kernel registry.

What one layer computes (per token t of one sequence; ``nk`` key heads of width ``dk``, ``nv`` value heads of
width ``dv``, ``nv`` a multiple of ``nk``: value head ``h`` reads key head ``h // (nv / nk)``)::

    [q; k; v] = silu(causal depthwise conv1d (kernel K, no bias) of in_proj_qkv(x))     per channel, window K
    z = in_proj_z(x); beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)  (fp32)
    q, k <- l2-normalised per head (eps 1e-6, fp32), q scaled by dk ** -0.5
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T k_t))^T      S: [dk, dv] per value head, S_0 = 0
    o_t = S_t^T q_t
    out = out_proj(RMSNorm_dv(o) * w * silu(z))                                           (the gated norm)

Tensor parallelism over heads (``nk`` and ``nv`` divisible by tp): TP rank r holds key heads
``[r nk/tp, (r+1) nk/tp)`` and the value heads they serve, ``[r nv/tp, (r+1) nv/tp)``. Its one fused
column-parallel ``in_proj`` computes, per rank, ``[q_r; k_r; v_r; z_r; b_r; a_r]`` (Qwen3.5's four HF tensors,
:class:`parallm.model.sharding.FusedSplit` of a head-split ``in_proj_qkv``) or ``[qkvz_r; ba_r]`` (Qwen3-Next's
two HF tensors, whose rows are grouped by key head: rank r's groups are one contiguous block of each, un-grouped
here as transformers' ``fix_query_key_value_ordering`` does); the depthwise conv's channels ``[q_r; k_r; v_r]``,
``A_log`` (an fp32 parameter in a model of any dtype) and ``dt_bias`` (by value head) are split the same way;
``out_proj`` is row parallel (its all-reduce / reduce-scatter sums the heads); the gated norm's ``[dv]`` weight
is shared by every head, so its gradient is a partial sum over TP (``tp_sum="always"``). Under sequence
parallelism the layer takes ``[T/tp, 1, H]`` like attention: ``in_proj`` all-gathers the tokens, ``out_proj``
reduce-scatters them.

Sequences. Padded batches ``[S, B, H]``: the input at padded positions is zeroed first (transformers'
``apply_mask_to_padding_states``), so left padding is a run of zeros before the sequence (the conv's own zero
padding, a state that stays 0) and each row is exactly transformers' result. Packed streams ``[T, 1, H]``: every
document of :class:`parallm.model.layers.attention.Packing` starts afresh: the conv window never reaches into the
previous document and the recurrent state is reset to 0 at each document's first token.

Kernels (:data:`KERNELS`; ``PARALLM_GDN_KERNEL`` = ``auto`` (default), ``torch`` or ``fla``; chosen once at
build, kept as ``layer.kernel``):

    torch   the chunked gated delta rule in torch (chunks of 64 tokens; in each chunk the UT transform by a
            triangular solve, then one scan over chunks), transformers' ``torch_chunk_gated_delta_rule``'s math;
            packed documents each start at a chunk boundary (zero-padded to a whole chunk), the state zeroed at
            their first chunk. The conv: ``conv1d`` on padded rows, a K-tap shifted sum masked at document starts
            on packed streams. Any device, any dtype (the recurrence in fp32).
    fla     flash-linear-attention's ``chunk_gated_delta_rule`` and ``causal_conv1d`` with ``cu_seqlens`` (packed
            streams; padded batches by the torch kernel); needs the ``fla`` package and CUDA.

Context parallelism (cp > 1, :mod:`parallm.model.context_parallel`): a rank holds two zigzag chunks of every
sequence, and the recurrence needs each sequence whole and in order. The layer therefore goes head-parallel over
the CP group, as Megatron does for this layer: after ``in_proj`` one all-to-all sends each CP rank every rank's
tokens for its ``1 / cp`` share of this TP rank's key and value heads (q, k, v, b, a); the rank puts them in
sequence order (the split's ``order``), runs the conv and the recurrence on whole sequences (padded rows:
compacted, real tokens first; packed: every document from a zero state), and a second all-to-all brings each
token's outputs of every head back to the rank that holds it (gated norm and ``out_proj`` stay local). The
backward of each all-to-all is the reverse one. Needs the key and value heads per TP rank divisible by cp (a
clear error with the numbers).
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
from ..context_parallel import ContextSplit
from ..kernels import choose_kernel
from .mlp import no_init

mtp = import_megatron().tensor_parallel

CHUNK = 64                      # tokens per chunk of the chunked recurrence (transformers' and fla's default)
KERNEL_ENV = "PARALLM_GDN_KERNEL"

try:  # optional CUDA kernels
    from fla.modules.convolution import causal_conv1d as _fla_conv
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # noqa: BLE001 - not installed / no CUDA
    _fla_conv = _fla_chunk = None


# -- the math -------------------------------------------------------------------------------------------------

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, *, reset: torch.Tensor | None = None, chunk: int = CHUNK):
    """The gated delta rule over ``[B, L, h, d]`` rows, by chunks: q, k ``[B, L, hk, dk]`` (raw: l2-normalised and
    scaled here), v ``[B, L, hv, dv]``, g (log decay, <= 0) and beta ``[B, L, hv]``; value head ``h`` uses key head
    ``h // (hv / hk)``. Every row starts from a zero state; ``reset``: bool ``[L_padded / chunk]``, the chunks at
    which the state is zeroed again (a packed document's first chunk). Returns fp32 ``[B, L, hv, dv]``."""
    b, length, hk, dk = k.shape
    hv = v.shape[2]
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    # [B, h, L, d] in fp32
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    beta, g = (t.transpose(1, 2).float() for t in (beta, g))
    q = l2norm(q) * dk ** -0.5
    k = l2norm(k)
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n = (length + pad) // chunk
    # [B, h, n, C, d]
    q, k, v = (t.reshape(b, hv, n, chunk, -1) for t in (q, k, v))
    beta, g = beta.reshape(b, hv, n, chunk), g.reshape(b, hv, n, chunk)
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    decay = g.cumsum(-1)                                                  # log of the decay since chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()   # [.., C, C]
    # the UT transform: (I + strictly-lower(beta k k^T decay)) [u, w] = [v beta, k beta exp(decay)]
    system = (kb @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair                                # intra-chunk, causal (diag kept)
    q_read = q * decay.exp().unsqueeze(-1)                                 # q reading the state at chunk start
    k_write = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)            # k decayed to the chunk's end
    chunk_decay = decay[..., -1].exp()[..., None, None]                    # [B, h, n, 1, 1]
    resets = reset.tolist() if reset is not None else [False] * n
    state = q.new_zeros(b, hv, dk, v.shape[-1])
    outs = []
    for i in range(n):
        if resets[i] and i:
            state = torch.zeros_like(state)
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, hv, n * chunk, -1)[:, :, :length]
    return out.transpose(1, 2)


def causal_conv_padded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu`` of the causal depthwise conv of ``x`` ``[B, C, S]`` (zeros before each row) with ``weight``
    ``[C, 1, K]``: transformers' ``causal_conv1d_fn``."""
    k = weight.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight, padding=k - 1, groups=x.shape[1])[..., :x.shape[-1]]
    return F.silu(out).to(x.dtype)


def document_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's position within its document of a packed stream ``[total]`` (0 at a document's first)."""
    t = torch.arange(total, device=cu_seqlens.device)
    cu = cu_seqlens.to(device=t.device, dtype=torch.long)
    doc = torch.searchsorted(cu[1:], t, right=True)
    return t - cu[doc]


def causal_conv_packed(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``silu`` of the causal depthwise conv over a packed stream ``x`` ``[T, C]`` whose documents start at
    ``cu_seqlens``: tap ``j`` of the window (``weight[:, 0, j]``, reading ``K - 1 - j`` tokens back) is dropped
    where that token lies in an earlier document, so no window crosses a document boundary."""
    k = weight.shape[-1]
    total = x.shape[0]
    pos = document_positions(cu_seqlens, total).unsqueeze(-1)             # [T, 1]
    xp = F.pad(x.to(weight.dtype), (0, 0, k - 1, 0))
    w = weight[:, 0]                                                        # [C, K]
    out = xp[k - 1:] * w[:, k - 1]
    for j in range(k - 1):
        back = k - 1 - j
        out = out + torch.where(pos >= back, xp[j:j + total], 0.0) * w[:, j]
    return F.silu(out).to(x.dtype)


def chunk_layout(cu_seqlens: torch.Tensor, total: int, chunk: int = CHUNK):
    """Where each token of a packed stream goes when every document starts at a chunk boundary: ``(index
    [T], length, reset [length / chunk])``: token t's place in a stream of ``length`` tokens (each document
    zero-padded up to whole chunks) and which chunks start a document. Empty documents take no room."""
    bounds = cu_seqlens.tolist()
    starts, index, at = [], [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        starts.append(at // chunk)
        index.append(torch.arange(at, at + b - a))
        at += -(-(b - a) // chunk) * chunk
    reset = torch.zeros(max(at // chunk, 1), dtype=torch.bool)
    reset[starts] = True
    idx = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    return idx.to(cu_seqlens.device), max(at, chunk), reset


def torch_packed_rule(q, k, v, g, beta, cu_seqlens):
    """:func:`chunk_gated_delta_rule` over a packed stream (``[T, h, d]`` / ``[T, h]``), each document from a
    zero state: documents laid out chunk-aligned, the state reset at each one's first chunk."""
    total = q.shape[0]
    idx, length, reset = chunk_layout(cu_seqlens, total)

    def spread(t):
        out = t.new_zeros((length,) + tuple(t.shape[1:]))
        return out.index_copy(0, idx, t)[None]

    out = chunk_gated_delta_rule(*(spread(t) for t in (q, k, v, g, beta)), reset=reset)
    return out[0].index_select(0, idx)


# -- kernels --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GDNKernel:
    """One implementation of the layer's conv + recurrence on packed streams: ``conv(x [T, C], weight [C, 1, K],
    cu_seqlens)`` and ``rule(q, k, v, g, beta, cu_seqlens)`` (``[T, h, d]``; fp32 out). Padded batches always take
    the torch path. ``unavailable(device, dtype)``: why it cannot run there, or None."""
    name: str
    conv: Callable
    rule: Callable
    unavailable: Callable[[torch.device, torch.dtype], str | None] = lambda device, dtype: None


def _fla_conv_packed(x, weight, cu_seqlens):
    out = _fla_conv(x=x[None], weight=weight[:, 0], bias=None, activation="silu",
                    cu_seqlens=cu_seqlens.to(device=x.device, dtype=torch.long))
    return (out[0] if isinstance(out, tuple) else out)[0]


def _fla_rule_packed(q, k, v, g, beta, cu_seqlens):
    hv = v.shape[1]
    if hv != k.shape[1]:          # grouped values: every value head gets its key head (any fla version)
        q = q.repeat_interleave(hv // k.shape[1], dim=1)
        k = k.repeat_interleave(hv // k.shape[1], dim=1)
    out, _ = _fla_chunk(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                        initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                        cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long))
    return out[0].float()


def _fla_unavailable(device, dtype):
    if _fla_chunk is None:
        return "the flash-linear-attention (fla) package is not installed"
    if as_device(device).type != "cuda":
        return f"it needs CUDA tensors (the model is on {device})"
    return None


KERNELS: dict[str, GDNKernel] = {k.name: k for k in (
    GDNKernel("torch", conv=causal_conv_packed, rule=torch_packed_rule),
    GDNKernel("fla", conv=_fla_conv_packed, rule=_fla_rule_packed, unavailable=_fla_unavailable),
)}


def resolve_kernel(name: str | None = None, *, device, dtype) -> GDNKernel:
    """The kernel for ``name`` (default: ``$PARALLM_GDN_KERNEL``, else "auto": fla where it can run on a
    bf16 / fp16 model, else torch: :func:`parallm.model.kernels.choose_kernel`)."""
    return choose_kernel(KERNELS, name, env=KERNEL_ENV, fast="fla", what="Gated DeltaNet", device=device,
                         dtype=dtype)


# -- the layer ------------------------------------------------------------------------------------------------

class GatedRMSNorm(nn.Module):
    """transformers' ``RMSNormGated``: RMS-normalise each head's ``[dv]`` in fp32, scale by ``weight`` (in the input
    dtype), multiply by ``silu(gate)`` in fp32, cast back."""

    def __init__(self, width: int, eps: float, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x, gate):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class DepthwiseConv(nn.Module):
    """The causal depthwise conv's ``weight [C_local, 1, K]`` (no bias): this rank's ``[q_r; k_r; v_r]``
    channels."""

    def __init__(self, channels: int, kernel: int, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype, device=device))


class _AllToAll(torch.autograd.Function):
    """``[n, ...]`` blocks: block j goes to rank j of ``group`` and block j received comes from rank j (``n`` the
    group's size); the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)     # contiguous (empty_like keeps strides)
        torch.distributed.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        torch.distributed.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def check_cp_heads(spec, tp: int, cp: int) -> None:
    """Raise ValueError when a TP rank's Gated DeltaNet heads do not split over ``cp`` ranks."""
    la = spec.linear_attn
    bad = [f"{name}={n} / tp={tp} = {n // tp}" for name, n in (("linear_num_key_heads", la.num_key_heads),
                                                                ("linear_num_value_heads", la.num_value_heads))
           if (n // tp) % cp]
    if bad:
        raise ValueError(f"{spec.architecture} cannot run its Gated DeltaNet layers with tp={tp} x cp={cp}: they "
                         f"split each TP rank's heads over the CP ranks, and {'; '.join(bad)} is not divisible "
                         f"by cp={cp} (key and value heads must be multiples of tp x cp)")


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer on this TP rank (module doc). ``forward(x, cos, sin, ctx)`` as attention's (RoPE
    unused): ``ctx`` a :class:`Packing` (packed), a bool ``[B, S]`` real-token mask or None (padded), or a
    :class:`ContextSplit` (context parallelism, either layout; ``cp_group`` given)."""

    def __init__(self, spec, config, tp: int, device=None, *, kernel: GDNKernel, cp_group=None):
        super().__init__()
        la = spec.linear_attn
        self.cp_group = cp_group
        self.cp = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
        if self.cp > 1:
            check_cp_heads(spec, tp, self.cp)
        self.kernel = kernel
        self.interleaved = la.interleaved
        self.nk, self.nv = la.num_key_heads // tp, la.num_value_heads // tp
        self.dk, self.dv = la.key_head_dim, la.value_head_dim
        key, value = self.nk * self.dk, self.nv * self.dv
        self.local_sizes = (key, key, value, value, self.nv, self.nv)        # q, k, v, z, b, a
        self.in_proj = mtp.ColumnParallelLinear(spec.hidden_size, sum(self.local_sizes) * tp, config=config,
                                                init_method=no_init, bias=False, gather_output=False)
        dtype = config.params_dtype
        self.conv1d = DepthwiseConv(2 * key + value, la.conv_kernel, dtype, device)
        # fp32 in a model of any dtype (the Qwen design: checkpoints store it fp32, vLLM / SGLang hold it fp32;
        # the table row is keep_fp32): exp(A_log) sets each head's decay, and bf16 would round it by up to 2^-8
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=torch.float32, device=device))
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype, device=device))
        self.norm = GatedRMSNorm(self.dv, spec.rms_norm_eps, dtype, device)
        self.out_proj = mtp.RowParallelLinear(la.num_value_heads * self.dv, spec.hidden_size, config=config,
                                              init_method=no_init, bias=False, input_is_parallel=True,
                                              skip_bias_add=False)

    def _split(self, proj):
        """``[..., in_local]`` -> q, k, v, z, b, a (``[..., width]`` each) from this rank's fused projection."""
        if not self.interleaved:
            return proj.split(self.local_sizes, dim=-1)
        # Qwen3-Next: [qkvz_r; ba_r], each grouped by key head: [q_g, k_g, v_g, z_g] and [b_g, a_g] per head g
        key, _, value, _, nv, _ = self.local_sizes
        qkvz, ba = proj.split([2 * key + 2 * value, 2 * nv], dim=-1)
        lead = tuple(proj.shape[:-1])
        per = self.nv // self.nk
        q, k, v, z = qkvz.reshape(lead + (self.nk, -1)).split([self.dk, self.dk, per * self.dv, per * self.dv], -1)
        b, a = ba.reshape(lead + (self.nk, 2 * per)).split([per, per], dim=-1)
        return tuple(t.reshape(lead + (-1,)) for t in (q, k, v, z, b, a))

    def _context_parallel(self, q, k, v, b, a, split: ContextSplit):
        """The conv and the recurrence under context parallelism (module doc): this rank's slots ``[rows, width,
        ...]`` of every local head in (``b`` / ``a`` as projected), ``[rows, width, nv, dv]`` (fp32) out."""
        cp, rows, width = self.cp, split.rows, split.width
        nkc, nvc, dk, dv = self.nk // cp, self.nv // cp, self.dk, self.dv
        parts = (q.reshape(rows, width, cp, nkc * dk), k.reshape(rows, width, cp, nkc * dk),
                 v.reshape(rows, width, cp, nvc * dv), b.reshape(rows, width, cp, nvc), a.reshape(rows, width, cp, nvc))
        sizes = [t.shape[-1] for t in parts]
        send = torch.cat(parts, dim=-1).permute(2, 0, 1, 3)                  # [cp (head group), rows, width, F]
        got = _AllToAll.apply(send, self.cp_group)                            # [cp (source rank), rows, width, F]
        seq = got.reshape(cp * rows, width, -1).index_select(0, split.order)  # [G, width, F] in sequence order
        q, k, v, b, a = seq.split(sizes, dim=-1)
        g = torch.distributed.get_rank(self.cp_group)
        heads = slice(g * nvc, (g + 1) * nvc)                                 # this rank's value heads
        beta = b.sigmoid()
        decay = -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])
        key, w = self.nk * dk, self.conv1d.weight
        weight = torch.cat([w[g * nkc * dk:(g + 1) * nkc * dk], w[key + g * nkc * dk:key + (g + 1) * nkc * dk],
                            w[2 * key + g * nvc * dv:2 * key + (g + 1) * nvc * dv]], dim=0)
        qkv = torch.cat([q, k, v], dim=-1)
        n = seq.shape[0]
        if split.packed:     # the documents in turn, each 2 cp c_d rows (real tokens first)
            out = self._varlen(qkv[:, 0], decay[:, 0], beta[:, 0], split.documents_cu(), weight,
                               (nkc, nvc))[:, None]
        elif self.kernel.name != "torch":   # [G, B]: every compacted row one document of G tokens
            flat = [t.transpose(0, 1).reshape((width * n,) + tuple(t.shape[2:])) for t in (qkv, decay, beta)]
            out = self._varlen(*flat, split.rows_cu(), weight, (nkc, nvc)).view(width, n, nvc, dv).transpose(0, 1)
        else:                # [P, B]: every row compacted, real tokens first
            qkv = causal_conv_padded(qkv.permute(1, 2, 0), weight).permute(2, 0, 1)
            q, k, v = qkv.split([nkc * dk, nkc * dk, nvc * dv], dim=-1)
            rows4 = (t.reshape(n, width, h, d).transpose(0, 1) for t, h, d in ((q, nkc, dk), (k, nkc, dk),
                                                                               (v, nvc, dv)))
            out = chunk_gated_delta_rule(*rows4, decay.float().transpose(0, 1), beta.transpose(0, 1)).transpose(0, 1)
        back = out.new_zeros((cp * rows, width) + tuple(out.shape[2:]))
        back = back.index_copy(0, split.order, out)                           # rank-major slots
        back = _AllToAll.apply(back.reshape(cp, rows, width, nvc * dv), self.cp_group)   # [cp (head group), ...]
        return back.permute(1, 2, 0, 3).reshape(rows, width, self.nv, dv)

    def _varlen(self, qkv, g, beta, cu_seqlens, conv_weight=None, heads=None):
        """The conv and the recurrence through the kernel on a packed stream: ``qkv [T, C]``, ``g`` / ``beta``
        ``[T, nv]``, documents at ``cu_seqlens`` (int64); ``heads``: ``(nk, nv)`` of the call (context
        parallelism: this rank's share). Returns fp32 ``[T, nv, dv]``."""
        nk, nv = heads or (self.nk, self.nv)
        qkv = self.kernel.conv(qkv, self.conv1d.weight if conv_weight is None else conv_weight, cu_seqlens)
        q, k, v = qkv.split([nk * self.dk, nk * self.dk, nv * self.dv], dim=-1)
        n = qkv.shape[0]
        return self.kernel.rule(q.reshape(n, nk, self.dk), k.reshape(n, nk, self.dk), v.reshape(n, nv, self.dv),
                                g.float(), beta, cu_seqlens)

    def forward(self, x, cos=None, sin=None, ctx=None):
        """``ctx``: a :class:`Packing`, a :class:`PaddedRows` (or its ``[B, S]`` bool mask; None: no padding), or
        a :class:`ContextSplit`. Padded rows run the torch kernel's padded path, or, with a varlen kernel (fla),
        each row's span of real tokens as one document of a packed stream (:meth:`PaddedRows.spans`): the same
        result, since the input is zeroed at padding and leading zeros leave the state at 0."""
        if isinstance(ctx, ContextSplit):
            proj, _ = self.in_proj(x)
            s, b = proj.shape[:2]
            q, k, v, z, beta, a = self._split(proj)
            out = self._context_parallel(q, k, v, beta, a, ctx)
            out = self.norm(out.to(v.dtype), z.reshape(s, b, self.nv, self.dv))
            out, _ = self.out_proj(out.reshape(s, b, self.nv * self.dv))
            return out
        packed = isinstance(ctx, Packing)
        rows = None if packed or ctx is None else ctx if isinstance(ctx, PaddedRows) else PaddedRows(ctx)
        if rows is not None and not rows.full:       # padded: zero the padding (transformers does the same)
            x = x * rows.keep.transpose(0, 1).unsqueeze(-1).to(x.dtype)
        proj, _ = self.in_proj(x)                    # [S, B, in_local] ([T, 1, ...] under sequence parallelism)
        s, b = proj.shape[:2]
        q, k, v, z, beta, a = self._split(proj)
        qkv = torch.cat([q, k, v], dim=-1)
        beta = beta.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if packed:
            out = self._varlen(qkv[:, 0], g[:, 0], beta[:, 0], ctx.cu_long())[:, None]
        else:                                        # padded rows as the documents of a packed stream
            if rows is None:
                rows = PaddedRows(torch.ones(b, s, dtype=torch.bool, device=x.device))
            index, cu, _ = rows.spans()
            flat = [t.reshape((s * b,) + tuple(t.shape[2:])).index_select(0, index) for t in (qkv, g, beta)]
            got = self._varlen(*flat, cu)
            out = got.new_zeros((s * b, self.nv, self.dv)).index_copy(0, index, got).view(s, b, self.nv, self.dv)
        out = self.norm(out.to(v.dtype), z.reshape(s, b, self.nv, self.dv))
        out, _ = self.out_proj(out.reshape(s, b, self.nv * self.dv))
        return out
