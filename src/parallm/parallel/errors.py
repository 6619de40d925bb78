"""Making one rank's error every rank's error.

Code that may fail on some ranks only (reading files, validating a state dict that only rank 0 holds) runs
*before* the collectives that depend on it, then every rank calls :func:`agree`: it exchanges a status and
raises the same exception type, naming the failing rank(s), everywhere. The exchange runs on gloo (a side group
when the world group is NCCL), whose collectives raise when a peer dies or the timeout passes; NCCL would wait
for its watchdog instead. Process-group timeouts stay the last resort for a rank that died.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import PORTABLE_ERRORS, ParallelError


def _agreement_group(group):
    """Agreement runs on gloo (CPU tensors): the caller's group, or the world's gloo control group
    (:func:`parallm.parallel.state.control_group`, the world group itself when that is gloo already)."""
    if group is not None:
        return group
    from .state import control_group
    return control_group()


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


def lost_peer_error(comm_error: BaseException, what: str, *, abort: bool = True) -> ParallelError:
    """A collective failed: a peer is gone. With ``abort`` the process groups are aborted first (a second
    collective on the broken group would leave the ranks that wait on the dead one waiting), so that every
    rank's connections close and its peers fail at once; without it (a background thread that must not tear
    down the groups the training loop uses) only the error is made."""
    if abort:
        abort_process_groups()
    return ParallelError(f"{what}: lost contact with another rank (did a rank die or get killed?): {comm_error}"
                         + ("; the process groups were aborted so that no rank waits for it" if abort else ""))


def _lost_peer(comm_error: BaseException, error: BaseException | None, what: str, *, abort: bool = True):
    """:func:`lost_peer_error`, raised (this rank's own ``error`` instead, when it has one). No local variable
    may hold the raised exception: the cycle exception -> traceback -> this frame would keep the failed
    collective's frames, and with them its process group, alive until the garbage collector runs, and a peer
    connected to this rank would wait for the timeout instead of failing at once."""
    if error is not None:
        if abort:
            abort_process_groups()
        raise error from comm_error
    raise lost_peer_error(comm_error, what, abort=abort) from comm_error


def exchange_rows(row, *, what: str, group=None, error: BaseException | None = None):
    """Every member's ``row`` (a short list of ints, the same length everywhere): an int64 tensor
    ``[members, len(row)]`` (on CPU). One all-gather, over the world's gloo control group by default, or over
    ``group`` on the device its backend serves (a model group: NCCL on GPUs, whose collectives do not raise
    when a peer dies, so a dead peer is then the process-group timeout's to report). A lost peer becomes a
    :class:`ParallelError` after the process groups are aborted (``error``, this rank's own failure, is raised
    instead when given)."""
    import torch
    device = "cpu"
    if group is not None:
        from .state import group_device
        device = group_device(group)
    group = _agreement_group(group)
    world = dist.get_world_size(group)
    mine = torch.tensor(list(row), dtype=torch.long, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(out, mine, group=group)
    except Exception as comm_error:  # noqa: BLE001 - a lost peer
        _lost_peer(comm_error, error, what)
    return torch.stack(out).cpu()


def gather_objects(obj, *, what: str, group=None, error: BaseException | None = None, abort: bool = True) -> list:
    """``all_gather_object`` with :func:`exchange_rows`' handling of a lost peer (``abort``: see
    :func:`lost_peer_error`)."""
    group = _agreement_group(group)
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as comm_error:  # noqa: BLE001
        _lost_peer(comm_error, error, what, abort=abort)
    return out


def raise_failures(statuses, *, what: str, group=None) -> None:
    """Raise :func:`remote_error` when any member's status (``status_of``, gathered) names a failure."""
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        raise remote_error(what, failed, group)


def status_of(error: BaseException | None):
    """What :func:`remote_error` needs to re-create ``error`` on another rank."""
    return None if error is None else (type(error).__name__, str(error))


def remote_error(what: str, failed, group=None) -> BaseException:
    """The exception a rank raises for other ranks' failures. ``failed``: ``[(member index, status_of(e))]``,
    first culprit first; the message names its global rank and how many others failed; the type is re-created
    by name when it is one of parallm's usual types (else :class:`ParallelError`)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    first, (type_name, message) = failed[0]
    others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    etype = PORTABLE_ERRORS.get(type_name, ParallelError)
    if etype is KeyError:  # KeyError quotes its message; keep text readable
        etype = ParallelError
    return etype(f"{what} failed on rank {ranks[first]}{others}: {message}")


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
    group = _agreement_group(group)
    try:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() == 0:
            return
        statuses = [None] * dist.get_world_size(group)
        dist.all_gather_object(statuses, status_of(error), group=group)
    except Exception as comm_error:  # noqa: BLE001 - a lost peer
        _lost_peer(comm_error, error, what)
    if error is not None:
        raise error
    raise remote_error(what, [(r, s) for r, s in enumerate(statuses) if s is not None], group)


def spread_failure(error: BaseException | None, *, what: str, group=None) -> None:
    """For a failure every member of ``group`` (default: world) already knows happened somewhere (a count
    carried by collectives the call makes anyway): exchange the statuses (one ``all_gather_object``) and raise
    on every member, the failing ranks their own exception, the others :func:`remote_error` naming them."""
    group = _agreement_group(group)
    statuses = gather_objects(status_of(error), what=what, group=group, error=error)
    if error is not None:
        raise error
    raise_failures(statuses, what=what, group=group)
    raise ParallelError(f"{what}: a rank reported a failure but none sent its message")


def run_local(fn, *, what: str, group=None):
    """Run ``fn()`` (local work, no collectives inside) and :func:`agree` on the outcome. Returns fn's result."""
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by agree
        result, error = None, e
    agree(error, what=what, group=group)
    return result


__all__ = ["ParallelError", "agree", "exchange_rows", "gather_objects", "remote_error", "run_local",
           "spread_failure", "status_of"]
