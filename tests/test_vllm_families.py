"""Issue 57's families and vLLM 0.32's CPU build: pushes where it runs them, parallm's refusals where it does not
(docs/families.md, "verl, Tinker, vLLM" of each family).

Runs in .venv-vllm (scripts/test.sh; elsewhere it skips). The checkpoints are tests/family_checkpoints.py's, with the
attention shapes vLLM's CPU kernels take (head dims 32 / 64; MLA with ``kv_lora_rank`` 512 and a 64-channel
RoPE, the only latent size the CPU MLA kernel compiles), written by parallm (transformers 5.25's names).

* **Gemma 4** (dense text, every feature of test_gemma4_features.py on) and **Kimi-K2.5** (the
  ``KimiK25ForConditionalGeneration`` wrapper, dense experts, a 2-layer vision tower; the engine started with
  ``limit_mm_per_prompt={"vision_chunk": 0}`` and a ``preprocessor_config.json`` for vLLM's Kimi image processor)
  run in fp32. After two AdamW steps at tp2 (trainer on 2 ranks, an in-process engine on rank 0,
  :func:`vllm_engines.push_against_fresh_engine`), ``push_weights`` into the running engine and vLLM loading
  ``save_hf_weights``' directory through its own loader hold the same tensors bit for bit (every one), both
  engines give the same samples and the stale engine's differ, and the engine's log-probs of its samples equal
  ``parallm.forward``'s before and after the push (within 1e-4, test_vllm.py's tolerance) and are far apart
  while stale. With multimodal inputs off vLLM builds Kimi's language model only (no vision tower: every engine
  tensor is ``language_model.*``); the tower's tensors, which parallm carries and sends unchanged, are dropped by
  vLLM's loader in the push as in its own load, so the tower is not checked here.
* **MiniMax-M2** does not run on the CPU build: the engine loads the model and its first forward fails in the CPU
  router (``assert self.scoring_func == "softmax"``: MiniMax-M2's sigmoid router with its correction bias is not
  grouped top-k). ``launch`` / ``serve`` / ``push_weights`` into an in-process engine are refused with that reason.
* **Qwen3.6** (Qwen3.5-MoE) does not start: vLLM's Qwen3.5 model file imports the Qwen3-VL vision code, which
  needs torchvision (none for this torch on CPU). Refused the same way; a push over a ``connect`` connection
  (an engine already running it elsewhere) is not.

The day a refusal test fails because the engine generates, the refusal should give way to a push test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/setup_vllm.sh creates .venv-vllm; "
                                       "scripts/test.sh runs this file there)")

import family_checkpoints as fc  # noqa: E402
import helpers  # noqa: E402
import vllm_engines as ve  # noqa: E402

VOCAB = 101
TOL = 1e-4
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0)
CONFIGS = {
    "gemma4": fc.gemma4(VOCAB, head_dim=32, global_head_dim=64, hidden_size=128),
    "kimi_k25": fc.kimi_k25(VOCAB, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                            num_attention_heads=2, num_key_value_heads=2),
    "minimax_m2": fc.minimax_m2(VOCAB, head_dim=32, rotary_dim=16, hidden_size=128),
    "qwen3_6": fc.qwen3_6(VOCAB),
}
ENGINES = {"gemma4": ENGINE, "kimi_k25": dict(ENGINE, limit_mm_per_prompt={"vision_chunk": 0})}
# vLLM's Kimi-K2.5 processing info builds its image processor at start-up (the fused CPU one: these keys)
KIMI_PREPROCESSOR = {"media_proc_cfg": {"patch_size": 2, "merge_kernel_size": [2, 2], "temporal_merge_kernel_size": 2,
                                        "in_patch_limit": 64, "in_patch_limit_each_frame": 64,
                                        "in_patch_limit_video": 64, "patch_limit_on_one_side": 8,
                                        "fixed_output_tokens": None, "image_mean": [0.5] * 3,
                                        "image_std": [0.5] * 3}}


def _write(rank, world, path, name):
    fc.write(path, CONFIGS[name], seed=3)
    ve.write_tokenizer(path, VOCAB)
    if name == "kimi_k25":
        with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
            json.dump(KIMI_PREPROCESSOR, f)
    return sorted(os.listdir(path))


def _checkpoint(tmp_path, name) -> str:
    path = str(tmp_path / name)
    files = helpers.run_ranks(_write, 1, path, name, timeout=180)[0]
    assert "model.safetensors" in files and "tokenizer.json" in files, files
    return path


def _push_rank(rank, world, s):
    out, states = ve.push_against_fresh_engine(s["ckpt"], s["saved"], s["engine"])
    if states is not None:
        out["prefixes"] = sorted({k.split(".")[0] for k in states["pushed"]})
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["gemma4", "kimi_k25"])
def test_push_equals_vllm_load(tmp_path, name):
    ckpt = _checkpoint(tmp_path, name)
    s = {"ckpt": ckpt, "saved": str(tmp_path / "saved"), "engine": ENGINES[name]}
    out = helpers.run_ranks(_push_rank, 2, s, timeout=840)[0]
    print(name, {k: out[k] for k in ("before", "stale_diff", "after_diff", "fresh_diff", "tensors", "prefixes")},
          out["push"])
    assert out["names"] and out["differ"] == {}, out["differ"]
    assert out["same_samples"] and out["moved"]
    assert max(out["before"], out["after_diff"], out["fresh_diff"]) < TOL, out
    assert out["stale_diff"] > 100 * TOL, out
    if name == "kimi_k25":      # no tower built (multimodal inputs off): every engine tensor is the language model's
        assert out["prefixes"] == ["language_model"], out["prefixes"]


def _refused_push(rank, world, ckpt):
    """push_weights of the family's model with no engine: refused before anything else is looked at."""
    import parallm
    from parallm.integrations import vllm as pv
    parallm.init_parallel()
    chunks = parallm.build_model(ckpt)
    out = {}
    ve.attempt(out, "push", lambda: pv.push_weights(chunks, None))
    parallm.destroy_parallel()
    return out["push"][:2]


ENGINE_SCRIPT = """
import sys
import vllm
if __name__ == "__main__":
    llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
                   kv_cache_memory_bytes=32 << 20)
    print("LOADED", flush=True)
    out = llm.generate([{"prompt_token_ids": list(range(1, 13))}], vllm.SamplingParams(max_tokens=2))
    print("GENERATED", out[0].outputs[0].token_ids, flush=True)
"""


def _engine_log(tmp_path, ckpt) -> tuple[int, str]:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = dict(os.environ, **dict(ve.SERVER_ENV, VLLM_LOGGING_LEVEL="INFO", VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    run = subprocess.run([sys.executable, str(script), ckpt], capture_output=True, text=True, timeout=500, env=env,
                         cwd=str(tmp_path))
    return run.returncode, run.stdout + run.stderr


@pytest.mark.timeout(600)
def test_minimax_m2_refused_where_the_cpu_router_fails(tmp_path):
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm import unsupported
    ckpt = _checkpoint(tmp_path, "minimax_m2")
    for call in (lambda: pv.launch(ckpt), lambda: pv.serve(ckpt)):
        with pytest.raises(ValueError, match=r"MiniMax-M2 \(minimax_m2\) is not supported on vLLM's CPU build"):
            call()
    kind, msg = helpers.run_ranks(_refused_push, 1, ckpt, timeout=120)[0]
    assert kind == "ValueError" and msg.startswith("push_weights: MiniMax-M2") and "cpu_router" in msg, (kind, msg)
    unsupported.refuse_family("minimax_m2", "push_weights", local=False)      # a connection's engine: not refused
    rc, log = _engine_log(tmp_path, ckpt)
    assert "GENERATED" not in log, "vLLM's CPU build now runs MiniMax-M2: replace the refusal by a push test"
    assert rc != 0 and "Resolved architecture: MiniMaxM2ForCausalLM" in log, log[-3000:]
    assert 'assert self.scoring_func == "softmax"' in log and "cpu_router.py" in log, log[-3000:]


@pytest.mark.timeout(300)
def test_qwen3_6_refused_where_vllm_cannot_import_it(tmp_path):
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm import unsupported
    with pytest.raises(ImportError, match="torchvision"):
        import vllm.model_executor.models.qwen3_5  # noqa: F401
    ckpt = _checkpoint(tmp_path, "qwen3_6")
    for call in (lambda: pv.launch(ckpt), lambda: pv.serve(ckpt)):
        with pytest.raises(ValueError, match=r"Qwen3.5 / Qwen3.6 \(qwen3_5_moe\) is not supported by the vLLM "
                                             r"installed here.*torchvision"):
            call()
    kind, msg = helpers.run_ranks(_refused_push, 1, ckpt, timeout=120)[0]
    assert kind == "ValueError" and msg.startswith("push_weights: Qwen3.5 / Qwen3.6"), (kind, msg)
    for family in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe_vl"):
        with pytest.raises(ValueError, match="torchvision"):
            unsupported.refuse_family(family, "launch")
        unsupported.refuse_family(family, "push_weights", local=False)       # a connection's engine: not refused
    unsupported.refuse_family("qwen3_next", "launch")                         # Qwen3-Next runs: not refused
