"""Four LoRA clients' rounds co-batched vs one after another (issue 58 item 4's benchmark). Not part of the test
suite; needs .venv-tinker (scripts/setup_tinker.sh).

    OMP_NUM_THREADS=1 .venv-tinker/bin/python bench/tinker_cobatch_bench.py [--models tiny,moe] [--reps 5] [--quick]

One server per side, the same checkpoint and launch (``parallm serve-tinker --tp 2 --sampler none``, LoRA rank 16
on every linear) but for ``--cobatch``: 8 (the default: consecutive ``forward_backward`` requests of different
clients run as one pass) against 1 (each request alone). Four SDK training clients, each with its own batch
(``--rows`` datums of ``--length`` tokens, next-token cross-entropy), submit a round at once: every client's
``forward_backward`` then its ``optim_step`` (the four ``forward_backward`` requests queue behind each other at
the leader, which is where co-batching groups them), then all eight results are awaited; wall time of the round
as the clients see it, the first round not timed, median of ``--reps``. Both sides compute the same thing (the
results are equal bit for bit: tests/test_tinker_cobatch.py); the script checks that the four clients' losses of
the last round are equal on both sides. Target (issue 58): co-batched <= 0.5x.

Models as bench/tinker_bench.py's: ``tiny`` (hidden 128, 2 layers) and ``moe`` (Qwen3-MoE shape, hidden 512,
4 layers, 16 experts top 4, vocab 32000). Take figures on a quiet machine (the sides run one after the other).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tinker_bench import make_model  # noqa: E402
from tinker_helpers import write_char_tokenizer  # noqa: E402

CLIENTS, RANK = 4, 16


def _data(vocab, rows, length, seed):
    import numpy as np
    from tinker import types
    g = np.random.default_rng(seed)
    ids = g.integers(3, vocab, size=(rows, length + 1))
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": r[1:].astype(np.int64),
                                        "weights": np.ones(length, np.float32)}) for r in ids]


def _side(ckpt, vocab, cobatch, args, work) -> tuple[list, list]:
    import tinker
    from tinker import types
    ready = os.path.join(work, "ready.json")
    cmd = [sys.executable, "-m", "parallm.integrations.tinker", "--model", ckpt, "--tp", "2", "--port", "0",
           "--sampler", "none", "--lora-rank", str(RANK), "--ready-file", ready, "--checkpoint-dir",
           os.path.join(work, "ckpt"), "--cobatch", str(cobatch)]
    log = open(os.path.join(work, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        while not os.path.exists(ready):
            if proc.poll() is not None:
                log.flush()
                raise RuntimeError("the server exited:\n" + open(log.name).read()[-3000:])
            time.sleep(0.5)
        client = tinker.ServiceClient(base_url=json.load(open(ready))["url"], api_key="tml-bench")
        tcs = [client.create_lora_training_client(base_model=ckpt, rank=RANK, train_unembed=False, seed=k).result()
               for k in range(CLIENTS)]
        data = [_data(vocab, args.rows, args.length, seed=k) for k in range(CLIENTS)]
        adam = types.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
        times, losses = [], []
        for k in range(args.reps + 1):
            t0 = time.perf_counter()
            futures = [(tc.forward_backward(d, "cross_entropy"), tc.optim_step(adam)) for tc, d in zip(tcs, data)]
            out = [(fb.result(), st.result()) for fb, st in futures]
            if k:
                times.append(time.perf_counter() - t0)
            losses = [fb.metrics["loss:sum"] for fb, _ in out]
        return times, losses
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,moe")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rows", type=int, default=4, help="datums per client")
    p.add_argument("--length", type=int, default=128, help="tokens per datum")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    models = ["tiny"] if args.quick else args.models.split(",")
    if args.quick:
        args.reps = 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinker_cobatch_bench_") as tmp:
        for kind in models:
            ckpt = make_model(os.path.join(tmp, kind), kind)
            write_char_tokenizer(ckpt)          # the server needs a tokenizer; the batches are token ids
            vocab = json.load(open(os.path.join(ckpt, "config.json")))["vocab_size"]
            alone, l1 = _side(ckpt, vocab, 1, args, tempfile.mkdtemp(dir=tmp))
            together, l8 = _side(ckpt, vocab, 8, args, tempfile.mkdtemp(dir=tmp))
            if l1 != l8:
                raise SystemExit(f"{kind}: the sides' losses differ ({l1} vs {l8}): not the same work")
            a, t = statistics.median(alone), statistics.median(together)
            rows.append((kind, a, t, t / a))
            print(f"{kind}: alone {[round(x, 3) for x in alone]} s, co-batched {[round(x, 3) for x in together]} s",
                  flush=True)
    print(f"\n| model | one after another (s) | co-batched (s) | ratio |  ({CLIENTS} clients x {args.rows} x "
          f"{args.length} tokens, tp2, LoRA r={RANK}, median of {args.reps} rounds)")
    print("|---|---|---|---|")
    for kind, a, t, ratio in rows:
        print(f"| {kind} | {a:.3f} | {t:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
