"""Where each parameter lives, declared once per parameter.

The weight table (:mod:`parallm.model.table`) states every parameter's layout kind, whether its gradient is a
partial sum over the TP group, and its part in tied embeddings. :func:`attach_placements` turns the rows that
apply to a chunk into a :class:`Placement` on each parameter (``param.parallm_placement``) and sets the
attributes megatron-core itself sets on the same layers, so Megatron's optimizer, grad clipping and checkpoint
code read parallm's chunks correctly:

    tensor_model_parallel / partition_dim / partition_stride   the TP split (megatron-core sets these only when
                                                               it initialises a weight; parallm builds without)
    sequence_parallel                                          norms, row-parallel biases, MoE router and shared
                                                               expert gate: config's value
    allreduce                                                  linear weights and biases (the replicated
                                                               down-projections of MLA too, as megatron-core's
                                                               duplicated linears): True; expert weights:
                                                               False when ep > 1 (megatron-core's
                                                               ``not (is_expert and expert_parallel)``)
    shared / shared_embedding                                  tied across stages: the first stage's embedding is
                                                               ``shared_embedding``; the last stage's head copy
                                                               ``shared`` and ``shared_embedding``

Loader, saver, export stream, ``finalize_grads`` and grad-norm clipping read the :class:`Placement`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sharding import ExpertStack, TPLayout, make_layout

# megatron-core's defaults for a parameter that is not split over TP (_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS).
_MEGATRON_TP_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


@dataclass(frozen=True)
class Placement:
    """One parameter's place in the parallel model.

    ``layout``: its TP layout kind (how HF tensors map onto each TP rank's shard).
    ``tp_sum``: its gradient on each TP rank is a partial sum (a TP-replicated parameter fed only part of the
    work: norms / value head / row-parallel biases under sequence parallelism, per-head q/k norms always);
    ``finalize_grads`` sums it over the TP group.
    ``tied``: ``"embedding"`` for the first stage's embedding and ``"copy"`` for the last stage's head copy when
    embeddings are tied across pipeline stages (gradients summed over the embedding group; the copy is neither
    saved nor counted in norms); None otherwise.
    ``expert``: for the stacked weight of a layer's routed experts, the global indices of the experts it holds
    along dim 0 (a ``range``: expert-parallel rank ``ep_rank`` holds ``[ep_rank * E / ep, (ep_rank + 1) * E /
    ep)``; ``layout`` is then an :class:`~parallm.model.sharding.ExpertStack` whose per-expert split is a dense
    MLP's); None for everything dense (router and shared expert included). Expert gradients are averaged over the
    expert-data-parallel group, dense ones over the data-parallel group; each expert is held by exactly one rank
    of every expert-parallel group.
    """
    layout: TPLayout
    tp_sum: bool = False
    tied: str | None = None
    expert: range | None = None

    @property
    def tensor_parallel(self) -> bool:
        return self.layout.tp_dim is not None


def placement_of(param: torch.Tensor) -> Placement:
    p = getattr(param, "parallm_placement", None)
    if p is None:
        raise RuntimeError("parameter has no parallm placement (was the model built by parallm.build_model?)")
    return p


def place(param: torch.Tensor, placement: Placement, *, module_kind: str, sequence_parallel: bool,
          expert_parallel: bool) -> None:
    """Attach ``placement`` and the attributes megatron-core sets on the same parameter. ``module_kind``: what
    owns it: ``"linear"`` (a megatron Column/RowParallelLinear weight or column bias), ``"row_bias"`` (a
    RowParallelLinear bias), ``"norm"`` (an RMSNorm weight), ``"replicated"`` (a TP-replicated weight that
    megatron-core marks ``sequence_parallel`` like a norm: the MoE router and the shared expert's gate),
    ``"replicated_linear"`` (a linear replicated over TP: megatron-core's duplicated linear, marked
    ``sequence_parallel`` and ``allreduce``: MLA's down-projections), ``"embedding"`` or ``"other"``. ``expert_parallel``: ep > 1 (expert weights are then not all-reduced over
    data parallelism: megatron-core's ``allreduce=False``)."""
    param.parallm_placement = placement
    if placement.tensor_parallel:
        param.tensor_model_parallel = True
        param.partition_dim = placement.layout.tp_dim
        param.partition_stride = placement.layout.stride
    else:
        for name, value in _MEGATRON_TP_DEFAULTS.items():
            setattr(param, name, value)
    if module_kind in ("norm", "row_bias", "replicated", "replicated_linear") or (placement.tp_sum
                                                                                  and module_kind == "other"):
        param.sequence_parallel = sequence_parallel
    if module_kind in ("linear", "row_bias", "replicated_linear"):
        param.allreduce = True
    if placement.expert is not None:
        param.allreduce = not expert_parallel
    if placement.tied == "embedding":
        param.shared_embedding = True
    elif placement.tied == "copy":
        param.shared = True
        param.shared_embedding = True


def _module_kinds(chunk) -> dict[str, str]:
    from megatron.core import tensor_parallel as mtp
    kinds = {}
    for mname, module in chunk.named_modules():
        prefix = f"{mname}." if mname else ""
        for pname, _ in module.named_parameters(recurse=False):
            if getattr(module, "parallm_param_kind", None):   # e.g. the MoE router: set by the module
                kind = module.parallm_param_kind
            elif isinstance(module, mtp.RowParallelLinear) and pname == "bias":
                kind = "row_bias"
            elif isinstance(module, (mtp.ColumnParallelLinear, mtp.RowParallelLinear)):
                kind = "linear"
            elif isinstance(module, mtp.VocabParallelEmbedding):
                kind = "embedding"
            elif type(module).__name__.endswith("RMSNorm"):
                kind = "norm"
            else:
                kind = "other"
            kinds[prefix + pname] = kind
    return kinds


def attach_placements(chunk, entries, *, pp: int) -> None:
    """Give every parameter of ``chunk`` its placement from the table ``entries`` that apply to the chunk. A
    parameter without a row, or a row without a parameter, is an internal error naming them (the table must
    cover the model exactly). The entries of one stacked expert parameter (one per expert it holds, ``index``
    0, 1, ... in order) make one placement."""
    spec = chunk.spec
    sp = chunk.sequence_parallel
    params = dict(chunk.named_parameters())
    rows = {e.local: e.row for e in entries}
    stacked: dict[str, list] = {}
    for e in entries:
        if e.index is not None:
            stacked.setdefault(e.local, []).append(e)
    missing = sorted(set(params) - set(rows))
    extra = sorted(set(rows) - set(params))
    if missing or extra:
        raise RuntimeError(f"internal error: the {spec.family} weight table does not match the model: parameters "
                           f"without a row {missing}, rows without a parameter {extra}")
    kinds = _module_kinds(chunk)
    tied_across = spec.tie_word_embeddings and chunk.task == "causal_lm" and pp > 1
    for name, param in params.items():
        row = rows[name]
        tied = row.tied if tied_across else None
        layout, experts = make_layout(row.kind, spec, chunk.padded_vocab_size), None
        if name in stacked:
            held = stacked[name]
            experts = range(held[0].row.expert, held[-1].row.expert + 1)
            if [e.index for e in held] != list(range(len(held))) or [e.row.expert for e in held] != list(experts):
                raise RuntimeError(f"internal error: {name} stacks experts {[e.row.expert for e in held]} at "
                                   f"{[e.index for e in held]}")
            if param.shape[0] != len(held):
                raise RuntimeError(f"internal error: {name} {tuple(param.shape)} stacks {len(held)} experts")
            layout = ExpertStack(layout, len(held))
        placement = Placement(layout=layout, tp_sum=row.tp_sum == "always" or (row.tp_sum == "sp" and sp),
                              tied=tied, expert=experts)
        place(param, placement, module_kind=kinds[name], sequence_parallel=sp, expert_parallel=chunk.dims.ep > 1)
