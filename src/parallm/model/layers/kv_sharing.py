"""Gemma 4's KV sharing (``num_kv_shared_layers``): the last layers of the model compute no keys or values of
their own and attend with those of an earlier layer (``spec.kv_source(layer)``: the last non-shared layer of the
same type, as transformers' ``kv_sharing_modes`` picks it).

The source layer's keys and values (after k_norm, RoPE and v_norm: what its attention kernel reads) are kept on the
batch's layer context (``ctx``) until the last layer that reads them has run; they are the same tensors, so the
gradient of every reader reaches the source's projection. A reader and its source must run in the same pipeline
stage (a ValueError names both otherwise), and layer recomputation is refused with KV sharing (the kept keys and
values would have to outlive the source layer's checkpointed forward).
"""

from __future__ import annotations

import torch


def check_kv_sharing_stages(spec, stage_layers) -> None:
    """ValueError unless every KV-sharing layer sits in the same (virtual) pipeline stage as its source layer.
    ``stage_layers``: every stage's layers (ranges), the same list on every rank, so every rank raises alike."""
    if not spec.kv_sources:
        return
    for layers in stage_layers:
        for layer in layers:
            source = spec.kv_source(layer)
            if source is not None and source not in layers:
                raise ValueError(f"layer {layer} reuses the keys / values of layer {source} (num_kv_shared_layers), "
                                 f"which another pipeline stage holds (this stage: layers {layers.start}-"
                                 f"{layers.stop - 1}); choose a split that keeps layers {source} and {layer} in one "
                                 "stage (build_model(layers_per_stage=[...]))")


def check_kv_sharing_recompute(spec, recompute) -> None:
    if spec.kv_sources and recompute is not None:
        raise ValueError(f"recompute={recompute!r} with KV sharing (num_kv_shared_layers) is not supported: the "
                         "shared keys / values would have to outlive their layer's recomputed forward")


def last_readers(spec) -> dict[int, int]:
    """Source layer -> the last layer that reads its keys / values."""
    out = {}
    for layer in range(spec.num_layers):
        source = spec.kv_source(layer)
        if source is not None:
            out[source] = max(layer, out.get(source, layer))
    return out


def keep(ctx, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """A source layer's keys and values, kept on the batch's layer context for its readers."""
    ctx.__dict__.setdefault("_shared_kv", {})[layer] = (k, v)


def take(ctx, layer: int, source: int, *, last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s keys and values: its source's, dropped from the context after the ``last`` reader."""
    held = ctx.__dict__.get("_shared_kv", {})
    if source not in held:
        raise RuntimeError(f"layer {layer} reuses layer {source}'s keys / values, which this batch has not computed "
                           "(the source must run first, in the same stage)")
    return held.pop(source) if last else held[source]
