"""LoRA on Kimi-K2.5 / K2.6 (``KimiK25ForConditionalGeneration``, INT4 routed experts) against PEFT 0.21 on
transformers 5.25's wrapper over the dequantised checkpoint (issue 57, item 5): PEFT adapts the language
model's latent attention and its dense / shared-expert MLPs (the routed experts are stacked tensors there, which
it leaves alone, as parallm does); parallm loads the PEFT directory onto the INT4 checkpoint at tp2: logits with
and without the adapters, one AdamW step of the factors (loss, gradient norm, every factor after it), as
tests/test_lora.py checks every other family. The adapter names follow transformers' in-memory module paths
(``model.language_model.layers...``), which the family's ``peft_renames`` map to the checkpoint's
``language_model.model.*``."""

from __future__ import annotations

import copy

import pytest
import torch

import helpers
import test_lora
from test_kimi_k25 import kimi_checkpoint, load_reference

peft = pytest.importorskip("peft")

TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _reference(tmp):
    import parallm
    int4_dir, deq_dir, _, _ = kimi_checkpoint(tmp, 11, group=32, symmetric=True, in_text=True)
    base = load_reference(deq_dir)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=test_lora.R, lora_alpha=test_lora.ALPHA,
                                                                      target_modules=list(TARGETS),
                                                                      lora_dropout=0.0))
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A")]
    assert adapted and all(".language_model." in n for n in adapted), [n for n in adapted if "language" not in n]
    test_lora._randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(base.config.text_config.vocab_size, batch=4, seq=12)
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        base_logits = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    before = test_lora._peft_state(model)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=test_lora.LR, eps=test_lora.EPS, weight_decay=test_lora.WD)
    total, count = test_lora.token_nll(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids,
                                       mask)
    (total / count).backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9).item()
    opt.step()
    ref = dict(logits=logits, base_logits=base_logits, before=before, after=test_lora._peft_state(model),
               loss=(total / count).item(), norm=norm)
    return int4_dir, adapter, (ids, mask), ref


@pytest.mark.timeout(900)
def test_kimi_k25_lora_against_peft_tp2(tmp_path):
    ckpt, adapter, batch, ref = _reference(tmp_path)
    res = helpers.run_ranks(test_lora._family_cases, 2, {"kimi_k25": (ckpt, adapter, batch)})[0]
    test_lora._assert_case(res["kimi_k25"], ref, batch[1], "kimi_k25")
    assert any("language_model" in k and ".mlp.gate_proj.lora_A" in k for k in ref["after"])
    assert any(".self_attn.kv_b_proj.lora_B" in k for k in ref["after"])
