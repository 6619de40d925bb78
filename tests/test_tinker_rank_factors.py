"""integrations/tinker/ranks.py on its own (main suite, no server): a rank-R PEFT factor cut to rank r and padded
back, against the layout written out directly: dense A ``[r, in]`` / B ``[out, r]``; routed experts stacked as
PEFT stacks them (A rows expert-major ``[E r, in]``, B columns ``k E + e``), their fused gate/up at ``2 r``; and a
PEFT directory's round trip (config ``r`` and the experts' ``rank_pattern``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from parallm.integrations.tinker.ranks import cut_factor, pad_factor, pad_peft_dir, shrink_peft_dir

E, BIG, R = 4, 8, 3


def _stack(parts, which):
    """Per-expert factors as PEFT stacks them (written out, not parallm's code)."""
    if which == "A":
        return torch.cat(parts, 0)
    out = torch.empty(parts[0].shape[0], parts[0].shape[1] * len(parts))
    for e, p in enumerate(parts):
        for k in range(p.shape[1]):
            out[:, k * len(parts) + e] = p[:, k]
    return out


def _held(shape, keep, dim):
    """A rank-BIG factor whose entries beyond ``keep`` (along the rank dim) are zero."""
    t = torch.randn(shape)
    if dim == 0:
        t[keep:] = 0
    else:
        t[:, keep:] = 0
    return t


@pytest.mark.parametrize("kind", ["dense", "experts_down", "experts_gate_up"])
def test_cut_and_pad_against_the_layout(kind):
    torch.manual_seed(0)
    mult = 2 if kind == "experts_gate_up" else 1
    held, keep = BIG * mult, R * mult
    prefix = {"dense": "base_model.model.model.layers.0.self_attn.q_proj",
              "experts_down": "base_model.model.model.layers.0.mlp.experts",
              "experts_gate_up": "base_model.model.model.layers.0.mlp.experts.base_layer"}[kind]
    n = 1 if kind == "dense" else E
    a_parts = [_held((held, 16), keep, 0) for _ in range(n)]
    b_parts = [_held((12, held), keep, 1) for _ in range(n)]
    a_big, b_big = _stack(a_parts, "A"), _stack(b_parts, "B")
    a_want, b_want = _stack([p[:keep] for p in a_parts], "A"), _stack([p[:, :keep] for p in b_parts], "B")
    kw = {"rank": R, "big": BIG, "num_experts": E}
    a_cut = cut_factor(prefix + ".lora_A.weight", a_big, **kw)
    b_cut = cut_factor(prefix + ".lora_B.weight", b_big, **kw)
    assert torch.equal(a_cut, a_want) and torch.equal(b_cut, b_want)
    assert torch.equal(pad_factor(prefix + ".lora_A.weight", a_cut, **kw), a_big)
    assert torch.equal(pad_factor(prefix + ".lora_B.weight", b_cut, **kw), b_big)


def test_peft_directory_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file
    src, small, back = (str(tmp_path / x) for x in ("big", "small", "back"))
    os.makedirs(src)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _held((BIG, 16), R, 0),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": _held((12, BIG), R, 1),
               "base_model.model.model.layers.0.mlp.experts.lora_A.weight": _held((E * BIG, 16), E * BIG, 0),
               "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight": _held((12, 2 * BIG * E),
                                                                                               2 * BIG * E, 1)}
    for name in list(tensors):              # the experts' entries beyond r, per expert, zero
        t = tensors[name]
        if ".experts." in name and ".lora_A." in name:
            t.view(E, BIG, 16)[:, R:] = 0
        elif ".experts." in name:
            t.view(12, 2 * BIG, E)[:, 2 * R:] = 0
    save_file(tensors, os.path.join(src, "adapter_model.safetensors"))
    config = {"r": BIG, "lora_alpha": 32, "rank_pattern": {r".*\.gate_up_proj": 2 * BIG}, "peft_type": "LORA"}
    with open(os.path.join(src, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    shrink_peft_dir(src, small, rank=R, big=BIG, num_experts=E)
    with open(os.path.join(small, "adapter_config.json")) as f:
        got = json.load(f)
    assert got["r"] == R and got["lora_alpha"] == 32 and got["rank_pattern"] == {r".*\.gate_up_proj": 2 * R}
    shapes = {k: tuple(v.shape) for k, v in load_file(os.path.join(small, "adapter_model.safetensors")).items()}
    assert shapes == {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (R, 16),
                      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (12, R),
                      "base_model.model.model.layers.0.mlp.experts.lora_A.weight": (E * R, 16),
                      "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight": (12, 2 * R * E)}
    assert pad_peft_dir(small, back, big=BIG, num_experts=E) == R
    again = load_file(os.path.join(back, "adapter_model.safetensors"))
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    with open(os.path.join(back, "adapter_config.json")) as f:
        assert json.load(f) == config
    with pytest.raises(ValueError, match="rank <= 2"):
        pad_peft_dir(small, back, big=2, num_experts=E)
