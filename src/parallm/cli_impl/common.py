"""Errors, formatting and the results table shared by the commands (no torch import here)."""

from __future__ import annotations

import math
import re
import sys

# Exit codes (docs/cli.md).
EXIT_OK = 0
EXIT_FAIL = 1      # a check did not match, or an error (broken checkpoint, crashed / hung rank)
EXIT_USAGE = 2     # bad command line

# Tolerances (docs/cli.md explains them).
LOGITS_ATOL = 1e-4       # fp32 outputs (logits / values) and losses, absolute, at real (unpadded) positions
WEIGHTS_ATOL = 1e-5      # weights after one SGD step, absolute
AUTO_UPDATE = 1e-2       # --lr auto: the step moves the largest weight by this much


class CLIError(Exception):
    """An error the CLI reports as ``error: <message>`` (exit 1), without a traceback."""

    exit_code = EXIT_FAIL


class UsageError(CLIError):
    """A bad combination of options (exit 2)."""

    exit_code = EXIT_USAGE


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def err(message: str) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)


def fmt_num(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if x == 0:
        return "0"
    return f"{x:.{digits}e}"


def fmt_s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def fmt_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    if n >= 1e3:
        return f"{n / 1e3:.1f} K"
    return str(n)


def render_table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


RESULT_HEADERS = ["layout", "model", "load s", "max|Δ out|", "Δ loss", "max|Δ w| step", "max|Δ out| after",
                  "save s", "round trip", "reload", "ok"]


def result_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("error"):
            out.append([r["layout"], r["model"]] + ["-"] * 8 + ["ERROR"])
            continue
        out.append([
            r["layout"], r["model"], fmt_s(r.get("load_s")), fmt_num(r.get("d_out")), fmt_num(r.get("d_loss")),
            fmt_num(r.get("d_weights")), fmt_num(r.get("d_after")), fmt_s(r.get("save_s")),
            "exact" if r.get("roundtrip") else "DIFF", "exact" if r.get("reload") else "DIFF",
            "ok" if r.get("ok") else "FAIL",
        ])
    return out


def results_table(rows: list[dict]) -> str:
    return render_table(RESULT_HEADERS, result_rows(rows), right={2, 3, 4, 5, 6, 7})


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()
