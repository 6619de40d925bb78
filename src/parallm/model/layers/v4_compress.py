"""DeepSeek-V4's compressors and lightning indexer (transformers' ``DeepseekV4HCACompressor``,
``DeepseekV4CSACompressor``, ``DeepseekV4Indexer``), training path (no cache): each document pooled from its
own first token (:mod:`parallm.model.layers.v4_layout`).

**Compressor** (``kv_proj``, ``gate_proj``, ``position_bias`` ``[rate, C]``, ``kv_norm``): every complete window of
``rate`` tokens of a document becomes one compressed key::

    entry[e] = rope(kv_norm(sum_i softmax_i(gate[t_i] + position_bias[i]) * kv[t_i]), position e * rate)

(softmax over the window's slots in fp32, per channel). HCA: ``C = head_dim``, the window's ``rate`` tokens. CSA
(``overlap``): ``C = 2 head_dim``, two series: the window's tokens' second halves and the *previous* window's
tokens' first halves, ``2 rate`` slots (the first window of a document has no previous one: those slots get
weight 0, as transformers' ``-inf`` gates). RoPE: the ``compress`` rope, interleaved pairs on the trailing
``rope_dim`` channels, at the window's first position.

**Indexer** (CSA layers; frozen, as transformers runs it for indices only and parallm's DSA indexer): its own
overlapping compressor at ``index_head_dim``, queries ``q_b_proj(q_residual)`` (``index_heads x
index_head_dim``, compress rope at the query's position), and per query the ``index_topk`` entries of its
document it sees with the highest ``sum_h w_h relu(q_h . k) index_head_dim^-0.5``, ``w = weights_proj(x)
index_heads^-0.5``: parallm's blocked :func:`~parallm.model.layers.indexer.select_topk` (ties: the lower entry;
no ``[queries, entries]`` tensor beyond one block).

Memory: the pooled windows are ``[entries, slots, C]``, linear in S.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..positions.rope import rope_inv_freq
from ..positions.yarn import yarn_attention_factor, yarn_inv_freq
from .indexer import select_topk
from .mla import ReplicatedLinear
from .v4_layout import V4Layout


class V4RMSNorm(nn.Module):
    """transformers' ``DeepseekV4RMSNorm``: ``(weight * x_fp32 * rsqrt(mean(x^2) + eps)).to(x.dtype)``, its weight
    fp32 in a model of any dtype (transformers' ``_keep_in_fp32_modules_strict``: ``q_a_norm``, ``kv_norm``)."""

    def __init__(self, size: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32, device=device))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def v4_cos_sin(rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` ``positions.shape + (rope_dim // 2,)`` (one frequency per interleaved pair, not
    duplicated) of a RopeSpec or a YarnSpec (times its attention factor, 1 for V4's compress rope)."""
    if getattr(rope, "kind", None) == "yarn":
        inv, factor = yarn_inv_freq(rope, device=positions.device), yarn_attention_factor(rope)
    else:
        inv, factor = rope_inv_freq(rope, device=positions.device), 1.0
    freqs = positions[..., None].float() * inv
    return freqs.cos() * factor, freqs.sin() * factor


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' V4 ``apply_rotary_pos_emb``: interleaved pairs ``(x_2i, x_2i+1)`` of the trailing ``2 *
    cos.shape[-1]`` channels rotated in fp32 (``cos`` / ``sin`` broadcast against ``x[..., :rope // 2]``, cast to
    x's dtype first as transformers does), the leading channels unchanged."""
    half = cos.shape[-1]
    nope = x[..., :-2 * half]
    # a copy of the rope channels: the products below keep it for the backward, not the whole of x
    rope = x[..., -2 * half:].to(torch.float32, copy=True)
    c = cos.to(x.dtype).float()
    s = sin.to(x.dtype).float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rot = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rot], dim=-1)


def _frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class V4Compressor(nn.Module):
    """One compressor (see the module docstring): ``width`` channels an entry, ``overlap`` for CSA's two
    series. Parameters replicated over TP."""

    def __init__(self, hidden: int, width: int, rate: int, *, overlap: bool, eps: float, dtype, device=None):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        out = 2 * width if overlap else width
        self.kv_proj = ReplicatedLinear(hidden, out, bias=False, dtype=dtype, device=device)
        self.gate_proj = ReplicatedLinear(hidden, out, bias=False, dtype=dtype, device=device)
        # fp32 in a model of any dtype, as transformers keeps it (_keep_in_fp32_modules_strict)
        self.position_bias = nn.Parameter(torch.empty(rate, out, dtype=torch.float32, device=device))
        self.kv_norm = V4RMSNorm(width, eps, device)

    def forward(self, x: torch.Tensor, lay: V4Layout, rope) -> torch.Tensor:
        """x ``[keys, H]`` (the key stream's tokens) -> the entries ``[E, width]``, RoPE'd."""
        e = lay.entries(self.rate)
        kv = self.kv_proj(x)[e.rows]                                         # [E, rate, C]
        gate = self.gate_proj(x)[e.rows] + self.position_bias
        if self.overlap:
            d = self.width
            prev_kv = torch.cat([kv[:1], kv[:-1]])[..., :d]                  # entry e - 1's window: Ca
            prev_gate = torch.cat([gate[:1], gate[:-1]])[..., :d]
            prev_gate = prev_gate.masked_fill(~e.prev_ok[:, None, None], float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)                   # [E, 2 rate, d]
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        pooled = self.kv_norm(pooled)
        doc_first = e.first.repeat_interleave(e.count, output_size=e.total)
        pos = (torch.arange(e.total, device=x.device) - doc_first) * self.rate
        cos, sin = v4_cos_sin(rope, pos)
        return rope_tail(pooled, cos, sin)


class V4Indexer(nn.Module):
    """A CSA layer's lightning indexer (see the module docstring), frozen: ``compressor`` (overlapping, at
    ``index_head_dim``), ``q_b_proj`` ``[index_heads * index_head_dim, q_lora_rank]``, ``weights_proj``
    ``[index_heads, H]``; replicated over TP, ``requires_grad=False``."""

    def __init__(self, spec, dtype, device=None):
        super().__init__()
        v = spec.v4
        self.heads, self.dim, self.topk, self.rate = v.index_heads, v.index_head_dim, v.index_topk, v.csa_rate
        self.compressor = V4Compressor(spec.hidden_size, v.index_head_dim, v.csa_rate, overlap=True,
                                       eps=spec.rms_norm_eps, dtype=dtype, device=device)
        self.q_b_proj = ReplicatedLinear(v.q_lora_rank, v.index_heads * v.index_head_dim, bias=False, dtype=dtype,
                                         device=device)
        self.weights_proj = ReplicatedLinear(spec.hidden_size, v.index_heads, bias=False, dtype=dtype,
                                             device=device)
        _frozen(self)

    @torch.no_grad()
    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cos, sin, lay: V4Layout, rope,
               keys_x: torch.Tensor | None = None) -> torch.Tensor:
        """``[Q, topk]`` int32: each query's selected entries (entry numbers), -1 in empty slots. ``x`` /
        ``q_resid`` ``[Q, ..]`` the queries' tokens, ``cos`` / ``sin`` their compress rope; ``keys_x``: the key
        stream's tokens (default ``x``)."""
        entries = self.compressor(x if keys_x is None else keys_x, lay, rope)            # [E, d]
        q = self.q_b_proj(q_resid).unflatten(-1, (self.heads, self.dim))
        q = rope_tail(q, cos[:, None], sin[:, None])
        w = F.linear(x, self.weights_proj.weight).float() * self.heads ** -0.5
        ranges = lay.entry_ranges(self.rate)
        return select_topk(q[:, None], entries[:, None], w[:, None], ranges, self.topk, scale=self.dim ** -0.5)
