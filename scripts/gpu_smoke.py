"""GPU smoke test: parity with transformers on CUDA + NCCL, a bf16 sanity check, the CUDA attention path.

    torchrun --nproc-per-node N scripts/gpu_smoke.py        (N = 1, 2 or 4 GPUs; or)
    bash scripts/gpu_smoke.sh

Prints one line per check and exits 0 when all pass. Not part of the CPU test suite.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist


def main() -> int:
    import transformers

    import parallm

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if world % 4 == 0 else 1
    parallm.init_parallel(tp=tp, pp=pp)  # nccl
    rank = dist.get_rank()
    ok = True

    def report(name, value, limit):
        nonlocal ok
        good = value <= limit
        ok &= good
        if rank == 0:
            print(f"{'PASS' if good else 'FAIL'} {name}: {value:.3e} (limit {limit:.0e})", flush=True)

    box = [tempfile.mkdtemp(prefix="parallm-gpu-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt = os.path.join(box[0], "m")
    cfg = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1001,
                                   tie_word_embeddings=True, attn_implementation="eager")
    if rank == 0:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        hf.save_pretrained(ckpt)
    dist.barrier()
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    mask[2, -12:] = 0
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    real = mask.bool()

    for packed in (False, True):
        chunks = parallm.build_model(ckpt, packed=packed, sequence_parallel=packed and tp > 1)
        parallm.load_hf_weights(chunks, ckpt)
        with torch.no_grad():
            out = parallm.forward(chunks, ids, mask)
        report(f"fp32 logits tp={tp} pp={pp} packed={packed}", (out - ref)[real].abs().max().item(), 1e-3)
        if rank == 0:
            print(f"INFO attention backend (fp32, packed={packed}): {chunks[0].attn_impl}")

    chunks = parallm.build_model(ckpt, packed=True, dtype=torch.bfloat16)
    parallm.load_hf_weights(chunks, ckpt)
    with torch.no_grad():
        out = parallm.forward(chunks, ids, mask)
    rel = ((out - ref)[real].abs().max() / ref[real].abs().max()).item()
    report("bf16 packed logits, relative to fp32 transformers", rel, 5e-2)
    if rank == 0:
        print(f"INFO attention backend (bf16, packed): {chunks[0].attn_impl}")
    parallm.destroy_parallel()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
