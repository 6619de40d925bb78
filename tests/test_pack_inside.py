"""Recurrent hybrids built padded run their padded batches through the packed path inside (issue 45 item 3).

A Qwen3.5 (Gated DeltaNet) or Nemotron-H (Mamba-2) model built with ``packed=False`` (the default) runs a batch
whose rows are padded only at their ends as a packed stream of its real tokens: every layer (embedding, norms,
projections, MLPs, attention, the recurrent mixers, the head) sees ``[T, 1, H]`` with ``T`` the real tokens, and
keeps activations for those only; the outputs come back ``[B, S, ...]`` with zeros at padding. Rows with a hole
(padding between real tokens, which transformers runs through) and batches without padding keep the padded layout.

Checked here in one process: the layer inputs' shapes (what each layout really computes), transformers' logits at
every real position, the same loss and gradients as the model forced through the padded layout, the bytes autograd
keeps for backward (the inside-packed step keeps less than the padded one, in proportion to the padding), the
attention backends reported (``chunk.attn_impl``), and dense models untouched. A pipeline whose microbatches take
different layouts (one packed inside, one holed) is checked on 2 ranks against transformers' loss and gradients.
Pipelines / tensor parallelism with every microbatch packed inside: tests/test_qwen3_5.py's padded cases.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from test_nemotron_h import make_model as make_nemotron, nemotron_config
from test_qwen3_5 import hybrid_config, make_model as make_qwen

TOL = 2e-5
SEQ = 40
LR = 0.1


def _checkpoint(kind: str, path: str, seed: int = 3):
    cfg = hybrid_config("qwen3_5_text") if kind == "gdn" else nemotron_config("M-*M-M")
    model = make_qwen(cfg, seed=seed) if kind == "gdn" else make_nemotron(cfg, seed=seed)
    return model, helpers.save_checkpoint(model, path), cfg.get_text_config().vocab_size


def _batch(vocab: int, seed: int = 4):
    """Four rows: full, left padded, right padded, padded at both ends (no holes)."""
    ids, mask = helpers.padded_batch(vocab, batch=4, seq=SEQ, seed=seed)
    mask[:] = 1
    mask[1, :13] = 0
    mask[2, SEQ - 9:] = 0
    mask[3, :5] = 0
    mask[3, SEQ - 7:] = 0
    return ids, mask


def _nll(out, ids, mask):
    lp = out[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp * m).sum() / m.sum()


def _step(chunks, ids, mask, *, inside: bool):
    """Loss, gradients and the bytes autograd saved for backward of one forward_backward, with packing inside
    on or off; the layer inputs' shapes seen on the way."""
    import parallm
    for c in chunks:
        c.pack_inside, was = inside, c.pack_inside
        c.zero_grad(set_to_none=True)
    shapes, saved = [], []
    weights = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}

    def keep(t):     # activations only: a weight saved for backward is a reference, not memory
        if t.untyped_storage().data_ptr() not in weights:
            saved.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    hooks = [layer.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
             for c in chunks for layer in c.layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = parallm.forward_backward(chunks, ids, mask, loss_fn=_nll)
    finally:
        for h in hooks:
            h.remove()
        for c in chunks:
            c.pack_inside = was
    grads = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters() if p.grad is not None}
    return float(loss), grads, saved, set(shapes)


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
def test_padded_batch_runs_packed_inside(kind, tmp_path, world_of_one):
    import parallm
    model, ckpt, vocab = _checkpoint(kind, str(tmp_path / "m"))
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    chunk, hidden = chunks[0], model.config.get_text_config().hidden_size
    assert chunk.pack_inside and chunk.attn_impl == "sdpa+sdpa-loop", (chunk.pack_inside, chunk.attn_impl)
    ids, mask = _batch(vocab)
    real = int(mask.sum())
    assert chunk.packs_inside(mask)

    ref = helpers.hf_logits(model, ids, mask)
    got = parallm.forward(chunks, ids, mask)
    assert helpers.max_diff_real(got, ref, mask) < TOL
    assert torch.all(got[mask == 0] == 0)             # nothing computed at padding

    loss_in, grads_in, saved_in, shapes_in = _step(chunks, ids, mask, inside=True)
    loss_pad, grads_pad, saved_pad, shapes_pad = _step(chunks, ids, mask, inside=False)
    assert shapes_in == {(real, 1, hidden)}, shapes_in          # every layer: the real tokens only
    assert shapes_pad == {(SEQ, 4, hidden)}, shapes_pad
    ref_loss = _nll(ref, ids, mask)
    assert abs(loss_in - float(ref_loss)) < TOL and abs(loss_in - loss_pad) < TOL
    assert grads_in.keys() == grads_pad.keys() and grads_in
    for name, g in grads_in.items():
        assert (g - grads_pad[name]).abs().max() <= 1e-5 * max(1.0, grads_pad[name].abs().max()), name
    # What autograd keeps for backward (activations, weights left out): what the packed model keeps on the same
    # batch, less than the padded layout (which keeps its [S, B, ...] activations).
    packed = parallm.build_model(ckpt, packed=True)
    parallm.load_hf_weights(packed, ckpt)
    loss_packed, _, saved_packed, _ = _step(packed, ids, mask, inside=False)
    assert abs(loss_packed - loss_in) < TOL
    total = [sum(n for _, n in saved) for saved in (saved_in, saved_packed, saved_pad)]
    assert total[0] == total[1] and total[0] < total[2], total


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
def test_holed_rows_and_full_batches_keep_the_padded_layout(kind, tmp_path, world_of_one):
    import parallm
    model, ckpt, vocab = _checkpoint(kind, str(tmp_path / "m"), seed=5)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    hidden = model.config.get_text_config().hidden_size
    ids, mask = _batch(vocab, seed=6)
    holed = mask.clone()
    holed[0, 20:23] = 0                               # a hole: transformers runs its positions
    full = torch.ones_like(mask)
    for m in (holed, full):
        assert not chunks[0].packs_inside(m)
        shapes = []
        hooks = [layer.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape)))
                 for layer in chunks[0].layers]
        try:
            got = parallm.forward(chunks, ids, m)
        finally:
            for h in hooks:
                h.remove()
        assert set(shapes) == {(SEQ, 4, hidden)}
        assert helpers.max_diff_real(got, helpers.hf_logits(model, ids, m), m) < TOL


def test_dense_and_packed_models_unchanged(tmp_path, world_of_one):
    import parallm
    model = helpers.make_hf_model(helpers.tiny_config("qwen3"), seed=1)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "dense"))
    dense = parallm.build_model(ckpt)
    assert not dense[0].pack_inside and dense[0].attn_impl == "sdpa"
    _, hybrid, vocab = _checkpoint("gdn", str(tmp_path / "h"))
    packed = parallm.build_model(hybrid, packed=True)
    assert not packed[0].pack_inside and packed[0].attn_impl == "sdpa-loop"
    ids, mask = _batch(vocab)
    assert not dense[0].packs_inside(mask) and not packed[0].packs_inside(mask)


def rank_mixed_pipeline(rank, world, ckpt, ids, mask):
    import parallm
    parallm.init_parallel(pp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    loss = parallm.forward_backward(chunks, ids, mask, loss_fn=_nll, num_microbatches=2)
    decided = [chunks[0].packs_inside(mask[:2]), chunks[0].packs_inside(mask[2:])]
    parallm.finalize_grads(chunks)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    sd = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()
    return float(loss), decided, sd if rank == 0 else None


@pytest.mark.timeout(300)
def test_pipeline_with_microbatches_of_both_layouts(tmp_path):
    """pp2, two microbatches: the first packed inside, the second holed (padded): the shapes that cross the stage
    boundary follow each microbatch's layout; the loss and the weights after one SGD step equal transformers'."""
    from parallm.verify.reference import hf_output
    model, ckpt, vocab = _checkpoint("gdn", str(tmp_path / "m"), seed=8)
    ids, mask = _batch(vocab, seed=9)
    mask[3, 20:24] = 0                                # a hole in the second microbatch
    results = helpers.run_ranks(rank_mixed_pipeline, 2, ckpt, ids, mask, timeout=300)
    before = helpers.hub_state_dict(model, str(tmp_path / "before"))
    model.zero_grad()
    ref = sum(_nll(hf_output(model, ids[sl], mask[sl], task="causal_lm"), ids[sl], mask[sl])
              for sl in (slice(0, 2), slice(2, 4))) / 2
    ref.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    want = helpers.hub_state_dict(model, str(tmp_path / "after"))
    for loss, decided, _ in results:
        assert decided == [True, False]
        assert abs(loss - float(ref)) < TOL
    got = results[0][2]
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] - w).abs().max() < TOL, name
    moved = [n for n in want if not torch.equal(want[n], before[n])]
    assert len(moved) > 0.9 * len(want), sorted(set(want) - set(moved))
