"""One layout checked against transformers, on every rank of an initialised world.

    1. ``init_parallel(tp, pp, vpp, cp)``; build the model (fp32, whatever the checkpoint's dtype: the check is about
       the weight mapping) and load the checkpoint (timed: "load_s").
    2. Gather the weights back (``save_hf_weights``) and compare them bit for bit with what transformers loads
       from the same checkpoint ("roundtrip").
    3. ``parallm.forward`` on :func:`padded_batch` rows (full, left-, right-, both-sides-padded) against
       transformers (fp32, eager attention, the same position_ids) at the real positions ("d_out").
    4. One SGD step: ``forward_backward`` + ``finalize_grads`` + ``p -= lr * p.grad`` against the same step on the
       transformers model: loss ("d_loss"), every weight ("d_weights") and the output after the step ("d_after").
    5. ``save_hf_weights(chunks, dir)`` (timed: "save_s"); transformers reloads the directory and must hold
       exactly the weights parallm gathered ("reload").

transformers runs on global rank 0 only; every comparison happens there. What a rank does alone (reading the
config, the reference) goes through :func:`parallm.parallel.errors.run_local`, so a failure anywhere becomes the
same error on every rank instead of a hang.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.state import group_device
from . import TOLERANCES
from ..checkpoint.hf_dir import HFCheckpoint
from ..model.params import grad_of, zero_grads
from .reference import (check_dtype, loss_for, max_diff_real, padded_batch, reference, reload_check,
                        sgd_step, stepped_difference)


@dataclass
class Check:
    """One layout check (picklable: launchers send it to the ranks). ``dp`` None: world / (tp x cp x pp); a given
    dp must match the world. ``lr`` None: chosen from transformers' gradients (see :func:`reference`)."""
    ckpt: str
    save_dir: str | None = None   # where the stepped model is saved (new or empty); required by check_layout
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int | None = None
    ep: int = 1                   # expert parallelism (mixture-of-experts models), carved out of dp x cp
    cp: int = 1                   # context parallelism: every rank of a CP group passes the same batch
    cp_attn: str = "auto"         # its attention (build_model's cp_attn)
    dtype: str = "float32"        # the parameters' dtype ("float32" or "bfloat16"); transformers runs in it too
    split: dict | None = None     # build_model's pipeline-split keywords (layers_per_stage=[...] or "balanced", ...)
    packed: bool = False
    sequence_parallel: bool = False
    task: str | None = None       # None: from the checkpoint's architectures
    mode: str = "auto"            # load_hf_weights mode
    microbatches: int = 1
    label: str = ""               # the model's name in the results
    batch: int = 4                # rounded up to a multiple of dp x microbatches
    seq: int = 16
    seed: int = 0
    lr: float | None = None
    atol: float | None = None             # None: by dtype (parallm.verify.TOLERANCES)
    weights_atol: float | None = None
    timeout_s: float | None = None

    def tolerances(self) -> tuple[float, float]:
        """(outputs and loss, weights after the step): the given ones, else the dtype's defaults."""
        atol, weights_atol = TOLERANCES.get(self.dtype, TOLERANCES["float32"])
        return (atol if self.atol is None else self.atol,
                weights_atol if self.weights_atol is None else self.weights_atol)

    def name(self, dp: int | None = None) -> str:
        """"tp2 pp2 vpp2 dp2 packed+SP value broadcast": the parts that differ from the defaults."""
        dp = dp or self.dp or 1
        parts = [f"tp{self.tp}"] + [f"{k}{v}" for k, v in (("cp", self.cp), ("pp", self.pp), ("vpp", self.vpp or 1),
                                                            ("dp", dp), ("ep", self.ep)) if v > 1]
        if self.sequence_parallel or self.packed:
            parts.append("packed+SP" if self.sequence_parallel else "packed")
        if self.task == "value":
            parts.append("value")
        if self.cp > 1 and self.cp_attn != "auto":
            parts.append(self.cp_attn)
        if self.dtype != "float32":
            parts.append({"bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype))
        for key, value in (self.split or {}).items():
            if value is not None:
                short = {"num_layers_in_first_pipeline_stage": "first", "num_layers_in_last_pipeline_stage": "last",
                         "layers_per_stage": "split"}.get(key, key)
                parts.append(f"{short} {value if isinstance(value, (int, str)) else ','.join(map(str, value))}")
        return " ".join(parts + ([self.mode] if self.mode != "auto" else []))


def _broadcast(value):
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _timed(t0: float) -> float:
    dist.barrier()
    return time.perf_counter() - t0


def check_layout(check: Check, *, progress=lambda msg: None) -> dict | None:
    """Run ``check`` on every rank (torch.distributed initialised; Megatron's groups are (re)made here). Returns
    the result row on global rank 0 (``ok``, ``d_out``, ``d_loss``, ``d_weights``, ``d_after``, ``roundtrip``,
    ``reload``, ``load_s``, ``save_s``, ``lr``, ``notes``, ...), None elsewhere."""
    import parallm
    from ..parallel.errors import run_local
    from ..parallel.state import current_dims

    world = dist.get_world_size()
    if check.dp and world != check.tp * check.cp * check.pp * check.dp:
        cp = f" x cp={check.cp}" if check.cp > 1 else ""
        raise ValueError(f"the world has {world} rank(s), not tp={check.tp}{cp} x pp={check.pp} x dp={check.dp} = "
                         f"{check.tp * check.cp * check.pp * check.dp}")
    parallm.init_parallel(tp=check.tp, pp=check.pp, vpp=check.vpp, cp=check.cp, ep=check.ep,
                          timeout_s=check.timeout_s)
    dims = current_dims()
    rank0, dp = dims.rank == 0, dims.dp
    row = dict(layout=check.name(dp), model=check.label)
    device = group_device()
    chunks, dtype = _build_and_load(check, row, rank0, device)
    pre = parallm.save_hf_weights(chunks)
    spec, task = chunks[0].spec, chunks[0].task
    mtp = run_local(lambda pre=pre: _split_mtp(pre, spec, check.ckpt, dtype) if rank0 else None,
                    what="checking the multi-token-prediction tensors")
    pieces = dp * check.microbatches
    batch = -(-check.batch // pieces) * pieces
    ids, mask = padded_batch(spec.vocab_size, batch=batch, seq=check.seq, seed=check.seed)
    ref = run_local(lambda pre=pre: reference(check.ckpt, task, ids=ids, mask=mask, pre=pre,
                                              pieces=pieces, lr=check.lr, device=device, dtype=dtype)
                    if rank0 else None, what="the transformers reference")
    del pre
    new = _step_and_compare(check, chunks, ids, mask, ref, mtp, row, rank0, dims, dtype)
    del ref
    reloaded = _save_and_reload(check, chunks, new, mtp, row, rank0, dtype)
    del chunks, new
    gc.collect()
    if not rank0:
        return None
    return _finish_row(check, row, reloaded, mtp, task, progress)


def _build_and_load(check: Check, row: dict, rank0: bool, device):
    """The model of ``check`` built and loaded (``row`` gets ``layers``, ``load_s``, ``load_mode``); returns
    (chunks, dtype)."""
    import parallm
    from ..families import load_config
    from ..parallel.errors import run_local
    ckpt = check.ckpt
    # The config travels from rank 0, so ranks that cannot see the directory (other nodes) still build the model;
    # the loader then streams their shards from rank 0 (mode auto -> broadcast).
    raw = _broadcast(run_local(lambda: load_config(ckpt)._raw if rank0 else None, what="reading config.json"))
    # When every rank sees the directory the model is built from it, so that multi-token-prediction tensors the
    # checkpoint holds are carried (build_model's mtp=None); they are checked against the checkpoint's bytes,
    # transformers having none to compare with.
    seen = torch.tensor([int(os.path.isdir(ckpt))], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    t0 = time.perf_counter()
    dist.barrier()
    dtype = check_dtype(check.dtype)
    chunks = parallm.build_model(ckpt if seen.item() else raw, task=check.task,
                                 packed=check.packed or check.sequence_parallel,
                                 sequence_parallel=check.sequence_parallel, dtype=dtype,
                                 cp_attn=check.cp_attn, **(check.split or {}))
    split = chunks[0].dims.layer_split      # the layers per virtual stage (None: the even split)
    row["layers"] = list(split) if split is not None else None
    report = parallm.load_hf_weights(chunks, ckpt, mode=check.mode)
    row.update(load_s=_timed(t0), load_mode=report.mode)
    return chunks, dtype


def _step_and_compare(check: Check, chunks, ids, mask, ref, mtp, row, rank0: bool, dims, dtype) -> dict:
    """``forward`` against the reference, one SGD step (this replica's rows), ``forward`` again and the weights
    after it (into ``row`` on rank 0); returns ``save_hf_weights`` after the step (rank 0; {} elsewhere)."""
    import parallm
    lr = _broadcast(ref["lr"] if rank0 else None)
    out = parallm.forward(chunks, ids, mask)
    if rank0:
        row["d_out"] = max_diff_real(out, ref["out"], mask)
    del out
    per = ids.shape[0] // dims.dp
    mine = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    loss = parallm.forward_backward(chunks, ids[mine], mask[mine], loss_fn=loss_for(chunks[0].task),
                                    num_microbatches=check.microbatches)
    parallm.finalize_grads(chunks)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                g = grad_of(p)           # bf16 parameters: the fp32 main_grad
                if g is not None:
                    p.copy_(sgd_step(p, g, lr))
        zero_grads(chunks)
    after = parallm.forward(chunks, ids, mask)
    new = parallm.save_hf_weights(chunks)
    if rank0:
        moved = [k for k in mtp["tensors"] if not torch.equal(new.pop(k), mtp["tensors"][k])]
        if moved:
            mtp["problems"].append(f"changed by the step: {', '.join(moved[:3])}")
        d_weights, what = stepped_difference(new, ref["stepped"], dtype)
        row.update(d_loss=abs(loss.item() - ref["loss"]), d_after=max_diff_real(after, ref["after"], mask),
                   d_weights=d_weights, lr=ref["lr"], update=ref["update"], loss=ref["loss"],
                   roundtrip=ref["roundtrip"], near_ties=ref["near_ties"],
                   notes=ref["notes"] + ([f"after the step: {what}"] if d_weights == float("inf") else []))
    return new


def _save_and_reload(check: Check, chunks, new, mtp, row, rank0: bool, dtype):
    """``save_hf_weights`` into ``check.save_dir`` (``row["save_s"]``), transformers reloading it on rank 0, the
    multi-token-prediction tensors saved as loaded. Returns the reload's (ok, problem) on rank 0."""
    import parallm
    from ..parallel.errors import run_local
    t0 = time.perf_counter()
    dist.barrier()
    parallm.save_hf_weights(chunks, check.save_dir, overwrite=True)
    row["save_s"] = _timed(t0)
    reloaded = run_local(lambda: reload_check(check.save_dir, chunks[0].task, saved=new, dtype=dtype)
                         if rank0 else None, what="reloading the saved directory with transformers")
    if rank0 and mtp["tensors"]:
        saved = HFCheckpoint(check.save_dir)
        lost = [k for k, v in mtp["tensors"].items() if k not in saved.weight_map
                or not torch.equal(saved.source(k).read(0, 0, v.shape[0]), v)]
        if lost:
            mtp["problems"].append(f"not saved as loaded: {', '.join(lost[:3])}")
    return reloaded


def _finish_row(check: Check, row: dict, reloaded, mtp, task: str, progress) -> dict:
    """Rank 0's result row: the reload, tolerances and the verdict."""
    row["reload"], problem = reloaded
    if problem:
        row["notes"].append(f"reload: {problem}")
    atol, weights_atol = check.tolerances()
    row.update(task=task, save_dir=check.save_dir, atol=atol, weights_atol=weights_atol, dtype=check.dtype,
               mtp_tensors=len(mtp["tensors"]), mtp_ok=not mtp["problems"])
    row["notes"] += [f"multi-token-prediction tensors {p}" for p in mtp["problems"]]
    row["ok"] = bool(row["d_out"] <= atol and row["d_loss"] <= atol and row["d_after"] <= atol
                     and row["d_weights"] <= weights_atol and row["roundtrip"] and row["reload"]
                     and row["mtp_ok"])
    if not row["ok"]:        # a top-k near-tie of the sparse-attention indexer: the likely reason, named
        row["notes"] += row["near_ties"]
    progress(f"{row['layout']} ({row['model']}): {'ok' if row['ok'] else 'FAIL'}")
    return row


def _split_mtp(pre: dict, spec, ckpt: str, dtype) -> dict:
    """Take the carried multi-token-prediction tensors out of ``pre`` (parallm's state right after loading;
    transformers drops them, so they are not part of its comparisons) and check them against the checkpoint's
    own bytes in the model's dtype. Returns ``{"tensors": {name: tensor}, "problems": [...]}``."""
    import re
    names = {n for n, _ in spec.carried_mtp}
    if spec.carried_mtp_layers:          # DeepSeek-V3 / GLM-4.5: model.layers.{L + j}.*
        names |= {k for k in pre
                  if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= spec.num_layers}
    tensors = {k: pre.pop(k) for k in sorted(names) if k in pre}
    problems = []
    if tensors:
        source = HFCheckpoint(ckpt)
        float8 = (torch.float8_e4m3fn, torch.float8_e5m2)      # FP8 block weights: dequantised, not copied
        differ = [k for k, v in tensors.items() if source.source(k).dtype not in float8
                  and not torch.equal(source.source(k).read(0, 0, v.shape[0]).to(v.dtype), v)]
        if differ:
            problems.append(f"not loaded bit for bit: {', '.join(differ[:3])}")
    return dict(tensors=tensors, problems=problems)


def render_table(headers: list[str], rows: list[list[str]], right=frozenset()) -> str:
    """Columns padded to their widest cell (those in ``right`` aligned right), a dashed rule under the headers."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join(line(r).rstrip() for r in [headers, ["-" * w for w in widths], *rows])


def results_table(rows: list[dict]) -> str:
    """:func:`check_layout` rows as a table: timings in seconds, differences as 1.2e-06, round trips exact / DIFF."""
    def num(x):
        return "-" if x is None else "nan" if x != x else "0" if x == 0 else f"{x:.1e}"

    def sec(x):
        return "-" if x is None else f"{x:.2f}"

    headers = ["layout", "model", "load s", "max|Δ out|", "Δ loss", "max|Δ w| step", "max|Δ out| after", "save s",
               "round trip", "reload", "ok"]
    cells = [[r["layout"], r["model"], sec(r.get("load_s")), num(r.get("d_out")), num(r.get("d_loss")),
              num(r.get("d_weights")), num(r.get("d_after")), sec(r.get("save_s")),
              "exact" if r.get("roundtrip") else "DIFF", "exact" if r.get("reload") else "DIFF",
              "ok" if r.get("ok") else "FAIL"] for r in rows]
    return render_table(headers, cells, right={2, 3, 4, 5, 6, 7})
