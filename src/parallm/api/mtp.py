"""Multi-token-prediction layers: whether a model carries them (from the config and the checkpoint's tensor
names), and every rank agreeing on it."""

from __future__ import annotations

import dataclasses


def with_mtp(spec, hf_config, mtp: bool | None):
    """``spec`` carrying its multi-token-prediction layers or not (see :func:`build_model`'s ``mtp``)."""
    if mtp not in (None, True, False):
        raise ValueError(f"mtp must be None, True or False, got {mtp!r}")
    from ..families import family_of
    pick = family_of(spec).mtp_tensors
    if pick is not None:        # the family lists its MTP tensors from the checkpoint's headers (Qwen3.5 mtp.*)
        present = checkpoint_shapes(hf_config)
        found = pick(present) if present is not None else ()
        if mtp and not found:
            raise ValueError("mtp=True, but " + (
                f"{spec.architecture} lists its multi-token-prediction tensors from the checkpoint's headers and "
                "hf_config is not a checkpoint directory: build from the directory" if present is None else
                f"the checkpoint {hf_config} holds no multi-token-prediction tensors"))
        return dataclasses.replace(spec, carried_mtp=found if mtp is not False else ())
    if mtp is None:
        mtp = spec.mtp_layers > 0 and checkpoint_has_mtp(hf_config, spec.num_layers)
    if mtp and not spec.mtp_layers:
        raise ValueError(f"mtp=True, but {spec.architecture}'s config has no multi-token-prediction layers "
                         "(num_nextn_predict_layers is 0 or the family has none)")
    return dataclasses.replace(spec, carried_mtp_layers=spec.mtp_layers if mtp else 0)


def agree_on_mtp(spec) -> None:
    """Every rank must carry the same multi-token-prediction tensors (``mtp=None`` decides from the checkpoint
    directory each rank sees; a rank that cannot see it carries none): one all-gather of (MTP layers, MTP
    tensors) over the world; a ValueError on every rank naming a rank that differs."""
    from ..parallel.errors import exchange_rows
    rows = exchange_rows([spec.carried_mtp_layers, len(spec.carried_mtp)], what="build_model").tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        raise ValueError(f"build_model: ranks disagree on the multi-token-prediction tensors to carry (rank 0: "
                         f"{rows[0][0]} MTP layers / {rows[0][1]} MTP tensors, rank {bad[0]}: {rows[bad[0]][0]} / "
                         f"{rows[bad[0]][1]}): with mtp=None each rank decides from the checkpoint directory it "
                         "sees; make it visible on every rank, or pass mtp=False")


def checkpoint_shapes(hf_config) -> dict | None:
    """``{HF name: shape}`` of every tensor of checkpoint directory ``hf_config`` (from the index and the
    safetensors headers: no tensor data), or None when it is not a readable checkpoint directory."""
    import os

    from ..checkpoint.hf_dir import HFCheckpoint
    from ..errors import CheckpointError
    if not isinstance(hf_config, (str, os.PathLike)) or not os.path.isdir(hf_config):
        return None
    try:
        ckpt = HFCheckpoint(hf_config)
        return {k: tuple(ckpt.source(k).shape) for k in ckpt.keys()}
    except CheckpointError:          # a config-only directory, or one the loader will name the problem of
        return None


def checkpoint_has_mtp(hf_config, num_layers: int) -> bool:
    """Whether ``hf_config`` is a checkpoint directory whose tensor names include ``model.layers.{num_layers}.``
    (read from the index or the safetensors header: no tensor data)."""
    import os

    from ..checkpoint.hf_dir import HFCheckpoint
    from ..errors import CheckpointError
    if not isinstance(hf_config, (str, os.PathLike)) or not os.path.isdir(hf_config):
        return False
    try:
        names = HFCheckpoint(hf_config).keys()
    except CheckpointError:          # a config-only directory, or one the loader will name the problem of
        return False
    prefix = f"model.layers.{num_layers}."
    return any(n.startswith(prefix) for n in names)
