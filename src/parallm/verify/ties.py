"""Top-k ties of the DeepSeek Sparse Attention indexer on the transformers side of a comparison.

parallm breaks ties among equal indexer scores by the lower key position, in every layout and on every rank
(:func:`parallm.model.layers.indexer.topk_lowest_first`); transformers' ``torch.topk`` keeps whichever tied keys
its kernel meets (CPU: different ones for different row lengths). With few indexer heads exact ties are common
(a key whose every head's ReLU is zero scores exactly 0), so :func:`lowest_first_topk` makes transformers'
indexers follow parallm's rule while a reference runs: a reference that is a choice among equals, not an error.

Near-ties are another matter: two exact computations that sum in another order differ in the last bits and may
keep different keys where the gap between the last kept and the first dropped score is tiny, a discrete choice
no tolerance covers. :func:`topk_margin` finds the smallest such gap, so ``parallm verify`` can name it as the
likely reason when a layout with an indexer differs (:data:`NEAR_TIE`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

NEAR_TIE = 1e-5       # a relative top-k boundary gap below this may flip a key between two exact computations


def _is_indexer(module) -> bool:
    return type(module).__name__.endswith("Indexer")


class _LowestFirst(TorchFunctionMode):
    """``topk`` (largest, along the last dim) as a stable descending sort cut at k: ties by the lower index."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            x, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if kwargs.get("largest", True) and dim in (-1, x.dim() - 1):
                values, indices = (x + 0.0).sort(dim=-1, descending=True, stable=True)
                return torch.return_types.topk((values[..., :k], indices[..., :k]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def lowest_first_topk(model):
    """While inside: every ``*Indexer`` module of ``model`` (transformers' ``DeepseekV32Indexer`` /
    ``GlmMoeDsaIndexer``) breaks top-k ties by the lower key position, as parallm does. Other modules' ``topk``
    (the MoE routers') is untouched. A model without indexers: nothing changes."""
    modes = []

    def enter(mod, args):
        modes.append(_LowestFirst())
        modes[-1].__enter__()

    def leave(mod, args, out):
        modes.pop().__exit__(None, None, None)

    hooks = []
    for m in model.modules():
        if _is_indexer(m):
            hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        while modes:
            modes.pop().__exit__(None, None, None)


def _margins(mod, hs, q_resid, cos, sin, am, mask, kk: int) -> tuple[float, int]:
    """(smallest relative gap, the flat ``row * S + position`` of the query holding it) of one transformers
    indexer call."""
    import torch.nn.functional as F

    from ..model.layers.indexer import rope_first
    glm = "Glm" in type(mod).__name__
    q = mod.wq_b(q_resid).unflatten(-1, (mod.n_heads, mod.head_dim))
    k = mod.k_norm(mod.wk(hs))
    q = rope_first(q, cos, sin, interleave=glm)
    k = rope_first(k.unsqueeze(-2), cos, sin, interleave=glm).squeeze(-2)
    scores = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * mod.softmax_scale)
    w = mod.weights_proj(hs.to(mod.weights_proj.weight.dtype)).float() * mod.n_heads ** -0.5
    total = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)                          # [B, S, S]
    visible = (am > -1e30 if am.dtype != torch.bool else am).reshape(total.shape)
    ranked = total.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
    chooses = visible.sum(-1) > kk                       # queries that keep fewer keys than they see
    chooses &= mask.bool().to(chooses.device)
    if not bool(chooses.any()):
        return float("inf"), -1
    last, first_out = ranked[..., kk - 1], ranked[..., kk]
    gap = ((last - first_out) / last.abs().clamp_min(1e-6)).masked_fill(~chooses, float("inf"))
    where = int(gap.flatten().argmin())
    return float(gap.flatten()[where]), where


def topk_margin(model, ids, mask, forward) -> tuple[float, str]:
    """The smallest relative gap ``(v[k-1] - v[k]) / max(|v[k-1]|, 1e-6)`` between the last score a transformers
    indexer keeps and the first it drops, over every real query that sees more than ``index_topk`` keys and
    every layer with an indexer, on ``model``'s forward of ``ids`` / ``mask`` (``forward()`` runs it, e.g.
    :func:`parallm.verify.reference.hf_output`); and where (``"layer L, row R,
    position P"``). 0 at an exact tie; ``(inf, "")`` for a model without indexers."""
    caught = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: caught.append((mod, args)))
             for m in model.modules() if _is_indexer(m)]
    try:
        if not hooks:
            return float("inf"), ""
        with torch.no_grad():
            forward()
            best, where = float("inf"), ""
            for layer, (mod, (hs, q_resid, (cos, sin), am, *_)) in enumerate(caught):
                gap, flat = _margins(mod, hs, q_resid, cos, sin, am, mask, mod.index_topk)
                if gap < best:
                    row, pos = divmod(flat, ids.shape[1])
                    best, where = gap, f"layer {getattr(mod, 'layer_idx', layer)}, row {row}, position {pos}"
            return best, where
    finally:
        for h in hooks:
            h.remove()


def near_tie_note(model, ids, mask, forward, when: str) -> list[str]:
    """A note for ``parallm verify`` when the indexer's top-k has a near-tie on this batch (gap < NEAR_TIE); []
    otherwise."""
    gap, where = topk_margin(model, ids, mask, forward)
    if gap >= NEAR_TIE:
        return []
    how = "are equal (an exact tie)" if gap == 0 else f"differ by {gap:.1e} (relative)"
    return [f"top-k near-tie {when}: the indexer's last kept and first dropped scores {how} at {where}; a "
            "last-bit difference in the scores, or another tie rule, keeps another key there and the outputs "
            "differ with no error on either side (parallm and this reference keep the lower key position). If "
            "this layout differs only through that, check with another --seed (docs/families.md, Ties and "
            "near-ties)"]
