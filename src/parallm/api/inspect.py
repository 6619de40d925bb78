"""What a checkpoint is and how it can be split, without a process group: :func:`inspect_checkpoint` (public as
``parallm.inspect_checkpoint``; the ``parallm inspect`` command renders its report).

Reads config.json and the safetensors headers only (never the tensor bytes) and runs the loader's own name /
shape check (``check_checkpoint`` against the family's weight table), so it cannot disagree with the loader;
``parallm verify`` runs the same checks (:func:`read_checkpoint`, :func:`check_split`) before it starts any rank.
The parameter memory per rank for a layout comes from the same weight table and shard functions the loader
uses, run on meta tensors (nothing is allocated).
"""

from __future__ import annotations

import math
import os

from ..errors import CheckpointError


class InspectError(CheckpointError, ValueError):
    """A checkpoint that cannot be read, or a layout it cannot be split into (the message says which and why)."""


# -- reading a checkpoint (shared with verify's preflight) ------------------------------------------------------


def read_checkpoint(path: str, *, task: str | None, pp: int = 1) -> dict:
    """config.json, family, task and every tensor's header, checked as the loader checks them (for ``pp``
    stages). Raises InspectError naming what cannot be read; missing / unexpected / mis-shaped tensors land in
    ``problem`` instead (``inspect`` still describes such a checkpoint)."""
    from . import resolve_task, with_mtp
    from ..checkpoint.hf_dir import SAFETENSORS_DTYPES, HFCheckpoint
    from ..checkpoint.loader import check_checkpoint
    from ..model.table import all_entries, expected_hf_shapes, fused_layout
    from ..families import load_config, spec_from_config
    if not os.path.isdir(path):
        raise InspectError(f"{path} does not exist" if not os.path.exists(path) else
                       f"{path} is not a directory (give the checkpoint directory, the one with config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InspectError(f"{path} has no config.json (is it a Hugging Face checkpoint directory?)")
    try:
        config = load_config(path)
        try:
            spec, family = spec_from_config(config)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}/config.json: {e}") from None
        task = resolve_task(config, task)
        spec = with_mtp(spec, path, None)          # MTP layers carried when the checkpoint holds them
        ckpt = HFCheckpoint(path)
        tensors, types = {}, {}
        for name, fname in ckpt.weight_map.items():
            src = ckpt.source(name)
            dtype = SAFETENSORS_DTYPES.get(src.dtype_code)
            types[name] = dtype
            tensors[name] = dict(shape=src.shape, file=fname, itemsize=dtype.itemsize if dtype else 4,
                                 dtype=str(dtype).replace("torch.", "") if dtype else src.dtype_code)
    except ValueError as e:  # CheckpointError included
        raise InspectError(str(e)) from None
    problem, notes, shapes = None, [], {k: v["shape"] for k, v in tensors.items()}
    try:
        shapes, packed = _mxfp4_shapes(shapes, types, config, tensors, os.path.abspath(path))
        if packed:
            notes.append(f"{len(packed)} expert tensors are MXFP4 (*_blocks / *_scales): dequantised on load, each "
                         "rank only its own experts' slice; saves write the model's dtype")
        shapes = _int4_shapes(shapes, types, config, tensors, notes, os.path.abspath(path))
        if spec.carried:
            notes.append(f"{len(spec.carried)} tensors outside the language model (a vision tower, its projector) "
                         "are carried: loaded, saved and exported unchanged, never run")
        expected = expected_hf_shapes(family.table, spec, task=task, pp=pp)
        aliases, init, fused = check_checkpoint(shapes, spec, task, expected,
                                                strict=True, where=os.path.abspath(path),
                                                fused=fused_layout(family.table, spec, task=task, pp=pp))
        if fused and any(e.row.save_fused for e in all_entries(family.table, spec, task=task, pp=pp)):
            notes.append(f"{len(fused)} per-expert tensors are read as slabs of the stacked expert tensors "
                         "(mlp.experts.gate_up_proj [E, ...]), which saves write back stacked")
        elif fused:
            notes.append(f"{len(fused)} tensors are read from fused MoE tensors (transformers 5's in-memory "
                         "layout, e.g. mlp.experts.gate_up_proj); saves write the Hub's per-expert names")
        if init:
            notes.append(f"{', '.join(init)} is not in the checkpoint: a value model initialises it (seeded)")
        if aliases:
            notes.append("the value head is read from a verl-style lm_head.weight [1, hidden]")
    except ValueError as e:
        problem = str(e)
    return dict(spec=spec, family=family, task=task, tensors=tensors, problem=problem, notes=notes,
                dtypes=sorted({t["dtype"] for t in tensors.values()}))


def _mxfp4_shapes(shapes: dict, types: dict, config, tensors: dict, where: str):
    """``shapes`` with each MXFP4 ``*_blocks`` / ``*_scales`` pair replaced by the tensor it stands for (as the
    loader reads it: :func:`parallm.checkpoint.mxfp4.mxfp4_view`), and the pairs; ``tensors``' entries of a pair
    are marked ``mxfp4`` (counted as the parameters they hold, 4.25 bits each: the scales in the blocks' share)."""
    from ..checkpoint.mxfp4 import is_mxfp4, mxfp4_plan, stacked_shape
    packed = mxfp4_plan(shapes, types, is_mxfp4(config), where=where)
    out = {k: v for k, v in shapes.items() if not any(k in pair for pair in packed.values())}
    for name, (blocks, scales) in packed.items():
        out[name] = stacked_shape(shapes[blocks])
        tensors[blocks].update(dtype="mxfp4", itemsize=4.25 / 8, shape=out[name], packed=True)
        tensors[scales].update(dtype="mxfp4", shape=(0,), packed=True)
    return out, packed


def _int4_shapes(shapes: dict, types: dict, config, tensors: dict, notes: list, where: str) -> dict:
    """``shapes`` with each compressed-tensors pack-quantized module's tensors replaced by its weight (as the
    loader reads it: :func:`parallm.checkpoint.int4.int4_view`); ``tensors``' entries of the packed words marked
    ``int4`` (half a byte per weight), its scales / zero points / shape counted in them; a note on the scheme."""
    from ..checkpoint.int4 import PACKED, int4_config, int4_view
    qconfig = int4_config(config)
    out, _, _ = int4_view(shapes, types, None, qconfig, where=where)
    modules = [k for k in shapes if k.endswith("." + PACKED)]
    for name in shapes:
        if name not in out:
            packed = name.endswith("." + PACKED)
            weight = name.rpartition(".")[0] + ".weight"
            tensors[name].update(dtype="int4", itemsize=0.5, shape=out[weight] if packed else (0,), packed=True)
    if modules:
        schemes = ", ".join(f"group size {s.group_size}, " + ("symmetric" if s.symmetric else "with zero points")
                            for s in qconfig.schemes)
        notes.append(f"{len(modules)} linear weights are compressed-tensors INT4 pack-quantized ({schemes}): "
                     "dequantised on load into the model dtype, each rank only its own slice; saves write the "
                     "model's dtype and no quantization_config")
    return out


def check_split(spec, *, tp: int, pp: int, vpp: int | None, split: dict | None = None,
                task: str = "causal_lm") -> dict | None:
    """The loader's own split checks, as an InspectError: tp over heads / KV heads / MLP, layers over pp x vpp (evenly,
    or as ``split``, ``build_model``'s pipeline-split keywords, says), and what build_model checks of the layers each
    stage holds (:func:`stage_refusal`). Returns ``split`` with ``layers_per_stage="balanced"`` replaced by
    build_model's counts for ``task``."""
    from ..model.spec import check_tp
    from ..parallel.stages import stage_sizes
    try:
        check_tp(spec, tp)
        if split and split.get("layers_per_stage") == "balanced":     # build_model's own split
            from . import balanced_layers_per_stage
            split = dict(split, layers_per_stage=balanced_layers_per_stage(spec, task=task, pp=pp, vpp=vpp or 1))
        stage_sizes(spec.num_layers, pp, vpp or 1, **(split or {}))
    except ValueError as e:
        raise InspectError(str(e)) from None
    refusal = stage_refusal(spec, pp, vpp or 1, split)
    if refusal is not None:
        raise InspectError(refusal)
    return split


def stage_refusal(spec, pp: int, vpp: int, split: dict | None = None) -> str | None:
    """Why ``build_model`` refuses this pipeline split of the layers (whose counts fit) for the layers it puts
    together (None: it does not): the stage checks it runs, on the same stage ranges: a Gemma 4 KV-sharing layer
    and the layer whose keys / values it reuses (``num_kv_shared_layers``), or a DeepSeek Sparse Attention shared
    layer and the layer whose selection it reuses, in different (virtual) stages. The message names both layers."""
    from ..model.layers.dsa import check_dsa_stages
    from ..model.layers.kv_sharing import check_kv_sharing_stages
    from ..parallel.stages import layer_numbers
    stages = [layer_numbers(spec.num_layers, pp, vpp, p, v, **(split or {})) for p in range(pp) for v in range(vpp)]
    try:
        check_dsa_stages(spec, stages)
        check_kv_sharing_stages(spec, stages)
    except ValueError as e:
        return str(e)
    return None


def even_pipelines(spec) -> tuple[dict, list]:
    """The even pipeline splits of the layers: ``{pp: [vpp > 1, ...]}`` of those build_model takes (a pp listed
    only when its vpp 1 split is taken: a vpp split's stage boundaries include vpp 1's, so it is refused whenever
    vpp 1 is), and ``[{"pp", "vpp", "reason"}]`` of those whose counts divide the layers but whose stages
    :func:`stage_refusal` refuses (Gemma 4's KV sharing, DSA's shared layers)."""
    from ..parallel.stages import layer_numbers
    L, ok, refused = spec.num_layers, {}, []
    for pp in range(1, L + 1):
        if not _splits(layer_numbers, L, pp, 1, 0, 0):
            continue
        for vpp in [1] + [v for v in range(2, L // pp + 1) if pp > 1 and _splits(layer_numbers, L, pp, v, 0, 0)]:
            reason = stage_refusal(spec, pp, vpp)
            if reason is not None:
                refused.append(dict(pp=pp, vpp=vpp, reason=reason))
            elif vpp == 1:
                ok[pp] = []
            elif pp in ok:
                ok[pp].append(vpp)
    return ok, refused


def _splits(fn, *args) -> bool:
    try:
        fn(*args)
        return True
    except ValueError:
        return False


def rank_params(spec, task: str, *, tp: int, pp: int, vpp: int | None, ep: int = 1,
                split: dict | None = None) -> list[dict]:
    """Per pipeline stage: parameters one of its TP ranks holds (every TP rank of a stage holds the same count;
    vocabulary padding included, the tied head copy of the last stage included when pp > 1; of a MoE layer's
    experts, one expert-parallel rank's ``E / ep``)."""
    import math

    from ..model.sharding import make_layout
    from ..model.table import chunk_entries, resolve_shape
    from ..families import family_of
    from ..model.spec import padded_vocab_size
    from ..parallel.stages import layer_numbers
    table, vpp, padded = family_of(spec).table, vpp or 1, padded_vocab_size(spec.vocab_size, tp)
    stages = []
    for pp_rank in range(pp):
        count, layers = 0, []
        for v in range(vpp):
            rng = layer_numbers(spec.num_layers, pp, vpp, pp_rank, v, **(split or {}))
            layers.append(f"{rng.start}-{rng.stop - 1}" if len(rng) > 1 else str(rng.start))
            experts = range(spec.moe.num_experts // ep) if spec.moe is not None else None
            for e in chunk_entries(table, spec, task=task, pp=pp, pre_process=(pp_rank == 0 and v == 0),
                                   post_process=(pp_rank == pp - 1 and v == vpp - 1), layers=rng, experts=experts):
                shapes = [resolve_shape(s, spec) for s in e.row.shapes]
                count += math.prod(make_layout(e.kind, spec, padded).shard_shape(0, tp, shapes))
        stages.append(dict(pp_rank=pp_rank, layers=", ".join(layers), params=count))
    return stages


def moe_facts(spec, *, dtype: str, tp: int) -> dict | None:
    """A mixture-of-experts model's experts and how they run: per MoE layer the experts, top-k and widths, the
    parameter tensors the layer holds (router, two stacked expert tensors, the shared expert's), and the expert
    GEMM kernel this machine's default device would use for the checkpoint's dtype at ``tp``
    (:func:`parallm.model.layers.moe.expert_kernel`, the choice ``build_model`` makes)."""
    import torch

    from ..model.layers.moe import expert_kernel, grouped_mm_support
    moe = spec.moe
    if moe is None:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, dtype, torch.float32)
    width = moe.expert_intermediate_size // tp if moe.expert_intermediate_size % tp == 0 else 0
    relu2 = moe.activation == "relu2"             # Nemotron-H: ungated, in the latent space when it has one
    sizes = (moe.latent_size or spec.hidden_size, (1 if relu2 else 2) * width, width)
    kernel = expert_kernel(device, torch_dtype, sizes) if width else "loop"
    if moe.activation in ("silu", "relu2"):
        activation = moe.activation
    elif moe.activation == "gelu_tanh":
        activation = "tanh GELU"
    elif moe.activation == "clamped_silu":
        activation = f"clamped SiLU (gate <= {moe.swiglu_limit:g}, |up| <= {moe.swiglu_limit:g})"
    else:
        activation = f"clamped SwiGLU (limit {moe.swiglu_limit:g}, alpha {moe.swiglu_alpha:g})"
    return dict(experts=moe.num_experts, top_k=moe.top_k, layers=len(moe.layers),
                expert_width=moe.expert_intermediate_size, shared_width=moe.shared_expert_intermediate_size,
                tensors_per_layer=3 + int(moe.score_bias) + int(moe.router_bias) + 2 * int(moe.expert_bias)
                + (2 + int(moe.shared_expert_gate) if moe.shared_expert_intermediate_size else 0)
                + (2 * (1 + int(moe.latent_bias)) if moe.latent_size else 0)
                + (7 if moe.beside_mlp else 0),     # Gemma 4: router scales, 3 norms, the dense MLP's 2 beside
                beside_mlp=moe.beside_mlp,
                router=moe.router, router_bias=moe.router_bias, expert_bias=moe.expert_bias, activation=activation,
                kernel=kernel, device=device,
                kernel_note=(grouped_mm_support(device, torch_dtype, sizes) if width else
                             f"moe_intermediate_size {moe.expert_intermediate_size} does not split over tp={tp}"))


def inspect_checkpoint(path: str, *, tp=None, pp=None, vpp=None, dp=None, ep=None, task=None,
                       split: dict | None = None) -> dict:
    """The report ``parallm inspect`` prints (see the module docstring); ``split``: ``build_model``'s
    pipeline-split keywords for the per-rank memory of ``tp`` / ``pp`` / ``vpp``."""
    from ..model.spec import check_tp
    from ..parallel.stages import stage_sizes
    ck = read_checkpoint(path, task=task)
    spec, tensors, L = ck["spec"], ck["tensors"], ck["spec"].num_layers
    pipelines, refused = even_pipelines(spec)
    files = {t["file"]: os.path.getsize(os.path.join(path, t["file"])) for t in tensors.values()}
    dtypes, itemsize = {}, {}
    for t in tensors.values():
        n = 1
        for d in t["shape"]:
            n *= d
        dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + n
        itemsize[t["dtype"]] = t["itemsize"]
    # the dtype the model loads into: the unquantised tensors' (MXFP4 experts are dequantised into it)
    plain = {k: v for k, v in dtypes.items() if k not in ("mxfp4", "int4")}
    main = max(plain, key=plain.get) if plain else "float32"
    report = dict(
        path=os.path.abspath(path), architecture=spec.architecture, family=ck["family"].name,
        model_type=spec.model_type, task=ck["task"],
        config=dict(layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, intermediate=spec.intermediate_size, vocab=spec.vocab_size,
                    tied=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, mlp_bias=spec.mlp_bias,
                    rope="none" if spec.nope else "yarn" if spec.yarn is not None else spec.rope.kind,
                    rope_theta=None if spec.nope else spec.rope.theta,
                    rotary_dim=None if spec.nope or spec.layer_ropes else spec.rotary_dim,
                    global_head_dim=spec.global_head_dim if spec.global_layers else None,
                    qk_norm="whole projection" if spec.qk_norm_whole else "per head" if spec.qk_norm else None,
                    rms_norm_eps=spec.rms_norm_eps, latent_attention=spec.mla is not None,
                    mtp_layers=spec.carried_mtp_layers, linear_layers=list(_linear_layers(spec)),
                    linear_heads=_linear_heads(spec), blocks=_blocks(spec), carried=len(spec.carried),
                    carried_parameters=sum(math.prod(shape) for _, shape in spec.carried),
                    mtp_tensors=len(spec.carried_mtp),
                    mtp_parameters=sum(math.prod(shape) for _, shape in spec.carried_mtp),
                    layer_pattern=_layer_pattern(spec), sinks=spec.attn_sinks,
                    sparse_attention=dsa_facts(spec), deepseek_v4=v4_facts(spec)),
        parameters=sum(dtypes.values()), tensors=len(tensors), dtypes=dtypes, dtype=main,
        dtype_bytes=itemsize.get(main, 4), files=files, problem=ck["problem"], notes=ck["notes"],
        valid_tp=[tp for tp in range(1, spec.num_heads + 1) if _splits(check_tp, spec, tp)],
        # pp -> the vpp values (> 1) that split the layers evenly (Megatron's interleaving) and build_model takes;
        # the even splits it refuses for the layers they separate (KV sharing, DSA's shared layers), with why
        pipelines=pipelines, refused_pipelines=refused)
    report["moe"] = moe_facts(spec, dtype=main, tp=tp or 1)
    if any(x is not None for x in (tp, pp, vpp, dp, ep)):
        tp, pp, dp, vpp, ep = tp or 1, pp or 1, dp or 1, vpp if vpp and vpp > 1 else None, ep or 1
        split = check_split(spec, tp=tp, pp=pp, vpp=vpp, split=split, task=ck["task"])
        if ep > 1 and (spec.moe is None or spec.moe.num_experts % ep):
            raise InspectError(f"--ep {ep}: " + ("the model has no experts" if spec.moe is None else
                                             f"num_experts={spec.moe.num_experts} is not divisible by ep={ep}"))
        report["layout"] = dict(tp=tp, pp=pp, vpp=vpp, dp=dp, ep=ep, world=tp * pp * dp,
                                stages=rank_params(spec, ck["task"], tp=tp, pp=pp, vpp=vpp, ep=ep, split=split),
                                split=(list(stage_sizes(L, pp, vpp or 1, **split)) if split else None))
    return report


def _layer_pattern(spec) -> str | None:
    """Which layers attend through a sliding window and which see everything (None: no window anywhere)."""
    if spec.sliding_window is None:
        return None
    groups: dict = {}
    for i in range(spec.num_layers):
        groups.setdefault(spec.window(i), []).append(i)

    def layers(ids):
        shown = ", ".join(map(str, ids[:6])) + (", ..." if len(ids) > 6 else "")
        return f"{len(ids)} layer{'s' if len(ids) > 1 else ''} ({shown})"
    parts = [f"window {w} on {layers(ids)}" for w, ids in groups.items() if w is not None]
    if None in groups:
        parts.append(f"full attention on {layers(groups[None])}")
    return "; ".join(parts)


def _blocks(spec) -> str | None:
    """A one-block-per-layer model's pattern (Nemotron-H: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE) and
    its Mamba-2 sizes; None for the others."""
    if not spec.layer_blocks:
        return None
    pattern = "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[k] for k in spec.layer_blocks)
    mb = spec.mamba
    return pattern + (f" (Mamba-2: {mb.num_heads} heads x {mb.head_dim}, {mb.n_groups} groups of B / C x "
                      f"{mb.state_size}, conv {mb.conv_kernel}, chunk {mb.chunk_size})" if mb is not None else "")


def _linear_layers(spec) -> tuple[int, ...]:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5); () otherwise."""
    return spec.linear_attn.layers if spec.linear_attn is not None else ()


def _linear_heads(spec) -> str | None:
    la = spec.linear_attn
    if la is None:
        return None
    return (f"{la.num_key_heads} key heads x {la.key_head_dim}, {la.num_value_heads} value heads x "
            f"{la.value_head_dim}, conv {la.conv_kernel}")


def dsa_facts(spec) -> dict | None:
    """DeepSeek Sparse Attention's indexer (None without one): its heads, top-k, RoPE layout, the layers that
    reuse another layer's selection, its parameters per layer (replicated on every TP rank, frozen; weights_proj
    fp32), and the memory a selection takes per token while it is held (int32 indices, -1 in empty slots: only
    the selections a later shared layer reads are kept, each until its last reader; the blocked scores are
    transient: no [S, S] tensor)."""
    d = spec.dsa
    if d is None:
        return None
    params = d.n_heads * d.head_dim * spec.mla.q_lora_rank + d.head_dim * spec.hidden_size + 2 * d.head_dim \
        + d.n_heads * spec.hidden_size
    return dict(heads=d.n_heads, head_dim=d.head_dim, topk=d.topk,
                rope="interleaved" if d.rope_interleave else "half-split", shared_layers=list(d.shared),
                indexer_layers=sum(spec.has_indexer(i) for i in range(spec.num_layers)),
                params_per_layer=params, selection_bytes_per_token=d.topk * 4)


def v4_facts(spec) -> dict | None:
    """DeepSeek-V4's attention kinds and hyper-connections (None for other families): each layer's kind
    (``S`` sliding window only, ``C`` compressed sparse, ``H`` heavily compressed), the compression rates, the
    indexer, the window, the streams, and which layers route by token id."""
    v4 = spec.v4
    if v4 is None:
        return None
    moe = spec.moe
    return dict(pattern="".join({"sliding": "S", "csa": "C", "hca": "H"}[k] for k in v4.layer_kinds),
                csa_rate=v4.csa_rate, hca_rate=v4.hca_rate, window=v4.sliding_window, index_heads=v4.index_heads,
                index_head_dim=v4.index_head_dim, index_topk=v4.index_topk, hc_mult=v4.hc_mult,
                sinkhorn_iters=v4.hc_sinkhorn_iters, q_lora_rank=v4.q_lora_rank, o_groups=v4.o_groups,
                o_lora_rank=v4.o_lora_rank, rope_dim=v4.rope_dim,
                hash_layers=list(getattr(moe, "hash_layers", ()) or ()))
