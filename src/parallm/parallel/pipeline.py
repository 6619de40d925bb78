"""The pipeline engine: all forwards, then all backwards (GPipe order), over point-to-point sends.

Why not Megatron's schedules: they hard-code ``device="cuda"``; ``torch.distributed.pipelining`` infers
inter-stage shapes once. This engine is small and explicit instead:

* Stage order is Megatron's interleaving: global stage ``k = vpp_rank * pp + pp_rank``, so activations always go
  to the next rank of the pipeline ring (the last rank wraps to rank 0's next virtual chunk) and gradients to the
  previous one.
* Every activation / gradient is preceded by its shape (3 int64s), so microbatches may differ in size
  (packed sequences, sequence parallel).
* Each rank walks its (microbatch, chunk) pairs in lexicographic order forward and in reverse order backward;
  that is a topological order of the whole pipeline, and sends are non-blocking, so the schedule cannot
  deadlock. Microbatches overlap across stages naturally (rank p works on microbatch m+1 while p+1 works on m),
  but the schedule keeps every microbatch's activations until the backward phase (GPipe memory, not 1F1B).

Not done here: 1F1B memory savings, overlapping communication with compute. On GPU, users who want those can
drive the same chunks with Megatron's ``get_forward_backward_func`` (see docs/pipeline.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import ParallelDims, dims_of


class _Ring:
    """Point-to-point neighbours in this rank's pipeline group (asked of the group, never computed)."""

    def __init__(self, layout: ParallelDims, device):
        ranks = dist.get_process_group_ranks(layout.pp_group)
        self.next = ranks[(layout.pp_rank + 1) % layout.pp]
        self.prev = ranks[(layout.pp_rank - 1) % layout.pp]
        self.device = device
        self.pending = []  # (work, tensors kept alive until it completes)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        header = torch.tensor(list(tensor.shape), dtype=torch.long, device=self.device)
        if header.numel() != 3:
            raise RuntimeError(f"pipeline tensors are [S, B, H]; got shape {tuple(tensor.shape)}")
        self.pending.append((dist.isend(header, dst), header))
        self.pending.append((dist.isend(tensor, dst), tensor))

    def recv(self, src: int, dtype) -> torch.Tensor:
        header = torch.empty(3, dtype=torch.long, device=self.device)
        dist.recv(header, src)
        buf = torch.empty(header.tolist(), dtype=dtype, device=self.device)
        dist.recv(buf, src)
        return buf

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def run_pipeline(chunks, microbatches, *, last_stage_fn, backward: bool, num_microbatches: int):
    """Run every microbatch through this rank's chunks.

    ``microbatches``: list of ``(input_ids, position_ids, attention_mask)``. ``last_stage_fn(chunk, out, mb_index)``
    turns the last stage's raw output into what is kept (a loss when ``backward``). Returns the list of kept
    values on last-stage ranks, [] elsewhere. With ``backward``, each kept loss is back-propagated scaled by
    ``1 / num_microbatches``.
    """
    layout = dims_of(chunks)
    param = next(chunks[0].parameters())
    ring = _Ring(layout, param.device)
    dtype = chunks[0].config.params_dtype
    saved, kept = [], []
    try:
        for m, (ids, pos, mask) in enumerate(microbatches):
            for chunk in chunks:
                inp = None
                if not chunk.pre_process:
                    inp = ring.recv(ring.prev, dtype)
                    inp.requires_grad_(backward)
                chunk.set_input_tensor(inp)
                out = chunk.compute(ids, pos, mask)
                chunk.set_input_tensor(None)
                if chunk.post_process:
                    out = last_stage_fn(chunk, out, m)
                    kept.append(out)
                else:
                    ring.send(out, ring.next)
                if backward:
                    saved.append((chunk, inp, out))
        ring.wait()
        if backward:
            for chunk, inp, out in reversed(saved):
                if chunk.post_process:
                    torch.autograd.backward(out / num_microbatches)
                else:
                    grad = ring.recv(ring.next, out.dtype)
                    torch.autograd.backward(out, grad)
                if inp is not None:
                    ring.send(inp.grad if inp.grad is not None else torch.zeros_like(inp), ring.prev)
            ring.wait()
    finally:
        for chunk in chunks:
            chunk.set_input_tensor(None)
    return [k.detach() for k in kept] if backward else kept


def broadcast_from_last_stage(layout: ParallelDims, tensor: torch.Tensor | None, shape, dtype,
                              device) -> torch.Tensor:
    """The last pipeline stage's tensor on every rank of the pipeline group."""
    ranks = dist.get_process_group_ranks(layout.pp_group)
    if layout.pp_rank != layout.pp - 1:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    else:
        tensor = tensor.detach().to(dtype).contiguous()
    dist.broadcast(tensor, src=ranks[-1], group=layout.pp_group)
    return tensor
