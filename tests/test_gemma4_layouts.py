"""Gemma 4 (dense and with the MoE block) in the layouts and features test_gemma4_features.py and
test_gemma4_moe.py leave out, against transformers 5.25 in fp32 through tests/layout_harness.py (docs/families.md,
"Gemma 4"):

* pp2 vpp2 of test_gemma4_features.py's 8-layer model (K = V, per-layer inputs, KV sharing 6 <- 4 and 7 <- 5,
  double-wide MLPs): the even split (2 layers per virtual stage) puts layer 6 and its source 4 on different
  virtual stages, which is refused naming both; ``layers_per_stage=[2, 1, 1, 4]`` keeps them together and runs.
  The per-layer inputs cross three stage boundaries there.
* every feature at once: that model with the MoE block on every layer, tp2 packed + SP (log-probs and entropy, a
  step on them) and pp2 vpp2 as above.
The output after the step is held to max(1e-4, 2 x transformers' own sdpa-vs-eager spread after the same step), as
test_gemma4_features.py holds it (softmax scale 1 and 8 layers make it sensitive).

* `parallm inspect` on the dense model (the MoE one: test_gemma4_moe.py): the even pp / vpp splits that separate a
  KV-sharing layer from its source are not offered but listed as refused naming the layers, and refused when asked
  for (``--pp 4``); the model without KV sharing offers them all.
* bf16 smoke (tp2, dense and MoE): the bf16 model's loss within bf16 rounding of the fp32 loss, a
  ``forward_backward`` step with every parameter's fp32 ``main_grad`` finite.
"""

from __future__ import annotations

import pytest
import torch

import helpers
import layout_harness
from test_gemma4_features import _spread, make_model as dense_model
from test_gemma4_moe import MOE

TOL = 2e-5
SEQ = 12
SPLIT = [2, 1, 1, 4]        # virtual stages (vpp_rank * pp + pp_rank): layers 0-1 | 2 | 3 | 4-7


def moe_model(seed: int):
    """test_gemma4_features.py's model with the MoE block on every layer (router scaled as test_gemma4_moe.py's)."""
    model = dense_model(seed, **{k: v for k, v in MOE.items() if k != "num_global_key_value_heads"})
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.proj.weight"):
                p.mul_(40.0)
            elif name.endswith("router.scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


CASES = [
    ("dense pp2 vpp2 mb2, stages 2/1/1/4, step on logits", dense_model, dict(pp=2, vpp=2, nmb=2),
     dict(layers_per_stage=SPLIT), "logits"),
    ("MoE + every feature tp2 packed+SP, logprobs+entropy, step", moe_model, dict(tp=2),
     dict(packed=True, sequence_parallel=True), "stats"),
    ("MoE + every feature pp2 vpp2 mb2, stages 2/1/1/4, step", moe_model, dict(pp=2, vpp=2, nmb=2),
     dict(layers_per_stage=SPLIT), "logits"),
]


def make_cases(tmp_path):
    cases = []
    for i, (name, make, layout, build, loss_on) in enumerate(CASES):
        model, (ids, mask) = make(60 + i), helpers.padded_batch(101, batch=4, seq=SEQ, seed=20 + i)
        cases.append(layout_harness.make_case(name, model, tmp_path, i, ids, mask, layout=layout, build=build,
                                              loss_on=loss_on, spread=_spread(model, ids, mask, layout, loss_on)))
    return cases


def rank_cases(rank, world, cases, refused_ckpt):
    import parallm
    parallm.init_parallel(pp=2, vpp=2)
    try:
        parallm.build_model(refused_ckpt)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    parallm.destroy_parallel()
    return layout_harness.rank_cases(rank, world, cases), refusal


@pytest.mark.timeout(900)
def test_gemma4_more_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases, cases[0]["ckpt"], timeout=600)
    for res in results:
        assert res[1] is not None and "layer 6 reuses the keys / values of layer 4" in res[1], res[1]
    for i, case in enumerate(cases):     # the output after the step: within max(1e-4, 2 x transformers' spread)
        print(f"transformers sdpa vs eager after the step: {case['spread']:.1e}", end="")
        layout_harness.check([case], [[r[0][i]] for r in results], tol=TOL, after_tol=max(1e-4, 2 * case["spread"]))


# -- bf16 smoke ---------------------------------------------------------------------------------------------------

def rank_bf16(rank, world, runs):
    import parallm
    from parallm.verify.reference import causal_lm_loss
    out = []
    for ckpt, ids, mask in runs:
        parallm.init_parallel(tp=2)
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
        parallm.load_hf_weights(chunks, ckpt)
        with torch.no_grad():
            loss = causal_lm_loss(parallm.forward(chunks, ids, mask), ids, mask).item()
        step = parallm.forward_backward(chunks, ids, mask, loss_fn=causal_lm_loss).item()
        grads = {n: getattr(p, "main_grad", None) for c in chunks for n, p in c.named_parameters() if p.requires_grad}
        bad = [n for n, g in grads.items() if g is None or not bool(torch.isfinite(g).all())]
        dtypes = {str(p.dtype) for c in chunks for p in c.parameters()}
        out.append(dict(loss=loss, step=step, bad_grads=bad, dtypes=sorted(dtypes)))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_bf16_smoke_dense_and_moe(tmp_path):
    from parallm.verify.reference import causal_lm_loss, hf_output
    runs, ref = [], []
    for i, make in enumerate((dense_model, moe_model)):
        model, (ids, mask) = make(80 + i), helpers.padded_batch(101, batch=4, seq=SEQ, seed=30 + i)
        ckpt = str(tmp_path / f"b{i}")
        model.save_pretrained(ckpt)
        with torch.no_grad():
            ref.append(causal_lm_loss(hf_output(model, ids, mask), ids, mask).item())
        runs.append((ckpt, ids, mask))
    results = helpers.run_ranks(rank_bf16, 2, runs, timeout=400)
    print()
    for name, r0, fp32 in zip(("dense", "MoE"), results[0], ref):
        print(f"bf16 {name}: loss {r0['loss']:.4f} (fp32 {fp32:.4f}), step loss {r0['step']:.4f}, "
              f"dtypes {r0['dtypes']}")
        assert "torch.bfloat16" in r0["dtypes"] and not r0["bad_grads"], r0    # every fp32 main_grad finite
        assert abs(r0["loss"] - fp32) < 0.02 * fp32 and abs(r0["step"] - r0["loss"]) < 1e-2 * fp32, (r0, fp32)


def test_inspect_dense(tmp_path, capsys):
    """``parallm inspect`` on the dense 8-layer model (global head dim, K = V, per-layer inputs, KV sharing)."""
    import parallm
    from parallm.cli import main
    ckpt = str(tmp_path / "d")
    dense_model(0).save_pretrained(ckpt)
    report = parallm.inspect_checkpoint(ckpt, tp=2)
    assert report["problem"] is None and report["moe"] is None and report["family"] == "gemma4"
    assert report["config"]["global_head_dim"] == 32 and report["config"]["rotary_dim"] is None
    assert main(["inspect", ckpt]) == 0
    text = capsys.readouterr().out
    assert "full layers' head dim 32" in text and "rotary 32 of 16" not in text, text
    # KV sharing (6 <- 4, 7 <- 5): the even splits that separate a pair are not offered but listed as refused,
    # naming the layers, and a layout asking for one is refused as build_model refuses it
    assert report["pipelines"] == {1: [], 2: []}, report["pipelines"]
    refused = {(r["pp"], r["vpp"]): r["reason"] for r in report["refused_pipelines"]}
    assert set(refused) == {(2, 2), (2, 4), (4, 1), (4, 2), (8, 1)}, refused
    assert "layer 6 reuses the keys / values of layer 4" in refused[(2, 2)]
    assert "valid pp/vpp  pp 1; pp 2\n" in text and "pp 2 x vpp 2: layer 6 reuses the keys / values of layer 4" in text
    with pytest.raises(parallm.CheckpointError, match="layer 6 reuses the keys / values of layer 4"):
        parallm.inspect_checkpoint(ckpt, pp=2, vpp=2)
    assert main(["inspect", ckpt, "--pp", "4"]) != 0
    assert "layer 6 reuses the keys / values of layer 4" in capsys.readouterr().err
    layout = parallm.inspect_checkpoint(ckpt, pp=2, vpp=2, split=dict(layers_per_stage=SPLIT))["layout"]
    assert layout["split"] == SPLIT
    # without KV sharing the same layer counts split every even way
    plain = str(tmp_path / "plain")
    dense_model(0, num_kv_shared_layers=0).save_pretrained(plain)
    report = parallm.inspect_checkpoint(plain)
    assert report["pipelines"] == {1: [], 2: [2, 4], 4: [2], 8: []} and report["refused_pipelines"] == []
