"""``parallm convert CHECKPOINT OUT``: a training checkpoint (``parallm.save_checkpoint``) -> a Hugging Face
directory, in this process, without starting ranks (:func:`parallm.checkpoint_to_hf`)."""

from __future__ import annotations

import os

from .errors import EXIT_OK, CLIError, UsageError
from .options import Formatter, add_revision, para, resolve_path

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert", formatter_class=Formatter,
        help="turn a training checkpoint into a Hugging Face directory (no processes started)",
        description=para("Write the model of training checkpoint CHECKPOINT (made by parallm.save_checkpoint, at "
                         "any layout) to OUT as a Hugging Face directory: safetensors files (with an index when "
                         "there are several) and config.json, which transformers' from_pretrained loads. Runs in "
                         "this process alone; every tensor read is checked against its CRC-32. A float32 export "
                         "of a bf16 / fp16 run writes the fp32 master weights. OUT appears complete or not at "
                         "all."),
        epilog="exit codes: 0 done; 1 the checkpoint cannot be converted (the message names the file or tensor); "
               "2 bad command line.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="training checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the written weights (default: the training dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--max-shard-size", help="largest safetensors file, e.g. 2GB or 500MB (default: the API's, "
                                            "5 GiB)")
    p.add_argument("--source", metavar="DIR|ID",
                   help="the Hugging Face checkpoint (directory, or Hub id in the local cache) the training started "
                        "from: its tokenizer, chat-template and generation files are copied into OUT, so that an "
                        "inference engine can serve OUT as it is (without it OUT holds the weights and config.json)")
    add_revision(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from ..checkpoint.training import checkpoint_to_hf
    from ..checkpoint.hf_dir import copy_serving_files
    source = None
    if args.source is not None:         # resolved before converting: a wrong source fails before any writing
        source = resolve_path(args.source, args.revision)
        if not os.path.isdir(source):
            raise CLIError(f"--source {args.source}: not a checkpoint directory")
    elif args.revision is not None:
        raise UsageError("--revision applies to --source")
    size = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}   # else checkpoint_to_hf's default
    checkpoint_to_hf(args.checkpoint, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None,
                     overwrite=args.overwrite, **size)
    copied = copy_serving_files(source, args.out) if source is not None else []
    print(f"wrote {args.out}" + (f" (+ {len(copied)} tokenizer / generation files from {source})" if copied else ""))
    return EXIT_OK
