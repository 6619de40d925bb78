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

LAYERS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96)


class _Engine:
    """A stand-in engine with one worker: what parallm's worker backend does with each call, minus vLLM."""

    def __init__(self, name):
        self.name, self.got, self.calls, self.shm = name, {}, [], None
        self.slot_bytes, self.group, self.infos = 0, None, []

    def workers(self):
        return 1

    def local(self):
        return True

    def init(self, info):
        import datetime

        import torch.distributed as dist
        if "verify" in info:
            self.calls.append("verify")
        elif info["transport"] == "shm":
            self.shm = torch.from_file(info["path"], shared=True, size=info["slot_bytes"] * info["slots"],
                                       dtype=torch.uint8)
            self.slot_bytes = info["slot_bytes"]
        else:
            timeout = datetime.timedelta(seconds=info["timeout_s"])
            store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"],
                                  is_master=False, timeout=timeout)
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(info["group"], store), info["rank_offset"],
                                               info["world_size"], timeout)

    def start(self):
        self.calls.append("start")

    def update(self, info):
        from parallm.integrations.vllm.backends import unpack
        time.sleep(0.005)                    # a slot rewritten too early would be read rewritten
        if info["transport"] == "shm":
            start = info["slot"] * self.slot_bytes
            buf = self.shm[start:start + info["nbytes"]]
        else:
            buf = torch.empty(info["nbytes"], dtype=torch.uint8)
            self.group.broadcast(buf, 0).wait()
        for name, t in unpack(buf, info):
            self.got[name] = t.clone()
        self.infos.append(info)
        self.calls.append("update")

    def finish(self):
        self.calls.append("finish")

    def reset_prefix_cache(self):
        pass


def _rank(rank, world, ckpt):
    import parallm
    from parallm.checkpoint import export
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm import client, remote
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    engines = []

    def handles(_, timeout):
        engines[:] = [_Engine("a"), _Engine("b")]
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
        out["calls"] = [(e.calls[0], e.calls[1], e.calls[-1], e.calls.count("update")) for e in engines]
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
        out["finished_after_failure"] = [e.calls[-1] for e in shm_engines]
        for e in shm_engines:
            e.got.clear()
    pv.push_weights(chunks, conn, bucket_bytes="64KB")
    state = parallm.save_hf_weights(chunks)
    if rank == 0:
        out["after_failure_exact"] = [all(torch.equal(e.got[n], state[n]) for n in state) for e in shm_engines]
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
    for first, second, last, n in r0["calls"]:
        assert (first, second, last) == ("verify", "start", "finish") and n == r0["updates"]
    for r in res:
        kind, msg, seconds = r["trainer_failed"]
        assert kind == "RuntimeError" and "rank 1 failed halfway" in msg and seconds < 30, r["trainer_failed"]
        assert r["needs_restart"] == []
    assert r0["finished_after_failure"] == ["finish", "finish"]
    assert r0["after_failure_exact"] == [True, True]
    assert r0["gloo_exact"] == [True, True]
    d = r0["default_bucket"]
    assert d["buckets"] == 1 and d["exact"] == [True, True], d
    assert d["model_bytes"] <= d["slot_bytes"] <= d["model_bytes"] + (2 << 20), d
    assert r0["hook_views"] and r0["hook_exact"]
    for r in res:
        assert r["out_and_copy"][0] == "ValueError" and "not given with copy=True" in r["out_and_copy"][1] \
            or r["out_and_copy"][0] == "ValueError" and "differ" in r["out_and_copy"][1], r["out_and_copy"]
        assert r["bad_out"][0] == "ValueError", r["bad_out"]
    assert "float64" in r0["bad_out"][1] and "contiguous 1-D torch.float32" in r0["bad_out"][1], r0["bad_out"]
