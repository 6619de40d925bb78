"""Which layers each pipeline stage owns (Megatron's interleaving), decided here alone: the decoder builds its
chunks from it, the layout answers "who owns layer i" with it, the loader and ``inspect`` plan with it."""

from __future__ import annotations


def layer_numbers(num_layers: int, pp: int, vpp: int, pp_rank: int, vpp_rank: int) -> range:
    """Global indices of the layers owned by virtual stage ``vpp_rank`` of pipeline rank ``pp_rank``.

    Megatron's interleaving: ``offset = vpp_rank * (L / vpp) + pp_rank * (L / pp / vpp)``, each chunk holding
    ``L / (pp * vpp)`` consecutive layers.
    """
    stages = pp * vpp
    if num_layers % stages:
        raise ValueError(f"{num_layers} layers do not split into pp={pp} x vpp={vpp} = {stages} equal stages")
    per = num_layers // stages
    offset = vpp_rank * (num_layers // vpp) + pp_rank * per
    return range(offset, offset + per)


def layer_owner(num_layers: int, pp: int, vpp: int, layer: int) -> tuple[int, int]:
    """(pp_rank, vpp_rank) owning global ``layer``: the inverse of :func:`layer_numbers` (chunk ``k = layer //
    per`` of the interleaved order is virtual stage ``k // pp`` of pipeline rank ``k % pp``)."""
    per = num_layers // (pp * vpp)
    chunk = layer // per
    return chunk % pp, chunk // pp
