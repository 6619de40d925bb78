"""Starting a ``vllm serve`` engine in processes of its own, ready for weight pushes: :func:`serve`.

The ``vllm`` command of vLLM's CPU build is broken (it looks up the version of a package named "vllm"), so the
server runs as ``python -m vllm.entrypoints.openai.api_server``; ``VLLM_SERVER_DEV_MODE=1`` exposes the
weight-transfer routes; ``--weight-transfer-config '{"backend": "parallm"}'`` makes every worker build parallm's
backend (registered through the ``vllm.general_plugins`` entry point: parallm must be installed in the server's
Python, ``pip install -e .`` for a checkout). The server runs in a session of its own, so that :meth:`Server.stop`
ends it with its engine core and workers; vLLM leaves files in /dev/shm behind (``vllm_dist_*`` with TP > 1):
``stop`` removes the ones that appeared while the server ran and belong to no running process's open files.

The server does not outlive its caller: it runs under a small watchdog process (:mod:`._watchdog`, the session's
leader) that ends the session within about a second of the calling process's end, however it ended (torchrun's
SIGTERM, SIGKILL, an OOM kill: no ``finally`` runs then). Its output goes to a file only its user reads
(``mkstemp``, mode 0600: vLLM's request logs hold prompts).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from .unsupported import refuse_checkpoint

__all__ = ["Server", "remove_shm_files", "serve", "shm_files"]

_SHM = "/dev/shm"
_WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_watchdog.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(_SHM))
    except OSError:
        return set()


class Server:
    """A running ``vllm serve`` engine (:func:`serve`): ``url``, ``process`` (its watchdog, the leader of the
    session the server, its engine core and workers run in), ``log`` (the path of its output).
    ``stop()`` ends it (idempotent; ``with serve(...) as server:`` calls it); ``kill()`` kills it at once."""

    def __init__(self, process, url: str, log: str, shm_before: set[str], model: str = ""):
        self.process, self.url, self.log, self.model = process, url, log, model
        self._shm_before = shm_before

    def wait_ready(self, timeout: float = 600.0) -> "Server":
        """Wait until the server answers ``/health``; itself. Raises with the log's tail (and stops the server)
        when it exits or is not ready within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"serve: the vLLM server for {self.model} exited with "
                                   f"{self.process.returncode}; the end of {self.log}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as res:
                    if res.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise TimeoutError(f"serve: the vLLM server for {self.model} was not ready within {timeout:.0f} "
                                   f"s; the end of {self.log}:\n{tail}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and every process of its session (an engine dying without a goodbye)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.kill()
        self.kill()                      # its workers, if the server went first
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        remove_shm_files(self._shm_before)

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def shm_files() -> set[str]:
    """The names in /dev/shm now (for :func:`remove_shm_files` afterwards)."""
    return _shm_names()


def remove_shm_files(before: set[str], *, wait: float = 10.0) -> list[str]:
    """Remove the files vLLM and parallm leave in /dev/shm (``vllm*``, ``psm_*``, ``sem.mp-*``, ``parallm_wt_*``)
    that appeared since ``before`` (:func:`shm_files`) and that no running process has open or mapped, waiting up
    to ``wait`` seconds for the processes still mapping them to end (an engine's workers outlive their parent by
    a moment); the names removed."""
    removed = []
    deadline = time.monotonic() + wait
    while True:
        left = []
        for name in sorted(_shm_names() - before - set(removed)):
            if not name.startswith(("vllm", "psm_", "sem.mp-", "parallm_wt_")):
                continue
            if _in_use(os.path.join(_SHM, name)):
                left.append(name)
                continue
            try:
                os.unlink(os.path.join(_SHM, name))
                removed.append(name)
            except OSError:
                pass
        if not left or time.monotonic() > deadline:
            return removed
        time.sleep(0.5)


def _in_use(path: str) -> bool:
    """Whether any process has ``path`` open or mapped (read from /proc; False where /proc says nothing)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    return True
        except OSError:
            continue
    return False


def serve(model_dir, *, tensor_parallel_size: int = 1, port: int | None = None, backend: str = "parallm",
          dtype: str = "float32", max_model_len: int | None = None, kv_cache_memory_bytes: int | None = 64 << 20,
          args=(), env: dict | None = None, python: str | None = None, log: str | None = None,
          timeout: float = 600.0, wait: bool = True, dev_mode: bool = True) -> Server:
    """Start ``python -m vllm.entrypoints.openai.api_server`` for ``model_dir`` on ``port`` (a free one by
    default) with ``tensor_parallel_size`` workers and parallm's weight-transfer ``backend``, and wait until it
    answers ``/health``. ``args``: more command-line arguments; ``env``: more environment variables (on CPU
    machines ``VLLM_CPU_OMP_THREADS_BIND`` decides the workers' cores; vLLM's default asks for one NUMA node per
    worker); ``python``: the interpreter (default: this one); ``log``: where its output goes (default: a new
    file of mode 0600 in the temporary directory). ``kv_cache_memory_bytes`` None leaves vLLM's own sizing (on
    CPU: most of the RAM). The server ends when this process does (see the module docstring). Raises with the
    log's tail when the server exits or is not ready within ``timeout`` seconds.
    ``wait=False`` returns at once: call :meth:`Server.wait_ready` (several servers then start side by side).
    ``dev_mode=False`` leaves vLLM's development routes (``/collective_rpc``, ``/sleep``, the weight-transfer
    routes: none of them behind vLLM's API key) off, for an engine that only serves requests."""
    refuse_checkpoint(model_dir, "serve")
    port = port or _free_port()
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", os.fspath(model_dir),
           "--port", str(port), "--host", "127.0.0.1", "--tensor-parallel-size", str(tensor_parallel_size),
           "--dtype", dtype, "--enforce-eager", "--seed", "0",
           "--weight-transfer-config", json.dumps({"backend": backend})]
    if tensor_parallel_size > 1:
        cmd += ["--distributed-executor-backend", "mp"]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    cmd += list(args)
    full_env = dict(os.environ, VLLM_SERVER_DEV_MODE="1" if dev_mode else "0", **(env or {}))
    if log is None:
        fd, log = tempfile.mkstemp(prefix=f"parallm_vllm_serve_{port}_", suffix=".log")     # mode 0600
    else:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    before = _shm_names()
    watchdog = [python or sys.executable, _WATCHDOG, str(os.getpid()), "--"]
    with os.fdopen(fd, "w") as out:
        process = subprocess.Popen(watchdog + cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                   start_new_session=True)
    server = Server(process, f"http://127.0.0.1:{port}", log, before, model=os.fspath(model_dir))
    return server.wait_ready(timeout) if wait else server
