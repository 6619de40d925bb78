"""LoRA adapters into an in-process vLLM engine: :func:`push_adapter`.

An engine that serves LoRA (``launch(..., enable_lora=True, max_lora_rank=...)``) receives the adapter alone:
``export_adapter_tensors`` (PEFT's names, a few MB) written as a PEFT directory on the engine's rank and handed
to vLLM as a ``LoRARequest`` with ``load_inplace=True``, so the next request that names it reloads it; the engine's
prefix cache is reset (checked), since vLLM keys cached blocks by the adapter's unchanged name and path. An engine
without LoRA receives the merged weights (``W + B A alpha / r``) through :func:`push_weights` instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref

import torch

from ...checkpoint.lora_io import export_adapter_tensors, peft_config_dict, write_peft_dir
from ...model.layers.lora import global_entries, lora_config_of
from ...model.layers.lora_merge import merged_weights
from ...parallel.errors import gather_objects, run_local
from ...parallel.state import as_chunks, dims_of, require_initialized
from .client import Connection
from .push import push_weights
from .unsupported import refuse_family

__all__ = ["push_adapter"]

LORA_ID = 1                   # the LoRARequest id parallm's adapter takes in an engine (one adapter per engine)


def _engine_lora(llm) -> tuple[bool, int, bool]:
    """(whether the engine serves LoRA, its max_lora_rank, whether it takes stacked 3-D expert factors)."""
    config = getattr(getattr(llm.llm_engine, "vllm_config", None), "lora_config", None)
    return (config is not None, int(getattr(config, "max_lora_rank", 0) or 0),
            bool(getattr(config, "enable_mixed_moe_lora_format", False)))


def _has_experts(chunks) -> bool:
    chunk = as_chunks(chunks)[0]
    return any(e.index is not None for e, _, _ in global_entries(chunk.spec, chunk.table, chunk.task, chunk.dims,
                                                                 lora_config_of(chunks)))


def _largest_rank(chunks) -> int:
    chunk = as_chunks(chunks)[0]
    return max(s.r for _, s, _ in global_entries(chunk.spec, chunk.table, chunk.task, chunk.dims,
                                                 lora_config_of(chunks)))


def _adapter_dir(llm) -> str:
    """The directory the engine's adapter is written to (made once per engine; removed when the engine object is
    collected or at interpreter exit, which a process ended by ``os._exit`` skips): in shared memory when the
    machine has it."""
    path = getattr(llm, "_parallm_lora_dir", None)
    if path is None:
        parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        root = tempfile.mkdtemp(prefix="parallm-lora-", dir=parent)
        path = os.path.join(root, "adapter")
        llm._parallm_lora_dir = path
        weakref.finalize(llm, shutil.rmtree, root, True)
    return path


def push_adapter(chunks, llm, *, rank: int = 0, name: str = "parallm", dtype: torch.dtype | None = None,
                 bucket_bytes=None) -> dict:
    """Bring the engine on global rank ``rank`` (a ``vllm.LLM`` from :func:`launch`, None on the other ranks) up to
    the model's adapters. Collective: every rank calls it.

    An engine serving LoRA: the adapter is gathered (:func:`parallm.export_adapter_tensors`), written as a PEFT
    directory on rank ``rank`` (a temporary directory kept for the engine, replaced at every push) and
    ``stats["lora_request"]`` is a ``vllm.lora.request.LoRARequest(name, 1, directory, load_inplace=True)`` on
    that rank (None elsewhere): pass it to ``llm.generate(..., lora_request=...)``, which loads the new adapter.
    The engine's ``max_lora_rank`` must hold the adapters' largest rank (2 r for routed experts' gate_up); with
    routed experts' factors it needs ``enable_mixed_moe_lora_format=True`` (the request then says
    ``is_3d_lora_weight=True``; vLLM runs MoE LoRA with Triton kernels: GPU only, never run here).
    An engine without LoRA, or engines in other processes (a :func:`connect` connection: loading an adapter into them
    is not implemented): :func:`push_weights` of the merged weights (``stats["mode"] == "merged"``).
    Returns ``{"mode": "adapter" | "merged", "bytes", "seconds", "lora_request", ...}``. Errors (no adapters, no
    engine on ``rank``, a rank too large for the engine) are raised on every rank."""
    require_initialized("push_adapter")
    chunks = as_chunks(chunks)
    refuse_family(chunks[0].spec.family, "push_adapter", local=not isinstance(llm, Connection))
    dims = dims_of(chunks)

    def check_model():
        if lora_config_of(chunks) is None:
            raise ValueError("push_adapter: the model has no LoRA adapters (use push_weights)")
        if not isinstance(rank, int) or not 0 <= rank < dims.world:
            raise ValueError(f"push_adapter: rank={rank!r} is not a rank of the world (0..{dims.world - 1})")
    run_local(check_model, what="push_adapter")
    if isinstance(llm, Connection):       # engines in other processes: the merged weights (no adapter loading yet)
        with merged_weights(chunks):
            stats = push_weights(chunks, llm, dtype=dtype, bucket_bytes=bucket_bytes)
        return dict(stats, mode="merged", lora_request=None)
    experts = _has_experts(chunks)
    info = gather_objects(_engine_lora(llm) if llm is not None else None, what="push_adapter")[rank]

    def check_engine():
        if info is None:
            raise ValueError(f"push_adapter: no engine on rank {rank} (pass the vllm.LLM there, None elsewhere)")
        if info[0] and _largest_rank(chunks) > info[1]:
            raise ValueError(f"push_adapter: the adapters' largest rank is {_largest_rank(chunks)}, the engine's "
                             f"max_lora_rank {info[1]}; launch it with max_lora_rank >= {_largest_rank(chunks)}")
        if info[0] and experts and not info[2]:
            raise ValueError("push_adapter: the adapters hold routed experts' factors, stacked as PEFT writes them "
                             "for transformers 5; launch the engine with enable_mixed_moe_lora_format=True (vLLM "
                             "then takes them with is_3d_lora_weight=True; its MoE LoRA kernels need Triton: "
                             "not on vLLM's CPU build)")
    run_local(check_engine, what="push_adapter")
    if not info[0]:
        with merged_weights(chunks):
            stats = push_weights(chunks, llm, rank=rank, dtype=dtype, bucket_bytes=bucket_bytes)
        return dict(stats, mode="merged", lora_request=None)
    start = time.perf_counter()
    tensors = dict(export_adapter_tensors(chunks, dtype=dtype))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def write():
        if dims.rank != rank:
            return None
        from vllm.lora.request import LoRARequest
        path = _adapter_dir(llm)
        write_peft_dir(path, tensors, peft_config_dict(chunks))
        # vLLM's prefix cache keys blocks by the adapter's name and path, both unchanged: the blocks cached under
        # the old adapter would be reused
        if not llm.reset_prefix_cache():
            raise RuntimeError(f"push_adapter: the engine on rank {rank} refused to reset its prefix cache (blocks "
                               "in use: requests ran during the push); its cached prompt prefixes would keep keys "
                               "and values of the old adapter")
        return LoRARequest(lora_name=name, lora_int_id=LORA_ID, lora_path=path, load_inplace=True,
                           is_3d_lora_weight=experts)
    request = run_local(write, what="push_adapter")
    seconds = time.perf_counter() - start
    return {"mode": "adapter", "bytes": nbytes, "seconds": seconds, "tensors": len(tensors),
            "gbps": nbytes / seconds / 1e9 if seconds > 0 else float("inf"), "lora_request": request}
