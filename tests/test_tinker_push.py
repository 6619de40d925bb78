"""Sampler snapshots in memory and several vLLM engines behind one router (issue 58, item 2), driven by the
unmodified tinker SDK against ``parallm serve-tinker --sampler vllm --engines 2 --full-engine`` (tp1 trainer,
three one-worker CPU engines), started once for the module and stopped in ``finally`` (what it leaves in /dev/shm removed):

- the router alone (fake engines, no vLLM): sessions spread over idle engines, a session sticks to its engine,
  load (requests in flight) decides a new session's engine, a dead engine's request errors and the session moves
  on; with a broken router (no stickiness / no failover) the same checks fail;
- the SDK's ephemeral ``save_weights_and_get_sampling_client`` of a LoRA client: nothing written under
  ``--checkpoint-dir`` (the tree compared file by file), the snapshot in the server's memory root (/dev/shm),
  sampled through both engines (vLLM's own request counters), log-probs within 1e-4 of the training forward;
- a full-fine-tuning client's ephemeral snapshots pushed into the ``--full-engine`` engine (``push_weights``),
  nothing written, log-probs within 1e-4 of the training forward; an earlier push's sampling client refused;
- a sampling session's requests all served by one engine (vLLM's counters);
- the newest 8 ephemeral snapshots kept in memory: the ninth save frees the first (directory gone, client
  refused);
- kill -9 of one engine while a request of it is in flight: that request errors naming the engine, the next
  requests (the same session's included) are served by the other engine.

Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402
from parallm.integrations.tinker.router import EngineRouter  # noqa: E402
from parallm.integrations.tinker.sampling import SampleJob, SamplerDead  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RANK = 8
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


# -- the router alone ---------------------------------------------------------------------------------------------

class FakeEngine:
    def __init__(self, i):
        self.i, self.url, self.dead = i, f"fake://{i}", None
        self.block = None                                  # an Event the next sample (only) waits on
        self.fail = False

    def sample(self, job):
        block, self.block = self.block, None
        if block is not None:
            assert block.wait(10)
        if self.fail:
            self.dead = f"engine {self.i} killed"
            raise SamplerDead(self.dead)
        return self.i

    def started(self):
        return True

    def alive(self):
        return self.dead is None

    def mark_dead(self):
        return self.dead

    def state(self):
        return "ready"

    def pid(self):
        return self.i

    def close(self):
        pass


def _job(session):
    return SampleJob(prompt=[3, 4], num_samples=1, params={}, prompt_logprobs=False, adapter_dir=None,
                     max_model_len=64, session=session)


def _check_routing(router) -> None:
    """Sessions alternate over idle engines and stick (also to a busier engine); a new session goes to the least
    loaded engine; a dead engine's request errors and its sessions move to the other engine."""
    e0, e1 = router.engines
    assert [router.sample(_job(s)) for s in ("a", "b", "a", "b")] == [0, 1, 0, 1]
    gate = e1.block = threading.Event()                    # a request of "b" in flight on engine 1
    t = threading.Thread(target=router.sample, args=(_job("b"),))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while router.inflight[1] == 0:
            assert time.monotonic() < deadline, "the blocked request never reached engine 1"
            time.sleep(0.01)
        assert router.sample(_job("c")) == 0               # load: engine 1 is busy
        assert router.sample(_job("b")) == 1               # stickiness beats load
    finally:
        gate.set()
        t.join(10)
    e0.fail = True
    with pytest.raises(SamplerDead, match="engine 0 of 2 .* died while serving this request"):
        router.sample(_job("a"))
    assert [router.sample(_job(s)) for s in ("a", "b", "c")] == [1, 1, 1]       # out of rotation
    e1.fail = True
    with pytest.raises(SamplerDead):
        router.sample(_job("a"))
    with pytest.raises(SamplerDead, match="every sampling engine is out of rotation"):
        router.sample(_job("b"))


def test_router_spreads_sticks_and_fails_over():
    _check_routing(EngineRouter([FakeEngine(0), FakeEngine(1)], watch_interval=0.05))


class _Forgetful(EngineRouter):
    def pick(self, key):                                   # break: no stickiness
        self.sessions.clear()
        return super().pick(key)


class _Stubborn(EngineRouter):
    def _take_out(self, i, why):                           # break: a dead engine stays in rotation
        pass

    def _live(self):
        return list(range(len(self.engines)))


@pytest.mark.parametrize("broken", [_Forgetful, _Stubborn])
def test_router_breaks_fail(broken):
    with pytest.raises((AssertionError, SamplerDead)):
        _check_routing(broken([FakeEngine(0), FakeEngine(1)], watch_interval=0.05))


# -- the server -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker_push"))
    model = th.tiny_model(os.path.join(work, "model"), seed=5)
    before = set(os.listdir("/dev/shm"))
    srv = None
    try:
        for attempt in range(2):              # a free port taken by another process meanwhile: once more
            try:
                srv = th.Server(model, work, tp=1, sampler="vllm", lora_rank=RANK, extra=["--engines", "2", "--full-engine"])
                break
            except RuntimeError as e:
                if attempt or "EADDRINUSE" not in str(e):
                    raise
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key="tml-any")
        deadline = time.monotonic() + 600
        while not th.ready_info(srv)["sampler_ready"]:
            assert time.monotonic() < deadline and not th.ready_info(srv)["sampler"].startswith("failed"), th.ready_info(srv)
            time.sleep(1)
        srv.engines = th.ready_info(srv)["engine_urls"]
        srv.engine_pids = th.ready_info(srv)["engine_pids"]
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        left = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("parallm-tinker-snapshots-")]
        assert not left, f"the server left its memory root in /dev/shm: {left}"


def _running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as res:
        text = res.read().decode()
    return sum(float(m) for m in re.findall(r'^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$', text, re.M))


def _trained(server, seed):
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=seed).result()
    g = np.random.default_rng(seed)
    for _ in range(2):
        tc.forward_backward([th.next_token_datum(g.integers(3, 99, 12).tolist()) for _ in range(4)], "cross_entropy").result()
        tc.optim_step(ADAM).result()
    return tc


def _unload(server, tc):
    def post(route, body):
        req = urllib.request.Request(f"{server.url}/api/v1/{route}", method="POST", data=json.dumps(body).encode(),
                                     headers={"X-API-Key": "tml-any", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    rid = post("unload_model", {"model_id": tc.model_id})["request_id"]
    assert post("retrieve_future", {"request_id": rid})["type"] == "unload_model"


def test_full_fine_tuning_snapshot_pushed(server):
    """First in the module (a full client lives alone on a server): its ephemeral snapshots pushed into the
    --full-engine engine (push_weights over parallm_shm), nothing written, sampled equal to the trainer's
    forward; a second push replaces the first, whose sampling client is then refused."""
    ckpt = os.path.join(server.work, "ckpt")
    tc = server.client.create_lora_training_client(base_model=server.model, rank=0).result()
    try:
        g = np.random.default_rng(3)
        prompt = g.integers(3, 99, 10).tolist()
        worst, clients = 0.0, []
        for step in range(2):
            tc.forward_backward([th.next_token_datum(g.integers(3, 99, 12).tolist()) for _ in range(3)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            files = th.file_sizes(ckpt)
            sc = tc.save_weights_and_get_sampling_client().result()
            assert th.file_sizes(ckpt) == files, "a pushed full snapshot wrote under --checkpoint-dir"
            clients.append(sc)
            want = th.forward_logprobs(tc, prompt)
            lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
            worst = max(worst, float(np.abs(np.array(lp[1:]) - want).max()))
            res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=5, seed=4,
                                                                                       stop=[])).result()
            for s in res.sequences:
                got = th.forward_logprobs(tc, prompt + s.tokens)[len(prompt) - 1:]
                worst = max(worst, float(np.abs(np.array(s.logprobs) - got).max()))
        print("full fine-tuning snapshot pushed: max |log-prob - trainer| =", worst)
        assert worst < 1e-4
        base = server.client.create_sampling_client(base_model=server.model).result()
        blp = np.array(base.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
        assert np.abs(blp - want).max() > 1e-3        # the check can fail: the base's log-probs differ
        with pytest.raises(Exception, match="no longer on the engine"):
            clients[0].compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    finally:
        _unload(server, tc)


def test_ephemeral_lora_snapshot_in_memory_through_two_engines(server):
    tc = _trained(server, 7)
    prompt = np.random.default_rng(1).integers(3, 99, 10).tolist()
    want = th.forward_logprobs(tc, prompt)
    ckpt = os.path.join(server.work, "ckpt")
    files = th.file_sizes(ckpt)
    counts = [th.vllm_served(u) for u in server.engines]
    clients = [tc.save_weights_and_get_sampling_client().result() for _ in range(2)]
    assert th.file_sizes(ckpt) == files, "an ephemeral snapshot wrote under --checkpoint-dir"
    roots = glob.glob("/dev/shm/parallm-tinker-snapshots-*")
    assert any(os.listdir(r) for r in roots), "no in-memory snapshot under /dev/shm"
    worst = 0.0
    for sc in clients:
        lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
        assert lp[0] is None
        worst = max(worst, float(np.abs(np.array(lp[1:]) - want).max()))
        res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=3,
                                                                                   stop=[])).result()
        for s in res.sequences:
            got = th.forward_logprobs(tc, prompt + s.tokens)[len(prompt) - 1:]
            worst = max(worst, float(np.abs(np.array(s.logprobs) - got).max()))
    print("ephemeral snapshot through two engines: max |log-prob - trainer| =", worst)
    assert worst < 1e-4
    delta = [th.vllm_served(u) - c for u, c in zip(server.engines, counts)]
    assert all(d >= 1 for d in delta), f"both engines must serve: {delta}"
    base = server.client.create_sampling_client(base_model=server.model).result()
    blp = np.array(base.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:])
    assert np.abs(blp - want).max() > 1e-3          # the check can fail: other weights give other log-probs


def test_a_session_sticks_to_one_engine(server):
    tc = _trained(server, 9)
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 6, 7, 8, 9, 10]
    counts = [th.vllm_served(u) for u in server.engines]
    for k in range(6):
        sc.compute_logprobs(types.ModelInput.from_ints(prompt + [11 + k])).result()
    delta = sorted(th.vllm_served(u) - c for u, c in zip(server.engines, counts))
    assert delta == [0, 6], f"one engine must serve all of a session's requests: {delta}"


def test_retired_memory_snapshots_are_freed(server):
    """--keep-sampler-snapshots (8) in memory: the ninth ephemeral save frees the first (its directory in
    /dev/shm gone, its sampling client refused)."""
    import urllib.parse
    tc = _trained(server, 13)
    mine = os.path.join("/dev/shm/parallm-tinker-snapshots-*", urllib.parse.quote(tc.model_id, safe="") + "-*")
    first = tc.save_weights_and_get_sampling_client().result()
    (first_dir,) = [d for d in glob.glob(mine) if not d.endswith("-engine")]
    for _ in range(8):
        tc.save_weights_and_get_sampling_client().result()
    kept = [d for d in glob.glob(mine) if not d.endswith("-engine")]
    assert len(kept) == 8 and first_dir not in kept, kept
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError), match="create a new one"):
        first.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()


def test_kill_one_engine(server):
    tc = _trained(server, 11)
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 6, 7, 8]
    counts = [th.vllm_served(u) for u in server.engines]
    sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    mine = [i for i, (u, c) in enumerate(zip(server.engines, counts)) if th.vllm_served(u) > c]
    assert len(mine) == 1
    victim, other = mine[0], 1 - mine[0]
    future = sc.sample(types.ModelInput.from_ints(prompt), 8, types.SamplingParams(max_tokens=400, seed=1, stop=[]))
    deadline = time.monotonic() + 120
    while _running(server.engines[victim]) < 1:
        assert time.monotonic() < deadline, "the request never ran on its engine"
        time.sleep(0.05)
    os.killpg(server.engine_pids[victim], signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError, match=f"engine {victim} of 2 .* died"):
        future.result()
    before = th.vllm_served(server.engines[other])
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()           # the same session, moved
    np.testing.assert_allclose(np.array(lp[1:]), th.forward_logprobs(tc, prompt), atol=1e-4)
    fresh = tc.save_weights_and_get_sampling_client().result()                      # a new snapshot, one engine
    fresh.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, seed=2)).result()
    assert th.vllm_served(server.engines[other]) - before >= 2
    health = json.loads(urllib.request.urlopen(server.url + "/api/v1/healthz", timeout=10).read())
    assert health["sampler"] == "ready", health
