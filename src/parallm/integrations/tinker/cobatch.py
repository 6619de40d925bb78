"""Many LoRA clients in one pass: consecutive ``forward_backward`` requests of different clients run as one
pipeline schedule over the shared base (:func:`parallm.api.parts.forward_backward_parts`).

The leader (:class:`.dispatch.Leader`, ``--cobatch N``) takes up to N consecutive ``forward_backward`` items of
distinct clients off its queue as one ``forward_many`` item; every rank runs it here. Each client's datums are
packed exactly as its request alone would be (:func:`.batch.pack`), and its microbatches run with its own
adapters: the client in the model (the first of the group, activated as a lone request would be) through the
model's parameters, every other one through its stored factors, set in the model's place for its microbatches by
the adapters' bank (:class:`parallm.model.layers.lora.LoraState`), with its LoRA scaling (its rank). Autograd
sends each microbatch's gradients to the factors it ran with: a client's gradients accumulate into its own stored
gradients, continuing from where its earlier requests left them, in the order a lone request would add them. The
results and every client's gradients are those of the requests one after another, bit for bit
(tests/test_tinker_cobatch.py).

Run alone instead, each with its own result or error: a full-fine-tuning client (its own model), an unknown
client, datums the packing refuses, a request whose output kind (next-token log-probs or logits) differs from the
group's first, a model with a load-balancing loss or a dynamic RoPE length that differs between requests, and
every request of a group whose pass failed (a ``loss_fn`` error anywhere: the group's gradients are rolled back
first, then each request runs alone, so the error reaches only the request that caused it).
"""

from __future__ import annotations

from parallm.api.parts import forward_backward_parts
from parallm.model.layers.lora import lora_state_of
from parallm.model.params import _accumulate_main_grad, uses_main_grad

from .batch import make_loss_fn, pack
from .clients import grads_restore, grads_snapshot
from .dispatch import run_item

__all__ = ["run_group"]


def _plan(trainer, items) -> tuple[list, list]:
    """``(together, alone)``: indices of the items that run in one pass (with their packed batches) and of those
    that run one by one."""
    d, together, alone, kind, seen = trainer.dims, [], [], None, set()
    for i, it in enumerate(items):
        if not it["backward"] or trainer._full(it["model_id"]) is not None or \
                it["model_id"] not in trainer.table.clients or it["model_id"] in seen:
            alone.append(i)
            continue
        seen.add(it["model_id"])
        try:
            packed = pack(it["data"], dp=d.dp, dp_rank=d.dp_rank, pp=d.pp, max_rows=trainer.max_rows)
        except Exception:  # noqa: BLE001 - the lone run raises it again as this request's error
            alone.append(i)
            continue
        if kind is None:
            kind = packed.next_token
        if packed.next_token != kind:
            alone.append(i)
            continue
        together.append((i, packed))
    return together, alone


class _Banks:
    """The stored factors of the group's clients other than the one in the model, made leaves that collect
    gradients (their gradients continuing from the stored ones; fp32 ``main_grad`` for bf16 factors)."""

    def __init__(self, params, states):
        self.params, self.states = params, states
        self.banks = []
        for st in states:
            bank = {}
            for p, v, (g, mg) in zip(params, st.params, st.grads):
                v.requires_grad_(p.requires_grad)
                v.grad = None if g is None else g.clone()
                if uses_main_grad(p):
                    v.main_grad = None if mg is None else mg.clone()
                    if not getattr(v, "_parallm_main_grad_hook", False):
                        v.register_post_accumulate_grad_hook(_accumulate_main_grad)
                        v._parallm_main_grad_hook = True
                bank[p] = v
            self.banks.append(bank)

    def keep(self) -> None:
        """The pass succeeded: the new gradients become the clients' stored ones."""
        for st in self.states:
            st.grads = [(v.grad, getattr(v, "main_grad", None)) for v in st.params]
        self.release()

    def release(self) -> None:
        for st in self.states:
            for v in st.params:
                v.grad = None
                v.requires_grad_(False)
                if hasattr(v, "main_grad"):
                    v.main_grad = None


def _together(trainer, items, together) -> list:
    """One pass of the ``together`` items; each one's result (as a lone ``op_forward`` returns it)."""
    d = trainer.dims
    first = items[together[0][0]]["model_id"]
    trainer._activate(first)
    states = [trainer.table.clients[items[i]["model_id"]] for i, _ in together[1:]]
    banks = _Banks(trainer.table.params, states)
    ranks = [trainer.table.clients[items[i]["model_id"]].lora["rank"] for i, _ in together]
    per_part = [None] + banks.banks
    lora = lora_state_of(trainer.chunks)
    captured = [[] for _ in together]
    parts = [(packed.batch, packed.microbatches,
              make_loss_fn(packed, loss_fn=items[i]["loss_fn"], config=items[i]["config"], dp=d.dp,
                           captured=captured[k]))
             for k, (i, packed) in enumerate(together)]

    def before_step(k):
        lora.bank = per_part[k]
        trainer._set_rank(ranks[k])

    guard = grads_snapshot(trainer.table.params)
    try:
        forward_backward_parts(trainer.chunks, parts, before_step=before_step,
                               output="logprobs" if together[0][1].next_token else None)
    except BaseException:
        lora.bank = None
        grads_restore(trainer.table.params, guard)
        banks.release()
        raise
    lora.bank = None
    banks.keep()
    for i, _ in together:
        trainer.table.clients[items[i]["model_id"]].accumulated += 1
    return [trainer.rows_result(items[i]["data"], captured[k]) for k, (i, _) in enumerate(together)]


def run_group(trainer, items: list) -> list:
    """Every rank: the items (``op_forward``'s arguments) co-batched where they can be, the rest one by one;
    ``{"outcomes": [...], "together": n}``: an outcome per item in the items' order (``("ok", value)`` /
    ``("error", ...)``; values on rank 0) and how many ran in the one pass (0: none did)."""
    together, alone = _plan(trainer, items)
    outcomes: list = [None] * len(items)
    ran = 0
    if len(together) > 1:
        try:
            values = _together(trainer, items, together)
            for (i, _), v in zip(together, values):
                outcomes[i] = ("ok", v)
            ran = len(together)
        except Exception:  # noqa: BLE001 - every rank raised (forward_backward agrees): each request alone
            alone = sorted(alone + [i for i, _ in together])
    else:
        alone = sorted(alone + [i for i, _ in together])
    for i in alone:
        outcomes[i] = run_item(trainer.execute, {"op": "forward", "args": items[i]})
    return {"outcomes": outcomes, "together": ran}

