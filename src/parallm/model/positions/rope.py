"""Rotary position embeddings (RoPE), equal to transformers' bit for bit.

Conventions:

* "rotate_half" layout (the Hugging Face / LLaMA convention, *not* the interleaved
  GPT-J layout): the rotary dimension ``dim`` is split into two halves; ``cos`` and
  ``sin`` are ``cat((freqs, freqs), -1)`` and the rotation is
  ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat((-x2, x1), -1)``.
* ``cos``/``sin`` are built in fp32 as ``position_ids[..., None].float() * inv_freq``
  (an elementwise product, exactly what ``transformers`` 5.x does) and are cast to the
  activation dtype only inside :func:`apply_rope`.
* The rotary dimension always equals ``head_dim``; partial rotary embeddings are
  rejected.
* Supported scaling kinds: ``default``, ``linear``, ``dynamic`` (dynamic NTK), ``llama3`` and
  ``proportional`` (Gemma 4's global layers: the first ``int(proportion * dim // 2)`` frequencies of the
  default ones over the *whole* head, ``1 / theta^(2j / dim)``, the rest 0, all divided by ``factor``; the
  rotation pairs channel ``j`` with ``j + dim / 2`` as the full-head RoPE does, and the zero frequencies leave
  their channels unchanged: cos 1, sin 0. Not GLM's partial RoPE, which rotates the first channels only).
  For all five, ``transformers`` uses an attention scaling (cos/sin multiplier) of exactly 1.0, so none is
  applied here.

Dynamic NTK: ``transformers`` keeps ``inv_freq`` as mutable module state: on each forward it takes
``seq_len = max(position_ids) + 1`` over the *whole* position tensor; if it exceeds the
cached length it recomputes ``inv_freq`` for that ``seq_len``, and it resets to the
original ``inv_freq`` when ``seq_len < max_position_embeddings`` after having grown.
This module is stateless: ``seq_len <= max_position_embeddings`` gives the original
frequencies and a larger ``seq_len`` gives the NTK-scaled frequencies for that
``seq_len``. That equals a fresh HF module, and an HF module whose inputs never shrink
while staying above ``max_position_embeddings`` (in that one case HF would keep the
frequencies of the earlier, longer input).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "proportional")

_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    """Everything needed to reproduce a transformers rotary embedding: the rotary ``dim`` (= head_dim, even),
    the base ``theta``, the ``kind`` (one of :data:`SUPPORTED_ROPE_KINDS`), its scaling ``factor`` (1.0 for
    ``default``), llama3's band edges ``low_freq_factor`` / ``high_freq_factor`` and pre-training context
    ``original_max_position_embeddings``, and the model's ``max_position_embeddings`` (dynamic NTK's threshold,
    as in transformers; required for ``dynamic``)."""

    dim: int
    theta: float
    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    proportion: float = 1.0     # proportional: the share of the head's frequencies that rotate (its partial factor)

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_ROPE_KINDS:
            raise ValueError(
                f"Unsupported RoPE kind {self.kind!r}; supported kinds: {SUPPORTED_ROPE_KINDS}"
            )
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE dim must be a positive even number, got {self.dim}")
        if self.kind == "dynamic":
            if self.max_position_embeddings is None:
                raise ValueError("dynamic RoPE needs max_position_embeddings")
            if self.dim <= 2:
                raise ValueError(f"dynamic RoPE needs dim > 2, got {self.dim}")
        if not 0.0 < self.proportion <= 1.0 or (self.proportion != 1.0 and self.kind != "proportional"):
            raise ValueError(f"RoPE proportion {self.proportion} must lie in (0, 1], and differ from 1 only for the "
                             "proportional kind")
        if self.kind == "llama3" and self.original_max_position_embeddings is None:
            raise ValueError("llama3 RoPE needs original_max_position_embeddings")


# -- config parsing -------------------------------------------------------------------------------------------

def _cfg_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    try:
        return getattr(config, key, default)
    except Exception:  # some config properties raise on access
        return default


def rope_spec_from_hf_config(config: Any, head_dim: int) -> RopeSpec:
    """Build a :class:`RopeSpec` from a transformers config object or a config.json dict.

    Accepted layouts:

    * transformers 5.x: ``rope_parameters = {"rope_type": ..., "rope_theta": ..., ...}``
      (config objects built from legacy ``rope_scaling``/``rope_theta`` kwargs also end
      up carrying only ``rope_parameters``).
    * transformers 4.x: top-level ``rope_theta`` (default 10000.0) plus ``rope_scaling``
      (``None`` or a dict keyed by ``"rope_type"`` or legacy ``"type"``).

    A non-empty ``rope_parameters`` wins over ``rope_scaling``. Inside the chosen dict,
    ``rope_theta`` wins over a top-level ``rope_theta`` and ``"rope_type"`` over ``"type"``.
    ``max_position_embeddings`` is read from the config top level. An unsupported kind (yarn, longrope, mrope,
    per-layer dicts, ...), ``partial_rotary_factor != 1`` or a missing required parameter is a ValueError.
    """
    params = _cfg_get(config, "rope_parameters")
    if not params:
        params = _cfg_get(config, "rope_scaling")
    params = dict(params) if params else {}

    # Per-layer-type nested dicts (e.g. {"full_attention": {...}, "sliding_attention": {...}}).
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            "Per-layer-type rope_parameters are not supported "
            f"(got keys {sorted(params)}); supported kinds: {SUPPORTED_ROPE_KINDS}"
        )

    kind = params.get("rope_type", params.get("type", "default"))
    if kind is None:
        kind = "default"
    if "mrope_section" in params or _cfg_get(config, "mrope_section") is not None:
        kind_desc = f"{kind!r} with mrope_section (mrope)"
        raise ValueError(
            f"Unsupported RoPE kind {kind_desc}; supported kinds: {SUPPORTED_ROPE_KINDS}"
        )
    if kind not in SUPPORTED_ROPE_KINDS:
        raise ValueError(f"Unsupported RoPE kind {kind!r}; supported kinds: {SUPPORTED_ROPE_KINDS}")

    prf = params.get("partial_rotary_factor", None)
    if prf is None:
        prf = _cfg_get(config, "partial_rotary_factor", None)
    if kind == "proportional":      # the factor picks the rotating frequencies over the whole head
        return _proportional(config, params, prf, head_dim)
    if prf is not None and float(prf) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={prf} is not supported (RoPE kind {kind!r}); only full "
            f"rotary embeddings (partial_rotary_factor == 1) are supported for kinds "
            f"{SUPPORTED_ROPE_KINDS}"
        )

    theta = params.get("rope_theta", None)
    if theta is None:
        theta = _cfg_get(config, "rope_theta", None)
    if theta is None:
        theta = _DEFAULT_THETA

    max_pos = _cfg_get(config, "max_position_embeddings", None)
    max_pos = int(max_pos) if max_pos is not None else None

    def required(key: str) -> Any:
        if params.get(key) is None:
            raise ValueError(f"RoPE kind {kind!r} requires {key!r} in rope parameters; got {params}")
        return params[key]

    kwargs: dict[str, Any] = {}
    if kind in ("linear", "dynamic", "llama3"):
        kwargs["factor"] = float(required("factor"))
    if kind == "llama3":
        kwargs["low_freq_factor"] = float(required("low_freq_factor"))
        kwargs["high_freq_factor"] = float(required("high_freq_factor"))
        # transformers gives a top-level original_max_position_embeddings priority,
        # then the rope dict, then falls back to max_position_embeddings.
        orig = _cfg_get(config, "original_max_position_embeddings", None)
        if orig is None:
            orig = params.get("original_max_position_embeddings", None)
        if orig is None:
            orig = max_pos
        if orig is None:
            raise ValueError("llama3 RoPE requires original_max_position_embeddings")
        kwargs["original_max_position_embeddings"] = int(orig)
    if kind == "dynamic" and max_pos is None:
        raise ValueError("dynamic RoPE requires max_position_embeddings in the config")

    return RopeSpec(
        dim=int(head_dim),
        theta=float(theta),
        kind=kind,
        max_position_embeddings=max_pos,
        **kwargs,
    )


def _proportional(config: Any, params: dict, prf, head_dim: int) -> RopeSpec:
    theta = params.get("rope_theta") or _cfg_get(config, "rope_theta") or _DEFAULT_THETA
    return RopeSpec(dim=int(head_dim), theta=float(theta), kind="proportional", factor=float(params.get("factor") or 1.0),
                    proportion=float(1.0 if prf is None else prf),
                    max_position_embeddings=_cfg_get(config, "max_position_embeddings", None))


# -- frequencies ----------------------------------------------------------------------------------------------

def _exponents(dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    # (0, 2, 4, ..., dim-2) / dim in fp32
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


@functools.lru_cache(maxsize=64)
def _static_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """inv_freq on CPU for everything except the NTK-grown dynamic branch."""
    dim = spec.dim
    if spec.kind == "dynamic":
        # transformers' init-time value (seq_len = max_position_embeddings), python floats.
        m = spec.max_position_embeddings
        f = spec.factor
        base = spec.theta * ((f * m / m) - (f - 1)) ** (dim / (dim - 2))
    else:
        base = spec.theta
    inv_freq = 1.0 / (base ** _exponents(dim))

    if spec.kind == "proportional":     # transformers' _compute_proportional_rope_parameters
        angles = int(spec.proportion * dim // 2)
        inv_freq[angles:] = 0.0
        inv_freq /= spec.factor
    elif spec.kind == "linear":
        inv_freq = inv_freq / spec.factor
    elif spec.kind == "llama3":
        f = spec.factor
        lo, hi = spec.low_freq_factor, spec.high_freq_factor
        ctx = spec.original_max_position_embeddings
        long_wavelen = ctx / lo  # longer than this: fully interpolated (divided by factor)
        short_wavelen = ctx / hi  # shorter than this: untouched
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > long_wavelen, inv_freq / f, inv_freq)
        ramp = (ctx / wavelen - lo) / (hi - lo)
        blended = (1 - ramp) * scaled / f + ramp * scaled
        in_between = ~(wavelen < short_wavelen) * ~(wavelen > long_wavelen)
        inv_freq = torch.where(in_between, blended, scaled)
    return inv_freq


def _ntk_inv_freq(spec: RopeSpec, seq_len: int, device: torch.device | str | None) -> torch.Tensor:
    """Dynamic-NTK inv_freq for seq_len > max_position_embeddings.

    Mirrors transformers' forward-time path, where ``seq_len`` is an int64 tensor, so the
    base is computed in fp32 tensor arithmetic (not python doubles).
    """
    dim = spec.dim
    m = spec.max_position_embeddings
    f = spec.factor
    seq = torch.tensor(seq_len, dtype=torch.int64, device=device)
    seq = torch.maximum(seq, torch.tensor(m, dtype=torch.int64, device=device))
    base = spec.theta * ((f * seq / m) - (f - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, device=device))


def rope_inv_freq(spec: RopeSpec, seq_len: int | None = None, *, device=None) -> torch.Tensor:
    """Inverse frequencies, fp32, shape ``[spec.dim // 2]``.

    ``seq_len`` only matters for ``kind == "dynamic"``: ``None`` or
    ``seq_len <= max_position_embeddings`` gives the original frequencies, a larger
    value the NTK-scaled ones for that length (as transformers' dynamic RoPE; see the
    module docstring for the statefulness caveat). ``device`` selects where the
    NTK-scaled branch is computed (transformers computes it on the activations' device);
    all other frequencies are computed on CPU and moved.
    """
    if spec.kind == "dynamic" and seq_len is not None and int(seq_len) > spec.max_position_embeddings:
        return _ntk_inv_freq(spec, int(seq_len), device)
    return _static_inv_freq(spec).to(device=device, copy=True)


def rope_cos_sin(spec: RopeSpec, position_ids: torch.Tensor, seq_len: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for arbitrary-shaped integer ``position_ids``.

    Returns fp32 ``cos, sin`` of shape ``position_ids.shape + (spec.dim,)`` on
    ``position_ids.device``, in the rotate_half convention (``cat((freqs, freqs), -1)``).
    For ``dynamic`` the effective sequence length is ``position_ids.max() + 1`` over the
    whole tensor (all batch rows together), like transformers, unless ``seq_len`` gives it: a batch run as
    microbatches (or split over context-parallel ranks) passes the whole batch's length so that every piece
    uses the frequencies transformers uses for the whole batch.
    """
    device = position_ids.device
    if spec.kind == "dynamic" and seq_len is None and position_ids.numel() > 0:
        seq_len = int(position_ids.max()) + 1
    inv_freq = rope_inv_freq(spec, seq_len, device=device)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat((-x2, x1), -1)`` where ``x1, x2`` are the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[..., heads, dim]`` by ``cos``/``sin`` of shape ``[..., dim]``.

    ``cos``/``sin`` are broadcast over the heads axis (``unsqueeze(-2)``) and cast to
    ``x.dtype`` first; the result ``x * cos + rotate_half(x) * sin`` is computed in
    ``x.dtype``, bit-identical to transformers' ``apply_rotary_pos_emb``.
    """
    if cos.shape[-1] != x.shape[-1] or sin.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"apply_rope: last dim of x ({x.shape[-1]}) must equal that of cos/sin "
            f"({cos.shape[-1]}/{sin.shape[-1]}); partial rotary is not supported"
        )
    cos = cos.to(x.dtype).unsqueeze(-2)
    sin = sin.to(x.dtype).unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
