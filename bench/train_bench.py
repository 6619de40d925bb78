"""Training-step memory and time at a real vocabulary size. Not part of the test suite.

    PYTHONPATH=src python bench/train_bench.py [--steps 2] [--rounds 1] [--reps 5] [--parts main,pp,recompute,clip,dp2]

Every process runs one thread; peak memory is the process's peak anonymous RSS (sampled every 2 ms), with
glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so freed large tensors go back to the OS on both sides.

main       Qwen2-shaped model (vocab 151936, hidden 256, 2 layers, 4 heads / 2 KV heads, intermediate 1024,
           untied), fp32, batch 4 x 512 in 4 microbatches, a loss from next-token log-probs. transformers in
           one process with gradient accumulation (logits -> log_softmax -> gather, per microbatch) against
           parallm ``forward_backward(output="logprobs")`` + ``finalize_grads`` at tp 1 and tp 2, same weights and
           tokens. Step time: the best of ``--steps - 1`` timed steps after one warm-up step, wall clock and
           process CPU time (on a shared machine the CPU time is the steadier figure); with ``--rounds`` the
           sides alternate and each keeps its best round.
pp         per-rank peak at pp=2 for 2 vs 8 microbatches of 1 x 512 (LLaMA-shaped, vocab 32000, hidden 256,
           4 layers: activations, not the head, dominate).
clip       clip_grad_norm_ on a model with ~12k parameter tensors (a LLaMA of 2000 layers, hidden 16, built by
           parallm at tp=1, gradients set seeded, fp32 and bf16 with fp32 main_grad): parallm's _foreach version
           against the per-parameter loop it replaced (tests/test_clip_foreach.py's reference), alternating,
           best of ``--reps``; both must give the same norm bit for bit.
dp2        a dp2 training step (forward_backward of 4 microbatches, finalize_grads, clip_grad_norm_, AdamW step,
           zero_grad; LLaMA-shaped, vocab 32000, hidden 256, 8 layers, 4 x 256 tokens per replica, fp32) with
           today's finalize_grads against gradient buckets reduced during the backward
           (``overlap_grad_reduce=True`` + ``expect_microbatches``), unsharded and under ZeRO (reduce-scatter),
           alternating rounds, best step per round; the weights after the steps must be equal.
recompute  memory held by one microbatch's forward graph (1 x 2048 tokens, 8 layers, hidden 256, vocab 32000,
           tp 1; padded attention, which keeps each layer's [S, S] scores, and packed) with recompute=None vs
           "full", and the backward's peak above it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, rss_anon, run_world, table  # noqa: E402

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
MB = 1 << 20


def nll_from_logits(logits, ids, mask):
    logp = logits.float().log_softmax(-1)
    lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp * m).sum() / m.sum()


def nll_from_logprobs(lp, ids, mask):
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp[:, :-1] * m).sum() / m.sum()


def _timed_steps(step, steps):
    """Run ``steps`` steps (the first a warm-up) under a peak-RSS sampler; returns a dict: peak, base (before
    the first step), time (best wall-clock step), cpu (best step's process CPU time: what contention on a
    shared machine distorts least), loss."""
    times, cpus, loss = [], [], None
    base = rss_anon()
    with PeakRss() as peak:
        for _ in range(steps):
            t, c = time.perf_counter(), time.process_time()
            loss = step()
            times.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
    pick = slice(1, None) if steps > 1 else slice(None)
    return dict(peak=peak.peak, base=base, time=min(times[pick]), cpu=min(cpus[pick]), loss=loss)


def hf_worker(rank, world, ckpt, ids, mask, nmb, steps):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.train()
    with torch.no_grad():  # weights in process memory (from_pretrained may leave them mapped from the file)
        for p in model.parameters():
            p.data = p.data.clone()
    size = ids.shape[0] // nmb
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, ids.shape[0], size):
            sl = slice(i, i + size)
            logits = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl]).logits
            loss = nll_from_logits(logits, ids[sl], mask[sl]) / nmb
            loss.backward()
            total += loss.item()
            del logits, loss
        return total

    return _timed_steps(step, steps)


def parallm_worker(rank, world, ckpt, ids, mask, nmb, steps, layout, build):
    import torch

    import parallm
    parallm.init_parallel(**layout)
    chunks = parallm.build_model(ckpt, **build)
    parallm.load_hf_weights(chunks, ckpt, progress=False)

    def step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        loss = parallm.forward_backward(chunks, ids, mask, loss_fn=nll_from_logprobs, num_microbatches=nmb,
                                        output="logprobs")
        parallm.finalize_grads(chunks)
        return loss.item()

    torch.distributed.barrier()
    out = _timed_steps(step, steps)
    parallm.destroy_parallel()
    return out


def graph_memory_worker(rank, world, ckpt, ids, mask, recompute, packed):
    """Anonymous memory held after one forward (graph kept for backward) minus before, and the step's peak."""
    import parallm
    parallm.init_parallel()
    chunks = parallm.build_model(ckpt, recompute=recompute, packed=packed)
    parallm.load_hf_weights(chunks, ckpt, progress=False)
    # one warm-up step so gradients and allocator pools exist on both sides
    parallm.forward_backward(chunks, ids, mask, loss_fn=nll_from_logprobs, output="logprobs")
    before = rss_anon()
    lp = parallm.forward(chunks, ids, mask, output="logprobs")
    held = rss_anon() - before
    with PeakRss() as peak:
        nll_from_logprobs(lp, ids, mask).backward()
    del lp
    parallm.destroy_parallel()
    return dict(held=held, peak=peak.peak - before)


def _ckpt(config, root):
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tempfile.mkdtemp(prefix="parallm-tbench-", dir=root)
    model.save_pretrained(path)
    return path


def _tokens(vocab, batch, seq, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.ones(batch, seq, dtype=torch.long)


def part_main(args, root):
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=256, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    ckpt = _ckpt(cfg, root)
    ids, mask = _tokens(cfg.vocab_size, 4, 512)
    runs = {"hf": [], "tp1": [], "tp2": []}
    for _ in range(args.rounds):   # alternate the sides; keep each side's best round
        runs["hf"].append(run_world(hf_worker, 1, ckpt, ids, mask, 4, args.steps))
        runs["tp1"].append(run_world(parallm_worker, 1, ckpt, ids, mask, 4, args.steps, dict(tp=1), {}))
        runs["tp2"].append(run_world(parallm_worker, 2, ckpt, ids, mask, 4, args.steps, dict(tp=2), {}))

    def best(name, key):   # per round: the slowest / largest rank; then the best round
        return min(max(r[key] for r in ranks) for ranks in runs[name])
    hf = {k: best("hf", k) for k in ("peak", "base", "time", "cpu")}
    print(f"main: Qwen2-shaped vocab {cfg.vocab_size}, hidden 256, 2 layers, batch 4 x 512, 4 microbatches, fp32, "
          f"best of {args.rounds} round(s)")
    print("losses: " + ", ".join(f"{n} {runs[n][0][0]['loss']:.6f}" for n in runs))
    rows = [("transformers, one process", f"{hf['peak'] / MB:.0f}", f"{hf['base'] / MB:.0f}", f"{hf['time']:.2f}",
             f"{hf['cpu']:.2f}", "1", "1", "1")]
    for name, label in (("tp1", "parallm tp=1"), ("tp2", "parallm tp=2, per rank (max)")):
        r = {k: best(name, k) for k in ("peak", "base", "time", "cpu")}
        rows.append((label, f"{r['peak'] / MB:.0f}", f"{r['base'] / MB:.0f}", f"{r['time']:.2f}", f"{r['cpu']:.2f}",
                     f"{r['peak'] / hf['peak']:.3f}", f"{r['time'] / hf['time']:.3f}", f"{r['cpu'] / hf['cpu']:.3f}"))
    print(table(rows, ["run", "peak MiB", "before step MiB", "step s (wall)", "step s (CPU)", "peak / HF",
                       "wall / HF", "CPU / HF"]))


def part_pp(args, root):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ckpt = _ckpt(cfg, root)
    out = {}
    for nmb in (2, 8):
        ids, mask = _tokens(cfg.vocab_size, nmb, 512)
        out[nmb] = run_world(parallm_worker, 2, ckpt, ids, mask, nmb, args.steps, dict(tp=1, pp=2), {})
    rows = [(f"pp rank {r}", f"{out[2][r]['peak'] / MB:.0f}", f"{out[8][r]['peak'] / MB:.0f}",
             f"{out[8][r]['peak'] / out[2][r]['peak']:.3f}",
             f"{(out[2][r]['peak'] - out[2][r]['base']) / MB:.0f} -> {(out[8][r]['peak'] - out[8][r]['base']) / MB:.0f}")
            for r in range(2)]
    print("pp: LLaMA-shaped vocab 32000, hidden 256, 4 layers, pp=2, microbatches of 1 x 512, fp32")
    print(table(rows, ["rank", "peak MiB, 2 mb", "peak MiB, 8 mb", "8 / 2", "step growth MiB, 2 -> 8 mb"]))


def part_recompute(args, root):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    ckpt = _ckpt(cfg, root)
    ids, mask = _tokens(cfg.vocab_size, 1, 2048)
    rows = []
    for packed in (False, True):
        res = {r: run_world(graph_memory_worker, 1, ckpt, ids, mask, r, packed)[0] for r in (None, "full")}
        rows += [(("packed" if packed else "padded"), str(r), f"{res[r]['held'] / MB:.1f}",
                  f"{res[r]['peak'] / MB:.1f}") for r in res]
        rows.append(("", "None / full", f"{res[None]['held'] / max(res['full']['held'], 1):.2f}", ""))
    print("recompute: LLaMA-shaped vocab 32000, hidden 256, 8 layers, 1 x 2048 tokens, tp=1, fp32")
    print(table(rows, ["attention", "recompute", "held by the forward graph MiB", "backward peak above it MiB"]))


def clip_worker(rank, world, layers, reps):
    import torch

    import parallm
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_clip_foreach import _set_grads, reference_clip   # the per-parameter loop parallm had before
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    parallm.init_parallel()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        chunks = parallm.build_model(cfg, dtype=dtype)
        tensors = sum(1 for c in chunks for _ in c.parameters())
        times = {"loop": [], "foreach": []}
        norms = {}
        for _ in range(reps):
            for name, fn in (("loop", reference_clip), ("foreach", parallm.clip_grad_norm_)):
                _set_grads(chunks, seed=7)
                t = time.perf_counter()
                norms[name] = fn(chunks, 1e-3, 2.0)
                times[name].append(time.perf_counter() - t)
        out[str(dtype).split(".")[-1]] = dict(tensors=tensors, loop=min(times["loop"]),
                                              foreach=min(times["foreach"]),
                                              equal=bool(torch.equal(norms["loop"], norms["foreach"])))
        del chunks
    parallm.destroy_parallel()
    return out


def part_clip(args, root):
    res = run_world(clip_worker, 1, 2000, args.reps)[0]
    print("clip: clip_grad_norm_(max_norm=1e-3, p=2) on a LLaMA of 2000 layers (hidden 16), tp=1, one thread, "
          f"best of {args.reps}")
    rows = [(dt, r["tensors"], f"{r['loop'] * 1e3:.1f}", f"{r['foreach'] * 1e3:.1f}", f"{r['foreach'] / r['loop']:.3f}",
             "yes" if r["equal"] else "NO") for dt, r in res.items()]
    print(table(rows, ["dtype", "parameter tensors", "per-parameter loop ms", "_foreach ms", "ratio",
                       "same norm bits"]))


def dp_step_worker(rank, world, ckpt, nmb, steps, overlap, shard):
    import torch

    import parallm
    from parallm.parallel.state import current_dims
    from parallm.train.grads import expect_microbatches
    parallm.init_parallel()
    dims = current_dims()
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt, progress=False)
    opt = parallm.build_optimizer(chunks, lr=1e-4, shard_over_dp=shard, overlap_grad_reduce=overlap)
    ids, mask = _tokens(chunks[0].spec.vocab_size, 4 * dims.dp, 256, seed=3)
    per = ids.shape[0] // dims.dp
    ids, mask = ids[dims.dp_rank * per:(dims.dp_rank + 1) * per], mask[dims.dp_rank * per:(dims.dp_rank + 1) * per]

    def step():
        if overlap:
            expect_microbatches(chunks, nmb)
        loss = parallm.forward_backward(chunks, ids, mask, loss_fn=nll_from_logprobs, num_microbatches=nmb,
                                        output="logprobs")
        parallm.finalize_grads(chunks)
        parallm.clip_grad_norm_(chunks, 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    torch.distributed.barrier()
    out = _timed_steps(step, steps)
    out["weights"] = {n: p.detach().clone() for n, p in chunks[0].named_parameters()} if rank == 0 else None
    parallm.destroy_parallel()
    return out


def part_dp2(args, root):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ckpt = _ckpt(cfg, root)
    sides = {("today", False): (False, False), ("overlap", False): (True, False),
             ("today", True): (False, True), ("overlap", True): (True, True)}
    runs = {k: [] for k in sides}
    for _ in range(args.rounds):
        for key, (overlap, shard) in sides.items():
            runs[key].append(run_world(dp_step_worker, 2, ckpt, 4, args.steps, overlap, shard))

    def best(key, field):
        return min(max(r[field] for r in ranks) for ranks in runs[key])
    print(f"dp2: LLaMA-shaped vocab 32000, hidden 256, 8 layers, fp32, 4 microbatches of 1 x 256 per replica, "
          f"output=logprobs; step = forward_backward + finalize_grads + clip + AdamW; best step of {args.steps - 1} "
          f"after a warm-up, best of {args.rounds} round(s)")
    rows = []
    for shard in (False, True):
        t = {k: (best((k, shard), "time"), best((k, shard), "cpu")) for k in ("today", "overlap")}
        same = all(torch.equal(runs[("today", shard)][0][0]["weights"][n], runs[("overlap", shard)][0][0]["weights"][n])
                   for n in runs[("today", shard)][0][0]["weights"])
        label = "ZeRO" if shard else "unsharded"
        rows.append((label, f"{t['today'][0]:.3f}", f"{t['overlap'][0]:.3f}", f"{t['overlap'][0] / t['today'][0]:.3f}",
                     f"{t['today'][1]:.3f}", f"{t['overlap'][1]:.3f}", f"{t['overlap'][1] / t['today'][1]:.3f}",
                     "yes" if same else "NO"))
    print(table(rows, ["optimizer", "today s (wall)", "overlap s (wall)", "wall ratio", "today s (CPU)",
                       "overlap s (CPU)", "CPU ratio", "same weights"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="steps per run; the first is a warm-up")
    ap.add_argument("--parts", default="main,pp,recompute")
    ap.add_argument("--rounds", type=int, default=1, help="main, dp2: alternate the sides this many times")
    ap.add_argument("--reps", type=int, default=5, help="clip: timed calls per side")
    args = ap.parse_args(argv)
    os.environ["PARALLM_PROGRESS"] = "0"
    with tempfile.TemporaryDirectory(prefix="parallm-tbench-") as root:
        for part in args.parts.split(","):
            {"main": part_main, "pp": part_pp, "recompute": part_recompute, "clip": part_clip,
             "dp2": part_dp2}[part](args, root)
            print(flush=True)


if __name__ == "__main__":
    main()
