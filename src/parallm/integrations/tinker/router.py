"""Several sampling engines behind one router (``--engines N``): :class:`EngineRouter`.

Each engine is a :class:`~.sampling.VllmSampler` (a ``vllm serve`` process group of its own, with its own tensor
parallelism, ``--engine-tp``). The router sends every sampling request to one engine:

- **stickiness**: the requests of one sampling session (the SDK's ``SamplingClient``: its
  ``sampling_session_id``; a request without one is keyed by its model path, or the base model) go to the engine
  that served the session first, while that engine lives, so its prefix cache keeps the session's prompts warm;
- **load**: a session's first request goes to the live engine with the fewest requests in flight, ties broken by
  the fewest sessions already assigned to it, then the lowest index (so sessions created one after another
  alternate between idle engines);
- **failures**: an engine whose process group exits (found by a watcher thread twice a second, or by a request
  whose connection breaks) is taken out of rotation: the requests it had in flight fail with an error naming it
  (vLLM keeps no state a retry could resume from), its sessions move to the other engines at their next request,
  and the others keep serving. With no engine left every request fails at once saying so.

A full-fine-tuning client's snapshots (``--full-engine``): one more engine, without LoRA and outside the
rotation, whose weights parallm pushes (``push_weights`` over ``parallm_shm``, :mod:`.sampling_routes`); it
serves the newest pushed snapshot only (a sampling client of an older one is refused, it would get other
weights), and its requests go nowhere else.

Sampler snapshots reach every live engine: a snapshot is loaded into each one as it is saved
(:meth:`preload`, in the background; an engine also loads it on first use), and unloaded from each when
it is released.
"""

from __future__ import annotations

import logging
import threading

from .sampling import SampleInputError, SampleJob, SamplerDead

__all__ = ["EngineRouter", "FULL_PUSH"]

FULL_PUSH = "parallm-full-push:"      # a pushed full snapshot's handle (no directory): FULL_PUSH + model id + count

log = logging.getLogger("parallm.tinker")


class EngineRouter:
    """``engines``: objects with ``sample(job)``, ``wait()``, ``state()``, ``close()``, ``release(dir)``,
    ``preload(dir)``, ``alive()``, ``pid()``, ``url`` (:class:`~.sampling.VllmSampler`)."""

    def __init__(self, engines: list, *, watch_interval: float = 0.5, full_engine=None):
        if not engines:
            raise ValueError("EngineRouter: at least one engine")
        self.engines = list(engines)
        self.full_engine = full_engine               # the pushed engine (--full-engine), or None
        self.full_current: str | None = None         # the FULL_PUSH handle it holds now
        self.lock = threading.Lock()
        self.inflight = [0] * len(engines)
        self.served = [0] * len(engines)
        self.sessions: dict[str, int] = {}           # session key -> engine index
        self.assigned = [0] * len(engines)           # sessions currently stuck to each engine
        self.out: dict[int, str] = {}                # engines out of rotation -> why
        self._stop = threading.Event()
        self._watch_interval = watch_interval
        threading.Thread(target=self._watch, name="tinker-engine-watch", daemon=True).start()

    # -- what the server reads ------------------------------------------------------------------------------------
    serves_full = False

    @property
    def url(self) -> list[str]:
        return [e.url for e in self.engines]

    def pid(self) -> int:
        return self.engines[0].pid()

    def pids(self) -> list[int]:
        return [e.pid() for e in self.engines]

    def _all(self) -> list:
        return self.engines + ([self.full_engine] if self.full_engine is not None else [])

    def state(self) -> str:
        states = [e.state() for e in self._all()]
        if any(s == "starting" for s in states):
            return "starting"
        live = [i for i, s in enumerate(states[:len(self.engines)]) if s == "ready" and i not in self.out]
        if live:
            return "ready"
        return f"failed: every engine failed ({'; '.join(self._why(i, s) for i, s in enumerate(states))})"

    def _why(self, i: int, state: str) -> str:
        return f"engine {i}: {self.out.get(i) or state}".splitlines()[0]

    def wait(self) -> str:
        for e in self._all():
            e.wait()
        return self.state()

    def close(self) -> None:
        self._stop.set()
        for e in self._all():
            e.close()

    # -- routing ----------------------------------------------------------------------------------------------------
    def _live(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if i not in self.out and e.dead is None]

    def _take_out(self, i: int, why: str) -> None:
        """Engine ``i`` leaves the rotation (caller holds the lock); its sessions are unassigned."""
        if i in self.out:
            return
        self.out[i] = why
        for key in [k for k, v in self.sessions.items() if v == i]:
            del self.sessions[key]
        self.assigned[i] = 0
        log.warning("sampling engine %d (%s) out of rotation: %s", i, self.engines[i].url, why.splitlines()[0])

    def pick(self, key: str) -> int:
        """The engine for a request of session ``key`` (counted in flight: :meth:`done` ends it)."""
        with self.lock:
            for i in [i for i, e in enumerate(self.engines) if i not in self.out and e.dead is not None]:
                self._take_out(i, self.engines[i].dead)
            live = self._live()
            if not live:
                raise SamplerDead("every sampling engine is out of rotation: "
                                  + "; ".join(f"engine {i} ({self.engines[i].url}): {self.out.get(i, '?')}"
                                              .splitlines()[0] for i in range(len(self.engines)))
                                  + "; training continues, sampling does not: restart the server")
            i = self.sessions.get(key)
            if i is None or i not in live:
                i = min(live, key=lambda j: (self.inflight[j], self.assigned[j], j))
                self.sessions[key] = i
                self.assigned[i] += 1
            self.inflight[i] += 1
            return i

    def done(self, i: int) -> None:
        with self.lock:
            self.inflight[i] -= 1
            self.served[i] += 1

    def sample(self, job: SampleJob):
        if job.adapter_dir is not None and job.adapter_dir.startswith(FULL_PUSH):
            return self._sample_full(job)
        key = job.session or (f"dir:{job.adapter_dir}" if job.adapter_dir else "base")
        i = self.pick(key)
        try:
            return self.engines[i].sample(job)
        except SamplerDead as e:
            with self.lock:
                self._take_out(i, str(e))
            left = len(self._live())
            raise SamplerDead(f"sampling engine {i} of {len(self.engines)} ({self.engines[i].url}) died while "
                              f"serving this request ({str(e).splitlines()[0]}); it is out of rotation, {left} "
                              "engine(s) keep serving: send the request again") from None
        finally:
            self.done(i)

    def _sample_full(self, job: SampleJob):
        if self.full_engine is None or job.adapter_dir != self.full_current:
            raise SampleInputError("this full-fine-tuning snapshot is no longer on the engine (a newer one was "
                                   "pushed, or its client was unloaded): the engine holds one snapshot, the "
                                   "newest: create a new sampling client")
        job = SampleJob(**{**job.__dict__, "adapter_dir": None})
        return self.full_engine.sample(job)

    # -- snapshots reach every live engine ----------------------------------------------------------------------------
    def preload(self, adapter_dir: str) -> None:
        """Load a new snapshot into every live engine, each on a thread of its own (errors logged: the engine
        loads it again on first use, and reports there)."""
        for i in self._live():
            threading.Thread(target=self._preload_one, args=(i, adapter_dir), daemon=True,
                             name=f"tinker-engine-{i}-load").start()

    def _preload_one(self, i: int, adapter_dir: str) -> None:
        try:
            self.engines[i].preload(adapter_dir)
        except Exception:  # noqa: BLE001 - see preload
            log.warning("engine %d could not load %s ahead of use", i, adapter_dir, exc_info=True)

    def release(self, adapter_dir: str) -> None:
        for i, e in enumerate(self.engines):
            if i in self.out:
                continue
            try:
                e.release(adapter_dir)
            except Exception:  # noqa: BLE001 - one engine's failure does not keep the others loaded
                log.warning("engine %d could not unload %s", i, adapter_dir, exc_info=True)

    def _watch(self) -> None:
        """Take an engine out of rotation as soon as its process group exits (not only at its next request)."""
        while not self._stop.wait(self._watch_interval):
            for i, e in enumerate(self.engines):
                if i in self.out or not e.started():
                    continue
                if not e.alive():
                    why = e.mark_dead()
                    with self.lock:
                        self._take_out(i, why)
