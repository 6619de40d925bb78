"""The MoE layer moves rows only by permutations and sums a token's k choices by a reduction.

On CUDA ``index_add`` / ``scatter_add`` and the backward of an ``index_select`` with repeated indices are atomic
adds whose order varies from run to run, so outputs and gradients would differ in their last bits between two
identical steps. CPU kernels are ordered, so a CPU test cannot see that variation; it checks the property that
makes it impossible instead: in the autograd graph of a MoE layer's output (top-k 2 and 4, with a shared expert)
every row gather uses an index without repeats, and no accumulating scatter / index-add appears. The layer is
also checked against a per-token reference, and two identical forward + backward passes for equal bits.
"""

from __future__ import annotations

import pytest
import torch

ACCUMULATING = ("IndexAddBackward", "ScatterAddBackward", "IndexPutBackward", "EmbeddingBackward")


def _block(top_k: int, shared: bool):
    import transformers
    from megatron.core import ModelParallelConfig

    import parallm.families  # noqa: F401 - registers the families
    from parallm.families.registry import spec_from_config
    from parallm.model.moe import MoEBlock
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


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A one-rank gloo world (the shared expert's megatron-core linears need parallel groups)."""
    import torch.distributed as dist

    import parallm
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                            world_size=1)
    try:
        parallm.init_parallel()
        yield
    finally:
        parallm.destroy_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("top_k,shared", [(2, False), (4, True)])
def test_moe_moves_rows_by_permutations_only(world_of_one, top_k, shared):
    block = _block(top_k, shared)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    out = block(x)
    nodes = _graph(out.grad_fn)
    names = sorted({type(n).__name__ for n in nodes})
    gathers = [n for n in nodes if type(n).__name__.startswith("IndexSelectBackward")]
    assert gathers, names          # the dispatch and the unsort are gathers
    for node in gathers:
        index = node._saved_index
        assert index.numel() == index.unique().numel(), f"a gather repeats rows (its backward accumulates): {names}"
    assert not [n for n in names if n.startswith(ACCUMULATING)], names
    torch.testing.assert_close(out, _reference(block, x), rtol=1e-5, atol=1e-6)

    def step():
        xx = x.detach().clone().requires_grad_(True)
        for p in block.parameters():
            p.grad = None
        (block(xx) * torch.linspace(-1, 1, 16)).sum().backward()
        return [xx.grad] + [p.grad.clone() for p in block.parameters()]
    first, second = step(), step()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
