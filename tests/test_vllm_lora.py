"""LoRA adapters into a real vLLM engine (vLLM's CPU build, in the trainer's process): ``pv.push_adapter``.

Runs in the vLLM venv (``PARALLM_REQUIRE_VLLM=1`` makes a missing vLLM a failure; elsewhere it skips). One 2-rank
spawn, Qwen3 at tp2 with LoRA r=8 on every projection:

* an engine serving LoRA (``enable_lora=True``) on rank 1: after two AdamW steps the adapter is pushed and vLLM's
  log-probs of its own samples under the ``LoRARequest`` equal parallm's ``forward(output="logprobs")`` (1e-4,
  fp32); one more step without a push leaves the engine stale; a second push (the same request name, reloaded in
  place) brings it back; requests without the adapter give the base model (parallm under ``adapters_disabled``);
  the push moves the adapter only (its bytes against the whole model's), written to a directory in /dev/shm;
* an engine without LoRA on rank 0: ``push_adapter`` pushes the merged weights; vLLM then equals parallm with
  its adapters, and parallm's base is bit-identical afterwards.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/setup_vllm.sh creates .venv-vllm)")

import helpers  # noqa: E402
import vllm_engines as ve  # noqa: E402

TOL = 1e-4
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _sample(llm, prompts, seed, *, src, lora=None):
    """vLLM's samples and their log-probs on rank ``src`` (with the adapter ``lora``), on every rank."""
    import torch.distributed as dist
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    obj = [None]
    if llm is not None:
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True)
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                           lora_request=lora)
        obj = [[(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
                for o in res]]
    dist.broadcast_object_list(obj, src=src)
    return obj[0]


def _rank(rank, world, ckpt):
    import parallm
    from parallm.integrations import vllm as pv
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt, lora=parallm.LoraConfig(8, 16, TARGETS))
    parallm.load_hf_weights(chunks, ckpt)
    vocab = chunks[0].spec.vocab_size
    prompts = ve.prompts(vocab, 1)
    opt = parallm.build_optimizer(chunks, lr=2e-2)
    ve.train(chunks, opt, vocab, 2, seed=2)

    llm = pv.launch(ckpt, rank=1, enable_lora=True, max_lora_rank=8, max_loras=1, **ENGINE)
    stats = pv.push_adapter(chunks, llm, rank=1)
    out["stats"] = {k: v for k, v in stats.items() if k != "lora_request"}
    out["request_here"] = stats["lora_request"] is not None
    req = stats["lora_request"]
    out["after"] = ve.max_diff(chunks, prompts, _sample(llm, prompts, 1, src=1, lora=req))
    with parallm.adapters_disabled(chunks):
        out["base"] = ve.max_diff(chunks, prompts, _sample(llm, prompts, 2, src=1))
    ve.train(chunks, opt, vocab, 1, seed=3)
    out["stale"] = ve.max_diff(chunks, prompts, _sample(llm, prompts, 3, src=1, lora=req))
    req = pv.push_adapter(chunks, llm, rank=1)["lora_request"]
    out["after2"] = ve.max_diff(chunks, prompts, _sample(llm, prompts, 4, src=1, lora=req))
    out["full_bytes"] = sum(math.prod(m.shape) * 4 for m in parallm.export_metadata(chunks))
    try:
        pv.push_adapter(chunks, llm, rank=0)
    except ValueError as e:
        out["no_engine"] = str(e)
    if llm is not None:
        # the adapter's directory (in /dev/shm) goes at interpreter exit, which this rank skips (the launcher
        # ends it with os._exit): removed here
        root = os.path.dirname(llm._parallm_lora_dir)
        out["adapter_dir"] = os.path.isdir(root)
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    del llm

    llm = pv.launch(ckpt, rank=0, **ENGINE)          # no LoRA: the merged weights
    base = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if not p.requires_grad}
    merged = pv.push_adapter(chunks, llm, rank=0)
    out["merged_mode"] = merged["mode"]
    out["merged"] = ve.max_diff(chunks, prompts, _sample(llm, prompts, 5, src=0))
    out["base_intact"] = all(torch.equal(p.detach(), base[n]) for n, p in chunks[0].named_parameters()
                             if not p.requires_grad)
    return out


@pytest.mark.timeout(900)
def test_push_adapter(tmp_path):
    from parallm import verify
    ckpt = ve.checkpoint(str(tmp_path / "ckpt"), "qwen3", 21, num_hidden_layers=2)
    res = verify.spawn(_rank, 2, ckpt, timeout=800, collective_timeout=helpers.COLLECTIVE_TIMEOUT_S,
                       preload=("helpers", "vllm_engines"),
                       env={"VLLM_LOGGING_LEVEL": "WARNING", "PARALLM_PROGRESS": "0"})
    r0, r1 = res
    assert r1["request_here"] and not r0["request_here"]
    assert r1["adapter_dir"], "no adapter directory on the engine's rank"
    assert r0["stats"]["mode"] == "adapter"
    assert r0["after"] < TOL, r0
    assert r0["base"] < TOL, r0                       # requests without the adapter: the base model
    assert r0["stale"] > 100 * TOL, r0
    assert r0["after2"] < TOL, r0
    assert r0["stats"]["bytes"] < 0.2 * r0["full_bytes"], r0["stats"]
    assert "no engine on rank 0" in r0["no_engine"]
    assert r0["merged_mode"] == "merged" and r0["merged"] < TOL and r0["base_intact"], r0


@pytest.mark.timeout(600)
def test_grpo_example_lora_learns(tmp_path):
    """``examples/grpo.py --lora 8`` with vLLM rollouts, 24 steps: the engine serves the adapter (pushed alone every
    step, a fraction of the model's bytes), its log-probs equal the trainer's, and the policy learns the task
    (reward and greedy accuracy up)."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLM_PROGRESS="0", VLLM_LOGGING_LEVEL="ERROR")
    env.pop("RANK", None)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, os.path.join(root, "examples", "grpo.py"), "--lora", "8", "--lr", "5e-3", "--steps", "24",
           "--jsonl", str(log)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(log)]
    assert len(rows) == 24 and all(r["push_mode"] == "adapter" for r in rows)
    assert max(r["logprob_mismatch_max"] for r in rows) < 1e-4
    first = sum(r["reward"] for r in rows[:4]) / 4
    last = sum(r["reward"] for r in rows[-4:]) / 4
    assert last > first + 0.05, (first, last)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("greedy accuracy"))
    before, after = (float(w.rstrip(",;")) for w in line.split() if w[0].isdigit() and "." in w)
    assert after > before, line
