"""LoRA on Nemotron-H (Mamba-2 ``in_proj``, attention q/k/v/o, the dense MLP's and the shared expert's up / down)
against transformers + PEFT 0.21, with :mod:`test_lora`'s checks: PEFT's adapter (A and B non-zero) loaded by
``parallm.load_hf_adapter``; logits with adapters on and off; one token-mean AdamW step (the updated factors in
PEFT's names against PEFT's after ``torch.optim.AdamW``), the frozen base unchanged. One 2-rank spawn: a MoE
pattern (``ME*ME``: routed experts take no adapter, as PEFT leaves transformers' stacked experts) at tp2 padded
and tp2 packed + SP. ``out_proj`` is refused, as PEFT refuses it on Mamba models.
"""

from __future__ import annotations

import copy

import peft
import pytest

import helpers
from test_lora import ALPHA, R, _adapted, _assert_case, _check_run, _randomize_adapter, peft_step
from test_nemotron_h import MOE_PATTERN, make_model, nemotron_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj")


def _reference(tmp):
    base = make_model(nemotron_config(MOE_PATTERN), seed=3)
    ckpt = helpers.save_checkpoint(base, str(tmp / "ckpt"))
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    _randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(101, batch=4, seq=19)
    ref = peft_step(model, base, ids, mask)
    return ckpt, adapter, (ids, mask), ref


def _cases(rank, world, ckpt, adapter, batch):
    import parallm
    out = {}
    for name, build in (("tp2", {}), ("tp2 packed+SP", dict(packed=True, sequence_parallel=True))):
        parallm.init_parallel(tp=2)
        out[name] = _check_run(rank, _adapted(ckpt, adapter, build), batch)
        parallm.destroy_parallel()
    parallm.init_parallel(tp=2)
    try:
        parallm.build_model(ckpt, lora=parallm.LoraConfig(R, ALPHA, ("out_proj",)))
    except ValueError as e:
        out["out_proj"] = str(e)
    parallm.destroy_parallel()
    return out if rank == 0 else None


@pytest.mark.timeout(400)
def test_nemotron_h_lora_against_peft(tmp_path):
    ckpt, adapter, batch, ref = _reference(tmp_path)
    names = set(ref["after"])
    assert any(".mixer.in_proj.lora_B" in k for k in names) and any(".shared_experts.up_proj." in k for k in names)
    assert not any(".experts.lora" in k or ".experts.base_layer" in k for k in names)
    res = helpers.run_ranks(_cases, 2, ckpt, adapter, batch, timeout=380)[0]
    for name in ("tp2", "tp2 packed+SP"):
        _assert_case(res[name], ref, batch[1], name)
    assert "PEFT refuses out_proj" in res["out_proj"]
