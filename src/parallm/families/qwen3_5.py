"""Qwen3.5 (``Qwen3_5ForCausalLM``) and Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``), and the published
vision-language checkpoints (``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``): the
hybrid Gated DeltaNet decoder of :mod:`parallm.families.hybrid_common` (shared with Qwen3-Next), with the Gated
DeltaNet's input projections stored as four tensors (``in_proj_qkv`` ``[q; k; v]``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, fused per rank). Qwen3.5-MoE: every layer's MLP routes (softmax top-k, renormalised) over
``num_experts`` experts plus the shared expert.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.spec import DecoderSpec
from ..model.table import Row
from .hybrid_common import GDN, H, LINEAR, hybrid_spec, hybrid_table, mtp_tensors, qwen_hybrid_moe
from .registry import Family, load_config, register

# Qwen3.5: in_proj_qkv ([q; k; v], split by heads), in_proj_z, in_proj_b, in_proj_a fused per rank
QWEN3_5_IN_PROJ = Row(
    GDN + "in_proj.weight", tuple(LINEAR + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), "gdn_in", "layer",
    (("gdn_conv_dim", H), ("gdn_value_dim", H), ("gdn_value_heads", H), ("gdn_value_heads", H)),
    when=("linear_layer",))


def qwen3_5_spec(config) -> DecoderSpec:
    return hybrid_spec(config, "qwen3_5", interleaved=False)


def qwen3_5_moe_spec(config) -> DecoderSpec:
    # every layer routes; the top-k weights are always renormalised (transformers' Qwen3_5MoeTopKRouter)
    moe = qwen_hybrid_moe(config, tuple(range(int(config.num_hidden_layers))), norm_topk_prob=True)
    return hybrid_spec(config, "qwen3_5_moe", interleaved=False, moe=moe)


QWEN3_5 = register(Family(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5TextForSequenceClassification", "Qwen3_5TextModel"),
    spec=qwen3_5_spec,
    table=hybrid_table(QWEN3_5_IN_PROJ, moe=False),
    causal_architecture="Qwen3_5ForCausalLM",
    value_architecture="Qwen3_5TextForSequenceClassification",
    mtp_tensors=mtp_tensors,
))

QWEN3_5_MOE = register(Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel"),
    spec=qwen3_5_moe_spec,
    table=hybrid_table(QWEN3_5_IN_PROJ, moe=True),
    causal_architecture="Qwen3_5MoeForCausalLM",
    # transformers 5.25 has no sequence-classification class for Qwen3.5-MoE; a value model is saved under this
    # name (parallm loads it back; transformers cannot)
    value_architecture="Qwen3_5MoeForSequenceClassification",
    mtp_tensors=mtp_tensors,
))


# -- the published vision-language checkpoints: the language model trained, the vision tower carried -----------

LANGUAGE_MODEL = "model.language_model."
CARRIED_ROW = Row("carried.{c}", ("{carried}",), "copy", "first", ((0,),), when=("carried",), trained=False)


def _language_model_names(row: Row) -> Row:
    """``row`` with its HF names (and fused names) under ``model.language_model.`` (``lm_head`` / ``score`` stay)."""
    def move(name: str) -> str:
        return LANGUAGE_MODEL + name[len("model."):] if name.startswith("model.") else name
    return replace(row, hf=tuple(move(h) for h in row.hf), fused=tuple(move(f) for f in row.fused))


def vl_table(text_table: tuple[Row, ...]) -> tuple[Row, ...]:
    """A text family's table for ``*ForConditionalGeneration`` checkpoints: the language model's tensors under
    ``model.language_model.``, every vision tensor carried (:data:`CARRIED_ROW`, one row per ``spec.carried``)."""
    return tuple(_language_model_names(r) for r in text_table) + (CARRIED_ROW,)


def _sub_config(config, key: str):
    sub = getattr(config, key, None)
    if sub is None:
        raise ValueError(f"a vision-language config needs {key} (got none)")
    return load_config(sub) if isinstance(sub, dict) else sub


_VISION_CACHE: dict[str, tuple] = {}


def vision_tensors(config) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every tensor of the vision tower (``model.visual.*``, names and shapes) as transformers builds it from
    ``config.vision_config`` (on the meta device: no memory, no weights)."""
    import json

    import torch
    import transformers
    vision = getattr(config, "vision_config", None)
    raw = vision if isinstance(vision, dict) else (vision.to_dict() if vision is not None else None)
    if raw is None or "model_type" not in raw:
        raise ValueError("a vision-language config needs a vision_config with its model_type")
    if raw["model_type"] in ("qwen3_5", "qwen3_5_moe"):     # early checkpoints name the VL model there
        raw = dict(raw, model_type=raw["model_type"] + "_vision")       # (transformers corrects it the same way)
        vision = raw
    key = json.dumps(raw, sort_keys=True, default=str)
    if key not in _VISION_CACHE:
        cfg = vision if not isinstance(vision, dict) else transformers.AutoConfig.for_model(
            raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        with torch.device("meta"):
            tower = _vision_model(cfg)
        _VISION_CACHE[key] = tuple(("model.visual." + k, tuple(t.shape)) for k, t in tower.state_dict().items())
    return _VISION_CACHE[key]


def _vision_model(cfg):
    """The vision tower's module for its config: ``AutoModel``'s, or where this transformers does not register
    the vision config with ``AutoModel`` (5.10 does not for Qwen3.5's), the class of the config's own modeling
    module whose ``config_class`` it is."""
    import importlib

    import transformers
    try:
        return transformers.AutoModel.from_config(cfg)
    except ValueError:
        module = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
        found = [o for o in vars(module).values() if isinstance(o, type)
                 and getattr(o, "config_class", None) is type(cfg) and issubclass(o, transformers.PreTrainedModel)]
        if len(found) != 1:
            raise ValueError(f"transformers {transformers.__version__} builds no vision tower for "
                             f"{type(cfg).__name__} (AutoModel does not know it; {module.__name__} has "
                             f"{[o.__name__ for o in found]})") from None
        return found[0](cfg)


def vl_spec(config, text_spec_fn, family: str) -> DecoderSpec:
    """The language model's spec from ``text_config``, named as the checkpoint, with the vision tower carried."""
    text = _sub_config(config, "text_config")
    spec = text_spec_fn(text)
    archs = getattr(config, "architectures", None) or []
    tied = getattr(config, "tie_word_embeddings", None)
    return replace(spec, family=family, architecture=archs[0] if archs else family,
                   model_type=getattr(config, "model_type", family), carried=vision_tensors(config),
                   tie_word_embeddings=spec.tie_word_embeddings if tied is None else bool(tied))


QWEN3_5_VL = register(Family(
    name="qwen3_5_vl",
    model_types=("qwen3_5",),
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForSequenceClassification", "Qwen3_5Model"),
    spec=lambda config: vl_spec(config, qwen3_5_spec, "qwen3_5_vl"),
    table=vl_table(QWEN3_5.table),
    causal_architecture="Qwen3_5ForConditionalGeneration",
    value_architecture="Qwen3_5ForSequenceClassification",
    mtp_tensors=mtp_tensors,
))

QWEN3_5_MOE_VL = register(Family(
    name="qwen3_5_moe_vl",
    model_types=("qwen3_5_moe",),
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel"),
    spec=lambda config: vl_spec(config, qwen3_5_moe_spec, "qwen3_5_moe_vl"),
    table=vl_table(QWEN3_5_MOE.table),
    causal_architecture="Qwen3_5MoeForConditionalGeneration",
    value_architecture="Qwen3_5MoeForSequenceClassification",
    mtp_tensors=mtp_tensors,
))
