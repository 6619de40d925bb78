"""Test helpers: thin names over :mod:`parallm.verify` (tiny seeded transformers models with non-trivial weights,
the transformers reference, local gloo ranks), plus checkpoint-writing and file utilities of the tests' own."""

from __future__ import annotations

import json
import os
import time

import torch

from parallm import verify

SPAWN_TIMEOUT_S = float(os.environ.get("PARALLM_TEST_SPAWN_TIMEOUT_S", "240"))
COLLECTIVE_TIMEOUT_S = 180   # the default process group's timeout in spawned ranks


# -- tiny HF models ------------------------------------------------------------------------------------------

randomize_ = verify.randomize_weights     # norms around 1, biases non-zero, matrices ~N(0, 0.08)
make_hf_model = verify.make_hf_model      # (config, *, task="causal_lm", seed=0): randomized, tied when configured
padded_batch = verify.padded_batch        # (vocab, *, batch=4, seq=10, seed=1): full / left / right / both padded
max_diff_real = verify.max_diff_real      # (a, b, mask): max |a - b| at real positions


def tiny_config(family: str, **overrides):
    """``verify.tiny_config`` (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 101), with MOE_DEFAULTS for the
    mixture-of-experts families."""
    return verify.tiny_config(family, **dict(MOE_DEFAULTS.get(family, {}), **overrides))


# Mixture-of-experts families: 4 experts, top-2, experts narrower than the dense MLP (Mixtral's experts are
# intermediate_size wide; Qwen-MoE's dense layers use intermediate_size, experts moe_intermediate_size).
MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}


def hub_state_dict(model, path: str) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes, read back from the files (the Hub's names: per-expert tensors for
    transformers 5's fused MoE experts)."""
    from safetensors.torch import load_file
    model.save_pretrained(path, safe_serialization=True)
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def write_config(path, config: dict) -> str:
    """A checkpoint directory holding only this config.json."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def write_ckpt(path, state: dict, config: dict) -> str:
    """A single-file safetensors checkpoint of ``state`` (any keys / shapes: for broken checkpoints)."""
    from safetensors.torch import save_file
    write_config(path, config)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def save_checkpoint(model, path: str, *, max_shard_size: str | None = None) -> str:
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def nan_fill(chunks) -> None:
    """Every parameter NaN (an integer table, DeepSeek-V4's tid2eid: -1): a load that succeeds must overwrite each
    one."""
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.fill_(float("nan") if p.is_floating_point() else -1)


def assert_same_state(got: dict, want: dict) -> None:
    """The same tensor names, and every tensor bit-exact."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict an HF checkpoint of this model holds (tied lm_head dropped as save_pretrained does)."""
    return verify.hf_state(model)


def rewrite_config_4x(path: str) -> None:
    """Turn a transformers-5 config.json into the transformers-4.x style (rope_theta / rope_scaling)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rp = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rp.pop("rope_theta", 10000.0)
    kind = rp.pop("rope_type", "default")
    rp.pop("type", None)
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def hf_logits(model, ids, mask):
    """transformers' fp32 logits with parallm's default position_ids."""
    with torch.no_grad():
        return verify.hf_output(model, ids, mask)


# -- launching gloo ranks ------------------------------------------------------------------------------------

def run_ranks(fn, world: int, *args, timeout: float = SPAWN_TIMEOUT_S):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (:func:`parallm.verify.spawn`); return the per-rank
    results (list by rank). A rank that raises, dies or hangs fails the call (``SpawnError``) with the root cause's
    traceback; a run past ``timeout`` is killed and fails."""
    return verify.spawn(fn, world, *args, timeout=timeout, collective_timeout=COLLECTIVE_TIMEOUT_S,
                        preload=("helpers",))


def run_ranks_allow_dead(fn, world: int, *args, timeout: float = SPAWN_TIMEOUT_S):
    """Like :func:`run_ranks`, for tests where a rank is meant to die (``os._exit``) and the survivors must end by
    themselves: every rank runs until it ends (or ``timeout``); never raises; returns one outcome per rank:

    ``("ok", result)``     the rank function returned
    ``("err", text)``      it raised (traceback text)
    ``("dead", exitcode)`` the process ended without a result (killed on purpose, crashed)
    ``("hang", None)``     still running at ``timeout`` (then killed; its Python stacks were printed shortly
                           before)
    """
    outcomes = verify.spawn_outcomes(fn, world, *args, timeout=timeout, collective_timeout=COLLECTIVE_TIMEOUT_S,
                                     preload=("helpers",))
    return [{"ok": ("ok", o.value), "error": ("err", o.traceback), "dead": ("dead", o.exitcode),
             "hang": ("hang", None)}[o.status] for o in outcomes]


def file_barrier(directory: str, rank: int, ranks, *, deadline: float) -> bool:
    """Wait (without torch.distributed) until every rank in ``ranks`` has called this with the same directory,
    or until ``time.monotonic() >= deadline``. Returns whether all arrived.

    Survivors of a killed peer use it to stay alive until every survivor has finished: a survivor that could
    only end because another one exited (closing its sockets) would otherwise go unnoticed.
    """
    open(os.path.join(directory, f"arrived-{rank}"), "w").close()
    while True:
        if all(os.path.exists(os.path.join(directory, f"arrived-{r}")) for r in ranks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def tree_digest(path: str) -> dict[str, str]:
    """{relative path: sha256} of every file under ``path`` (directories as ``"<dir>"``), to compare trees."""
    import hashlib
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path)] = "<dir>"
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out
