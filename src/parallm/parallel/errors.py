"""Making one rank's error every rank's error.

Code that may fail on some ranks only (reading files, validating a state dict that only rank 0 holds) runs
*before* the collectives that depend on it, then every rank calls :func:`agree`: it exchanges a status and
raises the same exception type, naming the failing rank(s), everywhere. Process-group timeouts stay the last
resort for a rank that died.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import PORTABLE_ERRORS, ParallelError


def _flag_device():
    if dist.get_backend() == "nccl":
        import torch
        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"


def abort_process_groups() -> None:
    """Tear down every process group after a peer was lost.

    A gloo collective with a dead member fails only on the ranks that talk to it directly; the others would
    wait for a partner that has itself given up. Aborting closes this rank's connections, so the failure
    spreads to every rank at once instead of after the process-group timeout. Distributed work cannot continue
    in this process afterwards (a rank died: the job is over).
    """
    try:
        from megatron.core import parallel_state
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - best effort: we are already failing
        pass
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def agree(error: BaseException | None, *, what: str, group=None) -> None:
    """Collective over ``group`` (default: world). Raises on every member if any member passed an error.

    Costs one one-element all-reduce when nobody failed; the messages are exchanged only on failure. A peer
    that died (gloo: "Connection closed by peer") turns into a :class:`ParallelError` saying so.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    import torch
    try:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() == 0:
            return
        status = None if error is None else (type(error).__name__, str(error))
        statuses = [None] * dist.get_world_size(group)
        dist.all_gather_object(statuses, status, group=group)
    except Exception as comm_error:  # noqa: BLE001 - a lost peer
        abort_process_groups()
        if error is not None:
            raise error from comm_error
        raise ParallelError(f"{what}: lost contact with another rank (did a rank die or get killed?): "
                            f"{comm_error}; the process groups were aborted so that no rank waits for it")\
            from comm_error
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if error is not None:
        raise error
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    first_rank, (type_name, message) = failed[0]
    others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    etype = PORTABLE_ERRORS.get(type_name, ParallelError)
    if etype is KeyError:  # KeyError quotes its message; keep text readable
        etype = ParallelError
    raise etype(f"{what} failed on rank {ranks[first_rank]}{others}: {message}")


def run_local(fn, *, what: str, group=None):
    """Run ``fn()`` (local work, no collectives inside) and :func:`agree` on the outcome. Returns fn's result."""
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by agree
        result, error = None, e
    agree(error, what=what, group=group)
    return result


__all__ = ["ParallelError", "agree", "run_local"]
