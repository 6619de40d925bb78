"""Qwen3-Next (``Qwen3NextForCausalLM``): the hybrid decoder of :mod:`parallm.families.hybrid_common` (Gated DeltaNet
layers with full-attention ones between them, gated attention output, zero-centred norms, partial RoPE), with
Qwen2-MoE's block on the layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick (softmax top-k,
``norm_topk_prob`` from the config, a shared expert with its sigmoid gate; the others keep a dense MLP).

The Gated DeltaNet's input projections are stored as two tensors whose rows are grouped by key head
(``in_proj_qkvz``: per key head ``[q; k; v of its value heads; z of them]``, ``in_proj_ba``: ``[b; a]``): a
rank's key heads are one contiguous block of each, so both split plainly over TP and the layer un-groups its
block (:mod:`parallm.model.layers.gated_deltanet`).
"""

from __future__ import annotations

from ..model.spec import DecoderSpec
from ..model.table import Row
from .hybrid_common import GDN, H, LINEAR, hybrid_spec, hybrid_table, mtp_tensors, qwen_hybrid_moe
from .moe_common import moe_layers, num_experts_of
from .registry import Family, register

# Qwen3-Next: in_proj_qkvz and in_proj_ba, rows grouped by key head
QWEN3_NEXT_IN_PROJ = Row(
    GDN + "in_proj.weight", (LINEAR + "in_proj_qkvz.weight", LINEAR + "in_proj_ba.weight"), "gdn_in", "layer",
    (("gdn_qkvz_size", H), ("gdn_ba_size", H)), when=("linear_layer",))


def qwen3_next_spec(config) -> DecoderSpec:
    moe = qwen_hybrid_moe(config, moe_layers(config, num_experts_of(config)),
                          norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)))
    return hybrid_spec(config, "qwen3_next", interleaved=True, moe=moe)


QWEN3_NEXT = register(Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    architectures=("Qwen3NextForCausalLM", "Qwen3NextForSequenceClassification", "Qwen3NextModel"),
    spec=qwen3_next_spec,
    table=hybrid_table(QWEN3_NEXT_IN_PROJ, moe=True),
    causal_architecture="Qwen3NextForCausalLM",
    value_architecture="Qwen3NextForSequenceClassification",
    mtp_tensors=mtp_tensors,
))
