"""Rank 0 leads, every rank follows: the server's work reaches the parallel model through one broadcast per item.

Global rank 0 runs the HTTP front end and the scheduler; its main thread (the *leader*) takes the next work item,
broadcasts it over a gloo control group of every rank, runs it like every other rank, then gathers every rank's
outcome (one ``all_gather_object``): an error on any rank fails the item on rank 0 with that rank's message, and
the item's state changes are rolled back by the op itself where it can (:mod:`.ops`). The other ranks (the
*followers*) loop on the broadcast.

Never a hang:

- every collective of the control group has a timeout (``timeout_s``); the leader broadcasts a no-op every
  ``keepalive_s`` while idle, so a follower that waits longer than the timeout knows rank 0 is gone and exits;
- parallm's own collectives inside an item have the process group's timeout (``init_parallel(timeout_s=)``);
- when a collective fails on the leader (a rank died or timed out), the model is declared lost: the item in
  flight fails with the error, every later training request fails at once with the same message, and the HTTP
  front end (sessions, checkpoint listing, sampling through vLLM) keeps serving.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
import traceback

import torch.distributed as dist

__all__ = ["Leader", "ModelLost", "follow", "new_control_group", "run_item"]

log = logging.getLogger("parallm.tinker")
NOOP = {"op": "noop"}
STOP = {"op": "stop"}


class ModelLost(RuntimeError):
    """The parallel model can no longer run collectives (a rank died or a collective timed out)."""


def new_control_group(timeout_s: float):
    """A gloo group of every rank with its own timeout (collective: every rank calls it)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def run_item(execute, item) -> tuple:
    """``("ok", value)`` or ``("error", (type name, message, user?))`` of one item on this rank."""
    try:
        return "ok", execute(item)
    except Exception as e:  # noqa: BLE001 - every error becomes the request's error
        user = isinstance(e, (ValueError, KeyError, TypeError, FileNotFoundError, FileExistsError))
        if not user:
            log.error("rank %d: %s failed:\n%s", dist.get_rank(), item.get("op"), traceback.format_exc())
        return "error", (type(e).__name__, str(e), user)


def _exchange(item, execute, group) -> list:
    box = [item]
    dist.broadcast_object_list(box, src=0, group=group)
    item = box[0]
    if item["op"] == "stop":
        return None
    outcome = run_item(execute, item) if item["op"] != "noop" else ("ok", None)
    outcomes = [None] * dist.get_world_size()          # a value stays on its rank (rank 0's is the result):
    dist.all_gather_object(outcomes, outcome if outcome[0] == "error" else ("ok", None), group=group)   # errors travel
    outcomes[dist.get_rank()] = outcome
    return outcomes


def follow(execute, group) -> None:
    """A follower's loop: run every item rank 0 broadcasts until it says stop or goes silent (then raise)."""
    while True:
        if _exchange(None, execute, group) is None:
            return


def _fail(done, name: str, message: str, user: bool) -> None:
    """An item's error to its callback: a user error's message as it is, any other named by its type."""
    done(False, message if user else f"{name}: {message}", "user" if user else "server")


def _groupable(item) -> bool:
    return item.get("op") == "forward" and bool(item.get("args", {}).get("backward"))


class Leader:
    """Rank 0's side: ``submit(item, done)`` from any thread; :meth:`run` (the main thread) executes items in
    submission order and calls ``done(ok, value_or_message, category)`` with rank 0's value or the first
    failing rank's error (category ``"user"`` for input errors, ``"server"`` otherwise)."""

    def __init__(self, execute, group, *, keepalive_s: float = 2.0, cobatch: int = 1):
        self.execute, self.group, self.keepalive_s = execute, group, keepalive_s
        self.cobatch = cobatch          # most forward_backward requests of distinct clients run as one item
        self.cobatched = {"passes": 0, "requests": 0}       # co-batched passes so far (healthz reports them)
        self.queue: queue.Queue = queue.Queue()
        self.lost: str | None = None
        self.busy = threading.Event()
        self._stop = False

    def submit(self, item: dict, done) -> None:
        if self.lost is not None:
            done(False, self.lost, "server")
            return
        self.queue.put((item, done))

    def stop(self) -> None:
        self._stop = True
        self.queue.put(None)

    def run(self) -> None:
        while True:
            try:
                job = self.queue.get(timeout=self.keepalive_s)
            except queue.Empty:
                job = (NOOP, None)
            if job is None or self._stop:
                self._broadcast_stop()
                return
            item, done = job
            if self.lost is not None:
                if done is not None:
                    done(False, self.lost, "server")
                continue
            if self.cobatch > 1 and _groupable(item):
                item, done = self._group(item, done)
            self.busy.set()
            try:
                self._one(item, done)
            finally:
                self.busy.clear()

    def _group(self, item, done):
        """``item`` with the ``forward_backward`` items of other clients queued right behind it (up to
        ``cobatch`` in all, stopping at the first other item) as one ``forward_many`` item, and the callback that
        hands each its own outcome; ``(item, done)`` itself when none follows."""
        jobs, ids = [(item, done)], {item["args"]["model_id"]}
        with self.queue.mutex:
            pending = self.queue.queue
            while len(jobs) < self.cobatch and pending and pending[0] is not None and _groupable(pending[0][0]) \
                    and pending[0][0]["args"]["model_id"] not in ids:
                jobs.append(pending.popleft())
                ids.add(jobs[-1][0]["args"]["model_id"])
        if len(jobs) == 1:
            return item, done
        dones = [d for _, d in jobs]

        def done_all(ok, value, category):
            if not ok:
                for d in dones:
                    d(False, value, category)
                return
            if value["together"]:
                self.cobatched = {"passes": self.cobatched["passes"] + 1,
                                  "requests": self.cobatched["requests"] + value["together"]}
            for d, (status, v) in zip(dones, value["outcomes"]):
                if status == "ok":
                    d(True, v, None)
                else:
                    _fail(d, *v)
        return {"op": "forward_many", "args": {"items": [it["args"] for it, _ in jobs]}}, done_all

    def _one(self, item, done) -> None:
        started = time.monotonic()
        try:
            outcomes = _exchange(item, self.execute, self.group)
        except Exception as e:  # noqa: BLE001 - a collective of the control group failed: a rank is gone
            self.lost = (f"the parallel model is lost: {item.get('op')} failed in a collective after "
                         f"{time.monotonic() - started:.0f} s ({type(e).__name__}: {e}); a rank died or "
                         "stopped answering. Restart the server (sessions and checkpoints on disk are kept)")
            log.error(self.lost)
            self._drain()
            if done is not None:
                done(False, self.lost, "server")
            return
        if done is None:
            return
        for rank, (status, value) in enumerate(outcomes):
            if status == "error":
                name, message, user = value
                if rank != 0:
                    message = f"{message} (on rank {rank})"
                if name in ("ParallelError", "DistBackendError", "DistError") or "lost contact" in message:
                    self.lost = f"the parallel model is lost: {message}"
                    self._drain()
                _fail(done, name, message, user)
                return
        done(True, outcomes[0][1], None)

    def _drain(self) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and job[1] is not None:
                job[1](False, self.lost, "server")

    def _broadcast_stop(self, wait_s: float = 5.0) -> None:
        """Tell the followers to stop; a follower already gone (a signal to the whole process group) must not
        hold rank 0 for the group's timeout: the broadcast runs on a thread given ``wait_s`` seconds."""
        if self.lost is not None:
            return

        def send():
            try:
                dist.broadcast_object_list([STOP], src=0, group=self.group)
            except Exception:  # noqa: BLE001 - followers already gone
                pass
        t = threading.Thread(target=send, daemon=True)
        t.start()
        t.join(wait_s)
        if t.is_alive():
            self.lost = "stopped while a follower was gone"
