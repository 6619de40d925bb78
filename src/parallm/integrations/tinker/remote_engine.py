"""Sampling engines running elsewhere (``--engine-url``, repeatable): ``vllm serve`` engines that someone else
started, on this machine or on other hosts, behind the router like the engines the server starts itself.

What such an engine must be (checked at start where it can be, refused naming the engine otherwise): the same
checkpoint as ``--model`` (not checkable over the API: the operator's promise; its ``/v1/models`` names its
root, which the ready file reports), LoRA on at runtime (``--enable-lora``, ``--max-lora-rank`` at least the
server's ``--lora-rank``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), ``--max-logprobs`` at least 64 for top-k
requests, ``--max-model-len`` at least the server's context, and its API key (if it has one) in the server's
``PARALLM_ENGINE_API_KEY`` (an environment variable, never a command-line argument: every user of the machine can
read those).

Snapshots. vLLM 0.32 loads a LoRA adapter only from a directory it can read, so an engine elsewhere reads the
server's sampler snapshots from ``--snapshot-dir``: a directory the server writes and every engine reads **at the
same path** (a shared filesystem across hosts; ``/dev/shm`` when the engines run on this machine). The server
refuses ``--engine-url`` without it. At start each engine loads the server's initial adapter from there and
unloads it again: an engine that cannot read the directory, has LoRA off or too small a rank is refused then,
with vLLM's answer, not at a client's first sample.

Liveness. The server does not own the process: an engine is alive while its ``/health`` answers; one that has
not answered for :data:`DEAD_AFTER_S` is taken out of rotation (the router's watcher asks twice a second, each
answer cached for :data:`HEALTH_EVERY_S`). Stopping the server leaves such engines running (the adapters it
loaded are unloaded when their snapshots are released).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

__all__ = ["RemoteServer", "engine_key", "probe"]

KEY_ENV = "PARALLM_ENGINE_API_KEY"
HEALTH_EVERY_S = 2.0
DEAD_AFTER_S = 15.0


def engine_key() -> str | None:
    """The API key of ``--engine-url`` engines (``PARALLM_ENGINE_API_KEY``), or None."""
    return os.environ.get(KEY_ENV) or None


class RemoteServer:
    """What :class:`~.sampling.VllmSampler` needs of its engine (as :class:`parallm.integrations.vllm.serve.Server`
    gives for one it started) for an engine at ``url`` it did not start."""

    process = None
    log = None

    def __init__(self, url: str, key: str | None):
        self.url, self.key = url.rstrip("/"), key
        self.model: str | None = None           # the engine's served base model name (from /v1/models)
        self.root: str | None = None
        self.max_model_len: int | None = None
        self._lock = threading.Lock()
        self._checked, self._last_ok = 0.0, time.monotonic()

    def _get(self, route: str, timeout: float):
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + route, headers=headers),
                                    timeout=timeout) as res:
            raw = res.read()
        return json.loads(raw) if raw else None

    def wait_ready(self, timeout: float = 600.0) -> "RemoteServer":
        """Wait until ``/health`` answers, then read ``/v1/models`` (the base model's name, root and length).
        Raises naming the engine when it does not answer within ``timeout`` or refuses the key."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            try:
                self._get("/health", 5)
                models = self._get("/v1/models", 30)["data"]
                break
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    raise RuntimeError(f"the engine at {self.url} refused the key ({e.code}): set {KEY_ENV} to "
                                       "its API key") from None
                last = f"{e.code} {e.reason}"
            except (OSError, ValueError, KeyError, TypeError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine at {self.url} did not answer within {timeout:.0f} s ({last})")
            time.sleep(1.0)
        base = [m for m in models if not m.get("parent")]
        if not base:
            raise RuntimeError(f"the engine at {self.url} lists no base model in /v1/models: {models}")
        self.model, self.root = base[0]["id"], base[0].get("root")
        self.max_model_len = base[0].get("max_model_len")
        self._last_ok = time.monotonic()
        return self

    def alive(self) -> bool:
        """False once ``/health`` has not answered for :data:`DEAD_AFTER_S` (asked at most every
        :data:`HEALTH_EVERY_S`)."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < HEALTH_EVERY_S:
                return now - self._last_ok < DEAD_AFTER_S
            self._checked = now
        try:
            self._get("/health", 5)
            self._last_ok = time.monotonic()
        except (OSError, ValueError):
            pass
        return time.monotonic() - self._last_ok < DEAD_AFTER_S

    def describe(self) -> str:
        return f"the engine at {self.url} has not answered /health for {DEAD_AFTER_S:.0f} s"

    def stop(self, timeout: float = 30.0) -> None:
        """Not this server's process: left running."""

    def tail(self, n: int = 40) -> str:
        return ""


def probe(sampler, template: str, copy_to: str) -> None:
    """Load the server's initial adapter (copied to ``copy_to`` under ``--snapshot-dir``) into a remote engine
    and unload it: raises with the engine's answer when it cannot (LoRA off, rank too small, the directory not
    readable there)."""
    import shutil
    shutil.copytree(template, copy_to, dirs_exist_ok=True)
    try:
        sampler.preload(copy_to)
        sampler.release(copy_to)
    except Exception as e:  # noqa: BLE001 - said with the engine's answer
        raise RuntimeError(f"the engine at {sampler.url} cannot load the server's adapters from {copy_to} ({e}): "
                           "it needs --enable-lora, --max-lora-rank >= the server's --lora-rank, "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and --snapshot-dir readable at the same path "
                           "where it runs") from None
    finally:
        shutil.rmtree(copy_to, ignore_errors=True)
