"""Gemma 4's MoE block (``enable_moe_block``, the 26B-A4B shape; docs/families.md "Gemma 4") against transformers
5.25's ``Gemma4ForCausalLM`` in fp32, through tests/layout_harness.py.

The tiny model is test_gemma4.py's 4 layers (sliding / full alternating, the full layers' own head shape, K = V)
with the MoE block on every layer: 4 experts of width 16, top-2, beside each layer's dense MLP of width 32. The
router's weights are scaled up (logits of order 1: clear top-k choices, no near-ties that rounding could flip), its
``scale`` around 1 and ``per_expert_scale`` in [0.5, 1.5] (transformers initialises it to ones: a model that
ignored it would pass).

Without a process group: config -> spec, the table against ``save_pretrained``'s names and shapes, the refusals.
One 2-rank spawn: tp2 padded (step on logits, breaks), tp2 ep2 packed + SP (log-probs and entropy, a step on them),
ep2 (dp2) padded, pp2 mb2, cp2 packed. Breaks that must move the logits (tp2): ``per_expert_scale`` ignored, the
router fed the experts' normed input instead of the residual, the two outputs' norms swapped.
"""

from __future__ import annotations

import pytest
import torch

import helpers
import layout_harness
from test_gemma4 import GEMMA4

TOL = 2e-5
SEQ = 12
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16, attention_k_eq_v=True,
           num_global_key_value_heads=1)


def moe_config(**overrides):
    import transformers
    base = {k: v for k, v in GEMMA4.items() if k != "per_layer_config"}
    return transformers.Gemma4TextConfig(**dict(base, global_head_dim=32, **dict(MOE, **overrides)))


def make_model(seed: int, **overrides):
    import transformers
    model = transformers.Gemma4ForCausalLM(moe_config(**overrides))
    helpers.randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in model.named_buffers():      # transformers' layer scalars are ones: make ignoring them visible
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):      # test_gemma4.py says why
                p.mul_(0.5)
            elif name.endswith("router.proj.weight"):     # logits of order 1: clear choices
                p.mul_(40.0)
            elif name.endswith("router.scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model.eval()


def test_spec_table_and_refusals(tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes, stacked_saves, all_entries
    spec, family = spec_from_config(moe_config())
    moe = spec.moe
    assert family.name == "gemma4" and moe.beside_mlp and moe.router == "gemma4" and moe.activation == "gelu_tanh"
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.layers) == (4, 2, 16, (0, 1, 2, 3))
    assert spec.intermediate_size == 32 and spec.hidden_act == "gelu_pytorch_tanh" and spec.global_k_eq_v
    hub = helpers.hub_state_dict(make_model(0), str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    stacked = stacked_saves(all_entries(family.table, spec, task="causal_lm", pp=1))
    saved = {stacked[n][0] if n in stacked else n for n in shapes}       # the names a save writes
    assert saved == set(hub), sorted(saved ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items() if k in hub)
    assert shapes["model.layers.2.experts.3.gate_up_proj"] == (32, 64) == tuple(hub[
        "model.layers.2.experts.gate_up_proj"].shape[1:])
    assert shapes["model.layers.2.experts.3.down_proj"] == (64, 16)
    for bad, match in ((dict(num_experts=None), "num_experts=None"),
                       (dict(top_k_experts=5), "top_k_experts=5 exceeds num_experts=4"),
                       (dict(moe_intermediate_size=0), "moe_intermediate_size=0")):
        with pytest.raises(ValueError, match=match):
            spec_from_config(moe_config(**bad))
    from parallm.model.spec import check_tp
    with pytest.raises(ValueError, match="moe_intermediate_size=15 is not divisible by tp=2"):
        check_tp(spec_from_config(moe_config(moe_intermediate_size=15))[0], 2)


def test_inspect_describes_the_moe_block(tmp_path, capsys):
    import parallm
    from parallm.cli import main
    ckpt = str(tmp_path / "m")
    make_model(0).save_pretrained(ckpt)
    report = parallm.inspect_checkpoint(ckpt, tp=2, ep=2)
    moe = report["moe"]
    assert moe["router"] == "gemma4" and moe["beside_mlp"] and moe["activation"] == "tanh GELU"
    assert moe["tensors_per_layer"] == 10 and moe["experts"] == 4 and report["problem"] is None
    assert report["config"]["global_head_dim"] == 32 and report["config"]["rotary_dim"] is None
    assert main(["inspect", ckpt]) == 0
    text = capsys.readouterr().out
    assert "beside the layer's dense MLP, router on the residual" in text and "tanh GELU" in text, text
    assert "full layers' head dim 32" in text and "rotary 32 of 16" not in text, text


CASES = [      # (name, layout, build, loss on, world)
    ("tp2 padded, step on logits, breaks", dict(tp=2), dict(), "logits", 2),
    ("dp2 ep2 padded, step on logits", dict(ep=2), dict(), "logits", 2),
    ("pp2 padded mb2, step on logits", dict(pp=2, nmb=2), dict(), "logits", 2),
    ("pp2 vpp2 padded mb2, step on logits", dict(pp=2, vpp=2, nmb=2), dict(), "logits", 2),
    ("cp2 packed, logprobs+entropy, step on them", dict(cp=2), dict(packed=True), "stats", 2),
    ("tp2 ep2 (dp2) packed+SP, logprobs+entropy, step on them", dict(tp=2, ep=2),
     dict(packed=True, sequence_parallel=True), "stats", 4),
]


def make_cases(tmp_path, world: int):
    cases = []
    for i, (name, layout, build, loss_on, w) in enumerate(CASES):
        if w != world:
            continue
        model, (ids, mask) = make_model(seed=40 + i), helpers.padded_batch(101, batch=4, seq=SEQ, seed=i)
        cases.append(layout_harness.make_case(name, model, tmp_path, i, ids, mask, layout=layout, build=build,
                                              loss_on=loss_on, world=world, breaks="breaks" in name))
    return cases


def _router_on_normed(block):
    """A break: the router reads the experts' input (``pre_feedforward_layernorm_2`` of the residual)."""
    from parallm.model.layers.moe import MoEBlock

    def forward(h, tokens=None, routed=None, token_ids=None, residual=None):
        normed = block.pre_norm_2(residual)
        moe = MoEBlock.forward(block, normed, tokens, routed, token_ids, router_x=normed)
        return block.out_norm_1(block.dense(h)) + block.out_norm_2(moe)
    return forward


def _breaks(chunks, case) -> dict:
    import parallm
    from parallm.model.layers.moe_beside import DenseBesideMoE
    ids, mask, out = case["ids"], case["mask"], {}
    blocks = [m for c in chunks for m in c.modules() if isinstance(m, DenseBesideMoE)]
    assert blocks
    for key in ("per_expert_scale", "router_input", "norms_swapped"):
        saved = [b.router.per_expert_scale.detach().clone() for b in blocks]
        for b in blocks:
            if key == "per_expert_scale":
                with torch.no_grad():
                    b.router.per_expert_scale.fill_(1.0)
            elif key == "router_input":
                b.forward = _router_on_normed(b)
            else:
                b.out_norm_1, b.out_norm_2 = b.out_norm_2, b.out_norm_1
        try:
            out[key] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
        finally:
            for b, s in zip(blocks, saved):
                with torch.no_grad():
                    b.router.per_expert_scale.copy_(s)
                if key == "router_input":
                    del b.forward
                elif key == "norms_swapped":
                    b.out_norm_1, b.out_norm_2 = b.out_norm_2, b.out_norm_1
    return out


def rank_cases(rank, world, cases):
    return layout_harness.rank_cases(rank, world, cases, breaks=_breaks)


@pytest.mark.timeout(900)
def test_gemma4_moe_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path, 2)
    results = helpers.run_ranks(rank_cases, 2, cases, timeout=600)
    layout_harness.check(cases, results, tol=TOL, break_min=1e-2)
    for key in ("break_per_expert_scale", "break_router_input", "break_norms_swapped"):
        assert key in results[0][0], key


@pytest.mark.timeout(900)
def test_gemma4_moe_tp2_ep2_packed_sp(tmp_path):
    cases = make_cases(tmp_path, 4)
    results = helpers.run_ranks(rank_cases, 4, cases, timeout=600)
    layout_harness.check(cases, results, tol=TOL)


# -- router replay --------------------------------------------------------------------------------------------------

def _hf_replayed(model, ids, mask, given):
    """transformers' logits with every layer's router made to route with ``given`` ``[B, S, L, k]`` (weights: the
    router's probabilities of those experts renormalised, times ``per_expert_scale``, as parallm replays), and
    transformers' own choices ``[B, S, L, k]`` of the plain forward."""
    from parallm.verify.reference import hf_output
    b, s = ids.shape
    own, originals = [], []
    for i, layer in enumerate(model.model.layers):
        router, original = layer.router, layer.router.forward
        originals.append((router, original))

        def replay(h, router=router, original=original, i=i):
            probs, _, _ = original(h)
            idx = given[:, :, i].reshape(b * s, -1)
            w = probs.gather(1, idx)
            return probs, w / w.sum(-1, keepdim=True) * router.per_expert_scale[idx], idx
        router.forward = replay
    try:
        with torch.no_grad():
            replayed = hf_output(model, ids, mask)
    finally:
        for router, _ in originals:
            del router.forward
    hooks = [layer.router.register_forward_hook(lambda m, i, o: own.append(o[2].view(b, s, -1)))
             for layer in model.model.layers]
    with torch.no_grad():
        hf_output(model, ids, mask)
    for h in hooks:
        h.remove()
    return replayed, torch.stack(own, dim=2)


def rank_replay(rank, world, ckpt, ids, mask, given):
    import parallm
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt, sequence_parallel=True, packed=True)
    parallm.load_hf_weights(chunks, ckpt)
    with torch.no_grad():
        replayed = parallm.forward(chunks, ids, mask, routed_experts=given)
        _, own = parallm.forward(chunks, ids, mask, return_routed_experts=True)
    parallm.destroy_parallel()
    return replayed, own


@pytest.mark.timeout(600)
def test_router_replay_against_transformers(tmp_path):
    model, (ids, mask) = make_model(seed=50), helpers.padded_batch(101, batch=4, seq=SEQ, seed=9)
    g = torch.Generator().manual_seed(9)
    b, s, n_layers = ids.shape[0], ids.shape[1], len(model.model.layers)
    given = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(b * s * n_layers)]).view(b, s, n_layers, 2)
    ref, hf_own = _hf_replayed(model, ids, mask, given)
    with torch.no_grad():
        from parallm.verify.reference import hf_output
        plain = hf_output(model, ids, mask)
    ckpt = str(tmp_path / "m")
    model.save_pretrained(ckpt)
    (replayed, own), _ = helpers.run_ranks(rank_replay, 2, ckpt, ids, mask, given, timeout=300)
    real = mask.bool()
    diff, moved = helpers.max_diff_real(replayed, ref, mask), helpers.max_diff_real(ref, plain, mask)
    print(f"\nreplayed logits vs transformers routed alike: {diff:.1e} (replay moves transformers' logits {moved:.1e})")
    assert diff < TOL and moved > 1e-2
    assert torch.equal(own[real].sort(-1).values, hf_own[real].sort(-1).values)
    assert bool((own[~real] == -1).all())


def test_wrapper_with_the_moe_block_table(tmp_path):
    """The ``gemma4`` wrapper (Gemma4ForConditionalGeneration, what the 26B-A4B checkpoint is) over the MoE text
    config: its table names the checkpoint's language-model tensors (experts stacked) and carries the tower."""
    import transformers
    from parallm.families import spec_from_config
    from parallm.model.table import all_entries, expected_hf_shapes, stacked_saves
    from test_gemma4_features import VISION
    cfg = transformers.Gemma4Config(text_config=moe_config().to_dict(), vision_config=VISION, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(cfg)
    helpers.randomize_(model, seed=3)
    spec, family = spec_from_config(model.config)
    assert family.name == "gemma4_vl" and spec.moe is not None and spec.moe.beside_mlp
    hub = helpers.hub_state_dict(model, str(tmp_path / "w"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    stacked = stacked_saves(all_entries(family.table, spec, task="causal_lm", pp=1))
    saved = {stacked[n][0] if n in stacked else n for n in shapes}
    assert saved == set(hub), sorted(saved ^ set(hub))[:6]
    assert "model.language_model.layers.1.experts.gate_up_proj" in hub
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items() if k in hub)
