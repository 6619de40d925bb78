"""An empty local batch: ``forward_backward`` with 0 rows on one data-parallel replica runs the same schedule as its
peers (the same number of microbatches, so the same pipeline messages, expert all-to-alls and gradient-bucket
collectives in the same order) and adds nothing to a token-mean objective.

One 4-rank spawn, replica 1 empty, 2 microbatches per call, each step compared with transformers trained on
replica 0's data alone (the same step with the empty replica's data omitted), returned loss and every weight
after ``finalize_grads`` + SGD:

* Qwen3-MoE with the load-balancing loss, tp2.dp2.ep2 (every MoE layer exchanges tokens over the replicas);
* Qwen2 (tied) pp2.dp2 with gradient buckets (``overlap_grad_reduce=True``, small buckets): on both replicas
  every bucket not left to ``finalize_grads`` is launched during the backward;
* a scalar ``loss_fn`` (a mean per microbatch, which an empty one does not have): the same ValueError on every
  rank, and the next call goes on normally.
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers
from test_moe import per_layer_balance_loss
from test_moe_token_mean import batch, nll_sum

LR = 0.5
TOL = 2e-5
COEF = 0.3
PIECES = [slice(0, 2), slice(2, 4)]      # replica 0's microbatches; replica 1 holds nothing


def reference(model, ids, mask, coef, tmp):
    """transformers on replica 0's two microbatches: token-mean loss + coef x token-weighted load balancing."""
    import parallm
    model = copy.deepcopy(model)
    model.zero_grad()
    parts = []
    for sl in PIECES:
        res = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=parallm.default_position_ids(mask[sl]),
                    output_router_logits=bool(coef))
        total, count = nll_sum(res.logits, ids[sl], mask[sl])
        aux = per_layer_balance_loss(res.router_logits, model.config, mask[sl]) if coef else torch.zeros(())
        parts.append((total, count, aux))
    n = sum(c for _, c, _ in parts)
    loss = (sum(t for t, _, _ in parts) + coef * sum(c * a for _, c, a in parts)) / n
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return loss.item(), helpers.hub_state_dict(model, tmp)


def _counting(launch, counter):
    def wrapped():
        if torch._C._current_graph_task_id() >= 0:     # from a gradient hook, inside the backward
            counter[0] += 1
        return launch()
    return wrapped


def rank_fn(rank, world, cases, ids, mask):
    import parallm
    from parallm.parallel.state import current_dims
    from parallm.train.buckets import grad_buffers_of
    out = {}
    for name, case in cases.items():
        parallm.init_parallel(**case["layout"])
        lay = current_dims()
        chunks = parallm.build_model(case["ckpt"])
        parallm.load_hf_weights(chunks, case["ckpt"])
        launched, early = [0], 0
        if case.get("buckets"):
            parallm.build_optimizer(chunks, lr=LR, overlap_grad_reduce=True, bucket_bytes=16 * 1024)
            for bs in grad_buffers_of(chunks).buckets:
                for b in bs:
                    b.launch = _counting(b.launch, launched)
                    early += not b.plan.deferred
        mine = slice(0, 4) if lay.dp_rank == 0 else slice(0, 0)
        loss = parallm.forward_backward(chunks, ids[mine], mask[mine], loss_fn=nll_sum, num_microbatches=2)
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * p.grad
        res = dict(loss=loss.item(), launched=(launched[0], early), state=parallm.save_hf_weights(chunks))
        # a scalar loss with an empty replica: the same error everywhere; then a normal call
        try:
            parallm.forward_backward(chunks, ids[mine], mask[mine], num_microbatches=2,
                                     loss_fn=lambda o, i, m: (lambda t, c: t / c)(*nll_sum(o, i, m)))
            res["scalar"] = None
        except ValueError as e:
            res["scalar"] = str(e)
        for c in chunks:
            c.zero_grad()
        parallm.finalize_grads(chunks)     # a step's state is left clean by the refused call's finalize
        again = parallm.forward_backward(chunks, ids[:2], mask[:2], loss_fn=nll_sum)
        res["again"] = bool(torch.isfinite(again))
        out[name] = res
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_an_empty_replica_runs_the_schedule_of_its_peers_and_adds_nothing(tmp_path):
    specs = {"qwen3-moe aux tp2.dp2.ep2": (helpers.tiny_config("qwen3_moe", num_hidden_layers=2,
                                                                output_router_logits=True, router_aux_loss_coef=COEF),
                                           dict(tp=2, ep=2), {}),
             "qwen2 tied pp2.dp2 buckets": (helpers.tiny_config("qwen2", num_hidden_layers=4,
                                                                tie_word_embeddings=True),
                                            dict(pp=2), {"buckets": True})}
    cases, refs = {}, {}
    for i, (name, (cfg, layout, opts)) in enumerate(specs.items()):
        model = helpers.make_hf_model(cfg, seed=70 + i)
        ckpt = helpers.save_checkpoint(model, str(tmp_path / f"m{i}"))
        ids, mask = batch(cfg.vocab_size)
        coef = COEF if "aux" in name else 0.0
        refs[name] = reference(model, ids, mask, coef, str(tmp_path / f"r{i}"))
        cases[name] = dict(ckpt=ckpt, layout=layout, **opts)
    res = helpers.run_ranks(rank_fn, 4, cases, ids, mask, timeout=580)
    print()
    for name, case in cases.items():
        ref_loss, ref_state = refs[name]
        loss_err = max(abs(r[name]["loss"] - ref_loss) for r in res)
        state = res[0][name]["state"]
        assert state.keys() == ref_state.keys()
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        launched = [r[name]["launched"] for r in res]
        print(f"{name:<28} loss {loss_err:.1e} weights {worst:.1e} buckets launched in the backward {launched}")
        assert loss_err < TOL and worst < TOL, (name, loss_err, worst)
        if case.get("buckets"):
            # every bucket not left to finalize_grads, on the empty replica too: launched in the backward
            assert all(n == want > 0 for n, want in launched), launched
        messages = {r[name]["scalar"] for r in res}
        assert len(messages) == 1 and None not in messages, messages
        assert "hold no rows" in messages.pop()
        assert all(r[name]["again"] for r in res)
