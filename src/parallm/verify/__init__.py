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

_LAZY = {
    "launch": ("spawn", "spawn_outcomes", "RankOutcome", "SpawnError"),
    "reference": ("tiny_config", "make_hf_model", "randomize_weights", "padded_batch", "hf_output", "hf_state",
                  "load_transformers", "quiet_transformers", "causal_lm_loss", "value_loss", "loss_for",
                  "max_diff_real", "compare_states", "reference", "reload_check"),
    "check": ("Check", "check_layout", "results_table", "render_table"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

__all__ = ["LOGITS_ATOL", "WEIGHTS_ATOL", "AUTO_UPDATE", *sorted(_WHERE)]


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
