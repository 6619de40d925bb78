"""A DeepSeek-V4-Flash-shaped layer stack (issue 56's benchmark): peak memory and time of a training step (forward +
loss + backward), parallm (tp = 1) against transformers' ``DeepseekV4ForCausalLM`` (eager attention, the only
implementation it has) on the same weights and batch, at S = 2k and 8k, fp32. Not part of the test suite.

    python bench/v4_bench.py                     # S = 2048, 8192; both sides at both (see "fits?" below)
    python bench/v4_bench.py --seqs 2048 4096 8192 --iters 2
    python bench/v4_bench.py --force-ref         # run transformers even where its estimate exceeds MemAvailable
    python bench/v4_bench.py --quick             # tiny shapes: checks that the script runs, measures nothing
    python bench/v4_bench.py --seqs 2048 --recompute selective   # parallm with build_model(recompute=...)
    python bench/v4_bench.py --seqs 8192 --parallm-only --recompute moe   # no transformers run (~17 GiB at 8k)

Shapes: V4-Flash's (hidden 4096, 64 heads of 512, one KV head, q_lora 1024, o_groups 8 x o_lora 1024, indexer 64
heads x 128 top-512, window 128, CSA rate 4, HCA rate 128, hc_mult 4, 256 experts top-6 of width 2048 + a shared
one, swiglu limit 10, 3 hash layers of 43) scaled to fit a 24 GiB CPU machine. Kept: head_dim 512 with one KV
head, partial RoPE 64 / 512, window 128, CSA rate 4, HCA rate 128, index_topk 512, index_head_dim 128, hc_mult 4
with 20 Sinkhorn iterations, top-6 routing with a shared expert, hidden / q_lora = hidden / o_lora = 4, index heads
= heads. Scaled: hidden 4096 -> 1024, heads 64 -> 8 (so index heads 8), o_groups 8 -> 2 (4 heads a group, not 8),
256 experts of 2048 -> 32 of 512 (hidden / width 2 kept), vocab 129280 -> 8192, 43 layers -> 2: one CSA layer
with a hash-routed MoE, one HCA layer with a routed (sqrtsoftplus) MoE (``--pattern``: letters S / C / H; hash
MoE on the first layer). Batch 1, fp32, one thread. No MTP layer (not in the training step of either side).

Method: the model is built once (seeded; sinks, hyper-connection scales, the correction bias and the hash tables
made non-trivial) and saved; each (side, S) then runs in a fresh process (this script re-invoked with ``--one``)
started with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so that freed blocks go back to the system: it loads the
checkpoint (transformers: ``from_pretrained``, eager, fp32; parallm: ``build_model`` + ``load_hf_weights``), makes
a seeded full-length batch, and reports the peak anonymous RSS during its first step above the level before it
(weights and batch made before; gradients allocated inside the step on both sides: each step frees them first),
then the best wall time of ``--iters`` more steps and the best process CPU time (one thread: less moved by
other work on a busy machine than the wall time, though not immune to it: shared caches and memory bandwidth);
the two sides' losses at the smallest S are compared.

Fits? transformers' eager attention builds ``[B, heads, S, S + compressed]`` fp32 scores per layer and keeps two
of them for the backward (the softmax output and the contiguous copy its ``probs[..., :-1] @ v`` makes), with
about three more alive at once in a layer's backward: ``estimate_ref_bytes``. Checked with the default shapes at
small S (2026-12-07, transformers' peak above the level before the step at S = 512, 1024, 2048: 605, 878, 1792
MiB against estimates of 66, 265, 1058 MiB): peak ~ 0.46 GiB + 0.17 MiB a token + 0.93 x the estimate, so at
S = 8192 (estimate 16.5 GiB) ~17.2 GiB above a process of ~1 GiB: it fits a quiet 24 GiB machine, not one where
other work holds more than ~4 GiB. Before each transformers run the script compares the estimate + 1 GiB with
MemAvailable and skips the run, saying so, if it does not fit (``--force-ref`` runs it anyway; an OOM-killed run
is reported, not fatal); ``--heads 4`` halves the scores (~9.5 GiB at 8k). Expected duration on one thread of a
quiet machine: ~10-20 min (transformers' 8k step is ~7 TFLOP of attention alone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import free_port, peak_and_best, table  # noqa: E402

KINDS = {"S": "sliding_attention", "C": "compressed_sparse_attention", "H": "heavily_compressed_attention"}
SHAPES = dict(vocab_size=8192, hidden_size=1024, num_attention_heads=8, head_dim=512, q_lora_rank=256, o_groups=2,
              o_lora_rank=256, index_n_heads=8, index_head_dim=128, index_topk=512, sliding_window=128,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
              n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=512, n_shared_experts=1, hc_mult=4,
              hc_sinkhorn_iters=20, swiglu_limit=10.0, routed_scaling_factor=1.5)
QUICK = dict(SHAPES, vocab_size=128, hidden_size=64, num_attention_heads=2, head_dim=32, q_lora_rank=16,
             o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=32, sliding_window=8,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, hc_sinkhorn_iters=3)


def v4_config(shapes: dict, pattern: str):
    import transformers
    n = len(pattern)
    return transformers.DeepseekV4Config(
        **shapes, num_hidden_layers=n, num_key_value_heads=1, partial_rotary_factor=64 / 512,
        layer_types=[KINDS[c] for c in pattern], mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1),
        num_nextn_predict_layers=0, bos_token_id=None, eos_token_id=None, max_position_embeddings=65536)


def save_model(shapes: dict, pattern: str, path: str) -> None:
    """The seeded model, saved: transformers' init, then sinks N(0, 1), hyper-connection scales around 1, the
    correction bias N(0, 0.3) and random hash tables (its init leaves them zero: every token on experts 0..k-1)."""
    import torch
    import transformers
    cfg = v4_config(shapes, pattern)
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("hc.scale", "hc_head.hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(p.shape[0])]))
    model.save_pretrained(path)


def estimate_ref_bytes(shapes: dict, pattern: str, s: int, batch: int = 1) -> tuple[int, int]:
    """(bytes kept for the backward, peak transient bytes) of transformers' eager attention scores at S = ``s``:
    per layer two ``[B, heads, S, S + compressed (+1)]`` fp32 tensors kept, about three of the widest alive in
    a layer's backward. The square terms only: the rest is linear in S and small beside them at 8k."""
    rates = shapes["compress_rates"]
    extra = {"S": 0, "C": s // rates["compressed_sparse_attention"], "H": s // rates["heavily_compressed_attention"]}
    per = [batch * shapes["num_attention_heads"] * s * (s + extra[c] + 1) * 4 for c in pattern]
    return 2 * sum(per), 3 * max(per)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def ce_loss(logits, ids, mask):
    lp = logits[:, :-1].log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def one(path: str, s: int, args) -> dict:
    """One side at one S in this process: (peak MiB of its first step, best of ``iters`` more, the loss)."""
    import torch
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    vocab = (QUICK if args.quick else SHAPES)["vocab_size"]     # the model itself is read from args.ckpt
    ids = torch.randint(0, vocab, (1, s), generator=g)
    mask = torch.ones(1, s, dtype=torch.long)
    losses = []
    if path == "transformers":
        import transformers
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(args.ckpt, attn_implementation="eager",
                                                                   dtype=torch.float32)
        model.train()
        pos = torch.arange(s)[None]

        def step():
            model.zero_grad(set_to_none=True)
            loss = ce_loss(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids, mask)
            loss.backward()
            losses.append(float(loss.detach()))
    else:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                          PARALLM_PROGRESS="0")
        import parallm
        parallm.init_parallel(tp=1)
        chunks = parallm.build_model(args.ckpt, recompute=args.recompute)
        parallm.load_hf_weights(chunks, args.ckpt)

        def step():
            for c in chunks:
                c.zero_grad(set_to_none=True)
            losses.append(float(parallm.forward_backward(chunks, ids, mask, loss_fn=ce_loss)))
    cpu = []

    def timed():
        t0 = time.process_time()
        step()
        cpu.append(time.process_time() - t0)
    peak, best = peak_and_best(timed, args.iters)
    return {"path": path, "s": s, "peak_mib": peak, "s_best": best, "cpu_best": min(cpu[1:]), "loss": losses[0]}


def run_one(path, s, args, env) -> tuple[dict | None, str | None]:
    extra = ["--quick"] if args.quick else []
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", path, str(s), "--ckpt", args.ckpt,
                          "--iters", str(args.iters), "--pattern", args.pattern]
                         + (["--recompute", args.recompute] if args.recompute else []) + extra,
                         env=env, capture_output=True, text=True)
    if out.returncode == 0:
        return json.loads(out.stdout.strip().splitlines()[-1]), None
    if path == "transformers" and out.returncode in (-9, 137):
        return None, "killed (out of memory?)"
    raise SystemExit(f"{path} at S = {s} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")


def report(args, shapes, seqs, by, skipped, load):
    print(f"parallm recompute: {args.recompute}; load average before: {load:.2f}; pattern {args.pattern} ({', '.join(KINDS[c] for c in args.pattern)}); "
          f"{shapes}; batch 1, fp32, one thread" + ("  (--quick: not a measurement)" if args.quick else ""))
    first = by.get(("transformers", seqs[0]))
    if first:
        diff = abs(by[("parallm", seqs[0])]["loss"] - first["loss"])
        selects = seqs[0] // shapes["compress_rates"]["compressed_sparse_attention"] > shapes["index_topk"]
        print(f"loss at S = {seqs[0]}: parallm {by[('parallm', seqs[0])]['loss']:.6f}, transformers "
              f"{first['loss']:.6f} (|diff| {diff:.2e}; "
              + ("the indexer selects here: near-ties at the top-k cut may pick different keys)" if selects else
                 "no query sees more than index_topk entries: no selection, the losses must agree)")
              + ("  -- MISMATCH" if diff > 1e-4 and not selects else ""))
    rows = []
    for s in seqs:
        new, old = by[("parallm", s)], by.get(("transformers", s))
        kept, transient = estimate_ref_bytes(shapes, args.pattern, s)
        rows.append([s, f"{new['peak_mib']:.0f}", f"{old['peak_mib']:.0f}" if old else skipped.get(s, "not run"),
                     f"{(kept + transient) / 2**20:.0f}",
                     f"{new['peak_mib'] / old['peak_mib']:.3f}" if old else "-", f"{new['s_best']:.2f}",
                     f"{old['s_best']:.2f}" if old else "-", f"{new['s_best'] / old['s_best']:.2f}" if old else "-",
                     f"{new['cpu_best']:.2f}", f"{old['cpu_best']:.2f}" if old else "-",
                     f"{new['cpu_best'] / old['cpu_best']:.2f}" if old else "-"])
    print(table(rows, ["S", "parallm peak MiB", "transformers peak MiB", "its scores' estimate MiB",
                       "memory ratio (<= 0.5)", "parallm s", "transformers s", "time ratio (<= 1.0)",
                       "parallm CPU s", "transformers CPU s", "CPU time ratio"]))
    small, large = by[("parallm", seqs[0])], by[("parallm", seqs[-1])]
    print(f"parallm: peak grows {large['peak_mib'] / max(small['peak_mib'], 1e-9):.2f}x for {seqs[-1] / seqs[0]:.0f}x "
          f"the tokens (linear: {seqs[-1] / seqs[0]:.0f}x); time {large['s_best'] / small['s_best']:.2f}x")
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}" + ("" if max(load, load_after) < 2 else
                                                     "  -- PROVISIONAL: machine not quiet"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--pattern", default="CH", help="attention kind per layer: S sliding, C CSA, H HCA (default CH)")
    ap.add_argument("--iters", type=int, default=1, help="timed steps after the measured first one (default 1)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads = indexer heads (default 8; a multiple of "
                    "o_groups 2): transformers' scores grow with it")
    ap.add_argument("--recompute", choices=("full", "moe", "selective"), default=None,
                    help="parallm's activation recomputation (build_model(recompute=...): docs/deepseek_v4.md); "
                         "transformers runs as is")
    ap.add_argument("--force-ref", action="store_true", help="run transformers whatever its memory estimate")
    ap.add_argument("--parallm-only", action="store_true", help="do not run transformers (no ratios)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "S"), help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.iters, args.pattern = [64, 256], 1, "SCH"
    if set(args.pattern) - set(KINDS) or not args.pattern:
        raise SystemExit(f"--pattern {args.pattern!r}: letters S, C, H only")
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args)))
        return
    shapes = QUICK if args.quick else dict(SHAPES, num_attention_heads=args.heads, index_n_heads=args.heads)
    if shapes["num_attention_heads"] % shapes["o_groups"]:
        raise SystemExit(f"--heads {args.heads}: not a multiple of o_groups {shapes['o_groups']}")
    seqs = sorted(args.seqs)
    load = os.getloadavg()[0]
    args.ckpt = tempfile.mkdtemp(prefix="v4-bench-")
    save_model(shapes, args.pattern, args.ckpt)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    by, skipped = {}, {}
    for s in seqs:
        for path in ("parallm", "transformers"):
            if path == "transformers" and args.parallm_only:
                skipped[s] = "not run (--parallm-only)"
                continue
            if path == "transformers" and not args.force_ref:
                need, have = sum(estimate_ref_bytes(shapes, args.pattern, s)) + 2**30, mem_available()
                if need > have:
                    skipped[s] = f"skipped: needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"
                    print(f"transformers at S = {s}: {skipped[s]} (--force-ref runs it; --heads 4 halves it)",
                          flush=True)
                    continue
            got, why = run_one(path, s, args, env)
            if got is None:
                skipped[s] = why
                print(f"transformers at S = {s}: {why}", flush=True)
                continue
            by[(path, s)] = got
            print(f"  {path} S = {s}: peak {got['peak_mib']:.0f} MiB, {got['s_best']:.2f} s", flush=True)
    shutil.rmtree(args.ckpt, ignore_errors=True)
    report(args, shapes, seqs, by, skipped, load)


if __name__ == "__main__":
    main()
