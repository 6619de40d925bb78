"""parallm's config groups in verl 0.9.1's Hydra config tree (docs/verl.md, "verl's config selects parallm").

Runs in .venv-verl (``scripts/test.sh`` runs it there with ``PARALLM_REQUIRE_VERL=1``); elsewhere it skips.

* ``test_config_groups``: Hydra composes verl's own primary configs (``ppo_trainer`` with ``model_engine=parallm``,
  ``sft_trainer_engine`` with ``engine=parallm optim=parallm``) with nothing but verl's overrides on the command
  line (parallm's Hydra plugin puts the groups on the search path), and verl's ``omega_conf_to_dataclass`` turns
  them into parallm's dataclasses: the actor, the reference policy (``forward_only``, the actor's layout) and the
  critic (the actor's layout) carry the layout verl's keys gave, the engine's options are those keys; ``optim=
  parallm`` is verl's FSDP optimizer config, field for field, plus verl's Megatron schedule keys (unset); bad
  values are refused when verl builds the config.
* ``test_optim_megatron_keys``: ``engine=parallm optim=parallm`` with verl's Megatron optimizer keys on the command
  line (``optim.lr_decay_style=cosine optim.lr_warmup_init=... optim.min_lr=...``): every step's LR and weight
  decay of parallm's AdamW over the toy model equal verl's Megatron engine's schedule (verl's
  ``get_megatron_optimizer_param_scheduler``, megatron-core's ``OptimizerParamScheduler``, on a plain torch AdamW,
  from ``optim=megatron`` with the same keys) for 8 cases over every decay style; keys that cannot be honoured
  are refused naming them.
* ``test_search_path_plugin``: without the plugin ``engine=parallm`` is unknown and
  ``hydra.searchpath=[pkg://parallm.integrations.verl.config]`` is the documented fallback; the plugin leaves
  other Hydra apps' search paths alone.
* ``test_options_precedence``: ``parallm_options``: verl's config when the engine config is parallm's,
  ``PARALLM_VERL_CONFIG`` over it key by key with a warning naming both values, the variable alone with verl's
  FSDP config (``strategy=parallm``).
* ``test_ppo_trainer_model_engine``: verl's PPO trainer (``examples/verl/grpo_fsdp2_cpu.sh`` with
  ``MODEL_ENGINE=parallm ADV=gae``, KL loss on so the reference policy is built) with the layout from verl's config
  (``actor_rollout_ref.actor.parallm.tensor_model_parallel_size=2``, no ``PARALLM_VERL_CONFIG``): actor, reference
  and critic are parallm's engines at tp2, 2 steps, and after each weight sync the rollout's probabilities equal
  the trainer's (fp32 both sides).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys

import pytest

if os.environ.get("PARALLM_REQUIRE_VERL") != "1":
    pytest.importorskip("verl", reason="verl is not installed here (bash scripts/setup_verl.sh creates .venv-verl; "
                                       "scripts/test.sh runs this file there)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compose(name, overrides):
    from hydra import compose, initialize_config_module
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def _ref_dataclass(cfg):
    """The reference policy's dataclass as verl's ``ActorRolloutRefWorker.init_model`` builds it (its
    ``log_prob_*`` keys renamed to the actor's first)."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    ref = cfg.actor_rollout_ref.ref.copy()
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


@pytest.mark.timeout(300)
def test_config_groups(tmp_path, monkeypatch):
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPOptimizerConfig

    from parallm.integrations.verl import toy
    from parallm.integrations.verl.config import (ParallmActorConfig, ParallmCriticConfig, ParallmEngineConfig,
                                                  ParallmOptimizerConfig)
    from parallm.integrations.verl.optim import MEGATRON_SCHEDULE_DEFAULTS
    from parallm.integrations.verl.options import parallm_options
    monkeypatch.delenv("PARALLM_VERL_CONFIG", raising=False)
    model = toy.write_checkpoint(str(tmp_path / "model"))
    a = "actor_rollout_ref.actor.parallm."
    cfg = _compose("ppo_trainer", ["model_engine=parallm", a + "tensor_model_parallel_size=2",
                                   a + "pipeline_model_parallel_size=2", a + "virtual_pipeline_model_parallel_size=2",
                                   a + "dtype=bf16", a + "packed=true", "actor_rollout_ref.rollout.n=2",
                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
                                   "critic.ppo_micro_batch_size_per_gpu=2", f"critic.model.path={model}"])
    assert cfg.model_engine == "parallm" and cfg.actor_rollout_ref.actor.strategy == "parallm"
    want = {"tp": 2, "pp": 2, "vpp": 2, "cp": 1, "ep": 1, "dtype": "bfloat16", "recompute": None, "packed": True,
            "attn_impl": "auto"}
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor) is ParallmActorConfig and type(actor.engine) is ParallmEngineConfig
    assert actor.engine.strategy == "parallm" and not actor.engine.forward_only
    assert parallm_options(actor.engine) == want, parallm_options(actor.engine)
    ref = _ref_dataclass(cfg)
    assert type(ref) is ParallmActorConfig and ref.engine.forward_only
    assert parallm_options(ref.engine) == want        # the reference policy runs in the actor's processes
    critic = omega_conf_to_dataclass(cfg.critic)
    assert type(critic) is ParallmCriticConfig and not critic.engine.forward_only
    assert {k: v for k, v in parallm_options(critic.engine).items() if k != "packed"} == \
        {k: v for k, v in want.items() if k != "packed"}
    assert type(omega_conf_to_dataclass(cfg.critic.optim)) is ParallmOptimizerConfig
    assert isinstance(omega_conf_to_dataclass(cfg.critic.optim), FSDPOptimizerConfig)

    # verl's SFT trainer: engine=parallm optim=parallm; optim=parallm is verl's FSDP optimizer config, field for
    # field, plus verl's Megatron LR-schedule keys (unset) and the precision-aware keys at Megatron's defaults
    sft = _compose("sft_trainer_engine", ["engine=parallm", "optim=parallm", "engine.context_parallel_size=2",
                                          "engine.expert_model_parallel_size=2", "engine.recompute=full"])
    engine = omega_conf_to_dataclass(sft.engine)
    assert type(engine) is ParallmEngineConfig
    assert parallm_options(engine) == {**want, "tp": 1, "pp": 1, "vpp": None, "cp": 2, "ep": 2,
                                       "dtype": "float32", "recompute": "full", "packed": False}
    fsdp_optim = OmegaConf.to_container(_compose("sft_trainer_engine", ["optim=fsdp"]).optim)
    ours = OmegaConf.to_container(sft.optim)
    assert ours.pop("_target_") == "parallm.integrations.verl.config.ParallmOptimizerConfig"
    assert {k: ours.pop(k) for k in list(fsdp_optim) if k != "_target_"} == \
        {k: v for k, v in fsdp_optim.items() if k != "_target_"}
    assert ours == {**{k: None for k in MEGATRON_SCHEDULE_DEFAULTS}, "use_precision_aware_optimizer": False,
                    "main_grads_dtype": "fp32", "exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32"}, ours

    # refused when verl builds the config, naming the key
    for override, words in [("engine.dtype=float16", "dtype"), ("engine.tensor_model_parallel_size=0",
                                                                "tensor_model_parallel_size"),
                            ("engine.recompute=partial", "recompute"), ("engine.strategy=fsdp2", "strategy")]:
        bad = _compose("sft_trainer_engine", ["engine=parallm", "optim=parallm", override])
        with pytest.raises(Exception, match=words):
            omega_conf_to_dataclass(bad.engine)
    # every recompute option of build_model is accepted (the config's list is build_model's)
    from parallm.integrations.verl.config import RECOMPUTE
    from parallm.model.recompute import RECOMPUTE as BUILD_RECOMPUTE
    assert RECOMPUTE == BUILD_RECOMPUTE
    for value in ("moe", "selective"):
        good = _compose("sft_trainer_engine", ["engine=parallm", "optim=parallm", f"engine.recompute={value}"])
        assert omega_conf_to_dataclass(good.engine).parallm_options()["recompute"] == value
    bad = _compose("ppo_trainer", ["model_engine=parallm", "actor_rollout_ref.actor.strategy=fsdp2",
                                   "actor_rollout_ref.rollout.n=2",
                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    with pytest.raises(Exception, match="strategy must be 'parallm'"):
        omega_conf_to_dataclass(bad.actor_rollout_ref.actor)
    with pytest.raises(HydraException):        # not a key of parallm's engine block
        _compose("sft_trainer_engine", ["engine=parallm", "engine.sequence_parallel=true"])


@pytest.mark.timeout(120)
def test_search_path_plugin(monkeypatch):
    """Without the plugin the group is unknown; ``hydra.searchpath`` is the fallback; other apps are left alone."""
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.errors import HydraException
    from verl.utils.config import omega_conf_to_dataclass

    from parallm.integrations.verl.options import parallm_options
    from hydra_plugins.parallm_verl import ParallmVerlSearchPathPlugin
    other = ConfigSearchPathImpl()
    other.append("hydra", "pkg://hydra.conf")
    other.append("main", "file:///srv/app/conf")
    ParallmVerlSearchPathPlugin().manipulate_search_path(other)
    assert [e.path for e in other.get_path()] == ["pkg://hydra.conf", "file:///srv/app/conf"]
    monkeypatch.setattr(ParallmVerlSearchPathPlugin, "manipulate_search_path", lambda self, search_path: None)
    with pytest.raises(HydraException, match="parallm"):
        _compose("sft_trainer_engine", ["engine=parallm", "optim=parallm"])
    fallback = _compose("sft_trainer_engine", ["engine=parallm", "optim=parallm", "engine.tensor_model_parallel_size=2",
                                               "hydra.searchpath=[pkg://parallm.integrations.verl.config]"])
    assert parallm_options(omega_conf_to_dataclass(fallback.engine))["tp"] == 2


@pytest.mark.timeout(120)
def test_options_precedence(monkeypatch, caplog):
    from verl.workers.config import FSDPEngineConfig

    from parallm.integrations.verl.config import ParallmEngineConfig
    from parallm.integrations.verl.options import parallm_options
    cfg = ParallmEngineConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, dtype="bf16")
    monkeypatch.delenv("PARALLM_VERL_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger="parallm"):
        got = parallm_options(cfg)
    assert (got["tp"], got["ep"], got["dtype"], got["pp"]) == (2, 2, "bfloat16", 1) and not caplog.records
    # the variable wins key by key, with a warning for each value that differs from verl's config
    monkeypatch.setenv("PARALLM_VERL_CONFIG", '{"tp": 1, "ep": 2, "packed": true}')
    with caplog.at_level(logging.WARNING, logger="parallm"):
        got = parallm_options(cfg)
    assert (got["tp"], got["ep"], got["packed"], got["dtype"]) == (1, 2, True, "bfloat16")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert any("tp=1" in m and "tensor_model_parallel_size=2" in m for m in messages), messages
    assert any("packed=True" in m and "packed=False" in m for m in messages), messages
    # verl's FSDP engine config (strategy=parallm): the variable alone
    fsdp = FSDPEngineConfig(strategy="fsdp")
    object.__setattr__(fsdp, "strategy", "parallm")
    monkeypatch.setenv("PARALLM_VERL_CONFIG", '{"pp": 2}')
    assert parallm_options(fsdp)["pp"] == 2 and parallm_options(fsdp)["tp"] == 1
    monkeypatch.setenv("PARALLM_VERL_CONFIG", '{"tensor_model_parallel_size": 2}')
    with pytest.raises(ValueError, match="unknown key"):
        parallm_options(cfg)


# verl's Megatron LR-schedule keys on optim=parallm's command line, one case per decay style; each is also given to
# optim=megatron (the reference), with megatron-core's spelling where verl's differs
MEGATRON_CASES = {
    "constant": ["optim.lr_decay_style=constant", "optim.lr_warmup_steps=3", "optim.lr_warmup_init=1e-5"],
    "linear": ["optim.lr_decay_style=linear", "optim.min_lr=1e-5", "optim.lr_warmup_steps_ratio=0.3",
               "optim.lr_decay_steps=8"],
    "cosine": ["optim.lr_decay_style=cosine", "optim.lr_warmup_steps=2", "optim.lr_warmup_init=1e-4",
               "optim.min_lr=1e-5", "optim.weight_decay_incr_style=cosine", "optim.weight_decay=0.05"],
    "inverse_square_root": ["optim.lr_decay_style=inverse_square_root", "optim.lr_warmup_steps=2",
                            "optim.min_lr=2e-4"],
    "wsd_cosine": ["optim.lr_decay_style=WSD", "optim.lr_wsd_decay_steps=4", "optim.lr_wsd_decay_style=cosine",
                   "optim.min_lr=1e-5", "optim.lr_warmup_steps=1", "optim.lr_warmup_init=1e-4"],
    "wsd_exponential": ["optim.lr_decay_style=WSD", "optim.lr_wsd_decay_steps=3", "optim.lr_decay_steps=9"],
    "style_unset": ["optim.min_lr=1e-4", "optim.lr_warmup_steps=2", "optim.lr_warmup_init=2e-4"],
    "wsd_minus_sqrt": ["optim.lr_decay_style=WSD", "optim.lr_wsd_decay_steps=5", "optim.lr_wsd_decay_style=minus_sqrt",
                       "optim.min_lr=1e-4", "optim.use_checkpoint_opt_param_scheduler=true"],
}
TOTAL_STEPS = 10


def _lrs(optimizer, scheduler, steps):
    """Each step's (lr, weight_decay) of every param group, from the scheduler's start, stepping by 1 as verl's
    engines' ``lr_scheduler_step`` does; past the last step too."""
    out = []
    for _ in range(steps):
        out.append([(g["lr"], g["weight_decay"]) for g in optimizer.param_groups])
        scheduler.step(1)
    return out


@pytest.mark.timeout(300)
def test_optim_megatron_keys(tmp_path, monkeypatch):
    """``engine=parallm optim=parallm`` with verl's Megatron optimizer keys on the command line: the LR (and weight
    decay) of every step, on parallm's own optimizer over a toy model, equals verl's Megatron engine's schedule
    (verl's ``get_megatron_optimizer_param_scheduler``: megatron-core's ``OptimizerParamScheduler`` on a plain
    ``torch.optim.AdamW``) built from ``optim=megatron`` with the same keys, for every decay style; the cosine case
    also against the formula; the biases / norm weights keep weight decay 0 (Megatron's rule); the scheduler's
    state survives the JSON checkpoint round trip; without Megatron keys the schedule is still verl's FSDP one;
    values that cannot be honoured are refused naming the key."""
    import json
    import math

    import torch
    from hydra.errors import HydraException
    from torch.optim.lr_scheduler import LambdaLR
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler
    from verl.workers.config import McoreOptimizerConfig

    import parallm
    from parallm.integrations.verl import toy
    from parallm.integrations.verl.config import ParallmOptimizerConfig
    from parallm.integrations.verl.optim import MegatronLRScheduler, build_lr_scheduler, build_optimizer
    monkeypatch.delenv("PARALLM_VERL_CONFIG", raising=False)

    def ours(overrides, total=TOTAL_STEPS):
        cfg = omega_conf_to_dataclass(_compose("sft_trainer_engine", ["engine=parallm", "optim=parallm",
                                                                      *overrides]).optim)
        assert type(cfg) is ParallmOptimizerConfig
        cfg.total_training_steps = total            # as verl's SFT trainer sets it
        return cfg

    def reference(overrides, total=TOTAL_STEPS):
        overrides = [o.replace("inverse_square_root", "inverse-square-root") for o in overrides]
        cfg = omega_conf_to_dataclass(_compose("sft_trainer_engine", ["optim=megatron", *overrides]).optim)
        assert type(cfg) is McoreOptimizerConfig
        cfg.total_training_steps = total
        return cfg

    model = toy.write_checkpoint(str(tmp_path / "model"))
    with socket.socket() as sock:        # one rank, this process
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    parallm.init_parallel(tp=1)
    try:
        chunks = parallm.build_model(model, init="random")
        for name, keys in MEGATRON_CASES.items():
            cfg = ours(keys)
            optimizer = build_optimizer(chunks, cfg)
            scheduler = build_lr_scheduler(optimizer, cfg)
            assert isinstance(scheduler, MegatronLRScheduler), name
            assert [g["name"] for g in optimizer.param_groups] == ["decay", "no_decay"]
            assert optimizer.param_groups[1]["params"], "the toy model has biases / norm weights"
            got = _lrs(optimizer, scheduler, TOTAL_STEPS + 3)
            ref_cfg = reference(keys)
            plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.123)
            want = _lrs(plain, get_megatron_optimizer_param_scheduler(plain, ref_cfg), TOTAL_STEPS + 3)
            for step, (groups, ((lr, wd),)) in enumerate(zip(got, want)):
                assert groups == [(lr, wd), (lr, 0.0)], (name, step, groups, (lr, wd))
            lrs = [lr for ((lr, _),) in want]
            assert len(set(lrs)) > 1, (name, lrs)   # every case's schedule moves
            print(name, ["%.3g" % x for x in lrs])
            # verl's McoreOptimizerConfig itself (a config that carries the Megatron kind) gives the same
            plain2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.5)
            assert [lr for ((lr, _),) in _lrs(plain2, build_lr_scheduler(plain2, ref_cfg), TOTAL_STEPS + 3)] == lrs
            # the checkpoint's JSON round trip: a fresh scheduler resumed after 4 steps continues the same
            plain3 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.5)
            first = build_lr_scheduler(plain3, cfg)
            first.step(4)
            state = json.loads(json.dumps(first.state_dict()))
            plain4 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.5)
            resumed = build_lr_scheduler(plain4, cfg)
            resumed.load_state_dict(state)
            assert [lr for ((lr, _),) in _lrs(plain4, resumed, 5)] == lrs[4:9], name
        # the cosine case by the formula: warm-up from lr_warmup_init to lr over 2 steps, cosine to min_lr at 10
        lr, init, low, w = 1e-3, 1e-4, 1e-5, 2
        formula = [init + (lr - init) * n / w if n <= w else
                   low + 0.5 * (1 + math.cos(math.pi * (n - w) / (TOTAL_STEPS - w))) * (lr - low)
                   if n <= TOTAL_STEPS else low for n in range(TOTAL_STEPS + 3)]
        plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.5)
        got = [lr for ((lr, _),) in _lrs(plain, build_lr_scheduler(plain, ours(MEGATRON_CASES["cosine"])),
                                         TOTAL_STEPS + 3)]
        assert got == pytest.approx(formula, rel=1e-12, abs=0.0), (got, formula)
        # no Megatron key: verl's FSDP schedule (LambdaLR) and every parameter decayed, as before
        cfg = ours(["optim.lr_scheduler_type=cosine", "optim.lr_warmup_steps=2"])
        optimizer = build_optimizer(chunks, cfg)
        assert type(build_lr_scheduler(optimizer, cfg)) is LambdaLR
        assert not optimizer.param_groups[1]["params"] and "wd_mult" not in optimizer.param_groups[0]
        # Megatron's override_optimizer_config names for Adam's eps / betas; other keys refused naming them
        cfg = ours(["optim.lr_decay_style=linear",
                    "optim.override_optimizer_config={adam_eps: 1e-6, adam_beta2: 0.95}"])
        group = build_optimizer(chunks, cfg).param_groups[0]
        assert (group["eps"], group["betas"]) == (1e-6, (0.9, 0.95)), group
        with pytest.raises(NotImplementedError, match="optimizer_cpu_offload"):
            build_optimizer(chunks, ours(["optim.lr_decay_style=linear",
                                          "optim.override_optimizer_config={optimizer_cpu_offload: true}"]))
    finally:
        parallm.destroy_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # refused, naming the key: when verl builds the config ...
    for keys, words in [
            (["optim.lr_decay_style=exponential"], "lr_decay_style"),
            (["optim.lr_decay_style=cosine", "optim.lr_scheduler_type=cosine"], "optim.lr_scheduler_type"),
            (["optim.min_lr=1e-5", "optim.min_lr_ratio=0.1"], "optim.min_lr_ratio"),
            (["optim.lr_decay_style=linear", "optim.num_cycles=1.0"], "optim.num_cycles"),
            (["optim.lr_decay_style=linear", "optim.zero_indexed_step=false"], "optim.zero_indexed_step"),
            (["optim.lr_decay_style=WSD"], "lr_wsd_decay_steps"),
            (["optim.lr_decay_style=WSD", "optim.lr_wsd_decay_steps=2", "optim.lr_wsd_decay_style=constant"],
             "lr_wsd_decay_style"),
            (["optim.weight_decay_incr_style=exponential"], "weight_decay_incr_style"),
            (["optim.min_lr=0.5"], "min_lr"),
            (["optim.lr_warmup_init=0.5"], "lr_warmup_init"),
            (["optim.use_precision_aware_optimizer=true"], "use_precision_aware_optimizer"),
            (["optim.exp_avg_dtype=bf16"], "exp_avg_dtype"),
            (["optim.optimizer=sgd"], "optim.optimizer"),
            (["optim.optimizer=Adam"], "optim.optimizer")]:
        with pytest.raises(Exception, match=words):    # hydra wraps it, the message kept
            ours(keys)
    # ... when the engine builds the schedule (total_training_steps known then) ...
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.5)
    with pytest.raises(ValueError, match="optim.lr_warmup_steps"):
        build_lr_scheduler(plain, ours(["optim.lr_decay_style=linear", "optim.lr_warmup_steps=10"]))
    with pytest.raises(ValueError, match="optim.lr_decay_steps"):
        build_lr_scheduler(plain, ours(["optim.lr_decay_style=linear"], total=-1))
    # ... and Hydra's own refusal, naming the key, for optim/megatron.yaml's Muon keys (not in optim=parallm)
    with pytest.raises(HydraException, match="muon_momentum"):
        _compose("sft_trainer_engine", ["engine=parallm", "optim=parallm", "optim.muon_momentum=0.9"])
    # Megatron's optimizer=adam (AdamW) composes
    assert ours(["optim.optimizer=adam", "optim.lr_decay_style=linear"]).optimizer == "adam"


@pytest.mark.timeout(900)
def test_ppo_trainer_model_engine(tmp_path):
    work = tmp_path / "work"
    shm = "/dev/shm"
    before = set(os.listdir(shm)) if os.path.isdir(shm) else set()
    env = {k: v for k, v in os.environ.items() if k != "PARALLM_VERL_CONFIG"}
    try:
        r = subprocess.run(["bash", os.path.join(ROOT, "examples/verl/grpo_fsdp2_cpu.sh"), str(work),
                            "actor_rollout_ref.actor.parallm.tensor_model_parallel_size=2",
                            "actor_rollout_ref.actor.use_kl_loss=True"],
                           env=dict(env, PYTHON=sys.executable, MODEL_ENGINE="parallm", ADV="gae", STEPS="2"),
                           capture_output=True, text=True, timeout=840, cwd=ROOT)
    finally:   # verl's weight-transfer buffers, left behind when Ray ends the workers
        for name in set(os.listdir(shm)) - before if os.path.isdir(shm) else ():
            if name.startswith("psm_"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm, name))
    log = r.stdout + r.stderr
    (tmp_path / "trainer.log").write_text(log)
    errors = "\n".join(line for line in log.splitlines() if "Error" in line)[:6000]
    assert r.returncode == 0, f"rc {r.returncode}; error lines:\n{errors}\n...\n{log[-4000:]}"
    # every engine (actor, reference, critic) says the layout verl's config gave it
    starts = re.findall(r"parallm engine: (\w+) .* at (tp=\d+ pp=\d+ vpp=\d+ cp=\d+ ep=\d+ dp=\d+), float32, "
                        r"(training|forward only)", log)
    assert {(task, mode) for task, _, mode in starts} == {("causal_lm", "training"), ("causal_lm", "forward only"),
                                                          ("value", "training")}, starts
    assert {layout for _, layout, _ in starts} == {"tp=2 pp=1 vpp=1 cp=1 ep=1 dp=1"}, starts
    print(starts)
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"step:(\d+) - .*", log)}
    assert sorted(lines) == [1, 2], (sorted(lines), log[-8000:])
    for step, line in lines.items():
        for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert re.search(re.escape(key) + r":-?[0-9]", line), (step, key, line[:2000])
        diff = float(re.search(r"training/rollout_probs_diff_max:([0-9.e+-]+)", line).group(1))
        print(f"step {step}: rollout_probs_diff_max {diff:.2e}")
        assert diff < 1e-5, (step, diff)
