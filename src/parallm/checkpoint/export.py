"""The export stream (weight sync): every HF tensor, exactly once, to the ranks that want it, in buckets.

``export_hf_tensors(chunks, *, dtype=None, bucket_bytes=..., dst_ranks=None, copy=False)`` is what an RL trainer
calls to push its weights into an inference engine: the destinations get one full HF-named tensor at a time; the
other ranks only send. ``export_metadata(chunks, dtype=None)`` says what the stream will yield, in order, without
moving anything. The plan (who sends which rows of which tensor in which bucket) is
:mod:`parallm.checkpoint.export_plan`; :mod:`parallm.checkpoint.export_run` runs it.

Transfer, per bucket. A *direct* part (rows of an HF tensor, at least ``DIRECT_MIN_BYTES``) travels alone,
straight from the sender into its place in the destinations' HF tensors: no copy on arrival. The other parts
(small tensors; column slices of row-parallel weights, which interleave in the HF tensor) are *packed*: each sender
copies its packed parts into its own contiguous segment of the staging room, one message per sender, and every
destination copies them into place. A sender converts to the wire dtype in the copy that packs (a rank that is
not a destination sends direct parts straight from its parameters when no conversion is needed). When every rank
is a destination the messages are broadcasts over the world, else point-to-point sends to each destination.

The contract with the consumer (a destination's loop over the generator):

* **When a yielded tensor may be overwritten.** Without ``copy``, a yielded tensor is valid until the consumer
  asks for the next item: from that request on, the stream may write other tensors into its memory (a
  consumer that copies each tensor where it belongs before asking for the next, as a ``param.copy_(t)``
  loader does, needs nothing more). After the stream's end, the last tensors stay valid until the next
  ``export_hf_tensors`` call on the same model. What the stream actually does, no more to be relied on: it
  has two bucket buffers and reuses one for bucket k+1 when the consumer asks for the first tensor of bucket
  k, so that tensors of the bucket being read survive the request.
* **``copy=True``** for consumers that keep tensors past the next request, hand them to another CUDA stream
  without synchronising, or to another process: every yielded tensor is then the consumer's own; the stream
  never writes into its memory again. The tensors of one bucket are views of one fresh allocation holding just
  that bucket's HF tensors (no copy is made: the messages land there), freed when the consumer has dropped all
  of them; clone a tensor to keep it apart from its bucket's memory.
* **``out``** for consumers that own the memory the tensors must end up in (a shared-memory region another
  process reads, a registered transfer buffer): ``out(k, numel)`` returns the memory of bucket ``k`` (0, 1, ...
  in order): a contiguous 1-D tensor of the wire dtype on the parameters' device, at least ``numel`` elements,
  into which the stream writes that bucket's HF tensors back to back (the rank's own rows packed there, direct
  messages received there, packed ones copied from the staging room into place); the yielded tensors are views
  of it, at element offsets in yield order. ``out(k + 1, ...)`` is called when the consumer asks for the first
  tensor of bucket ``k`` (``out(0, ...)`` at the first request), so by then the consumer holds nothing of bucket
  ``k - 1`` from the stream and the memory it hands out may be bucket ``k - 1``'s: two buffers used in turn
  suffice, and the consumer may wait inside ``out`` until its reader is done with that buffer. Once bucket
  ``k``'s tensors are yielded the stream never writes into its memory again. Only destinations call it; with
  ``out`` the stream allocates no output buffer (the staging room stays the stream's). Not with ``copy=True``.
  For a model on an accelerator ``out`` may also return host memory (a shared-memory file, a pinned buffer):
  the stream then assembles bucket ``k`` in its own device buffer as usual and copies it into ``out``'s memory
  once it is complete, just before yielding its first tensor (a blocking device-to-host copy on the current
  stream, after the bucket's receives and placing copies); the yielded tensors are views of ``out``'s memory.
  Checked on CPU with the copy forced (tests/test_vllm_fanout.py); written, not run on a GPU.
* **CUDA streams.** Tensors are ready on the CUDA stream that is current when they are yielded (a consumer
  reading them on another stream makes it wait on that one first). When the consumer asks for the item that
  ends a buffer's validity, the stream records an event on the consumer's current stream (the one current at
  that request), and every write that reuses the buffer (the packing copy, and the receives, which NCCL orders
  after the current stream) is ordered after that event. A consumer that reads on a side stream must therefore
  make it visible on the current stream (``torch.cuda.current_stream().wait_stream(side)``) or ask for the next
  item inside ``torch.cuda.stream(side)``; one that hands tensors to another process (CUDA IPC) must pass
  ``copy=True``. Written from the CUDA semantics, not run: no GPU has run this code.
* **Ending early.** A consumer that stops before the end (``close()``, ``break`` out of its loop, or dropping
  the generator so that it is garbage-collected) ends the stream on every rank: the other ranks raise a
  ``ParallelError`` naming the rank that stopped and how far it read; the stopping rank stops quietly. An
  exception thrown into the generator (``gen.throw(e)``) ends it the same way, and the others raise ``e``'s
  type (re-created by name, see ``parallel.errors``) with its message. Either way no rank is left in a
  collective. The cost: one small all-gather over the world per bucket, through which every rank learns before
  each bucket whether to go on. A consumer that stops while holding the generator alive (a reference kept in a
  traceback, say) is not seen until the process-group timeout: close it (``contextlib.closing``).

Memory, independent of the model's size: a destination holds two bucket buffers (the consumer reads bucket k
while bucket k+1 is in flight), each of at most ``max(bucket_bytes, the largest entry)`` (with ``copy=True``
only the staging rooms are reused; the tensors themselves are the consumer's); a rank that is not a destination
holds at most two buffers of what it must pack for one bucket (nothing when it sends straight from its
parameters). Buffers stay with the model between calls; two streams open on the same model at once do not share
them.
"""

from __future__ import annotations

import torch

from ..model.loaded import require_loaded
from ..model.table import held_params, model_entries
from ..parallel.errors import exchange_rows, gather_objects, raise_failures, status_of
from ..parallel.state import as_chunks, dims_of, require_initialized
from .cast import WIRE_DTYPES, check_entry_casts
from .export_plan import TensorMeta, as_rows, make_plan, place, plan_buckets, stream_metadata
from .export_run import _Buffers, _StreamState, _run
from .saver import parse_size

# The planner's pieces under the names the tests and older code use.
_as_rows, _place = as_rows, place
__all__ = ["DEFAULT_BUCKET_BYTES", "DIRECT_MIN_BYTES", "TensorMeta", "export_hf_tensors", "export_metadata",
           "plan_buckets"]

DEFAULT_BUCKET_BYTES = 64 * 1024 ** 2
DIRECT_MIN_BYTES = 4 * 1024 ** 2   # parts this large travel alone into their place; smaller ones are packed


def _wire_dtype(chunks, dtype, what: str) -> torch.dtype:
    wire = dtype or chunks[0].config.params_dtype
    if wire not in WIRE_DTYPES:
        raise ValueError(f"{what}: dtype must be one of {[str(d) for d in WIRE_DTYPES]}, got {dtype}")
    return wire


def export_metadata(chunks, *, dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """What ``export_hf_tensors(chunks, dtype=dtype)`` yields on a destination, in the same order, as
    :class:`TensorMeta` ``(name, dtype, shape)``: computed from the model's table alone, without any exchange
    or data movement, and the same on every rank (whatever its layout coordinates). Not collective. An engine's
    refit plan (vLLM's weight-source metadata, NeMo-RL's refit) is prepared once from it."""
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    wire = _wire_dtype(chunks, dtype, "export_metadata")
    _, everything = model_entries(chunks, layout)
    return stream_metadata(everything, chunks[0].spec, task=chunks[0].task, pp=layout.pp, dtype=wire)


def _parse_bucket(bucket_bytes) -> int:
    try:
        n = parse_size(bucket_bytes)
    except (TypeError, ValueError):
        raise ValueError(f"export_hf_tensors: bucket_bytes must be a size in bytes, got {bucket_bytes!r}") from None
    if n < 1:
        raise ValueError(f"export_hf_tensors: bucket_bytes must be at least 1 byte, got {bucket_bytes!r}")
    return n


def _parse_dst(dst_ranks, world: int) -> list[int]:
    if dst_ranks is None:
        return list(range(world))
    try:
        ranks = sorted({int(r) for r in dst_ranks})
    except (TypeError, ValueError):
        raise ValueError(f"export_hf_tensors: dst_ranks must be a list of global ranks, got {dst_ranks!r}") \
            from None
    outside = [r for r in ranks if not 0 <= r < world]
    if outside or not ranks:
        raise ValueError(f"export_hf_tensors: dst_ranks {list(dst_ranks)} " + (
            f"name rank(s) {outside} outside the world of {world} ranks (0..{world - 1})" if outside
            else "is empty: name at least one destination rank"))
    return ranks


def export_hf_tensors(chunks, *, dtype: torch.dtype | None = None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                      dst_ranks=None, copy: bool = False, out=None, merged: bool = False):
    """Every HF tensor of the model, once, in table order (the order of :func:`export_metadata`), as
    ``(hf_name, full tensor)`` on each rank of ``dst_ranks`` (default: every rank). Collective: every rank calls
    it and iterates the returned generator to its end; on a rank that is not a destination the generator yields
    nothing and ends once this rank's part has been sent.

    ``dtype``: the tensors' dtype (default: the model's), converted on the sender while packing; a value the
    dtype cannot hold (e.g. > 65504 into float16) is a :class:`CheckpointError` on every rank, raised here
    before anything is sent. ``bucket_bytes`` (int, or "64MB" / "1GiB"): the most bytes one bucket carries;
    small tensors share a bucket; a tensor larger than that is a bucket of its own, sent in messages of at most
    ``bucket_bytes``.

    Yielded tensors live on the parameters' device and are never views of a parameter. Without ``copy`` a
    tensor is valid until the next item is requested; with ``copy=True`` it is the consumer's to keep; with
    ``out`` (a callable ``out(bucket_index, numel) -> tensor``, destinations only) the tensors are views of the
    memory ``out`` hands out per bucket, written there in place (no temporary copied afterwards). A
    consumer that stops early (``close()``, ``break``, garbage collection, ``throw()``) ends the stream on every
    rank with an error there, never a hang. The contract in full, with CUDA streams, and the memory bound are
    in the module docstring.

    Arguments are checked on every rank in the call's single exchange: a bucket below one byte, a destination
    outside the world, or ranks passing different arguments is a ``ValueError`` on every rank; a model whose
    weights were never loaded (:mod:`parallm.model.loaded`) a ``RuntimeError`` on every rank.

    ``merged=True`` (a model with LoRA adapters, :mod:`parallm.model.layers.lora`): the tensors are the merged weights
    ``W + B A * alpha / r`` under the base model's HF names, for an engine without LoRA. Each rank merges its
    own shards in place when the stream starts (first ``next``) and restores the original bits when it ends or
    is closed (one copy of the rank's adapted weights is held meanwhile); a model without adapters exports
    its weights as they are.
    """
    if merged:
        return _merged_stream(chunks, dict(dtype=dtype, bucket_bytes=bucket_bytes, dst_ranks=dst_ranks, copy=copy,
                                           out=out))
    return open_stream(chunks, dtype=dtype, bucket_bytes=bucket_bytes, dst_ranks=dst_ranks, copy=copy,
                       out=out)[0]


def _merged_stream(chunks, kwargs):
    """:func:`export_hf_tensors` of the merged weights (LoRA), restored when the stream ends."""
    from ..model.layers.lora_merge import merged_weights
    with merged_weights(chunks):
        yield from open_stream(chunks, **kwargs)[0]


def open_stream(chunks, *, dtype=None, bucket_bytes=DEFAULT_BUCKET_BYTES, dst_ranks=None, copy=False,
                what: str = "export_hf_tensors", out=None):
    """:func:`export_hf_tensors`, returning ``(generator, state)``: ``state.exchanged`` says whether the stream
    ended early through an agreement (a rank stopped or failed and every rank learnt of it: the others raised),
    which callers that agree on an outcome afterwards need to know; ``state.buckets``, ``state.tensors``: the
    plan's counts. ``what`` names the operation in errors."""
    require_initialized(what)
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec = chunks[0].spec
    mine, everything = model_entries(chunks, layout)
    wire = dtype or chunks[0].config.params_dtype
    error, nbytes, numel, dst = None, 0, 0, []
    try:
        wire = _wire_dtype(chunks, dtype, "export_hf_tensors")
        nbytes = _parse_bucket(bucket_bytes)
        numel = max(1, nbytes // torch.empty((), dtype=wire).element_size())
        dst = _parse_dst(dst_ranks, layout.world)
        if out is not None and (copy or not callable(out)):
            raise ValueError(f"{what}: out must be a callable out(bucket_index, numel) -> tensor, and not given "
                             f"with copy=True (the tensors live in the memory out hands out); got out={out!r}, "
                             f"copy={copy!r}")
        check_entry_casts(mine, wire, instead="export")   # before anything moves: everybody's error, not a hang
        require_loaded(chunks, what)                      # never-loaded weights (parallm.model.loaded)
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the exchange
        error = e
    holds, params = held_params(mine, everything)
    dst_mask = [int(r in dst) for r in range(layout.world)]
    rows = exchange_rows([int(error is not None), nbytes, WIRE_DTYPES.index(wire) if wire in WIRE_DTYPES else -1,
                          layout.tp_rank, layout.dp_rank, int(bool(copy))] + dst_mask + holds, what=what,
                         error=error)
    if rows[:, 0].any():
        statuses = gather_objects(status_of(error), what=what, error=error)
        if error is not None:
            raise error
        raise_failures(statuses, what=what)
    w = layout.world
    args = torch.cat([rows[:, 1:3], rows[:, 5:6 + w]], dim=1)
    if not bool((args == args[0]).all()):
        differ = [r for r in range(w) if not bool((args[r] == args[0]).all())]
        raise ValueError(f"{what}: every rank must pass the same dtype, bucket_bytes, dst_ranks and copy; "
                         f"rank(s) {differ} differ from rank 0")
    direct = max(1, DIRECT_MIN_BYTES // torch.empty((), dtype=wire).element_size())
    key = (torch.cat([rows[:, 1:5], rows[:, 6 + w:]], dim=1).numpy().tobytes(), direct)  # not dst_ranks
    cache = getattr(chunks[0], "_parallm_export", None)
    if cache is None:
        cache = chunks[0]._parallm_export = {"plans": {}, "buffers": _Buffers()}   # kept with the model
    plan = cache["plans"].get(key)
    if plan is None:
        plan = make_plan(rows[:, 3].tolist(), rows[:, 4].tolist(), rows[:, 6 + w:].tolist(), everything,
                         world=w, tp=layout.tp, pp=layout.pp, spec=spec, task=chunks[0].task,
                         padded_vocab=chunks[0].padded_vocab_size, numel=numel, direct_numel=direct, wire=wire)
        if len(cache["plans"]) >= 4:
            cache["plans"].pop(next(iter(cache["plans"])))
        cache["plans"][key] = plan
    device = next(chunks[0].parameters()).device
    for i in params:        # fp32 rows in a 2-byte stream, int64 rows in any: their bits, as wire elements
        kept = [plan.bit_dtypes.get(n, torch.float32) for n in everything[i].hf if n in plan.fp32_bits]
        if kept:
            params[i] = params[i].detach().to(kept[0]).contiguous().view(wire)
    state = _StreamState(what, layout, plan)
    stream = _run(plan, cache["buffers"], params, dst, wire, device, layout, bool(copy), state, out)
    next(stream)   # to its first (internal) yield: from here on close() / garbage collection reach its handlers
    return stream, state
