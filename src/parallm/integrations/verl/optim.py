"""The verl engine's optimizer and LR schedule, from ``optim=parallm`` (:class:`..config.ParallmOptimizerConfig`:
verl's FSDP optimizer keys plus its Megatron LR-schedule keys), verl's ``FSDPOptimizerConfig`` (the
``PARALLM_VERL_CONFIG`` route) or verl's ``McoreOptimizerConfig`` (docs/verl.md, "The optimizer").

Two schedules, chosen by the keys:

* FSDP keys only (no Megatron schedule key set): verl's own ``get_constant_schedule_with_warmup`` /
  ``get_cosine_schedule_with_warmup`` (``LambdaLR``), built with the arguments verl 0.9.1's FSDP engine passes
  them; AdamW decays every parameter, as verl's FSDP engine's ``torch.optim.AdamW(module.parameters())``.
* Any Megatron schedule key set (``lr_decay_style``, ``lr_warmup_init``, ``min_lr``, ``lr_decay_steps``, ...), or an
  ``McoreOptimizerConfig``: megatron-core's ``OptimizerParamScheduler`` itself, on parallm's optimizer (a
  ``torch.optim.Optimizer``: the scheduler only writes each param group's ``lr`` and ``weight_decay``), with the
  arguments verl 0.9.1's Megatron engine passes it (``verl.utils.megatron.optimizer.
  get_megatron_optimizer_param_scheduler``), and AdamW decaying as Megatron's optimizer does (biases and 1-D
  parameters not decayed: their group carries ``wd_mult=0``). The class is megatron-core's rather than a
  re-implementation so that every step's LR, the state saved in checkpoints and the resume rules
  (``use_checkpoint_opt_param_scheduler``) are what verl's Megatron engine has by construction; parallm already
  depends on megatron-core.

Values neither schedule can honour are refused naming the key (:func:`check_optimizer_config`, run when verl
builds ``ParallmOptimizerConfig`` and again when the engine builds the optimizer).
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

import parallm

__all__ = ["build_optimizer", "build_lr_scheduler", "warmup_steps", "check_optimizer_config",
           "uses_megatron_schedule", "megatron_schedule", "MegatronLRScheduler", "MEGATRON_SCHEDULE_DEFAULTS"]

# verl 0.9.1's optim/megatron.yaml defaults of its LR-schedule keys (what optim=megatron gives when a key is not on
# the command line; McoreOptimizerConfig's dataclass default for lr_decay_style is "linear", the yaml's "constant")
MEGATRON_SCHEDULE_DEFAULTS = {"lr_warmup_init": 0.0, "lr_decay_steps": None, "lr_decay_style": "constant",
                              "min_lr": 0.0, "weight_decay_incr_style": "constant",
                              "lr_wsd_decay_style": "exponential", "lr_wsd_decay_steps": None,
                              "use_checkpoint_opt_param_scheduler": False}
# megatron-core 0.16's OptimizerParamScheduler spellings; verl's yaml comment spells inverse_square_root, which
# megatron-core does not know (verl's Megatron engine fails on it after the warm-up): accepted here as the same
_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_DECAY_ALIASES = {"inverse_square_root": "inverse-square-root"}
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WD_INCR_STYLES = ("constant", "linear", "cosine")
_FP32 = ("fp32", "float32", "32")
# FSDP schedule keys and their defaults (optim/fsdp.yaml): with the Megatron schedule any other value is refused
_FSDP_SCHEDULE_DEFAULTS = {"lr_scheduler_type": ("constant",), "warmup_style": (None,), "min_lr_ratio": (None, 0.0),
                           "num_cycles": (0.5,), "zero_indexed_step": (True,)}


def _decay_everything(name: str, param) -> bool:
    """verl's FSDP engine builds ``torch.optim.AdamW(module.parameters(), weight_decay=...)``: every parameter
    decays (biases and norm weights too), unlike parallm's default Megatron rule."""
    return False


def _megatron_keys_set(optim_config) -> list[str]:
    return [k for k in MEGATRON_SCHEDULE_DEFAULTS if getattr(optim_config, k, None) is not None]


def uses_megatron_schedule(optim_config) -> bool:
    """True when the LR schedule is megatron-core's: a Megatron schedule key is set, or the config is verl's
    ``McoreOptimizerConfig`` (it has no ``lr_scheduler_type``)."""
    return bool(_megatron_keys_set(optim_config)) or not hasattr(optim_config, "lr_scheduler_type")


def _megatron_values(optim_config) -> dict:
    """The Megatron schedule keys, unset ones (``None``) at ``optim/megatron.yaml``'s defaults, the decay style in
    megatron-core's spelling."""
    out = {k: getattr(optim_config, k, None) for k in MEGATRON_SCHEDULE_DEFAULTS}
    out = {k: (MEGATRON_SCHEDULE_DEFAULTS[k] if v is None else v) for k, v in out.items()}
    out["lr_decay_style"] = _DECAY_ALIASES.get(out["lr_decay_style"], out["lr_decay_style"])
    return out


def check_optimizer_config(optim_config) -> None:
    """Refuse, naming the key, what parallm's engine cannot honour: an optimizer other than AdamW (verl's FSDP
    ``optimizer_impl=torch.optim optimizer=AdamW`` or Megatron's ``optimizer=adam``, which is AdamW), Megatron's
    precision-aware optimizer or non-fp32 ``*_dtype``, unknown ``lr_decay_style`` / ``weight_decay_incr_style`` /
    ``lr_wsd_decay_style``, WSD without ``lr_wsd_decay_steps``, ``min_lr`` / ``lr_warmup_init`` out of the range
    megatron-core asserts, and with the Megatron schedule an FSDP schedule key away from its default (it would
    be ignored). Needs no ``total_training_steps`` (:func:`megatron_schedule` checks what depends on it)."""
    impl = getattr(optim_config, "optimizer_impl", "torch.optim")
    name = getattr(optim_config, "optimizer", "AdamW")
    if not (str(name) == "adam" or (impl == "torch.optim" and str(name).lower() == "adamw")):
        raise NotImplementedError(
            f"parallm engine: optimizer {impl}.{name} (optim.optimizer={name!r}); parallm's optimizer is AdamW: "
            "optimizer_impl='torch.optim' optimizer='AdamW' (verl's FSDP keys) or optimizer='adam' (verl's Megatron "
            "keys; Megatron's adam is AdamW)")
    if getattr(optim_config, "use_precision_aware_optimizer", False):
        raise NotImplementedError("parallm engine: optim.use_precision_aware_optimizer=True is not supported "
                                  "(parallm keeps fp32 main gradients and fp32 Adam moments)")
    for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(optim_config, key, "fp32")
        if str(value) not in _FP32:
            raise NotImplementedError(f"parallm engine: optim.{key}={value!r}; parallm keeps main gradients and "
                                      "Adam moments in fp32 (accepted: fp32)")
    if str(getattr(optim_config, "optimizer", "")) == "muon" or getattr(optim_config,
                                                                       "use_layer_wise_distributed_optimizer", False):
        raise NotImplementedError("parallm engine: optim.use_layer_wise_distributed_optimizer / Muon are not "
                                  "supported")
    if not uses_megatron_schedule(optim_config):
        return
    keys = _megatron_keys_set(optim_config)
    given = ", ".join(f"optim.{k}" for k in keys) or "verl's McoreOptimizerConfig"
    for key, defaults in _FSDP_SCHEDULE_DEFAULTS.items():
        if hasattr(optim_config, key) and getattr(optim_config, key) not in defaults:
            raise ValueError(
                f"parallm engine: optim.{key}={getattr(optim_config, key)!r} is a key of verl's FSDP LR schedule, "
                f"but the Megatron schedule keys ({given}) select megatron-core's; leave optim.{key} at its default "
                f"({defaults[0]!r}) and use the Megatron keys (lr_decay_style, min_lr, lr_warmup_init, ...)")
    m = _megatron_values(optim_config)
    if m["lr_decay_style"] not in _DECAY_STYLES:
        raise ValueError(f"parallm engine: optim.lr_decay_style={getattr(optim_config, 'lr_decay_style')!r}; "
                         f"megatron-core knows {list(_DECAY_STYLES)} (inverse_square_root accepted too)")
    if m["weight_decay_incr_style"] not in _WD_INCR_STYLES:
        raise ValueError(f"parallm engine: optim.weight_decay_incr_style={m['weight_decay_incr_style']!r}; "
                         f"megatron-core knows {list(_WD_INCR_STYLES)}")
    if m["lr_decay_style"] == "WSD":
        if m["lr_wsd_decay_style"] not in _WSD_STYLES:
            raise ValueError(f"parallm engine: optim.lr_wsd_decay_style={m['lr_wsd_decay_style']!r}; megatron-core's "
                             f"WSD anneals {list(_WSD_STYLES)}")
        wsd = m["lr_wsd_decay_steps"]
        if wsd is None or isinstance(wsd, bool) or not isinstance(wsd, int) or wsd < 1:
            raise ValueError(f"parallm engine: optim.lr_wsd_decay_steps={wsd!r}; lr_decay_style=WSD needs a positive "
                             "number of annealing steps")
    if not isinstance(m["use_checkpoint_opt_param_scheduler"], bool):
        raise ValueError("parallm engine: optim.use_checkpoint_opt_param_scheduler must be true or false, got "
                         f"{m['use_checkpoint_opt_param_scheduler']!r}")
    lr, min_lr, init = float(optim_config.lr), float(m["min_lr"]), float(m["lr_warmup_init"])
    if min_lr < 0.0 or min_lr > lr:
        raise ValueError(f"parallm engine: optim.min_lr={m['min_lr']!r} must be in [0, optim.lr={optim_config.lr!r}] "
                         "(megatron-core's OptimizerParamScheduler asserts it)")
    if init > lr:
        raise ValueError(f"parallm engine: optim.lr_warmup_init={m['lr_warmup_init']!r} must be <= "
                         f"optim.lr={optim_config.lr!r} (megatron-core's OptimizerParamScheduler asserts it)")


def _eps_and_betas(optim_config) -> tuple[float, tuple]:
    """``eps`` / ``betas`` with ``override_optimizer_config`` applied: ``eps`` (verl's FSDP name) or ``adam_eps``,
    ``adam_beta1`` / ``adam_beta2`` (Megatron's ``OptimizerConfig`` names, what verl's Megatron engine passes on);
    ``amsgrad=False`` / ``foreach`` / ``fused`` / ``capturable`` / ``differentiable`` / ``maximize=False`` change
    nothing here; anything else is refused naming it."""
    override = dict(getattr(optim_config, "override_optimizer_config", None) or {})
    if "eps" in override and "adam_eps" in override:
        raise ValueError("parallm engine: override_optimizer_config sets both eps and adam_eps")
    eps = float(override.pop("eps", override.pop("adam_eps", 1e-8)))
    betas = list(optim_config.betas)
    for i, key in enumerate(("adam_beta1", "adam_beta2")):
        if key in override:
            betas[i] = float(override.pop(key))
    if override.pop("amsgrad", False):
        raise NotImplementedError("parallm engine: AdamW(amsgrad=True) is not parallm's AdamW")
    for harmless in ("foreach", "fused", "capturable", "differentiable", "maximize"):
        if harmless == "maximize" and override.get(harmless):
            raise NotImplementedError("parallm engine: AdamW(maximize=True) is not supported")
        override.pop(harmless, None)
    if override:
        raise NotImplementedError(f"parallm engine: override_optimizer_config keys {sorted(override)} are not "
                                  "supported (known: eps / adam_eps, adam_beta1, adam_beta2, amsgrad=False, "
                                  "foreach, fused)")
    return eps, tuple(betas)


def build_optimizer(chunks, optim_config):
    """parallm's AdamW from the optimizer config (:func:`check_optimizer_config` first). verl's FSDP schedule:
    every parameter decays (verl's FSDP engine's ``torch.optim.AdamW(module.parameters())``). The Megatron
    schedule: Megatron's rule (biases and 1-D parameters not decayed, parallm's default), the group that skips
    carrying ``wd_mult=0`` so that megatron-core's scheduler, which rewrites every group's ``weight_decay``,
    keeps it at 0 (as in Megatron's own param groups)."""
    check_optimizer_config(optim_config)
    eps, betas = _eps_and_betas(optim_config)
    megatron = uses_megatron_schedule(optim_config)
    kwargs = {} if megatron else {"no_decay": _decay_everything}
    optimizer = parallm.build_optimizer(chunks, lr=optim_config.lr, betas=betas, eps=eps,
                                        weight_decay=optim_config.weight_decay, **kwargs)
    if megatron:
        for group in optimizer.param_groups:
            group["wd_mult"] = 0.0 if group.get("name") == "no_decay" or group["weight_decay"] == 0.0 else 1.0
    return optimizer


def warmup_steps(optim_config) -> int:
    """verl's FSDP engine's warm-up length: ``lr_warmup_steps`` when > 0, else ``int(lr_warmup_steps_ratio *
    total_training_steps)`` (``None`` counts as unset)."""
    n = optim_config.lr_warmup_steps
    if n is None or n <= 0:
        n = int(optim_config.lr_warmup_steps_ratio * optim_config.total_training_steps)
    return n


def megatron_schedule(optim_config) -> dict:
    """The keyword arguments of megatron-core's ``OptimizerParamScheduler`` (less the optimizer) exactly as verl
    0.9.1's Megatron engine computes them (``get_megatron_optimizer_param_scheduler``): ``lr_decay_steps`` (None:
    ``total_training_steps``); the warm-up ``lr_warmup_steps``, or when that is unset / <= 0
    ``int(lr_warmup_steps_ratio * lr_decay_steps)`` (of the decay steps, not the total); ``start_wd = end_wd =
    weight_decay`` over ``total_training_steps`` (so any ``weight_decay_incr_style`` keeps the decay constant);
    ``override_opt_param_scheduler = not use_checkpoint_opt_param_scheduler``. Refuses, naming the keys, what
    megatron-core would assert on: no positive decay-step count, a warm-up not shorter than the decay."""
    check_optimizer_config(optim_config)
    m = _megatron_values(optim_config)
    total = optim_config.total_training_steps
    decay = m["lr_decay_steps"] if m["lr_decay_steps"] is not None else total
    if decay is None or isinstance(decay, bool) or not isinstance(decay, int) or decay < 1:
        raise ValueError(f"parallm engine: optim.lr_decay_steps={m['lr_decay_steps']!r} with "
                         f"optim.total_training_steps={total!r}: megatron-core's schedule needs a positive number of "
                         "decay steps (lr_decay_steps, or total_training_steps when it is null)")
    warmup = optim_config.lr_warmup_steps
    ratio = getattr(optim_config, "lr_warmup_steps_ratio", None)
    if ratio is not None and (warmup is None or warmup <= 0):
        warmup = int(ratio * decay)
    if warmup is None:
        raise ValueError("parallm engine: optim.lr_warmup_steps and optim.lr_warmup_steps_ratio are both null; "
                         "set one (-1 / 0.0: no warm-up)")
    if warmup >= decay:
        raise ValueError(f"parallm engine: the warm-up (optim.lr_warmup_steps={optim_config.lr_warmup_steps!r}, "
                         f"optim.lr_warmup_steps_ratio={ratio!r}: {warmup} steps) must be shorter than the decay "
                         f"(optim.lr_decay_steps / total_training_steps: {decay} steps)")
    use_ckpt = bool(m["use_checkpoint_opt_param_scheduler"])
    return dict(init_lr=m["lr_warmup_init"], max_lr=optim_config.lr, min_lr=m["min_lr"], lr_warmup_steps=warmup,
                lr_decay_steps=decay, lr_decay_style=m["lr_decay_style"], start_wd=optim_config.weight_decay,
                end_wd=optim_config.weight_decay, wd_incr_steps=total, wd_incr_style=m["weight_decay_incr_style"],
                use_checkpoint_opt_param_scheduler=use_ckpt, override_opt_param_scheduler=not use_ckpt,
                wsd_decay_steps=m["lr_wsd_decay_steps"], lr_wsd_decay_style=m["lr_wsd_decay_style"])


class MegatronLRScheduler(OptimizerParamScheduler):
    """megatron-core's ``OptimizerParamScheduler``, stepping by 1 by default (the engine's ``lr_scheduler_step``
    calls ``step()``, verl's Megatron engine ``step(1)``) and answering ``get_last_lr()`` (every group's ``lr``;
    verl's Megatron engine reports ``param_groups[0]["lr"]``). A checkpoint state that is not megatron-core's (saved
    with verl's FSDP schedule) is refused on load."""

    def step(self, increment: int = 1) -> None:
        super().step(increment)

    def get_last_lr(self) -> list:
        return [group["lr"] for group in self.optimizer.param_groups]

    def load_state_dict(self, state_dict: dict) -> None:
        if "num_steps" not in state_dict and "num_iters" not in state_dict:
            raise ValueError("parallm engine: the checkpoint's LR-schedule state is not megatron-core's (keys "
                             f"{sorted(state_dict)}): it was saved with verl's FSDP schedule keys; resume with "
                             "those, or leave 'extra' out of checkpoint.load_contents")
        super().load_state_dict(state_dict)


def build_lr_scheduler(optimizer, optim_config):
    """The LR schedule on parallm's optimizer (a ``torch.optim.Optimizer``). Megatron schedule keys set (or an
    ``McoreOptimizerConfig``): megatron-core's ``OptimizerParamScheduler`` with :func:`megatron_schedule`'s
    arguments. Otherwise verl's own ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``
    (``LambdaLR``), built with the arguments verl 0.9.1's FSDP engine passes them (``_build_lr_scheduler``), so
    the LR of every step is verl's. ``lr_scheduler_type`` other than ``constant`` / ``cosine`` is a
    ``NotImplementedError``."""
    if uses_megatron_schedule(optim_config):
        return MegatronLRScheduler(optimizer, **megatron_schedule(optim_config))
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
