"""Several LoRA training clients on one base model: each client's adapters, optimizer state and accumulated
gradients, switched in and out of the one model per request.

The model is built once with adapters of the server's rank ``R`` on every adaptable projection (``all-linear``);
a client of rank ``r <= R`` holds zeros beyond ``r`` and runs with scaling ``alpha / r`` (:mod:`.ranks`). A
client *is* a set of values for those adapter parameters plus its AdamW state (moments, step) and the gradients
its ``forward_backward`` calls have accumulated since its last ``optim_step``. The active client's values live in
the model; switching to another copies the active one's out (``detach().clone()`` of every trainable parameter,
``optimizer.state_dict()`` cloned, every gradient) and the next one's in (``copy_``, ``load_state_dict``). Memory:
one adapter + optimizer + gradient copy per inactive client (LoRA-sized). Nothing else of the model changes
between clients, so a client's results do not depend on what the others did (tested: two clients interleaved
equal each alone).

A client created with ``train_attn=False`` (or ``train_mlp`` / ``train_unembed`` False) gets zero A and B on those modules: their
update is exactly zero, their gradients are exactly zero (the gradient of B is ``g (A x)^T = 0``, of A
``B^T g x^T = 0``), and AdamW leaves zeros at zero, so those modules stay the base model's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil

import torch

__all__ = ["ClientState", "ClientTable", "clone_state_dict", "grads_restore", "grads_snapshot",
           "write_initial_adapter"]

SAMPLER_PREFIX = "sampler:"


@dataclasses.dataclass
class ClientState:
    model_id: str
    lora: dict                       # rank, seed, train_mlp, train_attn, train_unembed, alpha
    base_model: str
    params: list | None = None       # None while active (the values are in the model)
    optim: dict | None = None
    grads: list | None = None
    steps: int = 0                   # optimizer steps taken
    accumulated: int = 0             # forward_backward calls since the last optimizer step


def clone_state_dict(sd):
    if torch.is_tensor(sd):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: clone_state_dict(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(clone_state_dict(v) for v in sd)
    return sd


def grads_snapshot(params) -> list:
    out = []
    for p in params:
        g = p.grad.detach().clone() if p.grad is not None else None
        mg = getattr(p, "main_grad", None)
        out.append((g, mg.detach().clone() if torch.is_tensor(mg) else None))
    return out


@torch.no_grad()
def grads_restore(params, snap) -> None:
    """The gradients ``snap`` holds put back. A bf16 parameter's fp32 ``main_grad`` is written in place; where the
    snapshot has none (a client that had no backward while the buffer did not exist yet) it is zeroed: left as it
    was, it would hold the previous client's gradient and the next backward would add to it."""
    for p, (g, mg) in zip(params, snap):
        p.grad = None if g is None else g.clone()
        current = getattr(p, "main_grad", None)
        if mg is not None:
            if current is None:
                p.main_grad = mg.clone()
            else:
                current.copy_(mg)
        elif current is not None:
            current.zero_()


class ClientTable:
    """The clients of this rank's model and which one is in it. Every rank holds the same table (the ops that
    change it are dispatched to every rank); each holds its own shards' values."""

    def __init__(self, chunks, optimizer):
        self.chunks, self.optimizer = chunks, optimizer
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.fresh_optim = clone_state_dict(optimizer.state_dict())
        self.clients: dict[str, ClientState] = {}
        self.active: str | None = None

    def add(self, state: ClientState) -> None:
        self.clients[state.model_id] = state

    def drop(self, model_id: str) -> None:
        self.clients.pop(model_id, None)
        if self.active == model_id:
            self.active = None

    def deactivate(self) -> None:
        """Copy the active client's values out of the model (nothing to do for a sampler snapshot)."""
        mid = self.active
        if mid is None:
            return
        self.active = None
        st = self.clients.get(mid)
        if st is None:          # a sampler snapshot or a dropped client: nothing to keep
            return
        st.params = [p.detach().clone() for p in self.params]
        st.optim = clone_state_dict(self.optimizer.state_dict())
        st.grads = grads_snapshot(self.params)

    @torch.no_grad()
    def activate(self, model_id: str) -> ClientState:
        if model_id not in self.clients:
            raise KeyError(f"unknown model {model_id!r}")
        if self.active == model_id:
            return self.clients[model_id]
        self.deactivate()
        st = self.clients[model_id]
        for p, v in zip(self.params, st.params):
            p.copy_(v)
        self.optimizer.load_state_dict(st.optim)
        grads_restore(self.params, st.grads)
        st.params = st.optim = st.grads = None
        self.active = model_id
        return st

    def reset_optimizer(self) -> None:
        self.optimizer.load_state_dict(self.fresh_optim)

    def zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _module_kind(peft_name: str) -> str:
    if ".lm_head." in peft_name or peft_name.startswith("lm_head."):
        return "unembed"
    if ".self_attn." in peft_name:
        return "attn"
    if ".mlp." in peft_name or ".block_sparse_moe." in peft_name:
        return "mlp"
    return "other"


def initial_factor(name: str, shape, *, seed: int, kind_on: bool) -> torch.Tensor:
    """One factor of a new client: B zero; A ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (PEFT's kaiming-uniform
    bound) from a generator seeded by the client's seed and the factor's name; zero for a module the client
    does not train."""
    if not kind_on or ".lora_B." in name:
        return torch.zeros(shape, dtype=torch.float32)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def write_initial_adapter(template_dir: str, out_dir: str, *, seed: int, train_mlp: bool, train_attn: bool,
                          rank: int, big: int, num_experts: int, train_unembed: bool = False) -> None:
    """A PEFT directory with a new client's factors, in the layout of ``template_dir`` (the server's adapters as
    ``save_hf_adapter`` wrote them at start-up: rank ``big``); a client of rank ``rank`` gets zeros beyond it
    (:mod:`.ranks`). Written by rank 0; every rank then ``load_hf_adapter``s it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .ranks import cut_factor, pad_factor
    kw = {"rank": rank, "big": big, "num_experts": num_experts}
    on = {"attn": train_attn, "mlp": train_mlp, "unembed": train_unembed, "other": train_attn or train_mlp}
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    with safe_open(os.path.join(template_dir, "adapter_model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            shape = tuple(t.get_shape())
            dtype = f.get_tensor(name).dtype
            t = initial_factor(name, shape, seed=seed, kind_on=on[_module_kind(name)])
            tensors[name] = pad_factor(name, cut_factor(name, t, **kw), **kw).to(dtype)
    for fname in os.listdir(template_dir):
        if fname.endswith(".json"):
            shutil.copy(os.path.join(template_dir, fname), os.path.join(out_dir, fname))
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "tinker_init.json"), "w") as fh:
        json.dump({"seed": seed, "train_mlp": train_mlp, "train_attn": train_attn, "rank": rank}, fh)
