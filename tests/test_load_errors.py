"""Errors that name the culprit, raised on *every* rank (one 4-rank spawn).

A rank that fails alone leaves its peers blocked in the next collective; every error here must reach all
ranks, with a message that names the culprit: the unsupported architecture (and what is supported), the numbers
that do not divide by tp, the missing / unexpected / mis-shaped tensor (with both shapes). Checkpoint errors are
checked for a state dict and a directory, with mode="slice" and mode="broadcast" (where only rank 0 reads and
the others learn of the error from it).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from helpers import hf_state_dict, make_hf_model, padded_batch, run_ranks, save_checkpoint, tiny_config

WORLD = 4
MODES = ("slice", "broadcast")


def _write_config(path, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def _write_ckpt(path, state: dict, config: dict) -> str:
    _write_config(path, config)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


K0 = "model.layers.0.self_attn.k_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"
EMB = "model.embed_tokens.weight"
EXTRA = "model.layers.0.self_attn.q_norm.weight"

# name -> (how to break the state dict, needles every rank's message must contain)
BAD = {
    "missing": (lambda sd: sd.pop(DOWN1), ["missing", DOWN1]),
    "unexpected": (lambda sd: sd.__setitem__(EXTRA, torch.ones(16)), ["unexpected", EXTRA]),
    "wrong-shape-k": (lambda sd: sd.__setitem__(K0, torch.randn(16, 64)), [K0, "(16, 64)", "(32, 64)"]),
    "wrong-shape-vocab": (lambda sd: sd.__setitem__(EMB, torch.randn(100, 64)), [EMB, "(100, 64)", "(101, 64)"]),
}

# config.json overrides that cannot be split over tp=4 -> needles
SPLIT = {
    "heads": (dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16),
              ["num_attention_heads=6", "tp=4"]),
    "kv-heads": (dict(num_attention_heads=12, num_key_value_heads=6, head_dim=8),
                 ["num_key_value_heads=6", "tp=4"]),
    "kv-heads-below-tp": (dict(num_attention_heads=12, num_key_value_heads=3, head_dim=8),
                          ["num_key_value_heads=3", "tp=4"]),
    "intermediate": (dict(intermediate_size=90), ["intermediate_size=90", "tp=4"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_errors")
    model = make_hf_model(tiny_config("llama"), seed=3)
    good_dir = save_checkpoint(model, str(root / "good"))
    with open(os.path.join(good_dir, "config.json")) as f:
        config = json.load(f)
    sd = hf_state_dict(model)
    arch_dir = _write_config(root / "mistral", dict(config, architectures=["MistralForCausalLM"],
                                                    model_type="mistral"))
    split_dirs = {name: _write_config(root / f"split-{name}", dict(config, **over))
                  for name, (over, _) in SPLIT.items()}
    bad = {}
    for name, (breaker, _) in BAD.items():
        broken = dict(sd)
        breaker(broken)
        bad[name] = (broken, _write_ckpt(root / f"bad-{name}", broken, config))
    ids, mask = padded_batch(config["vocab_size"])
    return dict(good_dir=good_dir, sd=sd, arch_dir=arch_dir, split_dirs=split_dirs, bad=bad, ids=ids, mask=mask)


def _errors_rank(rank, world, s):
    import parallm
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e))

    parallm.init_parallel(tp=1)
    attempt("arch", lambda: parallm.build_model(s["arch_dir"]))

    parallm.init_parallel(tp=4)
    for name, d in s["split_dirs"].items():
        attempt(("split", name), lambda: parallm.build_model(d))

    parallm.init_parallel(tp=2)  # dp=2: broadcast must reach replicas too
    chunks = parallm.build_model(s["good_dir"])
    for name, (sd, d) in s["bad"].items():
        for mode in MODES:
            src = sd if mode == "slice" or rank == 0 else None
            attempt((name, "dict", mode), lambda: parallm.load_hf_weights(chunks, src, mode=mode))
            attempt((name, "dir", mode), lambda: parallm.load_hf_weights(chunks, d, mode=mode))
    # slice needs the source everywhere; rank 0 must hold it
    attempt("slice-rank0-only", lambda: parallm.load_hf_weights(
        chunks, s["sd"] if rank == 0 else None, mode="slice"))
    attempt("none-on-rank0", lambda: parallm.load_hf_weights(
        chunks, None if rank == 0 else s["sd"], mode="auto"))
    attempt("missing-dir", lambda: parallm.load_hf_weights(chunks, s["good_dir"] + "-nope", mode="slice"))
    # after all those errors the ranks are still in step: a good load and a forward work
    parallm.load_hf_weights(chunks, s["good_dir"], mode="broadcast")
    with torch.no_grad():
        logits = parallm.forward(chunks, s["ids"], s["mask"])
    out["finite"] = bool(torch.isfinite(logits).all())
    return out


@pytest.fixture(scope="module")
def results(setup):
    """Per-rank {case: None | (exception type name, message)}; one spawn for the whole module."""
    return run_ranks(_errors_rank, WORLD, setup)


def _check(results, key, etype, needles):
    failures = []
    for rank, res in enumerate(results):
        got = res[key]
        if got is None:
            failures.append(f"{key}: rank {rank} did not raise")
            continue
        name, msg = got
        if name != etype:
            failures.append(f"{key}: rank {rank} raised {name}, expected {etype}: {msg}")
        missing = [n for n in needles if n not in msg]
        if missing:
            failures.append(f"{key}: rank {rank} message lacks {missing}: {msg}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
def test_unsupported_architecture_on_every_rank(results):
    _check(results, "arch", "ValueError", ["MistralForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SPLIT))
def test_not_divisible_by_tp_on_every_rank(results, name):
    _check(results, ("split", name), "ValueError", SPLIT[name][1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["dict", "dir"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_checkpoint_on_every_rank(results, name, kind, mode):
    _check(results, (name, kind, mode), "CheckpointError", BAD[name][1])


@pytest.mark.timeout(300)
def test_source_placement_errors_on_every_rank(results):
    _check(results, "slice-rank0-only", "CheckpointError", ["mode='broadcast'", "[1, 2, 3]"])
    _check(results, "none-on-rank0", "CheckpointError", ["rank 0", "None"])


@pytest.mark.timeout(300)
def test_missing_directory_named_on_every_rank(results):
    # The message must say which path is missing (today it says only "the source on global rank 0 does not
    # exist"; see parallm/checkpoint/loader.py _choose_mode).
    _check(results, "missing-dir", "CheckpointError", ["good-nope"])


@pytest.mark.timeout(300)
def test_ranks_still_in_step_after_errors(results):
    assert all(r["finite"] for r in results)
