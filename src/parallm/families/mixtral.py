"""Mixtral (``MixtralForCausalLM``): Mistral whose every MLP routes over ``num_local_experts`` experts of
``intermediate_size``, top-k softmax weights always renormalised. The Hub names the experts
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) and the router
``block_sparse_moe.gate``. Router jitter (``router_jitter_noise`` > 0, random noise in training) is refused.
"""

from __future__ import annotations

from ..model.spec import DecoderSpec
from .moe_common import moe_rows, moe_spec, moe_table, num_experts_of
from .mistral import mistral_spec
from .registry import Family, register

MIXTRAL_TABLE = moe_table(moe_rows("model.layers.{i}.block_sparse_moe.", router="gate.weight",
                                   gate="experts.{e}.w1.weight", up="experts.{e}.w3.weight",
                                   down="experts.{e}.w2.weight"))


def mixtral_spec(config) -> DecoderSpec:
    jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise ValueError(f"Mixtral with router_jitter_noise={jitter} is not supported (parallm routes "
                         "deterministically); set it to 0")
    experts = num_experts_of(config)
    moe = moe_spec(config, num_experts=experts, expert_intermediate_size=getattr(config, "intermediate_size", None),
                   norm_topk_prob=True, layers=tuple(range(int(config.num_hidden_layers))) if experts else ())
    return mistral_spec(config, "mixtral", moe=moe)


MIXTRAL = register(Family(
    name="mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM", "MixtralForSequenceClassification", "MixtralModel"),
    spec=mixtral_spec,
    table=MIXTRAL_TABLE,
    causal_architecture="MixtralForCausalLM",
    value_architecture="MixtralForSequenceClassification",
))
