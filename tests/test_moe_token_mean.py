"""Token-mean losses on mixture-of-experts models, with the load-balancing loss, against transformers in fp32.

``loss_fn`` returns ``(loss_sum, num_tokens)``; every replica holds 4 sequences of very unequal lengths, split
into 2 microbatches, so the token counts differ across microbatches and data-parallel replicas. The objective
(docs/moe.md) is ``sum(loss_sum) / N + coef * sum_m(num_tokens_m * aux_m) / N`` over the microbatches m of every
replica, ``aux_m`` the sum over MoE layers of transformers' ``load_balancing_loss_func`` of that layer on m
(what transformers trains with ``output_router_logits=True`` on each microbatch, token-weighted). The reference
builds exactly that on the transformers model, backward, one SGD step; each layout must match its returned
loss and every weight after ``finalize_grads`` + the same step.

Models: Qwen3-MoE with the load-balancing loss on (coefficient 0.3), a DeepSeek-V3 (MLA, sigmoid group-limited
router with a selection bias, shared experts; transformers trains it with no load-balancing loss, nor does
parallm), and a DeepSeek-V3.2 (DeepSeek sparse attention: the DeepSeek-V3 model plus a lightning indexer keeping
``index_topk`` = 8 keys per query, 16 indexer heads, rotate_half RoPE in the indexer, YaRN; a dense first layer; no
load-balancing loss either) on rows of up to 32 tokens, so that most queries attend to a selection of their keys:
the batch is one whose top-k boundary gaps are all >= 1e-5 relative (``test_dsa_parts.topk_margin``), and
transformers with every key kept is shown to give another loss. Layouts: tp2.ep2, cp2.ep2 and pp2.ep2 (where each
microbatch's token count reaches the first stage with its gradient), all dp2, on 4 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers
from test_deepseek import set_selection_bias
from test_deepseek_parts import deepseek_config
from test_dsa_parts import topk_margin, v32_config
from test_moe import per_layer_balance_loss

LR = 0.5
TOL = 2e-5
LENGTHS = [12, 2, 10, 3, 5, 12, 2, 7]   # real tokens per sequence; replica r holds rows 4r..4r+3, 2 per microbatch
COEF = 0.3


def nll_sum(logits, ids, mask):
    """(sum of next-token negative log-likelihoods over real positions, their count)."""
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum(), m.sum()


def batch(vocab, lengths=LENGTHS, seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        if i % 2:
            mask[i, -n:] = 1
        else:
            mask[i, :n] = 1
    return ids, mask


PIECES = [slice(i, i + 2) for i in range(0, len(LENGTHS), 2)]   # (replica 0: mb 0, 1), (replica 1: mb 0, 1)


def objective_parts(model, ids, mask, coef):
    """Per microbatch of every replica: (loss_sum, num_tokens, aux), differentiable."""
    import parallm
    out = []
    for sl in PIECES:
        res = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=parallm.default_position_ids(mask[sl]),
                    output_router_logits=bool(coef))
        total, count = nll_sum(res.logits, ids[sl], mask[sl])
        aux = per_layer_balance_loss(res.router_logits, model.config, mask[sl]) if coef else torch.zeros(())
        out.append((total, count, aux))
    return out


def reference(model, ids, mask, coef, tmp):
    model = copy.deepcopy(model)
    model.zero_grad()
    parts = objective_parts(model, ids, mask, coef)
    n = sum(c for _, c, _ in parts)
    loss = (sum(t for t, _, _ in parts) + coef * sum(c * a for _, c, a in parts)) / n
    loss.backward()
    # the point of the test: weighting each microbatch's aux by its tokens differs from a plain mean of them
    plain = (sum(t for t, _, _ in parts) / n + coef * sum(a for _, _, a in parts) / len(parts)).item()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return loss.item(), plain, helpers.hub_state_dict(model, tmp)


MODELS = {"qwen3-moe aux": lambda: helpers.tiny_config("qwen3_moe", num_hidden_layers=2, output_router_logits=True,
                                                       router_aux_loss_coef=COEF),
          "deepseek-v3": lambda: deepseek_config(num_hidden_layers=2),
          "deepseek-v3.2 dsa": lambda: v32_config(num_hidden_layers=2, index_topk=8)}
LAYOUTS = {"tp2.ep2": dict(tp=2), "cp2.ep2": dict(cp=2), "pp2.ep2": dict(pp=2)}
# DeepSeek-V3.2's rows: longer than index_topk (8); as unequal as LENGTHS
DSA_LENGTHS = [32, 4, 27, 9, 14, 32, 5, 21]
MARGIN = 1e-5       # the smallest relative top-k boundary gap a DSA batch may have (see test_dsa.py)


def dsa_batch(model):
    """(ids, mask, margin, dense loss): the first of a few seeded DSA_LENGTHS batches without a top-k near-tie
    (every boundary gap >= MARGIN relative), and transformers' token-mean loss on it with every key kept."""
    for seed in range(12):
        ids, mask = batch(model.config.vocab_size, DSA_LENGTHS, seed=20 + seed)
        margin = topk_margin(model, ids, mask)
        if margin >= MARGIN:
            dense = copy.deepcopy(model)
            for m in dense.modules():
                if hasattr(m, "index_topk"):
                    m.index_topk = 10 * ids.shape[1]
            with torch.no_grad():
                parts = objective_parts(dense, ids, mask, 0.0)
            return ids, mask, margin, (sum(t for t, _, _ in parts) / sum(c for _, c, _ in parts)).item()
    raise AssertionError(f"no batch among 12 without a top-k near-tie (relative gap < {MARGIN})")


def rank_fn(rank, world, cases, data):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    for key, case in cases.items():
        ids, mask = data[case["model"]]
        parallm.init_parallel(ep=2, **case["layout"])
        lay = current_dims()
        assert lay.dp == 2
        chunks = parallm.build_model(case["ckpt"])
        parallm.load_hf_weights(chunks, case["ckpt"])
        mine = slice(4 * lay.dp_rank, 4 * lay.dp_rank + 4)
        loss = parallm.forward_backward(chunks, ids[mine], mask[mine], loss_fn=nll_sum, num_microbatches=2)
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
        out[key] = dict(loss=loss.item(), state=parallm.save_hf_weights(chunks))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_moe_token_mean_with_load_balancing_matches_transformers(tmp_path):
    cases, refs, data = {}, {}, {}
    for i, (model_name, make) in enumerate(MODELS.items()):
        cfg = make()
        model = helpers.make_hf_model(cfg, seed=60 + i)
        if "deepseek" in model_name:
            set_selection_bias(model, seed=7)
        ckpt = helpers.save_checkpoint(model, str(tmp_path / f"m{i}"))
        if "dsa" in model_name:
            ids, mask, margin, dense = dsa_batch(model)
        else:
            ids, mask = batch(cfg.vocab_size)
        coef = COEF if "aux" in model_name else 0.0
        ref_loss, plain, ref_state = reference(model, ids, mask, coef, str(tmp_path / f"r{i}"))
        if coef:
            assert abs(plain - ref_loss) > 100 * TOL, (plain, ref_loss)
        if "dsa" in model_name:       # the selection matters
            print(f"{model_name}: top-k margin {margin:.1e}, loss {ref_loss:.5f}, with every key kept {dense:.5f}")
            assert abs(dense - ref_loss) > 1e-3, (dense, ref_loss)
        refs[model_name] = (ref_loss, ref_state)
        data[model_name] = (ids, mask)
        for layout_name, layout in LAYOUTS.items():
            cases[f"{model_name} {layout_name}"] = dict(ckpt=ckpt, layout=layout, model=model_name)
    res = helpers.run_ranks(rank_fn, 4, cases, data, timeout=580)
    print()
    errors = {}
    for key, case in cases.items():
        ref_loss, ref_state = refs[case["model"]]
        loss_err = max(abs(r[key]["loss"] - ref_loss) for r in res)
        state = res[0][key]["state"]
        assert state.keys() == ref_state.keys(), sorted(set(state) ^ set(ref_state))
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        print(f"{key:<28} loss {loss_err:.1e} weights {worst:.1e} (loss {ref_loss:.5f})")
        errors[key] = (loss_err, worst)
    for key, (loss_err, worst) in errors.items():
        assert loss_err < TOL, (key, loss_err)
        assert worst < TOL, (key, worst)
