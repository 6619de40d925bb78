"""Qwen3 (``Qwen3ForCausalLM``): LLaMA with an RMSNorm over head_dim on every query and key head (qk-norm)."""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .llama import DECODER_TABLE
from .registry import Family, base_spec_kwargs, layer_windows, qwen_window_types, register


def qwen3_spec(config) -> DecoderSpec:
    windows = layer_windows(config, "Qwen3", default_types=qwen_window_types)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(**base_spec_kwargs(config, "qwen3"), layer_windows=windows, qkv_bias=bias, o_bias=bias,
                       qk_norm=True)


QWEN3 = register(Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3Model"),
    spec=qwen3_spec,
    table=DECODER_TABLE,
    causal_architecture="Qwen3ForCausalLM",
    value_architecture="Qwen3ForSequenceClassification",
))
