"""DeepSeek Sparse Attention under ``recompute="full"`` (issue 55, item 2): the peak memory of a training step of a
GLM-5-shaped model, with the top-k selections as parallm now keeps them (only those a later shared layer reads,
int32) against the former behaviour emulated (every full layer's selection held on the layer context for the
whole microbatch as int64 plus a bool mask). Target: the peak now no higher than with them held; both reported,
with the selection bytes held while the loss runs. Not part of the test suite.

    python bench/dsa_recompute_bench.py              # S = 8192, 6 full layers (dsa_bench's layer shapes,
                                                     # index_topk 512, a small MoE), batch 1, fp32
    python bench/dsa_recompute_bench.py --shared     # indexer_types full / shared alternating
    python bench/dsa_recompute_bench.py --quick      # tiny shapes: checks the script runs, measures nothing

Each variant runs in a fresh process (glibc ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB); the figure is the peak anonymous
RSS of one ``forward_backward`` above the level before it (the model built and one step run before).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, free_port, rss_anon, table  # noqa: E402
from dsa_bench import QUICK, SHAPES  # noqa: E402


def emulate_former():
    """Every full layer's selection kept on the layer context as int64 + bool (the former behaviour)."""
    from parallm.model.layers import dsa
    original = dsa.DSAttention._selection

    def held(self, x, q_resid, cos, sin, ctx, ranges):
        index = original(self, x, q_resid, cos, sin, ctx, ranges)
        if self.indexer is not None:
            ctx.__dict__.setdefault("_former", {})[self.layer_number] = (index.long(), index >= 0)
        return index
    dsa.DSAttention._selection = held


def one(args) -> dict:
    import torch
    from transformers import GlmMoeDsaConfig

    import parallm
    from parallm.model.layers.dsa import DSAttention
    torch.set_num_threads(args.threads)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    if args.variant == "former":
        emulate_former()
    shapes = QUICK if args.quick else SHAPES
    layers = args.layers
    extra = dict(index_topk_freq=2, index_skip_topk_offset=1) if args.shared else {}
    cfg = GlmMoeDsaConfig(**shapes, num_hidden_layers=layers, vocab_size=1000, intermediate_size=256,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          first_k_dense_replace=1, max_position_embeddings=4 * args.seq,
                          architectures=["GlmMoeDsaForCausalLM"], **extra)
    import transformers
    torch.manual_seed(0)
    ckpt = tempfile.mkdtemp(prefix="dsa-recompute-bench-")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    parallm.init_parallel(tp=1)
    chunks = parallm.build_model(ckpt, recompute="full")
    parallm.load_hf_weights(chunks, ckpt)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    seen = []
    attn = next(m for m in chunks[0].modules() if isinstance(m, DSAttention))
    attn.register_forward_pre_hook(lambda mod, a: seen.append(a[3]))
    held = []

    def loss_fn(out, ids_, mask_):
        ctx = seen[-1].__dict__
        tensors = [t for v in list(ctx.get("_dsa_selected", {}).values()) + list(ctx.get("_former", {}).values())
                   for t in (v if isinstance(v, tuple) else (v,))]
        held.append(sum(t.numel() * t.element_size() for t in tensors))
        lp = out[:, :-1].float().log_softmax(-1)
        return -lp.gather(-1, ids_[:, 1:, None]).mean()

    parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn)          # gradients exist before the measure
    before = rss_anon()
    with PeakRss() as peak:
        parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn)
    parallm.destroy_parallel()
    return {"peak_mib": (peak.peak - before) / 2**20, "held_mib": held[-1] / 2**20}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--shared", action="store_true", help="indexer_types full / shared alternating")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per variant (2 on a quiet 2-core machine)")
    ap.add_argument("--variant", choices=("now", "former"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.layers = 96, 4
    if args.variant:
        print("RESULT " + json.dumps(one(args)))
        return
    results = {}
    for variant in ("now", "former"):
        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
               "--variant", variant]
        run = subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)), capture_output=True,
                             text=True, check=True)
        results[variant] = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))[7:])
    now, former = results["now"], results["former"]
    rows = [("selections held while the loss runs", f"{now['held_mib']:.1f} MiB", f"{former['held_mib']:.1f} MiB",
             "report"),
            ("step peak RSS above start", f"{now['peak_mib']:.0f} MiB", f"{former['peak_mib']:.0f} MiB",
             "now <= former")]
    print(f"GLM-5-shaped, {args.layers} layers ({'full / shared' if args.shared else 'all full'}), S = {args.seq}, "
          f"recompute full, fp32, {args.threads} thread(s)" + ("  (--quick: not a measurement)" if args.quick else ""))
    print(table(rows, ["metric", "now (int32, shared readers only)", "former (int64 + bool, every layer)",
                       "target"]))


if __name__ == "__main__":
    main()
