"""The Tinker server's overhead (issue 47's benchmark): one SDK round (``forward_backward`` + ``optim_step``,
``cross_entropy``) against the same work called directly in parallm, at tp2 on 2 local ranks. Not part of the
test suite; needs .venv-tinker (scripts/setup_tinker.sh).

    OMP_NUM_THREADS=1 .venv-tinker/bin/python bench/tinker_bench.py [--models tiny,moe] [--reps 5] [--quick]

Both sides: the same checkpoint, LoRA rank 32 (alpha 32) on every attention and MLP projection (experts
included), the same batch of 16 datums of 256 tokens (next-token targets, weights 1), one process per rank, one
thread each, the first round not timed (warm-up), then ``--reps`` timed rounds; the median is reported.

direct  ``parallm.forward_backward(output="logprobs")`` with a summed next-token loss over the batch,
        ``finalize_grads``, ``clip_grad_norm_`` (the norm only), ``opt.step()``, ``zero_grad``: what a user of
        parallm's API calls for one step.
server  ``parallm serve-tinker --tp 2 --sampler none --lora-unembed skip`` (no adapter on the output head, as the
        direct side: the server's default ``--lora-unembed train`` holds one for every client, which a
        ``train_unembed=False`` client runs at zero: at the MoE shape's 32000-token vocabulary that is ~15 % more
        work than the direct side) and the SDK from this process: ``forward_backward(data,
        "cross_entropy")`` and ``optim_step`` submitted back to back, then both results awaited: wall time of the
        round seen by the client (HTTP, the SDK's protobuf, the dispatcher's broadcast, Tinker's per-datum loss,
        the result's way back).

The two sides run one after the other (direct, then server): load from other jobs that changes between them
moves the ratio, so take figures on a quiet machine. Where a round's fixed cost goes: docs/tinker.md
("Benchmark").

Models: ``tiny`` (the tests' Qwen3: hidden 128, 2 layers, vocab 112) and ``moe`` (a Qwen3-MoE shape: hidden
512, 4 layers, 8 heads / 4 KV heads, 16 experts of width 256, top 4, vocab 32000). Target: server <= 1.1x
direct at both shapes (issue 58; issue 47's was 1.2x); each row says whether it is met. ``--quick``: the tiny
model, 2 timed rounds (checks the script, not for figures).
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
from common import run_world  # noqa: E402

ROWS, LENGTH, RANK = 16, 256, 32
TARGET = 1.1          # issue 58: the SDK round at most 1.1x the direct call, at the tiny and the MoE shape


def make_model(path: str, kind: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    if kind == "tiny":
        cfg = dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=112)
    else:
        cfg = dict(model_type="qwen3_moe", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                   moe_intermediate_size=256, intermediate_size=1024, vocab_size=32000, decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=True)
    config = AutoConfig.for_model(**cfg, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    # the server refuses a model directory without a tokenizer (docs/tinker.md); the tests' character-level one
    # (100 tokens) fits both vocabularies; the batch's random token ids need no tokenizer
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tinker_helpers import write_char_tokenizer
    write_char_tokenizer(path)
    return path


def batch_tokens(vocab: int, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (ROWS, LENGTH + 1), generator=g)


def _direct(rank, world, ckpt, vocab, reps):
    import torch

    import parallm
    torch.set_num_threads(1)
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt, lora=parallm.LoraConfig(RANK, 32.0, "all-linear"))
    parallm.load_hf_weights(chunks, ckpt)
    opt = parallm.build_optimizer(chunks, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    ids = batch_tokens(vocab)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def loss_fn(out, mb):
        return -out[:, :-1].sum()
    times = []
    for k in range(reps + 1):
        t0 = time.perf_counter()
        parallm.forward_backward(chunks, batch, loss_fn=loss_fn, output="logprobs")
        parallm.finalize_grads(chunks)
        parallm.clip_grad_norm_(chunks, float("inf"))
        opt.step()
        opt.zero_grad()
        if k:
            times.append(time.perf_counter() - t0)
    parallm.destroy_parallel()
    return times


def _server(ckpt, vocab, reps, work) -> list[float]:
    import numpy as np
    import tinker
    from tinker import types
    ready = os.path.join(work, "ready.json")
    cmd = [sys.executable, "-m", "parallm.integrations.tinker", "--model", ckpt, "--tp", "2", "--port", "0",
           "--sampler", "none", "--lora-rank", str(RANK), "--lora-unembed", "skip", "--ready-file", ready,
           "--checkpoint-dir",
           os.path.join(work, "ckpt")]
    log = open(os.path.join(work, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    client = None
    try:
        while not os.path.exists(ready):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {log.name}")
            time.sleep(0.5)
        url = json.load(open(ready))["url"]
        client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = client.create_lora_training_client(base_model=ckpt, rank=RANK, train_unembed=False).result()
        ids = batch_tokens(vocab).numpy()
        data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": r[1:].astype(np.int64),
                                            "weights": np.ones(LENGTH, np.float32)}) for r in ids]
        adam = types.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
        times = []
        for k in range(reps + 1):
            t0 = time.perf_counter()
            fb, st = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
            fb.result(), st.result()
            if k:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        if client is not None:       # ends the SDK's heartbeat and telemetry threads before the server goes
            try:
                client.close("success").result(timeout=30)
            except Exception:  # noqa: BLE001 - the rounds are timed; a server that went away is no matter
                pass
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
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    models = ["tiny"] if args.quick else args.models.split(",")
    reps = 2 if args.quick else args.reps
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinker_bench_") as tmp:
        for kind in models:
            ckpt = make_model(os.path.join(tmp, kind), kind)
            vocab = json.load(open(os.path.join(ckpt, "config.json")))["vocab_size"]
            direct = run_world(_direct, 2, ckpt, vocab, reps)[0]
            work = tempfile.mkdtemp(dir=tmp)
            served = _server(ckpt, vocab, reps, work)
            d, s = statistics.median(direct), statistics.median(served)
            rows.append((kind, d, s, s / d))
            print(f"{kind}: direct {[round(t, 3) for t in direct]} s, server {[round(t, 3) for t in served]} s",
                  flush=True)
    print(f"\n| model | direct round (s) | SDK round (s) | server / direct | <= {TARGET}x |  (batch {ROWS} x "
          f"{LENGTH}, tp2, LoRA r={RANK}, median of {reps})")
    print("|---|---|---|---|---|")
    for kind, d, s, ratio in rows:
        print(f"| {kind} | {d:.3f} | {s:.3f} | {ratio:.2f}x | {'met' if ratio <= TARGET else 'missed'} |")


if __name__ == "__main__":
    main()
