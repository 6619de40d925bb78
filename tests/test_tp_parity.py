"""Tensor-parallel parity against transformers (fp32, gloo, one 4-rank spawn for the whole matrix).

One spawn of 4 ranks runs tp = 1, 2, 4 in turn (dp = 4 / tp) and, for each tp, every model case:

* load from the checkpoint directory (mode="slice"); every parameter is pre-filled with NaN so a parameter the
  loader skips shows up; vocab padding rows must be zero; the weight table's entries must name exactly the
  chunk's parameters;
* ``parallm.forward`` logits (or values) vs transformers at real positions (left / right / both padding) < 2e-5,
  and identical on every rank;
* ``save_hf_weights`` on rank 0 == the HF state dict, bit-exact, same key set ({} on other ranks); at tp=4 also
  written to a directory that the parent loads with ``from_pretrained``;
* loading from the state dict on rank 0 only (None elsewhere; auto -> broadcast, and explicit broadcast), from the
  state dict on every rank (auto -> slice) and mode="broadcast" from the directory give forward outputs
  torch.equal to the slice-loaded ones.

Cases: LLaMA untied + attention_bias + mlp_bias + llama3 rope + vocab 101 + indexed multi-file checkpoint +
config.json rewritten to 4.x style; LLaMA tied + nkv=1 + head_dim=32 != 64/8 + linear rope; Qwen2 untied nkv=2
vocab 99; Qwen2 tied nkv=1 dynamic rope (NTK actually triggered: max_position_embeddings < sequence length);
Qwen2 tied *value* model (score head; tied config must not skip it). With tp=4, nkv < tp in every case.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from helpers import (hf_logits, hf_state_dict, make_hf_model, max_diff_real, padded_batch, rewrite_config_4x,
                     run_ranks, save_checkpoint, tiny_config)

TPS = (1, 2, 4)
PIPELINES = ((2, 2, None), (1, 2, 2))  # (tp, pp, vpp): per-chunk table coverage, round trip, parity
LAYERS = 4
WORLD = 4
TOL = 2e-5

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
# head_dim 16, theta 5e5: wavelengths 6.3 (< 64/4: kept), 32.5 (blended), >= 168 (> 64: divided by factor)

CASES = {
    # name: (family, task, config overrides, save options)
    "llama-untied-bias-llama3-v101-multifile-4x": (
        "llama", "causal_lm",
        dict(attention_bias=True, mlp_bias=True, vocab_size=101, rope_parameters=LLAMA3,
             max_position_embeddings=128),
        dict(max_shard_size="20KB", config_4x=True, bf16_check=True)),
    "llama-tied-nkv1-hd32-linear": (
        "llama", "causal_lm",
        dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=1, head_dim=32,
             rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}),
        dict()),
    "qwen2-untied-nkv2-v99": (
        "qwen2", "causal_lm", dict(num_key_value_heads=2, vocab_size=99), dict()),
    "qwen2-tied-nkv1-dynamic": (
        "qwen2", "causal_lm",
        dict(tie_word_embeddings=True, num_key_value_heads=1, max_position_embeddings=8,
             rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        dict()),
    "qwen2-tied-value": (
        "qwen2", "value", dict(tie_word_embeddings=True, vocab_size=99), dict()),
}


def hf_values(model, ids, mask):
    """Per-token values of an HF *ForSequenceClassification(num_labels=1): score(last hidden state)."""
    import parallm
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask,
                             position_ids=parallm.default_position_ids(mask)).last_hidden_state
        return model.score(hidden).squeeze(-1).float()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_parity")
    out = {}
    for i, (name, (family, task, overrides, save)) in enumerate(CASES.items()):
        config = tiny_config(family, num_hidden_layers=LAYERS, **overrides)
        model = make_hf_model(config, task=task, seed=10 + i)
        path = save_checkpoint(model, str(root / name), max_shard_size=save.get("max_shard_size"))
        if save.get("max_shard_size"):
            files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
            assert os.path.isfile(os.path.join(path, "model.safetensors.index.json")) and len(files) > 2, files
        if save.get("config_4x"):
            rewrite_config_4x(path)
            with open(os.path.join(path, "config.json")) as f:
                raw = json.load(f)
            assert "rope_parameters" not in raw and raw["rope_scaling"]["type"] == "llama3", raw
        ids, mask = padded_batch(config.vocab_size, seed=20 + i)
        ref = hf_values(model, ids, mask) if task == "value" else hf_logits(model, ids, mask)
        out[name] = dict(name=name, family=family, task=task, path=path, state_dict=hf_state_dict(model),
                         ids=ids, mask=mask, ref=ref, vocab=config.vocab_size, tied=config.tie_word_embeddings,
                         out_dirs={tp: str(root / f"saved-{name}-tp{tp}") for tp in TPS},
                         bf16_check=save.get("bf16_check", False))
        if save.get("bf16_check"):
            # transformers with the same bf16-rounded weights (computing in fp32): what a bf16 checkpoint loaded
            # into an fp32 parallm model must match, as tightly as the fp32 model matches the fp32 weights
            rounded = copy.deepcopy(model)
            with torch.no_grad():
                for p in rounded.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
            out[name]["ref_bf16"] = hf_logits(rounded, ids, mask)
            assert max_diff_real(out[name]["ref_bf16"], ref, mask) > 100 * TOL  # the rounding is visible
    return out


# -- rank side ------------------------------------------------------------------------------------------------

def _build_nan(parallm, source, task, **kwargs):
    chunks = parallm.build_model(source, task=task, **kwargs)
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.fill_(float("nan"))
    return chunks


def _load_coverage_problems(chunks, layout) -> list[str]:
    """Every parameter was loaded (none still NaN) and the weight table names exactly the chunk's parameters."""
    from parallm.model.table import model_entries
    problems = []
    nan = _nan_params(chunks)
    if nan:
        problems.append(f"parameters not loaded (still NaN): {nan}")
    mine, _ = model_entries(chunks, layout)
    for chunk in chunks:
        table_names = [e.local for e, c in mine if c is chunk]
        params = {n for n, _ in chunk.named_parameters()}
        if len(table_names) != len(set(table_names)) or set(table_names) != params:
            problems.append(f"chunk {chunk.vpp_rank} table vs parameters: only in table "
                            f"{sorted(set(table_names) - params)}, only in chunk {sorted(params - set(table_names))}")
    return problems


def _nan_params(chunks):
    return sorted(n for c in chunks for n, p in c.named_parameters() if torch.isnan(p).any())


def _log(*msg):
    if os.environ.get("PARALLM_TEST_DEBUG"):
        import sys
        print(*msg, file=sys.stderr, flush=True)


def _run_case(parallm, case, tp, rank):
    from parallm.parallel.state import current_dims

    layout = current_dims()
    res = {"problems": []}
    problems = res["problems"]
    task, ids, mask = case["task"], case["ids"], case["mask"]

    _log(f"rank {rank} tp={tp} {case['name']}: build + slice load")
    chunks = _build_nan(parallm, case["path"], task)
    report = parallm.load_hf_weights(chunks, case["path"], mode="slice")
    if report.mode != "slice":
        problems.append(f"mode slice reported {report.mode}")
    problems += _load_coverage_problems(chunks, layout)
    # vocab padding rows are zero
    chunk = chunks[0]
    emb = chunk.embedding.weight
    per = chunk.padded_vocab_size // tp
    first_pad = case["vocab"] - layout.tp_rank * per
    if first_pad < per and torch.count_nonzero(emb[max(first_pad, 0):]).item():
        problems.append("embedding vocab padding rows are not zero")

    _log(f"rank {rank} tp={tp} {case['name']}: forward")
    with torch.no_grad():
        out = parallm.forward(chunks, ids, mask)
    res["diff"] = max_diff_real(out, case["ref"], mask)
    outs = [torch.empty_like(out) for _ in range(layout.world)]
    torch.distributed.all_gather(outs, out.contiguous())
    differ = [r for r, o in enumerate(outs) if not torch.equal(o, outs[0])]
    if differ:
        problems.append(f"forward output on ranks {differ} differs from rank 0's")
    expected_shape = tuple(ids.shape) + ((case["vocab"],) if task == "causal_lm" else ())
    if tuple(out.shape) != expected_shape:
        problems.append(f"output shape {tuple(out.shape)} != {expected_shape}")

    # HF -> shards -> HF, bit-exact
    _log(f"rank {rank} tp={tp} {case['name']}: save")
    state = parallm.save_hf_weights(chunks)
    if rank == 0:
        ref = case["state_dict"]
        if set(state) != set(ref):
            problems.append(f"saved keys: missing {sorted(set(ref) - set(state))}, "
                            f"extra {sorted(set(state) - set(ref))}")
        unequal = sorted(k for k in set(state) & set(ref) if not torch.equal(state[k], ref[k]))
        if unequal:
            problems.append(f"saved tensors differ from HF: {unequal}")
    elif state != {}:
        problems.append(f"save_hf_weights returned {len(state)} tensors on rank {rank} (expected {{}})")
    if tp == 4:
        parallm.save_hf_weights(chunks, case["out_dirs"][tp])

    # every other way to load gives the same model
    sd = case["state_dict"]
    variants = {
        "dict on rank 0 only (auto)": (sd if rank == 0 else None, "auto", "broadcast"),
        "dict on rank 0 only (broadcast)": (sd if rank == 0 else None, "broadcast", "broadcast"),
        "dict on every rank (auto)": (sd, "auto", "slice"),
        "directory (broadcast)": (case["path"], "broadcast", "broadcast"),
    }
    if case["tied"] and task == "causal_lm":
        # a tied checkpoint that also carries lm_head.weight must not change the result
        stray = dict(sd, **{"lm_head.weight": torch.randn_like(sd["model.embed_tokens.weight"])})
        variants["tied dict + stray lm_head (slice)"] = (stray, "slice", "slice")
        variants["tied dict + stray lm_head (broadcast)"] = (stray if rank == 0 else None, "broadcast", "broadcast")
    if case.get("bf16_check"):
        # a bf16 checkpoint (the usual HF dtype) is cast the same way by both modes
        bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        bf16_out = {}
        for mode in ("slice", "broadcast"):
            other = _build_nan(parallm, case["path"], task)
            parallm.load_hf_weights(other, bf16 if mode == "slice" or rank == 0 else None, mode=mode)
            if any(p.dtype != torch.float32 for c in other for p in c.parameters()):
                problems.append(f"bf16 state dict ({mode}): parameters are no longer fp32")
            if _nan_params(other):
                problems.append(f"bf16 state dict ({mode}): parameters not loaded: {_nan_params(other)}")
            with torch.no_grad():
                bf16_out[mode] = parallm.forward(other, ids, mask)
        if not torch.equal(bf16_out["slice"], bf16_out["broadcast"]):
            problems.append("bf16 state dict: slice and broadcast loads differ")
        res["bf16_diff"] = max_diff_real(bf16_out["slice"], case["ref_bf16"], mask)
        if not res["bf16_diff"] < TOL:
            problems.append(f"bf16 state dict: max diff {res['bf16_diff']:.3g} to transformers with the same "
                            f"bf16-rounded weights (tolerance {TOL})")
        # a larger vocab padding multiple: same logits, same saved weights
        other = _build_nan(parallm, case["path"], task, vocab_multiple=16)
        if other[0].padded_vocab_size % (16 * tp):
            problems.append(f"vocab_multiple=16: padded vocab {other[0].padded_vocab_size}")
        parallm.load_hf_weights(other, case["path"], mode="broadcast")
        with torch.no_grad():
            d = max_diff_real(parallm.forward(other, ids, mask), case["ref"], mask)
        if not d < TOL:
            problems.append(f"vocab_multiple=16: max diff to HF {d:.3g}")
        state = parallm.save_hf_weights(other)
        if rank == 0 and (set(state) != set(sd) or any(not torch.equal(state[k], sd[k]) for k in sd)):
            problems.append("vocab_multiple=16: round trip not bit-exact")
    for what, (source, mode, want_mode) in variants.items():
        _log(f"rank {rank} tp={tp} {case['name']}: {what}")
        other = _build_nan(parallm, case["path"], task)
        rep = parallm.load_hf_weights(other, source, mode=mode)
        if rep.mode != want_mode:
            problems.append(f"{what}: mode {rep.mode}, expected {want_mode}")
        nan = _nan_params(other)
        if nan:
            problems.append(f"{what}: parameters not loaded: {nan}")
        with torch.no_grad():
            same = torch.equal(parallm.forward(other, ids, mask), out)
        if not same:
            problems.append(f"{what}: forward differs from the slice-loaded model")
    return res


def _run_pipeline_case(parallm, case, rank):
    """pp > 1: every chunk's parameters are exactly its table entries and all get loaded; round trip; parity."""
    from parallm.parallel.state import current_dims

    layout = current_dims()
    problems = []
    chunks = _build_nan(parallm, case["path"], case["task"])
    if len(chunks) != layout.vpp:
        problems.append(f"{len(chunks)} chunks for vpp={layout.vpp}")
    parallm.load_hf_weights(chunks, case["path"], mode="slice")
    problems += _load_coverage_problems(chunks, layout)
    state = parallm.save_hf_weights(chunks)
    if rank == 0:
        ref = case["state_dict"]
        if set(state) != set(ref) or any(not torch.equal(state[k], ref[k]) for k in ref):
            problems.append(f"round trip: keys {sorted(set(state) ^ set(ref))}, differing "
                            f"{sorted(k for k in set(state) & set(ref) if not torch.equal(state[k], ref[k]))}")
    with torch.no_grad():
        out = parallm.forward(chunks, case["ids"], case["mask"])
    return {"problems": problems, "diff": max_diff_real(out, case["ref"], case["mask"])}


def _parity_rank(rank, world, cases):
    import parallm
    results = {}
    for tp in TPS:
        parallm.init_parallel(tp=tp)
        for name, case in cases.items():
            try:
                results[tp, name] = _run_case(parallm, case, tp, rank)
            except Exception as e:  # keep the ranks in step is impossible after a failure; report it
                raise RuntimeError(f"tp={tp} case {name}: {type(e).__name__}: {e}") from e
    for layout in PIPELINES:
        tp, pp, vpp = layout
        parallm.init_parallel(tp=tp, pp=pp, vpp=vpp)
        for name, case in cases.items():
            try:
                results[layout, name] = _run_pipeline_case(parallm, case, rank)
            except Exception as e:
                raise RuntimeError(f"tp={tp} pp={pp} vpp={vpp} case {name}: {type(e).__name__}: {e}") from e
    return results


# -- parent side ----------------------------------------------------------------------------------------------

def _fmt(layout):
    tp, pp, vpp = layout
    return f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")


@pytest.mark.timeout(400)
def test_tp_parity_roundtrip_and_load_modes(cases):
    import transformers

    results = run_ranks(_parity_rank, WORLD, cases)
    failures = []
    rows = []
    for name, case in cases.items():
        diffs = []
        for tp in TPS:
            per_rank = [r[tp, name] for r in results]
            for rank, res in enumerate(per_rank):
                failures += [f"tp={tp} {name} rank {rank}: {p}" for p in res["problems"]]
            d = per_rank[0]["diff"]
            diffs.append(d)
            if not d < TOL:
                failures.append(f"tp={tp} {name}: max |parallm - HF| at real positions {d:.3g} >= {TOL}")
        for layout in PIPELINES:
            per_rank = [r[layout, name] for r in results]
            for rank, res in enumerate(per_rank):
                failures += [f"{_fmt(layout)} {name} rank {rank}: {p}" for p in res["problems"]]
            d = max(res["diff"] for res in per_rank)
            diffs.append(d)
            if not d < TOL:
                failures.append(f"{_fmt(layout)} {name}: max |parallm - HF| at real positions {d:.3g} >= {TOL}")
        rows.append((name, diffs))

        # the directory save_hf_weights wrote at tp=4 loads in transformers, with the same weights
        out_dir = case["out_dirs"][4]
        cls = (transformers.AutoModelForSequenceClassification if case["task"] == "value"
               else transformers.AutoModelForCausalLM)
        reloaded = cls.from_pretrained(out_dir, dtype=torch.float32)
        got = hf_state_dict(reloaded)
        ref = case["state_dict"]
        if set(got) != set(ref) or any(not torch.equal(got[k], ref[k]) for k in ref):
            failures.append(f"{name}: from_pretrained(save_hf_weights(out_dir)) != HF weights")

    print("\nmax |parallm - transformers| over real positions (fp32)")
    print(f"{'case':46s}" + "".join(f"{'tp=' + str(tp):>12s}" for tp in TPS)
          + "".join(f"{_fmt(layout):>14s}" for layout in PIPELINES))
    for name, diffs in rows:
        print(f"{name:46s}" + "".join(f"{d:12.3g}" for d in diffs[:len(TPS)])
              + "".join(f"{d:14.3g}" for d in diffs[len(TPS):]))
    for name, case in cases.items():
        if case["bf16_check"]:
            bf16 = [max(r[tp, name].get("bf16_diff", float("nan")) for r in results) for tp in TPS]
            print(f"{name + ' (bf16 weights)':46s}" + "".join(f"{d:12.3g}" for d in bf16))
    assert not failures, "\n".join(failures)
