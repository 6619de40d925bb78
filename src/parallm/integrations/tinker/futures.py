"""The SDK's futures: every accepted request gets a request id at once; its result (or error) is fetched with
``/api/v1/retrieve_future``, which the server holds open up to :data:`LONG_POLL_S` while the work runs and
otherwise answers ``try_again`` (the SDK asks again immediately, so holding the call is what keeps the client
from spinning). Thread-safe: route threads create, the dispatcher and the samplers' threads resolve; a waiter is
either a thread (:meth:`FutureStore.wait`) or a callback (:meth:`FutureStore.watch`: the HTTP front end's event
loop, which holds its long polls without a thread each).
"""

from __future__ import annotations

import itertools
import threading
import time

__all__ = ["FutureStore", "LONG_POLL_S"]

LONG_POLL_S = 20.0        # below the SDK's 45 s timeout of a retrieve_future call
KEEP_S = 3600.0           # a result nobody fetched is dropped after an hour


class _Entry:
    __slots__ = ("kind", "model_id", "done", "result", "error", "created", "finished", "extra")

    def __init__(self, kind, model_id, extra):
        self.kind, self.model_id, self.extra = kind, model_id, extra
        self.done, self.result, self.error = False, None, None
        self.created, self.finished = time.monotonic(), None


class FutureStore:
    """Request id -> pending / result / error. A result is ``("json", dict)`` or ``("proto", bytes)``; an
    error ``(message, category)``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)
        self._watchers: dict[str, list] = {}

    def create(self, kind: str, *, model_id: str | None = None, extra: dict | None = None) -> str:
        with self._cond:
            rid = f"req-{next(self._ids)}"
            self._entries[rid] = _Entry(kind, model_id, extra or {})
            self._gc()
            return rid

    def resolve(self, rid: str, result) -> None:
        self._finish(rid, result=result)

    def fail(self, rid: str, message: str, *, category: str = "server") -> None:
        self._finish(rid, error=(message, category))

    def _finish(self, rid, *, result=None, error=None):
        with self._cond:
            e = self._entries.get(rid)
            if e is None or e.done:
                return
            e.done, e.result, e.error, e.finished = True, result, error, time.monotonic()
            self._cond.notify_all()
            watchers = self._watchers.pop(rid, ())
        for fn in watchers:                 # outside the lock: a callback may look at the store
            fn()

    def watch(self, rid: str, fn) -> bool:
        """Call ``fn()`` (no arguments, from the resolving thread: it must not block) once ``rid`` is done; False,
        and no call, when ``rid`` is unknown or already done."""
        with self._cond:
            e = self._entries.get(rid)
            if e is None or e.done:
                return False
            self._watchers.setdefault(rid, []).append(fn)
            return True

    def unwatch(self, rid: str, fn) -> None:
        """Forget ``fn`` (a long poll that timed out before ``rid`` was done)."""
        with self._cond:
            fns = self._watchers.get(rid)
            if fns is not None and fn in fns:
                fns.remove(fn)
                if not fns:
                    del self._watchers[rid]

    def watched(self) -> int:
        """How many callbacks wait (long polls held by the front end)."""
        with self._cond:
            return sum(len(fns) for fns in self._watchers.values())

    def wait(self, rid: str, timeout: float = LONG_POLL_S) -> _Entry | None:
        """The entry once done, or still pending after ``timeout`` seconds; None for an unknown id."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                e = self._entries.get(rid)
                if e is None or e.done:
                    return e
                left = deadline - time.monotonic()
                if left <= 0:
                    return e
                self._cond.wait(left)

    def get(self, rid: str) -> _Entry | None:
        with self._cond:
            return self._entries.get(rid)

    def pending(self) -> list[str]:
        with self._cond:
            return [rid for rid, e in self._entries.items() if not e.done]

    def _gc(self):
        now = time.monotonic()
        stale = [rid for rid, e in self._entries.items() if e.done and now - e.finished > KEEP_S]
        for rid in stale:
            del self._entries[rid]
