"""Command-line options: the help formatter, value types, and the check / launch options ``demo`` and
``verify`` share. No torch import at module level: ``--help`` stays fast."""

from __future__ import annotations

import argparse
import os
import textwrap

from ..verify import AUTO_UPDATE, LOGITS_ATOL, TOLERANCES, WEIGHTS_ATOL
from .errors import CLIError, UsageError


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps our line breaks; fills in the supported architectures from parallm's family registry (imported only
    when that help is shown: it brings torch)."""

    def _format_text(self, text):
        if "{architectures}" in text:
            import parallm.families  # noqa: F401 - registers the families
            from ..families.registry import supported_architectures
            text = text.replace("{architectures}", textwrap.fill(", ".join(supported_architectures()), width=100))
        return super()._format_text(text)


def para(text: str) -> str:
    """Wrap a description (RawDescriptionHelpFormatter keeps line breaks but does not wrap)."""
    return "\n\n".join(textwrap.fill(" ".join(p.split()), width=100) for p in text.split("\n\n"))


def resolve_path(text: str, revision: str | None = None) -> str:
    """A checkpoint directory, or a Hub id read from the local Hugging Face cache (never downloaded), as the
    directory to read; what cannot be resolved is a CLIError naming the cache searched."""
    from ..checkpoint.hf_dir import resolve_checkpoint
    from ..errors import CheckpointError
    try:
        return os.fspath(resolve_checkpoint(text, revision=revision))
    except (CheckpointError, ValueError) as e:
        raise CLIError(str(e)) from None


def add_revision(p) -> None:
    p.add_argument("--revision", metavar="REV",
                   help="for a Hub id: the branch, tag or commit of the cached snapshot (default: main)")


def positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _lr(text: str) -> float | None:
    """A positive number, or "auto" (None)."""
    try:
        v = None if text == "auto" else float(text)
    except ValueError:
        v = float("nan")
    if v is not None and not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'auto', got {text!r}")
    return v


LAUNCH_EPILOG = """\
launching:
  Standalone (no torchrun), parallm starts the ranks itself: tp x pp x dp local processes (demo: 4),
  one thread each, gloo on CPU, or nccl when there is one GPU per rank (--device).
  Under torchrun (RANK / WORLD_SIZE set), every process runs the check in place on torchrun's world:
      torchrun --nproc-per-node 4 -m parallm verify CKPT --tp 2 --pp 2
  (`python -m parallm` and the `parallm` script are the same program). Multi-node: the checkpoint needs to
  be visible on global rank 0 only (the others receive their shards from it).

what is checked (transformers runs on rank 0, fp32, eager attention, the same position_ids):
  max|Δ out|        logits (or values) of parallm.forward vs transformers at real (unpadded) positions
                    of a batch with full, left-padded and right-padded rows             (<= --atol)
  Δ loss            the training loss of one step                                         (<= --atol)
  max|Δ w| step     every weight after one SGD step (forward_backward + finalize_grads) (<= --weights-atol)
  max|Δ out| after  the output after that step                                            (<= --atol)
  round trip        save_hf_weights right after loading == what transformers loads      (bit-exact)
  reload            transformers' from_pretrained of the directory parallm saved        (bit-exact)
  load s / save s   wall time of build_model + load_hf_weights / of save_hf_weights(dir)

exit codes: 0 every check passed; 1 a check failed, or an error (broken checkpoint, a rank crashed or hung);
2 bad command line."""


def _split_list(text: str):
    if text == "balanced":
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts or 'balanced', got {text!r}") from None


def add_split_options(p) -> None:
    """build_model's pipeline-split keywords as options (``inspect``, ``verify``)."""
    p.add_argument("--num-layers-in-first-pipeline-stage", type=positive, metavar="N",
                   help="an uneven pipeline split (Megatron's name): N layers on the first pipeline rank")
    p.add_argument("--num-layers-in-last-pipeline-stage", type=positive, metavar="N",
                   help="... N layers on the last pipeline rank (the ranks between share the rest equally)")
    p.add_argument("--layers-per-stage", metavar="N,N,...", type=_split_list,
                   help="an explicit split: one count per virtual stage, in the order vpp_rank * pp + pp_rank; or "
                        "'balanced': build_model's split that evens out the stages' work, the head included")


def split_kwargs(args) -> dict:
    """The pipeline-split options given, as build_model's keywords."""
    return {k: v for k, v in (("num_layers_in_first_pipeline_stage", args.num_layers_in_first_pipeline_stage),
                              ("num_layers_in_last_pipeline_stage", args.num_layers_in_last_pipeline_stage),
                              ("layers_per_stage", args.layers_per_stage)) if v is not None}


def check_options() -> argparse.ArgumentParser:
    """The options ``demo`` and ``verify`` share (a parent parser)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("check options")
    g.add_argument("--batch-size", type=positive, default=4, metavar="B",
                   help="rows in the test batch (rounded up to a multiple of dp x microbatches; default 4: "
                        "rows cycle through full, left-padded, right-padded, padded on both sides)")
    g.add_argument("--seq-len", type=positive, default=16, metavar="S", help="tokens per row, at least 8 (default 16)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    g.add_argument("--lr", type=_lr, default=None, metavar="LR|auto",
                   help=f"learning rate of the SGD step. auto (default): chosen so the largest weight moves by "
                        f"{AUTO_UPDATE:g}, which makes the weight comparison meaningful at any model scale")
    g.add_argument("--atol", type=float, default=None, metavar="X",
                   help=f"absolute tolerance for outputs and the loss (default {LOGITS_ATOL:g} in float32, "
                        f"{TOLERANCES['bfloat16'][0]:g} in bfloat16; large real models may need more: summation "
                        "order differs between layouts)")
    g.add_argument("--weights-atol", type=float, default=None, metavar="X",
                   help=f"absolute tolerance for the weights after the step (default {WEIGHTS_ATOL:g} in float32; "
                        f"bfloat16: {TOLERANCES['bfloat16'][1]:g} beyond one bf16 rounding step of each weight)")
    g = p.add_argument_group("launch options")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="standalone only: cpu = gloo ranks with GPUs hidden; cuda = nccl, one GPU per rank; "
                        "auto (default) = cuda when there is a GPU for every rank, else cpu")
    g.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up after this long: every rank is stopped and the command fails instead of "
                        "hanging; also bounds each collective (default 600)")
    g.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    g.add_argument("--quiet", action="store_true", help="no progress lines (the table and errors only)")
    g.add_argument("--debug", action="store_true",
                   help="show tracebacks, and keep the ranks' logs (their directory is printed)")
    return p


def check_kwargs(args) -> dict:
    """The :class:`parallm.verify.Check` fields the check options set."""
    if args.seq_len < 8:
        raise UsageError(f"--seq-len must be at least 8 (the batch has left and right padding), got {args.seq_len}")
    return dict(batch=args.batch_size, seq=args.seq_len, seed=args.seed, lr=args.lr, atol=args.atol,
                weights_atol=args.weights_atol, timeout_s=args.timeout)
