"""A DeepSeek-V4 decoder layer (transformers' ``DeepseekV4DecoderLayer``): hyper-connected attention, then the
hyper-connected mixture of experts (:mod:`parallm.model.layers.hyper_connections`).

::

    post, comb, x = attn_hc(streams)          streams: [.., n, H] (flattened [.., n H] between layers)
    streams = post * attention(input_layernorm(x)) + comb^T streams
    post, comb, x = ffn_hc(streams)
    streams = post * moe(post_attention_layernorm(x), token ids) + comb^T streams

Every V4 layer routes over experts (hash layers pick them from the token ids: ``ctx.token_ids``, which the chunk
sets for the rows of the activations). The attention (:class:`parallm.model.layers.v4_attention.V4Attention`)
computes its own RoPE from ``ctx.positions``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..recompute import recomputed_attention
from .hyper_connections import HyperConnection, mix_streams
from .moe import MoEBlock
from .norms import norm_class
from .v4_attention import V4Attention


class V4Layer(nn.Module):
    """Built with :class:`parallm.model.decoder.DecoderLayer`'s signature (the kernels it does not use are
    accepted and ignored)."""

    def __init__(self, spec, config, tp: int, layer_number: int, device, *, backend=None, dims=None,
                 cp_attn: str = "allgather", gdn_kernel=None, mamba_kernel=None):
        super().__init__()
        v4 = spec.v4
        self.layer_number = layer_number
        self.block = None
        self.hidden, self.n = spec.hidden_size, v4.hc_mult
        hc = dict(sinkhorn_iters=v4.hc_sinkhorn_iters, eps=v4.hc_eps, norm_eps=spec.rms_norm_eps, device=device)
        self.attn_hc = HyperConnection(spec.hidden_size, v4.hc_mult, **hc)
        self.ffn_hc = HyperConnection(spec.hidden_size, v4.hc_mult, **hc)
        norm = norm_class(spec)     # fp32 weights in a model of any dtype, as transformers keeps V4's norms
        self.input_layernorm = norm(spec.hidden_size, spec.rms_norm_eps, torch.float32, device)
        cp_group = dims.cp_group if dims is not None and dims.cp > 1 else None
        tp_group = dims.tp_group if dims is not None and dims.tp > 1 else None
        self.self_attention = V4Attention(spec, config, tp, device, layer_number=layer_number, cp_group=cp_group,
                                          tp_group=tp_group)
        self.post_attention_layernorm = norm(spec.hidden_size, spec.rms_norm_eps, torch.float32, device)
        self.mlp = MoEBlock(spec, config, dims, device, layer=layer_number)
        self.recompute_attention = False    # recompute="selective": the attention keeps its inputs only

    def _attend(self, h, cos, sin, ctx):
        if self.recompute_attention:        # recompute="selective"
            return recomputed_attention(self.self_attention, h, cos, sin, ctx)
        return self.self_attention(h, cos, sin, ctx)

    def forward(self, x, cos, sin, ctx, tokens=None, routed=None):
        streams = x.unflatten(-1, (self.n, self.hidden))
        post, comb, h = self.attn_hc(streams)
        streams = mix_streams(streams, self._attend(self.input_layernorm(h), cos, sin, ctx), post, comb)
        post, comb, h = self.ffn_hc(streams)
        m = self.mlp(self.post_attention_layernorm(h), tokens, routed, token_ids=ctx.token_ids)
        return mix_streams(streams, m, post, comb).flatten(-2)
