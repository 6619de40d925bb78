"""A bad batch on one rank is an error on every rank (no rank is left waiting in the pipeline)."""

import time

import pytest

import helpers


def rank_bad_batch(rank, world, ckpt, vocab, ref):
    import parallm
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    ids, mask = helpers.padded_batch(vocab)
    out = {}
    bad = ids.clone()
    if rank == 3:
        bad[0, 0] = vocab + 5                                  # out of range on one rank only
    for name, call in [
        ("forward", lambda: parallm.forward(chunks, bad, mask)),
        ("forward_backward", lambda: parallm.forward_backward(chunks, bad, mask, loss_fn=lambda o, i, m: o.sum())),
        ("microbatches", lambda: parallm.forward_backward(chunks, ids, mask, loss_fn=lambda o, i, m: o.sum(),
                                                          num_microbatches=3 if rank == 0 else 1)),
    ]:
        t = time.monotonic()
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e), time.monotonic() - t)
    # still in step afterwards: a normal forward everywhere gives transformers' logits
    out["after"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), ref, mask)
    # chunks built for tp2 x pp2 are refused once init_parallel changed the layout (their groups are gone)
    parallm.init_parallel(tp=4, pp=1)
    for name, call in [("stale_forward", lambda: parallm.forward(chunks, ids, mask)),
                       ("stale_save", lambda: parallm.save_hf_weights(chunks))]:
        try:
            call()
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
    # an attention kernel that does not fit the model is a clear error at build
    try:
        parallm.build_model(ckpt, attn_impl="sdpa-loop")
        out["attn"] = None
    except ValueError as e:
        out["attn"] = str(e)
    out["attn_auto"] = [parallm.build_model(ckpt).pop().attn_impl,
                        parallm.build_model(ckpt, packed=True).pop().attn_impl]
    # float16 parameters are refused for training (no loss scaling), on every rank; forward still runs
    import torch
    f16 = parallm.build_model(ckpt, dtype=torch.float16)
    parallm.load_hf_weights(f16, ckpt)
    out["fp16_forward"] = bool(torch.isfinite(parallm.forward(f16, ids, mask)).all())
    try:
        parallm.forward_backward(f16, ids, mask, loss_fn=lambda o, i, m: o.sum())
        out["fp16_train"] = None
    except ValueError as e:
        out["fp16_train"] = str(e)
    # last: a loss_fn that raises on one last-stage rank mid-pipeline: that rank finishes the schedule with zero
    # gradients and every rank raises at the end of the call (no abort, no timeout); the groups still work after
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)

    def loss_fn(o, i, m):
        if rank == 3:
            raise ArithmeticError("a loss_fn bug on rank 3")
        return o.sum()
    t = time.monotonic()
    try:
        parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn, num_microbatches=2)
        out["midway"] = None
    except Exception as e:  # noqa: BLE001
        out["midway"] = (type(e).__name__, str(e), time.monotonic() - t)
    loss = parallm.forward_backward(chunks, ids, mask, loss_fn=lambda o, i, m: o.sum(), num_microbatches=2)
    with torch.no_grad():
        out["after_midway"] = (loss.item(), parallm.forward(chunks, ids, mask).sum().item() / 2)
    return out


@pytest.mark.timeout(200)
def test_bad_batch_on_one_rank_fails_everywhere(tmp_path):
    cfg = helpers.tiny_config("llama", num_hidden_layers=2)
    model = helpers.make_hf_model(cfg)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask = helpers.padded_batch(cfg.vocab_size)
    res = helpers.run_ranks(rank_bad_batch, 4, ckpt, cfg.vocab_size, helpers.hf_logits(model, ids, mask))
    for rank, r in enumerate(res):
        for name, culprit in [("forward", 3), ("forward_backward", 3), ("microbatches", 0)]:
            assert r[name] is not None, name
            etype, msg, elapsed = r[name]
            needle = "num_microbatches=3" if name == "microbatches" else f"[0, {cfg.vocab_size})"
            assert etype == "ValueError" and needle in msg and elapsed < 60, (name, r[name])
            if rank != culprit:                                # the others are told who failed
                assert f"failed on rank {culprit}" in msg, (name, msg)
            elif name != "microbatches":                       # and the culprit's own message names it too
                assert f"on global rank {culprit}" in msg, (name, msg)
        assert r["after"] < 2e-5, r["after"]
        for name in ("stale_forward", "stale_save"):
            assert r[name] is not None and "built for tp=2 x pp=2 x dp=1" in r[name] and \
                "now: tp=4 x pp=1 x dp=1" in r[name], (name, r[name])
        assert r["attn"] is not None and "packed kernel" in r["attn"] and "'sdpa'" in r["attn"], r["attn"]
        assert r["attn_auto"] == ["sdpa", "sdpa-loop"]  # CPU: flash-attn cannot run
        assert r["fp16_forward"] and r["fp16_train"] is not None and "loss scaling" in r["fp16_train"], r
        etype, msg, elapsed = r["midway"]
        assert "a loss_fn bug on rank 3" in msg and elapsed < 30, r["midway"]
        if rank == 3:                                   # its own exception
            assert etype == "ArithmeticError", r["midway"]
        else:                                           # not a type remote_error re-creates: ParallelError
            assert etype == "ParallelError" and "forward_backward failed on rank 3" in msg, r["midway"]
        got, want = r["after_midway"]                   # the process groups were not torn down
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), r["after_midway"]
    print(f"\nforward after the errors: max |parallm - transformers| {max(r['after'] for r in res):.2e}")


def rank_loss_fn_raises(rank, world, ckpt, vocab, layout):
    """A loss_fn raising on one rank of a layout whose backward talks across ranks, then a good call: the failing
    rank stays alive and goes on, so nothing here ends through a closed connection or a timeout."""
    import torch

    import parallm
    parallm.init_parallel(**layout)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def loss_fn(o, i, m):
        if rank == world - 1:
            raise RuntimeError("a loss_fn bug")
        return o.sum()
    t = time.monotonic()
    try:
        parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn, output="logprobs", num_microbatches=2)
        failed = None
    except Exception as e:  # noqa: BLE001
        failed = (type(e).__name__, str(e), time.monotonic() - t)
    parallm.model.params.zero_grads(chunks)
    loss = parallm.forward_backward(chunks, ids, mask, loss_fn=lambda o, i, m: o.sum(), output="logprobs",
                                    num_microbatches=2)
    with torch.no_grad():
        want = parallm.forward(chunks, ids, mask, output="logprobs").sum().item() / 2
    return failed, loss.item(), want


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", [dict(cp=2), dict(tp=2), dict(pp=2), dict()], ids=["cp2", "tp2", "pp2", "dp2"])
def test_loss_fn_raising_on_one_rank_fails_every_rank_at_once(tmp_path, layout):
    """Every rank raises the loss_fn's error at the end of the call, in seconds, and the next call works (the
    process groups are not torn down). Before, the peers of a live failing rank waited for the timeout."""
    cfg = helpers.tiny_config("llama", num_hidden_layers=2)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg), str(tmp_path / "m"))
    res = helpers.run_ranks(rank_loss_fn_raises, 2, ckpt, cfg.vocab_size, layout)
    for rank, (failed, got, want) in enumerate(res):
        assert failed is not None, (rank, layout)
        etype, msg, elapsed = failed
        assert etype == "RuntimeError" and "a loss_fn bug" in msg and elapsed < 20, (rank, failed)
        if rank == 0:
            assert "forward_backward failed on rank 1" in msg, msg
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, got, want)
