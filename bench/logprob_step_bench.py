"""The log-prob training step at tp 2 against transformers and against an earlier parallm, in the same run: a
regression guard. Not part of the test suite.

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/logprob_step_bench.py [--ref GIT_REF] [--rounds 3] [--steps 3]
        [--hidden 896 --intermediate 4864 --layers 4 --heads 14 --batch 4 --seq 512 --microbatches 4]

One step (bench/train_bench.py's workers): parallm ``forward_backward(output="logprobs")`` (masked mean next-token
NLL) + ``finalize_grads`` at tp 2 on 2 local ranks, and transformers' same step in one process (logits ->
log_softmax -> gather per microbatch, gradient accumulation), on a Qwen2-shaped model with a 151,936-token vocabulary (default: Qwen2.5-0.5B's widths,
4 layers), fp32, the same weights and tokens. ``--ref``: also time the parallm of that git commit (checked out
into a temporary worktree, run with its own ``src`` on ``PYTHONPATH``: the same script, the same workers), so a
change that slows the step shows as ``this / ref`` > 1 in one run, whatever the machine's state. The sides
alternate round by round; each keeps its best step (wall clock, and the process CPU time, steadier on a shared
machine). Losses must agree. Report the load average next to the figures (``uptime``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))


def _inputs(args):
    import torch
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 151936, (args.batch, args.seq), generator=g), torch.ones(args.batch, args.seq,
                                                                                     dtype=torch.long)


def _side(args, side: str) -> dict:
    """One side's round in this process's parallm (the worker mode of this script)."""
    from common import run_world
    from train_bench import hf_worker, parallm_worker     # the same steps as train_bench's "main" part
    ids, mask = _inputs(args)
    if side == "hf":
        ranks = run_world(hf_worker, 1, args.ckpt, ids, mask, args.microbatches, args.steps)
    else:
        ranks = run_world(parallm_worker, 2, args.ckpt, ids, mask, args.microbatches, args.steps, dict(tp=2), {})
    return dict(time=max(r["time"] for r in ranks), cpu=max(r["cpu"] for r in ranks), loss=ranks[0]["loss"])


def _round(args, side: str, src: str) -> dict:
    """Run one side in a fresh interpreter whose parallm comes from ``src``."""
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--ckpt", args.ckpt] + [
        f"--{k}={getattr(args, k)}" for k in ("steps", "batch", "seq", "microbatches")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    last = out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []
    if out.returncode != 0 or not last or not last[0].startswith("{"):
        raise RuntimeError(f"{side} ({src}) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(last[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", help="git ref of an earlier parallm to time beside this tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_side(args, args.worker)))
        return

    import torch
    import transformers
    repo = os.path.dirname(HERE)
    root = tempfile.mkdtemp(prefix="parallm-lpbench-")
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    args.ckpt = os.path.join(root, "ckpt")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(args.ckpt)
    sides = {"transformers": os.path.join(repo, "src"), "parallm": os.path.join(repo, "src")}
    if args.ref:
        tree = os.path.join(root, "ref")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree, args.ref], check=True,
                       capture_output=True)
        sides[f"parallm@{args.ref}"] = os.path.join(tree, "src")
    try:
        runs = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, src in sides.items():
                runs[name].append(_round(args, "hf" if name == "transformers" else "parallm", src))
        best = {name: {k: min(r[k] for r in rs) for k in ("time", "cpu")} for name, rs in runs.items()}
        print(f"log-prob step: Qwen2-shaped vocab 151936, hidden {args.hidden}, {args.layers} layers, "
              f"batch {args.batch} x {args.seq} in {args.microbatches} microbatches, fp32, parallm at tp 2; "
              f"best of {args.rounds} round(s) x {args.steps - 1} timed step(s)")
        print("losses: " + ", ".join(f"{n} {rs[0]['loss']:.6f}" for n, rs in runs.items()))
        hf = best["transformers"]
        for name, b in best.items():
            line = f"{name:24s} wall {b['time']:7.2f} s  CPU {b['cpu']:7.2f} s  wall/HF {b['time'] / hf['time']:.3f}"
            line += f"  CPU/HF {b['cpu'] / hf['cpu']:.3f}"
            if args.ref and name == "parallm":
                ref = best[f"parallm@{args.ref}"]
                line += f"  this/ref wall {b['time'] / ref['time']:.3f} CPU {b['cpu'] / ref['cpu']:.3f}"
            print(line)
    finally:
        if args.ref:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", os.path.join(root, "ref")],
                           check=False, capture_output=True)


if __name__ == "__main__":
    main()
