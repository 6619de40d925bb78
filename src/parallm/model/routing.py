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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, experts


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
