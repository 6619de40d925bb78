"""GPU smoke checks of `parallm verify` in bf16 and of carried MTP tensors, run by scripts/gpu_smoke.sh.
Never run on a GPU; written on a CPU-only session.

1. `parallm verify --dtype bfloat16 --device cuda` on a tiny LLaMA (world 1; tp2 with 2+ GPUs): NCCL, bf16
   parameters with fp32 main_grad, transformers in bf16, the bf16 tolerances (docs/cli.md).
2. `parallm verify --device cuda` on a tiny Qwen3-Next checkpoint holding mtp.* tensors: built from the
   directory, the MTP tensors carried on the GPU and checked bit for bit (row mtp_ok), fp32.
Run: python scripts/gpu_checks/verify.py (exit 0 when every check passes; prints the JSON rows).
SMOKE_DEVICE=cpu runs the same commands on gloo ranks (checked on CPU: passes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch


def tiny_llama(path: str) -> str:
    from parallm.verify import make_hf_model, tiny_config
    make_hf_model(tiny_config("llama", num_hidden_layers=4, attention_bias=True), seed=2).save_pretrained(path)
    return path


def tiny_qwen3_next_with_mtp(path: str) -> int:
    """A tiny Qwen3-Next saved by transformers, plus mtp.* tensors written into its safetensors (the published
    checkpoints' names: mtp.fc, the pre-fc norms, mtp.layers.0.* shaped as the last attention layer, mtp.norm)."""
    from safetensors.torch import load_file, save_file

    from parallm.verify import make_hf_model, tiny_config
    cfg = tiny_config("qwen3_next", num_hidden_layers=4, full_attention_interval=2, head_dim=16,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48)
    model = make_hf_model(cfg, seed=3)
    with torch.no_grad():           # zero-centred norms: w ~ 0.2 N(0, 1), as tests/test_qwen3_5.py does
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and ".linear_attn." not in name:
                p.sub_(1.0)
    model.save_pretrained(path)
    state = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, f)))
    assert "model.safetensors" in os.listdir(path), "expected a single-file checkpoint"
    g = torch.Generator().manual_seed(5)
    h = cfg.hidden_size
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g), "mtp.norm.weight": torch.randn(h, generator=g),
           "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=g),
           "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=g)}
    src = "model.layers.3."
    mtp.update({"mtp.layers.0." + k[len(src):]: torch.randn(v.shape, generator=g) for k, v in state.items()
                if k.startswith(src)})
    save_file({**state, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return len(mtp)


def verify(ckpt: str, out: str, *args: str) -> dict:
    cmd = [sys.executable, "-m", "parallm", "verify", ckpt, "--device", DEVICE, "--json", out, "--quiet", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(" ".join(cmd[2:]), "->", proc.returncode)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    rows = json.load(open(out))["rows"] if os.path.exists(out) else []
    return dict(code=proc.returncode, rows=rows)


DEVICE = os.environ.get("SMOKE_DEVICE", "cuda")


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing to check")
        return 1
    gpus = torch.cuda.device_count() if DEVICE == "cuda" else 2
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        llama = tiny_llama(os.path.join(tmp, "llama"))
        for tp in sorted({1, min(2, gpus)}):
            r = verify(llama, os.path.join(tmp, f"bf16-tp{tp}.json"), "--dtype", "bfloat16", "--tp", str(tp))
            ok = r["code"] == 0 and r["rows"] and r["rows"][0]["ok"] and r["rows"][0]["dtype"] == "bfloat16"
            print("bf16 tp", tp, r["rows"][0] if r["rows"] else None)
            if not ok:
                failures.append(f"verify --dtype bfloat16 --tp {tp}")
        nxt = os.path.join(tmp, "qwen3_next")
        n = tiny_qwen3_next_with_mtp(nxt)
        r = verify(nxt, os.path.join(tmp, "mtp.json"))
        row = r["rows"][0] if r["rows"] else {}
        print("qwen3_next mtp", row)
        if not (r["code"] == 0 and row.get("ok") and row.get("mtp_tensors") == n and row.get("mtp_ok")):
            failures.append("verify on a Qwen3-Next checkpoint with mtp.* tensors")
    print("FAILED: " + "; ".join(failures) if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
