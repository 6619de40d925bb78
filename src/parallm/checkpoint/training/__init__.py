"""Training checkpoints: the model and the optimizer state, written in parallel with
``torch.distributed.checkpoint`` (DCP), loadable at any other layout (docs/checkpoints.md).

What a checkpoint directory holds

    .metadata, __{rank}_{n}.distcp   DCP's files: every tensor keyed by its global identity (below), each rank
                                     writing its own slices of the global tensors
    parallm.json                     what the checkpoint is (:mod:`.record`): format, step, the HF config (for the
                                     HF export), the layout and dtype it was saved with, the optimizer's
                                     hyperparameters, the tensor list, the caller's ``extra`` as JSON, and a
                                     CRC-32 of every stored item and of .metadata

Keys (HF names, global shapes; vocabulary padding is never stored, replicated pieces are stored once)

    model/<hf name>              the parameters, in the model's dtype
    optim/master/<hf name>       fp32 master weights (bf16 / fp16 models only)
    optim/exp_avg/<hf name>      AdamW's moments (fp32 for bf16 / fp16 models)
    optim/exp_avg_sq/<hf name>
    optim/step/<hf name>         AdamW's step counter of the parameter holding that tensor
    extra/<i>                    the tensors in rank 0's ``extra``, in the order met (:mod:`.extra`)

A local parameter is a list of slices of these tensors (:func:`parallm.checkpoint.global_view.global_slices`,
from its placement and weight-table entry); optimizer state tensors have the parameter's shape, so they are
sliced the same way. Saving offers each rank's primary slices (DCP writes a slice offered by several
data-parallel replicas once); loading asks for every slice a rank holds (replicas included) and DCP reads the
overlapping parts of whatever slices the saving layout wrote. QKV / gate-up fusions and vocabulary padding
therefore round-trip exactly across tp, pp, vpp, dp and ``shard_over_dp``. A routed expert's tensors are their
own table entries under the Hub's per-expert names (``...experts.{e}...``), so under expert parallelism each
expert-parallel rank offers the slices of the experts it holds (its expert-data-parallel replicas offer the same
slices, written once), and a load at another ``ep`` asks for the experts it holds now.

The modules: :mod:`.save` (``save_checkpoint``), :mod:`.pending` (asynchronous saves), :mod:`.load`
(``load_checkpoint``), :mod:`.offline` (``read_tensors``, ``checkpoint_to_hf``: no process group), :mod:`.record`
(parallm.json and the checks against it), :mod:`.extra` (``extra`` as JSON + tensors), :mod:`.start` (what a
save and a load start from); the DCP planners, the verifying reader and DCP's exceptions are
:mod:`parallm.checkpoint.dcp_io`.
"""

from .load import load_checkpoint
from .offline import checkpoint_to_hf, read_tensors
from .pending import AsyncCheckpointSave, wait_for_pending_saves
from .save import save_checkpoint

__all__ = ["AsyncCheckpointSave", "checkpoint_to_hf", "load_checkpoint", "read_tensors", "save_checkpoint",
           "wait_for_pending_saves"]
