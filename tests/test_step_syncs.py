"""No host syncs inside forward_backward's schedule for the loss's bookkeeping (issue 45 item 5).

On a GPU every ``.item()`` / ``float(tensor)`` / ``.tolist()`` / ``.cpu()`` of a device tensor blocks the host
until the device catches up, so the last stage could not queue the next step's work. Counted here on CPU by a
``TorchFunctionMode`` that sees every such call: inside the last stage's work per microbatch (``loss_fn``'s
token count, each metric), the pipeline's side channel (the token count travelling with a microbatch's
gradient) and the load-balancing loss's backward weight, there must be none, whatever the number of
microbatches and metrics; the statistics are read once per call, after the schedule.
"""

from __future__ import annotations

import pytest
import torch

import helpers

SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}


def rank_count(rank, world, ckpt, ids, mask):
    from torch.overrides import TorchFunctionMode

    import parallm
    from parallm.api import step
    from parallm.model.layers import moe_aux
    from parallm.parallel import pipeline
    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in SYNCS:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    def counted(fn):
        def wrapper(*a, **kw):
            with Count():
                return fn(*a, **kw)
        return wrapper

    step.LastStage.__call__ = counted(step.LastStage.__call__)
    pipeline._exchange = counted(pipeline._exchange)
    moe_aux._AttachAux.backward = staticmethod(counted(moe_aux._AttachAux.backward))
    parallm.init_parallel(pp=world)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)

    def loss_fn(out, mb):
        lp = out
        m = mb["attention_mask"].float()
        m[:, -1] = 0
        n = m.sum()
        metrics = {f"m{i}": (lp * m).sum() / n.clamp(min=1) * (i + 1) for i in range(6)}
        metrics["top"] = lp.max()
        return ((-lp * m).sum(), n), metrics

    counts = {}
    for micro in (1, 4):
        seen.clear()
        loss, metrics = parallm.forward_backward(chunks, {"input_ids": ids, "attention_mask": mask},
                                                 loss_fn=loss_fn, num_microbatches=micro, output="logprobs",
                                                 metric_reduce={"top": "max"})
        counts[micro] = (list(seen), float(loss), sorted(metrics))
    try:        # a negative tensor count, read with the statistics: an error on every rank
        parallm.forward_backward(chunks, {"input_ids": ids, "attention_mask": mask}, num_microbatches=2,
                                 loss_fn=lambda out, mb: (out.sum(), -mb["attention_mask"].sum()),
                                 output="logprobs")
        counts["negative"] = None
    except ValueError as e:
        counts["negative"] = str(e)
    parallm.destroy_parallel()
    return counts


@pytest.mark.timeout(300)
def test_no_host_sync_in_the_schedule_for_losses_and_metrics(tmp_path):
    cfg = helpers.tiny_config("qwen3_moe", num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.02)
    model = helpers.make_hf_model(cfg, seed=3)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=4, seq=12, seed=1)
    results = helpers.run_ranks(rank_count, 2, ckpt, ids, mask, timeout=300)
    for rank, counts in enumerate(results):
        assert "negative num_tokens for 2 microbatch" in (counts.pop("negative") or ""), counts
        for micro, (seen, loss, names) in counts.items():
            assert seen == [], (rank, micro, seen)       # none in the last stage, the side channel, the aux weight
            assert names == sorted([f"m{i}" for i in range(6)] + ["top"])
        assert all(torch.isfinite(torch.tensor(c[1])) for c in counts.values()), counts
