"""The public entry points: build_model, forward and forward_backward (docs/api.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping

import torch

from .families import load_config, spec_from_config
from .model.decoder import RECOMPUTE, DecoderChunk, build_chunks
from .model.kernels import agree_on_kernels
from .model.logprobs import TokenStats, check_output
from .model.spec import TASKS
from .parallel.comm import gather_last_dim
from .parallel.errors import exchange_rows, spread_failure
from .model.layers.moe import AuxScales
from .model.loaded import require_loaded
from .model.params import attach_main_grad_hooks
from .parallel.pipeline import broadcast_from_last_stage, run_pipeline
from .parallel.state import as_chunks, current_dims, dims_of, kv_replica_group, require_initialized
from .train.grads import announce_step
from .train.batching import bin_order, fewest_bins, inverse, token_bins
from .train.metrics import MetricAccumulator, check_reductions, finish, local_vector, spec_hash


logger = logging.getLogger("parallm")


def build_model(hf_config, *, task: str | None = "causal_lm", packed: bool = False,
                sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                vocab_multiple: int = 1, attn_impl: str = "auto", recompute: str | None = None,
                cp_attn: str = "auto", num_layers_in_first_pipeline_stage: int | None = None,
                num_layers_in_last_pipeline_stage: int | None = None,
                layers_per_stage=None, mtp: bool | None = None,
                revision: str | None = None, lora=None, init: str = "empty", seed: int = 0) -> list[DecoderChunk]:
    """Build this rank's share of the model: one chunk per virtual pipeline stage (``len == vpp`` or 1).

    ``hf_config``: a transformers ``PretrainedConfig``, a checkpoint directory, or a config.json path, or a Hub id
    (``Qwen/Qwen2.5-0.5B``) read from the local Hugging Face cache at ``revision`` (default ``main``), never
    downloaded (:func:`parallm.checkpoint.hf_dir.resolve_checkpoint`: a local directory of the same spelling
    wins; an id the cache lacks is a CheckpointError naming the cache searched). A directory (or id) becomes the
    chunks' ``hf_source``: :func:`parallm.save_hf_weights` copies its tokenizer and generation files.
    ``task``: ``"causal_lm"`` (logits), ``"value"`` (a ``score`` head ``[1, H]`` giving values ``[B, S]``),
    ``"hidden"`` (headless: final-normed hidden states ``[B, S, H]``, what verl's ``*Model`` classes return), or
    None to follow the config (``*ForSequenceClassification`` -> value). ``packed``: remove padding and run
    the real tokens as one stream (varlen attention). ``sequence_parallel``: split that stream over the TP
    ranks between the parallel linears (needs ``packed=True``).
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
    the backward (``torch.utils.checkpoint``, non-reentrant, RNG state restored).
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
    Collective (every rank calls it): replicated-KV groups are created here when num_key_value_heads < tp.
    """
    require_initialized("build_model")
    dtype = model_dtype(dtype)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS} ('empty': load the weights next; 'random': random "
                         f"weights from seed), got {init!r}")
    from .checkpoint.hf_dir import config_source
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
    kv_replica_group(spec.num_kv_heads)
    agree_on_kernels(chunks)        # kernel choices differing across ranks: an error on every rank
    _agree_on_mtp(spec)             # mtp=None decides per rank, from the directory that rank sees
    attach_main_grad_hooks(chunks)
    source = _source_dir(hf_config)
    for chunk in chunks:
        chunk.hf_config = getattr(config, "_raw", config)
        chunk.hf_source = source
    if init == "random":
        from .checkpoint.random_init import init_random
        init_random(chunks, seed=seed)
    if lora is not None:        # LoRA adapters, the base frozen (docs/lora.md)
        from .model.layers.lora import add_lora
        add_lora(chunks, lora)
    return chunks


INITS = ("empty", "random")
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
    (:func:`parallm.model.table.balance_costs`; ``seq_len`` None: 4096, at most ``max_position_embeddings``;
    build_model uses the default, pass this function's result as ``layers_per_stage`` for another length).
    None at ``pp * vpp == 1``. The same on every rank (a pure function of the config)."""
    from .families import family_of
    from .model.table import balance_costs
    from .parallel.stages import balanced_sizes
    if pp * vpp == 1:
        return None
    if spec.num_layers < pp * vpp:
        raise ValueError(f"{spec.num_layers} layers do not split into pp={pp} x vpp={vpp} stages of at least one "
                         "layer each")
    layers, head = balance_costs(family_of(spec).table, spec, task=task, seq_len=seq_len)
    return list(balanced_sizes(layers, head, pp * vpp))


def with_mtp(spec, hf_config, mtp: bool | None):
    """``spec`` carrying its multi-token-prediction layers or not (see :func:`build_model`'s ``mtp``)."""
    if mtp not in (None, True, False):
        raise ValueError(f"mtp must be None, True or False, got {mtp!r}")
    from .families import family_of
    pick = family_of(spec).mtp_tensors
    if pick is not None:        # the family lists its MTP tensors from the checkpoint's headers (Qwen3.5 mtp.*)
        present = checkpoint_shapes(hf_config)
        found = pick(present) if present is not None else ()
        if mtp and not found:
            raise ValueError(f"mtp=True, but " + (
                f"{spec.architecture} lists its multi-token-prediction tensors from the checkpoint's headers and "
                "hf_config is not a checkpoint directory: build from the directory" if present is None else
                f"the checkpoint {hf_config} holds no multi-token-prediction tensors"))
        return dataclasses.replace(spec, carried_mtp=found if mtp is not False else ())
    if mtp is None:
        mtp = spec.mtp_layers > 0 and checkpoint_has_mtp(hf_config, spec.num_layers)
    if mtp and not spec.mtp_layers:
        raise ValueError(f"mtp=True, but {spec.architecture}'s config has no multi-token-prediction layers "
                         "(num_nextn_predict_layers is 0 or the family has none)")
    return dataclasses.replace(spec, carried_mtp_layers=spec.mtp_layers if mtp else 0)


def _agree_on_mtp(spec) -> None:
    """Every rank must carry the same multi-token-prediction tensors (``mtp=None`` decides from the checkpoint
    directory each rank sees; a rank that cannot see it carries none): one all-gather of (MTP layers, MTP
    tensors) over the world; a ValueError on every rank naming a rank that differs."""
    from .parallel.errors import exchange_rows
    rows = exchange_rows([spec.carried_mtp_layers, len(spec.carried_mtp)], what="build_model").tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        raise ValueError(f"build_model: ranks disagree on the multi-token-prediction tensors to carry (rank 0: "
                         f"{rows[0][0]} MTP layers / {rows[0][1]} MTP tensors, rank {bad[0]}: {rows[bad[0]][0]} / "
                         f"{rows[bad[0]][1]}): with mtp=None each rank decides from the checkpoint directory it "
                         "sees; make it visible on every rank, or pass mtp=False")


def checkpoint_shapes(hf_config) -> dict | None:
    """``{HF name: shape}`` of every tensor of checkpoint directory ``hf_config`` (from the index and the
    safetensors headers: no tensor data), or None when it is not a readable checkpoint directory."""
    import os

    from .checkpoint.hf_dir import HFCheckpoint
    from .errors import CheckpointError
    if not isinstance(hf_config, (str, os.PathLike)) or not os.path.isdir(hf_config):
        return None
    try:
        ckpt = HFCheckpoint(hf_config)
        return {k: tuple(ckpt.source(k).shape) for k in ckpt.keys()}
    except CheckpointError:          # a config-only directory, or one the loader will name the problem of
        return None


def checkpoint_has_mtp(hf_config, num_layers: int) -> bool:
    """Whether ``hf_config`` is a checkpoint directory whose tensor names include ``model.layers.{num_layers}.``
    (read from the index or the safetensors header: no tensor data)."""
    import os

    from .checkpoint.hf_dir import HFCheckpoint
    from .errors import CheckpointError
    if not isinstance(hf_config, (str, os.PathLike)) or not os.path.isdir(hf_config):
        return False
    try:
        names = HFCheckpoint(hf_config).keys()
    except CheckpointError:          # a config-only directory, or one the loader will name the problem of
        return False
    prefix = f"model.layers.{num_layers}."
    return any(n.startswith(prefix) for n in names)


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


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(attention_mask) - 1`` clipped at 0: every sequence counts from its first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")


def _is_batch_mapping(x) -> bool:
    """A dict of tensors, or a mapping-like batch (``tensordict.TensorDict``: ``keys()`` and ``[key]``)."""
    return isinstance(x, Mapping) or (not torch.is_tensor(x) and hasattr(x, "keys") and hasattr(x, "__getitem__")
                                      and hasattr(x, "batch_size"))


def _unpack_batch(input_ids, attention_mask, position_ids):
    """The positional form ``(input_ids, attention_mask, position_ids)`` or a batch mapping in ``input_ids``'s
    place -> ``(input_ids, attention_mask, position_ids, extras)``: ``extras`` None for the positional form,
    else a dict of the mapping's other entries (checked by :func:`_check_extras`)."""
    if not _is_batch_mapping(input_ids):
        return input_ids, attention_mask, position_ids, None
    batch = input_ids
    if attention_mask is not None or position_ids is not None:
        raise ValueError("a batch mapping carries attention_mask and position_ids itself; do not pass them beside "
                         "it")
    keys = [str(k) for k in batch.keys()]
    if "input_ids" not in keys:
        raise ValueError(f"the batch mapping has no 'input_ids' (keys: {keys})")
    if any(k in keys for k in ("cu_seqlens", "cu_seqlens_q")):
        raise ValueError("packed cu_seqlens-style batches are not supported: pass padded [B, S] input_ids with an "
                         "attention_mask (build_model(packed=True) removes the padding inside the model)")
    get = (lambda k: batch[k] if k in keys else None)
    return get("input_ids"), get("attention_mask"), get("position_ids"), \
        {k: batch[k] for k in keys if k not in BATCH_KEYS}


def _check_extras(extras, input_ids):
    """The batch mapping's other entries on the model's device: each a tensor whose first dimension is the
    batch (per sample ``[B, ...]`` or per token ``[B, S, ...]``), else a ValueError naming it. None stays None
    (the positional form)."""
    if extras is None:
        return None
    b = input_ids.shape[0]
    out = {}
    for k, v in extras.items():
        if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] != b:
            shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
            raise ValueError(f"batch[{k!r}] must be a tensor whose first dimension is the batch ({b}), got {shape}")
        out[k] = v.to(input_ids.device)
    return out


def _split_extras(extras, m: int, sizes=None):
    """``extras`` split along dim 0 as the microbatches are (:func:`_microbatches`): a list of ``m`` dicts, or
    None for the positional form."""
    if extras is None:
        return None
    if not extras:
        return [{} for _ in range(m)]
    parts = [t.split(sizes) if sizes is not None else t.tensor_split(m) for t in extras.values()]
    return [dict(zip(extras, piece)) for piece in zip(*parts)]


def _check_batch(chunks, input_ids, attention_mask, position_ids):
    """Validate the batch locally (callers then agree across ranks, _checked_call: a bad batch on one rank is an
    error on every rank) and return it on the model's device, position_ids defaulted."""
    if not torch.is_tensor(input_ids) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be an integer tensor [batch, seq], got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    device = next(chunks[0].parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    position_ids = position_ids.to(device)
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    _check_window_rows(chunks[0], attention_mask)
    vocab = chunks[0].spec.vocab_size
    low, high = (int(input_ids.min()), int(input_ids.max())) if input_ids.numel() else (0, 0)
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}); got values in [{low}, {high}] (on global rank "
                         f"{chunks[0].dims.rank})")
    return input_ids.long(), attention_mask, position_ids


def _check_window_rows(chunk: DecoderChunk, attention_mask: torch.Tensor) -> None:
    """Sliding windows count keys by index in the padded row (transformers' masks); the packed and
    context-parallel layouts count them among a row's real tokens. The two agree when each row's real tokens are
    contiguous (left / right padding), or when a row spans no more than the window: any other row is refused
    there, naming it (the padded layout takes it)."""
    window = chunk.spec.sliding_window
    if window is None or not (chunk.packed or chunk.dims.cp > 1) or not attention_mask.numel():
        return
    mask = attention_mask.bool()
    s = mask.shape[1]
    idx = torch.arange(s, device=mask.device)
    first = torch.where(mask, idx, s).min(-1).values
    last = torch.where(mask, idx, -1).max(-1).values
    span = (last - first + 1).clamp(min=0)
    bad = ((span > mask.sum(-1)) & (span > window)).nonzero().squeeze(-1).tolist()
    if bad:
        row = bad[0]
        raise ValueError(f"row {row} of the batch has padding between its real tokens ({int(mask[row].sum())} "
                         f"real tokens spread over {int(span[row])} positions) and the model has a sliding window "
                         f"of {window}: the packed and context-parallel layouts count the window over real "
                         "tokens, transformers over positions in the row; pass rows padded only at their ends, or "
                         "use the padded layout (packed=False, cp=1)")


def gather_output(chunk: DecoderChunk, out, temperature: float = 1.0, request=None):
    """Last-stage output -> ``[B, S, V]`` fp32 logits (TP-gathered, vocab padding removed, divided by
    ``temperature``) or ``[B, S]`` values. With a log-prob ``request`` the chunk already returned ``[B, S]``
    log-probs (or :class:`TokenStats`), which pass through. Differentiable."""
    if request is not None:
        return out
    out = out.transpose(0, 1)  # [B, S, ...]; contiguous for padded logits and packed outputs
    if chunk.task in ("value", "hidden"):
        return out.float()
    logits = gather_last_dim(out, chunk.dims.tp_group)
    logits = logits[..., :chunk.spec.vocab_size].float()
    return logits / temperature if temperature != 1.0 else logits


def _output_shape(chunk, b, s, request):
    if request is not None:
        return (2, b, s) if request.entropy else (b, s)
    spec = chunk.spec
    return {"causal_lm": (b, s, spec.vocab_size), "hidden": (b, s, spec.hidden_size)}.get(chunk.task, (b, s))


# Fewest tokens a microbatch of forward's default count holds beyond pp microbatches, by device type (others:
# the CUDA figure). CPU: about where the per-microbatch cost (a send per stage, the Python of every layer) stays
# under a few percent of the work on this project's 2-core machine; CUDA: a guess sized for kernel launches,
# not measured on a GPU.
MIN_FORWARD_MICROBATCH_TOKENS = {"cpu": 128, "cuda": 4096}


def default_forward_microbatches(batch: int, pp: int, tokens: int | None = None, device="cpu") -> int:
    """``forward``'s microbatch count at ``pp > 1`` when none is given: ``pp`` (at most one per sequence), and
    up to ``4 pp`` while each microbatch keeps :data:`MIN_FORWARD_MICROBATCH_TOKENS` of the batch's ``tokens``
    (``batch x seq``; None: no floor) on ``device``'s type. With ``m`` microbatches a pipeline of equal stages
    idles ``(pp - 1) / (m + pp - 1)`` of the time: 1/3 at ``m = pp = 2``, 1/9 at ``m = 4 pp``. A forward keeps
    nothing of a microbatch once it has passed, so more of them cost no memory, only smaller matrix products
    and one more message per stage each."""
    if tokens is None:
        more = 4 * pp
    else:
        floor = MIN_FORWARD_MICROBATCH_TOKENS.get(torch.device(device).type, MIN_FORWARD_MICROBATCH_TOKENS["cuda"])
        more = min(4 * pp, tokens // floor)
    return max(1, min(batch, max(pp, more)))


def forward(chunks, input_ids, attention_mask=None, position_ids=None, *, output=None, temperature=1.0,
            token_chunk=None, num_microbatches=None, max_tokens_per_microbatch=None, routed_experts=None,
            return_routed_experts=False):
    """Whole-batch output on every rank.

    ``output=None``: fp32 logits ``[B, S, V]`` (causal_lm; divided by ``temperature``) or values ``[B, S]``
    (value). ``output="logprobs"``: fp32 ``[B, S]``, ``log_softmax(logits[b, t] / temperature)[input_ids[b,
    t+1]]`` (0 at ``t = S-1`` and at padded positions). ``output="logprobs+entropy"``: a :class:`TokenStats` of
    two such tensors. At ``pp > 1`` the batch runs through the pipeline as ``num_microbatches`` microbatches
    along dim 0, their sizes differing by at most one (default :func:`default_forward_microbatches`: ``pp``, up
    to ``4 pp`` for batches with enough tokens, at most one per sequence), so the stages overlap instead of
    waiting for each other; results are the same for any count (at ``pp == 1`` it is ignored).
    ``max_tokens_per_microbatch``: microbatches by a token budget instead, at any pp (as in
    :func:`forward_backward`); outputs come back in the caller's order. ``input_ids`` may be a batch mapping
    (:func:`forward_backward`; its other entries are ignored, except ``routed_experts``).
    Log-probs are computed vocab-parallel in chunks of ``token_chunk`` tokens (default: about
    32 MiB of fp32 logits per chunk on CPU, 2 GiB on GPU: ``model.logprobs.DEFAULT_CHUNK_BYTES``), never
    gathering ``[..., V]``.

    Router replay (mixture-of-experts models, docs/moe.md): ``routed_experts`` (or a batch mapping's
    ``"routed_experts"`` entry, not both), ``[B, S, num_moe_layers, top_k]`` integers, or ``[T, num_moe_layers,
    top_k]`` for the batch's ``T`` real tokens in row order: every MoE layer routes each real token to those
    experts instead of its router's top-k (MoE layers numbered in model order from 0; values at padding
    positions are ignored), the combine weights being the router's probabilities of those experts.
    ``return_routed_experts=True``: returns ``(output, routed)``, ``routed`` int64 ``[B, S, num_moe_layers,
    top_k]`` the experts every MoE layer routed each token with (the replayed ones when given), -1 at padding
    positions, the same on every rank.
    """
    require_initialized("forward")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)

    def check():
        request = check_output(output, temperature, task=chunks[0].task, token_chunk=token_chunk)
        ids, mask, pos, extras = _unpack_batch(input_ids, attention_mask, position_ids)
        batch = _check_batch(chunks, ids, mask, pos)
        given = _check_replay(chunks, routed_experts, extras, batch[1], record=return_routed_experts)
        b = batch[0].shape[0]
        if max_tokens_per_microbatch is not None:
            bins = fewest_bins(_real_lengths(batch[1]), max_tokens_per_microbatch)
            m = num_microbatches or 1
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
        else:
            bins = None
            m = num_microbatches if num_microbatches is not None else default_forward_microbatches(
                b, layout.pp, batch[0].numel(), batch[0].device)
            if isinstance(m, bool) or not isinstance(m, int) or m < 1 or (b and m > b):
                raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number from 1 to the "
                                 f"batch size {b}")
        require_loaded(chunks, "forward")
        return (batch, request, bins, given), _call_fingerprint(
            layout, batch, m, request, given, temperature=temperature, token_chunk=token_chunk,
            budget=max_tokens_per_microbatch), m
    budget = max_tokens_per_microbatch
    ((input_ids, attention_mask, position_ids), request, bins, given), m = _checked_call(
        layout, check, what="forward",
        count_moe=budget is None and layout.pp > 1 and layout.ep > 1 and chunks[0].spec.moe is not None,
        default=num_microbatches is None)
    order = sizes = None
    if budget is not None:     # bins of at most `budget` real tokens, as many on every replica
        order, sizes = _token_budget_bins(layout, attention_mask, max(bins, m))
        input_ids, attention_mask, position_ids = (t[order] for t in (input_ids, attention_mask, position_ids))
        if given is not None:
            given = given[order]
        m = len(sizes)
    replaying = given is not None or return_routed_experts
    if replaying:
        _start_replay(chunks, given, m if layout.pp > 1 or order is not None else 1, sizes,
                      record=return_routed_experts)
    try:
        out = _forward_run(chunks, layout, input_ids, position_ids, attention_mask, m, sizes, order, request,
                           temperature)
    finally:
        recorded = [c.router_replay.stop() for c in chunks] if replaying else None
    if not return_routed_experts:
        return out
    return out, _routed_of_call(chunks, layout, recorded, input_ids.shape, order)


def _forward_run(chunks, layout, input_ids, position_ids, attention_mask, m, sizes, order, request, temperature):
    """:func:`forward` once the batch is checked (and in bin order under a token budget)."""
    if layout.pp == 1 and order is None:
        return gather_output(chunks[0], chunks[0].compute(input_ids, position_ids, attention_mask, stats=request),
                             temperature, request)
    b, s = input_ids.shape
    mbs = _microbatches(chunks, input_ids, position_ids, attention_mask, m, sizes=sizes)
    if layout.pp == 1:      # a token budget at pp = 1: the microbatches one after another
        length = chunks[0].rope_length(position_ids, attention_mask)
        outs = []
        for i, mb in enumerate(mbs):
            chunks[0].router_replay.microbatch = i
            outs.append(_stackable(gather_output(chunks[0], chunks[0].compute(
                *mb[:3], stats=request, rope_length=length, **({"cp": mb[3]} if len(mb) > 3 else {})),
                temperature, request)))
        return _caller_order(outs, order, request)
    with torch.no_grad():
        outs = run_pipeline(chunks, mbs, last_stage_fn=lambda chunk, out, i: _stackable(
                                gather_output(chunk, out, temperature, request)),
                            backward=False, compute_kwargs={"stats": request,
                                                            "rope_length": chunks[0].rope_length(position_ids,
                                                                                                 attention_mask)},
                            on_step=lambda kind, i, v: setattr(chunks[v].router_replay, "microbatch", i))
    joined = torch.cat(outs, dim=1 if request is not None and request.entropy else 0) if outs else None
    out = broadcast_from_last_stage(layout, joined, _output_shape(chunks[0], b, s, request), torch.float32,
                                    input_ids.device)
    if order is not None:
        return _caller_order([out], order, request)
    return TokenStats(out[0], out[1]) if request is not None and request.entropy else out


REPLAY_KEY = "routed_experts"    # the batch mapping's entry for router replay


def _check_replay(chunks, routed_experts, extras, attention_mask, *, record: bool = False):
    """Router replay's input, checked (:func:`parallm.model.layers.routing.check_routed_experts`): the keyword or the
    batch mapping's ``"routed_experts"`` entry (taken out of ``extras``), as ``[B, S, L, k]`` int64, or None."""
    if not isinstance(record, bool):
        raise ValueError(f"return_routed_experts must be True or False, got {record!r}")
    if extras is not None and REPLAY_KEY in extras:
        if routed_experts is not None:
            raise ValueError("routed_experts given twice: as a keyword and in the batch mapping; pass one")
        routed_experts = extras.pop(REPLAY_KEY)
    moe = chunks[0].spec.moe
    if (routed_experts is not None or record) and moe is None:
        raise ValueError(f"{'routed_experts' if routed_experts is not None else 'return_routed_experts'}: "
                         f"{chunks[0].spec.architecture} has no mixture-of-experts layers")
    if routed_experts is None:
        return None
    from .model.layers.routing import check_routed_experts, moe_layer_indices
    spec = chunks[0].spec
    return check_routed_experts(routed_experts, attention_mask, moe_layers=moe_layer_indices(spec),
                                num_layers=spec.num_layers, top_k=moe.top_k, num_experts=moe.num_experts)


def _start_replay(chunks, given, m: int, sizes=None, *, record: bool) -> None:
    """Every chunk's router replay on for one call: ``given`` ``[B, S, L, k]`` (or None) split as the ``m``
    microbatches are (:func:`_microbatches`)."""
    parts = None
    if given is not None:
        parts = list(given.split(sizes)) if sizes is not None else list(given.tensor_split(m))
    for chunk in chunks:
        chunk.router_replay.start(parts, record=record)


def _routed_of_call(chunks, layout, recorded, shape, order) -> torch.Tensor:
    """``forward(return_routed_experts=True)``'s second result: the chunks' recorded microbatches joined into
    ``[B, S, L, k]`` int64 (-1 at padding), the MoE layers of every pipeline stage (a MAX all-reduce over the
    pipeline group: each stage fills its own layers' columns, -1 elsewhere), in the caller's order."""
    from .model.layers.routing import moe_layer_indices
    spec = chunks[0].spec
    device = next(chunks[0].parameters()).device
    b, s = shape
    full = torch.full((b, s, len(moe_layer_indices(spec)), spec.moe.top_k), -1, dtype=torch.long, device=device)
    start = 0
    for m in sorted({m for rec in recorded for m in rec}):
        part = torch.stack([rec[m] for rec in recorded if m in rec]).amax(0)
        full[start:start + part.shape[0]] = part
        start += part.shape[0]
    if layout.pp > 1:
        torch.distributed.all_reduce(full, op=torch.distributed.ReduceOp.MAX, group=layout.pp_group)
    if order is not None:
        full = full.index_select(0, torch.tensor(inverse(order), dtype=torch.long, device=device))
    return full


def _real_lengths(attention_mask) -> list[int]:
    return attention_mask.sum(-1).tolist() if attention_mask.numel() else [0] * attention_mask.shape[0]


def _token_budget_bins(layout, attention_mask, fewest: int) -> tuple[list[int], list[int]]:
    """``max_tokens_per_microbatch``'s microbatches: the bin count agreed over the data-parallel replicas (the
    largest ``fewest``: one MAX all-reduce over the data-parallel group), then :func:`token_bins` of this
    replica's real lengths. Returns ``(order, sizes)`` (:func:`parallm.train.batching.bin_order`)."""
    k = fewest
    if layout.dp > 1:
        t = torch.tensor([k], dtype=torch.long, device=attention_mask.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=layout.dp_group)
        k = int(t.item())
    return bin_order(token_bins(_real_lengths(attention_mask), k))


def _caller_order(outs, order, request):
    """Outputs of the token-budget microbatches (in bin order, TokenStats stacked) -> the caller's order."""
    entropy = request is not None and request.entropy
    joined = torch.cat(outs, dim=1 if entropy else 0)
    back = torch.tensor(inverse(order), dtype=torch.long, device=joined.device)
    joined = joined.index_select(1 if entropy else 0, back)
    return TokenStats(joined[0], joined[1]) if entropy else joined


def _microbatches(chunks, input_ids, position_ids, attention_mask, m: int, sizes=None) -> list[tuple]:
    """The batch as ``m`` microbatches along dim 0 (sizes differing by at most one, the larger first; equal when
    ``m`` divides the batch; an empty batch gives ``m`` empty ones, so that every data-parallel replica runs the
    same schedule): ``(input_ids, position_ids, attention_mask)``, with this rank's context-parallel
    split of each as a fourth element under context parallelism (computed once per microbatch here; it travels
    through the pipeline with its microbatch). ``sizes``: the microbatches' sizes instead (a token budget's bins,
    the batch already in bin order)."""
    split = (lambda t: t.split(sizes)) if sizes is not None else (lambda t: t.tensor_split(m))
    mbs = list(zip(*(split(t) for t in (input_ids, position_ids, attention_mask))))
    if chunks[0].dims.cp > 1:
        mbs = [mb + (chunks[0].context_split(*mb),) for mb in mbs]
    return mbs


def _call_fingerprint(layout, batch, num_microbatches: int, request, given=None, *, extras=None,
                      temperature=1.0, token_chunk=None, budget=None) -> list[int] | None:
    """:func:`parallm.parallel.batch_check.batch_fingerprint` of a checked ``(input_ids, attention_mask,
    position_ids)`` with the batch mapping's ``extras`` and the call's arguments that shape the work
    (:data:`SETTINGS`; router replay's ``given`` experts ``[B, S, L, k]`` at the real positions, padding values
    ignored, -1 without replay), or None when the replica is this rank alone (nothing to compare)."""
    from .parallel.batch_check import batch_fingerprint, weighted_sum
    if layout.tp * layout.cp * layout.pp == 1:
        return None
    ids, mask, pos = batch
    kind = 0 if request is None else 2 if request.entropy else 1
    replay = -1 if given is None else weighted_sum(given * mask.bool()[:, :, None, None])
    bits = torch.tensor([float(temperature)], dtype=torch.float64).view(torch.int64).item()
    return batch_fingerprint(ids, pos, mask, extras=extras, settings=(
        num_microbatches, kind, replay, bits, -1 if token_chunk is None else token_chunk,
        -1 if budget is None else budget))


SETTINGS = ("num_microbatches", "output", "routed_experts", "temperature", "token_chunk",
            "max_tokens_per_microbatch")      # _call_fingerprint's settings, as errors name them


def _checked_call(layout, check, *, what: str, count_moe: bool, default: bool = False):
    """The checks every ``forward`` / ``forward_backward`` call makes before any model collective.

    ``check()`` (local work, no collectives) returns ``(result, fingerprint or None, microbatch count)``. Then,
    with ``count_moe``, the microbatch count over the expert-parallel group (:func:`_same_microbatches`); then
    ONE agreement over the world (:func:`parallm.parallel.batch_check.agree_on_batch`: an all-reduce of ``1 + 2
    dp`` integers on the gloo control group; messages are exchanged only on failure) that also compares the
    batch fingerprints of the ranks of each model replica, so that an error of any of them on any rank, or
    ranks of one replica passing different batches, is an error on every rank before anything waits. A rank
    whose own check failed still takes part (its row marked failed, left out of the comparisons).
    Returns ``(result, the microbatch count to run)``."""
    from .parallel.batch_check import agree_on_batch
    try:
        result, fingerprint, count = check()
        error = None
    except Exception as e:  # noqa: BLE001 - agreed on by every rank below
        result, fingerprint, count, error = None, None, 0, e
    failed = error is not None
    if count_moe:
        count, problem = _same_microbatches(count, layout, what, default=default, failed=failed)
        error = error or problem
    agree_on_batch(error, fingerprint, layout, what=what, setting_names=SETTINGS)
    return result, count


def _stackable(out):
    return torch.stack(tuple(out)) if isinstance(out, TokenStats) else out


def _same_microbatches(num_microbatches: int, layout, what: str = "forward_backward", *,
                       default: bool = False, failed: bool = False) -> tuple[int, ValueError | None]:
    """Under expert parallelism the ranks of an expert-parallel group exchange tokens in every MoE layer, so they
    must run the same number of microbatches (batch sizes may differ): one all-gather over that group. A
    mismatch is a ValueError (returned, the same on every rank of the group), not a hang. ``default``: no rank
    was given a count (``num_microbatches`` is this rank's default); every rank then runs the smallest default
    of any rank. ``failed``: this rank's own check failed (its row is left out). Returns ``(the count to run,
    error or None)``. (The group is the same set of replicas at every pipeline stage and TP / CP position, so
    a pipeline's stages all choose the same count.)"""
    import torch.distributed as dist
    rows = exchange_rows([int(failed), num_microbatches, int(default)], what=what, group=layout.ep_group)
    ranks = [r for r, row in zip(dist.get_process_group_ranks(layout.ep_group), rows.tolist()) if not row[0]]
    rows = rows[rows[:, 0] == 0]
    if not len(rows):
        return num_microbatches, None
    counts, defaults = rows[:, 1].tolist(), rows[:, 2].tolist()
    if all(defaults):
        return min(counts), None
    if len(set(counts)) > 1 or any(defaults):
        given = [c if not d else "default" for c, d in zip(counts, defaults)]
        return num_microbatches, ValueError(
            f"{what}: with expert parallelism (ep={layout.ep}) every rank must pass the same num_microbatches; got "
            f"{given} on global ranks {ranks} (one expert-parallel group)")
    return num_microbatches, None


def _load_balancing_per_microbatch(chunks, values, layout, device, num_microbatches: int) -> torch.Tensor:
    """``[num_microbatches]`` fp64: each microbatch's sum over every MoE layer of its load-balancing loss, the same
    on every rank of the replica: summed over the pipeline stages (each holds its layers' values) and, under
    sequence / context parallelism, over TP / CP (each rank holds its tokens' share). ``values``: the chunks'
    ``(microbatch, value)`` records."""
    per = torch.zeros(num_microbatches, dtype=torch.float32, device=device)
    for m, v in values:
        per[m] += v.float().to(device)
    if chunks[0].sequence_parallel:
        torch.distributed.all_reduce(per, group=layout.tp_group)
    if layout.cp > 1:
        torch.distributed.all_reduce(per, group=layout.cp_group)
    if layout.pp > 1:
        torch.distributed.all_reduce(per, group=layout.pp_group)
    return per.double().cpu()


def forward_backward(chunks, input_ids, attention_mask=None, *, loss_fn, num_microbatches: int = 1,
                     position_ids=None, output=None, temperature=1.0, token_chunk=None, metric_reduce=None,
                     max_tokens_per_microbatch=None, routed_experts=None):
    """Forward and backward of ``loss_fn`` over ``num_microbatches`` microbatches (split along dim 0).

    Two forms. Positional: ``forward_backward(chunks, input_ids, attention_mask, ...)`` calls
    ``loss_fn(out, input_ids_mb, attention_mask_mb)``. Batch: ``forward_backward(chunks, batch, ...)`` with a
    mapping (a dict of tensors, or a ``tensordict.TensorDict``) holding ``input_ids``, optional
    ``attention_mask`` and ``position_ids``, and any other tensors whose first dimension is the batch (per
    sample ``[B, ...]`` or per token ``[B, S, ...]``: advantages, old / reference log-probs, loss masks); every
    entry is split with the microbatches and ``loss_fn(out, mb)`` gets the microbatch's dict (``position_ids``
    defaulted). Under context parallelism ``out`` is the whole microbatch's output on every rank of the CP group,
    so per-token entries are not split over CP. Packed ``cu_seqlens``-style batches are refused (pass padded
    ``[B, S]`` tensors; ``build_model(packed=True)`` removes the padding inside).
    ``out`` is what :func:`forward` returns for that microbatch with the same ``output`` / ``temperature``
    (differentiable). Gradients accumulate as the gradient
    of ``mean_m loss_fn(mb_m)``: in ``param.grad`` for fp32 parameters, in fp32 ``param.main_grad`` for
    bf16 / fp16 ones (:func:`parallm.model.params.grad_of`); call :func:`parallm.finalize_grads` before
    stepping. Schedules: one microbatch's forward then its backward at ``pp == 1``; 1F1B (interleaved with
    virtual stages) at ``pp > 1`` (docs/pipeline.md). Each data-parallel replica passes its own batch. Returns
    that mean, averaged over data-parallel replicas (the global loss), on every rank.

    An empty local batch (0 rows; ``num_microbatches`` then need not divide anything) runs ``num_microbatches``
    empty microbatches, the schedule of its peers (the same messages, all-to-alls and gradient-bucket
    collectives): ``loss_fn`` is not called on them and they back-propagate zero. With a token-mean ``loss_fn``
    they add nothing (the step equals the one without that replica's data); with a scalar one, whose mean an
    empty microbatch does not have, any empty microbatch is a ValueError on every rank after the backward.

    With gradient buckets (``build_optimizer(overlap_grad_reduce=True)``) the call announces its microbatches
    (:func:`parallm.train.grads.announce_step`), so each bucket's reduction starts during the backward once its
    last gradient is in; to accumulate one step over several calls, announce their total first with
    :func:`parallm.train.grads.expect_microbatches`.

    Mixture-of-experts models whose config sets ``output_router_logits=True``: write ``aux_m`` for microbatch
    m's load-balancing loss, the sum over MoE layers of the layer's loss on m's real tokens (each as
    transformers' ``load_balancing_loss_func`` computes it for that layer alone; layers summed as Megatron does,
    docs/moe.md). With a scalar ``loss_fn`` the objective is ``mean_m [loss_fn(mb_m) + router_aux_loss_coef *
    aux_m]``, averaged over replicas; the returned loss includes it.

    Token-mean losses: ``loss_fn`` may return ``(loss_sum, num_tokens)`` (a scalar tensor and a count: a number or
    a tensor) for every microbatch instead. The objective is then ``sum(loss_sum) / sum(num_tokens)`` over all
    microbatches and all data-parallel replicas (verl's ``loss_agg_mode="token-mean"``), not a mean of
    per-microbatch means, and that is what is returned. Each ``loss_sum`` is back-propagated unscaled and
    :func:`parallm.finalize_grads` divides the gradients by the global token count (summed over every such call
    since the last finalize, so gradient accumulation over several calls is token-mean over all of them; a count
    of 0 divides by 1). With a load-balancing loss the objective is
    ``sum(loss_sum) / N + coef * sum(num_tokens_m * aux_m) / N`` over all microbatches m of all replicas,
    ``N = sum(num_tokens)``: the token-mean loss plus ``coef`` times the token-weighted mean of the microbatches'
    load-balancing losses. For one microbatch on one replica that is exactly transformers' ``loss +
    router_aux_loss_coef * aux_loss`` with a token-mean ``loss``; a microbatch with no tokens adds nothing. (The
    backward weights ``aux_m`` by ``coef * num_tokens_m``, known once ``loss_fn`` has run on the last stage and
    sent to the others with m's gradient, and ``finalize_grads`` divides by ``N`` as it does the rest.) Mixing
    the two kinds within a call, or within one step before ``finalize_grads``, is a ValueError.

    Token budget: ``max_tokens_per_microbatch=n`` forms the microbatches from the real tokens
    (``attention_mask``) instead of equal row counts: the sequences are spread, longest first onto the least
    loaded, over the fewest bins of at most ``n`` tokens (:mod:`parallm.train.batching`; verl's dynamic batch
    size), the count agreed over the data-parallel replicas (the largest; at least ``num_microbatches``), so
    every replica runs the same schedule (a replica with fewer sequences than bins runs empty microbatches).
    Batch entries travel with their rows. A sequence longer than ``n`` is a ValueError. Use a token-mean
    ``loss_fn``: the objective is then the same whatever the bins (a scalar loss's mean over microbatches
    depends on them). Every rank passes the same ``n``.

    Metrics: ``loss_fn`` may return ``(loss, metrics)`` or ``((loss_sum, num_tokens), metrics)``, ``metrics`` a
    dict of scalar tensors (or numbers) with the same names for every microbatch; ``forward_backward`` then
    returns ``(objective, metrics)``, the metrics reduced over the microbatches and data-parallel replicas as
    ``metric_reduce`` (``{name: "mean" | "sum" | "max" | "min"}``) says, fp32 scalars, the same on every rank
    at every pipeline stage. ``"mean"`` (the default) weights each microbatch by its ``num_tokens`` for a
    token-mean loss (a per-microbatch token mean becomes the global token mean), by 1 for a scalar loss
    (:mod:`parallm.train.metrics`). Every replica with data must return the same names (else ValueError
    everywhere).

    Router replay (mixture-of-experts models): ``routed_experts`` (or the batch mapping's ``"routed_experts"``
    entry; either form of :func:`forward`'s) makes every MoE layer route each real token to the given experts,
    the combine weights being the router's probabilities of those experts, so the router is trained on the
    routing the rollout engine used (docs/moe.md). It is split with the microbatches (and the context-parallel
    split) and is not handed to ``loss_fn``. A load-balancing loss counts the replayed experts.

    A ``loss_fn`` that raises on some ranks: those ranks finish the schedule back-propagating zero for that
    microbatch and the later ones (their peers get every message and collective they wait for), then every rank
    raises at the end of the call (the raising rank its own exception, the others the same type naming it). The
    process groups stay usable; the gradients hold the failed call's partial sums: zero them before going on.
    """
    require_initialized("forward_backward")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)

    def check():
        request = check_output(output, temperature, task=chunks[0].task, token_chunk=token_chunk)
        ids, mask, pos, extras = _unpack_batch(input_ids, attention_mask, position_ids)
        batch = _check_batch(chunks, ids, mask, pos)
        b = batch[0].shape[0]
        bins = None
        if max_tokens_per_microbatch is not None:
            bins = fewest_bins(_real_lengths(batch[1]), max_tokens_per_microbatch)
            if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
                raise ValueError(f"num_microbatches={num_microbatches!r} must be a whole number >= 1")
        elif not isinstance(num_microbatches, int) or num_microbatches < 1 or b % num_microbatches:
            raise ValueError(f"batch size {b} does not split into num_microbatches={num_microbatches}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(output, batch) -> loss (or loss_fn(output, "
                            "input_ids, attention_mask) with the positional form)")
        if chunks[0].config.params_dtype == torch.float16:
            raise ValueError("forward_backward: float16 parameters need loss scaling, which parallm does not do "
                             "(small fp16 gradients underflow to zero); train in bfloat16 (same memory, fp32 "
                             "main_grad) or float32. float16 models can still run forward")
        reductions = check_reductions(metric_reduce)
        given = _check_replay(chunks, routed_experts, extras, batch[1])
        extras = _check_extras(extras, batch[0])
        require_loaded(chunks, "forward_backward")
        return (batch, request, extras, reductions, bins, given), _call_fingerprint(
            layout, batch, num_microbatches, request, given, extras=extras, temperature=temperature,
            token_chunk=token_chunk, budget=max_tokens_per_microbatch), num_microbatches
    ((ids_all, mask_all, pos_all), request, extras, reductions, bins, given), _ = _checked_call(
        layout, check, what="forward_backward", count_moe=layout.ep > 1 and chunks[0].spec.moe is not None)
    if request is not None:   # the head's weight gradient goes straight into its existing gradient buffer
        request = dataclasses.replace(request, accumulate=True)
    sizes = None
    if max_tokens_per_microbatch is not None:    # bins of at most the budget's real tokens, as many per replica
        order, sizes = _token_budget_bins(layout, mask_all, max(bins, num_microbatches))
        ids_all, mask_all, pos_all = (t[order] for t in (ids_all, mask_all, pos_all))
        if extras:
            index = torch.tensor(order, dtype=torch.long, device=ids_all.device)
            extras = {k: v.index_select(0, index) for k, v in extras.items()}
        if given is not None:
            given = given.index_select(0, torch.tensor(order, dtype=torch.long, device=given.device))
        num_microbatches = len(sizes)
    mbs = _microbatches(chunks, ids_all, pos_all, mask_all, num_microbatches, sizes=sizes)
    extra_mbs = _split_extras(extras, num_microbatches, sizes)
    records = {}    # microbatch -> (loss or loss_sum, kind: "pair" | "scalar" | "empty", num_tokens), last stage
    failure = []    # loss_fn's first exception on this rank: raised on every rank once the schedule is over
    metrics = MetricAccumulator(reductions)

    def last_stage(chunk, out, m):
        ids, pos, mask = mbs[m][:3]
        result = gather_output(chunk, out, temperature, request)
        kind, tokens = "empty", 0.0
        if not failure and ids.shape[0]:
            try:
                if extra_mbs is None:
                    returned = loss_fn(result, ids, mask)
                else:
                    returned = loss_fn(result, {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                                **extra_mbs[m]})
                value, tokens, values = _loss_parts(returned)
                kind = "scalar" if tokens is None else "pair"
                metrics.add(values, 1.0 if tokens is None else tokens)
            except Exception as e:  # noqa: BLE001 - agreed on by every rank after the schedule
                failure.append(e)
        if failure or kind == "empty":   # the same messages and collectives as the peers, zero gradients
            value, kind, tokens = _zero_loss(result), "empty" if not failure else "scalar", 0.0
        records[m] = (value.detach().float(), kind, tokens or 0.0)
        if scales is not None:      # the weight of m's load-balancing loss in the backward (AuxScales)
            scales.tokens[m] = -1.0 if kind == "scalar" else tokens
        return value / num_microbatches if kind == "scalar" else value    # what is back-propagated

    moe = chunks[0].spec.moe
    coef = moe.aux_loss_coef if moe is not None else 0.0
    scales = AuxScales(coef, num_microbatches) if coef else None
    if scales is not None:
        for chunk in chunks:
            chunk.moe_aux.start(scales)
    if given is not None:    # router replay: each microbatch's experts, set per step below
        _start_replay(chunks, given, num_microbatches, sizes, record=False)

    def on_step(kind, m, v):
        if scales is not None:
            chunks[v].moe_aux.microbatch = m
        chunks[v].router_replay.microbatch = m
    announce_step(chunks, len(mbs))
    try:
        run_pipeline(chunks, mbs, last_stage_fn=last_stage, backward=True, compute_kwargs={
            "stats": request, "rope_length": chunks[0].rope_length(pos_all, mask_all)},
            on_step=on_step, side=scales.tokens if scales is not None and layout.pp > 1 else None)
    finally:
        aux_values = [v for chunk in chunks for v in chunk.moe_aux.stop()]
        for chunk in chunks:
            chunk.router_replay.stop()
    device = ids_all.device
    # from the last stage: [microbatches returning a pair, returning a scalar, empty, sum of the values, sum of
    # the token counts, ranks whose loss_fn raised, replicas with data, with metrics, the metric spec's hash and
    # its square, the lengths of the metric sums / maxima / spec; each microbatch's count (-1: a scalar loss)]
    mine, metric_sums, metric_max = None, [], []
    if records:
        kinds = [records[m][1] for m in range(num_microbatches)]
        counts = [-1.0 if records[m][1] == "scalar" else records[m][2] for m in range(num_microbatches)]
        metric_sums, metric_max = local_vector(metrics) if not failure else ([], [])
        h = spec_hash(metrics.spec()) if not failure else 0
        mine = torch.tensor([kinds.count("pair"), kinds.count("scalar"), kinds.count("empty"),
                             torch.stack([v for v, _, _ in records.values()]).sum().item(),
                             sum(max(c, 0.0) for c in counts), float(bool(failure)),
                             float(kinds.count("empty") < num_microbatches), float(h > 0), h, h * h,
                             len(metric_sums) - len(metrics.spec()), len(metric_max), len(metrics.spec())]
                            + counts, dtype=torch.float64)
        if layout.tp * layout.cp > 1:
            # the TP / CP ranks of the last stage hold the same loss values; a loss_fn may still have raised on
            # some of them only: the maximum carries that to all of them (and so through the broadcast below)
            mine = mine.to(device)
            torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX,
                                         group=layout.tp_cp_group if layout.cp > 1 else layout.tp_group)
    stats = broadcast_from_last_stage(layout, mine, (_FIXED + num_microbatches,), torch.float64, device).cpu()
    n_sums, n_max, n_spec = (int(x) for x in stats[10:13])
    if n_sums + n_max + n_spec:    # the metrics' sums, maxima and spec bytes, to every stage (zeros on failure)
        width = n_sums + n_spec + n_max
        flat = metric_sums + metric_max
        local = torch.tensor(flat if len(flat) == width else [0.0] * width, dtype=torch.float64) \
            if records else None
        flat = broadcast_from_last_stage(layout, local, (width,), torch.float64, device).cpu()
        metric_sums, metric_max = flat[:n_sums + n_spec].tolist(), flat[n_sums + n_spec:].tolist()
    if coef:    # what the backward weighted each microbatch's load-balancing loss with (AuxScales)
        per = _load_balancing_per_microbatch(chunks, aux_values, layout, device, num_microbatches)
        stats[3] += coef * (per.sum() if stats[1] else (per * stats[_FIXED:].clamp(min=0.0)).sum())
    total = stats[:_FIXED]
    if layout.dp > 1:      # one all-reduce: the kinds' counts, the values, the tokens, failures of every replica
        total = total.to(device)
        torch.distributed.all_reduce(total, group=layout.dp_group)
        total = total.cpu()
    # the same numbers on every rank from here (tp x cp x pp x dp is the world): what is raised below is raised
    # everywhere, without an agreement of its own over the world
    if total[5]:        # a loss_fn raised somewhere: its message to every rank, then raised everywhere
        spread_failure(failure[0] if failure else None, what="forward_backward")
    pairs, scalars, empty = (int(x) for x in total[:3])
    reported = _reduce_metrics(layout, total, metric_sums, metric_max, device)
    if pairs and scalars:
        raise ValueError(f"forward_backward: loss_fn returned (loss_sum, num_tokens) for {pairs} and a scalar for "
                         f"{scalars} of the {pairs + scalars + empty} microbatches (all data-parallel replicas); "
                         "return one kind")
    if scalars and empty:
        raise ValueError(f"forward_backward: {empty} of the {layout.dp} x {num_microbatches} microbatches "
                         "(data-parallel replicas x microbatches) hold no rows, and loss_fn returns a scalar, a "
                         "mean per microbatch, which an empty one does not have; return (loss_sum, num_tokens) "
                         "(a token mean, to which empty microbatches add nothing)")
    if not pairs:        # the mean over microbatches (and over data-parallel replicas)
        if _pending_tokens(chunks) is not None:
            raise ValueError("forward_backward: a scalar loss_fn after a (loss_sum, num_tokens) one before "
                             "finalize_grads; the gradients of one step come from one kind")
        objective = (total[3] / (num_microbatches * layout.dp)).float().to(device)
    else:     # token-mean: sum(loss_sum) / sum(num_tokens) over microbatches and data-parallel replicas
        _add_pending_tokens(chunks, float(total[4]))
        objective = (total[3] / max(float(total[4]), 1.0)).float().to(device)
    return objective if reported is None else (objective, reported)


_FIXED = 13    # forward_backward's fixed statistics (see its comment), before the per-microbatch counts


def _reduce_metrics(layout, total, sums: list[float], maxima: list[float], device):
    """The metrics over every replica (:mod:`parallm.train.metrics`), or None when no loss_fn returned any.
    ``total``: forward_backward's statistics summed over the replicas; ``sums`` / ``maxima``: this replica's.
    Every replica with data must return metrics of the same names and reductions (checked exactly from the
    spec hashes' sum and sum of squares), else a ValueError on every rank."""
    with_data, with_metrics, h, h2 = (float(x) for x in total[6:10])
    if not with_metrics:
        return None
    if with_metrics != with_data or h * h != with_metrics * h2:
        raise ValueError("forward_backward: loss_fn returned metrics on some data-parallel replicas and not on "
                         "others, or metrics of other names or reductions; return the same metrics everywhere")
    n_sums, n_max, n_spec = (int(round(float(x) / with_metrics)) for x in total[10:13])
    if not sums:           # a replica with no data (empty microbatches): zeros, which add nothing
        sums, maxima = [0.0] * (n_sums + n_spec), [-math.inf] * n_max
    sums_t = torch.tensor(sums, dtype=torch.float64, device=device)
    max_t = torch.tensor(maxima, dtype=torch.float64, device=device)
    if layout.dp > 1:
        torch.distributed.all_reduce(sums_t, group=layout.dp_group)
        if n_max:
            torch.distributed.all_reduce(max_t, op=torch.distributed.ReduceOp.MAX, group=layout.dp_group)
    return finish(sums_t.cpu(), max_t.cpu(), int(with_metrics), n_spec, device)


def _zero_loss(result) -> torch.Tensor:
    """A loss whose gradient is zero, through the same graph as ``result`` (a tensor or a TokenStats): what a
    rank whose ``loss_fn`` raised back-propagates, so that its backward makes the same collectives and sends as
    its peers'."""
    tensors = list(result) if isinstance(result, TokenStats) else [result]
    return sum((t * 0).sum() for t in tensors)


def _loss_parts(result):
    """``loss_fn``'s return -> ``(value, num_tokens or None, metrics or None)``: a scalar tensor, or a pair
    ``(loss_sum, num_tokens)`` whose count is a number or a one-element tensor; either of them may come as
    ``(it, metrics)``, ``metrics`` a dict of scalars."""
    metrics = None
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], Mapping):
        result, metrics = result
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise ValueError(f"loss_fn must return a scalar tensor or (loss_sum, num_tokens); got a sequence of "
                             f"{len(result)}")
        value, tokens = result
        tokens = float(tokens.detach().float().sum()) if torch.is_tensor(tokens) else float(tokens)
        if not tokens >= 0:
            raise ValueError(f"loss_fn's num_tokens must be >= 0, got {tokens}")
    else:
        value, tokens = result, None
    if not (torch.is_tensor(value) and value.dim() == 0):
        got = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"loss_fn must return a scalar tensor (or (loss_sum, num_tokens) with a scalar loss_sum), "
                         f"got {'a loss_sum of ' if tokens is not None else ''}{got}")
    return value, tokens, metrics


def _pending_tokens(chunks):
    """The token count of the (loss_sum, num_tokens) calls since the last finalize_grads, or None."""
    return getattr(chunks[0], "pending_tokens", None)


def _add_pending_tokens(chunks, count: float) -> None:
    chunks[0].pending_tokens = (_pending_tokens(chunks) or 0.0) + count
