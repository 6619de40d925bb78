"""The MoE load-balancing loss: each layer's value (transformers' ``load_balancing_loss_func`` applied to that layer
alone), the weight each microbatch's loss enters the backward with, and the chunk's bookkeeping of it
(docs/moe.md, "Load-balancing loss"). Used by :class:`parallm.model.layers.moe.MoEBlock`."""

from __future__ import annotations

import contextlib

import torch


class AuxScales:
    """The weight each microbatch's load-balancing loss enters the backward with, in one ``forward_backward``
    call: ``coef / num_microbatches`` when that microbatch's ``loss_fn`` returned a scalar (the objective is a
    mean over microbatches), ``coef * num_tokens`` when it returned ``(loss_sum, num_tokens)`` (every gradient
    is divided by the global token count in ``finalize_grads``, so the term becomes ``coef * num_tokens / N``:
    a token-weighted mean of the microbatches' losses, docs/moe.md). ``tokens[m]`` is set on the last pipeline
    stage when ``loss_fn`` has run (-1 for a scalar loss) and reaches the other stages with the gradient of
    microbatch ``m`` (:func:`parallm.parallel.pipeline.run_pipeline`'s ``side``), before their backward of it."""

    def __init__(self, coef: float, num_microbatches: int):
        self.coef, self.num_microbatches = float(coef), num_microbatches
        self.tokens: dict[int, float] = {}

    def of(self, m: int):
        """Microbatch ``m``'s weight: a float, or a 0-dim device tensor when its token count is one (a
        ``loss_fn``'s tensor count, or one received from the last stage: never read on the host here)."""
        n = self.tokens.get(m)
        if n is None:
            raise RuntimeError(f"load-balancing loss: microbatch {m}'s backward ran before its loss kind and token "
                               "count reached this rank")
        if torch.is_tensor(n):
            return torch.where(n < 0, self.coef / self.num_microbatches, self.coef * n)
        return self.coef / self.num_microbatches if n < 0 else self.coef * n


class _ScaleOf:
    """A microbatch's :class:`AuxScales` entry, read when its backward runs (:meth:`value`)."""

    def __init__(self, scales: AuxScales, m: int):
        self.scales, self.m = scales, m

    def value(self):
        return self.scales.of(self.m)

    def __float__(self) -> float:
        return float(self.value())


class MoEAux:
    """Load-balancing loss bookkeeping of one chunk: active only inside :func:`parallm.forward_backward` when
    the model's ``aux_loss_coef`` > 0 (then ``scale`` is not None). ``microbatch`` is the microbatch whose step
    runs (set by the pipeline engine before each forward and backward step); each MoE layer adds its loss to the
    objective with that microbatch's weight (:class:`AuxScales`, read at backward time) and records its
    detached value as ``(microbatch, value)``."""

    def __init__(self):
        self.scales: AuxScales | None = None
        self.microbatch = 0
        self.values: list[tuple[int, torch.Tensor]] = []
        self.recording = True    # False while activation recompute replays a layer's forward in the backward
        self.mode = "per_layer"  # build_model(aux_loss=...): "per_layer" (Megatron's) or "pooled" (transformers')
        self.num_layers = 0      # the model's MoE layers (pooled: every layer's fractions are averaged over them)
        self.pooled: dict[int, list] = {}   # pooled: microbatch -> [sum_l f_l, sum_l p_l (detached)]

    @property
    def scale(self) -> _ScaleOf | None:
        """The running microbatch's weight (a handle read at backward time), None when inactive."""
        return None if self.scales is None else _ScaleOf(self.scales, self.microbatch)

    @contextlib.contextmanager
    def replaying(self):
        """Inside: a replayed forward (activation recompute's, in the backward) computes and attaches the loss
        again, as the autograd graph needs, but does not record its value a second time."""
        before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before

    def start(self, scales: AuxScales) -> None:
        self.scales, self.values, self.microbatch, self.pooled = scales, [], 0, {}

    def record(self, value: torch.Tensor) -> None:
        self.values.append((self.microbatch, value))

    def record_fractions(self, f: torch.Tensor, p: torch.Tensor) -> None:
        """Pooled mode: one layer's ``f`` (assignments per real token, global over the sequence's ranks) and ``p``
        (this rank's share of the mean router probability) for the running microbatch."""
        acc = self.pooled.setdefault(self.microbatch, [torch.zeros_like(f), torch.zeros_like(p)])
        acc[0] += f
        acc[1] += p.detach()

    def pooled_weight(self, m: int) -> torch.Tensor:
        """d(pooled loss) / d p_l for microbatch ``m``: ``E * sum_l f_l / L^2`` (the same for every layer l)."""
        f = self.pooled[m][0]
        return f.numel() * f / self.num_layers ** 2

    def stop(self) -> list[tuple[int, torch.Tensor]]:
        values, self.scales, self.values = self.values, None, []
        if self.mode == "pooled":      # each microbatch's one pooled value: E sum_e (F_e / L) (P_e / L)
            values = [(m, f.numel() * (f * p).sum() / self.num_layers ** 2) for m, (f, p) in self.pooled.items()]
            self.pooled = {}
        return values


class _AttachAux(torch.autograd.Function):
    """Forward: ``out`` unchanged. Backward: also sends gradient ``float(scale)`` into ``aux`` (megatron-core's
    MoEAuxLossAutoScaler; ``scale`` is read only now, see :class:`AuxScales`): the layer's loss joins the
    objective without travelling through the pipeline."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        scale = ctx.scale.value() if hasattr(ctx.scale, "value") else ctx.scale
        if torch.is_tensor(scale):      # a device token count: no host read
            return grad, torch.ones_like(aux) * scale.to(aux.device, aux.dtype), None
        return grad, torch.full_like(aux, float(scale)), None


class _AttachPooled(torch.autograd.Function):
    """Pooled mode (transformers' ``load_balancing_loss_func`` over every MoE layer at once): forward ``out``
    unchanged; backward also sends into the layer's ``p`` (its share of the mean router probability per expert)
    the pooled loss's gradient ``scale * E * sum_l f_l / L^2``, read at backward time, when every layer of the
    microbatch has recorded its ``f`` (``pp = 1``: the whole forward ran before)."""

    @staticmethod
    def forward(ctx, out, p, aux, m, scale):
        ctx.aux, ctx.m, ctx.scale = aux, m, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.scale.value() if hasattr(ctx.scale, "value") else ctx.scale
        weight = ctx.aux.pooled_weight(ctx.m)
        scale = scale.to(weight.device, weight.dtype) if torch.is_tensor(scale) else float(scale)
        return grad, weight * scale, None, None, None


def balance_fractions(probs, choices, tokens, *, num_experts: int, tp_group=None):
    """``(f, p)`` of one layer: ``f_e`` = top-k assignments to expert e per real token (summed over ``tp_group``,
    no gradient), ``p_e`` = this rank's share of the mean router probability of e over the real tokens
    (differentiable; the shares over ``tp_group`` sum to the mean). See :func:`load_balancing_loss`."""
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
    return counts / real, prob_sum / real


def load_balancing_loss(probs, choices, tokens, *, num_experts: int, tp_group=None):
    """One layer's loss, transformers' ``load_balancing_loss_func`` applied to this layer alone:
    ``E * sum_e f_e * P_e`` with ``f_e`` = top-k assignments to expert e per real token and ``P_e`` = mean router
    probability of e over real tokens. ``tokens``: 1 for real rows, 0 for padding. With ``tp_group`` (the
    ranks sharing the sequence's tokens: TP under sequence parallelism, the context-parallel group, or both)
    the counts are summed over it and the returned value is this rank's share of the loss (the shares sum to
    the loss; each carries the gradient of its tokens)."""
    f, p = balance_fractions(probs, choices, tokens, num_experts=num_experts, tp_group=tp_group)
    return num_experts * (f * p).sum()
