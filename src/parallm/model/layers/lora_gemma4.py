"""What LoRA on Gemma 4 adapts beyond the attention / MLP projections and what it refuses (read by
:func:`parallm.model.layers.lora_plan.layer_slots`).

Routed experts (the MoE block beside the MLP, transformers' stacked ``experts.gate_up_proj [E, 2 I, H]`` /
``experts.down_proj [E, H, I]``): PEFT 0.21 has no conversion pattern for gemma4, so its ``target_modules``
(``gate_proj`` / ``up_proj`` / ``down_proj``) adapt the layer's dense MLP only; the experts are adapted through
``target_parameters`` (a ``ParamWrapper`` per stacked parameter, rank ``r`` each: gate_up's B ``[2 I, r E]``
over the ``[gate; up]`` rows, down's A ``[r E, I]``). parallm takes them as ``target_modules`` entries
``"experts.gate_up_proj"`` / ``"experts.down_proj"`` (PEFT's target_parameters spelling; bare ``"gate_up_proj"``
too, which names nothing else). A bare ``"down_proj"`` names the dense MLP's nn.Linear only, as PEFT's
``target_modules`` does; a regex ``target_modules`` never reaches the experts (PEFT matches regexes against
modules only)."""

from __future__ import annotations

# the families of the Gemma 4 text model: the text checkpoint and the multimodal wrapper's language model
GEMMA4_FAMILIES = ("gemma4", "gemma4_vl")
# Gemma 4: the nn.Linear modules PEFT's "all-linear" adapts beyond the attention / MLP projections (the per-layer
# inputs' and the router's), which parallm does not adapt: refused (see check_gemma4_targets)
GEMMA4_OTHER_LINEAR = ("per_layer_model_projection", "per_layer_input_gate", "per_layer_projection", "router.proj")
# the routed experts' stacked parameters (PEFT's target_parameters) as parallm's target_modules name them
GEMMA4_EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
# what a saved adapter_config.json of the gemma4 wrapper (Gemma4ForConditionalGeneration) excludes, so that PEFT
# adapts exactly what parallm did: the vision / audio towers hold q/k/v/o_proj, gate/up/down_proj too
# (Gemma4ClippableLinear, which PEFT 0.21 refuses: "Target module ... is not supported"), and "all-linear" would
# reach their inner nn.Linear and the embed_vision / embed_audio projections. parallm never adapts them.
GEMMA4_VL_PEFT_EXCLUDE = r".*\.(vision_tower|audio_tower|embed_vision|embed_audio)(\..*)?"


def check_gemma4_targets(spec, config) -> None:
    """Gemma 4: PEFT's "all-linear" also adapts the per-layer inputs' linears (``per_layer_model_projection``,
    each layer's ``per_layer_input_gate`` / ``per_layer_projection``) and the MoE router's ``proj``, which parallm
    does not adapt: refused (with the model's names) rather than adapting less than PEFT would; naming them is
    refused too."""
    others = [m for m in GEMMA4_OTHER_LINEAR
              if (m.startswith("per_layer") and spec.per_layer_input_size) or (m == "router.proj" and spec.moe)]
    named = [m for m in others for lm in ("model.", "model.language_model.")
             if config.targets(f"{lm}layers.0.{m}") or config.targets(f"{lm}{m}")]
    if others and (config.all_linear or named):
        raise ValueError(f"LoRA on Gemma 4's {', '.join(named or others)} is not supported (PEFT's 'all-linear' "
                         "adapts them); name the attention / MLP projections instead (q/k/v/o_proj, gate/up/down_proj"
                         "; the routed experts: experts.gate_up_proj, experts.down_proj)")


def gemma4_expert_hit(config, fused: str) -> bool:
    """Whether ``config`` targets the routed experts' stacked parameter ``fused``
    (``model.layers.3.experts.down_proj``): a name of the tuple equal to it or a dotted suffix of it with the
    ``experts.`` component (``"experts.down_proj"``), or the bare ``"gate_up_proj"`` (see the module doc)."""
    t = config.target_modules
    if isinstance(t, str):
        return False
    return any(x not in ("down_proj", "all-linear") and (fused == x or fused.endswith("." + x)) for x in t)
