"""The ``parallm`` command line (docs/cli.md): one module per command, and what they share: :mod:`.errors`
(exit codes, one-line errors), :mod:`.options` (help formatting, the check / launch options), :mod:`.launch`
(local ranks or torchrun), :mod:`.rank_job` (what every rank runs), :mod:`.report` (the table and verdict).

    demo      tiny checkpoints of every family, four layouts (:mod:`.demo`)
    verify    one layout of your checkpoint (:mod:`.verify`)
    inspect   a checkpoint and its valid layouts, no processes (:mod:`.inspect`)
    convert   a training checkpoint -> a Hugging Face directory, no processes (:mod:`.convert`)

``demo`` and ``verify`` run :func:`parallm.verify.check_layout` on local ranks started by
:func:`parallm.verify.spawn`, or in place under torchrun. ``--help`` stays fast: torch, megatron-core and
transformers are imported when a command runs, or for ``verify`` / ``inspect --help``, whose list of supported
architectures comes from the family registry.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..errors import USER_ERRORS
from . import convert, demo, inspect, serve_tinker, verify
from .errors import EXIT_FAIL, EXIT_USAGE, CLIError, err
from .options import Formatter

DESCRIPTION = """\
Run Hugging Face decoder checkpoints as Megatron-core tensor / pipeline / data-parallel models, and check
that they compute exactly what transformers computes (`parallm verify --help` lists the architectures).

commands:
  demo      make tiny checkpoints of every family and check several parallel layouts end to end
  verify    the same checks on your checkpoint, for the layout you give (--tp, --pp, ...)
  inspect   what a checkpoint is and how it can be split (no processes started)
  convert   turn a training checkpoint (parallm.save_checkpoint) into a Hugging Face directory
  serve-tinker  serve the Tinker API (the tinker SDK's ServiceClient) on a model split over local ranks

Run `parallm COMMAND --help` for each command's options."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parallm", description=DESCRIPTION, formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"parallm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (demo, verify, inspect, convert, serve_tinker):
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args)
    except CLIError as e:
        if args.debug:
            import traceback
            traceback.print_exc()
        err(e)
        return e.exit_code
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - parallm's own errors name the culprit: one line
        if args.debug:
            raise
        err(e if type(e).__name__ in USER_ERRORS else f"{type(e).__name__}: {e}")
        print("(run with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
