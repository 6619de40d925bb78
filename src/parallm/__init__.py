"""parallm: Hugging Face decoder LLMs as Megatron-core tensor / pipeline / data-parallel models.

Public API (a contract, see docs/api.md)::

    parallm.init_parallel(tp=1, pp=1, vpp=None, *, backend=None, seed=0)
    parallm.destroy_parallel()
    chunks = parallm.build_model(hf_config, *, task="causal_lm", packed=False, sequence_parallel=False,
                                 dtype=torch.float32)
    parallm.load_hf_weights(chunks, source, *, mode="auto")
    state = parallm.save_hf_weights(chunks, out_dir=None, *, dtype=None)
    for name, tensor in parallm.export_hf_tensors(chunks, *, dtype=None): ...
    out = parallm.forward(chunks, input_ids, attention_mask=None, position_ids=None)
    loss = parallm.forward_backward(chunks, input_ids, attention_mask=None, *, loss_fn, num_microbatches=1)
    parallm.finalize_grads(chunks)
"""

from . import families as _families  # noqa: F401  (registers the model families)
from .api import build_model, default_position_ids, forward, forward_backward
from .checkpoint.loader import load_hf_weights
from .checkpoint.saver import export_hf_tensors, save_hf_weights
from .errors import CheckpointError, ParallelError
from .parallel.grads import finalize_grads
from .parallel.state import destroy_parallel, init_parallel

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ParallelError", "build_model", "default_position_ids", "destroy_parallel",
    "export_hf_tensors",
    "finalize_grads", "forward", "forward_backward", "init_parallel", "load_hf_weights", "save_hf_weights",
]
