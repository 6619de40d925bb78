"""Mistral (``MistralForCausalLM``): LLaMA without biases, plus an optional sliding window on every layer
(``sliding_window``; transformers' Mistral ignores ``layer_types``): ``DecoderSpec.layer_windows``, run in every
layout (docs/families.md).
"""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .llama import DECODER_TABLE
from .registry import Family, base_spec_kwargs, layer_windows, register


def mistral_spec(config, family: str = "mistral", **extra) -> DecoderSpec:
    """Also Mixtral's base (``family``, and its ``moe`` in ``extra``)."""
    windows = layer_windows(config, family.capitalize(), every_layer=True)
    return DecoderSpec(**base_spec_kwargs(config, family), layer_windows=windows, **extra)


MISTRAL = register(Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM", "MistralForSequenceClassification", "MistralModel"),
    spec=mistral_spec,
    table=DECODER_TABLE,
    causal_architecture="MistralForCausalLM",
    value_architecture="MistralForSequenceClassification",
))
