"""LoRA against full training on a Qwen3-MoE-shaped model (issue 39's benchmark). Not part of the test suite.

    PYTHONPATH=src python bench/lora_bench.py [--world 2] [--tp 2] [--ep 1] [--r 16] [--steps 3] [--small]
        [--hidden 1024 --expert-width 768]     # nearer Qwen3-30B-A3B's proportions (hidden 2048, experts 768)

Both sides: the same model (Qwen3-MoE shape: hidden 512, 4 layers, 8 heads / 4 KV heads, 16 experts of width 256,
top 4, vocab 32000, fp32 unless ``--dtype bfloat16``), the same weights, the same batch (4 x 256 tokens per replica,
2 microbatches, a token-mean next-token loss), one process per rank, one thread each.

full   every parameter trained: ``build_optimizer`` + ``forward_backward`` + ``finalize_grads`` + step.
lora   ``build_model(lora=LoraConfig(r, 2r, all seven projections))`` (experts included), the base frozen.

Reported per side (rank 0): optimizer state bytes (``opt.state_bytes()``), gradient bytes (every ``grad_of``
after ``finalize_grads``), peak RSS over the steps, best step time (wall and CPU) of ``--steps - 1`` timed steps,
and for a weight sync: the bytes and seconds of ``export_hf_tensors(dst_ranks=[0])`` (full) against
``export_adapter_tensors`` (lora; every rank receives it). Targets (issue 39): optimizer + gradient memory <=
0.1x full, adapter bytes <= 0.05x full. ``--small`` shrinks everything to check that the script runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, run_world, table  # noqa: E402

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
MB = 1 << 20
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape(small: bool) -> dict:
    if small:
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                    vocab_size=256, decoder_sparse_step=1, mlp_only_layers=[])
    return dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024,
                vocab_size=32000, decoder_sparse_step=1, mlp_only_layers=[])


def token_nll(logprobs, ids, mask):
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(logprobs[:, :-1] * m).sum(), m.sum()


def _side(rank, world, ckpt, args, lora: bool):
    import torch

    import parallm
    from parallm.model.params import grad_of
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    parallm.init_parallel(tp=args.tp, ep=args.ep)
    config = parallm.LoraConfig(args.r, 2 * args.r, TARGETS) if lora else None
    chunks = parallm.build_model(ckpt, dtype=dtype, lora=config)
    parallm.load_hf_weights(chunks, ckpt)
    opt = parallm.build_optimizer(chunks, lr=1e-4)
    dims = chunks[0].dims
    g = torch.Generator().manual_seed(1 + dims.dp_rank)
    vocab = chunks[0].spec.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    times, cpus = [], []
    with PeakRss() as peak:
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            parallm.forward_backward(chunks, ids, mask, loss_fn=token_nll, num_microbatches=2, output="logprobs")
            parallm.finalize_grads(chunks)
            grad_bytes = sum(x.numel() * x.element_size() for c in chunks for p in c.parameters()
                             if (x := grad_of(p)) is not None)
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    t0 = time.perf_counter()
    if lora:
        nbytes = sum(t.numel() * t.element_size() for _, t in parallm.export_adapter_tensors(chunks))
    else:
        nbytes = sum(t.numel() * t.element_size() for _, t in parallm.export_hf_tensors(chunks, dst_ranks=[0]))
    sync_s = time.perf_counter() - t0
    out = dict(state=opt.state_bytes(), grads=grad_bytes, peak=peak.peak, step=min(times[1:] or times),
               cpu=min(cpus[1:] or cpus), sync_bytes=nbytes, sync_s=sync_s)
    parallm.destroy_parallel()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--hidden", type=int, default=None, help="wider shapes: hidden size (head_dim 64 kept)")
    ap.add_argument("--expert-width", type=int, default=None, help="moe_intermediate_size")
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    if args.small:
        args.seq, args.steps = 16, 2
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import helpers
    tmp = tempfile.mkdtemp()
    dims = shape(args.small)
    if args.hidden:
        dims.update(hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                    num_key_value_heads=args.hidden // 128, intermediate_size=2 * args.hidden)
    if args.expert_width:
        dims.update(moe_intermediate_size=args.expert_width)
    if args.layers:
        dims.update(num_hidden_layers=args.layers)
    print("shape:", {k: v for k, v in dims.items() if k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                           "moe_intermediate_size", "vocab_size")})
    model = helpers.make_hf_model(helpers.tiny_config("qwen3_moe", **dims))
    ckpt = os.path.join(tmp, "ckpt")
    helpers.hub_state_dict(model, ckpt)
    del model
    res = {name: run_world(_side, args.world, ckpt, args, name == "lora")[0] for name in ("full", "lora")}
    rows = [[name, f"{r['state'] / MB:.1f}", f"{r['grads'] / MB:.1f}", f"{r['peak'] / MB:.0f}",
             f"{r['step']:.3f}", f"{r['cpu']:.3f}", f"{r['sync_bytes'] / MB:.2f}", f"{r['sync_s']:.3f}"]
            for name, r in res.items()]
    print(table(rows, ["side", "opt state MB", "grads MB", "peak RSS MB", "step s", "step cpu s", "sync MB",
                       "sync s"]))
    f, lo = res["full"], res["lora"]
    print(f"optimizer + gradient memory: {(lo['state'] + lo['grads']) / (f['state'] + f['grads']):.4f}x full "
          f"(target <= 0.1); adapter sync bytes: {lo['sync_bytes'] / f['sync_bytes']:.4f}x full (target <= 0.05)")


if __name__ == "__main__":
    main()
