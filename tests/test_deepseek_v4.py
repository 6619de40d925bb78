"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) against transformers 5.25 in fp32, in every layout (docs/families.md).

The tiny model switches every feature on: 4 layers sliding / CSA / HCA / CSA (window 4, CSA pools every 2
tokens over overlapping windows of 4, HCA every 4; the indexer keeps 3 of up to 8 compressed keys, so the
selection matters), 2 hyper-connection streams (non-trivial mixing: ``scale`` around 1), hash layers 0 and 2
(random token -> expert tables) and routed layers 1 and 3 (sqrtsoftplus with a correction bias N(0, 0.3)),
the clamped SwiGLU with a limit the activations cross, sinks N(0, 1), every weight non-trivial. Rows are full or
right-padded (left padding is refused: transformers aligns the compressor's pools to the padded row).

Without a process group: config -> spec, the table against ``save_pretrained``'s names, refusals. One spawn of
4 ranks: tp2 padded + recompute (with breaks that must move the logits: Sinkhorn off by one, the compressor's
pool shifted, a hash layer routed by its router), tp2·ep2 packed + SP, pp2 (the streams cross the stage
boundary) with 2 microbatches, pp2·vpp2, cp2 packed, tp2·cp2 packed + SP: logits, log-probs, entropy, a
bit-exact save and export, one SGD step (loss, gradient norm, every weight, the logits after it).
"""

from __future__ import annotations

import pytest
import torch

import helpers
import layout_harness

WORLD = 4
TOL = 2e-5
SEQ = 16
V4 = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=1, head_dim=16, q_lora_rank=8, partial_rotary_factor=0.5, n_routed_experts=4,
          num_experts_per_tok=2, hc_mult=2, hc_sinkhorn_iters=3, o_groups=2, o_lora_rank=8, index_n_heads=8,
          index_head_dim=8, index_topk=3, sliding_window=4, swiglu_limit=0.3, routed_scaling_factor=1.5,
          compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"],
          mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"], num_nextn_predict_layers=0,
          bos_token_id=None, eos_token_id=None)


def v4_config(**overrides):
    import transformers
    return transformers.DeepseekV4Config(**dict(V4, **overrides))


def make_model(cfg, *, seed: int):
    """:func:`helpers.make_hf_model` with what its randomisation leaves trivial made non-trivial: the
    hyper-connections' scales around 1, sinks N(0, 1), the correction bias N(0, 0.3), random hash tables (two
    distinct experts per token)."""
    model = helpers.make_hf_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("hc.scale", "hc_head.hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(p.shape[0])]))
    return model


def right_padded_batch(vocab: int, *, batch: int, seq: int, seed: int):
    """``[batch, seq]`` rows: full, and right-padded by 3, 6 and 1 (ids 0 at padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b, pad in enumerate((0, 3, 6, 1) * (batch // 4)):
        if pad:
            mask[b, seq - pad:] = 0
    return ids.masked_fill(mask == 0, 0), mask


# -- no process group ----------------------------------------------------------------------------------------

def test_config_spec_and_table(tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    cfg = v4_config()
    spec, family = spec_from_config(cfg)
    assert family.name == "deepseek_v4" and spec.v4.layer_kinds == ("sliding", "csa", "hca", "csa")
    assert spec.v4.hc_mult == 2 and spec.stream_width == 64 and spec.num_kv_heads == 1 and spec.head_dim == 16
    assert spec.v4.rope_dim == 8 and spec.v4.csa_rate == 2 and spec.v4.hca_rate == 4
    hub = helpers.hub_state_dict(make_model(cfg, seed=0), str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:8]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items()), \
        [(k, tuple(hub[k].shape), s) for k, s in shapes.items() if tuple(hub[k].shape) != s]
    for bad, match in ((dict(num_key_value_heads=2), "num_key_value_heads"),
                       (dict(attention_bias=True), "attention_bias")):
        with pytest.raises(ValueError, match=match):
            spec_from_config(v4_config(**bad))


def test_inspect_explains_the_layer_kinds(tmp_path, capsys):
    import parallm
    from parallm.cli import main
    ckpt = str(tmp_path / "m")
    make_model(v4_config(), seed=1).save_pretrained(ckpt)
    report = parallm.inspect_checkpoint(ckpt, tp=2, ep=2)
    v4 = report["config"]["deepseek_v4"]
    assert v4["pattern"] == "SCHC" and v4["hc_mult"] == 2 and v4["hash_layers"] == [0, 2] and v4["index_topk"] == 3
    assert main(["inspect", ckpt]) == 0
    text = capsys.readouterr().out
    assert "per layer SCHC" in text and "compressed sparse attention" in text, text
    assert "2 hyper-connection streams" in text and "hash routing" in text, text


# -- distributed -----------------------------------------------------------------------------------------------

# name, layout (tp, pp, vpp, cp, ep, nmb), build kwargs, breaks measured
CASES = [
    ("tp2 dp2 padded + recompute, breaks", dict(tp=2), {"recompute": "full"}, True),
    ("tp2 ep2 packed+SP", dict(tp=2, ep=2), {"packed": True, "sequence_parallel": True}, False),
    ("pp2 dp2 mb2 (streams cross the stage)", dict(pp=2, nmb=2), {}, False),
    ("pp2 vpp2 dp2 mb2", dict(pp=2, vpp=2, nmb=2), {}, False),
    ("cp2 dp2 ep2 packed", dict(cp=2, ep=2), {"packed": True}, False),
    ("tp2 cp2 packed+SP", dict(tp=2, cp=2), {"packed": True, "sequence_parallel": True}, False),
]


def cut_gap(model, ids, mask) -> float:
    """The smallest gap, over every CSA layer and query with more visible compressed keys than the top-k, between
    the k-th and the (k+1)-th indexer score in transformers' forward: the selection is only comparable across
    implementations (which sum in different orders) where it is not a near-tie (docs/families.md, DSA's ties)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    scores, original = [], hf.DeepseekV4IndexerScorer.forward

    def record(self, q, compressed, hidden):
        out = original(self, q, compressed, hidden)
        scores.append(out.detach())
        return out
    hf.DeepseekV4IndexerScorer.forward = record
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        hf.DeepseekV4IndexerScorer.forward = original
    k, rate, gap = model.config.index_topk, model.config.compress_rates["compressed_sparse_attention"], float("inf")
    for s in scores:
        for b, q in zip(*torch.nonzero(mask.bool(), as_tuple=True)):
            visible = s[b, q, :(int(q) + 1) // rate]
            if visible.numel() > k:
                top = visible.topk(k + 1).values
                gap = min(gap, float(top[k - 1] - top[k]))
    return gap


def make_cases(tmp_path):
    cases = []
    for i, (name, layout, build, breaks) in enumerate(CASES):
        for seed in range(90 + 10 * i, 100 + 10 * i):        # a model and batch without a near-tie at the cut
            model = make_model(v4_config(), seed=seed)
            ids, mask = right_padded_batch(V4["vocab_size"], batch=8, seq=SEQ, seed=seed)
            if cut_gap(model, ids, mask) > 1e-4:
                break
        else:
            raise AssertionError(f"{name}: no seed without a near-tie in the indexer's top-k")
        cases.append(layout_harness.make_case(name, model, tmp_path, i, ids, mask, layout=layout, build=build,
                                              world=WORLD, breaks=breaks))
    return cases


def _logit_diff(chunks, case) -> float:
    import parallm
    return helpers.max_diff_real(parallm.forward(chunks, case["ids"], case["mask"]), case["ref"], case["mask"])


def _sinkhorn_fewer(chunks, case) -> float:
    from parallm.model.layers.hyper_connections import HyperConnection
    hcs = [m for c in chunks for m in c.modules() if isinstance(m, HyperConnection)]
    for m in hcs:
        m.sinkhorn_iters -= 1
    try:
        return _logit_diff(chunks, case)
    finally:
        for m in hcs:
            m.sinkhorn_iters += 1


def _pool_shifted(chunks, case) -> float:
    """Every compressor pooling the windows one position later (tokens [e m + 1, (e + 1) m + 1))."""
    from parallm.model.layers import v4_compress
    original = v4_compress.V4Compressor.forward
    v4_compress.V4Compressor.forward = lambda self, x, lay, rope: original(self, torch.roll(x, -1, 0), lay, rope)
    try:
        return _logit_diff(chunks, case)
    finally:
        v4_compress.V4Compressor.forward = original


def _hash_by_router(chunks, case) -> float:
    """The hash layers choosing their experts by the router's top-k (no correction bias) instead of the token."""
    from parallm.model.layers.routing import ScoreRouter
    hashed = [m for c in chunks for m in c.modules() if isinstance(m, ScoreRouter) and m.is_hash]
    assert hashed, "no hash layer to break"
    for m in hashed:
        m.is_hash, m.e_score_correction_bias = False, torch.zeros(m.weight.shape[0])
    try:
        return _logit_diff(chunks, case)
    finally:
        for m in hashed:
            m.is_hash, m.e_score_correction_bias = True, None


def _breaks(chunks, case) -> dict:
    """How far each deliberate break moves the logits (each must move them past the tolerance)."""
    return dict(sinkhorn=_sinkhorn_fewer(chunks, case), pool=_pool_shifted(chunks, case),
                hash=_hash_by_router(chunks, case))


def rank_cases(rank, world, cases):
    return layout_harness.rank_cases(rank, world, cases, breaks=_breaks)


@pytest.mark.timeout(900)
def test_deepseek_v4_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, WORLD, cases)
    layout_harness.check(cases, results, tol=TOL)
    assert {"break_sinkhorn", "break_pool", "break_hash"} <= set(results[0][0])


def rank_bf16(rank, world, ckpt, ids, mask, ref):
    import parallm
    parallm.init_parallel(tp=world)
    chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
    parallm.load_hf_weights(chunks, ckpt)
    fp32 = sorted({n.split(".")[-2] + "." + n.split(".")[-1] for c in chunks for n, p in c.named_parameters()
                   if p.dtype == torch.float32})
    diff = helpers.max_diff_real(parallm.forward(chunks, ids, mask).float(), ref, mask)
    sd = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()
    return fp32, diff, {k: str(v.dtype) for k, v in sd.items()} if rank == 0 else None


@pytest.mark.timeout(600)
def test_bf16_keeps_transformers_fp32_modules(tmp_path):
    """bf16 at tp2: the modules transformers keeps in fp32 (hyper-connections, norms, sinks, position biases, the
    correction bias) are fp32 parameters, saved in fp32; against the fp32 model's logits, parallm's bf16 error is
    no larger than twice transformers' own bf16 error (bf16 rounding moves the indexer's top-k, so both drift)."""
    import transformers
    model = make_model(v4_config(), seed=5)
    ckpt = str(tmp_path / "m")
    model.save_pretrained(ckpt)
    ids, mask = right_padded_batch(V4["vocab_size"], batch=4, seq=SEQ, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    assert hf.model.layers[0].attn_hc.fn.dtype == torch.float32 and hf.model.norm.weight.dtype == torch.float32
    from parallm.verify.reference import hf_output
    with torch.no_grad():
        ref = hf_output(model, ids, mask)
        hf_error = helpers.max_diff_real(hf_output(hf, ids, mask).float(), ref, mask)
    results = helpers.run_ranks(rank_bf16, 2, ckpt, ids, mask, ref)
    fp32, diff, saved = results[0]
    for name in ("attn_hc.fn", "ffn_hc.scale", "hc_head.hc_fn", "input_layernorm.weight", "final_norm.weight",
                 "self_attention.sinks"):
        assert any(n.endswith(name.split(".", 1)[-1]) for n in fp32), (name, fp32)
    assert saved["model.layers.1.hc_attn_fn"] == "torch.float32" and saved["model.norm.weight"] == "torch.float32"
    assert saved["model.layers.1.attn.wq_a.weight"] == "torch.bfloat16"
    ours = max(r[1] for r in results)
    print(f"bf16 vs the fp32 model: parallm {ours:.3f}, transformers {hf_error:.3f}")
    assert ours <= 2 * hf_error + 1e-2, (ours, hf_error)
