"""gpt-oss through a training run's other parts, against transformers 5.25 in fp32 (one 4-rank spawn):

* **Router replay** (tp2 x ep2 packed + SP, and pp2 x ep2 with recompute; dp2, 2 microbatches per replica,
  token-mean loss): transformers' reference has every ``GptOssTopKRouter`` replaced for the call by one that
  routes the real tokens with the given experts, weighted by the softmax over those experts' logits (the
  router's bias included), as parallm's replay weighs them; the given experts are random and differ from the
  router's own choice at most tokens. Logits with replay, the trainer's own choices (``return_routed_experts``)
  against transformers' top-k, replaying them gives bit-identical logits, and every weight after one SGD step
  (the router's, which must move, included).
* **Training checkpoints**: AdamW steps at tp2 x ep2, ``save_checkpoint``, one more step; the checkpoint loaded
  at pp2 x ep2 (other experts on other ranks) holds bit-identical weights and gives the same next step (within
  1e-6); ``checkpoint_to_hf`` (one process, no model) writes transformers' stacked expert tensors, bit-identical
  to ``save_hf_weights``, which transformers loads.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

import helpers
from test_gpt_oss_parts import gpt_oss_config
from test_router_replay import PIECES, batch, nll_sum, random_experts

LR = 0.5
TOL = 2e-5


def routers(model):
    return [layer.mlp.router for layer in model.model.layers]


@contextlib.contextmanager
def routing(model, given=None, mask=None, record=None):
    """transformers' gpt-oss routers for one call: with ``given`` ``[B, S, L, k]`` the real tokens route with those
    experts, weighted by the softmax over their logits; ``record`` receives each layer's chosen experts."""
    gates = routers(model)
    originals = [g.forward for g in gates]

    def make(j, gate, original):
        def forward(hidden_states):
            logits, weights, experts = original(hidden_states)
            if given is not None:
                real = mask.reshape(-1).bool()[:, None]
                experts = torch.where(real, given[:, :, j].reshape(-1, given.shape[-1]), experts)
                weights = torch.softmax(logits.gather(1, experts), dim=-1)
            if record is not None:
                record.append(experts)
            return logits, weights, experts
        return forward
    for j, (gate, original) in enumerate(zip(gates, originals)):
        gate.forward = make(j, gate, original)
    try:
        yield
    finally:
        for gate, original in zip(gates, originals):
            gate.forward = original


def replay_reference(model, ids, mask, given, tmp):
    model = copy.deepcopy(model)
    b, s = ids.shape
    with torch.no_grad():
        with routing(model, given, mask):
            replayed = model(input_ids=ids, attention_mask=mask).logits
        record = []
        with routing(model, record=record):
            plain = model(input_ids=ids, attention_mask=mask).logits
    own = torch.stack([e.view(b, s, -1) for e in record], dim=2)
    model.zero_grad()
    parts = []
    for sl in PIECES:
        with routing(model, given[sl], mask[sl]):
            parts.append(nll_sum(model(input_ids=ids[sl], attention_mask=mask[sl]).logits, ids[sl], mask[sl]))
    loss = sum(t for t, _ in parts) / sum(c for _, c in parts)
    loss.backward()
    before = [g.weight.detach().clone() for g in routers(model)]
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    moved = min((g.weight - w).abs().max().item() for g, w in zip(routers(model), before))
    return dict(replayed=replayed, plain=plain, own=own, loss=loss.item(), moved=moved,
                state=helpers.hub_state_dict(model, tmp))


def _replay_case(rank, chunks, dims, ids, mask, given):
    import parallm
    mine = slice(4 * dims.dp_rank, 4 * dims.dp_rank + 4)
    res = {}
    with torch.no_grad():
        res["replayed"] = parallm.forward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine],
                                                   "routed_experts": given[mine]})
        plain, own = parallm.forward(chunks, ids[mine], mask[mine], return_routed_experts=True)
        res["plain"], res["own"] = plain, own
        res["round_trip"] = torch.equal(parallm.forward(chunks, ids[mine], mask[mine], routed_experts=own), plain)
    loss = parallm.forward_backward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine],
                                             "routed_experts": given[mine]},
                                    loss_fn=lambda o, mb: nll_sum(o, mb["input_ids"], mb["attention_mask"]),
                                    num_microbatches=2)
    parallm.finalize_grads(chunks)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                if p.requires_grad:
                    p -= LR * p.grad
    res["loss"] = loss.item()
    res["state"] = parallm.save_hf_weights(chunks)
    res["dp_rank"] = dims.dp_rank
    return res


def _adam_steps(chunks, ids, mask, dims, opt, n):
    import parallm
    per = ids.shape[0] // dims.dp
    mine = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    for _ in range(n):
        parallm.forward_backward(chunks, ids[mine], mask[mine], loss_fn=nll_sum)
        parallm.finalize_grads(chunks)
        opt.step()
        opt.zero_grad()


def rank_fn(rank, world, replay_ckpt, data, train_ckpt, train_batch, tmp):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    ids, mask, given = data
    for name, layout, build in (("tp2.ep2 packed sp", dict(tp=2, ep=2), dict(packed=True, sequence_parallel=True)),
                                ("pp2.ep2 recompute", dict(pp=2, ep=2), dict(recompute="full"))):
        parallm.init_parallel(**layout)
        chunks = parallm.build_model(replay_ckpt, **build)
        parallm.load_hf_weights(chunks, replay_ckpt)
        out[name] = _replay_case(rank, chunks, current_dims(), ids, mask, given)
        parallm.destroy_parallel()
    # training checkpoints: saved at tp2 x ep2, loaded at pp2 x ep2
    t_ids, t_mask = train_batch
    parallm.init_parallel(tp=2, ep=2)
    chunks = parallm.build_model(train_ckpt)
    parallm.load_hf_weights(chunks, train_ckpt)
    opt = parallm.build_optimizer(chunks, lr=1e-3, weight_decay=0.1)
    _adam_steps(chunks, t_ids, t_mask, current_dims(), opt, 2)
    saved = parallm.save_hf_weights(chunks)
    parallm.save_checkpoint(os.path.join(tmp, "train"), chunks, opt, step=2)
    _adam_steps(chunks, t_ids, t_mask, current_dims(), opt, 1)
    next_a = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()
    parallm.init_parallel(pp=2, ep=2)
    chunks = parallm.build_model(train_ckpt)
    opt = parallm.build_optimizer(chunks, lr=1e-3, weight_decay=0.1)
    info = parallm.load_checkpoint(os.path.join(tmp, "train"), chunks, opt)
    loaded = parallm.save_hf_weights(chunks)
    _adam_steps(chunks, t_ids, t_mask, current_dims(), opt, 1)
    next_b = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()
    if rank == 0:
        out["train"] = dict(step=info["step"], saved=saved, loaded=loaded, next_a=next_a, next_b=next_b)
    return out


@pytest.mark.timeout(900)
def test_gpt_oss_router_replay_and_training_checkpoints(tmp_path):
    from safetensors.torch import load_file

    from parallm.checkpoint.training import checkpoint_to_hf
    from parallm.verify.reference import load_transformers
    cfg = gpt_oss_config(num_hidden_layers=2, sliding_window=4)
    model = helpers.make_hf_model(cfg, seed=80)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "replay"))
    ids, mask = batch(cfg.vocab_size)
    given = random_experts(*ids.shape, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_local_experts, 12)
    given[~mask.bool()] = -5
    ref = replay_reference(model, ids, mask, given, str(tmp_path / "ref"))
    real = mask.bool()
    assert (given.sort(-1).values == ref["own"].sort(-1).values).all(-1)[real].float().mean() < 0.5
    assert ref["moved"] > 1e-4
    train_model = helpers.make_hf_model(gpt_oss_config(num_hidden_layers=2), seed=81)
    train_ckpt = helpers.save_checkpoint(train_model, str(tmp_path / "train_ckpt"))
    train_batch = helpers.padded_batch(cfg.vocab_size, batch=4, seq=16, seed=3)
    res = helpers.run_ranks(rank_fn, 4, ckpt, (ids, mask, given), train_ckpt, train_batch, str(tmp_path),
                            timeout=880)
    for name in ("tp2.ep2 packed sp", "pp2.ep2 recompute"):
        per = [r[name] for r in res]
        for r in per:
            rows = slice(4 * r["dp_rank"], 4 * r["dp_rank"] + 4)
            assert helpers.max_diff_real(r["replayed"], ref["replayed"][rows], mask[rows]) < TOL, name
            assert helpers.max_diff_real(r["plain"], ref["plain"][rows], mask[rows]) < TOL, name
            own = r["own"][mask[rows].bool()].sort(-1).values
            assert torch.equal(own, ref["own"][rows][mask[rows].bool()].sort(-1).values), name
            assert r["round_trip"], name
        assert abs(per[0]["loss"] - ref["loss"]) < TOL, name
        state = per[0]["state"]
        assert state.keys() == ref["state"].keys()
        assert max((state[k] - ref["state"][k]).abs().max().item() for k in state) < TOL, name
    train = res[0]["train"]
    assert train["step"] == 2
    helpers.assert_same_state(train["loaded"], train["saved"])
    assert max((train["next_a"][k] - train["next_b"][k]).abs().max().item() for k in train["next_a"]) < 1e-6
    moved = max((train["next_a"][k] - train["saved"][k]).abs().max().item() for k in train["saved"])
    assert moved > 1e-4
    checkpoint_to_hf(str(tmp_path / "train"), str(tmp_path / "offline"))
    helpers.assert_same_state(load_file(str(tmp_path / "offline" / "model.safetensors")), train["saved"])
    _, info = load_transformers(str(tmp_path / "offline"), task="causal_lm")
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
