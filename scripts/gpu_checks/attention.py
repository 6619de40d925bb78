"""GPU smoke checks for issue 34 items 2 and 6 (context-parallel block kernel on CUDA, sliding windows): one GPU,
one process; run by scripts/gpu_smoke.sh after scripts/gpu_smoke.py. Written on CPU, never run on a GPU yet.

    python scripts/gpu_checks/attention.py            (CUDA)
    python scripts/gpu_checks/attention.py --cpu      (a dry run on CPU: aten's flash op emulated in fp32 with its documented
                                         bottom-right masks; checks this script's logic, not the GPU)

Checks, one line each (PASS / FAIL, measured, limit):
  A. kernel choice: block_kernel(None, cuda:0 / 0) is the CUDA kernel; cuda_flash_usable on bf16 / fp16 heads of 64
  B. CUDA_BLOCK (aten _flash_attention_forward varlen) against MATH_BLOCK on the same inputs (upcast to fp32),
     grouped-query heads (8 query heads, 2 KV heads, head_dim 64), bf16 and fp16: the pieces of a cp2 split
     (padded rows, and a packed batch of 7 documents of different lengths), all-gather plan and every ring step
     merged by log-sum-exp, windows None and 24: merged output and lse; then the backward from the merged output
     and lse (dq, dk, dv), relative to MATH's norm
  C. fp32 inputs on CUDA: CUDA_BLOCK takes the fp32 tiles (flash needs half precision): equal to MATH to 1e-5
  D. a Mistral with a sliding window of 16 (S = 96, 6x) built packed on this GPU: fp32 logits against
     transformers (eager) 1e-4; bf16 packed logits (the flash path under a window) relative to fp32 < 3e-2
  E. the same Mistral padded: windowed rows through the piece plan (no [S, S] mask), same limits
  F. attention sinks (gpt-oss) through CUDA_BLOCK vs MATH_BLOCK: packed plan, windows None / 24, bf16 (3e-2
     relative) and fp32 (1e-5): output, dq and the sink's gradient
Exits 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (--cpu runs the script's logic on CPU)")
        return 1
    from parallm.model.layers import blocks as A
    from parallm.model.context_parallel import ring_plan, split_batch
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    failures = []

    def report(name, value, limit, ok=None):
        ok = (value <= limit) if ok is None else ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3g} (limit {limit:.3g})")
        if not ok:
            failures.append(name)

    if args.cpu:
        _emulate_flash(A)

    # A. choice
    ok = all(A.block_kernel(None, d) is A.CUDA_BLOCK for d in (torch.device("cuda", 0), 0, "cuda:0"))
    report("A kernel choice on cuda:0 / 0", 0.0 if ok else 1.0, 0.0)
    if not args.cpu:
        for dt in (torch.bfloat16, torch.float16):
            usable = A.cuda_flash_usable(torch.zeros(4, 8, 64, dtype=dt, device=device))
            report(f"A flash usable for {dt}", 0.0 if usable else 1.0, 0.0)

    # B. CUDA_BLOCK vs MATH_BLOCK on the pieces of real splits, merged by lse, forward and backward
    hq, hkv, d = 8, 2, 64
    g = torch.Generator().manual_seed(0)
    cases = []
    ids = torch.randint(1, 100, (3, 160), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    mask[2, 100:] = 0
    cases.append(("padded", ids, mask, False))
    lengths = [150, 7, 64, 33, 1, 90, 12]
    pmask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        pmask[i, :n] = 1
    cases.append(("packed 7 docs", torch.randint(1, 100, pmask.shape, generator=g), pmask, True))
    for dt in (torch.bfloat16, torch.float16):
        tol_out, tol_lse, tol_grad = (3e-2, 1e-2, 5e-2) if dt == torch.bfloat16 else (5e-3, 2e-3, 1e-2)
        worst = dict(out=0.0, lse=0.0, grad=0.0)
        for label, ids, mask, packed in cases:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            for rank in range(2):
                sp = split_batch(ids, pos, mask, cp=2, rank=rank, packed=packed)
                r = sp.slots
                q = torch.randn(r, hq, d, generator=g).to(device, dt)
                kv_all = torch.randn(2 * r, 2, hkv, d, generator=g).to(device, dt)    # gathered, global order
                grad = torch.randn(r, hq, d, generator=g).to(device, dt)
                for window in (None, 24):
                    # the all-gather plan: one call over every chunk and document
                    plans = [("allgather", sp.plan(window), kv_all[:, 0], kv_all[:, 1])]
                    # the ring: every source's block, merged
                    blocks = kv_all.view(2, r, 2, hkv, d)
                    ring = [(f"ring{s}", ring_plan(sp, s, window), blocks[s, :, 0], blocks[s, :, 1])
                            for s in range(2)]
                    for group in (plans, ring):
                        res = {}
                        for name, kernel in (("cuda", A.CUDA_BLOCK), ("math", A.MATH_BLOCK)):
                            acc = torch.zeros(r, hq, d, device=device)
                            lse = torch.full((r, hq), float("-inf"), device=device)
                            for _, plan, k, v in group:
                                if plan.pieces:
                                    A.merge_rows(acc, lse, *kernel.attend(q, k, v, plan, d ** -0.5))
                            dq = torch.zeros(r, hq, d, device=device)
                            dks = [torch.zeros(k.shape, device=device) for _, _, k, _ in group]
                            dvs = [torch.zeros(k.shape, device=device) for _, _, k, _ in group]
                            for (_, plan, k, v), dk, dv in zip(group, dks, dvs):
                                if plan.pieces:
                                    kernel.attend_backward(q, k, v, acc, lse, grad, plan, d ** -0.5, dq, dk, dv)
                            res[name] = (acc, lse, [dq] + dks + dvs)
                        (oc, lc, gc), (om, lm, gm) = res["cuda"], res["math"]
                        seen = torch.isfinite(lm)
                        worst["out"] = max(worst["out"], (oc - om).abs().max().item())
                        worst["lse"] = max(worst["lse"], (lc - lm)[seen].abs().max().item())
                        for a, b in zip(gc, gm):
                            worst["grad"] = max(worst["grad"], ((a - b).norm() / b.norm().clamp_min(1e-12)).item())
        report(f"B {dt} merged output vs fp32 math (max abs)", worst["out"], tol_out)
        report(f"B {dt} merged lse vs fp32 math (max abs)", worst["lse"], tol_lse)
        report(f"B {dt} dq/dk/dv vs fp32 math (relative norm)", worst["grad"], tol_grad)

    # C. fp32 on CUDA: the tiles
    ids, mask = cases[1][1], cases[1][2]
    sp = split_batch(ids, (mask.cumsum(-1) - 1).clamp(min=0), mask, cp=2, rank=1, packed=True)
    q = torch.randn(sp.slots, hq, d, generator=g).to(device)
    k, v = (torch.randn(2 * sp.slots, hkv, d, generator=g).to(device) for _ in range(2))
    plan = sp.plan(24)
    outs = [A.attend_plan(q, k, v, plan, kern) for kern in (A.CUDA_BLOCK, A.MATH_BLOCK)]
    report("C fp32 CUDA_BLOCK (tiles) vs math", (outs[0] - outs[1]).abs().max().item(), 1e-5)

    # D. a windowed Mistral, packed, on this device
    _model_check(device, report, cpu=args.cpu)
    print("all passed" if not failures else f"FAILED: {failures}")
    return 0 if not failures else 1


def _model_check(device, report, *, cpu: bool) -> None:
    import tempfile

    import torch.distributed as dist

    import parallm
    R = __import__("parallm.verify.reference", fromlist=["x"])
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl")
    if not cpu:
        torch.cuda.set_device(device)
    parallm.init_parallel()
    cfg = R.tiny_config("mistral", sliding_window=16, max_position_embeddings=128, num_hidden_layers=2)
    model = R.make_hf_model(cfg, seed=3)
    ids, mask = R.padded_batch(cfg.vocab_size, batch=4, seq=96, seed=2)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits.float()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        got = {}
        for packed in (True, False):      # E: the padded layout's windowed rows through the block kernel
            for dt in (torch.float32, torch.bfloat16):
                chunks = parallm.build_model(tmp, packed=packed, dtype=dt)
                parallm.load_hf_weights(chunks, tmp)
                with torch.no_grad():
                    got[packed, dt] = parallm.forward(chunks, ids.to(device), mask.to(device)).float().cpu()
                del chunks
    real = mask.bool()
    for packed, label in ((True, "D windowed Mistral packed"), (False, "E windowed Mistral padded (piece plan)")):
        report(f"{label} fp32 logits vs transformers", (got[packed, torch.float32] - want)[real].abs().max().item(),
               1e-4)
        rel = ((got[packed, torch.bfloat16] - want)[real].norm() / want[real].norm()).item()
        report(f"{label} bf16 logits vs fp32 transformers (relative)", rel, 3e-2)
    parallm.destroy_parallel()
    _sink_check(device, report)


def _sink_check(device, report) -> None:
    """F: attention sinks through CUDA_BLOCK (aten flash + the sink merged into the lse) against MATH_BLOCK in
    fp32 on the same inputs: a packed plan of 3 documents, window None and 24; output, dq and dsink."""
    from parallm.model.layers import blocks as A
    from parallm.model.layers.attention import make_packing
    g = torch.Generator().manual_seed(4)
    mask = torch.zeros(3, 80, dtype=torch.long)
    for r, n in enumerate((80, 33, 57)):
        mask[r, :n] = 1
    packing = make_packing(mask)
    t = packing.total
    for dt, limit in ((torch.bfloat16, 3e-2), (torch.float32, 1e-5)):
        for window in (None, 24):
            base = [torch.randn(t, h, 64, generator=g) for h in (8, 2, 2)] + [torch.randn(8, generator=g)]
            res = {}
            for name, kernel, dev, dtype in (("cuda", A.CUDA_BLOCK, device, dt), ("math", A.MATH_BLOCK, "cpu",
                                                                                 torch.float32)):
                q, k, v, sink = (x.to(dev, dtype).requires_grad_() for x in base)
                out = A.attend_plan(q, k, v, packing.window_plan(window), kernel, sink=sink)
                out.float().pow(2).sum().backward()
                res[name] = [x.float().cpu() for x in (out.detach(), q.grad, sink.grad)]
            worst = max(((a - b).norm() / b.norm().clamp(min=1e-6)).item() for a, b in zip(res["cuda"], res["math"]))
            report(f"F sinks on CUDA_BLOCK {dt} window {window}: out, dq, dsink vs MATH (relative)", worst, limit)


def _emulate_flash(A) -> None:
    """--cpu: aten's flash op replaced by the tests' fp32 emulation with its documented masks (bottom-right
    aligned), ``cuda_flash_usable`` true for half types as on a GPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
    from cuda_emulation import emulated_flash
    A.flash_forward, A.flash_backward = emulated_flash()
    A.cuda_flash_usable = lambda q: q.dtype in (torch.float16, torch.bfloat16)


if __name__ == "__main__":
    sys.exit(main())
