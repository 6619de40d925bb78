"""Checkpoint I/O benchmark (issue: I/O at scale). Not part of the test suite.

    python bench/io_bench.py [--workdir DIR] [--layers 12]

Builds a ~430 MB bf16 LLaMA checkpoint in several files, then at tp 2 x pp 2 (4 gloo ranks) measures, each as a
ratio against a reference measured in the same run:
  slice load wall            / one process materialising every tensor of the checkpoint
  broadcast rank-0 peak extra anonymous memory / largest tensor
  broadcast load wall        / (checkpoint bytes / gloo broadcast bandwidth of this world)
  parallel save wall         / one process safetensors save_file of the same state dict (without and with
                               os.sync: neither side fsyncs by itself)
Each timing is the best of a few runs; the machine is shared, so run it twice and look at both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, rss_anon, run_world, table, write_shards  # noqa: E402


def make_checkpoint(path, layers):
    import torch
    h, inter, heads, kv, vocab = 1024, 2816, 16, 4, 32000
    d = h // heads
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=h, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               hidden_act="silu", torch_dtype="bfloat16")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": t(vocab, h), "model.norm.weight": t(h), "lm_head.weight": t(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": t(h), p + "post_attention_layernorm.weight": t(h),
                        p + "self_attn.q_proj.weight": t(heads * d, h), p + "self_attn.k_proj.weight": t(kv * d, h),
                        p + "self_attn.v_proj.weight": t(kv * d, h), p + "self_attn.o_proj.weight": t(h, heads * d),
                        p + "mlp.gate_proj.weight": t(inter, h), p + "mlp.up_proj.weight": t(inter, h),
                        p + "mlp.down_proj.weight": t(h, inter)})
    return write_shards(path, tensors.items(), 100 * 2 ** 20)


def materialise_all(path) -> float:
    """Reference: one process reads every tensor of the checkpoint into memory (bytes touched)."""
    import torch
    from safetensors import safe_open
    t0 = time.perf_counter()
    checksum = 0
    for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for k in f.keys():
                # get_tensor maps the file (zero-copy); materialising means copying into memory, as a load does
                x = f.get_tensor(k).clone()
                checksum += int(x.view(torch.uint8)[::4096].sum())
    return time.perf_counter() - t0


def save_reference(state, path, sync: bool) -> float:
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if sync:
        os.sync()
    return time.perf_counter() - t0


def rank_bench(rank, world, ckpt, total_bytes, workdir):
    import torch
    import torch.distributed as dist

    import parallm
    parallm.init_parallel(tp=2, pp=2)
    out = {}
    # gloo broadcast bandwidth of this world (64 MiB from rank 0)
    buf = torch.empty(32 * 2 ** 20, dtype=torch.bfloat16)
    dist.broadcast(buf, src=0)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        dist.broadcast(buf, src=0)
    dist.barrier()
    out["bcast_bw"] = 3 * buf.numel() * 2 / (time.perf_counter() - t0)

    def timed_load(mode):
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p.zero_()
        base = rss_anon()
        dist.barrier()
        with PeakRss() as peak:
            t = time.perf_counter()
            parallm.load_hf_weights(chunks, ckpt, mode=mode)
            dist.barrier()
            wall = time.perf_counter() - t
        return chunks, wall, peak.peak - base

    for mode in ("slice", "broadcast"):
        timed_load(mode)  # warm-up: page cache, allocator
    chunks, out["slice_wall"], _ = timed_load("slice")
    del chunks
    chunks, out["bcast_wall"], out["bcast_extra"] = timed_load("broadcast")
    target = os.path.join(workdir, "saved")
    state = parallm.save_hf_weights(chunks)
    ref_dir = os.path.join(workdir, "ref-save")
    os.makedirs(ref_dir, exist_ok=True)
    for sync in (False, True):     # without / with flushing to disk (neither save_file nor parallm fsyncs)
        walls, refs = [], []
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            parallm.save_hf_weights(chunks, target, overwrite=True, max_shard_size="100MB")
            if sync:
                os.sync()
            dist.barrier()
            walls.append(time.perf_counter() - t)
            if rank == 0:
                refs.append(save_reference(state, ref_dir, sync))
            dist.barrier()
        out[f"save_wall_sync{sync}"] = min(walls)
        if rank == 0:
            out[f"save_ref_sync{sync}"] = min(refs)
    dist.barrier()
    parallm.destroy_parallel()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="parallm-bench-")
    ckpt = os.path.join(workdir, "ckpt")
    total, largest, nfiles = make_checkpoint(ckpt, args.layers)
    materialise_all(ckpt)                      # warm the page cache
    ref_load = min(materialise_all(ckpt) for _ in range(2))
    res = run_world(rank_bench, 4, ckpt, total, workdir)
    r0 = res[0]
    slice_wall = max(r["slice_wall"] for r in res)
    bcast_wall = max(r["bcast_wall"] for r in res)
    ideal_bcast = total / r0["bcast_bw"]
    rows = [
        ("slice load / materialise-all (1 proc)", f"{slice_wall:.2f} s / {ref_load:.2f} s",
         f"{slice_wall / ref_load:.2f}", "<= 3 (goal 1)"),
        ("broadcast rank-0 peak extra anon / largest tensor", f"{r0['bcast_extra'] / 2**20:.1f} MiB / "
         f"{largest / 2**20:.1f} MiB", f"{r0['bcast_extra'] / largest:.2f}", "<= 3 (goal 2)"),
        ("broadcast load / (bytes / gloo bcast bandwidth)", f"{bcast_wall:.2f} s / {ideal_bcast:.2f} s "
         f"({r0['bcast_bw'] / 2**20:.0f} MiB/s)", f"{bcast_wall / ideal_bcast:.2f}", "report"),
    ]
    for sync in (False, True):
        wall = max(r[f"save_wall_sync{sync}"] for r in res)
        ref = r0[f"save_ref_sync{sync}"]
        rows.append((f"parallel save / save_file (1 proc){' incl. os.sync' if sync else ''}",
                     f"{wall:.2f} s / {ref:.2f} s", f"{wall / ref:.2f}", "<= 1.5 (goal 1)"))
    print(f"checkpoint: {total / 2**20:.0f} MiB bf16 in {nfiles} files, largest tensor {largest / 2**20:.1f} MiB; "
          f"layout tp=2 x pp=2 (4 gloo ranks, {os.cpu_count()} cores)")
    print(table(rows, ["metric", "measured", "ratio", "target"]))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
