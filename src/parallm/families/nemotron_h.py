"""Nemotron-H and Nemotron-3 (``NemotronHForCausalLM``, model type ``nemotron_h``): a hybrid of Mamba-2 layers,
attention layers and MLP / MoE layers, one block per layer.

Each layer is ``x + mixer(norm(x))`` with one mixer, of the kind ``layers_block_type[i]`` says (config.json of
transformers 5; older ones say ``hybrid_override_pattern``, one character per layer: ``M`` Mamba-2, ``*``
attention, ``-`` MLP, ``E`` MoE):

* Mamba-2 (:mod:`parallm.model.layers.mamba2`): ``mamba_num_heads`` heads of ``mamba_head_dim``, ``n_groups``
  B / C groups of ``ssm_state_size``, conv window ``conv_kernel`` (with ``use_conv_bias``), ``chunk_size``,
  ``time_step_limit``; ``use_bias`` for in_proj / out_proj;
* attention: GQA without positions (no RoPE) and without biases (transformers 5.25 builds q/k/v/o without bias
  whatever ``attention_bias`` says, so parallm reads none);
* MLP: ``down(relu(up x)^2)`` (``mlp_hidden_act`` ``relu2``, ungated), ``mlp_bias``;
* MoE: the sigmoid router with its fp32 selection bias (``e_score_correction_bias``), group-limited top-k
  (``n_group`` / ``topk_group``), ``norm_topk_prob``, ``routed_scaling_factor`` (DeepSeek-V3's router:
  :mod:`parallm.model.layers.routing`); ``n_routed_experts`` relu2 experts of ``moe_intermediate_size``, working
  in a ``moe_latent_size`` latent space when set (``fc1_latent_proj`` / ``fc2_latent_proj`` around them); a
  shared relu2 expert of ``moe_shared_expert_intermediate_size`` on the hidden states. No load-balancing loss
  (transformers adds none).

Norms: RMSNorm with the weight multiplied in fp32 (``NemotronHRMSNorm``), ``layer_norm_epsilon``; the Mamba-2
gated norm is over ``n_groups`` groups, gate first. The checkpoint names are the Hub's (``backbone.``, per-expert
tensors), as transformers' ``save_pretrained`` writes them (a state dict taken from transformers' model in memory,
``model.`` names, must be saved with ``save_pretrained`` first).

Multi-token prediction (``num_nextn_predict_layers``; the checkpoints' ``mtp.*`` tensors, which transformers
drops): carried bit for bit, never run, as for Qwen3.5 (``build_model(mtp=...)``).

Config fields transformers 5.25 does not read are not read here either (``residual_in_fp32``,
``n_shared_experts``, ``moe_shared_expert_overlap``, ``attention_bias``, ``sliding_window``).
"""

from __future__ import annotations

from dataclasses import replace

from ..model.positions.rope import RopeSpec
from ..model.spec import DecoderSpec, Mamba2Spec
from ..model.table import Row
from .deepseek_v3 import _config_dict
from .hybrid_common import CARRIED_MTP_ROW, mtp_tensors
from .moe_common import FUSED_BLOCK, moe_spec
from .registry import Family, register

H, V, Q, KV, I = "hidden_size", "vocab_size", "q_size", "kv_size", "intermediate_size"
E, EI, SI, LAT, EIN = "num_experts", "expert_intermediate_size", "shared_expert_intermediate_size", \
    "moe_latent_size", "expert_input_size"
BLOCK = "backbone.layers.{i}."
MIX = BLOCK + "mixer."
L = "layers.{l}."
MAMBA, ATTN, MLP = L + "self_attention.", L + "self_attention.", L + "mlp."
FUSED = FUSED_BLOCK.replace("mlp.", "mixer.")    # model.layers.{i}.mixer.: transformers' in-memory names

# transformers 5.25's NemotronHConfig defaults, for config.json files that leave a key out
DEFAULTS = dict(mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4,
                chunk_size=128, use_conv_bias=True, use_bias=False, time_step_limit=(0.0, float("inf")),
                layer_norm_epsilon=1e-5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False, n_routed_experts=8,
                moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, moe_latent_size=None,
                num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
                tie_word_embeddings=False, mamba_hidden_act="silu")
# the config's older names (transformers' NemotronHConfig maps them the same way)
LEGACY = dict(mamba_n_groups="n_groups", mamba_d_conv="conv_kernel", mamba_dt_limit="time_step_limit",
              mamba_conv_bias="use_conv_bias", mamba_chunk_size="chunk_size")
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
         "mlp": "mlp", "moe": "moe"}


def _raw(config) -> dict:
    raw = _config_dict(config)
    for old, new in LEGACY.items():
        if old in raw and new not in raw:
            raw[new] = raw[old]
    return raw


def _get(raw: dict, key: str):
    value = raw.get(key)
    return DEFAULTS.get(key) if value is None else value


def layer_blocks(raw: dict) -> tuple[str, ...]:
    """Each layer's block kind from ``layers_block_type`` (or ``layer_types``), else ``hybrid_override_pattern``."""
    types = raw.get("layers_block_type") or raw.get("layer_types")
    if types is not None:
        bad = sorted({t for t in types if t not in TYPES})
        if bad:
            raise ValueError(f"layers_block_type {bad} are not supported (parallm runs {sorted(TYPES)})")
        return tuple(TYPES[t] for t in types)
    pattern = raw.get("hybrid_override_pattern")
    if not pattern:
        raise ValueError("a nemotron_h config needs layers_block_type or hybrid_override_pattern")
    bad = sorted({ch for ch in pattern if ch not in PATTERN})
    if bad:
        raise ValueError(f"hybrid_override_pattern characters {bad} are not supported (M, *, -, E)")
    return tuple(PATTERN[ch] for ch in pattern)


def _float(value) -> float:
    """A number of config.json: transformers 5 writes infinities as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _int(raw: dict, key: str) -> int:
    value = _get(raw, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"invalid nemotron_h config: {key}={value!r} (a positive integer expected)")
    return value


def _moe(raw: dict, blocks: tuple[str, ...]):
    layers = tuple(i for i, k in enumerate(blocks) if k == "moe")
    if not layers:
        return None
    moe = moe_spec(_Attrs(raw), num_experts=_int(raw, "n_routed_experts"),
                   expert_intermediate_size=_int(raw, "moe_intermediate_size"),
                   norm_topk_prob=bool(_get(raw, "norm_topk_prob")), layers=layers,
                   shared_expert_intermediate_size=_int(raw, "moe_shared_expert_intermediate_size"))
    latent = _get(raw, "moe_latent_size")
    if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int) or latent <= 0):
        raise ValueError(f"invalid moe_latent_size={latent!r} (a positive integer or null expected)")
    scaling = _get(raw, "routed_scaling_factor")
    return replace(moe, aux_loss_coef=0.0, router="sigmoid_grouped", n_group=_int(raw, "n_group"),
                   topk_group=_int(raw, "topk_group"), routed_scaling_factor=float(scaling), score_bias=True,
                   activation="relu2", latent_size=latent, latent_bias=bool(_get(raw, "mlp_bias")))


class _Attrs:
    def __init__(self, raw: dict):
        self.__dict__.update({k: _get(raw, k) for k in DEFAULTS}, **{k: v for k, v in raw.items()
                                                                     if k not in DEFAULTS})


def nemotron_h_spec(config) -> DecoderSpec:
    raw = _raw(config)
    blocks = layer_blocks(raw)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if _get(raw, key) != want:
            raise ValueError(f"{key}={_get(raw, key)!r} is not supported for nemotron_h (parallm implements "
                             f"{want!r})")
    hidden, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    head_dim = _get(raw, "head_dim") or hidden // heads
    limit = tuple(_float(v) for v in _get(raw, "time_step_limit"))
    eps = float(_get(raw, "layer_norm_epsilon"))
    mamba_layers = tuple(i for i, k in enumerate(blocks) if k == "mamba")
    mamba = Mamba2Spec(num_heads=_int(raw, "mamba_num_heads"), head_dim=_int(raw, "mamba_head_dim"),
                       n_groups=_int(raw, "n_groups"), state_size=_int(raw, "ssm_state_size"),
                       conv_kernel=_int(raw, "conv_kernel"), chunk_size=_int(raw, "chunk_size"),
                       layers=mamba_layers, time_step_limit=limit, conv_bias=bool(_get(raw, "use_conv_bias")),
                       proj_bias=bool(_get(raw, "use_bias")), norm_eps=eps) if mamba_layers else None
    moe = _moe(raw, blocks)
    archs = raw.get("architectures") or []
    vocab = _int(raw, "vocab_size")
    return DecoderSpec(
        family="nemotron_h", architecture=archs[0] if archs else "NemotronHForCausalLM", model_type="nemotron_h",
        hidden_size=hidden, num_layers=len(blocks), num_heads=heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads") or heads), head_dim=int(head_dim),
        intermediate_size=_int(raw, "intermediate_size"), vocab_size=vocab, rms_norm_eps=eps,
        # no RoPE: a placeholder the attention layers never apply (nope)
        rope=RopeSpec(dim=int(head_dim) + int(head_dim) % 2, theta=10000.0, kind="default",
                      max_position_embeddings=raw.get("max_position_embeddings")), nope=True,
        mlp_bias=bool(_get(raw, "mlp_bias")),
        # transformers 5.25 never ties Nemotron-H's head (no tied weight keys; lm_head is its own tensor)
        tie_word_embeddings=False,
        # transformers builds the embedding without padding_idx: every position trains its row
        pad_token_id=None, hidden_act="relu2", moe=moe,
        layer_blocks=blocks, mamba=mamba, norm_weight_fp32=True)


def nemotron_h_table() -> tuple[Row, ...]:
    mamba = ("mamba_block",)
    attn = ("attention_block",)
    mlp = ("mlp_block",)
    moe = ("moe_layer",)
    return (
        Row("embedding.weight", ("backbone.embeddings.weight",), "vocab", "first", ((V, H),), tied="embedding"),
        Row(L + "norm.weight", (BLOCK + "norm.weight",), "copy", "layer", ((H,),), tp_sum="sp"),
        # Mamba-2
        Row(MAMBA + "in_proj.weight", (MIX + "in_proj.weight",), "mamba_in", "layer", (("mamba_in_proj_size", H),),
            when=mamba),
        Row(MAMBA + "in_proj.bias", (MIX + "in_proj.bias",), "mamba_in", "layer", (("mamba_in_proj_size",),),
            when=mamba + ("mamba_proj_bias",)),
        Row(MAMBA + "conv1d.weight", (MIX + "conv1d.weight",), "mamba_conv", "layer",
            (("mamba_conv_dim", 1, "mamba_conv_kernel"),), when=mamba),
        Row(MAMBA + "conv1d.bias", (MIX + "conv1d.bias",), "mamba_conv", "layer", (("mamba_conv_dim",),),
            when=mamba + ("mamba_conv_bias",)),
        *(Row(MAMBA + name, (MIX + name,), "column", "layer", (("mamba_heads",),), when=mamba, keep_fp32=True)
          for name in ("A_log", "D", "dt_bias")),
        Row(MAMBA + "norm.weight", (MIX + "norm.weight",), "column", "layer", (("mamba_inner",),), when=mamba),
        Row(MAMBA + "out_proj.weight", (MIX + "out_proj.weight",), "row", "layer", ((H, "mamba_inner"),),
            when=mamba),
        Row(MAMBA + "out_proj.bias", (MIX + "out_proj.bias",), "copy", "layer", ((H,),),
            when=mamba + ("mamba_proj_bias",), tp_sum="sp"),
        # attention (no RoPE, no biases)
        Row(ATTN + "linear_qkv.weight", (MIX + "q_proj.weight", MIX + "k_proj.weight", MIX + "v_proj.weight"),
            "qkv", "layer", ((Q, H), (KV, H), (KV, H)), when=attn),
        Row(ATTN + "linear_proj.weight", (MIX + "o_proj.weight",), "row", "layer", ((H, Q),), when=attn),
        # the dense MLP (relu2: up alone)
        Row(MLP + "linear_fc1.weight", (MIX + "up_proj.weight",), "column", "layer", ((I, H),), when=mlp),
        Row(MLP + "linear_fc1.bias", (MIX + "up_proj.bias",), "column", "layer", ((I,),), when=mlp + ("mlp_bias",)),
        Row(MLP + "linear_fc2.weight", (MIX + "down_proj.weight",), "row", "layer", ((H, I),), when=mlp),
        Row(MLP + "linear_fc2.bias", (MIX + "down_proj.bias",), "copy", "layer", ((H,),), when=mlp + ("mlp_bias",),
            tp_sum="sp"),
        # MoE
        Row(MLP + "router.weight", (MIX + "gate.weight",), "copy", "layer", ((E, H),), when=moe, tp_sum="sp",
            keep_fp32=True),
        Row(MLP + "router.e_score_correction_bias", (MIX + "gate.e_score_correction_bias",), "copy", "layer",
            ((E,),), when=moe, trained=False, keep_fp32=True),
        Row(MLP + "experts.linear_fc1.weight", (MIX + "experts.{e}.up_proj.weight",), "column", "layer",
            ((EI, EIN),), when=moe, per_expert=True, fused=(FUSED + "experts.up_proj",)),
        Row(MLP + "experts.linear_fc2.weight", (MIX + "experts.{e}.down_proj.weight",), "row", "layer",
            ((EIN, EI),), when=moe, per_expert=True, fused=(FUSED + "experts.down_proj",)),
        Row(MLP + "shared_experts.linear_fc1.weight", (MIX + "shared_experts.up_proj.weight",), "column", "layer",
            ((SI, H),), when=moe),
        Row(MLP + "shared_experts.linear_fc2.weight", (MIX + "shared_experts.down_proj.weight",), "row", "layer",
            ((H, SI),), when=moe),
        Row(MLP + "fc1_latent_proj.weight", (MIX + "fc1_latent_proj.weight",), "copy", "layer", ((LAT, H),),
            when=moe + ("moe_latent",), tp_sum="sp"),
        Row(MLP + "fc1_latent_proj.bias", (MIX + "fc1_latent_proj.bias",), "copy", "layer", ((LAT,),),
            when=moe + ("moe_latent", "mlp_bias"), tp_sum="sp"),
        Row(MLP + "fc2_latent_proj.weight", (MIX + "fc2_latent_proj.weight",), "copy", "layer", ((H, LAT),),
            when=moe + ("moe_latent",), tp_sum="sp"),
        Row(MLP + "fc2_latent_proj.bias", (MIX + "fc2_latent_proj.bias",), "copy", "layer", ((H,),),
            when=moe + ("moe_latent", "mlp_bias"), tp_sum="sp"),
        Row("final_norm.weight", ("backbone.norm_f.weight",), "copy", "last", ((H,),), tp_sum="sp"),
        Row("output_layer.weight", ("lm_head.weight",), "vocab", "last", ((V, H),), when=("causal_lm", "untied")),
        Row("output_layer.weight", ("backbone.embeddings.weight",), "vocab", "last", ((V, H),),
            when=("causal_lm", "tied_copy"), save=False, tied="copy"),
        Row("score.weight", ("score.weight",), "copy", "last", ((1, H),), when=("value",), tp_sum="sp"),
        CARRIED_MTP_ROW,
    )


NEMOTRON_H = register(Family(
    name="nemotron_h",
    model_types=("nemotron_h",),
    architectures=("NemotronHForCausalLM", "NemotronHForSequenceClassification", "NemotronHModel"),
    spec=nemotron_h_spec,
    table=nemotron_h_table(),
    causal_architecture="NemotronHForCausalLM",
    # transformers 5.25 has no sequence-classification class for Nemotron-H: a value model is saved under this
    # name (parallm loads it back; transformers cannot)
    value_architecture="NemotronHForSequenceClassification",
    mtp_tensors=mtp_tensors,
    peft_renames=(("backbone.", "model."),),     # transformers' conversion mapping renames backbone. to model.
))
