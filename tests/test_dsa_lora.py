"""LoRA on DeepSeek Sparse Attention models (GLM-5 with shared indexer layers) against transformers + PEFT: every
MLA projection and the routed experts adapted, the indexer frozen (never adapted: it runs without gradient in
transformers). Sequences of 48 tokens, index_topk 16: the sparse path with kv_b_proj's adapter folded into the
latent-space weights. tp2 padded and tp2 packed + sequence parallel: logits with / without the adapters, one
token-mean AdamW step (every factor after it), the base untouched."""

from __future__ import annotations

import copy

import helpers
import peft
import pytest
import torch
from test_dsa_parts import glm5_config, topk_margin
from test_lora import (
    ALPHA,
    EPS,
    LR,
    WD,
    R,
    _adapted,
    _assert_case,
    _check_run,
    _peft_state,
    _randomize_adapter,
    token_nll,
)

TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def reference(tmp):
    import parallm
    cfg = glm5_config(num_hidden_layers=2, index_topk_freq=2, index_skip_topk_offset=1)   # [full, shared]
    base = helpers.make_hf_model(cfg, seed=0)
    ckpt = helpers.save_checkpoint(base, str(tmp / "ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                      target_modules=list(TARGETS), lora_dropout=0.0))
    _randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=4, seq=48)
    assert topk_margin(model, ids, mask) >= 1e-5             # no top-k near-tie (test_dsa.batch_without_near_ties)
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        base_logits = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    before = _peft_state(model)
    assert not any(".indexer." in k for k in before) and any("kv_b_proj" in k for k in before)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)
    total, count = token_nll(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids, mask)
    (total / count).backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9).item()
    opt.step()
    return ckpt, adapter, (ids, mask), dict(logits=logits, base_logits=base_logits, before=before,
                                            after=_peft_state(model), loss=(total / count).item(), norm=norm)


def rank_cases(rank, world, ckpt, adapter, batch):
    import parallm
    out = {}
    for name, build in (("tp2", {}), ("tp2_packed_sp", dict(packed=True, sequence_parallel=True))):
        parallm.init_parallel(tp=2)
        chunks = _adapted(ckpt, adapter, build)
        assert not any(".indexer." in n for c in chunks for n, p in c.named_parameters() if p.requires_grad)
        out[name] = _check_run(rank, chunks, batch)
        parallm.destroy_parallel()
    return out if rank == 0 else None


@pytest.mark.timeout(400)
def test_dsa_lora_against_peft(tmp_path):
    ckpt, adapter, batch, ref = reference(tmp_path)
    res = helpers.run_ranks(rank_cases, 2, ckpt, adapter, batch, timeout=380)[0]
    for name, out in res.items():
        _assert_case(out, ref, batch[1], name)
