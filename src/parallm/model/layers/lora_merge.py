"""Merging LoRA adapters into their base weights for an export (``W + B A * scaling``, fp32, one rounding) and
restoring the original bits afterwards: what :func:`parallm.save_hf_weights` / :func:`parallm.export_hf_tensors`
with ``merged=True`` and the vLLM push of a merged model read."""

from __future__ import annotations

import contextlib

import torch

from ...parallel.state import as_chunks
from .lora import (HEAD, Adapter, LoraColumnParallelLinear, LoraExperts, LoraReplicatedLinear, LoraRowParallelLinear,
                   lora_config_of)


def adapted_weights(chunks):
    """``(weight, adapter)`` of every adapted base weight of this rank (an expert weight's adapter as
    ``(ExpertAdapter, part)``): what :func:`merged_weights` merges."""
    for chunk in as_chunks(chunks):
        for module in chunk.modules():
            if isinstance(module, (LoraColumnParallelLinear, LoraRowParallelLinear, LoraReplicatedLinear)):
                yield module.weight, module.lora
            elif isinstance(module, LoraExperts):
                yield module.linear_fc1.weight, (module.lora, "gate_up_proj")
                yield module.linear_fc2.weight, (module.lora, "down_proj")


@torch.no_grad()
def _deltas(weight, what):
    """``[(view of weight, fp32 delta)]`` for one adapted weight."""
    if isinstance(what, Adapter):
        if what.kind in ("row", "replicated", "split"):
            return [(weight, what.delta(what.slots[0].part))]
        out, at = [], 0
        for part, rows in what.local_rows:
            if part in what.lora_A:
                out.append((weight[at:at + rows], what.delta(part)))
            at += rows
        return out
    ad, part = what
    if part not in ad.lora_A:
        return []
    delta = torch.bmm(ad.lora_B[part].float(), ad.lora_A[part].float()) * ad.slots[part].scaling
    return [(weight, delta.transpose(-2, -1) if ad.columns else delta)]


@contextlib.contextmanager
def merged_weights(chunks):
    """Inside, every adapted base weight holds ``W + B A * scaling`` (computed in fp32, rounded once into the
    weight's dtype): what an engine without LoRA serves. On exit the original bits are copied back. Each adapted
    weight is copied aside first, to host memory (on a GPU the merge then costs no device memory beyond one
    weight's fp32 delta at a time: with expert LoRA the adapted weights are most of the model, and this is when a
    colocated engine needs the room). No collectives: each rank merges its own shards."""
    config, chunk = lora_config_of(chunks), as_chunks(chunks)[0]
    if config is not None and config.targets(HEAD) and chunk.share_embeddings_and_output_weights:
        raise ValueError("merged export with an lm_head adapter on a model with tied embeddings: lm_head.weight is "
                         "embed_tokens.weight, so merging B A into it would change the input embedding too. Export "
                         "the adapter (save_hf_adapter), or train on an untied copy of the base")
    saved = []
    try:
        with torch.no_grad():
            for weight, what in adapted_weights(chunks):
                pieces = _deltas(weight, what)
                if not pieces:
                    continue
                saved.append((weight, weight.detach().to("cpu", copy=True)))
                for view, delta in pieces:
                    view.copy_((view.float() + delta).to(view.dtype))
        yield
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.detach().copy_(original, non_blocking=False)
