"""The verl engine's optimizer and LR schedule: parallm's AdamW and verl's own schedule functions, built from verl's
``FSDPOptimizerConfig`` the way verl 0.9.1's FSDP engine builds its own (docs/verl.md)."""

from __future__ import annotations

import parallm

__all__ = ["build_optimizer", "build_lr_scheduler", "warmup_steps"]


def _decay_everything(name: str, param) -> bool:
    """verl's FSDP engine builds ``torch.optim.AdamW(module.parameters(), weight_decay=...)``: every parameter
    decays (biases and norm weights too), unlike parallm's default Megatron rule."""
    return False


def build_optimizer(chunks, optim_config):
    """parallm's AdamW from verl's ``FSDPOptimizerConfig``: ``optimizer_impl="torch.optim"``,
    ``optimizer="AdamW"`` (what verl's FSDP engine builds by default); ``override_optimizer_config`` may set
    ``eps`` (and ``amsgrad=False`` / ``foreach`` / ``fused``, which change nothing here). Anything else is a
    ``NotImplementedError`` naming it."""
    impl = getattr(optim_config, "optimizer_impl", "torch.optim")
    name = getattr(optim_config, "optimizer", "AdamW")
    if impl != "torch.optim" or str(name).lower() != "adamw":
        raise NotImplementedError(f"parallm engine: optimizer {impl}.{name}; parallm's optimizer is AdamW "
                                  "(optimizer_impl='torch.optim', optimizer='AdamW')")
    override = dict(getattr(optim_config, "override_optimizer_config", None) or {})
    eps = float(override.pop("eps", 1e-8))
    if override.pop("amsgrad", False):
        raise NotImplementedError("parallm engine: AdamW(amsgrad=True) is not parallm's AdamW")
    for harmless in ("foreach", "fused", "capturable", "differentiable", "maximize"):
        if harmless == "maximize" and override.get(harmless):
            raise NotImplementedError("parallm engine: AdamW(maximize=True) is not supported")
        override.pop(harmless, None)
    if override:
        raise NotImplementedError(f"parallm engine: override_optimizer_config keys {sorted(override)} are not "
                                  "supported (known: eps, amsgrad=False, foreach, fused)")
    return parallm.build_optimizer(chunks, lr=optim_config.lr, betas=tuple(optim_config.betas), eps=eps,
                                   weight_decay=optim_config.weight_decay, no_decay=_decay_everything)


def warmup_steps(optim_config) -> int:
    """verl's FSDP engine's warm-up length: ``lr_warmup_steps`` when > 0, else ``int(lr_warmup_steps_ratio *
    total_training_steps)`` (``None`` counts as unset)."""
    n = optim_config.lr_warmup_steps
    if n is None or n <= 0:
        n = int(optim_config.lr_warmup_steps_ratio * optim_config.total_training_steps)
    return n


def build_lr_scheduler(optimizer, optim_config):
    """verl's LR schedule on parallm's optimizer (a ``torch.optim.Optimizer``): verl's own
    ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` (``LambdaLR``), built with the
    arguments verl 0.9.1's FSDP engine passes them (``_build_lr_scheduler``), so the LR of every step is
    verl's. ``lr_scheduler_type`` other than ``constant`` / ``cosine`` is a ``NotImplementedError``."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    kind = optim_config.lr_scheduler_type
    warmup = warmup_steps(optim_config)
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warmup)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=optim_config.total_training_steps,
            min_lr_ratio=optim_config.min_lr_ratio, num_cycles=optim_config.num_cycles,
            zero_indexed_step=optim_config.zero_indexed_step)
    raise NotImplementedError(f"parallm engine: lr_scheduler_type={kind!r}; verl 0.9.1's FSDP engine knows "
                              "'constant' and 'cosine' (with warm-up), and so does this one")
