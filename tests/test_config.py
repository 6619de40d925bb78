"""HF config -> DecoderSpec (no process group): config.json in transformers 4.x and 5.x style, head_dim,
unsupported architectures."""

from __future__ import annotations

import json
import os

import pytest

from parallm.families import load_config, spec_from_config, supported_architectures
from parallm.model.positions.rope import RopeSpec

from helpers import rewrite_config_4x, tiny_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 123456.0},
    "linear": {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 20000.0},
    "llama3": LLAMA3,
}


def _save(config, path) -> str:
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    return str(path)


def _read(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", list(ROPES))
def test_4x_and_5x_config_json_give_same_spec(tmp_path, family, rope):
    config = tiny_config(family, rope_parameters=dict(ROPES[rope]), tie_word_embeddings=True,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    config.architectures = ["LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM"]
    d5 = _save(config, tmp_path / "v5")
    d4 = _save(config, tmp_path / "v4")
    rewrite_config_4x(d4)
    raw4, raw5 = _read(d4), _read(d5)
    assert "rope_parameters" in raw5 and "rope_theta" not in raw5
    assert "rope_parameters" not in raw4 and raw4["rope_theta"] == ROPES[rope]["rope_theta"]
    if rope != "default":
        assert raw4["rope_scaling"]["type"] == rope  # legacy key "type", as 4.x-era checkpoints carry

    spec5, fam5 = spec_from_config(d5)
    spec4, fam4 = spec_from_config(d4)
    spec_obj, fam_obj = spec_from_config(config)
    spec_file, _ = spec_from_config(os.path.join(d4, "config.json"))
    spec_dict, _ = spec_from_config(raw4)
    assert fam5 is fam4 is fam_obj and fam5.name == family
    assert spec4 == spec5 == spec_obj == spec_file == spec_dict

    r = spec5.rope
    assert r.kind == rope and r.theta == ROPES[rope]["rope_theta"] and r.dim == 32
    if rope != "default":
        assert r.factor == ROPES[rope]["factor"]
    if rope == "llama3":
        assert (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == (1.0, 4.0, 16)
    assert spec5.head_dim == 32 and spec5.q_size == 256 and spec5.kv_size == 64
    assert spec5.num_heads == 8 and spec5.num_kv_heads == 2 and spec5.tie_word_embeddings
    assert spec5.architecture == ("LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM")


def test_4x_rope_scaling_with_rope_type_key_and_no_scaling(tmp_path):
    base = _read(_save(tiny_config("llama"), tmp_path / "a"))
    base.pop("rope_parameters")
    cfg = dict(base, rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    spec, _ = spec_from_config(cfg)
    assert spec.rope == RopeSpec(dim=16, theta=5e5, kind="linear", factor=2.0, max_position_embeddings=64)
    cfg = dict(base, rope_theta=5e5, rope_scaling=None)
    spec, _ = spec_from_config(cfg)
    assert spec.rope.kind == "default" and spec.rope.theta == 5e5
    cfg = dict(base)  # no rope keys at all: transformers' default theta
    spec, _ = spec_from_config(cfg)
    assert spec.rope.kind == "default" and spec.rope.theta == 10000.0


def test_head_dim_read_from_config():
    spec, _ = spec_from_config(tiny_config("llama", num_attention_heads=8, num_key_value_heads=1, head_dim=32))
    assert spec.head_dim == 32 != 64 // 8
    raw = tiny_config("llama").to_dict()
    raw.pop("head_dim", None)  # older configs without head_dim: hidden / heads
    assert spec_from_config(raw)[0].head_dim == 16
    raw["head_dim"] = None
    assert spec_from_config(raw)[0].head_dim == 16


def test_missing_num_key_value_heads_means_mha():
    raw = tiny_config("llama").to_dict()
    raw.pop("num_key_value_heads")
    assert spec_from_config(raw)[0].num_kv_heads == 4


def test_biases_and_sizes_from_config():
    spec, _ = spec_from_config(tiny_config("llama", attention_bias=True, mlp_bias=True, vocab_size=77,
                                           intermediate_size=48, num_hidden_layers=3, rms_norm_eps=1e-6))
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, True, True)
    assert (spec.vocab_size, spec.intermediate_size, spec.num_layers, spec.rms_norm_eps) == (77, 48, 3, 1e-6)
    spec, _ = spec_from_config(tiny_config("qwen2"))
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, False, False)


def test_value_architecture_maps_to_family():
    raw = tiny_config("qwen2").to_dict()
    raw["architectures"] = ["Qwen2ForSequenceClassification"]
    spec, fam = spec_from_config(raw)
    assert fam.name == "qwen2" and spec.architecture == "Qwen2ForSequenceClassification"


@pytest.mark.parametrize("arch,model_type", [("GemmaForCausalLM", "gemma"), ("GPT2LMHeadModel", "gpt2"),
                                             (None, "gemma")])
def test_unsupported_architecture_lists_supported(arch, model_type):
    raw = tiny_config("llama").to_dict()
    raw["model_type"] = model_type
    if arch is None:
        raw.pop("architectures", None)
    else:
        raw["architectures"] = [arch]
    with pytest.raises(ValueError) as info:
        spec_from_config(raw)
    msg = str(info.value)
    assert "unsupported architecture" in msg
    assert (arch or model_type) in msg
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        assert supported in msg
    assert set(supported_architectures()) >= {"LlamaForCausalLM", "Qwen2ForCausalLM",
                                              "LlamaForSequenceClassification", "Qwen2ForSequenceClassification"}


def test_model_type_without_architectures():
    raw = tiny_config("qwen2").to_dict()
    raw.pop("architectures", None)
    assert spec_from_config(raw)[1].name == "qwen2"


def test_qwen2_sliding_window_layers():
    """Layers from max_window_layers on slide (the refusal is gone: tests/test_sliding_window.py runs them)."""
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert spec_from_config(config)[0].layer_windows == (None, 8)
    assert spec_from_config(config.to_dict())[0].layer_windows == (None, 8)


def test_unsupported_rope_kind_rejected():
    raw = tiny_config("llama").to_dict()
    raw["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4,
                              "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match="longrope"):
        spec_from_config(raw)
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        spec_from_config(raw)
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    with pytest.raises(ValueError, match="mrope"):
        spec_from_config(raw)


def test_yarn_config_gives_a_yarn_spec():
    """A Qwen-style long-context config (4.x ``rope_scaling`` with ``type``) reads as YaRN over the whole head;
    the decoder's parity with transformers is in test_yarn_dense.py."""
    raw = tiny_config("qwen2").to_dict()
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 1e6
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    spec = spec_from_config(raw)[0]
    assert spec.rope.kind == "default" and spec.yarn is not None
    assert (spec.yarn.dim, spec.yarn.theta, spec.yarn.factor, spec.yarn.original_max_position_embeddings) == (
        spec.head_dim, 1e6, 4.0, 32768)


def test_load_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(str(tmp_path))


def test_broken_config_json_is_named(tmp_path):
    """Missing or non-integer size fields and invalid JSON are ValueErrors that say what is wrong."""
    import json

    from parallm.families import spec_from_config
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ValueError, match="missing required field.*num_hidden_layers"):
        spec_from_config(str(tmp_path))
    path.write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": "96", "vocab_size": 10}))
    with pytest.raises(ValueError, match="intermediate_size='96'"):
        spec_from_config(str(tmp_path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        spec_from_config(str(tmp_path))


def test_attention_backend_registry():
    """attn_impl: "auto" picks per model kind and device; a kernel that does not fit or cannot run says why."""
    import torch
    from parallm.model.layers.attention import BACKENDS, resolve_attn_impl
    assert resolve_attn_impl("auto", packed=False, device="cpu", dtype=torch.float32).name == "sdpa"
    assert resolve_attn_impl("auto", packed=True, device="cpu", dtype=torch.bfloat16).name == "sdpa-loop"
    assert resolve_attn_impl("sdpa-loop", packed=True, device="cpu", dtype=torch.float32) is BACKENDS["sdpa-loop"]
    with pytest.raises(ValueError, match="cannot run here: .*(not installed|needs CUDA)"):
        resolve_attn_impl("flash-attn", packed=True, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="padded model runs one of \\['sdpa'\\]"):
        resolve_attn_impl("flash-attn", packed=False, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'auto' or one of"):
        resolve_attn_impl("xformers", packed=True, device="cpu", dtype=torch.float32)
