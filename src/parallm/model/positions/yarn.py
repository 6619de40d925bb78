"""YaRN RoPE (``rope_type: "yarn"``) and partial rotary embeddings, equal to transformers 5 bit for bit.

YaRN (transformers' ``_compute_yarn_parameters``, the DeepSeek-V3 / Kimi-K2 / Qwen long-context scaling) blends,
per frequency, the original ``inv_freq`` (extrapolation, high frequencies) with ``inv_freq / factor``
(interpolation, low frequencies) over a linear ramp between the correction dimensions of ``beta_fast`` and
``beta_slow`` rotations in ``original_max_position_embeddings`` positions (floored / ceiled unless ``truncate``
is False). It also scales the rotation:

* cos / sin are multiplied by the **attention factor**: ``attention_factor`` when given, else
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set (DeepSeek-V3: 1.0), else
  ``mscale(factor)``, with ``mscale(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1`` (1 otherwise);
* DeepSeek's multi-head latent attention multiplies its softmax scale by ``mscale(factor, mscale_all_dim) ** 2``
  when ``mscale_all_dim`` is set (:func:`mla_softmax_scale`; often forgotten, and with DeepSeek-V3's factor 40 it
  is 1.87: logits off by that much).

Partial rotary embeddings (GLM-4.5, ``partial_rotary_factor``): the first ``int(head_dim * factor)`` channels of
each head rotate (rotate_half layout, not interleaved), the rest pass unchanged (:func:`apply_partial_rope`).

Everything here is pure: no process groups, no modules.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from .rope import _cfg_get as _get
from .rope import apply_rope

_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class YarnSpec:
    """transformers' YaRN parameters, read as ``_compute_yarn_parameters`` reads them. ``dim`` is the rotary
    dimension (``head_dim * partial_rotary_factor``; DeepSeek: ``qk_rope_head_dim``). ``mscale`` /
    ``mscale_all_dim`` / ``attention_factor`` are None when the config does not set them (their truthiness
    matters, as in transformers); ``beta_fast`` / ``beta_slow`` are already defaulted (32 / 1)."""
    dim: int
    theta: float
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"YaRN rotary dim must be a positive even number, got {self.dim}")
        if not self.factor or self.factor <= 0:
            raise ValueError(f"YaRN needs a positive factor, got {self.factor!r}")
        if not self.original_max_position_embeddings or self.original_max_position_embeddings <= 0:
            raise ValueError("YaRN needs original_max_position_embeddings > 0, got "
                             f"{self.original_max_position_embeddings!r}")

    @property
    def kind(self) -> str:
        return "yarn"


# -- reading configs (transformers 4.x and 5.x layouts, objects and config.json dicts) ------------------------

def rope_parameters(config: Any) -> dict:
    """The config's RoPE dict as transformers 5's ``standardize_rope_params`` leaves it: ``rope_parameters``
    (5.x) or ``rope_scaling`` (4.x), with ``rope_type`` (from a legacy ``type``), ``rope_theta`` (a top-level
    ``rope_theta`` or 10000), ``partial_rotary_factor`` (top level when not in the dict) and, for yarn, llama3 and
    longrope, ``original_max_position_embeddings`` (a top-level value wins, then the dict's, then
    ``max_position_embeddings``). Per-layer-type nested dicts are refused."""
    params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported (got keys {sorted(params)})")
    kind = params.get("rope_type", params.get("type")) or "default"
    params["rope_type"] = kind
    params.pop("type", None)
    if params.get("rope_theta") is None:
        theta = _get(config, "rope_theta")
        params["rope_theta"] = float(theta) if theta is not None else _DEFAULT_THETA
    if "partial_rotary_factor" not in params and _get(config, "partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = _get(config, "partial_rotary_factor")
    if kind in ("llama3", "yarn", "longrope"):
        top = _get(config, "original_max_position_embeddings")
        if top is not None:
            params["original_max_position_embeddings"] = top
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = _get(config, "max_position_embeddings")
    return params


def rotary_dim(head_dim: int, partial_rotary_factor: float | None) -> int:
    """transformers' ``int(head_dim * partial_rotary_factor)`` (the whole head when the factor is None)."""
    return int(head_dim * (1.0 if partial_rotary_factor is None else partial_rotary_factor))


def yarn_spec_from_params(params: dict, *, dim: int, max_position_embeddings: int | None) -> YarnSpec:
    """A :class:`YarnSpec` from a standardised RoPE dict (:func:`rope_parameters`) of ``rope_type == "yarn"``;
    ``dim``: the rotary dimension; ``max_position_embeddings``: the config's (a missing ``factor`` is
    ``max_position_embeddings / original_max_position_embeddings``, as in transformers)."""
    if params.get("rope_type") != "yarn":
        raise ValueError(f"not a yarn RoPE dict: rope_type={params.get('rope_type')!r}")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn RoPE requires original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("yarn RoPE without factor needs max_position_embeddings")
        factor = max_position_embeddings / original
    optional = {k: (float(params[k]) if params.get(k) is not None else None)
                for k in ("mscale", "mscale_all_dim", "attention_factor")}
    return YarnSpec(dim=int(dim), theta=float(params["rope_theta"]), factor=float(factor),
                    original_max_position_embeddings=int(original),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    truncate=bool(params.get("truncate", True)), **optional)


# -- the numbers ----------------------------------------------------------------------------------------------

def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1 (transformers' / DeepSeek's ``get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(spec: YarnSpec) -> float:
    """The multiplier transformers applies to cos and sin (its ``attention_scaling``)."""
    if spec.attention_factor is not None:
        return spec.attention_factor
    if spec.mscale and spec.mscale_all_dim:
        return float(yarn_get_mscale(spec.factor, spec.mscale) / yarn_get_mscale(spec.factor, spec.mscale_all_dim))
    return yarn_get_mscale(spec.factor)


def softmax_mscale(spec: YarnSpec | None) -> float:
    """DeepSeek's softmax-scale factor ``mscale(factor, mscale_all_dim) ** 2`` (1.0 without yarn or without
    ``mscale_all_dim``)."""
    if spec is None or not spec.mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(spec.factor, spec.mscale_all_dim)
    return m * m


def mla_softmax_scale(q_head_dim: int, spec: YarnSpec | None) -> float:
    """Multi-head latent attention's softmax scale, computed as ``DeepseekV3Attention.scaling`` is (the same
    float): ``q_head_dim ** -0.5``, times ``mscale * mscale`` with ``mscale = mscale(factor, mscale_all_dim)``
    under yarn. ``q_head_dim`` is transformers' ``qk_head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim`` (not
    megatron-core's ``qk_head_dim``, which is the nope part alone)."""
    scaling = q_head_dim ** (-0.5)
    if spec is not None and spec.mscale_all_dim:
        m = yarn_get_mscale(spec.factor, spec.mscale_all_dim)
        scaling = scaling * m * m
    return scaling


def _correction_range(spec: YarnSpec) -> tuple[float, float]:
    dim, base, ctx = spec.dim, spec.theta, spec.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


@functools.lru_cache(maxsize=64)
def _yarn_inv_freq(spec: YarnSpec) -> torch.Tensor:
    dim = spec.dim
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (spec.factor * pos_freqs)
    low, high = _correction_range(spec)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def yarn_inv_freq(spec: YarnSpec, *, device=None) -> torch.Tensor:
    """fp32 ``[dim // 2]``, equal to ``ROPE_INIT_FUNCTIONS["yarn"](config)[0]`` (computed on CPU, then moved)."""
    return _yarn_inv_freq(spec).to(device=device, copy=True)


def yarn_cos_sin(spec: YarnSpec, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``position_ids.shape + (dim,)`` (``cat((freqs, freqs), -1)``), each multiplied
    by :func:`yarn_attention_factor` in fp32, as transformers' rotary embedding computes them before casting
    them to the activations' dtype (``apply_rope`` / :func:`apply_partial_rope` cast)."""
    inv_freq = yarn_inv_freq(spec, device=position_ids.device)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = yarn_attention_factor(spec)
    return emb.cos() * factor, emb.sin() * factor


# -- partial rotary ---------------------------------------------------------------------------------------------

def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x`` (``[..., heads, head_dim]``) in the rotate_half
    layout and pass the rest unchanged: transformers' GLM-4.5 ``apply_rotary_pos_emb``, bit for bit. With
    ``cos`` as wide as the head it is :func:`parallm.model.positions.rope.apply_rope`."""
    rot = cos.shape[-1]
    if rot > x.shape[-1]:
        raise ValueError(f"apply_partial_rope: the rotary dim {rot} exceeds the head dim {x.shape[-1]}")
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
