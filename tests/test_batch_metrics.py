"""``forward_backward(chunks, batch, *, loss_fn)`` with a batch mapping and metrics, against transformers in fp32.

The batch is a dict: ``input_ids``, ``attention_mask`` and the data an RL loss needs, per sample
(``advantages`` ``[B]``) and per token (``old_logprobs`` ``[B, S]``): they are split with the microbatches and
reach ``loss_fn(out, mb)`` in ``mb``, no closure over the whole batch. The loss is a PPO-style token mean of
``-ratio * advantage`` on ``output="logprobs"``; ``loss_fn`` returns ``((loss_sum, num_tokens), metrics)`` with
a token-weighted mean (``ratio``), a maximum (``ratio_max``), a minimum (``ratio_min``) and a sum (``tokens``).
On 4 ranks, pp2.dp2 and cp2.dp2 with 2 microbatches of unequal token counts per replica: the returned objective,
every metric (on every rank, every pipeline stage) and the weights after one SGD step equal transformers' on the
whole batch; the same at pp2.dp2 with the batch as a ``tensordict.TensorDict`` (and ``forward`` of a TensorDict
equal to the dict's bit for bit). Then the errors: metrics with other names on one microbatch, a batch entry whose first dimension
is not the batch, both on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers
from test_moe_token_mean import batch

LR = 0.5
TOL = 2e-5


def token_mask(mask):
    m = torch.zeros_like(mask, dtype=torch.float32)
    m[:, :-1] = (mask[:, 1:] * mask[:, :-1]).float()
    return m


def rl_loss(out, mb):
    """``out``: log-probs [b, S]; ``mb``: the microbatch's mapping."""
    m = token_mask(mb["attention_mask"])
    ratio = torch.exp(out - mb["old_logprobs"])
    loss_sum = -(ratio * mb["advantages"][:, None] * m).sum()
    n = m.sum()
    real = ratio.detach()[m > 0]
    metrics = {"ratio": (ratio.detach() * m).sum() / n.clamp(min=1), "ratio_max": real.max(),
               "ratio_min": real.min(), "tokens": n}
    return (loss_sum, n), metrics


def reference(model, ids, mask, old, adv):
    import parallm
    model = copy.deepcopy(model)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits
    lp = torch.zeros(ids.shape, dtype=torch.float32)
    lp[:, :-1] = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = token_mask(mask)
    ratio = torch.exp(lp - old)
    loss = -(ratio * adv[:, None] * m).sum() / m.sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    real = ratio.detach()[m > 0]
    metrics = {"ratio": ((ratio.detach() * m).sum() / m.sum()).item(), "ratio_max": real.max().item(),
               "ratio_min": real.min().item(), "tokens": m.sum().item()}
    return loss.item(), metrics, helpers.hf_state_dict(model), lp.detach()


def rank_fn(rank, world, ckpt, data, layouts):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    for name, layout in layouts.items():
        layout = dict(layout)
        as_tensordict = layout.pop("tensordict", False)
        parallm.init_parallel(**layout)
        lay = current_dims()
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        mine = slice(4 * lay.dp_rank, 4 * lay.dp_rank + 4)
        mb = {k: v[mine] for k, v in data.items()}
        if as_tensordict:       # the same rows as a tensordict.TensorDict: forward equal bit for bit to the dict's
            from tensordict import TensorDict
            plain, mb = mb, TensorDict(mb, batch_size=[4])
            with torch.no_grad():
                out["forward_equal"] = torch.equal(parallm.forward(chunks, mb, output="logprobs"),
                                                   parallm.forward(chunks, plain, output="logprobs"))
        loss, metrics = parallm.forward_backward(chunks, mb, loss_fn=rl_loss, num_microbatches=2,
                                                 output="logprobs",
                                                 metric_reduce={"ratio_max": "max", "ratio_min": "min",
                                                                "tokens": "sum"})
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * p.grad
        out[name] = dict(loss=loss.item(), metrics={k: v.item() for k, v in metrics.items()},
                         state=parallm.save_hf_weights(chunks))
        for c in chunks:
            c.zero_grad()
        errors = {}
        calls = {"n": 0}

        def renamed(o, b):
            calls["n"] += 1
            (s, n), mets = rl_loss(o, b)
            return (s, n), ({"other": n} if calls["n"] == 2 else mets)
        bad = dict(mb, advantages=mb["advantages"][:3])
        for key, fn in (("names", lambda: parallm.forward_backward(chunks, mb, loss_fn=renamed, num_microbatches=2,
                                                                    output="logprobs")),
                        ("shape", lambda: parallm.forward_backward(chunks, bad, loss_fn=rl_loss, output="logprobs"))):
            try:
                fn()
                errors[key] = None
            except ValueError as e:
                errors[key] = str(e)
            for c in chunks:
                c.zero_grad()
        out[name]["errors"] = errors
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_batch_mapping_and_metrics_against_transformers(tmp_path):
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=2)
    model = helpers.make_hf_model(cfg, seed=80)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask = batch(cfg.vocab_size)
    g = torch.Generator().manual_seed(4)
    _, _, _, lp = reference(model, ids, mask, torch.zeros(ids.shape), torch.ones(ids.shape[0]))
    old = lp + 0.1 * torch.randn(ids.shape, generator=g)        # ratios around 1, not 1
    adv = torch.randn(ids.shape[0], generator=g)
    ref_loss, ref_metrics, ref_state, _ = reference(model, ids, mask, old, adv)
    data = {"input_ids": ids, "attention_mask": mask, "old_logprobs": old, "advantages": adv}
    layouts = {"pp2.dp2": dict(pp=2), "cp2.dp2": dict(cp=2), "pp2.dp2 TensorDict": dict(pp=2, tensordict=True)}
    res = helpers.run_ranks(rank_fn, 4, ckpt, data, layouts)
    assert all(r["forward_equal"] for r in res)
    for name in layouts:
        for rank, r in enumerate(res):
            got = r[name]
            assert abs(got["loss"] - ref_loss) < TOL, (name, rank, got["loss"], ref_loss)
            assert got["metrics"].keys() == ref_metrics.keys(), got["metrics"]
            for k, v in ref_metrics.items():
                assert abs(got["metrics"][k] - v) < TOL * max(1.0, abs(v)), (name, rank, k, got["metrics"][k], v)
            assert "return the same names" in (got["errors"]["names"] or ""), got["errors"]
            assert "first dimension is the batch" in (got["errors"]["shape"] or ""), got["errors"]
        state = res[0][name]["state"]
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        print(f"{name}: loss {abs(res[0][name]['loss'] - ref_loss):.1e} weights {worst:.1e} {res[0][name]['metrics']}")
        assert worst < TOL, (name, worst)
