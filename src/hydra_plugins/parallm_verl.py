"""Hydra search-path plugin of parallm: puts parallm's config groups for verl (``engine/parallm``,
``optim/parallm``, ``actor/parallm_actor``, ``ref/parallm_ref``, ``critic/parallm_critic``,
``model_engine/parallm``; in ``parallm/integrations/verl/config``) on the search path of verl's Hydra apps, so that
``model_engine=parallm`` (verl's PPO trainer) and ``engine=parallm optim=parallm`` (verl's SFT trainer) work with
nothing else on the command line (docs/verl.md).

Hydra imports every module of the ``hydra_plugins`` namespace package in every Hydra app, so this module imports
nothing but Hydra, and finds parallm's directory without importing parallm (``importlib.util.find_spec``). It acts
only on apps whose primary config is verl's (``verl/trainer/config``) and appends (after verl's own groups: no
verl config is shadowed, only options named ``parallm`` are added).
"""

from __future__ import annotations

import importlib.util
import os
import re

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

_VERL_CONFIG = re.compile(r"verl[./\\]trainer[./\\]config/?$")


def parallm_verl_config_dir() -> str | None:
    """The directory of parallm's verl config groups, or None when parallm is not importable here."""
    spec = importlib.util.find_spec("parallm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "integrations", "verl", "config")
        if os.path.isdir(os.path.join(path, "engine")):
            return path
    return None


class ParallmVerlSearchPathPlugin(SearchPathPlugin):
    """Appends ``file://<parallm>/integrations/verl/config`` to a verl app's config search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if not any(_VERL_CONFIG.search(e.path or "") for e in search_path.get_path()):
            return
        path = parallm_verl_config_dir()
        if path is not None:
            search_path.append(provider="parallm", path="file://" + path)
