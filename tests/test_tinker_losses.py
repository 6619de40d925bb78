"""Tinker's built-in losses (parallm.integrations.tinker.losses) against a direct reference: each loss's value
from its documented formula, token by token in float64, and its gradient with respect to the target log-probs
from the formula's derivative (not autograd of the same code); the input checks; the packing of datums into
parallm batches (batch.py). No server, no SDK: runs in the main suite."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from parallm.integrations.tinker import batch as tb
from parallm.integrations.tinker import losses as tl_mod
from parallm.integrations.tinker.protocol import Datum

N = 11


def _inputs(seed: int, *, n: int = N, mask=None):
    g = torch.Generator().manual_seed(seed)
    tl = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    lp = tl + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8      # ratios around 0.67..1.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    w = (torch.rand(n, generator=g, dtype=torch.float64) > 0.3).double()
    inputs = {"target_tokens": torch.randint(0, 50, (n,), generator=g), "weights": w, "logprobs": lp,
              "advantages": adv}
    inputs["sequence_ratio_mask"] = torch.tensor(mask if mask is not None else [0] * 3 + [1] * (n - 3)).double()
    return tl, inputs


def _reference(loss_fn, tl, inp, cfg):
    """(value, d value / d tl) by the documented formulas, token by token."""
    lo_d, hi_d = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    lo = inp.get("clip_low_threshold", torch.full_like(tl, lo_d))
    hi = inp.get("clip_high_threshold", torch.full_like(tl, hi_d))
    value, grad = 0.0, []
    if loss_fn == "gspo":
        m = [t for t in range(len(tl)) if inp["sequence_ratio_mask"][t] != 0]
        s = math.exp(sum(float(tl[t] - inp["logprobs"][t]) for t in m) / len(m))
    for t in range(len(tl)):
        x = float(tl[t])
        if loss_fn == "cross_entropy":
            w = float(inp["weights"][t])
            value += -x * w
            grad.append(-w)
            continue
        q, a = float(inp["logprobs"][t]), float(inp["advantages"][t])
        r = s if loss_fn == "gspo" else math.exp(x - q)
        c = min(max(r, float(lo[t])), float(hi[t]))
        if loss_fn == "importance_sampling":
            value += -r * a
            grad.append(-r * a)
        elif loss_fn in ("ppo", "gspo"):
            value += -min(r * a, c * a)
            unclipped = float(lo[t]) <= r <= float(hi[t]) or r * a < c * a
            grad.append(-r * a if unclipped else 0.0)
        elif loss_fn == "cispo":
            value += -c * x * a
            grad.append(-c * a)
        elif loss_fn == "dro":
            beta = cfg["beta"]
            value += -(x * a - 0.5 * beta * (x - q) ** 2)
            grad.append(-(a - beta * (x - q)))
    return value, torch.tensor(grad, dtype=torch.float64)


CASES = [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), ("cispo", {}),
         ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.05}), ("dro", {"beta": 0.3}),
         ("gspo", {}), ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.01})]


@pytest.mark.parametrize("loss_fn,cfg", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_value_and_gradient(loss_fn, cfg, seed):
    tl, inputs = _inputs(seed)
    keep = tl_mod.LOSSES[loss_fn][0] + tl_mod.LOSSES[loss_fn][1]
    inputs = {k: v for k, v in inputs.items() if k in keep}
    config = tl_mod.check_config(loss_fn, cfg)
    tl_mod.check_inputs(loss_fn, config, {k: v.numpy() for k, v in inputs.items()}, length=N, vocab=50, index=0)
    x = tl.clone().requires_grad_(True)
    got = tl_mod.datum_loss(loss_fn, config, x, inputs)
    got.backward()
    want, want_grad = _reference(loss_fn, tl, inputs, config)
    assert abs(float(got.detach()) - want) <= 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-12, atol=1e-12)


def test_per_token_thresholds():
    tl, inputs = _inputs(5)
    g = torch.Generator().manual_seed(9)
    inputs["clip_low_threshold"] = 0.8 + 0.15 * torch.rand(N, generator=g, dtype=torch.float64)
    inputs["clip_high_threshold"] = 1.05 + 0.2 * torch.rand(N, generator=g, dtype=torch.float64)
    for loss_fn in ("ppo", "cispo", "gspo"):
        inp = {k: v for k, v in inputs.items() if k in tl_mod.LOSSES[loss_fn][0] + tl_mod.LOSSES[loss_fn][1]}
        x = tl.clone().requires_grad_(True)
        got = tl_mod.datum_loss(loss_fn, {}, x, inp)
        got.backward()
        want, want_grad = _reference(loss_fn, tl, inp, {})
        assert abs(float(got.detach()) - want) <= 1e-12 * max(1.0, abs(want))
        torch.testing.assert_close(x.grad, want_grad, rtol=1e-12, atol=1e-12)


def test_gspo_ratio_uses_the_masked_tokens_only():
    tl, inputs = _inputs(3, mask=[1, 0] * 5 + [1])
    inputs = {k: v for k, v in inputs.items() if k != "weights"}
    moved = dict(inputs, logprobs=inputs["logprobs"].clone())
    moved["logprobs"][1] += 5.0          # an unmasked token's sampler log-prob changes only its own term
    a = float(tl_mod.datum_loss("gspo", {}, tl, inputs))
    b = float(tl_mod.datum_loss("gspo", {}, tl, moved))
    assert a == b
    moved["logprobs"][0] += 0.01          # a masked one moves the sequence ratio
    assert float(tl_mod.datum_loss("gspo", {}, tl, moved)) != a


BAD = [
    ("cross_entropy", {}, {"target_tokens": np.zeros(N, np.int64)}, "lacks loss_fn_inputs ['weights']"),
    ("cross_entropy", {}, {"target_tokens": np.zeros(N, np.int64), "weights": np.ones(N, np.float32),
                           "mask": np.ones(N, np.float32)}, "does not take"),
    ("cross_entropy", {}, {"target_tokens": np.zeros(N - 1, np.int64), "weights": np.ones(N - 1, np.float32)},
     "has shape (10,), the model input has 11 tokens"),
    ("cross_entropy", {}, {"target_tokens": np.full(N, 50, np.int64), "weights": np.ones(N, np.float32)},
     "target token 50 is outside the vocabulary [0, 50)"),
    ("cross_entropy", {}, {"target_tokens": np.zeros(N, np.int64), "weights": np.full(N, np.nan, np.float32)},
     "non-finite"),
    ("ppo", {"clip_low_threshold": 0.9}, {"target_tokens": np.zeros(N, np.int64), "logprobs": np.zeros(N),
                                          "advantages": np.zeros(N), "clip_low_threshold": np.ones(N)},
     "both per token"),
    ("gspo", {}, {"target_tokens": np.zeros(N, np.int64), "logprobs": np.zeros(N), "advantages": np.zeros(N),
                  "sequence_ratio_mask": np.zeros(N)}, "marks no token"),
]


@pytest.mark.parametrize("loss_fn,cfg,inputs,message", BAD)
def test_bad_inputs_are_named(loss_fn, cfg, inputs, message):
    with pytest.raises(tl_mod.LossInputError, match=re.escape(message)):
        config = tl_mod.check_config(loss_fn, cfg)
        tl_mod.check_inputs(loss_fn, config, inputs, length=N, vocab=50, index=3)


@pytest.mark.parametrize("loss_fn,cfg,message", [
    ("stable_reinforce", {}, "not offered"), ("custom", {"loss_id": 1.0}, "server-side custom losses"),
    ("reinforce", {}, "unknown loss_fn 'reinforce'"), ("dro", {}, "needs loss_fn_config\\['beta'\\]"),
    ("ppo", {"eps": 0.2}, "unknown loss_fn_config key 'eps'"),
    ("ppo", {"clip_low_threshold": 1.3, "clip_high_threshold": 1.1}, "is above"),
    ("cispo", {"clip_low_threshold": "x"}, "must be a finite number")])
def test_bad_configs_are_named(loss_fn, cfg, message):
    with pytest.raises(tl_mod.LossInputError, match=message):
        tl_mod.check_config(loss_fn, cfg)


# -- packing datums into parallm batches -------------------------------------------------------------------------

def _datum(tokens, targets=None, **more):
    tokens = np.asarray(tokens, np.int64)
    y = np.asarray(targets if targets is not None else list(tokens[1:]) + [7], np.int64)
    return Datum(tokens, {"target_tokens": y, "weights": np.ones(len(tokens), np.float32), **more})


def test_pack_next_token_rows_and_replicas():
    data = [_datum([1, 2, 3]), _datum([4, 5]), _datum([6, 7, 8, 9]), _datum([3])]
    for dp_rank, rows in ((0, [0, 2]), (1, [1, 3])):
        p = tb.pack(data, dp=2, dp_rank=dp_rank, pp=1)
        assert p.next_token and p.microbatches == 1
        b = p.batch
        assert b["tinker_row"].tolist() == rows
        for r, i in enumerate(rows):
            n = len(data[i].tokens)
            assert b["input_ids"][r, :n + 1].tolist() == data[i].tokens.tolist() + [int(data[i].inputs["target_tokens"][-1])]
            assert b["attention_mask"][r].tolist() == [1] * (n + 1) + [0] * (b["input_ids"].shape[1] - n - 1)
    p = tb.pack(data[:3], dp=2, dp_rank=1, pp=2)             # fewer rows than the other replica: padded
    assert p.batch["tinker_row"].tolist()[0] == 1 and -1 in p.batch["tinker_row"].tolist()
    assert p.batch["input_ids"].shape[0] % p.microbatches == 0


def test_target_logprobs_both_paths_agree():
    g = torch.Generator().manual_seed(0)
    data = [_datum([5, 9, 2, 4]), _datum([1, 3, 3])]
    p = tb.pack(data, dp=1, dp_rank=0, pp=1)
    logits = torch.randn(2, p.batch["input_ids"].shape[1], 12, generator=g, dtype=torch.float64)
    # what forward(output="logprobs") returns: log-prob of input_ids[t + 1] at t
    lsm = logits.log_softmax(-1)
    fast = torch.zeros(2, logits.shape[1], dtype=torch.float64)
    fast[:, :-1] = lsm[:, :-1].gather(-1, p.batch["input_ids"][:, 1:, None]).squeeze(-1)
    q = tb.pack([_datum([5, 9, 2, 4], targets=[9, 2, 4, 7]), _datum([1, 3, 3], targets=[3, 3, 7])], dp=1,
                dp_rank=0, pp=1)
    q.next_token = False                      # force the logits path on the same targets
    for r in range(2):
        a = tb.target_logprobs(fast, p.batch, r, next_token=True)
        b = tb.target_logprobs(logits[:, :-1], q.batch, r, next_token=False)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    other = tb.pack([_datum([5, 9, 2, 4], targets=[1, 1, 1, 1])], dp=1, dp_rank=0, pp=1)
    assert not other.next_token


def test_loss_fn_scales_to_the_plain_sum():
    """forward_backward averages over microbatches and finalize_grads over replicas: the hook multiplies by
    both, so the gradient is that of the plain sum of the datums' losses."""
    data = [_datum([1, 2, 3]), _datum([4, 5, 6])]
    p = tb.pack(data, dp=2, dp_rank=0, pp=2)
    out = torch.zeros(p.batch["input_ids"].shape, dtype=torch.float64, requires_grad=True)
    captured = []
    fn = tb.make_loss_fn(p, loss_fn="cross_entropy", config={}, dp=2, captured=captured)
    total = fn(out, p.batch)
    total.backward()
    assert float(total) == 0.0 and [c[0] for c in captured] == [0]
    grad = out.grad[0, :3]
    assert torch.equal(grad, torch.full((3,), -1.0 * p.microbatches * 2, dtype=torch.float64))


# -- mixed requests: a request is the sum of its datums sent alone (issue 54, items 1-2) -----------------------

def _mixed_datum(loss_fn, i, n, *, int_inputs: bool, clip: bool):
    """Datum i of a mixed request: its float inputs as int64 arrays (``int_inputs``, as a numpy array of 0/1
    weights or integer advantages travels) or fractional float32; per-token clip thresholds only when ``clip``."""
    g = np.random.default_rng(100 + i)
    tokens = g.integers(0, 40, n)
    inputs = {"target_tokens": np.concatenate([tokens[1:], [g.integers(0, 40)]]).astype(np.int64)}

    def value(lo, hi):
        return g.integers(lo, hi + 1, n).astype(np.int64) if int_inputs else \
            (g.random(n) * (hi - lo) + lo).astype(np.float32)
    if loss_fn == "cross_entropy":
        inputs["weights"] = value(0, 1) if int_inputs else (g.random(n) * 0.9 + 0.05).astype(np.float32)
    else:
        inputs["logprobs"] = value(-3, -1)
        inputs["advantages"] = value(-2, 2)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = np.ones(n, np.int64 if int_inputs else np.float32)
    if clip:
        inputs["clip_low_threshold"] = np.full(n, 0.9, np.float32)
        inputs["clip_high_threshold"] = np.full(n, 1.05, np.float32)
    return Datum(tokens.astype(np.int64), inputs)


def _request_total(data, loss_fn, config, out_of):
    """(loss, d loss / d out per datum) of ``data`` as one packed request; ``out_of(tokens)`` gives a datum's
    fake ``output="logprobs"`` row (a leaf), so the gradient per datum is comparable across packings."""
    p = tb.pack(data, dp=1, dp_rank=0, pp=1)
    leaves = [out_of(d.tokens) for d in data]
    width = p.batch["input_ids"].shape[1]
    out = torch.stack([torch.cat([x, x.new_zeros(width - len(x))]) for x in leaves])
    captured = []
    total = tb.make_loss_fn(p, loss_fn=loss_fn, config=config, dp=1, captured=captured)(out, p.batch)
    grads = torch.autograd.grad(total, leaves)
    return float(total), grads, {i: lp for i, lp, _ in captured}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_mixed_request_equals_its_datums_alone(loss_fn):
    """Datums with int-typed and float-typed inputs, with and without per-token clip thresholds, in one request:
    its loss, log-probs and gradients equal the sum of each datum sent alone (before issue 54: the first datum's
    int dtype truncated the others' floats, and datums without thresholds ran with bounds 0, 0)."""
    clip_ok = loss_fn in ("ppo", "cispo", "gspo")
    config = tl_mod.check_config(loss_fn, {"beta": 0.3} if loss_fn == "dro" else {})
    data = [_mixed_datum(loss_fn, i, n, int_inputs=i % 2 == 0, clip=clip_ok and i in (1, 2))
            for i, n in enumerate((5, 8, 3, 6))]
    for i, d in enumerate(data):
        tl_mod.check_inputs(loss_fn, config, d.inputs, length=len(d.tokens), vocab=40, index=i)
    table = {}

    def out_of(tokens):
        key = tuple(int(t) for t in tokens)
        if key not in table:
            g = torch.Generator().manual_seed(len(table) + 7)
            table[key] = -torch.rand(len(tokens) + 1, generator=g, dtype=torch.float64) * 2 - 0.5
        return table[key].clone().requires_grad_(True)
    total, grads, lps = _request_total(data, loss_fn, config, out_of)
    alone = [_request_total([d], loss_fn, config, out_of) for d in data]
    assert abs(total - sum(a[0] for a in alone)) <= 1e-9 * max(1.0, abs(total)), (total, [a[0] for a in alone])
    for i, a in enumerate(alone):
        torch.testing.assert_close(grads[i], a[1][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(lps[i], a[2][0], rtol=0, atol=0)
    if clip_ok:       # the datums without thresholds ran with the default bounds, not 0 / 0
        assert any(abs(a[0]) > 1e-6 for j, a in enumerate(alone) if j in (0, 3))


def test_column_types_do_not_follow_the_first_datum():
    ints = Datum(np.array([1, 2, 3]), {"target_tokens": np.array([2, 3, 4]), "weights": np.array([1, 0, 1])})
    floats = Datum(np.array([4, 5]), {"target_tokens": np.array([5, 6]),
                                      "weights": np.array([0.5, -1.75], np.float32)})
    p = tb.pack([ints, floats], dp=1, dp_rank=0, pp=1)
    assert p.batch["in_weights"].dtype == torch.float32 and p.batch["in_target_tokens"].dtype == torch.long
    assert p.batch["in_weights"][1, :2].tolist() == [0.5, -1.75]
    with pytest.raises(tl_mod.LossInputError, match="target_tokens must be integers"):
        tl_mod.check_inputs("cross_entropy", {}, {"target_tokens": np.array([2.0, 3.0], np.float32),
                                                  "weights": np.ones(2, np.float32)}, length=2, vocab=9, index=0)
