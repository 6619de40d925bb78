"""The sender's side of a push into engines in other processes (``parallm.integrations.vllm.remote``), without
vLLM: two stand-in engines behind :func:`~parallm.integrations.vllm.connect` that read each update exactly as
parallm's worker-side backends do (``backends.unpack`` over the shared-memory slot, or a receive in the engine's
gloo group), the trainer at tp2 on 2 gloo ranks, 64 KiB buckets (dozens of updates, both slots reused many
times). Runs in the main suite (no vLLM needed).

* ``parallm_shm`` is one copy on the sender: every tensor the export stream yields to the fan-out is a view of
  the shared-memory file (the stream wrote it there through its ``out`` hook), the stream allocated no output
  buffer of its own, each update's offsets are where those views lie; what each engine read is bit-equal to
  ``save_hf_weights``. The stand-ins read a slot a few milliseconds after the update call (a sender that wrote
  into a slot before every engine had loaded it would show here).
* ``parallm_gloo`` the same through a gloo group per engine (bit-equal, buffers of the sender).
* The default bucket of a push into other processes (512 MiB) is capped at the model's size: one bucket, slots
  of the model's bytes (plus alignment room), bit-equal.
* ``export_hf_tensors(out=...)`` itself: yielded tensors are views of the caller's buffers, equal to
  ``copy=True``'s; ``out`` with ``copy=True`` and an ``out`` that returns a wrong buffer raise on every rank.
* A trainer rank failing during the stream (rank 1 raising halfway): the same error type on every rank within
  seconds, nobody hangs, the engines finished with what they had (not marked failed), and the next push brings
  every tensor.
"""

from __future__ import annotations

import time

import torch

import helpers
import vllm_engines as ve

LAYERS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96)


def _rank(rank, world, ckpt):
    import parallm
    from parallm.checkpoint import export_run as export
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm import client, remote
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    engines = []

    def handles(_, timeout):
        engines[:] = [ve.StandIn("a"), ve.StandIn("b")]
        return engines
    client._handles = handles

    # parallm_shm: the stream writes into the file
    conn = pv.connect(["a", "b"], backend="parallm_shm", timeout=30)
    seen = []
    add = remote._Fanout.add

    def watched(self, name, tensor):
        region = self.conn.shm
        seen.append(region is not None and tensor.untyped_storage().data_ptr()
                    == region.untyped_storage().data_ptr())
        return add(self, name, tensor)
    remote._Fanout.add = watched
    stats = pv.push_weights(chunks, conn, bucket_bytes="64KB")
    remote._Fanout.add = add
    out["updates"] = stats["updates"]
    out["stream_output_buffers"] = chunks[0]._parallm_export["buffers"].count("output")
    state = parallm.save_hf_weights(chunks)
    if rank == 0:
        out["in_shm"] = (len(seen), all(seen))
        out["shm_exact"] = [sorted(e.got) == sorted(state) and all(torch.equal(e.got[n], state[n]) for n in state)
                            for e in engines]
        out["calls"] = [([c for c in e.calls if c != "update"], e.calls.count("update")) for e in engines]
        out["slots"] = sorted({i["slot"] for i in engines[0].infos})
    shm_engines = list(engines)

    # a trainer rank fails halfway through the stream; the next push brings everything
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.5)
    source, calls = export._source, [0]

    def failing(params, p):
        calls[0] += 1
        if rank == 1 and calls[0] == 12:
            raise RuntimeError("rank 1 failed halfway")
        return source(params, p)
    export._source = failing
    t0 = time.monotonic()
    try:
        pv.push_weights(chunks, conn, bucket_bytes="64KB")
        out["trainer_failed"] = ("ok", "", 0.0)
    except Exception as e:  # noqa: BLE001
        out["trainer_failed"] = (type(e).__name__, str(e), time.monotonic() - t0)
    export._source = source
    out["needs_restart"] = conn.needs_restart
    if rank == 0:
        out["after_failure_calls"] = [e.calls[-1] for e in shm_engines]
        for e in shm_engines:
            e.got.clear()
            e.calls.clear()
    stats = pv.push_weights(chunks, conn, bucket_bytes="64KB")
    out["needs_restart_after_next"] = (conn.needs_restart, stats["needs_restart"])
    state = parallm.save_hf_weights(chunks)
    if rank == 0:
        out["after_failure_exact"] = [all(torch.equal(e.got[n], state[n]) for n in state) for e in shm_engines]
        out["recovery_calls"] = [e.calls[:4] + e.calls[-3:] for e in shm_engines]
    conn.close()

    # parallm_gloo: the same through a gloo group per engine
    conn = pv.connect(["a", "b"], backend="parallm_gloo", timeout=30)
    pv.push_weights(chunks, conn, bucket_bytes="64KB")
    if rank == 0:
        out["gloo_exact"] = [all(torch.equal(e.got[n], state[n]) for n in state) for e in engines]
    conn.close()

    # the default bucket for engines in other processes (512 MiB) capped at the model's size: one bucket, and
    # shared-memory slots of about the model's bytes rather than 2 x 512 MiB
    conn = pv.connect(["a", "b"], backend="parallm_shm", timeout=30)
    stats = pv.push_weights(chunks, conn)
    if rank == 0:
        out["default_bucket"] = dict(buckets=stats["buckets"], slot_bytes=conn.slot_bytes,
                                     model_bytes=sum(t.numel() * t.element_size() for t in state.values()),
                                     exact=[all(torch.equal(e.got[n], state[n]) for n in state) for e in engines])
    conn.close()

    # a model on an accelerator pushing into host memory (a CUDA trainer's slots: the shm file, gloo's sender
    # buffers): forced here on CPU, the stream assembles each bucket in its own buffer and copies it into the slot
    staged = export._staged
    export._staged = lambda buf, device: True
    remote._Fanout.add = watched
    seen.clear()
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.25)
    state = parallm.save_hf_weights(chunks)
    conn = pv.connect(["a", "b"], backend="parallm_shm", timeout=30)
    try:
        stats = pv.push_weights(chunks, conn, bucket_bytes="64KB")
    finally:
        remote._Fanout.add, export._staged = add, staged
    if rank == 0:
        out["staged"] = dict(in_shm=len(seen) > 0 and all(seen), updates=stats["updates"],
                             output_buffers=chunks[0]._parallm_export["buffers"].count("output"),
                             exact=[all(torch.equal(e.got[n], state[n]) for n in state) for e in engines])
    conn.close()

    # the hook itself
    bufs = {}

    def into(k, numel):
        bufs[k % 2] = b = torch.empty(numel + 7, dtype=torch.float32)
        return b
    hooked = []
    for name, t in parallm.export_hf_tensors(chunks, bucket_bytes="64KB", dst_ranks=[0], out=into):
        hooked.append((name, any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                                 for b in bufs.values()), t.clone()))
    copied = dict(parallm.export_hf_tensors(chunks, bucket_bytes="64KB", dst_ranks=[0], copy=True))
    if rank == 0:
        out["hook_views"] = all(v for _, v, _ in hooked) and len(hooked) == len(copied)
        out["hook_exact"] = all(torch.equal(t, copied[n]) for n, _, t in hooked)
    for key, kwargs in (("out_and_copy", dict(out=into, copy=True)),
                        ("bad_out", dict(out=lambda k, n: torch.empty(n, dtype=torch.float64)))):
        try:
            for _ in parallm.export_hf_tensors(chunks, dst_ranks=[0], **(kwargs if rank == 0 else
                                                                         {"copy": kwargs.get("copy", False)})):
                pass
            out[key] = ("ok", "")
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e))
    return out


def test_push_fanout_one_copy_and_failures(tmp_path):
    cfg = helpers.tiny_config("qwen2", tie_word_embeddings=False, **LAYERS)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=3), str(tmp_path / "ckpt"))
    res = helpers.run_ranks(_rank, 2, ckpt)
    r0 = res[0]
    count, all_in = r0["in_shm"]
    assert count > 0 and all_in, "the stream yielded tensors outside the shared-memory file: an extra copy"
    assert r0["stream_output_buffers"] == 0
    assert r0["updates"] > 8, r0["updates"]
    assert r0["shm_exact"] == [True, True]
    assert r0["slots"] == [0, 1]
    for calls, n in r0["calls"]:
        assert calls == ["init", "verify", "pause", "start", "finish", "reset", "resume"] and n == r0["updates"], calls
    for r in res:
        kind, msg, seconds = r["trainer_failed"]
        assert kind == "RuntimeError" and "rank 1 failed halfway" in msg and seconds < 30, r["trainer_failed"]
        # both engines had received part of the push: not finished (vLLM would build the layer it was loading
        # from uninitialised memory), paused, listed as not to be used until a complete push
        assert r["needs_restart_after_next"][1] == [], r["needs_restart_after_next"]
    assert r0["needs_restart"] == ["a", "b"] and r0["needs_restart_after_next"][0] == [], r0
    assert r0["after_failure_calls"] == ["update", "update"], r0["after_failure_calls"]
    # the next push closes the interrupted update first, then sends every tensor
    assert r0["recovery_calls"] == [["verify", "pause", "finish", "start", "finish", "reset", "resume"]] * 2, \
        r0["recovery_calls"]
    assert r0["after_failure_exact"] == [True, True]
    assert r0["gloo_exact"] == [True, True]
    d = r0["default_bucket"]
    assert d["buckets"] == 1 and d["exact"] == [True, True], d
    assert d["model_bytes"] <= d["slot_bytes"] <= d["model_bytes"] + (2 << 20), d
    assert r0["hook_views"] and r0["hook_exact"]
    staged = r0["staged"]
    assert staged["in_shm"] and staged["output_buffers"] == 2 and staged["updates"] > 8, staged
    assert staged["exact"] == [True, True], staged
    for r in res:
        assert r["out_and_copy"][0] == "ValueError" and "not given with copy=True" in r["out_and_copy"][1] \
            or r["out_and_copy"][0] == "ValueError" and "differ" in r["out_and_copy"][1], r["out_and_copy"]
        assert r["bad_out"][0] == "ValueError", r["bad_out"]
    assert "float64" in r0["bad_out"][1] and "contiguous 1-D torch.float32" in r0["bad_out"][1], r0["bad_out"]


def test_out_may_be_host_memory_for_a_device_model():
    """``export_hf_tensors(out=...)`` for parameters on CUDA takes host memory (what a remote push hands it: the
    shared-memory slots, gloo's sender buffers), where it used to raise on the first bucket; memory on another
    device is still refused."""
    from parallm.checkpoint import export_run as export
    cuda = torch.device("cuda", 0)
    buf = export._consumer_buffer(lambda k, n: torch.empty(n + 3), 0, 8, torch.float32, cuda)
    assert buf.device.type == "cpu" and buf.numel() == 8 and export._staged(buf, cuda)
    assert not export._staged(buf, torch.device("cpu"))
    try:
        export._consumer_buffer(lambda k, n: torch.empty(n, device="meta"), 0, 8, torch.float32, cuda)
    except ValueError as e:
        assert "on cuda:0 (or on the host)" in str(e), e
    else:
        raise AssertionError("a buffer on another device was accepted")

