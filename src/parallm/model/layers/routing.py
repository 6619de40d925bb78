"""The sigmoid, group-limited router of DeepSeek-V3 / Kimi-K2 / Moonlight and GLM-4.5 (``noaux_tc``), equal to
transformers' ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` bit for bit.

For the tokens ``h`` ``[N, H]`` of one MoE layer::

    logits  = h W^T                 in fp32: h and W taken to fp32 for this product only (transformers keeps
                                    the router weight in fp32 and upcasts the activations for it); the
                                    activations the experts see keep the model dtype
    scores  = sigmoid(logits)                                   [N, E] fp32
    choice  = scores + e_score_correction_bias                  the bias (fp32) only chooses
    group score = sum of each group's two best choice values    (n_group groups of E / n_group experts)
    keep the topk_group best groups, then the top_k experts among them by choice value
    weights = scores of those experts (unbiased), / (their sum + 1e-20) if norm_topk_prob,
              * routed_scaling_factor

The selection bias is DeepSeek's auxiliary-loss-free balancing: a per-expert offset updated by a rule outside
backpropagation (never by gradients), added only to choose. It must stay fp32: its values differ from each
other by less than a bf16 ulp near their magnitude, so rounding it to bf16 changes which experts win
(``tests/test_deepseek_parts.py`` builds such a case). :class:`GroupLimitedRouter` holds it as an fp32
parameter without gradient (``requires_grad=False``), so the weight table can load, save and export it like
any other tensor.

Router replay (:class:`RouterReplay`, below): ``forward`` / ``forward_backward(routed_experts=...)`` route every
MoE layer with experts chosen elsewhere (the rollout engine's), the combine weights still the router's
probabilities of those experts (:func:`softmax_weights`, :func:`sigmoid_weights`), so gradients reach the router;
``forward(return_routed_experts=True)`` records the choices made. docs/moe.md, "Router replay".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.comm import all_gather_single


def check_grouping(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise ValueError when the grouping cannot run (numbers named): ``n_group`` must divide the experts into
    groups of at least two (a group is scored by its two best experts), ``1 <= topk_group <= n_group``, and the
    kept groups must hold at least ``top_k`` experts."""
    problems = []
    if n_group <= 0 or num_experts % n_group:
        problems.append(f"n_group={n_group} does not divide n_routed_experts={num_experts}")
    elif num_experts // n_group < 2:
        problems.append(f"groups of {num_experts // n_group} expert(s): each group is scored by its two best, so "
                        "it needs at least 2")
    if not 1 <= topk_group <= max(n_group, 1):
        problems.append(f"topk_group={topk_group} is not in [1, n_group={n_group}]")
    elif n_group > 0 and not num_experts % n_group and top_k > topk_group * (num_experts // n_group):
        problems.append(f"num_experts_per_tok={top_k} exceeds the {topk_group * (num_experts // n_group)} experts of "
                        f"the topk_group={topk_group} groups kept")
    if problems:
        raise ValueError("invalid group-limited routing: " + "; ".join(problems))


def group_limited_topk(scores: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int,
                       topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[N, top_k]`` fp32, experts ``[N, top_k]`` int64) from sigmoid ``scores`` ``[N, E]`` (fp32) and
    the selection ``bias`` ``[E]`` (fp32; None: no bias), in transformers' operations and order (unsorted top-k:
    the experts of a token come in the order ``torch.topk(sorted=False)`` gives, the same as transformers')."""
    n, num_experts = scores.shape
    choice = scores + bias if bias is not None else scores
    per_group = num_experts // n_group
    group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    return sigmoid_weights(scores, experts, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor), experts


def sigmoid_weights(scores: torch.Tensor, experts: torch.Tensor, *, norm_topk_prob: bool,
                    routed_scaling_factor: float) -> torch.Tensor:
    """The combine weights ``[N, k]`` of ``experts`` ``[N, k]`` from the unbiased sigmoid ``scores`` ``[N, E]``:
    the chosen scores, / (their sum + 1e-20) if ``norm_topk_prob``, * ``routed_scaling_factor``. The same for
    the router's own choice and for replayed experts (router replay), so gradients reach the router either way."""
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def softmax_weights(probs: torch.Tensor, experts: torch.Tensor, *, norm_topk_prob: bool) -> torch.Tensor:
    """The combine weights ``[N, k]`` of ``experts`` ``[N, k]`` from the softmax router's fp32 ``probs``
    ``[N, E]`` (Qwen-MoE, Mixtral): the chosen probabilities, renormalised to sum to 1 if ``norm_topk_prob``.
    For the router's own top-k this is transformers' ``topk`` values; for replayed experts, the router's
    probabilities of THOSE experts (router replay)."""
    weights = probs.gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def topk_softmax_weights(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The combine weights ``[N, k]`` of ``experts`` ``[N, k]`` for gpt-oss's router (``topk_softmax``): the
    softmax over those experts' fp32 ``logits`` ``[N, E]`` (the router's bias included). For the router's own
    top-k this is transformers' ``GptOssTopKRouter`` weights; for replayed experts, the same softmax over THEIR
    logits (router replay)."""
    return torch.softmax(logits.gather(1, experts), dim=-1)


def sigmoid_route(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, n_group: int,
                  topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits ``[N, E]`` fp32, weights ``[N, top_k]`` fp32, experts ``[N, top_k]``) for tokens ``h`` ``[N, H]``
    of any dtype, the router ``weight`` ``[E, H]`` and the fp32 selection ``bias`` ``[E]`` (see the module doc).
    Differentiable in ``h`` and ``weight`` through the weights' unbiased scores; never in ``bias``."""
    if bias is not None and bias.dtype != torch.float32:
        raise ValueError(f"the selection bias must be float32 (rounding it changes which experts win), got "
                         f"{bias.dtype}")
    logits = F.linear(h.float(), weight.float())
    weights, experts = group_limited_topk(logits.sigmoid(), bias.detach() if bias is not None else None,
                                          top_k=top_k, n_group=n_group, topk_group=topk_group,
                                          norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    return logits, weights, experts


class GroupLimitedRouter(nn.Module):
    """The router of one MoE layer: ``weight`` ``[E, H]`` (fp32, as transformers keeps it) and
    ``e_score_correction_bias`` ``[E]`` (fp32, ``requires_grad=False``: updated by a rule, never by gradients),
    both replicated over TP; megatron-core marks a router ``sequence_parallel`` (its gradient is a partial sum
    over TP under sequence parallelism)."""
    parallm_param_kind = "replicated"

    def __init__(self, num_experts: int, hidden: int, *, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, score_bias: bool = True, device=None):
        super().__init__()
        check_grouping(num_experts, top_k, n_group, topk_group)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device=device))
        if score_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits fp32 ``[N, E]``, weights fp32 ``[N, k]``, experts ``[N, k]``) for ``h`` ``[N, H]``."""
        return sigmoid_route(h, self.weight, self.e_score_correction_bias, top_k=self.top_k, n_group=self.n_group,
                             topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                             routed_scaling_factor=self.routed_scaling_factor)


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's router scores, transformers' ``SqrtSoftplusActivation``: ``sqrt(softplus(x))``."""
    return F.softplus(logits).sqrt()


class ScoreRouter(nn.Module):
    """DeepSeek-V4's router of one MoE layer (transformers' ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``),
    replicated over TP: ``weight`` ``[E, H]`` in the model dtype (its logits ``h W^T`` in the model dtype, as
    transformers), scores ``sqrt(softplus(logits))``; a top-k layer chooses the ``top_k`` experts of ``scores +
    e_score_correction_bias`` (``[E]`` fp32, ``requires_grad=False``: updated by a rule, never by gradients), a
    hash layer takes them from ``tid2eid[token_id]`` (``[vocab, top_k]`` int64, frozen: a parameter without
    gradient so the weight table loads, saves and exports it bit for bit, never cast). The weights are the chosen
    (unbiased) scores / (their sum + 1e-20) * ``routed_scaling_factor``, for the router's own choice and for
    replayed experts alike (:func:`sigmoid_weights` with ``norm_topk_prob``)."""
    parallm_param_kind = "replicated"

    def __init__(self, num_experts: int, hidden: int, *, top_k: int, routed_scaling_factor: float,
                 hash_vocab: int | None, dtype, device=None):
        super().__init__()
        self.top_k, self.routed_scaling_factor = top_k, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        self.is_hash = hash_vocab is not None
        if self.is_hash:
            self.tid2eid = nn.Parameter(torch.zeros(hash_vocab, top_k, dtype=torch.int64, device=device),
                                        requires_grad=False)
            self.e_score_correction_bias = None
        else:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False)
            self.tid2eid = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)

    def choose(self, scores: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """The experts ``[N, k]`` int64: ``tid2eid[token_ids]`` in a hash layer (``token_ids`` ``[N]`` needed),
        else the top-k of the scores plus the fp32 correction bias (unsorted, as transformers)."""
        if self.is_hash:
            if token_ids is None:
                raise ValueError("a DeepSeek-V4 hash MoE layer chooses its experts from the token ids: "
                                 "MoEBlock.forward needs token_ids (one per row of its input)")
            if token_ids.numel() != scores.shape[0]:
                raise ValueError(f"token_ids has {token_ids.numel()} entries for {scores.shape[0]} rows of the MoE "
                                 "input (one token id per row)")
            return self.tid2eid.index_select(0, token_ids.reshape(-1).long())
        choice = scores + self.e_score_correction_bias.detach()
        return torch.topk(choice, self.top_k, dim=-1, sorted=False).indices

    def weights(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return sigmoid_weights(scores, experts, norm_topk_prob=True,
                               routed_scaling_factor=self.routed_scaling_factor)


class Gemma4Router(nn.Module):
    """Gemma 4's router of one MoE layer (transformers' ``Gemma4TextRouter``), replicated over TP: ``weight``
    ``[E, H]`` (``router.proj``), ``scale`` ``[H]`` and ``per_expert_scale`` ``[E]``, all in the model dtype. For
    the layer's residual ``h`` ``[N, H]``: the logits of ``rms(h) * scale * H^-0.5`` (``rms`` weightless, in fp32,
    cast back, as ``Gemma4RMSNorm(with_scale=False)``), their softmax in fp32, its top-k renormalised to sum to 1,
    each weight times ``per_expert_scale`` of its expert (op for op as transformers)."""
    parallm_param_kind = "replicated"

    def __init__(self, num_experts: int, hidden: int, *, top_k: int, eps: float, dtype, device=None):
        super().__init__()
        self.top_k, self.eps, self.root = top_k, eps, hidden ** -0.5
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        self.scale = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        normed = (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(h.dtype)
        return F.linear(normed * self.scale * self.root, self.weight)

    def weights(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The combine weights ``[N, k]`` fp32 of ``experts`` from the fp32 ``probs``: renormalised over the k,
        times ``per_expert_scale`` (for the router's own top-k and for replayed experts alike)."""
        return softmax_weights(probs, experts, norm_topk_prob=True) * self.per_expert_scale[experts]

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs ``[N, E]`` fp32, weights ``[N, k]`` fp32, experts ``[N, k]``) for the residual ``h`` ``[N, H]``."""
        probs = torch.softmax(self.logits(h), dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return probs, top * self.per_expert_scale[experts], experts


# -- router replay ---------------------------------------------------------------------------------------------

class RouterReplay:
    """Router replay state of one chunk for one ``forward`` / ``forward_backward`` call.

    ``given``: per microbatch, the experts to route with, ``[B_mb, S, num_moe_layers, top_k]`` int64 (the MoE
    layers numbered in model order, 0 for the first MoE layer; padding positions hold anything: their rows keep
    the router's own choice), or None (the router's top-k). ``recording``: the MoE layers keep the choices they
    route with (``rows``), and the chunk turns them into ``recorded[m]``, ``[B_mb, S, num_moe_layers, top_k]``
    int64 with -1 at padding positions and in the columns of MoE layers other chunks hold. ``microbatch``: set by
    the caller before each forward step."""

    def __init__(self):
        self.given: list[torch.Tensor] | None = None
        self.recording = False
        self.microbatch = 0
        self.rows: dict[int, torch.Tensor] = {}
        self.recorded: dict[int, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.given is not None or self.recording

    def start(self, given: list[torch.Tensor] | None, *, record: bool) -> None:
        self.given, self.recording, self.microbatch, self.rows, self.recorded = given, record, 0, {}, {}

    def stop(self) -> dict[int, torch.Tensor]:
        recorded = self.recorded
        self.start(None, record=False)
        return recorded

    def current(self) -> torch.Tensor | None:
        """The running microbatch's given experts ``[B_mb, S, L, k]``, or None."""
        return None if self.given is None else self.given[self.microbatch]


def moe_layer_indices(spec) -> list[int]:
    """The global indices of the decoder's MoE layers in model order (position j: MoE layer j of a
    ``routed_experts`` tensor); multi-token-prediction layers are not run and not counted."""
    if spec.moe is None:
        return []
    return sorted(layer for layer in spec.moe.layers if layer < spec.num_layers)


def _context_split_type():
    from ..context_parallel import ContextSplit
    return ContextSplit


def _packing_type():
    from .attention import Packing
    return Packing


def rows_of_tokens(t: torch.Tensor, attention_mask: torch.Tensor, ctx, *, share=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-token ``[B, S, ...]`` tensor in the order of this rank's MoE input rows (the activations
    ``x.reshape(-1, H)`` of :class:`parallm.model.layers.moe.MoEBlock`): ``(rows [N, ...], real [N] bool)``.

    Padded layout (``ctx`` a mask or None): ``[S, B]`` s-major. Packed (``ctx`` a ``Packing``): the real tokens
    row by row, then the stream's padding (not real). Context parallel (``ctx`` a ``ContextSplit``): this rank's
    slots (``ctx.origin``'s share of this rank; -1 slots are padding). ``share``: under sequence parallelism the
    function that keeps this TP rank's share of the rows (the decoder's ``_my_rows``)."""
    b, s = attention_mask.shape
    rest = tuple(t.shape[2:])
    share = share or (lambda x: x)
    if isinstance(ctx, _context_split_type()):
        slots = ctx.slots
        mine = ctx.origin[ctx.rank * slots:(ctx.rank + 1) * slots]
        rows = t.reshape((b * s,) + rest).index_select(0, mine.clamp(min=0))
        return share(rows), share(mine >= 0)
    if isinstance(ctx, _packing_type()):
        rows = t.reshape((b * s,) + rest).index_select(0, ctx.indices)
        pad = ctx.total - ctx.nnz
        real = torch.arange(ctx.total, device=t.device) < ctx.nnz
        if pad:
            rows = torch.cat([rows, rows.new_zeros((pad,) + rest)])
        return share(rows), share(real)
    return t.transpose(0, 1).reshape((s * b,) + rest), attention_mask.transpose(0, 1).reshape(-1).bool()


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def tokens_of_rows(rows: torch.Tensor, attention_mask: torch.Tensor, ctx, *, sp_group=None, cp_group=None
                   ) -> torch.Tensor:
    """:func:`rows_of_tokens` inverted for recorded choices: this rank's rows ``[N, k]`` (int64) -> the whole
    microbatch's ``[B, S, k]``, -1 at padding positions, the same on every rank of the TP / CP group.
    Collective: ``sp_group`` (the TP group under sequence parallelism: each rank holds a share of the rows) is
    all-gathered first, then under context parallelism ``cp_group``."""
    b, s = attention_mask.shape
    k = rows.shape[-1]
    if sp_group is not None:
        rows = _all_gather_rows(rows, sp_group)
    out = rows.new_full((b * s, k), -1)
    if isinstance(ctx, _context_split_type()):
        gathered = _all_gather_rows(rows, cp_group)
        src, dst = ctx.placement()
        out[dst] = gathered.index_select(0, src)
    elif isinstance(ctx, _packing_type()):
        out[ctx.indices] = rows[:ctx.nnz]
    else:
        out = rows.view(s, b, k).transpose(0, 1).reshape(b * s, k).clone()
        out[~attention_mask.reshape(-1).bool()] = -1
    return out.view(b, s, k)


def check_routed_experts(routed, attention_mask: torch.Tensor, *, moe_layers: list[int], num_layers: int,
                         top_k: int, num_experts: int) -> torch.Tensor:
    """Validate ``routed_experts`` against a ``[B, S]`` batch and return it as ``[B, S, L, k]`` int64 on the
    mask's device (``L = len(moe_layers)``, the model's MoE layers in order). Accepted: ``[B, S, L, k]``
    (padded, like ``input_ids``), or ``[T, L, k]`` with ``T`` the batch's real tokens (``attention_mask.sum()``)
    in row order (a packed / remove-padding stream: row 0's real tokens, then row 1's, ...), spread onto the
    real positions. The layer axis may also hold all ``num_layers`` decoder layers (vLLM's ``routed_experts``
    layout: a slot per layer, dense layers' slots unused) when the model has dense layers too: the MoE layers'
    slots are taken, the others ignored. Values at padding positions are ignored (their rows keep the router's
    own choice); at real positions each must be an expert id in ``[0, E)``, distinct within a token. A
    ValueError names what is wrong, with the numbers."""
    num_moe_layers = len(moe_layers)
    if not torch.is_tensor(routed) or routed.dtype.is_floating_point or routed.dtype == torch.bool \
            or routed.is_complex():
        raise ValueError(f"routed_experts must be an integer tensor, got "
                         f"{getattr(routed, 'dtype', type(routed).__name__)}")
    b, s = attention_mask.shape
    mask = attention_mask.bool()
    real = int(mask.sum())
    want = f"[{b}, {s}, {num_moe_layers}, {top_k}] (batch, seq, MoE layers, top_k) or [{real}, " \
           f"{num_moe_layers}, {top_k}] (the batch's {real} real tokens in row order)"
    shape = tuple(routed.shape)
    routed = routed.to(attention_mask.device)
    if routed.dim() in (3, 4) and shape[-2] == num_layers != num_moe_layers:    # a slot per decoder layer
        routed = routed.index_select(-2, torch.tensor(moe_layers, dtype=torch.long, device=routed.device))
        shape = tuple(routed.shape)
    if routed.dim() == 3 and shape[1:] == (num_moe_layers, top_k) and shape[0] == real:
        full = routed.new_full((b, s, num_moe_layers, top_k), 0)
        full[mask] = routed
        routed = full
    elif routed.dim() != 4 or shape != (b, s, num_moe_layers, top_k):
        detail = ""
        if routed.dim() in (3, 4):
            if shape[-2] != num_moe_layers:
                detail = f": {shape[-2]} MoE layers given, the model has {num_moe_layers}" + (
                    f" (or pass all {num_layers} decoder layers)" if num_layers != num_moe_layers else "")
            elif shape[-1] != top_k:
                detail = f": top_k {shape[-1]} given, the model routes each token to {top_k} experts"
            elif routed.dim() == 3:
                detail = f": {shape[0]} tokens given, the batch has {real} real tokens"
            else:
                detail = f": batch {tuple(shape[:2])} given, input_ids is ({b}, {s})"
        raise ValueError(f"routed_experts has shape {list(shape)}; expected {want}{detail}")
    routed = routed.long()
    at_real = routed[mask]                                     # [real, L, k]
    if at_real.numel():
        low, high = int(at_real.min()), int(at_real.max())
        if low < 0 or high >= num_experts:
            bad = ((at_real < 0) | (at_real >= num_experts)).nonzero()[0].tolist()
            pos = mask.nonzero()[bad[0]].tolist()
            raise ValueError(f"routed_experts must hold expert ids in [0, {num_experts}) at real positions; got "
                             f"values in [{low}, {high}] (first: {int(at_real[tuple(bad)])} at batch row "
                             f"{pos[0]}, position {pos[1]}, MoE layer {bad[1]})")
        ordered = at_real.sort(dim=-1).values
        dup = (ordered[..., 1:] == ordered[..., :-1]).any(-1)          # [real, L]
        if bool(dup.any()):
            t, layer = dup.nonzero()[0].tolist()
            pos = mask.nonzero()[t].tolist()
            raise ValueError(f"routed_experts repeats an expert within a token: {at_real[t, layer].tolist()} at "
                             f"batch row {pos[0]}, position {pos[1]}, MoE layer {layer} (top_k distinct experts "
                             "per token)")
    return routed
