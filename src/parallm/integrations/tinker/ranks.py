"""LoRA rank per client: the model holds adapters of the server's rank ``R`` (``--lora-rank``); a client of rank
``r <= R`` keeps its factors in the first ``r_s = R_s r / R`` rows of each A and columns of each B (``R_s``: the
slot's rank in the model, ``R``, or ``2 R`` for a routed expert's fused gate/up as PEFT holds it) and zeros beyond.
Those zeros stay exactly zero: their gradients are exactly zero (B's column j: ``g (A x)_j = 0``; A's row j:
``B[:, j]^T g x^T = 0``) and AdamW moves a zero with zero gradient and zero moments by nothing (its decoupled
weight decay scales zero). Its scaling ``alpha / r`` is set when the client is switched in
(:func:`parallm.model.layers.lora.set_adapter_rank`).

What leaves the server is the rank-``r`` adapter: :func:`shrink_peft_dir` cuts a PEFT directory the model wrote
(rank ``R``) to rank ``r`` (tensors and ``adapter_config.json``: ``r``, ``rank_pattern`` of the experts' gate/up),
:func:`pad_peft_dir` makes a rank-``r`` directory loadable into the model again (zeros beyond ``r``).

PEFT's layout (``checkpoint/lora_io.py``): a dense factor is A ``[r, in]`` / B ``[out, r]``; a routed experts'
stacked factor (names ending ``experts.lora_A.weight`` / ``experts.base_layer.lora_A.weight``) is A ``[E r, in]``
(expert-major rows) and B ``[out, r E]`` (column ``k E + e``: expert e's column k).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

__all__ = ["cut_factor", "pad_factor", "pad_peft_dir", "peft_rank", "shrink_peft_dir"]

_STACKED = re.compile(r"\.experts\.(base_layer\.)?lora_[AB]\.weight$")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _blocks(name: str, num_experts: int) -> int:
    return num_experts if _STACKED.search(name) else 1


def _ranks(name: str, size: int, *, rank: int, big: int, num_experts: int) -> tuple[int, int, int]:
    """``(blocks, R_s, r_s)`` of a factor whose rank dimension has ``size`` entries at rank ``big``."""
    n = _blocks(name, num_experts)
    if size % n or (size // n * rank) % big:
        raise ValueError(f"{name}: rank dimension {size} does not hold {n} blocks of a multiple of {big} / {rank}")
    held = size // n
    return n, held, held * rank // big


def cut_factor(name: str, t: torch.Tensor, *, rank: int, big: int, num_experts: int) -> torch.Tensor:
    """A rank-``big`` PEFT factor cut to rank ``rank`` (the first ``r_s`` of each block)."""
    if ".lora_A." in name:
        n, held, keep = _ranks(name, t.shape[0], rank=rank, big=big, num_experts=num_experts)
        return t.reshape(n, held, t.shape[1])[:, :keep].reshape(n * keep, t.shape[1]).clone()
    n, held, keep = _ranks(name, t.shape[1], rank=rank, big=big, num_experts=num_experts)
    return t.reshape(t.shape[0], held, n)[:, :keep].reshape(t.shape[0], keep * n).clone()


def pad_factor(name: str, t: torch.Tensor, *, rank: int, big: int, num_experts: int) -> torch.Tensor:
    """A rank-``rank`` PEFT factor padded with zeros to rank ``big`` (the inverse of :func:`cut_factor`)."""
    if ".lora_A." in name:
        n = _blocks(name, num_experts)
        keep = t.shape[0] // n
        out = t.new_zeros(n, keep * big // rank, t.shape[1])
        out[:, :keep] = t.reshape(n, keep, t.shape[1])
        return out.reshape(-1, t.shape[1])
    n = _blocks(name, num_experts)
    keep = t.shape[1] // n
    out = t.new_zeros(t.shape[0], keep * big // rank, n)
    out[:, :keep] = t.reshape(t.shape[0], keep, n)
    return out.reshape(t.shape[0], -1)


def peft_rank(directory: str) -> int:
    with open(os.path.join(directory, CONFIG)) as f:
        return int(json.load(f)["r"])


def _rewrite(src: str, dst: str, *, rank_from: int, rank_to: int, fn) -> None:
    """``dst`` (replaced) = ``src`` with every tensor through ``fn`` and the config's ranks from ``rank_from`` to
    ``rank_to`` (``r``, and ``rank_pattern`` values, which the server's adapters hold only for the experts'
    gate/up: ``2 r``); other files copied. Written beside ``dst`` and moved into place."""
    from safetensors.torch import load_file, save_file
    tensors = {k: fn(k, v).contiguous() for k, v in load_file(os.path.join(src, WEIGHTS)).items()}
    with open(os.path.join(src, CONFIG)) as f:
        config = json.load(f)
    if int(config["r"]) != rank_from:
        raise ValueError(f"{src}: adapter rank {config['r']}, expected {rank_from}")
    config["r"] = rank_to
    config["rank_pattern"] = {k: v * rank_to // rank_from for k, v in (config.get("rank_pattern") or {}).items()}
    tmp = dst.rstrip("/") + ".rank-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for fname in os.listdir(src):
        if fname not in (CONFIG, WEIGHTS) and os.path.isfile(os.path.join(src, fname)):
            shutil.copy(os.path.join(src, fname), os.path.join(tmp, fname))
    save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def shrink_peft_dir(src: str, dst: str, *, rank: int, big: int, num_experts: int) -> None:
    """The rank-``big`` PEFT directory ``src`` as a rank-``rank`` one at ``dst`` (may be ``src``)."""
    if rank == big and src == dst:
        return
    _rewrite(src, dst, rank_from=big, rank_to=rank,
             fn=lambda k, v: cut_factor(k, v, rank=rank, big=big, num_experts=num_experts))


def pad_peft_dir(src: str, dst: str, *, big: int, num_experts: int) -> int:
    """The rank-``r`` PEFT directory ``src`` (a sampler snapshot) padded to rank ``big`` at ``dst``; returns r.
    A rank above ``big`` is a ValueError naming both."""
    rank = peft_rank(src)
    if not 1 <= rank <= big:
        raise ValueError(f"{src}: adapter rank {rank}; this server's adapters hold rank <= {big} (--lora-rank)")
    _rewrite(src, dst, rank_from=rank, rank_to=big,
             fn=lambda k, v: pad_factor(k, v, rank=rank, big=big, num_experts=num_experts))
    return rank
