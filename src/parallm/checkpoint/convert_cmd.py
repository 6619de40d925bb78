"""``parallm convert CHECKPOINT OUT``: a training checkpoint (``parallm.save_checkpoint``) -> an HF directory, in
this process, without starting ranks (:func:`parallm.checkpoint.train_ckpt.checkpoint_to_hf`).

A command module in the shape the ``parallm`` command line uses (``add_parser(sub)`` registers the subcommand
and sets ``run``); ``main(argv)`` runs it on its own (``python -m parallm.checkpoint.convert_cmd``).
Exit codes: 0 done, 1 the checkpoint cannot be converted (the message names the file or tensor), 2 bad
command line.
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")
HELP = "turn a training checkpoint into a Hugging Face directory (no processes started)"
DESCRIPTION = ("Write the model of training checkpoint CHECKPOINT (made by parallm.save_checkpoint, at any "
               "layout) to OUT as a Hugging Face directory: safetensors files (an index when there are several), "
               "and config.json, which transformers' from_pretrained loads. Runs in this process alone; every "
               "tensor read is checked against its CRC-32. A float32 export of a bf16 / fp16 run writes the fp32 "
               "master weights.")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="training checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory (written atomically)")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the written weights (default: the training dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help=HELP, description=DESCRIPTION,
                       epilog="exit codes: 0 done; 1 the checkpoint cannot be converted; 2 bad command line.")
    _arguments(p)
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from .train_ckpt import checkpoint_to_hf
    checkpoint_to_hf(args.checkpoint, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None,
                     overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="parallm convert", description=DESCRIPTION)
    _arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except Exception as e:  # noqa: BLE001 - parallm's errors name the culprit: one line
        if args.debug:
            raise
        print(f"parallm convert: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
