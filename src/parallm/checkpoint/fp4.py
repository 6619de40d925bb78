"""FP4 (e2m1) routed experts of DeepSeek-V4 checkpoints: dequantisation on load.

A V4 checkpoint whose config says ``expert_dtype: "fp4"`` (in ``quantization_config``, or top level as the V4
configs ship it; transformers' ``DeepseekV4Config`` folds it into ``quantization_config``) stores each routed
expert's linear weight ``X.weight`` (``[N, K]`` once dequantised) as::

    X.weight   [N, K / 2]    int8 (or float4_e2m1fn_x2): two e2m1 values per byte, column 2j in the low nibble,
                             column 2j + 1 in the high nibble
    X.scale    [N, K / 32]   one scale per row per 32 columns: float8_e8m0fnu (``scale_fmt: "ue8m0"``), uint8
                             UE8M0 exponents (``2 ** (b - 127)``) or float32

(``X.weight_scale_inv`` is transformers' name of the same scale; both are read). A nibble ``n`` is
``E2M1[n] = (0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6)[n]`` and the weight is
``E2M1[n] * scale`` multiplied in fp32, then rounded once into the model dtype by the loader's filling copy:
transformers' ``Fp8Dequantize._dequantize_one`` (``_unpack_fp4``, the fp32 product, one cast), bit for bit. With
UE8M0 scales the fp32 product is exact (a two-bit significand times a power of two); with float32 scales it is
the same fp32 rounding transformers makes.

:class:`Fp4Source` reads such a pair as the ``[N, K]`` weight: a slice of rows reads only those rows' bytes and
scales, a slice of columns only the bytes and 32-wide groups covering them, so a rank reads only its own experts
(one tensor each in these checkpoints) and, within them, only its TP slice. A last dimension that is not a
multiple of 32 takes its partial group's scale (transformers refuses such a grid).

Refused by name (a :class:`~parallm.errors.CheckpointError`): packed weights in a checkpoint whose config does
not say ``expert_dtype: "fp4"``, a packed weight without its scale (a ``float4_e2m1fn_x2`` tensor, or an int8
``*.weight`` when FP4 is declared), a scale of the wrong shape or dtype, a scale without its weight, a weight
stored both packed and unpacked. Saves write the dequantised weights in the model's (or the requested) dtype and
drop ``quantization_config`` (parallm writes no FP4).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import CheckpointError
from ..model.sharding import Source
from .fp8 import is_scale_dtype, scale_names, scale_pairs, scale_values

GROUP = 32                      # columns per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED_DTYPES = (torch.int8,) + tuple(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))


def is_packed(dtype) -> bool:
    """Whether ``dtype`` stores FP4 pairs when a scale goes with it (int8, float4_e2m1fn_x2)."""
    return dtype in PACKED_DTYPES


def expert_dtype_of(config) -> str | None:
    """``expert_dtype`` of a config (object or config.json dict): ``quantization_config``'s, else the top-level
    key V4 configs ship; None when neither is set."""
    def get(c, key):
        return c.get(key) if isinstance(c, Mapping) else getattr(c, key, None)
    q = get(config, "quantization_config")
    if q and not isinstance(q, Mapping):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    value = (q or {}).get("expert_dtype") or get(config, "expert_dtype")
    if value not in (None, "fp8", "fp4"):
        raise CheckpointError(f"expert_dtype={value!r} is not supported (parallm reads 'fp8' and 'fp4' experts)")
    return value


# -- the arithmetic ---------------------------------------------------------------------------------------------

def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[..., B]`` bytes of e2m1 pairs -> ``[..., 2 B]`` fp32 values, low nibble first."""
    if not is_packed(packed.dtype):
        raise ValueError(f"FP4 pairs are stored as int8 or float4_e2m1fn_x2, got {packed.dtype}")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return values.flatten(-2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, *, column: int = 0, group_start: int = 0,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1[nibble] * scale`` in fp32, returned in ``dtype``.

    ``packed``: ``[..., r, B]``, the bytes of columns ``[column, column + 2 B)`` of the full weight (``column``
    even); ``scale``: the same rows' scales for the groups from ``group_start`` on (``[..., r, G]``, any format
    :func:`~parallm.checkpoint.fp8.scale_values` reads): column ``c`` takes group ``c // 32``."""
    if column % 2:
        raise ValueError(f"an FP4 slice begins at an even column (a byte boundary), got {column}")
    values = unpack(packed)
    cols = values.shape[-1]
    groups = torch.div(torch.arange(column, column + cols, device=values.device), GROUP,
                       rounding_mode="floor") - group_start
    if cols and (int(groups[0]) < 0 or int(groups[-1]) >= scale.shape[-1]):
        raise ValueError(f"FP4 columns [{column}, {column + cols}) need scale groups [{column // GROUP}, "
                         f"{(column + cols - 1) // GROUP}], not the {scale.shape[-1]} from {group_start} given")
    scales = scale_values(scale.to(device=values.device)).index_select(-1, groups)
    return (values * scales).to(dtype)


class Fp4Source(Source):
    """A packed FP4 weight ``[..., N, K / 2]`` and its scales ``[..., N, ceil(K / 32)]`` (each a :class:`Source`)
    read as the ``[..., N, K]`` fp32 weight. 2-D: any rows or columns, touching only their bytes and groups;
    more dims (experts stacked): whole entries along dim 0."""

    def __init__(self, weight: Source, scale: Source):
        self.weight, self.scale = weight, scale
        self.shape = (*weight.shape[:-1], 2 * weight.shape[-1])
        self.dtype = torch.float32

    @property
    def is_floating(self) -> bool:
        return True

    def read(self, dim, start, stop):
        ndim = len(self.shape)
        dim = dim % ndim
        if dim == ndim - 1 and ndim == 2:
            b0, b1 = start // 2, -(-stop // 2)
            g0 = start // GROUP
            g1 = max(g0, -(-stop // GROUP))
            part = dequantize(self.weight.read(1, b0, b1), self.scale.read(1, g0, g1),
                              column=2 * b0, group_start=g0)
            return part[..., start - 2 * b0:stop - 2 * b0]
        if dim != 0:
            raise ValueError(f"a {ndim}-D FP4 weight is read along dim 0{' or 1' if ndim == 2 else ''} (got {dim})")
        return dequantize(self.weight.read(0, start, stop), self.scale.read(0, start, stop))


# -- the loader's view ------------------------------------------------------------------------------------------

def packed_shape(weight_shape) -> tuple[int, ...]:
    """The dequantised shape of a packed ``[..., N, B]`` weight: ``[..., N, 2 B]``."""
    return (*weight_shape[:-1], 2 * weight_shape[-1])


def fp4_scale_shape(weight_shape) -> tuple[int, ...]:
    """The scale shape a packed ``[..., N, B]`` weight needs: ``[..., N, ceil(2 B / 32)]``."""
    return (*weight_shape[:-1], -(-2 * weight_shape[-1] // GROUP))


def fp4_plan(present: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype], declared: bool, *,
             where: str) -> dict[str, str]:
    """The checkpoint's FP4 weights: ``{weight: its scale's name}`` (packed dtype with a scale), every pairing
    checked from metadata. ``declared``: the config says ``expert_dtype: "fp4"`` (:func:`expert_dtype_of`; a
    checkpoint without FP4 tensors, such as a dequantised one parallm saved, loads into such a model too)."""
    pairs = {w: s for w, s in scale_pairs(present, dtypes, is_packed).items() if is_packed(dtypes.get(w))}
    bare = sorted(n for n, d in dtypes.items() if n not in pairs and is_packed(d)
                  and (d != torch.int8 or declared and n.endswith(".weight")))
    if bare:
        raise CheckpointError(f"{where}: {', '.join(bare[:4])} is packed FP4 ({dtypes[bare[0]]}) but the checkpoint "
                              f"has no {' or '.join(scale_names(bare[0]))}: its bytes read as weights would be wrong")
    if not pairs:
        return {}
    if not declared:
        shown = ", ".join(sorted(pairs)[:4])
        raise CheckpointError(f"{where}: packed FP4 weights with scales ({shown}) but the config does not say "
                              "expert_dtype 'fp4': their bytes read as weights would be wrong")
    for weight, scale in sorted(pairs.items()):
        shape, want = tuple(present[weight]), fp4_scale_shape(tuple(present[weight]))
        if len(shape) < 2:
            raise CheckpointError(f"{where}: {weight} is packed FP4 of shape {list(shape)}; at least 2 dims expected")
        if not is_scale_dtype(dtypes.get(scale)):
            raise CheckpointError(f"{where}: {scale} is {dtypes.get(scale)}; FP4 scales are float8_e8m0fnu, uint8 "
                                  "UE8M0 exponents or floating point")
        if tuple(present[scale]) != want:
            raise CheckpointError(f"{where}: {scale} has shape {list(present[scale])}; the packed {list(shape)} "
                                  f"weight {weight} ({packed_shape(shape)[-1]} columns, one scale per row per "
                                  f"{GROUP}) needs {list(want)}")
    return pairs


def fp4_view(present: dict, dtypes: dict, raw, *, declared: bool, where: str):
    """A checkpoint's ``(names -> shapes, names -> dtypes, raw)`` with each FP4 weight's pair replaced by the
    weight (read through an :class:`Fp4Source`, fp32) and its scale no tensor of its own. Unchanged when it has
    none."""
    pairs = fp4_plan(present, dtypes, declared, where=where)
    if not pairs:
        return present, dtypes, raw
    scales = set(pairs.values())
    shapes = {k: (packed_shape(v) if k in pairs else v) for k, v in present.items() if k not in scales}
    types = {k: (torch.float32 if k in pairs else dtypes.get(k)) for k in shapes}

    def read(name):
        scale = pairs.get(name)
        return raw(name) if scale is None else Fp4Source(raw(name), raw(scale))
    return shapes, types, read
