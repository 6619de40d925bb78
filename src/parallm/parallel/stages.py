"""Which layers each pipeline stage owns (Megatron's interleaving), decided here alone: the decoder builds its
chunks from it, the layout answers "who owns layer i" with it, the loader and ``inspect`` plan with it.

Virtual stages are numbered in Megatron's global order ``k = vpp_rank * pp + pp_rank``, and stage ``k`` holds
the ``sizes[k]`` layers after those of stages ``0 .. k-1``. The sizes come from one of three splits:

* even (the default): ``L / (pp * vpp)`` layers per virtual stage;
* Megatron's uneven split, ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
  (either or both, ``pp >= 2``): the first (last) pipeline rank holds that many layers, the ranks between
  share the rest equally; with virtual stages each pipeline rank's layers are split equally over its ``vpp``
  chunks (megatron-core's ``get_num_layers_to_build`` / ``get_transformer_layer_offset``, and its
  ``TransformerConfig`` checks: the first / last counts and each middle rank's count divisible by ``vpp``);
* an explicit ``layers_per_stage``: one count per virtual stage in the order above (``pp * vpp`` of them), as
  megatron-core's ``pipeline_model_parallel_layout`` lists its stages; every stage holds at least one layer.
  :func:`balanced_sizes` computes one from per-layer costs (``build_model(layers_per_stage="balanced")``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate


def _balanced(num_layers: int, stages: int) -> list[int]:
    """``stages`` counts adding up to ``num_layers``, differing by at most one, the larger ones last."""
    base, extra = divmod(num_layers, stages)
    return [base] * (stages - extra) + [base + 1] * extra


def balanced_sizes(layer_costs: Sequence[int], head_cost: int, stages: int) -> tuple[int, ...]:
    """Layers per virtual stage (global order, consecutive, at least one each) that make the dearest stage as
    cheap as it can be, the last stage paying ``head_cost`` on top of its layers: the split that lets a pipeline
    run fastest when a stage costs the sum of its layers' ``layer_costs``. Ties go to the split whose stage costs
    have the smallest sum of squares (the most even), then to fewer layers on later stages. Exact (dynamic
    programming over integer costs, O(stages x layers^2)); a ValueError when there are fewer layers than
    stages."""
    costs, n = [int(c) for c in layer_costs], len(layer_costs)
    if stages < 1 or n < stages:
        raise ValueError(f"{n} layers do not split into {stages} stages of at least one layer each")
    prefix = [0, *accumulate(costs)]

    def cost(j: int, i: int, k: int) -> int:           # stage k holding layers j .. i-1
        return prefix[i] - prefix[j] + (head_cost if k == stages - 1 else 0)

    def search(key, bound=None):
        """best[k][i]: the least ``key`` total of layers 0 .. i-1 in stages 0 .. k (``key`` combines a stage's
        cost into the total: max for the dearest stage, + square for the sum of squares; stages dearer than
        ``bound`` not allowed), and where stage k starts; the latest start wins a tie."""
        best = [{i: key(None, cost(0, i, 0)) for i in range(1, n - stages + 2)
                 if bound is None or cost(0, i, 0) <= bound}]
        back = [{}]
        for k in range(1, stages):
            row, starts = {}, {}
            for i in ((n,) if k == stages - 1 else range(k + 1, n - stages + k + 2)):
                for j in range(i - 1, k - 1, -1):
                    c = cost(j, i, k)
                    if j not in best[k - 1] or bound is not None and c > bound:
                        continue
                    total = key(best[k - 1][j], c)
                    if i not in row or total < row[i]:
                        row[i], starts[i] = total, j
            best.append(row)
            back.append(starts)
        return best, back

    # the dearest stage as cheap as it can be, then, among the splits reaching it, the most even
    best, _ = search(lambda total, c: c if total is None else max(total, c))
    best, back = search(lambda total, c: c * c + (total or 0), bound=best[-1][n])
    sizes, i = [], n
    for k in range(stages - 1, 0, -1):
        j = back[k][i]
        sizes.append(i - j)
        i = j
    return (i, *reversed(sizes))


def _uneven_hint(num_layers: int, pp: int, vpp: int) -> str:
    stages = pp * vpp
    if num_layers < stages:
        return " (fewer layers than stages: use fewer stages)"
    example = _balanced(num_layers, stages)
    hint = f"; give the split explicitly, e.g. layers_per_stage={example}"
    if vpp == 1 and pp >= 2:
        first = num_layers // pp
        if (num_layers - first) % (pp - 1) == 0:
            hint += f", or num_layers_in_first_pipeline_stage={first}"
        last = num_layers - (num_layers // pp) * (pp - 1)
        hint += f", or num_layers_in_last_pipeline_stage={last}"
    return hint


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def stage_sizes(num_layers: int, pp: int, vpp: int = 1, *, num_layers_in_first_pipeline_stage: int | None = None,
                num_layers_in_last_pipeline_stage: int | None = None,
                layers_per_stage: Sequence[int] | None = None) -> tuple[int, ...]:
    """The number of layers of each virtual stage ``k = vpp_rank * pp + pp_rank`` (``pp * vpp`` counts adding up
    to ``num_layers``); see the module docstring for the three splits. An impossible split is a ValueError naming
    the numbers (and, for an even split that does not divide, how to give an uneven one)."""
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    stages = pp * vpp
    if layers_per_stage is not None:
        if first is not None or last is not None:
            raise ValueError("give either layers_per_stage or num_layers_in_first/last_pipeline_stage, not both")
        sizes = list(layers_per_stage)
        if len(sizes) != stages:
            raise ValueError(f"layers_per_stage has {len(sizes)} entries; pp={pp} x vpp={vpp} needs {stages} (one "
                             f"per virtual stage, in the order vpp_rank * pp + pp_rank)")
        bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n <= 0]
        if bad:
            raise ValueError(f"layers_per_stage={list(layers_per_stage)}: every stage needs a positive whole number "
                             f"of layers (got {bad})")
        if sum(sizes) != num_layers:
            raise ValueError(f"layers_per_stage={sizes} adds up to {sum(sizes)} layers; the model has {num_layers}")
        return tuple(sizes)
    if first is None and last is None:
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers do not split into pp={pp} x vpp={vpp} = {stages} equal stages"
                             + _uneven_hint(num_layers, pp, vpp))
        return (num_layers // stages,) * stages

    # Megatron's uneven split (its TransformerConfig checks, then get_num_layers_to_build's counts).
    given = {k: v for k, v in (("num_layers_in_first_pipeline_stage", first),
                               ("num_layers_in_last_pipeline_stage", last)) if v is not None}
    for name, value in given.items():
        _check_count(name, value)
        if value % vpp:
            raise ValueError(f"{name}={value} is not divisible by vpp={vpp} (each of the stage's {vpp} virtual "
                             "stages holds the same number of layers)")
    if pp < 2:
        raise ValueError(f"an uneven pipeline split ({', '.join(f'{k}={v}' for k, v in given.items())}) needs "
                         f"pp >= 2, got pp={pp}")
    middle_ranks = pp - len(given)
    middle = num_layers - sum(given.values())
    described = " + ".join(f"{v} ({k.split('_')[3]})" for k, v in given.items())
    if middle_ranks == 0:
        if middle:
            raise ValueError(f"{num_layers} layers at pp={pp}: {described} = {sum(given.values())} layers, and "
                             f"there is no middle stage for the other {middle}")
    else:
        if middle <= 0 or middle % middle_ranks or (middle // middle_ranks) % vpp:
            raise ValueError(f"{num_layers} layers at pp={pp} x vpp={vpp}: {described} leaves {middle} layers for "
                             f"{middle_ranks} middle pipeline rank(s), which must each get the same positive number "
                             f"of layers, divisible by vpp={vpp}")
    per_middle = middle // middle_ranks if middle_ranks else 0
    per_rank = [per_middle] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return tuple(per_rank[p] // vpp for _ in range(vpp) for p in range(pp))


def layer_numbers(num_layers: int, pp: int, vpp: int, pp_rank: int, vpp_rank: int, *,
                  num_layers_in_first_pipeline_stage: int | None = None,
                  num_layers_in_last_pipeline_stage: int | None = None,
                  layers_per_stage: Sequence[int] | None = None) -> range:
    """Global indices of the layers owned by virtual stage ``vpp_rank`` of pipeline rank ``pp_rank``.

    Even split (no keyword given): Megatron's interleaving, ``offset = vpp_rank * (L / vpp) + pp_rank * (L / pp /
    vpp)``, each chunk holding ``L / (pp * vpp)`` consecutive layers. The keywords give an uneven split (see
    :func:`stage_sizes`); its layers are consecutive in the virtual-stage order ``vpp_rank * pp + pp_rank``.
    """
    sizes = stage_sizes(num_layers, pp, vpp, num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
                        layers_per_stage=layers_per_stage)
    k = vpp_rank * pp + pp_rank
    offset = sum(sizes[:k])
    return range(offset, offset + sizes[k])


def layer_owner(num_layers: int, pp: int, vpp: int, layer: int, *,
                num_layers_in_first_pipeline_stage: int | None = None,
                num_layers_in_last_pipeline_stage: int | None = None,
                layers_per_stage: Sequence[int] | None = None) -> tuple[int, int]:
    """(pp_rank, vpp_rank) owning global ``layer``: the inverse of :func:`layer_numbers` (virtual stage ``k`` of
    the global order is virtual stage ``k // pp`` of pipeline rank ``k % pp``)."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is not in the model's {num_layers} layers")
    sizes = stage_sizes(num_layers, pp, vpp, num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                        num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
                        layers_per_stage=layers_per_stage)
    k = bisect_right(list(accumulate(sizes)), layer)
    return k % pp, k // pp
