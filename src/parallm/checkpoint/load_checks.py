"""What a checkpoint must hold for a model, checked before any weight moves (:func:`check_checkpoint`), and the
value head's source (a ``score.weight``, a verl-style ``lm_head`` alias, or initialised). Used by the loader
(:mod:`.loader`) and ``parallm.inspect_checkpoint``."""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..families import family_of
from .hf_dir import check_keys_and_shapes

__all__ = ["IGNORED_SUFFIXES", "VALUE_HEAD", "VALUE_HEAD_INIT_SEED", "VALUE_HEAD_INIT_STD", "check_checkpoint",
           "fused_plan", "ignorable_names", "init_value_head", "refuse_uncarried_mtp", "value_head_plan"]

# Buffers some checkpoints carry that are recomputed, never loaded.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
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


def fused_plan(present: dict, expected: dict, fused: dict, *, num_experts: int, where: str) -> dict:
    """Tensors the checkpoint stores fused (transformers 5's in-memory MoE layout, :class:`FusedPart`): HF name ->
    its part, for every expected tensor absent under its own name whose fused tensor is present. A fused tensor
    whose shape is not ``[E, parts * rows, cols]`` of the tensors it holds is a :class:`CheckpointError`."""
    plan = {}
    for name, part in fused.items():
        if name in present or part.name not in present:
            continue
        rows, *cols = expected[name]
        want = (rows * part.parts, *cols) if part.expert is None else (num_experts, rows * part.parts, *cols)
        if tuple(present[part.name]) != tuple(want):
            raise CheckpointError(f"{where}: wrong shape: {part.name}: checkpoint {tuple(present[part.name])} vs "
                                  f"model {want} (the fused layout of {name} and its kin)")
        plan[name] = part
    return plan


def check_checkpoint(present: dict, spec, task: str, expected: dict, *, strict: bool, where: str,
                     fused: dict | None = None):
    """The checkpoint's tensor names and shapes against the model's (``expected``), value-head sources and
    fused MoE tensors (``fused``: :func:`~parallm.model.table.fused_layout`) included. Raises
    :class:`CheckpointError` naming every problem; returns ``(aliases, initialised, fused parts)``:
    ``value_head_plan``'s two and :func:`fused_plan`'s."""
    if strict and spec.mtp_layers and not spec.carried_mtp_layers:
        refuse_uncarried_mtp(present, spec, where)
    pick = family_of(spec).mtp_tensors
    if strict and pick is not None and not spec.carried_mtp and (extra := pick(present)):
        raise CheckpointError(
            f"{where}: the checkpoint carries multi-token-prediction tensors ({', '.join(n for n, _ in extra[:3])}"
            f"{f' and {len(extra) - 3} more' if len(extra) > 3 else ''}) and the model was built without them: "
            "build it from this checkpoint directory (build_model(path), mtp=None or True) to carry them through "
            "save_hf_weights / export_hf_tensors / training checkpoints, or load with strict=False to drop them "
            "(as transformers does)")
    aliases, init = value_head_plan(present, spec, task)
    parts = fused_plan(present, expected, fused or {}, where=where,
                       num_experts=spec.moe.num_experts if spec.moe is not None else 0)
    seen = {k: v for k, v in present.items() if k not in {p.name for p in parts.values()}}
    seen.update({k: present[v] for k, v in aliases.items()})
    seen.update({k: expected[k] for k in parts})
    want = {k: v for k, v in expected.items() if k not in init}
    check_keys_and_shapes(seen, want, strict=strict, ignorable=ignorable_names(spec, task), where=where)
    return aliases, init, parts


def refuse_uncarried_mtp(present: dict, spec, where: str) -> None:
    """A checkpoint holding multi-token-prediction layers (``model.layers.{L + j}.*``, ``L`` decoder layers) for a
    model built without them: a :class:`CheckpointError` that says how to carry or drop them."""
    import re
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    extra = sorted(k for k in present if (m := pattern.match(k)) and int(m.group(1)) >= spec.num_layers)
    if extra:
        raise CheckpointError(
            f"{where}: the checkpoint carries multi-token-prediction layer tensors ({', '.join(extra[:3])}"
            f"{f' and {len(extra) - 3} more' if len(extra) > 3 else ''}) and the model was built without them: "
            "build it with build_model(..., mtp=True) (the default when built from this checkpoint directory) to "
            "carry them through save_hf_weights / export_hf_tensors, or load with strict=False to drop them (as "
            "transformers does)")


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


def ignorable_names(spec, task: str) -> tuple[str, ...]:
    if task in ("hidden", "value"):  # a headless model / a critic started from a causal-LM checkpoint
        return IGNORED_SUFFIXES + ("lm_head.weight",) + ((VALUE_HEAD,) if task == "hidden" else ())
    # A tied checkpoint may still carry lm_head.weight (some exporters write it); the embedding is the truth.
    return IGNORED_SUFFIXES + (("lm_head.weight",) if spec.tie_word_embeddings else ())
