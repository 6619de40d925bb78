"""``parallm.checkpoint.shards.hf_shard_map``: each rank's share of the HF tensors, element by element (what a
sparse / delta weight sync diffs and ships), on 4 gloo ranks, one spawn, six layouts:

Qwen2 tied, one KV head (replicated over TP), padded vocabulary, at tp2 x pp2; Qwen3 at pp2 x vpp2 x dp2; Qwen3
at tp2 x cp2; Qwen3-MoE at tp2 x ep2 (dp2); DeepSeek-V3 (MLA, shared experts, score bias) at tp2 x ep2;
Qwen3-Next (Gated DeltaNet fused projections and conv, MoE) at tp2 x pp2.

Every rank turns every position of every tensor it contributes into (HF tensor, flat position) with
``hf_positions``; rank 0 gathers them all and checks that every element of every HF tensor the export stream
carries comes from exactly one rank (no gap, no duplicate), with the exported value (bit-exact); that every rank
lists the same entries in the export stream's order; and that data- and context-parallel replicas contribute
nothing.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from test_deepseek_parts import deepseek_config
from test_qwen3_5 import hybrid_config, make_model

LAYOUTS = {
    "qwen2_tied_tp2_pp2": dict(tp=2, pp=2),
    "qwen3_pp2_vpp2_dp2": dict(pp=2, vpp=2),
    "qwen3_tp2_cp2": dict(tp=2, cp=2),
    "qwen3_moe_tp2_ep2": dict(tp=2, ep=2),
    "deepseek_tp2_ep2": dict(tp=2, ep=2),
    "qwen3_next_tp2_pp2": dict(tp=2, pp=2),
}
# how many of the 4 ranks contribute anything: data- and context-parallel replicas none (dp2: the dp rank 0 of
# each stage; cp2: cp rank 0 of each TP rank); under ep2 the dp rank 1 ranks hold other experts
CONTRIBUTING = {"qwen2_tied_tp2_pp2": 4, "qwen3_pp2_vpp2_dp2": 2, "qwen3_tp2_cp2": 2, "qwen3_moe_tp2_ep2": 4,
                "deepseek_tp2_ep2": 4, "qwen3_next_tp2_pp2": 4}


def _checkpoints(tmp):
    out = {}
    cfg = helpers.tiny_config("qwen2", tie_word_embeddings=True, num_key_value_heads=1)
    out["qwen2_tied_tp2_pp2"] = helpers.save_checkpoint(helpers.make_hf_model(cfg), str(tmp / "qwen2"))
    cfg = helpers.tiny_config("qwen3", num_hidden_layers=4)
    out["qwen3_pp2_vpp2_dp2"] = helpers.save_checkpoint(helpers.make_hf_model(cfg), str(tmp / "qwen3_4"))
    out["qwen3_tp2_cp2"] = helpers.save_checkpoint(helpers.make_hf_model(helpers.tiny_config("qwen3")),
                                                   str(tmp / "qwen3"))
    out["qwen3_moe_tp2_ep2"] = helpers.save_checkpoint(helpers.make_hf_model(helpers.tiny_config("qwen3_moe")),
                                                       str(tmp / "moe"))
    out["deepseek_tp2_ep2"] = helpers.save_checkpoint(helpers.make_hf_model(deepseek_config()), str(tmp / "dsv3"))
    out["qwen3_next_tp2_pp2"] = helpers.save_checkpoint(make_model(hybrid_config("qwen3_next"), seed=0),
                                                        str(tmp / "next"))
    return out


def _shards_rank(rank, world, paths):
    import torch.distributed as dist

    import parallm
    from parallm.checkpoint.shards import hf_shard_map

    report = {}
    for name, layout in LAYOUTS.items():
        parallm.init_parallel(**layout)
        chunks = parallm.build_model(paths[name], dtype=torch.float32)
        parallm.load_hf_weights(chunks, paths[name], progress=False)
        exported = {k: v.clone() for k, v in parallm.export_hf_tensors(chunks)}
        shards = hf_shard_map(chunks)
        mine = {}
        for sh in shards:
            t = sh.tensor()
            if t is None:
                continue
            assert tuple(t.shape) == sh.shape, (sh.key, t.shape, sh.shape)
            slot, pos = sh.hf_positions(torch.arange(t.numel()))
            flat = t.reshape(-1)
            for k, (hf, _) in enumerate(sh.slots):
                m = slot == k
                mine.setdefault(hf, []).append((pos[m], flat[m].clone()))
        keys = [sh.key for sh in shards]
        every = [None] * world
        dist.all_gather_object(every, (mine, keys))
        rep = {"same_order": all(k == keys for _, k in every),
               "stream_order": [n for k in keys for n in k.split("+")] == list(exported),
               "contributes": any(sh.contributes for sh in shards)}
        if rank == 0:
            bad = []
            for hf, want in exported.items():
                parts = [p for m, _ in every for p in m.get(hf, [])]
                pos = torch.cat([p for p, _ in parts]) if parts else torch.zeros(0, dtype=torch.long)
                val = torch.cat([v for _, v in parts]) if parts else torch.zeros(0)
                if pos.numel() != want.numel() or torch.unique(pos).numel() != want.numel():
                    bad.append((hf, "coverage", pos.numel(), torch.unique(pos).numel(), want.numel()))
                    continue
                got = torch.empty(want.numel(), dtype=val.dtype)
                got[pos] = val
                if got.dtype != want.dtype or not torch.equal(got.view(want.shape), want):
                    bad.append((hf, "values"))
            rep["bad"], rep["tensors"] = bad, len(exported)
        report[name] = rep
        parallm.destroy_parallel()
    return report


@pytest.mark.timeout(420)
def test_hf_shard_map(tmp_path):
    paths = _checkpoints(tmp_path)
    reports = helpers.run_ranks(_shards_rank, 4, paths, timeout=400)
    for name in LAYOUTS:
        for rank, rep in enumerate(reports):
            r = rep[name]
            assert r["same_order"] and r["stream_order"], (name, rank, r)
        assert sum(rep[name]["contributes"] for rep in reports) == CONTRIBUTING[name], name
        r0 = reports[0][name]
        assert r0["tensors"] > 0 and not r0["bad"], (name, r0["bad"][:5])
