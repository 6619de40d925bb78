"""Process groups: torch.distributed start-up and Megatron-core's model-parallel groups.

parallm never computes global ranks by arithmetic: every "which rank is my peer" question goes to
``megatron.core.parallel_state`` or to ``torch.distributed.get_process_group_ranks`` (predecessor trap 9).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("PARALLM_TIMEOUT_S", "600"))


def _import_parallel_state():
    from ..quiet import megatron_import
    with megatron_import():
        from megatron.core import parallel_state
    return parallel_state


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, *, backend: str | None = None,
                  seed: int = 0, timeout_s: float | None = None) -> None:
    """Initialise torch.distributed (if needed) and Megatron-core's model-parallel groups.

    torch.distributed is started from the environment (``env://``, as torchrun sets RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT) unless the caller already initialised it, in which case it is used as it is.
    The backend defaults to nccl when CUDA is available and gloo otherwise. Every collective parallm issues is
    bounded by ``timeout_s`` (default: env PARALLM_TIMEOUT_S or 600 s) so a lost peer ends in an error, not a hang.

    ``world_size`` must equal ``tp * pp * dp`` for an integer dp; Megatron's rank order (tp fastest, then dp,
    then pp) decides which ranks share a group.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"vpp must be a positive integer or None, got {vpp!r}")
        if vpp == 1:
            vpp = None
        elif pp == 1:
            raise ValueError(f"virtual pipeline (vpp={vpp}) needs pipeline parallelism (pp > 1), got pp=1")
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                "parallm.init_parallel: torch.distributed is not initialised and the environment lacks "
                f"{', '.join(missing)}; launch with torchrun, or call torch.distributed.init_process_group first")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        _OWN["process_group"] = True
    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(f"world size {world} is not tp*pp*dp: tp={tp} x pp={pp} = {tp * pp} does not divide {world}")
    ps = _import_parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        distributed_timeout_minutes=max(1, int(round(timeout.total_seconds() / 60))),
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _GROUP_CACHE.clear()


def destroy_parallel() -> None:
    """Destroy Megatron's model-parallel groups, and the default process group if init_parallel created it (a
    process group the caller created stays theirs to destroy)."""
    ps = _import_parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _GROUP_CACHE.clear()
    if _OWN.pop("process_group", False) and dist.is_initialized():
        dist.destroy_process_group()


def require_initialized(what: str) -> None:
    ps = _import_parallel_state()
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        raise RuntimeError(f"{what} needs parallel groups: call parallm.init_parallel(tp=..., pp=...) first")


class Layout:
    """This rank's coordinates, read from parallel_state (never computed from the global rank)."""

    def __init__(self):
        ps = _import_parallel_state()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def coords(self) -> tuple[int, int, int]:
        return (self.tp_rank, self.pp_rank, self.dp_rank)


_GROUP_CACHE: dict = {}
_OWN: dict = {}   # what parallm created (so destroy_parallel leaves the caller's process group alone)


def kv_replica_group(num_kv_heads: int):
    """The group of TP ranks holding the same replicated KV head (nkv < tp), or None when KV heads are not
    replicated. Every rank must call this (group creation is collective over the world)."""
    layout = Layout()
    tp = layout.tp
    if num_kv_heads >= tp:
        return None
    key = ("kv", num_kv_heads, tp)
    if key not in _GROUP_CACHE:
        rep = tp // num_kv_heads
        mine = None
        # Enumerate every TP group in the world so all ranks create the same groups in the same order.
        all_tp = [None] * layout.world
        dist.all_gather_object(all_tp, dist.get_process_group_ranks(layout.tp_group))
        seen = []
        for ranks in all_tp:
            if ranks not in seen:
                seen.append(ranks)
        for ranks in seen:
            for block in range(num_kv_heads):
                members = ranks[block * rep:(block + 1) * rep]
                group = dist.new_group(members)
                if layout.rank in members:
                    mine = group
        _GROUP_CACHE[key] = mine
    return _GROUP_CACHE[key]
