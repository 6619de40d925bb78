"""HF weights -> this rank's shards, driven by the family's weight table.

Modes
    slice      every rank reads only its own slices (a directory every rank can see, or a state dict on every
               rank).
    broadcast  global rank 0 alone reads (directory or state dict); for each HF tensor, in table order, it cuts
               the shard of every rank that owns a piece and sends it there (point to point), so rank 0 holds
               one full tensor at a time and every rank, data-parallel replicas included, receives only its own
               shards.
    auto       slice when every rank sees the directory (or holds the state dict), else broadcast.
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
from ..model.decoder import as_chunks
from ..parallel.errors import run_local
from ..model.placement import placement_of
from ..parallel.state import ParallelDims, dims_of, require_initialized
from ..progress import bar
from .hf_dir import HFCheckpoint, check_floating, check_keys_and_shapes, tensor_shapes
from ..model.sharding import TensorSource, make_shard
from ..model.table import Entry, all_entries, chunk_entries, expected_hf_shapes

logger = logging.getLogger("parallm")

# Buffers some checkpoints carry that are recomputed, never loaded.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
MODES = ("auto", "slice", "broadcast")


@dataclass
class LoadReport:
    mode: str
    tensors: int          # parameters filled on this rank
    seconds: float
    initialised: tuple[str, ...] = ()   # HF names not in the checkpoint that were initialised (value head)


VALUE_HEAD = "score.weight"
VALUE_HEAD_INIT_STD = 0.02   # when config.initializer_range is absent
VALUE_HEAD_INIT_SEED = 0


def value_head_plan(present: dict, spec, task: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """Where a value model's head comes from: ``score.weight``; else a verl-style ``lm_head.weight`` of shape
    ``[1, H]`` (alias); else (a plain causal-LM checkpoint) it is initialised. Returns (aliases, initialised)."""
    if task != "value" or VALUE_HEAD in present:
        return {}, ()
    if tuple(present.get("lm_head.weight", ())) == (1, spec.hidden_size):
        return {VALUE_HEAD: "lm_head.weight"}, ()
    return {}, (VALUE_HEAD,)


def check_checkpoint(present: dict, spec, task: str, expected: dict, *, strict: bool, where: str):
    """The checkpoint's tensor names and shapes against the model's (``expected``), value-head sources
    included. Raises :class:`CheckpointError` naming every problem; returns ``value_head_plan``'s
    (aliases, initialised)."""
    aliases, init = value_head_plan(present, spec, task)
    seen = {**present, **{k: present[v] for k, v in aliases.items()}}
    want = {k: v for k, v in expected.items() if k not in init}
    check_keys_and_shapes(seen, want, strict=strict, ignorable=ignorable_names(spec, task), where=where)
    return aliases, init


def init_value_head(param: torch.Tensor, hf_config) -> float:
    """N(0, initializer_range) from a fixed seed: identical on every rank (the head is replicated)."""
    std = getattr(hf_config, "initializer_range", None)
    if std is None and isinstance(hf_config, dict):
        std = hf_config.get("initializer_range")
    std = float(std or VALUE_HEAD_INIT_STD)
    g = torch.Generator().manual_seed(VALUE_HEAD_INIT_SEED)
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float32) * std)
    return std


def model_entries(chunks, layout: ParallelDims):
    """(entry, chunk) pairs owned by this rank (of a MoE layer's experts, only those of its expert-parallel
    rank), plus the whole model's entry list (global order, every expert)."""
    spec, task = chunks[0].spec, chunks[0].task
    table = family_of(spec).table
    experts = layout.expert_range(spec.moe.num_experts) if spec.moe is not None else None
    mine = []
    for chunk in chunks:
        for e in chunk_entries(table, spec, task=task, pp=layout.pp, pre_process=chunk.pre_process,
                               post_process=chunk.post_process, layers=chunk.layer_range, experts=experts):
            mine.append((e, chunk))
    return mine, all_entries(table, spec, task=task, pp=layout.pp)


def ignorable_names(spec, task: str) -> tuple[str, ...]:
    if task in ("hidden", "value"):  # a headless model / a critic started from a causal-LM checkpoint
        return IGNORED_SUFFIXES + ("lm_head.weight",) + ((VALUE_HEAD,) if task == "hidden" else ())
    # A tied checkpoint may still carry lm_head.weight (some exporters write it); the embedding is the truth.
    return IGNORED_SUFFIXES + (("lm_head.weight",) if spec.tie_word_embeddings else ())


def _source_kind(source) -> tuple[str, str]:
    """(kind, description) of this rank's source: kind is "dir", "missing-dir", "dict" or "none"."""
    if source is None:
        return "none", "None"
    if isinstance(source, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(source))
        return ("dir" if os.path.isdir(path) else "missing-dir"), path
    if isinstance(source, dict):
        return ("dict" if source else "none"), "a state dict" if source else "an empty state dict"
    raise TypeError(f"load_hf_weights: source must be a checkpoint directory, a state dict or None, "
                    f"got {type(source).__name__}")


def _choose_mode(mode: str, kinds: list[tuple[str, str]]) -> str:
    kind0, what0 = kinds[0]
    if kind0 == "missing-dir":
        if os.path.isfile(what0):
            raise CheckpointError(f"load_hf_weights: {what0} is a file; pass the checkpoint directory holding it")
        raise CheckpointError(f"load_hf_weights: checkpoint directory {what0} does not exist (on global rank 0)")
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


def _fit_dtype(shard: torch.Tensor, dtype: torch.dtype, names) -> torch.Tensor:
    """Cast to the model dtype; values the dtype cannot hold (e.g. > 65504 into float16) are an error, and so
    is an integer / bool checkpoint tensor for a floating-point parameter (its bits are not weights)."""
    if shard.dtype == dtype:
        return shard
    if dtype.is_floating_point and not shard.dtype.is_floating_point:
        raise CheckpointError(f"{', '.join(names)}: checkpoint dtype {shard.dtype} is not a floating-point type "
                              f"(the model parameter is {dtype})")
    cast = shard.to(dtype)
    if cast.is_floating_point() and not torch.isfinite(cast).all() and torch.isfinite(shard).all():
        biggest = shard.abs().max().item()
        raise CheckpointError(f"{', '.join(names)}: values up to {biggest:.6g} overflow {dtype} (max "
                              f"{torch.finfo(dtype).max:.6g}); build the model in bfloat16 or float32")
    return cast


def _copy_into(param: torch.Tensor, shard: torch.Tensor, entry: Entry) -> None:
    if tuple(shard.shape) != tuple(param.shape):
        raise CheckpointError(f"{entry.local} <- {', '.join(entry.hf)}: shard shape {tuple(shard.shape)} "
                              f"does not fit parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(_fit_dtype(shard, param.dtype, entry.hf))


def _fill_from_blocks(param, entry: Entry, sources, layout: ParallelDims) -> None:
    """Slice mode: read each piece of this rank's shard (``shard_blocks``) straight into its place in the
    parameter: one copy per byte, no intermediate shard. Vocab padding rows are zeroed."""
    tp_layout = placement_of(param).layout
    blocks = tp_layout.blocks(layout.tp_rank, layout.tp, [s.shape for s in sources])
    filled = 0
    with torch.no_grad():
        for src, dim, a, b, la, lb, _ in blocks:
            if lb > param.shape[dim]:
                raise CheckpointError(f"{entry.local} <- {entry.hf[src]}: the checkpoint's shape "
                                      f"{tuple(sources[src].shape)} does not fit parameter {tuple(param.shape)}")
            part = sources[src].read(dim, a, b)
            target = param.narrow(dim, la, lb - la)
            if tuple(part.shape) != tuple(target.shape):
                raise CheckpointError(f"{entry.local} <- {entry.hf[src]}: slice {tuple(part.shape)} does not fit "
                                      f"{tuple(target.shape)}")
            target.copy_(_fit_dtype(part, param.dtype, entry.hf))
            filled = max(filled, lb)
        if tp_layout.name == "vocab":
            param.narrow(0, filled, param.shape[0] - filled).zero_()
        elif filled != param.shape[tp_layout.tp_dim or 0]:
            raise CheckpointError(f"{entry.local} <- {', '.join(entry.hf)}: the checkpoint fills {filled} of "
                                  f"{tuple(param.shape)}")


def load_hf_weights(chunks, source, *, mode: str = "auto", strict: bool = True,
                    progress: bool | None = None, allow_pickle: bool = False) -> LoadReport:
    """Fill ``chunks`` (this rank's model) from an HF checkpoint directory or state dict. Collective.

    Strict by default: a tensor the model needs but the checkpoint lacks, a tensor the model does not use
    (``strict=False`` ignores those), or a tensor of the wrong shape is a :class:`CheckpointError` on every rank,
    naming the tensor and both shapes. Tied models ignore a stray ``lm_head.weight`` and load the head from
    ``model.embed_tokens.weight``. ``mode="auto"`` picks slice when every rank sees the directory (or holds the
    state dict) and broadcast otherwise; the returned :class:`LoadReport` says which (rank 0 also logs it).
    ``progress``: a tqdm bar on rank 0 (see :mod:`parallm.progress`). Pickle checkpoints (``.bin`` / ``.pt``)
    are refused unless ``allow_pickle=True`` (then read with ``torch.load(weights_only=True)``). A value the
    model dtype cannot hold (float16 overflow) is an error naming the tensor.
    """
    require_initialized("load_hf_weights")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec, task = chunks[0].spec, chunks[0].task
    table = family_of(spec).table
    expected = expected_hf_shapes(table, spec, task=task, pp=layout.pp)
    kind = run_local(lambda: _source_kind(source), what="load_hf_weights")
    kinds = [None] * layout.world
    dist.all_gather_object(kinds, kind)
    requested = mode
    mode = run_local(lambda: _choose_mode(mode, kinds), what="load_hf_weights")
    if layout.rank == 0:
        logger.info("load_hf_weights: mode=%s%s", mode, " (chosen by mode='auto')" if requested == "auto" else "")
    mine, everything = model_entries(chunks, layout)  # the table covers every parameter (checked at build)
    padded_vocab = chunks[0].padded_vocab_size
    reader = source if mode == "slice" or layout.rank == 0 else None

    def open_and_check():
        if reader is None:
            return None, None
        if isinstance(reader, dict):
            present, where = tensor_shapes(reader), "state dict"
            get = lambda name: TensorSource(reader[name])  # noqa: E731
        else:
            ckpt = HFCheckpoint(reader, allow_pickle=allow_pickle)
            present, where = {k: ckpt.shape(k) for k in ckpt.keys()}, ckpt.path
            get = ckpt.source
        aliases, init = check_checkpoint(present, spec, task, expected, strict=strict, where=where)
        check_floating([aliases.get(k, k) for k in expected if k not in init], lambda n: get(n).is_floating,
                       where=where)
        return (lambda name: get(aliases.get(name, name))), (aliases, init)

    get, plan = run_local(open_and_check, what="load_hf_weights")
    if mode == "broadcast":
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    aliases, init = plan
    to_init = [(e, c) for e, c in mine if set(e.hf) & set(init)]
    mine = [(e, c) for e, c in mine if not set(e.hf) & set(init)]
    for entry, chunk in to_init:
        std = init_value_head(chunk.get_parameter(entry.local), chunk.hf_config)
        if layout.rank == 0 or chunk.post_process and layout.tp_rank == 0 and layout.dp_rank == 0:
            warnings.warn(f"{', '.join(entry.hf)} is not in the checkpoint (a causal-LM checkpoint loaded as a "
                          f"value model): initialised N(0, {std}) with seed {VALUE_HEAD_INIT_SEED}", stacklevel=2)
    if mode == "slice":
        def fill():
            for entry, chunk in bar(mine, desc="parallm load (slice)", rank=layout.rank, progress=progress):
                _fill_from_blocks(chunk.get_parameter(entry.local), entry, [get(n) for n in entry.hf], layout)
        run_local(fill, what="load_hf_weights")
    else:
        everything = [e for e in everything if not set(e.hf) & set(init)]
        _broadcast_load(mine, everything, get, layout, spec, padded_vocab, progress)
    return LoadReport(mode=mode, tensors=len(mine) + len(to_init), seconds=time.perf_counter() - t0,
                      initialised=tuple(init))


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
    etype = {"CheckpointError": CheckpointError, "ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
             "TypeError": TypeError}.get(type_name, ParallelError)
    return etype(f"load_hf_weights failed on rank 0: {message}")


def _broadcast_load(mine, everything, get, layout: ParallelDims, spec, padded_vocab: int, progress) -> None:
    """Rank 0 streams: for each HF tensor in global order it reads (lazily, slice by slice) the shard of each TP
    rank that needs one and sends it to every owner (data-parallel replicas included), so rank 0 holds about
    one shard at a time.

    Each shard is preceded by a status word. If rank 0 fails mid-stream (a read error, or a receiver that died),
    it sends every rank still waiting a failure status and its error message, and every rank raises that error
    at once, with no further collective (which could wait on a dead rank)."""
    order = {(e.row, e.layer): i for i, e in enumerate(everything)}
    wanted = sorted(((order[(e.row, e.layer)], e, chunk) for e, chunk in mine), key=lambda t: t[0])
    requests = [(i, layout.tp_rank) for i, _, _ in wanted]
    gathered = [None] * layout.world if layout.rank == 0 else None
    dist.gather_object(requests, gathered, dst=0)
    device = next(mine[0][1].parameters()).device
    status = torch.zeros(1, dtype=torch.long, device=device)
    if layout.rank != 0:
        try:
            for _, entry, chunk in wanted:
                dist.recv(status, src=0)
                if status.item() < 0:
                    raise _recv_failure(-status.item(), device)
                param = chunk.get_parameter(entry.local)
                buf = param.data if param.data.is_contiguous() else torch.empty_like(param.data)
                dist.recv(buf, src=0)
                if buf is not param.data:
                    param.data.copy_(buf)
        except (CheckpointError, ParallelError, ValueError, TypeError, FileNotFoundError):
            raise
        except Exception as e:  # noqa: BLE001 - the connection to rank 0 broke
            raise ParallelError(f"load_hf_weights: lost contact with rank 0 while receiving weights (did it die?):"
                                f" {e}") from e
        return
    wire_dtype = mine[0][1].config.params_dtype
    local = {i: (e, c) for i, e, c in wanted}
    needers: dict[int, dict[int, list[int]]] = {}   # entry index -> tp rank -> global ranks
    remaining = {r: len(reqs) for r, reqs in enumerate(gathered)}
    for rank, reqs in enumerate(gathered):
        for i, tp_rank in reqs:
            needers.setdefault(i, {}).setdefault(tp_rank, []).append(rank)
    pbar = bar(total=len(needers), desc="parallm load (broadcast)", rank=0, progress=progress)
    sending_to = None
    try:
        for i in sorted(needers):
            entry = everything[i]
            sources = [get(n) for n in entry.hf]
            for tp_rank, ranks in needers[i].items():
                shard = make_shard(entry.kind, sources, tp_rank, layout.tp, spec, padded_vocab)
                wire = None
                for rank in ranks:
                    if rank == 0:
                        e, chunk = local[i]
                        _copy_into(chunk.get_parameter(e.local), shard, e)
                        remaining[rank] -= 1
                        continue
                    if wire is None:
                        wire = _fit_dtype(shard, wire_dtype, entry.hf).to(device=device).contiguous()
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
        _send_failure(e, [r for r, left in remaining.items() if r != 0 and left > 0], device)
        raise e
    finally:
        pbar.close()
