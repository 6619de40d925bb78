"""``parallm inspect CHECKPOINT``: renders :func:`parallm.inspect_checkpoint`'s report (the library call,
``parallm.api.inspect``: what a checkpoint is and how it can be split, without a process group)."""

from __future__ import annotations


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


# -- the report is the library's (parallm.api.inspect); here it is rendered --------------------------------------


def read_checkpoint(path: str, *, task: str | None, pp: int = 1) -> dict:
    """:func:`parallm.api.inspect.read_checkpoint`, its errors as CLIError (``error: ...``, exit 1)."""
    from ..api.inspect import InspectError, read_checkpoint as read
    try:
        return read(path, task=task, pp=pp)
    except InspectError as e:
        raise CLIError(str(e)) from None


def check_split(spec, **kwargs):
    """:func:`parallm.api.inspect.check_split`, its errors as CLIError."""
    from ..api.inspect import InspectError, check_split as check
    try:
        return check(spec, **kwargs)
    except InspectError as e:
        raise CLIError(str(e)) from None


def inspect_checkpoint(path: str, **kwargs) -> dict:
    """:func:`parallm.inspect_checkpoint`, its errors as CLIError."""
    from ..api.inspect import InspectError, inspect_checkpoint as inspect
    try:
        return inspect(path, **kwargs)
    except InspectError as e:
        raise CLIError(str(e)) from None


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


def _rope(c: dict) -> str:
    """"rope default (theta 10000)", with "rotary 8 of 16 channels" when partial; "no rope (no positional
    embedding)" (Nemotron-H's attention); then the q / k norm when there is one."""
    if c["rope"] == "none":
        return "no rope (no positional embedding)"
    rot = c.get("rotary_dim")
    partial = f", rotary {rot} of {c['head_dim']} channels" if rot is not None and rot != c["head_dim"] else ""
    norm = {"per head": "; qk norm per head", "whole projection": "; qk norm over the whole projection (all heads)"}
    per_type = "; full layers' head dim " + str(c["global_head_dim"]) if c.get("global_head_dim") else ""
    return f"rope {c['rope']} (theta {c['rope_theta']:g}{partial}{per_type})" + norm.get(c.get("qk_norm"), "")


def render(report: dict) -> str:
    from ..model.spec import padded_vocab_size
    c, yes = report["config"], {True: "yes", False: "no"}
    lines = [
        f"checkpoint    {report['path']}",
        f"architecture  {report['architecture']} (family {report['family']}, model_type {report['model_type']}, "
        f"task {report['task']})",
        f"shape         {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads x {c['head_dim']} "
        f"({c['kv_heads']} kv heads), intermediate {c['intermediate']}, vocab {c['vocab']}",
        f"details       tied embeddings {yes[c['tied']]}; bias qkv {yes[c['qkv_bias']]} / o {yes[c['o_bias']]} / "
        f"mlp {yes[c['mlp_bias']]}; {_rope(c)}; rms eps {c['rms_norm_eps']:g}",
        *([f"layers        {c['layer_pattern']}" + ("; a learned attention sink per head" if c.get("sinks") else "")]
          if c.get("layer_pattern") else (["layers        a learned attention sink per head"] if c.get("sinks")
                                          else [])),
        *([f"blocks        {c['blocks']}"] if c.get("blocks") else []),
        *([f"hybrid        Gated DeltaNet layers {c['linear_layers']} ({c['linear_heads']}); full attention "
           f"(output-gated) on the other {c['layers'] - len(c['linear_layers'])}"] if c.get("linear_layers") else []),
        *([_dsa_line(c["sparse_attention"])] if c.get("sparse_attention") else []),
        *(_v4_lines(c["deepseek_v4"]) if c.get("deepseek_v4") else []),
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
                                           else "")
                 + (", and the Mamba-2 heads and groups" if c.get("blocks") and "Mamba-2" in c["blocks"] else "")
                 + ")")
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
    lines += _refused_lines(report.get("refused_pipelines") or [])
    lines += _moe_lines(report) + _memory_lines(report)
    return "\n".join(lines)


def _refused_lines(refused: list) -> list[str]:
    """The even pp / vpp splits build_model refuses for the layers they separate, each with the layers named (the
    first clause of build_model's message: ``layer 6 reuses the keys / values of layer 4 ...``)."""
    if not refused:
        return []
    lines = ["refused       even splits that put a layer and the layer it reuses in different stages (build_model "
             "refuses them; keep the pair together with --layers-per-stage):"]
    for r in refused:
        split = f"pp {r['pp']}" + (f" x vpp {r['vpp']}" if r["vpp"] > 1 else "")
        lines.append(f"                {split}: {r['reason'].split(', which another pipeline stage holds')[0]}")
    return lines


def _moe_lines(report: dict) -> list[str]:
    """The experts' lines of :func:`render` (none for a dense model)."""
    lines = []
    moe = report.get("moe")
    if moe:
        shared = f", shared expert {moe['shared_width']} wide" if moe["shared_width"] else ""
        lines.append(f"experts       {moe['experts']} per MoE layer ({moe['layers']} layers), top-{moe['top_k']}, "
                     f"{moe['expert_width']} wide{shared}; {moe['tensors_per_layer']} parameter tensors per MoE "
                     "layer (each rank's experts stacked per projection)"
                     + ("; beside the layer's dense MLP, router on the residual (Gemma 4)" if moe.get("beside_mlp")
                        else ""))
        fmt = ("MXFP4 in the checkpoint (FP4 values, a power-of-two scale per 32; dequantised on load into "
               f"{report['dtype']})" if "mxfp4" in report["dtypes"] else
               "compressed-tensors INT4 pack-quantized in the checkpoint (8 int4 values per int32 word, a scale per "
               f"group; dequantised on load into {report['dtype']})" if "int4" in report["dtypes"] else report["dtype"])
        extras = [x for x, on in (("router bias", moe.get("router_bias")), ("expert biases", moe.get("expert_bias")),
                                  (moe.get("activation"), moe.get("activation") not in (None, "silu"))) if on]
        lines.append(f"expert format {fmt}" + (f"; {', '.join(extras)}" if extras else ""))
        how = "torch._grouped_mm" if moe["kernel"] == "grouped_mm" else "a loop over the experts"
        lines.append(f"expert GEMMs  {how} on {moe['device']} in {report['dtype']}"
                     + (f" ({moe['kernel_note']})" if moe["kernel_note"] else ""))
    return lines


def _memory_lines(report: dict) -> list[str]:
    """The per-rank parameter memory table of :func:`render` (when a layout was given)."""
    from ..verify import render_table
    lines = []
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
    return lines


def _dsa_line(d: dict) -> str:
    shared = f"; layers {d['shared_layers']} reuse the previous full layer's selection" if d["shared_layers"] else ""
    return (f"sparse attn   DeepSeek Sparse Attention: indexer {d['heads']} heads x {d['head_dim']} ({d['rope']} "
            f"RoPE), top-{d['topk']} keys per query on {d['indexer_layers']} layers{shared}; indexer "
            f"{_count(d['params_per_layer'])} params per layer, replicated over TP, frozen; a selection takes "
            f"{d['selection_bytes_per_token']} bytes per token (int32), held only until the last shared layer "
            "that reads it")


def _v4_lines(d: dict) -> list[str]:
    """DeepSeek-V4's layer kinds and hyper-connections, for a newcomer who has not read the paper."""
    hashed = f"; layers {d['hash_layers']} pick experts from the token id (hash routing)" if d["hash_layers"] else ""
    return [f"attention     DeepSeek-V4, per layer {d['pattern']}: S = a sliding window of {d['window']} keys only; "
            f"C = that plus compressed sparse attention (every {d['csa_rate']} tokens pooled into one key, the "
            f"indexer's top-{d['index_topk']} of them per query, {d['index_heads']} indexer heads x "
            f"{d['index_head_dim']}); H = the window plus heavily compressed attention (every {d['hca_rate']} "
            "tokens pooled, all visible ones attended); one key = value head, a sink per head, q-LoRA "
            f"{d['q_lora_rank']}, output in {d['o_groups']} groups of rank {d['o_lora_rank']}, RoPE on the last "
            f"{d['rope_dim']} channels",
            f"residual      {d['hc_mult']} hyper-connection streams mixed around every block (Sinkhorn "
            f"{d['sinkhorn_iters']} steps), collapsed before the final norm{hashed}"]
