"""LLaMA (1/2/3.x): the reference family. Other families state only how they differ from it."""

from __future__ import annotations

from ..model.table import Row
from ..model.spec import DecoderSpec
from .registry import Family, base_spec_kwargs, register

H, I, Q, KV, V = "hidden_size", "intermediate_size", "q_size", "kv_size", "vocab_size"
ATTN = "model.layers.{i}.self_attn."
MLP = "model.layers.{i}.mlp."

DECODER_TABLE: tuple[Row, ...] = (
    Row("embedding.weight", ("model.embed_tokens.weight",), "vocab", "first", ((V, H),),
        tied="embedding"),
    Row("layers.{l}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "copy", "layer",
        ((H,),), tp_sum="sp"),
    Row("layers.{l}.self_attention.linear_qkv.weight",
        (ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), "qkv", "layer",
        ((Q, H), (KV, H), (KV, H))),
    Row("layers.{l}.self_attention.linear_qkv.bias",
        (ATTN + "q_proj.bias", ATTN + "k_proj.bias", ATTN + "v_proj.bias"), "qkv", "layer",
        ((Q,), (KV,), (KV,)), when=("qkv_bias",)),
    Row("layers.{l}.self_attention.q_norm.weight", (ATTN + "q_norm.weight",), "copy", "layer", (("head_dim",),),
        when=("qk_norm",), tp_sum="always"),
    Row("layers.{l}.self_attention.k_norm.weight", (ATTN + "k_norm.weight",), "copy", "layer", (("head_dim",),),
        when=("qk_norm",), tp_sum="always"),
    Row("layers.{l}.self_attention.linear_proj.weight", (ATTN + "o_proj.weight",), "row", "layer", ((H, Q),)),
    Row("layers.{l}.self_attention.linear_proj.bias", (ATTN + "o_proj.bias",), "copy", "layer", ((H,),),
        when=("o_bias",), tp_sum="sp"),
    Row("layers.{l}.post_attention_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
        "copy", "layer", ((H,),), tp_sum="sp"),
    Row("layers.{l}.mlp.linear_fc1.weight", (MLP + "gate_proj.weight", MLP + "up_proj.weight"), "gate_up",
        "layer", ((I, H), (I, H))),
    Row("layers.{l}.mlp.linear_fc1.bias", (MLP + "gate_proj.bias", MLP + "up_proj.bias"), "gate_up", "layer",
        ((I,), (I,)), when=("mlp_bias",)),
    Row("layers.{l}.mlp.linear_fc2.weight", (MLP + "down_proj.weight",), "row", "layer", ((H, I),)),
    Row("layers.{l}.mlp.linear_fc2.bias", (MLP + "down_proj.bias",), "copy", "layer", ((H,),),
        when=("mlp_bias",), tp_sum="sp"),
    Row("final_norm.weight", ("model.norm.weight",), "copy", "last", ((H,),), tp_sum="sp"),
    Row("output_layer.weight", ("lm_head.weight",), "vocab", "last", ((V, H),), when=("causal_lm", "untied")),
    # Tied across pipeline stages: the last stage's head copy is loaded from the embedding, never saved.
    Row("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "last", ((V, H),),
        when=("causal_lm", "tied_copy"), save=False, tied="copy"),
    Row("score.weight", ("score.weight",), "copy", "last", ((1, H),), when=("value",), tp_sum="sp"),
)


def llama_spec(config, family: str = "llama") -> DecoderSpec:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(**base_spec_kwargs(config, family), qkv_bias=bias, o_bias=bias,
                       mlp_bias=bool(getattr(config, "mlp_bias", False)))


LLAMA = register(Family(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM", "LlamaForSequenceClassification", "LlamaModel"),
    spec=llama_spec,
    table=DECODER_TABLE,
    causal_architecture="LlamaForCausalLM",
    value_architecture="LlamaForSequenceClassification",
))
