"""Where a parameter's gradient lives, the one convention every reader of gradients follows.

fp32 parameters keep ``param.grad``. bf16 / fp16 parameters accumulate in an fp32 ``param.main_grad`` (as
Megatron's DDP): :func:`attach_main_grad_hooks` gives them a post-accumulate-grad hook that adds each fresh
``param.grad`` into ``main_grad`` and frees it, so microbatches accumulate in fp32 and no low-precision
``param.grad`` is kept. :func:`grad_of` says which tensor is a parameter's gradient; finalize_grads,
clip_grad_norm_, the optimizer, the checkpoint code and the log-prob head read it.
"""

from __future__ import annotations

import torch

from ..parallel.state import as_chunks

LOW_PRECISION = (torch.bfloat16, torch.float16)


def uses_main_grad(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient accumulates in an fp32 ``main_grad`` (bf16 / fp16 parameters)."""
    return p.dtype in LOW_PRECISION


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding ``p``'s gradient: ``p.main_grad`` (fp32) when present, else ``p.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _accumulate_main_grad(p: torch.Tensor) -> None:
    grad = p.grad
    if grad is None:
        return
    if getattr(p, "main_grad", None) is None:
        p.main_grad = grad.float()      # the hook is only on bf16 / fp16 parameters: a new fp32 tensor
    else:
        p.main_grad.add_(grad)
    p.grad = None


def attach_main_grad_hooks(chunks) -> None:
    """Give every bf16 / fp16 parameter of ``chunks`` the hook that accumulates into fp32 ``main_grad``.

    ``main_grad`` is created on the first backward that reaches the parameter. A ``main_grad`` set by someone
    else (Megatron's DDP assigns views of its buffer) is used as it is: whichever hook runs first moves
    ``param.grad`` into it and the other finds nothing left to add.
    """
    for chunk in as_chunks(chunks):
        for p in chunk.parameters():
            if uses_main_grad(p) and p.requires_grad and not getattr(p, "_parallm_main_grad_hook", False):
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                p._parallm_main_grad_hook = True


def clear_grad(p: torch.Tensor, *, set_to_none: bool = True) -> None:
    """Reset ``p``'s gradient before the next accumulation: ``main_grad`` zeroed in place (the fp32 buffer is
    kept), ``param.grad`` dropped (or zeroed with ``set_to_none=False``). A gradient that is a view into a
    gradient bucket (``build_optimizer(overlap_grad_reduce=True)``) is zeroed in place and stays that view."""
    view = getattr(p, "_parallm_grad_view", None)
    if view is not None:
        view.zero_()
        if uses_main_grad(p):
            p.main_grad = view
        else:
            p.grad = view
        return
    if p.grad is not None:
        if set_to_none:
            p.grad = None
        else:
            p.grad.zero_()
    main = getattr(p, "main_grad", None)
    if main is not None:
        main.zero_()


def zero_grads(chunks) -> None:
    """:func:`clear_grad` of every parameter of ``chunks`` (with gradient buckets: every bucket zeroed and the
    step's accumulation counts reset)."""
    chunks = as_chunks(chunks)
    buffers = getattr(chunks[0], "_parallm_grad_buffers", None) if chunks else None
    if buffers is not None:
        buffers.zero()
    for chunk in chunks:
        for p in chunk.parameters():
            clear_grad(p)
