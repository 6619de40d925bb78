"""GPU check for parallm's verl engine (never run: no GPU was lent). Needs verl 0.9.1 in the interpreter
(`pip install "verl[verl-core]==0.9.1"` beside CUDA torch) and CUDA devices; exits 0 with a message if verl is
missing. Run: `torchrun --nproc-per-node 1 scripts/gpu_checks/verl_engine.py` (or plain python: it initialises a
1-rank group); with `--nproc-per-node 2` (or more) the engine runs at dp = ranks, which also exercises verl's
``batch_num_tokens`` all-reduce on the NCCL data-parallel group (a CPU tensor there raised before); `--cpu`: a dry
run of the same code on verl's CPU platform (gloo; the offload and memory checks are skipped there: the engine
never offloads a model that lives in host memory; tests/test_verl.py checks that logic on CPU with the device faked).

Checks, on CUDA: verl's EngineRegistry builds parallm's engine for device "cuda"; a PPO step through verl's
``ppo_loss`` runs (verl's CPU micro-batch moved to the outputs' device: before, "Expected all tensors to be on
the same device"); with param_offload and optimizer_offload on, verl's mode switches (train_mode / eval_mode)
offload the model and the AdamW state through parallm.offload (torch.cuda.memory_allocated AND memory_reserved
fall by at least the parameter bytes outside the modes: offload ends with empty_cache) and bring them back
(parallm.onload), and a second offload reuses the pinned host copies of the first; the log-probs and the weights
after one PPO step equal a run without offload bit for bit. The weight syncs with the model offloaded between
them: every tensor of get_per_tensor_param held to the end equals a save_hf_weights taken before (copy=True), the
parameters are offloaded again after each export, and the delta sync (a seed cast to bf16 as verl's seed casts
it, verl's prime_delta_snapshots, a PPO step, get_per_tensor_param_delta_shard's pairs) patches the seed into a
copy bit-equal to a fresh export cast to bf16, with exactly the changed elements shipped.
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import Checks, start  # noqa: E402

CPU = "--cpu" in sys.argv
try:
    import verl  # noqa: F401
except ImportError:
    print("verl not installed: verl GPU check skipped")
    sys.exit(0)
os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "parallm.integrations.verl")
if CPU:
    os.environ.setdefault("VERL_PLATFORM", "cpu")
import parallm.integrations.verl  # noqa: E402,F401
import torch.distributed as dist  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import parallm  # noqa: E402
from parallm.integrations.verl import toy  # noqa: E402

world, rank, device = start(CPU, 29591)
assert CPU or torch.cuda.is_available(), "needs a CUDA device (or --cpu)"
if not dist.is_initialized():
    dist.init_process_group("gloo" if CPU else "nccl")
checks = Checks(rank)
path = toy.write_checkpoint(tempfile.mkdtemp(prefix="parallm_verl_gpu_"))
actor_cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                        entropy_coeff=0.01, loss_agg_mode="token-mean")


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 60, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, 7:] = 0
    td = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                     "prompts": ids[:, :5].clone(), "responses": ids[:, 5:].clone(),
                     "response_mask": mask[:, 5:].clone(), "old_log_probs": torch.full((4, 4), -2.0),
                     "advantages": torch.randn(4, 4, generator=g)}, batch_size=[4])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, calculate_entropy=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, global_batch_size=4)
    return td


def engine(offload):
    """parallm's engine built by verl's EngineRegistry for this device, with verl's offload flags ``offload``."""
    eng = FSDPEngineConfig(strategy="fsdp", use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                           infer_micro_batch_size_per_gpu=2, param_offload=offload, optimizer_offload=offload)
    object.__setattr__(eng, "strategy", "parallm")
    e = EngineRegistry.new(model_type="language_model", backend="parallm",
                           model_config=HFModelConfig(path=path, use_remove_padding=False,
                                                      override_config={"attn_implementation": "sdpa"}),
                           engine_config=eng, optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=2),
                           checkpoint_config=CheckpointConfig())
    e.initialize()
    return e


def ppo_step(e):
    with e.train_mode():
        e.train_batch(batch(), loss_function=lambda model_output, data, dp_group=None:
                      ppo_loss(actor_cfg, model_output, data, dp_group))


def run(offload):
    e = engine(offload)
    assert e.device_type == device.type, e.device_type
    cuda = device.type == "cuda"
    mem = (lambda: (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())) if cuda else (lambda: (0, 0))
    outside = []
    with e.eval_mode():
        lp = e.infer_batch(batch())["model_output"]["log_probs"]
    outside.append(mem())
    from parallm.train.offload import _held
    hosts = [h for _, h in _held(e.chunks)["params"]]
    ppo_step(e)
    outside.append(mem())
    again = [h for _, h in _held(e.chunks)["params"]]
    reused = len(hosts) == len(again) > 0 and all(a is b for a, b in zip(hosts, again)) \
        and all(h.is_pinned() == cuda for h in again)
    e.to(device.type, model=True, optimizer=True, grad=True)
    inside = mem()
    weights = {k: v.clone() for k, v in parallm.export_hf_tensors(e.chunks)}
    pbytes = sum(p.numel() * p.element_size() for c in e.chunks for p in c.parameters())
    parallm.destroy_parallel()
    return [t.cpu() for t in lp.unbind()], weights, outside, inside, pbytes, reused


def delta(offload):
    """The weight syncs on this device, the model offloaded between syncs when ``offload``."""
    e = engine(offload)
    with e._resident():
        reference = parallm.save_hf_weights(e.chunks)       # {name: cpu tensor} on rank 0

    def param_bytes():
        return sum(p.untyped_storage().nbytes() for c in e.chunks for p in c.parameters())

    held = list(e.get_per_tensor_param()[0])               # every tensor kept to the end, as verl's seed keeps them
    held_ok = rank != 0 or all(torch.equal(t.cpu(), reference[k]) for k, t in held) and len(held) == len(reference)
    after = [param_bytes()]
    seed = {k: t.detach().to(torch.bfloat16).cpu() for k, t in held}
    del held
    e.prime_delta_snapshots()
    after.append(param_bytes())
    ppo_step(e)
    patched = {k: v.clone() for k, v in seed.items()}
    shipped = 0
    entries, _ = e.get_per_tensor_param_delta_shard()
    for slots, _dtype, counts, idx, val, _pg in entries:   # dp only: rank 0 contributes every element (group None)
        off = 0
        for (name, _shape), c in zip(slots, counts.tolist()):
            if rank == 0:
                patched[name].view(-1)[idx[off:off + c].long().cpu()] = val[off:off + c].cpu()
            off += c
            shipped += c
    after.append(param_bytes())
    now = {k: v.detach().to(torch.bfloat16).cpu() for k, v in e.get_per_tensor_param()[0]}
    changed = sum(int((seed[k].view(-1).view(torch.int16) != now[k].view(-1).view(torch.int16)).sum()) for k in now)
    equal = rank != 0 or all(torch.equal(patched[k], now[k]) for k in now)
    parallm.destroy_parallel()
    return held_ok, after, equal, shipped, changed


lp0, w0, _, _, _, _ = run(False)
lp1, w1, outside, inside, pbytes, reused = run(True)
same_lp = all(torch.equal(a, b) for a, b in zip(lp0, lp1))
same_w = all(torch.equal(w0[k], w1[k]) for k in w0)
checks("offloaded log-probs bit-equal (a PPO step ran on this device)", same_lp, True, ok=same_lp)
checks("offloaded weights bit-equal", same_w, True, ok=same_w)
if device.type == "cuda":       # a CPU model is never offloaded (nowhere to go): these are CUDA-only
    checks("the second offload reuses the first's pinned host copies", reused, True, ok=reused)
    checks("allocated bytes freed outside the modes >= parameter bytes", inside[0] - max(o[0] for o in outside),
           pbytes, ok=all(inside[0] - o[0] >= pbytes for o in outside))
    checks("reserved bytes freed outside the modes >= parameter bytes (empty_cache)",
           inside[1] - max(o[1] for o in outside), pbytes, ok=all(inside[1] - o[1] >= pbytes for o in outside))
for offload in (False, True):
    held_ok, after, equal, shipped, changed = delta(offload)
    checks(f"full export held to the end equals save_hf_weights (offload={offload})", held_ok, True, ok=held_ok)
    if offload and device.type == "cuda":
        checks("parameters offloaded again after each export (bytes after full, prime, delta)", after, [0, 0, 0],
               ok=after == [0, 0, 0])
    checks(f"delta sync at bf16 (offload={offload}): patched copy bit-equal, shipped = changed", (shipped, changed),
           "equal", ok=equal and (rank != 0 or shipped == changed > 0))
sys.exit(checks.finish("verl engine"))
