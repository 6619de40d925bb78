"""What LoRA on Gemma 4 refuses (read by :func:`parallm.model.layers.lora_plan.layer_slots`): the nn.Linear
modules beyond the attention / MLP projections that PEFT's "all-linear" would adapt and parallm does not."""

from __future__ import annotations

# Gemma 4: the nn.Linear modules PEFT's "all-linear" adapts beyond the attention / MLP projections (the per-layer
# inputs' and the router's), which parallm does not adapt: refused (see check_gemma4_targets)
GEMMA4_OTHER_LINEAR = ("per_layer_model_projection", "per_layer_input_gate", "per_layer_projection", "router.proj")


def check_gemma4_targets(spec, config) -> None:
    """Gemma 4: PEFT's "all-linear" also adapts the per-layer inputs' linears (``per_layer_model_projection``,
    each layer's ``per_layer_input_gate`` / ``per_layer_projection``) and the MoE router's ``proj``, which parallm
    does not adapt: refused (with the model's names) rather than adapting less than PEFT would; naming them is
    refused too."""
    others = [m for m in GEMMA4_OTHER_LINEAR
              if (m.startswith("per_layer") and spec.per_layer_input_size) or (m == "router.proj" and spec.moe)]
    t = config.target_modules
    named = [m for m in others if config.targets(f"model.layers.0.{m}") or config.targets(f"model.{m}")]
    if others and (t == "all-linear" or (not isinstance(t, str) and "all-linear" in t) or named):
        raise ValueError(f"LoRA on Gemma 4's {', '.join(named or others)} is not supported (PEFT's 'all-linear' "
                         "adapts them); name the attention / MLP projections instead (q/k/v/o_proj, gate/up/down_proj)")
