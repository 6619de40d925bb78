"""The report of ``demo`` / ``verify``: the results table and the verdict on stdout, ``--json``, the exit code."""

from __future__ import annotations

import json

from ..verify import AUTO_UPDATE
from .errors import EXIT_FAIL, EXIT_OK, err


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
        dtypes = sorted({r.get("dtype", "float32") for r in rows}) or ["float32"]
        print(f"{info.get('world', '?')} rank(s), {where}; reference: transformers {version('transformers')} in "
              f"{'/'.join(dtypes)} (eager attention) on rank 0")
    if rows:
        lrs = sorted({f"{r['lr']:.3g}" for r in rows if r.get("lr")})
        print(f"\n{results_table(rows)}\n")
        tols = sorted({(r.get("atol"), r.get("weights_atol")) for r in rows if r.get("atol") is not None})
        tol = "; ".join(f"outputs and loss {a:g}, weights after the step {w:g}" for a, w in tols) or "-"
        print(f"tolerances: {tol} (absolute; bf16 weights: beyond one rounding step); SGD lr {', '.join(lrs)}"
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
