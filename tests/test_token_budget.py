"""Microbatches by a token budget (``max_tokens_per_microbatch=``), against transformers in fp32.

Pure tests check the bins (every sequence once, within the budget, balanced, deterministic, a sequence longer
than the budget refused by name). One 4-rank spawn at pp2.dp2 then runs a batch of very unequal lengths (1 to
30 real tokens of 32; one replica needs 2 bins of 40 tokens, the other 1, so the count is agreed: 2 on both), in
padded and packed models: ``forward_backward`` (batch form, a per-token loss mask entry that must travel with its
rows through the reordering, token-mean loss) gives transformers' loss and weights after SGD; every microbatch
``loss_fn`` saw holds at most the budget; ``forward(..., output="logprobs", max_tokens_per_microbatch=...)``
returns transformers' log-probs in the caller's order. Then one replica passes a single sequence: it runs an
empty microbatch (the agreed count is 2), and the loss is transformers' on the five sequences.
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers
from parallm.train.batching import bin_order, fewest_bins, inverse, token_bins

LR = 0.5
TOL = 2e-5
BUDGET = 40
LENGTHS = [30, 2, 3, 25, 1, 16, 4, 8]      # replica 0: rows 0-3 (60 tokens: 2 bins), replica 1: rows 4-7 (29: 1)
SEQ = 32


def test_bins_hold_every_sequence_once_within_the_budget_balanced():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(0, 40, (), generator=g))
        lengths = torch.randint(0, 100, (n,), generator=g).tolist()
        budget = max(lengths + [1]) + int(torch.randint(0, 200, (), generator=g))
        k = fewest_bins(lengths, budget)
        bins = token_bins(lengths, k)
        assert sorted(i for b in bins for i in b) == list(range(n))
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert max(loads) <= budget and (k == 1 or max(loads) - min(loads) <= max(lengths))
        assert k <= max(1, -(-sum(lengths) // budget)) + 2        # close to the fewest possible
        assert bins == token_bins(lengths, k)                    # deterministic
        order, sizes = bin_order(bins)
        assert [order[j] for j in inverse(order)] == list(range(n)) and sum(sizes) == n
    with pytest.raises(ValueError, match="sequence 1 holds 50 real tokens, more than max_tokens_per_microbatch=40"):
        fewest_bins([3, 50, 2], 40)


def nll_sum(logits, mb):
    lp = logits[:, :-1].float().log_softmax(-1)
    m = mb["loss_mask"][:, :-1]
    nll = -lp.gather(-1, mb["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum(), m.sum()


def _batch(vocab):
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, vocab, (len(LENGTHS), SEQ), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        if i % 2:
            mask[i, -n:] = 1
        else:
            mask[i, :n] = 1
    loss_mask = torch.zeros(ids.shape)
    loss_mask[:, :-1] = (mask[:, 1:] * mask[:, :-1]).float()
    loss_mask[:, 5] = 0       # not every real position counts: the mask is data, not derivable from the ids
    return ids, mask, loss_mask


def reference(model, ids, mask, loss_mask):
    import parallm
    model = copy.deepcopy(model)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits
    total, count = nll_sum(logits, {"input_ids": ids, "loss_mask": loss_mask})
    loss = total / count
    loss.backward()
    lp = torch.zeros(ids.shape)
    lp[:, :-1] = logits[:, :-1].detach().float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return loss.item(), helpers.hf_state_dict(model), lp * mask * torch.cat(
        [mask[:, 1:], torch.zeros(ids.shape[0], 1, dtype=mask.dtype)], 1)


def rank_fn(rank, world, ckpt, ids, mask, loss_mask):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    for packed in (False, True):
        parallm.init_parallel(pp=2)
        lay = current_dims()
        chunks = parallm.build_model(ckpt, packed=packed)
        parallm.load_hf_weights(chunks, ckpt)
        mine = slice(4 * lay.dp_rank, 4 * lay.dp_rank + 4)
        lp = parallm.forward(chunks, ids[mine], mask[mine], output="logprobs", max_tokens_per_microbatch=BUDGET)
        # replica 1 with one sequence: 2 bins agreed, so it runs an empty microbatch (packed: an empty stream)
        few = slice(0, 4) if lay.dp_rank == 0 else slice(4, 5)
        uneven = parallm.forward_backward(chunks, {"input_ids": ids[few], "attention_mask": mask[few],
                                                   "loss_mask": loss_mask[few]},
                                          loss_fn=nll_sum, max_tokens_per_microbatch=BUDGET).item()
        parallm.finalize_grads(chunks)
        for c in chunks:
            c.zero_grad()
        seen = []

        def loss_fn(o, mb):
            seen.append(int(mb["attention_mask"].sum()))
            return nll_sum(o, mb)
        loss = parallm.forward_backward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine],
                                                 "loss_mask": loss_mask[mine]},
                                        loss_fn=loss_fn, max_tokens_per_microbatch=BUDGET)
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * p.grad
        state = parallm.save_hf_weights(chunks)
        big = []        # a budget every sequence fits in one bin: still at least pp microbatches (stages overlap)
        parallm.forward_backward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine]},
                                 loss_fn=lambda o, mb: big.append(1) or nll_sum(o, dict(mb, loss_mask=mb[
                                     "attention_mask"])), max_tokens_per_microbatch=10 ** 6)
        out[packed] = dict(lp=lp, loss=loss.item(), seen=seen, state=state, uneven=uneven,
                           dp_rank=lay.dp_rank, last=lay.pp_rank == 1, big=len(big))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_token_budget_microbatches_against_transformers(tmp_path):
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=4)
    model = helpers.make_hf_model(cfg, seed=90)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask, loss_mask = _batch(cfg.vocab_size)
    ref_loss, ref_state, ref_lp = reference(model, ids, mask, loss_mask)
    ref_uneven = reference(model, ids[:5], mask[:5], loss_mask[:5])[0]
    res = helpers.run_ranks(rank_fn, 4, ckpt, ids, mask, loss_mask)
    for packed in (False, True):
        for rank, r in enumerate(res):
            got = r[packed]
            mine = slice(4 * got["dp_rank"], 4 * got["dp_rank"] + 4)
            assert abs(got["loss"] - ref_loss) < TOL, (packed, rank, got["loss"], ref_loss)
            assert abs(got["uneven"] - ref_uneven) < TOL, (packed, rank, got["uneven"], ref_uneven)
            assert got["big"] == (2 if got["last"] else 0), (packed, rank, got["big"])   # >= pp bins
            both = ref_lp[mine] != 0       # positions whose token and next token are real
            lp_err = ((got["lp"] - ref_lp[mine]) * both).abs().max().item()
            assert lp_err < TOL, (packed, rank, lp_err)
            if got["last"]:      # loss_fn runs on the last stage: 2 microbatches (agreed), each within the budget
                assert len(got["seen"]) == 2 and max(got["seen"]) <= BUDGET, got["seen"]
                assert sum(got["seen"]) == sum(LENGTHS[mine]), got["seen"]
        state = res[0][packed]["state"]
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        print(f"packed={packed}: weights {worst:.1e}, microbatch tokens {[r[packed]['seen'] for r in res]}")
        assert worst < TOL, (packed, worst)
