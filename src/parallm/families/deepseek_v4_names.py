"""DeepSeek-V4's two checkpoint spellings, and the multi-token-prediction tensors its checkpoints carry.

parallm's V4 weight table names tensors as transformers' ``DeepseekV4ForCausalLM.save_pretrained`` writes them
(and reads them back): ``head.weight``, ``model.embed_tokens.weight``, ``model.norm.weight``,
``model.hc_head.{hc_fn,hc_base,hc_scale}``, ``model.layers.{i}.*`` (``attn.wq_a.weight``, ``attn.attn_sink``,
``attn_norm.weight``, ``hc_attn_fn``, ``ffn.experts.{e}.w1.weight``, ...). The released Hub checkpoints
(deepseek-ai/DeepSeek-V4-Flash, -Pro) use DeepSeek's inference names, with no ``model.`` prefix::

    Hub                              transformers' save name
    embed.weight                     model.embed_tokens.weight
    norm.weight                      model.norm.weight
    hc_head_fn / _base / _scale      model.hc_head.hc_fn / hc_base / hc_scale
    head.weight                      head.weight
    layers.{i}.<rest>                model.layers.{i}.<rest>   (<rest> the same: attn.*, ffn.*, hc_attn_fn, ...,
                                                               except the attention's KV norm:)
    layers.{i}.attn.kv_norm.weight   model.layers.{i}.attn.norm.weight
    mtp.{j}.<rest>                   mtp.{j}.<rest>            (transformers drops them; parallm carries them)

Block scales follow their weight (``layers.{i}.attn.wq_a.scale`` -> ``model.layers.{i}.attn.wq_a.scale``).
:func:`checkpoint_names` is what the loader applies for this family (``Family.checkpoint_names``): a checkpoint in
either spelling loads into the same parameters; one that mixes them is refused, naming a tensor of each. Saves
write transformers' save names (the table's), which both transformers and parallm read back.

:func:`mtp_tensors` lists the ``mtp.*`` tensors as the model holds them (``spec.carried_mtp``): scales are no
tensors of their own and an FP4 weight has its dequantised shape (its bytes twice as wide), since the loader reads
them through :mod:`parallm.checkpoint.fp8` / :mod:`parallm.checkpoint.fp4` like every other weight.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError

# The scale spellings and the FP4 layout of parallm.checkpoint.fp8 / fp4, restated: families/ sits below
# checkpoint/ (the loader imports the families), so it cannot import them. tests/test_v4_checkpoint.py checks the
# listing against the loader's view of a real checkpoint.
DOT_SCALE, SCALE_SUFFIX = ".scale", "_scale_inv"
FP4_GROUP = 32
_PACKED = (torch.int8,) + tuple(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))

MODEL = "model."
MTP_PREFIX = "mtp."
# whole-name renames, Hub -> transformers' save name (the rest is the model. prefix on layers.*)
_HUB_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
            "hc_head_scale": "model.hc_head.hc_scale"}
_SAVE_TOP = {v: k for k, v in _HUB_TOP.items()}
_HUB_LAYERS, _SAVE_LAYERS = "layers.", "model.layers."


# the attention's KV norm: attn.kv_norm on the Hub (DeepSeek's inference code, vLLM's loader), attn.norm in
# transformers' saves (its conversion renames every ".norm." to ".kv_norm." on load, so save_pretrained writes the
# attention's back as attn.norm; the compressors' norms are compressor.norm in both)
_HUB_KV_NORM, _SAVE_KV_NORM = ".attn.kv_norm.", ".attn.norm."


def hub_to_hf(name: str) -> str:
    """A Hub checkpoint name -> transformers' save name (names of neither form, such as ``head.weight`` and
    ``mtp.*``, are the same in both)."""
    if name in _HUB_TOP:
        return _HUB_TOP[name]
    if name.startswith(_HUB_LAYERS):
        return MODEL + name.replace(_HUB_KV_NORM, _SAVE_KV_NORM)
    return name


def hf_to_hub(name: str) -> str:
    """transformers' save name -> the Hub checkpoint's name (:func:`hub_to_hf`'s inverse)."""
    if name in _SAVE_TOP:
        return _SAVE_TOP[name]
    if name.startswith(_SAVE_LAYERS):
        return name[len(MODEL):].replace(_SAVE_KV_NORM, _HUB_KV_NORM)
    return name


def _is_hub(name: str) -> bool:
    return name in _HUB_TOP or name.startswith(_HUB_LAYERS)


def spelling(names) -> str | None:
    """``"hub"``, ``"hf"`` (transformers' save names) or None (only names both share: ``head.weight``,
    ``mtp.*``) for a checkpoint's tensor names; a :class:`CheckpointError` naming a tensor of each when both
    appear."""
    hub = sorted(n for n in names if _is_hub(n))
    hf = sorted(n for n in names if n.startswith(MODEL))
    if hub and hf:
        raise CheckpointError(f"a DeepSeek-V4 checkpoint mixing the Hub names ({', '.join(hub[:3])}"
                              f"{', ...' if len(hub) > 3 else ''}: {len(hub)} tensors) and transformers' save names "
                              f"({', '.join(hf[:3])}{', ...' if len(hf) > 3 else ''}: {len(hf)} tensors): which one "
                              "holds the model's weights is ambiguous")
    return "hub" if hub else "hf" if hf else None


def checkpoint_names(names) -> dict[str, str]:
    """``{checkpoint name: the table's name}`` for every tensor of a V4 checkpoint in either spelling (the loader
    reads each table name from its checkpoint name). A mix of both is a :class:`CheckpointError`
    (:func:`spelling`); a name the table lacks passes through, for the loader to name as unexpected."""
    names = list(names)
    if spelling(names) != "hub":
        return {n: n for n in names}
    return {n: hub_to_hf(n) for n in names}


# -- multi-token prediction -------------------------------------------------------------------------------------

def _scale_of(weight: str, present) -> str | None:
    for name in (weight + SCALE_SUFFIX, weight[: -len(".weight")] + DOT_SCALE if weight.endswith(".weight") else ""):
        if name in present:
            return name
    return None


def mtp_tensors(present: dict, dtypes: dict | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The multi-token-prediction tensors among a checkpoint's ``{name: shape}`` (``mtp.*``, the same in both
    spellings), in name order, as the model holds them: scales left out (they are read with their weights) and
    each FP4 weight with its dequantised shape ``[..., N, 2 B]``. Which weights are FP4: by their dtype when
    ``dtypes`` is given (int8 / float4_e2m1fn_x2 with a scale), else by their scale's shape (one per row per 32
    columns, ``[..., N, ceil(2 B / 32)]``: an FP8 block grid has ``ceil(N / 128)`` rows)."""
    mtp = {n: tuple(s) for n, s in present.items() if n.startswith(MTP_PREFIX)}
    scales = {}
    for name in mtp:
        scale = _scale_of(name, mtp)
        if scale is not None:
            scales[name] = scale
    out = []
    for name in sorted(mtp):
        if name in scales.values():
            continue
        shape = mtp[name]
        scale = scales.get(name)
        if scale is not None:
            packed = dtypes.get(name) in _PACKED if dtypes is not None else (
                len(shape) >= 2 and mtp[scale] == (*shape[:-1], -(-2 * shape[-1] // FP4_GROUP)) and shape[-2] > 1)
            if packed:
                shape = (*shape[:-1], 2 * shape[-1])
        out.append((name, shape))
    return tuple(out)
