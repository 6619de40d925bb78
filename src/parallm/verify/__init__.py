"""Verification against transformers: one harness for the tests, ``parallm demo`` / ``verify`` and the benchmarks.

Local ranks (:mod:`.launch`)::

    results = spawn(fn, world, *args, timeout=240)      # fn(rank, world, *args) on `world` gloo ranks
    outcomes = spawn_outcomes(fn, world, *args)         # one RankOutcome per rank, never raises

The transformers side (:mod:`.reference`, no torch.distributed)::

    tiny_config(family, **overrides), make_hf_model(config, task=..., seed=...), randomize_weights(model, seed)
    padded_batch(vocab, batch=..., seq=..., seed=...)   # rows: full, left-, right-, both-sides-padded
    hf_output(model, ids, mask, task=...), hf_state(model), load_transformers(path, task=...)
    causal_lm_loss, value_loss, loss_for(task), max_diff_real(a, b, mask), compare_states(got, want)
    reference(ckpt, task, ids=..., mask=..., ...)       # output, one SGD step, output and weights after it

One layout on every rank (:mod:`.check`)::

    row = check_layout(Check(ckpt, tp=2, pp=2, ...))    # load, compare, step, save, reload; rank 0's row
    results_table(rows)                                 # the rows as a table

Importing this package is cheap (no torch): the command line reads the tolerances below for its ``--help``.
"""

import importlib

LOGITS_ATOL = 1e-4    # fp32 outputs (logits / values) and losses, absolute, at real (unpadded) positions
WEIGHTS_ATOL = 1e-5   # weights after one SGD step, absolute
AUTO_UPDATE = 1e-2    # lr=None: the step moves the largest weight by this much (lr = AUTO_UPDATE / max|grad|)
# Default tolerances by the model's dtype, (outputs and loss, weights after the step). bf16 (measured on tiny
# models: outputs differ by 0.03 where fp32 differs by 1e-6; a broken gradient moves the output after the step
# by > 1): outputs 0.1; weights: what exceeds one bf16 rounding step of each weight (verify.reference.
# stepped_difference), 1e-3, a tenth of the automatic update.
VERIFY_DTYPES = ("float32", "bfloat16")   # float16 cannot train without loss scaling, which parallm does not do
TOLERANCES = {"float32": (LOGITS_ATOL, WEIGHTS_ATOL), "bfloat16": (1e-1, 1e-3)}

_LAZY = {
    "launch": ("spawn", "spawn_outcomes", "RankOutcome", "SpawnError"),
    "reference": ("tiny_config", "make_hf_model", "randomize_weights", "padded_batch", "hf_output", "hf_state",
                  "load_transformers", "quiet_transformers", "causal_lm_loss", "value_loss", "loss_for",
                  "max_diff_real", "compare_states", "reference", "reload_check", "stepped_difference"),
    "check": ("Check", "check_layout", "results_table", "render_table"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

__all__ = ["LOGITS_ATOL", "WEIGHTS_ATOL", "AUTO_UPDATE", "TOLERANCES", "VERIFY_DTYPES", *sorted(_WHERE)]


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
