"""verl's SFT trainer (``verl.trainer.sft_trainer``), unmodified and launched as verl documents it (``torchrun``),
with parallm selected and sized by verl's own config (``engine=parallm optim=parallm
engine.tensor_model_parallel_size=2``; docs/verl.md, "verl's config selects parallm"), against verl's FSDP2
engine in fp32 on the same tiny model and data.

Runs in .venv-verl (``scripts/test.sh`` runs it there with ``PARALLM_REQUIRE_VERL=1``); elsewhere it skips.

Each run is ``examples/verl/sft_cpu.sh`` (the documented command; its task: parallm's toy Qwen2, 2 layers, 128
wide, every weight seeded and non-trivial, made with transformers from a config, with a chat template whose turns
end in a newline; 32 two-turn conversations in verl's SFT parquet layout, a ``messages`` column): 2 ranks (gloo,
verl's CPU platform from parallm), global batch 8, 2 steps, AdamW lr 1e-3 (verl's FSDP optimizer defaults
otherwise: weight decay 0.01, clip 1.0, constant schedule), verl's ``sft_loss``, verl's file logger on. The
reference is ``ENGINE=fsdp2``: verl's FSDP2 engine with fp32 parameters and fp32 mixed precision. parallm runs at
dp2, tp2 and pp2 (pp2 with verl's dynamic batch size, so its micro-batches differ from the reference's fixed
ones). Step-1 and step-2 ``train/loss`` and ``train/grad_norm`` must agree within 1e-5 relative (seen: 1e-7), and
parallm's engine must report the layout verl's config asked for.

``test_sft_trainer_megatron_optim_keys``: one more parallm run, with verl's Megatron optimizer keys
(``optim.lr_decay_style=cosine`` ...; docs/verl.md, "The optimizer"): verl's logged ``train/lr`` per step is
megatron-core's ``OptimizerParamScheduler``'s.

Before the fix of ``fixes._fix_torchrun_backend_string`` no run starts: verl's ``initialize_global_process_group``
passes ``"cpu:gloo,cpu:gloo"`` to torch ("Duplicate device type cpu"); without parallm's config groups on Hydra's
search path ``engine=parallm`` is an unknown option; with the groups but without ``parallm_options`` reading the
engine config the engine runs at dp2 whatever verl's config says (the layout line fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

if os.environ.get("PARALLM_REQUIRE_VERL") != "1":
    pytest.importorskip("verl", reason="verl is not installed here (bash scripts/setup_verl.sh creates .venv-verl; "
                                       "scripts/test.sh runs this file there)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"VERL_USE_EXTERNAL_MODULES": "parallm.integrations.verl", "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}
RTOL = 1e-5
# parallm's layouts, each through verl's config: the overrides, and the engine's start-up line they must give
LAYOUTS = {
    "dp2": ([], "tp=1 pp=1 vpp=1 cp=1 ep=1 dp=2"),
    "tp2": (["engine.tensor_model_parallel_size=2"], "tp=2 pp=1 vpp=1 cp=1 ep=1 dp=1"),
    "pp2": (["engine.pipeline_model_parallel_size=2", "data.use_dynamic_bsz=True", "data.max_token_len_per_gpu=40"],
            "tp=1 pp=2 vpp=1 cp=1 ep=1 dp=1"),
}


def sft(work: str, name: str, overrides: list[str], engine: str = "parallm", env: dict | None = None):
    """``examples/verl/sft_cpu.sh work overrides`` (verl's SFT trainer under ``torchrun``, 2 ranks) with
    ``ENGINE=engine``, verl's file logger on; returns ``({step: metrics}, the run's output)``."""
    metrics_file = os.path.join(work, f"{name}.jsonl")
    t0 = time.time()
    r = subprocess.run(["bash", os.path.join(ROOT, "examples/verl/sft_cpu.sh"), work, "trainer.logger=[console,file]",
                        f"trainer.default_local_dir={work}/ckpt_{name}", *overrides],
                       env=dict(os.environ, PYTHON=sys.executable, ENGINE=engine, VERL_FILE_LOGGER_PATH=metrics_file,
                                **ENV, **(env or {})),
                       capture_output=True, text=True, timeout=420, cwd=ROOT)
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"{name}: rc {r.returncode}\n{log[-6000:]}"
    with open(metrics_file) as f:
        steps = {rec["step"]: rec["data"] for rec in map(json.loads, filter(str.strip, f))}
    print(f"{name}: {time.time() - t0:.1f} s, " + ", ".join(
        f"step {s}: loss {m['train/loss']!r} grad_norm {m['train/grad_norm']!r}" for s, m in sorted(steps.items())))
    return steps, log


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("verl_sft"))
    steps, log = sft(work, "fsdp2", [], engine="fsdp2")
    assert sorted(steps) == [1, 2], (steps, log[-4000:])
    return work, steps


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sft_trainer_parallm_matches_fsdp(reference, layout):
    work, ref = reference
    overrides, line = LAYOUTS[layout]
    steps, log = sft(work, f"parallm_{layout}", overrides)
    # the engine built what verl's config asked for (its rank 0 prints the layout on start-up)
    assert f"at {line}, float32, training" in log, log[-4000:]
    assert sorted(steps) == [1, 2], (steps, log[-4000:])
    for step in (1, 2):
        for key in ("train/loss", "train/grad_norm"):
            got, want = steps[step][key], ref[step][key]
            assert abs(got - want) <= RTOL * abs(want), (layout, step, key, got, want)


@pytest.mark.timeout(900)
def test_sft_trainer_megatron_optim_keys(reference):
    """verl's Megatron optimizer keys on the SFT trainer's command line with ``optim=parallm`` (docs/verl.md, "The
    optimizer"): cosine decay to ``min_lr`` over the trainer's total steps (``lr_decay_steps`` unset: verl's SFT
    trainer fills in ``total_training_steps``), one warm-up step from ``lr_warmup_init``. The ``train/lr`` verl
    logs after each step is megatron-core's ``OptimizerParamScheduler`` at that step count, and step 1 (before any
    update) equals the FSDP2 reference."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    work, ref = reference
    steps, log = sft(work, "parallm_megatron_optim",
                     ["optim.lr_decay_style=cosine", "optim.lr_warmup_steps=1", "optim.lr_warmup_init=1e-4",
                      "optim.min_lr=1e-5"], env={"STEPS": "3"})
    assert sorted(steps) == [1, 2, 3], (steps, log[-4000:])
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = OptimizerParamScheduler(plain, init_lr=1e-4, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=1,
                                    lr_decay_steps=3, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=3, wd_incr_style="constant")
    for step in (1, 2, 3):
        sched.step(1)
        assert steps[step]["train/lr"] == pytest.approx(plain.param_groups[0]["lr"], rel=1e-12), \
            (step, steps[step]["train/lr"], plain.param_groups[0]["lr"])
    for key in ("train/loss", "train/grad_norm"):
        assert abs(steps[1][key] - ref[1][key]) <= RTOL * abs(ref[1][key]), (key, steps[1][key], ref[1][key])
