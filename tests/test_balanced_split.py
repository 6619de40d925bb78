"""``build_model(layers_per_stage="balanced")``: the cost model (per-token multiply-adds of each layer and of the
head, from the weight table) against the weights transformers builds, and the split search against brute force.
The balanced split running end to end (forward, SGD step, round trip against transformers) is a case of
tests/test_pipeline.py and tests/test_moe.py's pipelined cases."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

import helpers


def _compositions(n: int, k: int):
    """Every way of writing n as k positive parts, in order."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))


def _stage_costs(sizes, costs, head):
    out, start = [], 0
    for s in sizes:
        out.append(sum(costs[start:start + s]))
        start += s
    out[-1] += head
    return out


def test_balanced_sizes_is_optimal_against_brute_force():
    from parallm.parallel.stages import balanced_sizes
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 11)
        k = rng.randint(1, n)
        costs = [rng.choice((1, 2, 3, 5, 8, 13)) for _ in range(n)]
        head = rng.choice((0, 0, 1, 7, 20, 100))
        got = balanced_sizes(costs, head, k)
        assert len(got) == k and sum(got) == n and min(got) >= 1, (costs, head, k, got)
        best = min((max(c), sum(x * x for x in c)) for c in
                   (_stage_costs(s, costs, head) for s in _compositions(n, k)))
        mine = _stage_costs(got, costs, head)
        assert (max(mine), sum(x * x for x in mine)) == best, (costs, head, k, got)


def test_balanced_sizes_examples():
    from parallm.parallel.stages import balanced_sizes
    assert balanced_sizes([4] * 8, 0, 2) == (4, 4)          # no head: the even split
    assert balanced_sizes([4] * 8, 16, 2) == (6, 2)         # a head worth 4 layers: the last stage gets 2 layers
    assert balanced_sizes([1] * 5, 0, 2) == (3, 2)          # a tie: fewer layers where the head is
    assert balanced_sizes([1] * 61, 3, 8) == (8, 8, 8, 8, 8, 8, 8, 5)
    assert balanced_sizes([2, 2, 2, 5, 5, 5, 5, 5], 4, 2) == (5, 3)   # unequal layers (dense ones first)
    assert balanced_sizes([3], 9, 1) == (1,)
    with pytest.raises(ValueError, match="3 layers do not split into 4 stages"):
        balanced_sizes([1, 1, 1], 0, 4)


def _reference_costs(model, spec, task):
    """Per layer: every matrix of transformers' layer at its size, routed experts (``.experts.``, held fused or
    not) at top_k / num_experts of theirs; the head from transformers' own head module."""
    costs = [Fraction(0)] * spec.num_layers
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "layers" not in parts or p.dim() < 2:
            continue
        layer = int(parts[parts.index("layers") + 1])
        share = Fraction(spec.moe.top_k, spec.moe.num_experts) if ".experts." in name else 1
        costs[layer] += share * p.numel()
    head = model.score.weight.numel() if task == "value" else model.lm_head.weight.numel()
    return [round(c) for c in costs], head


@pytest.mark.parametrize("family,overrides,task", [
    ("llama", dict(num_hidden_layers=3, vocab_size=500), "causal_lm"),
    ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=True), "value"),
    ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), "causal_lm"),   # a dense layer in between
    ("qwen3_moe", dict(num_hidden_layers=2), "causal_lm"),
    ("mixtral", dict(num_hidden_layers=2), "causal_lm"),
])
def test_forward_costs_count_what_transformers_builds(family, overrides, task):
    from parallm.families import spec_from_config
    from parallm.model.stage_costs import forward_costs
    cfg = helpers.tiny_config(family, **overrides)
    spec, fam = spec_from_config(cfg)
    model = helpers.make_hf_model(cfg, seed=0, task=task)
    layers, head = forward_costs(fam.table, spec, task=task)
    assert (layers, head) == _reference_costs(model, spec, task)
    if spec.moe is not None:
        assert len(set(layers)) == (2 if "mlp_only_layers" in overrides else 1)
    assert forward_costs(fam.table, spec, task="hidden")[1] == 0


def test_balanced_layers_per_stage_follows_the_head():
    from parallm.api import balanced_layers_per_stage
    from parallm.families import spec_from_config
    spec, _ = spec_from_config(helpers.tiny_config("qwen2", num_hidden_layers=4, vocab_size=2000))
    assert balanced_layers_per_stage(spec, task="causal_lm", pp=2) == [3, 1]   # head = 4.2 layers' work
    assert balanced_layers_per_stage(spec, task="value", pp=2) == [2, 2]       # a value head costs nothing
    assert balanced_layers_per_stage(spec, task="causal_lm", pp=2, vpp=2) == [1, 1, 1, 1]
    assert balanced_layers_per_stage(spec, task="causal_lm", pp=1) is None


def test_inspect_shows_the_balanced_split(tmp_path, capsys):
    import json

    from parallm.cli import main
    model = helpers.make_hf_model(helpers.tiny_config("qwen2", num_hidden_layers=4, vocab_size=2000), seed=0)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    assert main(["inspect", ckpt, "--pp", "2", "--layers-per-stage", "balanced", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["split"] == [3, 1] and [s["layers"] for s in layout["stages"]] == ["0-2", "3"]
    assert main(["inspect", ckpt, "--pp", "2", "--layers-per-stage", "balanced", "--task", "value", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["split"] == [2, 2]
    assert main(["inspect", ckpt, "--pp", "8", "--layers-per-stage", "balanced"]) == 1
    assert "4 layers do not split into pp=8" in capsys.readouterr().err


def test_default_forward_microbatches():
    """pp microbatches, and up to 4 pp while each keeps the device's token floor; never more than the batch."""
    from parallm.api import MIN_FORWARD_MICROBATCH_TOKENS, default_forward_microbatches as default
    cpu = MIN_FORWARD_MICROBATCH_TOKENS["cpu"]
    assert default(8, 2, 8 * 256) == 8                 # 256 tokens per sequence: one sequence each, 4 pp
    assert default(8, 2, 8 * 9) == 2                   # 72 tokens: pp
    assert default(64, 2, 5 * cpu) == 5                # between: as many as keep the floor
    assert default(3, 4, 3 * 4096) == 3                # fewer sequences than pp
    assert default(64, 4, 64 * 1024, "cuda") == 16 and default(8, 2, 8 * 256, "cuda") == 2
    assert default(8, 2) == 8 and default(0, 2, 0) == 1


def test_forward_costs_of_deepseek_v3_latent_attention_and_dense_first_layer():
    """DeepSeek-V3: latent attention's projections, a dense first layer (first_k_dense_replace) and MoE layers
    with shared experts, each at the cost of what transformers builds."""
    from test_deepseek_parts import deepseek_config

    from parallm.families import spec_from_config
    from parallm.model.stage_costs import forward_costs
    cfg = deepseek_config(num_hidden_layers=3)
    spec, fam = spec_from_config(cfg)
    model = helpers.make_hf_model(cfg, seed=0)
    layers, head = forward_costs(fam.table, spec, task="causal_lm")
    assert (layers, head) == _reference_costs(model, spec, "causal_lm")
    assert layers[0] != layers[1] == layers[2]
