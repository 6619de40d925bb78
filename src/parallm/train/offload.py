"""Offload for colocated rollouts: the trainer's parameters, gradients and optimizer state leave the device while
a rollout engine uses it, and come back bit for bit.

:func:`offload` copies each tensor's storage to host memory (pinned on CUDA, so the copies back are fast and
asynchronous) and shrinks the storage to 0 bytes, which frees the device memory while every tensor object, view
and reference stays as it is: a gradient bucket's views, ZeRO's parameter buffers, the optimizer's masters and
moments, ``param.main_grad``. Storages are handled once each (views share them). :func:`onload` grows each
storage back and copies the bytes in, so training continues as if nothing happened. Between the two, the
offloaded tensors must not be used (a forward fails: their storage is empty). No collective: each rank moves
its own tensors.

Host memory: the host copy of a storage is kept after :func:`onload` and reused by the next :func:`offload` of
the same storage (same size), so an RL loop that offloads every step holds one host copy per storage, allocated
once, instead of a fresh pinned block each time (torch's pinned-memory cache rounds each block up to a power of
two and keeps freed ones: fresh copies each step would grow it). A host copy no longer matching any offloaded
storage is dropped at the next offload of its kind. Offloading the parameters also drops the export stream's
cached buffers (:mod:`parallm.checkpoint.export`: two output and two staging buffers of a bucket each, on the
device; the next export allocates them again). On CUDA, :func:`offload` ends with ``torch.cuda.empty_cache()``
so that the freed blocks go back to the driver (a colocated rollout engine allocates outside torch's cache).
"""

from __future__ import annotations

import contextlib

import torch

from ..parallel.state import as_chunks
from .buckets import grad_buffers_of

KINDS = ("params", "grads", "optimizer_state")


def _tensors(chunks, optimizer, kind: str) -> list[torch.Tensor]:
    if kind == "params":
        return [p.data for c in chunks for p in c.parameters()]
    if kind == "grads":
        out = []
        buffers = grad_buffers_of(chunks)
        if buffers is not None:
            out += buffers.all_buffers()
        for c in chunks:
            for p in c.parameters():
                for g in (p.grad, getattr(p, "main_grad", None)):
                    if g is not None:
                        out.append(g)
        return out
    if optimizer is None:
        return []
    return [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t)]


def _held(chunks) -> dict:
    held = getattr(chunks[0], "_parallm_offloaded", None)
    if held is None:
        held = chunks[0]._parallm_offloaded = {k: [] for k in KINDS}
    return held


def _host_copies(chunks) -> dict:
    """Per kind, ``{storage key: host tensor}`` of the previous offload, reused by the next (module docstring).
    The key is the storage's identity (``_cdata``, its ``StorageImpl``); a host tensor is reused only when its
    size matches, so a storage freed and another allocated at the same place gets correct bytes either way."""
    hosts = getattr(chunks[0], "_parallm_offload_hosts", None)
    if hosts is None:
        hosts = chunks[0]._parallm_offload_hosts = {k: {} for k in KINDS}
    return hosts


def _drop_export_buffers(chunks) -> None:
    """Free the export stream's cached buffers (:func:`parallm.checkpoint.export.open_stream` keeps them with
    the model as ``chunks[0]._parallm_export``), unless a stream holds them right now."""
    cache = getattr(chunks[0], "_parallm_export", None)
    buffers = cache.get("buffers") if isinstance(cache, dict) else None
    if buffers is not None and not buffers.busy:
        buffers.bufs.clear()


def offload(chunks, optimizer=None, *, params: bool = True, grads: bool = True, optimizer_state: bool = True
            ) -> int:
    """Move the chosen tensors of ``chunks`` (and ``optimizer``'s state) to host memory and free their device
    storage (each storage resized to 0 bytes). Returns the bytes moved. A kind already offloaded is left
    alone. Host copies are reused from the previous offload; with ``params`` the export stream's cached
    buffers are freed too; on CUDA the allocator's cache is emptied at the end. See the module docstring."""
    chunks = as_chunks(chunks)
    held, hosts = _held(chunks), _host_copies(chunks)
    claimed = {st.data_ptr() for kind in KINDS for st, _ in held[kind]}
    moved = 0
    for kind, wanted in zip(KINDS, (params, grads, optimizer_state)):
        if not wanted or held[kind]:
            continue
        before, hosts[kind] = hosts[kind], {}
        for t in _tensors(chunks, optimizer, kind):
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in claimed:
                continue
            claimed.add(storage.data_ptr())
            device = storage.device
            raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            host = before.pop(storage._cdata, None)
            if host is None or host.numel() != raw.numel():
                host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")
            host.copy_(raw, non_blocking=device.type == "cuda")
            held[kind].append((storage, host))
            hosts[kind][storage._cdata] = host
            moved += raw.numel()
        del before          # host copies of storages not offloaded this time: freed
    cuda = any(st.device.type == "cuda" for kind in KINDS for st, _ in held[kind])
    if cuda:
        torch.cuda.synchronize()
    for kind in KINDS:
        for storage, _ in held[kind]:
            storage.resize_(0)
    if params:
        _drop_export_buffers(chunks)
    if cuda:
        torch.cuda.empty_cache()
    return moved


def onload(chunks, optimizer=None, *, params: bool = True, grads: bool = True, optimizer_state: bool = True
           ) -> int:
    """Bring back what :func:`offload` moved (the chosen kinds): each storage grown to its size again and its
    bytes copied in. Returns the bytes moved. ``optimizer`` is accepted for symmetry (the state's storages
    are remembered by :func:`offload`)."""
    chunks = as_chunks(chunks)
    held = _held(chunks)
    moved = 0
    cuda = False
    for kind, wanted in zip(KINDS, (params, grads, optimizer_state)):
        if not wanted:
            continue
        for storage, host in held[kind]:
            storage.resize_(host.numel())
            raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            raw.copy_(host, non_blocking=storage.device.type == "cuda")
            cuda = cuda or storage.device.type == "cuda"
            moved += host.numel()
        held[kind] = []
    if cuda:
        torch.cuda.synchronize()
    return moved


@contextlib.contextmanager
def offloaded(chunks, optimizer=None, **kinds):
    """``with offloaded(chunks, opt): ...`` runs the block with :func:`offload`'s tensors on the host."""
    offload(chunks, optimizer, **kinds)
    try:
        yield
    finally:
        onload(chunks, optimizer, **kinds)
