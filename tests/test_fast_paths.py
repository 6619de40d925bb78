"""Paths chosen for speed that must not change results: the padded attention without an S x S mask when a
batch has no padding, and the head's token chunk sized by bytes per device. One gloo rank, in process."""

from __future__ import annotations

import pytest
import torch

import helpers




def test_unpadded_batch_runs_without_a_mask(world_of_one, tmp_path, monkeypatch):
    import parallm
    from parallm.model.layers import attention
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
    real = attention.padded_attention_mask
    monkeypatch.setattr(attention, "padded_attention_mask", lambda m: built.append(m.shape) or real(m))
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


@pytest.mark.parametrize("packed", [False, True])
def test_microbatches_scale_dynamic_rope_for_the_whole_batch(world_of_one, tmp_path, packed):
    """Dynamic NTK RoPE scales for the batch's longest position. Run as microbatches (forward at pp > 1 by
    default, forward_backward's num_microbatches), every microbatch must use the whole batch's frequencies, as
    transformers does on the whole batch: here row 0 is longer than max_position_embeddings, row 1 is not, so
    each microbatch's own length would pick other frequencies for row 1."""
    import parallm
    cfg = helpers.tiny_config("qwen2", max_position_embeddings=8,
                              rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = helpers.make_hf_model(cfg)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    chunks = parallm.build_model(ckpt, packed=packed)
    parallm.load_hf_weights(chunks, ckpt)
    ids = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0                                      # row 1: 6 tokens (< 8), row 0: 14 (> 8)
    pos = parallm.default_position_ids(mask)

    def loss_fn(out, i, m):
        return (out.float().pow(2).sum(-1) * m).sum() / m.sum()

    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert helpers.max_diff_real(parallm.forward(chunks, ids, mask), ref, mask) < 2e-5
    loss = parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn, num_microbatches=2).item()
    # the whole-batch reference: the two microbatches' losses averaged, with transformers' whole-batch frequencies
    ref_loss = sum(loss_fn(ref[b:b + 1], ids[b:b + 1], mask[b:b + 1]) for b in range(2)) / 2
    assert abs(loss - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    ref_loss.backward()
    torch.testing.assert_close(chunks[0].layers[0].self_attention.linear_proj.weight.grad,
                               model.model.layers[0].self_attn.o_proj.weight.grad, rtol=1e-4, atol=1e-5)
    # row 1 alone, with its own (unscaled) frequencies, gives another loss: the check above can fail
    own = model(input_ids=ids[1:, :6], attention_mask=mask[1:, :6], position_ids=pos[1:, :6]).logits
    assert (own[0] - ref[1, :6]).abs().max() > 1e-3
