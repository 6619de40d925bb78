"""``examples/grpo.py --engines serve`` end to end: the trainer at tp2 on 2 ranks (torchrun), two ``vllm serve``
engines in processes of their own (2 tensor-parallel workers and 1) started by rank 0, every step's rollouts
split between them, a push into both through parallm_shm every step, and a 400-token system prompt in front of
every prompt (three full KV blocks of 128, vLLM-CPU's block size: the engines' prefix caches hold it from step to
step). Runs in the vLLM venv (``scripts/test.sh``).

The engines' log-probs of their samples equal the trainer's (within 1e-4, which the example checks itself at
every step, ``--max-mismatch``) on every one of 8 steps (a push that did not reach one of the engines leaves them
apart, by ~1 from the first step, which follows the supervised warm-up; rollouts paired with the wrong prompts
too; a prefix cache not reset after a push serves the system prompt's keys and values of the previous step's
weights), and the engines served most prompt tokens from their prefix caches (vLLM's ``/metrics``). That the
example learns (the reward rising within 24 steps) is checked on the same example with the in-process engine
(tests/test_vllm.py::test_grpo_example_learns), not here: 24 steps with engines in other processes cost the
suite several minutes more. The servers are stopped by the example (and
their /dev/shm files removed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test.sh runs this file in .venv-vllm)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(900)
def test_grpo_with_serve_engines_learns(tmp_path):
    from parallm.integrations.vllm.serve import remove_shm_files, shm_files
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR", PARALLM_PROGRESS="0")
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "grpo.py"), "--rollout", "vllm", "--engines", "serve", "--steps", "8",
           "--system-prompt-tokens", "400", "--workdir", str(tmp_path), "--jsonl", str(log)]
    before = shm_files()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    finally:
        left = remove_shm_files(before)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        assert r["rollout"] == "vllm-serve" and 0.0 <= r["reward"] <= 1.0 and r["push_s"] > 0, r
        assert r["logprob_mismatch_max"] <= 1e-4, r
    hits, queries = (float(x) for x in re.search(r"prefix cache: (\d+) of (\d+) prompt tokens", proc.stdout).groups())
    assert hits > 0.5 * queries, (hits, queries)          # the system prompt came from the caches
    assert not [n for n in left if n.startswith("parallm_wt_")], left      # the example closed its connection
