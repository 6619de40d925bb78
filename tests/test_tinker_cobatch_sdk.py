"""Many clients in one pass through the SDK (issue 58 item 4): ``parallm serve-tinker`` (tiny Qwen3, tp2, the
parallm sampler, ``--cobatch`` at its default) and four LoRA clients of ranks 8 / 4 / 8 / 2 with four losses
(cross_entropy, importance_sampling, ppo, dro) whose requests are submitted interleaved (every client's
``forward_backward``, then every client's ``optim_step``, all before any result is read), two rounds; then the
same four clients created again with the same seeds and trained one request at a time (each result read before
the next request). Every result (per-datum log-probs, ``loss:sum``), every gradient norm and every client's
sampler snapshot (its adapter tensors) are equal bit for bit; ``/api/v1/healthz`` shows the server ran passes of
several clients' requests. The trainer-level test (layouts, bf16, a failing request in a group, the break that
must fail) is tests/test_tinker_cobatch.py.

Runs in .venv-tinker (scripts/setup_tinker.sh)."""

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

pytestmark = pytest.mark.timeout(600)
CLIENTS = [(8, "cross_entropy", {}), (4, "importance_sampling", {}),
           (8, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}), (2, "dro", {"beta": 0.1})]
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tinker-cobatch"))
    model = th.tiny_model(os.path.join(work, "model"), seed=6)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=8)
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key="tml-any")
        yield srv
    finally:
        srv.stop()


def _datums(k, round_, loss):
    g = np.random.default_rng(1000 * k + round_)
    out = []
    for _ in range(2 + k):
        n = int(g.integers(5, 16))
        full = g.integers(3, 99, n + 1)
        inputs = {"target_tokens": full[1:].astype(np.int64)}
        if loss == "cross_entropy":
            inputs["weights"] = g.random(n).astype(np.float32)
        else:
            inputs["logprobs"] = (-g.random(n) * 4).astype(np.float32)
            inputs["advantages"] = g.standard_normal(n).astype(np.float32)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1].tolist()), loss_fn_inputs=inputs))
    return out


def _clients(server, seed0):
    return [server.client.create_lora_training_client(base_model=server.model, rank=r, seed=seed0 + k,
                                                      train_unembed=False).result()
            for k, (r, _, _) in enumerate(CLIENTS)]


def _record(fb, st) -> tuple:
    return ([o["logprobs"].to_numpy() for o in fb.loss_fn_outputs], fb.metrics["loss:sum"],
            st.metrics["grad_norm:mean"])


def _same(a, b) -> bool:
    return a[1] == b[1] and a[2] == b[2] and len(a[0]) == len(b[0]) and \
        all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))


def _passes(server) -> dict:
    return json.loads(urllib.request.urlopen(server.url + "/api/v1/healthz", timeout=10).read())["cobatch"]


def test_four_clients_interleaved_equal_each_alone(server):
    before = _passes(server)
    together = _clients(server, 40)
    got = []
    for round_ in range(2):
        fbs = [tc.forward_backward(_datums(k, round_, loss), loss, cfg)
               for k, (tc, (_, loss, cfg)) in enumerate(zip(together, CLIENTS))]
        sts = [tc.optim_step(types.AdamParams(**ADAM)) for tc in together]
        got.append([_record(fb.result(), st.result()) for fb, st in zip(fbs, sts)])
    after = _passes(server)
    assert after["passes"] > before["passes"] and after["requests"] >= after["passes"] * 2, (before, after)
    alone = _clients(server, 40)
    want = []
    for round_ in range(2):
        row = []
        for k, (tc, (_, loss, cfg)) in enumerate(zip(alone, CLIENTS)):
            fb = tc.forward_backward(_datums(k, round_, loss), loss, cfg).result()
            row.append(_record(fb, tc.optim_step(types.AdamParams(**ADAM)).result()))
        want.append(row)
    assert _passes(server) == after, "the one-at-a-time clients were co-batched"
    for round_ in range(2):
        for k in range(len(CLIENTS)):
            assert _same(got[round_][k], want[round_][k]), (round_, k, got[round_][k][1:], want[round_][k][1:])
    for k, (a, b) in enumerate(zip(together, alone)):
        ta = th.adapter_tensors(th.adapter_dir(server.work, a.save_weights_for_sampler(f"co-{k}").result().path))
        tb = th.adapter_tensors(th.adapter_dir(server.work, b.save_weights_for_sampler(f"al-{k}").result().path))
        assert set(ta) == set(tb) and all(torch.equal(ta[n], tb[n]) for n in ta), k
        assert any(ta[n].abs().max() > 0 for n in ta if "lora_B" in n), "the adapters did not move"
