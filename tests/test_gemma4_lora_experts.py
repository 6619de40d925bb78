"""LoRA on Gemma 4's routed experts (the MoE block beside the MLP) against transformers 5.25 + PEFT 0.21
(docs/lora.md, "Gemma 4's routed experts"; model/layers/lora_gemma4.py).

PEFT has no conversion pattern for gemma4: its ``target_modules`` gate/up/down_proj adapt each layer's dense MLP
(nn.Linear), and the stacked experts (``experts.gate_up_proj [E, 2 I, H]``, ``experts.down_proj [E, H, I]``) are
adapted through ``target_parameters`` (a ``ParamWrapper`` per parameter, rank ``r`` each; gate_up the inner
wrapper). parallm takes the same as ``LoraConfig(target_modules=(..., "experts.gate_up_proj",
"experts.down_proj"))``; a bare ``"down_proj"`` stays the dense MLP's.

The model is test_gemma4_moe.py's (4 layers, K = V global layers, 4 experts of width 16, top-2, beside a dense MLP
of width 32). Without a process group: the plan (which slots, their ranks and TP layouts, what a bare
``"down_proj"`` or a regex adapts) and the PEFT config mapping; the reference's gate / up halves of the experts'
B swapped must move PEFT's logits far beyond the tolerance (the ``[gate; up]`` row order is checked by the
spawned cases). One 4-rank spawn (tp2 splits each expert's ``[gate_r; up_r]`` rows: ``gate_up_rows``): tp2 ep2
(dp2, each replica half the batch, token-mean AdamW) on the grouped GEMM and on the loop, tp2 ep2 packed + SP,
ep2 (dp4): logits with and without adapters, the step's factors against PEFT's, the base untouched; the adapter
save_hf_adapter writes after the tp2 ep2 step has PEFT's names and shapes, ``PeftModel.from_pretrained`` runs it
as PEFT's own state, and parallm reads it back into a fresh model; the merged export equals PEFT's
``merge_and_unload``.
"""

from __future__ import annotations

import copy
import json
import os

import peft
import pytest
import torch

import helpers
from test_gemma4_moe import make_model, moe_config
from test_lora import (ALPHA, R, _adapted, _assert_case, _assert_close_dict, _check_run, _hf_logits, _merged_and_saved,
                       _randomize_adapter, dp_rows, peft_step)

DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
WIDTH = 16          # moe_intermediate_size


def _peft_config():
    return peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(DENSE), target_parameters=list(EXPERTS),
                           lora_dropout=0.0)


def _reference(tmp):
    """(checkpoint, adapter dir, batch, reference dict, base model, PEFT model before the step)."""
    base = make_model(5)
    ckpt = helpers.save_checkpoint(base, str(tmp / "ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    _randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    start = copy.deepcopy(model)
    ids, mask = helpers.padded_batch(101, batch=4, seq=12, seed=3)
    ref = peft_step(model, base, ids, mask)
    return ckpt, adapter, (ids, mask), ref, base, start


def test_plan_ranks_layouts_and_names():
    from parallm.checkpoint.lora_io import _expert_leaves
    from parallm.families import spec_from_config
    from parallm.model.layers.lora_plan import LoraConfig, layer_slots
    from parallm.model.sharding import PartsSplit, Replicated, Split
    from parallm.model.table import all_entries
    spec, family = spec_from_config(moe_config())
    entries = {e.local: e for e in all_entries(family.table, spec, task="causal_lm", pp=1) if e.layer == 2
               and e.index in (None, 0)}

    def slots(targets, local):
        return layer_slots(spec, entries[f"layers.2.{local}"], LoraConfig(R, ALPHA, targets), tp=2, sp=False)

    kind, (fc1,) = slots(DENSE + EXPERTS, "mlp.experts.linear_fc1.weight")
    assert kind == "experts_fc1" and fc1.module == "model.layers.2.experts" and fc1.part == "gate_up_proj"
    assert (fc1.rows, fc1.cols, fc1.r, fc1.scaling) == (2 * WIDTH, 64, R, ALPHA / R)      # rank r: no conversion
    assert repr(fc1.b_layout) == repr(PartsSplit((WIDTH, WIDTH))) and isinstance(fc1.a_layout, Replicated)
    assert fc1.a_tp_sum
    kind, (fc2,) = slots(EXPERTS, "mlp.experts.linear_fc2.weight")
    assert kind == "experts_fc2" and (fc2.rows, fc2.cols, fc2.r) == (64, WIDTH, R) and repr(fc2.a_layout) == repr(Split(1))
    assert slots(["gate_up_proj"], "mlp.experts.linear_fc1.weight")[0] == "experts_fc1"   # names nothing else
    # a bare down_proj (PEFT's target_modules) is the dense MLP's; a regex never reaches the experts
    assert slots(["down_proj"], "mlp.experts.linear_fc2.weight") is None
    assert slots(["down_proj"], "mlp.linear_fc2.weight")[0] == "row"
    assert slots(r".*\.experts\..*", "mlp.experts.linear_fc1.weight") is None
    assert slots(DENSE, "mlp.experts.linear_fc1.weight") is None
    with pytest.raises(ValueError, match="routed expert"):       # PEFT names no pattern key on the experts
        layer_slots(spec, entries["layers.2.mlp.experts.linear_fc1.weight"],
                    LoraConfig(R, ALPHA, EXPERTS, rank_pattern={"gate_up_proj": 8}), tp=2, sp=False)
    with pytest.raises(ValueError, match="router.proj"):
        slots(EXPERTS + ["router.proj"], "mlp.experts.linear_fc1.weight")

    class Chunk:
        table = family.table
    Chunk.spec = spec
    leaves = _expert_leaves(Chunk)       # PEFT's target_parameters (either spelling) -> parallm's names
    assert leaves["down_proj"] == leaves["experts.down_proj"] == ["experts.down_proj"]


def test_reference_gate_up_order_matters(tmp_path):
    """PEFT's logits with the experts' gate_up B rows [gate; up] swapped move far beyond the spawned cases'
    tolerance: the cases see the row order (the gate_up_rows TP split of B)."""
    ckpt, adapter, batch, ref, base, start = _reference(tmp_path)
    swapped = copy.deepcopy(start)
    with torch.no_grad():
        for name, p in swapped.named_parameters():
            if name.endswith("experts.base_layer.lora_B.default.weight"):        # [2 I, r E]: gate_up's B
                p.copy_(torch.cat([p[WIDTH:], p[:WIDTH]]))
    assert helpers.max_diff_real(_hf_logits(swapped, batch), ref["logits"], batch[1]) > 1e-2


def _cases(rank, world, ckpt, adapter, batch, tmp):
    import parallm
    results = {}
    for name, env, kw, build in (("tp2 ep2", "auto", dict(tp=2, ep=2), {}),
                                 ("tp2 ep2 loop", "loop", dict(tp=2, ep=2), {}),
                                 ("tp2 ep2 packed+SP", "auto", dict(tp=2, ep=2),
                                  dict(packed=True, sequence_parallel=True)),
                                 ("ep2 dp4", "auto", dict(ep=2), {})):
        os.environ["PARALLM_MOE_EXPERTS"] = env
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, build)
        out = _check_run(rank, chunks, batch, dp_slice=dp_rows(batch))
        if name == "tp2 ep2":
            _merged_and_saved(chunks, out, os.path.join(tmp, "saved"))
        results[name] = out
        parallm.destroy_parallel()
    os.environ.pop("PARALLM_MOE_EXPERTS", None)
    parallm.init_parallel(tp=2, ep=2)         # the saved adapter back into a fresh model
    fresh = parallm.build_model(ckpt)
    parallm.load_hf_weights(fresh, ckpt)
    config = parallm.load_hf_adapter(fresh, os.path.join(tmp, "saved"))
    reloaded = dict(parallm.export_adapter_tensors(fresh))
    parallm.destroy_parallel()
    if rank == 0:
        results["reloaded"], results["reloaded_targets"] = reloaded, config.target_modules
    return results if rank == 0 else None


@pytest.mark.timeout(900)
def test_gemma4_expert_lora_against_peft(tmp_path):
    from safetensors.torch import load_file

    from parallm.checkpoint.lora_io import CONFIG_NAME, WEIGHTS_NAME
    ckpt, adapter, batch, ref, base, _ = _reference(tmp_path)
    after = ref["after"]
    # PEFT's names: the dense MLP beside the experts, the experts' stacked factors (gate_up inner), rank r each
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in after
    assert after["base_model.model.model.layers.0.experts.base_layer.lora_A.weight"].shape == (4 * R, 64)
    assert after["base_model.model.model.layers.0.experts.base_layer.lora_B.weight"].shape == (2 * WIDTH, R * 4)
    assert after["base_model.model.model.layers.0.experts.lora_A.weight"].shape == (4 * R, WIDTH)
    res = helpers.run_ranks(_cases, 4, ckpt, adapter, batch, str(tmp_path), timeout=800)[0]
    for name in ("tp2 ep2", "tp2 ep2 loop", "tp2 ep2 packed+SP", "ep2 dp4"):
        out = res[name]
        print(f"\n{name}: logits {helpers.max_diff_real(out['logits'], ref['logits'], batch[1]):.1e}, loss "
              f"{abs(out['loss'] - ref['loss']):.1e}, step factors "
              f"{max((out['after'][k] - after[k]).abs().max().item() for k in after):.1e}")
        _assert_case(out, ref, batch[1], name)
    ours = load_file(str(tmp_path / "saved" / WEIGHTS_NAME))
    theirs = load_file(os.path.join(adapter, WEIGHTS_NAME))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    _assert_close_dict(ours, after, 1e-5, "saved adapter")
    assert all(torch.equal(res["reloaded"][k], ours[k]) for k in ours)         # bit-exact back into parallm
    assert set(EXPERTS) <= set(res["reloaded_targets"]) and "down_proj" in res["reloaded_targets"]
    with open(tmp_path / "saved" / CONFIG_NAME) as f:
        saved_config = json.load(f)
    assert sorted(saved_config["target_parameters"]) == sorted(EXPERTS) and not saved_config["rank_pattern"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "saved"))
    stepped = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    peft.set_peft_model_state_dict(stepped, ours)
    assert torch.equal(_hf_logits(loaded, batch), _hf_logits(stepped, batch))
    merged_hub = helpers.hub_state_dict(copy.deepcopy(stepped).merge_and_unload(), str(tmp_path / "merged_ref"))
    from parallm.families import spec_from_config
    from parallm.model.table import all_entries, stack_experts, stacked_saves
    spec, family = spec_from_config(base.config)
    stacked = stacked_saves(all_entries(family.table, spec, task="causal_lm", pp=1))
    _assert_close_dict(stack_experts(res["tp2 ep2"]["merged"], stacked), merged_hub, 1e-6, "merged export")
