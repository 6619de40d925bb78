"""Checkpoint loading benchmarks (issues: load speed vs transformers; dtype conversion). Not part of the tests.

    python bench/load_bench.py vs-transformers [--size 383MB|1.5GB] [--reps 5] [--workdir DIR]
    python bench/load_bench.py dtype [--reps 3] [--workdir DIR]

vs-transformers
    A Qwen2-shaped fp32 checkpoint in 60 MB shards (``--size 383MB``: hidden 512, 24 layers, vocab 32000, untied;
    ``--size 1.5GB``: hidden 1024, 24 layers, inter 3072). On 2 gloo ranks, alternately in the same processes:
    transformers' ``from_pretrained(tp_plan="auto")`` (needs the ``accelerate`` package) and parallm's
    ``build_model`` + ``load_hf_weights`` at tp=2 (``--mode``, default auto). Each side's time is the wall of
    rank 0 between two barriers, the best of ``--reps``; the ratio is transformers / parallm (speed of parallm
    relative to transformers: > 1 is faster). GB/s = checkpoint bytes / time. A third row, the copy floor: each
    rank copies its half of every tensor from the page cache into fresh memory and does nothing else.

dtype
    A bf16 checkpoint shaped as Qwen2.5-0.5B (24 layers, hidden 896, 14 heads / 2 KV heads, inter 4864, vocab
    151936, tied; ~942 MB), at tp2 x pp2 on 4 gloo ranks, ``mode="slice"``: ``load_hf_weights`` into a model
    built in bf16 and into one built in fp32, best of ``--reps`` each, four ways:
      fresh     in one world of processes, a new model per load: the load pays the first touch of the
                parameters' pages, which the kernel zeroes (twice as many for fp32); every model's memory is
                fresh, whatever the dtype (``fresh_pages_on_free``), and the previous model is freed (checked);
      touched   the same, with the parameters zeroed before the clock starts (as bench/io_bench.py measures):
                parallm's own work;
      floor     no loader: each rank copies each of its parameters (from a loaded bf16 model) into a fresh
                tensor of the target dtype: what writing the bytes into fresh memory costs on this machine;
      first     the first load of a new world of processes (one world per load, the dtypes alternating), as a
                trainer loads once at start.
    The fresh, floor and first cases run twice: as they come, and with the VM's memory warmed just before (each
    rank writes and frees 1.25x its fp32 model's bytes right before the case, for both dtypes). On the VMs here
    the host backs guest memory lazily: the first ~2.5 GB of fresh memory in use cost ~0.4 ms per MiB, every MiB
    past that ~3 ms (measured: 2.5 vs 0.35 GB/s filling fresh memory), unless it was touched in the last
    seconds. The fp32 model (2.4 GB on top of the ranks' own ~1.2 GB) crosses that line and the bf16 one does
    not, so "as they come" prices the fp32 load's second half at the host's rate, whoever writes it (the floor
    too). Warmed, both dtypes' pages are fresh to the process and zeroed by the kernel, as on a host without
    that lazy backing.
    The page faults during the loads are reported (all ranks). Target: fp32 <= 2.0x bf16 (twice the bytes are
    written).

Both sides read from the page cache (the checkpoint is read once before timing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings
import weakref

sys.path.insert(0, os.path.dirname(__file__))
from common import run_world, table, write_shards  # noqa: E402

SIZES = {
    "383MB": dict(hidden_size=512, intermediate_size=1344, num_hidden_layers=24, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False),
    "1.5GB": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
}
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def qwen2_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (inter, h),
                       p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def make_checkpoint(path: str, cfg: dict, dtype_name: str, shard_bytes: int) -> int:
    """Random weights (N(0, 0.02)) written as HF safetensors shards of at most ``shard_bytes``; returns bytes."""
    import torch
    dtype = getattr(torch, dtype_name)
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", torch_dtype=dtype_name, **cfg)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(0)
    tensors = ((name, (torch.randn(*shape, generator=g) * 0.02).to(dtype))
               for name, shape in qwen2_tensors(cfg).items())
    return write_shards(path, tensors, shard_bytes)[0]


def prepared_checkpoint(workdir: str, name: str, cfg: dict, dtype_name: str, shard_bytes: int) -> tuple[str, int]:
    """``workdir/name``, written by :func:`make_checkpoint` unless it is there already, read once into the page
    cache; returns (path, bytes of its safetensors files)."""
    ckpt = os.path.join(workdir, name)
    if not os.path.isdir(ckpt):
        make_checkpoint(ckpt, cfg, dtype_name, shard_bytes)
    total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    warm_page_cache(ckpt)
    return ckpt, total


def warm_page_cache(path: str) -> None:
    for fname in os.listdir(path):
        with open(os.path.join(path, fname), "rb") as f:
            while f.read(1 << 24):
                pass


def _timed(fn):
    import torch.distributed as dist
    dist.barrier()
    t = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - t, result


def rank_vs_transformers(rank, world, ckpt, reps, mode):
    import torch
    import torch.distributed as dist
    import transformers

    import parallm
    dist.init_process_group("gloo")
    parallm.init_parallel(tp=world)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    def hf():
        return transformers.AutoModelForCausalLM.from_pretrained(ckpt, tp_plan="auto", dtype=torch.float32)

    def ours():
        chunks = parallm.build_model(ckpt, dtype=torch.float32)
        parallm.load_hf_weights(chunks, ckpt, mode=mode)
        return chunks

    def floor():
        """The copy floor: this rank copies its half of every tensor (rows split over the ranks) from the page
        cache into fresh memory, nothing else."""
        from safetensors import safe_open
        kept = []
        for fname in sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")):
            with safe_open(os.path.join(ckpt, fname), framework="pt") as f:
                for k in f.keys():
                    x = f.get_tensor(k)
                    n = x.shape[0] // world
                    kept.append(x.narrow(0, rank * n, n).clone())
        return kept

    times = {"transformers": [], "parallm": [], "floor": []}
    for i in range(reps + 1):                 # first round: warm-up (imports, allocator, page cache)
        for name, fn in (("transformers", hf), ("parallm", ours), ("floor", floor)):
            t, model = _timed(fn)
            if i:
                times[name].append(t)
            del model
            gc.collect()      # every side starts from the same allocator state (megatron modules hold cycles)
    parallm.destroy_parallel()
    return {k: min(v) for k, v in times.items()}


def fresh_pages_on_free() -> None:
    """Make every model's parameters fresh memory, whatever the dtype: glibc then serves allocations of 64 KiB and
    more with their own mappings and returns them to the kernel when freed (``mallopt(M_MMAP_THRESHOLD)``, which
    also turns off glibc's adaptive threshold). 64 KiB puts every weight matrix of both dtypes in its own mapping
    (with 1 MiB, tensors between 0.5 and 1 MiB were fresh in fp32 but reused heap in bf16: 2.27x the faults). Without it a model built after another one is freed reuses some
    of its pages: which ones depends on the order and the sizes (a bf16 model built after an fp32 one fitted in
    the freed memory and faulted 138 MiB in all, the fp32 one 1089 MiB), so the two dtypes did not pay alike."""
    import ctypes
    libc = ctypes.CDLL(None)
    if not libc.mallopt(-3, 64 << 10):       # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def warm_vm_memory(nbytes: int) -> None:
    """Write and free ``nbytes`` of fresh memory (a buffer this large is a mapping of its own, returned to the
    kernel when freed), so that the VM's host backs it when the next case allocates: see the module docstring."""
    import torch
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    del buf


def warm_bytes(ckpt) -> int:
    """What :func:`warm_vm_memory` writes, the same for both dtypes: 1.25x this rank's fp32 model bytes."""
    import torch
    import parallm
    probe = parallm.build_model(ckpt, dtype=torch.float32)
    nbytes = sum(p.numel() * p.element_size() for c in probe for p in c.parameters()) * 5 // 4
    _free(probe, "size probe")
    return nbytes


def _touch(chunks) -> None:
    """Zero every parameter. A function of its own so that no loop variable outlives the call: a leftover
    reference to the last chunk kept a freed model alive into the next case (its memory then came from pages the
    VM had never backed, 3-5x dearer per fault; that, not the loader, made the earlier "fresh" fp32 rows 3x)."""
    import torch
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()


def rank_dtype(rank, world, ckpt, reps):
    import torch
    import parallm
    fresh_pages_on_free()
    parallm.init_parallel(tp=2, pp=2)
    kinds = ("fresh", "warm", "touched", "floor", "floor-warm")
    dtypes = (("bf16", torch.bfloat16), ("fp32", torch.float32))
    times = {f"{name}/{kind}{what}": [] for name, _ in dtypes for kind in kinds for what in ("", "/faults")}
    nbytes = warm_bytes(ckpt)

    def record(i, key, t, faults):
        if i:
            times[key].append(t)
            times[key + "/faults"].append(faults)

    for i in range(reps + 1):
        for kind in ("fresh", "warm", "touched"):
            for name, dtype in dtypes:
                if kind == "warm":
                    warm_vm_memory(nbytes)
                chunks = parallm.build_model(ckpt, dtype=dtype)
                if kind == "touched":      # the parameters' pages exist before the clock starts
                    _touch(chunks)
                faults = _minflt()
                t, _ = _timed(lambda model=chunks: parallm.load_hf_weights(model, ckpt, mode="slice"))
                record(i, f"{name}/{kind}", t, _minflt() - faults)
                _free(chunks, f"{name} model ({kind}, rep {i})")
                del chunks
        # floor: no loader; fresh tensors of this rank's parameter shapes, each copied from the loaded bf16 model
        source = parallm.build_model(ckpt, dtype=torch.bfloat16)
        parallm.load_hf_weights(source, ckpt, mode="slice")
        params = [p.detach() for c in source for p in c.parameters()]
        for kind in ("floor", "floor-warm"):
            for name, dtype in dtypes:
                if kind == "floor-warm":
                    warm_vm_memory(nbytes)
                faults = _minflt()
                t, copies = _timed(lambda dtype=dtype, src=params: [torch.empty(p.shape, dtype=dtype).copy_(p)
                                                                    for p in src])
                record(i, f"{name}/{kind}", t, _minflt() - faults)
                del copies
                gc.collect()
        del params
        _free(source, f"floor source (rep {i})")
        del source
    parallm.destroy_parallel()
    return {k: min(v) for k, v in times.items()}


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _free(chunks: list, what: str) -> None:
    """Drop the caller's model (the caller deletes its name after) and check that nothing else holds it: each
    case must start with the last model freed."""
    alive = [weakref.ref(c) for c in chunks]
    chunks.clear()
    gc.collect()
    if any(r() is not None for r in alive):
        raise RuntimeError(f"a {what} outlived its case")


def rank_first_load(rank, world, ckpt, dtype_name, warm):
    """One load, the first of a new process (as a trainer loads once at start): build, then the timed load.
    ``warm``: first write and free 1.25x this rank's fp32 model bytes (the VM's memory; module docstring)."""
    import torch

    import parallm
    parallm.init_parallel(tp=2, pp=2)
    if warm:
        warm_vm_memory(warm_bytes(ckpt))
    chunks = parallm.build_model(ckpt, dtype=getattr(torch, dtype_name))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t, _ = _timed(lambda: parallm.load_hf_weights(chunks, ckpt, mode="slice"))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    parallm.destroy_parallel()
    return {"time": t, "faults": faults}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("vs-transformers", "dtype"))
    ap.add_argument("--size", choices=sorted(SIZES), default="383MB")
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="parallm-load-bench-")
    try:
        if args.what == "vs-transformers":
            ckpt, total = prepared_checkpoint(workdir, f"qwen2-fp32-{args.size}", SIZES[args.size], "float32",
                                              60 * 10 ** 6)
            res = run_world(rank_vs_transformers, 2, ckpt, args.reps, args.mode)[0]
            tf, ours = res["transformers"], res["parallm"]
            print(f"checkpoint: Qwen2-shaped fp32, {total / 1e6:.0f} MB in 60 MB shards; tp=2 on 2 gloo ranks "
                  f"({os.cpu_count()} cores), mode={args.mode}, best of {args.reps}")
            fl = res["floor"]
            print(table([("transformers from_pretrained(tp_plan='auto')", f"{tf:.3f} s", f"{total / tf / 1e9:.2f}"),
                         ("parallm build_model + load_hf_weights", f"{ours:.3f} s", f"{total / ours / 1e9:.2f}"),
                         ("floor: each rank clones its half of every tensor", f"{fl:.3f} s",
                          f"{total / fl / 1e9:.2f}")],
                        ["", "time", "GB/s"]))
            print(f"parallm speed / transformers speed = {tf / ours:.2f}  (goal >= 1.0, aim 2.0)")
        else:
            ckpt, total = prepared_checkpoint(workdir, "qwen2.5-0.5b-bf16", QWEN05, "bfloat16", 5 * 10 ** 9)
            res = run_world(rank_dtype, 4, ckpt, args.reps)
            t = {k: max(r[k] for r in res) for k in res[0]}
            print(f"checkpoint: Qwen2.5-0.5B-shaped bf16, {total / 1e6:.0f} MB; tp2 x pp2 on 4 gloo ranks "
                  f"({os.cpu_count()} cores), mode=slice, best of {args.reps}")
            rows = []
            for kind, what in (("fresh", "fresh model (first touch of its pages inside the load)"),
                               ("warm", "  the same, VM memory warmed just before"),
                               ("touched", "pages touched before the load"),
                               ("floor", "floor, no loader: copy each parameter into fresh memory"),
                               ("floor-warm", "  the same, VM memory warmed just before")):
                bf, fp = t[f"bf16/{kind}"], t[f"fp32/{kind}"]
                faults = "/".join(f"{sum(r[f'{n}/{kind}/faults'] for r in res) * 4096 / 2 ** 20:.0f}"
                                  for n in ("bf16", "fp32"))
                rows.append((what, f"{bf:.3f} s", f"{fp:.3f} s", f"{fp / bf:.2f}", faults))
            for warm, what in ((False, "first load of a new process (new world per load)"),
                               (True, "  the same, VM memory warmed just before")):
                first = {"bfloat16": [], "float32": []}
                for _ in range(args.reps):       # a new world of processes per load, the dtypes alternating
                    for dtype_name in first:
                        r = run_world(rank_first_load, 4, ckpt, dtype_name, warm)
                        first[dtype_name].append((max(x["time"] for x in r), sum(x["faults"] for x in r)))
                bf, fp = min(first["bfloat16"]), min(first["float32"])
                rows.append((what, f"{bf[0]:.3f} s", f"{fp[0]:.3f} s", f"{fp[0] / bf[0]:.2f}",
                             f"{bf[1] * 4096 / 2 ** 20:.0f}/{fp[1] * 4096 / 2 ** 20:.0f}"))
            print(table(rows, ["", "bf16 model", "fp32 model", "fp32 / bf16 (target <= 2.0)",
                               "page faults in the load, MiB (bf16/fp32, all ranks)"]))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
