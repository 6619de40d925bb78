"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type: gemma3_text``): config -> :class:`~parallm.model.spec.DecoderSpec`,
as transformers 5.25's ``modeling_gemma3`` runs it. Built as the exact reference for the pieces Gemma 4 shares
with it (docs/families.md, "Gemma 3 text" and "Gemma 4").

What differs from LLaMA, each a spec field: every RMSNorm zero-centred (``x_normed * (1 + w)`` in fp32:
``zero_centered_norm``), q / k norms per head (``qk_norm``), sandwich norms (``sandwich_norms``: HF
``post_attention_layernorm`` norms the attention's output before its residual add, ``pre_feedforward_layernorm``
is the pre-MLP norm (parallm's ``post_attention_layernorm``), ``post_feedforward_layernorm`` norms the MLP's
output), the softmax scale ``query_pre_attn_scalar ** -0.5`` (``attn_scale``), embeddings times
``sqrt(hidden_size)`` (``embed_scale``), ``hidden_activation`` (``gelu_pytorch_tanh``), sliding / full layers
(``layer_types``, ``sliding_window``) with a RoPE per layer type (``rope_parameters`` keyed by layer type:
full layers ``rope_theta`` 1e6, sliding ones 1e4 by default: ``layer_ropes``), final logit soft-capping
(``final_logit_softcapping``), tied embeddings by default, ``pad_token_id`` 0.

Refused, by name: ``attn_logit_softcapping`` (attention-logit capping is not implemented),
``use_bidirectional_attention``. ``Gemma3ForConditionalGeneration`` (the vision wrapper) is not registered.
"""

from __future__ import annotations

from ..model.positions.rope import rope_spec_from_hf_config
from ..model.spec import DecoderSpec
from ..model.table import Row
from .deepseek_v3 import _config_dict
from .llama import DECODER_TABLE
from .registry import Family, base_spec_kwargs, layer_windows, load_config, register

MODEL_TYPES = ("gemma3_text",)
ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3TextModel")
LAYER = "model.layers.{i}."

# transformers' Gemma3TextConfig defaults, for config.json files that leave a key out
GEMMA3_DEFAULTS = dict(head_dim=256, query_pre_attn_scalar=256, rms_norm_eps=1e-6, sliding_window=4096,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0)
THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _table() -> tuple[Row, ...]:
    """LLaMA's table with the pre-MLP norm read from ``pre_feedforward_layernorm`` and the two output norms."""
    out = []
    for row in DECODER_TABLE:
        if row.local == "layers.{l}.post_attention_layernorm.weight":
            out.append(Row(row.local, (LAYER + "pre_feedforward_layernorm.weight",), "copy", "layer",
                           (("hidden_size",),), tp_sum="sp"))
            out += [Row(f"layers.{{l}}.{local}.weight", (LAYER + f"{hf}.weight",), "copy", "layer",
                        (("hidden_size",),), tp_sum="sp")
                    for local, hf in (("attn_out_norm", "post_attention_layernorm"),
                                      ("mlp_out_norm", "post_feedforward_layernorm"))]
        else:
            out.append(row)
    return tuple(out)


GEMMA3_TABLE = _table()


def gemma3_window_types(config, n: int) -> list[str]:
    """``Gemma3TextConfig``'s default ``layer_types``: every ``sliding_window_pattern``-th layer (6) is full."""
    pattern = int(config.get("sliding_window_pattern", None) or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def _rope_by_type(raw: dict) -> dict:
    """``{"full_attention": params, "sliding_attention": params}`` as ``Gemma3TextConfig`` fills them in (a
    4.x-style config.json: ``rope_theta`` / ``rope_scaling`` for full layers, ``rope_local_base_freq`` for
    sliding ones)."""
    params = raw.get("rope_parameters") or {}
    if params and not all(isinstance(v, dict) for v in params.values()):
        params = {}             # a flat dict: the legacy keys below
    out = {k: dict(params.get(k) or {"rope_type": "default"}) for k in THETA}
    if not params and raw.get("rope_scaling"):
        out["full_attention"].update(raw["rope_scaling"])
    legacy = {"full_attention": raw.get("rope_theta"), "sliding_attention": raw.get("rope_local_base_freq")}
    for kind, theta in THETA.items():
        out[kind].setdefault("rope_theta", legacy[kind] if legacy[kind] is not None else theta)
    return out


def gemma3_spec(config) -> DecoderSpec:
    raw = _config_dict(config)
    if raw.get("model_type", "gemma3_text") not in MODEL_TYPES:
        raise ValueError(f"model_type={raw.get('model_type')!r} is not a Gemma 3 text config ({MODEL_TYPES})")
    for key, value in GEMMA3_DEFAULTS.items():
        if raw.get(key) is None and not (key == "pad_token_id" and key in raw):
            raw[key] = value
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"Gemma 3 with attn_logit_softcapping={raw['attn_logit_softcapping']!r} is not supported "
                         "(attention-logit soft-capping is not implemented); set it to null")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True is not supported (parallm's attention is "
                         "causal)")
    ropes = _rope_by_type(raw)
    max_pos = raw.get("max_position_embeddings")
    head_dim = int(raw["head_dim"])
    spec_of = {k: rope_spec_from_hf_config({"rope_parameters": p, "max_position_embeddings": max_pos}, head_dim)
               for k, p in ropes.items()}
    flat = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    flat.update(rope_parameters=ropes["full_attention"], hidden_act=raw["hidden_activation"])
    cfg = load_config(flat)
    kwargs = base_spec_kwargs(cfg, "gemma3")
    kwargs["rope"] = spec_of["full_attention"]
    windows = layer_windows(cfg, "Gemma 3", default_types=gemma3_window_types)
    types = raw.get("layer_types") or gemma3_window_types(cfg, kwargs["num_layers"])
    cap = raw.get("final_logit_softcapping")
    return DecoderSpec(
        **kwargs, qk_norm=True, zero_centered_norm=True, sandwich_norms=True, layer_windows=windows,
        layer_ropes=tuple(spec_of["sliding_attention"] if t == "sliding_attention" else None for t in types),
        attn_scale=float(raw["query_pre_attn_scalar"]) ** -0.5, embed_scale=float(kwargs["hidden_size"]) ** 0.5,
        final_logit_softcap=None if cap is None else float(cap),
        qkv_bias=bool(raw.get("attention_bias")), o_bias=bool(raw.get("attention_bias")))


GEMMA3 = register(Family(
    name="gemma3",
    model_types=MODEL_TYPES,
    architectures=ARCHITECTURES,
    spec=gemma3_spec,
    table=GEMMA3_TABLE,
    causal_architecture="Gemma3ForCausalLM",
    value_architecture="Gemma3TextForSequenceClassification",
))
