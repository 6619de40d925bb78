"""The self-contained building blocks of the DeepSeek-V3 / Kimi-K2 / Moonlight and GLM-4.5 families, each against
transformers 5 (or megatron-core) itself, before they are wired into the decoder:

* YaRN RoPE (inv_freq, the cos / sin attention factor, MLA's softmax mscale^2), DeepSeek's interleaved RoPE and
  GLM's partial rotary: bit for bit;
* the sigmoid group-limited router with its fp32 selection bias: bit for bit, fp32 and bf16 activations;
* FP8 128x128 block dequantisation (ragged edges, slices) and its errors;
* uneven pipeline splits against megatron-core's own layer counts and offsets;
* config -> spec parsing of DeepSeek-V3 (q LoRA / Moonlight, yarn / default, kimi_k2) and GLM-4.5 (-Air);
* multi-head latent attention forward and backward at tp1 (in process) and tp2 (two gloo ranks), padded and
  packed (tp2: with sequence parallelism), against ``DeepseekV3Attention``; its shard mapping bit-exact.
"""

from __future__ import annotations

import math

import pytest
import torch

import helpers

# -- tiny configs ---------------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


def deepseek_config(**overrides):
    """A tiny DeepseekV3Config: 4 heads, q LoRA 24, kv LoRA 16, nope 12 + rope 8, v 10 (!= nope + rope), yarn
    with a non-trivial attention factor and softmax mscale, biases on, rms_norm_eps 1e-2 (the latent norms use
    1e-6 whatever it says: a wrong eps shows), 8 experts in 4 groups."""
    from transformers import DeepseekV3Config
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, attention_bias=True, rms_norm_eps=1e-2,
              n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=2, intermediate_size=96, num_hidden_layers=3, first_k_dense_replace=1,
              vocab_size=101, max_position_embeddings=64, rope_parameters=dict(YARN), rope_interleave=True)
    kw.update(overrides)
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def moonlight_config(**overrides):
    """No q LoRA (q_proj), default RoPE, rotate_half layout, no biases."""
    return deepseek_config(**dict(dict(q_lora_rank=None, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 5e4},
                                       rope_interleave=False, attention_bias=False), **overrides))


def glm_config(**overrides):
    from transformers import Glm4MoeConfig
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
              use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=1, intermediate_size=96, num_hidden_layers=3, first_k_dense_replace=1,
              routed_scaling_factor=2.5, vocab_size=101, max_position_embeddings=64)
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


# -- YaRN -----------------------------------------------------------------------------------------------------

YARN_VARIANTS = {
    # DeepSeek-V3's own numbers (attention factor 1 exactly, softmax mscale^2 = 1.87)
    "deepseek-v3": dict(factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                        mscale_all_dim=1.0),
    # Kimi-K2: beta_fast == beta_slow (floor / ceil of one correction dim: a ramp one channel wide)
    "kimi-k2": dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0),
    # both correction dims in (-1, 0]: low == high == 0, a zero-width ramp starting on channel 0 (0 / 0 without
    # transformers' +0.001 guard)
    "degenerate-ramp": dict(factor=4.0, original_max_position_embeddings=16, beta_fast=3.3, beta_slow=2.6),
    "truncate-off": dict(factor=8.0, original_max_position_embeddings=512, mscale=0.9, mscale_all_dim=0.6,
                         truncate=False),
    "explicit-attention-factor": dict(factor=6.0, original_max_position_embeddings=256, attention_factor=1.3),
    "mscale-alone": dict(factor=5.0, original_max_position_embeddings=128, mscale=0.8),
}


def _yarn_deepseek(variant):
    params = dict(YARN_VARIANTS[variant], rope_type="yarn", rope_theta=10000.0)
    max_pos = 4096 * int(params["factor"])
    return deepseek_config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_parameters=params,
                           max_position_embeddings=max_pos)


@pytest.mark.parametrize("variant", sorted(YARN_VARIANTS))
def test_yarn_matches_transformers_deepseek(variant):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.model.positions.yarn import yarn_attention_factor, yarn_cos_sin, yarn_inv_freq
    cfg = _yarn_deepseek(variant)
    spec = deepseek_v3_spec(cfg)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    assert torch.equal(yarn_inv_freq(spec.yarn), inv_freq)
    assert yarn_attention_factor(spec.yarn) == factor
    assert spec.mla.scale == DeepseekV3Attention(cfg, 0).scaling          # mscale^2 included, the same float
    pos = torch.tensor([[0, 1, 2, 7, 100, 4095], [5, 9, 3000, 16383, 2, 0]])
    rot = DeepseekV3RotaryEmbedding(cfg)
    cos, sin = yarn_cos_sin(spec.yarn, pos)
    for dtype in (torch.float32, torch.bfloat16):
        ref_cos, ref_sin = rot(torch.zeros(1, dtype=dtype), pos)
        assert torch.equal(cos.to(dtype), ref_cos) and torch.equal(sin.to(dtype), ref_sin), dtype


def test_yarn_matches_transformers_generic_configs():
    """Other families' yarn through the same functions: LLaMA with partial rotary and a factor left out (then
    max_position_embeddings / original), Qwen2 from a transformers-4.x config.json (rope_scaling + type)."""
    from transformers import LlamaConfig, Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from parallm.model.positions.yarn import (rope_parameters, rotary_dim, yarn_attention_factor, yarn_inv_freq,
                                    yarn_spec_from_params)
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=24, max_position_embeddings=96,
                        rope_parameters={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32,
                                         "rope_theta": 5e5, "partial_rotary_factor": 0.5})
    qwen_json = {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e6,
                 "max_position_embeddings": 128,
                 "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    for hf, source, head_dim in ((llama, llama, 24), (Qwen2Config(**qwen_json), qwen_json, 16)):
        params = rope_parameters(source)
        dim = rotary_dim(head_dim, params.get("partial_rotary_factor"))
        spec = yarn_spec_from_params(params, dim=dim, max_position_embeddings=_get(source, "max_position_embeddings"))
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        assert torch.equal(yarn_inv_freq(spec), inv_freq) and yarn_attention_factor(spec) == factor
    assert dim == 16 and spec.theta == 1e6


def _get(config, key):
    return config[key] if isinstance(config, dict) else getattr(config, key)


def test_softmax_mscale_is_not_one():
    """The test configs make the softmax mscale^2 and the cos/sin factor matter (so the MLA parity test catches
    either one missing)."""
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.model.positions.yarn import softmax_mscale, yarn_attention_factor
    spec = deepseek_v3_spec(deepseek_config())
    assert softmax_mscale(spec.yarn) > 1.2 and abs(yarn_attention_factor(spec.yarn) - 1) > 0.03
    assert spec.mla.scale == pytest.approx(softmax_mscale(spec.yarn) / math.sqrt(20))
    assert softmax_mscale(deepseek_v3_spec(_yarn_deepseek("deepseek-v3")).yarn) == pytest.approx(1.8739, abs=1e-4)


# -- RoPE layouts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_matches_transformers(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from parallm.model.layers.mla import apply_rope_interleaved
    from parallm.model.positions.yarn import YarnSpec, yarn_cos_sin
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g, dtype=dtype), torch.randn(2, 1, 5, 8, generator=g, dtype=dtype)
    cos, sin = yarn_cos_sin(YarnSpec(dim=8, theta=1e4, factor=4.0, original_max_position_embeddings=16),
                            torch.arange(10).view(2, 5))
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q, k, cos.to(dtype), sin.to(dtype))
    # parallm's layout: [batch, seq, heads, d] with cos [batch, seq, d]
    assert torch.equal(apply_rope_interleaved(q.transpose(1, 2), cos, sin).transpose(1, 2), ref_q)
    assert torch.equal(apply_rope_interleaved(k.transpose(1, 2), cos, sin).transpose(1, 2), ref_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_glm(dtype):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    from parallm.families.glm4_moe import glm4_moe_spec
    from parallm.model.positions.rope import rope_cos_sin
    from parallm.model.positions.yarn import apply_partial_rope
    cfg = glm_config()
    spec = glm4_moe_spec(cfg)
    assert spec.rotary_dim == 16 < spec.head_dim == 32
    pos = torch.tensor([[0, 3, 4, 50, 63], [1, 2, 9, 10, 11]])
    ref_cos, ref_sin = Glm4MoeRotaryEmbedding(cfg)(torch.zeros(1, dtype=dtype), pos)
    cos, sin = rope_cos_sin(spec.rope, pos)
    assert torch.equal(cos.to(dtype), ref_cos) and torch.equal(sin.to(dtype), ref_sin)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 5, 32, generator=g, dtype=dtype), torch.randn(2, 2, 5, 32, generator=g, dtype=dtype)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert torch.equal(apply_partial_rope(q.transpose(1, 2), cos, sin).transpose(1, 2), ref_q)
    assert torch.equal(apply_partial_rope(k.transpose(1, 2), cos, sin).transpose(1, 2), ref_k)


# -- the sigmoid group-limited router -------------------------------------------------------------------------

ROUTERS = {
    "deepseek": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                     routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek-unnormalised": dict(n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=3,
                                  routed_scaling_factor=1.7, norm_topk_prob=False),
    "glm-air": dict(n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.0,
                    norm_topk_prob=True),
}


def _hf_router(kind, variant):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    cfg = (deepseek_config if kind == "deepseek" else glm_config)(**ROUTERS[variant])
    router = (DeepseekV3TopkRouter if kind == "deepseek" else Glm4MoeTopkRouter)(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(0.3 * torch.randn(router.weight.shape, generator=g))
        # a non-zero random selection bias of the size DeepSeek's balancing rule gives it
        router.e_score_correction_bias.copy_(0.1 * torch.randn(router.num_experts, generator=g))
    return cfg, router


def _parallm_router(cfg):
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.families.glm4_moe import glm4_moe_spec
    from parallm.model.layers.routing import GroupLimitedRouter
    spec = (deepseek_v3_spec if cfg.model_type == "deepseek_v3" else glm4_moe_spec)(cfg)
    moe = spec.moe
    assert moe.router == "sigmoid_grouped" and moe.score_bias
    return GroupLimitedRouter(moe.num_experts, spec.hidden_size, top_k=moe.top_k, n_group=moe.n_group,
                              topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
                              routed_scaling_factor=moe.routed_scaling_factor)


@pytest.mark.parametrize("kind,variant", [("deepseek", "deepseek"), ("deepseek", "deepseek-unnormalised"),
                                          ("glm", "glm-air")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_transformers(kind, variant, dtype):
    cfg, ref = _hf_router(kind, variant)
    mine = _parallm_router(cfg)
    with torch.no_grad():
        mine.weight.copy_(ref.weight)
        mine.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    h = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    h_ref, h_mine = h.clone().requires_grad_(), h.clone().requires_grad_()
    logits, weights, experts = mine(h_mine)
    ref_logits, ref_weights, ref_experts = ref(h_ref)
    assert logits.dtype == weights.dtype == torch.float32
    assert torch.equal(logits, ref_logits) and torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
    # the gradient through the (unbiased) weights, into the tokens and the router weight; none into the bias
    r = torch.randn(weights.shape, generator=torch.Generator().manual_seed(5))
    (weights * r).sum().backward()
    (ref_weights * r).sum().backward()
    assert torch.equal(h_mine.grad, h_ref.grad) and torch.equal(mine.weight.grad, ref.weight.grad)
    assert mine.e_score_correction_bias.grad is None and not mine.e_score_correction_bias.requires_grad
    # the bias changes the choice: routing with it differs from plain top-k of the scores, and from the same
    # grouping without it
    scores = ref_logits.sigmoid()
    plain = scores.topk(cfg.num_experts_per_tok, dim=-1).indices.sort(-1).values
    assert (experts.sort(-1).values != plain).any(dim=-1).sum() >= 5
    with torch.no_grad():
        mine.e_score_correction_bias.zero_()
    unbiased = mine(h)[2].sort(-1).values
    assert (experts.sort(-1).values != unbiased).any(dim=-1).sum() >= 5


def test_router_bias_must_stay_fp32():
    """Two experts whose biased scores are 1e-4 apart, with biases that bf16 rounds to one value: in fp32 expert 0
    wins, with the bias rounded to bf16 (as a bf16 model would store it) expert 1 does, in transformers' router
    too. So parallm refuses a non-fp32 bias."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from parallm.model.layers.routing import sigmoid_route
    cfg = deepseek_config(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=1, hidden_size=4)
    bias = torch.tensor([0.1001, 0.1000, -1.0, -1.0])
    assert bias[0] != bias[1] and bias.bfloat16()[0] == bias.bfloat16()[1]
    weight = torch.eye(4)
    logit1 = torch.logit(torch.tensor(0.5 + 0.00005)).item()     # scores 0.5 and 0.50005: bias decides
    h = torch.tensor([[0.0, logit1, 0.0, 0.0]])
    kw = dict(top_k=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert sigmoid_route(h, weight, bias, **kw)[2].item() == 0
    ref = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.e_score_correction_bias.copy_(bias)
        assert ref(h)[2].item() == 0
        ref.e_score_correction_bias.copy_(bias.bfloat16().float())
        assert ref(h)[2].item() == 1                                 # the bf16-rounded bias picks another expert
    with pytest.raises(ValueError, match="selection bias must be float32"):
        sigmoid_route(h, weight, bias.bfloat16(), **kw)


def test_grouping_errors_name_the_numbers():
    from parallm.model.layers.routing import check_grouping
    with pytest.raises(ValueError, match="n_group=3 does not divide n_routed_experts=8"):
        check_grouping(8, 2, 3, 1)
    with pytest.raises(ValueError, match="groups of 1 expert"):
        check_grouping(8, 2, 8, 2)
    with pytest.raises(ValueError, match="topk_group=5 is not in"):
        check_grouping(8, 2, 4, 5)
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds the 4 experts"):
        check_grouping(8, 5, 4, 2)


# -- FP8 block checkpoints ------------------------------------------------------------------------------------

def _fp8(shape, seed):
    from parallm.checkpoint.fp8 import scale_grid
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=g) * 120).to(torch.float8_e4m3fn)
    return weight, (torch.rand(scale_grid(shape), generator=g) * 1e-2 + 1e-4)


def test_fp8_dequantize_matches_transformers():
    """Whole blocks: equal to transformers' load-time Fp8Dequantize (fp32 product, one cast) in fp32 and bf16.
    Ragged edges (576 rows as DeepSeek-V3's kv_a_proj_with_mqa, 300 columns, fused experts): equal to
    transformers' _dequantize_fp8_weight in fp32 (Fp8Dequantize derives the block from the grid and gets ragged
    shapes wrong: it is shown here), and bf16 is that fp32 result rounded once."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    from parallm.checkpoint.fp8 import dequantize
    hf = Fp8Dequantize(None)
    weight, scale = _fp8((256, 384), 0)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize(weight, scale, dtype=dtype), hf._dequantize_one(weight, scale, output_dtype=dtype))
    assert not torch.equal(weight.to(torch.bfloat16), dequantize(weight, scale))          # a bare cast is wrong
    for shape in ((576, 300), (300, 256), (2, 130, 260)):
        weight, scale = _fp8(shape, 1)
        full = dequantize(weight, scale, dtype=torch.float32)
        assert torch.equal(full, _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)), shape
        assert torch.equal(dequantize(weight, scale), full.to(torch.bfloat16))
    weight, scale = _fp8((300, 256), 2)
    assert not torch.equal(hf._dequantize_one(weight, scale, output_dtype=torch.float32),
                           dequantize(weight, scale, dtype=torch.float32))                # 300 = 3 x 100, not 128s
    # a slice (what a TP rank reads) dequantises to the slice of the whole
    weight, scale = _fp8((576, 300), 3)
    full = dequantize(weight, scale, dtype=torch.float32)
    for rows, cols in (((100, 450), (0, 300)), ((0, 576), (150, 300)), ((130, 131), (7, 129))):
        part = dequantize(weight[rows[0]:rows[1], cols[0]:cols[1]], scale, dtype=torch.float32,
                          start=(rows[0], cols[0]))
        assert torch.equal(part, full[rows[0]:rows[1], cols[0]:cols[1]]), (rows, cols)


def test_fp8_state_dict_errors_name_the_tensor():
    from parallm.checkpoint.fp8 import block_size_of, dequantize, dequantize_state_dict
    from parallm.errors import CheckpointError
    weight, scale = _fp8((576, 300), 4)
    norm = torch.randn(576).bfloat16()
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    out = dequantize_state_dict({name: weight, name + "_scale_inv": scale, "model.norm.weight": norm})
    assert sorted(out) == [name, "model.norm.weight"] and out["model.norm.weight"] is norm
    assert torch.equal(out[name], dequantize(weight, scale))
    with pytest.raises(CheckpointError, match=rf"{name} is torch.float8_e4m3fn but the checkpoint has no "
                                              rf"{name}_scale_inv"):
        dequantize_state_dict({name: weight})
    with pytest.raises(CheckpointError, match=rf"{name}_scale_inv has shape \[4, 3\]; a \[576, 300\] weight in "
                                              r"128x128 blocks needs \[5, 3\]"):
        dequantize_state_dict({name: weight, name + "_scale_inv": scale[:4]})
    with pytest.raises(CheckpointError, match=r"q_proj.weight_scale_inv is a block scale without its weight"):
        dequantize_state_dict({"q_proj.weight_scale_inv": scale})
    with pytest.raises(CheckpointError, match=r"model.norm.weight has a block scale .* not a float8 weight"):
        dequantize_state_dict({"model.norm.weight": norm, "model.norm.weight_scale_inv": scale})
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}}
    assert block_size_of(cfg) == (128, 128) and block_size_of({}) is None
    with pytest.raises(CheckpointError, match="quant_method='gptq' is not supported"):
        block_size_of({"quantization_config": {"quant_method": "gptq"}})


# -- uneven pipeline splits -----------------------------------------------------------------------------------

MEGATRON_SPLITS = [(5, 2, None, 2, None), (5, 2, None, None, 2), (5, 2, None, 3, 2), (61, 8, None, 6, 7),
                   (61, 16, None, 2, 3), (12, 4, 2, 2, 2), (14, 4, 2, 4, 2), (10, 3, None, None, 2),
                   (14, 4, 2, None, 2), (9, 3, 3, 3, None)]
# splits megatron-core's TransformerConfig refuses: parallm refuses them too
MEGATRON_REFUSES = [(16, 4, 2, None, 2), (10, 4, None, 3, None), (5, 2, None, 2, 2), (12, 4, 2, 3, None),
                    (12, 3, 2, None, 3)]


def test_uneven_splits_match_megatron():
    """Every (pp rank, virtual stage)'s first layer and layer count equal megatron-core's
    get_transformer_layer_offset / get_num_layers_to_build for the same TransformerConfig."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from parallm.parallel.stages import layer_numbers, layer_owner
    for layers, pp, vpp, first, last in MEGATRON_SPLITS:
        cfg = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                pipeline_dtype=torch.float32)
        kw = dict(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        owned = []
        for p in range(pp):
            for v in range(vpp or 1):
                rng = layer_numbers(layers, pp, vpp or 1, p, v, **kw)
                vs = v if vpp else None
                want = get_transformer_layer_offset(cfg, vp_stage=vs, pp_rank=p)
                assert (rng.start, len(rng)) == (want, get_num_layers_to_build(cfg, vp_stage=vs, pp_rank=p)), (
                    layers, pp, vpp, first, last, p, v)
                owned += list(rng)
                assert all(layer_owner(layers, pp, vpp or 1, i, **kw) == (p, v) for i in rng)
        assert sorted(owned) == list(range(layers))
    for layers, pp, vpp, first, last in MEGATRON_REFUSES:
        with pytest.raises(ValueError):
            TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                              pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                              num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                              pipeline_dtype=torch.float32)
        with pytest.raises(ValueError):
            layer_numbers(layers, pp, vpp or 1, 0, 0, num_layers_in_first_pipeline_stage=first,
                          num_layers_in_last_pipeline_stage=last)


def test_explicit_split_and_unchanged_even_split():
    from parallm.parallel.stages import layer_numbers, layer_owner, stage_sizes
    assert [list(layer_numbers(5, 2, 1, p, 0, layers_per_stage=[2, 3])) for p in range(2)] == [[0, 1], [2, 3, 4]]
    # virtual stages in Megatron's order k = vpp_rank * pp + pp_rank
    sizes = [1, 2, 2, 1]
    got = {(p, v): list(layer_numbers(6, 2, 2, p, v, layers_per_stage=sizes)) for p in range(2) for v in range(2)}
    assert got == {(0, 0): [0], (1, 0): [1, 2], (0, 1): [3, 4], (1, 1): [5]}
    assert [layer_owner(6, 2, 2, i, layers_per_stage=sizes) for i in range(6)] == [(0, 0), (1, 0), (1, 0), (0, 1),
                                                                                   (0, 1), (1, 1)]
    # the even split as before (the old formula), positional calls unchanged
    for layers, pp, vpp in ((8, 2, 2), (12, 2, 3), (16, 4, 2), (4, 1, 1)):
        per = layers // (pp * vpp)
        for p in range(pp):
            for v in range(vpp):
                start = v * (layers // vpp) + p * per
                assert layer_numbers(layers, pp, vpp, p, v) == range(start, start + per)
    assert stage_sizes(61, 8, 1, num_layers_in_first_pipeline_stage=6, num_layers_in_last_pipeline_stage=7) == (
        6, 8, 8, 8, 8, 8, 8, 7)


@pytest.mark.parametrize("args,kw,needle", [
    ((5, 2, 1, 0, 0), {}, r"5 layers do not split into pp=2 x vpp=1 = 2 equal stages; give the split explicitly, "
                          r"e.g. layers_per_stage=\[2, 3\], or num_layers_in_first_pipeline_stage=2, or "
                          r"num_layers_in_last_pipeline_stage=3"),
    ((5, 2, 1, 0, 0), dict(layers_per_stage=[2, 2]), r"layers_per_stage=\[2, 2\] adds up to 4 layers; the model "
                                                     r"has 5"),
    ((5, 2, 1, 0, 0), dict(layers_per_stage=[5]), r"layers_per_stage has 1 entries; pp=2 x vpp=1 needs 2"),
    ((5, 2, 1, 0, 0), dict(layers_per_stage=[5, 0]), r"every stage needs a positive whole number of layers"),
    ((5, 2, 1, 0, 0), dict(num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2),
     r"5 layers at pp=2: 2 \(first\) \+ 2 \(last\) = 4 layers, and there is no middle stage for the other 1"),
    ((10, 4, 1, 0, 0), dict(num_layers_in_first_pipeline_stage=3), r"3 \(first\) leaves 7 layers for 3 middle"),
    ((12, 4, 2, 0, 0), dict(num_layers_in_last_pipeline_stage=3), r"num_layers_in_last_pipeline_stage=3 is not "
                                                                  r"divisible by vpp=2"),
    ((5, 1, 1, 0, 0), dict(num_layers_in_first_pipeline_stage=5), r"needs pp >= 2"),
    ((5, 2, 1, 0, 0), dict(num_layers_in_first_pipeline_stage=0), r"must be a positive integer"),
])
def test_impossible_splits_are_refused(args, kw, needle):
    from parallm.parallel.stages import layer_numbers
    with pytest.raises(ValueError, match=needle):
        layer_numbers(*args, **kw)


# -- config -> spec -------------------------------------------------------------------------------------------

def test_deepseek_v3_spec():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.families.registry import load_config
    cfg = deepseek_config()
    spec = deepseek_v3_spec(cfg)
    m = spec.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (24, 16, 12, 8, 10)
    assert m.q_head_dim == 20 == spec.head_dim and spec.num_kv_heads == 4 and m.rope_interleave and m.down_proj_bias
    assert spec.o_bias and spec.rotary_dim == 8 and spec.yarn.factor == 4.0 and spec.yarn.mscale_all_dim == 0.707
    assert m.scale == DeepseekV3Attention(cfg, 0).scaling and m.latent_norm_eps == 1e-6 != spec.rms_norm_eps
    moe = spec.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.layers) == (8, 2, 32, (1, 2))
    assert (moe.router, moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.score_bias) == (
        "sigmoid_grouped", 4, 2, 2.5, True)
    assert moe.shared_expert_intermediate_size == 64 and not moe.shared_expert_gate and moe.aux_loss_coef == 0
    assert spec.mtp_layers == 1 and spec.intermediate_size == 96
    assert (spec.mla_kv_a_size, spec.mla_kv_b_size, spec.mla_v_size) == (24, 4 * 22, 40)
    # Moonlight: no q LoRA, default RoPE
    moon = deepseek_v3_spec(moonlight_config(n_group=1, topk_group=1, num_nextn_predict_layers=0))
    assert moon.mla.q_lora_rank is None and moon.yarn is None and moon.rope.kind == "default"
    assert moon.rope.dim == 8 and moon.rope.theta == 5e4 and not moon.mla.rope_interleave and not moon.o_bias
    assert moon.mla.scale == DeepseekV3Attention(moonlight_config(), 0).scaling and moon.mtp_layers == 0
    assert (moon.moe.n_group, moon.moe.topk_group) == (1, 1)
    # Kimi-K2: model_type kimi_k2, read from a transformers-4.x style config.json (rope_theta + rope_scaling)
    raw = cfg.to_dict()
    raw.pop("rope_parameters")
    raw.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], rope_theta=10000.0,
               rope_scaling={"type": "yarn", **{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}})
    kimi = deepseek_v3_spec(load_config(raw))
    assert kimi.model_type == "kimi_k2" and kimi.architecture == "DeepseekV3ForCausalLM"
    assert (kimi.mla, kimi.yarn, kimi.moe, kimi.rope) == (spec.mla, spec.yarn, spec.moe, spec.rope)


@pytest.mark.parametrize("overrides,needle", [
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "RoPE kind 'linear'"),
    (dict(n_group=3), "n_group=3 does not divide n_routed_experts=8"),
    (dict(kv_lora_rank=0), "kv_lora_rank=0"),
])
def test_deepseek_v3_spec_refusals(overrides, needle):
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.families.registry import load_config
    raw = deepseek_config().to_dict()
    raw.update(overrides)
    with pytest.raises(ValueError, match=needle):
        deepseek_v3_spec(load_config(raw))


def test_glm4_moe_spec():
    from parallm.families.glm4_moe import glm4_moe_spec
    from parallm.families.registry import load_config
    spec = glm4_moe_spec(glm_config())
    assert spec.qkv_bias and not spec.o_bias and spec.qk_norm and spec.mla is None and spec.yarn is None
    assert (spec.head_dim, spec.rotary_dim, spec.num_kv_heads) == (32, 16, 2) and spec.rope.kind == "default"
    moe = spec.moe
    assert (moe.router, moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.layers) == (
        "sigmoid_grouped", 1, 1, 2.5, (1, 2))
    assert moe.shared_expert_intermediate_size == 32 and spec.mtp_layers == 1
    # GLM-4.5-Air: no qk-norm, scaling factor 1.0
    air = glm4_moe_spec(glm_config(use_qk_norm=False, routed_scaling_factor=1.0))
    assert not air.qk_norm and air.moe.routed_scaling_factor == 1.0
    # a config.json without partial_rotary_factor: transformers' default 0.5 (the config object agrees)
    raw = glm_config().to_dict()
    raw.pop("rope_parameters")
    raw.pop("partial_rotary_factor", None)
    raw.update(rope_theta=1e6, head_dim=64)
    from transformers import Glm4MoeConfig
    assert Glm4MoeConfig.from_dict(raw).rope_parameters["partial_rotary_factor"] == 0.5
    assert glm4_moe_spec(load_config(raw)).rotary_dim == 32
    with pytest.raises(ValueError, match="GLM-4.5 with yarn RoPE is not supported"):
        glm4_moe_spec(glm_config(rope_parameters=dict(YARN)))


def test_existing_families_keep_their_spec():
    """The new spec fields default to what every existing family had."""
    from parallm.families import spec_from_config
    for family in ("llama", "qwen3_moe", "mixtral"):
        spec, _ = spec_from_config(helpers.tiny_config(family))
        assert spec.mla is None and spec.yarn is None and spec.mtp_layers == 0 and spec.rotary_dim == spec.head_dim
        if spec.moe is not None:
            assert spec.moe.router == "softmax" and not spec.moe.score_bias and spec.moe.routed_scaling_factor == 1


# -- multi-head latent attention ------------------------------------------------------------------------------

CASES = {"lora-yarn": deepseek_config, "moonlight": moonlight_config}


def _batch(hidden):
    """x [3, 7, H], a mask (full, left-padded, right-padded rows), the loss weights r."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 7, hidden, generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, 4:] = 0
    return x, mask, torch.randn(3, 7, hidden, generator=g)


def _hf_reference(cfg, x, mask, r):
    """transformers' DeepseekV3Attention on the padded batch: output, input gradient and parameter gradients of
    sum(out * r) over real positions; the HF state (randomised)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from parallm.model.layers.attention import padded_attention_mask
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, 0)
    helpers.randomize_(attn, seed=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    x = x.clone().requires_grad_()
    allowed = padded_attention_mask(mask)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, _ = attn(hidden_states=x, position_embeddings=DeepseekV3RotaryEmbedding(cfg)(x, pos),
                  attention_mask=additive)
    (out * r * mask[..., None]).sum().backward()
    state = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    return state, out.detach(), x.grad, {k: p.grad for k, p in attn.named_parameters()}


def _rows(t, packing):
    """[B, S, ...] -> the packed stream [total, 1, ...] (real tokens in order, zeros after)."""
    flat = t.reshape((-1,) + tuple(t.shape[2:]))[packing.indices]
    pad = flat.new_zeros((packing.total - packing.nnz,) + tuple(flat.shape[1:]))
    return torch.cat([flat, pad])[:, None]


def run_mla(cfg, state, x, mask, r, *, tp, rank, packed, sp):
    """This rank's MLA (tp ranks of the current megatron-core groups) loaded from the HF ``state`` through
    split_mla, run forward and backward on the batch; returns (output, input gradient, {HF name: gradient of this
    rank's shard}), the output and input gradient in this rank's layout ([S, B, H] padded, [T(/tp), 1, H])."""
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.model.layers.attention import make_packing, pack_tokens, resolve_attn_impl
    from parallm.model.decoder import RMSNorm, make_config
    from parallm.model.layers.attention import padded_attention_mask
    from parallm.model.layers.mla import MLA_WEIGHTS, MLAttention, split_mla
    from parallm.model.positions.rope import rope_cos_sin
    from parallm.model.positions.yarn import yarn_cos_sin
    from parallm.parallel.cpu_compat import enable_megatron_sequence_parallel_on_cpu
    spec = deepseek_v3_spec(cfg)
    config = make_config(tp=tp, pp=1, vpp=None, dtype=torch.float32, sequence_parallel=sp)
    if config.sequence_parallel:
        enable_megatron_sequence_parallel_on_cpu()
    backend = resolve_attn_impl("auto", packed=packed, device="cpu", dtype=torch.float32)
    attn = MLAttention(spec, config, tp, backend=backend, norm=RMSNorm)
    params = dict(attn.named_parameters())
    assert sorted(params) == sorted(MLA_WEIGHTS[n][0] for n in state), (sorted(params), sorted(state))
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
        for name, tensor in state.items():
            params[MLA_WEIGHTS[name][0]].copy_(split_mla(spec, name, tensor, tp)[rank])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    if packed:
        ctx = make_packing(mask, tp if sp else 1)
        xs, rs, pos = _rows(x, ctx), _rows(r * mask[..., None], ctx), pack_tokens(pos, ctx)[:, None]
        if sp:
            xs, rs = xs.chunk(tp)[rank], rs.chunk(tp)[rank]
    else:
        ctx = padded_attention_mask(mask)
        xs, rs, pos = x.transpose(0, 1), (r * mask[..., None]).transpose(0, 1), pos.transpose(0, 1)
    cos, sin = yarn_cos_sin(spec.yarn, pos) if spec.yarn is not None else rope_cos_sin(spec.rope, pos)
    xs = xs.clone().requires_grad_()
    out = attn(xs, cos, sin, ctx)
    (out * rs).sum().backward()
    return out.detach(), xs.grad, {n: params[MLA_WEIGHTS[n][0]].grad for n in state}


def _check_mla(results, ref, mask, *, packed, sp, spec, tol=2e-6):
    """Compare every rank's results with transformers': outputs and input gradients at real positions, shard
    gradients merged (replicated ones: equal on every rank, or summed over TP under sequence parallelism)."""
    from parallm.model.layers.attention import make_packing
    from parallm.model.layers.mla import MLA_WEIGHTS, merge_mla
    state, out_ref, dx_ref, grads_ref = ref
    errors = {}
    if packed:
        idx = make_packing(mask).indices
        want_out, want_dx = out_ref.reshape(-1, out_ref.shape[-1])[idx], dx_ref.reshape(-1, dx_ref.shape[-1])[idx]
        for k, (out, dx, _) in enumerate(results):
            if sp:   # each rank holds its rows: put them together
                out = torch.cat([res[0] for res in results])
                dx = torch.cat([res[1] for res in results])
            errors[f"out{k}"] = (out[:len(idx), 0] - want_out).abs().max().item()
            errors[f"dx{k}"] = (dx[:len(idx), 0] - want_dx).abs().max().item()
    else:
        real = mask.bool().transpose(0, 1)
        for k, (out, dx, _) in enumerate(results):
            errors[f"out{k}"] = (out - out_ref.transpose(0, 1))[real].abs().max().item()
            errors[f"dx{k}"] = (dx - dx_ref.transpose(0, 1))[real].abs().max().item()
    for name in state:
        shards = [res[2][name] for res in results]
        if MLA_WEIGHTS[name][1] == "copy":
            if sp:
                got = torch.stack(shards).sum(0)
            else:
                got = shards[0]
                errors[f"{name} replicas"] = max((s - got).abs().max().item() for s in shards)
        else:
            got = merge_mla(spec, name, shards)
        errors[name] = (got - grads_ref[name]).abs().max().item() / max(grads_ref[name].abs().max().item(), 1.0)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, bad
    return max(errors.values())




@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("packed", [False, True])
def test_mla_tp1_matches_transformers(world_of_one, case, packed):
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    cfg = CASES[case]()
    x, mask, r = _batch(cfg.hidden_size)
    ref = _hf_reference(cfg, x, mask, r)
    got = run_mla(cfg, ref[0], x, mask, r, tp=1, rank=0, packed=packed, sp=False)
    _check_mla([got], ref, mask, packed=packed, sp=False, spec=deepseek_v3_spec(cfg))


TP2_RUNS = [("lora-yarn", False, False), ("moonlight", False, False), ("lora-yarn", True, True),
            ("moonlight", True, True), ("lora-yarn", True, False)]


def mla_tp2_rank(rank, world, runs):
    import parallm
    parallm.init_parallel(tp=2)
    try:
        return [run_mla(cfg, state, x, mask, r, tp=2, rank=rank, packed=packed, sp=sp)
                for cfg, state, x, mask, r, packed, sp in runs]
    finally:
        parallm.destroy_parallel()


@pytest.mark.timeout(240)
def test_mla_tp2_matches_transformers():
    """tp2 (two gloo ranks): heads split over TP, the latent projections replicated; padded, packed, and packed
    with sequence parallelism (the replicated parameters' gradients then partial sums over TP)."""
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    runs, refs = [], []
    for case, packed, sp in TP2_RUNS:
        cfg = CASES[case]()
        x, mask, r = _batch(cfg.hidden_size)
        refs.append(_hf_reference(cfg, x, mask, r))
        runs.append((cfg, refs[-1][0], x, mask, r, packed, sp))
    per_rank = helpers.run_ranks(mla_tp2_rank, 2, runs)
    for k, ((case, packed, sp), ref) in enumerate(zip(TP2_RUNS, refs)):
        cfg = CASES[case]()
        _check_mla([per_rank[0][k], per_rank[1][k]], ref, runs[k][3], packed=packed, sp=sp,
                   spec=deepseek_v3_spec(cfg))


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_shards_round_trip(case):
    """split_mla / merge_mla bit-exact at tp 1, 2, 4; heads stay whole (kv_b per head: k_nope then v); a split
    that would cut a head is refused."""
    from parallm.families.deepseek_v3 import deepseek_v3_spec
    from parallm.model.layers.mla import MLA_WEIGHTS, merge_mla, mla_hf_shapes, split_mla
    spec = deepseek_v3_spec(CASES[case]())
    shapes = mla_hf_shapes(spec)
    assert set(shapes) <= set(MLA_WEIGHTS) and ("q_b_proj.weight" in shapes) == (case == "lora-yarn")
    g = torch.Generator().manual_seed(9)
    for name, shape in shapes.items():
        full = torch.randn(shape, generator=g)
        for tp in (1, 2, 4):
            shards = split_mla(spec, name, full, tp)
            assert torch.equal(merge_mla(spec, name, shards), full), (name, tp)
            kind = MLA_WEIGHTS[name][1]
            if kind == "copy":
                assert all(s is full or torch.equal(s, full) for s in shards)
            else:
                n = spec.num_heads
                per_head = full.unflatten(0 if kind == "column" else 1, (n, -1))
                for rank, s in enumerate(shards):
                    heads = per_head.narrow(0 if kind == "column" else 1, rank * n // tp, n // tp)
                    assert torch.equal(s, heads.flatten(0, 1) if kind == "column" else heads.flatten(1, 2))
    kv_b = torch.arange(spec.mla_kv_b_size).float()[:, None].expand(-1, spec.kv_lora_rank).contiguous()
    first = split_mla(spec, "kv_b_proj.weight", kv_b, 2)[0][:, 0]
    per = spec.mla.qk_nope_head_dim + spec.mla.v_head_dim
    assert torch.equal(first, torch.arange(2 * per).float())          # heads 0 and 1: [k_nope_0; v_0; k_nope_1; v_1]
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=3"):
        split_mla(spec, "kv_b_proj.weight", kv_b, 3)
    with pytest.raises(ValueError, match=r"kv_b_proj.weight: shape \[3, 16\], expected"):
        split_mla(spec, "kv_b_proj.weight", kv_b[:3], 2)
