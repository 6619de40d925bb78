"""Local ranks for the tests, the benchmarks and ``parallm demo`` / ``verify``: one launcher that never hangs.

``spawn(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` processes started by
``torch.multiprocessing.start_processes`` (torch's own spawn API, the one torch.distributed.elastic starts its
workers with) from a forkserver that imported torch, megatron-core, transformers and parallm once, so a rank
starts in well under a second instead of paying those imports again. Each rank has RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE set, one thread, and torch.distributed initialised before ``fn`` runs (gloo, or
nccl with one GPU per rank) through a ``file://`` rendezvous in a fresh temporary directory (no port to pick).
Arguments and results travel through files (``torch.save``): tensors sent through a pipe would each cost a
shared-memory file descriptor. The launcher reads the ranks' reports with ``torch.load(weights_only=True)``, which
unpickles no code: a result is tensors, numbers, strings, None, and lists / tuples / dicts / sets of them (a rank
whose result holds anything else reports that as its error). The arguments are pickled: the launching process
writes them into its own new temporary directory (as multiprocessing pickles ``fn`` itself).

Ending, in every case within ``timeout`` (plus ``grace``):

* every rank returns: ``spawn`` returns the results, a list by rank;
* a rank raises or dies: the others get ``grace`` seconds to end by themselves (with parallm they raise the same
  error, see parallel.errors.agree), then they are killed, and :class:`SpawnError` names the root cause: the
  first error that is not a lost connection (rank 0's first), else the rank that died, else the ranks that hung;
* past ``timeout`` every rank still running is killed (``SpawnError``: "timed out after ... s").

``spawn_outcomes`` runs to the end instead (tests where a rank is meant to die, and survivors must end by
themselves): it returns one :class:`RankOutcome` per rank and never raises. Shortly before the deadline each rank
still running prints its Python stacks (faulthandler) to its output; on Linux a rank dies with the forkserver,
which ends with the launching process, so no rank outlives it.

Not ``torch.distributed.launcher.api.elastic_launch``: its agent kills every rank at the first failure (the
survivors' own ending is what some tests check) and has no deadline for a hung rank; its start-up is about the
same (bench/launch_bench.py).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from ..errors import USER_ERRORS

GRACE_S = 5.0
# Ranks import these once, in the forkserver (failing imports are skipped); megatron-core comes with parallm.api,
# which imports it without its start-up notice (parallel.megatron_import).
PRELOAD = ("torch", "torch.distributed", "transformers", "parallm.families",
           "parallm.api", "parallm.checkpoint.loader", "parallm.checkpoint.saver", "parallm.verify.check")
# An error with one of these in its message only says that another rank went away first.
_LOST_PEER = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "socket",
              "connection refused", "lost contact")


@dataclass
class RankOutcome:
    """How one rank ended.

    status: "ok" (``fn`` returned ``value``); "error" (it raised: ``error_type``, ``message``, ``traceback``,
    ``time``); "dead" (the process ended without a report: ``exitcode``, negative for a signal); "hang" (still
    running when the launcher stopped waiting, then killed). ``log``: the last lines of the rank's output when it
    went to a file (``log_dir``)."""
    rank: int
    status: str
    value: object = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    time: float = 0.0
    exitcode: int | None = None
    log: str | None = None

    @property
    def lost_peer(self) -> bool:
        return self.status == "error" and any(s in (self.message or "").lower() for s in _LOST_PEER)


class SpawnError(RuntimeError):
    """Some rank did not finish. ``outcomes``: one :class:`RankOutcome` per rank; ``culprit``: the root cause;
    ``summary``: one line naming it (an error of parallm's own types: its message, prefixed "rank r: " when r is
    not 0); ``timed_out``: the deadline passed."""

    def __init__(self, outcomes: list[RankOutcome], *, timeout: float, timed_out: bool):
        self.outcomes, self.timed_out = outcomes, timed_out
        self.culprit = c = root_cause(outcomes)
        failed = [o.rank for o in outcomes if o.status != "ok"]
        hung = [o.rank for o in outcomes if o.status == "hang"]
        if c.status == "error" and (not timed_out or not c.lost_peer):
            # parallm's own errors name the culprit (and are the same on every rank): the message alone says it
            message = " ".join((c.message or "").split()) or c.error_type
            self.summary = ("" if c.rank == 0 else f"rank {c.rank}: ") + \
                (message if c.error_type in USER_ERRORS else f"{c.error_type}: {message}")
        elif timed_out:
            self.summary = (f"timed out after {timeout:.0f} s: rank(s) {hung} did not finish (a hang, or too slow "
                            "for the time given)")
        elif c.status == "dead":
            self.summary = f"rank {c.rank} died (exit code {c.exitcode}{_signal_name(c.exitcode)}) without a report"
        else:
            self.summary = f"rank(s) {hung} hung: the other ranks ended with errors and these did not"
        detail = c.traceback or (f"last lines of rank {c.rank}'s output:\n{c.log}" if c.log else "")
        super().__init__(f"{len(failed)} rank(s) failed ({failed}); {self.summary}" + (f"\n{detail}" if detail else ""))


def root_cause(outcomes: list[RankOutcome]) -> RankOutcome:
    """The error that is not a lost connection (rank 0's, else the earliest), else a dead rank, else a hung one."""
    real = [o for o in outcomes if o.status == "error" and not o.lost_peer]
    if real:
        return min(real, key=lambda o: (o.rank != 0, o.time))
    for status in ("dead", "hang", "error"):
        found = [o for o in outcomes if o.status == status]
        if found:
            return min(found, key=lambda o: o.time) if status == "error" else found[0]
    raise ValueError("no rank failed")


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f", killed by {signal.Signals(-code).name}" + (" (out of memory?)" if code == -9 else "")
        except ValueError:
            pass
    return ""


def spawn(fn, world: int, *args, timeout: float = 600.0, **options) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks; return the results (list by rank), or raise
    :class:`SpawnError` (a rank raised, died or hung). ``fn`` must be a module-level function (it is pickled by
    reference); its result must hold only tensors, numbers, strings, None, and lists / tuples / dicts / sets of
    them (what ``torch.load(weights_only=True)`` reads). Options: see :func:`spawn_outcomes`."""
    outcomes, timed_out = _launch(fn, world, args, timeout=timeout, stop_on_failure=True, **options)
    if timed_out or any(o.status != "ok" for o in outcomes):
        raise SpawnError(outcomes, timeout=timeout, timed_out=timed_out)
    return [o.value for o in outcomes]


def spawn_outcomes(fn, world: int, *args, timeout: float = 600.0, **options) -> list[RankOutcome]:
    """Like :func:`spawn`, but every rank runs until it ends by itself (or the deadline passes), and one
    :class:`RankOutcome` per rank is returned; never raises for a rank's failure.

    Options (both functions): ``backend`` "gloo" (default) or "nccl" (rank r uses GPU r); ``collective_timeout``
    (seconds, default ``timeout``) bounds every collective of the default process group; ``env``: extra
    environment for the ranks; ``log_dir``: send each rank's stdout / stderr to ``log_dir/rank-<r>.log`` (default:
    inherited); ``preload``: more modules the forkserver imports (only the process's first spawn starts it);
    ``on_poll``: called about every 0.2 s while the ranks run (e.g. to show progress); ``grace`` (spawn only)."""
    return _launch(fn, world, args, timeout=timeout, stop_on_failure=False, **options)[0]


def _launch(fn, world, args, *, timeout, stop_on_failure, grace=GRACE_S, backend="gloo", collective_timeout=None,
            env=None, log_dir=None, preload=(), on_poll=None):
    import torch
    import torch.multiprocessing as tmp
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *preload])
    with tempfile.TemporaryDirectory(prefix="parallm-ranks-") as tmpdir:
        torch.save(args, os.path.join(tmpdir, "args.pt"))
        run = dict(dir=tmpdir, backend=backend, env=dict(env or {}), log_dir=log_dir,
                   collective_timeout=collective_timeout or timeout,
                   stacks_at=max(timeout - 15.0, 0.9 * timeout))
        start = time.monotonic()
        procs = tmp.start_processes(_rank_main, args=(fn, world, run), nprocs=world, join=False,
                                    daemon=True, start_method="forkserver").processes
        timed_out, failed_at = False, None
        try:
            while any(p.exitcode is None for p in procs):
                if on_poll:
                    on_poll()
                now = time.monotonic()
                if now >= start + timeout:
                    timed_out = True
                    break
                if stop_on_failure and any(p.exitcode for p in procs):
                    failed_at = failed_at or now
                    if now - failed_at > grace:
                        break
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
        finally:
            hung = {r for r, p in enumerate(procs) if p.exitcode is None}
            for r in hung:
                procs[r].kill()
            for p in procs:
                p.join(timeout=10)
            if on_poll:
                on_poll()
        return [_outcome(r, p, tmpdir, log_dir, r in hung) for r, p in enumerate(procs)], timed_out


def _outcome(rank, proc, tmpdir, log_dir, hung) -> RankOutcome:
    import torch
    log = None
    if log_dir:
        try:
            with open(os.path.join(log_dir, f"rank-{rank}.log"), errors="replace") as f:
                log = "".join(f.readlines()[-15:]).rstrip() or None
        except OSError:
            pass
    path = os.path.join(tmpdir, f"result-{rank}.pt")
    if os.path.exists(path):
        try:
            report = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001 - _rank_main checked it; a damaged file is that rank's failure
            report = dict(status="error", error_type=type(e).__name__, time=time.time(),
                          message=f"the launcher cannot read this rank's report: {e}")
        return RankOutcome(rank, log=log, exitcode=proc.exitcode, **report)
    return RankOutcome(rank, "hang" if hung else "dead", exitcode=proc.exitcode, log=log, time=time.time())


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank when its parent (the forkserver) ends."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (not Linux)
        pass


def _rank_main(rank: int, fn, world: int, run: dict) -> None:
    """A rank (the process target): environment, output, process group, ``fn``, and its report file."""
    import faulthandler
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    os.environ.update(run["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    if run["log_dir"]:
        fd = os.open(os.path.join(run["log_dir"], f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _die_with_parent()
    faulthandler.dump_traceback_later(run["stacks_at"], exit=False)
    torch.set_num_threads(1)
    try:
        # written by the launching process into its own temporary directory (0700): objects of any type
        args = torch.load(os.path.join(run["dir"], "args.pt"), weights_only=False)
        if run["backend"] == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(run["backend"], init_method=f"file://{run['dir']}/rendezvous", rank=rank,
                                world_size=world, timeout=timedelta(seconds=run["collective_timeout"]))
        report = dict(status="ok", value=fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        traceback.print_exc()
        report = dict(status="error", error_type=type(e).__name__, message=str(e),
                      traceback=traceback.format_exc(), time=time.time())
    path = os.path.join(run["dir"], f"result-{rank}.pt")
    try:
        torch.save(report, path + ".tmp")
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path + ".tmp")
        if unsafe:
            raise TypeError(f"it holds {', '.join(sorted(unsafe)[:6])}, which the launcher does not unpickle (it "
                            "reads tensors, numbers, strings, None, and lists / tuples / dicts / sets of them)")
    except Exception as e:  # noqa: BLE001 - an unpicklable result, or one of types the launcher refuses
        report = dict(status="error", error_type="TypeError", time=time.time(), traceback=traceback.format_exc(),
                      message=f"the rank function's result cannot be sent back to the launcher: {e}")
        torch.save(report, path + ".tmp")
    os.replace(path + ".tmp", path)
    if report["status"] == "ok":
        try:
            import parallm
            parallm.destroy_parallel()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report["status"] == "ok" else 1)  # after a failed collective, teardown could block
