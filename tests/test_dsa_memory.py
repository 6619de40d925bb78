"""What DeepSeek Sparse Attention keeps, and what its indexer's plan costs at sizes this machine cannot run:

* the top-k selections a microbatch holds on its layer context while the loss runs (one rank, GLM-5, fp32):
  none without shared indexer layers (with or without recomputation), none with shared layers without
  recomputation (the last reader drops its source's), one per source layer with shared layers under
  ``recompute="full"`` (the readers' replays need it; the source's replay takes it back), int32 with -1 for
  empty slots; nothing left after the backward; losses and gradients equal with and without recomputation.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from test_dsa_parts import glm5_config


def _held_at_loss(ckpt, ids, mask, *, recompute):
    """(the selections on the layer context when loss_fn runs {layer: (dtype, shape)}, those after the backward,
    the loss, the gradients)."""
    import parallm
    from parallm.model.layers.dsa import DSAttention
    chunks = parallm.build_model(ckpt, recompute=recompute)
    parallm.load_hf_weights(chunks, ckpt)
    seen = []
    attn = next(m for m in chunks[0].modules() if isinstance(m, DSAttention))
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.append(args[3]))
    at_loss = {}

    def loss_fn(out, ids_, mask_):
        at_loss.update({k: (v.dtype, tuple(v.shape)) for k, v in seen[0].__dict__.get("_dsa_selected", {}).items()})
        lp = out[:, :-1].float().log_softmax(-1)
        m = (mask_[:, 1:] * mask_[:, :-1]).float()
        return -(lp.gather(-1, ids_[:, 1:, None]).squeeze(-1) * m).sum() / m.sum()

    try:
        loss = parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn)
    finally:
        hook.remove()
    after = dict(seen[0].__dict__.get("_dsa_selected", {}))
    grads = {n: p.main_grad.clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
             for n, p in chunks[0].named_parameters() if p.requires_grad}
    return at_loss, after, loss, grads


@pytest.mark.parametrize("shared", [False, True])
def test_selections_held_at_loss_time(world_of_one, tmp_path, shared):
    cfg = glm5_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1) if shared \
        else glm5_config(num_hidden_layers=4)
    model = helpers.make_hf_model(cfg, seed=3)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "glm5"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, seed=2, batch=2, seq=40)     # 40 > top-k 16: sparse
    plain = _held_at_loss(ckpt, ids, mask, recompute=None)
    replayed = _held_at_loss(ckpt, ids, mask, recompute="full")
    assert plain[0] == {} and plain[1] == {}
    if shared:            # layers full, shared, full, shared: sources 0 and 2, each read by the next layer
        assert replayed[0] == {0: (torch.int32, (80, 16)), 2: (torch.int32, (80, 16))}, replayed[0]
    else:
        assert replayed[0] == {}, replayed[0]
    assert replayed[1] == {}, replayed[1]              # the sources' replays took theirs back
    assert abs(float(plain[2]) - float(replayed[2])) < 1e-6
    for name, g in plain[3].items():
        assert torch.allclose(g, replayed[3][name], atol=1e-6, rtol=0), name
