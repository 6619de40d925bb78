"""Offload for colocated rollouts (``parallm.train.offload``): parameters, gradients and optimizer state leave the
device (every offloaded tensor's storage is 0 bytes afterwards, on CPU too) and come back bit for bit.

On 2 ranks, two layouts (dp2 bf16 with ZeRO and gradient buckets: masters, main_grad views into buckets,
parameters as views into ZeRO buffers; tp2 fp32 unsharded): three steps of forward_backward + finalize_grads +
AdamW, with everything offloaded and onloaded between steps and again between a backward and its
finalize_grads (gradients alive, through the context manager), against the same three steps without offload:
weights and optimizer state ``torch.equal``.

``test_host_copies_reused``: repeated offloads reuse one host copy per storage (the same tensors, not fresh
(pinned, on CUDA) allocations each time), a storage that changed size gets a new one, and offloading the parameters
frees the export stream's cached buffers; the model still trains bit for bit like one never offloaded.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from test_optim import ce_loss


def _step(parallm, chunks, opt, ids, dims, middle=None):
    per = ids.shape[0] // dims.dp
    parallm.forward_backward(chunks, ids[dims.dp_rank * per:(dims.dp_rank + 1) * per], loss_fn=ce_loss)
    if middle is not None:
        middle()
    parallm.finalize_grads(chunks)
    opt.step()
    opt.zero_grad()


def _all_storages(chunks, opt):
    from parallm.train.offload import KINDS, _tensors
    return {kind: [t.untyped_storage().nbytes() for t in _tensors(chunks, opt, kind)] for kind in KINDS}


def rank_fn(rank, world, ckpt, batches, cases):
    import parallm
    from parallm.parallel.state import dims_of
    from parallm.train.offload import offload, offloaded, onload
    out = {}
    for name, case in cases.items():
        parallm.init_parallel(**case["layout"])
        runs = {}
        for kind in ("plain", "offload"):
            chunks = parallm.build_model(ckpt, dtype=case["dtype"])
            parallm.load_hf_weights(chunks, ckpt)
            opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1, **case["opt"])
            dims = dims_of(chunks)
            sizes = []
            for i, ids in enumerate(batches):
                middle = None
                if kind == "offload" and i == 1:     # gradients alive: offload everything, onload, finalize
                    def middle():
                        with offloaded(chunks, opt):
                            sizes.append(_all_storages(chunks, opt))
                _step(parallm, chunks, opt, ids, dims, middle)
                if kind == "offload":
                    moved = offload(chunks, opt)
                    sizes.append(_all_storages(chunks, opt))
                    assert onload(chunks, opt) == moved > 0
            runs[kind] = dict(state=parallm.save_hf_weights(chunks),
                              opt={k: {n: t.clone() for n, t in st.items() if torch.is_tensor(t)}
                                   for k, st in opt.state_dict()["state"].items()},
                              sizes=sizes)
        out[name] = runs
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_offload_and_onload_continue_bit_for_bit(tmp_path):
    model = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=2), seed=12)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (4, 8), generator=g) for _ in range(3)]
    cases = {"dp2 bf16 zero buckets": dict(layout={}, dtype=torch.bfloat16,
                                           opt=dict(shard_over_dp=True, overlap_grad_reduce=True,
                                                    bucket_bytes=16 * 1024)),
             "tp2 fp32": dict(layout=dict(tp=2), dtype=torch.float32, opt={})}
    res = helpers.run_ranks(rank_fn, 2, ckpt, batches, cases)
    for r in res:
        for name in cases:
            plain, off = r[name]["plain"], r[name]["offload"]
            for sizes in off["sizes"]:      # every offloaded storage empty: parameters, gradients, state
                assert all(n == 0 for kind in sizes.values() for n in kind), sizes
                assert sizes["params"] and sizes["optimizer_state"], sizes
            assert off["sizes"][1]["grads"], off["sizes"][1]     # the offload between backward and finalize
            assert plain["opt"].keys() == off["opt"].keys()
            for k in plain["opt"]:
                for n in plain["opt"][k]:
                    assert torch.equal(plain["opt"][k][n], off["opt"][k][n]), (name, k, n)
    for name in cases:
        helpers.assert_same_state(res[0][name]["offload"]["state"], res[0][name]["plain"]["state"])


def _reuse_rank(rank, world, ckpt, ids):
    import parallm
    from parallm.parallel.state import dims_of
    from parallm.train.offload import _held, offload, onload
    parallm.init_parallel()
    out = {}
    runs = {}
    for kind in ("plain", "offload"):
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        opt = parallm.build_optimizer(chunks, lr=1e-2)
        dims = dims_of(chunks)
        hosts = []
        for _ in range(3):
            _step(parallm, chunks, opt, ids, dims)
            if kind == "offload":
                for _name, t in parallm.export_hf_tensors(chunks):     # the export stream caches its buffers
                    pass
                cached = sum(b.numel() for b in chunks[0]._parallm_export["buffers"].bufs.values())
                offload(chunks, opt)
                held = _held(chunks)
                hosts.append({k: [h for _, h in held[k]] for k in held})
                out.setdefault("cached_before", []).append(cached)
                out.setdefault("cached_after", []).append(len(chunks[0]._parallm_export["buffers"].bufs))
                onload(chunks, opt)
        runs[kind] = parallm.save_hf_weights(chunks)
        if kind == "offload":
            # the 2nd and 3rd offloads use the host tensors of the 1st (the optimizer state exists from step 1)
            out["same"] = all(len(h[k]) == len(hosts[0][k]) and all(a is b for a, b in zip(h[k], hosts[0][k]))
                              for h in hosts[1:] for k in ("params", "optimizer_state"))
            out["counts"] = {k: len(hosts[0][k]) for k in hosts[0]}
            # a storage whose size changed gets a host copy of its own size
            p = next(chunks[0].parameters())
            p.data = torch.zeros(p.numel() + 3, dtype=p.dtype)[:p.numel()].view_as(p)
            offload(chunks, opt, grads=False, optimizer_state=False)
            mine = [h for st, h in _held(chunks)["params"] if st._cdata == p.untyped_storage()._cdata]
            out["resized"] = len(mine) == 1 and mine[0].numel() == (p.numel() + 3) * p.element_size()
            onload(chunks, opt)
    out["equal"] = all(torch.equal(runs["plain"][k], runs["offload"][k]) for k in runs["plain"])
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(200)
def test_host_copies_reused(tmp_path):
    model = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=2), seed=12)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    out = helpers.run_ranks(_reuse_rank, 1, ckpt, ids)[0]
    print(out)
    assert out["counts"]["params"] > 0 and out["counts"]["optimizer_state"] > 0, out
    assert out["same"], out                      # one host copy per storage, reused by every later offload
    assert out["resized"], out
    assert all(n > 0 for n in out["cached_before"]) and out["cached_after"] == [0, 0, 0], out
    assert out["equal"], out
