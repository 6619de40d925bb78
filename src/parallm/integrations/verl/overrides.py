"""verl's ``model.override_config`` for parallm's engine.

verl's ``HFModelConfig`` applies ``override_config`` (or its ``model_config`` entry, verl's Megatron spelling) to
the transformers config it builds (``hf_config``), and verl's FSDP engine builds its model from that config.
parallm's engine builds from the checkpoint directory's own ``config.json`` (parallm reads the checkpoint's files
for the model's structure, its multi-token-prediction layers and the tokenizer files it copies into HF exports),
so an override that changes the model would be ignored: :func:`check_overrides` refuses it, naming the keys.
Accepted, because they change nothing parallm computes: ``attn_implementation`` (parallm picks its attention kernel
itself: ``attn_impl``), ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (verl sets them from the tokenizer;
the engine pads with ``pad_token_id``, at positions no output is read from), and any override whose value is
already ``config.json``'s.
"""

from __future__ import annotations

import copy

__all__ = ["check_overrides", "unhonoured_overrides"]

NO_EFFECT = ("attn_implementation", "bos_token_id", "eos_token_id", "pad_token_id")


def unhonoured_overrides(model_config) -> list[str]:
    """The config keys that verl's ``override_config`` would change (module docstring), sorted."""
    given = dict(getattr(model_config, "override_config", None) or {})
    given = dict(given.get("model_config", given))        # verl's HFModelConfig reads it so
    rest = {k: v for k, v in given.items() if k not in NO_EFFECT}
    if not rest:
        return []
    from transformers import AutoConfig
    from verl.utils.model import update_model_config
    path = getattr(model_config, "local_hf_config_path", None) or model_config.local_path
    base = AutoConfig.from_pretrained(path, trust_remote_code=getattr(model_config, "trust_remote_code", False))
    changed = copy.deepcopy(base)
    update_model_config(changed, override_config_kwargs=rest)
    before, after = base.to_dict(), changed.to_dict()
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


def check_overrides(model_config) -> None:
    """Raise ``NotImplementedError`` naming the overrides parallm's engine would not honour (module docstring)."""
    keys = unhonoured_overrides(model_config)
    if keys:
        raise NotImplementedError(
            f"parallm engine: model.override_config changes {keys} of {model_config.local_path}'s config.json; "
            "parallm builds the model from that config.json, not from verl's overridden hf_config: write the "
            "values into (a copy of) the checkpoint's config.json instead. Accepted without effect: "
            f"{list(NO_EFFECT)}, and values equal to config.json's")
