"""parallm as verl's training engine, and a CPU platform for verl (verl 0.9.1 exactly; docs/verl.md).

Importing this package (verl does it in every process when ``VERL_USE_EXTERNAL_MODULES=parallm.integrations.verl``)
checks the verl version, applies the narrow CPU workarounds of :mod:`.fixes`, registers the CPU platform of
:mod:`.platform` (selected with ``VERL_PLATFORM=cpu``) and registers parallm's engines with verl's
``EngineRegistry`` as backend ``"parallm"`` (``actor_rollout_ref.actor.strategy=parallm``) once verl's engine
package is imported. ``import parallm`` never imports this package nor verl.
"""

from __future__ import annotations

from . import fixes as _fixes

_fixes.apply()

from .platform import PlatformCPU, register_platform  # noqa: E402

register_platform()

__all__ = ["PlatformCPU", "register_platform", "VERL_VERSION"]
VERL_VERSION = _fixes.VERL_VERSION


def _register_engines(_module) -> None:
    # .engine registers the engines when its import completes; imported first, it is the one importing verl's
    # engine package, and this gets its half-built module: its own end registers them
    import importlib
    importlib.import_module(__name__ + ".engine")


_fixes.after_import("verl.workers.engine", _register_engines)


def __getattr__(name):
    if name in ("ParallmEngine", "ParallmEngineWithLMHead", "ParallmEngineWithValueHead"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)
