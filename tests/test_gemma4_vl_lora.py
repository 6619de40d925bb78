"""LoRA on the ``gemma4`` wrapper (``Gemma4ForConditionalGeneration``, family ``gemma4_vl``: parallm trains its
language model, the towers carried) against transformers 5.25 + PEFT 0.21 (docs/lora.md, "The gemma4 wrapper").

The wrapper's vision (and audio) towers have ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` / ``gate_proj`` /
``up_proj`` / ``down_proj`` too (``Gemma4ClippableLinear``, on which PEFT's LoRA fails: asserted), so PEFT adapts
the language model alone only with ``exclude_modules`` (parallm's :data:`GEMMA4_VL_PEFT_EXCLUDE`), which
parallm's saved ``adapter_config.json`` carries. The model: test_gemma4_moe.py's text config (4 layers, K = V
global layers, the MoE block) under a 1-layer vision tower (no audio tower: see wrapper_model); targets the seven
projections and the routed experts (``target_parameters``). One 2-rank spawn: tp2 and ep2 (dp2, each replica half
the batch) with test_lora.py's checks (logits with adapters on / off, one AdamW step's factors, the base frozen;
the gradient norm against PEFT's float64 one);
the tp2 save has PEFT's names (``model.language_model.layers...``), none under a tower, ``exclude_modules`` in its
config, ``PeftModel.from_pretrained`` on the wrapper runs it as PEFT's own state, and parallm reads it back bit for
bit.
"""

from __future__ import annotations

import copy
import json
import os

import peft
import pytest
import torch

import helpers
from test_gemma4_features import VISION
from test_gemma4_lora_experts import DENSE, EXPERTS
from test_gemma4_moe import moe_config
from test_lora import (ALPHA, R, _adapted, _assert_case, _assert_close_dict, _check_run, _hf_logits, _randomize_adapter,
                       token_nll, dp_rows, peft_step)

def wrapper_model(seed: int):
    """The wrapper over test_gemma4_moe.py's text config (router scaled as there) and a 1-layer vision tower (no
    audio tower: its clipped linears' 0-d ``input_min`` / ``input_max`` tensors, carried, fail parallm's loader;
    docs/families.md, "Gemma 4")."""
    import transformers
    cfg = transformers.Gemma4Config(text_config=moe_config().to_dict(), vision_config=VISION, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(cfg)
    helpers.randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():
            if "language_model" not in name:
                continue
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
            elif name.endswith("router.proj.weight"):
                p.mul_(40.0)
            elif name.endswith("router.scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model.eval()


def _peft_config(**kw):
    from parallm.model.layers.lora_gemma4 import GEMMA4_VL_PEFT_EXCLUDE
    return peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(DENSE), target_parameters=list(EXPERTS),
                           lora_dropout=0.0, **dict(dict(exclude_modules=GEMMA4_VL_PEFT_EXCLUDE), **kw))


def _reference(tmp):
    base = wrapper_model(9)
    ckpt = helpers.save_checkpoint(base, str(tmp / "ckpt"))
    model = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    _randomize_adapter(model, 7)
    adapter = str(tmp / "adapter")
    model.save_pretrained(adapter)
    ids, mask = helpers.padded_batch(101, batch=4, seq=12, seed=3)
    ref = dict(peft_step(model, base, ids, mask), norm64=_norm64(base, adapter, ids, mask))
    return ckpt, adapter, (ids, mask), ref, base


def _norm64(base, adapter, ids, mask) -> float:
    """PEFT's gradient norm of the token-mean loss in float64 (transformers' experts on its eager loop: the
    grouped GEMM takes no float64)."""
    import parallm
    base = copy.deepcopy(base).double()
    for m in base.modules():
        if hasattr(getattr(m, "config", None), "_experts_implementation"):
            m.config._experts_implementation = "eager"
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True).double()
    total, count = token_nll(model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask))
                             .logits, ids, mask)
    (total / count).backward()
    return torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.requires_grad)).item()


def _cases(rank, world, ckpt, adapter, batch, tmp):
    import parallm
    results = {}
    for name, kw in (("tp2", dict(tp=2)), ("ep2 dp2", dict(ep=2))):
        parallm.init_parallel(**kw)
        chunks = _adapted(ckpt, adapter, {})
        out = _check_run(rank, chunks, batch, dp_slice=dp_rows(batch))
        if name == "tp2":
            parallm.save_hf_adapter(chunks, os.path.join(tmp, "saved"), overwrite=True)
        results[name] = out
        parallm.destroy_parallel()
    parallm.init_parallel(tp=2)              # the saved adapter back into a fresh model
    fresh = parallm.build_model(ckpt)
    parallm.load_hf_weights(fresh, ckpt)
    parallm.load_hf_adapter(fresh, os.path.join(tmp, "saved"))
    reloaded = dict(parallm.export_adapter_tensors(fresh))
    parallm.destroy_parallel()
    if rank == 0:
        results["reloaded"] = reloaded
    return results if rank == 0 else None


def test_peft_needs_the_exclusion():
    """Without the exclusion PEFT's names reach the towers' projections, whose wrapper PEFT cannot adapt."""
    base = wrapper_model(9)
    with pytest.raises(ValueError, match="Gemma4ClippableLinear"):
        peft.get_peft_model(copy.deepcopy(base), _peft_config(exclude_modules=None))
    model = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    names = {k.split(".lora_")[0] for k in peft.get_peft_model_state_dict(model)}
    assert names and all(k.startswith("base_model.model.model.language_model.layers.") for k in names), names


@pytest.mark.timeout(600)
def test_gemma4_wrapper_lora_against_peft(tmp_path):
    from safetensors.torch import load_file

    from parallm.checkpoint.lora_io import CONFIG_NAME, WEIGHTS_NAME
    from parallm.model.layers.lora_gemma4 import GEMMA4_VL_PEFT_EXCLUDE
    ckpt, adapter, batch, ref, base = _reference(tmp_path)
    after = ref["after"]
    assert "base_model.model.model.language_model.layers.1.experts.base_layer.lora_B.weight" in after
    assert not any("tower" in k or "embed_" in k for k in after)
    res = helpers.run_ranks(_cases, 2, ckpt, adapter, batch, str(tmp_path), timeout=500)[0]
    for name in ("tp2", "ep2 dp2"):
        out = res[name]
        print(f"\n{name}: logits {helpers.max_diff_real(out['logits'], ref['logits'], batch[1]):.1e}, loss "
              f"{abs(out['loss'] - ref['loss']):.1e}, step factors "
              f"{max((out['after'][k] - after[k]).abs().max().item() for k in after):.1e}, grad norm "
              f"{abs(out['norm'] - ref['norm64']) / ref['norm64']:.1e} from PEFT's float64 (PEFT's fp32 "
              f"{abs(ref['norm'] - ref['norm64']) / ref['norm64']:.1e})")
        # the gradient norm against PEFT's float64 one, within 2 x PEFT's own fp32 distance to it (measured 9.8e-6
        # relative: Gemma 4's softmax scale 1 rounds gradients at ~1e-5; ep2 dp2 was 1.2e-5 from PEFT's fp32 norm
        # and 2.5e-6 from the float64 one); the rest of test_lora.py's checks as they are
        own = abs(ref["norm"] - ref["norm64"]) / ref["norm64"]
        assert abs(out["norm"] - ref["norm64"]) <= max(1e-5, 2 * own) * ref["norm64"], (name, out["norm"], ref)
        _assert_case(out, dict(ref, norm=out["norm"]), batch[1], name)
    ours = load_file(str(tmp_path / "saved" / WEIGHTS_NAME))
    theirs = load_file(os.path.join(adapter, WEIGHTS_NAME))
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    _assert_close_dict(ours, after, 1e-5, "saved adapter")
    assert all(torch.equal(res["reloaded"][k], ours[k]) for k in ours)
    with open(tmp_path / "saved" / CONFIG_NAME) as f:
        saved_config = json.load(f)
    assert saved_config["exclude_modules"] == GEMMA4_VL_PEFT_EXCLUDE
    assert sorted(saved_config["target_parameters"]) == sorted(EXPERTS)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "saved"))
    assert {k.split(".lora_")[0] for k in peft.get_peft_model_state_dict(loaded)} == \
        {k.split(".lora_")[0] for k in ours}            # PEFT adapts exactly what parallm did
    stepped = peft.get_peft_model(copy.deepcopy(base), _peft_config())
    peft.set_peft_model_state_dict(stepped, ours)
    assert torch.equal(_hf_logits(loaded, batch), _hf_logits(stepped, batch))
