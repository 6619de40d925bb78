"""examples/rl_step.py (docs/api.md's GRPO / PPO actor step, shipped as a file): started as a plain ``python
examples/rl_step.py`` (it launches its 2 ranks itself, tp2) on the tiny Qwen3 it writes; its own check compares
every step's loss, gradient norm and entropy metric, and the saved weights, with transformers + torch AdamW."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"^(reference )?step (\d+): loss ([-+0-9.]+)\s+grad norm ([0-9.]+)\s+entropy ([0-9.]+)", re.M)


@pytest.mark.timeout(300)
def test_rl_step_example(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLM_PROGRESS="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "rl_step.py"), "--steps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: parallm matches transformers + torch.optim.AdamW" in proc.stdout, proc.stdout
    rows = {(bool(m[0]), int(m[1])): tuple(float(x) for x in m[2:]) for m in STEP.findall(proc.stdout)}
    assert sorted(rows) == [(False, 0), (False, 1), (False, 2), (True, 0), (True, 1), (True, 2)], rows
    for step in range(3):       # the printed figures agree (5 digits), and the loss moves: the steps did something
        assert rows[(False, step)] == rows[(True, step)], (step, rows)
    assert rows[(False, 2)][0] < rows[(False, 0)][0], rows
    weights = float(re.search(r"max \|weights - reference\| after 3 steps: ([0-9.e+-]+)", proc.stdout)[1])
    assert weights < 2e-5, proc.stdout
    assert os.path.isfile(out / "config.json") and os.path.isfile(out / "model.safetensors")
