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
import re

import pytest
import torch

from helpers import (hf_logits, hf_state_dict, make_hf_model, max_diff_real, padded_batch, run_ranks, save_checkpoint,
                     tiny_config, write_ckpt, write_config)

WORLD = 4
MODES = ("slice", "broadcast")


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
    arch_dir = write_config(root / "gemma", dict(config, architectures=["GemmaForCausalLM"],
                                                    model_type="gemma"))
    split_dirs = {name: write_config(root / f"split-{name}", dict(config, **over))
                  for name, (over, _) in SPLIT.items()}
    bad = {}
    for name, (breaker, _) in BAD.items():
        broken = dict(sd)
        breaker(broken)
        bad[name] = (broken, write_ckpt(root / f"bad-{name}", broken, config))
    ids, mask = padded_batch(config["vocab_size"])
    # value head sources (docs/layouts.md, value head): score.weight, or a verl-style lm_head.weight of shape [1, H]
    value_model = make_hf_model(tiny_config("llama"), task="value", seed=4)
    value_sd = hf_state_dict(value_model)
    verl_sd = dict(value_sd)
    verl_sd["lm_head.weight"] = verl_sd.pop("score.weight")
    with torch.no_grad():
        import parallm
        hidden = value_model.model(input_ids=ids, attention_mask=mask,
                                   position_ids=parallm.default_position_ids(mask)).last_hidden_state
        value_ref = value_model.score(hidden).squeeze(-1)
    return dict(good_dir=good_dir, sd=sd, arch_dir=arch_dir, split_dirs=split_dirs, bad=bad, ids=ids, mask=mask,
                value_sd=value_sd, verl_sd=verl_sd, value_ref=value_ref, ref_logits=hf_logits(model, ids, mask))


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
    # strict=False ignores unexpected tensors (and only those)
    unexpected_sd = s["bad"]["unexpected"][0]
    for mode in MODES:
        attempt(("non-strict", mode), lambda: parallm.load_hf_weights(
            chunks, unexpected_sd if mode == "slice" or rank == 0 else None, mode=mode, strict=False))
        missing_sd = s["bad"]["missing"][0]
        attempt(("non-strict-missing", mode), lambda: parallm.load_hf_weights(
            chunks, missing_sd if mode == "slice" or rank == 0 else None, mode=mode, strict=False))
    # save into a non-empty directory is refused everywhere (before anything is gathered)
    attempt("save-nonempty", lambda: parallm.save_hf_weights(chunks, s["good_dir"]))
    _value_head_sources(parallm, rank, s, out)
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(s["good_dir"])
    # after all those errors the ranks are still in step: a good load and a forward give transformers' logits
    parallm.load_hf_weights(chunks, s["good_dir"], mode="broadcast")
    with torch.no_grad():
        logits = parallm.forward(chunks, s["ids"], s["mask"])
    out["final-diff"] = max_diff_real(logits, s["ref_logits"], s["mask"])
    return out


def _value_head_sources(parallm, rank, s, out):
    """Value model (tp=2, dp=2) from score.weight, from a verl-style lm_head.weight [1, H], and from a plain
    causal-LM checkpoint (head initialised, the same on every rank, and the user told)."""
    import logging
    import warnings

    def build():
        chunks = parallm.build_model(s["good_dir"], task="value")
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p.fill_(float("nan"))
        return chunks

    for name, sd in (("score", s["value_sd"]), ("verl-lm_head", s["verl_sd"])):
        for mode in MODES:
            chunks = build()
            key = ("value", name, mode)
            out[key] = None
            try:
                parallm.load_hf_weights(chunks, sd if mode == "slice" or rank == 0 else None, mode=mode)
                with torch.no_grad():
                    values = parallm.forward(chunks, s["ids"], s["mask"])
                out[key + ("diff",)] = max_diff_real(values, s["value_ref"], s["mask"])
            except Exception as e:  # noqa: BLE001
                out[key] = (type(e).__name__, str(e))

    chunks = build()
    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Catch(logging.WARNING)
    logging.getLogger().addHandler(handler)
    key = ("value", "causal-checkpoint")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parallm.load_hf_weights(chunks, s["good_dir"], mode="slice")
        records += [str(w.message) for w in caught]
        out[key] = None
        params = dict(chunks[-1].named_parameters())
        nan = [n for c in chunks for n, p in c.named_parameters() if torch.isnan(p).any()]
        score = params["score.weight"].detach().clone()
        every = [torch.empty_like(score) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(every, score)
        out[key + ("nan",)] = nan
        out[key + ("same",)] = all(torch.equal(x, every[0]) for x in every)
        out[key + ("told",)] = [m for m in records if "score" in m or "value head" in m]
    except Exception as e:  # noqa: BLE001
        out[key] = (type(e).__name__, str(e))
    finally:
        logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def results(setup):
    """Per-rank {case: None | (exception type name, message)}; one spawn for the whole module."""
    return run_ranks(_errors_rank, WORLD, setup)


def _check(results, key, etype, needles, patterns=()):
    """Every rank raised ``etype`` with a message containing every needle and matching every regex pattern."""
    failures = []
    for rank, res in enumerate(results):
        got = res[key]
        if got is None:
            failures.append(f"{key}: rank {rank} did not raise")
            continue
        name, msg = got
        if name != etype:
            failures.append(f"{key}: rank {rank} raised {name}, expected {etype}: {msg}")
        missing = [n for n in needles if n not in msg] + [p for p in patterns if not re.search(p, msg)]
        if missing:
            failures.append(f"{key}: rank {rank} message lacks {missing}: {msg}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
def test_unsupported_architecture_on_every_rank(results):
    _check(results, "arch", "ValueError", ["GemmaForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])


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
    # names the ranks that lack the source (1, 2, 3) and the way out
    _check(results, "slice-rank0-only", "CheckpointError", ["mode='broadcast'"],
           patterns=[r"\b1\b", r"\b2\b", r"\b3\b"])
    _check(results, "none-on-rank0", "CheckpointError", ["rank 0", "None"])


@pytest.mark.timeout(300)
def test_missing_directory_named_on_every_rank(results):
    # The message must say which path is missing (not only "the source on global rank 0 does not exist"); the
    # type is CheckpointError's subclass that is also a FileNotFoundError (build_model raises the same one).
    _check(results, "missing-dir", "MissingCheckpointError", ["good-nope", "does not exist"])


@pytest.mark.timeout(300)
def test_ranks_still_in_step_after_errors(results):
    diffs = [r["final-diff"] for r in results]
    assert max(diffs) < 2e-5, diffs


@pytest.mark.timeout(300)
def test_non_strict_load(results):
    for mode in MODES:
        assert all(r[("non-strict", mode)] is None for r in results), [r[("non-strict", mode)] for r in results]
        _check(results, ("non-strict-missing", mode), "CheckpointError", ["missing", DOWN1])


@pytest.mark.timeout(300)
def test_save_into_non_empty_directory_refused(results):
    _check(results, "save-nonempty", "FileExistsError", ["good", "overwrite=True"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["score", "verl-lm_head"])
def test_value_head_loads_from_score_or_verl_lm_head(results, source, mode):
    """docs/layouts.md (value head): the value head loads from score.weight or from a verl-style lm_head.weight [1, H]."""
    key = ("value", source, mode)
    errors = [r[key] for r in results if r[key] is not None]
    assert not errors, errors[0]
    diffs = [r[key + ("diff",)] for r in results]
    assert max(diffs) < 2e-5, diffs


@pytest.mark.timeout(300)
def test_value_head_from_causal_lm_checkpoint_is_initialised_and_told(results):
    """docs/layouts.md (value head): from a plain causal-LM checkpoint the head is initialised and the user is told; a
    replicated head must be the same on every rank."""
    key = ("value", "causal-checkpoint")
    errors = [r[key] for r in results if r[key] is not None]
    assert not errors, errors[0]
    assert all(r[key + ("nan",)] == [] for r in results), [r[key + ("nan",)] for r in results]
    assert all(r[key + ("same",)] for r in results), "score.weight differs across ranks"
    assert results[0][key + ("told",)], "no warning / log message about the initialised value head on rank 0"
