"""LoRA rank per client (integrations/tinker/ranks.py): one server holding rank-8 adapters (``--lora-rank 8``,
the parallm sampler), a tiny Qwen3 at tp2, the SDK as the client. Clients of rank 4 and 2 interleaved request by
request, each against transformers + PEFT at its own rank (PEFT reads ``r`` and ``lora_alpha`` from the
snapshot: scaling alpha / r) with torch's AdamW: log-probs, ``loss:sum``, the gradient norm, the adapters after
each step; each equal bit for bit to the same client trained alone; the rank-r snapshot (config and tensors);
``get_info``; a sampler snapshot's log-probs against the training forward; a training checkpoint loaded back
(rank restored, bit-exact resume); a rank above the server's refused with the SDK's error.

Runs in .venv-tinker (scripts/setup_tinker.sh)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(600)
HELD, ALPHA = 8, 32
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.05, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker-ranks"))
    model = th.tiny_model(os.path.join(work, "model"), seed=4)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=HELD)
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key="tml-any")
        yield srv
    finally:
        srv.stop()


def _client(server, rank, seed, **kw):
    return server.client.create_lora_training_client(base_model=server.model, rank=rank, seed=seed,
                                                     train_unembed=False, **kw).result()


def _data(seed, n=3):
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(g.integers(5, 14))
        full = g.integers(3, 99, length + 1)
        out.append((full[:-1].tolist(), {"target_tokens": full[1:].astype(np.int64),
                                         "weights": (g.random(length) > 0.25).astype(np.float32)}))
    return out


def _datums(data):
    return [types.Datum(model_input=types.ModelInput.from_ints(x), loss_fn_inputs=dict(inp)) for x, inp in data]


def _snapshot(server, tc, name):
    return th.adapter_dir(server.work, tc.save_weights_for_sampler(name).result().path)


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_interleaved_against_peft_and_alone(server):
    clients = {4: _client(server, 4, seed=11), 2: _client(server, 2, seed=12, train_attn=False)}
    refs, opts = {}, {4: None, 2: None}
    for r, tc in clients.items():
        assert tc.get_info().lora_rank == r
        init = _snapshot(server, tc, f"init-{r}")
        th.check_peft_rank(init, r, ALPHA)
        refs[r] = th.peft_model(server.model, init)
    for step in range(2):
        futures = {}
        for r, tc in clients.items():          # interleaved: a's forward_backward, b's, a's step, b's step
            futures[r] = [tc.forward_backward(_datums(_data(100 * r + step)), "cross_entropy")]
        for r, tc in clients.items():
            futures[r].append(tc.optim_step(types.AdamParams(**ADAM)))
        for r, (fb, st) in futures.items():
            res, norm = fb.result(), st.result().metrics["grad_norm:mean"]
            ref_loss, ref_lps, opts[r] = th.reference_step(refs[r], _data(100 * r + step), "cross_entropy", {},
                                                           ADAM, opts[r])
            for out, want in zip(res.loss_fn_outputs, ref_lps):
                np.testing.assert_allclose(out["logprobs"].to_numpy(), want.numpy(), atol=2e-5, rtol=0)
            assert abs(res.metrics["loss:sum"] - ref_loss) <= 1e-5 * abs(ref_loss), (r, step)
            assert abs(norm - th.reference_step.grad_norm) <= 1e-5 * norm, (r, step)
            after = th.adapter_tensors(_snapshot(server, clients[r], f"step{step}-{r}"))
            want = th.peft_state(refs[r])
            assert set(after) == set(want)
            worst, key = max((float((after[k] - want[k]).abs().max()), k) for k in want)
            print(f"rank {r} step {step}: adapters within {worst:.2g} of PEFT + AdamW ({key})")
            # AdamW divides each gradient by its magnitude: an entry whose true gradient is tiny moves by
            # lr * g / (|g| + eps) with g known to fp32's absolute error (test_tinker_layouts: 9e-6 at lr 1e-3)
            assert worst <= 2e-5, (r, step, worst, key)
    probe = _data(999)
    for r, tc in clients.items():                  # the trained clients' forward against PEFT's
        fwd = tc.forward(_datums(probe), "cross_entropy").result()
        for out, (x, inp) in zip(fwd.loss_fn_outputs, probe):
            want = th.target_logprobs(refs[r], x, inp["target_tokens"]).detach().numpy()
            np.testing.assert_allclose(out["logprobs"].to_numpy(), want, atol=2e-5, rtol=0)
    tb = th.adapter_tensors(_snapshot(server, clients[2], "final-2"))
    assert all(not tb[k].any() for k in tb if ".self_attn." in k)          # train_attn=False stays zero
    for r, seed, kw in ((4, 11, {}), (2, 12, {"train_attn": False})):       # each alone: bit for bit
        alone = _client(server, r, seed=seed, **kw)
        for step in range(2):
            alone.forward_backward(_datums(_data(100 * r + step)), "cross_entropy").result()
            alone.optim_step(types.AdamParams(**ADAM)).result()
        assert _equal(th.adapter_tensors(_snapshot(server, alone, f"alone-{r}")),
                      th.adapter_tensors(_snapshot(server, clients[r], f"final-{r}")))


def test_sampler_and_checkpoint_of_a_lower_rank(server):
    tc = _client(server, 2, seed=21)
    tc.forward_backward(_datums(_data(5)), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**dict(ADAM, learning_rate=1e-2))).result()
    other = _client(server, 8, seed=22)                       # another rank in the model between the two
    other.forward_backward(_datums(_data(6)), "cross_entropy").result()
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 40, 41, 42, 7, 60, 61, 9, 22]
    other.forward(_datums(_data(7)), "cross_entropy").result()
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    fwd = tc.forward(_datums([(prompt[:-1], {"target_tokens": np.array(prompt[1:]),
                                             "weights": np.ones(len(prompt) - 1, np.float32)})]),
                     "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(lp[1:]), fwd, atol=1e-4)
    path = tc.save_state("rank2").result().path
    rest = tinker.RestClient(base_url=server.url, api_key="tml-any")
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 2
    tc.forward_backward(_datums(_data(8)), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    want = th.adapter_tensors(_snapshot(server, tc, "continued"))
    resumed = server.client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 2
    resumed.forward_backward(_datums(_data(8)), "cross_entropy").result()
    resumed.optim_step(types.AdamParams(**ADAM)).result()
    snap = _snapshot(server, resumed, "resumed")
    th.check_peft_rank(snap, 2, ALPHA)
    assert _equal(th.adapter_tensors(snap), want)


def test_rank_above_the_servers_refused(server):
    with pytest.raises(tinker.BadRequestError, match="rank 1 to 8"):
        _client(server, 16, seed=1)
    _client(server, 1, seed=1).forward(_datums(_data(9)), "cross_entropy").result()       # rank 1 serves
