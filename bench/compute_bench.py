"""Training-step throughput benchmark. Not part of the test suite.

    python bench/compute_bench.py [--layers 4] [--hidden 512] [--seq 256] [--batch 8] [--iters 3]

One process (tp = pp = 1, gloo world of 1), fp32, both sides in the same process and run:
  forward + backward tokens/s of parallm.forward_backward  /  transformers (sdpa) forward + loss + backward
  packed / padded real-tokens/s of parallm on a batch with 50% padding
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import free_port, table  # noqa: E402


def ce_loss(logits, ids, mask):
    lp = logits[:, :-1].log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def timed(fn, iters):
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import torch
    import transformers

    import parallm
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                   vocab_size=8000, max_position_embeddings=4 * args.seq,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float()
    ckpt = tempfile.mkdtemp(prefix="parallm-cbench-")
    hf.save_pretrained(ckpt)
    parallm.init_parallel(tp=1)
    g = torch.Generator().manual_seed(0)
    b, s = args.batch, args.seq
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    full = torch.ones(b, s, dtype=torch.long)
    pos_full = parallm.default_position_ids(full)

    def hf_step(mask, pos):
        hf.zero_grad(set_to_none=True)
        out = hf(input_ids=ids, attention_mask=mask, position_ids=pos)
        ce_loss(out.logits, ids, mask).backward()

    padded = parallm.build_model(ckpt)
    parallm.load_hf_weights(padded, ckpt)
    packed = parallm.build_model(ckpt, packed=True)
    parallm.load_hf_weights(packed, ckpt)

    def pl_step(chunks, mask):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        parallm.forward_backward(chunks, ids, mask, loss_fn=ce_loss)

    t_hf = timed(lambda: hf_step(full, pos_full), args.iters)
    t_pl = timed(lambda: pl_step(padded, full), args.iters)
    # 50% padding: every row keeps s/2 real tokens, alternately left- and right-padded
    half = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        if r % 2:
            half[r, s // 2:] = 1
        else:
            half[r, :s // 2] = 1
    t_pad = timed(lambda: pl_step(padded, half), args.iters)
    t_pack = timed(lambda: pl_step(packed, half), args.iters)
    real = int(half.sum())
    rows = [
        ("fwd+bwd tokens/s, tp=1: parallm / transformers (sdpa)",
         f"{b * s / t_pl:.0f} / {b * s / t_hf:.0f}", f"{t_hf / t_pl:.2f}", ">= 1.0"),
        ("real tokens/s at 50% padding: packed / padded",
         f"{real / t_pack:.0f} / {real / t_pad:.0f}", f"{t_pad / t_pack:.2f}", ">= 1.6"),
    ]
    print(f"model: LLaMA hidden {args.hidden}, {args.layers} layers, vocab {cfg.vocab_size}; batch {b} x {s}; "
          f"fp32, {torch.get_num_threads()} threads")
    print(table(rows, ["metric", "measured", "ratio", "target"]))
    parallm.destroy_parallel()


if __name__ == "__main__":
    main()
