"""Kimi-K2.5 / K2.6 (``KimiK25ForConditionalGeneration``, ``model_type: kimi_k25``; transformers 5.25's
``Kimi_K25ForConditionalGeneration``): a MoonViT vision tower and projector over a DeepSeek-V3 text model
(``text_config``, ``model_type: kimi_k2``, which transformers maps to ``deepseek_v3``).

parallm trains the language model and carries the vision tower and projector (never run, written back
unchanged), with every tensor named as the released checkpoints name it (what transformers' ``kimi_k25``
conversion mapping reads): the language model under ``language_model.model.*`` with its head
``language_model.lm_head.weight``; the tower as ``vision_tower.patch_embed.*``, ``vision_tower.encoder.blocks.{i}.*``
(``norm0``, ``wqkv`` fused ``[3 h, h]``, ``wo``, ``norm1``, ``mlp.fc0``, ``mlp.fc1``),
``vision_tower.encoder.final_layernorm.*`` and ``mm_projector.{pre_norm, proj.0, proj.2}.*``. Their shapes follow
``vision_config`` (the released ``vt_*`` / ``init_pos_emb_*`` keys or transformers' names; both given and
different is an error). The routed experts of the released checkpoints are compressed-tensors INT4
pack-quantized, dequantised on load (:mod:`parallm.checkpoint.int4`). ``tie_word_embeddings`` is the wrapper's
(transformers' default for it is true; the released configs say false).
"""

from __future__ import annotations

from dataclasses import replace

from ..model.spec import DecoderSpec
from ..model.table import Row
from .deepseek_v3 import DEEPSEEK_V3_TABLE, deepseek_v3_spec
from .qwen3_5 import CARRIED_ROW
from .registry import Family, load_config, register

LANGUAGE_MODEL = "language_model."
# (released key, transformers' key, transformers' default) for each vision_config number the tower's shapes need
_VISION_KEYS = {"hidden": ("vt_hidden_size", "hidden_size", 1152),
                "layers": ("vt_num_hidden_layers", "num_hidden_layers", 27),
                "intermediate": ("vt_intermediate_size", "intermediate_size", 4304),
                "pos_h": ("init_pos_emb_height", "pos_emb_height", 64),
                "pos_w": ("init_pos_emb_width", "pos_emb_width", 64),
                "patch": ("patch_size", "patch_size", 14)}


def _get(config, key, default=None):
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _vision_number(vision, what: str) -> int:
    released, hf, default = _VISION_KEYS[what]
    a, b = _get(vision, released), _get(vision, hf)
    if a is not None and b is not None and a != b:
        raise ValueError(f"vision_config has {released}={a} and {hf}={b}: which one the tower was built with is "
                         "ambiguous")
    value = a if a is not None else b if b is not None else default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"vision_config.{released if a is not None else hf}={value!r} is not a positive integer")
    return value


def vision_tensors(config, text_hidden: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every tensor of the vision tower and projector, as the released checkpoints name them, with its shape."""
    vision = _get(config, "vision_config")
    if vision is None:
        raise ValueError("a kimi_k25 config needs a vision_config")
    n = {k: _vision_number(vision, k) for k in _VISION_KEYS}
    h, i = n["hidden"], n["intermediate"]
    merge = list(_get(vision, "merge_kernel_size", None) or (2, 2))
    merged = h * merge[0] * merge[1]
    pre_norm = _get(config, "projection_hidden_size") or _get(vision, "mm_hidden_size") or h
    out = [("vision_tower.patch_embed.proj.weight", (h, 3, n["patch"], n["patch"])),
           ("vision_tower.patch_embed.proj.bias", (h,)),
           ("vision_tower.patch_embed.pos_emb.weight", (n["pos_h"], n["pos_w"], h))]
    for j in range(n["layers"]):
        block = f"vision_tower.encoder.blocks.{j}."
        for name, shape in (("norm0", (h,)), ("norm1", (h,))):
            out += [(block + name + ".weight", shape), (block + name + ".bias", shape)]
        for name, rows, cols in (("wqkv", 3 * h, h), ("wo", h, h), ("mlp.fc0", i, h), ("mlp.fc1", h, i)):
            out += [(block + name + ".weight", (rows, cols)), (block + name + ".bias", (rows,))]
    out += [("vision_tower.encoder.final_layernorm.weight", (h,)), ("vision_tower.encoder.final_layernorm.bias", (h,)),
            ("mm_projector.pre_norm.weight", (pre_norm,)), ("mm_projector.pre_norm.bias", (pre_norm,)),
            ("mm_projector.proj.0.weight", (merged, merged)), ("mm_projector.proj.0.bias", (merged,)),
            ("mm_projector.proj.2.weight", (text_hidden, merged)), ("mm_projector.proj.2.bias", (text_hidden,))]
    return tuple(out)


def kimi_k25_spec(config) -> DecoderSpec:
    """The language model's spec from ``text_config`` (DeepSeek-V3's), named as the wrapper, the tower carried."""
    text = _get(config, "text_config")
    if text is None:
        raise ValueError("a kimi_k25 config needs a text_config (the DeepSeek-V3 language model's)")
    text = load_config(text) if isinstance(text, dict) else text
    spec = deepseek_v3_spec(text)
    archs = _get(config, "architectures") or ["KimiK25ForConditionalGeneration"]
    tied = _get(config, "tie_word_embeddings")
    return replace(spec, family="kimi_k25", architecture=archs[0], model_type=_get(config, "model_type", "kimi_k25"),
                   carried=vision_tensors(config, spec.hidden_size),
                   tie_word_embeddings=True if tied is None else bool(tied))


def _wrapper_names(row: Row) -> Row:
    """``row`` with its HF names under the wrapper: ``model.*`` -> ``language_model.model.*``, ``lm_head.*`` ->
    ``language_model.lm_head.*`` (a value head's ``score.weight`` stays)."""
    def move(name: str) -> str:
        return LANGUAGE_MODEL + name if name.startswith(("model.", "lm_head.")) else name
    return replace(row, hf=tuple(move(h) for h in row.hf), fused=tuple(move(f) for f in row.fused))


KIMI_K25 = register(Family(
    name="kimi_k25",
    model_types=("kimi_k25",),
    architectures=("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"),
    spec=kimi_k25_spec,
    table=tuple(_wrapper_names(r) for r in DEEPSEEK_V3_TABLE) + (CARRIED_ROW,),
    causal_architecture="KimiK25ForConditionalGeneration",
    # no sequence-classification class exists for Kimi-K2.5: a value model is saved under this name (parallm loads
    # it back; transformers cannot)
    value_architecture="KimiK25ForSequenceClassification",
    # transformers holds the language model at model.language_model.*, the head at lm_head (PEFT's names)
    peft_renames=(("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head.")),
))
