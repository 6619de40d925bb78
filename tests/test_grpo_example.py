"""examples/grpo.py without vLLM: transformers' ``generate`` as the rollout engine (the fallback), started as a
plain ``python examples/grpo.py`` (it launches its 2 ranks itself). The vLLM run of the example is in
tests/test_vllm.py (the vLLM venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_grpo_example_transformers_rollouts(tmp_path):
    """Three GRPO steps at tp2: every step's rollout log-probs (transformers, refreshed from save_hf_weights)
    equal the trainer's on the same tokens (without the refresh they differ by ~1: the engine would keep the
    checkpoint from before the warm-up), and every logged figure is in range."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLM_PROGRESS="0")
    env.pop("RANK", None)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo.py"), "--rollout", "transformers", "--steps", "3",
           "--prompts", "8", "--jsonl", str(log)]     # no --workdir: both ranks must find rank 0's temporary one
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout"] == "transformers" and 0.0 <= r["reward"] <= 1.0 and r["push_s"] > 0, r
        assert r["logprob_mismatch_max"] < 1e-4, r
        assert r["entropy"] > 0 and 0.0 <= r["clip_frac"] <= 1.0, r
    assert "greedy accuracy on 256 held-out prompts" in proc.stdout


@pytest.mark.timeout(300)
def test_grpo_example_moe_router_replay(tmp_path):
    """``--model moe``: a Qwen3-MoE trained with router replay (the old policy's experts, recorded by
    ``forward(return_routed_experts=True)``, replayed in every PPO update), three steps at tp2 with transformers
    rollouts: the rollouts' log-probs equal the trainer's (the MoE weights reach transformers' fused experts
    every step), and the routing drift (how much the updates moved the replayed routing) is logged in range.
    Router replay's numerics are tested against transformers in tests/test_router_replay.py."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLM_PROGRESS="0")
    env.pop("RANK", None)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "grpo.py"), "--model", "moe", "--rollout", "transformers",
           "--steps", "3", "--prompts", "8", "--jsonl", str(log)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["model"] == "moe" and 0.0 <= r["reward"] <= 1.0, r
        assert r["logprob_mismatch_max"] < 1e-4, r
        assert 0.0 <= r["routing_drift"] <= 1.0 and r["entropy"] > 0, r
    assert "router replay: routing drift" in proc.stdout
