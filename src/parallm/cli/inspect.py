"""``parallm inspect CHECKPOINT``: what a checkpoint is and how it can be split, without a process group.

Reads config.json and the safetensors headers only (never the tensor bytes) and runs the loader's own name /
shape check (``check_checkpoint`` against the family's weight table), so it cannot disagree with the loader;
``parallm verify`` runs the same checks (:func:`read_checkpoint`, :func:`check_split`) before it starts any rank.
The parameter memory per rank for ``--tp/--pp/--vpp`` comes from the same weight table and shard functions the
loader uses, run on meta tensors (nothing is allocated).
"""

from __future__ import annotations

import math
import os

from .errors import EXIT_FAIL, EXIT_OK, CLIError, UsageError
from .options import Formatter, add_revision, add_split_options, para, positive, resolve_path, split_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect", formatter_class=Formatter, help="describe a checkpoint and its valid layouts",
        description=para("Describe CHECKPOINT from config.json and the safetensors headers (tensor bytes are not "
                         "read): architecture, sizes, parameter count, dtypes, files, whether every tensor the "
                         "model needs is there with the right shape, the valid tp values and (pp, vpp) pairs, and "
                         "with --tp / --pp / --vpp the parameter memory each rank holds. Starts no processes.")
        + "\n\nsupported architectures: {architectures}",
        epilog="exit codes: 0 fine; 1 the checkpoint has a problem or cannot be read, or the layout does not "
               "split; 2 bad command line.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="Hugging Face checkpoint directory, or a Hub id (org/name) in the local Hugging Face cache "
                        "(HF_HUB_CACHE / HF_HOME; never downloaded)")
    add_revision(p)
    p.add_argument("--tp", type=positive, help="estimate memory per rank for this tensor-parallel size")
    p.add_argument("--pp", type=positive, help="... and this many pipeline stages")
    p.add_argument("--vpp", type=positive, help="... and this many virtual stages per pipeline rank")
    p.add_argument("--dp", type=positive, help="... and this many data-parallel replicas (sets the world size)")
    p.add_argument("--ep", type=positive, help="... and this many expert-parallel ranks (mixture of experts; "
                                               "divides --dp)")
    add_split_options(p)
    p.add_argument("--task", choices=("auto", "causal_lm", "value"), default="auto",
                   help="count a value head instead of the lm head (default: from the config)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run)


def run(args) -> int:
    import json
    if args.vpp and args.vpp > 1 and not (args.pp and args.pp > 1):
        raise UsageError(f"--vpp {args.vpp} needs --pp > 1 (virtual stages interleave a pipeline)")
    if args.ep and args.ep > 1 and (args.dp or 1) % args.ep:
        raise UsageError(f"--ep {args.ep} must divide --dp {args.dp or 1} (experts are split over data-parallel "
                         "ranks)")
    split = split_kwargs(args)
    report = inspect_checkpoint(resolve_path(args.checkpoint, args.revision), tp=args.tp, pp=args.pp, vpp=args.vpp,
                                dp=args.dp, ep=args.ep,
                                task=None if args.task == "auto" else args.task, split=split)
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return EXIT_FAIL if report["problem"] else EXIT_OK


# -- reading a checkpoint (shared with verify's preflight) ------------------------------------------------------


def read_checkpoint(path: str, *, task: str | None, pp: int = 1) -> dict:
    """config.json, family, task and every tensor's header, checked as the loader checks them (for ``pp``
    stages). Raises CLIError naming what cannot be read; missing / unexpected / mis-shaped tensors land in
    ``problem`` instead (``inspect`` still describes such a checkpoint)."""
    from ..api import resolve_task, with_mtp
    from ..checkpoint.hf_dir import SAFETENSORS_DTYPES, HFCheckpoint
    from ..checkpoint.loader import check_checkpoint
    from ..model.table import all_entries, expected_hf_shapes, fused_layout
    from ..families import load_config, spec_from_config
    if not os.path.isdir(path):
        raise CLIError(f"{path} does not exist" if not os.path.exists(path) else
                       f"{path} is not a directory (give the checkpoint directory, the one with config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CLIError(f"{path} has no config.json (is it a Hugging Face checkpoint directory?)")
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
        raise CLIError(str(e)) from None
    problem, notes, shapes = None, [], {k: v["shape"] for k, v in tensors.items()}
    try:
        shapes, packed = _mxfp4_shapes(shapes, types, config, tensors, os.path.abspath(path))
        if packed:
            notes.append(f"{len(packed)} expert tensors are MXFP4 (*_blocks / *_scales): dequantised on load, each "
                         "rank only its own experts' slice; saves write the model's dtype")
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


def check_split(spec, *, tp: int, pp: int, vpp: int | None, split: dict | None = None,
                task: str = "causal_lm") -> dict | None:
    """The loader's own split checks, as a CLIError: tp over heads / KV heads / MLP, layers over pp x vpp (evenly,
    or as ``split``, ``build_model``'s pipeline-split keywords, says). Returns ``split`` with
    ``layers_per_stage="balanced"`` replaced by build_model's counts for ``task``."""
    from ..model.spec import check_tp
    from ..parallel.stages import stage_sizes
    try:
        check_tp(spec, tp)
        if split and split.get("layers_per_stage") == "balanced":     # build_model's own split
            from ..api import balanced_layers_per_stage
            split = dict(split, layers_per_stage=balanced_layers_per_stage(spec, task=task, pp=pp, vpp=vpp or 1))
        stage_sizes(spec.num_layers, pp, vpp or 1, **(split or {}))
    except ValueError as e:
        raise CLIError(str(e)) from None
    return split


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
    sizes = (spec.hidden_size, 2 * width, width)
    kernel = expert_kernel(device, torch_dtype, sizes) if width else "loop"
    activation = moe.activation if moe.activation == "silu" else \
        f"clamped SwiGLU (limit {moe.swiglu_limit:g}, alpha {moe.swiglu_alpha:g})"
    return dict(experts=moe.num_experts, top_k=moe.top_k, layers=len(moe.layers),
                expert_width=moe.expert_intermediate_size, shared_width=moe.shared_expert_intermediate_size,
                tensors_per_layer=3 + int(moe.score_bias) + int(moe.router_bias) + 2 * int(moe.expert_bias)
                + (2 + int(moe.shared_expert_gate) if moe.shared_expert_intermediate_size else 0),
                router=moe.router, router_bias=moe.router_bias, expert_bias=moe.expert_bias, activation=activation,
                kernel=kernel, device=device,
                kernel_note=(grouped_mm_support(device, torch_dtype, sizes) if width else
                             f"moe_intermediate_size {moe.expert_intermediate_size} does not split over tp={tp}"))


def inspect_checkpoint(path: str, *, tp=None, pp=None, vpp=None, dp=None, ep=None, task=None,
                       split: dict | None = None) -> dict:
    """The report ``parallm inspect`` prints (see the module docstring); ``split``: ``build_model``'s
    pipeline-split keywords for the per-rank memory of ``tp`` / ``pp`` / ``vpp``."""
    from ..model.spec import check_tp
    from ..parallel.stages import layer_numbers, stage_sizes
    ck = read_checkpoint(path, task=task)
    spec, tensors, L = ck["spec"], ck["tensors"], ck["spec"].num_layers
    files = {t["file"]: os.path.getsize(os.path.join(path, t["file"])) for t in tensors.values()}
    dtypes, itemsize = {}, {}
    for t in tensors.values():
        n = 1
        for d in t["shape"]:
            n *= d
        dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + n
        itemsize[t["dtype"]] = t["itemsize"]
    # the dtype the model loads into: the unquantised tensors' (MXFP4 experts are dequantised into it)
    plain = {k: v for k, v in dtypes.items() if k != "mxfp4"}
    main = max(plain, key=plain.get) if plain else "float32"
    report = dict(
        path=os.path.abspath(path), architecture=spec.architecture, family=ck["family"].name,
        model_type=spec.model_type, task=ck["task"],
        config=dict(layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, intermediate=spec.intermediate_size, vocab=spec.vocab_size,
                    tied=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, mlp_bias=spec.mlp_bias,
                    rope="yarn" if spec.yarn is not None else spec.rope.kind, rope_theta=spec.rope.theta,
                    rms_norm_eps=spec.rms_norm_eps, latent_attention=spec.mla is not None,
                    mtp_layers=spec.carried_mtp_layers, linear_layers=list(_linear_layers(spec)),
                    linear_heads=_linear_heads(spec), carried=len(spec.carried),
                    carried_parameters=sum(math.prod(shape) for _, shape in spec.carried),
                    mtp_tensors=len(spec.carried_mtp),
                    mtp_parameters=sum(math.prod(shape) for _, shape in spec.carried_mtp),
                    layer_pattern=_layer_pattern(spec), sinks=spec.attn_sinks),
        parameters=sum(dtypes.values()), tensors=len(tensors), dtypes=dtypes, dtype=main,
        dtype_bytes=itemsize.get(main, 4), files=files, problem=ck["problem"], notes=ck["notes"],
        valid_tp=[tp for tp in range(1, spec.num_heads + 1) if _splits(check_tp, spec, tp)],
        # pp -> the vpp values (> 1) that split the layers evenly (Megatron's interleaving)
        pipelines={pp: [v for v in range(2, L // pp + 1) if pp > 1 and _splits(layer_numbers, L, pp, v, 0, 0)]
                   for pp in range(1, L + 1) if _splits(layer_numbers, L, pp, 1, 0, 0)})
    report["moe"] = moe_facts(spec, dtype=main, tp=tp or 1)
    if any(x is not None for x in (tp, pp, vpp, dp, ep)):
        tp, pp, dp, vpp, ep = tp or 1, pp or 1, dp or 1, vpp if vpp and vpp > 1 else None, ep or 1
        split = check_split(spec, tp=tp, pp=pp, vpp=vpp, split=split, task=ck["task"])
        if ep > 1 and (spec.moe is None or spec.moe.num_experts % ep):
            raise CLIError(f"--ep {ep}: " + ("the model has no experts" if spec.moe is None else
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


def _linear_layers(spec) -> tuple[int, ...]:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5); () otherwise."""
    return spec.linear_attn.layers if spec.linear_attn is not None else ()


def _linear_heads(spec) -> str | None:
    la = spec.linear_attn
    if la is None:
        return None
    return (f"{la.num_key_heads} key heads x {la.key_head_dim}, {la.num_value_heads} value heads x "
            f"{la.value_head_dim}, conv {la.conv_kernel}")


def _count(n: int) -> str:
    for div, unit in ((1e9, " B"), (1e6, " M"), (1e3, " K")):
        if n >= div:
            return f"{n / div:.{1 if unit == ' K' else 2}f}{unit}"
    return str(n)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def render(report: dict) -> str:
    from ..model.spec import padded_vocab_size
    from ..verify import render_table
    c, yes = report["config"], {True: "yes", False: "no"}
    lines = [
        f"checkpoint    {report['path']}",
        f"architecture  {report['architecture']} (family {report['family']}, model_type {report['model_type']}, "
        f"task {report['task']})",
        f"shape         {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads x {c['head_dim']} "
        f"({c['kv_heads']} kv heads), intermediate {c['intermediate']}, vocab {c['vocab']}",
        f"details       tied embeddings {yes[c['tied']]}; bias qkv {yes[c['qkv_bias']]} / o {yes[c['o_bias']]} / "
        f"mlp {yes[c['mlp_bias']]}; rope {c['rope']} (theta {c['rope_theta']:g}); rms eps {c['rms_norm_eps']:g}",
        *([f"layers        {c['layer_pattern']}" + ("; a learned attention sink per head" if c.get("sinks") else "")]
          if c.get("layer_pattern") else (["layers        a learned attention sink per head"] if c.get("sinks")
                                          else [])),
        *([f"hybrid        Gated DeltaNet layers {c['linear_layers']} ({c['linear_heads']}); full attention "
           f"(output-gated) on the other {c['layers'] - len(c['linear_layers'])}"] if c.get("linear_layers") else []),
        *([f"carried       {c['carried']} tensors ({_count(c['carried_parameters'])} params: the vision tower) held "
           "on the first stage, loaded, saved and exported unchanged, never run nor trained"]
          if c.get("carried") else []),
        *([f"mtp           {c['mtp_tensors']} multi-token-prediction tensors ({_count(c['mtp_parameters'])} params, "
           "mtp.*) held replicated on the last stage, loaded, saved and exported unchanged, never run nor trained"]
          if c.get("mtp_tensors") else []),
        f"parameters    {_count(report['parameters'])} ({report['parameters']:,}) in {report['tensors']} tensors",
        "dtype         " + ", ".join(f"{k} ({_count(v)} params)" for k, v in report["dtypes"].items()),
        f"files         {len(report['files'])} safetensors file(s), {_bytes(sum(report['files'].values()))}:",
    ]
    shown = sorted(report["files"].items())
    lines += [f"                {name}  {_bytes(size)}" for name, size in shown[:8]]
    if len(shown) > 8:
        lines.append(f"                ... and {len(shown) - 8} more")
    lines.append(f"check         PROBLEM: {report['problem']}" if report["problem"] else
                 "check         ok: every tensor the model needs is present with the right shape")
    lines += [f"note          {n}" for n in report["notes"]]
    tps = report["valid_tp"]
    lines.append(f"valid tp      {', '.join(map(str, tps))}  (tp must divide the {c['heads']} query heads, the "
                 f"{c['kv_heads']} kv heads (or be a multiple of them: replicated) and intermediate "
                 f"{c['intermediate']}" + (", and the Gated DeltaNet key and value heads" if c.get("linear_layers")
                                           else "") + ")")
    pads = [f"tp {t}: {padded_vocab_size(c['vocab'], t)}" for t in tps
            if padded_vocab_size(c["vocab"], t) != c["vocab"]]
    if pads:
        lines.append(f"              vocab {c['vocab']} is padded with zero rows (never visible): " + ", ".join(pads))
    reps = [str(t) for t in tps if t > c["kv_heads"]]
    if reps:
        lines.append(f"              kv heads are replicated at tp {', '.join(reps)}")
    lines.append("valid pp/vpp  " + "; ".join(f"pp {p}" + (f" (vpp {', '.join(map(str, v))})" if v else "")
                                            for p, v in report["pipelines"].items()))
    lines.append(f"              ({c['layers']} layers split evenly: pp x vpp must divide {c['layers']}; other pp "
                 "with --layers-per-stage or --num-layers-in-first/last-pipeline-stage)")
    moe = report.get("moe")
    if moe:
        shared = f", shared expert {moe['shared_width']} wide" if moe["shared_width"] else ""
        lines.append(f"experts       {moe['experts']} per MoE layer ({moe['layers']} layers), top-{moe['top_k']}, "
                     f"{moe['expert_width']} wide{shared}; {moe['tensors_per_layer']} parameter tensors per MoE "
                     "layer (each rank's experts stacked per projection)")
        fmt = ("MXFP4 in the checkpoint (FP4 values, a power-of-two scale per 32; dequantised on load into "
               f"{report['dtype']})" if "mxfp4" in report["dtypes"] else report["dtype"])
        extras = [x for x, on in (("router bias", moe.get("router_bias")), ("expert biases", moe.get("expert_bias")),
                                  (moe.get("activation"), moe.get("activation") not in (None, "silu"))) if on]
        lines.append(f"expert format {fmt}" + (f"; {', '.join(extras)}" if extras else ""))
        how = "torch._grouped_mm" if moe["kernel"] == "grouped_mm" else "a loop over the experts"
        lines.append(f"expert GEMMs  {how} on {moe['device']} in {report['dtype']}"
                     + (f" ({moe['kernel_note']})" if moe["kernel_note"] else ""))
    if "layout" in report:
        lay, b, fp32 = report["layout"], report["dtype_bytes"], report["dtype"] == "float32"
        lines.append(f"\nparameter memory per rank, tp {lay['tp']} x pp {lay['pp']}"
                     + (f" x vpp {lay['vpp']}" if lay["vpp"] else "") + f" x dp {lay['dp']}"
                     + (f" (ep {lay['ep']})" if lay["ep"] > 1 else "") + f" = {lay['world']} rank(s):")
        rows = [[str(st["pp_rank"]), st["layers"], _count(st["params"])]
                + ([] if fp32 else [_bytes(st["params"] * b)]) + [_bytes(st["params"] * 4), _bytes(st["params"] * 16)]
                for st in lay["stages"]]
        headers = ["pp rank", "layers", "params"] + ([] if fp32 else [f"as {report['dtype']}"]) + [
            "as float32", "fp32 + grads + Adam"]
        lines.append(render_table(headers, rows, right=set(range(2, len(headers)))))
        lines.append("(every TP rank of a stage holds the same; data-parallel replicas hold a full copy each. "
                     "Training adds 4 B/param fp32 gradients and 8 B/param Adam moments (last column), plus an "
                     "fp32 master copy (4 B/param) when training in bf16, plus activations.)")
    return "\n".join(lines)
