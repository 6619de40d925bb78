"""DeepSeek-V4's mixture of experts (transformers 5.25 ``DeepseekV4SparseMoeBlock``): the :class:`MoESpec` read
from a config (:func:`v4_moe_spec`) and the MoE rows of the weight table (:data:`V4_MOE_ROWS`), which the V4
family file combines with its attention and hyper-connection rows.

* **Every layer is MoE**; ``mlp_layer_types[i]`` says how layer i chooses its experts: ``"moe"``, the top-k of
  ``sqrt(softplus(x W^T)) + e_score_correction_bias``; ``"hash_moe"``, the frozen int64 table
  ``tid2eid[token_id]`` ``[vocab, top_k]``. Both weight the chosen experts by their unbiased scores / (their sum
  + 1e-20) * ``routed_scaling_factor`` (``norm_topk_prob`` is not read: transformers always renormalises).
* **Experts**: ``n_routed_experts`` of ``moe_intermediate_size``, ``silu(clamp(gate, max=L)) * clamp(up, -L, L)``
  (``swiglu_limit``); **one shared expert** of ``moe_intermediate_size`` with the same clamps (transformers builds
  one whatever ``n_shared_experts`` says: a config with another value is refused rather than read two ways).
* **Load-balancing loss** (``output_router_logits``, ``router_aux_loss_coef``): transformers'
  ``load_balancing_loss_func`` over the top-k layers' router logits (softmax and its top-k), hash layers left out.

Checkpoint names (what ``save_pretrained`` writes; transformers renames ``ffn.`` to ``mlp.`` and fuses the experts
in memory, names the rows accept too)::

    model.layers.{i}.ffn.gate.weight                  [E, H]          router (model dtype)
    model.layers.{i}.ffn.gate.bias                    [E]             correction bias, fp32 ("moe" layers)
    model.layers.{i}.ffn.gate.tid2eid                 [vocab, top_k]  int64 ("hash_moe" layers)
    model.layers.{i}.ffn.experts.{e}.w1 / w3.weight   [I, H]          gate / up
    model.layers.{i}.ffn.experts.{e}.w2.weight        [H, I]          down
    model.layers.{i}.ffn.shared_experts.w1 / w3 / w2.weight
"""

from __future__ import annotations

from ..model.spec import MoESpec
from ..model.table import Row
from .moe_common import aux_loss_coef

H, EI, SI, E, V, K = ("hidden_size", "expert_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                      "vocab_size", "moe_top_k")
BLOCK = "model.layers.{i}.ffn."          # the checkpoint's names
MEMORY = "model.layers.{i}.mlp."         # transformers' in-memory names (a state dict, fused experts)
MLP = "layers.{l}.mlp."

MLP_LAYER_TYPES = ("hash_moe", "moe")

V4_MOE_ROWS = (
    Row(MLP + "router.weight", (BLOCK + "gate.weight",), "copy", "layer", ((E, H),), when=("moe_layer",),
        tp_sum="sp", fused=(MEMORY + "gate.weight",)),
    Row(MLP + "router.e_score_correction_bias", (BLOCK + "gate.bias",), "copy", "layer", ((E,),),
        when=("moe_layer", "topk_layer"), trained=False, keep_fp32=True,
        fused=(MEMORY + "gate.e_score_correction_bias",)),
    Row(MLP + "router.tid2eid", (BLOCK + "gate.tid2eid",), "copy", "layer", ((V, K),),
        when=("moe_layer", "hash_layer"), trained=False, integer=True, fused=(MEMORY + "gate.tid2eid",)),
    Row(MLP + "experts.linear_fc1.weight", (BLOCK + "experts.{e}.w1.weight", BLOCK + "experts.{e}.w3.weight"),
        "gate_up", "layer", ((EI, H), (EI, H)), when=("moe_layer",), per_expert=True,
        fused=(MEMORY + "experts.gate_up_proj",)),
    Row(MLP + "experts.linear_fc2.weight", (BLOCK + "experts.{e}.w2.weight",), "row", "layer", ((H, EI),),
        when=("moe_layer",), per_expert=True, fused=(MEMORY + "experts.down_proj",)),
    Row(MLP + "shared_experts.linear_fc1.weight", (BLOCK + "shared_experts.w1.weight",
                                                   BLOCK + "shared_experts.w3.weight"), "gate_up", "layer",
        ((SI, H), (SI, H)), when=("moe_layer", "shared_expert"),
        fused=(MEMORY + "shared_experts.gate_proj.weight", MEMORY + "shared_experts.up_proj.weight")),
    Row(MLP + "shared_experts.linear_fc2.weight", (BLOCK + "shared_experts.w2.weight",), "row", "layer",
        ((H, SI),), when=("moe_layer", "shared_expert"), fused=(MEMORY + "shared_experts.down_proj.weight",)),
)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def v4_moe_spec(config) -> MoESpec:
    """The :class:`MoESpec` of a ``DeepseekV4Config`` (or a config object with its fields), every field checked:
    a ValueError names what parallm would otherwise compute differently from transformers."""
    get = lambda key, default=None: getattr(config, key, default)      # noqa: E731
    n = get("num_hidden_layers")
    experts, top_k, width = get("n_routed_experts", get("num_local_experts")), get("num_experts_per_tok"), \
        get("moe_intermediate_size")
    bad = [f"{k}={v!r}" for k, v in (("num_hidden_layers", n), ("n_routed_experts", experts),
                                     ("num_experts_per_tok", top_k), ("moe_intermediate_size", width))
           if not _positive_int(v)]
    if bad:
        raise ValueError(f"invalid DeepSeek-V4 MoE config: {', '.join(bad)} (positive integers expected)")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    scoring = get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"scoring_func={scoring!r}: parallm implements DeepSeek-V4's 'sqrtsoftplus' router only")
    limit, scale = get("swiglu_limit"), get("routed_scaling_factor", 1.0)
    if not _positive(limit):
        raise ValueError(f"swiglu_limit={limit!r}: DeepSeek-V4's clamped experts need a positive limit")
    if not _positive(scale):
        raise ValueError(f"routed_scaling_factor={scale!r}: a positive number expected")
    shared = get("n_shared_experts", 1)
    if shared != 1:
        raise ValueError(f"n_shared_experts={shared!r}: transformers builds one shared expert of "
                         f"moe_intermediate_size={width} whatever this says; parallm refuses any value but 1")
    if get("hidden_act", "silu") != "silu" or get("mlp_bias", False):
        raise ValueError(f"DeepSeek-V4's experts are bias-free SiLU MLPs (hidden_act={get('hidden_act')!r}, "
                         f"mlp_bias={get('mlp_bias')!r})")
    kinds = list(get("mlp_layer_types") or ())
    if len(kinds) != n or any(k not in MLP_LAYER_TYPES for k in kinds):
        raise ValueError(f"mlp_layer_types={kinds!r}: one of {MLP_LAYER_TYPES} per layer "
                         f"(num_hidden_layers={n}) expected")
    return MoESpec(num_experts=experts, top_k=top_k, expert_intermediate_size=width, norm_topk_prob=True,
                   layers=tuple(range(n)), shared_expert_intermediate_size=width, aux_loss_coef=aux_loss_coef(config),
                   router="sqrtsoftplus", routed_scaling_factor=float(scale), score_bias=True,
                   activation="clamped_silu", swiglu_limit=float(limit), shared_expert_limit=float(limit),
                   hash_layers=tuple(i for i, k in enumerate(kinds) if k == "hash_moe"))
