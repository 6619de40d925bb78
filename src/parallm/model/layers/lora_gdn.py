"""LoRA on the hybrid Gated DeltaNet families (Qwen3.5 ``qwen3_5``, Qwen3.5-MoE / Qwen3.6 ``qwen3_5_moe``,
Qwen3-Next ``qwen3_next``) as PEFT 0.21 adapts transformers 5's text models, and the language model of the
vision-language wrappers (``qwen3_5_vl`` / ``qwen3_5_moe_vl``: PEFT adapts the same modules under
``model.language_model.``) (read by :func:`parallm.model.layers.lora_plan.layer_slots`).

What PEFT adapts there (names as PEFT matches them):

* the full-attention layers' ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (the generic fused-QKV slots:
  q_proj's rows are per head ``[q_h; gate_h]``, a contiguous block of whole heads per TP rank, as the fused
  QKV's q part holds them);
* the Gated DeltaNet's input projections, each its own adapter: Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` /
  ``in_proj_b`` / ``in_proj_a``, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, all inside parallm's one
  column-parallel ``in_proj`` whose per-rank rows are those of the weight (:func:`gdn_slots`: each adapter's B
  rows laid out by its source's part of the weight's ``FusedSplit``: ``in_proj_qkv``'s ``[q_r; k_r; v_r]``, the
  others plain row splits; Qwen3-Next's rows grouped by key head, a plain split); and ``out_proj``, row parallel;
* the MLPs: Qwen3.5's dense ``gate_proj`` / ``up_proj`` / ``down_proj``; Qwen3.5-MoE's shared expert's only (its
  model type ``qwen3_5_moe_text`` maps to transformers' ``qwen3_5_text`` conversion, for which PEFT has no expert
  retargeting: the stacked routed experts, no nn.Linear, keep no adapter); Qwen3-Next's routed experts only
  (``qwen3_next`` maps to ``qwen2_moe``'s pattern: the MLP names become ``target_parameters`` ``gate_up_proj`` /
  ``down_proj``; see ``PEFT_EXPERT_FAMILIES``);
* ``"all-linear"``: every nn.Linear but the head: on Qwen3.5 exactly the modules above; on the MoE models also
  each layer's ``shared_expert_gate`` (``[1, H]``), and on Qwen3-Next the router's ``gate.weight`` (added as a
  target parameter by PEFT's conversion). parallm adapts neither: :func:`check_hybrid_targets` refuses
  ``"all-linear"`` there, and naming them, with the model's names (name the projections instead). On the
  vision-language wrappers PEFT's ``"all-linear"`` also reaches the vision tower (carried by parallm, never
  trained): refused too, as is a target naming a vision module.
"""

from __future__ import annotations

from ..sharding import Replicated, Split, make_layout
from ..table import resolve_shape

# the Gated DeltaNet's projections as PEFT names them (Qwen3.5's four input projections, Qwen3-Next's two)
GDN_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
# the text models, and the vision-language wrappers (their language model adapted, the vision tower never)
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")
# parallm's Gated DeltaNet parameters that carry adapters (under layers.{l}.)
GDN_ADAPTED = ("self_attention.in_proj.weight", "self_attention.out_proj.weight")


def targeted(config, module: str) -> bool:
    """Whether ``config`` targets Gated DeltaNet module ``module`` (its names, or ``"all-linear"``)."""
    return config.targets(module) or (config.all_linear and module.rsplit(".", 1)[-1] in GDN_LINEAR)


def _refused(spec) -> list[str]:
    """The nn.Linear / parameters PEFT's "all-linear" adapts on this model that parallm does not."""
    out = []
    if spec.moe is not None and spec.moe.shared_expert_gate:
        out.append("shared_expert_gate")
    if spec.family == "qwen3_next" and spec.moe is not None and spec.moe.layers:
        out.append("gate")            # the router's weight: PEFT's conversion adds "gate.weight" as a parameter
    return out


# (id(spec), target_modules) -> spec of the checks passed (the spec kept, so that its id is not reused): the
# check runs once per model and targets, not once per table entry (a released wrapper carries ~330 vision tensors)
_PASSED: dict = {}


def check_hybrid_targets(spec, config) -> None:
    """Refuse (ValueError naming the modules) targets that make PEFT adapt what parallm does not here: on the MoE
    models ``"all-linear"`` (PEFT's adds ``shared_expert_gate``; Qwen3-Next's also the router ``gate``) and those
    names themselves; on the vision-language wrappers ``"all-linear"`` (PEFT's reaches the vision tower's linears)
    and any target naming a vision tensor (the tower is carried, never adapted)."""
    key = (id(spec), config.target_modules)
    if _PASSED.get(key) is spec:
        return
    _check(spec, config)
    if len(_PASSED) > 256:
        _PASSED.clear()
    _PASSED[key] = spec


def _check(spec, config) -> None:
    if spec.carried:
        vision = sorted({n.removesuffix(".weight").rsplit(".", 1)[-1] for n, _ in spec.carried
                         if n.endswith(".weight") and config.targets(n.removesuffix(".weight"))})
        if vision or config.all_linear:
            raise ValueError(f"LoRA on {spec.architecture}'s vision tower is not supported: "
                             f"{'target ' + ', '.join(vision) + ' names its modules' if vision else 'all-linear'} "
                             "(PEFT's 'all-linear' adapts the tower's qkv, proj, linear_fc1, linear_fc2); parallm "
                             "adapts the language model only: name its projections (q_proj, k_proj, v_proj, o_proj, "
                             f"{', '.join(gdn_names(spec))}, gate_proj, up_proj, down_proj)")
    others = _refused(spec)
    layer = spec.moe.layers[0] if spec.moe is not None and spec.moe.layers else 0
    prefix = "model.language_model." if spec.carried else "model."
    named = [m for m in others if config.targets(f"{prefix}layers.{layer}.mlp.{m}")]
    if others and (config.all_linear or named):
        names = ", ".join(f"mlp.{m}" for m in (named or others))
        raise ValueError(f"LoRA on {spec.architecture}'s {names} is not supported (PEFT's 'all-linear' adapts "
                         f"{'them' if len(named or others) > 1 else 'it'}); name the projections instead: q_proj, "
                         "k_proj, v_proj, o_proj, the Gated DeltaNet's "
                         f"{', '.join(gdn_names(spec))} and gate_proj, up_proj, down_proj")


def check_shared_gate_targets(spec, config) -> None:
    """Qwen2-MoE: PEFT's ``"all-linear"`` also adapts each MoE layer's ``shared_expert_gate`` (an
    ``nn.Linear(H, 1)``), which parallm does not: refuse it (and naming it) rather than adapt another set."""
    layer = spec.moe.layers[0] if spec.moe.layers else 0
    if config.all_linear or config.targets(f"model.layers.{layer}.mlp.shared_expert_gate"):
        raise ValueError(f"LoRA on {spec.architecture}'s mlp.shared_expert_gate is not supported (PEFT's "
                         "'all-linear' adapts it); name the projections instead: q_proj, k_proj, v_proj, o_proj, "
                         "gate_proj, up_proj, down_proj")


def gdn_names(spec) -> tuple[str, ...]:
    """The Gated DeltaNet projections of this model, as PEFT names them."""
    if spec.linear_attn is None:
        return ()
    ins = ("in_proj_qkvz", "in_proj_ba") if spec.linear_attn.interleaved else \
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    return ins + ("out_proj",)


def gdn_slots(spec, entry, config, modules, *, sp: bool, slot_cls):
    """``(kind, slots)`` of a Gated DeltaNet layer's ``in_proj`` (``"column"``: one slot per targeted HF input
    projection, A ``[r, H]`` replicated, B split as that projection's rows in the fused weight) or ``out_proj``
    (``"row"``: A split by columns, B replicated); None when nothing of it is targeted. ``modules``: the entry's
    ``[(HF module, leaf)]``; ``slot_cls``: lora_plan's Slot."""
    local = entry.local.split(".", 2)[-1]
    hit = [targeted(config, m) for m, _ in modules]
    if not any(hit):
        return None
    if local == "self_attention.out_proj.weight":
        (m, p), = modules
        rows, cols = resolve_shape(entry.row.shapes[0], spec)
        return "row", [slot_cls(m, p, rows, cols, *config.rank_alpha_scaled(m), Split(1), Replicated(), False,
                                sp)]
    fused = make_layout(entry.row.kind, spec, 0)          # the weight's FusedSplit: (layout, rows) per source
    slots = []
    for (m, p), (layout, rows), h in zip(modules, fused.parts, hit):
        if h:
            slots.append(slot_cls(m, p, rows, spec.hidden_size, *config.rank_alpha_scaled(m), Replicated(), layout,
                                  sp, False))
    return "column", slots
