"""Gradient buckets (``build_optimizer(overlap_grad_reduce=True)``): the data-parallel reduction bucket by bucket,
started during the backward (``forward_backward`` announces its microbatches itself), reduce-scattered under ZeRO, with
the bits of the unbucketed ``finalize_grads`` / ``clip_grad_norm_`` / optimizer step.

Pure tests check the plan (every parameter once, deferred ones last, slices per owner, padding bound, balance).
One 4-rank spawn then trains the same weights three ways per layout: ``ref`` (no buckets: today's
``finalize_grads``, an unsharded optimizer), ``overlap`` (buckets; each ``forward_backward`` announces its own
microbatches, a step of two calls is announced by hand with ``expect_microbatches``) and, for dp > 2, ``late``
(the same buckets, nothing announced: all reduced in ``finalize_grads``); two steps each, pipelines with 4
microbatches, and compares gradients after ``finalize_grads``, the clipped norm, the clipped gradients and the
weights after each step with ``torch.equal``. Every layout also checks that bucket reductions were launched from
inside the backward (a gradient hook, counted by wrapping each bucket's launch). Errors: too few passes
announced, and a second call in a step that the first announced alone, refused before they run.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from parallm.train.buckets import ALIGN, plan_buckets

# -- the plan (pure) -------------------------------------------------------------------------------------------


def _check_plan(sizes, deferred, plans, *, world, shard, bucket_numel):
    seen = [i for p in plans for i in p.params]
    assert sorted(seen) == list(range(len(sizes)))            # every parameter exactly once
    flags = [p.deferred for p in plans]
    assert flags == sorted(flags)                             # deferred buckets last
    for p in plans:
        assert all(deferred[i] == p.deferred for i in p.params)
        assert all(o % ALIGN == 0 for o in p.offsets)
        spans = sorted((o, o + sizes[i]) for o, i in zip(p.offsets, p.params))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))     # no overlap
        assert spans[-1][1] <= p.numel
        if len(p.params) > 1:
            assert sum(-(-sizes[i] // ALIGN) * ALIGN for i in p.params) <= bucket_numel
        if not shard:
            assert p.kind == ("all_reduce" if world > 1 else "local") and p.owners == ()
        elif p.kind == "reduce_scatter":
            assert p.numel == world * p.segment and p.numel <= 1.25 * sum(sizes[i] + ALIGN for i in p.params)
            for o, i, r in zip(p.offsets, p.params, p.owners):
                assert r * p.segment <= o and o + sizes[i] <= (r + 1) * p.segment
        else:
            assert p.kind == "owner" and len(set(p.owners)) == 1


def test_plan_unsharded_keeps_backward_order_and_defers():
    sizes = [100, 5000, 7, 64, 129, 3000, 1, 2]
    deferred = [False, False, True, False, False, True, False, False]
    plans = plan_buckets(sizes, deferred, world=2, bucket_numel=4096, shard=False)
    _check_plan(sizes, deferred, plans, world=2, shard=False, bucket_numel=4096)
    order = [i for p in plans for i in p.params]
    assert order == [0, 1, 3, 4, 6, 7, 2, 5]       # plan order: backward order, deferred at the end
    assert len(plans[1].params) == 1               # 5000 elements: a bucket of its own


@pytest.mark.parametrize("world", [2, 4])
def test_plan_sharded_slices_and_balance(world):
    g = torch.Generator().manual_seed(world)
    sizes = [int(n) for n in torch.randint(1, 3000, (300,), generator=g)] + [200_000, 150_000]
    deferred = [bool(d) for d in torch.rand(len(sizes), generator=g) < 0.1]
    plans = plan_buckets(sizes, deferred, world=world, bucket_numel=50_000, shard=True)
    _check_plan(sizes, deferred, plans, world=world, shard=True, bucket_numel=50_000)
    kinds = {p.kind for p in plans}
    assert kinds == {"reduce_scatter", "owner"}        # the two large parameters are owned whole
    owned = [0] * world
    for p in plans:
        for i, r in zip(p.params, p.owners):
            owned[r] += sizes[i]
    assert max(owned) <= sum(sizes) / world + max(sizes), owned     # the greedy bound: mean + largest
    assert min(owned) > 0.5 * sum(sizes) / world, owned
    assert plan_buckets(sizes, deferred, world=world, bucket_numel=50_000, shard=True) == plans   # deterministic


# -- against the unbucketed path, on 4 ranks ---------------------------------------------------------------------

LR = 1e-2
MAX_NORM = 0.05      # small enough that every step clips


def ce_loss(logits, ids, mask):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def nll_sum(lp, ids, mask):
    """Token-mean from log-probs: (sum of -log p over real next tokens, their count)."""
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp[:, :-1] * m).sum(), m.sum()


def _batch(vocab, step, rows=8, seq=12):
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):
        mask[r, : int(torch.randint(0, seq // 2, (), generator=g))] = 0     # left padding of 0..5 tokens
    return ids, mask


def _grads(chunks):
    from parallm.model.params import grad_of
    return {f"{c.vpp_rank}.{n}": grad_of(p).clone() for c in chunks for n, p in c.named_parameters()}


def _weights(chunks):
    return {f"{c.vpp_rank}.{n}": p.detach().clone() for c in chunks for n, p in c.named_parameters()}


def _counting(launch, counter):
    def wrapped():
        if torch._C._current_graph_task_id() >= 0:     # inside a backward pass (a gradient hook launched it)
            counter[0] += 1
        return launch()
    return wrapped


def _train(case, kind, dims):
    """Two steps of forward_backward + finalize_grads + clip + AdamW; what each produced, per step."""
    import parallm
    from parallm.train.buckets import grad_buffers_of
    from parallm.train.grads import expect_microbatches
    chunks = parallm.build_model(case["ckpt"], dtype=case.get("dtype", torch.float32),
                                 sequence_parallel=case.get("sp", False), packed=case.get("sp", False),
                                 recompute=case.get("recompute"))
    parallm.load_hf_weights(chunks, case["ckpt"])
    buckets = kind != "ref"
    opt = parallm.build_optimizer(chunks, lr=LR, weight_decay=0.1, shard_over_dp=buckets and case["shard"],
                                  overlap_grad_reduce=buckets, bucket_bytes=case["bucket_bytes"])
    buffers = grad_buffers_of(chunks)
    m = case["microbatches"]
    launched_in_backward = [0]
    if buffers is not None:     # count the bucket reductions started from inside autograd's backward
        for bs in buffers.buckets:
            for b in bs:
                b.launch = _counting(b.launch, launched_in_backward)
    steps = []
    for step in range(2):
        ids, mask = _batch(chunks[0].spec.vocab_size, step)
        per = ids.shape[0] // dims.dp
        mine = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
        calls = case.get("calls", 1)     # gradient accumulation over several forward_backward calls
        # one call announces its own microbatches (forward_backward); several calls of one step announce their
        # total by hand first; "late" runs the same buckets with nothing reduced before finalize_grads
        total = case.get("announce", m * calls)
        if kind == "overlap" and total is not None and (calls > 1 or "announce" in case):
            expect_microbatches(chunks, total)
        if kind == "late":
            buffers.accumulated = True     # as after an unannounced backward: forward_backward announces nothing
        rows = per // calls
        for c in range(calls):
            part = slice(mine.start + c * rows, mine.start + (c + 1) * rows)
            parallm.forward_backward(chunks, ids[part], mask[part], num_microbatches=m, output=case.get("output"),
                                     loss_fn=nll_sum if case.get("output") else ce_loss)
        early = launched_in_backward[0]
        launched_in_backward[0] = 0
        parallm.finalize_grads(chunks)
        grads = _grads(chunks)
        held = {f"{c.vpp_rank}.{n}": buffers is None or buffers.holds(p) for c in chunks
                for n, p in c.named_parameters()}
        norm = parallm.clip_grad_norm_(chunks, MAX_NORM)
        clipped = _grads(chunks)
        opt.step()
        opt.zero_grad()
        steps.append(dict(grads=grads, held=held, norm=norm, clipped=clipped, weights=_weights(chunks),
                          early=early,
                          buckets=0 if buffers is None else sum(not b.plan.deferred for bs in buffers.buckets
                                                                for b in bs)))
    return steps


def _rank(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case.get("tp", 1), pp=case.get("pp", 1), vpp=case.get("vpp"), ep=case.get("ep", 1))
        dims = current_dims()
        runs = {}
        for kind in case["kinds"]:
            try:
                runs[kind] = _train(case, kind, dims)
            except (RuntimeError, ValueError) as e:
                runs[kind] = f"{type(e).__name__}: {e}"
        out.append(dict(name=case["name"], dp=dims.dp, runs=runs))
        parallm.destroy_parallel()
    return out


def _same(a: dict, b: dict, keys) -> list[str]:
    return [k for k in keys if not torch.equal(a[k], b[k])]


@pytest.mark.timeout(600)
def test_bucketed_overlapped_reduction_has_the_bits_of_finalize_grads(tmp_path):
    llama = helpers.make_hf_model(helpers.tiny_config("llama", num_hidden_layers=4, num_key_value_heads=1), seed=1)
    tied = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=4, tie_word_embeddings=True), seed=2)
    moe = helpers.make_hf_model(helpers.tiny_config("qwen3_moe", num_hidden_layers=2), seed=3)
    ckpts = {name: helpers.save_checkpoint(m, str(tmp_path / name))
             for name, m in (("llama", llama), ("tied", tied), ("moe", moe))}
    small = 24 * 1024      # bytes: a few parameters per bucket, so there are many buckets
    both = ("ref", "overlap")
    cases = [
        # one KV head over tp2 (QKV deferred: summed over its replicas first), packed + SP (norms tp_sum), dp2
        dict(name="llama nkv1 tp2.dp2 sp", ckpt=ckpts["llama"], tp=2, sp=True, microbatches=4, shard=False,
             bucket_bytes=small, kinds=both),
        # tied across stages (both copies deferred), token-mean losses from fused log-prob heads accumulated over
        # two forward_backward calls of 2 microbatches each (4 backward passes announced)
        dict(name="qwen2 tied pp2.dp2 logprobs 2 calls", ckpt=ckpts["tied"], pp=2, microbatches=2, calls=2,
             shard=False, output="logprobs", bucket_bytes=small, kinds=both),
        # ZeRO: reduce-scattered buckets, bf16 parameters with fp32 main_grad views, parameters as views
        dict(name="qwen2 tied pp2.dp2 bf16 zero", ckpt=ckpts["tied"], pp=2, microbatches=4, shard=True,
             dtype=torch.bfloat16, bucket_bytes=small, kinds=both),
        # interleaved virtual stages with activation recompute, ZeRO
        dict(name="llama pp2.vpp2.dp2 recompute zero", ckpt=ckpts["llama"], pp=2, vpp=2, microbatches=4,
             shard=True, recompute="full", bucket_bytes=small, kinds=both),
        # dp4 x ep2: dense buckets over dp4 (bits follow the buffer layout there), experts over edp2, ZeRO
        dict(name="qwen3_moe dp4.ep2 zero", ckpt=ckpts["moe"], ep=2, microbatches=2, shard=True,
             bucket_bytes=small, kinds=("ref", "overlap", "late")),
        # one microbatch too few announced: an error on every rank, not a gradient reduced too early
        dict(name="announced too few", ckpt=ckpts["llama"], microbatches=2, announce=1, shard=False,
             bucket_bytes=small, kinds=("overlap",)),
        # two calls in one step, the first announcing only itself (forward_backward's own announcement): the
        # second is refused with the way to announce the total
        dict(name="two calls, one announced", ckpt=ckpts["llama"], microbatches=1, announce=None, calls=2,
             shard=False, bucket_bytes=small, kinds=("overlap",)),
    ]
    res = helpers.run_ranks(_rank, 4, cases)
    for rank, per_rank in enumerate(res):
        for case, r in zip(cases, per_rank):
            runs = r["runs"]
            if case["name"] == "announced too few":
                assert isinstance(runs["overlap"], str) and "more backward passes" in runs["overlap"], runs
                assert runs["overlap"].startswith("ValueError"), runs     # refused before the backward ran
                continue
            if case["name"] == "two calls, one announced":
                assert isinstance(runs["overlap"], str) and "expect_microbatches(chunks, total)" in runs["overlap"]
                continue
            ref, new = runs["ref"], runs["overlap"]
            assert not isinstance(new, str), new
            for step, (a, b) in enumerate(zip(ref, new)):
                keys = sorted(a["grads"])
                held = [k for k in keys if b["held"][k]]
                print(f"rank {rank} {case['name']} step {step}: {b['early']} of {b['buckets']} buckets reduced "
                      f"during the backward, {len(held)} of {len(keys)} gradients held")
                assert b["early"] > 0 and b["buckets"] > 1
                if case["shard"]:
                    assert len(held) < len(keys)
                if r["dp"] > 2:          # layout-dependent sums: the same buckets without overlap, bit for bit
                    c = runs["late"][step]
                    assert not _same(c["grads"], b["grads"], held), case["name"]
                    assert torch.equal(c["norm"], b["norm"]) and not _same(c["weights"], b["weights"], keys)
                    worst = max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in held)
                    assert worst < 1e-6, worst
                    expert = [k for k in held if ".experts." in k]
                    assert expert
                    if step == 0:     # over edp2 every element is a + b: exact (until dense weights differ)
                        assert not _same(a["grads"], b["grads"], expert)
                    continue
                assert not _same(a["grads"], b["grads"], held), (case["name"], step)
                assert torch.equal(a["norm"], b["norm"]), (case["name"], step, a["norm"], b["norm"])
                assert not _same(a["clipped"], b["clipped"], held), (case["name"], step)
                assert not _same(a["weights"], b["weights"], keys), (case["name"], step)
