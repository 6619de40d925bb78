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
        assert r["after"] < 2e-5, r["after"]
        for name in ("stale_forward", "stale_save"):
            assert r[name] is not None and "built for tp=2 x pp=2 x dp=1" in r[name] and \
                "now: tp=4 x pp=1 x dp=1" in r[name], (name, r[name])
        assert r["attn"] is not None and "packed kernel" in r["attn"] and "'sdpa'" in r["attn"], r["attn"]
        assert r["attn_auto"] == ["sdpa", "sdpa-loop"]  # CPU: flash-attn cannot run
    print(f"\nforward after the errors: max |parallm - transformers| {max(r['after'] for r in res):.2e}")
