"""The bucketed export stream and dtype conversion on load / save / export, on 4 gloo ranks (one spawn, three
layouts): tp2 x pp2 (Qwen2, nkv < tp, padded vocab), tp1 x pp2 x vpp2 x dp2, and a Qwen3-MoE at tp2 x ep2.

Every tensor exactly once, bit-exact against the checkpoint and against save_hf_weights; buckets small enough to
split large tensors; a cast on the sender; a subset of destination ranks; export_metadata equal to the stream
(names, dtypes, shapes, order) on every rank; the two-buffer memory bound (a destination's tensors live in two
buffers, reused by the next call; tensors kept with copy=True intact and in memory of their own); a consumer that
stops early on one rank only (break after 3 tensors, close() before reading, dropping the generator, throw())
ends the stream on every rank, with an error on the others, within seconds, and the next export is exact; bad
arguments and overflowing casts are errors on every rank; bf16 -> fp32 loads exactly, fp32 -> bf16 rounds as
torch does, fp32 -> fp16 overflow is the catalog's error."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import (hf_state_dict, hub_state_dict, make_hf_model, run_ranks, save_checkpoint, tiny_config,
                     write_ckpt)

DOWN1 = "model.layers.1.mlp.down_proj.weight"
OVERFLOW = f"{DOWN1}: values up to 1e+06 overflow torch.float16 (max 65504); build the model in bfloat16 or float32"


def _attempt(out, key, fn):
    try:
        out[key] = ("ok", fn())
    except Exception as e:  # noqa: BLE001
        out[key] = (type(e).__name__, str(e))


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def _export_checks(rank, chunks, ref, saved, out, prefix, cases):
    """Run each export case; ``out[prefix + key]`` = (names in order, whether every tensor equals the
    checkpoint's (cast with torch's .to), the storages the tensors were views of, (name, dtype, shape) of each
    tensor)."""
    import parallm

    def export(keep=False, **kw):
        names, equal, kept, storages, meta = [], True, {}, [], []
        for name, t in parallm.export_hf_tensors(chunks, **kw):
            names.append(name)
            meta.append((name, t.dtype, tuple(t.shape)))
            storages.append(_storage(t))
            want = ref[name].to(kw.get("dtype") or torch.float32)
            equal &= t.dtype == want.dtype and torch.equal(t, want)
            if saved is not None and rank == 0:
                equal &= torch.equal(t.float(), saved[name].to(t.dtype).float())
            if keep:
                kept[name] = t
        if keep:   # tensors kept with copy=True were never overwritten by later buckets
            equal &= all(torch.equal(t, ref[n].to(t.dtype)) for n, t in kept.items())
        return names, bool(equal), storages, meta

    for key, kw in cases.items():
        _attempt(out, prefix + key, lambda: export(**kw))


def _meta(meta):
    """export_metadata's entries as plain tuples (what the launcher carries back), after checking their type."""
    import parallm
    assert all(isinstance(m, parallm.TensorMeta) for m in meta)
    return [(m.name, m.dtype, tuple(m.shape)) for m in meta]


def _buffer_report(chunks):
    """The buffers the stream keeps with the model: numel by (kind, dtype)."""
    cache = chunks[0]._parallm_export["buffers"]
    return {f"{kind}/{dtype}": sorted(b.numel() for k, b in cache.bufs.items() if k[0] == kind and k[1] == dtype)
            for kind in ("output", "staging", "packing") for dtype in (torch.float32, torch.bfloat16)}


def _abandon_cases(rank, chunks, ref, out):
    """A consumer that stops early on one rank only. ``out[key]`` = (outcome, message, seconds, tensors read)."""
    import parallm

    def run(key, body):
        t0 = time.monotonic()
        got = []
        try:
            body(got)
            out[key] = ("ok", "", time.monotonic() - t0, len(got))
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e), time.monotonic() - t0, len(got))

    def break_after_3(dst, who, bucket):
        def body(got):
            for name, t in parallm.export_hf_tensors(chunks, dst_ranks=dst, bucket_bytes=bucket):
                got.append(name)
                if rank == who and len(got) == 3:
                    break        # the generator is dropped here: CPython closes it at once
        return body

    def close_unread(who):
        def body(got):
            gen = parallm.export_hf_tensors(chunks, dst_ranks=[0], bucket_bytes=3000)
            if rank == who:
                gen.close()
                return
            for name, _ in gen:
                got.append(name)
        return body

    def drop_after_3(who):
        def body(got):
            gen = parallm.export_hf_tensors(chunks, bucket_bytes=3000)
            for name, _ in gen:
                got.append(name)
                if rank == who and len(got) == 3:
                    del gen      # no close(): garbage collection ends it
                    return
        return body

    def throw_after_2(who):
        def body(got):
            gen = parallm.export_hf_tensors(chunks, dst_ranks=[0, 1], bucket_bytes=3000)
            for name, _ in gen:
                got.append(name)
                if rank == who and len(got) == 2:
                    gen.throw(ValueError("the engine refused it"))
        return body

    run("break3-every-rank", break_after_3(None, 1, 3000))
    run("break3-dst0", break_after_3([0], 0, 3000))
    run("break3-big-bucket", break_after_3(None, 2, "64MB"))   # one bucket: nothing left to tell the others
    run("close-sender", close_unread(2))
    run("drop-after-3", drop_after_3(3))
    run("throw", throw_after_2(0))
    names = []
    equal = True
    for name, t in parallm.export_hf_tensors(chunks, bucket_bytes=3000):
        names.append(name)
        equal &= torch.equal(t, ref[name])
    out["after-abandon"] = (names, bool(equal))


def _rank(rank, world, s):
    import torch.distributed as dist

    import parallm
    from parallm.checkpoint import export as export_module
    out = {}

    # -- tp2 x pp2: every case, direct parts, the memory bound, early stops, errors, dtype conversion --------
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(s["ckpt"])
    parallm.load_hf_weights(chunks, s["ckpt"], mode="slice")
    saved = parallm.save_hf_weights(chunks)                        # rank 0: the reference of the export stream
    cases = {"default": {}, "tiny-buckets": dict(bucket_bytes=600), "one-row-buckets": dict(bucket_bytes=1),
             "bf16": dict(dtype=torch.bfloat16, bucket_bytes="4KB"),
             "keep": dict(keep=True, copy=True, bucket_bytes=2000),
             "dst0": dict(dst_ranks=[0], bucket_bytes=3000), "dst13": dict(dst_ranks=[3, 1], bucket_bytes=5000),
             "bound": dict(bucket_bytes=3000), "bound-again": dict(bucket_bytes=3000)}
    _export_checks(rank, chunks, s["ref"], saved, out, "", cases)
    out["buffers"] = _buffer_report(chunks)
    out["meta"] = _meta(parallm.export_metadata(chunks))
    out["meta-bf16"] = _meta(parallm.export_metadata(chunks, dtype=torch.bfloat16))
    # the same with direct parts: rows of 64+ bytes travel alone into their place (the tiny model's tensors are
    # all below the default threshold, so above every part was packed)
    default_direct, export_module.DIRECT_MIN_BYTES = export_module.DIRECT_MIN_BYTES, 64
    try:
        _export_checks(rank, chunks, s["ref"], saved, out, "direct/", cases)
    finally:
        export_module.DIRECT_MIN_BYTES = default_direct
    _abandon_cases(rank, chunks, s["ref"], out)
    # bad arguments: ValueError on every rank (also when only one rank passes a different value)
    _attempt(out, "bucket-0", lambda: list(parallm.export_hf_tensors(chunks, bucket_bytes=0)))
    _attempt(out, "bucket-neg", lambda: list(parallm.export_hf_tensors(chunks, bucket_bytes=-5)))
    _attempt(out, "dst-outside", lambda: list(parallm.export_hf_tensors(chunks, dst_ranks=[0, 4])))
    _attempt(out, "dst-negative", lambda: list(parallm.export_hf_tensors(chunks, dst_ranks=[-1])))
    _attempt(out, "args-differ", lambda: list(parallm.export_hf_tensors(chunks, bucket_bytes=1000 + (rank == 2))))
    _attempt(out, "copy-differs", lambda: list(parallm.export_hf_tensors(chunks, copy=rank == 3)))
    _attempt(out, "meta-bad-dtype", lambda: parallm.export_metadata(chunks, dtype=torch.int8))
    # a value float16 cannot hold: export and save refuse it on every rank, before anything moves
    from parallm.model.table import model_entries
    from parallm.parallel.state import dims_of
    layout = dims_of(chunks)
    if layout.tp_rank == 1:   # one TP rank's shard only: its error must reach every rank
        for e, c in model_entries(chunks, layout)[0]:
            if DOWN1 in e.hf:
                with torch.no_grad():
                    c.get_parameter(e.local).view(-1)[0] = 1e6
    _attempt(out, "export-fp16-overflow", lambda: list(parallm.export_hf_tensors(chunks, dtype=torch.float16)))
    _attempt(out, "save-fp16-overflow", lambda: parallm.save_hf_weights(chunks, dtype=torch.float16))
    parallm.load_hf_weights(chunks, s["ckpt"], mode="slice")
    _export_checks(rank, chunks, s["ref"], None, out, "", {"after-errors": dict(bucket_bytes=10000)})

    # dtype conversion on load (slice and broadcast): bf16 -> fp32 exact, fp32 -> bf16 as torch rounds
    for mode in ("slice", "broadcast"):
        m32 = parallm.build_model(s["ckpt"], dtype=torch.float32)
        parallm.load_hf_weights(m32, s["ckpt_bf16"], mode=mode)
        got = parallm.save_hf_weights(m32)
        out[f"bf16->fp32/{mode}"] = rank != 0 or all(
            got[n].dtype == torch.float32 and torch.equal(got[n], s["ref"][n].bfloat16().float()) for n in s["ref"])
        m16 = parallm.build_model(s["ckpt"], dtype=torch.bfloat16)
        parallm.load_hf_weights(m16, s["ckpt"], mode=mode)
        got = parallm.save_hf_weights(m16)
        out[f"fp32->bf16/{mode}"] = rank != 0 or all(
            got[n].dtype == torch.bfloat16 and torch.equal(got[n], s["ref"][n].bfloat16()) for n in s["ref"])
        got = parallm.save_hf_weights(chunks, dtype=torch.bfloat16)
        out[f"save-bf16/{mode}"] = rank != 0 or all(torch.equal(got[n], s["ref"][n].bfloat16()) for n in s["ref"])
        f16 = parallm.build_model(s["ckpt"], dtype=torch.float16)
        _attempt(out, f"fp32->fp16-overflow/{mode}", lambda: parallm.load_hf_weights(f16, s["ckpt_big"], mode=mode))
    del chunks, m32, m16, f16
    parallm.destroy_parallel()

    # -- other layouts: tp1 x pp2 x vpp2 x dp2 (dense), tp2 x ep2 (dp2, MoE) -----------------------------------
    layout_cases = {"default": {}, "dst0": dict(dst_ranks=[0], bucket_bytes=3000),
                    "bf16": dict(dtype=torch.bfloat16, bucket_bytes="4KB"), "bound": dict(bucket_bytes=3000),
                    "keep": dict(keep=True, copy=True, bucket_bytes=2000)}
    for name, kw, ckpt, ref in (("vpp", dict(tp=1, pp=2, vpp=2), s["ckpt"], s["ref"]),
                                ("moe", dict(tp=2, ep=2), s["moe"], s["moe_ref"])):
        parallm.init_parallel(**kw)
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt, mode="slice")
        _export_checks(rank, chunks, ref, None, out, f"{name}/", layout_cases)
        out[f"{name}/buffers"] = _buffer_report(chunks)
        out[f"{name}/meta"] = _meta(parallm.export_metadata(chunks))
        out[f"{name}/meta-bf16"] = _meta(parallm.export_metadata(chunks, dtype=torch.bfloat16))
        out[f"{name}/layers"] = [list(c.layer_range) for c in chunks]
        del chunks
        parallm.destroy_parallel()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    # nkv=1 < tp=2 (replicated KV heads), vocab 99 (padded over tp), untied: every layout kind, 4 layers over pp=2
    cfg = tiny_config("qwen2", num_hidden_layers=4, num_key_value_heads=1, vocab_size=99)
    model = make_hf_model(cfg, seed=41)
    ckpt = save_checkpoint(model, str(root / "ckpt"))
    ref = hf_state_dict(model)
    import json
    with open(f"{ckpt}/config.json") as f:
        config = json.load(f)
    big = dict(ref)
    big[DOWN1] = big[DOWN1].clone()
    big[DOWN1][0, 0] = 1e6
    moe = make_hf_model(tiny_config("qwen3_moe", num_hidden_layers=2), seed=42)
    moe_dir = str(root / "moe")
    moe_ref = hub_state_dict(moe, moe_dir)
    s = dict(ckpt=ckpt, ref=ref, ckpt_bf16=write_ckpt(root / "bf16", {k: v.bfloat16() for k, v in ref.items()}, config),
             ckpt_big=write_ckpt(root / "big", big, config), moe=moe_dir, moe_ref=moe_ref)
    return run_ranks(_rank, 4, s, timeout=500), ref, moe_ref


def _check_every_tensor_once(res, ref, key):
    order = None
    for rank, r in enumerate(res):
        status, value = r[key]
        assert status == "ok", (rank, value)
        names, equal, _, _ = value
        assert equal, (key, rank)
        assert len(names) == len(set(names)) and set(names) == set(ref), (key, rank)
        assert order is None or names == order          # the same order everywhere
        order = names


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", ["default", "tiny-buckets", "one-row-buckets", "bf16", "keep", "after-errors",
                                 "direct/default", "direct/tiny-buckets", "direct/one-row-buckets", "direct/bf16",
                                 "direct/keep", "vpp/default", "vpp/bf16", "vpp/keep", "moe/default", "moe/bf16",
                                 "moe/keep"])
def test_export_every_tensor_once_bit_exact(results, key):
    res, ref, moe_ref = results
    _check_every_tensor_once(res, moe_ref if key.startswith("moe/") else ref, key)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,dst", [("dst0", [0]), ("dst13", [1, 3]), ("direct/dst0", [0]),
                                     ("direct/dst13", [1, 3]), ("vpp/dst0", [0]), ("moe/dst0", [0])])
def test_export_to_some_ranks_only(results, key, dst):
    res, ref, moe_ref = results
    ref = moe_ref if key.startswith("moe/") else ref
    for rank, r in enumerate(res):
        status, (names, equal, _, _) = r[key]
        assert status == "ok" and equal
        if rank in dst:
            assert len(names) == len(set(names)) and set(names) == set(ref), rank
        else:
            assert names == [], rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prefix", ["", "vpp/", "moe/"])
def test_export_metadata_equals_the_stream(results, prefix):
    """Names, dtypes, shapes and order, on every rank (also those that receive nothing), for the model dtype and
    a cast; at three layouts (the vpp layout has non-contiguous layer ranges per rank)."""
    res, _, _ = results
    stream = res[0][f"{prefix}default"][1][3]
    stream_bf16 = res[0][f"{prefix}bf16"][1][3]
    assert stream and all(d == torch.float32 for _, d, _ in stream)
    for rank, r in enumerate(res):
        assert [tuple(m) for m in r[f"{prefix}meta"]] == stream, rank
        assert [tuple(m) for m in r[f"{prefix}meta-bf16"]] == stream_bf16, rank
        assert all(d == torch.bfloat16 for _, d, _ in r[f"{prefix}meta-bf16"])
        assert r[f"{prefix}default"][1][3] == stream                    # every destination saw the same stream
    if prefix == "vpp/":
        assert [r["vpp/layers"] for r in res] == [[[0], [2]], [[0], [2]], [[1], [3]], [[1], [3]]]
    msg = res[0]["meta-bad-dtype"]
    assert msg[0] == "ValueError" and "dtype must be one of" in msg[1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prefix", ["", "direct/", "vpp/", "moe/"])
def test_export_two_buffer_bound(results, prefix):
    """Without copy, a destination's tensors are views of two buffers, the same two on the next call (kept with
    the model), each at most the largest bucket; with copy=True every bucket has memory of its own."""
    res, _, _ = results
    for rank, r in enumerate(res):
        status, (names, _, storages, meta) = r[f"{prefix}bound"]
        assert status == "ok", rank
        assert len(names) > 10
        assert len(set(storages)) == 2, (rank, len(set(storages)))
        if f"{prefix}bound-again" in r:
            assert set(r[f"{prefix}bound-again"][1][2]) == set(storages), rank
        kept = r[f"{prefix}keep"][1][2]
        assert len(set(kept)) > 2 and not set(kept) & set(storages), rank
        bufs = r[f"{prefix}buffers" if prefix in ("vpp/", "moe/") else "buffers"]
        assert all(len(v) <= 2 for v in bufs.values()), (rank, bufs)      # two per kind and dtype
        assert bufs["output/torch.float32"] or rank not in (0,), (rank, bufs)
        largest = max(torch.Size(s).numel() for _, _, s in meta)
        bound = max(64 * 2 ** 20 // 4, 2 * largest)      # the largest bucket (default 64 MB) or one entry's room
        assert all(n <= bound for kind in bufs.values() for n in kind), (rank, bufs, bound)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,who,dst", [("break3-every-rank", 1, None), ("break3-dst0", 0, [0]),
                                         ("drop-after-3", 3, None), ("close-sender", 2, [0])])
def test_export_abandoned_on_one_rank_ends_everywhere(results, key, who, dst):
    """The rank that stopped ends quietly; every other rank raises a ParallelError that names it and how far it
    read, within seconds (no rank waits for the process-group timeout), and the next export is exact."""
    res, ref, _ = results
    n = len(ref)
    for rank, r in enumerate(res):
        status, msg, seconds, got = r[key]
        assert seconds < 20, (key, rank, seconds)
        if rank == who:
            assert status == "ok" and got == (0 if key == "close-sender" else 3), (rank, status, msg)
        else:
            assert status == "ParallelError", (key, rank, status, msg)
            read = 0 if key == "close-sender" else 3
            assert f"rank {who} stopped reading the stream" in msg and f"after {read} of {n} tensors" in msg, msg
            assert got < n if dst is None or rank in dst else got == 0, (rank, got)
    for rank, r in enumerate(res):
        names, equal = r["after-abandon"]
        assert equal and sorted(names) == sorted(ref), rank


@pytest.mark.timeout(600)
def test_export_stopped_within_its_last_bucket_is_a_clean_stop(results):
    """With one bucket every message is under way before the consumer reads: the others end normally."""
    res, ref, _ = results
    for rank, r in enumerate(res):
        status, msg, seconds, got = r["break3-big-bucket"]
        assert status == "ok" and seconds < 20, (rank, msg)
        assert got == (3 if rank == 2 else len(ref)), (rank, got)


@pytest.mark.timeout(600)
def test_export_error_thrown_in_reaches_every_rank(results):
    res, _, _ = results
    for rank, r in enumerate(res):
        status, msg, seconds, _ = r["throw"]
        assert status == "ValueError" and "the engine refused it" in msg and seconds < 20, (rank, status, msg)
        if rank != 0:
            assert "export_hf_tensors failed on rank 0" in msg, msg


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,needles", [
    ("bucket-0", ["bucket_bytes", "at least 1 byte"]), ("bucket-neg", ["bucket_bytes", "-5"]),
    ("dst-outside", ["dst_ranks", "[4]", "outside the world of 4"]), ("dst-negative", ["dst_ranks", "[-1]"]),
    ("args-differ", ["same dtype, bucket_bytes, dst_ranks and copy", "[2]"]),
    ("copy-differs", ["same dtype, bucket_bytes, dst_ranks and copy", "[3]"])])
def test_export_bad_arguments_are_value_errors_on_every_rank(results, key, needles):
    res, _, _ = results
    for rank, r in enumerate(res):
        status, msg = r[key]
        assert status == "ValueError", (rank, status, msg)
        assert all(n in msg for n in needles), (rank, msg)


@pytest.mark.timeout(600)
def test_float16_overflow_on_export_and_save_on_every_rank(results):
    res, _, _ = results
    for key, verb in (("export-fp16-overflow", "export"), ("save-fp16-overflow", "save")):
        for rank, r in enumerate(res):
            status, msg = r[key]
            assert status == "CheckpointError", (key, rank, msg)
            assert "values up to 1e+06 overflow torch.float16 (max 65504)" in msg and f"{verb} in bfloat16" in msg
            assert "mlp.down_proj.weight" in msg, msg


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["slice", "broadcast"])
def test_load_dtype_conversion(results, mode):
    res, _, _ = results
    for what in ("bf16->fp32", "fp32->bf16", "save-bf16"):
        assert all(r[f"{what}/{mode}"] for r in res), what
    for rank, r in enumerate(res):
        status, msg = r[f"fp32->fp16-overflow/{mode}"]
        assert status == "CheckpointError" and OVERFLOW in msg, (rank, msg)
