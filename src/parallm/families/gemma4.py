"""Gemma 4 text (``Gemma4ForCausalLM``, ``model_type: gemma4_text``), the subset parallm runs: config ->
:class:`~parallm.model.spec.DecoderSpec`, as transformers 5.25's ``modeling_gemma4`` runs it (docs/families.md,
"Gemma 4").

Runs: Gemma 3 text's layer (sandwich norms, q / k norms per head, RoPE per layer type, sliding / full layers,
scaled embeddings, the tanh GELU, final logit soft-capping, tied embeddings) with Gemma 4's differences: norms
that multiply their weight directly (``Gemma4RMSNorm``: ``x * pow(mean(x^2) + eps, -0.5)`` times the weight, in
fp32: ``norm_pow``), the values' weightless RMSNorm (``v_norm``), softmax scale 1.0 (``attn_scale``), proportional RoPE on the
full layers (RopeSpec kind ``proportional``), each layer's output times its ``layer_scalar``.

Refused at config parse, naming the field (not implemented): per-layer input embeddings
(``hidden_size_per_layer_input`` > 0), KV sharing (``num_kv_shared_layers`` > 0), K = V (``attention_k_eq_v``),
a global head dim or global KV-head count other than the sliding layers' (``global_head_dim`` /
``num_global_key_value_heads`` / ``per_layer_config``; transformers' default ``global_head_dim`` is 512), the MoE
block (``enable_moe_block``), ``use_bidirectional_attention``. Every released Gemma 4 checkpoint uses at least one
of these: none runs yet. Not registered: ``Gemma4ForConditionalGeneration`` (the wrapper).
"""

from __future__ import annotations

from ..model.table import Row
from .deepseek_v3 import _config_dict
from .gemma3 import GEMMA3_TABLE, gemma3_spec
from .registry import Family, register

MODEL_TYPES = ("gemma4_text",)
ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4TextModel")

GEMMA4_DEFAULTS = dict(head_dim=256, rms_norm_eps=1e-6, sliding_window=512, hidden_activation="gelu_pytorch_tanh",
                       tie_word_embeddings=True, pad_token_id=0, hidden_size_per_layer_input=256,
                       num_kv_shared_layers=0, attention_k_eq_v=False, enable_moe_block=False)
GLOBAL_HEAD_DIM = 512    # Gemma4TextConfig's default global_head_dim
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

GEMMA4_TABLE = GEMMA3_TABLE + (
    Row("layers.{l}.layer_scalar", ("model.layers.{i}.layer_scalar",), "copy", "layer", ((1,),),
        when=("layer_scalar",)),
)


def _refuse(raw: dict) -> None:
    head_dim, nkv = raw["head_dim"], raw.get("num_key_value_heads")
    checks = (
        ("hidden_size_per_layer_input", bool(raw["hidden_size_per_layer_input"]),
         "per-layer input embeddings are not implemented; 0 turns them off"),
        ("num_kv_shared_layers", bool(raw["num_kv_shared_layers"]), "KV sharing between layers is not implemented"),
        ("attention_k_eq_v", bool(raw["attention_k_eq_v"]), "K = V attention is not implemented"),
        ("enable_moe_block", bool(raw["enable_moe_block"]), "the MoE block beside the MLP is not implemented"),
        ("use_bidirectional_attention", bool(raw.get("use_bidirectional_attention")),
         "parallm's attention is causal"),
    )
    for key, bad, why in checks:
        if bad:
            raise ValueError(f"Gemma 4 with {key}={raw[key]!r} is not supported ({why})")
    overrides = raw.get("per_layer_config")
    if overrides is None:           # a config.json transformers has not written: its class default
        overrides = {"full": {"head_dim": raw.get("global_head_dim") or GLOBAL_HEAD_DIM,
                              "num_key_value_heads": raw.get("num_global_key_value_heads") or nkv}}
    for layer, o in overrides.items():
        for key, base, name in (("head_dim", head_dim, "global_head_dim"),
                                ("num_key_value_heads", nkv, "num_global_key_value_heads")):
            if key in o and o[key] not in (None, base):
                raise ValueError(f"Gemma 4 with {name}={o[key]!r} (layer {layer}) other than the sliding layers' "
                                 f"{key}={base!r} is not supported (attention of one head shape per model)")


def gemma4_spec(config):
    from dataclasses import replace
    raw = _config_dict(config)
    if raw.get("model_type", "gemma4_text") not in MODEL_TYPES:
        raise ValueError(f"model_type={raw.get('model_type')!r} is not a Gemma 4 text config ({MODEL_TYPES})")
    for key, value in GEMMA4_DEFAULTS.items():
        if raw.get(key) is None and not (key == "pad_token_id" and key in raw):
            raw[key] = value
    _refuse(raw)
    params = raw.get("rope_parameters") or {}
    raw["rope_parameters"] = {k: dict(params.get(k) or v) for k, v in ROPE.items()}
    if raw.get("layer_types") is None:      # Gemma4TextConfig: every 6th layer full, the last one full
        n = int(raw["num_hidden_layers"])
        raw["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    raw["layer_types"] = list(raw["layer_types"])[:-1] + ["full_attention"]
    raw.update(model_type="gemma3_text", query_pre_attn_scalar=1.0, attn_logit_softcapping=None)
    spec = gemma3_spec(raw)
    return replace(spec, family="gemma4", model_type="gemma4_text", architecture=_arch(raw),
                   zero_centered_norm=False, norm_pow=True, attn_scale=1.0, v_norm=True, layer_scalar=True)


def _arch(raw: dict) -> str:
    archs = raw.get("architectures") or []
    return archs[0] if archs else "Gemma4ForCausalLM"


GEMMA4 = register(Family(
    name="gemma4",
    model_types=MODEL_TYPES,
    architectures=ARCHITECTURES,
    spec=gemma4_spec,
    table=GEMMA4_TABLE,
    causal_architecture="Gemma4ForCausalLM",
    value_architecture="Gemma4TextForSequenceClassification",
))
