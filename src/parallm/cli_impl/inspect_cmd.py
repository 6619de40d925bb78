"""``parallm inspect CHECKPOINT``: what a checkpoint is and how it can be split, without a process group.

Reads config.json and the safetensors headers only (never the tensor bytes): architecture, sizes, parameter
count, dtypes, files; runs the loader's name / shape check against the family's weight table; lists the tp
values the model splits over and the (pp, vpp) pairs its layer count allows; and estimates the parameter memory
each rank holds for a layout (``--tp/--pp/--vpp``), computed from the same weight table and shard functions
the loader uses (on meta tensors: nothing is allocated).
"""

from __future__ import annotations

import os

from .common import CLIError, fmt_bytes, fmt_count, render_table
from .preflight import (ST_DTYPE_BYTES, ST_DTYPE_NAMES, check_split, check_tensors, model_spec, read_config,
                        resolve_task, tensor_table)


def valid_tps(spec) -> list[int]:
    from ..model.spec import check_tp
    out = []
    for tp in range(1, spec.num_heads + 1):
        try:
            check_tp(spec, tp)
        except ValueError:
            continue
        out.append(tp)
    return out


def valid_pipelines(num_layers: int) -> dict[int, list[int]]:
    """pp -> the vpp values (> 1) that split ``num_layers`` evenly (Megatron's interleaving)."""
    from ..model.spec import layer_numbers
    out = {}
    for pp in range(1, num_layers + 1):
        try:
            layer_numbers(num_layers, pp, 1, 0, 0)
        except ValueError:
            continue
        vpps = []
        if pp > 1:
            for vpp in range(2, num_layers // pp + 1):
                try:
                    layer_numbers(num_layers, pp, vpp, 0, 0)
                except ValueError:
                    continue
                vpps.append(vpp)
        out[pp] = vpps
    return out


def rank_params(spec, task: str, *, tp: int, pp: int, vpp: int | None) -> list[dict]:
    """Per pipeline stage: parameters one of its TP ranks holds (every TP rank of a stage holds the same count;
    vocabulary padding included, the tied head copy of the last stage included when pp > 1)."""
    import torch

    from ..model.table import chunk_entries, resolve_shape
    from ..model.sharding import TensorSource, make_shard
    from ..families import family_of
    from ..model.spec import layer_numbers, padded_vocab_size
    table = family_of(spec).table
    vpp = vpp or 1
    padded = padded_vocab_size(spec.vocab_size, tp)
    stages = []
    for pp_rank in range(pp):
        count, layers = 0, []
        for v in range(vpp):
            rng = layer_numbers(spec.num_layers, pp, vpp, pp_rank, v)
            layers.append(f"{rng.start}-{rng.stop - 1}" if len(rng) > 1 else str(rng.start))
            for e in chunk_entries(table, spec, task=task, pp=pp, pre_process=(pp_rank == 0 and v == 0),
                                   post_process=(pp_rank == pp - 1 and v == vpp - 1), layers=rng):
                sources = [TensorSource(torch.empty(resolve_shape(s, spec), device="meta")) for s in e.row.shapes]
                count += make_shard(e.kind, sources, 0, tp, spec, padded).numel()
        stages.append(dict(pp_rank=pp_rank, layers=", ".join(layers), params=count))
    return stages


def inspect_checkpoint(path: str, *, tp: int | None = None, pp: int | None = None, vpp: int | None = None,
                       dp: int | None = None, task: str | None = None) -> dict:
    config = read_config(path)
    spec, family = model_spec(config, path)
    task = resolve_task(config, task)
    tensors = tensor_table(path)
    problem, notes = None, []
    try:
        notes = check_tensors(spec, task, 1, tensors, os.path.abspath(path))
    except CLIError as e:
        problem = str(e)
    files = {}
    for meta in tensors.values():
        files.setdefault(meta["file"], 0)
    for f in files:
        files[f] = os.path.getsize(os.path.join(path, f))
    dtype_counts: dict[str, int] = {}
    total = 0
    for meta in tensors.values():
        n = 1
        for d in meta["shape"]:
            n *= d
        total += n
        name = ST_DTYPE_NAMES.get(meta["dtype"], meta["dtype"])
        dtype_counts[name] = dtype_counts.get(name, 0) + n
    main_dtype = max(dtype_counts, key=dtype_counts.get) if dtype_counts else "float32"
    st_code = {v: k for k, v in ST_DTYPE_NAMES.items()}.get(main_dtype, "F32")
    report = dict(
        path=os.path.abspath(path), architecture=spec.architecture, family=family.name,
        model_type=spec.model_type, task=task,
        config=dict(layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_heads,
                    kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate=spec.intermediate_size,
                    vocab=spec.vocab_size, tied=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias,
                    o_bias=spec.o_bias, mlp_bias=spec.mlp_bias, rope=spec.rope.kind, rope_theta=spec.rope.theta,
                    rms_norm_eps=spec.rms_norm_eps),
        parameters=total, tensors=len(tensors), dtypes=dtype_counts, dtype=main_dtype,
        dtype_bytes=ST_DTYPE_BYTES.get(st_code, 4), files=files, problem=problem, notes=notes,
        valid_tp=valid_tps(spec), pipelines=valid_pipelines(spec.num_layers),
    )
    if any(x is not None for x in (tp, pp, vpp, dp)):
        tp, pp, dp = tp or 1, pp or 1, dp or 1
        vpp = vpp if vpp and vpp > 1 else None
        check_split(spec, tp, pp, vpp)
        report["layout"] = dict(tp=tp, pp=pp, vpp=vpp, dp=dp, world=tp * pp * dp,
                                stages=rank_params(spec, task, tp=tp, pp=pp, vpp=vpp))
    return report


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def render(report: dict) -> str:
    c = report["config"]
    lines = [
        f"checkpoint    {report['path']}",
        f"architecture  {report['architecture']} (family {report['family']}, model_type {report['model_type']}, "
        f"task {report['task']})",
        f"shape         {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads x {c['head_dim']} "
        f"({c['kv_heads']} kv heads), intermediate {c['intermediate']}, vocab {c['vocab']}",
        f"details       tied embeddings {_yes(c['tied'])}; bias qkv {_yes(c['qkv_bias'])} / o {_yes(c['o_bias'])} "
        f"/ mlp {_yes(c['mlp_bias'])}; rope {c['rope']} (theta {c['rope_theta']:g}); rms eps {c['rms_norm_eps']:g}",
        f"parameters    {fmt_count(report['parameters'])} ({report['parameters']:,}) in {report['tensors']} tensors",
        "dtype         " + ", ".join(f"{k} ({fmt_count(v)} params)" for k, v in report["dtypes"].items()),
        f"files         {len(report['files'])} safetensors file(s), {fmt_bytes(sum(report['files'].values()))}:",
    ]
    shown = sorted(report["files"].items())
    for name, size in shown[:8]:
        lines.append(f"                {name}  {fmt_bytes(size)}")
    if len(shown) > 8:
        lines.append(f"                ... and {len(shown) - 8} more")
    if report["problem"]:
        lines.append(f"check         PROBLEM: {report['problem']}")
    else:
        lines.append("check         ok: every tensor the model needs is present with the right shape")
    for n in report["notes"]:
        lines.append(f"note          {n}")

    from ..model.spec import padded_vocab_size
    tps = report["valid_tp"]
    lines.append(f"valid tp      {', '.join(map(str, tps))}  (tp must divide the {c['heads']} query heads, the "
                 f"{c['kv_heads']} kv heads (or be a multiple of them: replicated) and intermediate "
                 f"{c['intermediate']})")
    pads = [f"tp {t}: {padded_vocab_size(c['vocab'], t)}" for t in tps
            if padded_vocab_size(c["vocab"], t) != c["vocab"]]
    if pads:
        lines.append(f"              vocab {c['vocab']} is padded with zero rows (never visible): " + ", ".join(pads))
    reps = [str(t) for t in tps if t > c["kv_heads"]]
    if reps:
        lines.append(f"              kv heads are replicated at tp {', '.join(reps)}")
    pipes = report["pipelines"]
    pp_text = "; ".join(f"pp {p}" + (f" (vpp {', '.join(map(str, v))})" if v else "") for p, v in pipes.items())
    lines.append(f"valid pp/vpp  {pp_text}")
    lines.append(f"              ({c['layers']} layers split evenly: pp x vpp must divide {c['layers']})")

    if "layout" in report:
        lay = report["layout"]
        b = report["dtype_bytes"]
        head = f"tp {lay['tp']} x pp {lay['pp']}" + (f" x vpp {lay['vpp']}" if lay["vpp"] else "") + \
            f" x dp {lay['dp']} = {lay['world']} rank(s)"
        lines.append("")
        lines.append(f"parameter memory per rank, {head}:")
        same = report["dtype"] == "float32"
        rows = []
        for st in lay["stages"]:
            n = st["params"]
            rows.append([str(st["pp_rank"]), st["layers"], fmt_count(n)]
                        + ([] if same else [fmt_bytes(n * b)]) + [fmt_bytes(n * 4), fmt_bytes(n * (4 + 4 + 8))])
        headers = ["pp rank", "layers", "params"] + ([] if same else [f"as {report['dtype']}"]) + [
            "as float32", "fp32 + grads + Adam"]
        lines.append(render_table(headers, rows, right=set(range(2, len(headers)))))
        lines.append("(every TP rank of a stage holds the same; data-parallel replicas hold a full copy each. "
                     "Training adds 4 B/param fp32 gradients and 8 B/param Adam moments (last column), plus an "
                     "fp32 master copy (4 B/param) when training in bf16, plus activations.)")
    return "\n".join(lines)
