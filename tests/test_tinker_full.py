"""Full-fine-tuning clients of parallm's Tinker server (issue 58, item 1): a LoRA rank of 0 through the unmodified
``tinker`` SDK 0.38 (``create_lora_training_client(base_model, rank=0)``) trains every parameter with AdamW. A
tiny Qwen3 served at tp2 on two CPU ranks (the parallm sampler), started once for the module and stopped in
``finally``; references computed here: transformers (fp32) with the documented losses and
``torch.optim.AdamW`` over every parameter.

Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import json
import os
import urllib.request

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(900)
KEY = "tml-parallm-full"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1,
        "grad_clip_norm": 0.5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker-full"))
    model = th.tiny_model(os.path.join(work, "model"), seed=5)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=4, api_key=KEY)
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        yield srv
    finally:
        srv.stop()


def _full(server):
    return server.client.create_lora_training_client(base_model=server.model, rank=0).result()


def _unload(server, tc):
    req = urllib.request.Request(f"{server.url}/api/v1/unload_model", method="POST",
                                 data=json.dumps({"model_id": tc.model_id}).encode(),
                                 headers={"X-API-Key": KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        rid = json.loads(r.read())["request_id"]
    req = urllib.request.Request(f"{server.url}/api/v1/retrieve_future", method="POST",
                                 data=json.dumps({"request_id": rid}).encode(),
                                 headers={"X-API-Key": KEY, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.read())["type"] == "unload_model"


def _data(seed, n=3, *, loss="cross_entropy", lps=None):
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(g.integers(6, 14))
        full = g.integers(3, 99, length + 1)
        x, y = full[:-1].astype(np.int64), full[1:].astype(np.int64)
        weights, noise, adv = (g.random(length) > 0.25).astype(np.float32), g.normal(0, 0.3, length), \
            g.normal(0, 1, length).astype(np.float32)          # drawn alike for every loss: the same tokens
        inputs = {"target_tokens": y}
        if loss == "cross_entropy":
            inputs["weights"] = weights
        else:
            inputs["logprobs"] = (lps[i] + noise).astype(np.float32)
            inputs["advantages"] = adv
            if loss == "gspo":
                inputs["sequence_ratio_mask"] = (np.arange(length) >= 2).astype(np.float32)
        out.append((x.tolist(), inputs))
    return out


def _datums(data):
    return [types.Datum(model_input=types.ModelInput.from_ints(x), loss_fn_inputs=dict(inp)) for x, inp in data]


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _weights(directory) -> dict:
    """Every tensor of a Hugging Face checkpoint directory (a full sampler snapshot)."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def _snapshot(server, tc, name):
    path = tc.save_weights_for_sampler(name).result().path
    return path, th.adapter_dir(server.work, path)


def _worst(got: dict, ref) -> float:
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def _forward_lp(tc, prompt):
    datum = (prompt[:-1], {"target_tokens": np.array(prompt[1:]), "weights": np.ones(len(prompt) - 1, np.float32)})
    return tc.forward(_datums([datum]), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


LOSSES = [("cross_entropy", None), ("ppo", None), ("importance_sampling", None), ("cispo", None),
          ("dro", {"beta": 0.5}), ("gspo", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})]


def test_full_steps_equal_transformers_adamw_and_sampling_follows(server):
    """A step per loss of the server (cross_entropy, then the RL losses on the model's own log-probs; weight decay
    and clipping) against transformers + torch.optim.AdamW over every parameter: loss:sum, log-probs, gradient
    norm, every weight after the steps (<= 1e-5); the parallm sampler then samples the trained weights (its
    log-probs equal the trained model's), the base model's sampling client still the base."""
    tc = _full(server)
    info = tc.get_info()
    assert info.is_lora is False and info.lora_rank is None
    ref = _hf_model(server.model)
    opt, worst_lp, clipped, rel = None, 0.0, 0, [0.0, 0.0]
    for step, (loss_fn, config) in enumerate(LOSSES):
        probe = _data(300 + step)
        lps = [th.target_logprobs(ref, x, inp["target_tokens"]).detach().numpy() for x, inp in probe]
        data = _data(300 + step, loss=loss_fn, lps=lps)
        res = tc.forward_backward(_datums(data), loss_fn, config).result()
        got = tc.optim_step(types.AdamParams(**ADAM)).result()
        ref_loss, ref_lps, opt = th.reference_step(ref, data, loss_fn, config or {}, ADAM, opt)
        for out, want in zip(res.loss_fn_outputs, ref_lps):
            lp = out["logprobs"].to_numpy()
            worst_lp = max(worst_lp, float(np.abs(lp - want.numpy()).max()))
        assert worst_lp <= 1e-5, worst_lp
        assert abs(res.metrics["loss:sum"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (res.metrics, ref_loss)
        norm = th.reference_step.grad_norm
        rel = [max(rel[0], abs(res.metrics["loss:sum"] - ref_loss) / max(1.0, abs(ref_loss))),
               max(rel[1], abs(got.metrics["grad_norm:mean"] - norm) / norm)]
        assert abs(got.metrics["grad_norm:mean"] - norm) <= 1e-5 * norm, (got.metrics, norm)
        clipped += norm > ADAM["grad_clip_norm"]
    assert clipped >= 2, clipped                            # the clipping is exercised
    path, directory = _snapshot(server, tc, "after")
    weights = _weights(directory)
    worst = _worst(weights, ref)
    assert worst <= 1e-5, worst
    moved = _worst(weights, _hf_model(server.model))   # a break that must fail: the weights did move
    assert moved > 1e-3, moved
    print(f"full steps: log-probs {worst_lp:.2e}, loss {rel[0]:.2e} / grad norm {rel[1]:.2e} relative, weights "
          f"{worst:.2e} (moved {moved:.2e})")
    # the parallm sampler samples the trained weights: from the client's own model, then (after another step)
    # from the snapshot's files
    prompt = [5, 40, 41, 42, 7, 60, 61, 9, 22]
    with torch.no_grad():
        want = th.target_logprobs(ref, prompt[:-1], prompt[1:]).numpy()
    sc = server.client.create_sampling_client(model_path=path).result()
    np.testing.assert_allclose(np.array(sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:]),
                               want, atol=1e-5)
    np.testing.assert_allclose(_forward_lp(tc, prompt), want, atol=1e-5)
    tc.forward_backward(_datums(_data(310)), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**dict(ADAM, learning_rate=1e-2))).result()
    assert np.abs(_forward_lp(tc, prompt) - want).max() > 1e-3            # the client moved on
    np.testing.assert_allclose(np.array(sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:]),
                               want, atol=1e-5)                            # the snapshot did not
    base = _hf_model(server.model)
    with torch.no_grad():
        base_lp = th.target_logprobs(base, prompt[:-1], prompt[1:]).numpy()
    bc = server.client.create_sampling_client(base_model=server.model).result()
    np.testing.assert_allclose(np.array(bc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:]),
                               base_lp, atol=1e-5)
    res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, seed=3,
                                                                               stop=[])).result()
    for s in res.sequences:
        with torch.no_grad():
            lp = th.target_logprobs(ref, (prompt + s.tokens)[:-1], (prompt + s.tokens)[1:]).numpy()
        np.testing.assert_allclose(np.array(s.logprobs), lp[len(prompt) - 1:], atol=1e-4)
    _unload(server, tc)


def test_one_full_client_alone(server):
    """A second full client is refused while one lives, a LoRA client too; after unload_model a LoRA client is
    created, and a full client is then refused while it lives."""
    tc = _full(server)
    with pytest.raises(tinker.BadRequestError, match="second full-fine-tuning client is refused.*"
                                                     + tc.model_id.replace(":", ".")):
        _full(server)
    with pytest.raises(tinker.BadRequestError, match="a LoRA client is refused"):
        server.client.create_lora_training_client(base_model=server.model, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="train_attn.*False"):
        server.client.create_lora_training_client(base_model=server.model, rank=0, train_attn=False).result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    run = rest.get_training_run(tc.model_id).result()
    assert run.is_lora is False and run.lora_rank is None
    _unload(server, tc)
    with pytest.raises(tinker.NotFoundError, match="unknown model"):
        tc.forward(_datums(_data(1)), "cross_entropy").result()
    lora = server.client.create_lora_training_client(base_model=server.model, rank=4).result()
    assert lora.get_info().is_lora
    with pytest.raises(tinker.BadRequestError, match="full-fine-tuning client .rank 0. is refused.*LoRA client"):
        _full(server)
    _unload(server, lora)


def _train(tc, seeds):
    for s in seeds:
        tc.forward_backward(_datums(_data(s)), "cross_entropy").result()
        tc.optim_step(types.AdamParams(**ADAM)).result()


def test_save_load_resumes_bit_exactly(server):
    """save_state then load_state_with_optimizer (into the client itself, and into a new client after unload):
    the next step's weights equal the uninterrupted run's bit for bit; load_state (weights only, fresh AdamW
    moments) must differ (a break that must fail)."""
    tc = _full(server)
    _train(tc, (400, 401))
    path = tc.save_state("resume").result().path
    _train(tc, (402,))
    want = _weights(_snapshot(server, tc, "continued")[1])
    tc.load_state_with_optimizer(path).result()
    _train(tc, (402,))
    again = _weights(_snapshot(server, tc, "again")[1])
    assert all(torch.equal(again[k], want[k]) for k in want)
    tc.load_state(path).result()                            # weights only: new moments
    _train(tc, (402,))
    other = _weights(_snapshot(server, tc, "fresh")[1])
    assert any(not torch.equal(other[k], want[k]) for k in want)
    info = tinker.RestClient(base_url=server.url, api_key=KEY).get_weights_info_by_tinker_path(path).result()
    assert info.is_lora is False
    _unload(server, tc)
    resumed = server.client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().is_lora is False
    _train(resumed, (402,))
    got = _weights(_snapshot(server, resumed, "resumed")[1])
    assert all(torch.equal(got[k], want[k]) for k in want)
    lora = None
    try:
        with pytest.raises(tinker.BadRequestError, match="a LoRA client is refused"):
            lora = server.client.create_lora_training_client(base_model=server.model, rank=4).result()
    finally:
        _unload(server, resumed)
        if lora is not None:
            _unload(server, lora)
