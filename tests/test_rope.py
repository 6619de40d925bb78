"""Parity tests for parallm.model.positions.rope against transformers' LLaMA rotary embedding."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from parallm.model.positions.rope import (
    SUPPORTED_ROPE_KINDS,
    RopeSpec,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    rope_spec_from_hf_config,
)

HIDDEN = 64
HEADS = 4
HEAD_DIM = 24  # deliberately != HIDDEN // HEADS (16)
MAX_POS = 64
THETA = 5e5

# llama3 band edges chosen so that, with HEAD_DIM=24 and THETA=5e5, the wavelengths fall
# in all three bands (high freq untouched, medium blended, low freq divided by factor).
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 3.0},  # 1/3 is inexact: catches x*(1/f) vs x/f
    "dynamic": {"rope_type": "dynamic", "factor": 2.5},
    "llama3": LLAMA3,
    # Gemma 4's global layers: 3 of the 12 frequencies rotate (over the whole head)
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
}


def _hf_config(kind: str, max_pos: int = MAX_POS) -> LlamaConfig:
    params = copy.deepcopy(SCALINGS[kind]) or {"rope_type": "default"}
    params["rope_theta"] = THETA
    return LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        intermediate_size=128,
        num_hidden_layers=1,
        vocab_size=100,
        max_position_embeddings=max_pos if kind != "llama3" else 4 * max_pos,
        rope_parameters=params,
    )


def _hf_cos_sin(config: LlamaConfig, position_ids: torch.Tensor):
    # A fresh module per call: HF dynamic rope keeps state between calls.
    rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        return rope(x, position_ids)


def _position_ids(max_pos: int, seed: int) -> torch.Tensor:
    """[3, S] position ids: left-padded rows (zeros then 0..n) and a shuffled row."""
    g = torch.Generator().manual_seed(seed)
    S = max_pos
    pad = 5
    row0 = torch.cat([torch.zeros(pad, dtype=torch.long), torch.arange(S - pad)])
    row1 = torch.arange(S)
    row1[-1] = max_pos - 1  # the max over the whole tensor is max_pos - 1
    row2 = torch.randperm(S, generator=g)
    return torch.stack([row0, row1, row2])


def _position_cases(kind: str):
    cases = [("below", _position_ids(40, 0))]
    if kind == "dynamic":
        cases += [
            ("at_max", _position_ids(MAX_POS, 1)),  # max+1 == max_position_embeddings: no NTK
            ("above", _position_ids(MAX_POS + 37, 2)),  # NTK branch
            ("far_above", _position_ids(5 * MAX_POS + 3, 3)),
        ]
    else:
        cases += [("long", _position_ids(300, 4))]
    return cases


def _spec(kind: str) -> RopeSpec:
    spec = rope_spec_from_hf_config(_hf_config(kind), head_dim=HEAD_DIM)
    assert spec.kind == kind
    assert spec.dim == HEAD_DIM
    return spec


@pytest.mark.parametrize("kind", SUPPORTED_ROPE_KINDS)
def test_cos_sin_match_transformers(kind):
    config = _hf_config(kind)
    spec = _spec(kind)
    for name, pos in _position_cases(kind):
        cos, sin = rope_cos_sin(spec, pos)
        hf_cos, hf_sin = _hf_cos_sin(config, pos)
        assert cos.dtype == torch.float32 and sin.dtype == torch.float32
        assert cos.shape == pos.shape + (HEAD_DIM,)
        assert torch.equal(cos, hf_cos), (kind, name, (cos - hf_cos).abs().max())
        assert torch.equal(sin, hf_sin), (kind, name, (sin - hf_sin).abs().max())


@pytest.mark.parametrize("kind", SUPPORTED_ROPE_KINDS)
def test_cos_sin_flat_positions(kind):
    spec = _spec(kind)
    pos = _position_ids(MAX_POS + 10, 5)
    cos, sin = rope_cos_sin(spec, pos)
    cos_flat, sin_flat = rope_cos_sin(spec, pos.reshape(-1))
    assert cos_flat.shape == (pos.numel(), HEAD_DIM)
    assert torch.equal(cos_flat, cos.reshape(-1, HEAD_DIM))
    assert torch.equal(sin_flat, sin.reshape(-1, HEAD_DIM))


def test_inv_freq_match_transformers():
    for kind in SUPPORTED_ROPE_KINDS:
        hf = LlamaRotaryEmbedding(_hf_config(kind))
        assert torch.equal(rope_inv_freq(_spec(kind)), hf.inv_freq), kind


@pytest.mark.parametrize(
    "theta, head_dim, max_pos, scaling",
    [
        # Llama-3.1-8B-like and Llama-3.2-1B-like (many medium-band frequencies at head_dim 128)
        (5e5, 128, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        (5e5, 64, 131072, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        (1e4, 128, 4096, {"rope_type": "linear", "factor": 7.0}),
        (1e6, 128, 4096, {"rope_type": "dynamic", "factor": 3.0}),
    ],
)
def test_realistic_configs_match_transformers(theta, head_dim, max_pos, scaling):
    config = LlamaConfig(
        hidden_size=8 * head_dim, num_attention_heads=8, head_dim=head_dim, intermediate_size=16,
        num_hidden_layers=1, vocab_size=10, max_position_embeddings=max_pos,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    spec = rope_spec_from_hf_config(config.to_dict(), head_dim=head_dim)
    assert torch.equal(rope_inv_freq(spec), LlamaRotaryEmbedding(config).inv_freq)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 2 * max_pos, (2, 257), generator=g)
    hf_cos, hf_sin = _hf_cos_sin(config, pos)
    cos, sin = rope_cos_sin(spec, pos)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_kinds_actually_differ():
    """Guards against a test setup where scaling is a no-op (e.g. kind ignored)."""
    pos = _position_ids(MAX_POS + 37, 2)
    base = rope_cos_sin(_spec("default"), pos)[0]
    for kind in ("linear", "dynamic", "llama3"):
        assert not torch.allclose(rope_cos_sin(_spec(kind), pos)[0], base), kind
    # dynamic below the threshold is the default rope (same theta, factor unused).
    below = _position_ids(40, 0)
    assert torch.equal(rope_cos_sin(_spec("dynamic"), below)[0], rope_cos_sin(_spec("default"), below)[0])


def test_llama3_hits_all_bands():
    spec = _spec("llama3")
    plain = rope_inv_freq(RopeSpec(dim=HEAD_DIM, theta=THETA, kind="default"))
    scaled = rope_inv_freq(spec)
    untouched = scaled == plain
    divided = torch.isclose(scaled, plain / spec.factor, rtol=1e-6, atol=0)
    blended = ~untouched & ~divided
    assert untouched.any() and divided.any() and blended.any()


def test_dynamic_seq_len_rule():
    spec = _spec("dynamic")
    orig = rope_inv_freq(spec)
    assert torch.equal(rope_inv_freq(spec, MAX_POS), orig)
    assert torch.equal(rope_inv_freq(spec, 1), orig)
    grown = rope_inv_freq(spec, MAX_POS + 1)
    assert not torch.equal(grown, orig)
    # seq_len is the max over the whole tensor (+1), not per row
    pos = torch.stack([torch.arange(10), torch.arange(90, 100)])
    cos, _ = rope_cos_sin(spec, pos)
    inv = rope_inv_freq(spec, 100)
    expected = torch.cat([pos[..., None].float() * inv] * 2, dim=-1).cos()
    assert torch.equal(cos, expected)


def test_dynamic_matches_stateful_hf_when_growing_and_resetting():
    config = _hf_config("dynamic")
    spec = _spec("dynamic")
    hf = LlamaRotaryEmbedding(config)
    x = torch.zeros(1)
    # grow, grow further, then drop below max_position_embeddings (HF resets)
    for n in (30, MAX_POS + 5, 3 * MAX_POS, 20):
        pos = _position_ids(n, n)
        with torch.no_grad():
            hf_cos, hf_sin = hf(x, pos)
        cos, sin = rope_cos_sin(spec, pos)
        assert torch.equal(cos, hf_cos), n
        assert torch.equal(sin, hf_sin), n


@pytest.mark.parametrize("kind", SUPPORTED_ROPE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_transformers(kind, dtype):
    config = _hf_config(kind)
    spec = _spec(kind)
    pos = _position_ids(MAX_POS + 37, 7)
    B, S = pos.shape
    g = torch.Generator().manual_seed(11)
    q_hf = torch.randn(B, HEADS, S, HEAD_DIM, generator=g).to(dtype)  # HF layout
    k_hf = torch.randn(B, 2, S, HEAD_DIM, generator=g).to(dtype)
    with torch.no_grad():
        hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q_hf, pos)
    q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, hf_cos, hf_sin)

    cos, sin = rope_cos_sin(spec, pos)
    q = apply_rope(q_hf.transpose(1, 2), cos, sin)  # ours: [B, S, heads, dim]
    k = apply_rope(k_hf.transpose(1, 2), cos, sin)
    assert q.dtype == dtype and k.dtype == dtype
    assert torch.equal(q, q_ref.transpose(1, 2))
    assert torch.equal(k, k_ref.transpose(1, 2))

    # packed / THD layout: [nnz, heads, dim] with cos [nnz, dim]
    q_packed = q_hf.transpose(1, 2).reshape(B * S, HEADS, HEAD_DIM)
    cos_p, sin_p = rope_cos_sin(spec, pos.reshape(-1))
    assert torch.equal(apply_rope(q_packed, cos_p, sin_p), q_ref.transpose(1, 2).reshape(B * S, HEADS, HEAD_DIM))


def test_apply_rope_is_a_rotation():
    spec = RopeSpec(dim=8, theta=10000.0, kind="default")
    pos = torch.tensor([[0, 3]])
    cos, sin = rope_cos_sin(spec, pos)
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[0, 0], x[0, 0])  # position 0: identity
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    # first frequency pair at position 3 rotates (x0, x4) by angle 3 rad
    c, s = math.cos(3.0), math.sin(3.0)
    assert torch.allclose(y[0, 1, :, 0], x[0, 1, :, 0] * c - x[0, 1, :, 4] * s)
    assert torch.allclose(y[0, 1, :, 4], x[0, 1, :, 4] * c + x[0, 1, :, 0] * s)
    with pytest.raises(ValueError):
        apply_rope(torch.randn(1, 2, 3, 6), cos, sin)


# ----------------------------------------------------------------------------------
# Config parsing
# ----------------------------------------------------------------------------------


def test_parse_v4_linear_dict():
    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "max_position_embeddings": 4096,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    spec = rope_spec_from_hf_config(cfg, head_dim=128)
    assert spec == RopeSpec(dim=128, theta=5e5, kind="linear", factor=2.0, max_position_embeddings=4096)


def test_parse_v4_llama3_dict():
    cfg = {
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    spec = rope_spec_from_hf_config(cfg, head_dim=128)
    assert spec.kind == "llama3"
    assert spec.theta == 500000.0
    assert spec.factor == 8.0
    assert spec.low_freq_factor == 1.0 and spec.high_freq_factor == 4.0
    assert spec.original_max_position_embeddings == 8192
    assert spec.max_position_embeddings == 131072
    # "rope_type" wins over legacy "type" (as transformers' standardization does)
    cfg["rope_scaling"]["type"] = "default"
    assert rope_spec_from_hf_config(cfg, head_dim=128).kind == "llama3"


def test_parse_v5_dict_prefers_rope_parameters():
    cfg = {
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0},
        # stale legacy fields must be ignored in favour of rope_parameters
        "rope_theta": 123.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    spec = rope_spec_from_hf_config(cfg, head_dim=64)
    assert spec == RopeSpec(dim=64, theta=1e6, kind="dynamic", factor=4.0, max_position_embeddings=2048)


def test_parse_v5_dict_default_theta():
    spec = rope_spec_from_hf_config({"rope_parameters": {"rope_type": "default"}}, head_dim=64)
    assert spec.kind == "default" and spec.theta == 10000.0 and spec.factor == 1.0


def test_parse_transformers_config_objects():
    # legacy kwargs on a 5.x config object end up in rope_parameters only
    c = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        max_position_embeddings=1024,
        rope_theta=2e5,
        rope_scaling={"type": "linear", "factor": 4.0},
    )
    spec = rope_spec_from_hf_config(c, head_dim=16)
    assert spec == RopeSpec(dim=16, theta=2e5, kind="linear", factor=4.0, max_position_embeddings=1024)

    c = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, rope_theta=3e4)
    spec = rope_spec_from_hf_config(c, head_dim=16)
    assert spec.kind == "default" and spec.theta == 3e4

    c = _hf_config("llama3")
    spec = rope_spec_from_hf_config(c, head_dim=HEAD_DIM)
    assert spec.kind == "llama3" and spec.original_max_position_embeddings == 64 and spec.theta == THETA

    # a round trip through to_dict() (what config.json holds in 5.x) parses the same
    assert rope_spec_from_hf_config(c.to_dict(), head_dim=HEAD_DIM) == spec


def test_parse_v4_style_object():
    class OldConfig:  # a 4.x-style object: rope_theta + rope_scaling attributes only
        rope_theta = 7e4
        rope_scaling = {"type": "dynamic", "factor": 2.0}
        max_position_embeddings = 512

    spec = rope_spec_from_hf_config(OldConfig(), head_dim=32)
    assert spec == RopeSpec(dim=32, theta=7e4, kind="dynamic", factor=2.0, max_position_embeddings=512)


@pytest.mark.parametrize(
    "cfg, bad",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}, "yarn"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "longrope"),
        ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, "mrope"),
        ({"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, "mrope"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "Per-layer"),
    ],
)
def test_parse_unsupported_kind_raises(cfg, bad):
    with pytest.raises(ValueError) as exc:
        rope_spec_from_hf_config({"max_position_embeddings": 4096, **cfg}, head_dim=64)
    msg = str(exc.value)
    assert bad in msg
    assert str(SUPPORTED_ROPE_KINDS) in msg


@pytest.mark.parametrize(
    "cfg",
    [
        {"rope_theta": 1e4, "partial_rotary_factor": 0.5, "max_position_embeddings": 2048},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.25},
         "max_position_embeddings": 2048},
    ],
)
def test_parse_partial_rotary_raises(cfg):
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_spec_from_hf_config(cfg, head_dim=64)


def test_parse_partial_rotary_one_is_fine():
    cfg = {"rope_theta": 1e4, "partial_rotary_factor": 1.0}
    assert rope_spec_from_hf_config(cfg, head_dim=64).kind == "default"


@pytest.mark.parametrize("scaling", [None, {"type": "default"}, {"rope_type": "default"}])
def test_parse_no_scaling(scaling):
    cfg = {"rope_theta": 1e6, "rope_scaling": scaling, "max_position_embeddings": 32768}
    spec = rope_spec_from_hf_config(cfg, head_dim=128)
    assert spec == RopeSpec(dim=128, theta=1e6, kind="default", max_position_embeddings=32768)


def test_parse_missing_required_params():
    with pytest.raises(ValueError, match="factor"):
        rope_spec_from_hf_config({"rope_scaling": {"type": "linear"}}, head_dim=64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rope_spec_from_hf_config({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, head_dim=64)
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_spec_from_hf_config(
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "max_position_embeddings": 8192},
            head_dim=64,
        )


def test_parse_llama3_original_max_fallbacks():
    base = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    # missing in the dict -> max_position_embeddings (transformers 5.x standardization)
    spec = rope_spec_from_hf_config({"rope_parameters": dict(base), "max_position_embeddings": 8192}, 64)
    assert spec.original_max_position_embeddings == 8192
    # top-level original_max_position_embeddings has priority (transformers 5.x, Phi3-style)
    cfg = {
        "rope_parameters": {**base, "original_max_position_embeddings": 4096},
        "original_max_position_embeddings": 2048,
        "max_position_embeddings": 8192,
    }
    assert rope_spec_from_hf_config(cfg, 64).original_max_position_embeddings == 2048
