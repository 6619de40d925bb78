"""Gradient buckets: the data-parallel reduction in a few contiguous buffers, started while the backward runs.

What :func:`parallm.build_optimizer` sets up with ``overlap_grad_reduce=True`` (and, for its ZeRO partition,
with ``shard_over_dp=True``), as megatron-core's DDP does:

* **Domains.** Gradients are combined over one group per kind of parameter (:func:`reduction_domains`): routed
  experts over the expert-data-parallel group, everything else over the data-parallel group.
* **Plan** (:func:`plan_buckets`, pure). Each domain's parameters, in backward order (last chunk first, each
  chunk's parameters last to first), are cut into buckets of about ``bucket_bytes`` of gradient. Parameters whose
  gradient needs a model-parallel correction first (KV heads replicated over TP, tied embeddings across stages,
  ``tp_sum``: see :mod:`parallm.train.grads`) and the head weight, whose gradient ``output="logprobs"`` adds
  without autograd (no hook fires), are *deferred*: they form the last buckets, reduced by ``finalize_grads``
  after its corrections, as before. Under ZeRO every parameter gets one owner rank in the domain: a bucket's
  parameters are packed into one slice per rank (largest first, onto the least loaded rank), padded to equal
  slices, and reduce-scattered; a bucket whose slices would waste more than a quarter in padding (one large
  parameter) belongs to one rank whole and is reduced onto it. Every offset is a multiple of ``ALIGN`` elements.
* **Buffers** (:class:`GradBuffers`). ``param.grad`` (fp32 parameters) or ``param.main_grad`` (bf16 ones) is
  a view into its bucket's buffer, so autograd and the main_grad hook accumulate in place and nothing is
  flattened or copied to reduce it. A post-accumulate-grad hook counts each parameter's accumulations.
* **Overlap.** :func:`parallm.train.grads.expect_microbatches` states how many backward passes of each chunk make
  the step (the pipeline engine runs one per microbatch per chunk). A bucket is ready when each of its parameters
  has had that many accumulations: that was the last one, so its reduction may start. Buckets are launched
  strictly in plan order (a ready bucket waits for the ones before it), so every rank issues the same
  collectives in the same order whatever its data (a routed expert that got no tokens on one rank is simply
  late there). Without the count nothing starts early: ``finalize_grads`` launches every bucket, which still
  saves the flatten copies. An accumulation into a bucket already being reduced is an error (the count was
  too small), not a wrong gradient.
* **Bits.** The reduction of a bucket is the sum of the same per-rank values as before, then the same
  ``mul_(scale)``; with two ranks in a group every element is ``a + b`` whatever the buffer layout, so results
  equal those of the unbucketed ``finalize_grads`` bit for bit. With more ranks the collective's summation
  order depends on where an element sits in the buffer (gloo's ring and NCCL alike), so bucketed and unbucketed
  results may differ in the last bit; bucketed runs with and without overlap are identical at any size.

:class:`ParamBuckets` is the same plan for the parameters of a ZeRO partition: each parameter a view into its
bucket's parameter buffer, so after the owners' step one all-gather (or one broadcast from the owner) per bucket
brings every replica up to date.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model.params import uses_main_grad
from ..model.placement import placement_of

ALIGN = 64                       # elements: where every tensor of a bucket starts
DEFAULT_BUCKET_BYTES = 40_000_000 * 4   # megatron-core's default bucket: 40M fp32 gradient elements
_PAD_LIMIT = 1.25                # a padded reduce-scatter bucket may hold at most 25% padding


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- the plan (pure) ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BucketPlan:
    """One bucket: ``params`` (positions in its domain's parameter list) at ``offsets`` of a buffer of
    ``numel`` elements. ``kind``: ``"all_reduce"`` (every rank gets every gradient), ``"reduce_scatter"`` (rank
    r's parameters lie in ``[r * segment, (r + 1) * segment)``) or ``"owner"`` (all of it belongs to
    ``owners[0]``, reduced onto that rank). ``owners``: each parameter's owner rank in the domain (ZeRO), ``()``
    unsharded. ``deferred``: reduced by finalize_grads only."""
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    kind: str
    segment: int = 0
    owners: tuple[int, ...] = ()
    deferred: bool = False


def plan_buckets(sizes: list[int], deferred: list[bool], *, world: int, bucket_numel: int, shard: bool
                 ) -> list[BucketPlan]:
    """Buckets for parameters of ``sizes`` elements, given in backward order: the non-deferred ones first, in
    that order, then the deferred ones; a new bucket starts when the next parameter would take the bucket past
    ``bucket_numel`` (a larger parameter is a bucket of its own). ``shard``: give every parameter an owner among
    ``world`` ranks (see the module docstring); the total each rank owns is balanced greedily, in plan order.
    Deterministic: every rank computes the same plan."""
    if len(sizes) != len(deferred):
        raise ValueError("sizes and deferred differ in length")
    runs: list[tuple[list[int], bool]] = []
    for late in (False, True):
        current, total = [], 0
        for i, n in enumerate(sizes):
            if deferred[i] != late:
                continue
            if current and total + _aligned(n) > bucket_numel:
                runs.append((current, late))
                current, total = [], 0
            current.append(i)
            total += _aligned(n)
        if current:
            runs.append((current, late))
    load = [0] * world
    plans = []
    for members, late in runs:
        if not shard or world == 1:
            offsets, at = [], 0
            for i in members:
                offsets.append(at)
                at += _aligned(sizes[i])
            plans.append(BucketPlan(tuple(members), tuple(offsets), at,
                                    "all_reduce" if world > 1 else "local",
                                    owners=(0,) * len(members) if shard else (), deferred=late))
            continue
        bins: list[list[int]] = [[] for _ in range(world)]
        fill = [0] * world
        for i in sorted(members, key=lambda i: (-sizes[i], i)):
            r = min(range(world), key=lambda r: (fill[r], load[r], r))
            bins[r].append(i)
            fill[r] += _aligned(sizes[i])
        total, segment = sum(fill), max(fill)
        if world * segment <= _PAD_LIMIT * total:
            params, offsets, owners = [], [], []
            for r in range(world):
                at = r * segment
                for i in sorted(bins[r]):
                    params.append(i)
                    offsets.append(at)
                    owners.append(r)
                    at += _aligned(sizes[i])
                load[r] += fill[r]
            plans.append(BucketPlan(tuple(params), tuple(offsets), world * segment, "reduce_scatter",
                                    segment=segment, owners=tuple(owners), deferred=late))
        else:
            owner = min(range(world), key=lambda r: (load[r], r))
            offsets, at = [], 0
            for i in members:
                offsets.append(at)
                at += _aligned(sizes[i])
            load[owner] += at
            plans.append(BucketPlan(tuple(members), tuple(offsets), at, "owner", owners=(owner,) * len(members),
                                    deferred=late))
    return plans


# -- domains --------------------------------------------------------------------------------------------------

def reduction_domains(dims) -> dict[str, tuple[object, int]]:
    """The group (and its size) over which each kind of gradient is combined: ``"dense"`` (everything but routed
    experts) over the data-parallel group, with its context-parallel ranks under context parallelism (each holds
    the gradient of its share of the tokens: they are summed, and the scale stays 1 / dp), ``"expert"`` over the
    expert-data-parallel group (megatron-core carves it from dp x cp, so it holds the context-parallel ranks
    already). The one place that says so: finalize_grads, the buckets, the ZeRO partition and the sharded grad
    norm all ask here."""
    dense = (dims.dp_cp_group, dims.dp_cp) if dims.cp > 1 else (dims.dp_group, dims.dp)
    return {"dense": dense, "expert": (dims.edp_group, dims.edp)}


def _needs_correction(p, dims, spec) -> bool:
    """Whether finalize_grads corrects ``p``'s gradient over a model-parallel group before the data-parallel
    reduction (so its bucket must wait for finalize_grads)."""
    pl = placement_of(p)
    kv_replicated = getattr(pl.layout, "num_kv_heads", spec.num_kv_heads) < dims.tp \
        and pl.layout.replica_rows(dims.tp_rank, dims.tp) is not None
    return kv_replicated or pl.tied is not None or (pl.tp_sum and dims.tp > 1)


def _unhooked(chunks) -> set[int]:
    """Parameters whose gradient may be accumulated without autograd, so without a post-accumulate-grad hook:
    the head weight, which the log-prob head adds into its existing fp32 gradient directly."""
    out = set()
    for chunk in chunks:
        head = getattr(chunk, "head_weight", None)
        if chunk.post_process and getattr(chunk, "task", None) == "causal_lm" and callable(head):
            out.add(id(head()))
    return out


@dataclass(eq=False)
class Domain:
    """The parameters of one reduction domain on this rank, in plan order, and their buckets."""
    name: str
    group: object
    size: int
    rank: int
    params: list
    plans: list[BucketPlan]


def plan_domains(chunks, dims, *, bucket_bytes: int, shard: bool) -> list[Domain]:
    """The domains of ``chunks`` (trainable parameters only) and their bucket plans. Parameters of different
    dtypes never share a bucket (each dtype is planned apart, in order of first appearance)."""
    spec = chunks[0].spec
    unhooked = _unhooked(chunks)
    ordered = [p for chunk in reversed(chunks) for p in reversed(list(chunk.parameters())) if p.requires_grad]
    domains = []
    for name, (group, size) in reduction_domains(dims).items():
        members = [p for p in ordered if (placement_of(p).expert is not None) == (name == "expert")]
        if not members:
            continue
        params, plans = [], []
        for dtype in dict.fromkeys(p.dtype for p in members):
            of_dtype = [p for p in members if p.dtype == dtype]
            grad_bytes = 4 if uses_main_grad(of_dtype[0]) else of_dtype[0].element_size()
            deferred = [_needs_correction(p, dims, spec) or id(p) in unhooked for p in of_dtype]
            base = len(params)
            for plan in plan_buckets([p.numel() for p in of_dtype], deferred, world=size, shard=shard,
                                     bucket_numel=max(1, bucket_bytes // grad_bytes)):
                plans.append(BucketPlan(tuple(base + i for i in plan.params), plan.offsets, plan.numel, plan.kind,
                                        plan.segment, plan.owners, plan.deferred))
            params.extend(of_dtype)
        rank = dist.get_rank(group) if size > 1 else 0
        domains.append(Domain(name, group, size, rank, params, plans))
    return domains


def _reduce_scatter(output, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # torch >= 2.13 / older
    return fn(output, inp, group=group, async_op=True)


def _all_gather(output, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor       # torch >= 2.13 / older
    return fn(output, inp, group=group, async_op=True)


# -- gradient buffers -----------------------------------------------------------------------------------------

class _Bucket:
    def __init__(self, plan: BucketPlan, params: list, domain: Domain, k: int):
        self.plan, self.domain, self.k = plan, domain, k
        self.params = [params[i] for i in plan.params]
        first = self.params[0]
        dtype = torch.float32 if uses_main_grad(first) else first.dtype
        self.buffer = torch.zeros(plan.numel, dtype=dtype, device=first.device)
        self.views = [self.buffer[o:o + p.numel()].view(p.shape) for o, p in zip(plan.offsets, self.params)]
        self.counts = [0] * len(self.params)
        self.pending = len(self.params)
        self.work = None

    def launch(self) -> None:
        plan, d = self.plan, self.domain
        if plan.kind == "all_reduce":
            self.work = dist.all_reduce(self.buffer, group=d.group, async_op=True)
        elif plan.kind == "reduce_scatter":
            mine = self.buffer[d.rank * plan.segment:(d.rank + 1) * plan.segment]
            self.work = _reduce_scatter(mine, self.buffer, d.group)
        else:   # "owner"
            self.work = dist.reduce(self.buffer, dst=dist.get_global_rank(d.group, plan.owners[0]), group=d.group,
                                    async_op=True)

    def owned_slice(self) -> torch.Tensor | None:
        """The part of the buffer that holds the global gradient on this rank after the reduction."""
        plan, d = self.plan, self.domain
        if plan.kind == "reduce_scatter":
            return self.buffer[d.rank * plan.segment:(d.rank + 1) * plan.segment]
        if plan.kind == "owner":
            return self.buffer if plan.owners[0] == d.rank else None
        return self.buffer

    def reset(self) -> None:
        self.counts = [0] * len(self.params)
        self.pending = len(self.params)
        self.work = None


def _bind(p, view) -> None:
    """Make ``view`` ``p``'s gradient tensor (``main_grad`` for bf16 / fp16, ``grad`` otherwise), keeping the
    values ``p`` has accumulated so far."""
    current = getattr(p, "main_grad", None) if uses_main_grad(p) else p.grad
    if current is view:
        return
    if current is None:
        view.zero_()
    else:
        view.copy_(current)
    if uses_main_grad(p):
        p.main_grad = view
    else:
        p.grad = view
    p._parallm_grad_view = view


class GradBuffers:
    """The gradient buckets of ``chunks`` (see the module docstring); ``chunks[0]._parallm_grad_buffers``.
    ``shard``: buckets are reduce-scattered (or reduced onto their owner): after :meth:`finish` only the
    gradients :meth:`holds` says are this rank's are global gradients."""

    def __init__(self, chunks, domains: list[Domain], *, shard: bool):
        self.chunks = chunks
        self.shard = shard
        self.domains = [d for d in domains if d.size > 1]
        self.buckets: list[list[_Bucket]] = []
        self.where: dict[int, tuple[_Bucket, int]] = {}
        self.handles = []
        self.expected: int | None = None
        self.claimed = 0            # backward passes forward_backward calls have run (or are running) this step
        self.accumulated = False
        previous = getattr(chunks[0], "_parallm_grad_buffers", None)
        if previous is not None:
            previous.detach()
        for k, d in enumerate(self.domains):
            buckets = [_Bucket(plan, d.params, d, k) for plan in d.plans]
            self.buckets.append(buckets)
            for b in buckets:
                for pos, (p, view) in enumerate(zip(b.params, b.views)):
                    _bind(p, view)
                    self.where[id(p)] = (b, pos)
                    if not b.plan.deferred:
                        self.handles.append(p.register_post_accumulate_grad_hook(self._hook(b, pos)))
        self.next = [0] * len(self.domains)
        chunks[0]._parallm_grad_buffers = self

    def detach(self) -> None:
        """Stop managing the chunks' gradients (a new optimizer replaces this one): hooks removed; the gradients
        stay where they are."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for bs in self.buckets:
            for b in bs:
                for p in b.params:
                    p.__dict__.pop("_parallm_grad_view", None)
        if getattr(self.chunks[0], "_parallm_grad_buffers", None) is self:
            del self.chunks[0]._parallm_grad_buffers

    # -- during the backward ------------------------------------------------------------------------------------
    def _hook(self, bucket: _Bucket, pos: int):
        def hook(p):
            _bind(p, bucket.views[pos])      # a gradient set to None since (zero_grad(set_to_none)) starts here
            if bucket.work is not None:
                raise RuntimeError(
                    "a gradient was accumulated into a bucket whose data-parallel reduction had already started: "
                    f"more backward passes than expect_microbatches(..., {self.expected}) announced for this step "
                    "(announce every backward pass of the step, or call finalize_grads first)")
            self.accumulated = True
            bucket.counts[pos] += 1
            if self.expected is not None and bucket.counts[pos] == self.expected:
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._launch_ready(bucket.k)
        return hook

    def _launch_ready(self, k: int) -> None:
        buckets = self.buckets[k]
        while self.next[k] < len(buckets):
            b = buckets[self.next[k]]
            if b.plan.deferred or b.pending:
                return
            b.launch()
            self.next[k] += 1

    def expect(self, num_microbatches: int) -> None:
        if self.accumulated:
            raise RuntimeError("expect_microbatches: gradients were accumulated since the last finalize_grads / "
                               "zero_grad; announce the step's backward passes before the first of them")
        self.expected = int(num_microbatches)

    # -- finalize_grads -------------------------------------------------------------------------------------------
    def bind_all(self) -> None:
        """Every managed parameter's gradient back in its view (deferred ones are not hooked)."""
        for bs in self.buckets:
            for b in bs:
                for p, view in zip(b.params, b.views):
                    _bind(p, view)

    def launch_rest(self) -> None:
        for k, buckets in enumerate(self.buckets):
            while self.next[k] < len(buckets):
                buckets[self.next[k]].launch()
                self.next[k] += 1

    def wait_and_scale(self, scale: float) -> None:
        for bs in self.buckets:
            for b in bs:
                b.work.wait()
        if scale != 1.0:
            for bs in self.buckets:
                for b in bs:
                    mine = b.owned_slice()
                    if mine is not None:
                        mine.mul_(scale)
        self.reset()

    def reset(self) -> None:
        for bs in self.buckets:
            for b in bs:
                b.reset()
        self.next = [0] * len(self.domains)
        self.expected = None
        self.claimed = 0
        self.accumulated = False

    def manages(self, p) -> bool:
        return id(p) in self.where

    def holds(self, p) -> bool:
        """Whether ``p``'s gradient on this rank is the global one after finalize_grads: always unsharded; under
        ZeRO on its owner only."""
        if not self.shard or id(p) not in self.where:
            return True
        b, pos = self.where[id(p)]
        return b.plan.owners[pos] == b.domain.rank

    def zero(self) -> None:
        """Zero every bucket (the views stay each parameter's gradient) and forget the step's counts."""
        for bs in self.buckets:
            for b in bs:
                if b.work is not None:
                    b.work.wait()
                b.buffer.zero_()
        self.bind_all()
        self.reset()

    def all_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for bs in self.buckets for b in bs]


def grad_buffers_of(chunks) -> GradBuffers | None:
    return getattr(chunks[0], "_parallm_grad_buffers", None)


# -- parameter buffers (ZeRO) ---------------------------------------------------------------------------------

class ParamBuckets:
    """A sharded domain's parameters as views into per-bucket buffers laid out as the gradient buckets, so the
    owners' updated parameters reach every rank with one collective per bucket (:meth:`sync`)."""

    def __init__(self, domain: Domain):
        self.domain = domain
        self.buckets = []
        for plan in domain.plans:
            params = [domain.params[i] for i in plan.params]
            buffer = torch.zeros(plan.numel, dtype=params[0].dtype, device=params[0].device)
            views = []
            with torch.no_grad():
                for o, p in zip(plan.offsets, params):
                    view = buffer[o:o + p.numel()].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view
                    views.append(view)
            self.buckets.append((plan, buffer, params, views))

    def owned(self) -> list:
        """The domain's parameters this rank owns."""
        d = self.domain
        return [p for plan, _, params, _ in self.buckets for p, o in zip(params, plan.owners) if o == d.rank]

    def rebind(self) -> None:
        """A parameter whose storage was replaced since (``param.data = ...``) is copied back into its view."""
        with torch.no_grad():
            for _, _, params, views in self.buckets:
                for p, view in zip(params, views):
                    if p.data_ptr() != view.data_ptr():
                        view.copy_(p.detach())
                        p.data = view

    def sync(self) -> None:
        """After the owners' step: every rank's copy of every parameter equal to its owner's (bits copied)."""
        d = self.domain
        works = []
        for plan, buffer, _, _ in self.buckets:
            if plan.kind == "reduce_scatter":
                mine = buffer[d.rank * plan.segment:(d.rank + 1) * plan.segment]
                works.append(_all_gather(buffer, mine, d.group))
            elif plan.kind == "owner":
                works.append(dist.broadcast(buffer, src=dist.get_global_rank(d.group, plan.owners[0]),
                                            group=d.group, async_op=True))
        for w in works:
            w.wait()
