"""``build_model(recompute="moe" / "selective")`` (model/recompute.py): the same loss and gradients as without
recomputation.

Without a process group: the routed experts recomputed chunk by chunk (model/layers/moe_recompute.py) against the
experts' own autograd, every activation / layout / bias / kernel, an expert with no rows, one chunk and one
expert a chunk, bit for bit (outputs and every gradient); the token form (rows gathered from the tokens again in
the backward) against ``slots_of`` + the experts, bit for bit; DeepSeek-V4's hyper-connections recomputed in
token pieces: outputs and gradients within 1e-6 relative (a piece's small GEMM may round differently from the
whole's; the parameters' gradients are sums over the pieces). Breaks that must fail: chunks given the wrong
experts' slabs, the pieces concatenated out of order.

Two gloo ranks: a tiny DeepSeek-V4 (hash and routed layers, the shared expert, hyper-connections, CSA / HCA
attention) at tp1 (dp2), tp2, ep2 (dp2) and tp2 packed + SP, and Qwen2-MoE (shared expert with its gate) at
tp2, ep2 and tp2 packed + SP: one
training step with each option against the same step without recomputation: the loss and every gradient bit for
bit; and V4 at tp2 with its hyper-connections recomputed in pieces of 5 tokens: the loss within 1e-6 relative,
the gradients within 1e-6 absolute (see the note at HC_TOL). A dense model refuses ``"moe"``. One rank: GLM-5
with shared indexer layers (DeepSeek sparse attention, MoE): the step bit for bit with each option, the shared
selections held for the attention replays under ``"selective"`` and none left after the backward.
"""

from __future__ import annotations

import pytest
import torch

import helpers

HC_NAMES = ("attn_hc.", "ffn_hc.", "hc_head.")
HC_TOL = 1e-6
# A whole V4 model with its hyper-connections in several pieces: the streams' gradient gets the pieces' terms
# (norm and collapse) already summed before the stream mix's joins them (another association), and the pieces'
# GEMMs may round differently: gradients within HC_TOL absolute (their entries are <= ~0.1 here; relative to a
# tensor's largest entry up to 1.7e-5 for hc_head.hc_base, a sum over tokens that mostly cancels).


# -- the routed experts, recomputed ---------------------------------------------------------------------------

EXPERT_CASES = [
    dict(layout="rows", activation="silu"),
    dict(layout="rows", activation="clamped_silu", limit=0.5),
    dict(layout="interleaved_columns", activation="clamped_swiglu", bias=True, limit=0.7, alpha=1.702),
    dict(layout="rows", activation="relu2"),
    dict(layout="rows", activation="gelu_tanh", bias=True),
]
COUNTS = [5, 0, 7, 3]


def make_experts(case, kernel, seed=0):
    from parallm.model.layers.moe import Experts
    experts = Experts(len(COUNTS), 32, 16, torch.float32, "cpu", **case)
    experts.kernel = kernel
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return experts


def run_experts(experts, rows, grad, counts=COUNTS):
    experts.zero_grad(set_to_none=True)
    x = rows.clone().requires_grad_()
    out = experts(x, counts, torch.tensor(counts))
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}


def _inputs(counts=COUNTS, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), 32, generator=g)
    return rows, torch.randn(sum(counts), 32, generator=g)


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
@pytest.mark.parametrize("budget", [1, 1 << 22])        # one expert a chunk; all in one chunk
@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"{c['layout']}-{c['activation']}")
def test_recomputed_experts_are_bit_identical(case, kernel, budget, monkeypatch):
    from parallm.model.layers import moe_recompute
    monkeypatch.setattr(moe_recompute, "CHUNK_ELEMENTS", budget)
    experts = make_experts(case, kernel)
    rows, grad = _inputs()
    want = run_experts(experts, rows, grad)
    experts.recompute = True
    got = run_experts(experts, rows, grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name
    assert got[2]["linear_fc1.weight"][1].count_nonzero() == 0       # the expert without rows: zero gradient


def test_experts_recompute_only_under_grad_and_not_for_adapters():
    from parallm.model.layers.moe import Experts
    experts = make_experts(EXPERT_CASES[0], "loop")
    experts.recompute = True
    assert experts.recomputes()
    with torch.no_grad():
        assert not experts.recomputes()

    class Adapted(Experts):           # an adapter overriding project (LoraExperts does) keeps the default path
        def project(self, x, part, groups):
            return super().project(x, part, groups)
    experts.__class__ = Adapted
    assert not experts.recomputes()


def test_chunks_given_the_wrong_slabs_must_fail(monkeypatch):
    """Break: each chunk's rows computed with the next expert's slab of the weights (equal counts, so the shapes
    agree): the gradients must differ from the default path's."""
    from parallm.model.layers import moe_recompute
    real = moe_recompute.expert_chunks

    def shifted(counts, per_row, budget=None):
        n = len(counts)
        for a, b, r0, r1 in real(counts, per_row, 1):
            yield (a + 1) % n, (a + 1) % n + 1, r0, r1
    counts = [4, 4, 4, 4]
    experts = make_experts(EXPERT_CASES[0], "loop")
    rows, grad = _inputs(counts)
    want = run_experts(experts, rows, grad, counts)
    experts.recompute = True
    monkeypatch.setattr(moe_recompute, "expert_chunks", shifted)
    got = run_experts(experts, rows, grad, counts)
    assert torch.equal(got[0], want[0])               # the forward is not chunked
    assert not torch.equal(got[1], want[1])
    assert not torch.equal(got[2]["linear_fc1.weight"], want[2]["linear_fc1.weight"])


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_token_form_equals_slots_of_and_experts(kernel, monkeypatch):
    from parallm.model.layers import moe_recompute
    from parallm.parallel.experts import expert_counts, slots_of, sort_slots, weighted_sum
    monkeypatch.setattr(moe_recompute, "CHUNK_ELEMENTS", 200)      # a few experts a chunk
    experts = make_experts(EXPERT_CASES[1], kernel)
    g = torch.Generator().manual_seed(3)
    n, k = 9, 2
    tokens0 = torch.randn(n, 32, generator=g)
    choices = torch.stack([torch.randperm(3, generator=g)[:k] for _ in range(n)])    # expert 3: no rows
    weights0 = torch.rand(n, k, generator=g)
    grad = torch.randn(n, 32, generator=g)
    slots, sorted_experts = sort_slots(choices)
    counts_device = expert_counts(sorted_experts, len(COUNTS))
    counts = counts_device.tolist()

    def run(token_form):
        experts.zero_grad(set_to_none=True)
        tokens, weights = tokens0.clone().requires_grad_(), weights0.clone().requires_grad_()
        if token_form:
            rows = moe_recompute.recomputed_token_experts(experts, tokens, slots, counts, counts_device)
        else:
            rows = experts(slots_of(tokens, slots), counts, counts_device)
        out = weighted_sum(rows, weights, slots)
        out.backward(grad)
        return [out.detach(), tokens.grad, weights.grad] + [p.grad.clone() for p in experts.parameters()]
    want = run(False)
    experts.recompute = True
    got = run(True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# -- DeepSeek-V4's hyper-connections, recomputed in token pieces ---------------------------------------------

def _hc_modules(seed=0):
    from parallm.model.layers.hyper_connections import HyperConnection, HyperHead
    hc = HyperConnection(16, 3, sinkhorn_iters=4, eps=1e-6, norm_eps=1e-6)
    head = HyperHead(16, 3, eps=1e-6, norm_eps=1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in (hc, head):
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.numel() <= 3 else 0.0))
    return hc, head


def _hc_run(hc, head, streams0, grads):
    hc.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    streams = streams0.clone().requires_grad_()
    post, comb, collapsed = hc(streams)
    out = head(streams.flatten(-2))
    loss = (post * grads[0]).sum() + (comb * grads[1]).sum() + (collapsed * grads[2]).sum() + (out * grads[3]).sum()
    loss.backward()
    params = {f"hc.{n}": p.grad.clone() for n, p in hc.named_parameters()}
    params.update({f"head.{n}": p.grad.clone() for n, p in head.named_parameters()})
    return [post.detach(), comb.detach(), collapsed.detach(), out.detach(), streams.grad], params


def _hc_inputs():
    g = torch.Generator().manual_seed(5)
    s, b, n, h = 11, 2, 3, 16
    streams = torch.randn(s, b, n, h, generator=g)
    return streams, [torch.randn(s, b, n, generator=g), torch.randn(s, b, n, n, generator=g),
                     torch.randn(s, b, h, generator=g), torch.randn(s, b, h, generator=g)]


def test_hyper_connections_recomputed_in_pieces(monkeypatch):
    from parallm.model.layers import hyper_connections
    monkeypatch.setattr(hyper_connections, "CHUNK_ELEMENTS", 3 * 2 * 3 * 16)    # pieces of 3 tokens (11 = 3+3+3+2)
    hc, head = _hc_modules()
    streams, grads = _hc_inputs()
    want, want_p = _hc_run(hc, head, streams, grads)
    hc.recompute = head.recompute = True
    got, got_p = _hc_run(hc, head, streams, grads)
    errs = [_rel(a, b) for a, b in zip(got, want)] + [_rel(got_p[n], want_p[n]) for n in want_p]
    assert max(errs) <= HC_TOL, errs
    hc.recompute = head.recompute = False       # and the default path is the default path
    again, again_p = _hc_run(hc, head, streams, grads)
    assert all(torch.equal(a, b) for a, b in zip(again, want))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_pieces_out_of_order_must_fail(monkeypatch):
    """Break: the pieces' outputs concatenated in reverse order: the outputs must differ."""
    from parallm.model.layers import hyper_connections
    monkeypatch.setattr(hyper_connections, "CHUNK_ELEMENTS", 3 * 2 * 3 * 16)
    hc, head = _hc_modules()
    streams, grads = _hc_inputs()
    want, _ = _hc_run(hc, head, streams, grads)
    real_cat = torch.cat
    monkeypatch.setattr(hyper_connections.torch, "cat", lambda parts, dim=0: real_cat(list(parts)[::-1], dim))
    hc.recompute = head.recompute = True
    got, _ = _hc_run(hc, head, streams, grads)
    assert not torch.equal(got[2], want[2])


# -- whole models on two ranks --------------------------------------------------------------------------------

def _step(ckpt, recompute, ids, mask, build):
    import parallm
    from parallm.verify.reference import causal_lm_loss
    chunks = parallm.build_model(ckpt, recompute=recompute, **build)
    parallm.load_hf_weights(chunks, ckpt)
    loss = parallm.forward_backward(chunks, ids, mask, loss_fn=causal_lm_loss)
    grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()
             if p.grad is not None}
    return float(loss), grads


def rank_models(rank, world, cases):
    import parallm
    out = []
    from parallm.model.layers import hyper_connections
    whole = hyper_connections.CHUNK_ELEMENTS
    for name, ckpt, ids, mask, layout, build, piece in cases:
        parallm.init_parallel(**layout)
        hyper_connections.CHUNK_ELEMENTS = piece or whole
        try:
            loss0, grads0 = _step(ckpt, None, ids, mask, build)
            for option in ("moe", "selective"):
                loss, grads = _step(ckpt, option, ids, mask, build)
                assert set(grads) == set(grads0)
                differ = [n for n in grads0 if not torch.equal(grads[n], grads0[n])]
                worst = max([(grads[n] - grads0[n]).abs().max().item() for n in differ], default=0.0)
                out.append((name, option, abs(loss - loss0) / abs(loss0), len(differ), worst, len(grads0)))
        finally:
            hyper_connections.CHUNK_ELEMENTS = whole
            parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_models_step_equal_with_and_without_recompute(tmp_path):
    from test_deepseek_v4 import make_model, right_padded_batch, v4_config
    cases = []
    v4 = v4_config()
    model = make_model(v4, seed=3)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "v4"))
    ids, mask = right_padded_batch(v4.vocab_size, batch=4, seq=16, seed=4)
    sp = dict(packed=True, sequence_parallel=True)
    for layout, build in ((dict(tp=1), {}), (dict(tp=2), {}), (dict(ep=2), {}), (dict(tp=2), sp)):
        cases.append((f"deepseek_v4 {layout} {build}", ckpt, ids, mask, layout, build, None))
    # hyper-connections in pieces of 5 tokens (16 = 5 + 5 + 5 + 1; a token's streams: batch 4 x 2 x 32)
    cases.append(("deepseek_v4 tp2 pieces", ckpt, ids, mask, dict(tp=2), {}, 5 * 4 * 2 * 32))
    qwen = helpers.tiny_config("qwen2_moe", num_hidden_layers=2)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(qwen, seed=5), str(tmp_path / "qwen2_moe"))
    ids, mask = helpers.padded_batch(qwen.vocab_size, seed=6, batch=4, seq=9)
    for layout, build in ((dict(tp=2), {}), (dict(ep=2), {}), (dict(tp=2), sp)):
        cases.append((f"qwen2_moe {layout} {build}", ckpt, ids, mask, layout, build, None))
    results = helpers.run_ranks(rank_models, 2, cases, timeout=560)
    worst_pieces = 0.0
    for rank_results in results:
        for name, option, dloss, differ, worst, count in rank_results:
            assert count > 20, (name, count)
            if not name.endswith("pieces"):          # bit for bit
                assert dloss == 0.0 and differ == 0, (name, option, dloss, differ, worst)
            else:
                assert dloss <= HC_TOL and worst <= HC_TOL, (name, option, dloss, worst)
                worst_pieces = max(worst_pieces, worst)
    assert worst_pieces > 0          # the pieces were taken (they round differently)
    print(f"DeepSeek-V4, hyper-connections in pieces: worst gradient difference {worst_pieces:.2e}")


def test_moe_option_refused_for_a_dense_model(world_of_one, tmp_path):
    import parallm
    cfg = helpers.tiny_config("qwen3")
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=0), str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="recompute='moe'"):
        parallm.build_model(ckpt, recompute="moe")
    with pytest.raises(ValueError, match="recompute must be one of"):
        parallm.build_model(ckpt, recompute="attention")


@pytest.mark.parametrize("option", ["moe", "selective"])
def test_shared_indexer_selections_under_recompute(world_of_one, tmp_path, option):
    """GLM-5 with shared indexer layers (a layer reusing an earlier layer's top-k selection, kept on the layer
    context for it): under ``"selective"`` the readers' attention replays read the selection in the backward and
    the source's replay takes it back; the step equals the one without recomputation, bit for bit, and nothing
    is left on the context."""
    from test_dsa_memory import _held_at_loss
    from test_dsa_parts import glm5_config
    cfg = glm5_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=3), str(tmp_path / "glm5"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, seed=2, batch=2, seq=40)     # 40 > top-k 16: sparse
    plain = _held_at_loss(ckpt, ids, mask, recompute=None)
    got = _held_at_loss(ckpt, ids, mask, recompute=option)
    assert got[1] == {}, got[1]
    if option == "selective":
        assert set(got[0]) == {0, 2}          # held for the replays of the layers reading them
    assert float(got[2]) == float(plain[2])
    for name, g in plain[3].items():
        assert torch.equal(g, got[3][name]), name
