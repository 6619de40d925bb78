"""GPU checks of the Mamba-2 layers (Nemotron-H / Nemotron-3); run by scripts/gpu_smoke.sh. Never run on a GPU yet.

    pip install mamba-ssm causal-conv1d     (the CUDA kernels; they build against the installed torch)
    torchrun --nproc-per-node 2 scripts/gpu_checks/mamba2.py          (1 or 2 GPUs)
    torchrun --nproc-per-node 2 scripts/gpu_checks/mamba2.py --cpu    (dry run on gloo: the kernel check is
                                                                        skipped)

Checks, one line each (PASS / FAIL, value, limit):
  m1. the mamba_ssm kernels (mamba_chunk_scan_combined with seq_idx, causal_conv1d_fn with seq_idx) against
      parallm's torch path on a packed stream of 5 documents (lengths 1 .. 150, 8 heads in 2 groups, chunk 64):
      fp32 outputs and the gradients of x, dt, B, C, D and the conv weight and bias; bf16 outputs, relative
  m2. build_model's kernel: "auto" picks mamba_ssm on CUDA for bf16 (chunk.mamba_kernel == "mamba_ssm"), torch
      for fp32, torch when PARALLM_MAMBA_KERNEL=torch
  m3-m4. a tiny Nemotron-H (M*-EM, rows of 150 tokens, chunk 64) at tp = world: packed + sequence parallel (m3)
      and padded with left padding (m4, the torch path whatever the kernel): fp32 logits against transformers
      (run with its torch fallback), with each kernel (mamba_ssm asked for by name at fp32: limit 1e-3)
  m5. bf16 packed on mamba_ssm (auto) against fp32 transformers, relative
  m6. the torch SSD scan passes the state chunk to chunk (issue 55): on the device, groups of 1 and 3 chunks
      against one group of every chunk (fp32, 4 documents, relative 1e-5); peak allocated memory of forward +
      backward at 4096 and 16384 tokens (128 heads of 64, state 128, chunk 256): x4 tokens -> <= x4.5 memory
      (device only; the --cpu dry run checks the equality)
Exits 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from gpu_common import Checks  # noqa: E402 (this folder is first on sys.path when run as a script)

report = Checks(int(os.environ.get("RANK", "0")))      # one PASS / FAIL line per check, on rank 0


def check_kernels(device):
    from parallm.model.layers import mamba2
    ms = mamba2.KERNELS["mamba_ssm"]
    why = ms.unavailable(device, torch.float32)
    if why is not None:
        print(f"SKIP m1 mamba_ssm kernels: {why}")
        return
    tk = mamba2.KERNELS["torch"]
    g = torch.Generator().manual_seed(0)
    lengths = [70, 5, 150, 1, 40]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    total = sum(lengths)
    for dtype, limit in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        base = dict(x=torch.randn(total, 8, 32, generator=g), dt=torch.rand(total, 8, generator=g) * 0.5 + 0.01,
                    b=torch.randn(total, 2, 16, generator=g), c=torch.randn(total, 2, 16, generator=g),
                    d=torch.randn(8, generator=g), xc=torch.randn(total, 64, generator=g),
                    w=torch.randn(64, 1, 4, generator=g) * 0.3, wb=torch.randn(64, generator=g) * 0.1)
        a = -torch.rand(8, generator=g).to(device) - 0.1
        outs, grads = {}, {}
        for kernel in (tk, ms):
            t = {k: v.to(device=device, dtype=torch.float32 if k in ("dt", "d") else dtype).requires_grad_()
                 for k, v in base.items()}
            y = kernel.scan(t["x"], t["dt"], a, t["b"], t["c"], t["d"], cu, chunk=64)
            conv = kernel.conv(t["xc"], t["w"], t["wb"], cu)
            (y.float().pow(2).sum() + conv.float().pow(2).sum()).backward()
            outs[kernel.name] = (y.float().detach(), conv.float().detach())
            grads[kernel.name] = {k: v.grad.float() for k, v in t.items()}
        scale = max(outs["torch"][0].abs().max().item(), 1.0)
        report(f"m1 mamba_ssm scan vs torch {dtype} (relative)",
               (outs["mamba_ssm"][0] - outs["torch"][0]).abs().max().item() / scale, limit)
        report(f"m1 causal_conv1d vs torch {dtype}",
               (outs["mamba_ssm"][1] - outs["torch"][1]).abs().max().item(), limit)
        if dtype == torch.float32:
            worst = max((grads["mamba_ssm"][k] - grads["torch"][k]).abs().max().item()
                        / max(grads["torch"][k].abs().max().item(), 1.0) for k in base)
            report("m1 mamba_ssm gradients vs torch fp32 (relative)", worst, 5e-3)


def check_scan(device, *, cpu: bool):
    import torch.nn.functional as F

    from parallm.model.layers import mamba2
    g = torch.Generator().manual_seed(3)

    def inputs(length, h, p, n, grp):
        t = [torch.randn(1, length, h, p, generator=g), torch.randn(1, length, h, generator=g),
             torch.randn(1, length, grp, n, generator=g), torch.randn(1, length, grp, n, generator=g)]
        return [v.to(device).requires_grad_() for v in t] + [(-torch.rand(h, generator=g) - 0.1).to(device)]

    x, dt, b, c, a = inputs(1000, 8, 16, 16, 2)
    reset = torch.zeros(16, dtype=torch.bool, device=device)
    reset[::4] = True
    whole = mamba2.ssd_scan(x, F.softplus(dt), a, b, c, chunk=64, reset=reset, budget=1 << 40)
    for chunks in (1, 3):
        part = mamba2.ssd_scan(x, F.softplus(dt), a, b, c, chunk=64, reset=reset, budget=chunks * 8 * 64 * 64)
        report(f"m6 torch scan in groups of {chunks} chunk(s) vs one group (relative)",
               ((part - whole).abs().max() / whole.abs().max()).item(), 1e-5)
    if cpu:
        return
    peaks = []
    for length in (4096, 16384):
        x, dt, b, c, a = inputs(length, 128, 64, 128, 8)
        reset = torch.zeros(length // 256, dtype=torch.bool, device=device)
        reset[::max(1, len(reset) // 4)] = True
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        mamba2.ssd_scan(x, F.softplus(dt), a, b, c, chunk=256, reset=reset).square().sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del x, dt, b, c
    print(f"     m6 peaks: {peaks[0] / 2**20:.0f} MiB at 4096 tokens, {peaks[1] / 2**20:.0f} MiB at 16384")
    report("m6 torch scan peak memory growth for 4x the tokens", peaks[1] / peaks[0], 4.5)


def check_model(parallm, R, device, world, workdir, *, cpu: bool):
    import transformers

    from parallm.model.layers import mamba2
    tp = world if world in (1, 2) else 2
    cfg = transformers.NemotronHConfig(
        hybrid_override_pattern="M*-EM", hidden_size=64, vocab_size=101, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
        conv_kernel=4, chunk_size=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, attn_implementation="eager")
    ckpt = os.path.join(workdir, "nemotron")
    if dist.get_rank() == 0:
        R.make_hf_model(cfg, seed=5).save_pretrained(ckpt)
    dist.barrier()
    model = R.make_hf_model(cfg, seed=5)
    ids, mask = R.padded_batch(cfg.vocab_size, batch=4, seq=150, seed=2)
    with torch.no_grad():
        ref = R.hf_output(model, ids, mask)
    ms_ok = mamba2.KERNELS["mamba_ssm"].unavailable(device, torch.bfloat16) is None
    for name, dtype in (("auto", torch.float32), ("auto", torch.bfloat16), ("torch", torch.bfloat16)):
        os.environ[mamba2.KERNEL_ENV] = name
        parallm.init_parallel(tp=tp)
        chunks = parallm.build_model(ckpt, dtype=dtype)
        want = "mamba_ssm" if (name == "auto" and dtype != torch.float32 and ms_ok) else "torch"
        report(f"m2 kernel under {name} {dtype} is {want} (0 = yes)", float(chunks[0].mamba_kernel != want), 0)
        parallm.destroy_parallel()
    layouts = [("m3 packed+SP", dict(packed=True, sequence_parallel=tp > 1)), ("m4 padded", {})]
    for name in (["torch"] if cpu or not ms_ok else ["mamba_ssm", "torch"]):
        os.environ[mamba2.KERNEL_ENV] = name
        for label, build in layouts:
            parallm.init_parallel(tp=tp)
            chunks = parallm.build_model(ckpt, **build)
            parallm.load_hf_weights(chunks, ckpt)
            out = parallm.forward(chunks, ids.to(device), mask.to(device)).cpu()
            report(f"{label} tp={tp} fp32 logits, kernel {chunks[0].mamba_kernel}", R.max_diff_real(out, ref, mask),
                   1e-3 if chunks[0].mamba_kernel == "mamba_ssm" else 1e-4)
            parallm.destroy_parallel()
    if ms_ok and not cpu:
        os.environ[mamba2.KERNEL_ENV] = "auto"
        parallm.init_parallel(tp=tp)
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16, packed=True)
        parallm.load_hf_weights(chunks, ckpt)
        out = parallm.forward(chunks, ids.to(device), mask.to(device)).float().cpu()
        scale = ref[mask.bool()].abs().max().item()
        report(f"m5 bf16 packed logits on {chunks[0].mamba_kernel} vs fp32 transformers (relative)",
               R.max_diff_real(out, ref, mask) / scale, 3e-2)
        parallm.destroy_parallel()
    os.environ.pop(mamba2.KERNEL_ENV, None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    import importlib

    from gpu_common import shared_tmp, start

    import parallm
    R = importlib.import_module("parallm.verify.reference")
    world, rank, device = start(args.cpu, 29541)
    dist.init_process_group("gloo" if args.cpu else "nccl")
    if rank == 0:
        check_kernels(device)
        check_scan(device, cpu=args.cpu)
    dist.barrier()
    check_model(parallm, R, device, world, shared_tmp("parallm_mamba2_check_"), cpu=args.cpu)
    return report.finish("Mamba-2")


if __name__ == "__main__":
    sys.exit(main())
