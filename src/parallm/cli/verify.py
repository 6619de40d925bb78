"""``parallm verify CHECKPOINT --tp ... [--pp --vpp --cp --dp --ep --dtype --packed --sequence-parallel --task --mode
and the pipeline-split options]``: one layout of your checkpoint against transformers
(:func:`parallm.verify.check_layout` on every rank).

Before any rank starts, the launching process reads config.json and the safetensors headers and runs the
loader's own checks (``inspect.read_checkpoint`` / ``check_split``): a broken checkpoint fails in a second, in one
line. Under torchrun rank 0 alone runs them; the ranks' loader checks everything again anyway.
"""

from __future__ import annotations

import os

from .errors import CLIError, UsageError
from .launch import run_job, under_torchrun
from .options import (LAUNCH_EPILOG, Formatter, add_revision, add_split_options, check_kwargs, check_options, para,
                      positive, resolve_path, split_kwargs)
from ..verify import VERIFY_DTYPES


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", parents=[check_options()], formatter_class=Formatter, help="check your checkpoint for one layout",
        description=para("Load CHECKPOINT (a Hugging Face directory: config.json + safetensors) with parallm in the "
                         "layout you give, compare with transformers, run one SGD step, save and reload with "
                         "transformers. A broken checkpoint (missing tensor, wrong shape, a layout that does not "
                         "split) is reported in one line naming the problem. bf16 / fp16 checkpoints are loaded "
                         "into an fp32 model: the check is about the weight mapping. Memory: rank 0 also holds the "
                         "transformers model in fp32 with its gradients and a gathered copy of the weights (about "
                         "4x the fp32 model size).") + "\n\nsupported architectures: {architectures}",
        epilog=LAUNCH_EPILOG)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="Hugging Face checkpoint directory, or a Hub id (org/name) in the local Hugging Face cache "
                        "(HF_HUB_CACHE / HF_HOME; never downloaded)")
    add_revision(p)
    p.add_argument("--tp", type=positive, default=1,
                   help="tensor-parallel ranks: each holds 1/tp of every layer's heads and MLP (default 1)")
    p.add_argument("--pp", type=positive, default=1,
                   help="pipeline stages: each holds a contiguous run of layers (default 1)")
    p.add_argument("--vpp", type=positive, default=None,
                   help="virtual stages per pipeline rank (Megatron's interleaving; needs --pp > 1 and layers "
                        "divisible by pp x vpp)")
    p.add_argument("--dp", type=positive, default=None,
                   help="data-parallel replicas: each gets its share of the batch, gradients are averaged. "
                        "Standalone: world = tp x cp x pp x dp (default dp 1); under torchrun: default "
                        "world / (tp x cp x pp), and a given --dp must match")
    p.add_argument("--cp", type=positive, default=1,
                   help="context-parallel ranks: every sequence is split over them, each computes its share "
                        "(default 1; world = tp x cp x pp x dp)")
    p.add_argument("--cp-attn", choices=("auto", "allgather", "ring"), default="auto",
                   help="with --cp > 1: how attention reaches the other ranks' keys (build_model's cp_attn)")
    add_split_options(p)
    p.add_argument("--dtype", choices=VERIFY_DTYPES, default="float32",
                   help="the model's parameter dtype; transformers runs in it too (default float32: the check is "
                        "about the weight mapping; bfloat16 checks the model as it will train, with looser default "
                        "tolerances)")
    p.add_argument("--ep", type=positive, default=1,
                   help="expert parallelism for mixture-of-experts models: the experts of every MoE layer are "
                        "split over this many of the data-parallel ranks (must divide dp; default 1)")
    p.add_argument("--packed", action="store_true",
                   help="remove padding: run the real tokens as one stream (varlen attention)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="split that stream over the tp ranks between the parallel linears (implies --packed)")
    p.add_argument("--task", choices=("auto", "causal_lm", "value"), default="auto",
                   help="causal_lm: logits; value: a critic / reward model (score head, one value per token, "
                        "compared with transformers' *ForSequenceClassification score of every token); auto "
                        "(default): from the config's architectures")
    p.add_argument("--mode", choices=("auto", "slice", "broadcast"), default="auto",
                   help="how weights are read: slice = every rank reads only its slices; broadcast = rank 0 reads "
                        "and sends each rank its shards; auto (default) = slice when every rank sees the directory")
    p.add_argument("--microbatches", type=positive, default=None, metavar="N",
                   help="microbatches per step (default: 2 with pipeline parallelism, else 1)")
    p.add_argument("--save-dir", metavar="DIR",
                   help="write the model after the step here (must be empty or absent) and keep it; default: a "
                        "temporary directory")
    p.add_argument("--no-preflight", action="store_true",
                   help="skip the quick checkpoint check in the launching process (the ranks' loader checks "
                        "everything anyway: this shows the distributed error path)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..verify import Check
    from .inspect import check_split, read_checkpoint
    vpp = args.vpp if args.vpp and args.vpp > 1 else None
    if vpp and args.pp == 1:
        raise UsageError(f"--vpp {args.vpp} needs --pp > 1 (virtual stages interleave a pipeline)")
    save_dir = os.path.abspath(args.save_dir) if args.save_dir else None
    if save_dir and os.path.isdir(save_dir) and os.listdir(save_dir):
        raise UsageError(f"--save-dir {args.save_dir} is not empty (give a new or empty directory)")
    try:
        ckpt = os.path.abspath(resolve_path(args.checkpoint, args.revision))
    except CLIError:
        if not under_torchrun() or os.environ["RANK"] == "0":
            raise
        ckpt = os.path.abspath(args.checkpoint)    # not cached on this node: rank 0 streams the shards
    task = None if args.task == "auto" else args.task
    split = split_kwargs(args)
    if split and args.pp == 1:
        raise UsageError("the pipeline-split options need --pp > 1")
    check = Check(ckpt, save_dir, tp=args.tp, pp=args.pp, vpp=vpp, dp=args.dp, ep=args.ep, cp=args.cp,
                  cp_attn=args.cp_attn, dtype=args.dtype, split=split or None, mode=args.mode,
                  task=task, packed=args.packed, sequence_parallel=args.sequence_parallel,
                  microbatches=args.microbatches or (2 if args.pp > 1 else 1),
                  label=os.path.basename(os.path.normpath(args.checkpoint)), **check_kwargs(args))
    header = None
    if not args.no_preflight and (not under_torchrun() or os.environ["RANK"] == "0"):
        found = read_checkpoint(ckpt, task=task, pp=args.pp)
        check_split(found["spec"], tp=args.tp, pp=args.pp, vpp=vpp, split=split, task=found["task"])
        if found["problem"]:
            raise CLIError(found["problem"])
        header = (f"{found['spec'].architecture} ({'/'.join(found['dtypes'])}, loaded in {args.dtype}), "
                  f"task {found['task']}")
    world = args.tp * args.cp * args.pp * (args.dp or 1)
    return run_job(args, dict(kind="verify", checks=[check], workdir=None), world=world,
                   title=f"parallm verify {ckpt}", header=header)
