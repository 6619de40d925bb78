"""Activation recomputation's options (``build_model(recompute=...)``, :data:`RECOMPUTE`):

* ``"full"``: every decoder layer keeps only its input and runs again whole in the backward
  (:class:`parallm.model.decoder.DecoderChunk`'s loop, ``torch.utils.checkpoint``);
* ``"moe"``: the routed experts keep only their input tokens and recompute their products in the backward a few
  experts at a time (:mod:`parallm.model.layers.moe_recompute`), the shared experts keep their input only, and
  DeepSeek-V4's hyper-connection mixes keep only the streams (recomputed in token pieces:
  :func:`parallm.model.layers.hyper_connections.recomputed`); the rest (attention, norms, routing) keeps its
  activations;
* ``"selective"``: ``"moe"``, and each attention block keeps only its input and runs again in its own backward.

Unlike ``"full"``, the selective options never hold a whole layer's activations at once in the backward: each
piece is recomputed when its own backward comes, the experts by chunks. Loss and gradients: bit for bit those
without recomputation, unless a hyper-connection is recomputed in several token pieces (then within ~1e-7:
:func:`parallm.model.layers.hyper_connections.recomputed`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .layers.hyper_connections import HyperConnection, HyperHead
from .layers.moe import Experts, MoEBlock

RECOMPUTE = (None, "full", "moe", "selective")


def mark_selective(chunk, attention: bool) -> None:
    """``recompute="moe"``: the routed experts (:mod:`parallm.model.layers.moe_recompute`), the shared experts and
    DeepSeek-V4's hyper-connection mixes recompute their products in the backward; ``"selective"``: the attention
    blocks too (``attention``). Everything else keeps its activations. ``"moe"`` on a model with neither experts
    nor hyper-connections is refused (it would change nothing)."""
    if not attention and chunk.spec.moe is None and chunk.spec.v4 is None:
        raise ValueError("recompute='moe' recomputes mixture-of-experts blocks and hyper-connections; this model has "
                         "neither ('selective' recomputes the attention as well, 'full' whole layers)")
    for m in chunk.modules():
        if isinstance(m, MoEBlock):
            m.recompute_shared = True
        elif isinstance(m, (Experts, HyperConnection, HyperHead)):
            m.recompute = True
        elif hasattr(m, "recompute_attention"):
            m.recompute_attention = attention


def recomputed_attention(attention, *args):
    """``attention(*args)`` keeping its inputs only (``torch.utils.checkpoint``, non-reentrant, RNG state
    restored): ``recompute="selective"``."""
    if not torch.is_grad_enabled():
        return attention(*args)
    return checkpoint(attention, *args, use_reentrant=False, preserve_rng_state=True)
