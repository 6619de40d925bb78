"""parallm's own options for the verl engine (the layout and model options verl's FSDP config has no field for).

One function, :func:`parallm_options`, read once by every engine at construction; where the options come from
is its business alone, so that source can change without touching the engine. Two sources (docs/verl.md):

* verl's config, when the engine config is parallm's own (:class:`~parallm.integrations.verl.config.
  ParallmEngineConfig`: ``engine=parallm`` in verl's SFT trainer, ``model_engine=parallm`` in its PPO trainer):
  ``tensor_model_parallel_size`` ... ``expert_model_parallel_size``, ``dtype``, ``recompute``, ``packed``,
  ``attn_impl`` of that block;
* the environment variable ``PARALLM_VERL_CONFIG`` (a JSON object, ``{"tp": 2, ...}``): the only source when
  verl hands the engine its FSDP config (``actor_rollout_ref.actor.strategy=parallm``), and an override of verl's
  config otherwise: each key it names wins over the config's value, with a warning naming both values whenever
  they differ.
"""

from __future__ import annotations

import json
import logging
import os

from .config import LAYOUT_KEYS, ParallmEngineConfig

__all__ = ["parallm_options"]

logger = logging.getLogger("parallm")
_DEFAULTS = {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "ep": 1, "dtype": "float32", "recompute": None,
             "packed": False, "attn_impl": "auto"}


def _from_environment() -> dict:
    """``PARALLM_VERL_CONFIG`` (JSON), the keys it names; unknown keys refused."""
    raw = os.environ.get("PARALLM_VERL_CONFIG", "").strip()
    given = json.loads(raw) if raw else {}
    if not isinstance(given, dict):
        raise ValueError(f"PARALLM_VERL_CONFIG must be a JSON object, got {raw!r}")
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"PARALLM_VERL_CONFIG: unknown key(s) {unknown}; known: {sorted(_DEFAULTS)}")
    return given


def parallm_options(engine_config=None) -> dict:
    """parallm's block for the engine: the defaults, then verl's config when ``engine_config`` is a
    :class:`ParallmEngineConfig`, then ``PARALLM_VERL_CONFIG`` (each key it names wins; a value that differs from
    verl's config is logged as a warning naming the verl key and both values)."""
    options = dict(_DEFAULTS)
    from_config = engine_config.parallm_options() if isinstance(engine_config, ParallmEngineConfig) else {}
    options.update(from_config)
    env = _from_environment()
    if from_config:
        verl_key = {opt: key for key, opt in LAYOUT_KEYS.items()}
        for opt, value in env.items():
            if value != from_config[opt]:
                logger.warning("parallm engine: PARALLM_VERL_CONFIG sets %s=%r, which overrides verl's config "
                               "(%s=%r)", opt, value, verl_key[opt], from_config[opt])
    options.update(env)
    return options
