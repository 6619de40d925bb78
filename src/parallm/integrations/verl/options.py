"""parallm's own options for the verl engine (the layout and model options verl's config has no field for).

One function, :func:`parallm_options`, read once by every engine at construction; where the options come from
is its business alone (today the ``PARALLM_VERL_CONFIG`` environment variable, docs/verl.md), so that source can
change without touching the engine.
"""

from __future__ import annotations

import json
import os

__all__ = ["parallm_options"]

_DEFAULTS = {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "ep": 1, "dtype": "float32", "recompute": None,
             "packed": False, "attn_impl": "auto"}


def parallm_options() -> dict:
    """parallm's block for the engine: ``PARALLM_VERL_CONFIG`` (JSON) over the defaults; unknown keys refused."""
    raw = os.environ.get("PARALLM_VERL_CONFIG", "").strip()
    given = json.loads(raw) if raw else {}
    if not isinstance(given, dict):
        raise ValueError(f"PARALLM_VERL_CONFIG must be a JSON object, got {raw!r}")
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"PARALLM_VERL_CONFIG: unknown key(s) {unknown}; known: {sorted(_DEFAULTS)}")
    return {**_DEFAULTS, **given}
