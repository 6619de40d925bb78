"""Tiny checkpoints of issue 57's families for the integration tests (tests/test_verl_families.py,
tests/test_tinker_families.py, tests/test_vllm_families.py): Kimi-K2.5 (the ``kimi_k25`` wrapper over a DeepSeek-V3
text model, a vision tower carried), dense Gemma 4 text, MiniMax-M2 and a Qwen3.6-shaped Qwen3.5-MoE, each with the
features its family tests switch on (tests/test_kimi_k25.py, test_gemma4_features.py, test_minimax_m2.py,
test_qwen3_6.py).

The checkpoints are written by parallm (``build_model(init="random")``, every tensor redrawn non-trivial,
``save_hf_weights``: transformers 5.25's save names), so that the same file serves every venv: .venv-verl's
transformers 5.10.4 has no ``kimi_k25``, and the references of these tests are parallm's own forward (which equals
transformers 5.25 on these features: the family tests) or, where the venv's transformers computes the family, that
transformers. config.json holds only the keys given here: parallm fills the rest as transformers 5.25's config
classes do (the family tests check the defaults).
"""

from __future__ import annotations

import json
import os

FAMILIES = ("kimi_k25", "gemma4", "minimax_m2", "qwen3_6")

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
_KIMI_VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                    num_hidden_layers=2, hidden_size=16, intermediate_size=24, merge_kernel_size=[2, 2])


def kimi_text(vocab: int, **overrides) -> dict:
    """Kimi-K2's text model (``kimi_k2``, DeepSeek-V3's architecture): MLA with q LoRA, YaRN, interleaved RoPE, a
    dense first layer, 8 experts in 4 groups (top-2 of 2 groups), a shared expert, the sigmoid router with its
    correction bias."""
    return dict(dict(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                     qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, attention_bias=False,
                     n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_shared_experts=1, intermediate_size=96, num_hidden_layers=3, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
                     hidden_act="silu", rms_norm_eps=1e-6, vocab_size=vocab, max_position_embeddings=64,
                     rope_parameters=dict(_YARN), rope_interleave=True, tie_word_embeddings=False,
                     bos_token_id=None, eos_token_id=None), **overrides)


def kimi_k25(vocab: int, **text) -> dict:
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": kimi_text(vocab, **text), "vision_config": dict(_KIMI_VISION),
            "projection_hidden_size": 16, "tie_word_embeddings": False}


def gemma4(vocab: int, **overrides) -> dict:
    """test_gemma4_features.py's model: 8 layers sliding / full alternating (window 4), the full layers' own head
    dim and KV heads, K = V on them, proportional RoPE with a partial factor, per-layer input embeddings, the last
    2 layers sharing KV with a double-wide MLP, soft-cap 0.5, tied embeddings."""
    return dict(dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], hidden_size=64,
                     intermediate_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                     hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab, vocab_size=vocab,
                     sliding_window=4, final_logit_softcapping=0.5,
                     layer_types=["sliding_attention", "full_attention"] * 4, num_kv_shared_layers=2,
                     use_double_wide_mlp=True, tie_word_embeddings=True,
                     rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                         "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                     bos_token_id=None, eos_token_id=None), **overrides)


def minimax_m2(vocab: int, **overrides) -> dict:
    """test_minimax_m2.py's model: q / k norms over the whole projection, the legacy ``rotary_dim`` (half the
    head), the sigmoid router with a correction bias, 4 experts top-2."""
    return dict(dict(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], hidden_size=64,
                     intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, rotary_dim=8, rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2,
                     use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
                     use_routing_bias=True, vocab_size=vocab, max_position_embeddings=512,
                     tie_word_embeddings=False, bos_token_id=None, eos_token_id=None), **overrides)


def qwen3_6(vocab: int, **overrides) -> dict:
    """test_qwen3_6.py's scaled Qwen3.6-35B-A3B (one block of 3 Gated DeltaNet + 1 gated attention layers, 8
    experts top-2 plus the gated shared expert, partial interleaved M-RoPE), as the text model
    (``Qwen3_5MoeForCausalLM``)."""
    layers = 4
    return dict(dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], hidden_size=64,
                     num_hidden_layers=layers, full_attention_interval=4,
                     layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                  for i in range(layers)],
                     num_attention_heads=8, num_key_value_heads=1, head_dim=32, attn_output_gate=True,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=16, shared_expert_intermediate_size=16, rms_norm_eps=1e-6,
                     router_aux_loss_coef=0.001, hidden_act="silu", vocab_size=vocab, max_position_embeddings=512,
                     tie_word_embeddings=False,
                     rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                                          mrope_section=[2, 1, 1], mrope_interleaved=True),
                     bos_token_id=None, eos_token_id=None), **overrides)


def qwen3_6_vl(vocab: int, **text) -> dict:
    """:func:`qwen3_6` as the released checkpoints ship it: the vision-language wrapper
    (``Qwen3_5MoeForConditionalGeneration``, ``text_config`` / ``vision_config``) with a 2-block vision tower."""
    text_config = qwen3_6(vocab, **text)
    del text_config["architectures"]
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text_config, "tie_word_embeddings": False,
            "vision_config": dict(model_type="qwen3_5_moe", depth=2, hidden_size=32, intermediate_size=64,
                                  num_heads=2, out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                                  temporal_patch_size=2, num_position_embeddings=64),
            "image_token_id": vocab - 2, "video_token_id": vocab - 3, "vision_start_token_id": vocab - 4,
            "vision_end_token_id": vocab - 5}


def rewrap(text_path: str, vl_path: str) -> int:
    """Put the language model of the text checkpoint at ``text_path`` into the wrapper checkpoint at ``vl_path``
    (``model.*`` -> ``model.language_model.*``, ``lm_head`` as is; the vision tower kept), so both hold the same
    language model; returns how many tensors were replaced (every one of the text checkpoint's)."""
    from safetensors.torch import load_file, save_file
    text = load_file(os.path.join(text_path, "model.safetensors"))
    vl_file = os.path.join(vl_path, "model.safetensors")
    vl = load_file(vl_file)
    renamed = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in text.items()}
    missing = sorted(set(renamed) - set(vl))
    assert not missing, f"the wrapper has no tensor named {missing[:3]}"
    vl.update(renamed)
    save_file(vl, vl_file, metadata={"format": "pt"})
    return len(renamed)


CONFIGS = {"kimi_k25": kimi_k25, "gemma4": gemma4, "minimax_m2": minimax_m2, "qwen3_6": qwen3_6}


def write(path: str, config: dict, *, seed: int = 3, tokens: dict | None = None) -> str:
    """The checkpoint of ``config`` (a config.json dict) at ``path``, written by parallm: random weights, each
    tensor redrawn (vectors 1 + 0.3 N(0, 1), the rest 0.08 N(0, 1)), ``save_hf_weights``; ``tokens``: token ids
    (``pad_token_id`` / ``eos_token_id`` / ``bos_token_id``) put into config.json after the save. Runs in a
    process of its own (it initialises and destroys parallm's parallel state)."""
    import torch

    import parallm
    config_dir = path + "-config"
    os.makedirs(config_dir, exist_ok=True)
    with open(os.path.join(config_dir, "config.json"), "w") as f:
        json.dump(config, f)
    parallm.init_parallel()
    chunks = parallm.build_model(config_dir, init="random", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in chunks[0].named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    parallm.save_hf_weights(chunks, path)
    parallm.destroy_parallel()
    if tokens:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            saved = json.load(f)
        target = saved.get("text_config", saved) if isinstance(saved.get("text_config"), dict) else saved
        for d in (saved, target):
            d.update(tokens)
        with open(cfg_path, "w") as f:
            json.dump(saved, f)
    return path
