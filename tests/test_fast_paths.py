"""Paths chosen for speed that must not change results: the padded attention without an S x S mask when a
batch has no padding, and the head's token chunk sized by bytes per device. One gloo rank, in process."""

from __future__ import annotations

import pytest
import torch

import helpers


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    import torch.distributed as dist

    import parallm
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                            world_size=1)
    try:
        parallm.init_parallel()
        yield
    finally:
        parallm.destroy_parallel()
        dist.destroy_process_group()


def test_unpadded_batch_runs_without_a_mask(world_of_one, tmp_path, monkeypatch):
    import parallm
    from parallm.model import decoder
    cfg = helpers.tiny_config("llama", num_hidden_layers=2)
    model = helpers.make_hf_model(cfg)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    ids = torch.randint(0, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    full = torch.ones_like(ids)
    padded = full.clone()
    padded[1, :4] = 0
    built = []
    real = decoder.padded_attention_mask
    monkeypatch.setattr(decoder, "padded_attention_mask", lambda m: built.append(m.shape) or real(m))
    out = parallm.forward(chunks, ids, full)
    assert built == []                                   # no [B, 1, S, S] mask for a batch without padding
    assert helpers.max_diff_real(out, helpers.hf_logits(model, ids, full), full) < 2e-5
    out_p = parallm.forward(chunks, ids, padded)
    assert built == [padded.shape]                       # padding: the mask path, as before
    assert helpers.max_diff_real(out_p, helpers.hf_logits(model, ids, padded), padded) < 2e-5
    # the two paths agree on the rows they share (row 0 has no padding in either batch)
    torch.testing.assert_close(out[0], out_p[0], rtol=0, atol=1e-5)
    # and training through the maskless path gives transformers' gradient
    loss = parallm.forward_backward(chunks, ids, full, loss_fn=lambda o, i, m: o.float().pow(2).mean())
    ref = model(input_ids=ids, attention_mask=full, position_ids=parallm.default_position_ids(full)).logits
    ref.float().pow(2).mean().backward()
    assert abs(loss.item() - ref.float().pow(2).mean().item()) < 1e-5
    got = chunks[0].layers[0].self_attention.linear_proj.weight.grad
    torch.testing.assert_close(got, model.model.layers[0].self_attn.o_proj.weight.grad, rtol=1e-4, atol=1e-6)


def test_head_chunk_sized_by_bytes_per_device():
    from parallm.model.logprobs import DEFAULT_CHUNK_BYTES, StatsRequest, chunk_tokens
    req = StatsRequest(entropy=False, temperature=1.0)
    cols = 152064 // 2
    assert chunk_tokens(req, cols, "cpu") == DEFAULT_CHUNK_BYTES["cpu"] // (4 * cols) == 110
    assert chunk_tokens(req, cols, "cuda") == DEFAULT_CHUNK_BYTES["cuda"] // (4 * cols)
    assert chunk_tokens(req, cols, "cuda") > 60 * chunk_tokens(req, cols, "cpu")
    assert chunk_tokens(StatsRequest(entropy=False, temperature=1.0, chunk=7), cols, "cuda") == 7
    assert chunk_tokens(req, 10 ** 12, "cpu") == 1
