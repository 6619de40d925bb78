"""parallm.build_optimizer: AdamW with torch.optim.AdamW's semantics, fp32 master weights, Megatron's no-decay rule,
ZeRO-1 sharding over data parallelism.

Pure tests check the step against ``torch.optim.AdamW`` bit for bit; one 4-rank spawn runs three steps (learning
rate changed between steps, weight decay on) at several layouts and compares the weights with transformers +
``torch.optim.AdamW`` on the unsharded model, with the same no-decay rule.
"""

import copy

import pytest
import torch

import helpers
from parallm.train.optim import MasterAdamW, default_no_decay

LRS = (1e-3, 2e-3, 5e-4)   # a learning rate per step: changed between steps through the optimizer
WD = 0.1
STEPS = len(LRS)
# Against transformers the gradients differ by fp32 reduction order: up to ~2e-7 absolute (measured at tp=1,
# entries up to 0.3). Adam's update g / (sqrt(v) + eps) moves by at most about dg / eps, so eps sets how far
# that noise reaches the weights; with eps = 1e-3 the bound is sum(lr) * DG / eps. (With eps = 1e-8 an entry of
# 1e-9 that comes out of a cancellation has an error of its own size, and weights differ by 1e-4.) Every part of
# AdamW still shows: without bias correction, with L2 instead of decoupled decay, or with eps under the square
# root, the update changes by O(1) of itself, i.e. by ~lr.
EPS = 1e-3
DG = 5e-7


# -- pure ------------------------------------------------------------------------------------------------------

def _pair(dtype):
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 4)]
    return [torch.randn(s) for s in shapes]


def test_master_adamw_fp32_is_torch_adamw_bit_for_bit():
    base = _pair(torch.float32)
    ref = [p.clone().requires_grad_() for p in base]
    mine = [p.clone().requires_grad_() for p in base]
    groups = lambda ps: [{"params": ps[:1] + ps[2:]}, {"params": ps[1:2], "weight_decay": 0.0}]  # noqa: E731
    o_ref = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=WD)
    o_mine = MasterAdamW(groups(mine), lr=1e-2, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    for step, lr in enumerate(LRS):
        for o in (o_ref, o_mine):
            for group in o.param_groups:
                group["lr"] = lr
        grads = [torch.randn(p.shape, generator=g) for p in base]
        for i, (r, m, gr) in enumerate(zip(ref, mine, grads)):
            if step == 1 and i == 2:   # a parameter without a gradient is skipped by both
                r.grad = m.grad = None
                continue
            r.grad, m.grad = gr.clone(), gr.clone()
        o_ref.step()
        o_mine.step()
    for r, m in zip(ref, mine):
        assert torch.equal(r, m)
        assert torch.equal(o_ref.state[r]["exp_avg_sq"], o_mine.state[m]["exp_avg_sq"])
        assert torch.equal(o_ref.state[r]["step"], o_mine.state[m]["step"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_adamw_low_precision_steps_fp32_masters(dtype):
    """bf16 / fp16 params: the masters follow torch.optim.AdamW on fp32 copies exactly (fp32 gradients from
    main_grad), the params are the masters rounded, the moments are fp32."""
    base = [p.to(dtype) for p in _pair(dtype)]
    low = [p.clone().requires_grad_() for p in base]
    ref = [p.float().requires_grad_() for p in base]
    o_low = MasterAdamW([{"params": low}], lr=1e-2, weight_decay=WD)
    o_ref = torch.optim.AdamW([{"params": ref}], lr=1e-2, weight_decay=WD)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=g) for p in base]
        for p, r, gr in zip(low, ref, grads):
            p.main_grad, r.grad = gr.clone(), gr.clone()
            p.grad = gr.to(dtype)   # ignored: main_grad wins
        o_low.step()
        o_ref.step()
    for p, r in zip(low, ref):
        st = o_low.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == st["master"].dtype == torch.float32
        assert torch.equal(st["master"], r)
        assert torch.equal(p, r.to(dtype))


def test_default_no_decay_is_megatrons_rule():
    assert default_no_decay("model.layers.0.self_attn.q_proj.bias", torch.zeros(4))
    assert default_no_decay("model.norm.weight", torch.zeros(4))
    assert default_no_decay("model.layers.0.mlp.down_proj.bias", torch.zeros(4))
    assert not default_no_decay("model.embed_tokens.weight", torch.zeros(4, 2))
    assert not default_no_decay("score.weight", torch.zeros(1, 2))


# -- against transformers ---------------------------------------------------------------------------------------

def ce_loss(logits, ids, mask):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def batches(vocab, *, batch=4, seq=8):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(STEPS)]


def reference_adamw(model, batches_, *, dp, no_decay=default_no_decay):
    """transformers + torch.optim.AdamW on the unsharded model; the loss of a step is the mean over ``dp`` equal
    pieces of the batch (what data-parallel replicas compute)."""
    model = copy.deepcopy(model).train()
    decay = [p for n, p in model.named_parameters() if not no_decay(n, p)]
    skip = [p for n, p in model.named_parameters() if no_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": skip, "weight_decay": 0.0}],
                            lr=LRS[0], eps=EPS)
    for ids, lr in zip(batches_, LRS):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        size = ids.shape[0] // dp
        losses = [ce_loss(model(input_ids=ids[i:i + size]).logits.float(), ids[i:i + size], None)
                  for i in range(0, ids.shape[0], size)]
        torch.stack(losses).mean().backward()
        opt.step()
    return helpers.hf_state_dict(model)


def train(parallm, chunks, opt, batches_, dims):
    """The training loop the tests share: each data-parallel replica takes its piece of every batch."""
    for i, (ids, lr) in enumerate(zip(batches_, LRS)):
        if i % 2:
            for group in opt.param_groups:
                group["lr"] = lr
        else:
            opt.set_lr(lr)
        per = ids.shape[0] // dims.dp
        parallm.forward_backward(chunks, ids[dims.dp_rank * per:(dims.dp_rank + 1) * per], loss_fn=ce_loss)
        parallm.finalize_grads(chunks)
        opt.step()
        opt.zero_grad()


def rank_adamw(rank, world, cases):
    import parallm
    from parallm.model.placement import placement_of
    from parallm.parallel.state import dims_of
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), ep=case.get("ep", 1))
        chunks = parallm.build_model(case["ckpt"])
        dims = dims_of(chunks)
        opt = parallm.build_optimizer(chunks, lr=1.0, eps=EPS, weight_decay=WD, shard_over_dp=case["shard"])
        parallm.load_hf_weights(chunks, case["ckpt"])   # after build_optimizer: masters follow the weights
        train(parallm, chunks, opt, case["batches"], dims)
        expert_bytes = sum(t.numel() * t.element_size() for p, st in opt.owned() if placement_of(p).expert is not None
                           for t in st.values() if torch.is_tensor(t))
        out.append(dict(state=parallm.save_hf_weights(chunks), state_bytes=opt.state_bytes(), dp=dims.dp,
                        expert_bytes=expert_bytes))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_adamw_three_steps_match_transformers(tmp_path):
    untied = helpers.make_hf_model(helpers.tiny_config("llama", num_hidden_layers=4), seed=1)
    tied = helpers.make_hf_model(helpers.tiny_config("qwen2", tie_word_embeddings=True), seed=2)
    moe = helpers.make_hf_model(helpers.tiny_config("qwen2_moe"), seed=3)   # routed + shared experts
    ckpts = {"untied": helpers.save_checkpoint(untied, str(tmp_path / "untied")),
             "tied": helpers.save_checkpoint(tied, str(tmp_path / "tied")),
             "moe": helpers.save_checkpoint(moe, str(tmp_path / "moe"))}
    models = {"untied": untied, "tied": tied, "moe": moe}
    data = {k: batches(m.config.vocab_size) for k, m in models.items()}
    cases = [dict(model="untied", tp=2, pp=2, shard=False),
             dict(model="untied", tp=2, pp=1, shard=True),     # dp2, ZeRO-1
             dict(model="untied", tp=2, pp=1, shard=False),    # dp2, the same without sharding
             dict(model="untied", tp=1, pp=2, vpp=2, shard=True),
             dict(model="tied", tp=1, pp=2, shard=False),      # tied across stages, qkv biases (no decay)
             dict(model="moe", tp=1, pp=1, ep=2, shard=True),   # dp4: dense state over dp4, experts' over edp2
             dict(model="moe", tp=1, pp=1, ep=2, shard=False)]
    for c in cases:
        c.update(ckpt=ckpts[c["model"]], batches=data[c["model"]])
    results = helpers.run_ranks(rank_adamw, 4, cases)
    refs = {}
    tol = sum(LRS) * DG / EPS   # see EPS; a wrong decay of a norm weight moves it by sum(lr) * WD * |w| ~ 3e-4
    for i, c in enumerate(cases):
        dp = results[0][i]["dp"]
        key = (c["model"], dp)
        if key not in refs:
            refs[key] = reference_adamw(models[c["model"]], data[c["model"]], dp=dp)
        ref, got = refs[key], results[0][i]["state"]
        assert got.keys() == ref.keys()
        worst = max(((got[k] - ref[k]).abs().max().item(), k) for k in ref)
        print(f"{c['model']} tp{c['tp']} pp{c['pp']} vpp{c.get('vpp')} ep{c.get('ep', 1)} shard={c['shard']}: max |w - ref| "
              f"{worst[0]:.2e} ({worst[1]}), tolerance {tol:.2e}")
        assert worst[0] < tol, f"case {c['model']} tp{c['tp']} pp{c['pp']} shard {c['shard']}: {worst}"
    # the comparison can fail: decaying norms and biases too moves them far beyond the tolerance
    wrong = reference_adamw(untied, data["untied"], dp=1, no_decay=lambda n, p: False)
    right = refs[("untied", 1)]
    wrong_diff = max((wrong[k] - right[k]).abs().max().item() for k in right)
    print(f"decaying norms and biases too: max |w - ref| {wrong_diff:.2e}")
    assert wrong_diff > 20 * tol
    # ZeRO-1 changes where the state lives, not the math: the same bits as the unsharded dp2 run
    assert all(torch.equal(results[0][1]["state"][k], results[0][2]["state"][k]) for k in results[0][1]["state"])
    # ZeRO-1: per-rank optimizer state about halves at dp2 (the same layout without sharding: cases 1 and 2)
    for rank in range(4):
        sharded, full = results[rank][1]["state_bytes"], results[rank][2]["state_bytes"]
        assert 0.4 * full < sharded < 0.6 * full, (rank, sharded, full)
    # under expert parallelism too (cases 5 and 6, ep2 x edp2): the same bits; each rank keeps about half of its
    # experts' state (partitioned over the expert-data-parallel pair) and about a quarter of the rest (over dp4)
    assert all(torch.equal(results[0][5]["state"][k], results[0][6]["state"][k]) for k in results[0][5]["state"])
    for rank in range(4):
        sharded, full = results[rank][5], results[rank][6]
        experts, experts_full = sharded["expert_bytes"], full["expert_bytes"]
        dense, dense_full = sharded["state_bytes"] - experts, full["state_bytes"] - experts_full
        print(f"moe ep2 rank {rank}: expert state {experts} / {experts_full} B, the rest {dense} / {dense_full} B")
        assert 0.35 * experts_full < experts < 0.65 * experts_full, (rank, experts, experts_full)
        assert 0.1 * dense_full < dense < 0.45 * dense_full, (rank, dense, dense_full)
