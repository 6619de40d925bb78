"""Whether a model's weights were ever filled.

``build_model`` allocates the parameters without initialising them (``torch.empty``: NaN or finite garbage), so
every chunk starts marked *not loaded* (``chunk.weights_loaded = False``, set by
:class:`parallm.model.decoder.DecoderChunk`). What fills every parameter marks it loaded: ``load_hf_weights``,
``load_checkpoint`` of a full training checkpoint (not a LoRA one, which holds the adapters only), the verl
compat loaders (through ``load_hf_weights``), ``build_model(..., init="random")``, or the user with
:func:`mark_loaded` after filling the parameters themselves. ``load_hf_adapter`` fills adapters only and changes
nothing. A load that fails after it began writing a rank's parameters leaves that rank's chunks marked not loaded.

``forward``, ``forward_backward``, ``save_hf_weights``, ``export_hf_tensors`` (and what streams through it) and
``save_checkpoint`` refuse chunks not marked loaded (:func:`require_loaded`, inside each call's agreement, so the
error is raised on every rank). Code that runs a chunk directly (``chunk.compute``, Megatron's schedules) is not
checked.
"""

from __future__ import annotations

from ..parallel.state import as_chunks

FIX = ("call parallm.load_hf_weights(chunks, ckpt) (or parallm.load_checkpoint) first, or build the model with "
       "parallm.build_model(..., init='random') for randomly initialised weights; if you filled every parameter "
       "yourself, call parallm.mark_loaded(chunks)")


def mark_loaded(chunks, loaded: bool = True) -> None:
    """Mark ``chunks`` (this rank's model) as holding real weights (``loaded=False``: as never loaded). For code
    that fills every parameter itself (copies from another model, its own initialisation); parallm's loaders
    mark the chunks themselves. Not collective, but every rank must mark its chunks: the checks agree across
    ranks, and a rank whose chunks are not marked makes every rank raise."""
    for chunk in as_chunks(chunks):
        chunk.weights_loaded = bool(loaded)


def is_loaded(chunks) -> bool:
    """Whether every chunk of ``chunks`` is marked loaded (an object without the mark counts as loaded: it was
    not built by parallm)."""
    return all(getattr(chunk, "weights_loaded", True) for chunk in as_chunks(chunks))


def require_loaded(chunks, what: str) -> None:
    """A RuntimeError naming the fix when ``chunks`` were never loaded. Local: callers run it inside their
    agreement across ranks."""
    if not is_loaded(chunks):
        raise RuntimeError(f"{what}: the model's weights were never loaded (build_model allocates the parameters "
                           f"without initialising them: they hold NaN or garbage); {FIX}")


__all__ = ["FIX", "is_loaded", "mark_loaded", "require_loaded"]
