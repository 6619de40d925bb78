"""Mistral (``MistralForCausalLM``): LLaMA without biases, plus an optional sliding window.

parallm runs full causal attention, which equals sliding-window attention for sequences no longer than the window;
longer sequences are refused by forward / forward_backward (``DecoderSpec.sliding_window``).
"""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .llama import DECODER_TABLE
from .registry import Family, base_spec_kwargs, register


def mistral_spec(config, family: str = "mistral", **extra) -> DecoderSpec:
    """Also Mixtral's base (``family``, and its ``moe`` in ``extra``)."""
    window = getattr(config, "sliding_window", None)
    return DecoderSpec(**base_spec_kwargs(config, family), sliding_window=int(window) if window else None, **extra)


MISTRAL = register(Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM", "MistralForSequenceClassification", "MistralModel"),
    spec=mistral_spec,
    table=DECODER_TABLE,
    causal_architecture="MistralForCausalLM",
    value_architecture="MistralForSequenceClassification",
))
