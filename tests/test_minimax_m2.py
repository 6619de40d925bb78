"""MiniMax-M2 against transformers 5.25 in fp32 (docs/families.md).

The tiny model switches every feature on: q / k RMSNorms over the whole projection (weights ``[4 * 16]`` /
``[2 * 16]``, non-trivial), partial RoPE given as the legacy ``rotary_dim`` (8 of 16 channels), the sigmoid router
with a non-zero ``e_score_correction_bias`` (N(0, 0.3): it changes which experts win), 4 experts top-2, every weight
non-trivial.

Without a process group: the config (4.x-style ``rotary_dim`` + ``rope_theta`` config.json read as transformers
reads it, transformers' class defaults, the refusals), the table against ``save_pretrained``'s names, the new
``kv_heads`` layout, ``inspect_checkpoint``.

One spawn of 4 ranks runs CASES (``init_parallel`` per case): fp32 logits vs transformers, log-probs (and entropy
under packed + SP), ``save_hf_weights`` bit-exact against the checkpoint, the export stream, one SGD step (loss,
gradient norm, every weight after it, output after). On the tp2 case two breaks on purpose must move the output:
the q / k norm computed per rank (no all-reduce) and the correction bias left out of the selection. LoRA vs PEFT
at tp2 (attention and the experts' w1 / w2 / w3) in a 2-rank spawn.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import helpers
import layout_harness

WORLD = 4
TOL = 2e-5
SEQ = 14
MINIMAX = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, rotary_dim=8, rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2,
               vocab_size=101, bos_token_id=None, eos_token_id=None)


def minimax_config(**overrides):
    return helpers.tiny_config("minimax_m2", **dict(MINIMAX, **overrides))


def make_model(cfg, *, seed: int):
    """:func:`helpers.make_hf_model` with a correction bias N(0, 0.3) per layer (transformers' buffer is zeros)."""
    model = helpers.make_hf_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


# -- no process group ----------------------------------------------------------------------------------------

def test_config_table_and_refusals(tmp_path):
    import transformers

    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    cfg = minimax_config()
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5       # transformers reads rotary_dim so
    spec, family = spec_from_config(cfg)
    assert family.name == "minimax_m2" and spec.qk_norm_whole and not spec.qk_norm
    assert spec.rotary_dim == 8 and spec.rope.theta == 10000.0
    assert spec.moe.router == "sigmoid_grouped" and spec.moe.score_bias and spec.moe.n_group == 1
    assert spec.moe.norm_topk_prob and spec.moe.routed_scaling_factor == 1.0 and spec.moe.layers == (0, 1)
    hub = helpers.hub_state_dict(make_model(cfg, seed=0), str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hub      # the Hub's per-expert names
    assert hub["model.layers.1.self_attn.q_norm.weight"].shape == (64,)
    # a released-style config.json (transformers 4.x: rope_theta and rotary_dim at the top, no head_dim): the
    # same rotary channels and theta as transformers 5.25 reads from it, head_dim its class default 128
    raw = json.loads(open(os.path.join(tmp_path, "m", "config.json")).read())
    for key in ("rope_parameters", "head_dim", "rope_theta"):
        raw.pop(key, None)
    raw.update(rope_scaling=None, rotary_dim=64, hidden_size=96, num_attention_heads=2, num_key_value_heads=1,
               use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
               use_mtp=True, num_mtp_modules=3, mtp_transformer_layers=1, shared_intermediate_size=0,
               attn_type_list=[1, 1], sliding_window=None, routed_scaling_factor=1.0)
    helpers.write_config(tmp_path / "old", raw)
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path / "old"))
    old, _ = spec_from_config(str(tmp_path / "old"))
    assert old.head_dim == hf.head_dim == 128 and old.rotary_dim == int(128 * hf.rope_parameters["partial_rotary_factor"])
    assert old.rotary_dim == 64 and old.rope.theta == hf.rope_parameters["rope_theta"] == 5e6
    # rope_parameters' factor wins over rotary_dim (transformers' setdefault order)
    both, _ = spec_from_config(dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.25}))
    assert both.rotary_dim == 32 and both.rope.theta == 1e4
    for bad, match in ((dict(use_qk_norm=False), "use_qk_norm=False"), (dict(qk_norm_type="per_head"), "per_head"),
                       (dict(scoring_func="softmax"), "scoring_func"), (dict(use_routing_bias=False), "use_routing"),
                       (dict(shared_intermediate_size=64), "shared"), (dict(attn_type_list=[0, 1]), "linear-attention"),
                       (dict(router_jitter_noise=0.1), "jitter"), (dict(sliding_window=8), "sliding_window"),
                       (dict(output_router_logits=True, router_aux_loss_coef=0.01), "load-balancing"),
                       (dict(rotary_dim=7), "7 rotary channels")):
        with pytest.raises(ValueError, match=match):
            spec_from_config(dict(raw, **bad))


def test_kv_heads_layout_round_trip_and_replicas():
    from parallm.model.sharding import KVHeadSplit, TensorSource
    x = torch.randn(2 * 3)                       # 2 KV heads of 3
    layout = KVHeadSplit(2, 3)
    for tp in (1, 2, 4):
        shards = [layout.shard([TensorSource(x)], r, tp) for r in range(tp)]
        assert torch.equal(layout.merge(shards)[0], x)
        owners = torch.zeros(6)
        for r, s in enumerate(shards):
            for blk in layout.blocks(r, tp, [(6,)]):
                assert torch.equal(s[blk.local_start:blk.local_stop], x[blk.hf_start:blk.hf_stop])
                owners[blk.hf_start:blk.hf_stop] += blk.primary
            assert bool(layout.primary_slices(r, tp, s.shape)) == (tp < 4 or r % 2 == 0)
            assert layout.replica_rows(r, tp) == ((0, 3) if tp == 4 else None)
        assert torch.equal(owners, torch.ones(6)), tp          # every element written by exactly one rank


def test_inspect_describes_qk_norm_and_partial_rotary(tmp_path, capsys):
    import parallm
    from parallm.cli import main
    ckpt = str(tmp_path / "m")
    make_model(minimax_config(), seed=1).save_pretrained(ckpt)
    report = parallm.inspect_checkpoint(ckpt, tp=2, ep=2)
    c = report["config"]
    assert c["qk_norm"] == "whole projection" and c["rotary_dim"] == 8 and c["head_dim"] == 16
    assert report["moe"]["router"] == "sigmoid_grouped" and report["moe"]["experts"] == 4
    assert main(["inspect", ckpt]) == 0
    text = capsys.readouterr().out
    assert "rotary 8 of 16 channels" in text and "qk norm over the whole projection" in text, text


# -- distributed -----------------------------------------------------------------------------------------------

# name, layout (tp, pp, cp, ep, nmb), build kwargs, breaks measured
CASES = [
    ("tp2 dp2 padded, breaks", dict(tp=2), {}, True),
    ("tp2 ep2 packed+SP", dict(tp=2, ep=2), {"packed": True, "sequence_parallel": True}, False),
    ("pp2 dp2 mb2", dict(pp=2, nmb=2), {}, False),
    ("cp2 dp2 ep2 packed", dict(cp=2, ep=2), {"packed": True}, False),
    ("tp4 (2 KV heads on 2 ranks each: the k norm counts each once)", dict(tp=4), {}, False),
]


def make_cases(tmp_path):
    return [layout_harness.make_case(name, make_model(minimax_config(), seed=70 + i), tmp_path, i,
                                     *helpers.padded_batch(101, batch=8, seq=SEQ, seed=i), layout=layout,
                                     build=build, world=WORLD, breaks=breaks)
            for i, (name, layout, build, breaks) in enumerate(CASES)]


def _breaks(chunks, case) -> dict:
    """The output with the q / k norm per rank and with the correction bias left out of the selection."""
    import parallm
    from parallm.model.layers import qk_norm, routing
    ids, mask, out = case["ids"], case["mask"], {}
    saved = qk_norm.tp_mean
    qk_norm.tp_mean = lambda x, group: x                  # each rank's own heads' mean
    try:
        out["qk_norm"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
    finally:
        qk_norm.tp_mean = saved
    route = routing.sigmoid_route
    routing.sigmoid_route = lambda h, w, bias, **kw: route(h, w, None, **kw)
    try:
        out["bias"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
    finally:
        routing.sigmoid_route = route
    return out


def rank_cases(rank, world, cases):
    return layout_harness.rank_cases(rank, world, cases, breaks=_breaks)


@pytest.mark.timeout(600)
def test_minimax_m2_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, WORLD, cases)
    layout_harness.check(cases, results, tol=TOL)
    assert all({"break_qk_norm", "break_bias"} <= set(results[0][i]) for i, c in enumerate(cases) if c["breaks"])


@pytest.mark.timeout(600)
def test_lora_against_peft_tp2(tmp_path):
    """Attention and the routed experts (w1 / w3 / w2, which PEFT 0.21 retargets to transformers' stacked
    gate_up_proj / down_proj through mixtral's pattern) at tp2: logits, base logits, one AdamW step."""
    import test_lora
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3")
    ckpt, adapter, batch, ref, _ = test_lora._reference("minimax_m2", tmp_path, overrides=MINIMAX, targets=targets)
    res = helpers.run_ranks(test_lora._family_cases, 2, {"minimax_m2": (ckpt, adapter, batch)})[0]
    test_lora._assert_case(res["minimax_m2"], ref, batch[1], "minimax_m2")
    assert any(".mlp.experts.base_layer.lora_B" in k for k in ref["after"])
    assert any(".self_attn.q_proj.lora_A" in k for k in ref["after"])
