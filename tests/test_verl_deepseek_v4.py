"""DeepSeek-V4 through parallm's verl engine (docs/families.md, "DeepSeek-V4: verl and Tinker").

Runs in .venv-verl (scripts/test.sh, ``PARALLM_REQUIRE_VERL=1``; elsewhere it skips). The tiny V4 of
tests/test_deepseek_v4.py (sliding / CSA / HCA layers, hash and routed MoE, 2 hyper-connection streams) with a
tokenizer, through parallm's actor engine built by verl's ``EngineRegistry`` at dp2 x ep2 on 2 gloo ranks
(as test_verl's ``_engine_vs_direct``): ``infer_batch``'s log-probs of verl's padding-free batches (left-padded
prompts packed away) against ``parallm.forward`` on the same rows right-padded (V4 refuses left padding; parallm
itself equals transformers 5.25 to 2e-5: tests/test_deepseek_v4.py); then one PPO ``train_batch`` with verl's
``ppo_loss``: a finite loss, every trained weight moved, exactly the frozen ones (the indexer, the int64
``tid2eid`` tables, the correction bias) unchanged. .venv-verl's transformers (5.10.4) is no reference for V4: its
V4 names its tensors otherwise (``model.layers.{i}.attn_hc.base``, per-expert ``mlp.experts.{e}.w1``) and loads
5.25's save with them missing; the checkpoint is therefore written by parallm (5.25's save names).
"""

from __future__ import annotations

import math
import os

import pytest

if os.environ.get("PARALLM_REQUIRE_VERL") != "1":
    pytest.importorskip("verl", reason="verl is not installed here (bash scripts/setup_verl.sh creates .venv-verl)")

import helpers  # noqa: E402
import test_verl  # noqa: E402


def _write_v4(rank, world, path):
    """The tiny V4 written by parallm (.venv-verl's transformers 5.10.4 saves V4 under other names): its config,
    weights from ``init="random"`` then every tensor drawn non-trivial (vectors too, random ``tid2eid`` tables),
    saved by ``save_hf_weights`` (transformers 5.25's save names), and a tokenizer."""
    import json
    import torch
    import parallm
    import vllm_engines
    from test_deepseek_v4 import V4
    config_dir = path + "-config"
    os.makedirs(config_dir, exist_ok=True)
    with open(os.path.join(config_dir, "config.json"), "w") as f:
        json.dump(dict(V4, architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4"), f)
    parallm.init_parallel()
    chunks = parallm.build_model(config_dir, init="random", seed=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in chunks[0].named_parameters():
            if p.dtype == torch.int64:
                e, k = V4["n_routed_experts"], p.shape[-1]
                p.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(p.shape[0])]))
            elif p.dim() == 1 or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    parallm.save_hf_weights(chunks, path)
    parallm.destroy_parallel()
    vllm_engines.write_tokenizer(path, V4["vocab_size"])
    return sorted(os.listdir(path))


def _right_padded(ids, mask):
    """The rows with their real tokens moved to the front (V4 takes right padding only)."""
    import torch
    out_ids, out_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for i in range(ids.shape[0]):
        real = ids[i][mask[i].bool()]
        out_ids[i, :real.numel()], out_mask[i, :real.numel()] = real, 1
    return out_ids, out_mask


def _engine_rank(rank, world, path):
    """test_verl's ``_engine_vs_direct`` with the direct side on right-padded rows: ``infer_batch``'s log-probs
    against ``parallm.forward`` (each row's real tokens first), then one PPO ``train_batch``."""
    os.environ.update(test_verl.ENV)
    import torch
    import verl  # noqa: F401  (loads parallm.integrations.verl: the CPU platform)
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    import parallm
    e = test_verl._parallm_engine(path, layout={"ep": 2}, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                                  infer_micro_batch_size_per_gpu=2)
    with e.eval_mode():
        lp = [t.clone() for t in e.infer_batch(test_verl._verl_batch([rank], world))["model_output"]["log_probs"]
              .unbind()]
    ids, mask = _right_padded(*test_verl._rows(rank)[:2])
    direct = parallm.forward(e.chunks, ids, mask, output="logprobs")
    want = [direct[i][mask[i].bool()] for i in range(ids.shape[0])]
    before = {k: v.detach().clone() for k, v in parallm.export_hf_tensors(e.chunks)}
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                      entropy_coeff=0.01, loss_agg_mode="token-mean")
    with e.train_mode():
        tr = e.train_batch(test_verl._verl_batch([rank], world), loss_function=lambda model_output, data,
                           dp_group=None: ppo_loss(cfg, model_output, data, dp_group))
    after = {k: v.detach().clone() for k, v in parallm.export_hf_tensors(e.chunks)}
    same = [k for k in before if torch.equal(before[k], after[k])]
    return {"lp": max((a[:-1] - b[:-1]).abs().max().item() for a, b in zip(lp, want)),
            "loss": float(sum(tr["loss"])), "unchanged": same, "tensors": len(before)}


@pytest.mark.timeout(600)
def test_v4_through_the_verl_engine(tmp_path):
    path = str(tmp_path / "v4")
    files = helpers.run_ranks(_write_v4, 1, path, timeout=120)[0]
    assert "model.safetensors" in files and "tokenizer.json" in files, files
    results = helpers.run_ranks(_engine_rank, 2, path, timeout=560)
    for rank, rep in enumerate(results):
        print("v4", rank, {k: v for k, v in rep.items() if k != "unchanged"})
        assert rep["lp"] < 1e-5, rep
        assert math.isfinite(rep["loss"]), rep
        # unchanged by the step: exactly the frozen tensors (the indexer, the hash tables, the correction bias)
        frozen = [k for k in rep["unchanged"] if ".indexer." in k or k.endswith(("gate.tid2eid", "gate.bias"))]
        assert frozen == rep["unchanged"], sorted(set(rep["unchanged"]) - set(frozen))
        assert any(".indexer." in k for k in frozen) and any(k.endswith("gate.tid2eid") for k in frozen), frozen
