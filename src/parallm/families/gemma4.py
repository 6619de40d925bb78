"""Gemma 4 text (``Gemma4ForCausalLM``, ``model_type: gemma4_text``), the subset parallm runs: config ->
:class:`~parallm.model.spec.DecoderSpec`, as transformers 5.25's ``modeling_gemma4`` runs it (docs/families.md,
"Gemma 4"; the ``gemma4`` wrapper's language model: :mod:`parallm.families.gemma4_vl`).

Runs: Gemma 3 text's layer (sandwich norms, q / k norms per head, RoPE per layer type, sliding / full layers,
scaled embeddings, the tanh GELU, final logit soft-capping, tied embeddings) with Gemma 4's differences: norms
that multiply their weight directly (``Gemma4RMSNorm``: ``x * pow(mean(x^2) + eps, -0.5)`` times the weight, in
fp32: ``norm_pow``), the values' weightless RMSNorm (``v_norm``), softmax scale 1.0 (``attn_scale``), proportional
RoPE on the full layers (RopeSpec kind ``proportional``), each layer's output times its ``layer_scalar``.

The full-attention layers' own attention shape (``per_layer_config``, from ``global_head_dim`` and, with
``attention_k_eq_v``, ``num_global_key_value_heads``; transformers' default ``global_head_dim`` is 512): the spec's
``global_layers`` / ``global_head_dim`` / ``global_kv_heads``, their own table rows (``global_attn``: kind
``qkv_global``, q / k norms and ``o_proj`` of that shape) and their proportional RoPE over the global head dim.
One global shape, on every full layer: other ``per_layer_config`` overrides are refused naming the layer.
K = V on the full layers (``attention_k_eq_v``: ``spec.global_k_eq_v``, rows of kind ``qk_global`` without
``v_proj``): the values are the keys' projection before k_norm / RoPE, then ``v_norm``.

Per-layer input embeddings (``hidden_size_per_layer_input`` P > 0: ``spec.per_layer_input_size``,
model/layers/per_layer_inputs.py), computed on the first pipeline stage and carried beside the hidden state to the
later ones; their vocabulary must be the tokens' (``vocab_size_per_layer_input == vocab_size``, as released).

KV sharing (``num_kv_shared_layers``: ``spec.kv_sources``, model/layers/kv_sharing.py): the last layers reuse the
keys / values of the last earlier layer of their type, have q_proj alone (``column`` rows) and, with
``use_double_wide_mlp``, an MLP of twice the intermediate size; a sharing layer and its source on different
pipeline stages, and layer recomputation, are refused.

The MoE block beside the MLP (``enable_moe_block``: :mod:`parallm.families.gemma4_moe`, the layer
:mod:`parallm.model.layers.moe_beside`): every layer's dense MLP plus routed experts, the router on the residual.

Refused at config parse, naming the field (not implemented): per-layer embeddings of another vocabulary,
``use_bidirectional_attention``. The ``gemma4`` wrapper: :mod:`parallm.families.gemma4_vl`.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.positions.rope import rope_spec_from_hf_config
from ..model.table import Row
from .deepseek_v3 import _config_dict
from .gemma3 import GEMMA3_TABLE, gemma3_spec
from .gemma4_moe import MOE_ROWS, gemma4_moe_spec
from .registry import Family, register

MODEL_TYPES = ("gemma4_text",)
ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4TextModel")

GEMMA4_DEFAULTS = dict(head_dim=256, rms_norm_eps=1e-6, sliding_window=512, hidden_activation="gelu_pytorch_tanh",
                       tie_word_embeddings=True, pad_token_id=0, hidden_size_per_layer_input=256,
                       vocab_size_per_layer_input=262_144,
                       num_kv_shared_layers=0, attention_k_eq_v=False, enable_moe_block=False,
                       use_double_wide_mlp=False)
GLOBAL_HEAD_DIM = 512    # Gemma4TextConfig's default global_head_dim
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

ATTN = "model.layers.{i}.self_attn."
GQ, GKV, H = "global_q_size", "global_kv_size", "hidden_size"
# the attention rows whose shapes depend on the layer's head dim / KV heads: local_attn as Gemma 3's, global_attn
# with the full layers' own (spec.global_layers)
SHAPED = {"layers.{l}.self_attention.linear_qkv.weight", "layers.{l}.self_attention.linear_qkv.bias",
          "layers.{l}.self_attention.q_norm.weight", "layers.{l}.self_attention.k_norm.weight",
          "layers.{l}.self_attention.linear_proj.weight"}
GLOBAL_ROWS = (
    Row("layers.{l}.self_attention.linear_qkv.weight",
        (ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), "qkv_global", "layer",
        ((GQ, H), (GKV, H), (GKV, H)), when=("global_attn", "not_k_eq_v")),
    Row("layers.{l}.self_attention.linear_qkv.weight", (ATTN + "q_proj.weight", ATTN + "k_proj.weight"),
        "qk_global", "layer", ((GQ, H), (GKV, H)), when=("global_attn", "k_eq_v")),
    Row("layers.{l}.self_attention.linear_qkv.bias",
        (ATTN + "q_proj.bias", ATTN + "k_proj.bias", ATTN + "v_proj.bias"), "qkv_global", "layer",
        ((GQ,), (GKV,), (GKV,)), when=("qkv_bias", "global_attn", "not_k_eq_v")),
    Row("layers.{l}.self_attention.linear_qkv.bias", (ATTN + "q_proj.bias", ATTN + "k_proj.bias"), "qk_global",
        "layer", ((GQ,), (GKV,)), when=("qkv_bias", "global_attn", "k_eq_v")),
    Row("layers.{l}.self_attention.q_norm.weight", (ATTN + "q_norm.weight",), "copy", "layer",
        (("global_head_dim",),), when=("qk_norm", "global_attn"), tp_sum="always"),
    Row("layers.{l}.self_attention.k_norm.weight", (ATTN + "k_norm.weight",), "copy", "layer",
        (("global_head_dim",),), when=("qk_norm", "global_attn"), tp_sum="always"),
    Row("layers.{l}.self_attention.linear_proj.weight", (ATTN + "o_proj.weight",), "row", "layer", ((H, GQ),),
        when=("global_attn",)),
)


PLE_ROWS = (      # per-layer input embeddings (model/layers/per_layer_inputs.py)
    Row("per_layer.embedding.weight", ("model.embed_tokens_per_layer.weight",), "vocab", "first",
        (("vocab_size", "per_layer_input_width"),), when=("per_layer_inputs",)),
    Row("per_layer.projection.weight", ("model.per_layer_model_projection.weight",), "copy", "first",
        (("per_layer_input_width", H),), when=("per_layer_inputs",), tp_sum="sp"),
    Row("per_layer.norm.weight", ("model.per_layer_projection_norm.weight",), "copy", "first",
        (("per_layer_input_size",),), when=("per_layer_inputs",), tp_sum="sp"),
    Row("layers.{l}.per_layer.gate.weight", ("model.layers.{i}.per_layer_input_gate.weight",), "copy", "layer",
        (("per_layer_input_size", H),), when=("per_layer_inputs",), tp_sum="sp"),
    Row("layers.{l}.per_layer.proj.weight", ("model.layers.{i}.per_layer_projection.weight",), "copy", "layer",
        ((H, "per_layer_input_size"),), when=("per_layer_inputs",), tp_sum="sp"),
    Row("layers.{l}.per_layer.norm.weight", ("model.layers.{i}.post_per_layer_input_norm.weight",), "copy",
        "layer", ((H,),), when=("per_layer_inputs",), tp_sum="sp"),
)


KV_ROWS = {"layers.{l}.self_attention.linear_qkv.weight", "layers.{l}.self_attention.linear_qkv.bias",
           "layers.{l}.self_attention.k_norm.weight"}     # absent on KV-sharing layers
SHARED_ROWS = tuple(      # a KV-sharing layer's projection: q_proj alone, split by query heads
    Row("layers.{l}.self_attention.linear_qkv." + part, (ATTN + f"q_proj.{part}",), "column", "layer",
        ((q,) + ((H,) if part == "weight" else ()),), when=("kv_shared_layer", kind) + extra)
    for part, extra in (("weight", ()), ("bias", ("qkv_bias",))) for q, kind in (("q_size", "local_attn"),
                                                                                   (GQ, "global_attn")))
MLP = "model.layers.{i}.mlp."
WIDE_ROWS = (     # double_wide_mlp: the KV-sharing layers' MLP of twice the intermediate size
    Row("layers.{l}.mlp.linear_fc1.weight", (MLP + "gate_proj.weight", MLP + "up_proj.weight"), "gate_up", "layer",
        (("2*intermediate_size", H), ("2*intermediate_size", H)), when=("wide_mlp",)),
    Row("layers.{l}.mlp.linear_fc2.weight", (MLP + "down_proj.weight",), "row", "layer",
        ((H, "2*intermediate_size"),), when=("wide_mlp",)),
)


def _conditioned(row: Row, *, local: bool = True) -> Row:
    """``row`` with the layer conditions of its layer kind: the sliding shape (``local_attn``), a layer with its
    own keys / values (``kv_layer``), the plain MLP (``plain_mlp``)."""
    extra = (("local_attn",) if local and row.local in SHAPED else ()) \
        + (("kv_layer",) if row.local in KV_ROWS else ()) \
        + (("plain_mlp",) if row.local in {r.local for r in WIDE_ROWS} else ())
    return replace(row, when=row.when + extra) if extra else row


def _table() -> tuple[Row, ...]:
    out = []
    for row in GEMMA3_TABLE:
        out.append(_conditioned(row))
        out += [_conditioned(g, local=False) for g in GLOBAL_ROWS if g.local == row.local]
        out += [r for r in SHARED_ROWS + WIDE_ROWS if r.local == row.local]
    return tuple(out) + MOE_ROWS + PLE_ROWS + (Row("layers.{l}.layer_scalar", ("model.layers.{i}.layer_scalar",),
                                                   "copy", "layer", ((1,),), when=("layer_scalar",)),)


GEMMA4_TABLE = _table()


def _refuse(raw: dict) -> None:
    checks = (
        ("vocab_size_per_layer_input", bool(raw["hidden_size_per_layer_input"])
         and raw["vocab_size_per_layer_input"] != raw["vocab_size"],
         f"per-layer input embeddings of a vocabulary other than the tokens' vocab_size={raw['vocab_size']} are "
         "not implemented"),
        ("use_bidirectional_attention", bool(raw.get("use_bidirectional_attention")),
         "parallm's attention is causal"),
    )
    for key, bad, why in checks:
        if bad:
            raise ValueError(f"Gemma 4 with {key}={raw[key]!r} is not supported ({why})")


def _overrides(raw: dict, types: list[str]) -> dict[int, dict]:
    """Layer index -> its ``per_layer_config`` overrides (keys given as layer indices, as transformers writes
    them, or as layer types); a config.json without it gets ``Gemma4TextConfig``'s: the full layers
    ``global_head_dim`` (default 512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    given = raw.get("per_layer_config")
    if given is None:
        o = {"head_dim": raw.get("global_head_dim") or GLOBAL_HEAD_DIM}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
            o["num_key_value_heads"] = raw["num_global_key_value_heads"]
        return {i: o for i, t in enumerate(types) if t == "full_attention"}
    out = {}
    for key, o in given.items():
        layers = [i for i, t in enumerate(types) if t == key] if key in types else [int(key)]
        for i in layers:
            out.setdefault(i, {}).update(o if isinstance(o, dict) else vars(o))
    return out


def global_shape(raw: dict, types: list[str]) -> tuple[tuple[int, ...], int, int]:
    """``(global_layers, global_head_dim, global_kv_heads)``: the layers whose attention shape differs from the
    sliding layers' ``head_dim`` / ``num_key_value_heads``, which must be every full-attention layer, sharing one
    shape (a ValueError names the layer otherwise); ``((), 0, 0)`` when none differs. With ``attention_k_eq_v``
    every full layer is global (K = V there) whatever its shape."""
    head_dim, nkv = int(raw["head_dim"]), int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    shapes = {}
    for i, o in sorted(_overrides(raw, types).items()):
        unknown = sorted(set(o) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise ValueError(f"Gemma 4 per_layer_config of layer {i} sets {unknown}: only head_dim and "
                             "num_key_value_heads per layer are supported")
        shape = (int(o.get("head_dim") or head_dim), int(o.get("num_key_value_heads") or nkv))
        if shape != (head_dim, nkv):
            if not 0 <= i < len(types) or types[i] != "full_attention":
                raise ValueError(f"Gemma 4 layer {i} ({types[i] if 0 <= i < len(types) else 'out of range'}) "
                                 f"with head_dim / num_key_value_heads {shape} other than head_dim={head_dim} / "
                                 f"num_key_value_heads={nkv}: only full-attention layers may differ")
            shapes[i] = shape
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if shapes and (len(set(shapes.values())) > 1 or sorted(shapes) != full):
        raise ValueError(f"Gemma 4 full layers {full} of different attention shapes {shapes} (layer: (head_dim, "
                         f"num_key_value_heads); the others {(head_dim, nkv)}): one global shape is supported")
    if not shapes:
        return (tuple(full), head_dim, nkv) if raw.get("attention_k_eq_v") else ((), 0, 0)
    (gd, gkv), = set(shapes.values())
    return tuple(sorted(shapes)), gd, gkv


def kv_sources(raw: dict) -> tuple[int | None, ...]:
    """Each layer's KV source (``Gemma4TextConfig.kv_sharing_modes``): the last ``num_kv_shared_layers`` layers
    reuse the keys / values of the last earlier layer of their type; () without sharing."""
    types, n = raw["layer_types"], int(raw["num_kv_shared_layers"] or 0)
    if not n:
        return ()
    first = len(types) - n
    out = []
    for i, t in enumerate(types):
        earlier = [j for j in range(first) if types[j] == t]
        if i >= first and not earlier:
            raise ValueError(f"Gemma 4 with num_kv_shared_layers={n}: layer {i} ({t}) has no earlier {t} layer "
                             f"among the first {first} to reuse the keys / values of")
        out.append(earlier[-1] if i >= first else None)
    return tuple(out)


def gemma4_spec(config):
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
    layers, gd, gkv = global_shape(raw, raw["layer_types"])
    full_rope = raw["rope_parameters"]["full_attention"]
    raw.update(model_type="gemma3_text", query_pre_attn_scalar=1.0, attn_logit_softcapping=None)
    spec = gemma3_spec(raw)
    if layers:      # the full layers' RoPE spans their own head dim (layer_ropes: None there, i.e. spec.rope)
        rope = rope_spec_from_hf_config({"rope_parameters": full_rope,
                                         "max_position_embeddings": raw.get("max_position_embeddings")}, gd)
        spec = replace(spec, rope=rope, global_layers=layers, global_head_dim=gd, global_kv_heads=gkv,
                       global_k_eq_v=bool(raw["attention_k_eq_v"]))
    spec = replace(spec, per_layer_input_size=int(raw["hidden_size_per_layer_input"] or 0),
                   kv_sources=kv_sources(raw), double_wide_mlp=bool(raw["use_double_wide_mlp"]),
                   moe=gemma4_moe_spec(raw))
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
