"""The ``parallm`` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parallm",
        description="Run Hugging Face LLaMA / Qwen2 models as Megatron-core tensor/pipeline/data-parallel models.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.version:
        from . import __version__
        print(__version__)
        return 0
    build_parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
