"""What the hybrid Gated DeltaNet families share (:mod:`parallm.families.qwen3_5`: Qwen3.5, Qwen3.5-MoE and their
vision-language checkpoints; :mod:`parallm.families.qwen3_next`): the config parsing (layer kinds, partial RoPE,
the Gated DeltaNet sizes, the Qwen-MoE block), the weight table built around a family's fused input projection,
and the multi-token-prediction tensors they carry. The layers are Gated DeltaNet (linear attention,
:mod:`parallm.model.layers.gated_deltanet`) except every ``full_attention_interval``-th (``config.layer_types``), which
runs full attention. What differs from Qwen3:

* the attention layers: q_proj's rows are per head ``[q_h; gate_h]`` and the attention output is multiplied by
  ``sigmoid(gate)`` before o_proj (``attn_output_gate``); qk-norm; RoPE on the first
  ``int(head_dim * partial_rotary_factor)`` channels (default 0.25); GQA;
* every RMSNorm (layer norms, qk-norm, final norm) is zero-centred: ``x_normed * (1 + w)`` in fp32
  (``zero_centered_norm``); the Gated DeltaNet's own gated norm is not;
* the MoE variants: routed experts (softmax top-k) plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``
  (Qwen2-MoE's block).

RoPE: Qwen3.5's text rotary is multimodal (``mrope_section``); for text-only positions (the same position on
every axis, what parallm passes) it is the plain rotate-half RoPE, which is what runs here.

Multi-token prediction (the checkpoints' ``mtp.*``: ``mtp.fc``, ``mtp.pre_fc_norm_embedding`` /
``pre_fc_norm_hidden``, ``mtp.layers.{j}.*`` (``mtp_num_hidden_layers`` of them), ``mtp.norm``; transformers drops
them): not run; carried bit for bit (:func:`mtp_tensors` lists them from the checkpoint's headers, the last
stage holds them replicated: ``build_model(mtp=...)``, :data:`CARRIED_MTP_ROW`).
"""

from __future__ import annotations

from dataclasses import replace

from ..model.positions.rope import rope_spec_from_hf_config
from ..model.spec import DecoderSpec, GatedDeltaNetSpec
from ..model.table import Row
from ..model.positions.yarn import rope_parameters, rotary_dim
from .deepseek_v3 import _config_dict, base_kwargs_without_rope
from .llama import DECODER_TABLE
from .moe_common import moe_rows, moe_spec, moe_table, num_experts_of
from .registry import load_config

H = "hidden_size"
LINEAR = "model.layers.{i}.linear_attn."
GDN = "layers.{l}.self_attention."
DEFAULT_PARTIAL_ROTARY = 0.25          # transformers' default for these families
LAYER_TYPES = ("linear_attention", "full_attention")


def _gdn_rows(in_proj: Row) -> tuple[Row, ...]:
    """A Gated DeltaNet layer's rows (``in_proj``: the family's fused input-projection row)."""
    when = ("linear_layer",)
    return (
        in_proj,
        Row(GDN + "conv1d.weight", (LINEAR + "conv1d.weight",), "gdn_conv", "layer",
            (("gdn_conv_dim", 1, "gdn_conv_kernel"),), when=when),
        # fp32 in every dtype (Qwen3.5 checkpoints store it fp32; vLLM / SGLang hold it fp32)
        Row(GDN + "A_log", (LINEAR + "A_log",), "column", "layer", (("gdn_value_heads",),), when=when,
            keep_fp32=True),
        Row(GDN + "dt_bias", (LINEAR + "dt_bias",), "column", "layer", (("gdn_value_heads",),), when=when),
        # one [dv] weight shared by every value head: each TP rank's gradient covers its heads only
        Row(GDN + "norm.weight", (LINEAR + "norm.weight",), "copy", "layer", (("gdn_value_head_dim",),), when=when,
            tp_sum="always"),
        Row(GDN + "out_proj.weight", (LINEAR + "out_proj.weight",), "row", "layer", ((H, "gdn_value_dim"),),
            when=when),
    )

MTP_PREFIX = "mtp."
# one row per tensor of spec.carried_mtp (the template is expanded by select_rows): replicated, never trained
CARRIED_MTP_ROW = Row("carried_mtp.{c}", ("{carried}",), "copy", "last", ((0,),), when=("carried_mtp",),
                      trained=False)


def mtp_tensors(present: dict) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The multi-token-prediction tensors among a checkpoint's ``{name: shape}`` (``mtp.*``, top level in text
    and vision-language checkpoints alike), in name order."""
    return tuple((n, tuple(present[n])) for n in sorted(present) if n.startswith(MTP_PREFIX))

def hybrid_table(in_proj: Row, *, moe: bool) -> tuple[Row, ...]:
    """The dense decoder table with its attention rows for attention layers only (q_proj ``[q_h; gate_h]`` per
    head: ``q_proj_size`` rows) and the Gated DeltaNet rows for the others; ``moe``: every MLP row for dense
    layers only, plus the Qwen-MoE rows with the shared expert and its gate (:mod:`parallm.families.moe_common`).
    A new table: the shared ones are not changed."""
    rows = []
    for r in DECODER_TABLE:
        if ".self_attention." in r.local:
            shapes = r.shapes
            if r.local.endswith("linear_qkv.weight"):
                shapes = (("q_proj_size", H),) + r.shapes[1:]
            elif r.local.endswith("linear_qkv.bias"):
                shapes = (("q_proj_size",),) + r.shapes[1:]
            r = replace(r, shapes=shapes, when=r.when + ("attention_layer",))
        rows.append(r)
    base = tuple(rows) + _gdn_rows(in_proj) + (CARRIED_MTP_ROW,)
    if not moe:
        return base
    experts = moe_rows("model.layers.{i}.mlp.", router="gate.weight", gate="experts.{e}.gate_proj.weight",
                       up="experts.{e}.up_proj.weight", down="experts.{e}.down_proj.weight")
    return moe_table(experts, base)


def layer_kinds(config) -> tuple[int, ...]:
    """The global indices of the Gated DeltaNet layers, from ``layer_types`` (or ``full_attention_interval``:
    every interval-th layer is full attention, as transformers' configs build ``layer_types``)."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        interval = int(getattr(config, "full_attention_interval", None) or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types {bad} are not supported (parallm runs {', '.join(LAYER_TYPES)})")
    return tuple(i for i, t in enumerate(types) if t == "linear_attention")


def _int(config, key: str, default=None):
    value = getattr(config, key, default)
    if value is None:
        raise ValueError(f"the config is missing {key}")
    return value


def hybrid_spec(config, family: str, *, interleaved: bool, moe=None) -> DecoderSpec:
    """The :class:`DecoderSpec` of a Qwen3-Next / Qwen3.5 text config (``interleaved``: Qwen3-Next's grouped input
    projections; ``moe``: the :class:`~parallm.model.spec.MoESpec`, None for dense). A config without
    ``intermediate_size`` (Qwen3.5-MoE's: every layer routes) gets the experts' width there, never used."""
    if getattr(config, "intermediate_size", None) is None and moe is not None \
            and len(moe.layers) == int(config.num_hidden_layers):
        config = load_config(dict(_config_dict(config), intermediate_size=moe.expert_intermediate_size))
    kwargs = base_kwargs_without_rope(config, family)
    head_dim = kwargs["head_dim"]
    params = rope_parameters(config)
    for key in ("mrope_section", "mrope_interleaved"):      # text positions: plain RoPE (module doc)
        params.pop(key, None)
    factor = params.pop("partial_rotary_factor", None)
    factor = DEFAULT_PARTIAL_ROTARY if factor is None else float(factor)
    dim = rotary_dim(head_dim, factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotary channels of head_dim={head_dim} (a "
                         "positive even number up to head_dim is needed)")
    if params["rope_type"] not in ("default", "linear", "dynamic", "llama3"):
        raise ValueError(f"{family} with {params['rope_type']!r} RoPE is not supported yet (RoPE kinds: default, "
                         "linear, dynamic, llama3)")
    max_pos = getattr(config, "max_position_embeddings", None)
    kwargs["rope"] = rope_spec_from_hf_config({"rope_parameters": params, "max_position_embeddings": max_pos}, dim)
    linear = GatedDeltaNetSpec(
        num_key_heads=_int(config, "linear_num_key_heads"), num_value_heads=_int(config, "linear_num_value_heads"),
        key_head_dim=_int(config, "linear_key_head_dim"), value_head_dim=_int(config, "linear_value_head_dim"),
        conv_kernel=_int(config, "linear_conv_kernel_dim", 4), layers=layer_kinds(config), interleaved=interleaved)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(**kwargs, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe, linear_attn=linear,
                       attn_output_gate=True, zero_centered_norm=True)


def qwen_hybrid_moe(config, layers: tuple[int, ...], *, norm_topk_prob: bool):
    """The Qwen-MoE block of these families: softmax top-k, a shared expert with its sigmoid gate."""
    experts = num_experts_of(config)
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    return moe_spec(config, num_experts=experts, expert_intermediate_size=getattr(config, "moe_intermediate_size", None),
                    norm_topk_prob=norm_topk_prob, layers=layers if experts else (),
                    shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
