"""What DeepSeek Sparse Attention keeps, and what its indexer's plan costs at sizes this machine cannot run:

* the top-k selections a microbatch holds on its layer context while the loss runs (one rank, GLM-5, fp32):
  none without shared indexer layers (with or without recomputation), none with shared layers without
  recomputation (the last reader drops its source's), one per source layer with shared layers under
  ``recompute="full"`` (the readers' replays need it; the source's replay takes it back), int32 with -1 for
  empty slots; nothing left after the backward; losses and gradients equal with and without recomputation.
"""

from __future__ import annotations

import math

import helpers
import pytest
import torch
from test_dsa_parts import glm5_config


def _held_at_loss(ckpt, ids, mask, *, recompute):
    """(the selections on the layer context when loss_fn runs {layer: (dtype, shape)}, those after the backward,
    the loss, the gradients)."""
    import parallm
    from parallm.model.layers.dsa import DSAttention
    chunks = parallm.build_model(ckpt, recompute=recompute)
    parallm.load_hf_weights(chunks, ckpt)
    seen = []
    attn = next(m for m in chunks[0].modules() if isinstance(m, DSAttention))
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.append(args[3]))
    at_loss = {}

    def loss_fn(out, ids_, mask_):
        at_loss.update({k: (v.dtype, tuple(v.shape)) for k, v in seen[0].__dict__.get("_dsa_selected", {}).items()})
        lp = out[:, :-1].float().log_softmax(-1)
        m = (mask_[:, 1:] * mask_[:, :-1]).float()
        return -(lp.gather(-1, ids_[:, 1:, None]).squeeze(-1) * m).sum() / m.sum()

    try:
        loss = parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn)
    finally:
        hook.remove()
    after = dict(seen[0].__dict__.get("_dsa_selected", {}))
    grads = {n: p.main_grad.clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
             for n, p in chunks[0].named_parameters() if p.requires_grad}
    return at_loss, after, loss, grads


@pytest.mark.parametrize("shared", [False, True])
def test_selections_held_at_loss_time(world_of_one, tmp_path, shared):
    cfg = glm5_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1) if shared \
        else glm5_config(num_hidden_layers=4)
    model = helpers.make_hf_model(cfg, seed=3)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "glm5"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, seed=2, batch=2, seq=40)     # 40 > top-k 16: sparse
    plain = _held_at_loss(ckpt, ids, mask, recompute=None)
    replayed = _held_at_loss(ckpt, ids, mask, recompute="full")
    assert plain[0] == {} and plain[1] == {}
    if shared:            # layers full, shared, full, shared: sources 0 and 2, each read by the next layer
        assert replayed[0] == {0: (torch.int32, (80, 16)), 2: (torch.int32, (80, 16))}, replayed[0]
    else:
        assert replayed[0] == {}, replayed[0]
    assert replayed[1] == {}, replayed[1]              # the sources' replays took theirs back
    assert abs(float(plain[2]) - float(replayed[2])) < 1e-6
    for name, g in plain[3].items():
        assert torch.allclose(g, replayed[3][name], atol=1e-6, rtol=0), name


# -- the indexer's block plan ---------------------------------------------------------------------------------

def test_indexer_plan_at_128k_tokens():
    """S = 128k tokens (one sequence), 64 indexer heads (DeepSeek-V3.2), an 80 GB device with 70 GB free: the plan
    (pure planning, nothing of that size allocated) implies at most 2,000 kernel launches a layer. Every block
    fits the budget, the blocks cover the queries in order, and each block's window covers its queries' keys.
    The former plan (2^24 fp32 scores a block, one Python step per query) made ~3 x 10^4 blocks of ~8 launches."""
    import numpy as np

    from parallm.model.layers.indexer_plan import pair_bytes, plan_blocks, plan_launches, score_budget
    s, heads = 128 * 1024, 64
    lo, hi = np.zeros(s, dtype=np.int64), np.arange(s)
    budget = score_budget("cuda", free=70 * 10**9)
    assert budget == 35 * 10**9
    blocks = plan_blocks(lo, hi, pair_bytes(heads), budget)
    launches = plan_launches(blocks)
    print(f"{len(blocks)} blocks, {launches} launches")
    assert launches <= 2000, launches
    assert blocks[0][0] == 0 and blocks[-1][1] == s
    assert all(b[1] == c[0] for b, c in zip(blocks, blocks[1:]))
    for a, e, k0, k1 in blocks:
        assert (e - a) * (k1 - k0) * pair_bytes(heads) <= budget or e - a == 1
        assert k0 <= lo[a:e].min() and k1 - 1 >= hi[a:e].max()
    # the former plan at the same size: m queries from a while m x heads x (a + m) keys <= 2^24 scores
    old, a = 0, 0
    while a < s:
        a += max(1, int((-a + math.sqrt(a * a + 4 * (1 << 24) / heads)) / 2))
        old += 1
    print(f"former plan: {old} blocks")
    assert old > 10**4
    # packed documents: no window crosses into another document's keys
    cu = np.array([0, 5000, 5001, 90000, s])
    lo = np.repeat(cu[:-1], np.diff(cu))
    for a, e, k0, k1 in plan_blocks(lo, hi, pair_bytes(heads), 1 << 30):
        assert k0 == lo[a:e].min() and k1 == hi[a:e].max() + 1


def _launches(fn) -> int:
    """Kernels ``fn`` launches on CPU: dispatched operations that write (in place, or a tensor not aliasing their
    inputs); views are not kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            if func._schema.name.endswith("_") or any(t.untyped_storage().data_ptr() not in ins for t in outs):
                Count.n += 1
            return out

    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("layout", ["packed fp32", "padded bf16"])
def test_launches_per_block(layout):
    """The launches select_topk makes for 1 and many blocks (budgets chosen so): at most LAUNCHES_PER_LAYER +
    blocks x LAUNCHES_PER_BLOCK, the numbers plan_launches uses; the selection is the same whatever the blocks."""
    from parallm.model.layers import indexer
    from parallm.model.layers.attention import PaddedRows, make_packing
    from parallm.model.layers.indexer_plan import LAUNCHES_PER_BLOCK, LAUNCHES_PER_LAYER, key_ranges, pair_bytes
    g = torch.Generator().manual_seed(0)
    if layout == "packed fp32":
        mask = torch.ones(2, 100, dtype=torch.bool)
        mask[1, 70:] = False
        ranges, width, dtype = key_ranges(make_packing(mask)), 1, torch.float32
        s = ranges.rows
    else:
        mask = torch.ones(3, 200, dtype=torch.bool)
        mask[1, :20] = False
        ranges, width, dtype, s = key_ranges(PaddedRows(mask)), 3, torch.bfloat16, 200
    q = torch.randn(s, width, 4, 8, generator=g).to(dtype)
    k = torch.randn(s, width, 8, generator=g).to(dtype)
    w = torch.randn(s, width, 4, generator=g)
    counts, results = {}, []
    for budget in (1 << 30, 4 * width * s * pair_bytes(4)):
        blocks = len(ranges.plan(0, s, pair_bytes(4), budget))
        out = []
        counts[blocks] = _launches(lambda: out.append(indexer.select_topk(q, k, w, ranges, 16, scale=0.3,
                                                                          budget=budget)))
        results.append(out[0])
    (one, n1), (many, n2) = sorted(counts.items())
    assert one == 1 and many >= 10, counts
    per_block = (n2 - n1) / (many - one)
    assert per_block <= LAUNCHES_PER_BLOCK and n1 - per_block <= LAUNCHES_PER_LAYER, (per_block, n1)
    assert torch.equal(results[0], results[1])


def test_score_budget(monkeypatch):
    from parallm.model.layers.indexer_plan import BUDGET_ENV, CPU_BUDGET, MIN_BUDGET, score_budget
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert score_budget("cpu") == CPU_BUDGET
    assert score_budget("cuda", free=10 * 2**30) == 5 * 2**30
    assert score_budget("cuda", free=1000) == MIN_BUDGET
    assert score_budget("cuda", 12345, free=10**12) == 12345
    monkeypatch.setenv(BUDGET_ENV, "3G")
    assert score_budget("cuda", free=10**12) == 3 * 2**30
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match="PARALLM_INDEXER_MEMORY='lots'"):
        score_budget("cpu")
