"""What a save and a load of a training checkpoint start from: the chunks, their layout and tensors, the
optimizer's fit to them, earlier asynchronous saves finished."""

from __future__ import annotations

import os

from ...families import family_of
from ...model.layers.lora import chunk_lora_entries, global_entries, lora_config_of
from ...model.table import expected_hf_shapes, is_trained, model_entries
from ...parallel.state import as_chunks, dims_of, require_initialized
from ...train.optim import ParallelAdamW
from .pending import wait_for_pending_saves


def begin(what: str, path, chunks):
    """The process groups, the chunks and their layout, earlier async saves finished: ``(path, chunks, dims)``
    with the path made absolute."""
    require_initialized(what)
    chunks = as_chunks(chunks)
    dims = dims_of(chunks)
    wait_for_pending_saves()
    return os.path.abspath(os.fspath(path)), chunks, dims


def model_layout(chunks, dims):
    """``(shapes, mine, saved)``: every HF tensor's full shape, this rank's ``(entry, chunk)`` pairs, and the
    ``(name, shape)`` of every tensor the model stores (all ranks' entries). A model with LoRA adapters stores
    its adapters only (:func:`lora_layout`)."""
    if lora_config_of(chunks) is not None:
        return lora_layout(chunks, dims)
    spec, task = chunks[0].spec, chunks[0].task
    shapes = expected_hf_shapes(family_of(spec).table, spec, task=task, pp=dims.pp)
    mine, everything = model_entries(chunks, dims)
    saved = [(n, shapes[n]) for e in everything if e.row.save for n in e.hf]
    return shapes, mine, saved


def lora_layout(chunks, dims):
    """:func:`model_layout` of a model with LoRA adapters: the factors alone (the frozen base comes from its HF
    checkpoint), each by its training-checkpoint name (:class:`parallm.model.layers.lora.LoraEntry`) and full shape, as
    slices of those tensors like any weight: reshardable."""
    chunk = chunks[0]
    every = global_entries(chunk.spec, chunk.table, chunk.task, dims, lora_config_of(chunks))
    shapes = {e.hf[0]: tuple(e.shape) for e, _, _ in every}
    return shapes, chunk_lora_entries(chunks), list(shapes.items())


def lora_record(chunks) -> dict | None:
    """What parallm.json says of a model's adapters: their config and the base they sit on (the checkpoint
    directory or Hub id the model was built from, None when built from a config object)."""
    config = lora_config_of(chunks)
    if config is None:
        return None
    return {"config": config.to_dict(), "base": getattr(chunks[0], "hf_source", None)}


def check_lora_record(record: dict, chunks, path: str) -> None:
    """A checkpoint of adapters loads into a model with adapters, a full one into a model without."""
    from ...errors import CheckpointError
    saved, mine = record.get("lora"), lora_config_of(chunks)
    if saved is not None and mine is None:
        raise CheckpointError(f"{path} holds LoRA adapters only (base: {saved.get('base')}): build the model with "
                              f"lora=parallm.LoraConfig(...) ({saved['config']}), load the base with "
                              "load_hf_weights, then load_checkpoint")
    if saved is None and mine is not None:
        raise CheckpointError(f"{path} is a full training checkpoint, and this model has LoRA adapters (whose "
                              "checkpoints hold the adapters only); build the model without lora=")


def trained_names(chunks, dims) -> list[str]:
    """The HF names of the stored tensors the optimizer trains (of every rank): those of parameters with
    ``requires_grad`` (not the router's selection bias, not a carried MTP layer). Read from this rank's chunks'
    parameters and the table alone: every rank computes the same list. With LoRA adapters: every factor."""
    if lora_config_of(chunks) is not None:
        return [n for n, _ in lora_layout(chunks, dims)[2]]
    mine, everything = model_entries(chunks, dims)
    frozen = {(e.row, e.layer) for e, c in mine if not c.get_parameter(e.local).requires_grad}
    frozen |= {(e.row, e.layer) for e in everything if not is_trained(e)}
    return [n for e in everything if e.row.save and (e.row, e.layer) not in frozen for n in e.hf]


def entries_by_param(mine) -> dict:
    """Parameter -> its weight-table entries among ``mine`` (one, or a stacked expert parameter's one per expert,
    in ``index`` order)."""
    out: dict = {}
    for entry, chunk in mine:
        out.setdefault(chunk.get_parameter(entry.local), []).append(entry)
    return out


def check_optimizer(optimizer, chunks) -> None:
    """``optimizer`` is None or what ``parallm.build_optimizer`` built for these chunks."""
    if optimizer is None:
        return
    if not isinstance(optimizer, ParallelAdamW):
        raise TypeError(f"optimizer must be what parallm.build_optimizer returned, got {type(optimizer).__name__}")
    params = {p for c in chunks for p in c.parameters()}
    if set(optimizer.names) != params:
        raise ValueError("the optimizer was built for other chunks than the ones passed (build it from these "
                         "chunks with parallm.build_optimizer)")
