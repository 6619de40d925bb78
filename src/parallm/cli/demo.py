"""``parallm demo``: tiny checkpoints of every supported family made with transformers, checked in four layouts.

Every model is small (hidden 64, 4 layers, 4 query heads of 16) with every weight redrawn from a seed
(:func:`parallm.verify.make_hf_model`); vocabulary sizes are odd on purpose (not divisible by tp: the padding
path runs).
"""

from __future__ import annotations

import os

from .launch import run_job
from .options import LAUNCH_EPILOG, Formatter, check_kwargs, check_options, para

# name -> (family, config overrides, task, label shown in the table)
MODELS = {
    "llama-untied": ("llama", dict(attention_bias=True, vocab_size=101), "causal_lm", "llama untied, qkvo bias"),
    "mistral-tied": ("mistral", dict(tie_word_embeddings=True, num_key_value_heads=1, vocab_size=99,
                                     sliding_window=None), "causal_lm", "mistral tied, 1 kv head"),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, vocab_size=103), "causal_lm", "qwen3 tied, qk-norm"),
    "qwen2-value": ("qwen2", dict(vocab_size=101), "value", "qwen2 value head"),
}
BASE = dict(intermediate_size=128, num_hidden_layers=4, head_dim=16, max_position_embeddings=128)

# world 4 = tp x pp x dp; quick: the subset `--quick` runs
LAYOUTS = [
    dict(model="llama-untied", tp=2, mode="slice", quick=True),
    dict(model="mistral-tied", tp=2, pp=2, vpp=2, microbatches=2, mode="broadcast", quick=False),
    dict(model="qwen3-tied", tp=2, sequence_parallel=True, quick=False),
    dict(model="qwen2-value", tp=2, pp=2, microbatches=2, sequence_parallel=True, quick=True),
]
WORLD = 4


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo", parents=[check_options()], formatter_class=Formatter, help="check several layouts on tiny models",
        description=para("Make tiny LLaMA (untied, qkvo biases), Mistral (tied, one KV head), Qwen3 (tied, qk-norm) "
                         "and Qwen2 (value model) checkpoints with transformers, start 4 local ranks (or use "
                         "torchrun's), and for each layout: load, compare with transformers, run one training "
                         "step, save and reload with transformers. Layouts: tp2 x dp2; tp2 x pp2 x vpp2 (tied, "
                         "broadcast load); tp2 x dp2 packed + sequence parallel; value model tp2 x pp2 packed + "
                         "sequence parallel. Prints a table; exit 0 when all match."),
        epilog=LAUNCH_EPILOG)
    p.add_argument("--quick", action="store_true",
                   help="run two layouts only (tp2 x dp2; value model tp2 x pp2 packed + SP): the fast test")
    p.add_argument("--workdir", metavar="DIR",
                   help="write the checkpoints (DIR/checkpoints) and the saved models (DIR/saved) here and keep "
                        "them; default: a temporary directory, removed at the end")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    p.set_defaults(run=run)


def run(args) -> int:
    job = dict(kind="demo", prepare=prepare, quick=args.quick, keep=args.keep, check=check_kwargs(args),
               workdir=os.path.abspath(args.workdir) if args.workdir else None)
    return run_job(args, job, world=WORLD, title="parallm demo" + (" --quick" if args.quick else ""))


def prepare(job: dict, workdir: str, world: int, progress):
    """On every rank: the demo's checks that fit ``world`` (tp x pp must divide it) and a note per skipped one;
    rank 0 makes the checkpoints they need."""
    import torch.distributed as dist

    from ..parallel.errors import run_local
    from ..verify import Check, make_hf_model, tiny_config
    checks, skipped = [], []
    for lay in LAYOUTS:
        lay = dict(lay)
        name, quick = lay.pop("model"), lay.pop("quick")
        if job["quick"] and not quick:
            continue
        if world % (lay["tp"] * lay.get("pp", 1)):
            skipped.append(f"{name} tp{lay['tp']} pp{lay.get('pp', 1)}: needs a multiple of "
                           f"{lay['tp'] * lay.get('pp', 1)} ranks, the world has {world}")
            continue
        checks.append(Check(os.path.join(workdir, "checkpoints", name), label=MODELS[name][3], task=MODELS[name][2],
                            **lay, **job["check"]))
    if not checks:
        raise ValueError(f"no demo layout fits a world of {world} rank(s) (they need 2 or 4)")

    def make():
        for c in checks:
            name = os.path.basename(c.ckpt)
            family, overrides, task, _ = MODELS[name]
            seed = sorted(MODELS).index(name) + 1
            make_hf_model(tiny_config(family, **BASE, **overrides), task=task, seed=seed).save_pretrained(c.ckpt)

    progress(f"{world} ranks up ({dist.get_backend()}); making {len(checks)} tiny checkpoints with transformers "
             f"in {workdir}")
    run_local(lambda: make() if dist.get_rank() == 0 else None, what="making the demo checkpoints")
    return checks, skipped
