"""LoRA on the hybrid Gated DeltaNet families (Qwen3.5, Qwen3.5-MoE / Qwen3.6, Qwen3-Next) against transformers +
PEFT 0.21 (docs/lora.md, "Gated DeltaNet families"; :mod:`parallm.model.layers.lora_gdn`), fp32, with
:mod:`test_lora`'s checks.

Three tiny text models with both layer kinds (test_qwen3_5.py's: 4 layers, Gated DeltaNet and gated full attention
alternating, 2 key / 4 value linear heads): dense Qwen3.5 (2 KV heads), Qwen3.5-MoE in Qwen3.6's shape (1 KV head:
replicated at tp2; 4 experts top-2 and the gated shared expert) and Qwen3-Next (4 experts, the grouped
``in_proj_qkvz`` / ``in_proj_ba``). Targets: q/k/v/o_proj, the Gated DeltaNet projections as PEFT names them and
gate/up/down_proj; PEFT adapts the dense MLPs (Qwen3.5), the shared expert and not the routed experts
(Qwen3.5-MoE: no conversion pattern), the routed experts and not the shared expert (Qwen3-Next: qwen2_moe's
pattern), and so must parallm (the names are checked on PEFT's side; parallm's must then equal them). And the
vision-language wrapper of the Qwen3.6-shaped model (``Qwen3_5MoeForConditionalGeneration``, the class of the
released checkpoints; a 2-block vision tower, carried): PEFT adapts its language model's modules under
``model.language_model.`` and no vision module, and so does parallm.

Per model, one 2-rank spawn: tp2 padded and tp2 packed + SP, and cp2 (dense Qwen3.5) or ep2 (dp2, the MoE
models: Qwen3-Next's expert adapters split over the ranks), each with PEFT's random adapter loaded
(``load_hf_adapter``; exported back bit-exact), logits with adapters on and off, one token-mean AdamW step (every
factor after it against PEFT's); the tp2 run's ``save_hf_adapter`` directory loaded by PEFT (its tensors bit-exact,
no missing / unexpected key, the same logits; the merged export equal to its ``merge_and_unload``) and its
adapters-only training checkpoint loaded at tp1 x dp2
(bit-exact). Breaks that must fail: a Gated DeltaNet input projection's B rows
from the other TP rank, and q_proj's B rows with each head's query and output-gate rows swapped (logits far off).
Refusals: "all-linear" on the MoE models (PEFT's reaches ``shared_expert_gate``; Qwen3-Next's the router ``gate``)
and naming those, "all-linear" on the wrapper (PEFT's reaches the vision tower); "all-linear" on dense Qwen3.5
adapts exactly the named set. Without a process group: the Gated DeltaNet slots' layouts at tp2 + SP and the
refusals (the conv, the wrapper's vision tower).
"""

from __future__ import annotations

import copy
import os

import peft
import pytest
import torch

import helpers
import test_lora
import test_qwen3_5 as q35
from test_lora import (ALPHA, R, _adapted, _assert_case, _check_run, _peft_state, _randomize_adapter, dp_rows,
                       peft_step)

ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GDN = {"qwen3_5_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
       "qwen3_5_moe_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
       "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj")}
GDN["qwen3_5_moe"] = GDN["qwen3_5_moe_text"]          # the vision-language wrapper (the released Qwen3.6's class)
# Qwen3.6's one KV head per 8 query heads
OVERRIDES = {"qwen3_5_moe_text": dict(num_key_value_heads=1), "qwen3_5_moe": dict(num_key_value_heads=1)}
BREAK_TOL = 1e-3


def _targets(model_type):
    return ATTN_MLP + GDN[model_type]


def _reference(model_type, tmp):
    import parallm
    cfg = q35.hybrid_config(model_type, **OVERRIDES.get(model_type, {}))
    base = q35.make_model(cfg, seed=0)
    ckpt = helpers.save_checkpoint(base, str(tmp / "ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                                      target_modules=list(_targets(model_type))))
    _randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    vocab = getattr(cfg, "text_config", cfg).vocab_size
    ids, mask = helpers.padded_batch(vocab, batch=4, seq=12, seed=3)
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        merged = copy.deepcopy(model).merge_and_unload()
        spread = helpers.max_diff_real(merged(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
                                       model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, mask)
    ref = peft_step(model, base, ids, mask)
    with torch.no_grad():
        ref.update(after_logits=model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, spread=spread)
    return base, ckpt, adapter, (ids, mask), ref


def _other_rank(t, group):
    """The other TP rank's shard of ``t`` (tp = 2)."""
    import torch.distributed as dist
    shards = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return shards[1 - dist.get_rank(group)]


def _broken_logits(chunks, batch, what):
    """The logits with one factor laid out wrong on purpose: ``"gdn_rank"``: the first Gated DeltaNet layer's first
    input projection's B rows from the other TP rank; ``"gate_rows"``: the first attention layer's q_proj B with
    each head's query and gate rows swapped."""
    import parallm
    from parallm.model.layers.lora import chunk_lora_entries
    chunk = chunks[0]
    spec = chunk.spec
    with torch.no_grad():
        for entry, c in chunk_lora_entries(chunks):
            name = entry.local
            if what == "gdn_rank" and ".in_proj.lora.lora_B.in_proj_qkv" in name:
                p = c.get_parameter(name)
                p.copy_(_other_rank(p.detach(), c.dims.tp_group))
                break
            if what == "gate_rows" and name.endswith("linear_qkv.lora.lora_B.q_proj"):
                p = c.get_parameter(name)
                d = spec.head_dim
                p.copy_(p.detach().view(-1, 2, d, p.shape[-1]).flip(1).reshape(p.shape))
                break
        else:
            raise AssertionError(f"no factor to break for {what}")
        return parallm.forward(chunks, *batch)


def _cases(rank, world, ckpt, adapter, batch, model_type, tmp):
    import parallm
    out = {}
    layouts = [("tp2", dict(tp=2), {}), ("tp2 packed+SP", dict(tp=2), dict(packed=True, sequence_parallel=True))]
    if model_type == "qwen3_5_text":        # context parallelism: the adapters inside in_proj, before the all-to-all
        layouts.append(("cp2", dict(cp=2), {}))
    else:                                   # expert parallelism (dp2: each replica half the batch, token-mean)
        layouts.append(("ep2", dict(ep=2), {}))
    for name, kw, build in layouts:
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, build)
        loaded = dict(parallm.export_adapter_tensors(chunks))
        res = _check_run(rank, chunks, batch, dp_slice=dp_rows(batch))
        if name == "tp2":
            parallm.save_hf_adapter(chunks, os.path.join(tmp, "saved"), overwrite=True)
            parallm.save_checkpoint(os.path.join(tmp, "lora_ckpt"), chunks, step=1, overwrite=True)
            merged = dict(parallm.export_hf_tensors(chunks, merged=True, copy=True))
            with torch.no_grad():
                after_logits = parallm.forward(chunks, *batch)
        if res is not None:
            res["loaded"] = loaded
            if name == "tp2":
                res["after_logits"], res["merged"] = after_logits, merged
        out[name] = res
        parallm.destroy_parallel()
    # the tp2 training checkpoint (adapters only) into a tp1 x dp2 model with the same adapters
    parallm.init_parallel(tp=1)
    chunks = parallm.build_model(ckpt, lora=parallm.LoraConfig(R, ALPHA, _targets(model_type)))
    parallm.load_hf_weights(chunks, ckpt)
    parallm.load_checkpoint(os.path.join(tmp, "lora_ckpt"), chunks)
    out["resumed"] = dict(parallm.export_adapter_tensors(chunks))
    parallm.destroy_parallel()
    parallm.init_parallel(tp=2)
    for what in ("gdn_rank", "gate_rows"):          # (Qwen3-Next's in_proj_qkvz matches "in_proj_qkv" too)
        out[what] = _broken_logits(_adapted(ckpt, adapter, {}), batch, what)
    from parallm.checkpoint.lora_io import peft_shapes
    for key, targets in (("all-linear", "all-linear"), ("named gate", ("q_proj", "shared_expert_gate")),
                         ("named router", ("q_proj", "gate"))):
        try:
            out[key] = sorted(peft_shapes(parallm.build_model(ckpt, lora=parallm.LoraConfig(R, ALPHA, targets))))
        except ValueError as e:
            out[key] = str(e)
    parallm.destroy_parallel()
    return out if rank == 0 else None


def _peft_loads(base, directory, batch):
    """PEFT's model of ``base`` with the adapter directory parallm saved: (its adapter tensors, its logits, its
    merged weights: ``merge_and_unload``)."""
    import parallm
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), directory)
    ids, mask = batch
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits
    state = _peft_state(model)
    return state, logits, model.merge_and_unload().state_dict()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen3_5_moe"])
def test_hybrid_lora_against_peft(tmp_path, model_type):
    base, ckpt, adapter, batch, ref, = _reference(model_type, tmp_path)
    names = set(ref["after"])
    for leaf in GDN[model_type]:                                    # every Gated DeltaNet projection, layer 0
        assert any(f".layers.0.linear_attn.{leaf}.lora_B" in k for k in names), (leaf, sorted(names))
    assert any(".layers.1.self_attn.q_proj.lora_B" in k for k in names)
    shared = any(".shared_expert." in k for k in names)
    routed = any(".mlp.experts." in k for k in names)
    dense = any(".mlp.gate_proj." in k for k in names)
    assert (dense, shared, routed) == {"qwen3_5_text": (True, False, False), "qwen3_5_moe_text": (False, True, False),
                                       "qwen3_next": (False, False, True),
                                       "qwen3_5_moe": (False, True, False)}[model_type], sorted(names)
    assert not any(".visual." in k for k in names)
    res = helpers.run_ranks(_cases, 2, ckpt, adapter, batch, model_type, str(tmp_path), timeout=800)[0]
    mask = batch[1]
    # the logits: within 2 x transformers' own spread (PEFT's merged model against its unmerged one: 1.1e-5 to
    # 2.0e-5 here; random adapters of 0.2 N(0, 1) on every projection amplify rounding through the hybrid layers:
    # each target group alone stayed within 8.5e-6 of PEFT at tp2, all of them 3.0e-5 under packed + SP)
    tol = max(test_lora.LOGIT_TOL, 2 * ref["spread"])
    print(f"\ntransformers' merged vs unmerged: {ref['spread']:.1e}; logits tolerance {tol:.1e}")
    for name in ("tp2", "tp2 packed+SP") + tuple(k for k in ("cp2", "ep2") if k in res):
        out = res[name]
        assert set(out["loaded"]) == set(ref["before"]), set(out["loaded"]) ^ set(ref["before"])
        assert all(torch.equal(out["loaded"][k], ref["before"][k]) for k in ref["before"]), name
        print(f"\n{model_type} {name}: logits {helpers.max_diff_real(out['logits'], ref['logits'], mask):.1e} "
              f"(base {helpers.max_diff_real(out['base_logits'], ref['base_logits'], mask):.1e}), "
              f"loss {abs(out['loss'] - ref['loss']):.1e}, step factors "
              f"{max((out['after'][k] - ref['after'][k]).abs().max().item() for k in ref['after']):.1e}")
        saved, test_lora.LOGIT_TOL = test_lora.LOGIT_TOL, tol
        try:
            _assert_case(out, ref, mask, f"{model_type} {name}")
        finally:
            test_lora.LOGIT_TOL = saved
    # parallm's saved directory in PEFT: the same tensors bit for bit, the same logits
    state, logits, merged = _peft_loads(base, os.path.join(tmp_path, "saved"), batch)
    tp2 = res["tp2"]
    # the merged export against PEFT's merge_and_unload of the same adapter (every weight both name alike: the
    # stacked routed experts' names differ, and carry no adapter here)
    common = set(merged) & set(tp2["merged"])
    assert any(k.endswith("linear_attn.in_proj_qkv.weight") or k.endswith("linear_attn.in_proj_qkvz.weight")
               for k in common) and any(k.endswith("self_attn.q_proj.weight") for k in common)
    off = max((tp2["merged"][k].float() - merged[k].float()).abs().max().item() for k in common)
    print(f"merged export vs merge_and_unload: {off:.1e} over {len(common)} tensors")
    assert off < 1e-6, off
    assert set(state) == set(tp2["after"]) and all(torch.equal(state[k], tp2["after"][k]) for k in state)
    after = helpers.max_diff_real(logits, tp2["after_logits"], mask)
    print(f"saved adapter in PEFT: logits {after:.1e} from parallm's; vs PEFT's own step "
          f"{helpers.max_diff_real(logits, ref['after_logits'], mask):.1e}")
    assert after < tol, after
    resumed = res["resumed"]                            # the training checkpoint, tp2 -> tp1 x dp2, bit for bit
    assert set(resumed) == set(tp2["after"]) and all(torch.equal(resumed[k], tp2["after"][k]) for k in resumed)
    for what in ("gdn_rank", "gate_rows"):              # the breaks must fail
        off = helpers.max_diff_real(res[what], ref["logits"], mask)
        print(f"break {what}: logits {off:.1e} off")
        assert off > BREAK_TOL, (what, off)
    if model_type == "qwen3_5_text":                    # "all-linear" is the named set here
        assert set(res["all-linear"]) == names, set(res["all-linear"]) ^ names
    elif model_type == "qwen3_5_moe":                   # the wrapper: PEFT's "all-linear" reaches the vision tower
        assert isinstance(res["all-linear"], str) and "vision tower is not supported" in res["all-linear"]
        assert "mlp.shared_expert_gate is not supported" in res["named gate"], res["named gate"]
    else:
        for key in ("all-linear", "named gate"):
            assert isinstance(res[key], str) and "mlp.shared_expert_gate" in res[key] and "not supported" in res[key]
    if model_type == "qwen3_next":
        assert "mlp.gate" in res["all-linear"].replace("mlp.shared_expert_gate", ""), res["all-linear"]
        assert "mlp.gate is not supported" in res["named router"], res["named router"]


def test_hybrid_lora_plan():
    """No process group: the Gated DeltaNet slots at tp2 + SP (each input projection's B laid out as its rows of
    the fused ``in_proj``; A's gradient a partial sum under SP), a partial in_proj target, and the refusals: the
    depthwise conv, "all-linear" and a vision module on the wrapper."""
    from parallm.families import spec_from_config
    from parallm.model.layers.lora import LoraConfig, layer_slots
    from parallm.model.layers.lora_plan import _local_rows
    from parallm.model.sharding import PartsSplit, Split
    from parallm.model.table import all_entries

    def slots(model_type, targets, layer=0):
        spec, fam = spec_from_config(q35.hybrid_config(model_type))
        out = {}
        for e in all_entries(fam.table, spec, task="causal_lm", pp=1):
            if e.layer == layer and e.index in (None, 0) and e.hf and "lm_head" not in e.hf[0]:
                found = layer_slots(spec, e, LoraConfig(R, ALPHA, targets), tp=2, sp=True)
                if found is not None:
                    out[e.local.split(".", 2)[-1]] = (found[0], found[1], _local_rows(spec, e, 2, 0))
        return out

    got = slots("qwen3_5_text", GDN["qwen3_5_text"])
    kind, ins, local = got["self_attention.in_proj.weight"]
    # in_proj_qkv [q 16; k 16; v 32] by parts, z [32], b [4], a [4]; per rank 32 + 16 + 2 + 2 rows
    assert kind == "column" and [s.part for s in ins] == ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    assert [s.rows for s in ins] == [64, 32, 4, 4] and local == [32, 16, 2, 2]
    assert isinstance(ins[0].b_layout, PartsSplit) and ins[0].b_layout.sizes == (16, 16, 32)
    assert all(isinstance(s.b_layout, Split) for s in ins[1:]) and all(s.a_tp_sum and not s.b_tp_sum for s in ins)
    kind, (out,), _ = got["self_attention.out_proj.weight"]
    assert kind == "row" and (out.rows, out.cols, out.a_tp_sum, out.b_tp_sum) == (64, 32, False, True)
    part = slots("qwen3_5_text", ("in_proj_z",))
    assert [s.part for s in part["self_attention.in_proj.weight"][1]] == ["in_proj_z"] and len(part) == 1
    nxt = slots("qwen3_next", GDN["qwen3_next"])["self_attention.in_proj.weight"][1]
    assert [(s.part, s.rows) for s in nxt] == [("in_proj_qkvz", 96), ("in_proj_ba", 8)]
    assert all(isinstance(s.b_layout, Split) for s in nxt)
    with pytest.raises(ValueError, match="conv1d is not supported"):
        slots("qwen3_5_text", ("conv1d",))
    for targets, match in (("all-linear", "all-linear"), (("q_proj", "qkv"), "target qkv names its modules")):
        with pytest.raises(ValueError, match=f"vision tower is not supported: {match}"):
            slots("qwen3_5", targets)
    assert "self_attention.in_proj.weight" in slots("qwen3_5", ("in_proj_qkv",))


def test_qwen2_moe_shared_expert_gate_refused():
    """Qwen2-MoE: PEFT's "all-linear" adapts each MoE layer's shared_expert_gate, parallm does not: "all-linear"
    and naming the gate are refused; the projections by name are adapted."""
    from parallm.families import spec_from_config
    from parallm.model.layers.lora import LoraConfig, layer_slots
    from parallm.model.table import all_entries
    spec, fam = spec_from_config(helpers.tiny_config("qwen2_moe", decoder_sparse_step=1))
    assert spec.moe.shared_expert_gate

    def adapted(targets):
        return [e.local for e in all_entries(fam.table, spec, task="causal_lm", pp=1)
                if e.layer == 0 and e.hf and layer_slots(spec, e, LoraConfig(R, ALPHA, targets), tp=2, sp=False)]
    for targets in ("all-linear", ("q_proj", "shared_expert_gate")):
        with pytest.raises(ValueError, match="shared_expert_gate is not supported"):
            adapted(targets)
    got = adapted(("q_proj", "gate_proj", "up_proj", "down_proj"))
    assert any("shared_expert" in n for n in got) and any("query" in n or "qkv" in n for n in got), got
