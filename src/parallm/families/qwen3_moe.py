"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 (qk-norm) whose MLPs route over experts (no shared expert).

``norm_topk_prob`` is read from the config; ``decoder_sparse_step`` and ``mlp_only_layers`` pick the MoE layers
(the others keep a dense MLP of ``intermediate_size``); experts are ``moe_intermediate_size`` wide.
"""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .moe_common import QWEN_MOE_TABLE, moe_layers, moe_spec, num_experts_of
from .registry import Family, base_spec_kwargs, layer_windows, register


def qwen3_moe_spec(config) -> DecoderSpec:
    windows = layer_windows(config, "Qwen3-MoE", every_layer=True)
    experts = num_experts_of(config)
    bias = bool(getattr(config, "attention_bias", False))
    moe = moe_spec(config, num_experts=experts, expert_intermediate_size=getattr(config, "moe_intermediate_size", None),
                   norm_topk_prob=getattr(config, "norm_topk_prob", False), layers=moe_layers(config, experts))
    return DecoderSpec(**base_spec_kwargs(config, "qwen3_moe"), layer_windows=windows, qkv_bias=bias, o_bias=bias,
                       qk_norm=True, moe=moe)


QWEN3_MOE = register(Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", "Qwen3MoeModel"),
    spec=qwen3_moe_spec,
    table=QWEN_MOE_TABLE,
    causal_architecture="Qwen3MoeForCausalLM",
    value_architecture="Qwen3MoeForSequenceClassification",
))
