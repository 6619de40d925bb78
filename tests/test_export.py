"""The bucketed export stream and dtype conversion on load / save / export, at tp2 x pp2 on 4 gloo ranks (one
spawn): every tensor exactly once, bit-exact against the checkpoint and against save_hf_weights; buckets small
enough to split large tensors; a cast on the sender; a subset of destination ranks; tensors a consumer keeps stay
intact; bad arguments and overflowing casts are errors on every rank; bf16 -> fp32 loads exactly, fp32 -> bf16
rounds as torch does, fp32 -> fp16 overflow is the catalog's error."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_state_dict, make_hf_model, run_ranks, save_checkpoint, tiny_config, write_ckpt

DOWN1 = "model.layers.1.mlp.down_proj.weight"
OVERFLOW = f"{DOWN1}: values up to 1e+06 overflow torch.float16 (max 65504); build the model in bfloat16 or float32"


def _attempt(out, key, fn):
    try:
        out[key] = ("ok", fn())
    except Exception as e:  # noqa: BLE001
        out[key] = (type(e).__name__, str(e))


def _rank(rank, world, s):
    import parallm
    out = {}
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(s["ckpt"])
    parallm.load_hf_weights(chunks, s["ckpt"], mode="slice")
    saved = parallm.save_hf_weights(chunks)                        # rank 0: the reference of the export stream

    def export(keep=False, **kw):
        """(names in order, whether every tensor equals the checkpoint's (cast with torch's .to))."""
        names, equal, kept = [], True, {}
        for name, t in parallm.export_hf_tensors(chunks, **kw):
            names.append(name)
            want = s["ref"][name].to(kw.get("dtype") or torch.float32)
            equal &= t.dtype == want.dtype and torch.equal(t, want)
            if rank == 0:
                equal &= torch.equal(t.float(), saved[name].to(t.dtype).float())
            if keep:
                kept[name] = t
        if keep:   # tensors the consumer kept were never overwritten by later buckets
            equal &= all(torch.equal(t, s["ref"][n]) for n, t in kept.items())
        return names, bool(equal)

    cases = {"default": {}, "tiny-buckets": dict(bucket_bytes=600), "one-row-buckets": dict(bucket_bytes=1),
             "bf16": dict(dtype=torch.bfloat16, bucket_bytes="4KB"), "keep": dict(keep=True, bucket_bytes=2000),
             "dst0": dict(dst_ranks=[0], bucket_bytes=3000), "dst13": dict(dst_ranks=[3, 1], bucket_bytes=5000)}
    for key, kw in cases.items():
        _attempt(out, key, lambda: export(**kw))
    # the same with direct parts: rows of 64+ bytes travel alone into their place (the tiny model's tensors are
    # all below the default threshold, so above every part was packed)
    from parallm.checkpoint import export as export_module
    default_direct, export_module.DIRECT_MIN_BYTES = export_module.DIRECT_MIN_BYTES, 64
    try:
        for key, kw in cases.items():
            _attempt(out, f"direct/{key}", lambda: export(**kw))
    finally:
        export_module.DIRECT_MIN_BYTES = default_direct
    # bad arguments: ValueError on every rank (also when only one rank passes a different value)
    _attempt(out, "bucket-0", lambda: export(bucket_bytes=0))
    _attempt(out, "bucket-neg", lambda: export(bucket_bytes=-5))
    _attempt(out, "dst-outside", lambda: export(dst_ranks=[0, 4]))
    _attempt(out, "dst-negative", lambda: export(dst_ranks=[-1]))
    _attempt(out, "args-differ", lambda: export(bucket_bytes=1000 + (rank == 2)))
    # a value float16 cannot hold: export and save refuse it on every rank, before anything moves
    from parallm.checkpoint.loader import model_entries
    from parallm.parallel.state import dims_of
    layout = dims_of(chunks)
    if layout.tp_rank == 1:   # one TP rank's shard only: its error must reach every rank
        for e, c in model_entries(chunks, layout)[0]:
            if DOWN1 in e.hf:
                with torch.no_grad():
                    c.get_parameter(e.local).view(-1)[0] = 1e6
    _attempt(out, "export-fp16-overflow", lambda: export(dtype=torch.float16))
    _attempt(out, "save-fp16-overflow", lambda: parallm.save_hf_weights(chunks, dtype=torch.float16))
    parallm.load_hf_weights(chunks, s["ckpt"], mode="slice")
    _attempt(out, "after-errors", lambda: export(bucket_bytes=10000))

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
    s = dict(ckpt=ckpt, ref=ref, ckpt_bf16=write_ckpt(root / "bf16", {k: v.bfloat16() for k, v in ref.items()}, config),
             ckpt_big=write_ckpt(root / "big", big, config))
    return run_ranks(_rank, 4, s, timeout=400), ref


def _ok(results, key):
    return [r[key] for r in results]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", ["default", "tiny-buckets", "one-row-buckets", "bf16", "keep", "after-errors",
                                 "direct/default", "direct/tiny-buckets", "direct/one-row-buckets", "direct/bf16",
                                 "direct/keep"])
def test_export_every_tensor_once_bit_exact(results, key):
    res, ref = results
    order = None
    for rank, r in enumerate(res):
        status, value = r[key]
        assert status == "ok", (rank, value)
        names, equal = value
        assert equal, (key, rank)
        assert len(names) == len(set(names)) and set(names) == set(ref), (key, rank)
        assert order is None or names == order          # the same order everywhere
        order = names


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,dst", [("dst0", [0]), ("dst13", [1, 3]), ("direct/dst0", [0]),
                                     ("direct/dst13", [1, 3])])
def test_export_to_some_ranks_only(results, key, dst):
    res, ref = results
    for rank, r in enumerate(res):
        status, (names, equal) = r[key]
        assert status == "ok" and equal
        if rank in dst:
            assert len(names) == len(set(names)) and set(names) == set(ref), rank
        else:
            assert names == [], rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,needles", [
    ("bucket-0", ["bucket_bytes", "at least 1 byte"]), ("bucket-neg", ["bucket_bytes", "-5"]),
    ("dst-outside", ["dst_ranks", "[4]", "outside the world of 4"]), ("dst-negative", ["dst_ranks", "[-1]"]),
    ("args-differ", ["same dtype, bucket_bytes and dst_ranks", "[2]"])])
def test_export_bad_arguments_are_value_errors_on_every_rank(results, key, needles):
    res, _ = results
    for rank, r in enumerate(res):
        status, msg = r[key]
        assert status == "ValueError", (rank, status, msg)
        assert all(n in msg for n in needles), (rank, msg)


@pytest.mark.timeout(600)
def test_float16_overflow_on_export_and_save_on_every_rank(results):
    res, _ = results
    for key, verb in (("export-fp16-overflow", "export"), ("save-fp16-overflow", "save")):
        for rank, r in enumerate(res):
            status, msg = r[key]
            assert status == "CheckpointError", (key, rank, msg)
            assert "values up to 1e+06 overflow torch.float16 (max 65504)" in msg and f"{verb} in bfloat16" in msg
            assert "mlp.down_proj.weight" in msg, msg


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["slice", "broadcast"])
def test_load_dtype_conversion(results, mode):
    res, _ = results
    for what in ("bf16->fp32", "fp32->bf16", "save-bf16"):
        assert all(r[f"{what}/{mode}"] for r in res), what
    for rank, r in enumerate(res):
        status, msg = r[f"fp32->fp16-overflow/{mode}"]
        assert status == "CheckpointError" and OVERFLOW in msg, (rank, msg)
