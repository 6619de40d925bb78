"""One DeepSeek Sparse Attention layer (issue 46's benchmark): peak memory and time of its forward + backward,
parallm's sparse path (the indexer's blocked top-k, attention over the selected latent rows: no [S, S] tensor)
against transformers' masked dense path (``GlmMoeDsaAttention`` with SDPA: the indexer's [S, heads, S] scores, an
[S, S] sparse mask folded into the causal one) on the same input and weights. Not part of the test suite.

    python bench/dsa_bench.py                    # S = 4k, 8k, 16k for parallm; transformers at 4k and 8k
    python bench/dsa_bench.py --ref-max 16384    # transformers at 16k too (its indexer scores alone: 8 GiB)
    python bench/dsa_bench.py --quick            # tiny shapes: checks the script runs, measures nothing
    python bench/dsa_bench.py --dtype bf16       # both paths in bf16 (default fp32)

Shapes (GLM-5's scaled down): hidden 1024, 16 heads, q_lora_rank 512, kv_lora_rank 512, nope 128 + rope 64,
v 128, indexer 8 heads x 64, index_topk 512; batch 1, fp32, one thread. Each (path, S) runs in a fresh process
(this script re-invoked with ``--one``), started with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so that freed
blocks go back to the system; the figure is the peak anonymous RSS during one forward + backward above the level
before it (weights and inputs made before), and the best of ``--iters`` wall times. The two paths' outputs are
compared at the smallest S.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import peak_and_best, table  # noqa: E402

SHAPES = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=8, index_head_dim=64,
              index_topk=512)
QUICK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16,
             index_topk=32)


def config(shapes: dict, s: int):
    from transformers import GlmMoeDsaConfig
    cfg = GlmMoeDsaConfig(**shapes, num_hidden_layers=1, vocab_size=128, intermediate_size=64,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          max_position_embeddings=max(s, 4096), rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 1e4})
    cfg._attn_implementation = "sdpa"
    return cfg


def reference_layer(shapes: dict, s: int):
    import torch
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention
    torch.manual_seed(0)
    cfg = config(shapes, s)
    layer = GlmMoeDsaAttention(cfg, 0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else
                    (0.1 * noise if name.endswith("bias") else noise / p.shape[-1] ** 0.5))
    return cfg, layer


def hf_path(shapes: dict, s: int, dtype):
    """(step inputs, fn(x) -> output) of transformers' layer."""
    import torch
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding
    cfg, layer = reference_layer(shapes, s)
    layer = layer.to(dtype)
    rope = GlmMoeDsaRotaryEmbedding(cfg)
    pos = torch.arange(s)[None]
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]

    def fn(x):
        return layer(hidden_states=x, position_embeddings=rope(x, pos), attention_mask=mask, position_ids=pos)[0]
    return fn


def parallm_path(shapes: dict, s: int, dtype):
    import torch
    import torch.distributed as dist

    import parallm
    from parallm.families import spec_from_config
    from parallm.model.decoder import RMSNorm, make_config
    from parallm.model.layers.attention import PaddedRows, resolve_attn_impl
    from parallm.model.layers.dsa import DSAttention
    from parallm.model.layers.indexer import INDEXER_WEIGHTS
    from parallm.model.layers.mla import MLA_WEIGHTS
    from parallm.model.positions.rope import rope_cos_sin
    store = tempfile.mkdtemp(prefix="dsa-bench-")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    parallm.init_parallel()
    cfg, ref = reference_layer(shapes, s)
    cfg.architectures = ["GlmMoeDsaForCausalLM"]
    spec, _ = spec_from_config(cfg)
    layer = DSAttention(spec, make_config(tp=1, pp=1, vpp=None, dtype=dtype, sequence_parallel=False), 1,
                        backend=resolve_attn_impl("auto", packed=False, device="cpu", dtype=dtype),
                        norm=RMSNorm, layer_number=0)
    names = {MLA_WEIGHTS[n][0]: n for n in MLA_WEIGHTS if n in ref.state_dict()}
    names.update({"indexer." + local: "indexer." + hf for hf, (local, _) in INDEXER_WEIGHTS.items()})
    state = ref.state_dict()
    with torch.no_grad():
        for local, p in layer.named_parameters():
            p.copy_(state[names[local]])
    del ref
    cos, sin = rope_cos_sin(spec.rope, torch.arange(s)[:, None])
    ctx = PaddedRows(torch.ones(1, s, dtype=torch.bool))

    def fn(x):
        return layer(x.transpose(0, 1), cos, sin, ctx).transpose(0, 1)
    return fn


def one(path: str, s: int, args) -> dict:
    import torch
    torch.set_num_threads(1)
    shapes = QUICK if args.quick else SHAPES
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    fn = {"parallm": parallm_path, "transformers": hf_path}[path](shapes, s, dtype)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(1, s, shapes["hidden_size"], generator=g).to(dtype)
    grad = torch.randn(x0.shape, generator=g).to(dtype)

    def step():
        x = x0.clone().requires_grad_()
        out = fn(x)
        (out * grad).sum().backward()
        return out.detach()

    peak, best = peak_and_best(step, args.iters)
    out = {"path": path, "s": s, "peak_mib": peak, "s_best": best}
    if args.save:
        with torch.no_grad():
            torch.save(fn(x0).float(), args.save)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--ref-max", type=int, default=8192, help="transformers runs at S up to this (default 8k)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="both paths' weights and activations (bf16: oneDNN's bf16 kernels where the CPU has them)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "S"), help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seqs, args.ref_max, args.iters = [128, 256], 256, 1
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args)))
        return
    seqs = sorted(args.seqs)
    runs = [(p, s) for s in seqs for p in ("parallm", "transformers") if p == "parallm" or s <= args.ref_max]
    load = os.getloadavg()[0]
    rows, env = [], dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    tmp = tempfile.mkdtemp(prefix="dsa-bench-out-")
    failed = {}
    extra = ["--quick"] if args.quick else []
    for path, s in runs:
        save = ["--save", os.path.join(tmp, f"{path}.pt")] if s == seqs[0] else []
        out = subprocess.run([sys.executable, __file__, "--one", path, str(s), "--iters", str(args.iters),
                              "--dtype", args.dtype] + extra + save, env=env, capture_output=True, text=True)
        if out.returncode and path == "transformers" and s != seqs[0]:
            # the reference's dense path may not fit this machine at the largest S: say so, keep the rest
            why = "killed (out of memory?)" if out.returncode in (-9, 137) else f"exit {out.returncode}"
            print(f"transformers at S = {s}: {why}; stderr tail: {out.stderr[-300:]!r}", flush=True)
            failed[s] = why
            continue
        if out.returncode:
            raise SystemExit(f"{path} at S = {s} failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by = {(r["path"], r["s"]): r for r in rows}
    import torch
    diff = (torch.load(os.path.join(tmp, "parallm.pt")) - torch.load(os.path.join(tmp, "transformers.pt"))).abs()
    shapes = QUICK if args.quick else SHAPES
    print(f"load average before: {load:.2f}; {shapes}; batch 1, {args.dtype}, one thread")
    print(f"max |parallm - transformers| of the outputs at S = {seqs[0]}: {float(diff.max()):.2e}")
    table_rows = []
    for s in seqs:
        new, old = by[("parallm", s)], by.get(("transformers", s))
        table_rows.append([s, f"{new['peak_mib']:.0f}", f"{old['peak_mib']:.0f}" if old else failed.get(s, "not run"),
                           f"{new['peak_mib'] / old['peak_mib']:.3f}" if old else "-",
                           f"{new['s_best']:.3f}", f"{old['s_best']:.3f}" if old else "not run",
                           f"{new['s_best'] / old['s_best']:.2f}" if old else "-"])
    print(table(table_rows, ["S", "parallm peak MiB", "transformers peak MiB", "ratio", "parallm s",
                             "transformers s", "time ratio"]))
    small, large = by[("parallm", seqs[0])], by[("parallm", seqs[-1])]
    print(f"parallm: peak grows {large['peak_mib'] / max(small['peak_mib'], 1e-9):.2f}x for "
          f"{seqs[-1] / seqs[0]:.0f}x the tokens (linear: {seqs[-1] / seqs[0]:.0f}x)")


if __name__ == "__main__":
    main()
