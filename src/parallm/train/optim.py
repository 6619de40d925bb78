"""AdamW for parallm chunks: ``torch.optim.AdamW``'s step, fp32 master weights for bf16 / fp16 parameters, and
optionally the optimizer state sharded over the data-parallel group (ZeRO-1) and the gradients reduced in buckets
during the backward (:mod:`parallm.train.buckets`).

Math. :class:`MasterAdamW` is a ``torch.optim.AdamW`` whose ``step`` hands torch's own functional Adam
(``decoupled_weight_decay=True``, the same call ``AdamW.step`` makes) different tensors: for a bf16 / fp16
parameter, its fp32 master copy instead of the parameter and the fp32 gradient (:func:`grad_of`) instead of
``param.grad``; afterwards the master is rounded into the parameter. fp32 parameters are their own masters, so
for them it *is* ``torch.optim.AdamW`` step for step. The moments of a low-precision parameter are fp32 too.
State is created when the optimizer is built (not at the first step), so it can be loaded before any step and
its memory measured (:meth:`ParallelAdamW.state_bytes`).

Master copies are taken from the parameters at the first step (or save) unless a checkpoint filled them, so an
optimizer may be built before or after the weights are loaded.

Weight decay. Two parameter groups, ``"decay"`` and ``"no_decay"``. By default, as Megatron does
(``megatron.core.optimizer._get_param_groups``), biases and 1-D parameters (norm weights) are not decayed and
everything else (matrices, the embedding, the head) is. ``no_decay(hf_name, param)`` replaces that rule; it is
asked with every HF name of a parameter (a fused QKV bias: the q, k and v bias names), which must agree.

Sharding (``shard_over_dp=True``): ZeRO-1 over each reduction domain (:func:`parallm.train.buckets.
reduction_domains`: routed experts over the expert-data-parallel group, the ranks holding the same experts,
everything else over the data-parallel group). The partition is the gradient-bucket plan of
:mod:`parallm.train.buckets`: every parameter has one owner rank, whose local :class:`MasterAdamW` holds its state
(master copy, moments, step), so per-rank optimizer memory falls as 1/dp; parameters are views into per-bucket
buffers, and after each step one all-gather (or one broadcast from the bucket's owner) per bucket copies the
owners' updated parameters to every replica. The math per parameter is unchanged, so sharded and unsharded runs
give the same bits. (torch's ``ZeroRedundancyOptimizer`` partitions by size alone; aligning ownership with the
gradient buckets is what lets them be reduce-scattered.) The user-facing ``param_groups`` are copied into the
local optimizers at every step.

Gradient buckets (``overlap_grad_reduce=True``): :class:`parallm.train.buckets.GradBuffers` over the same plan;
with sharding too, buckets are reduce-scattered and after ``finalize_grads`` each rank holds the global gradient
of the parameters it owns only (what its step reads).
"""

from __future__ import annotations

import collections
import functools
import inspect

import torch

from ..model.layers.lora import chunk_lora_entries
from ..model.table import model_entries
from ..parallel.errors import run_local
from ..model.params import clear_grad, grad_of, uses_main_grad
from ..parallel.state import as_chunks, dims_of, require_initialized
from .buckets import DEFAULT_BUCKET_BYTES, GradBuffers, ParamBuckets, grad_buffers_of, plan_domains


def default_no_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: no weight decay for biases and 1-D parameters (norm weights)."""
    return name.endswith(".bias") or param.dim() == 1


def _scalar_dtype():
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@functools.cache
def _functional_adamw():
    """torch's functional AdamW, called exactly as ``torch.optim.AdamW.step`` calls it."""
    from torch.optim import adam
    if "decoupled_weight_decay" in inspect.signature(adam.adam).parameters:   # torch >= 2.6: AdamW is Adam
        return lambda *a, **kw: adam.adam(*a, decoupled_weight_decay=True, **kw)
    from torch.optim import adamw
    return adamw.adamw


class MasterAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with fp32 master weights and moments for bf16 / fp16 parameters, reading
    :func:`grad_of`. ``amsgrad`` / ``maximize`` / ``capturable`` / ``fused`` are not offered."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._stale_masters = set()
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    def _init_state(self, p):
        low = uses_main_grad(p)
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
        dtype = torch.float32 if low else p.dtype
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if low:
            state["master"] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            self._stale_masters.add(p)

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Take the master copy of every low-precision parameter whose master was not loaded from a checkpoint
        and has not stepped yet."""
        stale = list(self._stale_masters)
        if stale:
            torch._foreach_copy_([self.state[p]["master"] for p in stale], stale)
        self._stale_masters.clear()

    def mark_master_loaded(self, p) -> None:
        self._stale_masters.discard(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync_masters()
        adamw = _functional_adamw()
        for group in self.param_groups:
            targets, grads, exp_avgs, exp_avg_sqs, steps, rounded = [], [], [], [], [], []
            for p in group["params"]:
                g = grad_of(p)
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                target = state.get("master", p)
                targets.append(target)
                grads.append(g if g.dtype == target.dtype else g.to(target.dtype))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                if target is not p:
                    rounded.append((p, target))
            if not targets:
                continue
            beta1, beta2 = group["betas"]
            adamw(targets, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], capturable=False,
                  differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)
            if rounded:   # each parameter becomes its master rounded, as p.copy_(master) makes it
                torch._foreach_copy_([p for p, _ in rounded], [m for _, m in rounded])
        return loss


HYPER = ("lr", "betas", "eps", "weight_decay")


def _copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """``HYPER`` of each ``source`` group into the ``target`` group of the same ``"name"`` (others untouched)."""
    by_name = {g["name"]: g for g in source}
    for group in target:
        saved = by_name.get(group["name"])
        if saved is not None:
            for k in HYPER:
                group[k] = tuple(saved[k]) if k == "betas" else saved[k]


class ParallelAdamW(torch.optim.Optimizer):
    """What :func:`build_optimizer` returns: AdamW over this rank's parameters (see the module docstring), a
    ``torch.optim.Optimizer``: torch's learning-rate schedulers (``torch.optim.lr_scheduler``) and step hooks
    work on it.

    ``param_groups``: ``[decay, no_decay]``, torch's dicts (``"params"``, ``"lr"``, ``"betas"``, ``"eps"``,
    ``"weight_decay"``, plus ``"name"``) over every trainable parameter; change ``"lr"`` (a scheduler does, or
    :meth:`set_lr`) between steps: each step copies the hyperparameters into the local optimizers that hold
    the state (under ZeRO, only this rank's partition). ``state``: parameter -> its state (master copy,
    moments, step) for the parameters whose state lives on this rank. :meth:`state_dict` /
    :meth:`load_state_dict` resume at the same layout (training checkpoints change layouts).
    """

    def __init__(self, chunks, *, lr, betas, eps, weight_decay, shard_over_dp, no_decay,
                 overlap_grad_reduce=False, bucket_bytes=None):
        self.chunks = as_chunks(chunks)
        self.dims = dims_of(self.chunks)
        self.shard_over_dp = bool(shard_over_dp)
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.names: dict[torch.Tensor, str] = {}       # param -> "<vpp rank>.<local name>" (unique on a rank)
        self.entries: dict[torch.Tensor, object] = {}  # param -> its weight-table entry (HF names)
        mine, _ = model_entries(self.chunks, self.dims)
        for entry, chunk in mine + chunk_lora_entries(self.chunks):     # LoRA factors: model/layers/lora.py
            p = chunk.get_parameter(entry.local)
            self.names[p] = f"{chunk.vpp_rank}.{entry.local}"
            self.entries[p] = entry

        def split():
            decay, skip = [], []
            for p, entry in self.entries.items():
                if not p.requires_grad:
                    continue
                verdicts = {n: bool(no_decay(n, p)) for n in entry.hf}
                if len(set(verdicts.values())) > 1:
                    raise ValueError(f"no_decay disagrees on the HF tensors fused into one parameter "
                                     f"({self.names[p]}): {verdicts}")
                (skip if next(iter(verdicts.values())) else decay).append(p)
            return decay, skip
        decay, skip = run_local(split, what="build_optimizer")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__([dict(params=decay, name="decay"), dict(params=skip, weight_decay=0.0, name="no_decay")],
                         defaults)
        self._parts: list[tuple[MasterAdamW, ParamBuckets | None]] = []
        self._build_parts(decay, skip, defaults, bucket_bytes)
        self.state = collections.defaultdict(dict, {p: st for p, st in self.owned()})
        for chunk in self.chunks:       # parallm.add_lora refuses chunks an optimizer already holds
            chunk._parallm_optimizer_built = True

    def _build_parts(self, decay, skip, defaults, bucket_bytes) -> None:
        if not (self.shard_over_dp or self.overlap_grad_reduce):
            self._add_part(decay + skip, None, defaults)
            return
        # One plan per reduction domain (routed experts over the expert-data-parallel group, the rest over the
        # data-parallel group): the gradient buckets and, under ZeRO, which rank owns each parameter's state.
        domains = plan_domains(self.chunks, self.dims, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                               shard=self.shard_over_dp)
        if self.overlap_grad_reduce:
            GradBuffers(self.chunks, domains, shard=self.shard_over_dp)
        if not self.shard_over_dp:
            self._add_part(decay + skip, None, defaults)
            return
        trainable = set(map(id, decay + skip))
        for d in domains:
            buckets = ParamBuckets(d) if d.size > 1 else None
            owned = buckets.owned() if buckets is not None else d.params
            self._add_part([p for p in owned if id(p) in trainable], buckets, defaults)

    def _add_part(self, params, buckets, defaults):
        """A local MasterAdamW over ``params`` (split into the two named groups) and, under ZeRO, the parameter
        buckets its domain syncs after each step."""
        keep = set(map(id, params))
        groups = [{"params": [p for p in g["params"] if id(p) in keep], "weight_decay": g["weight_decay"],
                   "name": g["name"]} for g in self.param_groups]
        self._parts.append((MasterAdamW(groups, **defaults), buckets))

    @property
    def _locals(self) -> list[MasterAdamW]:
        return [local for local, _ in self._parts]

    # -- torch.optim.Optimizer's surface -----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's, while the optimizer is built; afterwards a ValueError: the groups are fixed by the model
        (decay / no_decay), and the state lives in local optimizers (ZeRO partitions) built from them."""
        if getattr(self, "_parts", None) is not None:
            raise ValueError("parallm's optimizer has fixed parameter groups ('decay', 'no_decay') over every "
                             "trainable parameter of the model; build another optimizer for other parameters")
        super().add_param_group(param_group)

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient (``grad_of``). Call after
        ``parallm.finalize_grads``. With ``shard_over_dp`` it is collective over the data-parallel group: each
        rank steps the parameters it owns, then one all-gather (or broadcast) per bucket brings every replica's
        parameters to the owners' new values."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dims_of(self.chunks)
        for local, buckets in self._parts:
            if buckets is not None:
                buckets.rebind()
            _copy_hyperparameters(self.param_groups, local.param_groups)
            local.step()
        for _, buckets in self._parts:
            if buckets is not None:
                buckets.sync()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` (None, or zeros with ``set_to_none=False``) and zero ``param.main_grad`` in place
        (an fp32 accumulation buffer is kept, not freed). With gradient buckets every bucket is zeroed in place
        and each gradient stays its view (``set_to_none`` does not apply to them)."""
        buffers = grad_buffers_of(self.chunks)
        if buffers is not None:
            buffers.zero()
        for p in self.names:
            if buffers is None or not buffers.manages(p):
                clear_grad(p, set_to_none=set_to_none)

    # -- state ---------------------------------------------------------------------------------------------
    def owned(self):
        """``(param, state)`` for every parameter whose optimizer state lives on this rank (all of them, or
        this data-parallel rank's ZeRO partition; under expert parallelism the experts' partition is over the
        expert-data-parallel group)."""
        for local in self._locals:
            for group in local.param_groups:
                for p in group["params"]:
                    yield p, local.state[p]

    def sync_masters(self) -> None:
        for local in self._locals:
            local.sync_masters()

    def mark_master_loaded(self, p) -> None:
        """``p``'s master copy was filled from a checkpoint: do not take it from the parameter."""
        for local in self._locals:
            local.mark_master_loaded(p)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (master copies, moments, step counters)."""
        return sum(t.numel() * t.element_size() for _, st in self.owned() for t in st.values()
                   if torch.is_tensor(t))

    def hyperparameters(self) -> list[dict]:
        return [{"name": g["name"], **{k: (list(g[k]) if k == "betas" else g[k]) for k in HYPER}}
                for g in self.param_groups]

    def set_hyperparameters(self, groups: list[dict]) -> None:
        _copy_hyperparameters(groups, self.param_groups)

    def state_dict(self) -> dict:
        """This rank's optimizer state, for a resume at the same layout (tensors by reference, as torch's
        ``Optimizer.state_dict``). Keys of ``"state"`` are ``"<vpp rank>.<parameter name>"``; with
        ``shard_over_dp`` only this data-parallel rank's partition is in it. To change layouts use
        :func:`parallm.save_checkpoint` / :func:`parallm.load_checkpoint`."""
        self.sync_masters()
        return {"kind": "parallm.AdamW", "layout": self.dims.describe(), "shard_over_dp": self.shard_over_dp,
                "param_groups": self.hyperparameters(),
                "state": {self.names[p]: dict(st) for p, st in self.owned()}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of :meth:`state_dict` at the same layout: values are copied into the existing state (dtypes
        kept: fp32 moments stay fp32). A mismatch (layout, sharding, names, shapes) is a ValueError naming it."""
        if state_dict.get("kind") != "parallm.AdamW":
            raise ValueError("not a parallm AdamW state dict (from ParallelAdamW.state_dict)")
        for key, mine in (("layout", self.dims.describe()), ("shard_over_dp", self.shard_over_dp)):
            if state_dict[key] != mine:
                raise ValueError(f"optimizer state dict saved with {key}={state_dict[key]}, this optimizer has "
                                 f"{key}={mine}; use parallm.save_checkpoint / load_checkpoint to change layouts")
        owned = {self.names[p]: (p, st) for p, st in self.owned()}
        saved = state_dict["state"]
        if set(saved) != set(owned):
            raise ValueError(f"optimizer state dict names differ: missing {sorted(set(owned) - set(saved))[:5]}, "
                             f"unexpected {sorted(set(saved) - set(owned))[:5]}")
        for name, (p, st) in owned.items():
            for k, t in st.items():
                src = saved[name].get(k)
                if src is None or tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"optimizer state {name}.{k}: expected shape {tuple(t.shape)}, got "
                                     f"{None if src is None else tuple(src.shape)}")
                t.copy_(src)
            self.mark_master_loaded(p)
        self.set_hyperparameters(state_dict["param_groups"])


def build_optimizer(chunks, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                    shard_over_dp: bool = False, no_decay=default_no_decay, overlap_grad_reduce: bool = False,
                    bucket_bytes: int | None = None) -> ParallelAdamW:
    """AdamW over ``chunks`` (this rank's model): ``torch.optim.AdamW`` semantics, fp32 master weights and
    moments for bf16 / fp16 parameters, weight decay skipping biases and norm weights unless ``no_decay``
    (``(hf_name, param) -> bool``) says otherwise (the DeepSeek-V3 selection bias and MTP layers are not
    trained: in no group), a ``torch.optim.Optimizer`` (torch's LR schedulers work on it), and with ``shard_over_dp=True`` the state sharded over the
    data-parallel group (ZeRO-1). ``overlap_grad_reduce=True``: gradients live in buckets of about
    ``bucket_bytes`` (default: megatron-core's 40M fp32 elements) that ``finalize_grads`` reduces bucket by
    bucket, starting during the backward (``forward_backward`` announces its microbatches;
    :func:`parallm.train.grads.expect_microbatches` a step of several calls); with ``shard_over_dp`` too, reduce-scattered, so after ``finalize_grads`` only the parameters this rank
    owns hold the global gradient (:mod:`parallm.train.buckets`). Collective (every rank calls it). See
    :mod:`parallm.train.optim`."""
    require_initialized("build_optimizer")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not callable(no_decay):
        raise TypeError("no_decay must be callable: no_decay(hf_name, param) -> bool")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 1):
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    return ParallelAdamW(chunks, lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps),
                         weight_decay=float(weight_decay), shard_over_dp=shard_over_dp, no_decay=no_decay,
                         overlap_grad_reduce=overlap_grad_reduce, bucket_bytes=bucket_bytes)
