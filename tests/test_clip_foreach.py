"""clip_grad_norm_ and the master-weight copy on ``torch._foreach_*`` kernels give the bits of the per-parameter
loops they replaced.

The per-parameter versions live here only, as the reference: the norm summed ``acc += vector_norm(part, p) ** p``
parameter after parameter over each one's primary slices, then every gradient scaled with ``g.mul_(coef)``; the
master copy ``master.copy_(p)`` / ``p.copy_(master)`` one tensor at a time. One 4-rank spawn builds models with
many parameter tensors (no weights loaded: the gradients are set directly, seeded, with some left None) at
layouts where primary slices matter (TP-replicated norms, KV heads replicated over TP, the tied head copy at
pp > 1, routed experts over ep) in fp32 and bf16 (fp32 ``main_grad``), and compares norm and gradients with
``torch.equal`` for p = 2, 1, 1.5 (a general exponent) and inf.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from parallm.train.optim import MasterAdamW

NORMS = (2.0, 1.0, 1.5, float("inf"))


def reference_clip(chunks, max_norm, norm_type):
    """The per-parameter clip_grad_norm_ that parallm had before its ``_foreach`` kernels (same reduction over
    ranks, which did not change)."""
    from parallm.model.params import grad_of
    from parallm.model.placement import placement_of
    from parallm.train.grads import _reduce_norm_partials
    device = next(chunks[0].parameters()).device
    inf = norm_type == float("inf")
    total = torch.zeros((), dtype=torch.float32, device=device)
    expert_total = torch.zeros((), dtype=torch.float32, device=device)
    dims = chunks[0].dims
    for chunk in chunks:
        for p in chunk.parameters():
            g = grad_of(p)
            pl = placement_of(p)
            if g is None or pl.tied == "copy":
                continue
            for dim, start, stop in pl.layout.primary_slices(dims.tp_rank, dims.tp, tuple(g.shape)):
                part = g.narrow(dim, start, stop - start).float()
                if part.numel() == 0:
                    continue
                acc = expert_total if pl.expert is not None else total
                if inf:
                    acc.copy_(torch.maximum(acc, part.abs().max()))
                else:
                    acc += torch.linalg.vector_norm(part, norm_type) ** norm_type
    norm = _reduce_norm_partials({"model": total, "expert": expert_total}, norm_type, dims)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for chunk in chunks:
        for p in chunk.parameters():
            g = grad_of(p)
            if g is not None:
                g.mul_(coef)
    return norm


def _set_grads(chunks, seed):
    """Seeded gradients of varied scale on every parameter (fp32 ``main_grad`` for bf16 ones); every 7th left
    None (a parameter no backward reached)."""
    from parallm.model.params import uses_main_grad
    g = torch.Generator().manual_seed(seed)
    i = 0
    for chunk in chunks:
        for p in chunk.parameters():
            i += 1
            p.grad = None
            p.main_grad = None
            if i % 7 == 0:
                continue
            value = torch.randn(p.shape, generator=g) * float(10.0 ** torch.randint(-3, 2, (), generator=g))
            if uses_main_grad(p):
                p.main_grad = value
            else:
                p.grad = value.to(p.dtype)


def _grads(chunks):
    from parallm.model.params import grad_of
    return [None if grad_of(p) is None else grad_of(p).clone() for c in chunks for p in c.parameters()]


def _rank(rank, world, cases):
    import parallm
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), ep=case.get("ep", 1))
        chunks = parallm.build_model(case["config"], dtype=case["dtype"])
        tensors = sum(1 for c in chunks for _ in c.parameters())
        results = []
        for k, norm_type in enumerate(NORMS):
            _set_grads(chunks, seed=100 * rank + k)
            ref_norm = reference_clip(chunks, 0.5, norm_type)
            ref = _grads(chunks)
            _set_grads(chunks, seed=100 * rank + k)
            norm = parallm.clip_grad_norm_(chunks, 0.5, norm_type)
            got = _grads(chunks)
            same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                       for a, b in zip(ref, got))
            results.append(dict(norm_type=norm_type, norm=norm.item(), ref=ref_norm.item(),
                                norm_equal=torch.equal(norm, ref_norm), grads_equal=same))
        out.append(dict(name=case["name"], tensors=tensors, results=results))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_foreach_clip_matches_the_per_parameter_loop_bit_for_bit():
    cases = [
        # 24 layers, one KV head over tp2 (QKV primary rows), TP-replicated norms counted on one rank, pp2
        dict(name="llama nkv1 tp2 pp2 fp32", tp=2, pp=2, dtype=torch.float32,
             config=helpers.tiny_config("llama", num_hidden_layers=24, num_key_value_heads=1)),
        # tied across stages (the head copy not counted), qkv biases, bf16 parameters with fp32 main_grad
        dict(name="qwen2 tied tp2 pp2 vpp2 bf16", tp=2, pp=2, vpp=2, dtype=torch.bfloat16,
             config=helpers.tiny_config("qwen2", num_hidden_layers=16, tie_word_embeddings=True)),
        # routed experts split over ep (their own partial), qk norms; dp4 x ep2
        dict(name="qwen3_moe ep2 fp32", tp=1, pp=1, ep=2, dtype=torch.float32,
             config=helpers.tiny_config("qwen3_moe", num_hidden_layers=6, num_experts=16)),
        dict(name="qwen3_moe tp2 ep2 bf16", tp=2, pp=1, ep=2, dtype=torch.bfloat16,
             config=helpers.tiny_config("qwen3_moe", num_hidden_layers=6, num_experts=8)),
    ]
    res = helpers.run_ranks(_rank, 4, cases)
    for rank, per_rank in enumerate(res):
        for case in per_rank:
            for r in case["results"]:
                print(f"rank {rank} {case['name']} ({case['tensors']} tensors) p={r['norm_type']}: "
                      f"norm {r['norm']:.6g} (reference {r['ref']:.6g})")
                assert r["norm_equal"], (rank, case["name"], r)
                assert r["grads_equal"], (rank, case["name"], r)
            assert case["tensors"] > 30, case


@pytest.mark.parametrize("norm_type", NORMS)
def test_sum_of_powers_adds_like_the_loop(norm_type):
    """Without a process group: 3000 tensors of assorted sizes and scales summed as the loop sums them (torch's
    sum, which reorders the additions, fails this), and 20000 norms raised to p element by element as the 0-dim
    ``n ** p`` rounds (a vectorised pow for a general exponent differs in ~2% of them)."""
    from parallm.train.grads import _powers, _sum_of_powers
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(int(n), generator=g) * float(10.0 ** torch.randint(-4, 4, (), generator=g))
             for n in torch.randint(1, 300, (3000,), generator=g)]
    acc = torch.zeros(())
    for part in parts:
        if norm_type == float("inf"):
            acc.copy_(torch.maximum(acc, part.abs().max()))
        else:
            acc += torch.linalg.vector_norm(part, norm_type) ** norm_type
    assert torch.equal(_sum_of_powers(parts, norm_type, torch.device("cpu")), acc)
    if norm_type != float("inf"):
        norms = torch.rand(20000, generator=g) * 100
        assert torch.equal(_powers(norms, norm_type), torch.stack([n ** norm_type for n in norms.unbind()]))


def test_master_copies_match_per_tensor_copies_bit_for_bit():
    """Many bf16 parameters (500 tensors of assorted shapes): masters taken and parameters rounded with
    ``_foreach_copy_`` equal ``master.copy_(p)`` and ``p.copy_(master)`` per tensor; fp32 parameters, which are
    their own masters, step as torch.optim.AdamW does."""
    g = torch.Generator().manual_seed(0)
    shapes = [(int(a), int(b)) for a, b in torch.randint(1, 20, (500, 2), generator=g)] + [(3,), (1,)]
    for dtype in (torch.bfloat16, torch.float32):
        base = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        params = [p.clone().requires_grad_() for p in base]
        opt = MasterAdamW([{"params": params}], lr=1e-2, weight_decay=0.1)
        refs = [b.float().clone().requires_grad_() for b in base]     # torch's AdamW on fp32 copies
        ref_opt = torch.optim.AdamW([{"params": refs}], lr=1e-2, weight_decay=0.1)
        for _ in range(2):
            grads = [torch.randn(s, generator=g) for s in shapes]
            for p, r, gr in zip(params, refs, grads):
                if dtype == torch.bfloat16:
                    p.main_grad = gr.clone()
                else:
                    p.grad = gr.clone()
                r.grad = gr.clone()
            opt.step()
            ref_opt.step()
        for p, r in zip(params, refs):
            if dtype == torch.bfloat16:
                expect = torch.empty_like(p)
                expect.copy_(r)                        # the per-tensor rounding the step used to do
                assert torch.equal(opt.state[p]["master"], r)
                assert torch.equal(p, expect)
            else:
                assert torch.equal(p, r)
        # taking masters: master.copy_(p) per tensor
        if dtype == torch.bfloat16:
            fresh = MasterAdamW([{"params": params}], lr=1e-2)
            fresh.sync_masters()
            for p in params:
                expect = torch.empty(p.shape, dtype=torch.float32)
                expect.copy_(p)
                assert torch.equal(fresh.state[p]["master"], expect)


@pytest.mark.parametrize("threads", [1, 2])
def test_part_norms_match_one_norm_per_part(threads):
    """The row-wise norms of stacked same-shape parts (CPU) have the bits of one ``vector_norm`` per part, for
    every p, at one and two threads: many parts of a few shapes (grouped), parts above the one-thread size
    (a whole-tensor norm splits them over threads: not grouped), non-contiguous slices and empty pieces, in an
    interleaved order the result must keep."""
    from parallm.train.grads import _part_norms
    g = torch.Generator().manual_seed(3)
    shapes = [(16,), (64, 16), (1,), (3, 5), (128, 256), (100000,), (40000,), (8, 4096)]
    parts = []
    for k in range(600):
        shape = shapes[int(torch.randint(0, len(shapes), (), generator=g))]
        if shape[0] >= 40000 and sum(p.numel() >= 40000 for p in parts) >= 12:
            shape = (7,)
        t = torch.randn(shape, generator=g) * float(10.0 ** torch.randint(-3, 3, (), generator=g))
        if k % 50 == 0 and t.dim() == 2:
            t = t[:, 1:]                               # a column slice: not contiguous
        if k % 97 == 0:
            t = t.reshape(-1)[:0]                      # an empty piece
        parts.append(t)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for norm_type in NORMS:
            expect = torch.stack([torch.linalg.vector_norm(p, norm_type) if p.numel() else torch.zeros(())
                                  for p in parts])
            got = _part_norms(parts, norm_type)
            assert torch.equal(got, expect), (norm_type, (got != expect).nonzero()[:5])
    finally:
        torch.set_num_threads(before)


def test_part_norms_memo_is_reused_only_while_it_holds():
    """The row-norm grouping kept between calls: reused for the same owners, rebuilt when the owners change
    (another parameter's gradient is None), bypassed when a part is not contiguous; every result exact."""
    from parallm.train.grads import _part_norms
    g = torch.Generator().manual_seed(5)

    def norms_of(parts):
        return torch.stack([torch.linalg.vector_norm(p) for p in parts])

    store = {}
    a = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(4, 3, generator=g)]
    assert torch.equal(_part_norms(a, 2.0, (store, "k", [0, 1, 2])), norms_of(a))
    assert store["k"][0] == [0, 1, 2]
    kept = store["k"]
    fresh = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(4, 3, generator=g)]
    assert torch.equal(_part_norms(fresh, 2.0, (store, "k", [0, 1, 2])), norms_of(fresh))
    assert store["k"] is kept                                    # same owners: the grouping reused
    other = [torch.randn(5, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)]
    assert torch.equal(_part_norms(other, 2.0, (store, "k", [1, 2, 3])), norms_of(other))
    assert store["k"][0] == [1, 2, 3]                            # owners changed: rebuilt
    strided = [torch.randn(5, generator=g), torch.randn(3, 4, generator=g).t(), torch.randn(4, 3, generator=g)]
    assert torch.equal(_part_norms(strided, 2.0, (store, "k", [1, 2, 3])), norms_of(strided))
