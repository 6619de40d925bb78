"""compressed-tensors INT4 ``pack-quantized`` checkpoints (Kimi-K2.5 / K2.6's routed experts): dequantisation on
load.

``quantization_config: {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups":
{"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
"group_size": 32, "symmetric": true, ...}}}, "ignore": ["lm_head", "re:.*self_attn.*", ...]}`` (in config.json, or
in its ``text_config`` as Kimi-K2.5 ships it), and for each quantised linear module ``M`` (weight ``[rows,
cols]``) these tensors instead of ``M.weight``::

    M.weight_packed       [rows, cols / 8]        int32: eight int4 values per word, value j at bits 4j .. 4j + 3
    M.weight_scale        [rows, cols / g]        one scale per group of g consecutive columns (bf16 / fp32)
    M.weight_zero_point   [ceil(rows / 8), cols / g]   int32 (asymmetric only): packed the same way along rows
    M.weight_shape        [2]                     int: (rows, cols)

A stored nibble ``n`` is the signed value ``n - 8`` (compressed-tensors' ``pack_to_int32`` /
``unpack_from_int32``); the weight is ``(q - zero_point) * scale`` computed in the scale's dtype, exactly
compressed-tensors' ``dequantize`` (``_process_group`` / ``_dequantize``: both operands taken to the scale's
dtype, one subtraction, one product, each value rounded once to that dtype), then converted to the model dtype
by the loader's filling copy. In a bf16 model that is the value compressed-tensors (and so transformers' and
vLLM's dequantising loads) computes, bit for bit; an fp32 model holds the same bf16-rounded values.

:class:`Int4Source` reads one module's weight: a TP slice of its rows reads only those rows' words and scales;
a slice of its columns only the words and groups covering them. Which modules are quantised is what the
checkpoint holds (every ``*.weight_packed``); each must be one the config's groups target (a class name such as
``Linear`` targets every module, ``re:`` patterns and names match the module's checkpoint name) and not one its
``ignore`` list names. Refused by name: other formats (``naive-quantized``, ``float-quantized``,
``nvfp4-pack-quantized``, ...), ``num_bits`` other than 4, strategies other than ``group``, non-int types,
activation or KV-cache quantization, ``actorder: group`` (``weight_g_idx``), a packed weight without its scale or
shape (or the reverse), shapes that do not pair up, a zero point missing (asymmetric) or present (symmetric),
and packed tensors in a checkpoint whose config declares no compressed-tensors quantization. Saves write the
dequantised weights in the model's (or the requested) dtype and drop ``quantization_config`` (parallm writes no
INT4).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..model.sharding import Source

BITS = 4
PER_WORD = 32 // BITS
OFFSET = 1 << (BITS - 1)                # stored nibble = signed value + 8
PACKED, SCALE, ZERO, SHAPE = "weight_packed", "weight_scale", "weight_zero_point", "weight_shape"
PARTS = (PACKED, SCALE, ZERO, SHAPE)
# what other compressed-tensors schemes store beside a weight: refused by name rather than read as weights
UNSUPPORTED_PARTS = ("weight_g_idx", "weight_global_scale", "input_scale", "input_global_scale",
                     "input_zero_point", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization: its targets and group size, and whether it has a zero point."""
    name: str
    targets: tuple[str, ...]
    group_size: int
    symmetric: bool


@dataclass(frozen=True)
class Int4Config:
    """A checkpoint's compressed-tensors INT4 pack-quantized settings (:func:`int4_config`)."""
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, module: str, where: str) -> Scheme:
        """The group quantising ``module`` (a name or ``re:`` target matching it before a class name, as
        compressed-tensors orders them); a :class:`CheckpointError` when the config ignores it or targets it
        with no group (or with two)."""
        if any(_matches(p, module) for p in self.ignore):
            raise CheckpointError(f"{where}: {module} is stored pack-quantized but quantization_config.ignore "
                                  "lists it")
        by_name = [s for s in self.schemes if any(_is_name(t) and _matches(t, module) for t in s.targets)]
        by_class = [s for s in self.schemes if any(not _is_name(t) for t in s.targets)]
        for hits in (by_name, by_class):
            if len(hits) > 1:
                raise CheckpointError(f"{where}: {module} is targeted by more than one quantization group "
                                      f"({', '.join(s.name for s in hits)})")
            if hits:
                return hits[0]
        raise CheckpointError(f"{where}: {module} is stored pack-quantized but no quantization_config group "
                              "targets it")


def _is_name(target: str) -> bool:
    """A target that names modules (``re:`` pattern or a dotted name) rather than a class (``Linear``)."""
    return target.startswith("re:") or "." in target


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _quantization_dict(config):
    """The ``quantization_config`` of a config (object or dict): its own, else its ``text_config``'s."""
    def get(c, key):
        return c.get(key) if isinstance(c, Mapping) else getattr(c, key, None)
    q = get(config, "quantization_config")
    text = get(config, "text_config")
    if not q and text is not None:
        q = get(text, "quantization_config")
    if q and not isinstance(q, Mapping):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    return q or None


def is_compressed_tensors(config) -> bool:
    """Whether ``config`` (or its ``text_config``) declares a compressed-tensors quantization."""
    q = _quantization_dict(config)
    return bool(q) and q.get("quant_method") == "compressed-tensors"


def int4_config(config) -> Int4Config | None:
    """The INT4 pack-quantized settings of a config that declares compressed-tensors quantization, None for
    any other config; everything parallm does not dequantise exactly is a :class:`CheckpointError` naming it."""
    q = _quantization_dict(config)
    if not q or q.get("quant_method") != "compressed-tensors":
        return None
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"compressed-tensors quantization_status={status!r} is not supported (parallm "
                              "reads 'compressed' checkpoints)")
    if q.get("kv_cache_scheme"):
        raise CheckpointError("compressed-tensors kv_cache_scheme is not supported (KV-cache quantization)")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise CheckpointError("a compressed-tensors quantization_config without config_groups")
    schemes = tuple(_scheme(name, group, q.get("format")) for name, group in groups.items())
    return Int4Config(schemes=schemes, ignore=tuple(q.get("ignore") or ()))


def _scheme(name: str, group, top_format) -> Scheme:
    fmt = group.get("format") or top_format
    if fmt != "pack-quantized":
        raise CheckpointError(f"compressed-tensors format {fmt!r} (group {name}) is not supported: parallm "
                              "dequantises 'pack-quantized' INT4 weights")
    for act in ("input_activations", "output_activations"):
        if group.get(act):
            raise CheckpointError(f"compressed-tensors group {name} quantizes {act}: not supported (parallm "
                                  "dequantises weight-only INT4)")
    w = group.get("weights") or {}
    checks = (("type", "int"), ("num_bits", BITS), ("strategy", "group"))
    for key, want in checks:
        if w.get(key) != want:
            raise CheckpointError(f"compressed-tensors group {name}: weights.{key}={w.get(key)!r} is not supported "
                                  f"(parallm dequantises {key}={want!r}: INT4 with a scale per group)")
    if w.get("actorder") == "group":
        raise CheckpointError(f"compressed-tensors group {name}: actorder='group' (weight_g_idx) is not supported")
    if w.get("dynamic") not in (None, False) or w.get("block_structure"):
        raise CheckpointError(f"compressed-tensors group {name}: dynamic / block-structured weight quantization "
                              "is not supported")
    size = w.get("group_size")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise CheckpointError(f"compressed-tensors group {name}: invalid group_size={size!r}")
    targets = group.get("targets") or ()
    return Scheme(name=name, targets=tuple([targets] if isinstance(targets, str) else targets), group_size=size,
                  symmetric=w.get("symmetric", True) is not False)


# -- the arithmetic ---------------------------------------------------------------------------------------------
#
# Vectorised (a load dequantises every routed expert) and bit-identical to the definition, whose operations it
# performs in the same dtypes: unpacking widens each byte of the words (two nibbles) to an int16 and moves its
# high nibble to the high byte with one shift-or-mask, so that the int16s read as bytes are the values in order
# (little-endian hosts; others take the per-nibble shifts); ``(q - z) * s`` is computed in the scale's dtype with
# each group's scale and zero point broadcast over its ``group_size`` columns instead of gathered per column.


def unpack(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``[..., words]`` int32 -> ``[..., count]`` int8 signed values (value ``j`` of a word at bits ``4j``:
    compressed-tensors' ``unpack_from_int32``, independent of the host's byte order)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed INT4 weights are int32, got {packed.dtype}")
    if sys.byteorder != "little":
        shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
        nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF                             # [..., words, 8]
        return (nibbles.flatten(-2)[..., :count] - OFFSET).to(torch.int8)
    pairs = packed.contiguous().view(torch.uint8).to(torch.int16)        # byte k: values 2k (low), 2k + 1 (high)
    pairs.bitwise_or_(pairs << BITS).bitwise_and_(0x0F0F)                 # value 2k in the low byte, 2k + 1 high
    return pairs.view(torch.uint8).sub_(OFFSET).view(torch.int8)[..., :count]      # n - 8, wrapped: signed


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               group_size: int) -> torch.Tensor:
    """``(q - zero_point) * scale`` in the scale's dtype: ``q`` ``[rows, groups * group_size]`` (int8 values of
    whole groups), ``scale`` and ``zero_point`` ``[rows, groups]``."""
    rows, groups = scale.shape
    if q.shape != (rows, groups * group_size):
        raise ValueError(f"{tuple(q.shape)} values do not make {rows} rows of {groups} groups of {group_size}")
    if zero_point is not None and zero_point.shape != scale.shape:
        raise ValueError(f"zero points {tuple(zero_point.shape)} do not match scales {tuple(scale.shape)}")
    out = q.reshape(rows, groups, group_size).to(scale.dtype)
    if zero_point is not None:
        out.sub_(zero_point.to(scale.dtype).unsqueeze(-1))
    return out.mul_(scale.unsqueeze(-1)).view(rows, groups * group_size)


class Int4Source(Source):
    """One pack-quantized module read as its weight ``[rows, cols]`` in the scale's dtype: ``read`` along dim 0
    takes only those rows' words, scales and zero points; along dim 1 only the words and groups covering the
    columns. ``weight_shape``'s values are checked on the first read."""

    def __init__(self, name: str, parts: dict, shape: tuple[int, int], scheme: Scheme):
        self.name, self.parts, self.scheme = name, parts, scheme
        self.shape = shape
        self.dtype = parts[SCALE].dtype
        self._checked = False
        self._zero = None
        # Each part's first (empty) read now, when the loader makes its sources, not amid the dequantisation:
        # a file's source makes and keeps a small view object on its first read, and made between the large
        # temporaries of one expert after another such objects fragmented glibc's heap (measured: 0.75 MiB per
        # 256 x 1024 expert never reused, ~430 MiB over a 576-expert load).
        for part in parts.values():
            part.read(0, 0, 0)

    @property
    def is_floating(self) -> bool:
        return True

    def _check_shape(self) -> None:
        if not self._checked:
            stored = tuple(int(v) for v in self.parts[SHAPE].full().flatten().tolist())
            if stored != tuple(self.shape):
                raise CheckpointError(f"{self.name}.{SHAPE} says {list(stored)}, but its packed weight and scales "
                                      f"describe {list(self.shape)}")
            self._checked = True

    def _zero_points(self) -> torch.Tensor | None:
        if self.scheme.symmetric:
            return None
        if self._zero is None:       # packed along rows: unpacked whole ([rows, groups]: small)
            self._zero = unpack(self.parts[ZERO].full().t(), self.shape[0]).t()
        return self._zero

    def read(self, dim, start, stop):
        self._check_shape()
        rows, cols = self.shape
        g = self.scheme.group_size
        zero = self._zero_points()
        if dim == 0:
            words, scale = self.parts[PACKED].read(0, start, stop), self.parts[SCALE].read(0, start, stop)
            zero = zero[start:stop] if zero is not None else None
            return dequantize(unpack(words, cols), scale, zero, g)
        g0, g1 = start // g, -(-stop // g)               # the whole groups covering the columns
        w0, w1 = g0 * g // PER_WORD, -(-g1 * g // PER_WORD)
        q = unpack(self.parts[PACKED].read(1, w0, w1), (w1 - w0) * PER_WORD)
        q = q[:, g0 * g - w0 * PER_WORD:g1 * g - w0 * PER_WORD]
        scale = self.parts[SCALE].read(1, g0, g1)
        zero = zero[:, g0:g1] if zero is not None else None
        return dequantize(q, scale, zero, g)[:, start - g0 * g:stop - g0 * g]


# -- the loader's view ------------------------------------------------------------------------------------------

def _modules(present: Mapping[str, tuple[int, ...]]) -> dict[str, dict[str, str]]:
    """``{module: {part: tensor name}}`` for every tensor named ``<module>.<part>`` of :data:`PARTS`."""
    out: dict[str, dict[str, str]] = {}
    for name in present:
        module, _, part = name.rpartition(".")
        if part in PARTS:
            out.setdefault(module, {})[part] = name
    return out


def _check_module(module: str, parts: dict, present, dtypes, scheme: Scheme, where: str) -> tuple[int, int]:
    """The weight shape ``(rows, cols)`` of one pack-quantized module, every part checked from metadata."""
    for need in (PACKED, SCALE, SHAPE):
        if need not in parts:
            have = ", ".join(sorted(parts.values()))
            raise CheckpointError(f"{where}: {have} without {module}.{need} (pack-quantized stores "
                                  f"{PACKED}, {SCALE} and {SHAPE})")
    if dtypes.get(parts[PACKED]) != torch.int32:
        raise CheckpointError(f"{where}: {parts[PACKED]} is {dtypes.get(parts[PACKED])}; packed INT4 is int32")
    scale_dtype = dtypes.get(parts[SCALE])
    if scale_dtype is None or not scale_dtype.is_floating_point:
        raise CheckpointError(f"{where}: {parts[SCALE]} is {scale_dtype}; scales must be floating point")
    packed, scale, shape = (tuple(present[parts[p]]) for p in (PACKED, SCALE, SHAPE))
    if len(packed) != 2 or len(scale) != 2 or shape != (2,):
        raise CheckpointError(f"{where}: {module}: {PACKED} {list(packed)}, {SCALE} {list(scale)}, {SHAPE} "
                              f"{list(shape)} (2-D weights with a [2] shape expected)")
    rows, cols = packed[0], scale[1] * scheme.group_size
    if scale[0] != rows or packed[1] != -(-cols // PER_WORD):
        raise CheckpointError(f"{where}: {module}: {PACKED} {list(packed)} and {SCALE} {list(scale)} do not pair "
                              f"up with group_size {scheme.group_size} (scheme {scheme.name}): {rows} rows of "
                              f"{cols} columns need [{rows}, {-(-cols // PER_WORD)}] words and [{rows}, "
                              f"{scale[1]}] scales")
    if scheme.symmetric and ZERO in parts:
        raise CheckpointError(f"{where}: {parts[ZERO]} in a symmetric scheme ({scheme.name}: symmetric true)")
    if not scheme.symmetric:
        if ZERO not in parts:
            raise CheckpointError(f"{where}: {module} has no {ZERO}, which the asymmetric scheme {scheme.name} "
                                  "needs")
        want = (-(-rows // PER_WORD), scale[1])
        if tuple(present[parts[ZERO]]) != want or dtypes.get(parts[ZERO]) != torch.int32:
            raise CheckpointError(f"{where}: {parts[ZERO]} is {dtypes.get(parts[ZERO])} {list(present[parts[ZERO]])}"
                                  f"; zero points packed along rows are int32 {list(want)}")
    return rows, cols


def int4_view(present: dict, dtypes: dict, raw, config: Int4Config | None, *, where: str):
    """A checkpoint's ``(names -> shapes, names -> dtypes, raw)`` with each pack-quantized module's tensors
    replaced by its ``M.weight`` (read through an :class:`Int4Source`). Unchanged when it has none; an error
    naming the problem for every inconsistency (see the module docstring)."""
    odd = sorted(n for n in present if n.rpartition(".")[2] in UNSUPPORTED_PARTS)
    modules = _modules(present)
    if odd:
        raise CheckpointError(f"{where}: {', '.join(odd[:4])}: compressed-tensors parts parallm does not read "
                              "(activation / KV-cache scales, global scales, g_idx)")
    if not modules:
        return present, dtypes, raw
    if config is None:
        shown = ", ".join(sorted(n for parts in modules.values() for n in parts.values())[:4])
        raise CheckpointError(f"{where}: pack-quantized tensors ({shown}) but the config declares no "
                              "compressed-tensors quantization_config: packed words read as weights would be wrong")
    shapes = {k: v for k, v in present.items() if k.rpartition(".")[0] not in modules
              or k.rpartition(".")[2] not in PARTS}
    plan = {}
    for module, parts in sorted(modules.items()):
        scheme = config.scheme_for(module, where)
        weight = module + ".weight"
        if weight in present:
            raise CheckpointError(f"{where}: {module} is stored both as {weight} and pack-quantized")
        shapes[weight] = _check_module(module, parts, present, dtypes, scheme, where)
        plan[weight] = (module, parts, scheme)
    types = {k: dtypes.get(k) for k in shapes}
    types.update({w: dtypes[parts[SCALE]] for w, (_, parts, _) in plan.items()})

    def read(name):
        entry = plan.get(name)
        if entry is None:
            return raw(name)
        module, parts, scheme = entry
        return Int4Source(module, {p: raw(n) for p, n in parts.items()}, shapes[name], scheme)
    return shapes, types, read
