"""gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``): what differs from LLaMA.

* **Attention**: q / k / v / o biases (``attention_bias``, default True); a learned **sink** logit per query head
  (``self_attn.sinks [num_attention_heads]``: one more logit in each softmax's denominator, no value), split over
  TP with the query heads; layers alternate between a ``sliding_window`` (128) and full attention
  (``layer_types``; without them the even layers slide, as ``GptOssConfig`` fills them in); YaRN RoPE
  (``rope_parameters``: factor 32, ``truncate`` False), rotate_half layout.
* **MoE on every layer**: the router has a bias and picks the ``top_k`` largest logits, then softmaxes those
  (``topk_softmax``); ``num_local_experts`` experts of ``intermediate_size`` with biases, the clamped SwiGLU
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)``, ``g = clamp(gate, max=limit)`` (``swiglu_limit``,
  ``swiglu_alpha``), no shared expert.
* **Expert tensors** as transformers keeps and saves them: ``mlp.experts.gate_up_proj [E, H, 2 I]`` (gate in the
  even columns, up in the odd ones), ``gate_up_proj_bias [E, 2 I]``, ``down_proj [E, I, H]``, ``down_proj_bias
  [E, H]``, router ``mlp.router.weight [E, H]`` / ``.bias [E]``. parallm holds them in the same orientation
  (``expert_layout="interleaved_columns"``), so every rank's share is a contiguous block of the checkpoint's
  tensor: expert ``e``'s slab of the stacked tensor, its ``gate_up`` columns ``[r 2I/tp, (r+1) 2I/tp)`` (the gate
  / up pairs ``[r I/tp, (r+1) I/tp)``: interleaving makes the TP split contiguous) and its ``down`` rows ``[r I/tp,
  (r+1) I/tp)``; the gate / up bias splits with its columns, the down bias is held whole on every TP rank and added
  on TP rank 0 only (once, before the row-parallel sum). Per expert the table names them
  ``mlp.experts.{e}.gate_up_proj`` etc. (vLLM's streamed per-expert names: the export stream's and the training
  checkpoints'); loads read them from the stacked tensors (or MXFP4 ``*_blocks`` / ``*_scales``:
  :mod:`parallm.checkpoint.mxfp4`), saves write the stacked tensors (``save_fused``).
"""

from __future__ import annotations

from ..model.spec import DecoderSpec, MoESpec
from ..model.table import Row
from .llama import DECODER_TABLE
from .moe_common import aux_loss_coef, moe_table, num_experts_of
from .registry import Family, base_spec_kwargs, layer_windows, register

H, E, EI, GU, NH = "hidden_size", "num_experts", "expert_intermediate_size", "expert_gate_up_size", "num_heads"
BLOCK = "model.layers.{i}.mlp."
MLP = "layers.{l}.mlp."

SINKS_ROW = Row("layers.{l}.self_attention.sinks", ("model.layers.{i}.self_attn.sinks",), "column", "layer",
                ((NH,),), when=("attn_sinks",))


def _expert_row(local: str, name: str, kind: str, shape: tuple, *, when=(), tp_sum: str = "never") -> Row:
    return Row(MLP + local, (BLOCK + "experts.{e}." + name,), kind, "layer", (shape,), when=("moe_layer",) + when,
               tp_sum=tp_sum, per_expert=True, fused=(BLOCK + "experts." + name,), save_fused=True)


GPT_OSS_MOE_ROWS = (
    Row(MLP + "router.weight", (BLOCK + "router.weight",), "copy", "layer", ((E, H),), when=("moe_layer",),
        tp_sum="sp"),
    Row(MLP + "router.bias", (BLOCK + "router.bias",), "copy", "layer", ((E,),), when=("moe_layer", "router_bias"),
        tp_sum="sp"),
    # [H, 2I] split by columns ("row": Split(1)), [2I] and [I, H] by rows ("column": Split(0)); the down bias is
    # replicated and summed over TP (only TP rank 0 adds it, so only its gradient is non-zero)
    _expert_row("experts.linear_fc1.weight", "gate_up_proj", "row", (H, GU)),
    _expert_row("experts.linear_fc1.bias", "gate_up_proj_bias", "column", (GU,), when=("expert_bias",)),
    _expert_row("experts.linear_fc2.weight", "down_proj", "column", (EI, H)),
    _expert_row("experts.linear_fc2.bias", "down_proj_bias", "copy", (H,), when=("expert_bias",), tp_sum="always"),
)


def _with_sinks(base: tuple[Row, ...]) -> tuple[Row, ...]:
    """``base`` with the sinks row after the attention output projection's rows."""
    at = max(i for i, r in enumerate(base) if ".self_attention.linear_proj." in r.local) + 1
    return base[:at] + (SINKS_ROW,) + base[at:]


GPT_OSS_TABLE = moe_table(GPT_OSS_MOE_ROWS, base=_with_sinks(DECODER_TABLE))


def gpt_oss_window_types(config, n: int) -> list[str]:
    """``GptOssConfig``'s default ``layer_types``: the even layers slide, the odd ones see everything."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


def _number(config, key: str, default: float) -> float:
    value = getattr(config, key, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"gpt-oss config: {key}={value!r} must be a positive number")
    return float(value)


def gpt_oss_moe(config) -> MoESpec:
    experts = num_experts_of(config)
    top_k = getattr(config, "num_experts_per_tok", None)
    width = getattr(config, "intermediate_size", None)
    bad = [f"{k}={v!r}" for k, v in (("num_local_experts", experts), ("num_experts_per_tok", top_k),
                                      ("intermediate_size", width))
           if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad:
        raise ValueError(f"invalid gpt-oss config: {', '.join(bad)} (positive integers expected)")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    return MoESpec(num_experts=experts, top_k=top_k, expert_intermediate_size=width, norm_topk_prob=True,
                   layers=tuple(range(int(config.num_hidden_layers))), aux_loss_coef=aux_loss_coef(config),
                   router="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
                   swiglu_limit=_number(config, "swiglu_limit", 7.0),
                   swiglu_alpha=_number(config, "swiglu_alpha", 1.702), expert_layout="interleaved_columns")


def gpt_oss_spec(config) -> DecoderSpec:
    bias = bool(getattr(config, "attention_bias", True))
    return DecoderSpec(**base_spec_kwargs(config, "gpt_oss"), qkv_bias=bias, o_bias=bias, attn_sinks=True,
                       norm_weight_fp32=True,    # GptOssRMSNorm: the weight times the fp32 normed input, then cast
                       layer_windows=layer_windows(config, "gpt-oss", default_types=gpt_oss_window_types),
                       moe=gpt_oss_moe(config))


GPT_OSS = register(Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures=("GptOssForCausalLM", "GptOssForSequenceClassification", "GptOssModel"),
    spec=gpt_oss_spec,
    table=GPT_OSS_TABLE,
    causal_architecture="GptOssForCausalLM",
    value_architecture="GptOssForSequenceClassification",
))
