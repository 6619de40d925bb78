"""Kimi-K2.5's parts without ranks: the INT4 reader against the compressed-tensors definition (and against the
compressed-tensors package itself where it imports), slices, the breaks the data shows, the refusals, the
config (docs/families.md)."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from test_kimi_k25 import VISION, dequantize, kimi_checkpoint, quant_config, quantize

from parallm.checkpoint.int4 import Int4Source, Scheme, int4_config, int4_view
from parallm.errors import CheckpointError
from parallm.model.sharding import TensorSource

M = "language_model.model.layers.1.mlp.experts.0.gate_proj"


def parts_of(seed: int, group: int, symmetric: bool, rows: int = 24, cols: int = 64) -> dict:
    return quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)), group, symmetric)


def source(parts, group, symmetric) -> Int4Source:
    shape = tuple(parts["weight_shape"].tolist())
    return Int4Source(M, {k: TensorSource(v) for k, v in parts.items()}, shape, Scheme("g", ("Linear",), group,
                                                                                          symmetric))


@pytest.mark.parametrize("group,symmetric", [(32, True), (16, False), (8, False)])
def test_int4_reader_equals_the_definition_and_its_slices(group, symmetric):
    parts = parts_of(group, group, symmetric, rows=21)        # 21 rows: a partly filled zero-point word
    src = source(parts, group, symmetric)
    full = src.full()
    assert full.dtype == torch.bfloat16 and torch.equal(full, dequantize(parts, group))
    for a, b in ((0, 21), (3, 11), (20, 21)):
        assert torch.equal(src.read(0, a, b), full[a:b])
    for a, b in ((0, 64), (5, 37), (32, 64), (63, 64)):
        assert torch.equal(src.read(1, a, b), full[:, a:b])
    # the breaks the end-to-end test must see: each changes the weights
    assert not torch.equal(dequantize(parts, group, order=range(7, -1, -1)), full)        # nibble order
    if not symmetric:
        assert not torch.equal(dequantize(parts, group, zero=False), full)                 # zero point ignored


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                    reason="the compressed-tensors package is not installed (not a parallm dependency)")
@pytest.mark.parametrize("group,symmetric", [(32, True), (16, False)])
def test_int4_reader_equals_compressed_tensors(group, symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    parts = parts_of(1, group, symmetric)
    q = unpack_from_int32(parts["weight_packed"], 4, torch.Size([24, 64]))
    assert torch.equal(pack_to_int32(q, 4), parts["weight_packed"])
    zero = None
    if not symmetric:
        zero = unpack_from_int32(parts["weight_zero_point"], 4, torch.Size([24, 64 // group]), packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
    assert torch.equal(source(parts, group, symmetric).full(), ct_dequantize(q, parts["weight_scale"], zero,
                                                                            args=args))


def view(state: dict, qconfig):
    present = {k: tuple(v.shape) for k, v in state.items()}
    dtypes = {k: v.dtype for k, v in state.items()}
    return int4_view(present, dtypes, lambda n: TensorSource(state[n]), qconfig, where="ckpt")


def _state(symmetric=True, group=32):
    return {M + "." + k: v for k, v in parts_of(0, group, symmetric).items()}


def _config(**weights):
    qc = quant_config(32, True)
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return int4_config({"quantization_config": qc})


def test_int4_view_reads_the_weight():
    shapes, dtypes, read = view(_state(), _config())
    assert shapes == {M + ".weight": (24, 64)} and dtypes[M + ".weight"] == torch.bfloat16
    assert torch.equal(read(M + ".weight").full(), source(parts_of(0, 32, True), 32, True).full())


@pytest.mark.parametrize("change,config,match", [
    (lambda s: s.pop(M + ".weight_scale"), None, "without .*weight_scale"),
    (lambda s: s.pop(M + ".weight_packed"), None, "without .*weight_packed"),
    (lambda s: s.update({M + ".weight_scale": s[M + ".weight_scale"][:, :1]}), None, "do not pair up"),
    (lambda s: s.update({M + ".weight_zero_point": torch.zeros(3, 2, dtype=torch.int32)}), None, "symmetric"),
    (lambda s: s.update({M + ".weight_g_idx": torch.zeros(64, dtype=torch.int32)}), None, "does not read"),
    (lambda s: s.update({M + ".weight": torch.zeros(24, 64)}), None, "both as"),
    (lambda s: None, dict(symmetric=False), "no weight_zero_point"),
    (lambda s: None, dict(group_size=16), "do not pair up"),
    (lambda s: None, "none", "declares no compressed-tensors"),
])
def test_int4_view_refusals(change, config, match):
    state = _state()
    change(state)
    qconfig = None if config == "none" else _config(**(config or {}))
    with pytest.raises(CheckpointError, match=match):
        shapes, _, read = view(state, qconfig)


def test_int4_weight_shape_is_checked():
    state = _state()
    state[M + ".weight_shape"] = torch.tensor([24, 63])
    _, _, read = view(state, _config())
    with pytest.raises(CheckpointError, match="weight_shape says"):
        read(M + ".weight").full()


@pytest.mark.parametrize("change,match", [
    (lambda q: q.update(format="naive-quantized"), "format 'naive-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits=8"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"), "strategy='channel'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "type='float'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_status"),
])
def test_int4_config_refusals(change, match):
    qc = quant_config(32, True)
    change(qc)
    with pytest.raises(CheckpointError, match=match):
        int4_config({"text_config": {"quantization_config": qc}})


def test_int4_targets_and_ignore():
    cfg = _config()
    ignored = "language_model.model.layers.1.self_attn.q_a_proj"
    with pytest.raises(CheckpointError, match="ignore lists it"):
        cfg.scheme_for(ignored, "ckpt")
    qc = quant_config(32, True)
    qc["config_groups"]["group_0"]["targets"] = [r"re:.*mlp\.experts\.\d+\.(gate|up)_proj$"]
    named = int4_config({"quantization_config": qc})
    assert named.scheme_for(M, "ckpt").group_size == 32
    with pytest.raises(CheckpointError, match="no quantization_config group targets it"):
        named.scheme_for(M.replace("gate_proj", "down_proj"), "ckpt")
    assert int4_config({"text_config": {}}) is None and int4_config({"quantization_config": {
        "quant_method": "fp8"}}) is None


def test_kimi_spec_names_tie_and_vision_keys(tmp_path):
    from parallm.families import spec_from_config
    int4, _, deq, _ = kimi_checkpoint(tmp_path, 5, group=32, symmetric=True, in_text=True)
    with open(f"{int4}/config.json") as f:
        cfg = json.load(f)
    spec, family = spec_from_config(cfg)
    assert family.name == "kimi_k25" and spec.mla is not None and spec.moe is not None
    assert dict(spec.carried) == {k: tuple(v.shape) for k, v in deq.items() if not k.startswith("language_model.")}
    assert not spec.tie_word_embeddings
    untied = copy.deepcopy(cfg)
    del untied["tie_word_embeddings"]          # transformers' Kimi_K25Config default: tied
    assert spec_from_config(untied)[0].tie_word_embeddings
    released = copy.deepcopy(cfg)             # the released vision_config's vt_* / init_pos_emb_* keys
    vc = released["vision_config"]
    for old, new in (("hidden_size", "vt_hidden_size"), ("num_hidden_layers", "vt_num_hidden_layers"),
                     ("intermediate_size", "vt_intermediate_size"), ("pos_emb_height", "init_pos_emb_height"),
                     ("pos_emb_width", "init_pos_emb_width")):
        vc[new] = vc.pop(old)
    assert spec_from_config(released)[0].carried == spec.carried
    vc["hidden_size"] = VISION["hidden_size"] * 2
    with pytest.raises(ValueError, match="ambiguous"):
        spec_from_config(released)
