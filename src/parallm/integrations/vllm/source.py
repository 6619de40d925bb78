"""A vLLM ``WeightSource`` over parallm's export stream, for vLLM's own trainer-side backends.

vLLM's trainer-side weight-transfer engines (``nccl``, ``ipc`` on GPUs) take a ``WeightSource``: ``metadata()``
(every tensor's name, dtype and full shape, without moving anything) and a fresh iteration per round that yields
exactly those tensors in that order, materialised (iterating is collective: every trainer rank iterates it, only
the sender's items are used). :func:`export_source` builds one over ``export_metadata`` /
``export_hf_tensors(dst_ranks=[sender], copy=True)``:

* the tensors come in the table's order, a decoder layer's tensors contiguous (the embedding first, the final
  norm and head last), which is what vLLM's layer-wise reload wants (it holds a layer's tensors until the layer
  is complete) and what ``layerwise_groups`` partitions;
* ``copy=True``: a backend may keep a tensor past the next item (vLLM's packed NCCL producer packs several,
  CUDA IPC hands them to another process);
* a tied model's ``lm_head.weight`` is not part of the stream (it is the embedding): vLLM's GPU models tie it
  themselves; vLLM's CPU build needs it loaded (parallm's own backends add it in the worker, :mod:`.backends`);
* ``held_names()`` is the default (None): the stream delivers every tensor to the sender whatever the trainer's
  layout, so for vLLM the sender holds the whole model and the other ranks take part in the stream only.

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    source = export_source(chunks, sender=0)
    engine = WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(..., rank=rank), client=..., source=source)
    engine.send_weights()            # every round, on every rank

Written for vLLM's GPU backends and tested on CPU through vLLM's ``WeightSource`` contract (its
``iter_groups`` and the metadata / iteration agreement its NCCL engine checks); vLLM's NCCL and IPC backends
themselves need CUDA (see the GPU smoke check).
"""

from __future__ import annotations

import torch

from ...checkpoint.export import DEFAULT_BUCKET_BYTES, export_hf_tensors, export_metadata
from ...parallel.state import as_chunks, dims_of

__all__ = ["export_source"]

_CLASS = None


def _source_class():
    global _CLASS
    if _CLASS is None:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        class ExportSource(WeightSource):
            """``WeightSource`` over parallm's export stream (see :mod:`parallm.integrations.vllm.source`)."""

            def __init__(self, chunks, *, sender: int = 0, dtype: torch.dtype | None = None,
                         bucket_bytes=DEFAULT_BUCKET_BYTES):
                self.chunks = as_chunks(chunks)
                world = dims_of(self.chunks).world
                if not (isinstance(sender, int) and 0 <= sender < world):
                    raise ValueError(f"export_source: sender must be a global rank of the world of {world}, "
                                     f"got {sender!r}")
                self.sender, self.dtype, self.bucket_bytes = sender, dtype, bucket_bytes
                self._meta = None

            def metadata(self) -> list:
                if self._meta is None:     # from the table alone: no exchange, the same on every rank
                    self._meta = [ParamMeta(m.name, m.dtype, tuple(m.shape))
                                  for m in export_metadata(self.chunks, dtype=self.dtype)]
                return self._meta

            def __iter__(self):
                return export_hf_tensors(self.chunks, dtype=self.dtype, bucket_bytes=self.bucket_bytes,
                                         dst_ranks=[self.sender], copy=True)

        _CLASS = ExportSource
    return _CLASS


def export_source(chunks, *, sender: int = 0, dtype: torch.dtype | None = None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """A vLLM ``WeightSource`` (class ``ExportSource``, a subclass of vLLM's) over the model's export stream,
    delivered to global rank ``sender`` (vLLM's trainer engines send from their rank 0: pass the trainer rank
    that plays it). Not collective to build; every rank iterates it each round. ``dtype`` / ``bucket_bytes``:
    as ``export_hf_tensors``."""
    return _source_class()(chunks, sender=sender, dtype=dtype, bucket_bytes=bucket_bytes)
