"""Building a rank's share of the model: :func:`build_model` and what it decides from the config (task, dtype,
the balanced pipeline split)."""

from __future__ import annotations

import logging

import torch

from ..families import load_config, spec_from_config
from ..model.decoder import RECOMPUTE, DecoderChunk, build_chunks
from ..model.kernels import agree_on_kernels
from ..model.params import attach_main_grad_hooks
from ..model.spec import TASKS
from ..parallel.state import current_dims, kv_replica_group, require_initialized
from .mtp import agree_on_mtp, with_mtp


logger = logging.getLogger("parallm")


def build_model(hf_config, *, task: str | None = "causal_lm", packed: bool = False,
                sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                vocab_multiple: int = 1, attn_impl: str = "auto", recompute: str | None = None,
                cp_attn: str = "auto", num_layers_in_first_pipeline_stage: int | None = None,
                num_layers_in_last_pipeline_stage: int | None = None,
                layers_per_stage=None, mtp: bool | None = None,
                revision: str | None = None, lora=None, init: str = "empty", seed: int = 0,
                aux_loss: str = "per_layer") -> list[DecoderChunk]:
    """Build this rank's share of the model: one chunk per virtual pipeline stage (``len == vpp`` or 1).

    ``hf_config``: a transformers ``PretrainedConfig``, a checkpoint directory, or a config.json path, or a Hub id
    (``Qwen/Qwen2.5-0.5B``) read from the local Hugging Face cache at ``revision`` (default ``main``), never
    downloaded (:func:`parallm.checkpoint.hf_dir.resolve_checkpoint`: a local directory of the same spelling
    wins; an id the cache lacks is a CheckpointError naming the cache searched). A directory (or id) becomes the
    chunks' ``hf_source``: :func:`parallm.save_hf_weights` copies its tokenizer and generation files.
    ``task``: ``"causal_lm"`` (logits), ``"value"`` (a ``score`` head ``[1, H]`` giving values ``[B, S]``),
    ``"hidden"`` (headless: final-normed hidden states ``[B, S, H]``, what verl's ``*Model`` classes return), or
    None to follow the config (``*ForSequenceClassification`` -> value). ``packed``: remove padding and run
    the real tokens as one stream (varlen attention). A recurrent hybrid (Gated DeltaNet, Mamba-2) built
    padded does that inside for every batch whose rows are padded only at their ends (outputs as the padded
    layout gives them, zeros at padding; ``chunk.attn_impl`` names both attention kernels): docs/families.md.
    ``sequence_parallel``: split that stream over the TP ranks between the parallel linears (needs
    ``packed=True``).
    ``init="empty"`` (default): the parameters are allocated, not initialised, and the chunks are marked not
    loaded: fill them with :func:`parallm.load_hf_weights` (or :func:`parallm.load_checkpoint`); ``forward``,
    ``forward_backward`` and the saves refuse them until then (:mod:`parallm.model.loaded`; after filling
    every parameter yourself, :func:`parallm.mark_loaded`). ``init="random"``: randomly initialised weights as
    transformers initialises them, from ``seed``, the same model at every layout
    (:mod:`parallm.checkpoint.random_init`). ``dtype``: a torch dtype or its name (``"float32"`` / ``"fp32"``,
    ``"bfloat16"`` / ``"bf16"``, ``"float16"`` / ``"fp16"``, as verl configs spell it).
    The vocabulary is padded to a multiple of ``vocab_multiple * tp`` (zero rows, never visible in outputs).
    ``attn_impl``: the attention kernel (``"auto"``, ``"sdpa"``, ``"sdpa-loop"``, ``"flash-attn"``; see
    :mod:`parallm.model.layers.attention`); the choice is logged and kept as ``chunk.attn_impl``.
    ``cp_attn``: under context parallelism (``init_parallel(cp=...)``), how attention reaches the other ranks'
    keys: ``"allgather"`` (all-gathered once per layer), ``"ring"`` (passed around the CP group, merged by
    log-sum-exp), or ``"auto"`` (docs/context-parallel.md says which and why); kept as ``chunk.cp_attn``.
    ``recompute="full"``: keep only each decoder layer's input in the forward and recompute its activations in
    the backward (``torch.utils.checkpoint``, non-reentrant, RNG state restored). ``recompute="moe"``: the
    mixture-of-experts blocks' routed experts (chunk by chunk in the backward), shared experts and DeepSeek-V4's
    hyper-connection mixes recompute their products, the rest keeps its activations; ``"selective"``: that and
    each attention block (:mod:`parallm.model.recompute`; ``"moe"`` on a model without experts or
    hyper-connections is a ValueError).
    Pipeline split (``pp > 1``; default: ``L / (pp * vpp)`` layers per virtual stage): Megatron's
    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (that many layers on the
    first / last pipeline rank, the rest shared equally by the ranks between; with vpp, each rank's layers
    split equally over its virtual stages), or ``layers_per_stage``, one count per virtual stage in the order
    ``vpp_rank * pp + pp_rank``, or ``layers_per_stage="balanced"``: the counts that make the dearest virtual
    stage cheapest when the last one also pays for the head (:func:`balanced_layers_per_stage`; with a large
    vocabulary the last stage gets fewer layers). An impossible split is a ValueError naming the numbers (and
    suggesting one). Every rank passes the same split; it is kept in ``chunk.dims.layer_split``.
    ``mtp``: carry the config's multi-token-prediction layers (DeepSeek-V3 / GLM-4.5 ``num_nextn_predict_layers``,
    HF ``model.layers.{L + j}.*``): the last pipeline stage holds them, sharded like a decoder layer, and
    ``load_hf_weights`` / ``save_hf_weights`` / ``export_hf_tensors`` / training checkpoints move them bit for
    bit; they are never run nor trained (``requires_grad=False``). None (default): carried when ``hf_config`` is
    a checkpoint directory whose tensors include ``model.layers.{L}.*`` (transformers' configs say 1 even for
    checkpoints without them), else not; True: carried (the checkpoint must then hold them); False: not carried
    (a checkpoint holding them then loads only with ``strict=False``, which drops them, as transformers does).
    bf16 / fp16 parameters accumulate their gradients in fp32 ``param.main_grad`` (a post-accumulate-grad hook
    adds each fresh ``param.grad`` into it and frees it); fp32 parameters keep ``param.grad``.
    ``lora``: a :class:`parallm.LoraConfig`: LoRA adapters beside the targeted linears, everything else frozen
    (:func:`parallm.add_lora`, docs/lora.md).
    ``aux_loss``: the convention of a MoE model's load-balancing loss (when its config turns it on,
    docs/moe.md): ``"per_layer"`` (default; Megatron-core's: one loss per MoE layer, summed; every layout) or
    ``"pooled"`` (transformers', TRL's, verl's FSDP engine's: one loss over every layer's routing at once, about
    ``1 / L`` of the sum at the same coefficient; ``pp = 1`` only: each layer's gradient needs every layer's
    routing of the microbatch).
    Collective (every rank calls it): replicated-KV groups are created here when num_key_value_heads < tp.
    """
    require_initialized("build_model")
    dtype = model_dtype(dtype)
    _check_options(recompute=recompute, aux_loss=aux_loss, init=init)
    from ..checkpoint.hf_dir import config_source
    hf_config = config_source(hf_config, revision=revision, what="build_model")
    config = load_config(hf_config)
    spec, family = spec_from_config(config)
    task = resolve_task(config, task)
    spec = with_mtp(spec, hf_config, mtp)
    if isinstance(layers_per_stage, str):
        if layers_per_stage != "balanced":
            raise ValueError(f"layers_per_stage must be a list of counts or 'balanced', got {layers_per_stage!r}")
        dims = current_dims()
        layers_per_stage = balanced_layers_per_stage(spec, task=task, pp=dims.pp, vpp=dims.vpp)
    chunks = build_chunks(spec, table=family.table, task=task, dtype=dtype, sequence_parallel=sequence_parallel,
                          vocab_multiple=vocab_multiple, packed=packed, attn_impl=attn_impl,
                          recompute=recompute, cp_attn=cp_attn,
                          pipeline_split=dict(num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                                              num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
                                              layers_per_stage=layers_per_stage))
    if chunks[0].dims.rank == 0:
        logger.info("build_model: %s %s, %s, attention %s%s", spec.architecture, task, chunks[0].dims.describe(),
                    chunks[0].attn_impl, f" (context parallel: {chunks[0].cp_attn})" if chunks[0].cp_attn else "")
    for nkv in spec.kv_head_counts:      # created collectively, in the same order on every rank
        kv_replica_group(nkv)
    agree_on_kernels(chunks)        # kernel choices differing across ranks: an error on every rank
    agree_on_mtp(spec)             # mtp=None decides per rank, from the directory that rank sees
    attach_main_grad_hooks(chunks)
    _describe(chunks, spec, getattr(config, "_raw", config), _source_dir(hf_config), aux_loss)
    if init == "random":
        from ..checkpoint.random_init import init_random
        init_random(chunks, seed=seed)
    if lora is not None:        # LoRA adapters, the base frozen (docs/lora.md)
        from ..model.layers.lora import add_lora
        add_lora(chunks, lora)
    return chunks


INITS = ("empty", "random")


def _check_options(*, recompute, aux_loss: str, init: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if aux_loss not in AUX_LOSSES:
        raise ValueError(f"aux_loss must be one of {AUX_LOSSES}, got {aux_loss!r}")
    if aux_loss == "pooled" and current_dims().pp > 1:
        raise ValueError(f"aux_loss='pooled' needs pp=1 (got pp={current_dims().pp}): transformers' pooled "
                         "load-balancing loss couples every MoE layer's routing of a microbatch, which the "
                         "pipeline stages hold apart; use aux_loss='per_layer' (Megatron's) with pipeline "
                         "parallelism")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS} ('empty': load the weights next; 'random': random "
                         f"weights from seed), got {init!r}")


def _describe(chunks, spec, hf_config, source, aux_loss: str) -> None:
    """What each chunk keeps of where it came from (config, source directory) and its MoE loss convention."""
    for chunk in chunks:
        chunk.hf_config = hf_config
        chunk.hf_source = source
        chunk.moe_aux.mode = aux_loss
        # the layers whose router the loss reads (DeepSeek-V4's hash layers are not among them)
        chunk.moe_aux.num_layers = len(spec.moe.balanced_layers) if spec.moe is not None else 0
AUX_LOSSES = ("per_layer", "pooled")


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}


def model_dtype(dtype) -> torch.dtype:
    """``build_model``'s ``dtype``: a floating-point torch dtype, or one of :data:`DTYPE_NAMES` (verl configs
    pass strings); anything else a ValueError listing what is accepted."""
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, torch.float16) "
                     f"or one of the names {sorted(DTYPE_NAMES)}, got {dtype!r}")


def _source_dir(hf_config) -> str | None:
    """The checkpoint directory a model was built from (a config.json path: its directory), else None."""
    import os
    if not isinstance(hf_config, (str, os.PathLike)):
        return None
    path = os.path.abspath(os.fspath(hf_config))
    return path if os.path.isdir(path) else os.path.dirname(path)


def balanced_layers_per_stage(spec, *, task: str, pp: int, vpp: int = 1, seq_len: int | None = None
                              ) -> list[int] | None:
    """``build_model(layers_per_stage="balanced")``'s split of ``spec`` (a :class:`parallm.model.spec.DecoderSpec`)
    over ``pp x vpp`` virtual stages: :func:`parallm.parallel.stages.balanced_sizes` of the per-token
    multiply-adds of each layer (its weights, and its token mixing at sequences of ``seq_len`` tokens: attention
    scores, or a Gated DeltaNet layer's recurrence) and of the ``task``'s head
    (:func:`parallm.model.stage_costs.balance_costs`; ``seq_len`` None: 4096, at most ``max_position_embeddings``;
    build_model uses the default, pass this function's result as ``layers_per_stage`` for another length).
    None at ``pp * vpp == 1``. The same on every rank (a pure function of the config)."""
    from ..families import family_of
    from ..model.stage_costs import balance_costs
    from ..parallel.stages import balanced_sizes
    if pp * vpp == 1:
        return None
    if spec.num_layers < pp * vpp:
        raise ValueError(f"{spec.num_layers} layers do not split into pp={pp} x vpp={vpp} stages of at least one "
                         "layer each")
    layers, head = balance_costs(family_of(spec).table, spec, task=task, seq_len=seq_len)
    return list(balanced_sizes(layers, head, pp * vpp))


def resolve_task(config, task):
    """``None`` -> from the config's architectures; a value task needs ``num_labels`` 1 when it is given."""
    archs = getattr(config, "architectures", None) or []
    is_seq_cls = any(a.endswith("ForSequenceClassification") for a in archs)
    if task is None:
        task = "value" if is_seq_cls else "causal_lm"
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS} (or None), got {task!r}")
    if is_seq_cls:
        labels = getattr(config, "num_labels", None)
        if labels is None:
            labels = len(getattr(config, "id2label", None) or {}) or None
        if task == "value" and labels not in (None, 1):
            raise ValueError(f"a value model needs num_labels=1; the config has num_labels={labels}")
        if task == "causal_lm":
            raise ValueError(f"the config describes {archs[0]} (no language-model head): build it with "
                             "task='value' (or task=None)")
    return task
