"""The ``gemma4`` wrapper (``Gemma4ForConditionalGeneration``, every released Gemma 4 checkpoint's architecture):
its language model trained as :mod:`parallm.families.gemma4` runs ``gemma4_text``, named as the checkpoint names
it (``model.language_model.*``; the head tied to ``model.language_model.embed_tokens``), and every other tensor
(``model.vision_tower.*``, ``model.audio_tower.*``, ``model.embed_vision.*``, ``model.embed_audio.*``) carried:
held on the first pipeline stage, loaded, saved and exported bit for bit, never run (docs/families.md, "Gemma 4").
Text only: image / audio inputs are not run (the towers are carried, as Qwen3.5's wrapper carries its vision
tower)."""

from __future__ import annotations

import json
from dataclasses import replace

from .deepseek_v3 import _config_dict
from .gemma4 import GEMMA4_TABLE, gemma4_spec
from .qwen3_5 import _sub_config, vl_table
from .registry import Family, register

LANGUAGE_MODEL = "model.language_model."
_TOWERS_CACHE: dict[str, tuple] = {}


def _as_config(config):
    """A transformers ``Gemma4Config`` (from a config object, a config.json dict or parallm's wrapper of one)."""
    import transformers
    if isinstance(config, transformers.Gemma4Config):
        return config
    raw = _config_dict(config)
    return transformers.Gemma4Config(**{k: v for k, v in raw.items()
                                        if k not in ("model_type", "transformers_version")})


def tower_tensors(config) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every tensor of the wrapper outside its language model and head (names and shapes), as transformers builds
    ``Gemma4ForConditionalGeneration`` from the config (on the meta device: no memory, no weights)."""
    import torch
    import transformers
    cfg = _as_config(config)
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if key not in _TOWERS_CACHE:
        with torch.device("meta"):
            model = transformers.Gemma4ForConditionalGeneration(cfg)
        _TOWERS_CACHE[key] = tuple((k, tuple(t.shape)) for k, t in model.state_dict().items()
                                   if not k.startswith((LANGUAGE_MODEL, "lm_head.")))
    return _TOWERS_CACHE[key]


def gemma4_vl_spec(config):
    """The language model's spec from ``text_config``, named as the wrapper, with the towers carried."""
    text = _sub_config(config, "text_config")
    spec = gemma4_spec(text)
    raw = _config_dict(config)
    archs = raw.get("architectures") or []
    tied = raw.get("tie_word_embeddings")
    return replace(spec, family="gemma4_vl", architecture=archs[0] if archs else "Gemma4ForConditionalGeneration",
                   model_type="gemma4", carried=tower_tensors(config),
                   tie_word_embeddings=spec.tie_word_embeddings if tied is None else bool(tied))


GEMMA4_VL = register(Family(
    name="gemma4_vl",
    model_types=("gemma4",),
    architectures=("Gemma4ForConditionalGeneration", "Gemma4Model"),
    spec=gemma4_vl_spec,
    table=vl_table(GEMMA4_TABLE),
    causal_architecture="Gemma4ForConditionalGeneration",
    value_architecture="Gemma4ForSequenceClassification",
))
