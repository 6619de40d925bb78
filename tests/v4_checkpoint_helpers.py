"""DeepSeek-V4 checkpoints as the Hub ships them, made by the tests from a tiny transformers model: FP8 e4m3
linears with UE8M0 block scales under ``X.scale``, FP4 (e2m1, two per int8 byte, low nibble first) routed experts
with one UE8M0 scale per row per 32 columns, Hub names (no ``model.`` prefix) and an MTP layer, each quantised by
the format's definition (not by parallm's code, not by transformers')."""

from __future__ import annotations

import json
import os

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BLOCK = (16, 16)        # small blocks so that tiny weights have several (and ragged) blocks
# linears the Hub checkpoints ship unquantised (bf16, no scale): the compressor's / indexer's projections
UNQUANTISED = (".compressor.wkv.", ".compressor.wgate.", ".indexer.weights_proj.")


def tiny_v4_config(**overrides):
    """A tiny V4: one layer of each attention kind, hash + routed MoE, hc_mult 2, experts 32 wide (one FP4 group
    per 32 columns)."""
    from transformers import DeepseekV4Config
    kw = dict(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, o_groups=2, o_lora_rank=16, index_n_heads=2,
              index_head_dim=16, index_topk=4, sliding_window=8,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              partial_rotary_factor=0.5, num_nextn_predict_layers=1)
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def save_tiny_v4(path: str, *, seed: int = 0, **overrides):
    """A seeded tiny transformers V4 (weights ~N(0, 0.08), norms around 1, ``tid2eid`` a valid routing) saved by
    ``save_pretrained`` (transformers' save names, fp32). Returns the model."""
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_v4_config(**overrides)).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(e, generator=g)[:b.shape[1]] for _ in range(b.shape[0])]))
    model.save_pretrained(path)
    return model


# -- the formats, by definition ----------------------------------------------------------------------------------

def ue8m0_for(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The UE8M0 exponent bytes (uint8, 2 ** (b - 127)) of the smallest power-of-two scale mapping ``amax`` into
    ``[-top, top]``."""
    e = torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


def ue8m0_value(b: torch.Tensor) -> torch.Tensor:
    """2 ** (b - 127) of exponent bytes, in fp32 (exact: computed in float64, every such power fits fp32)."""
    return (2.0 ** (b.to(torch.float64) - 127)).to(torch.float32)


def quantize_fp8(w: torch.Tensor, block=BLOCK, *, scale_dtype=torch.float8_e8m0fnu):
    """``w`` [R, C] -> (float8_e4m3fn weight, scale ``[ceil(R / b0), ceil(C / b1)]``): UE8M0 (as
    ``float8_e8m0fnu`` or its uint8 bytes) or, for ``scale_dtype=torch.float32``, the fp32 amax / 448."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(gr * block[0], gc * block[1])
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(gr, block[0], gc, block[1]).abs().amax(dim=(1, 3))
    if scale_dtype == torch.float32:
        scale = amax.clamp(min=1e-30) / 448.0
        stored = scale
    else:
        b = ue8m0_for(amax, 448.0)
        scale = ue8m0_value(b)
        stored = b if scale_dtype == torch.uint8 else b.view(torch.float8_e8m0fnu)
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, stored


def quantize_fp4(w: torch.Tensor, *, scale_dtype=torch.float8_e8m0fnu, packed_dtype=torch.int8):
    """``w`` [N, K] (K a multiple of 32) -> (packed ``[N, K / 2]``: column 2j in the low nibble of byte j, column
    2j + 1 in the high one; scale ``[N, K / 32]``), the nibble of each value the nearest e2m1 value of w / scale."""
    n, k = w.shape
    groups = w.float().reshape(n, k // 32, 32)
    amax = groups.abs().amax(dim=-1)
    if scale_dtype == torch.float32:
        scale = amax.clamp(min=1e-30) / 6.0
        stored = scale
    else:
        b = ue8m0_for(amax, 6.0)
        scale = ue8m0_value(b)
        stored = b if scale_dtype == torch.uint8 else b.view(torch.float8_e8m0fnu)
    x = (groups / scale.unsqueeze(-1)).reshape(n, k)
    nibble = (x.unsqueeze(-1) - E2M1).abs().argmin(dim=-1).to(torch.uint8)     # nearest (first of +0 / -0)
    packed = nibble[:, 0::2] | (nibble[:, 1::2] << 4)
    return packed.view(packed_dtype), stored


def fp4_by_definition(packed: torch.Tensor, scale_bytes_or_fp32: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 weight a packed tensor means, from the definition (low nibble = even column)."""
    u8 = packed.view(torch.uint8)
    values = torch.empty(u8.shape[0], 2 * u8.shape[1])
    values[:, 0::2] = E2M1[(u8 & 0xF).long()]
    values[:, 1::2] = E2M1[(u8 >> 4).long()]
    s = scale_bytes_or_fp32
    s = ue8m0_value(s) if s.dtype == torch.uint8 else s.float()
    return values * s.repeat_interleave(32, dim=1)[:, :values.shape[1]]


# -- a Hub-spelled, quantised checkpoint --------------------------------------------------------------------------

def hub_name(name: str) -> str:
    """transformers' save name -> the Hub's (written out here independently of parallm's mapping)."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    if not name.startswith("model.layers."):
        return name
    # the released checkpoints name the attention's KV norm attn.kv_norm (DeepSeek's inference code; vLLM's
    # loader); transformers saves it as attn.norm
    return name[len("model."):].replace(".attn.norm.", ".attn.kv_norm.")


def is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name and name.endswith(".weight")


def is_fp8_linear(name: str) -> bool:
    return (".attn." in name or ".shared_experts." in name or name.endswith(("e_proj.weight", "h_proj.weight"))) \
        and name.endswith(".weight") and not name.endswith("norm.weight") \
        and not any(u in name for u in UNQUANTISED)


def mtp_layer(state: dict, layer: int = 2) -> dict:
    """An MTP layer as the Hub ships one (``mtp.0.*``): a copy of decoder layer ``layer``'s tensors under Hub names
    plus its own projections and norms."""
    g = torch.Generator().manual_seed(7)
    prefix = f"model.layers.{layer}."
    out = {"mtp.0." + k[len(prefix):]: v.clone() for k, v in state.items() if k.startswith(prefix)}
    hidden = state["model.norm.weight"].shape[0]
    out.update({"mtp.0.e_proj.weight": 0.08 * torch.randn(hidden, hidden, generator=g),
                "mtp.0.h_proj.weight": 0.08 * torch.randn(hidden, hidden, generator=g),
                "mtp.0.enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                "mtp.0.hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                "mtp.0.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g)})
    return out


def quantize_state(state: dict, *, scale_dtype=torch.float8_e8m0fnu, hub_names: bool = True,
                   fp4_packed_dtype=torch.int8) -> dict:
    """A save-named fp32 state dict (plus ``mtp.*``) as the Hub ships it: FP8 attention / shared-expert / MTP
    projections with UE8M0 ``X.scale``, FP4 routed experts with ``X.scale``, the rest bf16-free fp32 (exact
    reference), names in the Hub's spelling when ``hub_names``."""
    out = {}
    for name, t in state.items():
        key = hub_name(name) if hub_names else name
        base = key[: -len(".weight")]
        if is_routed_expert(name):
            out[key], out[base + ".scale"] = quantize_fp4(t, scale_dtype=scale_dtype, packed_dtype=fp4_packed_dtype)
        elif is_fp8_linear(name):
            out[key], out[base + ".scale"] = quantize_fp8(t, scale_dtype=scale_dtype)
        else:
            out[key] = t.contiguous()
    return out


def write_hub_checkpoint(path: str, config, state: dict, *, legacy: bool = False) -> str:
    """``state`` as ``model.safetensors`` with a config.json declaring FP8 (UE8M0, BLOCK) + FP4 experts;
    ``legacy``: V4-Flash's first spelling (``DeepseekV3ForCausalLM``, ``compress_ratios``, ``num_hash_layers``,
    top-level ``expert_dtype``)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    d = config.to_dict()
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(BLOCK), "scale_fmt": "ue8m0"}
    if legacy:
        # V4-Flash's per-layer ratios (0 / 4 / 128 name the kind; the tiny rates ride on compress_rate_csa / _hca)
        ratios = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        d["compress_ratios"] = [ratios[t] for t in d.pop("layer_types")] + [0]
        d["num_hash_layers"] = d.pop("mlp_layer_types").count("hash_moe")
        d["compress_rate_csa"] = d["compress_rates"]["compressed_sparse_attention"]
        d["compress_rate_hca"] = d.pop("compress_rates")["heavily_compressed_attention"]
        d["architectures"], d["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
        d["expert_dtype"] = "fp4"
    else:
        d["quantization_config"]["expert_dtype"] = "fp4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    return path
