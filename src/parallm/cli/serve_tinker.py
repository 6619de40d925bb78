"""``parallm serve-tinker --model M --tp 2 --port 8000``: the Tinker-API server (docs/tinker.md). The options and
the ranks live in :mod:`parallm.integrations.tinker.launcher`; this module only registers the command (the
launcher is imported when the command runs or asks for help: ``parallm --help`` stays fast)."""

from __future__ import annotations

from .options import Formatter, para


def add_parser(sub) -> None:
    from ..integrations.tinker.launcher import add_arguments
    p = sub.add_parser(
        "serve-tinker", formatter_class=Formatter,
        help="serve the Tinker API (the tinker SDK's ServiceClient) on a model split over local ranks",
        description=para("Serve a Hugging Face decoder as a Tinker-API server: the tinker SDK (0.38.x, "
                         "pip install 'parallm[tinker]') reaches it with ServiceClient(base_url=\"http://HOST:PORT\") "
                         "and any API key (or --api-key's), and trains LoRA clients on the model split over the "
                         "tp * pp * cp * dp local ranks started here (under torchrun: this rank). "
                         "Sampling: a vLLM engine (vllm serve) when vLLM is installed, else the trainer's own "
                         "forwards. See docs/tinker.md."),
        epilog="exit codes: 0 stopped (SIGINT / SIGTERM); 1 the parallel model was lost or failed to start.")
    add_arguments(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=_run)


def _run(args) -> int:
    from ..integrations.tinker.launcher import run
    return run(args)
