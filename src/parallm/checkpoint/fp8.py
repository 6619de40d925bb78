"""FP8 block-quantised checkpoints (DeepSeek-V3 / R1 / V3.1, Kimi-K2): dequantisation on load.

Such a checkpoint stores a quantised linear weight as two tensors::

    <name>.weight             [rows, cols]                float8_e4m3fn
    <name>.weight_scale_inv   [ceil(rows / 128), ceil(cols / 128)]   float32, one per 128 x 128 block

(``quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}`` in
config.json; embeddings, norms, the router and the head stay bf16). The real weight is ``weight * scale_inv``
block by block; the edge blocks of a dimension that is not a multiple of 128 are ragged (DeepSeek-V3's
``kv_a_proj_with_mqa`` is ``[576, 7168]``: five block rows, the last 64 rows high) and use their block's scale.
A bare ``weight.to(bf16)`` is off by the scale (typically 1e-3 .. 1e-1): silently wrong weights, Megatron-Bridge's
known trap. So here a float8 weight without its scale, a scale of the wrong grid, or a scale without its weight
is a :class:`~parallm.errors.CheckpointError` naming the tensor.

The arithmetic is transformers' load-time ``Fp8Dequantize``: both factors taken to fp32, multiplied in fp32,
the product cast to the target dtype (one rounding). Unlike that routine, which derives the block from the scale
grid (``rows // scale_rows``, wrong for ragged shapes), the block size here is the checkpoint's
``weight_block_size``, so ragged edges come out right; on them the result equals transformers'
``_dequantize_fp8_weight`` in fp32 (``tests/test_deepseek_parts.py``).

:func:`dequantize` also takes a slice of a weight (``start``: where it begins in the full tensor) with the full
scale grid, so a loader that reads only a rank's rows or columns dequantises exactly those.

DeepSeek-V4's spellings (``quantization_config: {..., "scale_fmt": "ue8m0"}``; transformers' ``Fp8Dequantize``
reads them all): the scale of ``X.weight`` may be stored as ``X.scale`` (the Hub checkpoints' name, which
transformers renames to ``X.weight_scale_inv``), and a scale may be UE8M0: ``float8_e8m0fnu`` (the value is
``2 ** (e - 127)``, exact in fp32) or ``uint8`` exponent bytes, read as ``2 ** (b - 127)`` exactly as transformers
computes it (:func:`scale_values`; never the byte's own value). A ``.scale`` is paired with its weight only when
that weight is float8 (a float ``X.weight`` beside an ``X.scale`` is two tensors of their own); FP4 weights with
their scales are :mod:`parallm.checkpoint.fp4`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import CheckpointError
from ..model.sharding import Source

BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
DOT_SCALE = ".scale"            # DeepSeek-V4's name of X.weight's scale: X.scale
UE8M0_BIAS = 127.0
SCALE_FMTS = (None, "float", "ue8m0")
EXPERT_DTYPES = (None, "fp8", "fp4")
# float8 storage dtypes this torch has (e8m0 is a scale format, not a weight format)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a float8 weight format (one that needs its scale to mean anything)."""
    return dtype in FP8_DTYPES


def scale_name(weight_name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (the checkpoint's name of the weight's block scales)."""
    return weight_name + SCALE_SUFFIX


def scale_names(weight_name: str) -> tuple[str, ...]:
    """Every name a checkpoint may give ``weight_name``'s scales: ``x.weight_scale_inv``, and for ``x.weight``
    DeepSeek-V4's ``x.scale``."""
    if weight_name.endswith(".weight"):
        return (scale_name(weight_name), weight_name[: -len(".weight")] + DOT_SCALE)
    return (scale_name(weight_name),)


def scale_pairs(present, dtypes: Mapping[str, torch.dtype], is_weight) -> dict[str, str]:
    """``{weight: its scale's name}`` for every scale tensor of a checkpoint: ``X_scale_inv`` for ``X`` (any
    weight present), ``X.scale`` for ``X.weight`` when ``is_weight(dtype of X.weight)`` (a quantised dtype: a
    ``.scale`` beside a float weight is no scale). A weight with both spellings is a :class:`CheckpointError`."""
    out: dict[str, str] = {}
    for name in present:
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
        elif name.endswith(DOT_SCALE) and is_weight(dtypes.get(name[: -len(DOT_SCALE)] + ".weight")):
            weight = name[: -len(DOT_SCALE)] + ".weight"
        else:
            continue
        if weight in out:
            raise CheckpointError(f"{weight} has two scales, {out[weight]} and {name}")
        out[weight] = name
    return out


def is_scale_dtype(dtype) -> bool:
    """Whether ``dtype`` can hold block scales: a float format that is no float8 weight format (float32,
    bfloat16, float16, float8_e8m0fnu), or uint8 (UE8M0 exponent bytes)."""
    return dtype == torch.uint8 or dtype is not None and dtype.is_floating_point and dtype not in FP8_DTYPES


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor's fp32 values: ``uint8`` holds UE8M0 exponents, ``2 ** (b - 127)`` (computed as
    transformers' ``Fp8Dequantize`` does); every float format (``float8_e8m0fnu`` included) converts exactly."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - UE8M0_BIAS).exp2()
    return scale.to(torch.float32)


def block_size_of(config) -> tuple[int, int] | None:
    """The block of an FP8 block-quantised checkpoint's config (``quantization_config.weight_block_size``), None
    when the config has no quantization, MXFP4 experts (:mod:`parallm.checkpoint.mxfp4`) or compressed-tensors INT4
    weights (:mod:`parallm.checkpoint.int4`). Another method, a per-tensor FP8 config without a block,
    or activation scales are refused by name (a cast would silently load wrong weights)."""
    q = config.get("quantization_config") if isinstance(config, Mapping) else getattr(config, "quantization_config",
                                                                                      None)
    if not q:
        return None
    if not isinstance(q, Mapping):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    method = q.get("quant_method")
    if method in ("mxfp4", "compressed-tensors"):   # gpt-oss's experts: .mxfp4; Kimi-K2.5's INT4 experts: .int4
        return None
    if method != "fp8":
        raise CheckpointError(f"quantization_config.quant_method={method!r} is not supported (parallm dequantises "
                              "FP8 block checkpoints, quant_method 'fp8', MXFP4 experts, 'mxfp4', and INT4 "
                              "pack-quantized weights, 'compressed-tensors')")
    for key, allowed in (("scale_fmt", SCALE_FMTS), ("expert_dtype", EXPERT_DTYPES)):
        if q.get(key) not in allowed:
            raise CheckpointError(f"quantization_config.{key}={q.get(key)!r} is not supported (parallm reads "
                                  f"{', '.join(repr(a) for a in allowed if a)})")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise CheckpointError(f"an FP8 checkpoint without a valid weight_block_size (got {block!r}): parallm "
                              "dequantises block-scaled FP8 (weight_scale_inv per block) only")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in (None, "dynamic"):
        raise CheckpointError(f"FP8 activation_scheme={scheme!r} is not supported (static activation scales)")
    return int(block[0]), int(block[1])


def scale_grid(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of ``shape`` (leading dims kept, e.g. fused experts ``[E, ...]``):
    ``ceil(rows / block[0]), ceil(cols / block[1])`` over the last two."""
    if len(shape) < 2:
        raise ValueError(f"block scales need a weight of at least 2 dims, got shape {list(shape)}")
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def check_scale(name: str, weight_shape, weight_dtype: torch.dtype, scale_shape, scale_dtype: torch.dtype,
                block: tuple[int, int] = BLOCK, scale: str | None = None) -> None:
    """Raise :class:`CheckpointError` naming ``name`` (the weight's checkpoint name) when its scale cannot
    dequantise it: a non-float8 weight, a scale that is not a float tensor, or a grid that is not the block
    grid of the weight. Reads metadata only. ``scale``: the scale's name (default ``<name>_scale_inv``)."""
    scale = scale or scale_name(name)
    if not is_fp8(weight_dtype):
        raise CheckpointError(f"{name} has a block scale {scale} but is {weight_dtype}, not a float8 weight")
    if not is_scale_dtype(scale_dtype):
        raise CheckpointError(f"{scale} is {scale_dtype}; block scales must be floating point "
                              "(float32 / bfloat16 / float8_e8m0fnu) or uint8 UE8M0 exponents")
    want = scale_grid(tuple(weight_shape), block)
    if tuple(scale_shape) != want:
        raise CheckpointError(f"{scale} has shape {list(scale_shape)}; a {list(weight_shape)} weight in "
                              f"{block[0]}x{block[1]} blocks needs {list(want)}")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, *, block: tuple[int, int] = BLOCK,
               dtype: torch.dtype = torch.bfloat16, start: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``weight * scale_inv`` block by block, computed in fp32 and returned in ``dtype``.

    ``weight``: float8 ``[..., r, c]``, the whole tensor or a slice of it beginning at row / column ``start`` of
    the full tensor (leading dims whole); ``scale_inv``: the full tensor's scale grid (``[..., R, C]``, any
    format :func:`scale_values` reads). Rows and columns of a ragged edge block use that block's scale."""
    if not is_fp8(weight.dtype):
        raise ValueError(f"dequantize: weight is {weight.dtype}, not float8")
    r0, c0 = start
    rows, cols = weight.shape[-2:]
    br, bc = block
    row_block = torch.div(torch.arange(r0, r0 + rows, device=weight.device), br, rounding_mode="floor")
    first, last = c0 // bc, (c0 + cols - 1) // bc
    if rows and int(row_block[-1]) >= scale_inv.shape[-2] or cols and last >= scale_inv.shape[-1]:
        raise ValueError(f"dequantize: rows [{r0}, {r0 + rows}) x columns [{c0}, {c0 + cols}) in {br}x{bc} blocks "
                         f"need more than the {list(scale_inv.shape[-2:])} scales given")
    out = weight.to(torch.float32)
    # each row's scales ([..., rows, C]: small), applied one column block at a time, in place: no weight-sized
    # scale tensor; every element is the fp32 product weight * scale of its block
    row_scales = scale_values(scale_inv.to(device=weight.device)).index_select(-2, row_block)
    for b in range(first, last + 1 if cols else first):
        lo, hi = max(b * bc, c0) - c0, min((b + 1) * bc, c0 + cols) - c0
        out[..., lo:hi].mul_(row_scales[..., b:b + 1])
    return out.to(dtype)


def dequantize_state_dict(state: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.bfloat16,
                          block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """A state dict with every float8 weight replaced by its dequantised ``dtype`` tensor and the scales
    removed (``X_scale_inv``, or ``X.scale`` for a float8 ``X.weight``); other tensors unchanged. A float8 tensor
    without its scale, a scale of the wrong grid or dtype, and a scale without its weight are a
    :class:`CheckpointError` naming the tensor."""
    dtypes = {k: v.dtype for k, v in state.items()}
    pairs = scale_pairs(state, dtypes, is_fp8)
    scales = set(pairs.values())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in scales:
            continue
        scale = state.get(pairs[name]) if name in pairs else None
        if is_fp8(tensor.dtype):
            if scale is None:
                raise CheckpointError(f"{name} is {tensor.dtype} but the checkpoint has no {scale_name(name)} "
                                      f"(one scale per {block[0]}x{block[1]} block): a plain cast would load wrong "
                                      "weights")
            check_scale(name, tensor.shape, tensor.dtype, scale.shape, scale.dtype, block, pairs[name])
            out[name] = dequantize(tensor, scale, block=block, dtype=dtype)
        elif scale is not None:
            check_scale(name, tensor.shape, tensor.dtype, scale.shape, scale.dtype, block, pairs[name])  # raises
        else:
            out[name] = tensor
    for weight, scale in pairs.items():
        if weight not in state:
            raise CheckpointError(f"{scale} is a block scale without its weight {weight}")
    return out


# -- the loader's view: a float8 weight read through its scales --------------------------------------------------

class DequantizedSource(Source):
    """A float8 weight of a checkpoint read as its dequantised fp32 values (:func:`dequantize`): ``read`` takes
    just the requested rows / columns of the stored float8 tensor and the full (small) scale grid, so a loader
    reading one TP rank's slice touches only that slice's bytes. fp32 is exact for the product (float8 x fp32
    scale), so the loader's copy into the parameter rounds once, into the model dtype, as transformers does. A
    3-D weight (experts stacked ``[E, rows, cols]``) is read along dim 0 (whole experts) only."""

    def __init__(self, weight: Source, scale: Source, block: tuple[int, int]):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape = tuple(weight.shape)
        self.dtype = torch.float32
        self._scale = None

    @property
    def is_floating(self) -> bool:
        return True

    def _scales(self) -> torch.Tensor:
        if self._scale is None:
            self._scale = scale_values(self.scale.full())
        return self._scale

    def read(self, dim, start, stop):
        part = self.weight.read(dim, start, stop)
        if len(self.shape) == 2:
            at = (start, 0) if dim == 0 else (0, start)
            return dequantize(part, self._scales(), block=self.block, dtype=torch.float32, start=at)
        if dim != 0:
            raise ValueError(f"a {len(self.shape)}-D float8 weight is read along dim 0 only (got dim {dim})")
        return dequantize(part, self._scales().narrow(0, start, stop - start), block=self.block, dtype=torch.float32)


def fp8_plan(present: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype],
             block: tuple[int, int] | None, *, where: str) -> dict[str, str]:
    """Which checkpoint tensors are float8 weights with block scales: ``{weight name: its scale's name}``
    (``X_scale_inv``, or DeepSeek-V4's ``X.scale`` for a float8 ``X.weight``), every pairing checked
    (:func:`check_scale`) from metadata alone. ``block``: the config's (:func:`block_size_of`); None: a
    checkpoint without a quantization config, which must hold no float8 tensor and no scale. Raises
    :class:`CheckpointError` naming each problem (a float8 weight without its scale, a scale without its weight
    or of the wrong grid, float8 weights where the config declares no quantization)."""
    scales = scale_pairs(present, dtypes, is_fp8)
    fp8 = sorted(n for n, d in dtypes.items() if is_fp8(d))
    if block is None:
        if fp8 or scales:
            shown = ", ".join((fp8 or sorted(scales.values()))[:4])
            raise CheckpointError(f"{where}: float8 tensors / block scales ({shown}) but the config has no "
                                  "quantization_config (weight_block_size): a plain cast would load wrong weights")
        return {}
    for weight, scale in sorted(scales.items()):
        if weight not in present:
            raise CheckpointError(f"{where}: {scale} is a block scale without its weight {weight}")
        check_scale(weight, present[weight], dtypes[weight], present[scale], dtypes[scale], block, scale)
    unscaled = [n for n in fp8 if n not in scales]
    if unscaled:
        raise CheckpointError(f"{where}: {', '.join(unscaled[:4])} is float8 but the checkpoint has no "
                              f"{' or '.join(scale_names(unscaled[0]))} (one scale per {block[0]}x{block[1]} block):"
                              " a plain cast would load wrong weights")
    return scales
