"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 (q/k/v bias) whose MLPs route over experts, plus a shared expert
(``shared_expert_intermediate_size`` wide) scaled per token by ``sigmoid(shared_expert_gate(x))``.

``norm_topk_prob`` (default False), ``decoder_sparse_step`` and ``mlp_only_layers`` as in the config.
"""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .moe_common import QWEN_MOE_TABLE, moe_layers, moe_spec, num_experts_of
from .registry import Family, base_spec_kwargs, layer_windows, qwen2_moe_window_types, register


def qwen2_moe_spec(config) -> DecoderSpec:
    windows = layer_windows(config, "Qwen2-MoE", default_types=qwen2_moe_window_types)
    experts = num_experts_of(config)
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    moe = moe_spec(config, num_experts=experts, expert_intermediate_size=getattr(config, "moe_intermediate_size", None),
                   norm_topk_prob=getattr(config, "norm_topk_prob", False), layers=moe_layers(config, experts),
                   shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
    # transformers 4.x configs have no qkv_bias field: the bias was always there
    qkv_bias = getattr(config, "qkv_bias", None)
    return DecoderSpec(**base_spec_kwargs(config, "qwen2_moe"), layer_windows=windows,
                       qkv_bias=True if qkv_bias is None else bool(qkv_bias), moe=moe)


QWEN2_MOE = register(Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    architectures=("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification", "Qwen2MoeModel"),
    spec=qwen2_moe_spec,
    table=QWEN_MOE_TABLE,
    causal_architecture="Qwen2MoeForCausalLM",
    value_architecture="Qwen2MoeForSequenceClassification",
))
