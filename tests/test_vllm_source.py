"""``parallm.integrations.vllm.export_source``: a vLLM ``WeightSource`` over the export stream, for vLLM's own
trainer-side weight-transfer backends (NCCL, CUDA IPC: GPU only, see the GPU smoke check). Checked on CPU
against vLLM's ``WeightSource`` contract as vLLM's code consumes it: ``metadata()`` the same on every rank and
equal to iteration element for element (vLLM's NCCL trainer engine checks this in ``_checked_iter``; it sizes the
workers' receive buffers from the metadata), ``iter_groups`` (vLLM's layer-wise partition, which raises when the
iteration leaves the metadata's order), a fresh pass per round, the sender receiving the full tensors bit-exact
(against ``save_hf_weights``) while the other ranks only take part, at tp2 on 2 gloo ranks.

Runs in the vLLM venv (``scripts/test.sh``).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test.sh runs this file in .venv-vllm)")

import helpers  # noqa: E402


def _rank(rank, world, ckpt):
    import torch

    import parallm
    from parallm.integrations import vllm as pv
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, layerwise_groups
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    out = {}
    source = pv.export_source(chunks, sender=0, bucket_bytes="64KB")
    out["is_weight_source"] = isinstance(source, WeightSource)
    meta = source.metadata()
    out["meta"] = [(m.name, str(m.dtype), m.shape) for m in meta]
    out["meta_types"] = all(isinstance(m, ParamMeta) for m in meta)
    out["same_as_export_metadata"] = out["meta"] == [(m.name, str(m.dtype), tuple(m.shape))
                                                     for m in parallm.export_metadata(chunks)]
    state = parallm.save_hf_weights(chunks)            # collective; the full state dict on rank 0
    rounds = []
    for _ in range(2):                                 # a fresh pass per round
        if rank == 0:
            got = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))   # raises on any disagreement
            rounds.append([n for n, _ in got])
            out.setdefault("bit_exact", all(torch.equal(t, state[n]) for n, t in got))
        else:
            rounds.append([n for n, _ in source])      # what vLLM's non-sender ranks do: take part, use nothing
    out["rounds"] = rounds
    groups = []
    if rank == 0:
        for names, tensors in source.iter_groups():
            groups.append(names)
            assert [tuple(t.shape) for t in tensors] == [m.shape for m in meta if m.name in names]
    else:
        for _ in source:
            pass
    out["groups"] = groups
    out["layerwise"] = layerwise_groups([m.name for m in meta])
    return out


def test_export_source_is_a_vllm_weight_source(tmp_path):
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=3, tie_word_embeddings=True)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=3), str(tmp_path / "ckpt"))
    res = helpers.run_ranks(_rank, 2, ckpt)
    r0, r1 = res
    assert r0["is_weight_source"] and r0["meta_types"] and r0["same_as_export_metadata"]
    assert r0["meta"] == r1["meta"]                                  # the same on every rank
    names = [m[0] for m in r0["meta"]]
    assert "lm_head.weight" not in names                             # tied: the embedding only
    assert r0["rounds"] == [names, names] and r1["rounds"] == [[], []]
    assert r0["bit_exact"]
    assert r0["groups"] == r0["layerwise"]
    # the table yields the un-indexed tensors (embedding, final norm) before the layers: one group, then a group
    # per layer, each layer's tensors together (what vLLM's layer-wise reload wants)
    assert r0["groups"][0] == [n for n in names if not n.startswith("model.layers.")]
    assert len(r0["groups"]) == 1 + 3
    assert r0["groups"][1] == [n for n in names if n.startswith("model.layers.0.")]   # a layer's tensors together
