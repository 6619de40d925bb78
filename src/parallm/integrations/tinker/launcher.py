"""``parallm serve-tinker`` / ``python -m parallm.integrations.tinker``: the options, and starting the ranks.

Standalone, the command starts ``tp * pp * cp * dp`` local processes (one per rank: gloo on CPU, NCCL with
GPUs) and watches them: when rank 0 (the HTTP server) ends, the others are ended; when another rank dies, rank 0
keeps serving what it can (it fails training requests with the lost rank named, :mod:`.dispatch`) until it is
stopped. SIGINT / SIGTERM stop every rank. Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) each process is
one rank and runs in place.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from .preflight import preflight
from .protocol import DEFAULT_MAX_BODY

__all__ = ["add_arguments", "die_with_parent", "main", "run"]

DESCRIPTION = """\
Serve a Hugging Face decoder as a Tinker-API server: the `tinker` SDK (0.38.x) reaches it with
ServiceClient(base_url="http://HOST:PORT") and any API key (or the one given by --api-key), and trains LoRA
clients on the model split over the ranks started here (docs/tinker.md)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a checkpoint directory or a Hub id in the local HF cache")
    p.add_argument("--model-name", default=None, help="the base model name clients use (default: --model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides dp * cp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the ranks span (one launch per node, each starting world / nnodes local ranks)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (node 0 holds rank 0: HTTP)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="node 0's address every rank reaches (with --nnodes > 1: not 127.0.0.1 across machines)")
    p.add_argument("--master-port", type=int, default=None,
                   help="the rendezvous port on node 0 (required with --nnodes > 1; default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed)")
    p.add_argument("--api-key", default=None,
                   help="the only API key accepted (default: env PARALLM_TINKER_API_KEY, else any key; the "
                        "environment keeps it out of `ps`: the ranks get it from there either way)")
    p.add_argument("--lora-rank", type=int, default=32,
                   help="the rank R of the adapters the model holds: a client asks for any rank 1..R")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (a rank-r client: scaling alpha / r)")
    p.add_argument("--lora-unembed", choices=("train", "skip", "refuse"), default="train",
                   help="the output head's adapter: train (the SDK's default train_unembed=True clients train it; "
                        "False ones keep it zero), skip (no head adapter: train_unembed=True clients train the "
                        "others, said so), refuse (train_unembed=True refused)")
    p.add_argument("--sampler", choices=("auto", "vllm", "parallm", "none"), default="auto",
                   help="vllm: a `vllm serve` engine; parallm: the trainer's forwards; auto: vllm if installed")
    p.add_argument("--engines", type=int, default=1,
                   help="vllm sampler: how many `vllm serve` engines, behind one router (requests spread by load, "
                        "a sampling session kept on one engine, a dead engine out of rotation)")
    p.add_argument("--full-engine", action="store_true",
                   help="vllm sampler: one more engine for a full-fine-tuning client's ephemeral snapshots, its "
                        "weights pushed by parallm (push_weights; vLLM's development routes on, 127.0.0.1 only)")
    p.add_argument("--engine-tp", type=int, default=1, help="vllm sampler: tensor-parallel workers of each engine")
    p.add_argument("--engine-url", action="append", default=None, metavar="URL",
                   help="a `vllm serve` engine started elsewhere (repeat for several; instead of --engines): LoRA "
                        "on at runtime, the same checkpoint; its API key in PARALLM_ENGINE_API_KEY; needs "
                        "--snapshot-dir (docs/tinker.md)")
    p.add_argument("--snapshot-dir", default=None,
                   help="with --engine-url: where sampler snapshots are written for the engines to load, a "
                        "directory they read at the same path (a shared filesystem; /dev/shm on this machine)")
    p.add_argument("--sampler-timeout", type=float, default=600.0, help="seconds the vLLM engine may take to start")
    p.add_argument("--max-context", type=int, default=None, help="cap on tokens per sequence (default: the model's)")
    p.add_argument("--cobatch", type=int, default=8,
                   help="most forward_backward requests of different LoRA clients run as one pass (1: one by one; "
                        "results are the same bit for bit)")
    p.add_argument("--microbatch-rows", type=int, default=None, help="most datums per microbatch")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where checkpoints go (every rank must see it; default: ./tinker-checkpoints)")
    p.add_argument("--session-timeout", type=float, default=600.0, help="seconds without a heartbeat")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait")
    p.add_argument("--ready-file", default=None,
                   help="written (JSON: url, pid, sampler_ready) once the server listens, again once the sampler "
                        "is ready")
    p.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY >> 20,
                   help="largest request body accepted, MiB (larger: 413, never read)")
    p.add_argument("--max-sample-tokens", type=int, default=1 << 20,
                   help="cap on num_samples x max_tokens of one sampling request")
    p.add_argument("--stability-ttl", type=float, default=86400.0,
                   help="seconds a record_stability_info sample stays recorded after its last use (default a day)")
    p.add_argument("--stability-max-tokens", type=int, default=1 << 28,
                   help="most tokens recorded for record_stability_info samples (int32 each); past it such "
                        "sampling requests are refused")
    p.add_argument("--keep-sampler-snapshots", type=int, default=8,
                   help="sampler snapshots kept per training client, newest first (0: keep all); older ones are "
                        "deleted with their engine-side adapters")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn``: the child gets ``sig`` when the process that started it dies, even by ``kill -9``
    (Linux's parent-death signal), so no rank or engine outlives the launcher and keeps the port. Elsewhere a
    no-op."""
    parent = os.getpid()

    def set_signal():
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(sig), 0, 0, 0)            # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:                      # the parent died before the signal was armed
            os.kill(os.getpid(), sig)
    return set_signal if sys.platform.startswith("linux") else None


def _spawn(args, argv) -> int:
    """This node's ranks: ``world / nnodes`` of them, global ranks from ``node_rank * local`` (node 0 holds rank
    0, the HTTP front end). Node 0's launcher lives as long as rank 0; another node's as long as any of its
    ranks (they stop when rank 0 says so or goes silent)."""
    world = args.tp * args.pp * args.cp * args.dp
    local = world // args.nnodes
    first = args.node_rank * local
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR=args.master_addr,
               MASTER_PORT=str(args.master_port or _free_port()), LOCAL_WORLD_SIZE=str(local),
               PARALLM_TIMEOUT_S=str(args.timeout), PARALLM_TINKER_CHECKED="1")
    if args.api_key:
        env["PARALLM_TINKER_API_KEY"] = args.api_key          # the environment, not the ranks' command lines
    procs = []
    for i in range(local):
        procs.append(subprocess.Popen([sys.executable, "-m", "parallm.integrations.tinker", *argv],
                                      env=dict(env, RANK=str(first + i), LOCAL_RANK=str(i)),
                                      preexec_fn=die_with_parent()))
    leader = args.node_rank == 0

    def stop(*_):              # rank 0 tells the others to stop; they are ended after it anyway
        for p in procs[:1] if leader else procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while (procs[0].poll() is None) if leader else any(p.poll() is None for p in procs):
        time.sleep(0.5)
    code = procs[0].returncode
    deadline = time.monotonic() + 30
    for p in procs[1:]:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs[1:]:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    return code


def _argv_of(args) -> list[str]:
    """The options of ``args`` as command-line arguments (what each rank process is started with)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction):            # a flag: present or not
            out += [action.option_strings[0]] if value else []
        elif isinstance(action, argparse._AppendAction):              # repeated: once per value
            out += [x for v in value or () for x in (action.option_strings[0], str(v))]
        elif action.option_strings and value is not None and action.dest not in ("help", "api_key"):
            out += [action.option_strings[0], str(value)]
    return out


def check_sdk() -> None:
    """The server decodes the SDK's own request types and protobuf messages: the ``tinker`` package of the line
    it speaks must be importable (``pip install 'parallm[tinker]'``)."""
    from .protocol import SDK_LINE
    try:
        import tinker
    except ImportError as e:
        raise SystemExit(f"parallm serve-tinker needs the tinker SDK {SDK_LINE}x: pip install 'parallm[tinker]' "
                         f"({e})") from None
    if not tinker.__version__.startswith(SDK_LINE):
        raise SystemExit(f"parallm serve-tinker speaks the protocol of tinker {SDK_LINE}x; tinker "
                         f"{tinker.__version__} is installed: pip install 'parallm[tinker]'")


def run(args) -> int:
    """Start the server (standalone: local ranks; under torchrun: this rank)."""
    check_sdk()
    if args.checkpoint_dir is None:
        args.checkpoint_dir = os.path.abspath("tinker-checkpoints")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if os.environ["RANK"] == "0" and os.environ.get("PARALLM_TINKER_CHECKED") != "1":
            preflight(args)         # under torchrun: rank 0 checks (the launcher below already did)
        import logging
        logging.basicConfig(level=logging.WARNING, format="[tinker %(process)d] %(levelname)s %(message)s")
        os.environ.setdefault("PARALLM_PROGRESS", "0")
        from .server import run_rank
        return run_rank(args)
    preflight(args)
    return _spawn(args, _argv_of(args))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallm.integrations.tinker", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
