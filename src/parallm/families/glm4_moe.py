"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (``Glm4MoeForCausalLM``): config -> :class:`~parallm.model.spec.DecoderSpec`.

What differs from LLaMA: q / k / v biases (``attention_bias``; none on o_proj), an optional RMSNorm over each
query / key head before RoPE (``use_qk_norm``; GLM-4.5-Air has none), RoPE on the first
``int(head_dim * partial_rotary_factor)`` channels of each head only, rotate_half layout (not interleaved;
transformers' default factor 0.5 when the config gives none), and DeepSeek-V3's MoE: dense-first layers
(``first_k_dense_replace``), the sigmoid group-limited router with its fp32 selection bias, one ungated shared
expert (:func:`parallm.families.deepseek_v3.grouped_moe_spec`, with GLM's defaults: ``routed_scaling_factor``
1.0, one group). MTP layers (``num_nextn_predict_layers``, GLM-4.5: 1) are recorded, not run.

YaRN is refused here: no GLM-4.5 checkpoint uses it, and its partial rotary would need it in the standard
attention path (docs/families.md). The weight table: LLaMA's (q / k / v biases, qk-norm rows) with the MoE rows
of DeepSeek-V3 (:data:`parallm.families.moe_common.GROUPED_MOE_ROWS`).
"""

from __future__ import annotations

from ..model.positions.rope import rope_spec_from_hf_config
from ..model.spec import DecoderSpec
from ..model.positions.yarn import rope_parameters, rotary_dim
from .deepseek_v3 import MTP_ROWS, base_kwargs_without_rope, grouped_moe_spec, mtp_layers_of
from .moe_common import GROUPED_MOE_ROWS, moe_table
from .registry import Family, register

MODEL_TYPES = ("glm4_moe",)
ARCHITECTURES = ("Glm4MoeForCausalLM", "Glm4MoeForSequenceClassification", "Glm4MoeModel")

# transformers' Glm4MoeConfig defaults, for config.json files that leave a key out
GLM_DEFAULTS = dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                    norm_topk_prob=True, n_shared_experts=1, num_nextn_predict_layers=1)
GLM_PARTIAL_ROTARY_FACTOR = 0.5   # Glm4MoeConfig's default (set for configs that give none)


def glm4_moe_spec(config) -> DecoderSpec:
    model_type = getattr(config, "model_type", "glm4_moe")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not a GLM-4.5 config ({', '.join(MODEL_TYPES)})")
    kwargs = base_kwargs_without_rope(config, "glm4_moe")
    head_dim = kwargs["head_dim"]
    params = rope_parameters(config)
    factor = params.pop("partial_rotary_factor", None)
    factor = GLM_PARTIAL_ROTARY_FACTOR if factor is None else float(factor)
    dim = rotary_dim(head_dim, factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotary channels of head_dim={head_dim} (a "
                         "positive even number up to head_dim is needed)")
    if params["rope_type"] == "yarn":
        raise ValueError("GLM-4.5 with yarn RoPE is not supported yet (RoPE kinds: default, linear, dynamic, "
                         "llama3)")
    max_pos = getattr(config, "max_position_embeddings", None)
    rope = rope_spec_from_hf_config({"rope_parameters": params, "max_position_embeddings": max_pos}, dim)
    bias = bool(getattr(config, "attention_bias", False))
    kwargs["rope"] = rope
    return DecoderSpec(**kwargs, qkv_bias=bias, o_bias=False, qk_norm=bool(getattr(config, "use_qk_norm", False)),
                       moe=grouped_moe_spec(config, GLM_DEFAULTS),
                       mtp_layers=mtp_layers_of(config, GLM_DEFAULTS["num_nextn_predict_layers"]))


GLM4_MOE_TABLE = moe_table(GROUPED_MOE_ROWS) + MTP_ROWS

GLM4_MOE = register(Family(
    name="glm4_moe",
    model_types=MODEL_TYPES,
    architectures=ARCHITECTURES,
    spec=glm4_moe_spec,
    table=GLM4_MOE_TABLE,
    causal_architecture="Glm4MoeForCausalLM",
    value_architecture="Glm4MoeForSequenceClassification",
))
