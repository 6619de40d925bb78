"""Issue 57's families through parallm's verl engine (docs/families.md, "verl, Tinker, vLLM" of each family).

Runs in .venv-verl (scripts/test.sh, ``PARALLM_REQUIRE_VERL=1``; elsewhere it skips). The tiny checkpoints of
tests/family_checkpoints.py with every feature of their family tests on: Kimi-K2.5 (the ``kimi_k25`` wrapper, MLA,
YaRN, grouped sigmoid routing with its correction bias, a vision tower carried), dense Gemma 4 (sliding / full
layers with their own head dims, K = V, per-layer input embeddings, KV shared by the last 2 layers, soft-cap, tied
embeddings), MiniMax-M2 (q / k norms over the whole projection, partial RoPE, sigmoid router with bias) and a
Qwen3.6-shaped Qwen3.5-MoE (Gated DeltaNet + gated attention, gated shared expert). Each through parallm's actor
engine built by verl's ``EngineRegistry`` on 2 gloo ranks (as tests/test_verl_deepseek_v4.py; dp2 x ep2 for the
MoE families, dp2 for Gemma 4): ``infer_batch``'s log-probs of verl's padding-free batches (left-padded prompts
packed away) against ``parallm.forward`` on the same rows, then one PPO ``train_batch`` with verl's ``ppo_loss``:
a finite loss, every trained weight moved and exactly the never-trained tensors unchanged (the routers'
correction biases, Gemma 4's layer scalars, the Kimi vision tower). Qwen3.6 runs a second time as released: the
vision-language wrapper (``Qwen3_5MoeForConditionalGeneration``, a vision tower carried) holding the same language
model as the text checkpoint (tests/family_checkpoints.py ``rewrap``): its log-probs equal the text model's bit for
bit and the step leaves the vision tower unchanged. Kimi-K2.5 runs a second time from the same
checkpoint with its routed experts in compressed-tensors' INT4 pack-quantized format (group 32, symmetric, as
released; quantised here from the format's definition, tests/test_kimi_k25.py): the engine's experts as loaded
equal their dequantisation bit for bit, and the dequantised experts train.

The reference is parallm's forward (which equals transformers 5.25 on these models: tests/test_kimi_k25.py,
test_gemma4_features.py, test_minimax_m2.py, test_qwen3_6.py): .venv-verl's transformers 5.10.4 has no
``kimi_k25`` at all (parallm's verl fixes register its config, :func:`parallm.integrations.verl.fixes.
fix_kimi_k25_config`), so the checkpoints are written by parallm (5.25's save names) for every family alike.
"""

from __future__ import annotations

import json
import math
import os

import pytest

if os.environ.get("PARALLM_REQUIRE_VERL") != "1":
    pytest.importorskip("verl", reason="verl is not installed here (bash scripts/setup_verl.sh creates .venv-verl)")

import family_checkpoints as fc  # noqa: E402
import helpers  # noqa: E402
import test_verl  # noqa: E402

VOCAB = 101
NAMES = fc.FAMILIES + ("kimi_k25_int4", "qwen3_6_vl")
LAYOUTS = {"kimi_k25": {"ep": 2}, "kimi_k25_int4": {"ep": 2}, "gemma4": {"tp": 1}, "minimax_m2": {"ep": 2},
           "qwen3_6": {"ep": 2}, "qwen3_6_vl": {"ep": 2}}
# never trained: the routers' correction biases (no gradient), Gemma 4's per-layer scalars (buffers in
# transformers), the carried vision tower
FROZEN = ("e_score_correction_bias", "layer_scalar")


def _frozen(name: str) -> bool:
    return name.endswith(FROZEN) or name.startswith(("vision_tower.", "mm_projector.", "model.visual."))


def _write_int4(src, path):
    """The Kimi checkpoint at ``src`` as the released ones ship it: every routed expert's weight in
    compressed-tensors' INT4 pack-quantized format (group 32, symmetric: tests/test_kimi_k25.py's quantiser, from
    the format's definition) with its ``quantization_config``; the dequantised experts (what the load must give)
    saved beside it as ``dequantized.pt``."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from test_kimi_k25 import EXPERT, dequantize, quant_config, quantize
    state, out, deq = load_file(os.path.join(src, "model.safetensors")), {}, {}
    for name, t in state.items():
        if EXPERT.match(name):
            parts = quantize(t, 32, True)
            out.update({name[:-len("weight")] + k: v for k, v in parts.items()})
            deq[name] = dequantize(parts, 32).float()
        else:
            out[name] = t
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config(32, True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), path)
    torch.save(deq, os.path.join(path, "dequantized.pt"))
    return len(deq)


def _write(rank, world, root):
    import vllm_engines
    out = {}
    for name in fc.FAMILIES:
        path = fc.write(os.path.join(root, name), fc.CONFIGS[name](VOCAB), seed=3)
        vllm_engines.write_tokenizer(path, VOCAB)
        out[name] = sorted(os.listdir(path))
    out["experts"] = _write_int4(os.path.join(root, "kimi_k25"), os.path.join(root, "kimi_k25_int4"))
    vl = fc.write(os.path.join(root, "qwen3_6_vl"), fc.qwen3_6_vl(VOCAB), seed=5)
    vllm_engines.write_tokenizer(vl, VOCAB)
    out["rewrapped"] = fc.rewrap(os.path.join(root, "qwen3_6"), vl)     # the same language model as qwen3_6
    out["qwen3_6_vl"] = sorted(os.listdir(vl))
    out["kimi_k25_int4"] = sorted(os.listdir(os.path.join(root, "kimi_k25_int4")))
    return out


def _family(e_rank, world, path, layout):
    """test_verl's ``_engine_vs_direct`` for one family: ``infer_batch`` against ``parallm.forward`` on the same
    rows, then one PPO ``train_batch``."""
    import torch
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    import parallm
    e = test_verl._parallm_engine(path, layout=layout, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                                  infer_micro_batch_size_per_gpu=2)
    with e.eval_mode():
        lp = [t.clone() for t in e.infer_batch(test_verl._verl_batch([e_rank], world))["model_output"]["log_probs"]
              .unbind()]
    ids, mask = test_verl._rows(e_rank)[:2]
    direct = parallm.forward(e.chunks, ids, mask, output="logprobs")
    want = [direct[i][mask[i].bool()] for i in range(ids.shape[0])]
    before = {k: v.detach().clone() for k, v in parallm.export_hf_tensors(e.chunks)}
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                      entropy_coeff=0.01, loss_agg_mode="token-mean")
    with e.train_mode():
        tr = e.train_batch(test_verl._verl_batch([e_rank], world), loss_function=lambda model_output, data,
                           dp_group=None: ppo_loss(cfg, model_output, data, dp_group))
    after = {k: v.detach().clone() for k, v in parallm.export_hf_tensors(e.chunks)}
    int4 = os.path.join(path, "dequantized.pt")
    loaded = None
    if os.path.exists(int4):        # the INT4 experts as loaded against their dequantisation (bit for bit)
        deq = torch.load(int4)
        loaded = max((before[k] - v).abs().max().item() for k, v in deq.items())
    return {"int4_loaded": loaded, "lp": max((a[:-1] - b[:-1]).abs().max().item() for a, b in zip(lp, want)),
            "lp_values": [t.tolist() for t in lp],
            "loss": float(sum(tr["loss"])), "tensors": len(before),
            "unchanged": sorted(k for k in before if torch.equal(before[k], after[k])),
            "frozen": sorted(k for k in before if _frozen(k))}


def _engine_rank(rank, world, root):
    os.environ.update(test_verl.ENV)
    import verl  # noqa: F401  (loads parallm.integrations.verl: the CPU platform, the kimi_k25 config)
    return {name: _family(rank, world, os.path.join(root, name), LAYOUTS[name]) for name in NAMES}


@pytest.mark.timeout(600)
def test_families_through_the_verl_engine(tmp_path):
    root = str(tmp_path)
    files = helpers.run_ranks(_write, 1, root, timeout=180)[0]
    assert files.pop("experts") == 48, "2 MoE layers x 8 experts x gate / up / down"
    assert files.pop("rewrapped") > 50
    for name, names in files.items():
        assert "model.safetensors" in names and "tokenizer.json" in names, (name, names)
    results = helpers.run_ranks(_engine_rank, 2, root, timeout=560)
    for rank, reps in enumerate(results):
        for name, rep in reps.items():
            print(name, rank, {k: v for k, v in rep.items() if k not in ("unchanged", "frozen", "lp_values")},
                  len(rep["unchanged"]), "unchanged")
    for reps in results:
        for name, rep in reps.items():
            assert rep["lp"] < 1e-5, (name, rep["lp"])
            assert math.isfinite(rep["loss"]), (name, rep["loss"])
            # exactly the never-trained tensors unchanged by the step: every other one moved
            assert rep["unchanged"] == rep["frozen"], (name, sorted(set(rep["unchanged"]) ^ set(rep["frozen"])))
        assert reps["kimi_k25_int4"]["int4_loaded"] == 0.0, reps["kimi_k25_int4"]["int4_loaded"]
    kinds = {name: len(rep["frozen"]) for name, rep in results[0].items()}
    assert kinds["kimi_k25"] > 10 and kinds["gemma4"] == 8 and kinds["minimax_m2"] == 2, kinds
    assert kinds["qwen3_6"] == 0, kinds
    # Qwen3.6 as released (the VL wrapper, vision tower carried untouched by the step): the engine's log-probs
    # equal the text checkpoint's, which holds the same language model (fc.rewrap)
    assert kinds["qwen3_6_vl"] > 20, kinds
    for reps in results:
        vl, text = reps["qwen3_6_vl"]["lp_values"], reps["qwen3_6"]["lp_values"]
        assert len(vl) == len(text) and all(a == b for a, b in zip(vl, text)), "the wrapper's language model differs"
