"""parallm: Hugging Face decoder LLMs as Megatron-core tensor / pipeline / context / data / expert-parallel models.

Public API (a contract, see docs/api.md)::

    parallm.init_parallel(tp=1, pp=1, vpp=None, *, cp=1, ep=1, backend=None, seed=None, timeout_s=None)
    #   cp: context parallelism; every rank of a CP group passes the same batch, outputs as at cp = 1
    parallm.destroy_parallel()                       # waits for pending asynchronous checkpoint saves first
    chunks = parallm.build_model(hf_config, *, task="causal_lm", packed=False, sequence_parallel=False,
                                 dtype=torch.float32, vocab_multiple=1, attn_impl="auto", recompute=None,
                                 cp_attn="auto")                # cp_attn: "allgather" | "ring" | "auto"
    parallm.load_hf_weights(chunks, source, *, mode="auto")
    state = parallm.save_hf_weights(chunks, out_dir=None, *, dtype=None)
    for name, tensor in parallm.export_hf_tensors(chunks, *, dtype=None, bucket_bytes=..., dst_ranks=None,
                                                  copy=False): ...
    meta = parallm.export_metadata(chunks, *, dtype=None)   # [TensorMeta(name, dtype, shape)], the stream's order
    out = parallm.forward(chunks, input_ids, attention_mask=None, position_ids=None, *, output=None,
                          temperature=1.0, token_chunk=None)   # output: None | "logprobs" | "logprobs+entropy"
    loss = parallm.forward_backward(chunks, input_ids, attention_mask=None, *, loss_fn, num_microbatches=1,
                                    position_ids=None, output=None, temperature=1.0, token_chunk=None)
    #   loss_fn returns a scalar (mean over microbatches) or (loss_sum, num_tokens) (token-mean)
    parallm.finalize_grads(chunks)
    norm = parallm.clip_grad_norm_(chunks, max_norm, norm_type=2.0)
    opt = parallm.build_optimizer(chunks, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  shard_over_dp=False, no_decay=default_no_decay)
    parallm.save_checkpoint(path, chunks, optimizer=None, *, step, extra=None, overwrite=False, async_save=False)
    info = parallm.load_checkpoint(path, chunks, optimizer=None)      # {"step": ..., "extra": ...}
    parallm.checkpoint_to_hf(path, out_dir, *, dtype=None, overwrite=False)   # offline, no process group

    from parallm.integrations import vllm as pv      # optional; importing parallm never imports vLLM
    llm = pv.launch(model_dir, *, rank=0, **llm_kwargs); stats = pv.push_weights(chunks, llm, *, rank=0)
"""

import importlib

from .errors import CheckpointError, ParallelError

__version__ = "0.1.0"

# Imported on first use, so `import parallm` (and `parallm --help`) does not pay for torch / megatron-core.
_LAZY = {
    "build_model": "api", "default_position_ids": "api", "forward": "api", "forward_backward": "api",
    "load_hf_weights": "checkpoint.loader", "save_hf_weights": "checkpoint.saver",
    "export_hf_tensors": "checkpoint.export", "export_metadata": "checkpoint.export",
    "TensorMeta": "checkpoint.export_plan", "finalize_grads": "train.grads",
    "clip_grad_norm_": "train.grads", "TokenStats": "model.logprobs",
    "init_parallel": "parallel.state", "destroy_parallel": "parallel.state",
    "build_optimizer": "train.optim", "save_checkpoint": "checkpoint.training",
    "load_checkpoint": "checkpoint.training", "checkpoint_to_hf": "checkpoint.training",
}

__all__ = ["CheckpointError", "ParallelError", *sorted(_LAZY)]


def __getattr__(name):
    if name in _LAZY:
        importlib.import_module(f"{__name__}.families")  # registers the model families
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
