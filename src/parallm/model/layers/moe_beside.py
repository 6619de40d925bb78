"""Gemma 4's feed-forward block with routed experts (``enable_moe_block``: the 26B-A4B checkpoint): the dense MLP
and the routed experts side by side, as transformers 5.25's ``Gemma4TextDecoderLayer`` runs them.

With ``x`` the layer's residual after attention and ``h`` the pre-MLP norm of it (the decoder's
``post_attention_layernorm``, HF ``pre_feedforward_layernorm``)::

    dense = down(gelu_tanh(gate h) * up h)                           the layer's dense MLP
    moe   = experts(pre_norm_2(x); router(x))                         router on the residual itself
    out   = out_norm_1(dense) + out_norm_2(moe)                       then the decoder's mlp_out_norm

(HF ``post_feedforward_layernorm_1`` / ``_2`` / ``pre_feedforward_layernorm_2``; the sum is what
``post_feedforward_layernorm``, the decoder's ``mlp_out_norm``, norms before the residual add.) The router is
:class:`~parallm.model.layers.routing.Gemma4Router`; the experts run ``gelu_tanh(gate) * up``.

Parameters (besides :class:`~parallm.model.layers.moe.MoEBlock`'s ``router.*`` / ``experts.*``): the dense MLP's
``linear_fc1`` / ``linear_fc2`` under the same names as a dense layer's MLP (so the dense rows of the weight table
and the LoRA plan apply unchanged), and the three norms ``out_norm_1`` / ``out_norm_2`` / ``pre_norm_2``,
replicated over TP (their gradient a partial sum over TP under sequence parallelism)."""

from __future__ import annotations

from .mlp import MLP
from .moe import MoEBlock
from .norms import norm_class
from ..spec import DecoderSpec


class DenseBesideMoE(MoEBlock):
    """The dense MLP and the routed experts of one Gemma 4 layer (see the module doc). ``forward`` takes the
    decoder's pre-MLP norm output ``h`` and the residual (keyword ``residual``)."""
    takes_residual = True

    def __init__(self, spec: DecoderSpec, config, dims, device, *, layer: int):
        super().__init__(spec, config, dims, device, layer=layer)
        dense = MLP(spec, config, width=spec.mlp_width(layer))
        if not dense.gated or dense.limit is not None:
            raise ValueError(f"the MoE block beside the MLP needs a gated MLP (hidden_act={spec.hidden_act!r})")
        self.linear_fc1, self.linear_fc2, self.dense_act = dense.linear_fc1, dense.linear_fc2, dense.act
        norm = norm_class(spec)
        self.out_norm_1, self.out_norm_2, self.pre_norm_2 = (
            norm(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device) for _ in range(3))

    def dense(self, h):
        g, _ = self.linear_fc1(h)
        gate, up = g.chunk(2, dim=-1)
        out, _ = self.linear_fc2(self.dense_act(gate) * up)
        return out

    def forward(self, h, tokens=None, routed=None, token_ids=None, residual=None):
        if residual is None:
            raise ValueError("Gemma 4's MoE block routes on the layer's residual: forward(..., residual=) needed")
        moe = super().forward(self.pre_norm_2(residual), tokens, routed, token_ids, router_x=residual)
        return self.out_norm_1(self.dense(h)) + self.out_norm_2(moe)
