"""Operations of the Tinker server (issue 58, item 5): ``unload_model``, sessions and training runs recorded on
disk, every checkpoint listed, a checkpoint's TTL changed, a checkpoint downloaded as one archive, and a restarted
server (same ``--checkpoint-dir``) listing and loading what the earlier one saved. Two starts of a tp2 server
(parallm sampler), the tinker SDK 0.38's RestClient where it has the call, raw HTTP where it has none
(``unload_model``: the SDK defines the request type but no method; the archive: parallm's own route).
Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RANK = 4
KEY = "tml-ops"
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _http(url, method="GET", body=None):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"X-API-Key": KEY, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _datums(seed):
    g = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        full = g.integers(3, 99, 11)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": full[1:].astype(np.int64),
                                               "weights": np.ones(10, np.float32)}))
    return out


def test_operations_and_a_restart(tmp_path):
    work = str(tmp_path)
    model = th.tiny_model(os.path.join(work, "model"), seed=6)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=RANK, env={"PARALLM_TINKER_API_KEY": KEY})
    try:
        client = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        rest = client.create_rest_client()
        tc = client.create_lora_training_client(base_model=model, rank=RANK, seed=3).result()
        tc.forward_backward(_datums(1), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        state = tc.save_state("kept").result().path
        snap = tc.save_weights_for_sampler("snap").result().path
        loss_before = tc.forward(_datums(2), "cross_entropy").result().metrics["loss:sum"]
        # every checkpoint of the server; a TTL set and honoured
        ids = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
        assert state in ids and snap in ids
        short = tc.save_state("short").result().path
        rest.set_checkpoint_ttl_from_tinker_path(short, 1).result()
        time.sleep(1.5)
        assert short not in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        with pytest.raises(tinker.NotFoundError, match="expired"):
            client.create_training_client_from_state(short).result()
        # the archive of a snapshot: its PEFT files, byte for byte
        status, raw = _http(f"{srv.url}/api/v1/training_runs/{tc.model_id}/checkpoints/sampler_weights/snap/archive")
        assert status == 200
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        directory = th.adapter_dir(work, snap)
        for f in ("adapter_model.safetensors", "adapter_config.json"):
            with open(os.path.join(directory, f), "rb") as fh:
                assert got[f"snap/{f}"] == fh.read()
        status, _ = _http(f"{srv.url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/../../x/archive")
        assert status == 400
        # sessions
        sessions = rest.list_sessions().result().sessions
        assert len(sessions) == 1
        info = rest.get_session(sessions[0]).result()
        assert tc.model_id in info.training_run_ids
        # unload: the client's state is dropped; its checkpoints stay
        status, body = _http(f"{srv.url}/api/v1/unload_model", "POST", {"model_id": tc.model_id})
        assert status == 200
        rid = json.loads(body)["request_id"]
        status, body = _http(f"{srv.url}/api/v1/retrieve_future", "POST", {"request_id": rid})
        assert json.loads(body) == {"model_id": tc.model_id, "type": "unload_model"}
        with pytest.raises(tinker.NotFoundError, match="unknown model"):
            tc.forward(_datums(2), "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match="dimuon.*not offered"):
            client.create_lora_training_client(base_model=model, rank=RANK,
                                               optimizer=types.DimuonOptimizerConfig()).result()
        old_model = tc.model_id
    finally:
        srv.stop()
    os.remove(srv.ready)
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=RANK, env={"PARALLM_TINKER_API_KEY": KEY})
    try:
        client = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        rest = client.create_rest_client()
        runs = {r.training_run_id: r for r in rest.list_training_runs().result().training_runs}
        assert old_model in runs and runs[old_model].lora_rank == RANK
        run = rest.get_training_run(old_model).result()
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
        assert sessions[0] in rest.list_sessions().result().sessions
        resumed = client.create_training_client_from_state_with_optimizer(state).result()
        assert resumed.forward(_datums(2), "cross_entropy").result().metrics["loss:sum"] == loss_before
        sc = client.create_sampling_client(model_path=snap).result()
        assert len(sc.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()) == 3
    finally:
        srv.stop()
