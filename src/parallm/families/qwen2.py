"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): LLaMA with a bias on q, k and v (none on o_proj or the MLP)."""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .llama import DECODER_TABLE
from .registry import Family, base_spec_kwargs, layer_windows, qwen_window_types, register


def qwen2_spec(config) -> DecoderSpec:
    windows = layer_windows(config, "Qwen2", default_types=qwen_window_types)
    return DecoderSpec(**base_spec_kwargs(config, "qwen2"), layer_windows=windows, qkv_bias=True, o_bias=False,
                       mlp_bias=False)


QWEN2 = register(Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2Model"),
    spec=qwen2_spec,
    table=DECODER_TABLE,
    causal_architecture="Qwen2ForCausalLM",
    value_architecture="Qwen2ForSequenceClassification",
))
