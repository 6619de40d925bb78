"""MiniMax-M2 (``MiniMaxM2ForCausalLM``, ``model_type: minimax_m2``): config -> :class:`~parallm.model.spec.DecoderSpec`,
as transformers 5.25's ``modeling_minimax_m2`` runs it.

What differs from LLaMA: q / k RMSNorms over the whole projection (all heads of a token at once:
``q_norm.weight [num_heads * head_dim]``, ``k_norm.weight [num_kv_heads * head_dim]``; under TP the mean spans the
ranks, :mod:`parallm.model.layers.qk_norm`), RoPE on the first ``int(head_dim * partial_rotary_factor)`` channels
of each head (rotate_half layout), and every layer's MLP routed over ``num_local_experts`` experts of
``intermediate_size`` by the sigmoid router with its fp32 selection bias ``e_score_correction_bias`` (the biased
scores choose the ``num_experts_per_tok`` experts, the unbiased sigmoid scores of those, renormalised to sum to 1,
weight them; no groups, no scaling, no shared expert): the DeepSeek-V3 router with one group
(:mod:`parallm.model.layers.routing`).

Partial RoPE, as ``MiniMaxM2Config.convert_rope_params_to_dict`` reads it: ``rope_parameters.partial_rotary_factor``
first, then a top-level ``partial_rotary_factor``, then the released configs' legacy ``rotary_dim / head_dim``; no
factor: the whole head. Defaults of transformers' config class for config.json files that leave a key out
(``head_dim`` 128 whatever ``hidden_size / num_attention_heads`` says, ``rope_theta`` 5e6).

The remote-code fields of the released configs transformers does not read are checked, and refused where they
would describe another model than the one transformers runs: ``use_qk_norm`` false, ``qk_norm_type`` other than
``per_layer``, ``scoring_func`` other than sigmoid, ``use_routing_bias`` false, ``shared_intermediate_size`` > 0,
``num_expert_group`` / ``topk_group`` > 1, ``routed_scaling_factor`` != 1, ``attn_type_list`` with linear-attention
layers (0), a sliding window (``sliding_window`` / ``attn_window_size``). Also refused: router jitter (random in
training), the load-balancing loss (``output_router_logits`` with ``router_aux_loss_coef`` > 0: transformers'
takes the softmax of the sigmoid router's logits; not implemented), yarn RoPE. MTP (``use_mtp``,
``num_mtp_modules``): transformers builds no MTP module and parallm runs none; a checkpoint holding tensors beyond
the decoder's is refused by the strict load, naming them (``strict=False`` drops them, as transformers does).

The weight table: LLaMA's (no biases) with the projection-wide q / k norm rows, and the experts in the Hub's
per-expert names that transformers' ``save_pretrained`` writes (``block_sparse_moe.experts.{e}.w1`` gate / ``w3``
up / ``w2`` down, ``block_sparse_moe.gate``, ``block_sparse_moe.e_score_correction_bias``); transformers 5's
in-memory stacked names (``mlp.experts.gate_up_proj`` ...) load too.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.positions.rope import rope_spec_from_hf_config
from ..model.positions.yarn import rope_parameters, rotary_dim
from ..model.spec import DecoderSpec
from ..model.table import Row
from .deepseek_v3 import _config_dict, base_kwargs_without_rope
from .llama import DECODER_TABLE
from .moe_common import moe_rows, moe_spec, moe_table
from .registry import Family, load_config, register

MODEL_TYPES = ("minimax_m2",)
ARCHITECTURES = ("MiniMaxM2ForCausalLM", "MiniMaxM2Model")

# transformers' MiniMaxM2Config defaults, for config.json files that leave a key out
MINIMAX_DEFAULTS = dict(head_dim=128, rms_norm_eps=1e-6, num_experts_per_tok=8, num_local_experts=256,
                        hidden_act="silu", tie_word_embeddings=False, max_position_embeddings=196608)
MINIMAX_THETA = 5_000_000.0      # MiniMaxM2Config.default_theta

ATTN = "model.layers.{i}.self_attn."
QK_NORM_ROWS = (
    # one rank's query heads' channels (the query rows' split); the KV heads' as the fused QKV's k rows
    Row("layers.{l}.self_attention.q_norm.weight", (ATTN + "q_norm.weight",), "column", "layer", (("q_size",),),
        when=("qk_norm_whole",)),
    Row("layers.{l}.self_attention.k_norm.weight", (ATTN + "k_norm.weight",), "kv_heads", "layer", (("kv_size",),),
        when=("qk_norm_whole",)),
)
_EXPERT_ROWS = moe_rows("model.layers.{i}.block_sparse_moe.", router="gate.weight", gate="experts.{e}.w1.weight",
                        up="experts.{e}.w3.weight", down="experts.{e}.w2.weight",
                        router_bias="e_score_correction_bias", fp32_router=True)
# transformers 5 keeps the bias as ``mlp.e_score_correction_bias`` in memory (its conversion's rename)
_EXPERT_ROWS = tuple(replace(r, fused=("model.layers.{i}.mlp.e_score_correction_bias",))
                     if r.local.endswith("e_score_correction_bias") else r for r in _EXPERT_ROWS)
MINIMAX_M2_TABLE = moe_table(_EXPERT_ROWS, base=DECODER_TABLE + QK_NORM_ROWS)

# remote-code fields: (key, the values transformers' model agrees with, why another value is refused)
_CHECKED = (
    ("use_qk_norm", (None, True), "transformers always normalises q and k"),
    ("qk_norm_type", (None, "per_layer"), "transformers normalises the whole projection (per_layer)"),
    ("scoring_func", (None, "sigmoid"), "transformers' router is the sigmoid one"),
    ("use_routing_bias", (None, True), "transformers' router always adds e_score_correction_bias"),
    ("shared_intermediate_size", (None, 0), "transformers' MiniMax-M2 has no shared expert"),
    ("num_expert_group", (None, 1), "transformers' router picks experts without groups"),
    ("topk_group", (None, 1), "transformers' router picks experts without groups"),
    ("routed_scaling_factor", (None, 1, 1.0), "transformers' router does not scale the weights"),
    ("sliding_window", (None,), "transformers' MiniMax-M2 attends to every earlier token"),
    ("attn_window_size", (None,), "transformers' MiniMax-M2 attends to every earlier token"),
)


def _check_fields(raw: dict) -> None:
    for key, ok, why in _CHECKED:
        if key in raw and raw[key] not in ok:
            raise ValueError(f"MiniMax-M2 with {key}={raw[key]!r} is not supported ({why})")
    kinds = raw.get("attn_type_list")
    if kinds is not None and any(k != 1 for k in kinds):
        raise ValueError(f"MiniMax-M2 with attn_type_list holding {sorted(set(kinds) - {1})} (linear-attention "
                         "layers, MiniMax-01's) is not supported: transformers' MiniMax-M2 runs softmax attention on "
                         "every layer")
    jitter = float(raw.get("router_jitter_noise") or 0.0)
    if jitter > 0:
        raise ValueError(f"MiniMax-M2 with router_jitter_noise={jitter} is not supported (parallm routes "
                         "deterministically); set it to 0")
    if raw.get("output_router_logits") and float(raw.get("router_aux_loss_coef") or 0.0) > 0:
        raise ValueError("MiniMax-M2 with output_router_logits=True and router_aux_loss_coef > 0 is not supported: "
                         "transformers' load-balancing loss (a softmax over the sigmoid router's logits) is not "
                         "implemented; set output_router_logits=False")


def _rope(raw: dict, head_dim: int):
    """The RoPE spec over the rotated channels, the factor read as transformers' MiniMax-M2 config reads it."""
    params = rope_parameters(raw)
    if not (raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get("rope_theta") \
            and raw.get("rope_theta") is None:
        params["rope_theta"] = MINIMAX_THETA
    factor = params.pop("partial_rotary_factor", None)
    if factor is None and raw.get("rotary_dim") is not None:
        factor = raw["rotary_dim"] / head_dim
    dim = rotary_dim(head_dim, None if factor is None else float(factor))
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"MiniMax-M2's rotary_dim / partial_rotary_factor ({raw.get('rotary_dim')!r} / {factor!r}) "
                         f"gives {dim} rotary channels of head_dim={head_dim} (a positive even number up to head_dim "
                         "is needed)")
    if params["rope_type"] == "yarn":
        raise ValueError("MiniMax-M2 with yarn RoPE is not supported (RoPE kinds: default, linear, dynamic, llama3)")
    max_pos = raw.get("max_position_embeddings")
    return rope_spec_from_hf_config({"rope_parameters": params, "max_position_embeddings": max_pos}, dim)


def minimax_m2_spec(config) -> DecoderSpec:
    raw = _config_dict(config)
    model_type = raw.get("model_type", "minimax_m2")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not a MiniMax-M2 config ({', '.join(MODEL_TYPES)})")
    for key, value in MINIMAX_DEFAULTS.items():
        if raw.get(key) is None:
            raw[key] = value
    _check_fields(raw)
    kwargs = base_kwargs_without_rope(raw, "minimax_m2")
    kwargs["rope"] = _rope(raw, kwargs["head_dim"])
    cfg = load_config(raw)
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    moe = moe_spec(cfg, num_experts=experts, expert_intermediate_size=raw.get("intermediate_size"),
                   norm_topk_prob=True, layers=tuple(range(int(raw["num_hidden_layers"]))))
    moe = replace(moe, aux_loss_coef=0.0, router="sigmoid_grouped", n_group=1, topk_group=1,
                  routed_scaling_factor=1.0, score_bias=True)
    return DecoderSpec(**kwargs, qk_norm_whole=True, moe=moe)


MINIMAX_M2 = register(Family(
    name="minimax_m2",
    model_types=MODEL_TYPES,
    architectures=ARCHITECTURES,
    spec=minimax_m2_spec,
    table=MINIMAX_M2_TABLE,
    causal_architecture="MiniMaxM2ForCausalLM",
    # transformers 5.25 has no MiniMaxM2ForSequenceClassification: a value model saves under this name
    value_architecture="MiniMaxM2ForSequenceClassification",
))
