"""gpt-oss LoRA against transformers + PEFT 0.21 (the harness of tests/test_lora.py).

PEFT adapts gpt-oss's attention through ``target_modules`` (q / k / v / o_proj: nn.Linear with biases) and its
stacked experts through ``target_parameters=["gate_up_proj", "down_proj"]`` (a ``ParamWrapper`` per stacked
parameter, rank ``r`` each; the sinks, the router and the expert biases get nothing). parallm takes the same as
``LoraConfig(target_modules=(q, k, v, o, "gate_up_proj", "down_proj"))``. One 4-rank spawn: tp2 x ep2 (dp2, each
replica half the batch, token-mean AdamW) on the grouped GEMM and on the loop, and tp2 x ep2 packed + SP; per case
logits with and without the adapters, the step's factors against PEFT's, the base untouched; the saved adapter
has PEFT's names and shapes and ``PeftModel.from_pretrained`` runs it; the merged export equals PEFT's
``merge_and_unload`` (gate_up's update transposed into ``[H, 2 I]``)."""

from __future__ import annotations

import copy
import os

import peft
import pytest
import torch

import helpers
from test_gpt_oss_parts import gpt_oss_config
from test_lora import (ALPHA, R, _adapted, _assert_case, _assert_close_dict, _check_run, _hf_logits, _merged_and_saved,
                       _randomize_adapter, dp_rows, peft_step)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["gate_up_proj", "down_proj"]


def _peft_config():
    return peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(ATTENTION), target_parameters=list(EXPERTS),
                           lora_dropout=0.0)


def _reference(tmp):
    """(checkpoint, adapter dir, batch, reference dict, base model): PEFT on a tiny gpt-oss, A and B random."""
    base = helpers.make_hf_model(gpt_oss_config(), seed=0)
    ckpt = helpers.save_checkpoint(base, str(tmp / "gpt_oss_ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    _randomize_adapter(model, 7)
    adapter = str(tmp / "gpt_oss_adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(base.config.vocab_size, batch=4, seq=12)
    ref = peft_step(model, base, ids, mask)
    return ckpt, adapter, (ids, mask), ref, base


def _cases(rank, world, ckpt, adapter, batch, tmp):
    import parallm
    results = {}
    for name, env, build in (("tp2_ep2", "auto", {}), ("tp2_ep2_loop", "loop", {}),
                             ("tp2_ep2_sp", "auto", dict(packed=True, sequence_parallel=True))):
        os.environ["PARALLM_MOE_EXPERTS"] = env
        parallm.init_parallel(tp=2, ep=2)
        chunks = _adapted(ckpt, adapter, build)
        out = _check_run(rank, chunks, batch, dp_slice=dp_rows(batch))
        if name == "tp2_ep2":
            _merged_and_saved(chunks, out, os.path.join(tmp, "saved"))
        results[name] = out
        parallm.destroy_parallel()
    os.environ.pop("PARALLM_MOE_EXPERTS", None)
    return results if rank == 0 else None


@pytest.mark.timeout(900)
def test_gpt_oss_lora_attention_and_experts_against_peft(tmp_path):
    from safetensors.torch import load_file

    from parallm.checkpoint.lora_io import CONFIG_NAME, WEIGHTS_NAME
    ckpt, adapter, batch, ref, base = _reference(tmp_path)
    # PEFT's names: the experts' stacked factors (gate_up the inner wrapper), rank r each
    assert ref["after"]["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (4 * R, 64)
    assert ref["after"]["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape == (64, R * 4)
    res = helpers.run_ranks(_cases, 4, ckpt, adapter, batch, str(tmp_path))[0]
    for name in ("tp2_ep2", "tp2_ep2_loop", "tp2_ep2_sp"):
        _assert_case(res[name], ref, batch[1], name)
    ours = load_file(str(tmp_path / "saved" / WEIGHTS_NAME))
    theirs = load_file(os.path.join(adapter, WEIGHTS_NAME))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    _assert_close_dict(ours, ref["after"], 1e-5, "saved adapter")
    import json
    with open(tmp_path / "saved" / CONFIG_NAME) as f:
        saved_config = json.load(f)
    assert sorted(saved_config["target_parameters"]) == sorted(EXPERTS) and not saved_config["rank_pattern"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "saved"))
    stepped = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    peft.set_peft_model_state_dict(stepped, ours)
    assert torch.equal(_hf_logits(loaded, batch), _hf_logits(stepped, batch))
    merged_ref = copy.deepcopy(stepped).merge_and_unload()
    merged_hub = helpers.hub_state_dict(merged_ref, str(tmp_path / "merged_ref"))
    # the export stream names each expert's tensors; stacked they are the checkpoint's
    from parallm.families import spec_from_config
    from parallm.model.table import all_entries, stack_experts, stacked_saves
    spec, family = spec_from_config(base.config)
    stacked = stacked_saves(all_entries(family.table, spec, task="causal_lm", pp=1))
    _assert_close_dict(stack_experts(res["tp2_ep2"]["merged"], stacked), merged_hub, 1e-6, "merged export")
