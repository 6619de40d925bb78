"""Qwen3.5 / Qwen3-Next ``A_log`` stays fp32 in a bf16 model: loaded, held, trained, saved and exported in fp32.

Qwen3.5 checkpoints store each Gated DeltaNet layer's ``linear_attn.A_log`` in float32 and every other tensor in
bf16 (vLLM and SGLang hold it fp32 whatever the model dtype); Qwen3.6 stores it bf16. The checkpoints here are
built that way from a tiny fp32 transformers model: every tensor rounded to bf16 except ``A_log``, whose values
are checked not to be bf16 values (a bf16 round trip anywhere shows), and a "Qwen3.6" one with everything bf16.

One spawn of 4 ranks, bf16 models throughout, per case: the ``A_log`` parameters fp32 and bit-equal to the
checkpoint's slice (slice and broadcast loads), every other parameter bf16; ``save_hf_weights`` (dict and
directory, ``dtype=bf16`` and default) writing ``A_log`` fp32 bit-exact and everything else as the checkpoint;
``export_hf_tensors`` in bf16 (small buckets: parts split; an odd start: the pure test), fp16 and fp32 yielding
``A_log`` fp32 bit-exact, ``export_metadata`` agreeing in names, dtypes and shapes; one AdamW step whose fp32
``A_log`` update is ``torch.optim.AdamW``'s on the same fp32 gradient, bit for bit; a training checkpoint
resharded from tp2 to tp4 and exported offline (``checkpoint_to_hf``). Layouts: Qwen3.5 tp2·dp2 and tp4,
Qwen3-Next tp2·pp2 (2 microbatches).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import helpers
from test_qwen3_5 import hybrid_config, long_batch, make_model

WORLD = 4
LR = 1e-3
# 4 key heads / 8 value heads so that tp4 splits them (2 value heads per rank)
HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)
BF16 = torch.bfloat16


def is_a_log(name: str) -> bool:
    return name.endswith("linear_attn.A_log")


def write_checkpoint(model, path: str, *, a_log_fp32: bool) -> dict:
    """``model`` saved by transformers, then every tensor rewritten in bf16 except ``A_log`` (fp32 unless
    ``a_log_fp32`` is False: Qwen3.6's all-bf16 checkpoint), config dtype bf16. Returns the state written."""
    from safetensors.torch import load_file, save_file
    model.save_pretrained(path, safe_serialization=True)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"], files
    sd = load_file(os.path.join(path, files[0]))
    out = {k: (v if is_a_log(k) and a_log_fp32 else v.to(BF16)) for k, v in sd.items()}
    a_logs = [k for k in out if is_a_log(k)]
    assert a_logs
    if a_log_fp32:       # values bf16 cannot hold: any rounding to bf16 on the way changes them
        assert all(out[k].dtype == torch.float32 and not torch.equal(out[k], out[k].to(BF16).float()) for k in a_logs)
    save_file(out, os.path.join(path, files[0]), metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["dtype"] = "bfloat16"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return out


def test_fp32_bits_start_at_an_even_bucket_element():
    """A tensor of fp32 bits in a 2-byte stream is viewed as float32 where it lands, which needs an even start:
    after an odd-sized tensor in the same bucket the plan skips one element (and only then), and the bits laid
    there by the plan's parts read back as the fp32 values."""
    from parallm.checkpoint.export_plan import place, plan_buckets
    from parallm.model.sharding import Split
    tp, odd, a_log = 2, (5,), torch.randn(8)
    bits = a_log.view(BF16)                                  # [16]: the planned shape, last dim doubled
    split = Split(0)

    def pieces(shape):
        return [(t, t, (shape[0] // tp,), split.blocks(t, tp, [shape])) for t in range(tp)]

    entries = [(0, [odd], [(0, 0, odd, split.blocks(0, 1, [odd]))]), (1, [tuple(bits.shape)], pieces(bits.shape))]
    for aligned, start in ((frozenset(), 5), (frozenset({(1, 0)}), 6)):
        (bucket,) = plan_buckets(entries, 1 << 10, 1 << 20, aligned=aligned)
        assert [o for _, _, o in bucket.outputs] == [0, start]
        out = torch.zeros(bucket.stage, dtype=BF16)
        staging = torch.zeros(bucket.numel - bucket.stage, dtype=BF16)
        shards = bits.chunk(tp)
        for p in bucket.parts:                                 # the senders' packing, by hand
            staging.narrow(0, p.offset - bucket.stage, p.numel).copy_(shards[p.tp][p.row_start:p.row_stop])
        got = out.narrow(0, start, bits.numel())
        place(bucket.placing[1], got, staging, base=bucket.stage)
        assert torch.equal(got, bits)
        if aligned:
            assert torch.equal(got.view(torch.float32), a_log)
        else:
            with pytest.raises(RuntimeError, match="storage_offset"):
                got.view(torch.float32)
    # an entry that does not need it is never moved
    (bucket,) = plan_buckets(entries[::-1], 1 << 10, 1 << 20, aligned=frozenset({(1, 0)}))
    assert [o for _, _, o in bucket.outputs] == [0, 16]


def _params(chunks) -> dict:
    return {n: p for c in chunks for n, p in c.named_parameters()}


def check_loaded(chunks, ckpt_sd, name):
    """A_log fp32 and equal to its checkpoint slice (as fp32), everything else bf16."""
    from parallm.model.table import entry_view, model_entries
    from parallm.parallel.state import current_dims
    params = _params(chunks)
    a_log = {n: p for n, p in params.items() if n.endswith("self_attention.A_log")}
    assert a_log and all(p.dtype == torch.float32 for p in a_log.values()), name
    assert all(p.dtype == BF16 for n, p in params.items() if n not in a_log), name
    lay = current_dims()
    mine, _ = model_entries(chunks, lay)
    seen = 0
    for e, chunk in mine:
        if not is_a_log(e.hf[0]):
            continue
        param, layout = entry_view(chunk, e)
        full = ckpt_sd[e.hf[0]].float()
        per = full.shape[0] // lay.tp
        assert torch.equal(param, full[lay.tp_rank * per:(lay.tp_rank + 1) * per]), (name, e.hf[0])
        seen += 1
    assert seen, name
    return a_log


def check_ways_out(chunks, want, name, tmp):
    """save_hf_weights (dict: default dtype and bf16; directory) and export_hf_tensors (bf16 in small buckets,
    fp16, fp32) with their metadata: A_log fp32 and bit-exact, every other tensor ``want``'s (bf16) in the
    requested dtype."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    import parallm
    rank = dist.get_rank()
    for kw in ({}, dict(dtype=BF16)):
        sd = parallm.save_hf_weights(chunks, **kw)
        if rank == 0:
            helpers.assert_same_state(sd, want)
            assert all(sd[k].dtype == (torch.float32 if is_a_log(k) else BF16) for k in sd), name
    out_dir = os.path.join(tmp, f"saved-{name}")
    parallm.save_hf_weights(chunks, out_dir, dtype=BF16)
    if rank == 0:
        disk = {}
        for f in sorted(os.listdir(out_dir)):
            if f.endswith(".safetensors"):
                disk.update(load_file(os.path.join(out_dir, f)))
        helpers.assert_same_state(disk, want)
    for wire, bucket in ((BF16, 96), (None, 1 << 20), (torch.float16, 200), (torch.float32, 1 << 20)):
        meta = parallm.export_metadata(chunks, dtype=wire)
        got = [(n, t.clone()) for n, t in parallm.export_hf_tensors(chunks, dtype=wire, bucket_bytes=bucket)]
        differ = [(a, b) for a, b in zip([(n, t.dtype, tuple(t.shape)) for n, t in got],
                                         [(m.name, m.dtype, tuple(m.shape)) for m in meta]) if a != b]
        assert len(got) == len(meta) and not differ, (name, wire, differ[:3])
        assert {n for n, _ in got} == set(want), name
        for n, t in got:
            expect = want[n] if is_a_log(n) else want[n].to(wire or BF16)
            assert t.dtype == expect.dtype and torch.equal(t, expect), (name, wire, n)


def adamw_step(chunks, ids, mask, nmb, name):
    """One AdamW step (no weight decay on 1-D params, no clipping): each fp32 A_log moves exactly as
    ``torch.optim.AdamW`` moves a copy of it given the same fp32 gradient."""
    import parallm
    from parallm.model.params import grad_of
    from parallm.parallel.state import current_dims
    from parallm.verify.reference import causal_lm_loss
    lay = current_dims()
    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    opt = parallm.build_optimizer(chunks, lr=LR, weight_decay=0.1)
    opt.zero_grad()
    loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=causal_lm_loss, num_microbatches=nmb)
    parallm.finalize_grads(chunks)
    a_log = {n: p for n, p in _params(chunks).items() if n.endswith("self_attention.A_log")}
    refs = {}
    for n, p in a_log.items():
        g = grad_of(p)
        assert g is not None and g.dtype == torch.float32 and getattr(p, "main_grad", None) is None, (name, n)
        assert bool(g.abs().min() > 0), (name, n)
        ref = torch.nn.Parameter(p.detach().clone())
        ref.grad = g.clone()
        refs[n] = ref
        torch.optim.AdamW([ref], lr=LR, weight_decay=0.0).step()
    before = {n: p.detach().clone() for n, p in a_log.items()}
    opt.step()
    for n, p in a_log.items():
        assert p.dtype == torch.float32, (name, n)
        assert torch.equal(p.detach(), refs[n].detach()), (name, n, (p - refs[n]).abs().max().item())
        delta = p.detach() - before[n]
        assert bool((delta.abs() - LR).abs().max() < 1e-5), (name, n, delta)     # Adam's first step: lr sign(g)
        assert not torch.equal(p.detach(), p.detach().to(BF16).float()), (name, n)   # not rounded to bf16
    assert torch.isfinite(loss), name
    return opt


def _rank(rank, world, s):
    import parallm
    import torch.distributed as dist
    out = {}

    # 1. Qwen3.5 at tp2 x dp2: load (both modes), every way out, one AdamW step, a training checkpoint
    parallm.init_parallel(tp=2)
    ckpt, sd = s["q35"], s["q35_sd"]
    chunks = parallm.build_model(ckpt, dtype=BF16)
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, ckpt, mode="slice")
    check_loaded(chunks, sd, "qwen3.5 tp2 slice")
    other = parallm.build_model(ckpt, dtype=BF16)
    helpers.nan_fill(other)
    parallm.load_hf_weights(other, ckpt, mode="broadcast")
    check_loaded(other, sd, "qwen3.5 tp2 broadcast")
    del other
    check_ways_out(chunks, sd, "qwen3.5-tp2", s["tmp"])
    opt = adamw_step(chunks, s["ids"], s["mask"], 1, "qwen3.5 tp2")
    stepped = parallm.save_hf_weights(chunks)
    stepped = {k: v.clone() for k, v in stepped.items()}
    dist.broadcast_object_list(obj := [stepped if rank == 0 else None], src=0)
    stepped = obj[0]
    assert all(stepped[k].dtype == torch.float32 and not torch.equal(stepped[k], sd[k]) for k in stepped
               if is_a_log(k))
    parallm.save_checkpoint(os.path.join(s["tmp"], "train"), chunks, opt, step=1)
    if rank == 0:       # exported offline in the run's dtype: A_log fp32 too
        from safetensors.torch import load_file

        from parallm.checkpoint.training import checkpoint_to_hf
        checkpoint_to_hf(os.path.join(s["tmp"], "train"), os.path.join(s["tmp"], "offline"))
        helpers.assert_same_state(load_file(os.path.join(s["tmp"], "offline", "model.safetensors")), stepped)
    del chunks, opt

    # 2. the training checkpoint resumed at tp4: the stepped fp32 A_log bit for bit; every way out at tp4
    parallm.init_parallel(tp=4)
    chunks = parallm.build_model(ckpt, dtype=BF16)
    opt = parallm.build_optimizer(chunks, lr=LR)
    helpers.nan_fill(chunks)
    parallm.load_checkpoint(os.path.join(s["tmp"], "train"), chunks, opt)
    check_loaded(chunks, stepped, "qwen3.5 tp4 resumed")
    check_ways_out(chunks, stepped, "qwen3.5-tp4", s["tmp"])
    del chunks, opt

    # 3. Qwen3-Next at tp2 x pp2: load, every way out, one AdamW step over 2 microbatches
    parallm.init_parallel(tp=2, pp=2)
    ckpt, sd = s["next"], s["next_sd"]
    chunks = parallm.build_model(ckpt, dtype=BF16)
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, ckpt)
    check_loaded(chunks, sd, "qwen3-next tp2 pp2")
    check_ways_out(chunks, sd, "qwen3-next-tp2pp2", s["tmp"])
    adamw_step(chunks, s["ids"], s["mask"], 2, "qwen3-next tp2 pp2")
    del chunks

    # 4. Qwen3.6's all-bf16 checkpoint: A_log held fp32 with the bf16 values, saved and exported as fp32
    parallm.init_parallel(tp=2)
    ckpt, sd = s["q36"], s["q36_sd"]
    chunks = parallm.build_model(ckpt, dtype=BF16)
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, ckpt, mode="broadcast")
    check_loaded(chunks, sd, "qwen3.6 tp2")
    check_ways_out(chunks, {k: (v.float() if is_a_log(k) else v) for k, v in sd.items()}, "qwen3.6-tp2", s["tmp"])
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_a_log_stays_fp32_in_bf16_models(tmp_path):
    q35 = make_model(hybrid_config("qwen3_5_text", **HEADS), seed=11)
    nxt = make_model(hybrid_config("qwen3_next", **HEADS), seed=12)
    s = {"tmp": str(tmp_path), "q35": str(tmp_path / "q35"), "next": str(tmp_path / "next"),
         "q36": str(tmp_path / "q36")}
    s["q35_sd"] = write_checkpoint(q35, s["q35"], a_log_fp32=True)
    s["next_sd"] = write_checkpoint(nxt, s["next"], a_log_fp32=True)
    s["q36_sd"] = write_checkpoint(q35, s["q36"], a_log_fp32=False)
    s["ids"], s["mask"] = long_batch(q35.config.vocab_size, batch=4, seq=9, seed=0)
    helpers.run_ranks(_rank, WORLD, s, timeout=560)
