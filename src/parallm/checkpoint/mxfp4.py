"""MXFP4 expert checkpoints (gpt-oss as OpenAI publishes it): dequantisation on load.

``quantization_config: {"quant_method": "mxfp4", ...}`` in config.json, and for each stacked expert tensor ``X``
(``model.layers.{i}.mlp.experts.gate_up_proj`` / ``down_proj``) two tensors instead of it::

    X_blocks   [E, R, G, 16]   uint8: two FP4 (E2M1) values per byte, low nibble first
    X_scales   [E, R, G]       uint8: one E8M0 exponent per block of 32 values (biased by 127)

where ``R`` is X's output dim and ``G * 32`` its input dim: the dequantised ``[E, R, G * 32]`` transposed is X
``[E, G * 32, R]`` (gate_up ``[E, H, 2 I]``, down ``[E, I, H]``). An element is ``FP4[nibble] * 2 ** (scale -
127)`` with ``FP4 = (0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6)``: transformers'
``convert_moe_packed_tensors`` (``integrations/mxfp4.py``), whose values these are exactly (an FP4 value has two
significant bits, so the product is exact in fp32 and in bf16 alike; the filling copy rounds nothing).

:class:`Mxfp4Source` is such a pair read as X: whole experts along dim 0, and one expert's rows or columns
(:meth:`~Mxfp4Source.read_slab`, what the loader's per-expert slabs use): a rank reads only its own experts'
packed bytes (a quarter of their bf16 size) and dequantises only its TP slice of them (the blocks of its output
columns, or the 32-wide groups covering its input rows). Biases, the router, attention and embeddings are stored
unquantised (bf16) and load as usual. Saves write the dequantised weights in the model's (or the requested)
dtype and drop ``quantization_config`` (parallm writes no MXFP4).

A ``_blocks`` tensor without its ``_scales`` (or the reverse), shapes that do not pair up, non-uint8 storage, or
MXFP4 tensors in a checkpoint whose config does not say ``mxfp4`` are a :class:`~parallm.errors.CheckpointError`
naming the tensor: reading packed bytes as weights would load silently wrong values.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import CheckpointError
from ..model.sharding import Source

BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32                      # values per block (one scale each)
SCALE_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(config) -> bool:
    """Whether ``config`` (object or config.json dict) declares an MXFP4 checkpoint."""
    q = config.get("quantization_config") if isinstance(config, Mapping) else getattr(config, "quantization_config",
                                                                                      None)
    if not q:
        return False
    if not isinstance(q, Mapping):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    return q.get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., R, G, 16]`` uint8 blocks and ``[..., R, G]`` uint8 scales -> ``[..., R, G * 32]`` in ``dtype``
    (exact: every value is an FP4 value times a power of two). Not transposed."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} / {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not pair with scales {list(scales.shape)} "
                         f"([..., G, {GROUP // 2}] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = (blocks & 0x0F).long(), (blocks >> 4).long()
    values = torch.stack([lut[low], lut[high]], dim=-1).flatten(-2)                  # [..., R, G, 32]
    out = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return out.flatten(-2).to(dtype)


class Mxfp4Source(Source):
    """A stacked expert tensor X ``[E, C, R]`` (``C = G * 32``) read from its MXFP4 ``blocks`` ``[E, R, G, 16]`` and
    ``scales`` ``[E, R, G]`` (each a :class:`Source`), dequantised to fp32 as it is read. Along dim 0 whole experts
    (``read``); :meth:`read_slab` one expert's rows ``[start, stop)`` of C (only the groups covering them are
    dequantised) or columns of R (only those rows of the blocks)."""

    def __init__(self, blocks: Source, scales: Source):
        e, r, g, _ = blocks.shape
        self.blocks, self.scales = blocks, scales
        self.shape = (e, g * GROUP, r)
        self.dtype = torch.float32

    @property
    def is_floating(self) -> bool:
        return True

    def read(self, dim, start, stop):
        if dim != 0:
            raise ValueError(f"an MXFP4 expert tensor is read by whole experts along dim 0 (got dim {dim})")
        return dequantize(self.blocks.read(0, start, stop), self.scales.read(0, start, stop)).transpose(1, 2)

    def read_slab(self, index: int, dim: int, start: int, stop: int) -> torch.Tensor:
        """Expert ``index``'s ``[C, R]`` slab, rows ``[start, stop)`` (``dim`` 0) or columns (``dim`` 1)."""
        blocks = self.blocks.read(0, index, index + 1)[0]                            # [R, G, 16]
        scales = self.scales.read(0, index, index + 1)[0]                            # [R, G]
        if dim == 1:
            return dequantize(blocks[start:stop], scales[start:stop]).t()
        g0, g1 = start // GROUP, -(-stop // GROUP)
        part = dequantize(blocks[:, g0:g1], scales[:, g0:g1])                        # [R, (g1 - g0) * 32]
        return part[:, start - g0 * GROUP:stop - g0 * GROUP].t()


def mxfp4_plan(present: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype], declared: bool, *,
               where: str) -> dict[str, tuple[str, str]]:
    """The checkpoint's MXFP4 tensors: ``{X: (X_blocks, X_scales)}``, every pairing checked from metadata alone.
    ``declared``: the model's config says ``quant_method: mxfp4`` (:func:`is_mxfp4`; a checkpoint without MXFP4
    tensors, such as a dequantised one parallm saved, loads into such a model too); MXFP4 tensors without it are
    a :class:`CheckpointError`, as is a blocks tensor without its scales (or the reverse), a pair whose shapes
    do not match, or storage other than uint8."""
    blocks = {n[:-len(BLOCKS)]: n for n in present if n.endswith(BLOCKS)}
    scales = {n[:-len(SCALES)]: n for n in present if n.endswith(SCALES)}
    if not declared:        # only packed bytes are taken for MXFP4 here (a float tensor named *_blocks is a tensor)
        blocks = {k: n for k, n in blocks.items() if dtypes.get(n) == torch.uint8}
        scales = {k: n for k, n in scales.items() if dtypes.get(n) == torch.uint8}
        if blocks or scales:
            shown = ", ".join(sorted(blocks.values()) + sorted(scales.values()))
            raise CheckpointError(f"{where}: MXFP4 tensors ({shown[:200]}) but the config has no quantization_config "
                                  "with quant_method 'mxfp4': packed bytes read as weights would be wrong")
        return {}
    plan = {}
    for base in sorted(set(blocks) | set(scales)):
        if base not in blocks or base not in scales:
            have, lack = (blocks, SCALES) if base in blocks else (scales, BLOCKS)
            raise CheckpointError(f"{where}: {have[base]} has no {base + lack} (MXFP4 stores both)")
        b, s = blocks[base], scales[base]
        if dtypes.get(b) != torch.uint8 or dtypes.get(s) != torch.uint8:
            raise CheckpointError(f"{where}: {b} / {s} are {dtypes.get(b)} / {dtypes.get(s)}; MXFP4 blocks and "
                                  "scales are uint8")
        bs, ss = tuple(present[b]), tuple(present[s])
        if len(bs) != 4 or bs[-1] != GROUP // 2 or bs[:-1] != ss:
            raise CheckpointError(f"{where}: {b} {list(bs)} and {s} {list(ss)} do not pair up (expected [E, R, G, "
                                  f"{GROUP // 2}] and [E, R, G])")
        if base in present:
            raise CheckpointError(f"{where}: {base} is stored both unquantised and as MXFP4")
        plan[base] = (b, s)
    return plan


def stacked_shape(blocks_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The shape of the tensor an ``[E, R, G, 16]`` blocks tensor stands for: ``[E, G * 32, R]``."""
    e, r, g, _ = blocks_shape
    return (e, g * GROUP, r)


def mxfp4_view(present: dict, dtypes: dict, raw, *, declared: bool, where: str):
    """A checkpoint's ``(names -> shapes, names -> dtypes, raw)`` with each MXFP4 pair replaced by the tensor it
    stands for (:func:`mxfp4_plan`): ``raw(X)`` then reads X through an :class:`Mxfp4Source` (fp32), and the
    blocks / scales are no tensors of their own. Unchanged when the checkpoint has none."""
    packed = mxfp4_plan(present, dtypes, declared, where=where)
    if not packed:
        return present, dtypes, raw
    inner = {n for pair in packed.values() for n in pair}
    shapes = {k: v for k, v in present.items() if k not in inner}
    shapes.update({k: stacked_shape(present[b]) for k, (b, _) in packed.items()})
    types = {k: dtypes.get(k, torch.float32) for k in shapes}
    types.update({k: torch.float32 for k in packed})

    def read(name):
        pair = packed.get(name)
        return raw(name) if pair is None else Mxfp4Source(raw(pair[0]), raw(pair[1]))
    return shapes, types, read
