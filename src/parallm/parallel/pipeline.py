"""The pipeline engine: 1F1B schedules (interleaved with virtual stages) over point-to-point sends.

Why not Megatron's schedules: they hard-code ``device="cuda"``; ``torch.distributed.pipelining`` infers
inter-stage shapes once. This engine is small and explicit instead:

* Stage order is Megatron's interleaving: global stage ``k = vpp_rank * pp + pp_rank``, so activations always go
  to the next rank of the pipeline ring (the last rank wraps to rank 0's next virtual chunk) and gradients to the
  previous one.
* Schedules (:func:`schedule`): each rank runs a fixed list of forward ("F") and backward ("B") steps on
  (microbatch, virtual chunk) pairs. ``pp == 1``: each microbatch's forward, then its backward. ``pp > 1``
  without virtual stages: 1F1B (rank p runs ``pp - p - 1`` warm-up forwards, then alternates one forward and one
  backward); with virtual stages: Megatron's interleaved 1F1B (same microbatch groups of ``pp``, same warm-up
  count). A rank therefore holds the activations of at most ``pp - p`` microbatches (1F1B), or
  ``2 (pp - p - 1) + (vpp - 1) pp + 1`` virtual-stage microbatches (interleaved), whatever ``num_microbatches``.
* Messages: every activation / gradient is preceded by a header naming it (kind, microbatch, sending stage) and
  its shape, so microbatches may differ in size (packed sequences, sequence parallel), and a receiver that gets
  another message than the one it waits for (two kinds of message share the link when ``pp == 2`` with virtual
  stages) keeps it until its turn: receives match by name, not by arrival order, on any backend.
* Sends are non-blocking (``isend``) and receives block; with every rank's steps in the orders of
  :func:`schedule` no rank can wait forever (checked for a grid of layouts by simulation in the tests).
  A send's buffer is released once the schedules prove the receiver has it (a later message from that peer),
  so buffers of in-flight sends do not pile up either.

Not done here: overlapping communication with compute.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .state import ParallelDims, dims_of

_ACT, _GRAD = 0, 1


# -- schedules (pure) -----------------------------------------------------------------------------------------

def _virtual_order(pp: int, vpp: int, num_microbatches: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order every rank runs its forwards (Megatron's schedule table: microbatches
    in groups of ``pp``, each group through chunk 0, then chunk 1, ...; the last group takes the rest)."""
    order = []
    start = 0
    while start < num_microbatches:
        stop = min(num_microbatches, start + pp)
        order += [(m, v) for v in range(vpp) for m in range(start, stop)]
        start = stop
    return order


def megatron_warmup(pp: int, pp_rank: int, vpp: int, num_microbatches: int) -> int:
    """Megatron's count of forward steps a rank runs before its first backward."""
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - pp_rank - 1, total)
    return min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)


def _steps(order, warm: int, vpp: int) -> list[tuple[str, int, int]]:
    fwd = [("F", m, v) for m, v in order]
    bwd = [("B", m, vpp - 1 - v) for m, v in order]
    steps = fwd[:warm]
    for k in range(len(fwd) - warm):
        steps += [fwd[warm + k], bwd[k]]
    return steps + bwd[len(fwd) - warm:]


def simulate(all_steps: list[list[tuple[str, int, int]]], pp: int, vpp: int):
    """Run every rank's steps with non-blocking sends and blocking receives. Returns ``(stuck, peak)``:
    the ranks blocked forever (empty when the schedules complete) and each rank's most live forwards."""
    last = pp * vpp - 1
    pos, live, peak = [0] * pp, [0] * pp, [0] * pp
    sent = set()
    moved = True
    while moved:
        moved = False
        for p in range(pp):
            while pos[p] < len(all_steps[p]):
                kind, m, v = all_steps[p][pos[p]]
                k = v * pp + p
                need = (("A", m, k - 1) if k > 0 else None) if kind == "F" else \
                    (("G", m, k + 1) if k < last else None)
                if need is not None and need not in sent:
                    break
                if kind == "F":
                    sent.add(("A", m, k))
                    live[p] += 1
                    peak[p] = max(peak[p], live[p])
                else:
                    sent.add(("G", m, k))
                    live[p] -= 1
                pos[p] += 1
                moved = True
    return [p for p in range(pp) if pos[p] < len(all_steps[p])], peak


def schedule(pp: int, pp_rank: int, vpp: int, num_microbatches: int, *, backward: bool
             ) -> list[tuple[str, int, int]]:
    """This rank's steps, in order: ``("F" | "B", microbatch, virtual chunk)``.

    Megatron's interleaved schedule needs ``num_microbatches`` to be a multiple of ``pp``; for other counts the
    same order with Megatron's warm-up would leave ranks waiting on each other, so the warm-up of the ranks that
    would block is lengthened (found by simulating all ranks, identically on each) until every schedule
    completes. All forwards first (GPipe) always completes, so this ends.
    """
    order = _virtual_order(pp, vpp, num_microbatches)
    if not backward:
        return [("F", m, v) for m, v in order]
    return _steps(order, warmups(pp, vpp, num_microbatches)[pp_rank], vpp)


@functools.lru_cache(maxsize=64)
def warmups(pp: int, vpp: int, num_microbatches: int) -> tuple[int, ...]:
    """Forward steps each pipeline rank runs before its first backward (Megatron's, lengthened where needed).
    Cached: the search simulates every rank's schedule, possibly many times (seconds at pp 8 x vpp 4 with 100
    microbatches), and a training loop asks for the same layout at every step, on each rank several times."""
    order = _virtual_order(pp, vpp, num_microbatches)
    warm = [megatron_warmup(pp, p, vpp, num_microbatches) for p in range(pp)]
    while True:
        stuck, _ = simulate([_steps(order, w, vpp) for w in warm], pp, vpp)
        if not stuck:
            return tuple(warm)
        for p in stuck:
            warm[p] = min(warm[p] + 1, len(order))


# -- point-to-point -------------------------------------------------------------------------------------------

class _Mailbox:
    """Point-to-point neighbours in this rank's pipeline group (asked of the group, never computed), named
    messages, and the sends still in flight.

    A message is named ``(kind, microbatch, sending stage)``. Sent buffers must stay alive until the receiver has
    them, but a gloo send does not report completion before it is waited on. The schedules say when that is
    certain: a message from peer q produced at q's step j means q has run every step before j, so every send to q
    consumed by one of those steps is complete; those are waited on (instantly) and dropped, which keeps the
    buffers held by in-flight sends bounded like the activations.
    """

    def __init__(self, layout: ParallelDims, device, *, vpp: int, num_microbatches: int, backward: bool):
        ranks = dist.get_process_group_ranks(layout.pp_group)
        self.next = ranks[(layout.pp_rank + 1) % layout.pp]
        self.prev = ranks[(layout.pp_rank - 1) % layout.pp]
        self.device = device
        self.pp, self.vpp = layout.pp, vpp
        self.schedule_args = (num_microbatches, backward)
        self.positions = {}  # pp rank -> {step: its index in that rank's schedule}
        self.pending = []    # [consumer's step index, destination, works, tensors kept alive]
        self.early = {}      # (src, name) -> tensor received before its turn

    def _position(self, pp_rank: int, step) -> int:
        if pp_rank not in self.positions:
            m, backward = self.schedule_args
            steps = schedule(self.pp, pp_rank, self.vpp, m, backward=backward)
            self.positions[pp_rank] = {s: i for i, s in enumerate(steps)}
        return self.positions[pp_rank][step]

    def _step(self, kind: int, m: int, stage: int):
        """(pp rank, step) of stage ``stage`` running microbatch ``m``: a forward for an activation, a backward
        for a gradient."""
        return stage % self.pp, ("F" if kind == _ACT else "B", m, stage // self.pp)

    def send(self, tensor: torch.Tensor, dst: int, name: tuple[int, int, int]) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() != 3:
            raise RuntimeError(f"pipeline tensors are [S, B, H]; got shape {tuple(tensor.shape)}")
        kind, m, stage = name
        consumer = self._position(*self._step(kind, m, stage + 1 if kind == _ACT else stage - 1))
        header = torch.tensor([*name, *tensor.shape], dtype=torch.long, device=self.device)
        self.pending.append([consumer, dst, [dist.isend(header, dst), dist.isend(tensor, dst)], (header, tensor)])

    def recv(self, src: int, name: tuple[int, int, int], dtype) -> torch.Tensor:
        if (src, name) in self.early:
            return self.early.pop((src, name))
        while True:
            header = torch.empty(6, dtype=torch.long, device=self.device)
            dist.recv(header, src)
            values = header.tolist()
            buf = torch.empty(values[3:], dtype=dtype, device=self.device)
            dist.recv(buf, src)
            got = tuple(values[:3])
            self._settle(src, self._position(*self._step(*got)))
            if got == name:
                return buf
            if (src, got) in self.early:
                raise RuntimeError(f"pipeline: message {got} from rank {src} arrived twice")
            self.early[(src, got)] = buf

    def _settle(self, peer: int, produced_at: int) -> None:
        """``peer`` has run its steps before ``produced_at``: the sends to it consumed by those are complete."""
        keep = []
        for entry in self.pending:
            consumer, dst, works, _ = entry
            if dst == peer and consumer < produced_at:
                for work in works:
                    work.wait()
            else:
                keep.append(entry)
        self.pending = keep

    def wait(self) -> None:
        for _, _, works, _ in self.pending:
            for work in works:
                work.wait()
        self.pending.clear()
        if self.early:
            raise RuntimeError(f"pipeline: unexpected messages left over: {sorted(self.early)}")


# -- the engine -----------------------------------------------------------------------------------------------

def run_pipeline(chunks, microbatches, *, last_stage_fn, backward: bool, compute_kwargs=None):
    """Run every microbatch through this rank's chunks in the order of :func:`schedule`.

    ``microbatches``: list of ``(input_ids, position_ids, attention_mask)``. ``last_stage_fn(chunk, out, mb_index)``
    turns the last stage's raw output into what is kept (a loss when ``backward``). ``compute_kwargs``: extra
    keyword arguments of ``chunk.compute``. Returns the kept values in microbatch order on last-stage ranks, []
    elsewhere. With ``backward``, each kept loss is back-propagated scaled by ``1 / len(microbatches)``, and only
    detached copies are returned.
    """
    layout = dims_of(chunks)
    param = next(chunks[0].parameters())
    box = _Mailbox(layout, param.device, vpp=len(chunks), num_microbatches=len(microbatches), backward=backward)
    dtype = chunks[0].config.params_dtype
    pp, vpp = layout.pp, len(chunks)
    kwargs = compute_kwargs or {}
    live = {}       # (m, v) -> (received input, output): the graphs still waiting for their backward
    kept = {}
    try:
        for kind, m, v in schedule(pp, layout.pp_rank, vpp, len(microbatches), backward=backward):
            chunk = chunks[v]
            stage = v * pp + layout.pp_rank
            if kind == "F":
                ids, pos, mask = microbatches[m]
                inp = None
                if not chunk.pre_process:
                    inp = box.recv(box.prev, (_ACT, m, stage - 1), dtype)
                    inp.requires_grad_(backward)
                chunk.set_input_tensor(inp)
                out = chunk.compute(ids, pos, mask, **kwargs)
                chunk.set_input_tensor(None)
                if chunk.post_process:
                    out = last_stage_fn(chunk, out, m)
                    kept[m] = out.detach() if backward else out
                else:
                    box.send(out, box.next, (_ACT, m, stage))
                if backward:
                    live[m, v] = (inp, out)
            else:
                inp, out = live.pop((m, v))
                if chunk.post_process:
                    torch.autograd.backward(out / len(microbatches))
                else:
                    grad = box.recv(box.next, (_GRAD, m, stage + 1), out.dtype)
                    torch.autograd.backward(out, grad)
                del out
                if inp is not None:
                    box.send(inp.grad if inp.grad is not None else torch.zeros_like(inp), box.prev,
                             (_GRAD, m, stage))
                del inp
        box.wait()
    finally:
        for chunk in chunks:
            chunk.set_input_tensor(None)
    return [kept[m] for m in sorted(kept)]


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
