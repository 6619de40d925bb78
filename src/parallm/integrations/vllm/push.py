"""Pushing the trainer's weights into vLLM engines: :func:`push_weights`.

Two kinds of target, one function:

* **an in-process engine** (what :func:`~parallm.integrations.vllm.launch` returned on one rank):
  ``push_weights(chunks, llm, rank=r)`` streams ``export_hf_tensors(dst_ranks=[r], copy=True)`` into one
  ``reload_weights`` call of the engine (HF names, checkpoint format), so the engine loads tensor by tensor as the
  buckets arrive: never the whole model at once. ``copy=True`` because vLLM keeps tensors: its layer-wise reload
  holds each layer's tensors until the layer is complete (and the vocabulary-padded embedding / head until the
  end), which the stream's default contract (valid until the next item) does not allow; with ``copy=True`` each
  bucket's tensors are memory of their own (no extra copy: the messages land there), freed when vLLM drops them.
  Tied models also send ``lm_head.weight`` (:mod:`.fixes`). On the engine's rank the stream runs on a thread of
  its own (:class:`_ReadAhead`), up to two buckets ahead of the engine loading on the calling thread; that thread
  is the only one issuing collectives until the stream ends. After the reload the engine's prefix cache is reset
  (checked: see :func:`_reset_prefix_cache`); a reload that fails part-way is closed (:func:`_reload`).
* **engines in other processes** (a :class:`~parallm.integrations.vllm.client.Connection` from
  :func:`~parallm.integrations.vllm.connect`): ``push_weights(chunks, conn)`` streams the weights to the
  connection's sending rank and fans every bucket out to every engine through vLLM's weight-transfer calls
  (:mod:`.remote`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

import torch

from ...checkpoint.cast import WIRE_DTYPES
from ...checkpoint.export import DEFAULT_BUCKET_BYTES, _parse_bucket, export_metadata, open_stream
from ...errors import ParallelError
from ...parallel.errors import exchange_rows, gather_objects, raise_failures, status_of
from ...parallel.state import as_chunks, dims_of
from .client import Connection
from .fixes import TIED_HEAD, TIED_SOURCE, SinkWriter, cpu_experts_repacked, engine_tensors, mismatch
from .remote import push_remote
from .unsupported import refuse_family

__all__ = ["push_weights"]


def _in_process_model_config(llm, rank: int):
    """The engine's model config; an error unless ``llm`` is a vLLM engine whose engine core runs in this
    process."""
    engine = getattr(llm, "llm_engine", None)
    model_config = getattr(engine, "model_config", None)
    if model_config is None or not hasattr(llm, "collective_rpc"):
        raise TypeError(f"push_weights: llm on rank {rank} is a {type(llm).__name__}, not a vllm.LLM "
                        "(parallm.integrations.vllm.launch starts one)")
    if getattr(engine, "model_executor", None) is None:
        raise ValueError(f"push_weights: the engine on rank {rank} runs its engine core in another process "
                         "(VLLM_ENABLE_V1_MULTIPROCESSING=1); push_weights hands tensors to an engine in this "
                         "process: start it with parallm.integrations.vllm.launch")
    return model_config


def _check_engine(chunks, llm, rank: int, dtype):
    """On the engine's rank, before anything moves: the engine is an in-process vLLM engine, the dtype is the
    engine's, and its names and shapes are the model's. Returns (engine dtype, whether the engine is tied)."""
    model_config = _in_process_model_config(llm, rank)
    engine_dtype = model_config.dtype
    if engine_dtype not in WIRE_DTYPES:
        raise ValueError(f"push_weights: the engine runs {engine_dtype}; parallm exports "
                         f"{[str(d) for d in WIRE_DTYPES]}")
    if dtype is not None and dtype != engine_dtype:
        raise ValueError(f"push_weights: dtype mismatch: the engine on rank {rank} runs {engine_dtype}, "
                         f"push_weights was given dtype={dtype} (leave dtype=None to push in the engine's dtype)")
    engine, tied = engine_tensors(model_config.hf_config)
    pushed = {m.name: m.shape for m in export_metadata(chunks, dtype=engine_dtype)}
    if tied:
        pushed.setdefault(TIED_HEAD, pushed.get(TIED_SOURCE))
    problem = mismatch(pushed, engine)
    if problem:
        raise ValueError(f"push_weights: the engine's model on rank {rank} does not match this model: {problem}")
    return engine_dtype, tied


def _reload(llm, weights) -> None:
    """vLLM's ``reload_weights`` from ``weights``. When it fails part-way (the engine's loader, or the stream: a
    sending rank's failure), vLLM leaves its layer-wise reload open: layers not yet complete keep the tensors
    they received and count them, so the next reload would complete them early with this push's stale tensors
    and drop the rest. The reload is closed here instead (``finalize_layerwise_reload``: the layers not reached
    keep their old weights, a layer reached in part is built from uninitialised memory): the engine must not be
    used until the next push, which is raised on every rank, succeeds; that push then reloads every layer in
    full. gpt-oss's attention sinks are written after the reload (:class:`.fixes.SinkWriter`)."""
    model = llm.apply_model(lambda m: m)[0]
    sinks = SinkWriter(model)
    with cpu_experts_repacked(model):
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sinks.divert(weights),
                                                         "is_checkpoint_format": True})
        except BaseException:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            with contextlib.suppress(Exception):
                finalize_layerwise_reload(model, llm.llm_engine.model_config)
            raise
    sinks.apply()


def _reset_prefix_cache(llm, rank: int) -> None:
    """vLLM's prefix cache (on by default) keeps the keys and values of cached prompt blocks, computed with the
    old weights, and its worker-side reload does not touch the scheduler's cache: reset it after every reload,
    and fail when vLLM refuses (it does while blocks are in use: requests running during the push)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"push_weights: the engine on rank {rank} refused to reset its prefix cache (blocks in "
                           "use: requests ran during the push); its cached prompt prefixes would keep keys and "
                           "values of the old weights")


def _cuda_context():
    """The calling thread's current CUDA device and stream (None without CUDA), for a thread working for it."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    return device, torch.cuda.current_stream(device)


@contextlib.contextmanager
def _on_cuda_context(context):
    """Make ``context`` (from :func:`_cuda_context`) current on this thread."""
    if context is None:
        yield
        return
    device, stream = context
    torch.cuda.set_device(device)
    with torch.cuda.stream(stream):
        yield


class _ReadAhead:
    """The engine rank's side of a push: a thread runs the export stream (its receives, its own shards' copies,
    its agreements) up to ``limit`` bytes ahead of the engine, which loads on the calling thread meanwhile. The
    stream is only ever driven by that thread; the engine's rank issues no other collective until ``close``.
    Iterating yields the stream's items in order, then raises what the stream raised (a peer's failure, a lost
    peer). On CUDA the thread runs on the calling thread's current device and stream (a new thread starts on
    device 0's default stream: the stream's buffer fences would be recorded there, and its copies ordered there,
    not where the engine reads them). ``close(error)`` ends it: with an error of the consumer (the engine), the
    thread throws it into the stream, which tells the other ranks (as a consumer's failure inside the stream
    does), and is joined."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit = stream, max(1, int(limit))
        self.items = collections.deque()
        self.queued = 0
        self.done = False
        self.failure = None            # what the stream raised
        self.abort = None              # what the consumer failed with (``close``)
        self.cond = threading.Condition()
        self.cuda = _cuda_context()
        self.thread = threading.Thread(target=self._run, name="parallm-push-read-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with _on_cuda_context(self.cuda):
                self._read()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.failure = e
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def _read(self) -> None:
        for name, tensor in self.stream:
            size = tensor.numel() * tensor.element_size()
            with self.cond:
                while self.queued and self.queued + size > self.limit and self.abort is None:
                    self.cond.wait()
                if self.abort is not None:
                    break
                self.items.append((name, tensor, size))
                self.queued += size
                self.cond.notify_all()
            name = tensor = None
        if self.abort is not None:
            with contextlib.suppress(BaseException):
                self.stream.throw(self.abort)

    def __iter__(self):
        while True:
            with self.cond:
                while not self.items and not self.done:
                    self.cond.wait()
                if not self.items:
                    break
                name, tensor, size = self.items.popleft()
                self.queued -= size
                self.cond.notify_all()
            yield name, tensor
            name = tensor = None
        if self.failure is not None:
            raise self.failure

    def close(self, error=None) -> None:
        with self.cond:
            if not self.done:
                self.abort = error if error is not None else ParallelError(
                    "push_weights: the engine stopped reading the weights before their end")
            self.items.clear()
            self.cond.notify_all()
        self.thread.join()


def push_weights(chunks, llm, *, rank: int = 0, dtype: torch.dtype | None = None, bucket_bytes=None) -> dict:
    """Push the model's current weights into vLLM engines. Two forms, both collective over every rank:

    ``push_weights(chunks, connection)`` with a :class:`~parallm.integrations.vllm.client.Connection` (what
    :func:`~parallm.integrations.vllm.connect` returned, on every rank): one export stream to the connection's
    sending rank, fanned out to every healthy engine of the connection (see :mod:`.remote`; ``rank`` is not
    used; ``bucket_bytes`` defaults to 512 MiB there, capped at the model's size: the sender's shared memory is
    two slots of it). Returns, on every rank: ``{"bytes", "tensors", "updates", "seconds", "gbps", "buckets",
    "engines": {engine name: {"bytes", "seconds" (until its finish_weight_update returned), "gbps"}}}``; an engine that
    failed raises :class:`~parallm.integrations.vllm.client.EngineFailed` on every rank after the others have
    finished.

    ``push_weights(chunks, llm, rank=r)``: into the in-process vLLM engine on global rank ``rank`` (what
    :func:`launch` returned there; None elsewhere). Collective over every rank, at any tp / pp / vpp / ep layout:
    the stream ``export_hf_tensors(chunks, dtype=..., bucket_bytes=..., dst_ranks=[rank], copy=True)`` goes into one
    ``reload_weights`` call of the engine as it arrives, bucket by bucket (``bucket_bytes``, default 64 MiB), read
    on a thread of the engine's rank up to two buckets ahead of the engine.

    ``dtype``: None pushes in the engine's dtype; any other value must be the engine's dtype. Checked on the
    engine's rank before anything moves, and raised on every rank (no rank left waiting): no engine on ``rank``
    (or one whose engine core runs in another process); a dtype mismatch; names the engine does not know,
    engine tensors the model does not have, or shapes that differ (the engine's side read from its config
    through parallm's table for its architecture). A failure inside the engine while loading ends the stream on
    every rank with the engine's error; a failure on a sending rank, with that rank's.

    Returns, on every rank: ``{"bytes": bytes streamed, "seconds": wall time of the slowest rank, "gbps":
    bytes / seconds / 1e9, "tensors": tensors pushed, "buckets": buckets}``.
    """
    # every rank alike, before any collective; a connection's engines already run the model elsewhere
    refuse_family(as_chunks(chunks)[0].spec.family, "push_weights", local=not isinstance(llm, Connection))
    if isinstance(llm, Connection):
        return push_remote(chunks, llm, dtype=dtype, bucket_bytes=bucket_bytes)
    t0 = time.perf_counter()
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    world, me = layout.world, layout.rank
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"push_weights: rank must be a global rank of the world of {world} (0..{world - 1}), "
                         f"got {rank!r}")
    if dtype is not None and dtype not in WIRE_DTYPES:
        raise ValueError(f"push_weights: dtype must be None or one of {[str(d) for d in WIRE_DTYPES]}, got {dtype}")
    error, engine_dtype, tied = None, None, False
    if me == rank and llm is not None:
        try:
            engine_dtype, tied = _check_engine(chunks, llm, rank, dtype)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            error = e
    code = WIRE_DTYPES.index(engine_dtype) if engine_dtype is not None else -1
    asked = WIRE_DTYPES.index(dtype) if dtype is not None else -1
    rows = exchange_rows([int(error is not None), int(llm is not None), code, asked, int(tied)],
                         what="push_weights", error=error)
    if not rows[rank, 1]:
        others = [r for r in range(world) if rows[r, 1]]
        raise ValueError(f"push_weights: no vLLM engine on rank {rank} (llm is None there)" + (
            f"; rank(s) {others} passed one: pass the rank launch() started it on" if others else
            "; start one with parallm.integrations.vllm.launch(model_dir, rank=...)"))
    if rows[:, 0].any():
        statuses = gather_objects(status_of(error), what="push_weights", error=error)
        if error is not None:
            raise error
        raise_failures(statuses, what="push_weights")
    if not bool((rows[:, 3] == rows[0, 3]).all()):
        raise ValueError(f"push_weights: every rank must pass the same dtype; rank(s) "
                         f"{[r for r in range(world) if rows[r, 3] != rows[0, 3]]} differ from rank 0")
    wire, tied = WIRE_DTYPES[int(rows[rank, 2])], bool(rows[rank, 4])
    stream, state = open_stream(chunks, dtype=wire, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                                dst_ranks=[rank], copy=True, what="push_weights")
    nbytes, tensors = 0, 0
    error = None
    if me == rank:
        ahead = _ReadAhead(stream, 2 * _parse_bucket(bucket_bytes or DEFAULT_BUCKET_BYTES))

        def weights():
            nonlocal nbytes, tensors
            for name, tensor in ahead:
                nbytes += tensor.numel() * tensor.element_size()
                tensors += 1
                yield name, tensor
                if tied and name == TIED_SOURCE:
                    tensors += 1
                    yield TIED_HEAD, tensor
        try:
            _reload(llm, weights())
            _reset_prefix_cache(llm, rank)
        except Exception as e:  # noqa: BLE001 - ends the stream on every rank, or is agreed on below
            error = e
        except BaseException as e:  # KeyboardInterrupt and the like: the others are told, then it goes on up
            ahead.close(e)
            raise
        ahead.close(error)          # tells the others when buckets are left; a no-op when the stream has ended
        if state.exchanged:         # the others raised inside their stream: nobody takes part in the last round
            raise error if error is not None else ahead.abort
    else:
        for _ in stream:
            pass
    seconds_us = int((time.perf_counter() - t0) * 1e6)
    rows = exchange_rows([int(error is not None), seconds_us, nbytes, tensors], what="push_weights", error=error)
    if rows[:, 0].any():
        statuses = gather_objects(status_of(error), what="push_weights", error=error)
        if error is not None:
            raise error
        raise_failures(statuses, what="push_weights")
    seconds = float(rows[:, 1].max()) / 1e6
    nbytes = int(rows[rank, 2])
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9 if seconds else 0.0,
            "tensors": int(rows[rank, 3]), "buckets": state.buckets}
