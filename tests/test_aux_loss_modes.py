"""The MoE load-balancing loss's two conventions (issue 45 item 2), each against its own reference in fp32.

``build_model(aux_loss="pooled")``: transformers' convention, the token-mean cross-entropy + ``router_aux_loss_coef``
x ``Qwen3MoeForCausalLM(output_router_logits=True).aux_loss`` (``load_balancing_loss_func`` over every layer's
router logits at once). ``aux_loss="per_layer"`` (the default,
Megatron's): the same cross-entropy + coef x the sum over layers of that function applied to each layer alone
(about L times the pooled value). Per layout (tp2 padded, tp2 packed + sequence parallel, cp2): the returned
objective and every weight after ``finalize_grads`` and one SGD step. ``aux_loss="pooled"`` at pp > 1 is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers
from test_moe import per_layer_balance_loss

LR = 0.5
COEF = 0.3
LAYOUTS = {"tp2": (dict(tp=2), {}), "tp2 packed+SP": (dict(tp=2), dict(packed=True, sequence_parallel=True)),
           "cp2": (dict(cp=2), {})}


def token_mean_nll(logits, ids, mask):
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def reference(model, ids, mask, mode, tmp):
    """transformers' step: its own loss (pooled) or the per-layer sum, backward, SGD."""
    import parallm
    model = copy.deepcopy(model)
    out = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask),
                output_router_logits=True)
    if mode == "pooled":     # transformers' own aux_loss: load_balancing_loss_func over all layers at once
        loss = token_mean_nll(out.logits, ids, mask) + COEF * out.aux_loss
    else:
        loss = token_mean_nll(out.logits, ids, mask) + COEF * per_layer_balance_loss(out.router_logits,
                                                                                    model.config, mask)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return loss.item(), helpers.hub_state_dict(model, tmp)


def rank_modes(rank, world, ckpt, ids, mask):
    import parallm
    out = {}
    for name, (layout, build) in LAYOUTS.items():
        for mode in ("pooled", "per_layer"):
            parallm.init_parallel(**layout)
            chunks = parallm.build_model(ckpt, aux_loss=mode, **build)
            parallm.load_hf_weights(chunks, ckpt)
            loss = parallm.forward_backward(chunks, ids, mask, loss_fn=token_mean_nll)
            parallm.finalize_grads(chunks)
            with torch.no_grad():
                for c in chunks:
                    for p in c.parameters():
                        if p.requires_grad:
                            p -= LR * p.grad
            out[(name, mode)] = (loss.item(), parallm.save_hf_weights(chunks))
            parallm.destroy_parallel()
    parallm.init_parallel(pp=2)
    try:
        parallm.build_model(ckpt, aux_loss="pooled")
        out["pp2"] = None
    except ValueError as e:
        out["pp2"] = str(e)
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(400)
def test_pooled_and_per_layer_load_balancing_each_match_their_reference(tmp_path):
    cfg = helpers.tiny_config("qwen3_moe", num_hidden_layers=3, output_router_logits=True, router_aux_loss_coef=COEF)
    model = helpers.make_hf_model(cfg, seed=11)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=4, seq=14, seed=3)
    refs = {mode: reference(model, ids, mask, mode, str(tmp_path / f"ref-{mode}")) for mode in ("pooled", "per_layer")}
    # the two conventions differ (about L times apart in the aux term): the test can tell them apart
    assert abs(refs["pooled"][0] - refs["per_layer"][0]) > 1e-3
    result = helpers.run_ranks(rank_modes, 2, ckpt, ids, mask, timeout=400)[0]
    assert "aux_loss='pooled' needs pp=1" in (result.pop("pp2") or ""), result
    for (name, mode), (loss, state) in result.items():
        want_loss, want_state = refs[mode]
        assert abs(loss - want_loss) < 2e-5, (name, mode, loss, want_loss)
        worst = max((state[k].float() - want_state[k].float()).abs().max().item() for k in want_state)
        assert worst < 2e-5, (name, mode, worst)
