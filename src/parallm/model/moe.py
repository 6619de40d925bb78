"""The mixture-of-experts MLP: an fp32 top-k router, routed experts split over expert-parallel ranks (each
expert's FFN split over TP like a dense MLP), and an optional gated shared expert (Qwen2-MoE).

Parameter names follow megatron-core's MoE layer (SequentialMLP experts)::

    mlp.router.weight                                 [E, H]        replicated over TP
    mlp.experts.local_experts.{x}.linear_fc1.weight   [2 I / tp, H] [gate_r; up_r] of global expert e = e0 + x
    mlp.experts.local_experts.{x}.linear_fc2.weight   [H, I / tp]   down_proj columns of TP rank r
    mlp.shared_experts.linear_fc1.weight / linear_fc2.weight        a dense MLP (Column/RowParallelLinear)
    mlp.shared_experts.gate_weight                    [1, H]        replicated over TP

Data flow of one MoE layer on one rank (N local tokens; under sequence parallelism N = T / tp)::

    router (fp32): logits [N, E] -> softmax -> top-k weights w [N, k] (renormalised when norm_topk_prob), experts
    into the TP region: sequence parallel: all-gather tokens, w and choices over TP (backward: reduce-scatter);
                        TP without SP: tokens and w enter as replicas (backward: all-reduce, as a column-parallel
                        linear's input); then every TP rank holds the same T tokens and choices
    slots (token, choice) sorted by expert -> all-to-all over the expert-parallel group (parallel/experts.py)
    -> each local expert computes its TP shard of the FFN on its rows -> all-to-all back -> slots unsorted by the
    inverse permutation, viewed [N, k, H], weighted and summed over the k choices (no atomic adds: the same bits
    on every run on any device) -> out of the TP region: reduce-scatter (SP) / all-reduce (TP), summing the TP
    partial sums.

The weights are applied before the TP reduction, so their gradient on each TP rank is partial; the way in
(reduce-scatter / all-reduce in backward) sums it, and the router's gradient is complete for the tokens it saw.
Routing is dropless (no capacity), and an expert that no token chose still runs on an empty batch, so its
weights get a zero gradient rather than None.

Compared with transformers (Qwen2/Qwen3-MoE, Mixtral): the same softmax / top-k / renormalisation, so the same
choices and weights in fp32. The router runs in fp32 here in every model dtype (transformers computes the logits
in the model dtype and the softmax in fp32), and the weights are cast to the model dtype before weighting
(as Qwen; Mixtral weights in fp32), so bf16 models differ from transformers by rounding only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.experts import combine, dispatch
from ..parallel.megatron_import import import_megatron
from .mlp import MLP
from .spec import DecoderSpec

mtp = import_megatron().tensor_parallel


class _Weight(nn.Module):
    def __init__(self, shape, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class Router(_Weight):
    """The router's ``[E, H]`` weight, replicated over TP (megatron-core marks it ``sequence_parallel``)."""
    parallm_param_kind = "replicated"


class Expert(nn.Module):
    """One routed expert's TP shard: ``down_r(silu(gate_r x) * up_r x)``, a partial sum over TP ranks."""

    def __init__(self, hidden: int, width_local: int, dtype, device):
        super().__init__()
        self.linear_fc1 = _Weight((2 * width_local, hidden), dtype, device)
        self.linear_fc2 = _Weight((hidden, width_local), dtype, device)

    def forward(self, x):
        gate, up = F.linear(x, self.linear_fc1.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.linear_fc2.weight)


class Experts(nn.Module):
    def __init__(self, n_local: int, hidden: int, width_local: int, dtype, device):
        super().__init__()
        self.local_experts = nn.ModuleList(Expert(hidden, width_local, dtype, device) for _ in range(n_local))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by local expert, ``counts[x]`` for local expert x (zero: an empty batch, so the
        expert still takes part in autograd and gets a zero gradient)."""
        outs = [expert(part) for expert, part in zip(self.local_experts, rows.split(counts, dim=0))]
        return torch.cat(outs, dim=0)


class SharedExpert(MLP):
    """Qwen2-MoE's always-on expert: the dense gated MLP (TP-split like it, no biases), scaled per token by
    ``sigmoid(x . gate_weight)`` when the model has the gate."""
    parallm_param_kind = "replicated"   # gate_weight (the linears' own weights are megatron layers)

    def __init__(self, spec: DecoderSpec, config, gate: bool, device):
        super().__init__(spec, config, width=spec.moe.shared_expert_intermediate_size, bias=False)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, spec.hidden_size, dtype=config.params_dtype,
                                                        device=device))

    def forward(self, x):
        out = super().forward(x)
        if hasattr(self, "gate_weight"):
            out = torch.sigmoid(F.linear(x, self.gate_weight)) * out
        return out


class MoEAux:
    """Load-balancing loss bookkeeping of one chunk: active (``scale`` set) only inside
    :func:`parallm.forward_backward` when the model's ``aux_loss_coef`` > 0. Each MoE layer adds its loss to the
    objective with weight ``scale`` (= coefficient / number of microbatches) and records its detached value."""

    def __init__(self):
        self.scale: float | None = None
        self.values: list[torch.Tensor] = []
        self.recording = True    # False while activation recompute replays a layer's forward in the backward

    @contextlib.contextmanager
    def replaying(self):
        """Inside: a replayed forward (activation recompute's, in the backward) computes and attaches the loss
        again, as the autograd graph needs, but does not record its value a second time."""
        before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before

    def start(self, scale: float) -> None:
        self.scale, self.values = scale, []

    def stop(self) -> list[torch.Tensor]:
        values, self.scale, self.values = self.values, None, []
        return values


class _AttachAux(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: also sends gradient ``scale`` into ``aux`` (megatron-core's
    MoEAuxLossAutoScaler): the layer's loss joins the objective without travelling through the pipeline."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def load_balancing_loss(probs, choices, tokens, *, num_experts: int, tp_group=None):
    """One layer's loss, transformers' ``load_balancing_loss_func`` applied to this layer alone:
    ``E * sum_e f_e * P_e`` with ``f_e`` = top-k assignments to expert e per real token and ``P_e`` = mean router
    probability of e over real tokens. ``tokens``: 1 for real rows, 0 for padding. With ``tp_group`` (sequence
    parallelism: this rank saw its share of the tokens) the counts are summed over TP and the returned value
    is this rank's share of the loss (the shares sum to the loss; each carries the gradient of its tokens)."""
    k = choices.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    counts.scatter_add_(0, choices.reshape(-1), tokens.float().repeat_interleave(k))
    real = tokens.float().sum().reshape(1)
    prob_sum = (probs * tokens.float().unsqueeze(-1)).sum(0)
    if tp_group is not None:
        stats = torch.cat([counts, real])
        torch.distributed.all_reduce(stats, group=tp_group)
        counts, real = stats[:-1], stats[-1:]
    real = real.clamp(min=1.0)
    return num_experts * ((counts / real) * (prob_sum / real)).sum()


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared expert) of one layer; replaces the dense MLP (see the module doc)."""

    def __init__(self, spec: DecoderSpec, config, dims, device):
        super().__init__()
        moe = spec.moe
        tp = config.tensor_model_parallel_size
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.hidden = spec.hidden_size
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp, self.tp_group = tp, dims.tp_group
        self.ep, self.ep_group = dims.ep, dims.ep_group
        self.experts_held = dims.expert_range(moe.num_experts)
        self.aux: MoEAux | None = None      # the chunk's tracker, set by the chunk
        self.router = Router((moe.num_experts, spec.hidden_size), config.params_dtype, device)
        self.experts = Experts(len(self.experts_held), spec.hidden_size, moe.expert_intermediate_size // tp,
                               config.params_dtype, device)
        if moe.shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(spec, config, moe.shared_expert_gate, device)

    def route(self, h):
        """fp32 router: (probs [N, E], weights [N, k], choices [N, k])."""
        logits = F.linear(h.float(), self.router.weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, choices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, choices

    def _into_tp_region(self, h, weights, choices):
        if self.sequence_parallel:
            h = mtp.gather_from_sequence_parallel_region(h, True, group=self.tp_group)
            weights = mtp.gather_from_sequence_parallel_region(weights, True, group=self.tp_group)
            gathered = choices.new_empty((choices.shape[0] * self.tp,) + tuple(choices.shape[1:]))
            torch.distributed.all_gather_into_tensor(gathered, choices.contiguous(), group=self.tp_group)
            return h, weights, gathered
        if self.tp > 1:
            h = mtp.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            weights = mtp.copy_to_tensor_model_parallel_region(weights, group=self.tp_group)
        return h, weights, choices

    def _out_of_tp_region(self, out):
        if self.sequence_parallel:
            return mtp.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        if self.tp > 1:
            return mtp.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out

    def forward(self, x, tokens=None):
        """x: ``[S, B, H]`` (or ``[T / tp, 1, H]`` under sequence parallelism). ``tokens``: 1 for the real rows
        of ``x.reshape(-1, H)`` (the load-balancing loss counts those only); None: all rows are real."""
        shape = x.shape
        h = x.reshape(-1, self.hidden)
        probs, weights, choices = self.route(h)
        aux = None
        if self.aux is not None and self.aux.scale is not None and torch.is_grad_enabled():
            real = tokens if tokens is not None else torch.ones(h.shape[0], device=h.device)
            aux = load_balancing_loss(probs, choices, real, num_experts=self.num_experts,
                                      tp_group=self.tp_group if self.sequence_parallel else None)
        h_all, w_all, c_all = self._into_tp_region(h, weights, choices)
        n, k = c_all.shape
        flat = c_all.reshape(-1)
        order = torch.argsort(flat, stable=True)                        # slots (token-major) sorted by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        # Deterministic on every device: only permutations move rows (a gather by a permutation, and its
        # backward, touch each row once), and the k choices of a token are summed by a reduction, not by
        # index_add / scatter-add, whose colliding atomic adds on CUDA vary in order from run to run.
        slots = h_all.unsqueeze(1).expand(n, k, self.hidden).reshape(n * k, self.hidden)
        rows, plan = dispatch(slots.index_select(0, order), counts, ep=self.ep, group=self.ep_group)
        rows = combine(self.experts(rows, plan.local_counts), plan)     # back in sorted-slot order
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=order.device))
        rows = rows.index_select(0, unsort).view(n, k, self.hidden)     # slot order: [token, choice]
        out = (rows * w_all.to(rows.dtype).unsqueeze(-1)).sum(dim=1)
        out = self._out_of_tp_region(out).view(shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        if aux is not None:
            if self.aux.recording:
                self.aux.values.append(aux.detach())
            out = _AttachAux.apply(out, aux, self.aux.scale)
        return out
