"""DeepSeek-V4's checkpoint formats, function by function, against transformers 5.25's own routines: FP8 with
UE8M0 scales (``float8_e8m0fnu`` and uint8 exponent bytes) under ``X.scale``, FP4 routed experts (e2m1 pairs, one
scale per row per 32 columns), the Hub <-> transformers name mapping, the MTP tensors, the legacy
``DeepseekV3ForCausalLM`` configs. The model-level load is tests/test_v4_checkpoint_model.py."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from parallm.checkpoint import fp4, fp8
from parallm.checkpoint.hf_dir import HFCheckpoint
from parallm.checkpoint.loader import _renamed
from parallm.errors import CheckpointError
from parallm.families import deepseek_v4_names as names
from parallm.families import registry
from parallm.model.sharding import TensorSource
from v4_checkpoint_helpers import (BLOCK, fp4_by_definition, hub_name, mtp_layer, quantize_fp4, quantize_fp8,
                                   quantize_state, save_tiny_v4, tiny_v4_config, ue8m0_value, write_hub_checkpoint)

SCALE_DTYPES = [torch.float8_e8m0fnu, torch.uint8, torch.float32]


def _tf_dequantize(q, s, dtype=torch.float32):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)


def _weight(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 0, cols).unsqueeze(0)


# -- FP8 ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_fp8_matches_transformers(scale_dtype):
    """Whole blocks (transformers derives the block from the grid): parallm's product equals Fp8Dequantize's,
    in fp32 and after the one rounding into bf16, bit for bit."""
    q, s = quantize_fp8(_weight(48, 64), scale_dtype=scale_dtype)
    for dtype in (torch.float32, torch.bfloat16):
        ours = fp8.dequantize(q, s, block=BLOCK, dtype=dtype)
        assert torch.equal(ours, _tf_dequantize(q, s, dtype))
    if scale_dtype != torch.float32:       # UE8M0: the product is exact, the definition's value
        full = ue8m0_value(s.view(torch.uint8)).repeat_interleave(16, 0).repeat_interleave(16, 1)
        assert torch.equal(fp8.dequantize(q, s, block=BLOCK, dtype=torch.float32), q.float() * full)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_fp8_ragged_and_sliced(scale_dtype):
    """A ragged [40, 56] weight in 16x16 blocks: equal to transformers' backward-path dequantisation (which takes
    the configured block), and every row / column slice read through DequantizedSource equals the full tensor's."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    q, s = quantize_fp8(_weight(40, 56, seed=1), scale_dtype=scale_dtype)
    full = fp8.dequantize(q, s, block=BLOCK, dtype=torch.float32)
    as_float = s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 else s    # what transformers reads there
    assert torch.equal(full, _dequantize_fp8_weight(q, as_float, list(BLOCK), torch.float32))
    src = fp8.DequantizedSource(TensorSource(q), TensorSource(s), BLOCK)
    for dim, a, b in ((0, 0, 40), (0, 7, 33), (1, 5, 51), (1, 16, 32), (1, 48, 56)):
        assert torch.equal(src.read(dim, a, b), full.narrow(dim, a, b - a)), (dim, a, b)


def test_fp8_breaks_must_fail():
    """A scale ignored, or UE8M0 bytes read as plain numbers, gives other weights."""
    q, s = quantize_fp8(_weight(48, 64, seed=2), scale_dtype=torch.uint8)
    good = fp8.dequantize(q, s, block=BLOCK, dtype=torch.float32)
    plain = fp8.dequantize(q, s.float(), block=BLOCK, dtype=torch.float32)          # byte value as the scale
    ignored = q.float()
    assert not torch.equal(good, plain) and not torch.equal(good, ignored)
    assert (good - plain).abs().max() > 1


def test_fp8_dot_scale_names():
    """``X.scale`` pairs with a float8 ``X.weight`` (as ``X.weight_scale_inv`` does); beside a float weight it
    is a tensor of its own; two scales for one weight, or a float8 weight with none, are refused by name."""
    q, s = quantize_fp8(_weight(32, 32))
    present = {"a.weight": (32, 32), "a.scale": (2, 2), "b.weight": (4,), "b.scale": (4,)}
    dtypes = {"a.weight": q.dtype, "a.scale": s.dtype, "b.weight": torch.float32, "b.scale": torch.float32}
    assert fp8.fp8_plan(present, dtypes, BLOCK, where="ckpt") == {"a.weight": "a.scale"}
    with pytest.raises(CheckpointError, match="a.weight has two scales"):
        fp8.fp8_plan(dict(present, **{"a.weight_scale_inv": (2, 2)}),
                     dict(dtypes, **{"a.weight_scale_inv": torch.float32}), BLOCK, where="ckpt")
    with pytest.raises(CheckpointError, match=r"a.weight is float8 .*a.weight_scale_inv or a.scale"):
        fp8.fp8_plan({"a.weight": (32, 32)}, {"a.weight": q.dtype}, BLOCK, where="ckpt")
    with pytest.raises(CheckpointError, match=r"a.scale has shape \[1, 1\]"):
        fp8.fp8_plan(dict(present, **{"a.scale": (1, 1)}), dtypes, BLOCK, where="ckpt")
    state = fp8.dequantize_state_dict({"a.weight": q, "a.scale": s}, dtype=torch.float32, block=BLOCK)
    assert list(state) == ["a.weight"] and torch.equal(state["a.weight"], _tf_dequantize(q, s))


def test_block_size_of_v4_keys():
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    assert fp8.block_size_of({"quantization_config": q}) == (128, 128)
    for key, bad in (("scale_fmt", "e5m2"), ("expert_dtype", "int4")):
        with pytest.raises(CheckpointError, match=key):
            fp8.block_size_of({"quantization_config": dict(q, **{key: bad})})


# -- FP4 ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.float4_e2m1fn_x2])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_fp4_matches_transformers(scale_dtype, packed_dtype):
    """Fp4Source's weight equals Fp8Dequantize._dequantize_one's (``_unpack_fp4``, the fp32 product) bit for
    bit, in fp32 and in bf16, and the format's definition (low nibble = even column) exactly."""
    packed, s = quantize_fp4(_weight(24, 96, seed=3), scale_dtype=scale_dtype, packed_dtype=packed_dtype)
    src = fp4.Fp4Source(TensorSource(packed), TensorSource(s))
    assert src.shape == (24, 96)
    ours = src.read(0, 0, 24)
    assert torch.equal(ours, _tf_dequantize(packed, s))
    assert torch.equal(ours.to(torch.bfloat16), _tf_dequantize(packed, s, torch.bfloat16))
    assert torch.equal(ours, fp4_by_definition(packed, s))


def test_fp4_slices():
    """Rows, columns from an odd start, whole groups, and stacked experts along dim 0: each equal to the same
    slice of the whole weight."""
    packed, s = quantize_fp4(_weight(24, 96, seed=4))
    src = fp4.Fp4Source(TensorSource(packed), TensorSource(s))
    full = src.read(0, 0, 24)
    for dim, a, b in ((0, 5, 17), (1, 5, 77), (1, 32, 64), (1, 0, 1), (1, 95, 96), (1, 31, 33)):
        assert torch.equal(src.read(dim, a, b), full.narrow(dim, a, b - a)), (dim, a, b)
    stacked = fp4.Fp4Source(TensorSource(torch.stack([packed, packed.flip(0)])), TensorSource(torch.stack([s, s.flip(0)])))
    assert stacked.shape == (2, 24, 96)
    assert torch.equal(stacked.read(0, 1, 2)[0], full.flip(0))


def test_fp4_breaks_must_fail():
    """Nibbles swapped (high first), the scale ignored, or UE8M0 bytes read as plain numbers: other weights."""
    packed, s = quantize_fp4(_weight(8, 64, seed=5), scale_dtype=torch.uint8)
    good = fp4.dequantize(packed, s)
    u8 = packed.view(torch.uint8)
    swapped = fp4.dequantize(((u8 >> 4) | (u8 << 4)).view(torch.int8), s)
    ignored = fp4.unpack(packed)
    plain = fp4.dequantize(packed, s.float())
    for wrong in (swapped, ignored, plain):
        assert not torch.equal(good, wrong)


def test_fp4_plan_refusals():
    packed, s = quantize_fp4(_weight(8, 64))
    present = {"e.w1.weight": (8, 32), "e.w1.scale": (8, 2)}
    dtypes = {"e.w1.weight": torch.int8, "e.w1.scale": s.dtype}
    assert fp4.fp4_plan(present, dtypes, True, where="ckpt") == {"e.w1.weight": "e.w1.scale"}
    shapes, types, _ = fp4.fp4_view(present, dtypes, lambda n: None, declared=True, where="ckpt")
    assert shapes == {"e.w1.weight": (8, 64)} and types == {"e.w1.weight": torch.float32}
    with pytest.raises(CheckpointError, match="does not say expert_dtype 'fp4'"):
        fp4.fp4_plan(present, dtypes, False, where="ckpt")
    with pytest.raises(CheckpointError, match=r"e.w1.scale has shape \[8, 4\].*needs \[8, 2\]"):
        fp4.fp4_plan(dict(present, **{"e.w1.scale": (8, 4)}), dtypes, True, where="ckpt")
    with pytest.raises(CheckpointError, match="e.w1.scale is torch.int32"):
        fp4.fp4_plan(present, dict(dtypes, **{"e.w1.scale": torch.int32}), True, where="ckpt")
    with pytest.raises(CheckpointError, match="e.w1.weight is packed FP4.*no e.w1.weight_scale_inv or e.w1.scale"):
        fp4.fp4_plan({"e.w1.weight": (8, 32)}, {"e.w1.weight": torch.int8}, True, where="ckpt")
    with pytest.raises(CheckpointError, match="x is packed FP4"):       # float4 storage needs a scale, always
        fp4.fp4_plan({"x": (8, 32)}, {"x": torch.float4_e2m1fn_x2}, False, where="ckpt")
    assert fp4.expert_dtype_of({"expert_dtype": "fp4"}) == "fp4"
    assert fp4.expert_dtype_of({"quantization_config": {"expert_dtype": "fp4"}}) == "fp4"
    assert fp4.expert_dtype_of({"quantization_config": {"quant_method": "fp8"}}) is None


def test_f4_safetensors_shapes(tmp_path):
    """safetensors counts F4 in 4-bit values; the checkpoint reader reports (and reads) torch's byte pairs."""
    from safetensors.torch import save_file
    packed, s = quantize_fp4(_weight(8, 64), packed_dtype=torch.float4_e2m1fn_x2)
    save_file({"w": packed, "s": s}, str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    w, sc = ckpt.source("w"), ckpt.source("s")
    assert w.shape == (8, 32) and w.dtype == torch.float4_e2m1fn_x2 and sc.dtype == torch.float8_e8m0fnu
    assert torch.equal(fp4.Fp4Source(w, sc).read(1, 3, 40), fp4_by_definition(packed, s)[:, 3:40])


# -- names --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny V4 saved by transformers, its save-named state, and a Hub checkpoint of it (FP8 + FP4, UE8M0 scales,
    an MTP layer)."""
    root = tmp_path_factory.mktemp("v4")
    model = save_tiny_v4(str(root / "hf"))
    state = load_file(str(root / "hf" / "model.safetensors"))
    hub = quantize_state(dict(state, **mtp_layer(state)))
    write_hub_checkpoint(str(root / "hub"), model.config, hub)
    return root, model, state, hub


def test_names_both_ways(tiny):
    """Every name transformers saves maps to the Hub's spelling (written out independently in the helpers) and
    back; the spelling of a checkpoint is recognised, and a mix of both is refused naming one of each."""
    _, _, state, hub = tiny
    for name in state:
        assert names.hf_to_hub(name) == hub_name(name)
        assert names.hub_to_hf(names.hf_to_hub(name)) == name
    assert names.spelling(state) == "hf" and names.spelling(hub) == "hub"
    assert names.checkpoint_names(state) == {n: n for n in state}
    mapped = names.checkpoint_names(hub)
    assert mapped["embed.weight"] == "model.embed_tokens.weight" and mapped["hc_head_fn"] == "model.hc_head.hc_fn"
    assert mapped["layers.1.attn.wq_a.scale"] == "model.layers.1.attn.wq_a.scale"
    assert mapped["head.weight"] == "head.weight" and mapped["mtp.0.e_proj.weight"] == "mtp.0.e_proj.weight"
    mixed = dict(hub, **{"model.layers.0.attn_norm.weight": state["model.layers.0.attn_norm.weight"]})
    with pytest.raises(CheckpointError, match=r"mixing the Hub names \(embed.weight.*model.layers.0.attn_norm"):
        names.checkpoint_names(mixed)
    with pytest.raises(CheckpointError, match="mixing"):
        _renamed({k: tuple(v.shape) for k, v in mixed.items()}, lambda n: None, names.checkpoint_names, "ckpt")


def test_hub_names_load_in_transformers(tiny):
    """transformers reads the Hub spelling (unquantised here) into exactly the parameters it reads from its own
    save names: the mapping is transformers' conversion_mapping's, not a guess."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM
    root, model, state, _ = tiny
    os.makedirs(root / "hub_plain", exist_ok=True)
    save_file({names.hf_to_hub(k): v for k, v in state.items()}, str(root / "hub_plain" / "model.safetensors"))
    model.config.save_pretrained(str(root / "hub_plain"))
    loaded = DeepseekV4ForCausalLM.from_pretrained(str(root / "hub_plain"), dtype=torch.float32).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def _views(path, config):
    """The loader's view of a checkpoint directory (names mapped, FP4 and FP8 dequantised), as _open_and_check
    composes it: {table name: shape}, read(name)."""
    ckpt = HFCheckpoint(path)
    present = {k: ckpt.source(k).shape for k in ckpt.keys()}
    present, raw, where = _renamed(present, ckpt.source, names.checkpoint_names, str(path))
    dtypes = {k: raw(k).dtype for k in present}
    present, dtypes, raw = fp4.fp4_view(present, dtypes, raw, declared=fp4.expert_dtype_of(config) == "fp4",
                                        where=where)
    scales = fp8.fp8_plan(present, dtypes, fp8.block_size_of(config), where=where)
    shapes = {k: v for k, v in present.items() if k not in set(scales.values())}

    def read(name):
        src = raw(name) if name not in scales else fp8.DequantizedSource(raw(name), raw(scales[name]),
                                                                          fp8.block_size_of(config))
        return src.read(0, 0, src.shape[0])
    return shapes, read


def test_hub_fp8_fp4_equals_transformers_dequantisation(tiny):
    """The Hub checkpoint (FP8 + FP4, UE8M0 ``.scale``, Hub names) read through parallm's views equals
    transformers' ``from_pretrained(..., FineGrainedFP8Config(dequantize=True))`` tensor for tensor, bit for bit
    in fp32, under transformers' save names; the MTP layer's tensors equal the formats' definitions."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config
    root, model, state, hub = tiny
    config = registry.load_config(str(root / "hub"))
    shapes, read = _views(root / "hub", config)
    qc = FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK, scale_fmt="ue8m0", expert_dtype="fp4")
    ref = DeepseekV4ForCausalLM.from_pretrained(str(root / "hub"), quantization_config=qc, dtype=torch.float32)
    plain = DeepseekV4ForCausalLM(tiny_v4_config())
    plain.load_state_dict(ref.state_dict())
    plain.save_pretrained(str(root / "ref"))
    expected = load_file(str(root / "ref" / "model.safetensors"))
    assert set(shapes) - set(expected) == {n for n in shapes if n.startswith("mtp.")}
    worst = 0.0
    for name, want in expected.items():
        got = read(name)
        assert got.shape == want.shape and torch.equal(got.to(want.dtype), want), name
        worst = max(worst, (want - state[name]).abs().max().item())
    assert worst > 0        # the checkpoint is really quantised (transformers' values are not the originals)
    q, s = hub["mtp.0.attn.wq_a.weight"], hub["mtp.0.attn.wq_a.scale"]
    assert torch.equal(read("mtp.0.attn.wq_a.weight"), _tf_dequantize(q, s))
    q, s = hub["mtp.0.ffn.experts.1.w2.weight"], hub["mtp.0.ffn.experts.1.w2.scale"]
    assert torch.equal(read("mtp.0.ffn.experts.1.w2.weight"), fp4_by_definition(q, s))
    assert torch.equal(read("mtp.0.enorm.weight"), hub["mtp.0.enorm.weight"])


def test_mtp_tensors(tiny):
    """The MTP tensors listed from the checkpoint's headers (shapes only, or with dtypes) are the views' names and
    shapes: scales left out, FP4 weights at their dequantised width."""
    root, _, _, hub = tiny
    config = registry.load_config(str(root / "hub"))
    shapes, _ = _views(root / "hub", config)
    want = tuple((n, tuple(shapes[n])) for n in sorted(shapes) if n.startswith("mtp."))
    present = {k: tuple(v.shape) for k, v in hub.items()}
    assert names.mtp_tensors(present) == want
    assert names.mtp_tensors(present, {k: v.dtype for k, v in hub.items()}) == want
    assert ("mtp.0.ffn.experts.0.w1.weight", (32, 64)) in want and not any(n.endswith(".scale") for n, _ in want)


# -- legacy configs -----------------------------------------------------------------------------------------------

def test_legacy_config_reads_as_v4(tiny, tmp_path):
    """A config that says DeepseekV3ForCausalLM with compress_ratios / num_hash_layers / a top-level expert_dtype
    is transformers' DeepseekV4Config with the same schedule as the V4 spelling, never DeepSeek-V3; a plain V3
    config stays V3."""
    from transformers import DeepseekV4Config
    root, model, _, hub = tiny
    path = write_hub_checkpoint(str(tmp_path / "legacy"), model.config, {"head.weight": hub["head.weight"]},
                                legacy=True)
    raw = registry._load_config(path)._raw
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and registry.is_legacy_v4(raw)
    config = registry.load_config(path)
    assert isinstance(config, DeepseekV4Config) and config.architectures == ["DeepseekV4ForCausalLM"]
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "hc_mult"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.quantization_config["expert_dtype"] == "fp4" and fp4.expert_dtype_of(config) == "fp4"
    assert isinstance(registry.load_config(raw), DeepseekV4Config)
    from transformers import AutoConfig
    trap = AutoConfig.from_pretrained(path)          # transformers itself reads it as DeepSeek-V3
    assert type(trap).__name__ == "DeepseekV3Config"
    assert registry.load_config(trap).layer_types == model.config.layer_types
    v4 = [f for f in registry.FAMILIES.values() if registry.V4_ARCHITECTURE in f.architectures]
    if v4:
        assert registry.family_for(raw) is v4[0]
    else:
        with pytest.raises(ValueError, match="DeepSeek-V4 config.*not read as DeepSeek-V3"):
            registry.family_for(raw)
    v3 = {k: v for k, v in raw.items() if k not in registry.V4_ONLY_KEYS}
    assert not registry.is_legacy_v4(v3) and registry.family_for(v3).name == "deepseek_v3"


def test_legacy_config_family_when_registered(monkeypatch):
    """With a V4 family registered, a legacy config picks it (the family's spec function receives the
    DeepseekV4Config)."""
    from transformers import DeepseekV4Config
    seen = []
    stub = registry.Family(name="v4_stub", model_types=("deepseek_v4",), architectures=("DeepseekV4ForCausalLM",),
                           spec=seen.append, table=(), causal_architecture="DeepseekV4ForCausalLM",
                           value_architecture="DeepseekV4ForSequenceClassification")
    monkeypatch.setitem(registry.FAMILIES, "v4_stub", stub)
    monkeypatch.setattr(registry, "FAMILIES", {"v4_stub": stub, **{k: v for k, v in registry.FAMILIES.items()
                                                                   if registry.V4_ARCHITECTURE not in v.architectures}})
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 3,
           "compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1, "hidden_size": 64}
    assert registry.family_for(raw) is stub
    registry.spec_from_config(raw)
    assert isinstance(seen[0], DeepseekV4Config)
    assert seen[0].layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert seen[0].mlp_layer_types == ["hash_moe", "moe", "moe"]
