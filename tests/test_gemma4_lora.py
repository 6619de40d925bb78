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

The targets ``parallm serve-tinker`` gives Gemma 4 (those above and the tied ``lm_head``) on the dense model:
every factor's gradient of a summed next-token loss at tp2 against PEFT's in float64, within twice PEFT's own fp32
distance to its float64 gradients (this model rounds its gradients at ~1e-5 of their largest in transformers
itself: docs/families.md, "Tinker, Gemma 4's step"); a gradient 1e-3 off in one tensor must fail the check.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import helpers
from test_gemma4_features import make_model as dense_model
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


def _rel_error(got, want) -> float:
    """The worst factor's max |got - want| over its largest |want| (the factors whose gradient is not zero)."""
    return max(((got[k].double() - want[k]).abs().max() / want[k].abs().max()).item() for k in want
               if want[k].abs().max() > 0)


def _peft_grads(ckpt, adapter, dtype, ids, mask):
    """PEFT's gradient of every factor (the names save_pretrained writes) of the summed next-token NLL."""
    import parallm
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True).to(dtype)
    total, _ = token_nll(model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask))
                         .logits, ids, mask)
    total.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p.grad)
    return {k: v.double().clone() for k, v in peft.get_peft_model_state_dict(model).items() if ".lora_" in k}


def _summed_nll(logits, ids, mask):
    return token_nll(logits, ids, mask)[0], torch.tensor(1.0)


def _tp2_grads(rank, world, ckpt, adapter, targets, batch):
    """parallm's gradient of every factor in PEFT's names (the gradients exported as the factors)."""
    import parallm
    from parallm.model.layers.lora import chunk_lora_entries
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt, lora=parallm.LoraConfig(R, ALPHA, targets))
    parallm.load_hf_weights(chunks, ckpt)
    parallm.load_hf_adapter(chunks, adapter)
    parallm.forward_backward(chunks, *batch, loss_fn=_summed_nll)
    parallm.finalize_grads(chunks)
    with torch.no_grad():
        for e, c in chunk_lora_entries(chunks):
            p = c.get_parameter(e.local)
            grad = p.grad if getattr(p, "main_grad", None) is None else p.main_grad
            p.copy_(grad)
    out = dict(parallm.export_adapter_tensors(chunks))
    parallm.destroy_parallel()
    return out if rank == 0 else None


@pytest.mark.timeout(300)
def test_gemma4_lora_tied_head_gradients_against_float64(tmp_path):
    targets = list(TARGETS) + ["lm_head"]
    base = dense_model(5, tie_word_embeddings=True)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
    assert base.lm_head.weight is base.model.embed_tokens.weight and base.config.final_logit_softcapping == 0.5
    ckpt = helpers.save_checkpoint(base, str(tmp_path / "ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets,
                                                                     lora_dropout=0.0))
    _randomize_adapter(model, 7)
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(101, batch=4, seq=12, seed=3)
    f32 = _peft_grads(ckpt, adapter, torch.float32, ids, mask)
    f64 = _peft_grads(ckpt, adapter, torch.float64, ids, mask)
    assert {"base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"} <= set(f64)
    assert any(".layers.7.mlp.gate_proj.lora_A" in k for k in f64)         # the double-wide MLP of a shared layer
    got = helpers.run_ranks(_tp2_grads, 2, ckpt, adapter, targets, (ids, mask), timeout=240)[0]
    assert set(got) == set(f64), set(got) ^ set(f64)
    own, err = _rel_error(f32, f64), _rel_error(got, f64)
    tol = max(2 * own, 1e-6)
    print(f"\nGemma 4 LoRA gradients vs PEFT fp64: parallm tp2 {err:.1e}, PEFT fp32 {own:.1e} (tolerance {tol:.1e})")
    assert tol < 1e-4, tol          # the check stays sharp: a 1e-3 error in one tensor fails it (below)
    assert err <= tol, (err, tol)
    broken = dict(got, **{"base_model.model.lm_head.lora_B.weight": got["base_model.model.lm_head.lora_B.weight"] *
                          (1 + 1e-3)})
    assert _rel_error(broken, f64) > tol
