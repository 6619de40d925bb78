"""A CPU platform for verl (``verl.plugin.platform``), so that verl's trainer, its workers and its engines run on
CPU processes with gloo.

verl reaches the device only through its platform object (``verl.utils.device`` delegates every call to
``get_platform()``), and its registry takes platforms from outside verl: importing
:mod:`parallm.integrations.verl` registers :class:`PlatformCPU` under the name ``"cpu"``, and
``VERL_PLATFORM=cpu`` selects it (verl resolves the platform once per process, on first use).

What the platform answers, and why:

* ``device_name`` ``"cpu"``, and ``current_device()`` the string ``"cpu"`` (not an index): verl moves tensors with
  ``tensor.to(get_device_id())``, where an int would mean ``cuda:<int>``.
* ``communication_backend_name`` ``"gloo"``.
* ``device_module``: :data:`cpu_device_module`, ``torch.cpu`` (streams, events, ``synchronize``, ``device_count``)
  plus what verl calls on ``torch.cuda`` that ``torch.cpu`` lacks: memory figures (``memory_allocated`` and its
  ``max_`` / ``reserved`` forms report this process's resident set size, ``mem_get_info`` the machine's available
  and total memory: a CPU has no caching allocator to ask), ``empty_cache`` (nothing to release), RNG
  (``manual_seed`` / ``get_rng_state`` / ``set_rng_state``: the CPU generator, which is the one CPU ops draw from).
* Ray: the accelerator resource is ``"GPU"``: verl's resource pools ask Ray for GPUs per worker, so a CPU run
  starts Ray with ``num_gpus`` set to the number of CPU ranks (``ray_kwargs.ray_init.num_gpus``), each "GPU" a slot
  for one training rank. Ray then sets ``CUDA_VISIBLE_DEVICES`` per worker, which a CPU build of torch ignores.
* No CUDA IPC (``is_ipc_supported`` False): verl's vLLM weight transfer then goes through shared memory.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["PlatformCPU", "cpu_device_module", "register_platform"]


def _rss() -> int:
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:    # psutil is a verl dependency; resource as a fallback (peak, in KiB on Linux)
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mem_get_info(device=None) -> tuple[int, int]:
    import psutil
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _make_device_module() -> types.ModuleType:
    mod = types.ModuleType("parallm_verl_cpu_device")
    mod.__doc__ = "torch.cpu plus the torch.cuda calls verl makes that torch.cpu lacks (see platform.py)."
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: "cpu"
    mod.set_device = lambda device=None: None
    mod.is_initialized = lambda: True
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(mod, name, lambda device=None: _rss())
    mod.mem_get_info = _mem_get_info
    mod.memory_stats = lambda device=None: {}
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.reset_max_memory_allocated = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.ipc_collect = lambda: None
    mod.manual_seed = lambda seed: torch.manual_seed(seed)
    mod.manual_seed_all = lambda seed: torch.manual_seed(seed)
    mod.seed = torch.seed
    mod.initial_seed = torch.initial_seed
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_capability = lambda device=None: (None, None)
    return mod


cpu_device_module = _make_device_module()


class PlatformCPU(PlatformBase):
    """verl's platform for CPU processes (gloo); see :mod:`parallm.integrations.verl.platform`."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return cpu_device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # never auto-detected: a CUDA machine must keep verl's own choice; VERL_PLATFORM=cpu selects this one
        return False

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float):
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def cudart(self):
        return None


def register_platform() -> type:
    """Register :class:`PlatformCPU` with verl's ``PlatformRegistry`` as ``"cpu"`` (idempotent)."""
    if PlatformRegistry.get("cpu") is not PlatformCPU:
        PlatformRegistry.register(platform="cpu")(PlatformCPU)
    return PlatformCPU
