"""``build_model(recompute="moe" / "selective")`` for the routed experts: their products recomputed in the
backward a few experts at a time, so that a MoE layer keeps only the rows its experts received, or at ep = 1 the
tokens those rows repeat (:func:`recomputed_token_experts`: k times smaller).

The default path (:meth:`parallm.model.layers.moe.Experts.forward` under autograd) keeps, per MoE layer, the
rows (``[M, H]``, M = tokens x top-k on one rank), fc1's output (``[M, 2 I / tp]``), the activation's
intermediates (clamped gate / up, ``silu(gate)``: up to three more ``[M, I / tp]``) and fc2's input: at
DeepSeek-V4-Flash's shape scaled to the bench (H 1024, I 512, top-6) ~192 MiB a layer at S = 2048, of a ~580 MiB
layer. :func:`recomputed_experts` computes the same output without autograd and keeps ``rows`` alone; its
backward walks the experts in chunks of at most :data:`CHUNK_ELEMENTS` recomputed elements (whole experts, at
least one a chunk), and for each chunk runs the experts' own forward (:meth:`Experts.compute`, the same
operations on the chunk's rows and the chunk's slabs of the stacked weights) under autograd and takes its
gradients at once: the chunk's rows' gradient and its slabs of the weights' (and biases') gradients, written into
whole-size gradients (slabs of experts that received no rows stay zero, as the default path's). What is alive in
the backward beyond the gradients is one chunk's products.

Bits: every operation of the forward and of the chunks is one of the default path's, per expert (a grouped GEMM
of a chunk computes each expert's group as the whole one does on CPU: a loop of ``mm`` per group; the loop
kernel is a loop anyway), so the outputs and the gradients are those of the default path (the tests check bit
equality on CPU; on a GPU's grouped kernel a chunk's groups are not guaranteed the whole's bits: not run on
one). Cost: each expert's two GEMMs and activation once more in the backward, in ``E / chunk`` pieces (on a GPU,
a larger :data:`CHUNK_ELEMENTS` means fewer launches).

Routing, the dispatch (all-to-all over EP, all-gather over TP) and the weighted sum of the choices are outside
(their own autograd functions keep what they keep: the weighted sum the expert outputs, ``[M, H]``); adapters
(:class:`parallm.model.layers.lora.LoraExperts` overrides ``project``) take the default path.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 22      # recomputed elements alive at once in the backward (16 MiB in fp32)


def expert_chunks(counts: list[int], per_row: int, budget: int = CHUNK_ELEMENTS):
    """``(first expert, end expert, first row, end row)`` of consecutive experts whose rows total at most
    ``budget / per_row`` (one expert alone where it has more); experts with no rows ride along."""
    limit = max(1, budget // max(per_row, 1))
    a = row = 0
    while a < len(counts):
        b, rows = a + 1, counts[a]
        while b < len(counts) and rows + counts[b] <= limit:
            rows += counts[b]
            b += 1
        yield a, b, row, row + rows
        a, row = b, row + rows


def _chunk_grads(ctx, saved, rows_of, grad, need_rows: bool, put_rows):
    """The backward of both functions (``saved``: their saved tensors): per chunk of experts, their forward again
    under autograd on the chunk's rows (``rows_of(r0, r1)``) and slabs of the weights; the rows' gradients
    handed to ``put_rows(r0, r1, g)``, the slabs' written into whole-size weight gradients (zero where an expert
    got no rows), which are returned."""
    counts_device, *params = saved[-5:]
    experts, counts = ctx.experts, ctx.counts
    need = ctx.needs_input_grad[-4:]
    grads = [torch.zeros_like(p) if p is not None and n else None for p, n in zip(params, need)]
    per_row = grad.shape[-1] * 2 + 4 * params[0].shape[-2 if not experts.columns else -1]
    grad = grad.contiguous()
    for a, b, r0, r1 in expert_chunks(counts, per_row):
        if r0 == r1:         # no rows: zero gradients, as the default path's
            continue
        with torch.enable_grad():
            x = rows_of(r0, r1).detach().requires_grad_(need_rows)
            slabs = [None if p is None else p.detach()[a:b].requires_grad_(n) for p, n in zip(params, need)]
            out = experts.compute(x, counts[a:b], counts_device[a:b], slabs)
            wanted = [t for t in [x, *slabs] if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad(out, wanted, grad[r0:r1]))
        if need_rows:
            put_rows(r0, r1, next(got))
        for g in grads:
            if g is not None:
                g[a:b] = next(got)
    return grads


class _RecomputedExperts(torch.autograd.Function):
    """Forward: ``experts.compute(rows, ...)`` without autograd, keeping ``rows``. Backward: per chunk of experts,
    the chunk's forward again under autograd and its gradients (see the module doc)."""

    @staticmethod
    def forward(ctx, experts, rows, counts, counts_device, w1, b1, w2, b2):
        with torch.no_grad():
            out = experts.compute(rows, counts, counts_device, (w1, b1, w2, b2))
        ctx.experts, ctx.counts = experts, counts
        ctx.save_for_backward(rows, counts_device, w1, b1, w2, b2)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        rows = saved[0]
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[1] else None

        def put(r0, r1, g):
            grad_rows[r0:r1] = g
        grads = _chunk_grads(ctx, saved, lambda r0, r1: rows[r0:r1], grad, grad_rows is not None, put)
        return (None, grad_rows, None, None, *grads)


class _RecomputedTokenExperts(torch.autograd.Function):
    """As :class:`_RecomputedExperts` for rows that are the tokens' routed slots (``tokens [n, H]`` each repeated
    for its k choices, sorted by expert: :func:`parallm.parallel.experts.slots_of`), keeping the tokens and the
    slot order instead of the rows. The tokens' gradient is that of ``slots_of``'s backward: each row's gradient
    put back in its token-major slot (written once: no accumulation) and summed over the k choices."""

    @staticmethod
    def forward(ctx, experts, tokens, slots, counts, counts_device, w1, b1, w2, b2):
        with torch.no_grad():
            out = experts.compute(tokens.index_select(0, slots.token), counts, counts_device, (w1, b1, w2, b2))
        ctx.experts, ctx.counts, ctx.slots = experts, counts, slots
        ctx.save_for_backward(tokens, counts_device, w1, b1, w2, b2)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        tokens, slots = saved[0], ctx.slots
        need = ctx.needs_input_grad[1]
        by_token = grad.new_empty(slots.order.shape[0], tokens.shape[-1]) if need else None

        def put(r0, r1, g):         # sorted slot s is token-major slot order[s]
            by_token.index_copy_(0, slots.order[r0:r1], g)
        grads = _chunk_grads(ctx, saved, lambda r0, r1: tokens.index_select(0, slots.token[r0:r1]), grad, need, put)
        grad_tokens = by_token.view(-1, slots.k, tokens.shape[-1]).sum(dim=1) if need else None
        return (None, grad_tokens, None, None, None, *grads)


def _check_counts(counts: list[int], rows: int) -> None:
    if sum(counts) != rows:
        raise ValueError(f"the experts' row counts sum to {sum(counts)}, but there are {rows} rows")


def recomputed_experts(experts, rows: torch.Tensor, counts: list[int], counts_device: torch.Tensor) -> torch.Tensor:
    """``experts(rows, counts, counts_device)`` (an :class:`parallm.model.layers.moe.Experts`) keeping only
    ``rows`` for the backward, which recomputes the experts chunk by chunk (see the module doc)."""
    _check_counts(counts, rows.shape[0])
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    return _RecomputedExperts.apply(experts, rows, counts, counts_device, fc1.weight, fc1.bias, fc2.weight,
                                    fc2.bias)


def recomputed_token_experts(experts, tokens: torch.Tensor, slots, counts: list[int],
                             counts_device: torch.Tensor) -> torch.Tensor:
    """``experts(slots_of(tokens, slots), counts, counts_device)`` where no all-to-all moves the rows (ep = 1),
    keeping ``tokens`` ``[n, H]`` (which the router keeps anyway) instead of the k times larger rows; each
    chunk's rows are gathered again in the backward (a gather: the same bits)."""
    _check_counts(counts, slots.token.shape[0])
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    return _RecomputedTokenExperts.apply(experts, tokens, slots, counts, counts_device, fc1.weight, fc1.bias,
                                         fc2.weight, fc2.bias)
