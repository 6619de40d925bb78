"""Checkpoint I/O: broadcast vs slice loads, parallel directory saves reloaded by transformers, the export
stream, rank 0's memory in broadcast mode, and the work a widening (bf16 -> fp32) load does not do."""

import threading
import time

import pytest
import torch

import helpers


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Samples RssAnon every 2 ms in a thread; .peak is the maximum seen."""

    def __init__(self):
        self.peak = rss_anon_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(0.002)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon_bytes())


def rank_io(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"])
        build = case.get("build", {})
        a = parallm.build_model(case["ckpt"], **build)
        rep = parallm.load_hf_weights(a, case["ckpt"], mode="auto")
        assert rep.mode == "slice"          # every rank sees the directory
        b = parallm.build_model(case["ckpt"], **build)
        assert parallm.load_hf_weights(b, case["ckpt"], mode="broadcast").mode == "broadcast"
        for ca, cb in zip(a, b):
            for (na, pa), (nb, pb) in zip(ca.named_parameters(), cb.named_parameters()):
                assert na == nb and torch.equal(pa, pb), na
        # export stream: every HF tensor once, on every rank, with the checkpoint's values
        names = []
        for name, tensor in parallm.export_hf_tensors(b):
            names.append(name)
            assert torch.equal(tensor, case["ref_sd"][name]), name
        assert len(names) == len(set(names)) and set(names) == set(case["ref_sd"])
        # parallel directory save, several files
        parallm.save_hf_weights(b, case["out"], max_shard_size="60KB")
        lay = current_dims()
        out.append(dict(name=case["name"], dp=lay.dp))
    return out


@pytest.mark.timeout(400)
def test_broadcast_slice_export_and_parallel_save(tmp_path):
    import json
    import os

    import transformers
    specs = [
        ("llama tp2 pp2", "llama", dict(num_hidden_layers=4, vocab_size=99), dict(tp=2, pp=2), {}),
        ("qwen2 tied tp2 dp2", "qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1), dict(tp=2, pp=1),
         {}),
        ("qwen2 value tp1 pp2 dp2", "qwen2", dict(num_hidden_layers=4), dict(tp=1, pp=2),
         {"build": {"task": "value"}}),
    ]
    cases = []
    for i, (name, family, overrides, layout, extra) in enumerate(specs):
        task = extra.get("build", {}).get("task", "causal_lm")
        cfg = helpers.tiny_config(family, **overrides)
        model = helpers.make_hf_model(cfg, seed=20 + i, task=task)
        ckpt = helpers.save_checkpoint(model, str(tmp_path / f"c{i}"), max_shard_size="40KB")
        cases.append(dict(name=name, ckpt=ckpt, ref_sd=helpers.hf_state_dict(model), out=str(tmp_path / f"o{i}"),
                          task=task, **layout, **extra))
    helpers.run_ranks(rank_io, 4, cases)
    for case in cases:
        files = sorted(f for f in os.listdir(case["out"]) if f.endswith(".safetensors"))
        assert len(files) > 1, files                       # several files, an index
        with open(os.path.join(case["out"], "model.safetensors.index.json")) as f:
            assert set(json.load(f)["weight_map"]) == set(case["ref_sd"])
        assert not [f for f in os.listdir(tmp_path) if "parallm-tmp" in f]   # no temp dir left behind
        cls = (transformers.AutoModelForSequenceClassification if case["task"] == "value"
               else transformers.AutoModelForCausalLM)
        reloaded = cls.from_pretrained(case["out"], dtype=torch.float32)
        sd = helpers.hf_state_dict(reloaded)
        assert set(sd) == set(case["ref_sd"]), case["name"]
        for k, v in case["ref_sd"].items():
            assert torch.equal(sd[k], v), (case["name"], k)


def rank_memory(rank, world, ckpt, model_bytes, largest):
    import parallm
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(ckpt)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()                                 # this rank's own shards are resident before we measure
    base = rss_anon_bytes()
    with PeakSampler() as s:
        parallm.load_hf_weights(chunks, ckpt, mode="broadcast")
    return (s.peak - base) / model_bytes, (s.peak - base) / largest


@pytest.mark.timeout(300)
def test_broadcast_rank0_memory_is_bounded(tmp_path):
    cfg = helpers.tiny_config("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                              num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    model = helpers.make_hf_model(cfg, seed=1)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "big"), max_shard_size="8MB")
    sd = helpers.hf_state_dict(model)
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    largest = max(t.numel() * t.element_size() for t in sd.values())
    res = helpers.run_ranks(rank_memory, 4, ckpt, model_bytes, largest)
    frac0, vs_largest = res[0]
    print(f"\nbroadcast load: rank 0 peak extra anon memory = {frac0:.3f} x model ({model_bytes / 2**20:.1f} MiB)"
          f" = {vs_largest:.2f} x largest tensor")
    # The failures this guards against hold the whole model (1.0) or a whole pipeline stage (0.5 at pp=2) on rank
    # 0; streaming holds a few tensors at a time (measured 0.08 of the model = 3 x the largest tensor). 0.25 sits
    # between the two with room for the allocator's noise.
    assert frac0 < 0.25, f"rank 0 held {frac0:.2f} of the model during a broadcast load"


def rank_cast_work(rank, world, ckpt_bf16, ckpt_fp32):
    """Loads (slice mode) counting two kinds of work a load must not do when the cast cannot overflow: a read of
    the source values for the overflow check, and a converted copy of a checkpoint tensor made outside the copy
    into the parameter (``Tensor.to`` to another dtype)."""
    import parallm
    from parallm.checkpoint import cast as cast_mod
    parallm.init_parallel(tp=2)
    counts = {"checked": 0, "converted": 0}
    real_extremes, real_to = cast_mod._finite_extremes, torch.Tensor.to

    def extremes(src):
        counts["checked"] += 1
        return real_extremes(src)

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.dtype != self.dtype and out.numel() > 1:
            counts["converted"] += 1
        return out

    out = {}
    cast_mod._finite_extremes, torch.Tensor.to = extremes, to
    try:
        for name, ckpt, dtype in (("bf16->fp32", ckpt_bf16, torch.float32), ("fp32->fp16", ckpt_fp32, torch.float16),
                                  ("fp32->bf16", ckpt_fp32, torch.bfloat16)):
            chunks = parallm.build_model(ckpt, dtype=dtype)
            counts.update(checked=0, converted=0)
            parallm.load_hf_weights(chunks, ckpt, mode="slice")
            out[name] = dict(counts)
            out[name + "/params"] = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    finally:
        cast_mod._finite_extremes, torch.Tensor.to = real_extremes, real_to
    return out


def test_widening_loads_neither_check_nor_convert_apart(tmp_path):
    """bf16 -> fp32 cannot overflow: the load reads no value for an overflow check and converts inside the copy
    into the parameter (no converted temporary); the narrowing loads do check (the counter works), and the
    widened weights are the checkpoint's values exactly."""
    cfg = helpers.tiny_config("qwen2")
    model = helpers.make_hf_model(cfg, seed=3)
    ckpt_fp32 = helpers.save_checkpoint(model, str(tmp_path / "fp32"))
    ckpt_bf16 = helpers.save_checkpoint(model.to(torch.bfloat16), str(tmp_path / "bf16"))
    res = helpers.run_ranks(rank_cast_work, 2, ckpt_bf16, ckpt_fp32)
    for r in res:
        assert r["bf16->fp32"] == {"checked": 0, "converted": 0}, r["bf16->fp32"]
        assert r["fp32->fp16"]["checked"] > 0 and r["fp32->bf16"]["checked"] > 0, r
        assert r["fp32->fp16"]["converted"] == 0 and r["fp32->bf16"]["converted"] == 0, r
        widened, narrowed = r["bf16->fp32/params"], r["fp32->bf16/params"]
        assert set(widened) == set(narrowed) and widened
        for n, p in widened.items():        # the bf16 values, widened exactly (= the fp32 ones rounded to bf16)
            assert p.dtype == torch.float32 and torch.equal(p, narrowed[n].to(torch.float32)), n
