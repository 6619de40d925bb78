"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3 / R1 / V3.1, Kimi-K2 under ``model_type: kimi_k2``,
Moonlight without a q LoRA): config -> :class:`~parallm.model.spec.DecoderSpec`.

What differs from LLaMA: multi-head latent attention (:class:`~parallm.model.spec.MLASpec`), RoPE on its
``qk_rope_head_dim`` part only (default or YaRN, interleaved when ``rope_interleave``, transformers' default
True), the first ``first_k_dense_replace`` layers dense (``intermediate_size``) and the rest routed over
``n_routed_experts`` experts of ``moe_intermediate_size`` by the sigmoid group-limited router with its fp32
selection bias (``n_group``, ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``), plus one always-on
shared expert ``n_shared_experts * moe_intermediate_size`` wide. transformers adds no load-balancing loss for
these models, so none is added here either. ``num_nextn_predict_layers`` (transformers' ``num_mtp_layers``)
multi-token-prediction layers after the last decoder layer are recorded (:attr:`DecoderSpec.mtp_layers`), not
run.

Refused, by name: ``scoring_func`` other than sigmoid / ``topk_method`` other than ``noaux_tc`` (DeepSeek-V2's
routers: transformers' DeepseekV3 code ignores these keys and would run the sigmoid router anyway),
``moe_layer_freq != 1``, ``num_key_value_heads != num_attention_heads`` (MLA gives every head its own key and
value; transformers would repeat them), RoPE kinds other than default / yarn.

The weight table: LLaMA's embedding, norms, dense MLP (dense-first layers) and head, the MLA rows of
:data:`parallm.model.layers.mla.MLA_WEIGHTS` instead of the fused QKV, and the MoE rows of GLM-4.5 / DeepSeek-V3
(:data:`parallm.families.moe_common.GROUPED_MOE_ROWS`: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
per-expert ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``). docs/families.md has the table with shapes.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.layers.mla import MLA_WEIGHTS
from ..model.positions.rope import RopeSpec
from ..model.spec import DecoderSpec, MLASpec, MoESpec
from ..model.table import Row
from ..model.positions.yarn import mla_softmax_scale, rope_parameters, yarn_spec_from_params
from .llama import DECODER_TABLE
from .moe_common import GROUPED_MOE_ROWS, moe_spec, moe_table
from .registry import Family, base_spec_kwargs, load_config, register

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV3ForSequenceClassification", "DeepseekV3Model")

# transformers' DeepseekV3Config defaults, for config.json files that leave a key out
DEEPSEEK_DEFAULTS = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                         norm_topk_prob=True, n_shared_experts=1, num_nextn_predict_layers=1)

_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")


def _config_dict(config) -> dict:
    """The config's fields as a plain dict (a transformers config object, a config.json dict or its wrapper)."""
    if isinstance(config, dict):
        return dict(config)
    raw = getattr(config, "_raw", None)
    if isinstance(raw, dict):
        return dict(raw)
    return config.to_dict()


def base_kwargs_without_rope(config, family: str) -> dict:
    """The fields every family reads alike (:func:`parallm.families.registry.base_spec_kwargs`), without its RoPE,
    which refuses what these families need (yarn, partial rotary): the caller sets ``rope`` itself."""
    raw = {k: v for k, v in _config_dict(config).items() if k not in _ROPE_KEYS}
    kwargs = base_spec_kwargs(load_config(raw), family)
    del kwargs["rope"]
    return kwargs


def _setting(config, key: str, defaults: dict):
    """``config.key``, or transformers' class default for a config.json that leaves it out (None stays None)."""
    if isinstance(config, dict):
        return config.get(key, defaults.get(key))
    return getattr(config, key, defaults.get(key))


def mtp_layers_of(config, default: int = 1) -> int:
    """``num_nextn_predict_layers`` (transformers 5 maps ``num_mtp_layers`` onto it): the multi-token-prediction
    layers a checkpoint of this config may carry after its decoder layers. transformers' default is 1 even for
    checkpoints without any, so their tensors are optional."""
    n = _setting(config, "num_nextn_predict_layers", {})
    if n is None:
        n = _setting(config, "num_mtp_layers", {"num_mtp_layers": default})
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"invalid num_nextn_predict_layers={n!r} (a non-negative integer expected)")
    return n


def grouped_moe_spec(config, defaults: dict = DEEPSEEK_DEFAULTS) -> MoESpec | None:
    """The MoE of DeepSeek-V3 and GLM-4.5: layers from ``first_k_dense_replace`` on route over
    ``n_routed_experts`` experts with the sigmoid group-limited router and its selection bias; one shared expert
    of ``n_shared_experts * moe_intermediate_size``, ungated; no load-balancing loss (transformers adds none).
    None when there are no routed experts."""
    experts = _setting(config, "n_routed_experts", {}) or _setting(config, "num_local_experts", {}) or 0
    first_dense = _setting(config, "first_k_dense_replace", defaults) or 0
    layers = tuple(range(first_dense, int(config.num_hidden_layers))) if experts else ()
    width = _setting(config, "moe_intermediate_size", {})
    shared = _setting(config, "n_shared_experts", defaults) or 0
    norm = _setting(config, "norm_topk_prob", defaults)
    moe = moe_spec(config, num_experts=experts, expert_intermediate_size=width, norm_topk_prob=bool(norm),
                   layers=layers, shared_expert_intermediate_size=shared * width if isinstance(width, int) else 0)
    if moe is None:
        return None
    groups = {k: _setting(config, k, defaults) for k in ("n_group", "topk_group")}
    bad = [f"{k}={v!r}" for k, v in groups.items()
           if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0)]
    if bad:
        raise ValueError(f"invalid group-limited routing config: {', '.join(bad)} (positive integers expected)")
    scaling = _setting(config, "routed_scaling_factor", defaults)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or scaling <= 0:
        raise ValueError(f"invalid routed_scaling_factor={scaling!r} (a positive number expected)")
    return replace(moe, aux_loss_coef=0.0, router="sigmoid_grouped", n_group=groups["n_group"] or 1,
                   topk_group=groups["topk_group"] or 1, routed_scaling_factor=float(scaling),
                   score_bias=True)


def _positive(config, key: str, *, optional: bool = False) -> int | None:
    value = getattr(config, key, None)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"invalid DeepSeek-V3 config: {key}={value!r} (a positive integer expected)")
    return value


def deepseek_v3_spec(config, *, family: str = "deepseek_v3", model_types: tuple[str, ...] = MODEL_TYPES,
                     defaults: dict = DEEPSEEK_DEFAULTS) -> DecoderSpec:
    """The spec of a DeepSeek-V3 config; ``family`` / ``model_types`` / ``defaults``: those of a family built on
    it (DeepSeek-V3.2, GLM-5: :mod:`parallm.families.dsa`)."""
    model_type = getattr(config, "model_type", model_types[0])
    if model_type not in model_types:
        raise ValueError(f"model_type={model_type!r} is not a {family} config ({', '.join(model_types)})")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        got = getattr(config, key, None)
        if got is not None and got != want:
            raise ValueError(f"DeepSeek-V3 with {key}={got!r} is not supported (parallm implements {key}={want!r}, "
                             "the DeepSeek-V3 router)")
    freq = getattr(config, "moe_layer_freq", None)
    if freq not in (None, 1):
        raise ValueError(f"moe_layer_freq={freq!r} is not supported (every layer after first_k_dense_replace "
                         "routes, as in transformers)")
    heads = _positive(config, "num_attention_heads")
    nkv = getattr(config, "num_key_value_heads", None)
    if nkv is not None and nkv != heads:
        raise ValueError(f"num_key_value_heads={nkv} != num_attention_heads={heads}: multi-head latent attention "
                         "expands keys and values to every head")
    q_lora = _positive(config, "q_lora_rank", optional=True)
    kv_lora = _positive(config, "kv_lora_rank")
    nope, rope_dim = _positive(config, "qk_nope_head_dim"), _positive(config, "qk_rope_head_dim")
    v_dim = _positive(config, "v_head_dim")

    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind not in ("default", "yarn"):
        raise ValueError(f"DeepSeek-V3 with RoPE kind {kind!r} is not supported (default or yarn)")
    max_pos = getattr(config, "max_position_embeddings", None)
    yarn = (yarn_spec_from_params(params, dim=rope_dim, max_position_embeddings=max_pos) if kind == "yarn"
            else None)
    bias = bool(getattr(config, "attention_bias", False))
    interleave = getattr(config, "rope_interleave", None)
    mla = MLASpec(kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim,
                  q_lora_rank=q_lora, rope_interleave=True if interleave is None else bool(interleave),
                  softmax_scale=mla_softmax_scale(nope + rope_dim, yarn), down_proj_bias=bias)
    kwargs = base_kwargs_without_rope(config, family)
    kwargs.update(head_dim=mla.q_head_dim, num_kv_heads=heads,
                  rope=RopeSpec(dim=rope_dim, theta=float(params["rope_theta"]), kind="default",
                                max_position_embeddings=max_pos))
    return DecoderSpec(**kwargs, o_bias=bias, mla=mla, yarn=yarn, moe=grouped_moe_spec(config, defaults),
                       mtp_layers=mtp_layers_of(config, defaults["num_nextn_predict_layers"]))


# -- the weight table -----------------------------------------------------------------------------------------

H = "hidden_size"
# the full HF shape of each MLA tensor (DecoderSpec attribute names: q_size = heads x (nope + rope))
_MLA_SHAPES = {
    "q_a_proj.weight": ("q_lora_rank", H), "q_a_proj.bias": ("q_lora_rank",),
    "q_a_layernorm.weight": ("q_lora_rank",), "q_b_proj.weight": ("q_size", "q_lora_rank"),
    "q_proj.weight": ("q_size", H),
    "kv_a_proj_with_mqa.weight": ("mla_kv_a_size", H), "kv_a_proj_with_mqa.bias": ("mla_kv_a_size",),
    "kv_a_layernorm.weight": ("kv_lora_rank",), "kv_b_proj.weight": ("mla_kv_b_size", "kv_lora_rank"),
    "o_proj.weight": (H, "mla_v_size"), "o_proj.bias": (H,),
}


def mla_rows() -> tuple[Row, ...]:
    """One row per :data:`~parallm.model.layers.mla.MLA_WEIGHTS` entry: its parameter in the layer's
    ``self_attention`` (an :class:`~parallm.model.layers.mla.MLAttention`), layout kind, ``tp_sum`` and conditions
    (``q_lora`` / ``no_q_lora`` / ``down_bias`` / ``o_bias``)."""
    return tuple(Row(f"layers.{{l}}.self_attention.{local}", ("model.layers.{i}.self_attn." + hf,), kind, "layer",
                     (_MLA_SHAPES[hf],), when=tuple(cond.split("+")) if cond else (), tp_sum=tp_sum)
                 for hf, (local, kind, tp_sum, cond) in MLA_WEIGHTS.items())


def _with_mla(table: tuple[Row, ...]) -> tuple[Row, ...]:
    """``table`` with its standard attention rows replaced by the MLA rows, where they stood."""
    out, placed = [], False
    for r in table:
        if ".self_attention." in r.local:
            if not placed:
                out.extend(mla_rows())
                placed = True
            continue
        out.append(r)
    return tuple(out)


_MTP = "model.layers.{i}."
# A multi-token-prediction layer's own tensors (DeepSeek-V3's and GLM-4.5's ``model.layers.{num_layers + j}.*``
# besides its decoder layer): its embedding copy, the norms of the embedding and of the previous hidden state,
# their projection ``eh_proj [H, 2H]`` and the shared head (norm and output layer). Carried when the model is
# built with MTP (condition ``mtp``): sharded like their counterparts (vocab rows, eh_proj's rows over TP),
# loaded, saved and exported, never run.
MTP_ROWS: tuple[Row, ...] = (
    Row("mtp_layers.{l}.embed_tokens.weight", (_MTP + "embed_tokens.weight",), "vocab", "mtp",
        (("vocab_size", H),), when=("mtp",)),
    Row("mtp_layers.{l}.enorm.weight", (_MTP + "enorm.weight",), "copy", "mtp", ((H,),), when=("mtp",)),
    Row("mtp_layers.{l}.hnorm.weight", (_MTP + "hnorm.weight",), "copy", "mtp", ((H,),), when=("mtp",)),
    Row("mtp_layers.{l}.eh_proj.weight", (_MTP + "eh_proj.weight",), "column", "mtp", ((H, "mtp_eh_proj_in"),),
        when=("mtp",)),
    Row("mtp_layers.{l}.shared_head.norm.weight", (_MTP + "shared_head.norm.weight",), "copy", "mtp", ((H,),),
        when=("mtp",)),
    Row("mtp_layers.{l}.shared_head.head.weight", (_MTP + "shared_head.head.weight",), "vocab", "mtp",
        (("vocab_size", H),), when=("mtp",)),
)

DEEPSEEK_V3_TABLE = moe_table(GROUPED_MOE_ROWS, base=_with_mla(DECODER_TABLE)) + MTP_ROWS

DEEPSEEK_V3 = register(Family(
    name="deepseek_v3",
    model_types=MODEL_TYPES,
    architectures=ARCHITECTURES,
    spec=deepseek_v3_spec,
    table=DEEPSEEK_V3_TABLE,
    causal_architecture="DeepseekV3ForCausalLM",
    value_architecture="DeepseekV3ForSequenceClassification",
))
