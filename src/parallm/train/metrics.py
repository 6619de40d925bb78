"""Metrics a ``loss_fn`` returns beside its loss, reduced over microbatches and data-parallel replicas.

``loss_fn`` may return ``(loss, metrics)`` or ``((loss_sum, num_tokens), metrics)``, ``metrics`` a dict of scalar
tensors (or numbers). Each key is reduced as ``metric_reduce`` says (default ``"mean"``):

* ``"mean"``: weighted by each microbatch's ``num_tokens`` for a token-mean loss (``sum_m n_m v_m / sum_m n_m``
  over every microbatch of every replica: the metric's token mean when ``v_m`` is a mean over m's tokens), by 1
  for a scalar loss (the mean over microbatches and replicas);
* ``"sum"``, ``"max"``, ``"min"``: over every microbatch of every replica.

Empty microbatches (``loss_fn`` is not called on them) add nothing. On the last pipeline stage
:class:`MetricAccumulator` folds the microbatches into a few numbers per key; ``forward_backward`` ships them
with its loss statistics (a second pipeline broadcast, one or two more data-parallel all-reduces, only when
there are metrics) and :func:`finish` turns the global sums into the values returned on every rank. The key
names travel as bytes inside the same tensors (every replica with metrics must use the same names and
reductions, checked exactly), so a replica whose microbatches were all empty returns them too.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch

REDUCTIONS = ("mean", "sum", "max", "min")


def check_reductions(metric_reduce) -> dict[str, str]:
    if metric_reduce is None:
        return {}
    if not isinstance(metric_reduce, Mapping):
        raise TypeError(f"metric_reduce must be a dict {{name: one of {REDUCTIONS}}}, got "
                        f"{type(metric_reduce).__name__}")
    bad = {k: v for k, v in metric_reduce.items() if v not in REDUCTIONS}
    if bad:
        raise ValueError(f"metric_reduce: {bad} (each reduction must be one of {REDUCTIONS})")
    return dict(metric_reduce)


def scalar_value(name: str, value):
    """A metric's value: a tensor stays a detached fp64 0-dim tensor on its device (read once per call, after the
    schedule: no host sync per microbatch), a number a float."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"loss_fn's metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.detach().double().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"loss_fn's metric {name!r} must be a scalar tensor or a number, got {type(value).__name__}")


class MetricAccumulator:
    """One call's metrics on a last-stage rank: per key ``(a, b)`` = ``(sum w v, sum w)`` for ``"mean"``,
    ``(sum v, 0)`` for ``"sum"``, ``(max v, 0)`` / ``(-min v, 0)`` for ``"max"`` / ``"min"``."""

    def __init__(self, reductions: dict[str, str]):
        self.reductions = reductions
        self.given: bool | None = None      # whether loss_fn returns metrics (None: not called yet)
        self.names: list[str] = []
        self.parts: dict[str, list[float]] = {}

    def add(self, metrics: Mapping | None, weight: float) -> None:
        """A microbatch's metrics (None: it returned none), weighted by ``weight`` for means. Every microbatch of
        a call returns the same names (else ValueError)."""
        names = None if metrics is None else [str(n) for n in metrics]
        if self.given is None:
            self.given, self.names = names is not None, names or []
            for n in self.names:
                how = self.reductions.get(n, "mean")
                self.parts[n] = [0.0, 0.0] if how in ("mean", "sum") else [-math.inf, 0.0]
        if (names is not None) != self.given or (names or []) != self.names:
            raise ValueError(f"loss_fn returned metrics {names} for one microbatch and "
                             f"{self.names if self.given else None} for another; return the same names every time")
        for n in self.names:
            v, part, how = scalar_value(n, metrics[n]), self.parts[n], self.reductions.get(n, "mean")
            if how == "mean":
                part[0] += weight * v
                part[1] += weight
            elif how == "sum":
                part[0] += v
            else:
                part[0] = _larger(part[0], v if how == "max" else -v)

    def spec(self) -> bytes:
        """The names and reductions, as bytes (what every replica must share); empty when loss_fn returned no
        metrics (``b"M"`` for an empty dict)."""
        if not self.given:
            return b""
        return ("M" + "\n".join(f"{n}\t{self.reductions.get(n, 'mean')}" for n in self.names)).encode()


def _larger(a, b):
    """max of two floats or 0-dim tensors, without reading a tensor on the host."""
    if not (torch.is_tensor(a) or torch.is_tensor(b)):
        return max(a, b)
    like = a if torch.is_tensor(a) else b
    return torch.maximum(torch.as_tensor(a, dtype=torch.float64, device=like.device),
                         torch.as_tensor(b, dtype=torch.float64, device=like.device))


def spec_hash(spec: bytes) -> int:
    """A 20-bit fingerprint + 1 of a spec (0: no metrics), small enough that sums of its squares over thousands
    of replicas stay exact in float64."""
    return 0 if not spec else (zlib.crc32(spec) & 0xFFFFF) + 1


def local_vector(acc: MetricAccumulator | None) -> tuple[list, list]:
    """``(sums, maxima)`` to reduce over data-parallel replicas: ``sums`` = each key's ``(a, b)`` for the
    summed reductions then the spec's bytes; ``maxima`` = each max / min key's value (floats or 0-dim tensors:
    :func:`as_vector` puts them in one tensor on the device)."""
    if acc is None or not acc.given:
        return [], []
    sums, maxima = [], []
    for n in acc.names:
        how = acc.reductions.get(n, "mean")
        if how in ("mean", "sum"):
            sums += acc.parts[n]
        else:
            maxima.append(acc.parts[n][0])
    return sums + list(acc.spec()), maxima


def as_vector(values: list, device) -> torch.Tensor:
    """Floats and 0-dim tensors -> one fp64 tensor on ``device`` (no host read of the tensors)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device) for v in values])


def layout_of(spec: bytes) -> tuple[list[tuple[str, str]], int, int]:
    """``(keys with their reductions, length of sums, length of maxima)`` for a spec."""
    text = spec.decode()[1:] if spec else ""
    keys = [tuple(line.split("\t")) for line in text.split("\n")] if text else []
    n_sum = sum(2 for _, how in keys if how in ("mean", "sum"))
    return keys, n_sum, len(keys) - n_sum // 2


def finish(sums: torch.Tensor, maxima: torch.Tensor, replicas_with_metrics: int, spec_length: int, device
           ) -> dict[str, torch.Tensor]:
    """The reduced ``sums`` (their bytes part summed over ``replicas_with_metrics`` identical specs) and
    ``maxima`` -> ``{name: fp32 scalar tensor on device}``."""
    raw = sums[len(sums) - spec_length:] / max(replicas_with_metrics, 1)
    spec = bytes(int(round(float(x))) for x in raw)
    keys, _, _ = layout_of(spec)
    out, i, j = {}, 0, 0
    for name, how in keys:
        if how in ("mean", "sum"):
            a, b = float(sums[i]), float(sums[i + 1])
            i += 2
            value = (a / b if b else 0.0) if how == "mean" else a
        else:
            value = float(maxima[j]) if how == "max" else -float(maxima[j])
            j += 1
        out[name] = torch.tensor(value, dtype=torch.float32, device=device)
    return out
