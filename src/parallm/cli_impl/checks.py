"""One layout check, run on every rank of an initialised world.

    1. ``init_parallel(tp, pp, vpp)``; build the model (fp32, whatever the checkpoint's dtype: the check is about
       the weight mapping) and load the checkpoint (timed: "load s").
    2. Gather the weights back (``save_hf_weights``) and compare them bit for bit with what transformers loads
       from the same checkpoint ("round trip").
    3. ``parallm.forward`` on a deterministic batch with a full row, left padding, right padding and both, against
       transformers (fp32, eager attention, the same position_ids) at the real positions ("max|Δ out|").
    4. One SGD step: ``forward_backward`` + ``finalize_grads`` + ``p -= lr * p.grad`` against the same step on the
       transformers model: loss ("Δ loss"), every weight ("max|Δ w| step") and the output after the step.
    5. ``save_hf_weights(chunks, dir)`` (timed: "save s"); transformers reloads the directory and must hold
       exactly the weights parallm gathered ("reload").

transformers runs on global rank 0 only; every comparison happens there. Everything a rank does alone (reading
the config, the reference) goes through :func:`parallm.parallel.errors.run_local`, so a failure anywhere becomes
the same error on every rank instead of a hang.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from .common import AUTO_UPDATE

# -- batch and losses ----------------------------------------------------------------------------------------


def make_batch(vocab: int, batch: int, seq: int, seed: int):
    """input_ids / attention_mask: rows cycle through full, left-padded, right-padded, padded on both sides."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        kind = b % 4
        if kind == 1:
            mask[b, :max(1, seq // 4)] = 0
        elif kind == 2:
            mask[b, seq - max(1, seq // 3):] = 0
        elif kind == 3:
            mask[b, :1] = 0
            mask[b, -2:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def ce_loss(logits, ids, mask):
    """Mean next-token cross entropy over real (unpadded) positions."""
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def value_loss(values, ids, mask):
    """Mean squared error of the values against a deterministic target made from the tokens."""
    target = (ids % 7).float() / 7.0
    m = mask.float()
    return (((values.float() - target) ** 2) * m).sum() / m.sum()


def loss_for(task: str):
    return value_loss if task == "value" else ce_loss


def max_diff_real(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    return (a.float().cpu()[m] - b.float().cpu()[m]).abs().max().item()


# -- transformers reference (rank 0) -------------------------------------------------------------------------


def _dtype_kwarg():
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass


def load_transformers(path: str, task: str, device):
    """transformers' model of the checkpoint in fp32 with eager attention, and its loading info."""
    import transformers
    quiet_transformers()
    cls = (transformers.AutoModelForSequenceClassification if task == "value"
           else transformers.AutoModelForCausalLM)
    kw = {_dtype_kwarg(): torch.float32, "attn_implementation": "eager", "output_loading_info": True}
    if task == "value":
        kw["num_labels"] = 1
    model, info = cls.from_pretrained(path, **kw)
    return model.float().to(device).eval(), info


def hf_output(model, ids, mask, task: str) -> torch.Tensor:
    """What parallm.forward returns, computed by transformers: logits, or score(last hidden state) for values."""
    from ..api import default_position_ids
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    pos = default_position_ids(mask)
    if task == "value":
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        return model.score(hidden).squeeze(-1).float()
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


def hf_state(model, *, clone: bool) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of ``model`` holds (a tied lm_head dropped, as save_pretrained does)."""
    sd = {k: (v.detach().cpu().clone() if clone else v.detach().cpu()) for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in sd and "score.weight" not in sd:
        sd.pop("lm_head.weight")
    return sd


def compare_states(got: dict, want: dict) -> tuple[bool, float, str]:
    """(bit-exact?, max |difference| (inf when names or shapes differ), what differs) between two HF state
    dicts."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}")
    if extra:
        problems.append(f"extra {', '.join(extra[:5])}")
    worst, worst_name, unequal = (float("inf") if problems else 0.0), None, []
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape:
            problems.append(f"{k}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            worst = float("inf")
            continue
        if not torch.equal(a, b.to(a.dtype)):
            unequal.append(k)
            d = (a.float() - b.float()).abs().max().item()
            if worst_name is None or d > worst:
                worst_name = k
            worst = max(worst, d)
    if unequal:
        problems.append(f"{len(unequal)} tensor(s) differ, most: {worst_name}")
    return not problems, worst, "; ".join(problems)


def reference(ckpt: str, task: str, ids, mask, pre: dict, *, pieces: int, lr, device):
    """transformers on the same checkpoint (rank 0): output, one SGD step, output after it, stepped weights."""
    model, info = load_transformers(ckpt, task, device)
    notes = []
    missing = sorted(str(k) for k in info.get("missing_keys", []))
    no_score = task == "value" and "score.weight" in missing
    missing = [k for k in missing if k != "score.weight"]
    if missing:
        notes.append(f"transformers did not find {', '.join(missing[:5])} in the checkpoint")
    if no_score:
        # parallm initialised the value head (or took a verl-style [1, H] lm_head); give transformers the same.
        with torch.no_grad():
            model.score.weight.copy_(pre["score.weight"].to(model.score.weight.device))
        notes.append("score.weight is not in the checkpoint: the reference uses the head parallm made "
                     "(see docs/layouts.md, value heads)")
    same, worst, what = compare_states(pre, hf_state(model, clone=False))
    if not same:
        notes.append(f"round trip: {what}")
    with torch.no_grad():
        out = hf_output(model, ids, mask, task).cpu()
    loss_fn = loss_for(task)
    size = ids.shape[0] // pieces
    model.zero_grad(set_to_none=True)
    losses = [loss_fn(hf_output(model, ids[i:i + size], mask[i:i + size], task), ids[i:i + size].to(device),
                      mask[i:i + size].to(device)) for i in range(0, ids.shape[0], size)]
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    gmax = max(g.abs().max().item() for g in grads) if grads else 0.0
    if lr is None:
        lr = AUTO_UPDATE / gmax if gmax > 0 else 1.0
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
        after = hf_output(model, ids, mask, task).cpu()
    stepped = hf_state(model, clone=True)
    del model
    gc.collect()
    return dict(out=out, loss=loss.item(), lr=float(lr), update=float(lr * gmax), after=after, stepped=stepped,
                roundtrip=same, notes=notes)


def reload_check(save_dir: str, task: str, saved: dict) -> tuple[bool, str]:
    """transformers reloads what parallm saved; it must hold exactly ``saved``."""
    model, info = load_transformers(save_dir, task, "cpu")
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            problems.append(f"{key.replace('_', ' ')}: {', '.join(str(k) for k in list(info[key])[:5])}")
    same, _, what = compare_states(hf_state(model, clone=False), saved)
    if not same:
        problems.append(what)
    del model
    return not problems, "; ".join(problems)


# -- one layout on every rank --------------------------------------------------------------------------------


def layout_name(case: dict) -> str:
    parts = [f"tp{case['tp']}"]
    if case["pp"] > 1:
        parts.append(f"pp{case['pp']}")
    if (case.get("vpp") or 1) > 1:
        parts.append(f"vpp{case['vpp']}")
    if (case.get("dp") or 1) > 1:
        parts.append(f"dp{case['dp']}")
    if case.get("sp"):
        parts.append("packed+SP")
    elif case.get("packed"):
        parts.append("packed")
    if case.get("task") == "value":
        parts.append("value")
    if case.get("mode", "auto") != "auto":
        parts.append(case["mode"])
    return " ".join(parts)


def _barrier_time(t0: float) -> float:
    dist.barrier()
    return time.perf_counter() - t0


def run_case(case: dict, job: dict, progress) -> dict | None:
    """Run one layout on every rank. Returns the result row on global rank 0, None elsewhere."""
    import parallm
    from ..families import load_config
    from ..parallel.errors import run_local
    from ..parallel.state import current_dims

    parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), timeout_s=job["timeout"])
    lay = current_dims()
    rank0 = lay.rank == 0
    case = dict(case, dp=lay.dp)
    row = dict(layout=layout_name(case), model=case["model"])
    ckpt, task = case["ckpt"], case.get("task")
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    # The config travels from rank 0, so ranks that cannot see the directory (other nodes) still build the
    # model; the loader then streams their shards from rank 0 (mode auto -> broadcast).
    raw = run_local(lambda: load_config(ckpt)._raw if rank0 else None, what="reading config.json")
    box = [raw]
    dist.broadcast_object_list(box, src=0)
    raw = box[0]

    t0 = time.perf_counter()
    dist.barrier()
    chunks = parallm.build_model(raw, task=task, packed=case.get("packed", False),
                                 sequence_parallel=case.get("sp", False), dtype=torch.float32)
    task = chunks[0].task
    report = parallm.load_hf_weights(chunks, ckpt, mode=case.get("mode", "auto"))
    row["load_s"] = _barrier_time(t0)
    row["load_mode"] = report.mode
    spec = chunks[0].spec

    pre = parallm.save_hf_weights(chunks)
    nmb = case.get("nmb", 1)
    pieces = lay.dp * nmb
    batch = -(-job["batch"] // pieces) * pieces
    ids, mask = make_batch(spec.vocab_size, batch, job["seq"], job["seed"])

    ref = run_local(lambda: reference(ckpt, task, ids, mask, pre, pieces=pieces, lr=job.get("lr"), device=device)
                    if rank0 else None,
                    what="the transformers reference")
    del pre
    box = [ref["lr"] if rank0 else None]
    dist.broadcast_object_list(box, src=0)
    lr = box[0]

    out = parallm.forward(chunks, ids, mask)
    if rank0:
        row["d_out"] = max_diff_real(out, ref["out"], mask)
    del out

    per = batch // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_for(task), num_microbatches=nmb)
    parallm.finalize_grads(chunks)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
    after = parallm.forward(chunks, ids, mask)
    new = parallm.save_hf_weights(chunks)
    if rank0:
        row["d_loss"] = abs(loss.item() - ref["loss"])
        row["d_after"] = max_diff_real(after, ref["after"], mask)
        _, row["d_weights"], what = compare_states(new, ref["stepped"])
        row["notes"] = list(ref["notes"])
        if row["d_weights"] == float("inf"):
            row["notes"].append(f"after the step: {what}")
        row.update(lr=ref["lr"], update=ref["update"], loss=ref["loss"], roundtrip=ref["roundtrip"])
    del after, ref

    t0 = time.perf_counter()
    dist.barrier()
    parallm.save_hf_weights(chunks, case["save_dir"], overwrite=True)
    row["save_s"] = _barrier_time(t0)
    reloaded = run_local(lambda: reload_check(case["save_dir"], task, new) if rank0 else None,
                         what="reloading the saved directory with transformers")
    del chunks, new
    gc.collect()
    if not rank0:
        return None
    row["reload"], reload_problem = reloaded
    notes = list(row.pop("notes", []))
    if reload_problem:
        notes.append(f"reload: {reload_problem}")
    row["notes"] = notes
    row["task"] = task
    row["save_dir"] = case["save_dir"]
    atol, watol = job["atol"], job["weights_atol"]
    row["ok"] = bool(row["d_out"] <= atol and row["d_loss"] <= atol and row["d_weights"] <= watol
                     and row["d_after"] <= atol and row["roundtrip"] and row["reload"])
    progress(f"{row['layout']} ({row['model']}): {'ok' if row['ok'] else 'FAIL'}")
    return row
