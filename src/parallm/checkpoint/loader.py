"""HF weights -> this rank's shards, driven by the family's weight table.

Modes
    slice      every rank reads only its own slices (a directory every rank can see, or a state dict on every
               rank).
    broadcast  global rank 0 alone reads (directory or state dict); for each HF tensor, in table order, it cuts
               the shard of every rank that owns a piece and sends it there (point to point), so rank 0 holds
               one full tensor at a time and every rank, data-parallel replicas included, receives only its own
               shards.
    auto       every rank holding the same kind of source as rank 0 reads its own slices; rank 0 streams the
               shards of the others (all ranks see the directory: slice; a state dict on rank 0 only: broadcast).

One exchange between the ranks per load: reading ranks check and fill first, then every rank contributes a row
of integers (outcome, kind of source, rank 0's value-head plan, its TP rank, which table entries it holds) to a
single all-gather. Messages travel only when something failed.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CheckpointError, ParallelError
from ..families import family_of
from ..model.loaded import mark_loaded
from ..model.sharding import SlabSource, TensorSource, make_shard
from ..model.table import (Entry, all_entries, chunk_entries, entry_view, expected_hf_shapes,  # noqa: F401
                           fused_layout, held_params, integer_hf_names, model_entries, row_dtype)
from ..parallel.errors import exchange_rows, gather_objects, remote_error, status_of
from ..parallel.state import ParallelDims, as_chunks, dims_of, require_initialized
from ..progress import bar
from .cast import LOAD_WIRE_DTYPES, check_cast, copy_cast_
from .fp4 import expert_dtype_of, fp4_view
from .fp8 import DequantizedSource, block_size_of, fp8_plan
from .int4 import int4_config, int4_view
from .mxfp4 import is_mxfp4, mxfp4_view
from .hf_dir import HFCheckpoint, MissingCheckpointError, check_floating, resolve_checkpoint, tensor_shapes
from .load_checks import VALUE_HEAD, VALUE_HEAD_INIT_SEED, check_checkpoint, init_value_head

logger = logging.getLogger("parallm")

MODES = ("auto", "slice", "broadcast")


@dataclass
class LoadReport:
    mode: str
    tensors: int          # parameters filled on this rank
    seconds: float
    initialised: tuple[str, ...] = ()   # HF names not in the checkpoint that were initialised (value head)


def _source_kind(source, revision: str | None = None) -> tuple[str, str]:
    """(kind, description) of this rank's source: kind is "dir", "missing-dir", "dict", "none" or "missing-id"
    (a Hub id this rank's Hugging Face cache does not hold; the description is the error saying so). A Hub id
    the cache holds is its snapshot directory (:func:`resolve_checkpoint`)."""
    if source is None:
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids; source is None")
        return "none", "None"
    if isinstance(source, (str, os.PathLike)):
        try:
            source = resolve_checkpoint(source, revision=revision)
        except CheckpointError as e:
            return "missing-id", str(e)
        path = os.path.abspath(os.fspath(source))
        return ("dir" if os.path.isdir(path) else "missing-dir"), path
    if isinstance(source, dict):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub ids; source is a state dict")
        return ("dict" if source else "none"), "a state dict" if source else "an empty state dict"
    raise TypeError(f"load_hf_weights: source must be a checkpoint directory, a state dict or None, "
                    f"got {type(source).__name__}")


def _choose_mode(mode: str, kinds: list[tuple[str, str]]) -> str:
    kind0, what0 = kinds[0]
    if kind0 == "missing-id":
        raise CheckpointError(f"load_hf_weights: {what0} (on global rank 0)")
    if kind0 == "missing-dir":
        if os.path.isfile(what0):
            raise CheckpointError(f"load_hf_weights: {what0} is a file; pass the checkpoint directory holding it")
        raise MissingCheckpointError(f"load_hf_weights: checkpoint directory {what0} does not exist (on global "
                                     "rank 0)")
    if kind0 == "none":
        raise CheckpointError(f"load_hf_weights: global rank 0 passed {what0}; rank 0 must hold the checkpoint "
                              "directory or the state dict")
    everywhere = all(k == kind0 for k, _ in kinds)
    if mode == "auto":
        return "slice" if everywhere else "broadcast"
    if mode == "slice" and not everywhere:
        lacking = [f"rank {r} ({what})" for r, (k, what) in enumerate(kinds) if k != kind0]
        raise CheckpointError(f"load_hf_weights(mode='slice') needs the source on every rank; "
                              f"{', '.join(lacking[:8])} lack it (use mode='broadcast' or 'auto')")
    return mode


def _fill_from_blocks(view, entry: Entry, sources, layout: ParallelDims) -> None:
    """Read each piece of this rank's shard (its layout's ``blocks``) straight into its place in the parameter
    (``view``: :func:`entry_view`'s tensor and layout: a routed expert's slab of its stacked parameter),
    converting to the parameter's dtype in the same copy (:func:`copy_cast_`): one copy per byte, no
    intermediate shard. Vocab padding rows are zeroed."""
    param, tp_layout = view
    if param.dim() == 0:                     # a 0-d tensor (Gemma 4's audio clip bounds): its one element as [1]
        param = param.view(1)
    blocks = tp_layout.blocks(layout.tp_rank, layout.tp, [s.shape for s in sources])
    filled = 0
    with torch.no_grad():
        for src, dim, a, b, la, lb, _ in blocks:
            if lb > param.shape[dim]:
                raise CheckpointError(f"{entry.local} <- {entry.hf[src]}: the checkpoint's shape "
                                      f"{tuple(sources[src].shape)} does not fit parameter {tuple(param.shape)}")
            part = sources[src].read(dim, a, b)
            target = param.narrow(dim, la, lb - la)
            if part.shape != target.shape:
                raise CheckpointError(f"{entry.local} <- {entry.hf[src]}: slice {tuple(part.shape)} does not fit "
                                      f"{tuple(target.shape)}")
            copy_cast_(target, part, entry.hf)
            filled = max(filled, lb)
        if tp_layout.name == "vocab":
            param.narrow(0, filled, param.shape[0] - filled).zero_()
        elif filled != param.shape[tp_layout.tp_dim or 0]:
            raise CheckpointError(f"{entry.local} <- {', '.join(entry.hf)}: the checkpoint fills {filled} of "
                                  f"{tuple(param.shape)}")


def load_threads() -> int:
    """Copy threads per rank for filling parameters: env ``PARALLM_LOAD_THREADS``, default ``min(4, cores)``.
    ``copy_`` releases the GIL, so threads overlap the copies (and, on CPU, the page faults of fresh memory)."""
    value = os.environ.get("PARALLM_LOAD_THREADS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"PARALLM_LOAD_THREADS must be a positive integer, got {value!r}") from None
    return max(1, min(4, os.cpu_count() or 1))


def _fill_all(own, get, layout: ParallelDims, progress) -> None:
    """Fill every (entry, chunk) of ``own`` from ``get``, the entries spread over :func:`load_threads` threads;
    the first failing entry (in table order) is raised after every started fill has ended."""
    pbar = bar(total=len(own), desc="parallm load", rank=layout.rank, progress=progress)
    jobs = [(entry_view(chunk, entry), entry, [get(n) for n in entry.hf]) for entry, chunk in own]
    try:
        threads = min(load_threads(), len(jobs))
        if threads <= 1:
            for param, entry, sources in jobs:
                _fill_from_blocks(param, entry, sources, layout)
                pbar.update(1)
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="parallm-load") as pool:
            futures = [pool.submit(_fill_from_blocks, param, entry, sources, layout)
                       for param, entry, sources in jobs]
            for f in futures:
                f.exception()        # wait; errors are raised below, in table order
                pbar.update(1)
        for f in futures:
            f.result()
    finally:
        pbar.close()


_KINDS = ("dir", "missing-dir", "dict", "none", "missing-id")
# The one exchange of a load: per rank [status, source kind, value head initialised, tp rank, request bitmap...].
_OK, _FAILED_KIND, _FAILED_READ = 0, 1, 2


def load_hf_weights(chunks, source, *, mode: str = "auto", strict: bool = True,
                    progress: bool | None = None, allow_pickle: bool = False,
                    revision: str | None = None) -> LoadReport:
    """Fill ``chunks`` (this rank's model) from an HF checkpoint directory or state dict. Collective.

    Strict by default: a tensor the model needs but the checkpoint lacks, a tensor the model does not use
    (``strict=False`` ignores those), or a tensor of the wrong shape is a :class:`CheckpointError` on every rank,
    naming the tensor and both shapes. Tied models ignore a stray ``lm_head.weight`` and load the head from
    ``model.embed_tokens.weight``. ``mode="auto"``: every rank that holds the same kind of source as rank 0 (the
    directory, or a state dict) reads its own slices, and rank 0 streams the shards of the others (so when every
    rank sees the directory this is slice mode); the returned :class:`LoadReport` says "slice" or "broadcast"
    (rank 0 also logs it). ``progress``: a tqdm bar on rank 0 (see :mod:`parallm.progress`). Pickle checkpoints
    (``.bin`` / ``.pt``) are refused unless ``allow_pickle=True`` (then read with
    ``torch.load(weights_only=True)``).

    ``source`` may be a Hub id (``Qwen/Qwen2.5-0.5B``) instead of a directory: its snapshot at ``revision``
    (default ``main``) is read from the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``), never
    downloaded (:func:`parallm.checkpoint.hf_dir.resolve_checkpoint`; a local directory of the same spelling
    wins). A directory (or id) loaded becomes the chunks' ``hf_source``, from which :func:`save_hf_weights`
    copies the tokenizer and generation files.

    dtypes: each tensor is converted to its parameter's dtype inside the copy that fills it (see
    :mod:`parallm.checkpoint.cast`); a value the model dtype cannot hold (float16 overflow) is an error naming
    the tensor; inf / NaN already in the checkpoint are loaded as they are.

    Cost: one exchange between the ranks (an all-gather of a few integers per rank). Every reading rank checks
    the names, shapes and dtypes of all tensors at once and fills its parameters first; then the ranks exchange
    their outcome (and which shards they still need), and rank 0 streams those. A successful load marks the
    chunks loaded (:mod:`parallm.model.loaded`: ``forward`` and the saves refuse a model never loaded). After an
    error the parameters hold a partial load, and the chunks of a rank whose parameters were being written are
    marked not loaded (an error that comes before any parameter is written leaves them as they were).
    ``strict=False`` ignores only tensors the model does not use: a tensor the model needs is never skipped, so
    a load that returns has filled every parameter.
    """
    require_initialized("load_hf_weights")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec, task = chunks[0].spec, chunks[0].task
    mine, everything = model_entries(chunks, layout)  # the table covers every parameter (checked at build)
    padded_vocab = chunks[0].padded_vocab_size

    # 1. local work: a rank that may read its own shards does so (check, then fill) before talking to anyone.
    kind, what, error, status, get, init = "none", "None", None, _OK, None, ()
    try:
        kind, what = _source_kind(source, revision)
        if kind == "dir":
            source = what          # a Hub id: its snapshot directory in the cache
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the exchange
        error, status = e, _FAILED_KIND
    reads = status == _OK and (layout.rank == 0 if mode == "broadcast" else kind in ("dir", "dict"))
    if reads:
        try:
            block = block_size_of(chunks[0].hf_config)     # FP8 block checkpoints: dequantised while read
            get, init = _open_and_check(source, spec, task, layout, strict=strict, allow_pickle=allow_pickle,
                                        fp8_block=block, mxfp4=is_mxfp4(chunks[0].hf_config),
                                        int4=int4_config(chunks[0].hf_config),
                                        fp4=expert_dtype_of(chunks[0].hf_config) == "fp4")
            own = [(e, c) for e, c in mine if not set(e.hf) & set(init)]
            mark_loaded(chunks, False)      # from here on a failure leaves a partial load
            _fill_all(own, get, layout, progress)
        except Exception as e:  # noqa: BLE001
            error, status = e, _FAILED_READ

    # 2. the one exchange: outcome, source kind, rank 0's value-head plan, the shards each rank holds.
    holds, params = held_params(mine, everything)
    rows = exchange_rows([status, _KINDS.index(kind), int(bool(init)), layout.tp_rank] + holds,
                         what="load_hf_weights", error=error)
    statuses, kinds = rows[:, 0].tolist(), [_KINDS[k] for k in rows[:, 1].tolist()]
    readers = _readers(mode, kinds)
    if any(statuses) or _mode_problem(mode, kinds):
        _settle(error, statuses, (kind, what), mode, readers, layout)
    requested, mode = mode, "slice" if all(readers) else "broadcast"
    if layout.rank == 0:
        logger.info("load_hf_weights: mode=%s%s", mode, " (chosen by mode='auto')" if requested == "auto" else "")
    if not readers[layout.rank]:
        init = (VALUE_HEAD,) if rows[0, 2].item() else ()      # rank 0's plan
    for entry, chunk in mine:
        if set(entry.hf) & set(init):
            std = init_value_head(chunk.get_parameter(entry.local), chunk.hf_config)
            if layout.rank == 0 or chunk.post_process and layout.tp_rank == 0 and layout.dp_cp_rank == 0:
                warnings.warn(f"{', '.join(entry.hf)} is not in the checkpoint (a causal-LM checkpoint loaded as a "
                              f"value model): initialised N(0, {std}) with seed {VALUE_HEAD_INIT_SEED}",
                              stacklevel=2)

    # 3. rank 0 streams the shards of every rank that did not read its own.
    if mode == "broadcast":
        skip = {i for i, e in enumerate(everything) if set(e.hf) & set(init)}
        needs = {r: (int(rows[r, 3]), [i for i in rows[r, 4:].nonzero().flatten().tolist() if i not in skip])
                 for r in range(layout.world) if not readers[r]}
        if layout.rank in needs:
            mark_loaded(chunks, False)
        _broadcast_load(needs, mine, everything, params, get, layout, spec, padded_vocab, progress)
    if kind == "dir":       # where save_hf_weights finds the tokenizer / generation files
        for chunk in chunks:
            chunk.hf_source = what
    mark_loaded(chunks)     # every parameter filled (a missing tensor is an error, strict or not)
    return LoadReport(mode=mode, tensors=len(mine), seconds=time.perf_counter() - t0, initialised=tuple(init))


def _open_and_check(source, spec, task, layout: ParallelDims, *, strict: bool, allow_pickle: bool,
                    fp8_block: tuple[int, int] | None = None, mxfp4: bool = False, int4=None, fp4: bool = False):
    """Open this rank's source and check every tensor's name, shape and dtype at once. Returns
    ``(get, initialised)``: ``get(hf_name)`` gives the :class:`Source` to read (value-head aliases applied).

    ``fp8_block``: the config's FP8 block (``quantization_config.weight_block_size``): float8 weights are then
    read through their ``*_scale_inv`` block scales (:class:`~parallm.checkpoint.fp8.DequantizedSource`, fp32,
    rounded once into the model dtype by the filling copy) and the scales are not weights of their own. Without
    it a float8 tensor or a scale is an error naming it. ``mxfp4``: the config declares MXFP4 experts: each
    ``X_blocks`` / ``X_scales`` pair is read as X (:class:`~parallm.checkpoint.mxfp4.Mxfp4Source`). ``int4``: the
    config's compressed-tensors INT4 settings (:func:`~parallm.checkpoint.int4.int4_config`): each pack-quantized
    module is read as its weight (:class:`~parallm.checkpoint.int4.Int4Source`). ``fp4``: the config declares
    FP4 experts (``expert_dtype: "fp4"``): each packed weight is read through its scale
    (:class:`~parallm.checkpoint.fp4.Fp4Source`). A family with ``checkpoint_names`` (DeepSeek-V4's Hub
    spelling) has its checkpoint's names mapped to the table's first."""
    family = family_of(spec)
    table = family.table
    expected = expected_hf_shapes(table, spec, task=task, pp=layout.pp)
    if isinstance(source, dict):
        present, where = tensor_shapes(source), "state dict"
        def raw(name):
            return TensorSource(source[name])
    else:
        ckpt = HFCheckpoint(source, allow_pickle=allow_pickle)
        raw, where = ckpt.source, ckpt.path
        present = {k: raw(k).shape for k in ckpt.keys()}
    if family.checkpoint_names is not None:
        present, raw, where = _renamed(present, raw, family.checkpoint_names, where)
    present, dtypes, raw = mxfp4_view(present, {k: getattr(raw(k), "dtype", None) for k in present}, raw,
                                      declared=mxfp4, where=where)
    present, dtypes, raw = int4_view(present, dtypes, raw, int4, where=where)
    present, dtypes, raw = fp4_view(present, dtypes, raw, declared=fp4, where=where)
    scales = fp8_plan(present, dtypes, fp8_block, where=where)
    if scales:
        stored = raw
        present = {k: v for k, v in present.items() if k not in set(scales.values())}

        def raw(name):
            scale = scales.get(name)
            return stored(name) if scale is None else DequantizedSource(stored(name), stored(scale), fp8_block)
    aliases, init, fused = check_checkpoint(present, spec, task, expected, strict=strict, where=where,
                                            fused=fused_layout(table, spec, task=task, pp=layout.pp))
    ints = integer_hf_names(table, spec, task=task, pp=layout.pp)     # int64 rows (tid2eid): not weights
    check_floating([fused[k].name if k in fused else aliases.get(k, k) for k in expected
                    if k not in init and k not in ints],
                   lambda n: raw(n).is_floating, where=where)

    def get(name):
        part = fused.get(name)
        if part is None:
            return raw(aliases.get(name, name))
        if part.expert is None:
            return raw(part.name)
        return SlabSource(raw(part.name), part.expert, part.part, part.parts)
    return get, init


def _renamed(present: dict, raw, rename, where: str):
    """``present`` and ``raw`` under the table's names (``rename``: the family's ``checkpoint_names``, checkpoint
    name -> table name), and ``where`` saying so when a name changed; two tensors mapped to one name are an
    error naming both."""
    to_table = rename(present)
    back: dict[str, str] = {}
    for name, table_name in to_table.items():
        if table_name in back:
            raise CheckpointError(f"{where}: {back[table_name]} and {name} both stand for {table_name}")
        back[table_name] = name
    moved = sorted(n for n, t in to_table.items() if n != t)
    if moved:
        where = f"{where} (names read as the table's: {moved[0]} as {to_table[moved[0]]}, ...)"
    return {t: present[n] for n, t in to_table.items()}, lambda name: raw(back.get(name, name)), where


def _readers(mode: str, kinds: list[str]) -> list[bool]:
    """Which ranks fill their own parameters from their own source: every rank (slice), rank 0 (broadcast), or
    every rank holding the same kind of source as rank 0 (auto)."""
    if mode == "slice":
        return [True] * len(kinds)
    if mode == "broadcast":
        return [r == 0 for r in range(len(kinds))]
    return [k == kinds[0] for k in kinds]


def _mode_problem(mode: str, kinds: list[str]) -> bool:
    """Whether :func:`_choose_mode` refuses these sources (known from the kinds alone, without descriptions)."""
    return kinds[0] in ("missing-dir", "none", "missing-id") or mode == "slice" and any(k != kinds[0] for k in kinds)


def _settle(error, statuses, source, mode: str, readers, layout: ParallelDims) -> None:
    """Something failed somewhere (or the sources do not fit the mode): the same error on every rank. Exchanges
    the messages (only now), then raises, in this order of precedence: a source that is not a source (the
    argument's type), a placement the mode cannot serve (:func:`_choose_mode`'s messages), a reading rank's
    failure. A failing rank raises its own error; the others name it. Failures of ranks that read ahead in
    auto mode but end up receiving from rank 0 are ignored (their parameters are overwritten by the stream)."""
    gathered = gather_objects((status_of(error), source), what="load_hf_weights", error=error)
    me = layout.rank
    kind_failed = [(r, s) for r, ((s, _), st) in enumerate(zip(gathered, statuses)) if st == _FAILED_KIND]
    if kind_failed:
        if statuses[me] == _FAILED_KIND:
            raise error
        raise remote_error("load_hf_weights", kind_failed)
    _choose_mode(mode, [src for _, src in gathered])
    read_failed = [(r, s) for r, ((s, _), st) in enumerate(zip(gathered, statuses))
                   if st == _FAILED_READ and readers[r]]
    if read_failed:
        if statuses[me] == _FAILED_READ and readers[me]:
            raise error
        raise remote_error("load_hf_weights", read_failed)


def _send_failure(error: BaseException, ranks, device) -> None:
    """Tell each waiting rank that rank 0 failed, with the error's type and text (best effort per rank)."""
    payload = f"{type(error).__name__}\0{error}".encode()
    header = torch.tensor([-len(payload)], dtype=torch.long, device=device)
    body = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    for rank in ranks:
        try:
            dist.send(header, dst=rank)
            dist.send(body, dst=rank)
        except Exception:  # noqa: BLE001 - that rank is gone; tell the others
            pass


def _recv_failure(length: int, device) -> BaseException:
    body = torch.empty(length, dtype=torch.uint8, device=device)
    dist.recv(body, src=0)
    type_name, _, message = bytes(body.cpu().tolist()).decode(errors="replace").partition("\0")
    return remote_error("load_hf_weights", [(0, (type_name, message))])


def _wire(shard: torch.Tensor, model_dtype: torch.dtype, names, device) -> torch.Tensor:
    """What rank 0 sends for a shard: overflow checked here (on the source values), then the narrower of the
    checkpoint's and the parameter's dtype ``model_dtype`` (a bf16 checkpoint for an fp32 model travels in bf16
    and is widened by the receiver's copy into its parameter)."""
    check_cast(shard, model_dtype, names)
    if model_dtype.is_floating_point != shard.dtype.is_floating_point:
        raise CheckpointError(f"{', '.join(names)}: checkpoint dtype {shard.dtype} for a {model_dtype} parameter")
    if shard.dtype not in LOAD_WIRE_DTYPES or \
            shard.element_size() > torch.empty((), dtype=model_dtype).element_size():
        shard = shard.to(model_dtype)
    return shard.to(device=device).contiguous()


def _broadcast_load(needs, mine, everything, params, get, layout: ParallelDims, spec, padded_vocab: int,
                    progress) -> None:
    """Rank 0 streams: for each HF tensor in global order it reads (lazily, slice by slice) the shard of each TP
    rank that needs one and sends it to every receiving owner (data-parallel replicas included), so rank 0 holds
    about one shard at a time. ``needs``: receiving rank -> (its tp rank, the ``everything`` indices it needs);
    ``params``: this rank's parameters by those indices.

    Each shard is preceded by a status word: the shard's dtype (an index into ``WIRE_DTYPES``), or, if rank 0
    failed mid-stream (a read error, an overflow, a receiver that died), minus the length of its error message,
    which follows; every waiting rank then raises that error at once, with no further collective (which could
    wait on a dead rank)."""
    device = next(mine[0][1].parameters()).device
    status = torch.zeros(1, dtype=torch.long, device=device)
    if layout.rank in needs:
        try:
            for i in needs[layout.rank][1]:
                dist.recv(status, src=0)
                if status.item() < 0:
                    raise _recv_failure(-status.item(), device)
                param = params[i]
                wire_dtype = LOAD_WIRE_DTYPES[status.item()]
                direct = wire_dtype == param.dtype and param.data.is_contiguous()
                buf = param.data if direct else torch.empty(param.shape, dtype=wire_dtype, device=device)
                dist.recv(buf, src=0)
                if not direct:
                    param.data.copy_(buf)
        except (CheckpointError, ParallelError, ValueError, TypeError, FileNotFoundError):
            raise
        except Exception as e:  # noqa: BLE001 - the connection to rank 0 broke
            raise ParallelError(f"load_hf_weights: lost contact with rank 0 while receiving weights (did it die?):"
                                f" {e}") from e
        return
    if layout.rank != 0:
        return
    model_dtype = mine[0][1].config.params_dtype
    needers: dict[int, dict[int, list[int]]] = {}   # entry index -> tp rank -> receiving global ranks
    remaining = {r: len(idx) for r, (_, idx) in needs.items()}
    for rank, (tp_rank, idx) in needs.items():
        for i in idx:
            needers.setdefault(i, {}).setdefault(tp_rank, []).append(rank)
    pbar = bar(total=len(needers), desc="parallm load (broadcast)", rank=0, progress=progress)
    sending_to = None
    try:
        for i in sorted(needers):
            entry = everything[i]
            sources = [get(n) for n in entry.hf]
            for tp_rank, ranks in needers[i].items():
                shard = make_shard(entry.kind, sources, tp_rank, layout.tp, spec, padded_vocab)
                # a keep_fp32 row (fp32 in a model of any dtype) travels in the checkpoint's dtype up to fp32,
                # an integer row (int64) as int64
                wire = _wire(shard, row_dtype(entry.row, model_dtype), entry.hf, device)
                status.fill_(LOAD_WIRE_DTYPES.index(wire.dtype))
                for rank in ranks:
                    sending_to = rank
                    dist.send(status, dst=rank)
                    dist.send(wire, dst=rank)
                    sending_to = None
                    remaining[rank] -= 1
                del shard, wire
            del sources
            pbar.update(1)
    except Exception as e:  # noqa: BLE001 - every waiting rank is told, then re-raised here
        if sending_to is not None:
            e = ParallelError(f"load_hf_weights: lost contact with rank {sending_to} while sending it weights "
                              f"(did it die?): {e}")
        _send_failure(e, [r for r, left in remaining.items() if left > 0], device)
        raise e
    finally:
        pbar.close()
