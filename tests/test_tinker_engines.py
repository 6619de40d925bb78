"""vLLM engines behind the Tinker server's router beyond one single-worker engine (issue 58), driven by the
unmodified tinker SDK and tinker-cookbook:

- tinker-cookbook 0.6.1's RL loop (``tinker_cookbook.rl.train.main``, unmodified except ``loss_fn``:
  tests/tinker_cookbook_runs.py) against ``--sampler vllm --engines 2``: the reward rises as in
  tests/test_tinker_vllm.py's single-engine run, and both engines served its samples (vLLM's own request
  counters on each engine's ``/metrics``, read before and after);
- ``--engine-tp 2``: one engine with two tensor-parallel workers (vLLM's ``mp`` executor) behind the router; a
  LoRA client's ephemeral snapshot (nothing under ``--checkpoint-dir``) sampled there, prompt and sampled
  tokens' log-probs within 1e-4 of the trainer's forward, the base's log-probs differing by more than 1e-3
  (the check can fail); the engine's process group holds two workers (``VLLM::Worker_TP0`` / ``_TP1``);
- ``--engine-url``: an engine the test starts itself (as if on another host: its own served name, its own API
  key given to the server in ``PARALLM_ENGINE_API_KEY``), sampler snapshots read from ``--snapshot-dir``: a
  LoRA client's ephemeral snapshot sampled there within 1e-4 of the trainer (nothing under
  ``--checkpoint-dir``), the engine killed: the next sample an error naming it; the launch refusals (no
  ``--snapshot-dir``, beside ``--engines``, a wrong key: the engine refused at start naming it).

Each test starts its own server (tp1 trainer; vLLM-CPU engines take most of the wall time) and stops it in
``finally``. Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(1500)
RANK = 8
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
HERE = os.path.dirname(os.path.abspath(__file__))


def _start(work: str, model: str, extra: list[str], env=None) -> th.Server:
    """A tp1 server with the vLLM sampler and ``extra`` options, once its engines are ready."""
    srv = None
    for attempt in range(2):              # a free port taken by another process meanwhile: once more
        try:
            srv = th.Server(model, work, tp=1, sampler="vllm", lora_rank=RANK, extra=extra, timeout=600, env=env)
            break
        except RuntimeError as e:
            if attempt or "EADDRINUSE" not in str(e):
                raise
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key="tml-any")
        deadline = time.monotonic() + 900
        while not th.ready_info(srv)["sampler_ready"]:
            state = th.ready_info(srv)["sampler"]
            assert time.monotonic() < deadline and not state.startswith("failed"), (state, srv.tail())
            time.sleep(1)
        srv.engines = th.ready_info(srv)["engine_urls"]
        srv.engine_pids = th.ready_info(srv)["engine_pids"]
        return srv
    except BaseException:
        srv.stop()
        raise


def _ephemeral_snapshot_check(srv, model, work, *, seed, what, samples):
    """A LoRA client of ``srv`` after two AdamW steps, its ephemeral snapshot (nothing written under
    ``--checkpoint-dir``): prompt log-probs and, with ``samples``, the sampled tokens' within 1e-4 of the trainer's
    forward, the base model's more than 1e-3 away (the check can fail). Returns (sampling client, prompt)."""
    tc = srv.client.create_lora_training_client(base_model=model, rank=RANK, seed=seed).result()
    g = np.random.default_rng(seed)
    for _ in range(2):
        tc.forward_backward([th.next_token_datum(g.integers(3, 99, 12).tolist()) for _ in range(4)],
                            "cross_entropy").result()
        tc.optim_step(ADAM).result()
    prompt = g.integers(3, 99, 10).tolist()
    want = th.forward_logprobs(tc, prompt)
    ckpt = os.path.join(work, "ckpt")
    files = th.file_sizes(ckpt)
    sc = tc.save_weights_and_get_sampling_client().result()
    assert th.file_sizes(ckpt) == files, "an ephemeral snapshot wrote under --checkpoint-dir"
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert lp[0] is None
    worst = float(np.abs(np.array(lp[1:]) - want).max())
    if samples:
        res = sc.sample(types.ModelInput.from_ints(prompt), samples,
                        types.SamplingParams(max_tokens=6, seed=3, stop=[])).result()
        for s in res.sequences:
            got = th.forward_logprobs(tc, prompt + s.tokens)[len(prompt) - 1:]
            worst = max(worst, float(np.abs(np.array(s.logprobs) - got).max()))
    print(f"{what}, ephemeral snapshot: max |log-prob - trainer| =", worst)
    assert worst < 1e-4
    base = srv.client.create_sampling_client(base_model=model).result()
    blp = np.array(base.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    assert np.abs(blp - want).max() > 1e-3        # the check can fail: the base's log-probs differ
    return sc, prompt


def _group_titles(pgid: int) -> list[str]:
    """The command names (process titles) of every process in process group ``pgid``."""
    out = subprocess.run(["ps", "-e", "-o", "pgid=,args="], capture_output=True, text=True).stdout
    return [line.split(None, 1)[1] for line in out.splitlines()
            if line.split(None, 1)[0] == str(pgid) and len(line.split(None, 1)) > 1]


def test_cookbook_rl_loop_with_two_engines(tmp_path):
    work = str(tmp_path)
    model = th.tiny_model(os.path.join(work, "model"), seed=4)
    srv = _start(work, model, ["--engines", "2"])
    try:
        assert len(srv.engines) == 2
        before = [th.vllm_served(u) for u in srv.engines]
        log_dir = os.path.join(work, "rl")
        env = dict(os.environ, TINKER_API_KEY="tml-any", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        run = subprocess.run([sys.executable, os.path.join(HERE, "tinker_cookbook_runs.py"), "rl", srv.url,
                              srv.model, log_dir, "8"], env=env, capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        with open(os.path.join(log_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        reward = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
        served = [th.vllm_served(u) - b for u, b in zip(srv.engines, before)]
        print("cookbook rl (two engines) env/all/reward/total by step:", [round(x, 3) for x in reward],
              "; requests served per engine:", served)
        assert len(reward) == 8 and np.mean(reward[-3:]) > np.mean(reward[:2]) + 0.2
        assert all(s >= 1 for s in served), f"both engines must serve the loop's samples: {served}"
    finally:
        srv.stop()


def test_engine_tp2_ephemeral_snapshot(tmp_path):
    work = str(tmp_path)
    model = th.tiny_model(os.path.join(work, "model"), seed=6)
    srv = _start(work, model, ["--engine-tp", "2"])
    try:
        titles = _group_titles(srv.engine_pids[0])
        workers = sorted(t for t in titles if re.search(r"Worker_TP\d", t))
        print("the engine's processes:", titles)
        assert len(workers) == 2, f"the engine must run two tensor-parallel workers: {titles}"
        _ephemeral_snapshot_check(srv, model, work, seed=3, what="engine tp2", samples=2)
    finally:
        srv.stop()


def _refusal(model: str, work: str, extra: list[str], env=None) -> str:
    run = subprocess.run([sys.executable, "-m", "parallm.integrations.tinker", "--model", model, "--port", "0",
                          "--checkpoint-dir", os.path.join(work, "ckpt"), *extra], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, **(env or {})))
    assert run.returncode != 0, run.stdout[-2000:]
    return run.stdout + run.stderr


def test_engine_started_elsewhere(tmp_path):
    from parallm.integrations.vllm.serve import serve
    work = str(tmp_path)
    model = th.tiny_model(os.path.join(work, "model"), seed=7)
    snaps = os.path.join(work, "snapshots")
    os.makedirs(snaps)
    assert "give --snapshot-dir" in _refusal(model, work, ["--engine-url", "http://127.0.0.1:1"])
    assert "not offered beside it" in _refusal(model, work, ["--engine-url", "http://127.0.0.1:1", "--snapshot-dir",
                                                             snaps, "--engines", "2"])
    key = secrets.token_urlsafe(16)
    engine = serve(model, max_model_len=256, dev_mode=False, timeout=900,
                   args=["--enable-lora", "--max-lora-rank", str(RANK), "--max-logprobs", "64",
                         "--served-model-name", "someone-elses-name"],
                   env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": key,
                        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"})
    srv = None
    try:
        os.makedirs(os.path.join(work, "bad"))
        bad = th.Server(model, os.path.join(work, "bad"), tp=1, sampler="vllm", lora_rank=RANK, timeout=600,
                        extra=["--engine-url", engine.url, "--snapshot-dir", snaps, "--max-context", "256"],
                        env={"PARALLM_ENGINE_API_KEY": "wrong"})
        try:
            deadline = time.monotonic() + 120
            while not th.ready_info(bad)["sampler"].startswith("failed"):
                assert time.monotonic() < deadline, th.ready_info(bad)
                time.sleep(1)
            assert "refused the key" in th.ready_info(bad)["sampler"] and engine.url in th.ready_info(bad)["sampler"]
        finally:
            bad.stop()
        srv = _start(work, model, ["--engine-url", engine.url, "--snapshot-dir", snaps, "--max-context", "256"],
                     env={"PARALLM_ENGINE_API_KEY": key})
        assert srv.engines == [engine.url]
        sc, prompt = _ephemeral_snapshot_check(srv, model, work, seed=5, what="engine started elsewhere", samples=0)
        written = [f for f in th.file_sizes(snaps) if f.endswith("adapter_model.safetensors")]
        assert written, "the snapshot the engine loaded is not under --snapshot-dir"
        engine.kill()
        with pytest.raises(Exception) as err:
            sc.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1)).result()
        assert engine.url in str(err.value), str(err.value)
        assert srv.proc.poll() is None, "the server must outlive an engine it did not start"
        srv.stop()
        assert not os.listdir(snaps), f"the server left snapshots behind: {os.listdir(snaps)}"
    finally:
        if srv is not None:
            srv.stop()
        engine.stop()
