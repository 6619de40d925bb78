"""Sampling for the SDK's ``SamplingClient`` (``sample``, ``compute_logprobs``): a vLLM engine in processes of its
own, or, where vLLM is not installed, parallm's own forwards.

- :class:`VllmSampler` (``--sampler vllm``, the default when vLLM imports): a ``vllm serve`` engine
  (``parallm.integrations.vllm.serve``, one worker) started by rank 0 with LoRA enabled
  (``--enable-lora``, runtime adapter loading). A sampler snapshot (``save_weights_for_sampler``) is a PEFT
  directory (``parallm.save_hf_adapter``) that the engine loads once under its own name
  (``/v1/load_lora_adapter``); the base model samples without one. Requests go to vLLM's
  ``/v1/completions`` with the prompt as token ids. The engine is a process of its own: when it dies, the
  requests in flight fail with the error, later sampling requests fail at once saying so, and training goes
  on.
- :class:`~.parallm_sampler.ParallmSampler` (``--sampler parallm``, or when vLLM is missing): the trainer ranks compute it, as
  work items between the training requests: prompt log-probs with one ``forward(output="logprobs")``, samples
  one token at a time with a full forward per token (no KV cache: quadratic in the length, a reference and a
  fallback, not a serving engine). Exact: the same model and numerics as training.

Both return the log-probs of the *unscaled* distribution (``log_softmax(logits)``, before temperature, top-k or
top-p: vLLM's default ``raw_logprobs``), the sampled tokens including the stop token that ended a sample, and
``stop_reason`` ``"stop"`` (a stop token / string or EOS) or ``"length"`` (``max_tokens``). Sampling
parameters: ``temperature``, ``top_p``, ``top_k`` (-1: all), ``max_tokens`` (None: up to the context length),
``seed``, ``stop`` (strings, token ids; ``None`` stops at EOS; ``[]`` disables EOS too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request

import numpy as np

from .engine_adapters import HeadSupport, head_factors_zero, stripped_copy
from .remote_engine import RemoteServer, engine_key
from .remote_engine import probe as remote_probe

__all__ = ["SampleInputError", "SampleJob", "SamplerDead", "VllmSampler", "stop_spec"]

log = logging.getLogger("parallm.tinker")


class SamplerDead(RuntimeError):
    """The sampling engine is gone; the message says what happened."""


class SampleInputError(ValueError):
    """A sampling request the sampler cannot serve as asked (a user error)."""


@dataclasses.dataclass
class SampleJob:
    prompt: list                 # token ids
    num_samples: int
    params: dict                 # the SDK's SamplingParams as a dict
    prompt_logprobs: bool
    adapter_dir: str | None      # a sampler snapshot's PEFT directory, None: the base model
    max_model_len: int
    topk_prompt: int = 0         # top-k log-probs of every prompt position (0: none)
    topk_sample: int = 0         # top-k log-probs of every sampled token's distribution (0: none)
    session: str | None = None   # the sampling session (the router keeps a session on one engine)


@dataclasses.dataclass
class SampleResult:
    sequences: list              # (tokens, logprobs, stop_reason) per sample
    prompt_logprobs: np.ndarray | None = None
    topk_sampled: list | None = None     # per sample (ids [n, k], logprobs [n, k])
    topk_prompt: tuple | None = None     # (ids [P, k], logprobs [P, k]), row 0 empty


TOPK_MAX = 64                    # top-k log-probs per position (vLLM's --max-logprobs for the engine)
TOPK_EMPTY = -99999.0            # the SDK's empty cell (token id 0)


def empty_topk(n: int, k: int) -> tuple:
    return np.zeros((n, k), np.int32), np.full((n, k), TOPK_EMPTY, np.float32)


def stop_spec(stop, eos: list) -> tuple[list, list, bool]:
    """Tinker's ``stop`` -> (stop strings, stop token ids, ignore_eos)."""
    if stop is None:
        return [], [], False
    if isinstance(stop, str):
        return [stop], [], False
    stop = list(stop)
    if not stop:
        return [], [], True
    if all(isinstance(s, str) for s in stop):
        return stop, [], False
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return [], stop, False
    raise SampleInputError("sampling_params.stop mixes strings and token ids")


def max_new_tokens(job: SampleJob) -> int:
    room = job.max_model_len - len(job.prompt)
    if room < 1:
        raise SampleInputError(f"the prompt has {len(job.prompt)} tokens; the sampler's context is "
                               f"{job.max_model_len}")
    want = job.params.get("max_tokens")
    return room if want is None else min(int(want), room)


# -- vLLM in processes of its own -------------------------------------------------------------------------------

class VllmSampler:
    """A ``vllm serve`` engine for the base model with runtime LoRA loading."""

    serves_full = False          # full-fine-tuning snapshots: the parallm sampler (sampling_routes.py)

    def __init__(self, model_dir: str, *, lora_rank: int, max_model_len: int, max_loras: int = 4,
                 timeout: float = 600.0, python: str | None = None, head: dict | None = None,
                 tensor_parallel_size: int = 1, head_support: HeadSupport | None = None, pushed: bool = False,
                 url: str | None = None, probe: tuple[str, str] | None = None):
        self.max_model_len, self.timeout = max_model_len, timeout
        self.name = "base"
        # url: an engine started elsewhere (remote_engine.py); probe: (initial adapter, a copy's path) it loads
        # once at start, so a misconfigured engine is refused then
        self.remote, self.probe = url is not None, probe
        if self.remote:
            self.key = engine_key()
            self.server = RemoteServer(url, self.key)
        else:
            from ..vllm import serve
            # pushed: an engine without LoRA whose weights parallm pushes (push_weights: the full-fine-tuning
            # client's snapshots, router.py); its weight-transfer routes need vLLM's development mode
            args = ([] if pushed else ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras",
                                       str(max_loras)])
            args += ["--generation-config", "vllm", "--served-model-name", self.name, "--max-logprobs",
                     str(TOPK_MAX)]
            self.key = secrets.token_urlsafe(32)       # this engine's own key: no unauthenticated side door
            env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_API_KEY": self.key}
            self.server = serve(model_dir, max_model_len=max_model_len, args=args, env=env, python=python,
                                wait=False, dev_mode=pushed, tensor_parallel_size=tensor_parallel_size)
        self.url = self.server.url
        # the model holds head adapters: {"arch", "zero_adapter"} (engine_adapters.py: what the engine is given)
        self.head = head
        self.head_support = (head_support or HeadSupport(head["arch"], python)) if head else None
        self.loaded: dict[str, str] = {}
        self._count = 0                          # engine-side adapter names handed out (never reused)
        self.gate = _Gate()
        self.lock = threading.RLock()
        self.dead: str | None = None
        self._ready = False

    def pid(self) -> int | None:
        return None if self.remote else self.server.process.pid

    def started(self) -> bool:
        return self._ready

    def alive(self) -> bool:
        return self.server.alive()

    def mark_dead(self) -> str:
        """The engine's process group exited (an engine elsewhere: stopped answering): every later request fails
        at once with the reason (returned)."""
        if self.dead is None and self.remote:
            self.dead = f"the vLLM sampler died: {self.server.describe()}"
        elif self.dead is None:
            self.dead = (f"the vLLM sampler (pid {self.server.process.pid}, {self.url}) died (exit code "
                         f"{self.server.process.returncode}); training continues; the end of its log "
                         f"{self.server.log}:\n"
                         f"{self.server.tail()[-800:]}")
        return self.dead

    def preload(self, adapter_dir: str) -> None:
        """Load a snapshot's adapter now rather than at its first request (:mod:`.router`)."""
        self._model(adapter_dir)

    def _ensure_ready(self) -> None:
        """The engine starts while the model is built; the first sample waits for it (up to ``timeout``)."""
        if self._ready:
            return
        with self.lock:
            if self._ready or self.dead is not None:
                return
            try:
                self.server.wait_ready(self.timeout)
                self._ready = True
                if self.remote:
                    self._check_remote()
            except Exception as e:  # noqa: BLE001 - the sampler is unusable: say why on every request
                self._ready = False
                self.dead = f"the vLLM sampler did not start: {e}"

    def _check_remote(self) -> None:
        """An engine started elsewhere: its base model's name, its context length, and one adapter load."""
        self.name = self.server.model
        if self.server.max_model_len is not None and self.server.max_model_len < self.max_model_len:
            raise RuntimeError(f"the engine at {self.url} serves {self.server.max_model_len} tokens a sequence; "
                               f"the server's context is {self.max_model_len}: start it with --max-model-len "
                               f"{self.max_model_len} or give the server --max-context {self.server.max_model_len}")
        if self.probe is not None:
            remote_probe(self, *self.probe)

    def state(self) -> str:
        """``ready``, ``starting`` or ``failed: <why>`` (what ``healthz`` and the ready file report)."""
        if self.dead is not None:
            return f"failed: {self.dead.splitlines()[0]}"
        return "ready" if self._ready else "starting"

    def wait(self) -> str:
        self._ensure_ready()
        return self.state()

    def close(self) -> None:
        self.server.stop()

    def _post(self, route: str, body: dict, *, timeout: float = 600.0):
        self._ensure_ready()
        if self.dead is not None:
            raise SamplerDead(self.dead)
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as res:
                raw = res.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the vLLM sampler refused {route}: {e.code} {e.read().decode()[:500]}") from None
        except (OSError, urllib.error.URLError) as e:
            for _ in range(0 if self.remote else 20):     # a killed engine is reaped within moments
                if not self.server.alive():
                    break
                time.sleep(0.25)
            if not self.server.alive():
                raise SamplerDead(self.mark_dead()) from None
            raise RuntimeError(f"the vLLM sampler at {self.url} did not answer {route}: {e}") from None
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:             # vLLM answers some routes with plain text
            return raw.decode(errors="replace")

    def _model(self, adapter_dir: str | None) -> str:
        """The engine-side name of a snapshot's adapter, loaded on first use. Snapshot directories are immutable
        (a save under a used name writes a new one: :mod:`.checkpoints`), so the directory identifies the
        weights; a name is never reused."""
        if adapter_dir is None:
            if self.head is None:
                return self.name
            adapter_dir = self.head["zero_adapter"]        # never "no adapter" beside head adapters (above)
        with self.lock:
            name = self.loaded.get(adapter_dir)
            if name is None:
                path = self._engine_dir(adapter_dir)
                self._count += 1
                name = f"tinker-{self._count}"
                self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
                self.loaded[adapter_dir] = name
            return name

    def _engine_dir(self, adapter_dir: str) -> str:
        """The directory the engine loads for a snapshot (engine_adapters.py)."""
        if self.head is None:
            return adapter_dir
        zero = head_factors_zero(adapter_dir)
        if zero is None:
            return adapter_dir
        if zero:
            return stripped_copy(adapter_dir, adapter_dir.rstrip("/") + "-engine")
        if not self.head_support.get():
            why = self.head_support.error or f"vLLM's {self.head['arch']} lists no lm_head embedding module"
            raise SampleInputError(f"this snapshot trains the output head (train_unembed=True) and vLLM does not "
                                   f"apply LoRA on {self.head['arch']}'s head ({why}): sample it with "
                                   "--sampler parallm, or train with train_unembed=False (or --lora-unembed skip)")
        return adapter_dir

    def release(self, adapter_dir: str) -> None:
        """Unload a snapshot's adapter from the engine (its directory was removed)."""
        with self.lock:
            name = self.loaded.pop(adapter_dir, None)
        if name is not None and self._ready and self.dead is None:
            self._post("/v1/unload_lora_adapter", {"lora_name": name}, timeout=60.0)

    def sample(self, job: SampleJob):
        """One ``/v1/completions`` call, or two when prompt log-probs come with several samples: vLLM-CPU 0.32's
        LoRA logits path indexes the adapters per request while prompt log-probs need a row per prompt token, so
        a prompt log-prob request runs with ``n = 1`` and alone on the engine (:class:`_Gate`); with ``n > 1`` or
        another request beside it the engine core crashes (seen: ``einsum(): subscript b has size 2 ... 8``) or
        could apply one request's head adapter to another's rows."""
        body = self._body(job)
        prompt_side = job.prompt_logprobs or job.topk_prompt
        if not prompt_side:
            with self.gate.shared():
                return self._parse(job, self._post("/v1/completions", body), None)
        prompt_body = dict(body, prompt_logprobs=job.topk_prompt)
        if job.num_samples == 1:
            with self.gate.alone():
                res = self._post("/v1/completions", prompt_body)
            return self._parse(job, res, res)
        prompt_body.update(n=1, max_tokens=1, logprobs=0)
        with self.gate.alone():
            first = self._post("/v1/completions", prompt_body)
        with self.gate.shared():
            res = self._post("/v1/completions", body)
        return self._parse(job, res, first)

    def _body(self, job: SampleJob) -> dict:
        strings, ids, ignore_eos = stop_spec(job.params.get("stop"), [])
        p = job.params
        body = {"model": self._model(job.adapter_dir), "prompt": list(job.prompt), "n": job.num_samples,
                "max_tokens": max_new_tokens(job), "temperature": float(p.get("temperature", 1.0)),
                "top_p": float(p.get("top_p", 1.0)), "top_k": int(p.get("top_k", -1)), "logprobs": job.topk_sample,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "stop": strings,
                "stop_token_ids": ids, "ignore_eos": ignore_eos, "skip_special_tokens": False}
        if p.get("seed") is not None:
            body["seed"] = int(p["seed"]) % (2 ** 63 - 1)
        return body

    def _parse(self, job: SampleJob, res: dict, prompt_res: dict | None) -> SampleResult:
        choices = sorted(res["choices"], key=lambda c: c["index"])
        out = SampleResult([])
        for c in choices:
            lp = c.get("logprobs") or {}
            out.sequences.append((list(c["token_ids"]), [float(x) for x in lp.get("token_logprobs") or []],
                                  "length" if c.get("finish_reason") == "length" else "stop"))
        if job.topk_sample:
            out.topk_sampled = [_vllm_topk([{int(str(t).removeprefix("token_id:")): v for t, v in d.items()}
                                            for d in (c.get("logprobs") or {}).get("top_logprobs") or []],
                                           job.topk_sample) for c in choices]
        if prompt_res is None:
            return out
        raw = prompt_res["choices"][0].get("prompt_logprobs") or []
        if job.prompt_logprobs:
            out.prompt_logprobs = np.full(len(job.prompt), np.nan, dtype=np.float32)
            for i, entry in enumerate(raw[:len(job.prompt)]):
                if entry:
                    got = entry.get(str(job.prompt[i]), entry.get(job.prompt[i]))
                    out.prompt_logprobs[i] = float(got["logprob"]) if got is not None else np.nan
        if job.topk_prompt:
            rows = [{int(t): v["logprob"] for t, v in (e or {}).items() if int(v.get("rank") or 0) <= job.topk_prompt}
                    for e in raw[:len(job.prompt)]]
            out.topk_prompt = _vllm_topk(rows, job.topk_prompt, empty_first=True)
        return out


class _Gate:
    """Requests share the engine; ``alone()`` waits for the others to end and holds new ones meanwhile."""

    def __init__(self):
        self.cond = threading.Condition()
        self.running, self.exclusive, self.waiting = 0, False, 0

    @contextlib.contextmanager
    def shared(self):
        with self.cond:
            while self.exclusive or self.waiting:
                self.cond.wait()
            self.running += 1
        try:
            yield
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def alone(self):
        with self.cond:
            self.waiting += 1
            while self.exclusive or self.running:
                self.cond.wait()
            self.waiting -= 1
            self.exclusive = True
        try:
            yield
        finally:
            with self.cond:
                self.exclusive = False
                self.cond.notify_all()


def _vllm_topk(rows: list, k: int, *, empty_first: bool = False) -> tuple:
    """vLLM's per-position ``{token id: log-prob}`` (the top k, plus the chosen token when it ranks lower) -> the
    top ``k`` by log-prob as ``(ids [n, k], logprobs [n, k])``."""
    ids, lps = empty_topk(len(rows), k)
    for i, row in enumerate(rows):
        if empty_first and i == 0:
            continue
        best = sorted(row.items(), key=lambda kv: -float(kv[1]))[:k]
        for j, (t, v) in enumerate(best):
            ids[i, j], lps[i, j] = int(t), float(v)
    return ids, lps
