"""``build_optimizer`` returns a ``torch.optim.Optimizer``: torch's learning-rate schedulers drive it.

On 4 ranks (tp2.dp2 with ZeRO and gradient buckets; pp2.dp2 unsharded): a ``LambdaLR`` warm-up + cosine
schedule over 4 AdamW steps equals the same schedule on ``torch.optim.AdamW`` over the transformers model (the
same two parameter groups: no weight decay on biases and norm weights), weights within the bound
test_optim.py derives; the scheduler's learning rates are torch's; ``param_groups`` hold the norm weights and
biases in ``no_decay``; ``state_dict`` / ``load_state_dict`` of the optimizer and the scheduler after 2 steps,
into a fresh model and optimizer, continue bit for bit as the uninterrupted run.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import helpers
from test_optim import DG, EPS, WD, ce_loss

BASE_LR = 2e-3
STEPS = 4


def schedule(step: int) -> float:
    """Linear warm-up over 2 steps, then cosine to 0 at step 5."""
    if step < 2:
        return (step + 1) / 2
    return 0.5 * (1 + math.cos(math.pi * (step - 2) / 3))


def data(vocab):
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, vocab, (4, 8), generator=g) for _ in range(STEPS)]


def reference(model, batches):
    from parallm.train.optim import default_no_decay
    model = copy.deepcopy(model).train()
    decay = [p for n, p in model.named_parameters() if not default_no_decay(n, p)]
    skip = [p for n, p in model.named_parameters() if default_no_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": skip, "weight_decay": 0.0}],
                            lr=BASE_LR, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    lrs = []
    for ids in batches:
        opt.zero_grad()
        losses = [ce_loss(model(input_ids=ids[i:i + 2]).logits.float(), ids[i:i + 2], None) for i in (0, 2)]
        torch.stack(losses).mean().backward()
        opt.step()
        lrs.append(sched.get_last_lr())
        sched.step()
    return helpers.hf_state_dict(model), lrs


def _train(parallm, chunks, opt, sched, batches, dims, steps):
    lrs = []
    for ids in batches[:steps] if steps else batches:
        per = ids.shape[0] // dims.dp
        parallm.forward_backward(chunks, ids[dims.dp_rank * per:(dims.dp_rank + 1) * per], loss_fn=ce_loss)
        parallm.finalize_grads(chunks)
        opt.step()
        opt.zero_grad()
        lrs.append(sched.get_last_lr())
        sched.step()
    return lrs


def rank_fn(rank, world, ckpt, batches, cases):
    import parallm
    from parallm.parallel.state import dims_of
    out = {}
    for name, case in cases.items():
        parallm.init_parallel(**case["layout"])

        def build():
            chunks = parallm.build_model(ckpt)
            parallm.load_hf_weights(chunks, ckpt)
            opt = parallm.build_optimizer(chunks, lr=BASE_LR, eps=EPS, weight_decay=WD, **case["opt"])
            return chunks, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        chunks, opt, sched = build()
        dims = dims_of(chunks)
        names = {id(p): n for c in chunks for n, p in c.named_parameters()}
        groups = {g["name"]: [names[id(p)] for p in g["params"]] for g in opt.param_groups}
        lrs = _train(parallm, chunks, opt, sched, batches, dims, 2)
        saved = (copy.deepcopy(opt.state_dict()), sched.state_dict(), parallm.save_hf_weights(chunks))
        lrs += _train(parallm, chunks, opt, sched, batches[2:], dims, 0)
        final = parallm.save_hf_weights(chunks)
        # resume from the state dicts into a fresh model and optimizer
        chunks2, opt2, sched2 = build()
        parallm.load_hf_weights(chunks2, saved[2] if rank == 0 else None)
        opt2.load_state_dict(saved[0])
        sched2.load_state_dict(saved[1])
        _train(parallm, chunks2, opt2, sched2, batches[2:], dims, 0)
        resumed = parallm.save_hf_weights(chunks2)
        try:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
            refused = False
        except ValueError:
            refused = True
        out[name] = dict(is_torch=isinstance(opt, torch.optim.Optimizer), groups=groups, lrs=lrs, final=final,
                         resumed=resumed, refused=refused)
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_lr_scheduler_on_parallm_optimizer_matches_torch_adamw(tmp_path):
    model = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=2), seed=11)   # qkv biases
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    batches = data(model.config.vocab_size)
    ref_state, ref_lrs = reference(model, batches)
    cases = {"tp2.dp2 zero buckets": dict(layout=dict(tp=2), opt=dict(shard_over_dp=True, overlap_grad_reduce=True,
                                                                         bucket_bytes=16 * 1024)),
             "pp2.dp2": dict(layout=dict(pp=2), opt={})}
    res = helpers.run_ranks(rank_fn, 4, ckpt, batches, cases)
    tol = sum(BASE_LR * schedule(s) for s in range(STEPS)) * DG / EPS
    for name in cases:
        for r in res:
            got = r[name]
            assert got["is_torch"] and got["refused"]      # the groups are the model's: no group added later
            assert [[pytest.approx(x, rel=1e-12) for x in lr] for lr in got["lrs"]] == ref_lrs, got["lrs"]
            decay, skip = got["groups"]["decay"], got["groups"]["no_decay"]
            assert skip and decay and all(n.endswith(".bias") or "norm" in n for n in skip), skip
            assert not any(n.endswith(".bias") or "norm" in n for n in decay), decay
        final = res[0][name]["final"]
        worst = max((final[k] - ref_state[k]).abs().max().item() for k in ref_state)
        print(f"{name}: max |w - ref| {worst:.2e}, tolerance {tol:.2e}")
        assert worst < tol, (name, worst)
        helpers.assert_same_state(res[0][name]["resumed"], final)
