"""Context parallelism: memory per rank and time per step, cp = 1 against cp = 4 (issue 25).

One packed sequence of 4096 tokens through a LLaMA-shaped model (hidden 256, 4 layers, 4 heads of 64, 2 KV heads,
MLP 1024, vocab 32000), fp32, ``output="logprobs"`` with the token-mean next-token loss (the RL case: no
``[T, V]`` logits are kept).

memory  per rank: anonymous memory held by the forward graph (after ``forward(..., output="logprobs")`` with
        gradients on, minus before), the bytes autograd saved (``saved_tensors_hooks``, parameters not counted),
        the peak of that forward and its ``.backward()`` above the memory before the forward, and the peak of a
        training step (``forward_backward``, whose log-prob head adds its weight gradient into the existing
        buffer) above the memory before it; glibc is set to map every allocation of 64 KiB or more on its own,
        so RSS follows what tensors hold; cp = 1 on one rank, cp = 4 on four, for
        both context-parallel attentions (``cp_attn`` "allgather" and "ring"), all in one run.
time    the same work both ways on four ranks: four sequences at cp = 4 (each split over the four ranks, one
        microbatch per sequence) against cp = 1 x dp = 4 (one sequence per rank); seconds per step (forward,
        backward, finalize_grads), best of ``--steps`` after a warm-up.

    python bench/cp_bench.py [--parts memory,time] [--steps 3] [--tokens 4096]

The machine's load average is printed with the figures (the time part runs four ranks on however many cores
there are: compare its two rows with each other, not with other machines).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PeakRss, rss_anon, run_world, table  # noqa: E402

MB = 2 ** 20


def token_mean_nll(lp, ids, mask):
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp[:, :-1] * m).sum(), m.sum()


class SavedBytes:
    """Bytes of the storages autograd saves during a forward (each counted once, parameters not counted): the
    activations its graph holds for the backward, whatever the allocator does."""

    def __init__(self, params):
        self.seen, self.now = {p.untyped_storage().data_ptr() for p in params}, 0

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.now += storage.nbytes()
        return t

    def unpack(self, t):
        return t


def _exact_rss() -> None:
    """glibc: allocations of 64 KiB and more are mapped on their own and unmapped when freed (a fixed threshold:
    the default one grows as large blocks are freed, after which freed tensors stay in the heap and RSS no longer
    falls when memory is released), so the process's anonymous memory follows the bytes tensors hold."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)      # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 << 10)      # M_TRIM_THRESHOLD


def memory_worker(rank, world, ckpt, ids, mask, cp, cp_attn):
    import torch

    import parallm
    _exact_rss()
    parallm.init_parallel(cp=cp)
    chunks = parallm.build_model(ckpt, packed=True, cp_attn=cp_attn)
    parallm.load_hf_weights(chunks, ckpt, progress=False)
    # a warm-up step: gradients and allocator pools exist before the measured one
    parallm.forward_backward(chunks, ids, mask, loss_fn=token_mean_nll, output="logprobs")
    parallm.finalize_grads(chunks)
    saved = SavedBytes([p for c in chunks for p in c.parameters()])
    torch.distributed.barrier()
    before = rss_anon()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        lp = parallm.forward(chunks, ids, mask, output="logprobs")
    held = rss_anon() - before
    loss, count = token_mean_nll(lp, ids, mask)
    with PeakRss() as peak:
        (loss / count).backward()
    del lp, loss
    parallm.finalize_grads(chunks)
    torch.distributed.barrier()
    before_step = rss_anon()
    with PeakRss() as step_peak:     # a training step as forward_backward runs it (the head's gradient fused)
        parallm.forward_backward(chunks, ids, mask, loss_fn=token_mean_nll, output="logprobs")
    parallm.destroy_parallel()
    return dict(held=held, peak=peak.peak - before, saved=saved.now, step=step_peak.peak - before_step)


def time_worker(rank, world, ckpt, ids, mask, cp, cp_attn, steps):
    import time

    import torch

    import parallm
    parallm.init_parallel(cp=cp)
    chunks = parallm.build_model(ckpt, packed=True, cp_attn=cp_attn)
    parallm.load_hf_weights(chunks, ckpt, progress=False)
    dims = chunks[0].dims
    per = ids.shape[0] // dims.dp
    mine = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)

    def step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        loss = parallm.forward_backward(chunks, ids[mine], mask[mine], loss_fn=token_mean_nll, output="logprobs",
                                        num_microbatches=per)
        parallm.finalize_grads(chunks)
        return loss.item()

    loss = step()
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - t)
    parallm.destroy_parallel()
    return dict(time=min(times), loss=loss)


def _ckpt(tokens, root):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tempfile.mkdtemp(prefix="parallm-cpbench-", dir=root)
    model.save_pretrained(path)
    return path


def _tokens(batch, tokens, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (batch, tokens), generator=g), torch.ones(batch, tokens, dtype=torch.long)


def part_memory(args, ckpt):
    ids, mask = _tokens(1, args.tokens)
    base = run_world(memory_worker, 1, ckpt, ids, mask, 1, "auto")[0]
    keys = ("held", "saved", "peak", "step")
    rows = [("cp=1", "-") + tuple(f"{base[k] / MB:.0f}" for k in keys) + ("1",) * len(keys)]
    for cp_attn in ("allgather", "ring"):
        res = run_world(memory_worker, 4, ckpt, ids, mask, 4, cp_attn)
        worst = {k: max(r[k] for r in res) for k in keys}
        rows.append(("cp=4 (max over ranks)", cp_attn) + tuple(f"{worst[k] / MB:.0f}" for k in keys)
                    + tuple(f"{worst[k] / base[k]:.3f}" for k in keys))
    print(f"memory: one packed sequence of {args.tokens} tokens, LLaMA-shaped hidden 256, 4 layers, vocab 32000, "
          "fp32, output='logprobs'")
    print(table(rows, ["run", "cp_attn", "forward graph MiB", "activations saved MiB", "forward+backward peak MiB",
                       "forward_backward peak MiB", "graph / cp1", "saved / cp1", "peak / cp1", "step peak / cp1"]))


def part_time(args, ckpt):
    ids, mask = _tokens(4, args.tokens, seed=1)
    dp = run_world(time_worker, 4, ckpt, ids, mask, 1, "auto", args.steps)
    rows = [("cp=1 x dp=4: one sequence per rank", "-", f"{max(r['time'] for r in dp):.2f}", "1",
             f"{dp[0]['loss']:.6f}")]
    for cp_attn in ("allgather", "ring"):
        res = run_world(time_worker, 4, ckpt, ids, mask, 4, cp_attn, args.steps)
        t = max(r["time"] for r in res)
        rows.append(("cp=4: each sequence over the 4 ranks", cp_attn, f"{t:.2f}",
                     f"{t / max(r['time'] for r in dp):.3f}", f"{res[0]['loss']:.6f}"))
    print(f"time: 4 sequences of {args.tokens} tokens per step on 4 ranks ({os.cpu_count()} cores), best of "
          f"{args.steps} steps")
    print(table(rows, ["run", "cp_attn", "s / step", "/ cp=1", "loss (token mean)"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="memory,time")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as root:
        ckpt = _ckpt(args.tokens, root)
        for part in args.parts.split(","):
            {"memory": part_memory, "time": part_time}[part](args, ckpt)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
