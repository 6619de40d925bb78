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
