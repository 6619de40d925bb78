"""GPU checks of the Gated DeltaNet layers (Qwen3.5 / Qwen3-Next); run by scripts/gpu_smoke.sh. Never run on a
GPU yet.

    pip install -e ".[gpu]"       (fla-core, einops: the flash-linear-attention kernels)
    torchrun --nproc-per-node 2 scripts/gpu_checks/gated_deltanet.py          (1 or 2 GPUs)
    torchrun --nproc-per-node 2 scripts/gpu_checks/gated_deltanet.py --cpu    (dry run on gloo: the fla check
                                                                               is skipped)

Checks, one line each (PASS / FAIL, value, limit):
  q1. the fla kernels (chunk_gated_delta_rule, causal_conv1d with cu_seqlens) against parallm's torch path on a
      packed stream of 5 documents (lengths 1 .. 150, grouped values 2 -> 4 heads): fp32 outputs and the
      gradients of q, k, v, g, beta, x and the conv weight; bf16 outputs, relative
  q2. build_model's kernel: "auto" picks fla on CUDA for bf16 (chunk.gdn_kernel == "fla"), torch for fp32 (fla's
      Triton dots would run TF32), torch when PARALLM_GDN_KERNEL=torch
  q3-q5. a tiny Qwen3.5 (4 layers, linear / full alternating, rows of 150 tokens) at tp = world: packed +
      sequence parallel (q3), padded with left padding and a hole between real tokens (q4: fla runs each row's
      span as a document of its varlen path), cp2 padded (q5, 2 GPUs): fp32 logits against transformers (run
      with its torch fallback), with each kernel (fla asked for by name at fp32: limit 1e-3 for its TF32 dots)
  q6. bf16 padded on fla (auto) against fp32 transformers, relative (rows padded at their ends: packed inside,
      attention on the packed kernel, flash-attn where installed)
  q7. fp32, rows padded only at their ends: the whole model runs packed inside (the first layer's input [T, 1, H])
      and gives transformers' logits
Exits 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

FAILS = []


def report(name, value, limit):
    ok = value <= limit
    if not ok:
        FAILS.append(name)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {value:.2e} (limit {limit:.0e})", flush=True)


def check_kernels(device):
    from parallm.model.layers import gated_deltanet as gdn
    fla = gdn.KERNELS["fla"]
    why = fla.unavailable(device, torch.float32)
    if why is not None:
        print(f"SKIP q1 fla kernels: {why}")
        return
    torch_k = gdn.KERNELS["torch"]
    g = torch.Generator().manual_seed(0)
    lengths = [70, 5, 150, 1, 40]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    total = sum(lengths)
    for dtype, limit in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        def data():
            t = dict(q=torch.randn(total, 2, 32, generator=g), k=torch.randn(total, 2, 32, generator=g),
                     v=torch.randn(total, 4, 32, generator=g), g=-torch.rand(total, 4, generator=g) * 0.3,
                     beta=torch.rand(total, 4, generator=g), x=torch.randn(total, 64, generator=g),
                     w=torch.randn(64, 1, 4, generator=g) * 0.3)
            return t
        base = data()
        outs, grads = {}, {}
        for kernel in (torch_k, fla):
            t = {k: v.to(device=device, dtype=dtype if k not in ("g",) else torch.float32).requires_grad_()
                 for k, v in base.items()}
            o = kernel.rule(t["q"], t["k"], t["v"], t["g"], t["beta"], cu)
            c = kernel.conv(t["x"], t["w"], cu)
            (o.float().pow(2).sum() + c.float().pow(2).sum()).backward()
            outs[kernel.name] = (o.float().detach(), c.float().detach())
            grads[kernel.name] = {k: v.grad.float() for k, v in t.items()}
        scale = max(outs["torch"][0].abs().max().item(), 1.0)
        report(f"q1 fla rule vs torch {dtype} (relative)",
               (outs["fla"][0] - outs["torch"][0]).abs().max().item() / scale, limit)
        report(f"q1 fla conv vs torch {dtype}", (outs["fla"][1] - outs["torch"][1]).abs().max().item(), limit)
        if dtype == torch.float32:
            worst = max((grads["fla"][k] - grads["torch"][k]).abs().max().item()
                        / max(grads["torch"][k].abs().max().item(), 1.0) for k in base)
            report("q1 fla gradients vs torch fp32 (relative)", worst, 5e-3)


def check_model(parallm, R, device, world, workdir, *, cpu: bool):
    from parallm.model.layers import gated_deltanet as gdn
    tp = world if world in (1, 2) else 2
    cfg = R.tiny_config("qwen3_5_text", num_hidden_layers=4, full_attention_interval=2, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16)
    ckpt = os.path.join(workdir, "q35")
    if dist.get_rank() == 0:
        model = R.make_hf_model(cfg, seed=5)
        model.save_pretrained(ckpt)
    dist.barrier()
    model = R.make_hf_model(cfg, seed=5)
    ids, mask = R.padded_batch(cfg.vocab_size, batch=4, seq=150, seed=2)
    holed = mask.clone()
    holed[1, 60:66] = 0                  # padding between real tokens: run through, as transformers does
    with torch.no_grad():
        ref = R.hf_output(model, ids, mask)
        ref_holed = R.hf_output(model, ids, holed)
    fla_ok = gdn.KERNELS["fla"].unavailable(device, torch.bfloat16) is None
    # q2: auto takes fla for bf16 / fp16 only (fp32: Triton's dots would run TF32), torch when asked
    for name, dtype in (("auto", torch.float32), ("auto", torch.bfloat16), ("torch", torch.bfloat16)):
        os.environ[gdn.KERNEL_ENV] = name
        parallm.init_parallel(tp=tp)
        chunks = parallm.build_model(ckpt, dtype=dtype)
        want = "fla" if (name == "auto" and dtype != torch.float32 and fla_ok) else "torch"
        report(f"q2 kernel under {name} {dtype} is {want} (0 = yes)", float(chunks[0].gdn_kernel != want), 0)
        parallm.destroy_parallel()
    # q3-q5: the layouts on each kernel (fla asked for by name at fp32), fp32 logits against transformers
    layouts = [("q3 packed+SP", dict(packed=True, sequence_parallel=tp > 1), dict(tp=tp), mask, ref),
               ("q4 padded (left padding, a hole)", {}, dict(tp=tp), holed, ref_holed)]
    if world == 2:
        layouts.append(("q5 cp2 padded", {}, dict(tp=1, cp=2), mask, ref))
    for name in (["torch"] if cpu or not fla_ok else ["fla", "torch"]):
        os.environ[gdn.KERNEL_ENV] = name
        for label, build, layout, m, want in layouts:
            parallm.init_parallel(**layout)
            chunks = parallm.build_model(ckpt, **build)
            parallm.load_hf_weights(chunks, ckpt)
            out = parallm.forward(chunks, ids.to(device), m.to(device)).cpu()
            report(f"{label} {layout} fp32 logits, kernel {chunks[0].gdn_kernel}", R.max_diff_real(out, want, m),
                   1e-3 if chunks[0].gdn_kernel == "fla" else 1e-4)
            parallm.destroy_parallel()
    # q7: a padded batch whose rows are padded only at their ends runs packed inside (every layer on the real
    # tokens; attention on the packed half of the model's "padded+packed" backend): fp32 logits vs transformers
    parallm.init_parallel(tp=tp)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    seen = []
    hook = chunks[0].layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    out = parallm.forward(chunks, ids.to(device), mask.to(device)).cpu()
    hook.remove()
    report(f"q7 padded rows packed inside (attention {chunks[0].attn_impl}; layer input batch dim {seen[0]}, "
           f"1 = packed) fp32 logits, kernel {chunks[0].gdn_kernel}",
           R.max_diff_real(out, ref, mask) if seen == [1] and chunks[0].packs_inside(mask.to(device))
           else float("inf"), 1e-3 if chunks[0].gdn_kernel == "fla" else 1e-4)
    parallm.destroy_parallel()
    if fla_ok and not cpu:      # q6: bf16 on fla (auto), padded (packed inside), against fp32 transformers
        os.environ[gdn.KERNEL_ENV] = "auto"
        parallm.init_parallel(tp=tp)
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
        parallm.load_hf_weights(chunks, ckpt)
        out = parallm.forward(chunks, ids.to(device), mask.to(device)).float().cpu()
        scale = ref[mask.bool()].abs().max().item()
        report(f"q6 bf16 padded logits on {chunks[0].gdn_kernel}, attention {chunks[0].attn_impl}, vs fp32 "
               "transformers (relative)",
               R.max_diff_real(out, ref, mask) / scale, 3e-2)
        parallm.destroy_parallel()
    os.environ.pop(gdn.KERNEL_ENV, None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    import importlib

    import parallm
    R = importlib.import_module("parallm.verify.reference")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29537")
    world = int(os.environ["WORLD_SIZE"])
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    if dist.get_rank() == 0:
        check_kernels(device)
    dist.barrier()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = [tmp]
        dist.broadcast_object_list(workdir, src=0)
        check_model(parallm, R, device, world, workdir[0], cpu=args.cpu)
    print(f"rank {dist.get_rank()}: {'all passed' if not FAILS else 'FAILED: ' + ', '.join(FAILS)}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
