"""Gated DeltaNet on padded batches (issue 45 item 3): a Qwen3.5-shaped training step on a padded batch of rows
of unequal length, on the CPU's torch kernel, four ways: the padded model as parallm runs it now (``padded``: the
whole batch packed inside, every layer on the real tokens only), the padded layout with the packing inside turned
off (``padded rows``: every layer on ``[S, B]``, the linear-attention layers on each row's span of real tokens
through the varlen path: what parallm ran before), the padded rows whole through the chunked recurrence, padding
included (``old padded``: the first implementation, re-implemented here), and the same batch in the packed layout
(``packed``, the reference). Peak memory and time of forward + backward. Not part of the test suite.

    python bench/gdn_padded_bench.py             # hidden 1024, 8 layers (6 Gated DeltaNet), rows of
                                                 # 1024 / 768 / 512 / 256 tokens left-padded to 1024, fp32
    python bench/gdn_padded_bench.py --quick     # tiny: checks the script runs, measures nothing

Each side runs in a fresh process (this script with --one) started with glibc's ``MALLOC_MMAP_THRESHOLD_`` at
1 MiB; the figure is the peak anonymous RSS during one step above the level before it (the gradients already
allocated by a first step), and the best of ``--iters`` step times. Target (issue 45): the padded layout's peak
within 1.1x of the packed one's. The four sides' losses are printed (the same batch: equal to ~1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import free_port, peak_and_best, table  # noqa: E402


def old_padded_forward(layer, x, ctx):
    """The padded path parallm ran before: every row whole through ``chunk_gated_delta_rule`` (padding included)."""
    import torch
    import torch.nn.functional as F

    from parallm.model.layers import gated_deltanet as gdn
    keep = ctx.keep if isinstance(ctx, gdn.PaddedRows) else ctx
    if keep is not None:
        x = x * keep.transpose(0, 1).unsqueeze(-1).to(x.dtype)
    proj, _ = layer.in_proj(x)
    s, b = proj.shape[:2]
    q, k, v, z, beta, a = layer._split(proj)
    qkv = gdn.causal_conv_padded(torch.cat([q, k, v], dim=-1).permute(1, 2, 0), layer.conv1d.weight).permute(2, 0, 1)
    key = layer.nk * layer.dk
    q, k, v = qkv.split([key, key, layer.nv * layer.dv], dim=-1)
    q, k = q.reshape(s, b, layer.nk, layer.dk), k.reshape(s, b, layer.nk, layer.dk)
    v = v.reshape(s, b, layer.nv, layer.dv)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    out = gdn.chunk_gated_delta_rule(*(t.transpose(0, 1) for t in (q, k, v, g, beta.sigmoid()))).transpose(0, 1)
    out = layer.norm(out.to(v.dtype), z.reshape(s, b, layer.nv, layer.dv))
    out, _ = layer.out_proj(out.reshape(s, b, layer.nv * layer.dv))
    return out


def one(side: str, args) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import tempfile

    import torch
    import transformers

    import parallm
    from parallm.model.layers import gated_deltanet as gdn
    torch.set_num_threads(1)
    head = 128 if args.hidden >= 512 else 32
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_text", hidden_size=args.hidden, num_hidden_layers=args.layers, full_attention_interval=4,
        num_attention_heads=args.hidden // head, num_key_value_heads=2, head_dim=head, intermediate_size=2 * args.hidden,
        linear_num_key_heads=args.hidden // head, linear_num_value_heads=2 * args.hidden // head,
        linear_key_head_dim=head, linear_value_head_dim=head, vocab_size=8000, max_position_embeddings=2 * args.seq)
    torch.manual_seed(0)
    ckpt = tempfile.mkdtemp(prefix="parallm-gdnpad-")
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(ckpt)
    parallm.init_parallel(tp=1)
    chunks = parallm.build_model(ckpt, packed=side == "packed")
    parallm.load_hf_weights(chunks, ckpt)
    if side in ("padded rows", "old padded"):
        for c in chunks:
            c.pack_inside = False
    if side == "old padded":
        gdn.GatedDeltaNet.forward = lambda self, x, cos=None, sin=None, ctx=None: old_padded_forward(self, x, ctx)
    b = len(args.lengths)
    ids = torch.randint(0, cfg.vocab_size, (b, args.seq), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(b, args.seq, dtype=torch.long)
    for r, n in enumerate(args.lengths):
        mask[r, args.seq - n:] = 1                       # left padding

    def loss_fn(logits, ids_, mask_):
        lp = logits[:, :-1].log_softmax(-1).gather(-1, ids_[:, 1:, None]).squeeze(-1)
        m = (mask_[:, 1:] * mask_[:, :-1]).float()
        return -(lp * m).sum() / m.sum()

    def step():
        for c in chunks:
            c.zero_grad(set_to_none=False)
        return float(parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn))

    loss = step()
    peak, best = peak_and_best(step, args.iters)
    parallm.destroy_parallel()
    return {"side": side, "peak_mib": peak, "s_best": best, "loss": loss}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 768, 512, 256])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.seq, args.lengths, args.iters = 128, 4, 160, [160, 100], 1
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args)))
        return
    load = os.getloadavg()[0]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    rest = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq), "--iters",
            str(args.iters), "--lengths", *map(str, args.lengths)]
    res = {}
    for side in ("padded", "padded rows", "old padded", "packed"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", side] + rest, env=env,
                             capture_output=True, text=True, check=True)
        res[side] = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
    packed = res["packed"]
    rows = [[side, f"{r['peak_mib']:.0f}", f"{r['peak_mib'] / packed['peak_mib']:.2f}", f"{r['s_best']:.2f}",
             f"{r['s_best'] / packed['s_best']:.2f}", f"{r['loss']:.6f}"] for side, r in res.items()]
    print(f"Qwen3.5 text hidden {args.hidden}, {args.layers} layers; rows {args.lengths} left-padded to {args.seq}; "
          f"fp32, one thread, torch kernel; load average before {load:.2f}"
          + ("  (--quick: not a measurement)" if args.quick else ""))
    print(table(rows, ["side", "step peak MiB", "vs packed", "step s", "vs packed", "loss"]))


if __name__ == "__main__":
    main()
