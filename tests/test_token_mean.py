"""Token-mean losses: ``loss_fn`` returning ``(loss_sum, num_tokens)`` makes the objective
``sum(loss_sum) / sum(num_tokens)`` over every microbatch and data-parallel replica, against transformers.

The global batch of 8 sequences holds very unequal numbers of real tokens (2 to 24 per sequence), so the
microbatches and the replicas hold very different counts, and a mean of per-microbatch means would differ from
the token mean by far more than the tolerance (asserted). One 4-rank spawn runs dp4, tp2 x dp2 and pp2 x dp2
(2 microbatches each, and tp1 x dp4 with the step split over two forward_backward calls, gradient accumulation),
each checked for the returned loss and the weights after ``finalize_grads`` + SGD; then the errors: a loss_fn
mixing the two kinds, and a scalar call after a pair call before ``finalize_grads``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers

LR = 0.5
TOL = 2e-5
LENGTHS = [24, 2, 20, 3, 6, 24, 2, 11]      # real tokens per sequence of the global batch (S = 24)


def nll_sum(logits, ids, mask):
    """(sum of next-token negative log-likelihoods over real positions, their count)."""
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum(), m.sum()


def _batch(vocab):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        if i % 2:
            mask[i, -n:] = 1      # left padding
        else:
            mask[i, :n] = 1       # right padding
    return ids, mask


def _reference(model, ids, mask):
    import parallm
    model = copy.deepcopy(model)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits
    total, count = nll_sum(logits, ids, mask)
    loss = total / count
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return loss.item(), helpers.hf_state_dict(model)


def _rank(rank, world, ckpt, ids, mask, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    for name, (tp, pp, calls) in cases.items():
        parallm.init_parallel(tp=tp, pp=pp)
        lay = current_dims()
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        per = ids.shape[0] // lay.dp
        mine = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        b_ids, b_mask = ids[mine], mask[mine]
        step = b_ids.shape[0] // calls
        losses = [parallm.forward_backward(chunks, b_ids[i:i + step], b_mask[i:i + step], loss_fn=nll_sum,
                                           num_microbatches=2 if calls == 1 else 1).item()
                  for i in range(0, b_ids.shape[0], step)]
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * p.grad
        out[name] = dict(losses=losses, state=parallm.save_hf_weights(chunks))
    # errors, on every rank
    parallm.init_parallel(tp=1, pp=1)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    calls = {"n": 0}

    def mixed(o, i, m):
        calls["n"] += 1
        total, count = nll_sum(o, i, m)
        return (total, count) if calls["n"] % 2 else total / count
    for key, fn in [("mixed", lambda: parallm.forward_backward(chunks, ids[:2], mask[:2], loss_fn=mixed,
                                                               num_microbatches=2)),
                    ("scalar_after_pair", lambda: (
                        parallm.forward_backward(chunks, ids[:2], mask[:2], loss_fn=nll_sum),
                        parallm.forward_backward(chunks, ids[:2], mask[:2],
                                                 loss_fn=lambda o, i, m: nll_sum(o, i, m)[0])))]:
        try:
            fn()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


@pytest.mark.timeout(300)
def test_token_mean_against_transformers_with_unequal_token_counts(tmp_path):
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=2, tie_word_embeddings=True)
    model = helpers.make_hf_model(cfg)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask = _batch(cfg.vocab_size)
    ref_loss, ref_state = _reference(model, ids, mask)
    # the point of the test: a mean of per-piece means is far from the token mean for this batch
    import parallm
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits
    piece_means = [(lambda t, c: (t / c).item())(*nll_sum(logits[i:i + 1], ids[i:i + 1], mask[i:i + 1]))
                   for i in range(len(LENGTHS))]
    assert abs(sum(piece_means) / len(piece_means) - ref_loss) > 100 * TOL
    cases = {"dp4": (1, 1, 1), "tp2.dp2": (2, 1, 1), "pp2.dp2": (1, 2, 1), "dp4.accumulate2": (1, 1, 2)}
    res = helpers.run_ranks(_rank, 4, ckpt, ids, mask, cases)
    for rank, r in enumerate(res):
        for name in cases:
            losses = r[name]["losses"]
            if len(losses) == 1:     # one call: it returns the global objective
                assert abs(losses[0] - ref_loss) < TOL, (name, losses, ref_loss)
            if rank == 0:
                state = r[name]["state"]
                assert state.keys() == ref_state.keys()
                worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
                assert worst < TOL, (name, worst)
        assert r["mixed"] is not None and "return one kind" in r["mixed"], r["mixed"]
        assert r["scalar_after_pair"] is not None and "before finalize_grads" in r["scalar_after_pair"], r
