"""The ranks of one model replica must pass the same batch, checked on every forward / forward_backward call.

The tensor-, context- and pipeline-parallel ranks of one replica (the ``tp x cp x pp`` ranks of one
data-parallel rank) compute one model on one batch: each TP rank its heads and vocabulary rows, each CP rank its
share of every sequence, each pipeline stage its layers. Ranks that pass different batches (data sharded by global
rank instead of by data-parallel rank) would compute a mixture of those batches without an error, or wait for
each other forever. So every call compares a fingerprint of the batch (and of the call's arguments that shape the
work) across the ranks of each replica, inside the call's one agreement over the world (:func:`agree_on_batch`,
which replaces :func:`parallm.parallel.errors.agree` there): one all-reduce of ``1 + 2 dp`` int64 on the gloo
control group, with the process-group timeout. A replica is identified by the data-parallel rank
megatron-core's ``parallel_state`` gives every rank (``ParallelDims.dp_rank``); no rank is computed.

What the fingerprint covers (:func:`batch_fingerprint`): the batch's shape; every value of ``input_ids``,
``attention_mask`` and ``position_ids`` (defaulted ones included); with ``extras`` (the other tensors of a batch
mapping, which ``forward_backward`` hands to ``loss_fn``) every entry's name, shape, dtype and bits; plus the
integers the caller adds (microbatch count, output kind, temperature, token chunk, token budget, router
replay's experts). Each tensor enters as the int64 sum of its values (bits for floating point) times fixed odd
weights, so a single changed element always changes that sum; the sums are then folded into one 61-bit number
per rank, so two different batches pass unnoticed only by a fold collision (probability about 2^-61). Not
covered: the ``loss_fn`` itself, ``metric_reduce``, and tensors outside the batch (a closure's data).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .errors import _agreement_group, _lost_peer, remote_error, status_of

_MOD = (1 << 61) - 1          # a Mersenne prime: the fold's modulus
_UNFILLED = -(1 << 62)        # a slot no rank of the world filled (or a failed rank's own slot): loses every MAX

HINT = ("shard data by chunks[0].dims.dp_rank (of chunks[0].dims.dp), not by global rank: every tensor-, "
        "context- and pipeline-parallel rank of a replica passes the replica's whole batch")


CHUNK = 1 << 22           # elements summed at a time (bounds the int64 temporaries of a large batch entry)


def _weights(start: int, n: int, device) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.long, device=device).mul_(2654435761).add_(40503).remainder_(
        1 << 31).mul_(2).add_(1)


def _weighted_sum(t: torch.Tensor) -> torch.Tensor:
    """:func:`weighted_sum` as a 0-d int64 tensor on ``t``'s device (the sum wraps modulo 2^64), read by the
    caller together with the others: one device-to-host copy per call, not one per tensor."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        t = t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.long, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK].long()
        total += (part * _weights(start, part.numel(), part.device)).sum()
    return total


def weighted_sum(t: torch.Tensor) -> int:
    """The sum, modulo 2^64, of ``t``'s values (floating point: its bits) times fixed odd weights: any single
    changed element changes it. Computed on ``t``'s device in slices of :data:`CHUNK` elements."""
    return int(_weighted_sum(t)) % (1 << 64)


def _read(sums: list[torch.Tensor]) -> list[int]:
    """0-d int64 tensors (on any devices) as ints modulo 2^64, in one copy per device."""
    if not sums:
        return []
    return [v % (1 << 64) for v in torch.stack([s.to(sums[0].device) for s in sums]).tolist()]


def extras_checksum(extras: dict | None) -> int:
    """One number for a batch mapping's other entries: each entry's name, dtype, shape and values, in name
    order (-1 for the positional form, which has none)."""
    if extras is None:
        return -1
    names = sorted(extras)
    return _combine(names, extras, _read([_weighted_sum(extras[n]) for n in names]))


def _combine(names, extras, sums: list[int]) -> int:
    total = 0
    for name, value in zip(names, sums):
        t = extras[name]
        head = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        total = (total * 1000003 + head * 7919 + value) % (1 << 64)
    return total


# what each position of batch_fingerprint's list stands for, in error messages
PARTS = ("batch size", "sequence length", "input_ids", "position_ids", "attention_mask", "other batch entries")


def batch_fingerprint(input_ids, position_ids, attention_mask, *, extras=None, settings=()) -> list[int]:
    """A few integers that differ when two batches differ (see the module docstring): ``[B, S, ids, positions,
    mask, extras]`` followed by ``settings`` (the caller's further integers, named in
    :func:`agree_on_batch`'s ``setting_names``). One device-to-host copy for all the sums."""
    names = sorted(extras) if extras is not None else []
    sums = _read([_weighted_sum(t) for t in (input_ids, position_ids, attention_mask)]
                 + [_weighted_sum(extras[n]) for n in names])
    out = [int(input_ids.shape[0]), int(input_ids.shape[1])] + sums[:3]
    out.append(_combine(names, extras, sums[3:]) if extras is not None else -1)
    return out + [int(s) for s in settings]


def fold(parts: list[int]) -> int:
    """``parts`` as one number in ``[0, 2^61 - 1)``."""
    h = len(parts)
    for v in parts:
        h = (h * 1099511628211 + (v % (1 << 64))) % _MOD
    return h


def agree_on_batch(error: BaseException | None, fingerprint: list[int] | None, layout, *, what: str,
                   setting_names=()) -> None:
    """The call's one agreement over the world (collective, every rank): raises on every rank when any rank
    passed an ``error`` (its own exception there, the others :func:`parallm.parallel.errors.remote_error` naming
    it), or when two ranks of one model replica passed different fingerprints (a ValueError naming the ranks
    and what differs, :data:`HINT`). ``fingerprint``: :func:`batch_fingerprint` (None: nothing to compare, as on
    a rank whose own check failed, or a replica of one rank). ``layout``: the chunks' ParallelDims.

    Costs one MAX all-reduce of ``1 + 2 dp`` int64 on the gloo control group when nothing is wrong: ``[failed,
    (h, -h) per data-parallel rank]``, each rank filling its replica's slot with its folded fingerprint ``h``;
    a slot whose maximum of ``h`` and of ``-h`` disagree holds two fingerprints. Only then (or on an error) are
    the details exchanged (one ``all_gather_object``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    group = _agreement_group(None)
    vec = torch.full((1 + 2 * layout.dp,), _UNFILLED, dtype=torch.long)
    vec[0] = int(error is not None)
    if error is None and fingerprint is not None:
        h = fold(fingerprint)
        vec[1 + 2 * layout.dp_rank], vec[2 + 2 * layout.dp_rank] = h, -h
    try:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        slots = vec[1:].view(-1, 2)
        filled = slots[:, 0] != _UNFILLED
        mismatch = bool((filled & (slots[:, 0] != -slots[:, 1])).any())
        if not vec[0].item() and not mismatch:
            return
        rows = [None] * dist.get_world_size(group)
        mine = (status_of(error), layout.dp_rank, None if error is not None else fingerprint)
        dist.all_gather_object(rows, mine, group=group)
    except Exception as comm_error:  # noqa: BLE001 - a lost peer
        _lost_peer(comm_error, error, what)
    if error is not None:
        raise error
    failed = [(r, s) for r, (s, _, _) in enumerate(rows) if s is not None]
    if failed:
        raise remote_error(what, failed, group)
    raise _differing(rows, layout, what, list(PARTS) + list(setting_names))


def _differing(rows, layout, what: str, names: list[str]) -> ValueError:
    """The error for the first replica (by data-parallel rank) whose ranks' fingerprints differ; ``rows``:
    ``(status, dp rank, fingerprint)`` per global rank of the world (the control group is the world in rank
    order)."""
    replicas: dict[int, list[int]] = {}
    for r, (_, dp_rank, fp) in enumerate(rows):
        if fp is not None:
            replicas.setdefault(dp_rank, []).append(r)
    for dp_rank in sorted(replicas):
        ranks = replicas[dp_rank]
        first = rows[ranks[0]][2]
        bad = [r for r in ranks[1:] if rows[r][2] != first]
        if not bad:
            continue
        other = rows[bad[0]][2]
        parts = [names[i] if i < len(names) else f"part {i}" for i, (a, b) in enumerate(zip(first, other))
                 if a != b] or ["the fingerprint's length"]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        return ValueError(
            f"{what}: every rank of one model replica (its tensor-parallel, context-parallel and pipeline-parallel "
            f"ranks: tp={layout.tp} x cp={layout.cp} x pp={layout.pp}, here the ranks of data-parallel rank "
            f"{dp_rank}: {ranks}) must pass the same batch and arguments; rank {bad[0]}'s differs from rank "
            f"{ranks[0]}'s{more} in: {', '.join(parts)}; {HINT}")
    return ValueError(f"{what}: the batch fingerprints of one model replica disagree, but no two ranks' details "
                      f"differ (a fingerprint fold that is not deterministic?); {HINT}")


__all__ = ["HINT", "agree_on_batch", "batch_fingerprint", "extras_checksum", "fold", "weighted_sum"]
