"""GPU smoke checks for issue 34 items 1, 4, 7 and issue 35 items 3, 5 (the training API); run by
scripts/gpu_smoke.sh. Written on CPU, never run on a GPU yet.

    torchrun --nproc-per-node N scripts/gpu_checks/train.py        (N = 1, 2 or 4 GPUs; NCCL)
    torchrun --nproc-per-node 2 scripts/gpu_checks/train.py --cpu  (a dry run on gloo: checks this script, not
                                                                    the GPU)

Checks, one line each (PASS / FAIL, measured, limit):
  T1. offload / onload on CUDA (bf16 model, AdamW with ZeRO and gradient buckets, between a backward and its
      finalize_grads and between steps): every offloaded storage 0 bytes, torch.cuda.memory_allocated() falls by
      at least 90% of the bytes moved, and two steps with offload equal two without (torch.equal on every weight)
  T2. (N >= 2) MoE with the load-balancing loss (Qwen3-MoE, output_router_logits) at pp = 2, token-mean loss, 2
      microbatches of unequal tokens: each microbatch's token count reaches stage 0 with its gradient (one fp64
      element beside the NCCL gradient message): loss and gradients' total norm against the same step at pp = 1
      on the same GPU ranks (one replica each), relative 1e-5
  T3. one world collective per forward / forward_backward call on NCCL (the agreement on the gloo control group;
      the CP / EP checks on their NCCL groups): counted with bench/call_overhead_bench.py's wrapper at dp = N
      (and cp2.ep2 at N = 4)
  T4. (N >= 2) an empty replica at dp = N with a token-mean loss (token budget too): no hang, loss equal to the
      same step without that replica's rows
  T5. no host sync per metric in forward_backward (torch.cuda.set_sync_debug_mode("warn") counts: 8 tensor
      metrics add none)
Exits 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from gpu_common import Checks, shared_tmp, start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--repo", default=os.environ.get("PARALLM_REPO", os.getcwd()),
                    help="the repository root (for bench/call_overhead_bench.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (--cpu runs the script on gloo)")
        return 1
    import parallm
    from parallm import verify
    from parallm.parallel.state import current_dims
    from parallm.train.offload import KINDS, _tensors, offload, onload
    sys.path.insert(0, os.path.join(args.repo, "bench"))
    import call_overhead_bench as bench

    world, rank, device = start(args.cpu, 29537)
    report = Checks(rank)

    parallm.init_parallel(backend="gloo" if args.cpu else None)
    tmp = shared_tmp("parallm-smoke-train-")
    if rank == 0:
        dense = verify.make_hf_model(verify.tiny_config("qwen2", num_hidden_layers=2), seed=1)
        dense.save_pretrained(os.path.join(tmp, "dense"), safe_serialization=True)
        moe_cfg = verify.tiny_config("qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.3)
        verify.make_hf_model(moe_cfg, seed=2).save_pretrained(os.path.join(tmp, "moe"), safe_serialization=True)
    dist.barrier()
    vocab = 101
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4 * world, 12), generator=g)
    mask = torch.ones_like(ids)
    for i in range(ids.shape[0]):
        mask[i, : (i * 5) % 11] = 0           # left padding of unequal length

    def nll(out, i, m):
        lp = out[:, :-1].float().log_softmax(-1).gather(-1, i[:, 1:, None]).squeeze(-1)
        w = (m[:, 1:] * m[:, :-1]).float()
        return -(lp * w).sum(), w.sum()

    def mine(per=4):
        dims = current_dims()
        return slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)

    # T1 offload / onload
    ckpt = os.path.join(tmp, "dense")
    runs = {}
    for kind in ("plain", "offload"):
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
        parallm.load_hf_weights(chunks, ckpt)
        opt = parallm.build_optimizer(chunks, lr=1e-3, shard_over_dp=True, overlap_grad_reduce=True)
        drop, moved_total, empty = 1.0, 0, True
        for step in range(2):
            sl = mine()
            parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=nll)
            if kind == "offload":
                before = torch.cuda.memory_allocated() if not args.cpu else 0
                moved = offload(chunks, opt)
                after = torch.cuda.memory_allocated() if not args.cpu else 0
                empty = empty and all(t.untyped_storage().nbytes() == 0 for k in KINDS
                                      for t in _tensors(chunks, opt, k))
                if not args.cpu:
                    drop = min(drop, (before - after) / max(moved, 1))
                moved_total += moved
                onload(chunks, opt)
            parallm.finalize_grads(chunks)
            opt.step()
            opt.zero_grad()
        runs[kind] = parallm.save_hf_weights(chunks)
    if rank == 0:
        same = runs["plain"].keys() == runs["offload"].keys() and all(
            torch.equal(runs["plain"][k], runs["offload"][k]) for k in runs["plain"])
        report("T1 offload: storages empty", 0.0 if empty else 1.0, 0.0)
        report("T1 offload: device memory freed per byte moved (1 - fraction)", 1.0 - drop if not args.cpu else 0.0,
               0.1)
        report("T1 offload: weights after two steps equal (0 = equal)", 0.0 if same else 1.0, 0.0)
    parallm.destroy_parallel()

    # T2 MoE aux, pp2 against pp1 (same ranks, one replica per pipeline / rank)
    if world >= 2:
        moe = os.path.join(tmp, "moe")
        results = {}
        for pp in (1, 2):
            parallm.init_parallel(pp=pp, backend="gloo" if args.cpu else None)
            chunks = parallm.build_model(moe)
            parallm.load_hf_weights(chunks, moe)
            dims = current_dims()
            sl = slice(0, 4)       # every replica the same rows: pp1 (dp = world) and pp2 (dp = world / 2) agree
            loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=nll, num_microbatches=2)
            parallm.finalize_grads(chunks)
            norm = parallm.clip_grad_norm_(chunks, 1e9)
            results[pp] = (loss.item(), norm.item())
            parallm.destroy_parallel()
        rel = max(abs(results[1][i] - results[2][i]) / max(abs(results[1][i]), 1e-12) for i in range(2))
        report("T2 MoE aux loss pp2 vs pp1 (loss, grad norm), relative", rel, 1e-5)

    # T3 world collectives per call
    ckpts = {"dense": os.path.join(tmp, "dense"), "moe": os.path.join(tmp, "moe")}
    layouts = ["dp"] + (["cp2.ep2"] if world == 4 else [])
    counts = bench.rank_fn(rank, world, ckpts, layouts, 2)
    worst = max(counts[n][c][1]["world"] for n in layouts for c in ("forward", "forward_backward"))
    report("T3 world collectives per call (max over calls)", worst, 1)

    # T4 empty replica, token-mean, with and without a token budget
    if world >= 2:
        parallm.init_parallel(backend="gloo" if args.cpu else None)
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        dims = current_dims()
        sl = slice(0, 4) if dims.dp_rank == 0 else slice(0, 0)
        got = [parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=nll, num_microbatches=2).item(),
               parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=nll, max_tokens_per_microbatch=20).item()]
        parallm.finalize_grads(chunks)
        parallm.destroy_parallel()
        parallm.init_parallel(backend="gloo" if args.cpu else None)
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        want = parallm.forward_backward(chunks, ids[:4], mask[:4], loss_fn=nll).item()   # every replica: rows 0-3
        parallm.destroy_parallel()
        report("T4 empty replica: loss against the step without it", max(abs(x - want) for x in got), 1e-5)
    _check_syncs(parallm, ckpt, ids, mask, report, args.cpu)
    return report.finish("training")


def _check_syncs(parallm, ckpt, ids, mask, report, cpu: bool) -> None:
    """T5: the loss bookkeeping makes no host sync during the schedule: torch.cuda.set_sync_debug_mode("warn")
    counts the syncs of a forward_backward with a token-mean loss and 8 tensor metrics and of the same call
    without metrics (4 microbatches); they must be equal (the model's own syncs, such as the padding check, are
    in both)."""
    import warnings
    parallm.init_parallel(backend="gloo" if cpu else None)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    device = next(chunks[0].parameters()).device
    batch = {"input_ids": ids[:4].to(device), "attention_mask": mask[:4].to(device)}

    def loss(metrics):
        def fn(out, mb):
            m = mb["attention_mask"][:, 1:].float()
            lp = out[:, :-1]
            n = m.sum()
            extra = {f"m{i}": (lp * m).sum() / n.clamp(min=1) * i for i in range(metrics)}
            return ((-lp * m).sum(), n), extra
        return fn
    counts = []
    for metrics in (0, 8):
        if not cpu:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            parallm.forward_backward(chunks, batch, loss_fn=loss(metrics), num_microbatches=4, output="logprobs")
        if not cpu:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    parallm.destroy_parallel()
    report(f"T5 host syncs of forward_backward with 8 metrics minus without ({counts[1]} vs {counts[0]})",
           float(counts[1] - counts[0]), 0.0)


if __name__ == "__main__":
    sys.exit(main())
