"""What vLLM 0.32's CPU build does with DeepSeek-V4, and parallm's refusal (docs/families.md, "DeepSeek-V4: vLLM").

Runs in .venv-vllm (scripts/test.sh; elsewhere it skips). A V4 checkpoint shaped as vLLM's CPU kernels require
(``head_dim`` 512, ``index_head_dim`` 128, a 64-channel RoPE; the Hub's tensor names and config keys:
``compress_ratios``, ``num_hash_layers``, ``topk_method: noaux_tc``), tiny otherwise, written here tensor by tensor
(.venv-vllm's transformers 5.19 cannot build 5.25's V4): a ``vllm.LLM`` in a process of its own builds the model
and loads every weight, then its first forward fails in the sparse sliding-window attention's metadata
(``compute_token_to_req_indices`` launches a Triton kernel; the CPU build has no Triton CPU backend). The day this
test fails because the engine generates, parallm's refusal (:mod:`parallm.integrations.vllm.unsupported`) should
give way to a push test. ``launch`` / ``serve`` of the same directory are refused with the reason first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/setup_vllm.sh creates .venv-vllm)")

import torch

H, HD, Q, O, IDX, E, I, V, HC = 64, 512, 32, 32, 128, 4, 32, 97, 2
KINDS = (0, 4, 128)                     # sliding, CSA (rate 4), HCA (rate 128)
CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": H,
          "head_dim": HD, "qk_rope_head_dim": 64, "partial_rotary_factor": 64 / HD, "q_lora_rank": Q,
          "o_groups": 2, "o_lora_rank": O, "num_attention_heads": 4, "num_key_value_heads": 1,
          "index_n_heads": 4, "index_head_dim": IDX, "index_topk": 8, "sliding_window": 128,
          "compress_ratios": list(KINDS) + [0], "compress_rope_theta": 160000.0, "num_hash_layers": 1,
          "topk_method": "noaux_tc", "hc_mult": HC, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
          "num_hidden_layers": len(KINDS), "n_routed_experts": E, "n_shared_experts": 1, "num_experts_per_tok": 2,
          "moe_intermediate_size": I, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
          "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "hidden_act": "silu", "vocab_size": V,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
          "num_nextn_predict_layers": 0}


def _shapes() -> dict:
    mix, stream = (2 + HC) * HC, HC * H
    out = {"embed.weight": (V, H), "head.weight": (V, H), "norm.weight": (H,), "hc_head_fn": (HC, stream),
           "hc_head_base": (HC,), "hc_head_scale": (1,)}
    for i, ratio in enumerate(KINDS):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (H,), p + "ffn_norm.weight": (H,)})
        for b in ("attn", "ffn"):
            out.update({f"{p}hc_{b}_fn": (mix, stream), f"{p}hc_{b}_base": (mix,), f"{p}hc_{b}_scale": (3,)})
        a = p + "attn."
        out.update({a + "wq_a.weight": (Q, H), a + "q_norm.weight": (Q,), a + "wq_b.weight": (4 * HD, Q),
                    a + "wkv.weight": (HD, H), a + "kv_norm.weight": (HD,), a + "attn_sink": (4,),
                    a + "wo_a.weight": (2 * O, 4 * HD // 2), a + "wo_b.weight": (H, 2 * O)})
        if ratio:
            width = HD * (2 if ratio == 4 else 1)
            c = a + "compressor."
            out.update({c + "wkv.weight": (width, H), c + "wgate.weight": (width, H), c + "ape": (ratio, width),
                        c + "norm.weight": (HD,)})
        if ratio == 4:
            x = a + "indexer."
            out.update({x + "wq_b.weight": (4 * IDX, Q), x + "weights_proj.weight": (4, H),
                        x + "compressor.wkv.weight": (2 * IDX, H), x + "compressor.wgate.weight": (2 * IDX, H),
                        x + "compressor.ape": (ratio, 2 * IDX), x + "compressor.norm.weight": (IDX,)})
        f = p + "ffn."
        out[f + "gate.weight"] = (E, H)
        if i >= CONFIG["num_hash_layers"]:
            out[f + "gate.bias"] = (E,)
        for e in range(E):
            out.update({f"{f}experts.{e}.w1.weight": (I, H), f"{f}experts.{e}.w3.weight": (I, H),
                        f"{f}experts.{e}.w2.weight": (H, I)})
        out.update({f + "shared_experts.w1.weight": (I, H), f + "shared_experts.w3.weight": (I, H),
                    f + "shared_experts.w2.weight": (H, I)})
    return out


def write_checkpoint(path: str) -> str:
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    state = {k: (1 + 0.1 * torch.randn(s, generator=g)) if "norm" in k else 0.08 * torch.randn(s, generator=g)
             for k, s in _shapes().items()}
    state["layers.0.ffn.gate.tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(V)])
    os.makedirs(path, exist_ok=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    import vllm_engines
    vllm_engines.write_tokenizer(path, V)
    return path


ENGINE = """
import sys
import vllm
if __name__ == "__main__":
    llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
                   kv_cache_memory_bytes=64 << 20)
    print("LOADED", flush=True)
    out = llm.generate([{"prompt_token_ids": list(range(1, 13))}], vllm.SamplingParams(max_tokens=2))
    print("GENERATED", out[0].outputs[0].token_ids, flush=True)
"""


@pytest.mark.timeout(600)
def test_cpu_build_loads_v4_then_fails_in_triton_metadata(tmp_path):
    import vllm_engines
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm.unsupported import DEEPSEEK_V4_REASON
    ckpt = write_checkpoint(str(tmp_path / "v4"))
    for call in (lambda: pv.launch(ckpt), lambda: pv.serve(ckpt)):
        with pytest.raises(ValueError, match="DeepSeek-V4 is not supported"):
            call()
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = dict(os.environ, **dict(vllm_engines.SERVER_ENV, VLLM_LOGGING_LEVEL="INFO"))
    run = subprocess.run([sys.executable, str(script), ckpt], capture_output=True, text=True, timeout=540, env=env,
                         cwd=str(tmp_path))
    log = run.stdout + run.stderr
    assert "GENERATED" not in log, "vLLM's CPU build now runs DeepSeek-V4: replace the refusal by a push test"
    assert run.returncode != 0
    assert "Resolved architecture: DeepseekV4ForCausalLM" in log, log[-3000:]
    assert "compute_token_to_req_indices" in log and "'function' object is not subscriptable" in log, log[-3000:]
    assert "compute_token_to_req_indices" in DEEPSEEK_V4_REASON
