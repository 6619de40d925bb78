"""The declarative weight tables against real transformers checkpoints (no process group).

Every checkpoint key is read by exactly the table's rows and every row's declared shape is the checkpoint's
shape: the loader's strictness and the saver's key set both rest on this. (That the rows also cover every
*parameter* of the built chunks needs parallel groups; tests/test_tp_parity.py checks it per chunk.)
"""

from __future__ import annotations

import pytest

from parallm.model.table import (CONDITIONS, KINDS, LAYER_CONDITIONS, Row, all_entries, chunk_entries,
                                 expected_hf_shapes, fused_layout, select_rows)
from parallm.families import FAMILIES, family_of, spec_from_config
from parallm.parallel.stages import layer_numbers

from helpers import hf_state_dict, hub_state_dict, make_hf_model, tiny_config

_DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                 n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32,
                 n_shared_experts=2, first_k_dense_replace=1)
CASES = {
    "llama-untied": ("llama", dict()),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-attention_bias": ("llama", dict(attention_bias=True)),
    "llama-mlp_bias": ("llama", dict(mlp_bias=True)),
    "llama-all-bias-tied-head_dim": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                   num_attention_heads=8, num_key_value_heads=1, head_dim=32)),
    "qwen2-untied": ("qwen2", dict(vocab_size=99)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3-tied-head_dim": ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-attention_bias": ("qwen3", dict(attention_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    # mixture of experts: checkpoints as save_pretrained writes them (per-expert Hub names)
    "qwen3-moe-mlp_only-sparse_step": ("qwen3_moe", dict(mlp_only_layers=[0], decoder_sparse_step=2)),
    "qwen3-moe-tied": ("qwen3_moe", dict(tie_word_embeddings=True, num_experts=8)),
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(mlp_only_layers=[3])),
    "mixtral": ("mixtral", dict()),
    # DeepSeek-V3 (multi-head latent attention, the router's selection bias, shared_experts, dense-first layers)
    # and GLM-4.5
    "deepseek-v3-q-lora-bias": ("deepseek_v3", dict(_DEEPSEEK, q_lora_rank=24, attention_bias=True)),
    "deepseek-v3-moonlight-tied": ("deepseek_v3", dict(_DEEPSEEK, q_lora_rank=None, tie_word_embeddings=True,
                                                       first_k_dense_replace=2)),
    "glm4-moe-qk-norm-bias": ("glm4_moe", dict(use_qk_norm=True, attention_bias=True, head_dim=32, n_routed_experts=8,
                                               num_experts_per_tok=2, moe_intermediate_size=32,
                                               first_k_dense_replace=1)),
}
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")
TASKS = ("causal_lm", "value")
NO_VALUE_CLASS = ("glm4_moe",)     # transformers 5.24 has no Glm4MoeForSequenceClassification
CASE_TASKS = [(c, t) for c, (f, _) in CASES.items() for t in TASKS if not (t == "value" and f in NO_VALUE_CLASS)]


def _shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.fixture(scope="module")
def hf_shapes(tmp_path_factory):
    """(case, task) -> (spec, family, HF checkpoint key -> shape); models built once per module."""
    out = {}
    root = tmp_path_factory.mktemp("tables")
    for case, (family, overrides) in CASES.items():
        for task in [t for c, t in CASE_TASKS if c == case]:
            config = tiny_config(family, num_hidden_layers=4, **overrides)
            model = make_hf_model(config, task=task)
            spec, fam = spec_from_config(model.config)
            sd = hub_state_dict(model, str(root / f"{case}-{task}")) if family in MOE else hf_state_dict(model)
            out[case, task] = (spec, fam, _shapes(sd))
    return out


@pytest.mark.parametrize("case,task", CASE_TASKS)
@pytest.mark.parametrize("pp", [1, 2])
def test_expected_shapes_equal_checkpoint(hf_shapes, case, task, pp):
    spec, family, ckpt = hf_shapes[case, task]
    expected = expected_hf_shapes(family.table, spec, task=task, pp=pp)
    missing = sorted(set(ckpt) - set(expected))
    extra = sorted(set(expected) - set(ckpt))
    assert not missing, f"checkpoint keys no table row reads (silently skipped): {missing}"
    assert not extra, f"table rows read keys the checkpoint does not have: {extra}"
    bad = {k: (ckpt[k], expected[k]) for k in ckpt if ckpt[k] != expected[k]}
    assert not bad, f"checkpoint vs table shapes: {bad}"
    if task == "value":
        assert "score.weight" in expected and expected["score.weight"] == (1, spec.hidden_size)
        assert "lm_head.weight" not in expected
    elif spec.tie_word_embeddings:
        assert "lm_head.weight" not in expected
    else:
        assert "lm_head.weight" in expected


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stages_partition_entries(hf_shapes, case, pp):
    """Chunks of all pipeline stages together hold every entry once (tied pp>1: plus the head copy, not saved)."""
    spec, family, ckpt = hf_shapes[case, "causal_lm"]
    everything = all_entries(family.table, spec, task="causal_lm", pp=pp)
    keys = [(e.row, e.layer) for e in everything]
    assert len(keys) == len(set(keys))
    got = []
    for p in range(pp):
        layers = layer_numbers(spec.num_layers, pp, 1, p, 0)
        ents = chunk_entries(family.table, spec, task="causal_lm", pp=pp, pre_process=p == 0,
                             post_process=p == pp - 1, layers=layers)
        locals_ = [(e.local, e.index) for e in ents]   # a stacked expert parameter: one entry per expert
        assert len(locals_) == len(set(locals_)), f"duplicate local names on stage {p}: {locals_}"
        got += [(e.row, e.layer) for e in ents]
        # local layer names restart at 0 in every chunk and the HF names carry the global index
        for e in ents:
            if e.layer is not None:
                local_idx = int(e.local.split(".")[1])
                assert layers[local_idx] == e.layer
                assert all(f"layers.{e.layer}." in n for n in e.hf)
    assert sorted(got, key=repr) == sorted(keys, key=repr)
    saved = [n for e in everything if e.row.save for n in e.hf]
    assert len(saved) == len(set(saved)), "a checkpoint key would be written twice"
    assert set(saved) == set(ckpt)
    head_copies = [e for e in everything if not e.row.save]
    if spec.tie_word_embeddings and pp > 1:
        assert [e.hf for e in head_copies] == [("model.embed_tokens.weight",)]
        assert head_copies[0].local == "output_layer.weight" and head_copies[0].row.stage == "last"
    else:
        assert head_copies == []


def test_family_tables_are_well_formed():
    for fam in FAMILIES.values():
        for row in fam.table:
            assert row.kind in KINDS
            assert all(c in CONDITIONS or c in LAYER_CONDITIONS for c in row.when)
            assert row.per_expert == all("{e}" in h for h in row.hf) and "{x}" not in row.local
            assert row.per_expert == (".experts." in row.local and ".shared_experts." not in row.local)
            if row.stage in ("layer", "mtp"):
                assert "{l}" in row.local and all("{i}" in h for h in row.hf)
            else:
                assert "{l}" not in row.local and all("{i}" not in h for h in row.hf)
            if row.kind in ("qkv", "qkv_global"):
                assert len(row.hf) == 3
            elif row.kind in ("gate_up", "qk_global"):     # qk_global: Gemma 4's K = V (q, k)
                assert len(row.hf) == 2
            elif row.kind == "gdn_in":     # Qwen3.5's in_proj_qkv / _z / _b / _a, Qwen3-Next's _qkvz / _ba
                assert len(row.hf) in (4, 2)
            else:
                assert len(row.hf) == 1
    assert {"llama", "qwen2"} <= set(FAMILIES)


@pytest.mark.parametrize("case", [c for c, (f, _) in CASES.items() if f in MOE])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_ranks_partition_expert_entries(hf_shapes, case, ep):
    """The experts of the ep ranks together hold every expert entry of every MoE layer once, dense entries on
    every rank; each rank's experts of a layer are one stacked parameter per projection (index 0, 1, ... along dim
    0, in global order) and the HF names carry the global index."""
    spec, family, _ = hf_shapes[case, "causal_lm"]
    everything = all_entries(family.table, spec, task="causal_lm", pp=1)
    per = spec.moe.num_experts // ep
    expert_keys = []
    for r in range(ep):
        mine = range(r * per, (r + 1) * per)
        ents = chunk_entries(family.table, spec, task="causal_lm", pp=1, pre_process=True, post_process=True,
                             layers=range(spec.num_layers), experts=mine)
        assert [e for e in ents if e.expert is None] == [e for e in everything if e.expert is None]
        stacks = {}
        for e in ents:
            if e.expert is not None:
                assert e.expert in mine and e.layer in spec.moe.layers
                assert e.index == e.expert - mine.start and e.local.endswith(("experts.linear_fc1.weight",
                                                                               "experts.linear_fc2.weight"))
                assert all(f".experts.{e.expert}." in n for n in e.hf)
                expert_keys.append((e.row, e.layer))
                stacks.setdefault(e.local, []).append(e.index)
            else:
                assert e.index is None
        assert len(stacks) == 2 * len(spec.moe.layers), sorted(stacks)
        assert all(v == list(range(per)) for v in stacks.values()), stacks
    want = [(e.row, e.layer) for e in everything if e.expert is not None]
    assert len(want) == len(spec.moe.layers) * spec.moe.num_experts * 2
    assert sorted(expert_keys, key=repr) == sorted(want, key=repr)


def test_tied_filters_rows_without_mutating_table(hf_shapes):
    spec, family, _ = hf_shapes["llama-tied", "causal_lm"]
    before = tuple(family.table)
    rows = select_rows(family.table, spec, "causal_lm", 1)
    assert not any(r.hf == ("lm_head.weight",) for r in rows)
    untied, _, _ = hf_shapes["llama-untied", "causal_lm"]
    assert any(r.hf == ("lm_head.weight",) for r in select_rows(family.table, untied, "causal_lm", 1))
    assert tuple(family.table) == before


def test_qwen2_spec_has_qkv_bias_only(hf_shapes):
    spec, family, _ = hf_shapes["qwen2-untied", "causal_lm"]
    assert family.name == "qwen2" and family_of(spec) is family
    assert spec.qkv_bias and not spec.o_bias and not spec.mlp_bias
    spec, _, _ = hf_shapes["llama-attention_bias", "causal_lm"]
    assert spec.qkv_bias and spec.o_bias and not spec.mlp_bias


def test_row_validation():
    with pytest.raises(ValueError, match="unknown kind"):
        Row("x", ("y",), "splat", "first", ((1,),))
    with pytest.raises(ValueError, match="unknown stage"):
        Row("x", ("y",), "copy", "middle", ((1,),))
    with pytest.raises(ValueError, match="1 sources but 0 shapes"):
        Row("x", ("y",), "copy", "first")
    with pytest.raises(ValueError, match="unknown condition"):
        Row("x", ("y",), "copy", "first", ((1,),), when=("sometimes",))


@pytest.mark.parametrize("case", [c for c, (f, _) in CASES.items() if f in MOE])
def test_fused_layout_names_transformers_in_memory_tensors(tmp_path, case):
    """The table's fused names are exactly the MoE tensors of transformers 5's in-memory state dict that the
    Hub's names do not have, and each per-expert HF tensor is the stated rows block of its expert's slab: built
    from a real model's ``state_dict()`` and compared with what ``save_pretrained`` writes."""
    import torch
    family_name, overrides = CASES[case]
    model = make_hf_model(tiny_config(family_name, num_hidden_layers=4, **overrides))
    spec, family = spec_from_config(model.config)
    memory, hub = model.state_dict(), hub_state_dict(model, str(tmp_path / "hub"))
    if spec.tie_word_embeddings:
        memory.pop("lm_head.weight")       # the tied head: in memory, not in the files
    fused = fused_layout(family.table, spec, task="causal_lm", pp=1)
    assert set(memory) - set(hub) == {p.name for p in fused.values()} - set(hub)
    assert set(hub) - set(memory) == set(fused) - set(memory)
    for name, part in fused.items():
        whole = memory[part.name]
        got = whole if part.expert is None else whole[part.expert].chunk(part.parts, dim=0)[part.part]
        assert torch.equal(got, hub[name]), name


def test_expert_stack_round_trips_and_its_blocks_describe_its_shard():
    """merge(shard(x)) == x bit for bit for stacked gate/up and down experts at tp 1, 2, 4, and every block names
    the slab (source // sources_per_expert) and rows / columns of the shard it describes."""
    import torch
    from parallm.model.sharding import ExpertStack, GateUpSplit, Split
    g = torch.Generator().manual_seed(0)
    count, width, hidden = 3, 8, 4
    for inner, shapes in ((GateUpSplit(), [(width, hidden)] * 2), (Split(1), [(hidden, width)])):
        layout = ExpertStack(inner, count)
        sources = [torch.randn(s, generator=g) for _ in range(count) for s in shapes]
        for tp in (1, 2, 4):
            shards = [layout.shard(sources, r, tp) for r in range(tp)]
            assert all(t.shape[0] == count for t in shards) and layout.tp_dim == inner.tp_dim + 1
            assert all(torch.equal(a, b) for a, b in zip(layout.merge(shards), sources))
            for r, shard in enumerate(shards):
                covered = torch.zeros(shard.shape, dtype=torch.bool)
                for b in layout.blocks(r, tp, [tuple(x.shape) for x in sources]):
                    x = b.source // inner.sources
                    local = shard[x].narrow(b.dim, b.local_start, b.local_stop - b.local_start)
                    assert torch.equal(local, sources[b.source].narrow(b.dim, b.hf_start, b.hf_stop - b.hf_start))
                    covered[x].narrow(b.dim, b.local_start, b.local_stop - b.local_start).fill_(True)
                assert covered.all() and layout.primary_slices(r, tp, tuple(shard.shape)) == [(0, 0, count)]


def test_carried_mtp_layers_live_on_the_last_stage(hf_shapes):
    """With its multi-token-prediction layer carried, a DeepSeek-V3 model's entries include ``model.layers.{L}.*``
    (a MoE decoder layer, every expert, plus the MTP layer's own tensors) once, all on the last pipeline stage
    under ``mtp_layers.0.``, none of them trained; without it (the spec from a config alone) none."""
    from dataclasses import replace

    from parallm.model.table import is_trained
    spec, family, ckpt = hf_shapes["deepseek-v3-q-lora-bias", "causal_lm"]
    assert spec.mtp_layers == 1 and spec.carried_mtp_layers == 0
    L = spec.num_layers
    assert not [n for n in expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
                if n.startswith(f"model.layers.{L}.")]
    carried = replace(spec, carried_mtp_layers=1)
    expected = expected_hf_shapes(family.table, carried, task="causal_lm", pp=2)
    mtp = {n: s for n, s in expected.items() if n.startswith(f"model.layers.{L}.")}
    last = f"model.layers.{L - 1}."
    assert {n.replace(f"model.layers.{L}.", last) for n in mtp if not n.split(".")[3] in
            ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")} == {n for n in ckpt if n.startswith(last)}
    assert mtp[f"model.layers.{L}.eh_proj.weight"] == (spec.hidden_size, 2 * spec.hidden_size)
    assert sum(".mlp.experts." in n for n in mtp) == spec.moe.num_experts * 3
    for p in range(2):
        ents = chunk_entries(family.table, carried, task="causal_lm", pp=2, pre_process=p == 0, post_process=p == 1,
                             layers=layer_numbers(L, 2, 1, p, 0))
        held = [e for e in ents if e.layer == L]
        assert (len(held) > 0) == (p == 1)
        assert all(e.local.startswith("mtp_layers.0.") and not is_trained(e) for e in held)
        assert all(is_trained(e) != e.local.endswith("e_score_correction_bias") for e in ents if e.layer != L)
