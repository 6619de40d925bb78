"""The public entry points (docs/api.md), one concern per module:

    build.py      build_model: a rank's share of the model, the task, the dtype, the balanced pipeline split
    mtp.py        whether a model carries its multi-token-prediction layers
    batch.py      a call's batch (positional or a mapping), default positions, microbatches and token budgets
    checks.py     every call's checks, agreed over the ranks before any model collective (one batch per replica)
    replay.py     router replay's input and record
    forward.py    forward: the whole batch's output on every rank
    step.py       forward_backward: the schedule with the caller's loss on the last stage
    objective.py  forward_backward's objective and metrics over the replicas

``parallm.build_model`` etc. are these modules' functions (``parallm/__init__.py`` imports them on first use).
"""

from .batch import MIN_FORWARD_MICROBATCH_TOKENS, default_forward_microbatches, default_position_ids
from .build import balanced_layers_per_stage, build_model, model_dtype, resolve_task
from .forward import forward, gather_output
from .mtp import with_mtp
from .step import forward_backward

__all__ = ["MIN_FORWARD_MICROBATCH_TOKENS", "balanced_layers_per_stage", "build_model", "default_forward_microbatches",
           "default_position_ids", "forward", "forward_backward", "gather_output", "model_dtype", "resolve_task",
           "with_mtp"]
