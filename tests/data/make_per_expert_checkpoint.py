"""Writes tests/data/moe_per_expert_checkpoint/: a training checkpoint (model + AdamW state, one step, fp32) of a
tiny Qwen3-MoE at tp1 x dp2 x ep2, saved by parallm before routed experts became stacked parameters (commit
ca3de77, when every expert's tensors were parameters of their own). ``tests/test_train_checkpoint.py`` loads it
with the current code. Kept for the record; running it again with today's code would write today's format.

    .venv/bin/python tests/data/make_per_expert_checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "moe_per_expert_checkpoint")
CONFIG = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
              num_hidden_layers=2)


def rank_main(rank, world, hf_dir, out):
    import parallm
    parallm.init_parallel(tp=1, pp=1, ep=2)
    chunks = parallm.build_model(hf_dir)
    parallm.load_hf_weights(chunks, hf_dir)
    opt = parallm.build_optimizer(chunks, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(3))
    from parallm.verify.reference import causal_lm_loss
    parallm.forward_backward(chunks, ids[2 * rank:2 * rank + 2], loss_fn=causal_lm_loss)
    parallm.finalize_grads(chunks)
    opt.step()
    opt.zero_grad()
    parallm.save_checkpoint(out, chunks, opt, step=1, extra={"written_by": "per-expert parameters"})
    parallm.destroy_parallel()


def main():
    sys.path.insert(0, os.path.join(HERE, ".."))
    import helpers
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        model = helpers.make_hf_model(helpers.tiny_config("qwen3_moe", **CONFIG), seed=21)
        hf_dir = helpers.save_checkpoint(model, os.path.join(tmp, "hf"))
        shutil.rmtree(OUT, ignore_errors=True)
        helpers.run_ranks(rank_main, 2, hf_dir, OUT)


if __name__ == "__main__":
    main()
