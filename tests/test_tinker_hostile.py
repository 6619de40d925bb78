"""The Tinker server against a hostile (or merely careless) client (issue 54): one tp2 server for the module
(``parallm serve-tinker``, the parallm sampler, an API key, ``--keep-sampler-snapshots 4``), driven by the
``tinker`` SDK 0.38 and by raw HTTP where the SDK would not send what is tested:

- mixed requests for every loss: datums whose inputs are int64 and float32 arrays, some with per-token clip
  thresholds and some without, in one request: ``loss:sum`` and log-probs equal the datums sent alone, and the
  gradient (``grad_norm:mean`` and the adapters after an ``optim_step``) equals one client that sent them one by
  one;
- a request refused before it runs (a bad checkpoint name, a missing path, a malformed body) followed by a good
  one of the same client: the good one runs at once (< 2 s), not after the 60 s gap timeout;
- ``..`` in every route and ``tinker://`` path: nothing outside the checkpoint root is listed, read, loaded or
  deleted (a victim checkpoint beside the root stays);
- a zstd bomb and a sparse bomb: refused, rank 0's peak memory grows by < 64 MiB; an oversized body refused before
  it is read; a bad ``Content-Length``; the key checked before the body;
- sampling parameters out of range and ``num_samples x max_tokens`` over the cap refused; ``optim_step`` with
  nothing accumulated refused;
- a sampler snapshot saved again under its name: a new sampling client samples the new weights, the old one is
  refused (never the other weights); 200 unnamed snapshots with retention on: at most 4 kept on disk;
- the API key is in no rank's command line; start-up mistakes are one-line errors before any rank starts;
- last: ``kill -9`` of the launcher takes its ranks with it and frees the port.

The vLLM sampler's side (a snapshot overwritten under one name, its engine's own key) is in test_tinker_vllm.py.
Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(600)
RANK = 8
KEY = "tml-hostile-secret-key"
KEEP = 4
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker_hostile"))
    model = th.tiny_model(os.path.join(work, "model"), seed=5)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=RANK, cli=True,
                    env={"PARALLM_TINKER_API_KEY": KEY},      # the environment: in no process's command line
                    extra=("--keep-sampler-snapshots", str(KEEP), "--max-body-mb", "4"))
    try:
        srv.model, srv.work, srv.root = model, work, os.path.join(work, "ckpt")
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        victim = os.path.join(work, "weights", "victim")            # beside the root, shaped like a checkpoint
        os.makedirs(victim)
        with open(os.path.join(victim, "tinker.json"), "w") as f:
            json.dump({"base_model": model, "lora": {"rank": RANK}, "time": "2026-01-01T00:00:00+00:00"}, f)
        srv.victim = victim
        yield srv
    finally:
        srv.stop()


def _client(server, seed):
    return server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=seed,
                                                     train_unembed=False).result()


def _raw(server, method, path, body=b"", headers=None, *, key=KEY):
    """One request on a fresh connection, the path sent as it is (no normalisation of ``..``)."""
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in dict({"X-API-Key": key, "Content-Length": str(len(body))}, **(headers or {})).items():
            if v is not None:
                conn.putheader(k, v)
        conn.endheaders()
        if body:
            conn.send(body)
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data[:1] == b"{" else data)
    finally:
        conn.close()


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


# -- mixed requests ------------------------------------------------------------------------------------------------

def _mixed(loss_fn, seed):
    """Four datums: 0 and 2 with int64 inputs (0/1 weights, integer advantages and log-probs), 1 and 3 with
    fractional float32 ones; 1 and 2 with per-token clip thresholds where the loss takes them."""
    g = np.random.default_rng(seed)
    clip = loss_fn in ("ppo", "cispo", "gspo")
    out = []
    for i, n in enumerate((7, 11, 5, 9)):
        full = g.integers(3, 99, n + 1)
        ints = i % 2 == 0
        inp = {"target_tokens": full[1:].astype(np.int64)}
        if loss_fn == "cross_entropy":
            inp["weights"] = (g.random(n) > 0.3).astype(np.int64) if ints else \
                (g.random(n) * 0.9 + 0.05).astype(np.float32)
        else:
            inp["logprobs"] = g.integers(-6, -3, n).astype(np.int64) if ints else \
                (-4.6 + g.normal(0, 0.3, n)).astype(np.float32)
            inp["advantages"] = g.integers(-2, 3, n).astype(np.int64) if ints else \
                g.normal(0, 1, n).astype(np.float32)
            if loss_fn == "gspo":
                inp["sequence_ratio_mask"] = np.ones(n, np.int64 if ints else np.float32)
        if clip and i in (1, 2):
            inp["clip_low_threshold"] = np.full(n, 0.95, np.float32)
            inp["clip_high_threshold"] = np.full(n, 1.02, np.float32)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1].tolist()), loss_fn_inputs=inp))
    return out


@pytest.mark.parametrize("loss_fn,config", [("cross_entropy", None), ("importance_sampling", None), ("ppo", None),
                                            ("cispo", None), ("dro", {"beta": 0.4}), ("gspo", None)])
def test_mixed_request_equals_datums_alone(server, loss_fn, config):
    data = _mixed(loss_fn, seed=len(loss_fn))
    together, one_by_one = _client(server, 11), _client(server, 11)        # the same initial adapter
    out = together.forward_backward(data, loss_fn, config).result()
    alone = [one_by_one.forward_backward([d], loss_fn, config).result() for d in data]
    total = sum(a.metrics["loss:sum"] for a in alone)
    assert abs(out.metrics["loss:sum"] - total) <= 1e-5 * max(1.0, abs(total)), (out.metrics, total)
    for i, a in enumerate(alone):
        np.testing.assert_allclose(out.loss_fn_outputs[i]["logprobs"].to_numpy(),
                                   a.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=0, atol=1e-5)
    g1 = together.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    g2 = one_by_one.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    assert g1 > 0 and abs(g1 - g2) <= 1e-5 * g1, (g1, g2)
    a = th.adapter_tensors(th.adapter_dir(server.work, together.save_weights_for_sampler(f"mix-{loss_fn}-a")
                                          .result().path))
    b = th.adapter_tensors(th.adapter_dir(server.work, one_by_one.save_weights_for_sampler(f"mix-{loss_fn}-b")
                                          .result().path))
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, worst


# -- refusals do not stall the client -------------------------------------------------------------------------------

def test_refused_requests_do_not_hold_up_the_next(server):
    tc = _client(server, 21)
    good = _mixed("cross_entropy", seed=3)[:2]
    tc.forward_backward(good, "cross_entropy").result()
    mistakes = [lambda: tc.save_state("a/b").result(), lambda: tc.save_state("..").result(),
                lambda: tc.save_weights_for_sampler(".").result(),
                lambda: tc.load_state(f"tinker://{tc.model_id}/weights/never-saved").result(),
                lambda: tc.load_state("tinker://../weights/victim").result()]
    for mistake in mistakes:
        with pytest.raises((tinker.BadRequestError, tinker.NotFoundError, tinker.RequestFailedError)):
            mistake()
        t0 = time.monotonic()
        out = tc.forward_backward(good, "cross_entropy").result()
        took = time.monotonic() - t0
        assert out.metrics["loss:sum"] > 0 and took < 2.0, f"the next request took {took:.1f} s"
    assert os.path.isdir(server.victim)


# -- nothing outside the root ----------------------------------------------------------------------------------------

def test_dot_dot_in_every_route_and_path(server):
    tc = _client(server, 31)
    tc.forward_backward(_mixed("cross_entropy", seed=4)[:1], "cross_entropy").result()
    base = "/api/v1/training_runs"
    for method, path in (("GET", f"{base}/../checkpoints"), ("GET", f"{base}/./checkpoints"),
                         ("GET", f"{base}/.."), ("DELETE", f"{base}/../checkpoints/weights/victim"),
                         ("DELETE", f"{base}/{tc.model_id}/checkpoints/weights/../../../weights/victim"),
                         ("DELETE", f"{base}/{tc.model_id}/checkpoints/weights/..")):
        status, body = _raw(server, method, path)
        assert status in (400, 404), (method, path, status, body)
        assert "tinker_path" not in json.dumps(body), body          # nothing listed
    for route, body in (("weights_info", {"tinker_path": "tinker://../weights/victim"}),
                        ("weights_info", {"tinker_path": "tinker://./weights/x"})):
        status, out = _raw(server, "POST", f"/api/v1/{route}", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
        assert status == 400, (route, status, out)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    with pytest.raises(tinker.BadRequestError):
        server.client.create_training_client_from_state("tinker://../weights/victim").result()
    with pytest.raises(tinker.BadRequestError):
        server.client.create_sampling_client(model_path="tinker://../sampler_weights/victim").result().sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises((tinker.BadRequestError, tinker.NotFoundError, ValueError)):
        rest.delete_checkpoint_from_tinker_path("tinker://../weights/victim").result()
    assert os.path.isfile(os.path.join(server.victim, "tinker.json"))


# -- size ------------------------------------------------------------------------------------------------------------

def _fwd_request(model_id, tokens, inputs):
    from tinker.proto import tinker_public_pb2 as pb
    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy", forward_only=True)
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for name, fill in inputs.items():
        fill(d.loss_fn_inputs[name], pb)
    return req.SerializeToString()


def test_bombs_and_oversized_bodies(server):
    import zstandard
    pid = server.pid
    before = _peak_kib(pid)
    proto = {"Content-Type": "application/x-protobuf"}
    zeros = zstandard.ZstdCompressor(level=19).compressobj()          # ~2 GiB of zeros in a few tens of kB
    bomb = b"".join([zeros.compress(bytes(64 << 20)) for _ in range(32)] + [zeros.flush()])
    assert len(bomb) < 200_000
    status, body = _raw(server, "POST", "/api/v1/forward_backward", bomb, dict(proto, **{"Content-Encoding": "zstd"}))
    assert status == 413 and "expands past" in body["error"], (status, body)

    def csr(shape, crow_len):
        def fill(t, pb):
            t.dtype = pb.DTYPE_INT64
            t.shape.extend(shape)
            t.sparse_csr.crow_indices = np.zeros(crow_len, np.int64).tobytes()
        return fill

    def dense(values, dtype):
        def fill(t, pb):
            t.dtype = pb.DTYPE_INT64 if dtype == np.int64 else pb.DTYPE_FLOAT32
            t.shape.append(len(values))
            t.dense = np.asarray(values, dtype).tobytes()
        return fill
    tokens = list(range(3, 13))
    for shape, crow in (((20000, 5000), 20001), ((10, 10 ** 8), 11)):
        raw = _fwd_request("nope", tokens, {"target_tokens": csr(shape, crow),
                                            "weights": dense(np.ones(10), np.float32)})
        status, body = _raw(server, "POST", "/api/v1/forward_backward", raw, proto)
        assert status == 400 and "sparse" in body["error"], (status, body)
    grown = (_peak_kib(pid) - before) / 1024
    print(f"rank 0 peak RSS growth over the zstd and sparse bombs: {grown:.1f} MiB")
    assert grown < 64, f"rank 0's peak memory grew by {grown:.0f} MiB"
    # a body over the cap (--max-body-mb 4) is refused from its header, never read; so is a bad length
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode() +
                  b"\r\nContent-Type: application/x-protobuf\r\nContent-Length: 209715200\r\n\r\n")
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413") and "--max-body-mb" in head, head[:300]
    status, body = _raw(server, "POST", "/api/v1/telemetry", b"{}", {"Content-Length": "12abc"})
    assert status == 400 and "Content-Length" in body["error"]
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:          # wrong key: 401 before the body
        s.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-wrong\r\n"
                  b"Content-Length: 3000000\r\n\r\n")
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 401"), head[:200]
    assert (_peak_kib(pid) - before) / 1024 < 64


# -- parameters that cannot be honoured -------------------------------------------------------------------------------

def test_sampling_params_and_empty_steps_are_refused(server):
    sc = server.client.create_sampling_client(base_model=server.model).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    for params, message in ((types.SamplingParams(max_tokens=3, top_p=0.0), "top_p"),
                            (types.SamplingParams(max_tokens=3, temperature=-1.0), "temperature"),
                            (types.SamplingParams(max_tokens=0), "max_tokens"),
                            (types.SamplingParams(max_tokens=3, top_k=-5), "top_k")):
        with pytest.raises(tinker.BadRequestError, match=message):
            sc.sample(prompt, 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="max-sample-tokens"):
        sc.sample(prompt, 4096, types.SamplingParams(max_tokens=500)).result()
    res = sc.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=1, temperature=0.5, top_k=5)).result()
    assert all(len(s.tokens) == 3 for s in res.sequences)
    tc = _client(server, 41)
    with pytest.raises(tinker.RequestFailedError, match="no gradients accumulated"):
        tc.optim_step(types.AdamParams(**ADAM)).result()
    tc.forward_backward(_mixed("cross_entropy", seed=5)[:1], "cross_entropy").result()
    assert tc.optim_step(types.AdamParams(**ADAM)).result().metrics["grad_norm:mean"] > 0
    with pytest.raises(tinker.RequestFailedError, match="no gradients accumulated"):       # not twice
        tc.optim_step(types.AdamParams(**ADAM)).result()


# -- snapshots ---------------------------------------------------------------------------------------------------------

def test_snapshot_saved_again_under_its_name(server):
    tc = _client(server, 51)
    prompt = [5, 9, 12, 7, 3]
    tc.save_weights_for_sampler("latest").result()
    first = server.client.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/latest").result()
    lp0 = first.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    for _ in range(2):
        tc.forward_backward(_mixed("cross_entropy", seed=6), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()
    path = tc.save_weights_for_sampler("latest").result().path
    second = server.client.create_sampling_client(model_path=path).result()
    lp1 = second.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                                   loss_fn_inputs={"target_tokens": np.array(prompt[1:]),
                                                   "weights": np.ones(len(prompt) - 1, np.float32)})],
                      "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(lp1[1:]), want, atol=1e-5)        # the new weights
    assert np.abs(np.array(lp1[1:]) - np.array(lp0[1:])).max() > 1e-3
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError), match="create a new one"):
        first.compute_logprobs(types.ModelInput.from_ints(prompt)).result()


def test_unnamed_snapshots_are_retained_newest_k(server):
    tc = _client(server, 61)
    tc.forward_backward(_mixed("cross_entropy", seed=7)[:1], "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    from parallm.integrations.tinker.checkpoints import CheckpointStore
    base = os.path.join(CheckpointStore(server.root).run_dir(tc.model_id), "sampler_weights")
    t0 = time.monotonic()
    clients = [f.result() for f in [tc.save_weights_and_get_sampling_client() for _ in range(200)]]
    took = time.monotonic() - t0
    # unnamed snapshots live in the server's memory root (/dev/shm), never under --checkpoint-dir
    import glob
    import urllib.parse
    assert not os.path.isdir(base) or not os.listdir(base), os.listdir(base)
    mine = os.path.join("/dev/shm/parallm-tinker-snapshots-*", urllib.parse.quote(tc.model_id, safe="") + "-*")
    kept = [d for d in glob.glob(mine) if not d.endswith("-engine")]
    size = sum(os.path.getsize(os.path.join(d, f)) for k in kept for d, _, fs in os.walk(k) for f in fs)
    print(f"200 unnamed snapshots in {took:.1f} s: {len(kept)} kept, {size / 1e3:.0f} kB in memory")
    assert len(kept) == KEEP, kept
    lp = clients[-1].compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()      # the newest samples
    assert np.isfinite(np.array(lp[1:])).all()
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError), match="retired|gone"):
        clients[0].compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()


# -- the process side ------------------------------------------------------------------------------------------------

def test_key_is_on_no_command_line_and_healthz_names_the_sampler(server):
    pids = th.rank_pids(server) + [server.proc.pid]
    assert len(pids) == 3
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), pid
    status, body = _raw(server, "GET", "/api/v1/healthz")
    assert status == 200 and body["status"] == "ok" and body["sampler"] == "ready", body
    assert set(body) == {"status", "sampler", "cobatch"} and set(body["cobatch"]) == {"passes", "requests"}, body
    with open(server.ready) as f:
        assert json.load(f)["sampler_ready"] is True


def _start_fails(args, workdir, *, env=None):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "parallm", "serve-tinker", *args, "--checkpoint-dir",
                          os.path.join(workdir, "ck")], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **th.SERVER_ENV, **(env or {})))
    took = time.monotonic() - t0
    lines = [x for x in out.stderr.strip().splitlines() if x.strip()]
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-2000:]
    return lines[0], took


def test_startup_mistakes_are_one_line_errors(server, tmp_path):
    port = int(urlsplit(server.url).port)
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in os.listdir(server.model):
        if f.startswith(("config", "model")):
            os.symlink(os.path.join(server.model, f), no_tok / f)
    for args, message in ((["--model", server.model, "--port", str(port)], "in use"),
                          (["--model", str(tmp_path / "nothing")], "does not exist"),
                          (["--model", server.model, "--tp", "3", "--port", "0"], "tp=3"),
                          (["--model", str(no_tok), "--port", "0"], "needs a tokenizer"),
                          (["--model", server.model, "--port", "0", "--ep", "2"], "no routed experts")):
        line, took = _start_fails(args, str(tmp_path))
        assert message in line and line.startswith("parallm serve-tinker:"), line
        assert took < 30, f"{args}: {took:.1f} s"


def test_kill_9_of_the_launcher_takes_the_ranks(server):
    """Last: the module's server goes down here."""
    ranks = th.rank_pids(server)
    port = int(urlsplit(server.url).port)
    os.kill(server.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _alive(p) for p in ranks):
        time.sleep(0.2)
    assert not any(_alive(p) for p in ranks), "ranks outlived the launcher"
    for _ in range(50):                                 # nothing listens on the port any more (connections of
        try:                                            # the dead server may linger in TIME_WAIT / FIN_WAIT)
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"something still listens on port {port} after the launcher was killed")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False
