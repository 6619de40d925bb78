"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): LLaMA with a bias on q, k and v (none on o_proj or the MLP)."""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .llama import DECODER_TABLE
from .registry import Family, base_spec_kwargs, register


def _sliding_layers(config) -> list[int]:
    """Layers transformers would run with sliding-window attention (none unless use_sliding_window)."""
    types = getattr(config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not getattr(config, "use_sliding_window", False):
        return []
    first = getattr(config, "max_window_layers", 0) or 0
    return list(range(first, int(config.num_hidden_layers)))


def qwen2_spec(config) -> DecoderSpec:
    sliding = _sliding_layers(config)
    if sliding:
        raise ValueError(f"Qwen2 with sliding-window attention on layers {sliding[:8]} is not supported "
                         "(use_sliding_window=True with max_window_layers < num_hidden_layers); parallm runs full "
                         "causal attention")
    return DecoderSpec(**base_spec_kwargs(config, "qwen2"), qkv_bias=True, o_bias=False, mlp_bias=False)


QWEN2 = register(Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2Model"),
    spec=qwen2_spec,
    table=DECODER_TABLE,
    causal_architecture="Qwen2ForCausalLM",
    value_architecture="Qwen2ForSequenceClassification",
))
