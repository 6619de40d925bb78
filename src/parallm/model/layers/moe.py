"""The mixture-of-experts MLP: a top-k router (logits in fp32), routed experts split over expert-parallel ranks
(each expert's FFN split over TP like a dense MLP) and stacked into one parameter per projection, and an
optional gated shared expert (Qwen2-MoE).

Parameters of one MoE layer (megatron-core's MoE layer naming, experts stacked as in its GroupedMLP)::

    mlp.router.weight                      [E, H]                  replicated over TP
    mlp.experts.linear_fc1.weight          [E_local, 2 I / tp, H]  [x]: [gate_r; up_r] of global expert e0 + x
    mlp.experts.linear_fc2.weight          [E_local, H, I / tp]    [x]: down_proj columns of TP rank r
    mlp.shared_experts.linear_fc1.weight / linear_fc2.weight       a dense MLP (Column/RowParallelLinear)
    mlp.shared_experts.gate_weight         [1, H]                  replicated over TP

The experts' GEMMs run as one ``torch._grouped_mm`` per projection where the device and dtype support it, else
as a loop over the local experts (:func:`expert_kernel`: chosen once per process and model shape, logged; the
MoE layers keep it as ``experts.kernel``, :func:`expert_kernel_of` reads it from chunks). Both give the same
bits on CPU.

Data flow of one MoE layer on one rank (N local tokens; under sequence parallelism N = T / tp)::

    router: logits = x W^T in the model dtype, then fp32 (what transformers computes), softmax -> top-k weights
    w [N, k] (renormalised when norm_topk_prob), experts [N, k]; under router replay the experts of the real
    rows are the given ones and w the router's probabilities of them (:meth:`MoEBlock.route`)
    slots (token, choice) sorted by expert -> all-to-all over the expert-parallel group (parallel/experts.py)
    -> each local expert computes its TP shard of the FFN on its rows -> all-to-all back -> slots unsorted by the
    inverse permutation, viewed [N, k, H], weighted and summed over the k choices (no atomic adds: the same bits
    on every run on any device)

and under TP (``tp`` > 1) one of two ways, decided at build:

* ``ep`` > 1 (the dispatch is Megatron's): each TP rank dispatches only its share of the tokens (under sequence
  parallelism its own tokens; without it a contiguous share of the TP replica, routed on every rank alike), the
  TP ranks all-gather the rows the all-to-all brought them and each computes its shard of every local expert on
  all of them; a reduce-scatter over TP adds the shards' partial sums, so each rank's rows come back complete
  and the all-to-all back carries complete outputs. No TP rank sends what another sends: the all-to-all carries
  1 / tp of what it would if every TP rank dispatched the whole replica. Without sequence parallelism the
  shares' outputs are then all-gathered into the replica (backward: each rank's share of the replicated
  gradient), and the routing weights enter through ``copy_to_tensor_model_parallel_region`` (backward: the
  shares' weight gradients summed over TP), so the router's gradient is complete on every rank.
* ``ep`` = 1: no all-to-all at all; the tokens enter the TP region (sequence parallelism: tokens, weights and
  choices all-gathered over TP; without it they are TP replicas), every TP rank computes its shard of every
  expert on all slots, and a reduce-scatter (SP) / all-reduce (TP) sums the TP partial sums, as a dense MLP
  does. Gathering tokens before they become k slots moves k times less than gathering slots.

Routing is dropless (no capacity), and an expert that no token chose still takes part in the backward (an empty
group), so its slab of the weights gets a zero gradient.

Compared with transformers (Qwen2/Qwen3-MoE, Mixtral): the same logits, softmax / top-k / renormalisation, so the
same choices and weights (in bf16 too); the weights are cast to the model dtype before weighting (as Qwen;
Mixtral weights in fp32), and the k choices are summed by one reduction rather than accumulated one by one, so
bf16 models differ from transformers by rounding only.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...parallel.experts import (combine, dispatch, expert_counts, gather_shares, share_of, share_sizes, slots_of,
                                 sort_slots, weighted_sum)
from ...parallel.comm import all_gather_single
from ...parallel.megatron_import import import_megatron
from ...parallel.state import as_device
from .mlp import MLP
from .moe_activations import clamped_silu, clamped_swiglu, swiglu
from .moe_recompute import recomputed_experts, recomputed_token_experts
from .moe_kernels import (KERNEL_ENV, KERNELS, PROBED_DEVICE_TYPES, _choose_kernel,  # noqa: F401 (re-exported)
                          empty_group_problem, expert_kernel, grouped_mm_support)
from .moe_aux import (AuxScales, MoEAux, _AttachAux, _AttachPooled,  # noqa: F401 (AuxScales, MoEAux: here too)
                      balance_fractions, load_balancing_loss)
from .routing import (Gemma4Router, GroupLimitedRouter, RouterReplay, ScoreRouter, sigmoid_weights, softmax_weights,
                      sqrtsoftplus, topk_softmax_weights)
from ..spec import DecoderSpec

mtp = import_megatron().tensor_parallel
logger = logging.getLogger("parallm")

def expert_kernel_of(chunks) -> str | None:
    """The experts' kernel of a model's chunks (every MoE layer holds the same), None for a dense model."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, Experts):
                return module.kernel
    return None


class _Weight(nn.Module):
    """A ``weight`` parameter and, when ``bias`` gives its shape, a ``bias`` one."""

    def __init__(self, shape, dtype, device, *, bias: tuple | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        if bias is not None:
            self.bias = nn.Parameter(torch.empty(bias, dtype=dtype, device=device))
        else:
            self.bias = None


class Router(_Weight):
    """The router's ``[E, H]`` weight (and gpt-oss's ``[E]`` bias), replicated over TP (megatron-core marks it
    ``sequence_parallel``)."""
    parallm_param_kind = "replicated"


def _group_of_rows(counts_device: torch.Tensor, rows: int, dtype) -> torch.Tensor:
    """``[rows, E_local]`` one-hot of each row's local expert (rows grouped by expert, ``counts_device`` of each),
    from the groups' bounds alone (no host sync)."""
    ends = counts_device.cumsum(0)
    at = torch.arange(rows, device=counts_device.device)[:, None]
    return ((at >= (ends - counts_device)[None]) & (at < ends[None])).to(dtype)


class Experts(nn.Module):
    """This rank's routed experts, stacked. ``layout="rows"``: ``linear_fc1.weight [E_local, 2 I / tp, H]``
    (expert x's ``[gate_r; up_r]``) and ``linear_fc2.weight [E_local, H, I / tp]``; ``"interleaved_columns"``
    (gpt-oss, transformers' own orientation): ``linear_fc1.weight [E_local, H, 2 I / tp]`` (gate / up in the even /
    odd columns) and ``linear_fc2.weight [E_local, I / tp, H]``. ``bias``: ``linear_fc1.bias [E_local, 2 I / tp]``
    and ``linear_fc2.bias [E_local, H]``, the latter added by TP rank 0 only (``add_down_bias``), so the
    row-parallel sum over TP adds it once. ``activation``: ``"silu"`` (``silu(gate) * up``) or
    ``"clamped_swiglu"`` (:func:`clamped_swiglu` with ``limit`` / ``alpha``), ``"gelu_tanh"`` (Gemma 4:
    ``gelu_tanh(gate) * up``). ``forward`` computes every local
    expert's TP shard ``down_r(act(gate_r x, up_r x))`` (a partial sum over TP ranks) on its rows."""

    def __init__(self, n_local: int, hidden: int, width_local: int, dtype, device, *, layout: str = "rows",
                 bias: bool = False, add_down_bias: bool = True, activation: str = "silu",
                 limit: float | None = None, alpha: float | None = None):
        super().__init__()
        self.columns = layout == "interleaved_columns"
        up = width_local if activation == "relu2" else 2 * width_local     # relu2: no gate, fc1 is up alone
        fc1 = (n_local, hidden, up) if self.columns else (n_local, up, hidden)
        fc2 = (n_local, width_local, hidden) if self.columns else (n_local, hidden, width_local)
        self.linear_fc1 = _Weight(fc1, dtype, device, bias=(n_local, up) if bias else None)
        self.linear_fc2 = _Weight(fc2, dtype, device, bias=(n_local, hidden) if bias else None)
        self.add_down_bias = add_down_bias
        self.activation, self.limit, self.alpha = activation, limit, alpha
        device_type = as_device(device).type
        self.kernel = expert_kernel(device_type, dtype, (hidden, up, width_local))
        self.recompute = False      # build_model(recompute="moe" / "selective"): see moe_recompute

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """The activation of fc1's output ``h`` ``[m, 2 w]``: gate / up are its halves (``rows``) or its even /
        odd columns (``interleaved_columns``)."""
        if self.activation == "relu2":         # Nemotron-H: relu(up x)^2
            return torch.square(F.relu(h))
        if self.activation == "silu" and not self.columns:
            return swiglu(h)
        gate, up = (h[..., 0::2], h[..., 1::2]) if self.columns else h.chunk(2, dim=-1)
        if self.activation == "silu":
            return F.silu(gate) * up
        if self.activation == "clamped_silu":
            return clamped_silu(gate, up, limit=self.limit)
        if self.activation == "gelu_tanh":     # Gemma 4: transformers' GELUTanh on the gate
            return F.gelu(gate, approximate="tanh") * up
        return clamped_swiglu(gate, up, limit=self.limit, alpha=self.alpha)

    def recomputes(self) -> bool:
        """recompute="moe" / "selective" applies here (not to adapters: they override :meth:`project`)."""
        return self.recompute and torch.is_grad_enabled() and type(self).project is Experts.project

    def forward(self, rows: torch.Tensor, counts: list[int], counts_device: torch.Tensor) -> torch.Tensor:
        """``rows`` grouped by local expert, ``counts[x]`` of them for local expert x (``counts_device``: the same
        on the device). An expert with no rows still takes part in autograd: its weights get a zero gradient.
        Biases enter through each row's one-hot expert times the stacked bias (a small GEMM: its gradient is a
        GEMM too, with no accumulation by index). :meth:`recomputes`: only ``rows`` kept (:mod:`.moe_recompute`)."""
        if self.recomputes():
            return recomputed_experts(self, rows, counts, counts_device)
        groups = self._groups(rows, counts, counts_device, self.linear_fc1.bias is not None)
        return self.project(self.act(self.project(rows, "gate_up_proj", groups)), "down_proj", groups)

    def _groups(self, rows, counts, counts_device, bias: bool) -> tuple:
        """``(counts, offsets, onehot)``: the grouped GEMM's offsets (None: a loop over the experts), each row's
        one-hot expert where there are biases."""
        offsets = counts_device.cumsum(0).to(torch.int32) if self.kernel == "grouped_mm" else None
        return counts, offsets, (_group_of_rows(counts_device, rows.shape[0], rows.dtype) if bias else None)

    def project(self, x: torch.Tensor, part: str, groups) -> torch.Tensor:
        """fc1 (``part`` ``"gate_up_proj"``) or fc2 (``"down_proj"``) of every local expert on its rows of ``x``,
        bias included (fc2's on TP rank 0 only). ``groups``: ``(counts, offsets, onehot)`` of :meth:`forward`
        (``offsets``: the grouped GEMM's, None: a loop over the experts)."""
        fc = self.linear_fc1 if part == "gate_up_proj" else self.linear_fc2
        bias = fc.bias if part == "gate_up_proj" or self.add_down_bias else None
        return project_rows(x, fc.weight, bias, self.columns, groups)

    def compute(self, rows: torch.Tensor, counts: list[int], counts_device: torch.Tensor, params) -> torch.Tensor:
        """:meth:`forward`'s operations with ``params`` ``(fc1 weight, fc1 bias, fc2 weight, fc2 bias)`` (slabs
        of ``len(counts)`` experts: :func:`recomputed_experts` recomputes a few experts at a time)."""
        w1, b1, w2, b2 = params
        groups = self._groups(rows, counts, counts_device, b1 is not None)
        h = self.act(project_rows(rows, w1, b1, self.columns, groups))
        return project_rows(h, w2, b2 if self.add_down_bias else None, self.columns, groups)


def project_rows(x: torch.Tensor, weight: torch.Tensor, bias, columns: bool, groups) -> torch.Tensor:
    """Every expert's projection (``weight [E, out, in]``, ``[E, in, out]`` if ``columns``) of its rows of ``x``."""
    counts, offsets, onehot = groups
    mat = weight if columns else weight.transpose(-2, -1)         # [E_local, in, out]
    if offsets is not None:
        y = torch._grouped_mm(x, mat, offs=offsets)
        return y if bias is None else y + onehot @ bias
    return torch.cat([xe @ mat[e] if bias is None else torch.addmm(bias[e], xe, mat[e])
                      for e, xe in enumerate(x.split(counts, dim=0))], dim=0)


class Latent(_Weight):
    """Nemotron-3's latent projection around the routed experts (``fc1_latent_proj [L, H]`` / ``fc2_latent_proj [H,
    L]``), replicated over TP: applied to the rank's tokens outside the experts' TP region (under sequence
    parallelism its gradient is a partial sum over TP: the table's ``tp_sum="sp"``)."""
    parallm_param_kind = "replicated"

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype, device):
        super().__init__((n_out, n_in), dtype, device, bias=(n_out,) if bias else None)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class SharedExpert(MLP):
    """Qwen2-MoE's always-on expert: the dense gated MLP (TP-split like it, no biases), scaled per token by
    ``sigmoid(x . gate_weight)`` when the model has the gate."""
    parallm_param_kind = "replicated"   # gate_weight (the linears' own weights are megatron layers)

    def __init__(self, spec: DecoderSpec, config, gate: bool, device):
        super().__init__(spec, config, width=spec.moe.shared_expert_intermediate_size, bias=False,
                         limit=spec.moe.shared_expert_limit)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, spec.hidden_size, dtype=config.params_dtype,
                                                        device=device))

    def forward(self, x):
        out = super().forward(x)
        if hasattr(self, "gate_weight"):
            out = torch.sigmoid(F.linear(x, self.gate_weight)) * out
        return out


class MoEBlock(nn.Module):
    """Router + routed experts (+ shared expert) of one layer; replaces the dense MLP (see the module doc)."""

    def __init__(self, spec: DecoderSpec, config, dims, device, *, layer: int | None = None):
        """``layer``: the global index of the decoder layer (which DeepSeek-V4 hash layers need to know)."""
        super().__init__()
        moe = spec.moe
        self.is_hash = layer is not None and moe.is_hash_layer(layer)
        if moe.hash_layers and layer is None:
            raise ValueError("a MoE spec with hash layers needs MoEBlock(..., layer=) (the decoder layer's index)")
        tp = config.tensor_model_parallel_size
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.hidden = spec.hidden_size
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp, self.tp_group, self.tp_rank = tp, dims.tp_group, dims.tp_rank
        # the ranks holding the other tokens of this rank's sequences (the load-balancing loss counts over them):
        # TP under sequence parallelism, the context-parallel ranks, or both
        cp = dims.cp > 1
        self.sequence_group = (dims.tp_cp_group if cp else self.tp_group) if self.sequence_parallel else \
            (dims.cp_group if cp else None)
        self.ep, self.ep_group = dims.ep, dims.ep_group
        # each TP rank dispatches its share of the tokens (Megatron's dispatch) when there is an all-to-all to
        # share; at ep = 1 the tokens enter the TP region as a dense MLP's do (k times less to move than slots)
        self.shares = tp > 1 and dims.ep > 1
        self.experts_held = dims.expert_range(moe.num_experts)
        self.aux: MoEAux | None = None      # the chunk's tracker, set by the chunk
        self.replay: RouterReplay | None = None     # the chunk's router replay state, set by the chunk
        self.moe_index = 0                  # this layer's place among the model's MoE layers (set by the chunk)
        self.recompute_shared = False       # recompute="moe" / "selective": the shared expert recomputed
        if moe.router == "sigmoid_grouped":   # DeepSeek-V3 / GLM-4.5: fp32 weight and selection bias
            self.router = GroupLimitedRouter(moe.num_experts, spec.hidden_size, top_k=moe.top_k, n_group=moe.n_group,
                                             topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
                                             routed_scaling_factor=moe.routed_scaling_factor,
                                             score_bias=moe.score_bias, device=device)
        elif moe.router == "sqrtsoftplus":    # DeepSeek-V4: model-dtype weight, fp32 bias or the int64 tid2eid
            self.router = ScoreRouter(moe.num_experts, spec.hidden_size, top_k=moe.top_k,
                                      routed_scaling_factor=moe.routed_scaling_factor,
                                      hash_vocab=spec.vocab_size if self.is_hash else None,
                                      dtype=config.params_dtype, device=device)
        elif moe.router == "gemma4":          # Gemma 4: on the residual, with its scale and per-expert scale
            self.router = Gemma4Router(moe.num_experts, spec.hidden_size, top_k=moe.top_k, eps=spec.rms_norm_eps,
                                       dtype=config.params_dtype, device=device)
        else:
            self.router = Router((moe.num_experts, spec.hidden_size), config.params_dtype, device,
                                 bias=(moe.num_experts,) if moe.router_bias else None)
        self.router_kind = moe.router
        if moe.latent_size:     # Nemotron-3: the routed experts in a latent space, replicated projections
            self.fc1_latent_proj = Latent(spec.hidden_size, moe.latent_size, moe.latent_bias, config.params_dtype,
                                          device)
            self.fc2_latent_proj = Latent(moe.latent_size, spec.hidden_size, moe.latent_bias, config.params_dtype,
                                          device)
        self.experts = Experts(len(self.experts_held), moe.latent_size or spec.hidden_size,
                               moe.expert_intermediate_size // tp,
                               config.params_dtype, device, layout=moe.expert_layout, bias=moe.expert_bias,
                               add_down_bias=dims.tp_rank == 0, activation=moe.activation,
                               limit=moe.swiglu_limit, alpha=moe.swiglu_alpha)
        if moe.shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(spec, config, moe.shared_expert_gate, device)

    def route(self, h, routed=None):
        """(probs [N, E] fp32, weights [N, k] fp32, choices [N, k]): the logits in the model dtype, as transformers
        computes them, then fp32 (the activations are not upcast: only the [N, E] logits are). The sigmoid
        group-limited router (:mod:`parallm.model.layers.routing`) gives its sigmoid scores as the probabilities;
        gpt-oss's ``topk_softmax`` router (its bias in the logits) the softmax over all experts (what the
        load-balancing loss reads), its weights being the softmax over the chosen ``k`` logits.

        ``routed``: router replay, ``(experts [N, k] int64, real [N] bool)`` in the rows of ``h``: the real rows
        route with those experts instead of the router's top-k (padding rows keep the router's own), and the
        weights are the router's probabilities of the experts routed with, normalised as the router normalises
        its own (:func:`softmax_weights` / :func:`sigmoid_weights` / :func:`topk_softmax_weights`), so the router
        still gets gradients."""
        if isinstance(self.router, GroupLimitedRouter):
            logits, weights, choices = self.router(h)
            scores = logits.sigmoid()
            if routed is not None:
                choices = torch.where(routed[1][:, None], routed[0], choices)
                weights = sigmoid_weights(scores, choices, norm_topk_prob=self.router.norm_topk_prob,
                                          routed_scaling_factor=self.router.routed_scaling_factor)
            return scores, weights, choices
        if isinstance(self.router, Gemma4Router):
            probs, weights, choices = self.router(h)
            if routed is not None:
                choices = torch.where(routed[1][:, None], routed[0], choices)
                weights = self.router.weights(probs, choices)
            return probs, weights, choices
        logits = F.linear(h, self.router.weight, self.router.bias).float()
        probs = torch.softmax(logits, dim=-1)
        if self.router_kind == "topk_softmax":       # gpt-oss: top-k of the logits, softmax over those k
            top, choices = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
            if routed is not None:
                choices = torch.where(routed[1][:, None], routed[0], choices)
                weights = topk_softmax_weights(logits, choices)
            return probs, weights, choices
        weights, choices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if routed is not None:
            choices = torch.where(routed[1][:, None], routed[0], choices)
            weights = softmax_weights(probs, choices, norm_topk_prob=self.norm_topk_prob)
        return probs, weights, choices

    def route_scores(self, h, routed=None, token_ids=None):
        """DeepSeek-V4's routing (:class:`~parallm.model.layers.routing.ScoreRouter`): (probs, balance choices,
        weights, choices). ``probs`` ``[N, E]`` fp32 and the balance choices ``[N, k]`` are what transformers'
        load-balancing loss reads from the recorded logits: ``softmax(logits)`` (in the logits' dtype) and its
        top-k, not the routed experts (None in a hash layer: its logits are not recorded). ``weights`` / ``choices``
        route the tokens; under router replay the real rows take the given experts (in a hash layer too: there the
        replay gives back what ``tid2eid`` chose) and the weights are the router's scores of them."""
        logits = self.router.logits(h)
        scores = sqrtsoftplus(logits)
        choices = self.router.choose(scores, token_ids)
        if routed is not None:
            choices = torch.where(routed[1][:, None], routed[0], choices)
        weights = self.router.weights(scores, choices).float()
        if self.is_hash:
            return None, None, weights, choices
        probs = torch.softmax(logits, dim=-1)
        return probs.float(), torch.topk(probs, self.top_k, dim=-1).indices, weights, choices

    def _into_tp_region(self, h, weights, choices):
        if self.sequence_parallel:
            h = mtp.gather_from_sequence_parallel_region(h, True, group=self.tp_group)
            weights = mtp.gather_from_sequence_parallel_region(weights, True, group=self.tp_group)
            gathered = choices.new_empty((choices.shape[0] * self.tp,) + tuple(choices.shape[1:]))
            all_gather_single(gathered, choices.contiguous(), group=self.tp_group)
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

    def _routed(self, h, weights, choices, *, tp_group):
        """The routed experts' weighted sum for the tokens ``h`` [n, H] (their TP shards' partial sums unless
        ``tp_group`` shares the dispatch, see :func:`dispatch`)."""
        slots, experts = sort_slots(choices)
        counts = expert_counts(experts, self.num_experts)
        # Deterministic on every device: rows move by gathers whose backward is a gather too (slots_of,
        # weighted_sum) or by permutations; nothing accumulates by index_add / scatter-add, whose colliding atomic
        # adds on CUDA vary in order from run to run.
        if self.ep == 1 and self.experts.recomputes():    # recompute="moe", no all-to-all: kept as the tokens
            plan = dispatch(h, counts, ep=1, group=None)[1]     # (at ep = 1 only the counts: rows pass through)
            rows = recomputed_token_experts(self.experts, h, slots, plan.local_counts, plan.local_counts_device)
            return weighted_sum(rows, weights.to(rows.dtype), slots)
        rows, plan = dispatch(slots_of(h, slots), counts, ep=self.ep, group=self.ep_group, tp=self.tp,
                              tp_group=tp_group)
        rows = combine(self.experts(rows, plan.local_counts, plan.local_counts_device), plan)  # sorted-slot order
        return weighted_sum(rows, weights.to(rows.dtype), slots)

    def forward(self, x, tokens=None, routed=None, token_ids=None, router_x=None):
        """x: ``[S, B, H]`` (or ``[T / tp, 1, H]`` under sequence parallelism). ``tokens``: 1 for the real rows
        of ``x.reshape(-1, H)`` (the load-balancing loss counts those only); None: all rows are real.
        ``routed``: router replay's ``(experts [N, k], real [N])`` for those rows (:meth:`route`); the
        load-balancing loss then counts the experts routed with (the replayed ones) against the router's
        probabilities, as usual (DeepSeek-V4: the top-k of the softmax, as transformers). ``token_ids``: int64, the
        leading shape of ``x``, the token id of each row (DeepSeek-V4's hash layers route by it; a hash layer
        without it raises). ``router_x``: what the router reads when it is not ``x`` (Gemma 4: the residual, shaped
        as ``x``)."""
        shape = x.shape
        h = x.reshape(-1, self.hidden)
        r = h if router_x is None else router_x.reshape(-1, self.hidden)
        if isinstance(self.router, ScoreRouter):
            if token_ids is not None and tuple(token_ids.shape) != tuple(shape[:-1]):
                raise ValueError(f"token_ids has shape {list(token_ids.shape)}; the MoE input is {list(shape)} "
                                 f"(one token id per row: {list(shape[:-1])})")
            probs, balance, weights, choices = self.route_scores(r, routed, token_ids)
        else:
            probs, weights, choices = self.route(r, routed)
            balance = choices
        if self.replay is not None and self.replay.recording:
            self.replay.rows[self.moe_index] = choices.detach()
        aux = pooled = None
        latent = hasattr(self, "fc1_latent_proj")
        if latent:        # the router saw the hidden states; the experts see the latent ones
            h = self.fc1_latent_proj(h)
        if self.aux is not None and self.aux.scale is not None and torch.is_grad_enabled() and probs is not None:
            real = tokens if tokens is not None else torch.ones(h.shape[0], device=h.device)
            if self.aux.mode == "pooled":     # transformers' convention: one loss over every MoE layer
                pooled = balance_fractions(probs, balance, real, num_experts=self.num_experts,
                                           tp_group=self.sequence_group)
            else:
                aux = load_balancing_loss(probs, balance, real, num_experts=self.num_experts,
                                          tp_group=self.sequence_group)
        if self.shares and self.sequence_parallel:       # this rank's own tokens are its share
            out = self._routed(h, weights, choices, tp_group=self.tp_group)
        elif self.shares:                                # a TP replica: route it all, dispatch this rank's share
            weights = mtp.copy_to_tensor_model_parallel_region(weights, group=self.tp_group)
            mine = dict(rank=self.tp_rank, size=self.tp, group=self.tp_group)
            sizes = share_sizes(h.shape[0], self.tp)
            start, rows = sum(sizes[:self.tp_rank]), sizes[self.tp_rank]
            out = self._routed(share_of(h, **mine), weights.narrow(0, start, rows), choices.narrow(0, start, rows),
                               tp_group=self.tp_group)
            out = gather_shares(out, rows=h.shape[0], **mine)
        else:
            out = self._out_of_tp_region(self._routed(*self._into_tp_region(h, weights, choices), tp_group=None))
        if latent:
            out = self.fc2_latent_proj(out)
        out = out.view(shape)
        if hasattr(self, "shared_experts"):
            out = out + (self.shared_experts(x) if not self.recompute_shared or not torch.is_grad_enabled() else
                         checkpoint(self.shared_experts, x, use_reentrant=False, preserve_rng_state=False))
        if aux is not None:
            if self.aux.recording:
                self.aux.record(aux.detach())
            out = _AttachAux.apply(out, aux, self.aux.scale)
        if pooled is not None:
            if self.aux.recording:
                self.aux.record_fractions(*pooled)
            out = _AttachPooled.apply(out, pooled[1], self.aux, self.aux.microbatch, self.aux.scale)
        return out
