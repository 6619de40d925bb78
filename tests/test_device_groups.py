"""Which device parallm uses follows the process group's per-device backend, not the whole backend string, and
parallm's cross-rank agreement runs on gloo whatever the world group is.

* Pure: ``backends_of`` / ``group_device`` for ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:gloo"`` and
  ``"cpu:gloo,cuda:nccl"`` (torchtitan's style; recent torch's default when ``device_id`` is given) with CUDA
  reported available: CUDA exactly when NCCL serves CUDA tensors.
* Two spawned ranks whose default group is created as ``"cpu:gloo,cuda:gloo"``: CPU models, transformers'
  logits; the same with the group reporting ``"cpu:gloo,cuda:nccl"`` (what a GPU machine's group would say; this
  CPU build of torch cannot create NCCL): still CPU models, nothing refused. With the world group reporting
  ``"nccl"`` at ``init_parallel``, parallm creates a gloo control group and a one-rank failure reaches both ranks
  through it.
"""

from __future__ import annotations

import pytest
import torch

import helpers


@pytest.mark.parametrize("name,expected", [
    ("gloo", ({"cpu": "gloo", "cuda": "gloo"}, "cpu")),
    ("nccl", ({"cuda": "nccl"}, "cuda")),
    ("cpu:gloo,cuda:gloo", ({"cpu": "gloo", "cuda": "gloo"}, "cpu")),
    ("cpu:gloo,cuda:nccl", ({"cpu": "gloo", "cuda": "nccl"}, "cuda")),
])
def test_group_device_from_the_per_device_backend(monkeypatch, name, expected):
    import torch.distributed as dist

    from parallm.parallel import state
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    backends, device = expected
    assert state.backends_of() == backends
    assert state.group_device() == torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # no CUDA: always the CPU
    assert state.group_device() == torch.device("cpu")


def _rank(rank, world, ckpt, ids, mask, ref):
    import torch.distributed as dist

    import parallm
    from parallm.parallel import state
    out = {"backend": dist.get_backend()}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    out["device"] = str(next(chunks[0].parameters()).device)
    out["diff"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), ref, mask)
    out["control"] = state.control_group() is not None

    real = dist.get_backend
    dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"      # a GPU machine's mixed group
    try:
        parallm.init_parallel(tp=2)
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        out["mixed_device"] = str(next(chunks[0].parameters()).device)
        out["mixed_diff"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), ref, mask)
        out["mixed_control"] = state.control_group() is not None
        dist.get_backend = lambda group=None: "nccl"                  # the world group cannot carry CPU tensors
        parallm.init_parallel(tp=2)
        out["nccl_control_backend"] = str(real(state.control_group()))
    finally:
        dist.get_backend = real
    from parallm.parallel.errors import run_local

    def check():
        if rank == 1:
            raise ValueError("bad input on rank 1")
    try:
        run_local(check, what="agreement")
        out["agree"] = None
    except ValueError as e:
        out["agree"] = str(e)
    parallm.destroy_parallel()
    out["control_after_destroy"] = state.control_group() is not None
    return out


@pytest.mark.timeout(200)
def test_mixed_backend_groups_build_cpu_models_and_agree_on_gloo(tmp_path):
    from parallm import verify
    cfg = helpers.tiny_config("llama", num_hidden_layers=2)
    model = helpers.make_hf_model(cfg)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask = helpers.padded_batch(cfg.vocab_size)
    ref = helpers.hf_logits(model, ids, mask)
    res = verify.spawn(_rank, 2, ckpt, ids, mask, ref, backend="cpu:gloo,cuda:gloo", timeout=180,
                       collective_timeout=60, preload=("helpers",))
    for rank, r in enumerate(res):
        assert r["backend"] == "cpu:gloo,cuda:gloo", r
        assert r["device"] == r["mixed_device"] == "cpu", r
        assert r["diff"] < 2e-5 and r["mixed_diff"] < 2e-5, r
        assert not r["control"] and not r["mixed_control"], r        # gloo serves CPU tensors: no second group
        assert r["nccl_control_backend"] == "gloo", r
        assert r["agree"] is not None and "bad input on rank 1" in r["agree"], r
        if rank == 0:
            assert "failed on rank 1" in r["agree"], r
        assert not r["control_after_destroy"], r
