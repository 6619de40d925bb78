"""Asynchronous saves: the handle :func:`parallm.save_checkpoint` returns with ``async_save=True``, the saves
still running in this process, and the gloo group their collectives use.

A pending save finishes before anything that would disturb it: the next ``save_checkpoint`` /
``load_checkpoint`` waits for it, and so does ``parallm.destroy_parallel`` (registered through
:func:`parallm.parallel.state.before_destroy` when a save starts), since the groups it tears down are the ones the
save's thread still talks over; a save that failed makes ``destroy_parallel`` raise its error."""

from __future__ import annotations

import shutil
import threading
from datetime import timedelta

import torch.distributed as dist

from ...parallel.state import _GROUP_CACHE, DEFAULT_TIMEOUT_S, before_destroy
from ..dcp_io import dcp_failure

_PENDING: list["AsyncCheckpointSave"] = []


class AsyncCheckpointSave:
    """Handle of an asynchronous :func:`parallm.save_checkpoint`. The state was copied to CPU memory before
    ``save_checkpoint`` returned; a background thread writes it, then (collectively over a dedicated gloo group)
    finishes the checkpoint and moves it into place. Training may go on meanwhile.

    ``wait()`` blocks until the checkpoint is complete at its path (or raises the save's error, on every
    rank); ``done()`` polls. The next ``save_checkpoint`` / ``load_checkpoint`` and ``parallm.destroy_parallel``
    wait for it; wait for the last one (or call ``destroy_parallel``) before the process exits: the thread is a
    daemon."""

    def __init__(self, path: str, tmp: str | None, future, finish):
        self.path = path
        self._tmp = tmp   # rank 0: removed if the save fails
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(future, finish), daemon=True,
                                        name="parallm-async-checkpoint")
        _PENDING.append(self)
        before_destroy(wait_for_pending_saves)
        self._thread.start()

    def _run(self, future, finish):
        try:
            try:
                metadata, error = future.result(), None
            except BaseException as e:  # noqa: BLE001
                metadata, error = None, dcp_failure(e, "save_checkpoint (async)", abort=False)
            finish(metadata, error)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout} s")
        if self in _PENDING:
            _PENDING.remove(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def wait_for_pending_saves() -> None:
    """Wait for every asynchronous save this process started; then raise the first failed one's error."""
    first = None
    while _PENDING:
        try:
            _PENDING[0].wait()
        except Exception as e:  # noqa: BLE001 - the others are still waited for
            first = first or e
    if first is not None:
        raise first


def async_group():
    """A gloo group over the whole world for the asynchronous saves' collectives (created once per
    ``init_parallel``; creating it is collective)."""
    key = ("async-checkpoint",)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    return _GROUP_CACHE[key]
