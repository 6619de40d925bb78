"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``model_type`` ``deepseek_v4``: V4-Flash, V4-Pro, V4.1): config ->
:class:`~parallm.model.spec.DecoderSpec`, and its weight table.

What differs from every other family (transformers 5.25's ``models/deepseek_v4``; docs/deepseek_v4.md):

* **Hyper-connections** (:mod:`parallm.model.layers.hyper_connections`): ``hc_mult`` residual streams, mixed
  before and after each block by Sinkhorn-normalised weights, collapsed by ``hc_head`` before the final norm.
* **Attention** (:mod:`parallm.model.layers.v4_attention`): one key = value head of ``head_dim`` (512), q-LoRA,
  sinks, a sliding window, the grouped low-rank output projection, interleaved partial RoPE on the trailing
  channels, and per ``layer_types`` the compressed sparse (CSA: lightning indexer over pooled keys) or heavily
  compressed (HCA) attention (:class:`~parallm.model.layer_specs.V4Spec`).
* **MoE on every layer** (:mod:`parallm.families.deepseek_v4_moe`): the ``sqrtsoftplus`` router with its
  correction bias, ``hash_moe`` layers routed by the token id, clamped SwiGLU experts and shared expert.

The config is read through transformers' ``DeepseekV4Config`` (which folds the legacy keys of early V4-Flash
configs: ``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``...), so it needs transformers >= 5.25.
"""

from __future__ import annotations

from ..model.layer_specs import V4Spec
from ..model.positions.rope import RopeSpec
from ..model.positions.yarn import yarn_spec_from_params
from ..model.spec import DecoderSpec
from ..model.table import Row
from .deepseek_v3 import base_kwargs_without_rope
from .deepseek_v4_attention import V4_ATTENTION_ROWS
from .deepseek_v4_moe import V4_MOE_ROWS, v4_moe_spec
from .deepseek_v4_names import checkpoint_names, mtp_tensors
from .hybrid_common import CARRIED_MTP_ROW
from .registry import Family, register

MODEL_TYPES = ("deepseek_v4",)
ARCHITECTURES = ("DeepseekV4ForCausalLM", "DeepseekV4Model")
KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
         "heavily_compressed_attention": "hca"}


def v4_config(config):
    """``config`` as transformers' ``DeepseekV4Config`` (a config.json dict or a parallm dict wrapper are built
    into one; legacy keys folded as transformers folds them)."""
    try:
        from transformers import DeepseekV4Config
    except ImportError as e:      # pragma: no cover - the pinned transformers has it
        raise ValueError("DeepSeek-V4 needs transformers >= 5.25 (DeepseekV4Config) to read its config") from e
    if isinstance(config, DeepseekV4Config):
        return config
    raw = config if isinstance(config, dict) else getattr(config, "_raw", None)
    if raw is None:
        raw = config.to_dict()
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    return DeepseekV4Config(**raw)


def _compress_rope(config, rope_dim: int):
    params = dict(config.rope_parameters["compress"])
    kind = params.get("rope_type", "default")
    if kind == "default":
        return RopeSpec(dim=rope_dim, theta=float(params["rope_theta"]), kind="default")
    if kind != "yarn":
        raise ValueError(f"DeepSeek-V4 with compress RoPE kind {kind!r} is not supported (default or yarn)")
    params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return yarn_spec_from_params(params, dim=rope_dim, max_position_embeddings=config.max_position_embeddings)


def _v4_attention_spec(config) -> V4Spec:
    main = config.rope_parameters["main"]
    if main.get("rope_type", "default") != "default":
        raise ValueError(f"DeepSeek-V4 with main RoPE kind {main.get('rope_type')!r} is not supported (default)")
    rope_dim = int(config.qk_rope_head_dim)
    unknown = sorted(set(config.layer_types) - set(KINDS))
    if unknown:
        raise ValueError(f"DeepSeek-V4 layer_types {unknown} are not supported ({sorted(KINDS)})")
    rates = config.compress_rates
    return V4Spec(layer_kinds=tuple(KINDS[t] for t in config.layer_types), q_lora_rank=config.q_lora_rank,
                  o_groups=config.o_groups, o_lora_rank=config.o_lora_rank, sliding_window=config.sliding_window,
                  rope_dim=rope_dim, main_rope=RopeSpec(dim=rope_dim, theta=float(main["rope_theta"]),
                                                        kind="default"),
                  compress_rope=_compress_rope(config, rope_dim),
                  csa_rate=rates["compressed_sparse_attention"], hca_rate=rates["heavily_compressed_attention"],
                  index_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
                  index_topk=config.index_topk, hc_mult=config.hc_mult, hc_sinkhorn_iters=config.hc_sinkhorn_iters,
                  hc_eps=float(config.hc_eps))


def deepseek_v4_spec(config) -> DecoderSpec:
    config = v4_config(config)
    if config.num_key_value_heads != 1:
        raise ValueError(f"DeepSeek-V4 with num_key_value_heads={config.num_key_value_heads} is not supported "
                         "(one shared key = value head, as transformers builds it)")
    if config.attention_bias or config.mlp_bias:
        raise ValueError("DeepSeek-V4 with attention_bias / mlp_bias is not supported (transformers' V4 has no "
                         "biases in its projections)")
    v4 = _v4_attention_spec(config)
    # transformers maps intermediate_size onto moe_intermediate_size (the shared expert's width); to_dict has no key
    kwargs = base_kwargs_without_rope(dict(config.to_dict(), intermediate_size=config.moe_intermediate_size),
                                      "deepseek_v4")
    kwargs.update(num_kv_heads=1, head_dim=int(config.head_dim), rope=v4.main_rope)
    # the MTP layer(s) are mtp.{j}.* in the checkpoint (not DeepSeek-V3's model.layers.{L + j}): carried, listed
    # from the checkpoint's headers by mtp_tensors (build_model(mtp=...))
    return DecoderSpec(**kwargs, norm_weight_fp32=True, v4=v4, moe=v4_moe_spec(config))


# -- the weight table -----------------------------------------------------------------------------------------

H, V = "hidden_size", "vocab_size"
LAYER = "model.layers.{i}."


def _layer_hc_rows(block: str) -> tuple[Row, ...]:
    """``attn_hc`` / ``ffn_hc`` of a layer: ``model.layers.{i}.hc_{attn,ffn}_{fn,base,scale}``."""
    hf = LAYER + f"hc_{block}_"
    shapes = {"fn": (("hc_mix_width", "stream_width"),), "base": (("hc_mix_width",),), "scale": ((3,),)}
    return tuple(Row(f"layers.{{l}}.{block}_hc.{p}", (hf + p,), "copy", "layer", shapes[p], tp_sum="sp",
                     keep_fp32=True) for p in ("fn", "base", "scale"))


# fp32 in a model of any dtype, as transformers keeps them (_keep_in_fp32_modules_strict): the hyper-connections,
# the layer norms and the final norm (the attention's and the MoE's own fp32 rows are in their row tables)
HEAD_HC_ROWS = tuple(Row(f"hc_head.{p}", (f"model.hc_head.{p}",), "copy", "last", (shape,), tp_sum="sp",
                         keep_fp32=True)
                     for p, shape in (("hc_fn", ("hc_mult", "stream_width")), ("hc_base", ("hc_mult",)),
                                      ("hc_scale", (1,))))

DEEPSEEK_V4_TABLE: tuple[Row, ...] = (
    Row("embedding.weight", ("model.embed_tokens.weight",), "vocab", "first", ((V, H),), tied="embedding"),
    *_layer_hc_rows("attn"),
    Row("layers.{l}.input_layernorm.weight", (LAYER + "attn_norm.weight",), "copy", "layer", ((H,),), tp_sum="sp",
        keep_fp32=True),
    *V4_ATTENTION_ROWS,
    *_layer_hc_rows("ffn"),
    Row("layers.{l}.post_attention_layernorm.weight", (LAYER + "ffn_norm.weight",), "copy", "layer", ((H,),),
        tp_sum="sp", keep_fp32=True),
    *V4_MOE_ROWS,
    *HEAD_HC_ROWS,
    Row("final_norm.weight", ("model.norm.weight",), "copy", "last", ((H,),), tp_sum="sp", keep_fp32=True),
    Row("output_layer.weight", ("head.weight",), "vocab", "last", ((V, H),), when=("causal_lm", "untied")),
    Row("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "last", ((V, H),),
        when=("causal_lm", "tied_copy"), save=False, tied="copy"),
    Row("score.weight", ("score.weight",), "copy", "last", ((1, H),), when=("value",), tp_sum="sp"),
    CARRIED_MTP_ROW,
)

DEEPSEEK_V4 = register(Family(
    name="deepseek_v4",
    model_types=MODEL_TYPES,
    architectures=ARCHITECTURES,
    spec=deepseek_v4_spec,
    table=DEEPSEEK_V4_TABLE,
    causal_architecture="DeepseekV4ForCausalLM",
    value_architecture="DeepseekV4ForSequenceClassification",
    mtp_tensors=mtp_tensors,
    checkpoint_names=checkpoint_names,
))
