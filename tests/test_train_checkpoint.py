"""Training checkpoints (parallm.save_checkpoint / load_checkpoint / checkpoint_to_hf).

Three spawns:

* resharding (4 ranks): a checkpoint saved at one layout is loaded at another and saved again; every stored
  tensor, model and optimizer state, must come back bit for bit (tp2.pp2 -> tp4, -> tp1.pp2.vpp2.dp2,
  -> tp2.dp2 with shard_over_dp; that one -> tp2.pp2 (dp1); a tied model tp2.dp2 -> pp2.dp2 with a head copy;
  a Qwen3-MoE tp2.dp2 with shard_over_dp -> pp2.dp2, -> tp4, -> ep4 (ZeRO) -> ep2 (ZeRO) -> tp2.ep2 ->
  pp2.ep2).
  The step after each resume matches the uninterrupted run's step (other layouts: fp32 reduction order only).
  The offline HF export equals ``save_hf_weights`` bit for bit and loads in transformers.
* exactness, async and errors (2 ranks): same-layout resume is bit-exact in fp32 and bf16 (fp32 master weights
  saved), an asynchronous save taken while training goes on holds the state of its call (its ``extra`` too),
  ``extra`` (JSON with tensors) comes back equal, ``destroy_parallel`` right after an asynchronous save leaves a
  complete checkpoint and raises when that save failed, and the error catalog (another model, no optimizer
  state, truncated / corrupted files, an unfinished checkpoint, a non-empty target, an ``extra`` that is not
  JSON + tensors on one rank, crafted checkpoints carrying pickles) raises on every rank naming the culprit,
  within a time bound, and no crafted pickle ever runs.
* a writer killed midway (4 ranks): the older checkpoint at the path stays byte-identical, the survivors raise
  within the bound.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import helpers
from test_checkpoint_extra import same_extra
from test_optim import ce_loss

BOUND_S = 60.0
EPS = 1e-3   # resumed steps at other layouts are compared with a tolerance: see test_optim.EPS
LR = 1e-3


def batches(vocab, n=3, *, batch=4, seq=8, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def train(parallm, chunks, opt, steps, dims, *, main_grad=False):
    for ids in steps:
        per = ids.shape[0] // dims.dp
        parallm.forward_backward(chunks, ids[dims.dp_rank * per:(dims.dp_rank + 1) * per], loss_fn=ce_loss)
        parallm.finalize_grads(chunks)
        if main_grad:   # bf16 models: forward_backward accumulated the gradients in fp32 main_grad only
            for c in chunks:
                for p in c.parameters():
                    assert p.grad is None and p.main_grad.dtype == torch.float32
        opt.step()
        opt.zero_grad()


# -- resharding ---------------------------------------------------------------------------------------------------

def _layout(parallm, tp, pp, vpp, ckpt, ep=1):
    from parallm.parallel.state import dims_of
    parallm.destroy_parallel()
    parallm.init_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep)
    chunks = parallm.build_model(ckpt)
    return chunks, dims_of(chunks)


def rank_reshard(rank, world, s):
    import parallm
    out = {}
    for model in s:
        m = s[model]
        src = m["source"]
        chunks, dims = _layout(parallm, *src["layout"], m["hf"], ep=src.get("ep", 1))
        parallm.load_hf_weights(chunks, m["hf"])
        opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=0.1, shard_over_dp=src["shard"])
        train(parallm, chunks, opt, m["batches"][:2], dims)
        parallm.save_checkpoint(src["path"], chunks, opt, step=2, extra={"model": model, "rank": rank})
        out[f"{model}/at-save"] = parallm.save_hf_weights(chunks)
        train(parallm, chunks, opt, m["batches"][2:], dims)
        out[f"{model}/uninterrupted"] = parallm.save_hf_weights(chunks)
        for target in m["targets"]:
            chunks, dims = _layout(parallm, *target["layout"], m["hf"], ep=target.get("ep", 1))   # no HF load
            assert dims.ep == target.get("ep", 1), dims.describe()
            opt = parallm.build_optimizer(chunks, lr=123.0, eps=EPS, weight_decay=0.1, shard_over_dp=target["shard"])
            info = parallm.load_checkpoint(target["from"], chunks, opt)
            assert info == {"step": 2, "extra": {"model": model, "rank": 0}}, info
            assert all(g["lr"] == LR for g in opt.param_groups), opt.param_groups   # hyperparameters restored
            parallm.save_checkpoint(target["path"], chunks, opt, step=2, extra=info["extra"])
            train(parallm, chunks, opt, m["batches"][2:], dims)
            out[target["path"]] = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(400)
def test_resume_across_layouts(tmp_path):
    from parallm.checkpoint.training import checkpoint_to_hf, read_tensors
    import transformers
    root = str(tmp_path)
    a = helpers.make_hf_model(helpers.tiny_config("llama", num_hidden_layers=4), seed=11)
    b = helpers.make_hf_model(helpers.tiny_config("qwen2", tie_word_embeddings=True), seed=12)
    c = helpers.make_hf_model(helpers.tiny_config("qwen3_moe"), seed=13)   # 4 experts, per-expert rows
    ck = lambda name: os.path.join(root, name)  # noqa: E731
    s = {
        "A": dict(hf=helpers.save_checkpoint(a, ck("hf-A")), batches=batches(a.config.vocab_size),
                  source=dict(layout=(2, 2, None), shard=False, path=ck("A-tp2pp2")),
                  targets=[dict(layout=(4, 1, None), shard=False, from_=None, path=ck("A-tp4")),
                           dict(layout=(1, 2, 2), shard=False, path=ck("A-tp1pp2vpp2dp2")),
                           dict(layout=(2, 1, None), shard=True, path=ck("A-tp2dp2-zero")),
                           dict(layout=(2, 2, None), shard=False, path=ck("A-zero-to-tp2pp2"),
                                from_=ck("A-tp2dp2-zero"))]),
        "B": dict(hf=helpers.save_checkpoint(b, ck("hf-B")), batches=batches(b.config.vocab_size),
                  source=dict(layout=(2, 1, None), shard=False, path=ck("B-tp2dp2")),
                  targets=[dict(layout=(1, 2, None), shard=True, path=ck("B-pp2dp2-zero"))]),
        "C": dict(hf=helpers.save_checkpoint(c, ck("hf-C")), batches=batches(c.config.vocab_size),
                  source=dict(layout=(2, 1, None), shard=True, path=ck("C-tp2dp2-zero")),
                  targets=[dict(layout=(1, 2, None), shard=False, path=ck("C-pp2dp2")),
                           dict(layout=(4, 1, None), shard=False, path=ck("C-tp4")),
                           # expert parallelism: ep 1 -> 4 (ZeRO: dense over dp4, one expert per rank) -> ep2 (ZeRO:
                           # experts over their edp2 pairs) -> tp2.ep2 -> pp2.ep2
                           dict(layout=(1, 1, None), ep=4, shard=True, path=ck("C-ep4-zero")),
                           dict(layout=(1, 1, None), ep=2, shard=True, path=ck("C-ep2-zero"),
                                from_=ck("C-ep4-zero")),
                           dict(layout=(2, 1, None), ep=2, shard=False, path=ck("C-tp2ep2"), from_=ck("C-ep2-zero")),
                           dict(layout=(1, 2, None), ep=2, shard=False, path=ck("C-pp2ep2"),
                                from_=ck("C-tp2ep2"))]),
    }
    for m in s.values():
        for t in m["targets"]:
            t["from"] = t.pop("from_", None) or m["source"]["path"]
    t0 = time.monotonic()
    res = helpers.run_ranks(rank_reshard, 4, s)[0]
    print(f"resharding spawn: {time.monotonic() - t0:.1f}s")
    tol = resume_tol()
    for model, m in s.items():
        stored = read_tensors(m["source"]["path"])
        assert any(k.startswith("optim/exp_avg/") for k in stored) and "extra" not in stored
        for t in m["targets"]:
            again = read_tensors(t["path"])
            assert again.keys() == stored.keys(), sorted(set(again) ^ set(stored))
            bad = [k for k in stored if not torch.equal(again[k], stored[k])]
            assert not bad, f"{t['from']} -> {t['path']}: {bad[:5]}"
            ref, got = res[f"{model}/uninterrupted"], res[t["path"]]
            worst = max(((got[k] - ref[k]).abs().max().item(), k) for k in ref)
            print(f"{os.path.basename(t['from'])} -> {os.path.basename(t['path'])}: step after resume vs "
                  f"uninterrupted {worst[0]:.2e} ({worst[1]})")
            assert worst[0] < tol, (t["path"], worst)
        # offline export: no process group; equals save_hf_weights of the model at the save, loads in transformers
        out = ck(f"hf-export-{model}")
        checkpoint_to_hf(m["source"]["path"], out)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out)
        exported = helpers.hf_state_dict(hf)
        at_save = res[f"{model}/at-save"]
        assert exported.keys() == at_save.keys()
        assert all(torch.equal(exported[k], at_save[k]) for k in at_save)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        checkpoint_to_hf(s["A"]["source"]["path"], ck("hf-export-A"))


def resume_tol():
    # one AdamW step at another layout: gradients differ by fp32 reduction order (<~5e-7), the update by
    # <~ dg / eps (see test_optim.EPS)
    return LR * 5e-7 / EPS * 3


# -- exact resume, async save, errors ------------------------------------------------------------------------------

def rich_extra(tag):
    """An ``extra`` with every JSON type and tensors of several dtypes and shapes (0-d, empty, bf16)."""
    g = torch.Generator().manual_seed(3)
    return {"tag": tag, "epoch": 3, "lr": 2.5e-4, "best": float("inf"), "ok": True, "none": None,
            "seen": [17, 4, [], {}], "rng": torch.get_rng_state(),
            "nested": {"t": [torch.randn(2, 3, generator=g).to(torch.bfloat16), torch.tensor(7)]},
            "empty": torch.zeros(0, 5)}


class Payload:
    """Unpickling this creates the file ``marker`` (``open(marker, "w")``): what a malicious pickle could run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def craft(good, out, kind, marker):
    """A copy of training checkpoint ``good`` that carries a pickle creating ``marker`` when unpickled, its
    parallm.json CRCs made to match (an attacker rewrites both):

    * ``v1``: the format parallm wrote before (version 1): ``extra`` pickled, as a DCP bytes item (the old
      ``load_checkpoint`` unpickled it);
    * ``bytes-item``: a version-2 record, and a DCP bytes item ``extra`` (DCP's default planner would
      ``torch.load(weights_only=False)`` it);
    * ``tensor-item``: the first tensor of ``good``'s extra replaced by a pickled object."""
    import io
    import json
    import pickle
    import zlib
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    shutil.copytree(good, out)
    md = FileSystemReader(out).read_metadata()
    buf = io.BytesIO()
    torch.save(pickle.dumps(Payload(marker)) if kind == "v1" else Payload(marker), buf)
    blob, name = buf.getvalue(), "__9_0.distcp"
    with open(os.path.join(out, name), "wb") as f:
        f.write(blob)
    if kind == "tensor-item":
        index = next(i for i in md.storage_data if i.fqn == "extra/0")
    else:
        index = MetadataIndex("extra")
        md.state_dict_metadata["extra"] = BytesStorageMetadata()
    md.storage_data[index] = _StorageInfo(name, 0, len(blob))
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with open(os.path.join(out, "parallm.json")) as f:
        record = json.load(f)
    with open(os.path.join(out, ".metadata"), "rb") as f:
        record["crc32"]["metadata"] = zlib.crc32(f.read())
    record["crc32"]["items"][name] = [[0, len(blob), zlib.crc32(blob)]]
    if kind == "v1":
        record["version"] = 1
        del record["extra"]
    with open(os.path.join(out, "parallm.json"), "w") as f:
        json.dump(record, f)
    return out


CRAFTED = {"v1": ("CheckpointError", ["format version 1", "pickle", "refuses"]),
           "bytes-item": ("CheckpointError", ["non-tensor item(s) extra", "never unpickles"]),
           "tensor-item": ("CheckpointError", ["load_checkpoint failed on rank", "Weights only load failed"])}


def _slow_first_write(fs, seconds):
    """Make DCP's first item write in this process wait ``seconds`` (an asynchronous save then surely runs past
    the next statement). Returns the original function."""
    original, waited = fs._write_item, []

    def slow(*args, **kwargs):
        if not waited:
            waited.append(True)
            time.sleep(seconds)
        return original(*args, **kwargs)
    fs._write_item = slow
    return original


def _destroy_with_pending_saves(parallm, rank, s, out):
    """destroy_parallel right after an asynchronous save: the checkpoint is complete when it returns (and loads
    at another layout); after a failed asynchronous save it raises, on every rank, once the groups are gone."""
    import torch.distributed.checkpoint.filesystem as fs
    from megatron.core import parallel_state
    from parallm.parallel.state import dims_of
    root = s["root"]
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(s["hf"])
    parallm.load_hf_weights(chunks, s["hf"])
    opt = parallm.build_optimizer(chunks, lr=1e-2)
    train(parallm, chunks, opt, s["batches"][:1], dims_of(chunks))
    want = parallm.save_hf_weights(chunks)
    path = os.path.join(root, "destroy-pending")
    original = _slow_first_write(fs, 2.0)
    try:
        parallm.save_checkpoint(path, chunks, opt, step=5, extra={"k": [1]}, async_save=True)
        early = os.path.exists(os.path.join(path, "parallm.json"))
        parallm.destroy_parallel()
        landed = os.path.exists(os.path.join(path, "parallm.json"))
    finally:
        fs._write_item = original
    if early or not landed:
        out["problems"].append(f"destroy_parallel after an async save: in place before it {early}, after {landed}")
    parallm.init_parallel(tp=1, pp=2)
    chunks = parallm.build_model(s["hf"])
    info = parallm.load_checkpoint(path, chunks, parallm.build_optimizer(chunks, lr=1.0))
    got = parallm.save_hf_weights(chunks)
    if info != {"step": 5, "extra": {"k": [1]}} or (rank == 0 and (got.keys() != want.keys() or not all(
            torch.equal(got[k], want[k]) for k in want))):
        out["problems"].append(f"the checkpoint destroy_parallel waited for does not load back ({info})")
    parallm.destroy_parallel()

    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(s["hf"], init="random")      # any weights: the save fails on purpose
    failing = os.path.join(root, "destroy-failing")
    original = fs._write_item
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError("disk full (test)")
        fs._write_item = broken
    try:
        parallm.save_checkpoint(failing, chunks, step=6, async_save=True)
        problem, out["messages"]["destroy-after-failed-async-save"] = _expect(
            rank, "destroy-after-failed-async-save", parallm.destroy_parallel, "OSError", ["disk full (test)"])
    finally:
        fs._write_item = original
    if problem:
        out["problems"].append(problem)
    if parallel_state.model_parallel_is_initialized():
        out["problems"].append("destroy_parallel raised before tearing the groups down")
    parallm.destroy_parallel()   # the error was raised once; nothing is pending any more
    if rank == 0 and (os.path.exists(failing) or [n for n in os.listdir(root) if n.startswith(".destroy-failing")]):
        out["problems"].append("a failed async save left files behind")   # rank 0 removes them before it returns


def _flip(path, where=0.5):
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        pos = int(f.tell() * where)
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


def _expect(rank, what, fn, etype, needles):
    """(problem or None, message): ``fn()`` must raise ``etype`` naming every needle, within BOUND_S."""
    t = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        elapsed = time.monotonic() - t
        problems = []
        if type(e).__name__ != etype:
            problems.append(f"{type(e).__name__} instead of {etype}")
        problems += [f"message lacks {n!r}" for n in needles if n not in str(e)]
        if elapsed > BOUND_S:
            problems.append(f"took {elapsed:.0f}s")
        return (f"{what}: " + "; ".join(problems) + f" ({e})" if problems else None), f"{type(e).__name__}: {e}"
    return f"{what}: no error on rank {rank}", None


def rank_exact(rank, world, s):
    import parallm
    from parallm.parallel.state import dims_of
    out = {"problems": []}
    for dtype, (tp, pp) in ((torch.float32, (1, 2)), (torch.bfloat16, (2, 1))):
        tag = str(dtype).replace("torch.", "")
        low = dtype == torch.bfloat16
        parallm.init_parallel(tp=tp, pp=pp)
        chunks = parallm.build_model(s["hf"], dtype=dtype)
        dims = dims_of(chunks)
        parallm.load_hf_weights(chunks, s["hf"])
        opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1)
        train(parallm, chunks, opt, s["batches"][:2], dims, main_grad=low)
        path, apath = os.path.join(s["root"], f"exact-{tag}"), os.path.join(s["root"], f"async-{tag}")
        parallm.save_checkpoint(path, chunks, opt, step=2, extra=rich_extra(tag))
        changing = rich_extra(tag + "-async")
        handle = parallm.save_checkpoint(apath, chunks, opt, step=2, extra=changing, async_save=True)
        changing["nested"]["t"][1].add_(1)   # the caller's objects change after the call: the save holds the old
        changing["seen"].append(99)
        train(parallm, chunks, opt, s["batches"][2:], dims, main_grad=low)   # while the async save writes
        handle.wait()
        assert handle.done()
        params = [p.detach().clone() for c in chunks for p in c.parameters()]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        for source in (path, apath):   # the async checkpoint holds the state at its call, as the sync one
            parallm.destroy_parallel()
            parallm.init_parallel(tp=tp, pp=pp)
            chunks = parallm.build_model(s["hf"], dtype=dtype)
            opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1)
            info = parallm.load_checkpoint(source, chunks, opt)
            if not same_extra(info["extra"], rich_extra(tag if source == path else tag + "-async")):
                out["problems"].append(f"{tag} {source}: extra came back as {info['extra']}")
            train(parallm, chunks, opt, s["batches"][2:], dims_of(chunks), main_grad=low)
            again = [p.detach() for c in chunks for p in c.parameters()]
            if not all(torch.equal(x, y) for x, y in zip(params, again)):
                out["problems"].append(f"{tag} {source}: parameters after the resumed step differ")
            sd = opt.state_dict()
            for k, v in state.items():
                for n, t in v.items():
                    if not torch.equal(sd["state"][k][n], t):
                        out["problems"].append(f"{tag} {source}: optimizer state {k}.{n} differs")
            if low and not all(v["master"].dtype == torch.float32 for v in sd["state"].values()):
                out["problems"].append("bf16 masters are not fp32")
        # same-layout state_dict round trip into a fresh optimizer
        fresh = parallm.build_optimizer(chunks, lr=0.5)
        fresh.load_state_dict(opt.state_dict())
        if not all(torch.equal(fresh.state_dict()["state"][k][n], t) for k, v in opt.state_dict()["state"].items()
                   for n, t in v.items()):
            out["problems"].append(f"{tag}: state_dict round trip differs")
        parallm.destroy_parallel()

    out["messages"] = {}
    _destroy_with_pending_saves(parallm, rank, s, out)

    # the error catalog, at tp1.pp2 fp32
    parallm.init_parallel(tp=1, pp=2)
    chunks = parallm.build_model(s["hf"])
    parallm.load_hf_weights(chunks, s["hf"])
    opt = parallm.build_optimizer(chunks, lr=1e-2)
    root = s["root"]
    good = os.path.join(root, "exact-float32")
    broken = {name: os.path.join(root, f"broken-{name}") for name in
              ("truncated", "corrupted", "metadata", "unfinished")}
    for name, ck in s["others"].items():   # checkpoints of other models, saved here
        other = parallm.build_model(ck)
        parallm.load_hf_weights(other, ck)
        parallm.save_checkpoint(os.path.join(root, f"model-{name}"), other, step=0)
    parallm.save_checkpoint(os.path.join(root, "no-optim"), chunks, step=0)
    if rank == 0:
        for name, path in broken.items():
            shutil.copytree(good, path)
        with open(os.path.join(broken["truncated"], "__1_0.distcp"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
        _flip(os.path.join(broken["corrupted"], "__0_0.distcp"))
        _flip(os.path.join(broken["metadata"], ".metadata"))
        os.remove(os.path.join(broken["unfinished"], "parallm.json"))
        for kind in CRAFTED:
            craft(os.path.join(root, "exact-float32"), os.path.join(root, f"crafted-{kind}"), kind,
                  os.path.join(root, f"marker-{kind}"))
    torch.distributed.barrier()
    loaded = parallm.build_model(s["hf"])
    parallm.load_hf_weights(loaded, s["hf"])
    cases = [
        ("other-shapes", lambda: parallm.load_checkpoint(os.path.join(root, "model-wide"), chunks),
         "CheckpointError", ["another model", "shapes differ", "model.layers.0.mlp.down_proj.weight", "(64, 128)"]),
        ("other-names", lambda: parallm.load_checkpoint(os.path.join(root, "model-tied"), chunks),
         "CheckpointError", ["another model", "lm_head.weight"]),
        ("no-optimizer-state", lambda: parallm.load_checkpoint(os.path.join(root, "no-optim"), chunks, opt),
         "CheckpointError", ["no-optim", "holds no optimizer state"]),
        ("truncated", lambda: parallm.load_checkpoint(broken["truncated"], chunks, opt),
         "CheckpointError", [os.path.join("broken-truncated", "__1_0.distcp"), "truncated"]),
        ("corrupted", lambda: parallm.load_checkpoint(broken["corrupted"], chunks, opt),
         "CheckpointError", [os.path.join("broken-corrupted", "__0_0.distcp"), "corrupted", "CRC-32"]),
        # the corrupted load above failed while it wrote the parameters: the model counts as never loaded
        ("save-after-failed-load", lambda: parallm.save_checkpoint(os.path.join(root, "after-failed"), chunks,
                                                                   step=1),
         "RuntimeError", ["save_checkpoint", "never loaded", "load_hf_weights"]),
        ("corrupted-metadata", lambda: parallm.load_checkpoint(broken["metadata"], chunks),
         "CheckpointError", [os.path.join("broken-metadata", ".metadata"), "corrupted"]),
        ("unfinished", lambda: parallm.load_checkpoint(broken["unfinished"], chunks),
         "CheckpointError", ["broken-unfinished", "parallm.json"]),
        ("missing", lambda: parallm.load_checkpoint(os.path.join(root, "nowhere"), chunks),
         "CheckpointError", ["nowhere", "does not exist"]),
        ("non-empty-target", lambda: parallm.save_checkpoint(good, chunks, opt, step=3),
         "FileExistsError", ["exact-float32", "overwrite=True"]),
        # extra: JSON + tensors only, checked on every rank (here a tuple on rank 1 alone), nothing written; saved
        # from a loaded model (a load that failed while reading, as "corrupted" above, leaves `chunks` marked not
        # loaded, which save_checkpoint refuses on that rank)
        ("extra-tuple-on-rank-1", lambda: parallm.save_checkpoint(
            os.path.join(root, "bad-extra-tuple"), loaded, step=1,
            extra={"sched": {"betas": (0.9, 0.99) if rank == 1 else [0.9, 0.99]}}),
         "TypeError", ["extra['sched']['betas']", "tuple", "use a list"] + (["failed on rank 1"] if rank == 0 else [])),
        ("extra-object", lambda: parallm.save_checkpoint(os.path.join(root, "bad-extra-object"), chunks, step=1,
                                                         extra={"gen": [torch.Generator()]}),
         "TypeError", ["extra['gen'][0]", "Generator", "JSON values"]),
    ] + [(f"crafted-{kind}", lambda kind=kind: parallm.load_checkpoint(os.path.join(root, f"crafted-{kind}"), chunks),
          etype, needles) for kind, (etype, needles) in CRAFTED.items()]
    for what, fn, etype, needles in cases:
        problem, out["messages"][what] = _expect(rank, what, fn, etype, needles)
        if problem:
            out["problems"].append(problem)
    out["good-loads"] = parallm.load_checkpoint(good, chunks, opt)["step"]   # still in step after the errors
    return out


@pytest.mark.timeout(400)
def test_exact_resume_async_and_errors(tmp_path):
    from parallm import CheckpointError
    from parallm.checkpoint.training import checkpoint_to_hf, read_tensors
    root = str(tmp_path)
    model = helpers.make_hf_model(helpers.tiny_config("llama"), seed=21)
    hf = helpers.save_checkpoint(model, os.path.join(root, "hf"))
    others = {"wide": helpers.save_checkpoint(
                  helpers.make_hf_model(helpers.tiny_config("llama", intermediate_size=128), seed=22),
                  os.path.join(root, "hf-wide")),
              "tied": helpers.save_checkpoint(
                  helpers.make_hf_model(helpers.tiny_config("llama", tie_word_embeddings=True), seed=23),
                  os.path.join(root, "hf-tied"))}
    s = dict(hf=hf, root=root, batches=batches(model.config.vocab_size), others=others)
    t0 = time.monotonic()
    results = helpers.run_ranks(rank_exact, 2, s)
    print(f"exact/async/errors spawn: {time.monotonic() - t0:.1f}s")
    for what, message in results[1]["messages"].items():
        print(f"rank 1, {what}: {message}")
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems)
    assert [r["good-loads"] for r in results] == [2, 2]
    assert not os.path.exists(os.path.join(root, "bad-extra-tuple"))
    assert not os.path.exists(os.path.join(root, "bad-extra-object"))
    assert not os.path.exists(os.path.join(root, "after-failed"))
    # no crafted pickle ran, in the ranks or here: the offline readers read the tensors they need and nothing else
    v1 = os.path.join(root, "crafted-v1")
    assert read_tensors(v1)["model/model.norm.weight"].shape == (64,)
    checkpoint_to_hf(v1, os.path.join(root, "hf-from-v1"))
    with pytest.raises(CheckpointError, match="Weights only load failed"):
        read_tensors(os.path.join(root, "crafted-tensor-item"), ["extra/0"])
    assert not [n for n in os.listdir(root) if n.startswith("marker-")]
    # ... although each payload is live: the old load_checkpoint's unpickling creates the marker
    import io
    import pickle
    live = os.path.join(root, "live-marker")
    buf = io.BytesIO()
    torch.save(pickle.dumps(Payload(live)), buf)
    buf.seek(0)
    pickle.loads(torch.load(buf, weights_only=True))   # what format 1's load_checkpoint did with its extra
    assert os.path.exists(live)
    # the offline export checks the items it reads: corrupt the embedding's bytes
    from torch.distributed.checkpoint import FileSystemReader
    bad = os.path.join(root, "broken-export")
    shutil.copytree(os.path.join(root, "exact-float32"), bad)
    info = next(v for k, v in FileSystemReader(bad).read_metadata().storage_data.items()
                if k.fqn == "model/model.embed_tokens.weight")
    with open(os.path.join(bad, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=f"{info.relative_path} is corrupted.*model/model.embed_tokens.weight"):
        checkpoint_to_hf(bad, os.path.join(root, "out"))
    assert not os.path.exists(os.path.join(root, "out"))
    # the same through the command (a subprocess each, run together)
    cmd = lambda *a: subprocess.Popen([sys.executable, "-m", "parallm", "convert", *a],  # noqa: E731
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    good_out, bad_out = os.path.join(root, "cli-good"), os.path.join(root, "cli-bad")
    procs = [cmd(os.path.join(root, "exact-bfloat16"), good_out, "--dtype", "float32"), cmd(bad, bad_out)]
    (ok_out, ok_err), (_, bad_err) = [p.communicate(timeout=120) for p in procs]
    ok_rc, bad_rc = procs[0].returncode, procs[1].returncode
    assert ok_rc == 0, ok_err
    masters = read_tensors(os.path.join(root, "exact-bfloat16"))
    from safetensors.torch import load_file
    written = load_file(os.path.join(good_out, "model.safetensors"))
    assert written.keys() == {k[len("model/"):] for k in masters if k.startswith("model/")}
    assert all(torch.equal(t, masters[f"optim/master/{k}"]) for k, t in written.items())   # fp32 masters
    assert bad_rc == 1 and "is corrupted" in bad_err and info.relative_path in bad_err, bad_err
    assert bad_err.startswith("error: ") and "Traceback" not in bad_err, bad_err
    assert not [n for n in os.listdir(root) if "parallm-tmp" in n]


# -- a writer killed midway --------------------------------------------------------------------------------------

KILL_SPAWN_TIMEOUT_S = 120


def rank_killed(rank, world, s):
    import parallm
    import torch.distributed.checkpoint.filesystem as fs
    from parallm.parallel.state import dims_of
    parallm.init_parallel(tp=2)   # dp2
    chunks = parallm.build_model(s["hf"])
    parallm.load_hf_weights(chunks, s["hf"])
    opt = parallm.build_optimizer(chunks, lr=1e-2)
    parallm.save_checkpoint(s["target"], chunks, opt, step=1)
    digest = helpers.tree_digest(s["target"]) if rank == 0 else None
    train(parallm, chunks, opt, s["batches"][:1], dims_of(chunks))
    if rank == s["victim"]:
        original, count = fs._write_item, [0]

        def dying(*args, **kwargs):
            count[0] += 1
            if count[0] >= 3:   # after some of its items are on disk
                os._exit(1)
            return original(*args, **kwargs)
        fs._write_item = dying
    t = time.monotonic()
    try:
        parallm.save_checkpoint(s["target"], chunks, opt, step=2, overwrite=True)
        err = None
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, str(e))
    elapsed = time.monotonic() - t
    survivors = [r for r in range(world) if r != s["victim"]]
    all_done = helpers.file_barrier(s["barrier"], rank, survivors, deadline=t + BOUND_S + 1)
    return dict(err=err, elapsed=elapsed, all_done=all_done, digest=digest)


@pytest.mark.timeout(300)
def test_killed_writer_keeps_previous_checkpoint(tmp_path):
    from parallm.checkpoint.training import read_tensors
    model = helpers.make_hf_model(helpers.tiny_config("llama"), seed=31)
    (tmp_path / "out").mkdir()
    (tmp_path / "barrier").mkdir()
    s = dict(hf=helpers.save_checkpoint(model, str(tmp_path / "hf")), target=str(tmp_path / "out" / "ckpt"),
             barrier=str(tmp_path / "barrier"), victim=1, batches=batches(model.config.vocab_size))
    t0 = time.monotonic()
    outcomes = helpers.run_ranks_allow_dead(rank_killed, 4, s, timeout=KILL_SPAWN_TIMEOUT_S)
    print(f"killed writer spawn: {time.monotonic() - t0:.1f}s")
    assert outcomes[1] == ("dead", 1), outcomes[1]
    for rank in (0, 2, 3):
        status, value = outcomes[rank]
        assert status == "ok", (rank, status, str(value)[-3000:])
        print(f"rank {rank}: {value['elapsed']:.1f}s {value['err']}")
        assert value["err"] is not None, f"rank {rank} returned normally although rank 1 died"
        assert value["err"][1].strip() and value["elapsed"] < BOUND_S
    assert helpers.tree_digest(s["target"]) == outcomes[0][1]["digest"]
    assert sorted(os.listdir(tmp_path / "out")) == ["ckpt"]   # no temporary directory left beside it
    assert read_tensors(s["target"])["optim/step/model.norm.weight"].item() == 0.0   # the step-1 checkpoint


# -- offline export: the dtype rules of every other path -----------------------------------------------------

def rank_big_value(rank, world, s):
    import parallm
    parallm.init_parallel(tp=1)
    chunks = parallm.build_model(s["hf"])
    parallm.load_hf_weights(chunks, s["hf"])
    from parallm.model.table import model_entries
    from parallm.parallel.state import dims_of
    for e, c in model_entries(chunks, dims_of(chunks))[0]:
        if "model.layers.1.mlp.down_proj.weight" in e.hf:
            with torch.no_grad():
                c.get_parameter(e.local).view(-1)[0] = 1e6
    parallm.save_checkpoint(s["ckpt"], chunks, step=1)


@pytest.mark.timeout(200)
def test_offline_export_refuses_a_float16_overflow(tmp_path):
    """checkpoint_to_hf(dtype=float16) of a weight float16 cannot hold: the catalog's overflow error (as
    save_hf_weights and export_hf_tensors raise it), and no output directory; bfloat16 holds it."""
    from parallm.checkpoint.training import checkpoint_to_hf
    from parallm.errors import CheckpointError
    model = helpers.make_hf_model(helpers.tiny_config("llama"), seed=32)
    s = dict(hf=helpers.save_checkpoint(model, str(tmp_path / "hf")), ckpt=str(tmp_path / "ckpt"))
    helpers.run_ranks(rank_big_value, 1, s)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: values up to 1e\+06 "
                                              r"overflow torch\.float16 \(max 65504\); export in bfloat16"):
        checkpoint_to_hf(s["ckpt"], str(tmp_path / "f16"), dtype=torch.float16)
    assert not os.path.exists(tmp_path / "f16")
    assert [p for p in os.listdir(tmp_path) if "parallm-tmp" in p] == []     # the temporary directory removed
    checkpoint_to_hf(s["ckpt"], str(tmp_path / "bf16"), dtype=torch.bfloat16)
    import transformers
    got = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert got.state_dict()["model.layers.1.mlp.down_proj.weight"].view(-1)[0] == torch.tensor(1e6).bfloat16()


# -- checkpoints written when every routed expert was a parameter of its own ---------------------------------------

PER_EXPERT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "moe_per_expert_checkpoint")


def rank_per_expert(rank, world, config_dir, root, layouts):
    import parallm
    out = {}
    for tp, ep, shard in layouts:
        parallm.init_parallel(tp=tp, ep=ep)
        chunks = parallm.build_model(config_dir)
        opt = parallm.build_optimizer(chunks, lr=5.0, weight_decay=0.1, shard_over_dp=shard)
        info = parallm.load_checkpoint(PER_EXPERT, chunks, opt)
        path = os.path.join(root, f"tp{tp}-ep{ep}-{'zero' if shard else 'plain'}")
        parallm.save_checkpoint(path, chunks, opt, step=info["step"], extra=info["extra"])
        out[path] = (info, parallm.save_hf_weights(chunks), [g["lr"] for g in opt.param_groups])
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_per_expert_checkpoints_of_earlier_parallm_load_with_stacked_experts(tmp_path):
    """tests/data/moe_per_expert_checkpoint was saved (tests/data/make_per_expert_checkpoint.py) by parallm before
    routed experts were stacked, at tp1 dp2 ep2 with AdamW state. Loaded with stacked experts at ep 1, 2 (ZeRO), 4
    and tp2.ep2, and saved again, every stored tensor (weights, moments, step counters) comes back bit for bit
    under the same per-expert keys, and the model's HF tensors equal the stored weights."""
    import json

    from parallm.checkpoint.training import read_tensors
    with open(os.path.join(PER_EXPERT, "parallm.json")) as f:
        record = json.load(f)
    assert record["saved_with"]["ep"] == 2
    config_dir = helpers.write_config(str(tmp_path / "config"), record["hf_config"])
    stored = read_tensors(PER_EXPERT)
    assert any(".mlp.experts.3.gate_proj." in k for k in stored) and any(k.startswith("optim/step/") for k in stored)
    layouts = [(1, 1, False), (1, 2, True), (1, 4, False), (2, 2, False)]
    res = helpers.run_ranks(rank_per_expert, 4, config_dir, str(tmp_path), layouts)[0]
    weights = {k[len("model/"):]: v for k, v in stored.items() if k.startswith("model/")}
    for path, (info, hf, lrs) in res.items():
        assert info == {"step": 1, "extra": {"written_by": "per-expert parameters"}}, info
        assert set(lrs) == {1e-2}, lrs
        helpers.assert_same_state(hf, weights)
        again = read_tensors(path)
        assert again.keys() == stored.keys(), sorted(set(again) ^ set(stored))[:5]
        bad = [k for k in stored if not torch.equal(again[k], stored[k])]
        assert not bad, (path, bad[:5])
