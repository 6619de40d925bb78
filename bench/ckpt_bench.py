"""Training-checkpoint benchmark (parallm.save_checkpoint / load_checkpoint / build_optimizer). Not a test.

    python bench/ckpt_bench.py [--workdir DIR] [--layers 8] [--repeat 3]

A LLaMA-shaped fp32 model (hidden 512, vocab 32000) with AdamW state after one step, on 4 gloo ranks. Each figure
is a ratio against a reference measured in the same run:
  save wall (tp2 x pp2, sync)        / one process torch.save of the same bytes (the unsharded model and both
                                       moments) to one file, fsynced (DCP fsyncs every file it writes)
  async save: time until it returns  / the sync save (the rest is written while the caller goes on)
  resharded load wall (tp4; tp1 x pp2 x vpp2 x dp2) / same-layout load wall (tp2 x pp2), page cache warm
  optimizer state bytes per rank with shard_over_dp / without, at dp 2 and dp 4, fp32 and bf16 models
Timings are the best of --repeat runs (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_world, table  # noqa: E402


def config(layers):
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1536,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                hidden_act="silu", torch_dtype="float32")


def _model(parallm, cfg, dtype, *, shard=False):
    import torch
    chunks = parallm.build_model(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    parallm.mark_loaded(chunks)           # filled by hand: save_checkpoint refuses a model never loaded
    opt = parallm.build_optimizer(chunks, lr=1e-4, weight_decay=0.1, shard_over_dp=shard)
    for c in chunks:   # one step with made-up gradients: moments are not zeros
        for p in c.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype) * 1e-3
    opt.step()
    opt.zero_grad()
    return chunks, opt


def rank_io(rank, world, cfg, workdir, repeat):
    import torch
    import torch.distributed as dist
    import parallm
    from parallm.parallel.state import dims_of
    out = {}
    parallm.init_parallel(tp=2, pp=2)
    chunks, opt = _model(parallm, cfg, torch.float32)
    path = os.path.join(workdir, "ckpt")

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    out["save"] = min(timed(lambda chunks=chunks, opt=opt: parallm.save_checkpoint(path, chunks, opt, step=1,
                                                                                    overwrite=True))
                      for _ in range(repeat))
    handles = []

    def async_call(chunks=chunks, opt=opt):
        handles.append(parallm.save_checkpoint(path + "-async", chunks, opt, step=1, overwrite=True,
                                               async_save=True))
    calls, totals = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        calls.append(timed(async_call))
        handles.pop().wait()
        dist.barrier()
        totals.append(time.perf_counter() - t0)
    out["async_call"], out["async_total"] = min(calls), min(totals)
    out["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
    # reference: one process torch.save of the same bytes (global shapes, model + two moments), fsynced
    if rank == 0:
        from parallm.checkpoint.training import read_tensors
        ref = read_tensors(path)
        out["ref_bytes"] = sum(t.numel() * t.element_size() for t in ref.values())
        best = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            with open(os.path.join(workdir, "ref.pt"), "wb") as f:
                torch.save(ref, f)
                f.flush()
                os.fsync(f.fileno())
            best = min(best or 1e9, time.perf_counter() - t0)
        out["torch_save"] = best
        del ref
    dist.barrier()
    # bytes the loads read (every stored item a rank's boxes overlap is read whole and CRC-checked)
    from parallm.checkpoint import dcp_io
    read, original = [0], dcp_io.VerifyingReader._slice_file

    def counting(self, file, sinfo):
        read[0] += sinfo.length
        return original(self, file, sinfo)
    dcp_io.VerifyingReader._slice_file = counting
    # every load the same way: a fresh model and optimizer at the layout, then timed loads (page cache warm)
    for name, (tp, pp, vpp) in (("same", (2, 2, None)), ("tp4", (4, 1, None)), ("tp1 x pp2 x vpp2 x dp2", (1, 2, 2)),
                                ("same (again)", (2, 2, None))):
        parallm.destroy_parallel()
        parallm.init_parallel(tp=tp, pp=pp, vpp=vpp)
        chunks = parallm.build_model(cfg)
        opt = parallm.build_optimizer(chunks, lr=1e-4)
        read[0] = 0
        out[name] = min(timed(lambda chunks=chunks, opt=opt: parallm.load_checkpoint(path, chunks, opt))
                        for _ in range(repeat))
        out[f"{name} bytes"] = read[0] / repeat
    dcp_io.VerifyingReader._slice_file = original
    # optimizer memory per rank
    mem = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tp in (2, 1):
            for shard in (False, True):
                parallm.destroy_parallel()
                parallm.init_parallel(tp=tp)
                chunks, opt = _model(parallm, cfg, dtype, shard=shard)
                mem[(str(dtype).replace("torch.", ""), dims_of(chunks).dp, shard)] = opt.state_bytes()
                del chunks, opt
    out["mem"] = mem
    parallm.destroy_parallel()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="parallm-ckpt-bench-")
    os.makedirs(workdir, exist_ok=True)
    cfg = config(args.layers)
    try:
        res = run_world(rank_io, 4, cfg, workdir, args.repeat)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    r0 = res[0]
    r0["same"] = min(r0["same"], r0["same (again)"])
    mib = r0["ref_bytes"] / 2 ** 20
    print(f"model: hidden 512, {args.layers} layers, vocab 32000, fp32; checkpoint {mib:.0f} MiB of tensors "
          f"(model + exp_avg + exp_avg_sq), DCP files {r0['bytes'] / 2 ** 20:.0f} MiB")
    rows = [
        ["save (tp2 x pp2, 4 writers) / torch.save one file, both fsynced",
         f"{r0['save']:.2f} s / {r0['torch_save']:.2f} s = {r0['save'] / r0['torch_save']:.2f}"],
        ["async save: returns after / sync save", f"{r0['async_call']:.2f} s / {r0['save']:.2f} s = "
         f"{r0['async_call'] / r0['save']:.2f} (done after {r0['async_total']:.2f} s)"],
    ]
    for name in ("tp4", "tp1 x pp2 x vpp2 x dp2"):
        rows.append([f"load resharded to {name} / same-layout load (tp2 x pp2)",
                     f"{r0[name]:.2f} s / {r0['same']:.2f} s = {r0[name] / r0['same']:.2f}"])
    for name in ("same", "tp4", "tp1 x pp2 x vpp2 x dp2"):
        total = sum(r[f"{name} bytes"] for r in res)
        rows.append([f"bytes read by all ranks, load at {name} / bytes stored",
                     f"{total / 2 ** 20:.0f} MiB / {r0['bytes'] / 2 ** 20:.0f} MiB = {total / r0['bytes']:.2f}"])
    print(table(rows, ["metric", "value"]))
    mem_rows = []
    for dtype in ("float32", "bfloat16"):
        for dp in (2, 4):
            per_rank = [(r["mem"][(dtype, dp, False)], r["mem"][(dtype, dp, True)]) for r in res]
            full = max(a for a, _ in per_rank)
            sharded = max(b for _, b in per_rank)
            mem_rows.append([dtype, dp, f"{full / 2 ** 20:.1f}", f"{sharded / 2 ** 20:.1f}",
                             f"{sharded / full:.2f} (1/dp = {1 / dp:.2f})"])
    print(table(mem_rows, ["model dtype", "dp", "state MiB/rank, not sharded", "sharded (max over ranks)",
                           "ratio"]))


if __name__ == "__main__":
    main()
