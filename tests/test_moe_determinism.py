"""The MoE layer moves rows only by permutations and sums a token's k choices by a reduction.

On CUDA ``index_add`` / ``scatter_add`` and the backward of an ``index_select`` with repeated indices are atomic
adds whose order varies from run to run, so outputs and gradients would differ in their last bits between two
identical steps. CPU kernels are ordered, so a CPU test cannot see that variation; it checks the property that
makes it impossible instead: in the autograd graph of a MoE layer's output (top-k 2 and 4, with a shared expert)
every row gather uses an index without repeats, and no accumulating scatter / index-add appears (the slots are
made by ``slots_of``, whose backward is a permutation and a sum over the k choices). The layer is also checked
against a per-token reference, and two identical forward + backward passes for equal bits; ``torch._grouped_mm``
and the per-expert loop for equal bits; and, on 4 gloo ranks, the distributed paths (each TP rank dispatching its
share at tp2 ep2 with and without sequence parallelism, tokens entering the TP region at tp2 ep1) for the same
graph property and equal bits over two steps. Every path also runs, forward and backward, without any aten op
that accumulates by index (index_add, scatter_add, index_put with accumulate, ...), the inside of parallm's own
autograd functions included.
"""

from __future__ import annotations

import pytest
import torch

import helpers

ACCUMULATING = ("IndexAddBackward", "ScatterAddBackward", "IndexPutBackward", "EmbeddingBackward")


def _block(top_k: int, shared: bool):
    import transformers
    from megatron.core import ModelParallelConfig

    import parallm.families  # noqa: F401 - registers the families
    from parallm.families.registry import spec_from_config
    from parallm.model.layers.moe import MoEBlock
    from parallm.parallel.state import current_dims
    cls = transformers.Qwen2MoeConfig if shared else transformers.Qwen3MoeConfig
    extra = dict(shared_expert_intermediate_size=24) if shared else {}
    cfg = cls(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=12, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, num_experts=6, num_experts_per_tok=top_k,
              norm_topk_prob=True, **extra)
    spec, _ = spec_from_config(cfg)
    config = ModelParallelConfig(tensor_model_parallel_size=1, params_dtype=torch.float32,
                                 use_cpu_initialization=True, perform_initialization=False)
    block = MoEBlock(spec, config, current_dims(), None)
    g = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


def _graph(root):
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return seen


def _expert(block, e, h):
    """Expert e (of the stacked weights) on one token: ``down(silu(gate h) * up h)``."""
    gate, up = (block.experts.linear_fc1.weight[e] @ h).chunk(2)
    return block.experts.linear_fc2.weight[e] @ (torch.nn.functional.silu(gate) * up)


def _reference(block, x):
    """Per token: sum over its top-k experts of weight * expert(token) (+ the shared expert)."""
    h = x.reshape(-1, block.hidden)
    _, weights, choices = block.route(h)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(block.top_k):
            out[t] += weights[t, j] * _expert(block, int(choices[t, j]), h[t])
    out = out.view(x.shape)
    return out + block.shared_experts(x) if hasattr(block, "shared_experts") else out




def _check_permutations_only(out):
    """The autograd graph of ``out``: every row gather's index has no repeats (its backward touches each row
    once) and no accumulating scatter / index-add appears. Returns the node names."""
    nodes = _graph(out.grad_fn)
    names = sorted({type(n).__name__ for n in nodes})
    gathers = [n for n in nodes if type(n).__name__.startswith("IndexSelectBackward")]   # e.g. the regroup
    for node in gathers:
        index = node._saved_index
        assert index.numel() == index.unique().numel(), f"a gather repeats rows (its backward accumulates): {names}"
    assert not [n for n in names if n.startswith(ACCUMULATING)], names
    return names


ACCUMULATING_OPS = ("index_add", "scatter_add", "scatter_reduce", "index_reduce", "embedding_dense_backward",
                    "_embedding_bag_backward")


def _accumulating_ops(fn):
    """The aten ops that accumulate by index (colliding atomic adds on CUDA) run by ``fn()``, forward and backward,
    custom autograd functions' insides included (``index_put`` counts with ``accumulate=True``)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0].rstrip("_")
            accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 and "index_put" in name else False)
            if name in ACCUMULATING_OPS or ("index_put" in name and accumulate):
                seen.append(func.__name__)
            return func(*args, **kwargs)

    with Ops():
        fn()
    return seen


def _step(block, x):
    xx = x.detach().clone().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    out = block(xx)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), xx.grad] + [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("top_k,shared", [(2, False), (4, True)])
def test_moe_moves_rows_by_permutations_only(world_of_one, top_k, shared):
    block = _block(top_k, shared)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    out = block(x)
    names = _check_permutations_only(out)
    # the slots (a gather by token whose backward is a permutation and a sum over k) and their weighted sum
    # (whose backward is a gather and an in-place product)
    assert {"_RepeatRowsBackward", "_WeightedSumBackward", "_SwiGLUBackward"} <= set(names), names
    torch.testing.assert_close(out, _reference(block, x), rtol=1e-5, atol=1e-6)
    first, second = _step(block, x), _step(block, x)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert _accumulating_ops(lambda: _step(block, x)) == []


@pytest.mark.parametrize("top_k,shared", [(2, False), (4, True)])
def test_grouped_mm_and_the_loop_give_the_same_bits(world_of_one, top_k, shared):
    """In fp32 on CPU torch._grouped_mm (one GEMM per projection) and the per-expert loop give bit-identical
    outputs and gradients, an expert no token chose included (6 experts, 15 tokens, top 2: some are empty)."""
    block = _block(top_k, shared)
    assert block.experts.kernel == "grouped_mm"
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(8))
    grouped = _step(block, x)
    block.experts.kernel = "loop"
    loop = _step(block, x)
    assert all(torch.equal(a, b) for a, b in zip(grouped, loop))
    assert all(torch.isfinite(t).all() for t in grouped)


def rank_graphs(rank, world, ckpt, layouts):
    """Per layout: the MoE layer's graph moves rows by permutations only, and two identical steps give the same
    bits (outputs, input and weight gradients)."""
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for tp, ep, sp in layouts:
        parallm.init_parallel(tp=tp, ep=ep)
        lay = current_dims()
        chunks = parallm.build_model(ckpt, packed=sp, sequence_parallel=sp)
        parallm.load_hf_weights(chunks, ckpt)
        block = chunks[0].layers[0].mlp
        x = torch.randn(12, 1, block.hidden, generator=torch.Generator().manual_seed(lay.dp_rank))
        if sp:
            x = x.narrow(0, lay.tp_rank * 12 // tp, 12 // tp)
        names = _check_permutations_only(block(x.clone().requires_grad_(True)))
        first, second = _step(block, x), _step(block, x)
        same = all(torch.equal(a, b) for a, b in zip(first, second))
        out.append((block.shares, names, same, _accumulating_ops(lambda: _step(block, x))))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_the_dispatch_under_tp_and_ep_moves_rows_by_permutations_only(tmp_path):
    """The same property for the distributed paths: each TP rank dispatching its share (tp2 ep2, with and without
    sequence parallelism: the all-gather / reduce-scatter over TP, the shares' gather) and the tokens entering the
    TP region (tp2 ep1), on 4 gloo ranks."""
    model = helpers.make_hf_model(helpers.tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=3), seed=9)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    layouts = [(2, 2, False), (2, 2, True), (2, 1, False)]
    results = helpers.run_ranks(rank_graphs, 4, ckpt, layouts)
    for rank_result in results:
        for (shares, names, same, accumulating), (tp, ep, sp) in zip(rank_result, layouts):
            assert shares == (ep > 1), (tp, ep, sp)
            assert same and accumulating == [], (tp, ep, sp, accumulating)
            assert {"_RepeatRowsBackward", "_WeightedSumBackward"} <= set(names), names
            if shares:
                assert {"_GatherRowsBackward", "_PermuteBackward"} <= set(names), names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_gives_autograds_bits(dtype):
    """The experts' fused ``silu(gate) * up`` (one saved tensor, one gradient buffer) equals autograd on
    ``F.silu(gate) * up`` bit for bit, forward and backward, in every training dtype."""
    from parallm.model.layers.moe import swiglu
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 24, generator=g).to(dtype).requires_grad_(True)
    grad = torch.randn(37, 12, generator=g).to(dtype)
    out = swiglu(h)
    out.backward(grad)
    mine, h.grad = h.grad, None
    gate, up = h.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    ref.backward(grad)
    assert torch.equal(out, ref) and torch.equal(mine, h.grad)
