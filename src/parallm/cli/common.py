"""What the commands share: errors and exit codes, formatting, the check / launch options, and running a job of
layout checks on local ranks (:func:`parallm.verify.spawn`) or in place under torchrun. No torch import at module
level: ``--help`` stays fast."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time

from ..errors import USER_ERRORS
from ..verify import AUTO_UPDATE, LOGITS_ATOL, WEIGHTS_ATOL

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2   # docs/cli.md


class CLIError(Exception):
    """Reported as ``error: <message>`` (exit 1), without a traceback."""
    exit_code = EXIT_FAIL


class UsageError(CLIError):
    """A bad combination of options (exit 2)."""
    exit_code = EXIT_USAGE


def one_line(message) -> str:
    return " ".join(str(message).split())


def err(message) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)


# -- help ------------------------------------------------------------------------------------------------------


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
    g.add_argument("--atol", type=float, default=LOGITS_ATOL, metavar="X",
                   help=f"absolute tolerance for outputs and the loss, fp32 (default {LOGITS_ATOL:g}; large real "
                        "models may need more: summation order differs between tp layouts)")
    g.add_argument("--weights-atol", type=float, default=WEIGHTS_ATOL, metavar="X",
                   help=f"absolute tolerance for the weights after the step (default {WEIGHTS_ATOL:g})")
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


def under_torchrun() -> bool:
    """True when a launcher (torchrun, or anything that sets RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# -- what every rank runs --------------------------------------------------------------------------------------


def _test_fault(rank: int) -> None:
    """Test hook: PARALLM_CLI_FAULT=die:R / hang:R makes rank R exit abruptly / never finish (tests/test_cli.py
    checks that the command reports it and never waits forever)."""
    kind, _, target = os.environ.get("PARALLM_CLI_FAULT", "").partition(":")
    if target == str(rank) and kind == "die":
        os._exit(3)
    while target == str(rank) and kind == "hang":
        time.sleep(3600)


def rank_job(rank: int, world: int, job: dict) -> dict | None:
    """Every rank: the job's layout checks in one process group (only Megatron's groups change between layouts,
    so the start-up is paid once). Rank 0 returns ``{"rows": [...], "info": {...}}``, the others None.

    job: ``kind`` "demo" | "verify"; ``checks`` (verify); ``quick`` (demo); ``workdir`` (None: rank 0 makes a
    temporary one, removed at the end unless ``keep``); ``backend``; ``timeout``; ``progress``: a file rank 0
    appends progress lines to (None: stderr, unless ``quiet``); ``check``: :class:`Check` fields."""
    import dataclasses

    import torch.distributed as dist

    import parallm
    from ..parallel.errors import run_local
    from ..parallel.megatron_import import ignore_library_warnings
    from ..verify import check_layout
    ignore_library_warnings()
    parallm.init_parallel(tp=1, backend=job["backend"], timeout_s=job["timeout"])
    rank, world = dist.get_rank(), dist.get_world_size()
    _test_fault(rank)

    def progress(msg: str) -> None:
        if rank == 0 and job["progress"]:
            with open(job["progress"], "a") as f:
                f.write(msg + "\n")
        elif rank == 0 and not job["quiet"]:
            print(msg, file=sys.stderr, flush=True)

    workdir, temporary = job["workdir"], job["workdir"] is None
    if temporary:
        box = [run_local(lambda: tempfile.mkdtemp(prefix=f"parallm-{job['kind']}-") if rank == 0 else None,
                         what="making a work directory")]
        dist.broadcast_object_list(box, src=0)
        workdir = box[0]
    info = dict(world=world, backend=dist.get_backend(), workdir=workdir, temporary=temporary, skipped=[])
    rows = []
    try:
        if job["kind"] == "demo":
            from .demo import prepare
            checks, info["skipped"] = prepare(job, workdir, world, progress)
        else:
            checks = job["checks"]
            progress(f"{world} ranks up ({dist.get_backend()})")
        for c in checks:
            if not c.save_dir:
                slug = "-".join(f"{c.name(world // (c.tp * c.pp))} {c.label}".replace(",", "").split())
                c = dataclasses.replace(c, save_dir=os.path.join(workdir, "saved", slug))
            rows.append(check_layout(c, progress=progress))
    finally:
        if temporary and rank == 0 and not job.get("keep"):
            shutil.rmtree(workdir, ignore_errors=True)
    return dict(rows=rows, info=info) if rank == 0 else None


# -- running a job and reporting -------------------------------------------------------------------------------


def run_job(args, job: dict, *, world: int, title: str, header: str | None = None) -> int:
    """Standalone: start ``world`` local ranks; under torchrun: run in place. Prints the report (rank 0)."""
    job.update(timeout=args.timeout, quiet=args.quiet, progress=None)
    if under_torchrun():
        return _run_torchrun(args, job, title=title + " (torchrun)", header=header)
    from ..verify import SpawnError, spawn
    job["backend"] = _choose_backend(args.device, world)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=f"parallm-{job['kind']}-")
    job["progress"] = os.path.join(tmp, "progress.txt")
    if job["workdir"] is None:
        job["workdir"] = tmp
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    show = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    show(f"{title}: starting {world} local rank(s) ({job['backend']})")
    env = dict(HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false",
               PARALLM_PROGRESS="0", PARALLM_TIMEOUT_S=str(args.timeout))
    if job["backend"] == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""   # CPU ranks: keep the CUDA code paths out entirely
    result, error = dict(rows=[], info={}), None
    try:
        result = spawn(rank_job, world, job, timeout=args.timeout, backend=job["backend"], env=env, log_dir=logs,
                       on_poll=_tail(job["progress"], show))[0]
    except SpawnError as e:
        error = e.summary
        detail = e.culprit.traceback or e.culprit.log
        if detail and (args.debug or e.culprit.status == "dead"):
            print(detail, file=sys.stderr)
    finally:
        if args.debug or getattr(args, "keep", False):
            print(f"(kept {tmp}; the ranks' logs are in {logs})", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return report(args, result["rows"], error=error, info=result["info"], title=title, header=header,
                  elapsed=time.perf_counter() - t0)


def _tail(path: str, show):
    """A poll function: shows the lines rank 0 appended to ``path`` since the last call (a partial line waits)."""
    seen, t0 = [0], time.monotonic()

    def poll() -> None:
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().splitlines(keepends=True)
            lines = [ln.rstrip("\n") for ln in lines if ln.endswith("\n")]
            for line in lines[seen[0]:]:
                show(f"[{time.monotonic() - t0:5.1f}s] {line}")
            seen[0] = len(lines)
    return poll


def _choose_backend(device: str, ranks: int) -> str:
    """gloo (CPU) or nccl (one GPU per local rank)."""
    if device == "cpu":
        return "gloo"
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and n < ranks:
        raise UsageError(f"--device cuda needs one GPU per rank: {ranks} rank(s), {n} GPU(s) visible")
    return "nccl" if n >= ranks else "gloo"


def _run_torchrun(args, job: dict, *, title: str, header: str | None) -> int:
    """Every rank of torchrun's world runs the job in place; rank 0 prints; all ranks exit with rank 0's code."""
    import torch.distributed as dist
    rank, t0 = int(os.environ["RANK"]), time.perf_counter()
    job["backend"] = None if args.device == "auto" else ("nccl" if args.device == "cuda" else "gloo")
    result, error = dict(rows=[], info={}), None
    try:
        result = rank_job(rank, int(os.environ["WORLD_SIZE"]), job) or result
    except Exception as e:  # noqa: BLE001 - one line; the others learn it from agree() or from torchrun
        mine = type(e).__name__ in USER_ERRORS  # parallm's own errors: the same message on every rank
        error = one_line(e) if mine else f"{type(e).__name__}: {one_line(e)}"
        if rank != 0 and (args.debug or not mine):
            err(f"[rank {rank}] {error}")
        if args.debug:
            import traceback
            traceback.print_exc()
    code = EXIT_FAIL
    if error is None:
        box = [bool(result["rows"]) and all(r["ok"] for r in result["rows"])]
        dist.broadcast_object_list(box, src=0)
        code = EXIT_OK if box[0] else EXIT_FAIL
    if rank == 0:
        code = report(args, result["rows"], error=error, info=result["info"], title=title, header=header,
                      elapsed=time.perf_counter() - t0)
        if result["info"].get("temporary") and job.get("keep"):
            print(f"(kept {result['info']['workdir']})", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if error is not None:
        os._exit(code)  # peers may be gone: skip process-group teardown
    import parallm
    parallm.destroy_parallel()
    return code


def report(args, rows: list[dict], *, error: str | None, info: dict, title: str, header: str | None,
           elapsed: float) -> int:
    """The table and the verdict on stdout (an error as one ``error:`` line on stderr); ``--json``; exit code."""
    from importlib.metadata import version

    from ..verify import results_table
    print(title)
    if header:
        print(header)
    if info:
        where = "nccl on GPUs" if info.get("backend") == "nccl" else "gloo on CPU"
        print(f"{info.get('world', '?')} rank(s), {where}; reference: transformers {version('transformers')} in "
              "float32 (eager attention) on rank 0")
    if rows:
        lrs = sorted({f"{r['lr']:.3g}" for r in rows if r.get("lr")})
        print(f"\n{results_table(rows)}\n")
        print(f"tolerances: outputs and loss {args.atol:g}, weights after the step {args.weights_atol:g} "
              f"(absolute, fp32); SGD lr {', '.join(lrs)}"
              + (f" (auto: largest update {AUTO_UPDATE:g})" if args.lr is None else ""))
        for r in rows:
            for n in r.get("notes", []):
                print(f"note [{r['layout']}]: {n}")
    for s in info.get("skipped", []):
        print(f"skipped: {s}")
    ok = error is None and bool(rows) and all(r["ok"] for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, error=error, info=info, ok=ok), f, indent=2, default=str)
    if error:
        err(error)
        return EXIT_FAIL
    if not ok:
        print(f"FAIL: {sum(not r['ok'] for r in rows)} of {len(rows)} layout(s) differ from transformers "
              f"({elapsed:.0f} s)")
        return EXIT_FAIL
    print(f"OK: {len(rows)} layout(s) match transformers ({elapsed:.0f} s)")
    return EXIT_OK
