"""LoRA on Gemma 4 against transformers + PEFT 0.21 (docs/families.md "Gemma 4"), with :mod:`test_lora`'s checks:
PEFT's adapter (A and B non-zero) loaded by ``parallm.load_hf_adapter``; logits with adapters on and off; one
token-mean AdamW step (the updated factors in PEFT's names against PEFT's), the frozen base unchanged.

The model is test_gemma4_layouts.py's: every Gemma 4 feature at once (8 layers; the full layers' own head shape, 32
over 1 KV head, with K = V: q_proj / k_proj only there; per-layer inputs; layers 6 / 7 sharing layers 4 / 5's
keys and values: q_proj only there, double-wide MLPs; the MoE block on every layer). Targets q/k/v/o_proj and
gate/up/down_proj: PEFT adapts each layer's dense MLP (nn.Linear) and not the stacked routed experts (no
nn.Linear; no conversion pattern for gemma4 in PEFT 0.21), and so does parallm. One 2-rank spawn: tp2 padded and
tp2 packed + SP (at tp2 the global layers' one KV head is replicated). "all-linear" is refused, naming the
per-layer inputs' linears and the router's ``proj`` that PEFT's "all-linear" would adapt too.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import helpers
from test_gemma4_layouts import moe_model
import test_lora
from test_lora import ALPHA, EPS, LR, R, WD, _adapted, _assert_case, _check_run, _peft_state, _randomize_adapter, \
    token_nll

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _reference(tmp):
    import parallm
    base = moe_model(5)
    with torch.no_grad():       # softer attention (q / k norm gains around 0.25): see _spread
        for name, p in base.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
    ckpt = helpers.save_checkpoint(base, str(tmp / "ckpt"))
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    _randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(101, batch=4, seq=12, seed=3)
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        base_logits = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    before = _peft_state(model)
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)
    total, count = token_nll(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids, mask)
    (total / count).backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9).item()
    opt.step()
    ref = dict(logits=logits, base_logits=base_logits, before=before, after=_peft_state(model),
               loss=(total / count).item(), norm=norm, spread=_spread(model, ids, mask, pos))
    return ckpt, adapter, (ids, mask), ref


def _spread(model, ids, mask, pos) -> float:
    """transformers' own spread: the adapted model's logits under its eager and sdpa attention. The softmax scale 1
    over 8 layers with random adapters amplifies rounding: with test_gemma4_features.py's q / k norm gains (around
    0.5) transformers' own spread was 1.0e-5 to 1.5e-5 and parallm's logits 2.1e-5 from PEFT's; the base here halves
    the gains again."""
    out = []
    for impl in ("eager", "sdpa"):
        model = copy.deepcopy(model)
        for m in model.modules():
            if getattr(getattr(m, "config", None), "_attn_implementation", None) is not None:
                m.config._attn_implementation = impl
        with torch.no_grad():
            out.append(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits)
    return helpers.max_diff_real(out[0], out[1], mask)


def _cases(rank, world, ckpt, adapter, batch):
    import parallm
    out = {}
    for name, build in (("tp2", {}), ("tp2 packed+SP", dict(packed=True, sequence_parallel=True))):
        parallm.init_parallel(tp=2)
        out[name] = _check_run(rank, _adapted(ckpt, adapter, build), batch)
        parallm.destroy_parallel()
    parallm.init_parallel(tp=2)
    for key, targets in (("all-linear", "all-linear"), ("named", ("q_proj", "per_layer_input_gate"))):
        try:
            parallm.build_model(ckpt, lora=parallm.LoraConfig(R, ALPHA, targets))
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    parallm.destroy_parallel()
    return out if rank == 0 else None


@pytest.mark.timeout(600)
def test_gemma4_lora_against_peft(tmp_path):
    ckpt, adapter, batch, ref = _reference(tmp_path)
    names = set(ref["after"])
    assert any(".layers.1.self_attn.k_proj.lora_B" in k for k in names)          # K = V: k_proj, no v_proj
    assert not any(".layers.1.self_attn.v_proj." in k for k in names)
    assert not any(".layers.6.self_attn.k_proj." in k for k in names)          # KV sharing: q_proj alone
    assert any(".layers.6.mlp.gate_proj.lora_A" in k for k in names)           # the dense MLP beside the experts
    assert not any(".experts." in k or ".router." in k for k in names)
    res = helpers.run_ranks(_cases, 2, ckpt, adapter, batch, timeout=500)[0]
    tol = max(test_lora.LOGIT_TOL, 2 * ref["spread"])       # the logits: within 2 x transformers' own spread
    print(f"\ntransformers' eager vs sdpa: {ref['spread']:.1e}; logits tolerance {tol:.1e}")
    for name in ("tp2", "tp2 packed+SP"):
        print(f"{name}: logits {helpers.max_diff_real(res[name]['logits'], ref['logits'], batch[1]):.1e} (base "
              f"{helpers.max_diff_real(res[name]['base_logits'], ref['base_logits'], batch[1]):.1e}), "
              f"loss {abs(res[name]['loss'] - ref['loss']):.1e}, step factors "
              f"{max((res[name]['after'][k] - ref['after'][k]).abs().max().item() for k in ref['after']):.1e}")
        bad = sorted((k for k in ref["after"] if (res[name]["after"][k] - ref["after"][k]).abs().max() > 1e-5))
        print("  factors off:", bad[:12], len(bad))
        saved, test_lora.LOGIT_TOL = test_lora.LOGIT_TOL, tol
        try:
            _assert_case(res[name], ref, batch[1], name)
        finally:
            test_lora.LOGIT_TOL = saved
    for key in ("all-linear", "named"):
        assert res[key] is not None and "per_layer_input_gate" in res[key] and "not supported" in res[key], res[key]
    assert "router.proj" in res["all-linear"], res["all-linear"]
