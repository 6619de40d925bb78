"""Tinker datums -> parallm batches, and the ``loss_fn`` that computes Tinker's losses on parallm's outputs.

A datum is a model input ``x`` of N tokens and ``loss_fn_inputs`` with one row per input position; row t's
``target_tokens[t]`` is the token the model predicts after reading ``x[:t + 1]``.

- **Next-token targets** (``target_tokens[t] == x[t + 1]`` for t < N - 1, what every SDK helper and the cookbook
  build): the row's ``input_ids`` are ``x`` followed by the last target (N + 1 tokens), and the target log-probs
  are ``forward(output="logprobs")[:, :N]``: parallm's vocab-parallel log-probs, no rank holds ``[N, V]``. The
  appended token changes nothing before it (causal attention).
- **Any other targets** (a target that is not the next input token, or ``[N, K]`` targets for a distribution):
  ``output=None`` logits ``[N, V]`` (gathered over tensor parallelism), ``log_softmax``, gather. Exact, but holds
  the vocabulary per token: a fallback.

Rows are right-padded to the batch's longest; the data-parallel replicas take rows ``d, d + dp, ...``, padded to
the same count (a multiple of the microbatch count) with one-token rows that contribute exactly zero. The
per-row losses are Tinker's sums; ``loss_fn`` returns their sum times ``microbatches * dp``, so that after
``forward_backward``'s mean over microbatches and ``finalize_grads``' mean over replicas the gradient is the
gradient of the plain sum over every datum (Tinker's objective), accumulated across calls until the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .losses import datum_loss

__all__ = ["Packed", "column_dtype", "make_loss_fn", "outputs_of", "pack"]


@dataclasses.dataclass
class Packed:
    batch: dict               # the parallm batch of this data-parallel replica (CPU tensors)
    next_token: bool          # the fast path (output="logprobs") or the logits fallback
    microbatches: int
    inputs: list              # the input names carried per token


def _is_next_token(data) -> bool:
    for d in data:
        y = np.asarray(d.inputs["target_tokens"])
        if y.ndim != 1 or len(d.tokens) == 0 or not np.array_equal(y[:-1], d.tokens[1:]):
            return False
    return True


def pack(data, *, dp: int, dp_rank: int, pp: int, max_rows: int | None = None) -> Packed:
    """This replica's batch of ``data`` (checked datums, :class:`protocol.Datum`)."""
    next_token = _is_next_token(data)
    mine = list(range(dp_rank, len(data), dp))
    rows = -(-len(data) // dp)                                  # every replica the same count
    micro = 1 if pp == 1 else max(1, min(rows, 2 * pp))
    if max_rows:
        micro = max(micro, -(-rows // max_rows))
    rows = max(micro, -(-rows // micro) * micro)
    length = max(len(d.tokens) for d in data) + (1 if next_token else 0)
    names = sorted({k for d in data for k in d.inputs})
    ids = torch.zeros(rows, length, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.long)
    n = torch.ones(rows, dtype=torch.long)
    row = torch.full((rows,), -1, dtype=torch.long)
    per_token, present = {}, {}
    for k in names:
        sample = next(np.asarray(d.inputs[k]) for d in data if k in d.inputs)
        shape = (rows, length) + tuple(sample.shape[1:])
        per_token[k] = torch.zeros(shape, dtype=column_dtype(k))
        present[k] = torch.zeros(rows, dtype=torch.bool)
    mask[:, 0] = 1                                               # padding rows: one token, zero contribution
    for r, i in enumerate(mine):
        d = data[i]
        x = torch.as_tensor(d.tokens, dtype=torch.long)
        tokens = torch.cat([x, torch.as_tensor(d.inputs["target_tokens"][-1:], dtype=torch.long)]) \
            if next_token else x
        ids[r, :len(tokens)] = tokens
        mask[r, :len(tokens)] = 1
        n[r], row[r] = len(x), i
        for k, v in d.inputs.items():
            per_token[k][r, :len(x)] = torch.as_tensor(np.asarray(v)).to(per_token[k].dtype)
            present[k][r] = True
    batch = {"input_ids": ids, "attention_mask": mask, "tinker_row": row, "tinker_len": n}
    batch.update({f"in_{k}": v for k, v in per_token.items()})
    batch.update({f"has_{k}": v for k, v in present.items()})
    return Packed(batch, next_token, micro, names)


def target_logprobs(out: torch.Tensor, mb: dict, r: int, *, next_token: bool) -> torch.Tensor:
    """Row r's target log-probs ``[n]`` (``[n, K]``) from the model output of its microbatch."""
    n = int(mb["tinker_len"][r])
    if next_token:
        return out[r, :n]
    targets = mb["in_target_tokens"][r, :n].to(out.device)
    x = out[r, :n]
    logp = torch.log_softmax(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x, dim=-1)
    if targets.dim() == 1:
        return logp.gather(-1, targets[:, None]).squeeze(-1)
    return logp.gather(-1, targets)


def column_dtype(name: str) -> torch.dtype:
    """A per-token input's column type, whatever dtype its senders used: ``target_tokens`` int64 (a float
    ``target_tokens`` is refused by :func:`.losses.check_inputs`, never cast), every other input float32 (an int
    ``weights`` array in one datum must not truncate another datum's float weights)."""
    return torch.long if name == "target_tokens" else torch.float32


def row_inputs(mb: dict, r: int, names, device) -> dict:
    """Row r's loss inputs: only those its own datum carried (``has_<name>``), so an optional input that other
    datums of the request carry (per-token clip thresholds) never reaches this row as zeros: it falls back to
    ``loss_fn_config`` or the default as when sent alone."""
    n = int(mb["tinker_len"][r])
    return {k: mb[f"in_{k}"][r, :n].to(device) for k in names
            if k != "target_tokens" and bool(mb[f"has_{k}"][r])} | \
        {"target_tokens": mb["in_target_tokens"][r, :n].to(device)}


def make_loss_fn(packed: Packed, *, loss_fn: str, config: dict, dp: int, captured: list):
    """The ``loss_fn(out, mb)`` of ``forward_backward``: Tinker's per-datum losses, summed, scaled by
    ``microbatches * dp`` (module docstring). Appends ``(datum index, target log-probs, loss)`` per real row to
    ``captured`` (on the ranks that run it: the last pipeline stage)."""
    scale = float(packed.microbatches * dp)

    def fn(out, mb):
        total = out.sum() * 0.0                      # keeps the graph when a microbatch holds padding rows only
        for r in range(mb["input_ids"].shape[0]):
            i = int(mb["tinker_row"][r])
            if i < 0:
                continue
            tl = target_logprobs(out, mb, r, next_token=packed.next_token)
            loss = datum_loss(loss_fn, config, tl, row_inputs(mb, r, packed.inputs, tl.device))
            captured.append((i, tl.detach().float().cpu(), float(loss.detach())))
            total = total + loss
        return total * scale

    return fn


def outputs_of(out: torch.Tensor, packed: Packed, *, loss_fn: str, config: dict, captured: list) -> None:
    """The forward-only counterpart: per-row target log-probs and losses of a whole replica's output."""
    mb = packed.batch
    for r in range(mb["input_ids"].shape[0]):
        i = int(mb["tinker_row"][r])
        if i < 0:
            continue
        tl = target_logprobs(out, mb, r, next_token=packed.next_token)
        loss = datum_loss(loss_fn, config, tl, row_inputs(mb, r, packed.inputs, tl.device))
        captured.append((i, tl.detach().float().cpu(), float(loss.detach())))
