"""The pipeline engine: 1F1B schedules (interleaved with virtual stages) over batched point-to-point exchanges.

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
* Exchanges (:func:`exchange_plan`): the schedules of all ranks are played out together in rounds, identically
  on every rank (a pure function of pp, vpp and the microbatch count). In each round every rank runs at most one
  step, and a message produced in one round travels in the next: its send and its receive sit in the same round
  of the two ranks. A rank posts each round's sends and receives together as one ``batch_isend_irecv`` (what
  Megatron's ``send_forward_recv_backward`` does) and waits for it before computing. Why this cannot deadlock on
  a transport that buffers nothing (NCCL: a send completes only once its receive is posted, a rank's operations
  run in issue order): once every rank has finished its rounds before r, every rank posts round r, and round r's
  operations are all matched within round r. Each link carries at most one message per round, so the order of
  messages on a link is the same on both ends, as NCCL (which matches point-to-point operations by order, not
  by name) requires.
* No headers: a message's shape is that of its microbatch's stage-boundary activation, which every rank of the
  pipeline computes from the batch it holds (:meth:`DecoderChunk.boundary_shape`), so microbatches may differ in
  size (packed streams) without a shape exchange or a host sync per message. A sender checks its tensor against
  that shape before posting.
* A message may arrive before its step needs it (``pp == 2`` with virtual stages: both kinds share a link); it
  waits in the inbox. An error inside the loop (a ``loss_fn`` that raises on the last stage, say) aborts the
  process groups before it is raised, so the peers, blocked in an exchange with this rank, fail too instead of
  waiting for the timeout (on gloo at once; on NCCL at the process-group timeout, see docs/pipeline.md).

Not done here: overlapping communication with compute.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .state import ParallelDims, dims_of

_ACT, _GRAD = 0, 1


# -- schedules (pure) -----------------------------------------------------------------------------------------

def microbatch_groups(pp: int, num_microbatches: int) -> list[int]:
    """Sizes of the groups of microbatches the interleaved schedule walks through the virtual chunks together:
    ``pp`` each, as Megatron's schedule table, when ``pp`` divides the count; otherwise ``count // pp`` groups whose
    sizes differ by at most one (fewer than ``pp`` microbatches: one group). Megatron refuses a last group smaller
    than ``pp`` (it leaves ranks waiting on each other); spreading the remainder keeps the warm-up, and the memory
    it holds, as close to Megatron's as a count allows."""
    if num_microbatches <= pp:
        return [num_microbatches]
    q, r = divmod(num_microbatches, pp)
    return [pp + r // q + (1 if i < r % q else 0) for i in range(q)]


def _virtual_order(pp: int, vpp: int, num_microbatches: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order every rank runs its forwards: each group of :func:`microbatch_groups`
    through chunk 0, then chunk 1, ..."""
    order, start = [], 0
    for size in microbatch_groups(pp, num_microbatches):
        order += [(m, v) for v in range(vpp) for m in range(start, start + size)]
        start += size
    return order


def warmup_steps(pp: int, pp_rank: int, vpp: int, num_microbatches: int) -> int:
    """Forward steps a rank runs before its first backward: Megatron's ``pp - p - 1`` (1F1B) or
    ``2 (pp - p - 1) + (vpp - 1) G`` (interleaved), ``G`` the largest microbatch group (``pp`` when ``pp`` divides
    the count, as in Megatron). A backward of chunk ``vpp - 1 - v`` then always follows its forward, and at most
    this many plus one virtual-stage microbatches are alive on the rank."""
    total = num_microbatches * vpp
    if vpp == 1:
        return min(pp - pp_rank - 1, total)
    return min((pp - pp_rank - 1) * 2 + (vpp - 1) * max(microbatch_groups(pp, num_microbatches)), total)


def _steps(order, warm: int, vpp: int) -> list[tuple[str, int, int]]:
    fwd = [("F", m, v) for m, v in order]
    bwd = [("B", m, vpp - 1 - v) for m, v in order]
    steps = fwd[:warm]
    for k in range(len(fwd) - warm):
        steps += [fwd[warm + k], bwd[k]]
    return steps + bwd[len(fwd) - warm:]


def _step_io(pp: int, vpp: int, pp_rank: int, step):
    """``(needs, makes)`` of one step: the message it consumes, from which pipeline rank, and the one it produces,
    for which rank (each ``None`` or ``(name, peer)``, names ``(kind, microbatch, sending stage)``)."""
    kind, m, v = step
    k, last = v * pp + pp_rank, pp * vpp - 1
    prev, nxt = (pp_rank - 1) % pp, (pp_rank + 1) % pp
    if kind == "F":
        return (((_ACT, m, k - 1), prev) if k > 0 else None,
                ((_ACT, m, k), nxt) if k < last else None)
    return (((_GRAD, m, k + 1), nxt) if k < last else None,
            ((_GRAD, m, k), prev) if k > 0 else None)


def play(all_steps: list[list[tuple[str, int, int]]], pp: int, vpp: int):
    """Play every rank's steps out together, in rounds. In a round each rank first exchanges: it sends what its
    previous round's step produced and receives what its peers send in this round; then it runs its next step if
    that step's input has arrived. Returns ``(stuck, peak, rounds)``: the ranks whose steps never complete (empty
    when the schedules complete), each rank's most live forwards, and each rank's rounds as
    ``[(ops, step or None)]`` without the empty ones; ``ops`` lists ``("send" | "recv", peer, name)``."""
    pos, live, peak = [0] * pp, [0] * pp, [0] * pp
    arrived = [set() for _ in range(pp)]
    outgoing = [None] * pp                   # (name, peer) produced in the previous round
    rounds = [[] for _ in range(pp)]
    while True:
        ops = [[] for _ in range(pp)]
        for p, out in enumerate(outgoing):
            if out is not None:
                name, peer = out
                ops[p].append(("send", peer, name))
                ops[peer].append(("recv", p, name))
                arrived[peer].add(name)
        outgoing = [None] * pp
        ran = [None] * pp
        for p in range(pp):
            if pos[p] == len(all_steps[p]):
                continue
            step = all_steps[p][pos[p]]
            needs, makes = _step_io(pp, vpp, p, step)
            if needs is not None and needs[0] not in arrived[p]:
                continue
            if needs is not None:
                arrived[p].remove(needs[0])
            live[p] += 1 if step[0] == "F" else -1
            peak[p] = max(peak[p], live[p])
            outgoing[p], ran[p] = makes, step
            pos[p] += 1
        if not any(ops) and not any(r is not None for r in ran):
            break
        for p in range(pp):
            if ops[p] or ran[p] is not None:
                rounds[p].append((tuple(ops[p]), ran[p]))
    return [p for p in range(pp) if pos[p] < len(all_steps[p])], peak, rounds


def simulate(all_steps: list[list[tuple[str, int, int]]], pp: int, vpp: int):
    """``(stuck, peak)`` of :func:`play`."""
    stuck, peak, _ = play(all_steps, pp, vpp)
    return stuck, peak


def schedule(pp: int, pp_rank: int, vpp: int, num_microbatches: int, *, backward: bool
             ) -> list[tuple[str, int, int]]:
    """This rank's steps, in order: ``("F" | "B", microbatch, virtual chunk)``: :func:`warmup_steps` forwards,
    then one forward and one backward in turn, then the remaining backwards. Every microbatch count completes
    with at most ``warmup_steps + 1`` live forwards per rank (checked by simulation for pp <= 8, vpp <= 4 in the
    tests)."""
    order = _virtual_order(pp, vpp, num_microbatches)
    if not backward:
        return [("F", m, v) for m, v in order]
    return _steps(order, warmup_steps(pp, pp_rank, vpp, num_microbatches), vpp)


@functools.lru_cache(maxsize=64)
def exchange_plan(pp: int, vpp: int, num_microbatches: int, *, backward: bool) -> tuple:
    """Every pipeline rank's rounds (:func:`play`) for these schedules. Cached: a training loop asks for the same
    layout at every step, and playing out pp 8 x vpp 4 with 100 microbatches takes a noticeable fraction of a
    second."""
    steps = [schedule(pp, p, vpp, num_microbatches, backward=backward) for p in range(pp)]
    stuck, _, rounds = play(steps, pp, vpp)
    if stuck:   # never, by schedule()'s construction; a bug if it happens
        raise RuntimeError(f"pipeline schedules pp={pp} vpp={vpp} m={num_microbatches} do not complete: {stuck}")
    return tuple(tuple(r) for r in rounds)


# -- the exchange ---------------------------------------------------------------------------------------------

class DistTransport:
    """Point-to-point over the pipeline process group: ``ranks`` are its members' global ranks in pipeline order
    (asked of the group, never computed); :meth:`post` starts one batch of sends and receives together."""

    def __init__(self, group):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        _first_use(group)

    def post(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        """``ops``: ``(is_send, tensor, global peer rank)``. Returns the works to wait on."""
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, t, peer, group=self.group)
                                       for send, t, peer in ops])


_WARMED: dict = {}


def _first_use(group) -> None:
    """NCCL wants every member in a group's first collective; a batch_isend_irecv involving a subset of the group
    as its first use is undefined there. One all-reduce over the group, once per group, settles that."""
    from .state import layout_generation
    key = (id(group), layout_generation())
    if key not in _WARMED:
        from .state import group_device
        flag = torch.zeros(1, device=group_device(group))
        dist.all_reduce(flag, group=group)
        _WARMED[key] = True


def run_pipeline(chunks, microbatches, *, last_stage_fn, backward: bool, compute_kwargs=None, transport=None,
                 on_step=None, side: dict | None = None):
    """Run every microbatch through this rank's chunks in the order of :func:`schedule`, exchanging activations
    and gradients as :func:`exchange_plan` says.

    ``microbatches``: list of ``(input_ids, position_ids, attention_mask)``, or of ``(input_ids, position_ids,
    attention_mask, context_split)`` under context parallelism (the split, this rank's share of the microbatch,
    travels with it to every chunk's ``compute(cp=...)`` and sizes the stage-boundary messages: the activations
    exchanged are the local ones). ``last_stage_fn(chunk, out, mb_index)``
    turns the last stage's raw output into what is kept (a loss when ``backward``). ``compute_kwargs``: extra
    keyword arguments of ``chunk.compute``. ``transport``: what carries the messages (default
    :class:`DistTransport` over the pipeline group; tests pass a stand-in). Returns the kept values in
    microbatch order on last-stage ranks, [] elsewhere. With ``backward``, what ``last_stage_fn`` returns is
    back-propagated as it is (the caller scales it), and only detached copies are returned.
    ``on_step(kind, m, v)``: called before each step runs (``"F"`` / ``"B"``, microbatch, virtual chunk).
    ``side``: a dict ``{microbatch: float}`` that travels backwards with the gradients: ``last_stage_fn`` fills
    ``side[m]`` on the last stage, every gradient message of microbatch ``m`` carries it (one fp64 element
    beside the gradient, in the same batch of operations) and the receiver stores it in its own ``side`` before
    its backward of ``m`` (the load-balancing loss's per-microbatch weight:
    :class:`parallm.model.layers.moe.AuxScales`).
    """
    layout = dims_of(chunks)
    pp, vpp = layout.pp, len(chunks)
    kwargs = compute_kwargs or {}
    rounds = exchange_plan(pp, vpp, len(microbatches), backward=backward)[layout.pp_rank] if pp > 1 else \
        [((), step) for step in schedule(1, 0, vpp, len(microbatches), backward=backward)]
    if pp > 1 and transport is None:
        transport = DistTransport(layout.pp_group)
    param = next(chunks[0].parameters())
    dtype, device = chunks[0].config.params_dtype, param.device
    shapes = chunks[0].boundary_shapes([(mb[0], mb[2]) + tuple(mb[3:]) for mb in microbatches]) \
        if pp > 1 else None
    inbox, outbox = {}, {}       # name -> received tensor / tensor to send
    live = {}       # (m, v) -> (received input, output): the graphs still waiting for their backward
    kept = {}
    try:
        for ops, step in rounds:
            if ops:
                _exchange(transport, ops, inbox, outbox, shapes, dtype, device, side)
            if step is None:
                continue
            kind, m, v = step
            chunk = chunks[v]
            stage = v * pp + layout.pp_rank
            if on_step is not None:
                on_step(kind, m, v)
            if kind == "F":
                ids, pos, mask, *split = microbatches[m]
                inp = None
                if not chunk.pre_process:
                    inp = inbox.pop((_ACT, m, stage - 1))
                    inp.requires_grad_(backward)
                chunk.set_input_tensor(inp)
                out = chunk.compute(ids, pos, mask, **kwargs, **({"cp": split[0]} if split else {}))
                chunk.set_input_tensor(None)
                if chunk.post_process:
                    out = last_stage_fn(chunk, out, m)
                    kept[m] = out.detach() if backward else out
                else:
                    outbox[_ACT, m, stage] = out.detach()
                if backward:
                    live[m, v] = (inp, out)
            else:
                inp, out = live.pop((m, v))
                if chunk.post_process:
                    torch.autograd.backward(out)
                else:
                    torch.autograd.backward(out, inbox.pop((_GRAD, m, stage + 1)))
                del out
                if inp is not None:
                    outbox[_GRAD, m, stage] = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                del inp
        if inbox or outbox:
            raise RuntimeError(f"pipeline: messages left over: received {sorted(inbox)}, unsent {sorted(outbox)}")
    except BaseException:
        # the peers wait in an exchange with this rank (a pipeline message, or under context parallelism the
        # backward's reduce-scatter of the keys and values): make it fail for them too (at once where aborting
        # closes the connections; on gloo that happens when this process ends)
        if pp > 1 or getattr(layout, "cp", 1) > 1:
            from .errors import abort_process_groups
            abort_process_groups()
        raise
    finally:
        for chunk in chunks:
            chunk.set_input_tensor(None)
    return [kept[m] for m in sorted(kept)]


def _exchange(transport, ops, inbox, outbox, shapes, dtype, device, side=None) -> None:
    """One round's sends and receives, posted together and waited for (with ``side``, each gradient message
    followed by its microbatch's side value: see :func:`run_pipeline`)."""
    posted, extra = [], []
    for op, peer, name in ops:
        shape = shapes[name[1]]
        if op == "send":
            tensor = outbox.pop(name).contiguous()
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RuntimeError(f"pipeline: message {name} is {tuple(tensor.shape)} {tensor.dtype}; every rank "
                                   f"expects {shape} {dtype} for microbatch {name[1]}")
        else:
            tensor = inbox[name] = torch.empty(shape, dtype=dtype, device=device)
        posted.append((op == "send", tensor, transport.ranks[peer]))
        if side is not None and name[0] == _GRAD:
            value = torch.as_tensor(side[name[1]] if op == "send" else 0.0, dtype=torch.float64).to(device).reshape(1)
            posted.append((op == "send", value, transport.ranks[peer]))
            if op != "send":
                extra.append((name[1], value))
    try:
        for work in transport.post(posted):
            work.wait()
    except Exception as comm_error:  # noqa: BLE001 - a peer failed or died mid-pipeline
        from .errors import lost_peer_error
        raise lost_peer_error(comm_error, "pipeline exchange") from comm_error
    for m, value in extra:
        side[m] = value[0]          # a device tensor: read by its user when needed, no host sync here


def broadcast_from_last_stage(layout: ParallelDims, tensor: torch.Tensor | None, shape, dtype,
                              device) -> torch.Tensor:
    """The last pipeline stage's tensor on every rank of the pipeline group (at pp = 1, ``tensor`` itself)."""
    if layout.pp == 1:
        return tensor.detach().to(dtype)
    ranks = dist.get_process_group_ranks(layout.pp_group)
    if layout.pp_rank != layout.pp - 1:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    else:
        tensor = tensor.detach().to(dtype).contiguous()
    dist.broadcast(tensor, src=ranks[-1], group=layout.pp_group)
    return tensor
