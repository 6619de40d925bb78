"""The ``parallm`` command line: ``demo``, ``verify``, ``inspect`` (docs/cli.md).

This module only parses arguments and dispatches; the work lives in :mod:`parallm.cli_impl`. ``--help`` stays
fast: nothing heavy (torch, megatron-core, transformers) is imported until a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .cli_impl.common import (AUTO_UPDATE, EXIT_FAIL, EXIT_OK, EXIT_USAGE, LOGITS_ATOL, WEIGHTS_ATOL, CLIError,
                              UsageError, err, one_line)

DESCRIPTION = """\
Run Hugging Face LLaMA / Qwen2 checkpoints as Megatron-core tensor / pipeline / data-parallel models, and
check that they compute exactly what transformers computes.

commands:
  demo      make tiny LLaMA and Qwen2 checkpoints and check several parallel layouts end to end
  verify    the same checks on your checkpoint, for the layout you give (--tp, --pp, ...)
  inspect   what a checkpoint is and how it can be split (no processes started)

Run `parallm COMMAND --help` for each command's options."""

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


def _para(text: str) -> str:
    """Wrap a description (RawDescriptionHelpFormatter keeps our line breaks but does not wrap)."""
    import textwrap
    return "\n\n".join(textwrap.fill(" ".join(p.split()), width=100) for p in text.split("\n\n"))


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _lr(text: str):
    if text == "auto":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"the learning rate must be > 0, got {v}")
    return v


def _run_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("check options")
    g.add_argument("--batch-size", type=_positive, default=4, metavar="B",
                   help="rows in the test batch (rounded up to a multiple of dp x microbatches; default 4: "
                        "rows cycle through full, left-padded, right-padded, padded on both sides)")
    g.add_argument("--seq-len", type=_positive, default=16, metavar="S",
                   help="tokens per row, at least 8 (default 16)")
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


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="parallm", description=DESCRIPTION, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"parallm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run_opts = _run_options()

    demo = sub.add_parser(
        "demo", parents=[run_opts], formatter_class=fmt, help="check several layouts on tiny models",
        description=_para("Make tiny LLaMA (tied and untied) and Qwen2 (causal LM and value model) checkpoints with "
                    "transformers, start 4 local ranks (or use torchrun's), and for each layout: load, compare "
                    "with transformers, run one training step, save and reload with transformers. Layouts: "
                    "tp2 x dp2; tp2 x pp2 x vpp2 (tied, broadcast load); tp2 x dp2 packed + sequence parallel; "
                    "value model tp2 x pp2 packed + sequence parallel. Prints a table; exit 0 when all match."),
        epilog=LAUNCH_EPILOG)
    demo.add_argument("--quick", action="store_true",
                      help="run two layouts only (tp2 x dp2; value model tp2 x pp2 packed + SP): the fast test")
    demo.add_argument("--workdir", metavar="DIR",
                      help="write the checkpoints (DIR/checkpoints) and the saved models (DIR/saved) here and "
                           "keep them; default: a temporary directory, removed at the end")
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")

    verify = sub.add_parser(
        "verify", parents=[run_opts], formatter_class=fmt, help="check your checkpoint for one layout",
        description=_para("Load CHECKPOINT (a Hugging Face directory: config.json + safetensors) with parallm in the "
                    "layout you give, compare with transformers, run one SGD step, save and reload with "
                    "transformers. A broken checkpoint (missing tensor, wrong shape, a layout that does not "
                    "split) is reported in one line naming the problem. bf16 / fp16 checkpoints are loaded "
                    "into an fp32 model: the check is about the weight mapping. Memory: rank 0 also holds the "
                    "transformers model in fp32 with its gradients and a gathered copy of the weights (about 4x "
                    "the fp32 model size)."),
        epilog=LAUNCH_EPILOG)
    verify.add_argument("checkpoint", metavar="CHECKPOINT", help="Hugging Face checkpoint directory")
    verify.add_argument("--tp", type=_positive, default=1,
                        help="tensor-parallel ranks: each holds 1/tp of every layer's heads and MLP (default 1)")
    verify.add_argument("--pp", type=_positive, default=1,
                        help="pipeline stages: each holds a contiguous run of layers (default 1)")
    verify.add_argument("--vpp", type=_positive, default=None,
                        help="virtual stages per pipeline rank (Megatron's interleaving; needs --pp > 1 and "
                             "layers divisible by pp x vpp)")
    verify.add_argument("--dp", type=_positive, default=None,
                        help="data-parallel replicas: each gets its share of the batch, gradients are averaged. "
                             "Standalone: world = tp x pp x dp (default dp 1); under torchrun: default world / "
                             "(tp x pp), and a given --dp must match")
    verify.add_argument("--packed", action="store_true",
                        help="remove padding: run the real tokens as one stream (varlen attention)")
    verify.add_argument("--sequence-parallel", action="store_true",
                        help="split that stream over the tp ranks between the parallel linears (implies --packed)")
    verify.add_argument("--task", choices=("auto", "causal_lm", "value"), default="auto",
                        help="causal_lm: logits; value: a critic / reward model (score head, one value per "
                             "token, compared with transformers' *ForSequenceClassification score of every "
                             "token); auto (default): from the config's architectures")
    verify.add_argument("--mode", choices=("auto", "slice", "broadcast"), default="auto",
                        help="how weights are read: slice = every rank reads only its slices; broadcast = rank 0 "
                             "reads and sends each rank its shards; auto (default) = slice when every rank sees "
                             "the directory")
    verify.add_argument("--microbatches", type=_positive, default=None, metavar="N",
                        help="microbatches per step (default: 2 with pipeline parallelism, else 1)")
    verify.add_argument("--save-dir", metavar="DIR",
                        help="write the model after the step here (must be empty or absent) and keep it; "
                             "default: a temporary directory")
    verify.add_argument("--no-preflight", action="store_true",
                        help="skip the quick checkpoint check in the launching process (the ranks' loader checks "
                             "everything anyway: this shows the distributed error path)")

    insp = sub.add_parser(
        "inspect", formatter_class=fmt, help="describe a checkpoint and its valid layouts",
        description=_para("Describe CHECKPOINT from config.json and the safetensors headers (tensor bytes are not "
                    "read): architecture, sizes, parameter count, dtypes, files, whether every tensor the model "
                    "needs is there with the right shape, the valid tp values and (pp, vpp) pairs, and with "
                    "--tp / --pp / --vpp the parameter memory each rank holds. Starts no processes."),
        epilog="exit codes: 0 fine; 1 the checkpoint has a problem or cannot be read, or the layout does not "
               "split; 2 bad command line.")
    insp.add_argument("checkpoint", metavar="CHECKPOINT", help="Hugging Face checkpoint directory")
    insp.add_argument("--tp", type=_positive, help="estimate memory per rank for this tensor-parallel size")
    insp.add_argument("--pp", type=_positive, help="... and this many pipeline stages")
    insp.add_argument("--vpp", type=_positive, help="... and this many virtual stages per pipeline rank")
    insp.add_argument("--dp", type=_positive, help="... and this many data-parallel replicas (sets the world size)")
    insp.add_argument("--task", choices=("auto", "causal_lm", "value"), default="auto",
                      help="count a value head instead of the lm head (default: from the config)")
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("parallm")
    except Exception:  # noqa: BLE001
        return "unknown"


# -- commands -------------------------------------------------------------------------------------------------


def _progress(args):
    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)
    return progress


def _job_options(args) -> dict:
    if args.seq_len < 8:
        raise UsageError(f"--seq-len must be at least 8 (the batch has left and right padding), got {args.seq_len}")
    return dict(batch=args.batch_size, seq=args.seq_len, seed=args.seed, lr=args.lr, atol=args.atol,
                weights_atol=args.weights_atol, timeout=args.timeout)


def _task(value: str):
    return None if value == "auto" else value


def cmd_inspect(args) -> int:
    from .cli_impl.inspect_cmd import inspect_checkpoint, render
    if args.vpp and args.vpp > 1 and not (args.pp and args.pp > 1):
        raise UsageError(f"--vpp {args.vpp} needs --pp > 1 (virtual stages interleave a pipeline)")
    report = inspect_checkpoint(args.checkpoint, tp=args.tp, pp=args.pp, vpp=args.vpp, dp=args.dp,
                                task=_task(args.task))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
    return EXIT_FAIL if report["problem"] else EXIT_OK


def _verify_case(args) -> dict:
    if args.vpp and args.vpp > 1 and args.pp == 1:
        raise UsageError(f"--vpp {args.vpp} needs --pp > 1 (virtual stages interleave a pipeline)")
    packed = args.packed or args.sequence_parallel
    nmb = args.microbatches or (2 if args.pp > 1 else 1)
    return dict(model=os.path.basename(os.path.normpath(args.checkpoint)), ckpt=os.path.abspath(args.checkpoint),
                tp=args.tp, pp=args.pp, vpp=args.vpp if args.vpp and args.vpp > 1 else None, dp=args.dp,
                packed=packed, sp=args.sequence_parallel, task=_task(args.task), mode=args.mode, nmb=nmb,
                save_dir=os.path.abspath(args.save_dir) if args.save_dir else None)


def _check_save_dir(path):
    if path and os.path.isdir(path) and os.listdir(path):
        raise UsageError(f"--save-dir {path} is not empty (give a new or empty directory)")


def cmd_verify(args) -> int:
    job = dict(_job_options(args), kind="verify", cases=[_verify_case(args)])
    case = job["cases"][0]
    _check_save_dir(case["save_dir"])
    if under_torchrun_():
        return _run_torchrun(args, job)
    header = None
    if not args.no_preflight:
        from .cli_impl.preflight import preflight
        info = preflight(case["ckpt"], tp=case["tp"], pp=case["pp"], vpp=case["vpp"], task=case["task"])
        header = (f"{info['architecture']} ({'/'.join(info['dtypes'])}, loaded in float32), task {info['task']}")
    world = case["tp"] * case["pp"] * (case["dp"] or 1)
    return _run_standalone(args, job, world, title=f"parallm verify {case['ckpt']}", header=header)


def cmd_demo(args) -> int:
    job = dict(_job_options(args), kind="demo", quick=args.quick, keep=args.keep)
    if under_torchrun_():
        if args.workdir:
            job["workdir"] = os.path.abspath(args.workdir)
        return _run_torchrun(args, job)
    from .cli_impl.demo import DEMO_WORLD
    return _run_standalone(args, job, DEMO_WORLD, title="parallm demo" + (" --quick" if args.quick else ""))


def under_torchrun_() -> bool:
    from .cli_impl.launch import under_torchrun
    return under_torchrun()


def _transformers_version() -> str:
    try:
        from importlib.metadata import version
        return version("transformers")
    except Exception:  # noqa: BLE001
        return "?"


def _report(args, rows: list[dict], *, error: str | None, info: dict, title: str, header: str | None,
            elapsed: float) -> int:
    from .cli_impl.common import results_table
    from .cli_impl.launch import device_words
    print(title)
    if header:
        print(header)
    if info:
        print(f"{info.get('world', '?')} rank(s), {device_words(info.get('backend', 'gloo'))}; reference: "
              f"transformers {_transformers_version()} in float32 (eager attention) on rank 0")
    if rows:
        print()
        print(results_table(rows))
        print()
        lrs = sorted({f"{r['lr']:.3g}" for r in rows if r.get("lr")})
        print(f"tolerances: outputs and loss {args.atol:g}, weights after the step {args.weights_atol:g} "
              f"(absolute, fp32); SGD lr {', '.join(lrs)}"
              + (f" (auto: largest update {AUTO_UPDATE:g})" if args.lr is None else ""))
        for r in rows:
            for n in r.get("notes", []):
                print(f"note [{r['layout']}]: {n}")
    for s in info.get("skipped", []):
        print(f"skipped: {s}")
    if args.json:
        with open(args.json, "w") as f:
            ok = error is None and bool(rows) and all(r["ok"] for r in rows)
            json.dump(dict(rows=rows, error=error, info=info, ok=ok), f, indent=2, default=str)
    failed = [r for r in rows if not r.get("ok")]
    if error:
        err(error)
        return EXIT_FAIL
    if failed or not rows:
        print(f"FAIL: {len(failed)} of {len(rows)} layout(s) differ from transformers ({elapsed:.0f} s)")
        return EXIT_FAIL
    print(f"OK: {len(rows)} layout(s) match transformers ({elapsed:.0f} s)")
    return EXIT_OK


def _run_standalone(args, job, world: int, *, title: str, header: str | None = None) -> int:
    import shutil
    import tempfile

    from .cli_impl.launch import choose_backend, spawn
    t0 = time.perf_counter()
    job["backend"] = choose_backend(args.device, world)
    temporary = None
    if job.get("workdir") is None:
        if getattr(args, "workdir", None):
            job["workdir"] = os.path.abspath(args.workdir)
        else:
            temporary = job["workdir"] = tempfile.mkdtemp(prefix=f"parallm-{job['kind']}-")
    progress = _progress(args)
    progress(f"{title}: starting {world} local rank(s) ({job['backend']})")
    try:
        res = spawn(job, world, timeout=args.timeout, progress=progress, debug=args.debug)
    finally:
        if temporary and not getattr(args, "keep", False):
            shutil.rmtree(temporary, ignore_errors=True)
    if temporary and getattr(args, "keep", False):
        print(f"(kept {temporary})", file=sys.stderr)
    if res.error and res.detail and (args.debug or "died" in res.error):
        print(res.detail, file=sys.stderr)
    return _report(args, res.rows, error=res.error, info=res.info, title=title, header=header,
                   elapsed=time.perf_counter() - t0)


def _quiet_library_warnings() -> None:
    """Warnings megatron-core / torch.distributed print on every call and that say nothing about the check."""
    import warnings
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*deprecated.*")


def _run_torchrun(args, job) -> int:
    """Every rank of torchrun's world runs the job in place; rank 0 prints; all ranks exit with rank 0's code."""
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    if not args.debug:
        _quiet_library_warnings()
    progress = _progress(args) if rank == 0 else (lambda msg: None)
    case = job["cases"][0] if job["kind"] == "verify" else None
    header = None
    if case is not None and not args.no_preflight and rank == 0:
        # Rank 0 alone: its error ends the run (torchrun stops the others); the loader checks on every rank.
        from .cli_impl.preflight import preflight
        pre = preflight(case["ckpt"], tp=case["tp"], pp=case["pp"], vpp=case["vpp"], task=case["task"])
        header = f"{pre['architecture']} ({'/'.join(pre['dtypes'])}, loaded in float32), task {pre['task']}"
    if args.device != "auto":
        job["backend"] = "nccl" if args.device == "cuda" else "gloo"
    from .cli_impl.job import run_job
    rows: list = []
    info: dict = {}
    error = None
    try:
        info = run_job(job, rows, progress)
    except Exception as e:  # noqa: BLE001 - reported in one line; the others learn it from agree() or torchrun
        error = one_line(f"{e}") or type(e).__name__
        if rank != 0 and (args.debug or type(e).__name__ not in ("CheckpointError", "ValueError", "ParallelError",
                                                                   "FileNotFoundError")):
            err(f"[rank {rank}] {type(e).__name__}: {error}")
        if args.debug:
            import traceback
            traceback.print_exc()
    code = EXIT_FAIL
    if error is None:
        ok = [all(r["ok"] for r in rows) and bool(rows)] if rank == 0 else [None]
        dist.broadcast_object_list(ok, src=0)
        code = EXIT_OK if ok[0] else EXIT_FAIL
    if rank == 0:
        title = f"parallm {job['kind']}" + (f" {case['ckpt']}" if case else "")
        code = _report(args, rows, error=error, info=info, title=title + " (torchrun)", header=header,
                       elapsed=time.perf_counter() - t0)
        if info.get("temporary") and job.get("keep"):
            print(f"(kept {info['workdir']})", file=sys.stderr)
    if error is None:
        import parallm
        parallm.destroy_parallel()
    sys.stdout.flush()
    sys.stderr.flush()
    if error is not None:
        os._exit(code)  # peers may be gone: skip process-group teardown
    return code


COMMANDS = {"demo": cmd_demo, "verify": cmd_verify, "inspect": cmd_inspect}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except CLIError as e:
        if getattr(args, "debug", False):
            import traceback
            traceback.print_exc()
        err(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - parallm's own errors name the culprit; print them in one line
        if getattr(args, "debug", False):
            raise
        err(f"{e}" if type(e).__name__ in ("CheckpointError", "ValueError", "FileNotFoundError")
            else f"{type(e).__name__}: {e}")
        print("(run with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
