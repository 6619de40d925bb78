"""parallm's Tinker-API server with the ``tinker`` SDK (0.38) itself as the client: a tiny Qwen3 served at tp2 on
two CPU ranks (``parallm serve-tinker``, the parallm sampler), started once for the module and stopped in
``finally``. Against references computed in this process: transformers + PEFT on the same adapter and
``torch.optim.AdamW`` (each loss's value, log-probs and the adapters after a step), bit-exact comparisons where
the server must be deterministic (two clients interleaved = each alone, a save / load resume).

Runs in .venv-tinker (scripts/setup_tinker.sh; scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(600)
RANK = 8
KEY = "tml-parallm-test"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker"))
    model = th.tiny_model(os.path.join(work, "model"), seed=3)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=RANK, api_key=KEY, cli=True)   # parallm serve-tinker
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        yield srv
    finally:
        srv.stop()


def _client(server, seed, **kw):
    kw.setdefault("train_unembed", False)
    return server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=seed, **kw).result()


def _snapshot(server, tc, name):
    path = tc.save_weights_for_sampler(name).result().path
    return th.adapter_dir(server.work, path)


def _data(seed, n=3, vocab=99, *, loss="cross_entropy", lps=None):
    """``n`` datums of next-token targets; the same tokens for every loss of one seed (``lps``: the log-probs
    the sampler's are drawn around)."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(g.integers(6, 14))
        full = g.integers(3, vocab, length + 1)
        x, y = full[:-1].astype(np.int64), full[1:].astype(np.int64)
        weights = (g.random(length) > 0.25).astype(np.float32)
        noise, adv = g.normal(0, 0.3, length), g.normal(0, 1, length)
        inputs = {"target_tokens": y}
        if loss == "cross_entropy":
            inputs["weights"] = weights
        else:
            base = lps[i] if lps is not None else -np.full(length, 4.5)
            inputs["logprobs"] = (base + noise).astype(np.float32)
            inputs["advantages"] = adv.astype(np.float32)
            if loss == "gspo":
                inputs["sequence_ratio_mask"] = (np.arange(length) >= 2).astype(np.float32)
        out.append((x.tolist(), inputs))
    return out


def _datums(data):
    return [types.Datum(model_input=types.ModelInput.from_ints(x), loss_fn_inputs=dict(inp)) for x, inp in data]


def step_against_peft(srv, tc, ref, *, eps: float | None = None) -> tuple[float, float, float]:
    """A LoRA client against ``ref`` (transformers + PEFT on the client's fresh snapshot): the forward, one
    cross-entropy AdamW step (lr 1e-2; ``eps`` or ADAM's) against PEFT + torch AdamW (every factor within 5e-6), the
    forward after it, and the sampler's log-probs of the trained snapshot equal to the training forward; returns
    the three distances (forward before, factors, forward after)."""
    before = forward_against(tc, ref, _data(300), 2e-5)
    adam = dict(ADAM, learning_rate=1e-2, eps=ADAM["eps"] if eps is None else eps)
    data = _data(301)
    tc.forward_backward(_datums(data), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**adam)).result()
    th.reference_step(ref, data, "cross_entropy", {}, adam)
    factors = _close(th.adapter_tensors(_snapshot(srv, tc, "after")), th.peft_state(ref), atol=5e-6)
    after = forward_against(tc, ref, _data(302), 2e-5)
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 9, 12, 7, 3, 40, 41, 60, 61, 70, 12, 13]
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want = th.forward_logprobs(tc, prompt)
    np.testing.assert_allclose(np.array(lp[1:]), want, atol=1e-5)
    return before, factors, after


def forward_against(tc, ref, probe, atol):
    """The client's forward log-probs of ``probe`` against ``ref``'s (worst absolute difference, below ``atol``)."""
    fwd = tc.forward(_datums(probe), "cross_entropy").result()
    worst = 0.0
    for out, (x, inp) in zip(fwd.loss_fn_outputs, probe):
        want = th.target_logprobs(ref, x, inp["target_tokens"]).detach().numpy()
        worst = max(worst, float(np.abs(out["logprobs"].to_numpy() - want).max()))
    assert worst < atol, worst
    return worst


def _close(a: dict, b: dict, atol):
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    worst, key = max((float((a[k].float() - b[k].float()).abs().max()), k) for k in a)
    assert worst <= atol, f"adapters differ by {worst:.3g} ({key}; {sum(float((a[k].float() - b[k].float()).abs().max()) > atol for k in a)} of {len(a)} tensors over)"
    return worst


LOSSES = [("cross_entropy", None), ("importance_sampling", None), ("ppo", None),
          ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", None), ("dro", {"beta": 0.5}),
          ("gspo", None)]


@pytest.mark.parametrize("loss_fn,config", LOSSES)
def test_loss_step_equals_peft_and_adamw(server, loss_fn, config):
    """forward_backward's loss:sum and log-probs, and the adapters after optim_step, against transformers + PEFT
    on the same adapter with the documented loss and torch.optim.AdamW."""
    seed = 10 + LOSSES.index((loss_fn, config))
    _check_step(server, _client(server, seed), loss_fn, config, seed)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_default_client_trains_the_output_head(server, loss_fn):
    """The SDK's default client (train_unembed=True: LoRA on the output head too, issue 54) against PEFT with
    lm_head among its target modules: loss, log-probs, gradient norm, every factor after the step (the head's
    included, which moves), and the parallm sampler's log-probs of the snapshot equal to the training forward."""
    seed = 40 + len(loss_fn)
    tc = server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=seed).result()
    assert tc.get_info().lora_rank == RANK
    _check_step(server, tc, loss_fn, None, seed)
    after = th.adapter_tensors(_snapshot(server, tc, "head-after"))
    heads = {k: v for k, v in after.items() if ".lm_head." in k}
    assert len(heads) == 2 and float(heads[next(k for k in heads if "lora_B" in k)].abs().max()) > 0
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 9, 12, 7, 3, 40, 41]
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want = tc.forward(_datums([(prompt[:-1], {"target_tokens": np.array(prompt[1:]),
                                              "weights": np.ones(len(prompt) - 1, np.float32)})]),
                      "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(lp[1:]), want, atol=1e-5)


def test_topk_logprobs_equal_transformers(server):
    """Top-k log-probs (issue 58) of a trained snapshot and of the base model, from the parallm sampler, against
    transformers + PEFT's top-k of the same logits."""
    tc = _client(server, 71)
    tc.forward_backward(_datums(_data(71)), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**dict(ADAM, learning_rate=1e-2))).result()
    path = tc.save_weights_for_sampler("topk").result().path
    prompt = [5, 9, 12, 7, 3, 40, 41, 22]
    th.check_topk(server.client.create_sampling_client(model_path=path).result(), server.model,
                  th.adapter_dir(server.work, path), prompt)
    th.check_topk(server.client.create_sampling_client(base_model=server.model).result(), server.model, None,
                  prompt)
    with pytest.raises(tinker.BadRequestError, match="0 to 64"):
        server.client.create_sampling_client(base_model=server.model).result().sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2),
            topk_prompt_logprobs=65).result()


def _check_step(server, tc, loss_fn, config, seed):
    ref = th.peft_model(server.model, _snapshot(server, tc, "init"))
    probe = _data(seed, loss="cross_entropy")
    lps = [th.target_logprobs(ref, x, inp["target_tokens"]).detach().numpy() for x, inp in probe]
    data = _data(seed, loss=loss_fn, lps=lps)
    if loss_fn == "cross_entropy":      # one datum whose targets are not the next tokens: the logits path
        x, inp = data[0]
        data.append((x, dict(inp, target_tokens=np.roll(inp["target_tokens"], 3))))
    res = tc.forward_backward(_datums(data), loss_fn, config).result()
    step = tc.optim_step(types.AdamParams(**ADAM)).result()
    ref_loss, ref_lps, _ = th.reference_step(ref, data, loss_fn, config or {}, ADAM)
    for out, want in zip(res.loss_fn_outputs, ref_lps):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), want.numpy(), atol=2e-5, rtol=0)
    # the loss as the documentation defines it, on the server's own log-probs, and against PEFT's
    mine = sum(float(th.reference_loss(loss_fn, torch.as_tensor(out["logprobs"].to_numpy(), dtype=torch.float64),
                                       {k: torch.as_tensor(v, dtype=torch.float64) for k, v in inp.items()},
                                       config or {})) for out, (_, inp) in zip(res.loss_fn_outputs, data))
    assert abs(res.metrics["loss:sum"] - mine) <= 1e-5 * max(1.0, abs(mine))
    assert abs(res.metrics["loss:sum"] - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
    assert abs(step.metrics["grad_norm:mean"] - th.reference_step.grad_norm) <= 1e-5 * th.reference_step.grad_norm
    _close(th.adapter_tensors(_snapshot(server, tc, "after")), th.peft_state(ref), atol=2e-6)


def test_adamw_steps_weight_decay_clipping_then_forward(server):
    """Two steps with weight decay and gradient clipping, then forward: torch AdamW over PEFT. (eps 1e-6: with
    1e-8 the clipped second step's smallest gradients, about 1e-8, make AdamW's update of those entries follow
    fp32 rounding; 1.6e-5 apart at lr 3e-3 was seen, the forward still within 2e-5.)"""
    adam = dict(ADAM, weight_decay=0.1, grad_clip_norm=0.05, learning_rate=3e-3, eps=1e-6)
    tc = _client(server, 21)
    ref = th.peft_model(server.model, _snapshot(server, tc, "init"))
    opt = None
    for step in range(2):
        data = _data(100 + step)
        tc.forward_backward(_datums(data), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**adam)).result()
        _, _, opt = th.reference_step(ref, data, "cross_entropy", {}, adam, opt)
    probe = _data(200)
    fwd = tc.forward(_datums(probe), "cross_entropy").result()
    for out, (x, inp) in zip(fwd.loss_fn_outputs, probe):
        want = th.target_logprobs(ref, x, inp["target_tokens"]).detach().numpy()
        np.testing.assert_allclose(out["logprobs"].to_numpy(), want, atol=2e-5, rtol=0)
    _close(th.adapter_tensors(_snapshot(server, tc, "after")), th.peft_state(ref), atol=5e-6)


def test_sampler_logprobs_match_training_forward(server):
    tc = _client(server, 31)
    tc.forward_backward(_datums(_data(31)), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**dict(ADAM, learning_rate=1e-2))).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 40, 41, 42, 7, 60, 61, 9, 22]
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    fwd = tc.forward(_datums([(prompt[:-1], {"target_tokens": np.array(prompt[1:]),
                                             "weights": np.ones(len(prompt) - 1, np.float32)})]),
                     "cross_entropy").result()
    assert lp[0] is None
    np.testing.assert_allclose(np.array(lp[1:]), fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)
    res = sc.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, seed=5, stop=[]),
                    include_prompt_logprobs=True).result()
    assert len(res.sequences) == 3 and all(len(s.tokens) == 6 and s.stop_reason == "length" for s in res.sequences)
    np.testing.assert_allclose(np.array(res.prompt_logprobs[1:]), np.array(lp[1:]), atol=1e-5)
    for s in res.sequences:                       # the sampled tokens' log-probs: the trainer's forward on them
        full = prompt + s.tokens
        got = tc.forward(_datums([(full[:-1], {"target_tokens": np.array(full[1:]),
                                               "weights": np.ones(len(full) - 1, np.float32)})]),
                         "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
        np.testing.assert_allclose(np.array(s.logprobs), got, atol=1e-4)
    again = sc.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, seed=5, stop=[]))
    assert [s.tokens for s in again.result().sequences] == [s.tokens for s in res.sequences]     # seeded
    th.check_sampling_params(sc, prompt, lambda toks: tc.forward(_datums([(toks[:-1], {
        "target_tokens": np.array(toks[1:]), "weights": np.ones(len(toks) - 1, np.float32)})]),
        "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())


def _train(tc, seeds, *, fail_at=None):
    for k, s in enumerate(seeds):
        tc.forward_backward(_datums(_data(s)), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()


def test_two_clients_at_once_equal_each_alone(server):
    """Clients A and B interleaved request by request (B also sends bad requests in between) train exactly as
    client C alone with A's seed and data: the adapters bit for bit."""
    a, b = _client(server, 41), _client(server, 42, train_attn=False)
    for s in (300, 301):
        fa = a.forward_backward(_datums(_data(s)), "cross_entropy")
        fb = b.forward_backward(_datums(_data(s + 50)), "cross_entropy")
        bad = b.forward_backward(_datums(_data(s, vocab=500)), "cross_entropy")     # tokens out of range
        oa, ob = a.optim_step(types.AdamParams(**ADAM)), b.optim_step(types.AdamParams(**ADAM))
        fa.result(), fb.result(), oa.result(), ob.result()
        with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
            bad.result()
    c = _client(server, 41)
    _train(c, (300, 301))
    ta, tc_ = th.adapter_tensors(_snapshot(server, a, "two-a")), th.adapter_tensors(_snapshot(server, c, "two-c"))
    assert all(torch.equal(ta[k], tc_[k]) for k in ta)
    tb = th.adapter_tensors(_snapshot(server, b, "two-b"))
    attn = [k for k in tb if ".self_attn." in k]
    assert attn and all(not tb[k].any() for k in attn)       # train_attn=False: those adapters stay zero
    assert any(tb[k].any() for k in tb if ".mlp." in k and "lora_B" in k)


def test_save_load_resumes_bit_exactly(server):
    tc = _client(server, 51)
    _train(tc, (400, 401))
    path = tc.save_state("resume").result().path
    assert path.endswith("/weights/resume")
    _train(tc, (402,))
    want = th.adapter_tensors(_snapshot(server, tc, "continued"))
    resumed = server.client.create_training_client_from_state_with_optimizer(path).result()
    _train(resumed, (402,))
    got = th.adapter_tensors(_snapshot(server, resumed, "resumed"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh = server.client.create_training_client_from_state(path).result()          # weights only: new moments
    _train(fresh, (402,))
    other = th.adapter_tensors(_snapshot(server, fresh, "fresh"))
    assert any(not torch.equal(other[k], want[k]) for k in want)
    ckpts = tinker.RestClient(base_url=server.url, api_key=KEY).list_checkpoints(tc.model_id).result().checkpoints
    assert {"weights/resume", "sampler_weights/continued"} <= {c.checkpoint_id for c in ckpts}
    info = tinker.RestClient(base_url=server.url, api_key=KEY).get_weights_info_by_tinker_path(path).result()
    assert info.lora_rank == RANK and info.is_lora


def test_forward_backward_custom_equals_builtin(server):
    """The SDK runs a custom loss on the client (a forward, then a cross_entropy request with weights
    -dC/dlogprobs): sum(-logprobs * w) as a custom loss steps exactly like the built-in cross_entropy."""
    data = _data(500)
    a, b = _client(server, 61), _client(server, 61)
    a.forward_backward(_datums(data), "cross_entropy").result()
    a.optim_step(types.AdamParams(**ADAM)).result()

    def custom(ds, logprobs):
        loss = sum((-lp * torch.as_tensor(d.loss_fn_inputs["weights"].to_numpy())).sum() for d, lp in zip(ds, logprobs))
        return loss, {"custom:sum": float(loss.detach())}
    out = b.forward_backward_custom(_datums(data), custom).result()
    b.optim_step(types.AdamParams(**ADAM)).result()
    assert "custom:sum" in out.metrics
    _close(th.adapter_tensors(_snapshot(server, a, "builtin")), th.adapter_tensors(_snapshot(server, b, "custom")),
           atol=1e-6)


def test_async_futures(server):
    async def run():
        tc = await server.client.create_lora_training_client(base_model=server.model, rank=RANK, seed=71,
                                                             train_unembed=False)
        fb = tc.forward_backward(_datums(_data(600)), "cross_entropy")
        st = tc.optim_step(types.AdamParams(**ADAM))
        return await fb, await st
    fb, st = asyncio.run(run())
    assert fb.metrics["loss:sum"] > 0 and st.metrics["grad_norm:mean"] > 0


@pytest.mark.parametrize("loss_fn,data,config,message", [
    ("stable_reinforce", "rl", None, "stable_reinforce is not offered"),
    ("reinforce", "ce", None, "unknown loss_fn 'reinforce'"),
    ("cross_entropy", "short", None, "has shape"),
    ("cross_entropy", "rl", None, r"lacks loss_fn_inputs \['weights'\]"),
    ("cross_entropy", "extra", None, r"loss_fn_inputs \['mask'\] this loss does not take"),
    ("dro", "rl", None, "needs loss_fn_config"),
    ("ppo", "rl", {"epsilon": 0.2}, "unknown loss_fn_config key 'epsilon'"),
])
def test_bad_requests_fail_with_the_sdk_error(server, loss_fn, data, config, message):
    tc = _client(server, 81)
    if data == "rl":
        d = _datums(_data(1, loss="ppo"))
    elif data == "extra":
        x, inp = _data(1)[0]
        d = _datums([(x, dict(inp, mask=inp["weights"]))])
    elif data == "short":
        x, inp = _data(1)[0]
        d = _datums([(x, dict(inp, weights=inp["weights"][:-1]))])
    else:
        d = _datums(_data(1))
    with pytest.raises(tinker.RequestFailedError, match=message):
        tc.forward_backward(d, loss_fn, config).result()
    tc.forward_backward(_datums(_data(2)), "cross_entropy").result()        # the client goes on


def test_bad_clients_and_routes(server):
    with pytest.raises(tinker.BadRequestError, match="--lora-rank 8"):
        server.client.create_lora_training_client(base_model=server.model, rank=16, train_unembed=False).result()
    with pytest.raises(tinker.BadRequestError, match="serves"):
        server.client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=RANK,
                                                  train_unembed=False).result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert caps.supported_models[0].model_name == server.model
    import httpx
    r = httpx.post(server.url + "/api/v1/no_such_route", json={}, headers={"X-API-Key": KEY})
    assert r.status_code == 404 and "not offered by parallm's Tinker server" in r.json()["error"]
    r = httpx.post(server.url + "/api/v1/client/config", json={"sdk_version": "0.41.0"}, headers={"X-API-Key": KEY})
    assert r.status_code == 400 and "0.38" in r.json()["error"]
    r = httpx.post(server.url + "/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                                  "sdk_version": "0.38.0"},
                   headers={"X-API-Key": "tml-wrong"})
    assert r.status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(
            base_model=server.model, rank=RANK, train_unembed=False).result()



def test_responses_leave_at_once(server):
    """Every response leaves in full as soon as it is written: on a kept-alive connection (as the SDK holds them)
    a request answers in milliseconds, small bodies and one larger than a write buffer (a forward's result of 8
    datums of 400 tokens: 13 kB, fetched again with ``retrieve_future``). With Nagle's algorithm on the server's
    socket, the response's last piece waited for the client's delayed ACK of the piece before it: about 40 ms
    per response on Linux (issue 47's server overhead)."""
    from tinker.proto import tinker_public_pb2 as pb
    tc = _client(server, 91)
    g = np.random.default_rng(91)
    req = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, loss_fn="cross_entropy", forward_only=True)
    for _ in range(8):                       # the SDK's protobuf, written here: the future's id is needed
        full = g.integers(3, 99, 401)
        d = req.data.add()
        d.model_input.add().encoded_text.tokens = full[:-1].astype(np.int32).tobytes()
        for name, v, dtype in (("target_tokens", full[1:].astype(np.int64), pb.DTYPE_INT64),
                               ("weights", np.ones(400, np.float32), pb.DTYPE_FLOAT32)):
            t = d.loss_fn_inputs[name]
            t.dtype, t.dense = dtype, v.tobytes()
            t.shape.append(400)
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    head = {"X-API-Key": KEY, "Content-Type": "application/json"}
    times = {}
    try:
        conn.request("POST", "/api/v1/forward_backward", body=req.SerializeToString(),
                     headers=dict(head, **{"Content-Type": "application/x-protobuf"}))
        r = conn.getresponse()
        rid = json.loads(r.read())["request_id"]
        for method, path, body in (("GET", "/api/v1/healthz", None), ("POST", "/api/v1/telemetry", b"{}"),
                                   ("POST", "/api/v1/retrieve_future", json.dumps({"request_id": rid}).encode())):
            times[path] = []
            for _ in range(24):
                t0 = time.perf_counter()
                conn.request(method, path, body=body, headers=head)
                r = conn.getresponse()
                size = len(r.read())
                assert r.status == 200 and size > 0
                times[path].append(time.perf_counter() - t0)
            if path.endswith("retrieve_future"):       # the forward's log-probs (the first call waited for it)
                assert size > 4 * 400 * 8, size
    finally:
        conn.close()
    for path, t in times.items():
        median = sorted(t[4:])[len(t[4:]) // 2]          # the first few: Linux's quick-ACK mode of a new connection
        assert median < 0.02, f"{path}: median response time {median * 1e3:.1f} ms over a kept-alive connection " \
                              f"(all, ms: {[round(x * 1e3, 1) for x in t]})"
