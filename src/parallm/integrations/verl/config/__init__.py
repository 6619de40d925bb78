"""parallm's config groups for verl 0.9.1's Hydra config tree, and the dataclasses they instantiate (docs/verl.md,
"verl's config selects parallm").

The YAML files beside this module are config groups in verl's layout (``engine/``, ``optim/``, ``actor/``,
``ref/``, ``critic/``, ``model_engine/``), named ``parallm``: with them on Hydra's search path,
``model_engine=parallm`` in verl's PPO trainer and ``engine=parallm optim=parallm`` in verl's SFT trainer select
this engine, sized by verl's own keys (``engine.tensor_model_parallel_size=2`` ...). They reach the search path
through parallm's Hydra search-path plugin (``hydra_plugins/parallm_verl.py``, found by Hydra when parallm is
installed) or ``hydra.searchpath=[pkg://parallm.integrations.verl.config]``.

verl turns each block into a dataclass by its ``_target_`` (``omega_conf_to_dataclass``), and verl's dataclasses
refuse keys they do not declare; hence parallm's own: :class:`ParallmEngineConfig` (verl's ``EngineConfig`` plus
parallm's layout and model options, under Megatron's names where verl has them), :class:`ParallmActorConfig`
(actor and reference policy: verl's ``ActorConfig`` whose engine is the ``parallm`` block),
:class:`ParallmCriticConfig` and :class:`ParallmOptimizerConfig` (verl's FSDP optimizer keys plus its Megatron
LR-schedule keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config import ActorConfig, CriticConfig, EngineConfig, FSDPOptimizerConfig

# parallm.model.recompute.RECOMPUTE (not imported: verl reads this config before any model code is loaded;
# tests/test_verl_config.py checks the two agree)
RECOMPUTE = (None, "full", "moe", "selective")

__all__ = ["ParallmEngineConfig", "ParallmActorConfig", "ParallmCriticConfig", "ParallmOptimizerConfig",
           "LAYOUT_KEYS"]

# verl's key (Megatron's name where verl's Megatron engine has one) -> parallm's option (engine's parallm_options)
LAYOUT_KEYS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
               "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
               "expert_model_parallel_size": "ep", "dtype": "dtype", "recompute": "recompute", "packed": "packed",
               "attn_impl": "attn_impl"}
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass
class ParallmEngineConfig(EngineConfig):
    """verl's ``EngineConfig`` (offload flags, ``forward_only``, ``seed``, ``router_replay``, the micro-batch
    fields verl's workers fill in) plus parallm's layout and model options:

    * ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``virtual_pipeline_model_parallel_size``
      (null: no interleaving), ``context_parallel_size``, ``expert_model_parallel_size``: parallm's tp, pp, vpp,
      cp, ep over verl's training ranks; the data-parallel size is what is left (ranks / (tp cp pp)).
    * ``dtype``: the parameters' dtype, ``float32`` (default) or ``bfloat16`` (fp32 gradients and master weights);
      ``fp32`` / ``bf16`` are accepted as verl spells them elsewhere. float16 is refused (parallm does no loss
      scaling).
    * ``recompute`` (null, ``"full"``, ``"moe"`` or ``"selective"``: :data:`RECOMPUTE`), ``packed`` (remove padding inside the model), ``attn_impl``: as
      ``parallm.build_model`` takes them.

    Values are checked here, when verl builds the config, so a bad one fails before any process group exists."""

    strategy: str = "parallm"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    dtype: str = "float32"
    recompute: Optional[str] = None
    packed: bool = False
    attn_impl: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "parallm":
            raise ValueError(f"ParallmEngineConfig: strategy must be 'parallm', got {self.strategy!r} (parallm's "
                             "engine config group builds parallm's engine only)")
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallm engine config: {key} must be an integer >= 1, got {value!r}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1):
            raise ValueError(f"parallm engine config: virtual_pipeline_model_parallel_size must be null or an "
                             f"integer >= 1, got {vpp!r}")
        if str(self.dtype) not in _DTYPES:
            raise ValueError(f"parallm engine config: dtype {self.dtype!r}; parallm trains in float32 or bfloat16 "
                             f"(known spellings: {sorted(_DTYPES)})")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"parallm engine config: recompute must be one of {RECOMPUTE} (null: none), got "
                             f"{self.recompute!r}")

    def parallm_options(self) -> dict:
        """These settings as the engine's option block (``tp``, ``pp``, ``vpp``, ``cp``, ``ep``, ``dtype``,
        ``recompute``, ``packed``, ``attn_impl``), ``dtype`` in parallm's spelling."""
        out = {opt: getattr(self, key) for key, opt in LAYOUT_KEYS.items()}
        out["dtype"] = _DTYPES[str(self.dtype)]
        return out


@dataclass
class ParallmActorConfig(ActorConfig):
    """verl's ``ActorConfig`` for ``strategy: parallm``: the engine block is ``parallm`` (a
    :class:`ParallmEngineConfig`), as ``megatron`` is for verl's Megatron actor. The reference policy uses it
    too, with ``parallm.forward_only`` set (``ref/parallm_ref.yaml``)."""

    strategy: str = "parallm"
    parallm: ParallmEngineConfig = field(default_factory=ParallmEngineConfig)
    use_remove_padding: bool = False
    use_rollout_log_probs: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "parallm":
            raise ValueError(f"ParallmActorConfig: strategy must be 'parallm', got {self.strategy!r} (with "
                             "model_engine=parallm the actor and reference policy are parallm's engine)")
        self.engine = self.parallm


@dataclass
class ParallmCriticConfig(CriticConfig):
    """verl's ``CriticConfig`` for ``strategy: parallm`` (the engine block is ``parallm``)."""

    strategy: str = "parallm"
    parallm: ParallmEngineConfig = field(default_factory=ParallmEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "parallm":
            raise ValueError(f"ParallmCriticConfig: strategy must be 'parallm', got {self.strategy!r} (with "
                             "model_engine=parallm the critic is parallm's engine)")
        self.engine = self.parallm


@dataclass
class ParallmOptimizerConfig(FSDPOptimizerConfig):
    """``optim=parallm``: verl's ``FSDPOptimizerConfig`` (every FSDP key, same defaults) plus the LR-schedule keys
    of verl's ``McoreOptimizerConfig`` (``optim/megatron.yaml``), so a command line written for ``optim=megatron``
    composes too. The Megatron keys default to ``None`` (unset): with none set the engine builds verl's FSDP
    schedule (``lr_scheduler_type``), with any set megatron-core's ``OptimizerParamScheduler`` as verl's Megatron
    engine builds it (:func:`parallm.integrations.verl.optim.megatron_schedule`), the unset ones taking
    ``optim/megatron.yaml``'s defaults. Checked here, when verl builds the config: values parallm cannot honour
    and FSDP schedule keys that contradict the Megatron ones are refused naming the key (the checks that need
    ``total_training_steps`` run when the engine builds the schedule)."""

    lr_warmup_init: Optional[float] = None
    lr_decay_steps: Optional[int] = None
    lr_decay_style: Optional[str] = None
    min_lr: Optional[float] = None
    weight_decay_incr_style: Optional[str] = None
    lr_wsd_decay_style: Optional[str] = None
    lr_wsd_decay_steps: Optional[int] = None
    use_checkpoint_opt_param_scheduler: Optional[bool] = None
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"

    def __post_init__(self):
        super().__post_init__()
        from ..optim import check_optimizer_config
        check_optimizer_config(self)
