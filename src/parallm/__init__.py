"""parallm: Hugging Face decoder LLMs as Megatron-core tensor / pipeline / context / data / expert-parallel models.

Public API (a contract, see docs/api.md)::

    parallm.init_parallel(tp=1, pp=1, vpp=None, *, cp=1, ep=1, backend=None, seed=None, timeout_s=None)
    #   cp: context parallelism; every rank of a CP group passes the same batch, outputs as at cp = 1
    parallm.destroy_parallel()                       # waits for pending asynchronous checkpoint saves first
    chunks = parallm.build_model(hf_config, *, task="causal_lm", packed=False, sequence_parallel=False,
                                 dtype=torch.float32, vocab_multiple=1, attn_impl="auto", recompute=None,
                                 cp_attn="auto", num_layers_in_first_pipeline_stage=None,
                                 num_layers_in_last_pipeline_stage=None, layers_per_stage=None, mtp=None,
                                 revision=None, lora=None, init="empty", seed=0, aux_loss="per_layer")
    #   dtype: a torch dtype or "float32" / "bf16" / ...; init="random": random weights from seed (no load needed)
    #   cp_attn: "allgather" | "ring" | "auto"; layers_per_stage: one count per virtual stage, or "balanced"
    #   mtp: carry the multi-token-prediction layers (moved bit for bit, never run); None: if the checkpoint has any
    #   lora: a parallm.LoraConfig: LoRA adapters beside the targeted linears, the base frozen (docs/lora.md)
    #   hf_config / source: a directory, or a Hub id ("Qwen/Qwen2.5-0.5B", revision=) from the local HF cache only
    parallm.load_hf_weights(chunks, source, *, mode="auto", strict=True, progress=None, allow_pickle=False,
                            revision=None)
    info = parallm.inspect_checkpoint(path, *, tp=None, pp=None, vpp=None, dp=None, ep=None, task=None, split=None)
    #   what `parallm inspect` prints, as a dict: config, layer kinds, dtypes, valid tp / pp, memory per rank
    parallm.mark_loaded(chunks)                      # after filling every parameter yourself: forward and the
    #   saves refuse a model never loaded (load_hf_weights / load_checkpoint / init="random" mark it themselves)
    state = parallm.save_hf_weights(chunks, out_dir=None, *, dtype=None, overwrite=False,
                                    max_shard_size=5 * 1024 ** 3, progress=None, source=None, merged=False)
    #   a directory save also gets the source checkpoint's tokenizer / chat template / generation config
    for name, tensor in parallm.export_hf_tensors(chunks, *, dtype=None, bucket_bytes=64 * 1024 ** 2,
                                                  dst_ranks=None, copy=False, out=None, merged=False): ...
    #   out(bucket_index, numel) -> tensor: yielded tensors are views of the buffers it hands out, written in place
    #   merged=True (a model with LoRA adapters): W + B A * alpha / r under the base's names (export and save)
    meta = parallm.export_metadata(chunks, *, dtype=None)   # [TensorMeta(name, dtype, shape)], the stream's order
    out = parallm.forward(chunks, batch_or_input_ids, attention_mask=None, position_ids=None, *, output=None,
                          temperature=1.0, token_chunk=None, num_microbatches=None,
                          max_tokens_per_microbatch=None, routed_experts=None, return_routed_experts=False)
    #   output: None | "logprobs" | "logprobs+entropy"; return_routed_experts=True returns (out, routed_experts)
    loss = parallm.forward_backward(chunks, batch_or_input_ids, attention_mask=None, *, loss_fn,
                                    num_microbatches=1, position_ids=None, output=None, temperature=1.0,
                                    token_chunk=None, metric_reduce=None, max_tokens_per_microbatch=None,
                                    routed_experts=None)
    #   routed_experts: router replay, [B, S, moe layers, top_k] (or a batch entry) routes every MoE layer with
    #   those experts, weighted by the router's probabilities of them (docs/moe.md)
    #   batch: a mapping with input_ids, attention_mask, optional position_ids and any per-sample / per-token
    #   tensors, split with the microbatches and handed to loss_fn(out, mb); (input_ids, attention_mask) works too.
    #   loss_fn returns a scalar (mean over microbatches), (loss_sum, num_tokens) (token-mean), or either with a
    #   dict of scalar metrics, and forward_backward then returns (objective, metrics)
    #   the tp / cp / pp ranks of one replica must pass the same batch (checked): shard data by
    #   chunks[0].dims.dp_rank of chunks[0].dims.dp
    parallm.finalize_grads(chunks)
    norm = parallm.clip_grad_norm_(chunks, max_norm, norm_type=2.0)
    opt = parallm.build_optimizer(chunks, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  shard_over_dp=False, no_decay=default_no_decay, overlap_grad_reduce=False,
                                  bucket_bytes=None)    # a torch.optim.Optimizer: torch's LR schedulers work
    parallm.offload(chunks, optimizer=None, *, params=True, grads=True, optimizer_state=True)
    parallm.onload(chunks, optimizer=None, ...); with parallm.offloaded(chunks, optimizer): ...
    parallm.save_checkpoint(path, chunks, optimizer=None, *, step, extra=None, overwrite=False, async_save=False)
    info = parallm.load_checkpoint(path, chunks, optimizer=None)      # {"step": ..., "extra": ...}
    parallm.checkpoint_to_hf(path, out_dir, *, dtype=None, overwrite=False, max_shard_size=5 * 1024 ** 3)
    #   offline, no process group

    cfg = parallm.LoraConfig(r, alpha, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                             "up_proj", "down_proj"), *, dropout=0.0, rank_pattern={}, alpha_pattern={}, seed=0)
    #   PEFT's rules: target_modules names, a regex string or "all-linear"; rank / alpha patterns; dropout 0 only
    parallm.add_lora(chunks, cfg)                    # or build_model(..., lora=cfg); before build_optimizer
    with parallm.adapters_disabled(chunks): ...      # the base model inside (a reference policy, no second model)
    for peft_name, tensor in parallm.export_adapter_tensors(chunks, *, dtype=None): ...   # PEFT's names, whole
    parallm.save_hf_adapter(chunks, out_dir, *, dtype=None, overwrite=False)   # PeftModel.from_pretrained loads it
    cfg = parallm.load_hf_adapter(chunks, peft_dir)  # each rank its slices; a model without adapters gets them

    from parallm.integrations import vllm as pv      # optional; importing parallm never imports vLLM
    llm = pv.launch(model_dir, *, rank=0, **llm_kwargs)
    stats = pv.push_weights(chunks, llm, *, rank=0, dtype=None, bucket_bytes=None)
    conn = pv.connect(["http://host:port", llm, ...], *, backend="parallm_shm", sender=0, timeout=300.0,
                      master_address=None)       # backend: "parallm_shm" | "parallm_gloo"
    stats = pv.push_weights(chunks, conn)          # engines in other processes, through vLLM's weight transfer
    stats = pv.push_adapter(chunks, llm, *, rank=0, name="parallm", dtype=None, bucket_bytes=None)
    #   an engine serving LoRA gets the adapter alone (stats["lora_request"] for llm.generate on that rank);
    #   an engine without LoRA, or a connection, gets the merged weights (stats["mode"] == "merged")
    #   verl: VERL_USE_EXTERNAL_MODULES=parallm.integrations.verl registers parallm's engine (docs/verl.md)
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
    "offload": "train.offload", "onload": "train.offload", "offloaded": "train.offload",
    "LoraConfig": "model.layers.lora", "add_lora": "model.layers.lora", "adapters_disabled": "model.layers.lora",
    "export_adapter_tensors": "checkpoint.lora_io", "save_hf_adapter": "checkpoint.lora_io",
    "load_hf_adapter": "checkpoint.lora_io", "mark_loaded": "model.loaded",
    "inspect_checkpoint": "api.inspect",
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
