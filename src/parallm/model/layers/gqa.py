"""Grouped-query attention on megatron-core's parallel linears: the fused QKV column-parallel projection (TP rank
r's ``[q_r; k_r; v_r]``), q / k norms (per head, or over the whole projection), RoPE, the attention kernel of the
layout (padded, packed, context parallel), attention sinks, the output gate, and Gemma's pieces: a weightless
RMSNorm over each value head (``spec.v_norm``) and a softmax scale other than ``head_dim ** -0.5``
(``spec.attn_scale``, folded into the queries: the kernels scale by ``head_dim ** -0.5``). A layer of
``spec.global_layers`` (Gemma 4's full-attention layers) runs its own head dim and KV-head count
(``spec.head_dim_of`` / ``spec.kv_heads_of``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...parallel.megatron_import import import_megatron
from ...parallel.state import as_device
from ..context_parallel import CP_KERNELS, ContextSplit
from ..positions.yarn import apply_partial_rope
from ..spec import DecoderSpec
from . import kv_sharing
from .attention import AttnBackend, Packing, block_kernel
from .mlp import no_init
from .norms import norm_class
from .qk_norm import WholeProjectionNorm, whole_projection_qk_norm

mtp = import_megatron().tensor_parallel
ModelParallelConfig = import_megatron().ModelParallelConfig


def value_rms_norm(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's ``v_norm`` (``Gemma4RMSNorm(with_scale=False)``): each head's values times
    ``(mean(v^2) + eps) ^ -0.5`` over head_dim, in fp32, cast back."""
    x = v.float()
    return (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(v)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, config: ModelParallelConfig, tp: int, device=None, *,
                 backend: AttnBackend, cp_group=None, cp_attn: str = "allgather", window: int | None = None,
                 tp_group=None, layer: int | None = None):
        super().__init__()
        # Gemma 4's KV sharing (layers/kv_sharing.py): a reader takes its source's keys / values (q_proj only);
        # a source keeps them on the batch context for its readers
        self.layer_number = layer
        self.kv_source = None if layer is None else spec.kv_source(layer)
        readers = kv_sharing.last_readers(spec)
        self.keeps_kv = layer in readers
        self.drops_kv = self.kv_source is not None and readers.get(self.kv_source) == layer
        # this layer's attention shape (Gemma 4's full layers: global_head_dim, global_kv_heads)
        head_dim = spec.head_dim if layer is None else spec.head_dim_of(layer)
        nkv = spec.num_kv_heads if layer is None else spec.kv_heads_of(layer)
        self.backend = backend
        self.window = window              # sliding window (spec.window(layer)); None: full causal attention
        self.cp_group = cp_group          # context parallelism: keys and values gathered over it
        self.cp_fn = CP_KERNELS[cp_attn]
        self.cp_block = block_kernel(backend, as_device(device))     # the ring's block kernel
        if spec.qk_norm:
            # One weight over head_dim shared by all heads; each TP rank sees only its heads, so its gradient is
            # a partial sum over TP (the table row says tp_sum="always").
            self.q_norm = norm_class(spec)(head_dim, spec.rms_norm_eps, config.params_dtype, device)
            if self.kv_source is None:
                self.k_norm = norm_class(spec)(head_dim, spec.rms_norm_eps, config.params_dtype, device)
        # MiniMax-M2: one RMS over the whole q / k projection; the TP group joins the ranks' heads (qk_norm.py)
        self.whole_qk, self.whole_qk_group = spec.qk_norm_whole, tp_group
        if spec.qk_norm_whole:
            if tp > 1 and tp_group is None:
                raise ValueError("a projection-wide q / k norm at tp > 1 needs the TP group (its mean spans ranks)")
            self.q_norm = WholeProjectionNorm(spec.num_heads // tp, spec.head_dim, spec.rms_norm_eps,
                                              config.params_dtype, device)
            self.k_norm = WholeProjectionNorm(max(1, spec.num_kv_heads // tp), spec.head_dim, spec.rms_norm_eps,
                                              config.params_dtype, device)
        self.head_dim = head_dim
        # Gemma: the softmax scale (the kernels apply head_dim ** -0.5: the rest multiplies the queries) and the
        # values' weightless RMSNorm
        factor = None if spec.attn_scale is None else spec.attn_scale * math.sqrt(head_dim)
        self.q_factor = None if factor is None or factor == 1.0 else factor
        self.v_norm_eps = spec.rms_norm_eps if spec.v_norm else None
        self.nope = spec.nope             # no positions at all (Nemotron-H's attention layers)
        self.num_heads_local = spec.num_heads // tp
        self.num_kv_local = max(1, nkv // tp)
        # K = V (Gemma 4's global layers): the fused projection is [q_r; k_r]; the values are the raw keys
        self.k_eq_v = layer is not None and spec.global_k_eq_v and spec.is_global_layer(layer)
        # the output gate (Qwen3-Next, Qwen3.5): each query head's rows are [q_h; gate_h] (2 heads' worth)
        self.gated = spec.attn_output_gate
        kv_rows = 0 if self.kv_source is not None else 1 if self.k_eq_v else 2
        local_out = ((2 if self.gated else 1) * self.num_heads_local + kv_rows * self.num_kv_local) * head_dim
        self.linear_qkv = mtp.ColumnParallelLinear(
            spec.hidden_size, local_out * tp, config=config, init_method=no_init, bias=spec.qkv_bias,
            gather_output=False)
        self.linear_proj = mtp.RowParallelLinear(
            spec.num_heads * head_dim, spec.hidden_size, config=config, init_method=no_init, bias=spec.o_bias,
            input_is_parallel=True, skip_bias_add=False)
        # gpt-oss: this TP rank's query heads' attention-sink logits (split with the heads), entering each
        # softmax's denominator once (every attention kernel takes ``sink=``)
        self.sinks = nn.Parameter(torch.empty(self.num_heads_local, dtype=config.params_dtype, device=device)) \
            if spec.attn_sinks else None

    def forward(self, x, cos, sin, ctx):
        """x: [S, B, H] (or [T/tp, 1, H] under sequence parallelism); ctx: a boolean mask [B, 1, S, S] (padded),
        a :class:`Packing` (packed, causal within each sequence), or a :class:`ContextSplit` (context
        parallelism, either layout: this rank's tokens attend to the whole sequence's keys)."""
        qkv, _ = self.linear_qkv(x)  # sequence parallel: all-gathered to [T, 1, ...] here
        s, b, _ = qkv.shape
        hq, hkv, d = self.num_heads_local, self.num_kv_local, self.head_dim
        nq = 2 * hq if self.gated else hq                   # gated: query heads interleaved with their gates
        heads = qkv.view(s, b, -1, d)            # [q_r; k_r; v_r] (K = V: [q_r; k_r]) as heads: views, no copies
        q = heads[:, :, :nq:nq // hq]
        if self.kv_source is not None:       # KV sharing: only the queries are this layer's
            return self._attend(self._queries(q, cos, sin), *kv_sharing.take(
                ctx, self.layer_number, self.kv_source, last=self.drops_kv), ctx, heads, s, b)
        k = heads[:, :, nq:nq + hkv]
        v = k if self.k_eq_v else heads[:, :, nq + hkv:]     # K = V: the keys' projection, before k_norm / RoPE
        if self.whole_qk:
            q, k = whole_projection_qk_norm(q, k, self.q_norm, self.k_norm, self.whole_qk_group)
        elif hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.nope:
            q = apply_partial_rope(q, cos, sin)     # the first rotary_dim channels (GLM-4.5); all otherwise
            k = apply_partial_rope(k, cos, sin)
        if self.q_factor is not None:
            q = q * self.q_factor
        if self.v_norm_eps is not None:
            v = value_rms_norm(v, self.v_norm_eps)
        if self.keeps_kv:
            kv_sharing.keep(ctx, self.layer_number, k, v)
        return self._attend(q, k, v, ctx, heads, s, b)

    def _queries(self, q, cos, sin):
        """A KV-sharing layer's queries: q_norm, RoPE, the softmax scale's factor."""
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        if not self.nope:
            q = apply_partial_rope(q, cos, sin)
        return q if self.q_factor is None else q * self.q_factor

    def _attend(self, q, k, v, ctx, heads, s, b):
        """The attention kernel of the layout, the output gate and the output projection."""
        hq, d = self.num_heads_local, self.head_dim
        nq = 2 * hq if self.gated else hq
        extra = {} if self.sinks is None else {"sink": self.sinks}
        if isinstance(ctx, ContextSplit):
            out = self.cp_fn(q, k, v, ctx, self.cp_group, self.cp_block, window=self.window,
                             **extra)                                                      # [rows, width, hq, d]
        elif isinstance(ctx, Packing):
            out = self.backend.fn(q[:, 0], k[:, 0], v[:, 0], ctx, window=self.window,
                                  **extra).unsqueeze(1)                                    # [T, 1, hq, d]
        else:
            # [S, B, h, d] -> [B, h, S, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = self.backend.fn(q, k, v, ctx, window=self.window, **extra).permute(2, 0, 1, 3)
        if self.gated:
            out = out * torch.sigmoid(heads[:, :, 1:nq:2])
        out, _ = self.linear_proj(out.reshape(s, b, hq * d))
        return out
