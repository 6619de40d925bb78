"""``build_model(..., init="random")``: randomly initialised weights, the same model at every layout.

Every HF tensor of the model is defined by its name, shape and the seed alone, and reaches the parameters through
the loader's own filling path (:func:`parallm.checkpoint.loader._fill_all`: each rank fills its TP slices from
the tensor's ``blocks``, vocabulary padding rows zeroed, tied copies filled from the embedding's name), so two
layouts built with the same seed hold the same model, bit for bit, and ``save_hf_weights`` writes the same
directory. No rank exchanges anything.

Values, as transformers initialises its decoders (``_init_weights``): matrices (every tensor of two or more
dimensions: projections, embeddings, heads, routers, experts, convolutions) ``N(0, initializer_range)`` (the
config's, default 0.02); RMSNorm weights 1, or 0 for the zero-centred norms that compute ``x * (1 + w)``
(Qwen3.5 / Qwen3-Next); the Gated DeltaNet's ``dt_bias`` 1; every other vector 0 (biases, DeepSeek-V3's
``e_score_correction_bias``, the Gated DeltaNet's ``A_log``, which transformers draws as ``log U(0, 16)``:
here ``A = 1``). The normal values are drawn in blocks of :data:`ROWS` rows along dim 0 (the HF tensor's rows),
each block from a generator seeded by ``(seed, tensor name, block)``: a rank generates only the row blocks its
slices touch (for a slice along another dimension, every row block once, keeping its columns: memory stays at
the slice plus one block).
"""

from __future__ import annotations

import zlib

import torch

from ..model.loaded import mark_loaded
from ..model.sharding import Source
from ..model.table import expected_hf_shapes, integer_hf_names, model_entries
from ..parallel.state import as_chunks, dims_of

ROWS = 64                      # rows per generator block
DEFAULT_STD = 0.02             # transformers' initializer_range default


def init_kind(name: str, ndim: int, *, zero_centered_norm: bool) -> str:
    """``"normal"``, ``"ones"`` or ``"zeros"`` for HF tensor ``name`` of ``ndim`` dimensions (module
    docstring)."""
    if ndim >= 2:
        return "normal"
    parts = name.split(".")
    if parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]:
        gated = "linear_attn" in parts      # the Gated DeltaNet's gated norm is not zero-centred
        return "zeros" if zero_centered_norm and not gated else "ones"
    return "ones" if parts[-1] in ("dt_bias", "D") else "zeros"     # D: Mamba-2's skip, 1 as mamba-ssm inits it


class RandomSource(Source):
    """One HF tensor of the random model, read slice by slice like a checkpoint's (see the module
    docstring)."""

    def __init__(self, name: str, shape, *, kind: str, std: float, seed: int, dtype: torch.dtype = torch.float32):
        self.name, self.shape, self.kind, self.std = name, tuple(int(s) for s in shape), kind, float(std)
        self.dtype = dtype      # int64: an integer row (DeepSeek-V4's tid2eid), zeros as transformers inits it
        self.key = (int(seed) * 1000003 + zlib.crc32(name.encode())) % (1 << 62)

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point

    def _block(self, k: int) -> torch.Tensor:
        start = k * ROWS
        rows = min(ROWS, self.shape[0] - start)
        g = torch.Generator().manual_seed((self.key * 2654435761 + k) % (1 << 63))
        return torch.randn((rows,) + self.shape[1:], generator=g, dtype=torch.float32).mul_(self.std)

    def read(self, dim: int, start: int, stop: int) -> torch.Tensor:
        shape = list(self.shape)
        shape[dim] = stop - start
        if not self.dtype.is_floating_point:
            return torch.zeros(shape, dtype=self.dtype)
        if self.kind != "normal" or stop <= start:
            return torch.full(shape, 1.0 if self.kind == "ones" else 0.0, dtype=torch.float32)
        if dim == 0:
            first, last = start // ROWS, (stop - 1) // ROWS
            rows = torch.cat([self._block(k) for k in range(first, last + 1)])
            return rows.narrow(0, start - first * ROWS, stop - start)
        blocks = -(-self.shape[0] // ROWS)
        return torch.cat([self._block(k).narrow(dim, start, stop - start) for k in range(blocks)])


def init_random(chunks, *, seed: int = 0) -> None:
    """Fill every parameter of ``chunks`` (this rank's model) with the random model of ``seed`` (module
    docstring) and mark the chunks loaded. Not collective: each rank fills its own slices."""
    from .loader import _fill_all
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    chunks = as_chunks(chunks)
    layout = dims_of(chunks)
    spec, task = chunks[0].spec, chunks[0].task
    config = chunks[0].hf_config
    std = getattr(config, "initializer_range", None)
    if std is None and isinstance(config, dict):
        std = config.get("initializer_range")
    std = float(std if std is not None else DEFAULT_STD)
    shapes = expected_hf_shapes(chunks[0].table, spec, task=task, pp=layout.pp)
    mine, _ = model_entries(chunks, layout)
    ints = integer_hf_names(chunks[0].table, spec, task=task, pp=layout.pp)
    mark_loaded(chunks, False)

    def get(name):
        shape = shapes[name]
        return RandomSource(name, shape, kind=init_kind(name, len(shape), zero_centered_norm=spec.zero_centered_norm),
                            std=std, seed=seed, dtype=torch.int64 if name in ints else torch.float32)
    _fill_all(mine, get, layout, progress=False)
    mark_loaded(chunks)


__all__ = ["DEFAULT_STD", "ROWS", "RandomSource", "init_kind", "init_random"]
