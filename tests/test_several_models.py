"""Several models in one world (RL: an actor, a reference policy, a critic, built in the same processes with
different configs and tasks) used in turns do not interfere: groups, caches, gradient buckets, token counts and
outputs stay each model's own.

On 4 ranks at pp2.dp2: an actor (Qwen2, AdamW with ZeRO and gradient buckets, token-mean loss against the
reference's log-probs passed in the batch), a reference (LLaMA, one KV head, forward only) and a critic (Qwen2
value model, plain AdamW, scalar loss), interleaved over two steps (reference forward, actor forward_backward,
critic forward_backward, then both finalize and step, actor log-probs after the step); the same operations on
each model alone in a fresh world give the same bits (outputs, losses, weights: ``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

import helpers
from parallm.verify.reference import value_loss

STEPS = 2


def actor_loss(out, mb):
    m = torch.zeros_like(out)
    m[:, :-1] = (mb["attention_mask"][:, 1:] * mb["attention_mask"][:, :-1]).float()
    return (-(out - mb["ref_lp"]) * m).sum() + (out * out * m).sum(), m.sum()


def rank_fn(rank, world, ckpts, ids, mask):
    import parallm
    from parallm.parallel.state import current_dims

    def build(which):
        task = "value" if which == "critic" else "causal_lm"
        chunks = parallm.build_model(ckpts[which], task=task)
        parallm.load_hf_weights(chunks, ckpts[which])
        opt = None
        if which == "actor":
            opt = parallm.build_optimizer(chunks, lr=1e-2, shard_over_dp=True, overlap_grad_reduce=True,
                                          bucket_bytes=16 * 1024)
        elif which == "critic":
            opt = parallm.build_optimizer(chunks, lr=1e-2)
        return chunks, opt

    def run(models, order):
        """The step's operations of the models in ``order`` (all three: interleaved)."""
        lay = current_dims()
        mine = slice(4 * lay.dp_rank, 4 * lay.dp_rank + 4)
        b_ids, b_mask = ids[mine], mask[mine]
        rec = {}
        for step in range(STEPS):
            ref_lp = None
            if "reference" in order:
                ref_lp = parallm.forward(models["reference"][0], b_ids, b_mask, output="logprobs")
                rec[f"ref{step}"] = ref_lp
            if ref_lp is None:
                ref_lp = torch.zeros(b_ids.shape)
            if "actor" in order:
                rec[f"actor_loss{step}"] = parallm.forward_backward(
                    models["actor"][0], {"input_ids": b_ids, "attention_mask": b_mask, "ref_lp": ref_lp},
                    loss_fn=actor_loss, output="logprobs", num_microbatches=2)
            if "critic" in order:
                rec[f"critic_loss{step}"] = parallm.forward_backward(models["critic"][0], b_ids, b_mask,
                                                                     loss_fn=value_loss, num_microbatches=2)
            for which in ("actor", "critic"):
                if which in order:
                    chunks, opt = models[which]
                    parallm.finalize_grads(chunks)
                    opt.step()
                    opt.zero_grad()
            if "actor" in order:
                rec[f"actor_lp{step}"] = parallm.forward(models["actor"][0], b_ids, b_mask, output="logprobs")
        for which in order:
            if which != "reference":
                rec[f"{which}_weights"] = parallm.save_hf_weights(models[which][0])
        return rec

    parallm.init_parallel(pp=2)
    together = run({w: build(w) for w in ("actor", "reference", "critic")}, ("actor", "reference", "critic"))
    parallm.destroy_parallel()
    alone = {}
    for which in ("reference", "actor", "critic"):
        parallm.init_parallel(pp=2)
        models = {which: build(which)}
        if which == "actor":      # its loss reads the reference's log-probs: built beside it, but only read
            models["reference"] = build("reference")
            alone.update(run(models, ("reference", "actor")))
        else:
            alone.update(run(models, (which,)))
        parallm.destroy_parallel()
    return together, alone


@pytest.mark.timeout(400)
def test_actor_reference_and_critic_in_one_world_do_not_interfere(tmp_path):
    actor = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=2), seed=20)
    reference = helpers.make_hf_model(helpers.tiny_config("llama", num_hidden_layers=4, num_key_value_heads=1),
                                      seed=21)
    critic = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=2, hidden_size=48,
                                                       num_attention_heads=4, num_key_value_heads=2),
                                   seed=22, task="value")
    ckpts = {name: helpers.save_checkpoint(m, str(tmp_path / name))
             for name, m in (("actor", actor), ("reference", reference), ("critic", critic))}
    ids, mask = helpers.padded_batch(101, seed=3, batch=8, seq=9)
    res = helpers.run_ranks(rank_fn, 4, ckpts, ids, mask)
    for rank, (together, alone) in enumerate(res):
        assert together.keys() == alone.keys(), sorted(set(together) ^ set(alone))
        for k in together:
            a, b = together[k], alone[k]
            if isinstance(a, dict):
                helpers.assert_same_state(a, b)
            else:
                assert torch.equal(a, b), (rank, k)
