"""Router replay against transformers with the routing forced the same way, fp32, at tp2.ep2 (packed with
sequence parallelism, and padded), tp2.ep1 (packed, sequence parallel: the tokens enter the TP region),
pp2.ep2 (with activation recompute), cp2.ep2 and, for DeepSeek-V3, pp2.vpp2.ep2 (all dp2, 4 ranks), for
Qwen3-MoE (softmax router, norm_topk_prob, with the load-balancing loss on) and DeepSeek-V3 (sigmoid
group-limited router with a selection bias, routed_scaling_factor, dense first layer, shared experts); and GLM-5
(DeepSeek sparse attention: the DeepSeek-V3 router and MLA plus a lightning indexer keeping ``index_topk`` = 8 keys
per query, 16 indexer heads, shared indexer layers that reuse the previous full layer's selection) at tp2.ep2
packed + SP and pp2.ep2 with recompute, on rows of up to 32 tokens: the forced routing changes the hidden states
every later indexer scores, so the batch is one whose top-k boundary gaps are all >= 1e-5 relative under the
replayed routing and under transformers' own (``test_dsa_parts.topk_margin``), and transformers' dense attention
(every key kept) is shown to give other replayed logits: the comparison runs through the sparse selection.

The reference is transformers' model whose every MoE router (``mlp.gate``, where transformers takes its top-k)
is replaced for the call by one that returns the given experts at real tokens (its own top-k at padding) with
the router's probabilities of those experts as weights: Qwen3-MoE ``softmax(logits)`` gathered and renormalised,
DeepSeek-V3 the unbiased ``sigmoid(logits)`` gathered, normalised (+1e-20) and scaled. The load-balancing loss
of the reference counts the replayed experts (per layer, ``E * sum_e f_e P_e``, layers summed, docs/moe.md).

The experts to replay are random (distinct per token), different from the router's own top-k at most tokens
(checked), and garbage (-5) at padding positions, which must be ignored. Per layout and model, one spawn checks:
logits with replay; the trainer's own choices (``return_routed_experts``) against transformers' top-k and their
round trip (replaying them gives bit-identical logits, in the padded and the per-token ``[T, L, k]`` forms);
``forward_backward`` with replay (batch-mapping entry, 2 microbatches per replica, token-mean loss), then
``finalize_grads`` and one SGD step: every weight, the router's included (which must move), equals the
reference's; replay under a token budget (rows reordered into bins, results in the caller's order); and clear
errors on every rank for wrong shapes, layer counts, top_k, ids out of range,
repeated experts, a float tensor, a dense model, and (cp2) CP ranks passing different experts at real tokens
(values at padding may differ).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import helpers
from test_deepseek import set_selection_bias
from test_deepseek_parts import deepseek_config
from test_dsa_parts import glm5_config, topk_margin

LR = 0.5
TOL = 2e-5
LENGTHS = [12, 2, 10, 3, 5, 12, 2, 7]   # real tokens per sequence; replica r holds rows 4r..4r+3, 2 per microbatch
COEF = 0.3
PIECES = [slice(i, i + 2) for i in range(0, len(LENGTHS), 2)]   # the microbatches of both replicas, in order


def nll_sum(logits, ids, mask):
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


def moe_gates(model):
    """The MoE layers' routers (transformers' ``mlp.gate``, where the top-k is taken), in model order."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def replay_weights(gate, h, experts):
    """The router's probabilities of ``experts``, as the router would weight its own choice."""
    if hasattr(gate, "e_score_correction_bias"):          # DeepSeek-V3: unbiased sigmoid scores
        logits = F.linear(h.float(), gate.weight.float())
        w = logits.sigmoid().gather(1, experts)
        if gate.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * gate.routed_scaling_factor
    logits = F.linear(h, gate.weight)                      # Qwen3-MoE: softmax over all experts
    w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, experts)
    if gate.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(logits.dtype)


@contextlib.contextmanager
def routing(model, given=None, mask=None, record=None):
    """transformers' routers for one call: with ``given`` ``[B, S, L, k]`` the real tokens (``mask``) route with
    those experts; ``record``: a list that receives each layer's ``(logits, experts)``."""
    gates = moe_gates(model)
    originals = [g.forward for g in gates]

    def make(j, gate, original):
        def forward(hidden_states):
            h = hidden_states.reshape(-1, gate.weight.shape[1])
            logits, w, experts = original(hidden_states)
            if given is not None:
                real = mask.reshape(-1).bool()[:, None]
                experts = torch.where(real, given[:, :, j].reshape(-1, given.shape[-1]), experts)
                logits, w = replay_weights(gate, h, experts)
            if record is not None:
                record.append((j, logits, experts))
            return logits, w, experts
        return forward
    for j, (gate, original) in enumerate(zip(gates, originals)):
        gate.forward = make(j, gate, original)
    try:
        yield
    finally:
        for gate, original in zip(gates, originals):
            gate.forward = original


def balance_loss(record, given, mask, num_experts):
    """Per MoE layer ``E * sum_e f_e P_e`` over the real tokens, f from the replayed experts, P from the
    router's softmax; summed over the layers."""
    real = mask.reshape(-1).bool()
    total = 0.0
    for j, logits, _ in record:
        probs = torch.softmax(logits.float(), dim=-1)[real]
        chosen = given[:, :, j].reshape(-1, given.shape[-1])[real]
        counts = torch.zeros(num_experts).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        total = total + num_experts * ((counts / real.sum()) * probs.mean(0)).sum()
    return total


def random_experts(b, s, layers, k, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    out = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(b * s * layers)])
    return out.view(b, s, layers, k)


def reference(model, ids, mask, given, coef, tmp):
    """(logits with replay, logits without, transformers' own top-k [B, S, L, k], loss and state after one SGD
    step of the token-mean objective with replay; router weights before)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        with routing(model, given, mask):
            replayed = model(input_ids=ids, attention_mask=mask).logits
        record = []
        with routing(model, record=record):
            plain = model(input_ids=ids, attention_mask=mask).logits
        b, s = ids.shape
        own = torch.stack([e.view(b, s, -1) for _, _, e in record], dim=2)
    num_experts = getattr(model.config, "num_experts", None) or model.config.n_routed_experts
    model.zero_grad()
    parts = []
    for sl in PIECES:
        record = []
        with routing(model, given[sl], mask[sl], record=record):
            logits = model(input_ids=ids[sl], attention_mask=mask[sl]).logits
        total, count = nll_sum(logits, ids[sl], mask[sl])
        aux = balance_loss(record, given[sl], mask[sl], num_experts) if coef else 0.0
        parts.append((total, count, aux))
    n = sum(c for _, c, _ in parts)
    loss = (sum(t for t, _, _ in parts) + coef * sum(c * a for _, c, a in parts)) / n
    loss.backward()
    routers = [g.weight.detach().clone() for g in moe_gates(model)]
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    moved = min((g.weight - r).abs().max().item() for g, r in zip(moe_gates(model), routers))
    return dict(replayed=replayed, plain=plain, own=own, loss=loss.item(), moved=moved,
                state=helpers.hub_state_dict(model, tmp))


MODELS = {"qwen3-moe": lambda: helpers.tiny_config("qwen3_moe", num_hidden_layers=2, output_router_logits=True,
                                                   router_aux_loss_coef=COEF),
          "deepseek-v3": lambda: deepseek_config(num_hidden_layers=4),
          # 4 layers: the first dense; indexer_types full, shared, full, shared
          "glm5-dsa": lambda: glm5_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1,
                                          index_topk=8)}
LAYOUTS = {"tp2.ep2 packed sp": dict(layout=dict(tp=2), build=dict(packed=True, sequence_parallel=True)),
           "tp2.ep2": dict(layout=dict(tp=2), build={}),
           "tp2.ep1 packed sp": dict(layout=dict(tp=2, ep=1), build=dict(packed=True, sequence_parallel=True)),
           "pp2.ep2 recompute": dict(layout=dict(pp=2), build=dict(recompute="full")),
           "cp2.ep2": dict(layout=dict(cp=2), build={})}
MODEL_LAYOUTS = {"qwen3-moe": LAYOUTS,
                 "deepseek-v3": dict(LAYOUTS, **{"pp2.vpp2.ep2": dict(layout=dict(pp=2, vpp=2), build={})}),
                 "glm5-dsa": {k: LAYOUTS[k] for k in ("tp2.ep2 packed sp", "pp2.ep2 recompute")}}
# GLM-5's rows: longer than index_topk (8), so that most queries attend to a selection of their keys
DSA_LENGTHS = [32, 10, 27, 14, 21, 32, 12, 25]
MARGIN = 1e-5       # the smallest relative top-k boundary gap a DSA batch may have (see test_dsa.py)


def errors_of(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def rank_fn(rank, world, cases, data):
    import parallm
    from parallm.parallel.state import current_dims
    out = {}
    for key, case in cases.items():
        ids, mask, given = data[case["model"]]
        parallm.init_parallel(**dict(dict(ep=2), **case["layout"]))
        lay = current_dims()
        assert lay.dp == 2
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        parallm.load_hf_weights(chunks, case["ckpt"])
        mine = slice(4 * lay.dp_rank, 4 * lay.dp_rank + 4)
        res = {"dp_rank": lay.dp_rank}
        with torch.no_grad():
            logits, routed = parallm.forward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine],
                                                      "routed_experts": given[mine]}, return_routed_experts=True)
            res["replayed"], res["replayed_routed"] = logits, routed
            plain, own = parallm.forward(chunks, ids[mine], mask[mine], return_routed_experts=True)
            res["plain"], res["own"] = plain, own
            again = parallm.forward(chunks, ids[mine], mask[mine], routed_experts=own)
            packed = parallm.forward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine],
                                              "routed_experts": own[mask[mine].bool()]})
            res["round_trip"] = torch.equal(again, plain) and torch.equal(packed, plain)
            if case["model"] == "deepseek-v3":     # a slot per decoder layer (vLLM's layout): the dense one ignored
                slots = torch.full(given[mine].shape[:2] + (given.shape[2] + 1, given.shape[3]), -3)
                slots[:, :, 1:] = given[mine]
                res["all_layers"] = torch.equal(parallm.forward(chunks, ids[mine], mask[mine],
                                                                routed_experts=slots), logits)
            # a token budget reorders the rows into bins: the experts travel with their rows, and come back in
            # the caller's order
            budget, budget_routed = parallm.forward(chunks, ids[mine], mask[mine], routed_experts=given[mine],
                                                    max_tokens_per_microbatch=max(16, 4 * ids.shape[1] // 3),
                                                    return_routed_experts=True)
            res["budget"] = (budget - logits).abs()[mask[mine].bool()].max().item()
            res["budget_routed"] = torch.equal(budget_routed, routed)
        loss = parallm.forward_backward(chunks, {"input_ids": ids[mine], "attention_mask": mask[mine],
                                                 "routed_experts": given[mine]}, loss_fn=lambda o, mb: nll_sum(
                                                     o, mb["input_ids"], mb["attention_mask"]), num_microbatches=2)
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
        res["loss"] = loss.item()
        res["state"] = parallm.save_hf_weights(chunks)
        if case.get("errors"):      # clear errors, on every rank
            b, s, layers, k = given[mine].shape
            bad_id = given[mine].clone()
            row = 0 if mask[mine][0, 0] else 1
            col = int(mask[mine][row].nonzero()[0])
            bad_id[row, col, layers - 1, 0] = 99
            dup = given[mine].clone()
            dup[row, col, 0, 1] = dup[row, col, 0, 0]
            res["errors"] = {
                "layers": errors_of(lambda: parallm.forward(chunks, ids[mine], mask[mine],
                                                            routed_experts=given[mine][:, :, :1])),
                "top_k": errors_of(lambda: parallm.forward(chunks, ids[mine], mask[mine],
                                                           routed_experts=given[mine][..., :1])),
                "range (rank 1 only)": errors_of(lambda: parallm.forward(
                    chunks, ids[mine], mask[mine], routed_experts=bad_id if rank == 1 else given[mine])),
                "repeated": errors_of(lambda: parallm.forward_backward(
                    chunks, ids[mine], mask[mine], loss_fn=nll_sum, routed_experts=dup)),
                "twice": errors_of(lambda: parallm.forward(chunks, {"input_ids": ids[mine],
                                                                    "routed_experts": given[mine]},
                                                           routed_experts=given[mine])),
                "float": errors_of(lambda: parallm.forward(chunks, ids[mine], mask[mine],
                                                           routed_experts=given[mine].float())),
            }
            dense = parallm.build_model(helpers.tiny_config("qwen2"))
            res["errors"]["dense"] = errors_of(lambda: parallm.forward(dense, ids[mine] % 101, mask[mine],
                                                                       return_routed_experts=True))
        if lay.cp > 1:     # every rank of a CP group must pass the same experts (at real positions)
            other = given[mine].clone()
            row = 0 if mask[mine][0, 0] else 1
            col = int(mask[mine][row].nonzero()[0])
            other[row, col, 0] = other[row, col, 0].flip(0)
            res["cp_differs"] = errors_of(lambda: parallm.forward(
                chunks, ids[mine], mask[mine], routed_experts=other if lay.cp_rank == 1 else given[mine]))
            padding_only = given[mine].clone()
            padding_only[~mask[mine].bool()] = 3 if lay.cp_rank == 1 else -7
            res["cp_padding_only"] = errors_of(lambda: parallm.forward(chunks, ids[mine], mask[mine],
                                                                       routed_experts=padding_only))
        out[key] = res
        parallm.destroy_parallel()
    return out


def dsa_batch(model, layers, k, num_experts):
    """(ids, mask, given experts, margin, dense): the first of a few seeded batches of DSA_LENGTHS rows whose
    top-k boundary gaps are all at least MARGIN, under transformers' own routing and under the replayed experts
    (which change the hidden states the later indexers score), and how far transformers' dense attention (every
    key kept) moves the replayed logits."""
    for seed in range(12):
        ids, mask = batch(model.config.vocab_size, DSA_LENGTHS, seed=30 + seed)
        given = random_experts(*ids.shape, layers, k, num_experts, seed=40 + seed)
        given[~mask.bool()] = -5
        margin = topk_margin(model, ids, mask)
        if margin < MARGIN:
            continue
        with routing(model, given, mask):
            margin = min(margin, topk_margin(model, ids, mask))
        if margin < MARGIN:
            continue
        dense = copy.deepcopy(model)
        for m in dense.modules():
            if hasattr(m, "index_topk"):
                m.index_topk = 10 * ids.shape[1]
        with torch.no_grad(), routing(model, given, mask), routing(dense, given, mask):
            sparse_logits = model(input_ids=ids, attention_mask=mask).logits
            dense_logits = dense(input_ids=ids, attention_mask=mask).logits
        return ids, mask, given, margin, (sparse_logits - dense_logits).abs()[mask.bool()].max().item()
    raise AssertionError(f"no batch among 12 without a top-k near-tie (relative gap < {MARGIN})")


@pytest.mark.timeout(900)
def test_router_replay_matches_transformers(tmp_path):
    cases, refs, data = {}, {}, {}
    for i, (model_name, make) in enumerate(MODELS.items()):
        cfg = make()
        model = helpers.make_hf_model(cfg, seed=70 + i)
        if model_name != "qwen3-moe":
            set_selection_bias(model, seed=8)
        ckpt = helpers.save_checkpoint(model, str(tmp_path / f"m{i}"))
        layers, k = len(moe_gates(model)), cfg.num_experts_per_tok
        num_experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        if "dsa" in model_name:
            ids, mask, given, margin, dense = dsa_batch(model, layers, k, num_experts)
            print(f"{model_name}: top-k margin {margin:.1e}, dense attention moves the replayed logits by "
                  f"{dense:.2f}")
            assert dense > 1e-2, dense                   # the selection matters
        else:
            ids, mask = batch(cfg.vocab_size)
            given = random_experts(*ids.shape, layers, k, num_experts, seed=11 + i)
            given[~mask.bool()] = -5            # padding positions: ignored
        coef = COEF if model_name == "qwen3-moe" else 0.0
        ref = reference(model, ids, mask, given, coef, str(tmp_path / f"r{i}"))
        # the replayed experts differ from the router's own choice at most (token, layer) of the real tokens
        real = mask.bool()
        same = (given.sort(-1).values == ref["own"].sort(-1).values).all(-1)[real]
        assert same.float().mean() < 0.5, same.float().mean()
        assert ref["moved"] > 1e-4, ref["moved"]        # the router is trained through the replayed weights
        refs[model_name] = ref
        data[model_name] = (ids, mask, given)
        for j, (layout_name, layout) in enumerate(MODEL_LAYOUTS[model_name].items()):
            cases[f"{model_name} {layout_name}"] = dict(ckpt=ckpt, model=model_name, errors=i == 0 and j == 0,
                                                        **layout)
    res = helpers.run_ranks(rank_fn, 4, cases, data, timeout=880)
    print()
    for key, case in cases.items():
        ref = refs[case["model"]]
        ids, mask, given = data[case["model"]]
        real = mask.bool()
        worst = {"replayed": 0.0, "plain": 0.0}
        for rank, r in enumerate(res):
            got = r[key]
            mine = slice(4 * got["dp_rank"], 4 * got["dp_rank"] + 4)
            m = real[mine]
            for name in worst:
                worst[name] = max(worst[name], (got[name] - ref[name][mine]).abs()[m].max().item())
            # what the trainer routed with: the given experts (replay) / transformers' top-k (as sets), -1 at
            # padding
            assert torch.equal(got["replayed_routed"][m], given[mine][m]), key
            assert torch.equal(got["own"][m].sort(-1).values, ref["own"][mine][m].sort(-1).values), key
            assert (got["replayed_routed"][~m] == -1).all() and (got["own"][~m] == -1).all(), key
            assert got["round_trip"], key
            assert got.get("all_layers", True), key
            assert got["budget"] < 1e-5 and got["budget_routed"], (key, got["budget"])
            if case["layout"].get("cp"):
                assert "must pass the same batch" in got["cp_differs"] and "routed_experts" in got["cp_differs"], \
                    got["cp_differs"]
                assert got["cp_padding_only"] is None, got["cp_padding_only"]     # padding values are ignored
            assert abs(got["loss"] - ref["loss"]) < TOL, (key, got["loss"], ref["loss"])
        state = res[0][key]["state"]
        assert state.keys() == ref["state"].keys(), sorted(set(state) ^ set(ref["state"]))
        step = max((state[k] - ref["state"][k]).abs().max().item() for k in ref["state"])
        print(f"{key:<28} logits replayed {worst['replayed']:.1e} plain {worst['plain']:.1e} weights after "
              f"the step {step:.1e}")
        assert worst["replayed"] < 1e-5 and worst["plain"] < 1e-5, (key, worst)
        assert step < TOL, (key, step)
        if case["errors"]:
            for r in res:
                errs = r[key]["errors"]
                assert "1 MoE layers given, the model has 2:" in errs["layers"] or \
                    errs["layers"].endswith("1 MoE layers given, the model has 2"), errs
                assert "top_k 1 given" in errs["top_k"], errs
                assert "[0, 4)" in errs["range (rank 1 only)"] and "99" in errs["range (rank 1 only)"], errs
                assert "repeats an expert" in errs["repeated"], errs
                assert "given twice" in errs["twice"], errs
                assert "must be an integer tensor, got torch.float32" in errs["float"], errs
                assert "has no mixture-of-experts layers" in errs["dense"], errs

