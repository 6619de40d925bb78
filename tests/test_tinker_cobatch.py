"""Many LoRA clients in one pass (issue 58 item 4; integrations/tinker/cobatch.py): the Tinker server's trainer on
2 gloo ranks (tp2, pp2), built as ``parallm serve-tinker`` builds it (rank-8 adapters on every linear and the
head; fp32, and bf16 at tp2). Four clients of ranks 4 / 8 / 8 / 2 with different losses (cross_entropy, importance_sampling, ppo, dro)
and different batch shapes run two rounds of ``forward_backward`` + ``optim_step``, once one request after another
(``op_forward``) and once, from the same initial adapters, co-batched (``op_forward_many``: one pass). Every
result (per-datum log-probs, ``loss:sum``), every gradient norm and every client's adapters after the two steps
are equal bit for bit; the pass really ran as one (``forward_backward_parts`` called once per round with four
parts). Breaks that must fail: the adapters' bank ignored (every client then runs the first client's adapters:
the results differ). A group with a request whose loss raises: that request alone gets the error, the others
the same results as alone.

Runs in the main venv (no SDK: the trainer is driven directly, as the dispatcher drives it); the SDK-level
co-batching is in tests/test_tinker_cobatch_sdk.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import helpers
import tinker_helpers as th

pytestmark = pytest.mark.timeout(600)
BIG = 8
CLIENTS = [("cross_entropy", 4, 3, 9), ("importance_sampling", 8, 2, 14), ("ppo", 8, 4, 6), ("dro", 2, 1, 11)]
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip_norm": 0.0}


def _data(seed, rows, length, loss):
    from parallm.integrations.tinker.protocol import Datum
    g = np.random.default_rng(seed)
    out = []
    for r in range(rows):
        n = int(length + (r % 3))
        x = g.integers(3, 100, size=n + 1)
        inputs = {"target_tokens": x[1:].astype(np.int64)}
        if loss == "cross_entropy":
            inputs["weights"] = g.random(n).astype(np.float32)
        else:
            inputs["logprobs"] = (-g.random(n) * 4).astype(np.float32)
            inputs["advantages"] = g.standard_normal(n).astype(np.float32)
        out.append(Datum(tokens=x[:n].astype(np.int64), inputs=inputs))
    return out


def _config(loss):
    return {"beta": 0.1} if loss == "dro" else ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
                                                  if loss == "ppo" else {})


def _trainer(model, work, rank, world, pp, dtype):
    import parallm
    from parallm.integrations.tinker.dispatch import new_control_group
    from parallm.integrations.tinker.trainer import Trainer
    tp = world // pp
    parallm.init_parallel(tp=tp, pp=pp, timeout_s=120)
    chunks = parallm.build_model(model, lora=parallm.LoraConfig(BIG, 32.0, ("all-linear", "lm_head")),
                                 dtype=dtype)
    parallm.load_hf_weights(chunks, model)
    opt = parallm.build_optimizer(chunks, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
    template = os.path.join(work, f"template-pp{pp}")
    parallm.save_hf_adapter(chunks, template, overwrite=True)
    return Trainer(chunks, opt, group=new_control_group(120)), template


def _create(trainer, template, work, name, rank_r, seed, rank, world):
    from parallm.integrations.tinker.clients import write_initial_adapter
    init = os.path.join(work, f"init-{name}")
    if rank == 0:
        write_initial_adapter(template, init, seed=seed, train_mlp=True, train_attn=True, train_unembed=True,
                              rank=rank_r, big=BIG, num_experts=1)
    torch.distributed.barrier()
    lora = {"rank": rank_r, "seed": seed, "train_mlp": True, "train_attn": True, "train_unembed": True}
    trainer.execute({"op": "create_client", "args": {"model_id": name, "lora": lora, "base_model": "m",
                                                     "init_dir": init}})


def _items(prefix, round_):
    return [{"model_id": f"{prefix}{k}", "loss_fn": loss, "config": _config(loss),
             "data": _data(100 * round_ + k, rows, length, loss), "backward": True}
            for k, (loss, _, rows, length) in enumerate(CLIENTS)]


def _params_of(trainer, name):
    trainer._activate(name)
    return [p.detach().clone() for p in trainer.table.params]


def _rounds(trainer, prefix, together, calls):
    """Two rounds of forward_backward + optim_step for the four clients; every result and grad norm."""
    results = []
    for round_ in range(2):
        items = _items(prefix, round_)
        if together:
            before = len(calls)
            got = trainer.execute({"op": "forward_many", "args": {"items": items}})
            assert len(calls) == before + 1 and calls[-1] == 4 and got["together"] == 4, calls  # one pass of four
            assert all(s == "ok" for s, _ in got["outcomes"]), got
            outs = [v for _, v in got["outcomes"]]
        else:
            outs = [trainer.execute({"op": "forward", "args": it}) for it in items]
        steps = [trainer.execute({"op": "optim_step", "args": {"model_id": it["model_id"], "adam": ADAM}})
                 for it in items]
        results.append((outs, steps))
    return results


def _same(a, b) -> bool:
    """Results equal bit for bit (None on ranks other than 0)."""
    if a is None or b is None:
        return a is None and b is None
    for (oa, sa), (ob, sb) in zip(a, b):
        if sa != sb:
            return False
        for x, y in zip(oa, ob):
            if x["metrics"] != y["metrics"] or len(x["outputs"]) != len(y["outputs"]):
                return False
            if not all(np.array_equal(u["logprobs"], v["logprobs"]) for u, v in zip(x["outputs"], y["outputs"])):
                return False
    return True


def _worker(rank, world, model, work, pp, dtype, out_dir):
    torch.set_num_threads(1)
    import parallm.integrations.tinker.cobatch as cobatch
    from parallm.model.layers.lora import LoraState
    calls = []
    real = cobatch.forward_backward_parts

    def counted(chunks, parts, **kw):
        calls.append(len(parts))
        return real(chunks, parts, **kw)
    cobatch.forward_backward_parts = counted
    trainer, template = _trainer(model, work, rank, world, pp, getattr(torch, dtype))
    for prefix in ("alone", "together", "broken"):
        for k, (_, r, _, _) in enumerate(CLIENTS):
            _create(trainer, template, work, f"{prefix}{k}", r, seed=10 + k, rank=rank, world=world)
    alone = _rounds(trainer, "alone", False, calls)
    together = _rounds(trainer, "together", True, calls)
    same = _same(alone, together) if rank == 0 else None
    worst = max(float((a.float() - b.float()).abs().max()) for k in range(4)
                for a, b in zip(_params_of(trainer, f"alone{k}"), _params_of(trainer, f"together{k}")))
    moved = max(float((a.float() - b.float()).abs().max()) for a, b in zip(_params_of(trainer, "alone1"),
                                                              _params_of(trainer, "alone2")))
    # a break that must fail: the bank ignored (every part runs the model's own adapters, the first client's)
    factor = LoraState.factor
    LoraState.factor = lambda self, p: p
    try:
        broken = _rounds(trainer, "broken", True, calls)
    finally:
        LoraState.factor = factor
    broken_same = _same(alone, broken) if rank == 0 else None
    # a request whose loss raises inside the pass: its error alone, the others as if alone
    items = _items("alone", 5)
    items[2]["loss_fn"] = "cross_entropy"       # its datums carry no weights: a KeyError in the loss
    got = trainer.execute({"op": "forward_many", "args": {"items": items}})
    status = [s for s, _ in got["outcomes"]] + [got["together"]]
    torch.save({"same": same, "worst": worst, "moved": moved, "broken_same": broken_same, "status": status,
                "calls": calls}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("pp,dtype", [(1, "float32"), (2, "float32"), (1, "bfloat16")],
                         ids=["tp2", "pp2", "tp2-bf16"])
def test_cobatched_clients_equal_alone_bit_for_bit(tmp_path, pp, dtype):
    """bf16: the factors' gradients accumulate in fp32 ``main_grad`` (the stored clients' too). This case also
    caught a bug of the lone path (fixed with it): a client created before the first backward had no
    ``main_grad`` to restore, so it inherited the previous client's and its first step added to it."""
    work = str(tmp_path)
    model = th.tiny_model(os.path.join(work, "model"), seed=3)
    helpers.run_ranks(_worker, 2, model, work, pp, dtype, work)
    got = torch.load(os.path.join(work, "rank0.pt"))
    assert got["same"] is True, "co-batched results differ from the requests alone"
    assert got["worst"] == 0.0, f"adapters after two co-batched steps differ from alone by {got['worst']}"
    assert got["moved"] > 1e-3, "the clients' adapters did not move apart (the comparison would be vacuous)"
    assert got["broken_same"] is False, "ignoring the adapters' bank went unnoticed"
    assert got["status"] == ["ok", "ok", "error", "ok", 0], got["status"]    # the pass failed: each alone
