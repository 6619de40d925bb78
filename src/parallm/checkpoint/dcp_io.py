"""torch.distributed.checkpoint (DCP) glue for training checkpoints: local tensors as slices of global tensors,
reads that verify every byte, and DCP's exceptions as parallm's.

State dicts handed to DCP map a checkpoint key to a list of local tensors; a :class:`SliceTable` (kept by the
planners, not in the state dict) says where each list element sits in the global tensor (the slices
:func:`parallm.checkpoint.global_view.global_slices` computes). Everything else is DCP's own machinery: on save,
identical slices offered by several ranks (data-parallel replicas) are written once (its plan dedup, balancing
the bytes over the ranks) and the global plan is validated (slices must tile every tensor exactly: a gap or an
overlap is an error); on load, each rank reads the parts of the saved slices that overlap its own, whatever
layout wrote them (resharding).

Integrity: DCP stores each slice as a ``torch.save`` blob, and ``torch.load`` does not notice flipped data
bytes. After a save, :func:`item_crcs` computes a CRC-32 of every stored item (each rank those of the files it
wrote); the training checkpoint keeps them in its ``parallm.json``, and :class:`VerifyingReader` checks each
item's length and CRC as it reads it, raising :class:`CheckpointError` naming the file and the tensor.

What is unpickled: DCP reads its ``.metadata`` file with ``pickle`` (a trusted checkpoint only, see
docs/checkpoints.md) and every tensor item with ``torch.load(weights_only=True)``. parallm stores only tensors,
and its planners never read a non-tensor ("bytes") item: DCP's default planner would ``torch.load`` one with
``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zlib
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import CheckpointError, ParallelError
from ..parallel.errors import lost_peer_error

METADATA_FILE = ".metadata"   # DCP's global metadata file name


@dataclass
class SliceTable:
    """Checkpoint key -> (global shape, offsets of each local slice, in the order of the key's tensor list). Keys
    not in it are plain tensors, saved whole (e.g. step counters)."""
    table: dict[str, tuple[tuple[int, ...], list[tuple[int, ...]]]] = field(default_factory=dict)

    def add(self, key: str, shape, offsets) -> int:
        entry = self.table.setdefault(key, (tuple(shape), []))
        if entry[0] != tuple(shape):
            raise RuntimeError(f"internal error: {key} declared with shapes {entry[0]} and {tuple(shape)}")
        entry[1].append(tuple(offsets))
        return len(entry[1]) - 1

    def find(self, key: str, offsets) -> int:
        return self.table[key][1].index(tuple(offsets))


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class SliceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (dedup, global-plan validation) over a state dict of lists of global-tensor
    slices (keys in ``slices``) and plain tensors (any other key)."""

    def __init__(self, slices: SliceTable):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.slices = slices

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if key in self.slices.table:
                shape, offsets = self.slices.table[key]
                for i, (off, t) in enumerate(zip(offsets, value)):
                    off = torch.Size(off)
                    items.append(WriteItem(index=MetadataIndex(key, off, i), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(
                                               chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                               properties=TensorProperties.create_from_tensor(t),
                                               size=torch.Size(shape))))
            elif torch.is_tensor(value):
                off = torch.Size([0] * value.dim())
                items.append(WriteItem(index=MetadataIndex(key, off), type=WriteItemType.TENSOR,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=off, sizes=value.size()),
                                           properties=TensorProperties.create_from_tensor(value),
                                           size=value.size())))
            else:
                raise TypeError(f"internal error: checkpoint item {key} is a {type(value).__name__}, not a tensor")
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if index.fqn in self.slices.table:
            return value[self.slices.find(index.fqn, index.offset)]
        return value


class SliceLoadPlanner(DefaultLoadPlanner):
    """Reads each requested slice into its target tensors (the first, highest-precision one is read into, the
    others are copied from it). ``targets``: key -> {offsets: [tensors]} for sliced keys, key -> [tensors] for
    plain tensors (read whole). Tensors only: a key the checkpoint stores as bytes is an error, and no bytes item
    is ever read."""

    def __init__(self, targets: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.targets = {}
        for key, value in targets.items():
            if isinstance(value, dict):
                value = {tuple(o): sorted(ts, key=lambda t: -t.element_size()) for o, ts in value.items()}
            elif isinstance(value, list):
                value = {None: sorted(value, key=lambda t: -t.element_size())}
            self.targets[key] = value

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for key, value in self.targets.items():
            md = self.metadata.state_dict_metadata[key]
            if isinstance(md, BytesStorageMetadata):
                raise CheckpointError(f"checkpoint item {key} holds bytes where a tensor is expected")
            chunks = []
            for off, ts in value.items():
                off = torch.Size(off if off is not None else [0] * ts[0].dim())
                chunks.append(ChunkStorageMetadata(offsets=off, sizes=ts[0].size()))
            requests += create_read_items_for_chunk_list(key, md, chunks)
        self.plan = LoadPlan(requests)
        return self.plan

    def _targets(self, index: MetadataIndex):
        value = self.targets[index.fqn]
        return value[None] if None in value else value[tuple(index.offset)]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        first = self._targets(read_item.dest_index)[0]
        return _narrow(first.detach(), read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        for other in self._targets(read_item.dest_index)[1:]:
            _narrow(other.detach(), read_item.dest_offsets, read_item.lengths).copy_(tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # create_local_plan requests no bytes item; DCP's default would torch.load it with weights_only=False
        raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn} is not a tensor; parallm never reads "
                              "such items (unpickling them could run code the checkpoint carries)")


# -- integrity ----------------------------------------------------------------------------------------------------

def _item_names(metadata) -> dict[tuple[str, int], str]:
    return {(info.relative_path, info.offset): index.fqn for index, info in metadata.storage_data.items()}


def writer_of(relative_path: str) -> int | None:
    """The rank (in the saving group) whose writer made a DCP data file (``__{rank}_{n}.distcp``)."""
    m = re.match(r"__(\d+)_", os.path.basename(relative_path))
    return int(m.group(1)) if m else None


def item_crcs(directory: str, metadata, *, rank: int, world: int) -> dict[str, list[list[int]]]:
    """``{file: [[offset, length, crc32], ...]}`` for the data files this rank checks: those it wrote (still in
    the page cache), or, for names that do not say, every ``world``-th file."""
    files: dict[str, list[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        files.setdefault(info.relative_path, []).append((info.offset, info.length))
    out = {}
    for k, name in enumerate(sorted(files)):
        owner = writer_of(name)
        if (owner if owner is not None else k % world) != rank:
            continue
        rows = []
        with open(os.path.join(directory, name), "rb") as f:
            for offset, length in sorted(set(files[name])):
                f.seek(offset)
                rows.append([offset, length, zlib.crc32(f.read(length))])
        out[name] = rows
    return out


def file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def check_files(directory: str, metadata) -> None:
    """Every data file the metadata names exists and is long enough for its items (a truncated file is named
    before any rank starts reading)."""
    need: dict[str, tuple[int, str]] = {}
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > need.get(info.relative_path, (0, ""))[0]:
            need[info.relative_path] = (end, index.fqn)
    for name, (end, key) in sorted(need.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (it holds {key}, among others)")
        size = os.path.getsize(path)
        if size < end:
            raise CheckpointError(f"{path} is truncated: {size} bytes, but {key} is stored up to byte {end}")


class VerifyingReader(FileSystemReader):
    """DCP's file reader, reading each item whole and checking its length and CRC-32 (``crcs`` as
    :func:`item_crcs` gives them) before ``torch.load`` sees it."""

    def __init__(self, path, crcs: dict[str, list[list[int]]]):
        super().__init__(path)
        self._crcs = {(name, off): (length, crc) for name, rows in crcs.items() for off, length, crc in rows}
        self._names: dict[tuple[str, int], str] = {}

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._names = _item_names(metadata)

    def _slice_file(self, file, sinfo):
        where = os.path.join(str(self.path), sinfo.relative_path)
        key = self._names.get((sinfo.relative_path, sinfo.offset), "an item")
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise CheckpointError(f"{where} is truncated: {key} needs bytes [{sinfo.offset}, "
                                  f"{sinfo.offset + sinfo.length}), the file ends before")
        expected = self._crcs.get((sinfo.relative_path, sinfo.offset))
        if expected is None:
            raise CheckpointError(f"{where}: {key} (offset {sinfo.offset}) has no recorded CRC-32 in "
                                  "parallm.json; the checkpoint's files do not match its record")
        if expected[0] != sinfo.length or zlib.crc32(data) != expected[1]:
            raise CheckpointError(f"{where} is corrupted: the {sinfo.length} bytes of {key} at offset "
                                  f"{sinfo.offset} fail their CRC-32 check")
        return io.BytesIO(data)


# -- DCP's exceptions as parallm's ---------------------------------------------------------------------------------

def dcp_failure(e: BaseException, what: str, *, abort: bool = True) -> Exception:
    """What a collective DCP call's exception means, on every rank: a ``KeyboardInterrupt`` is re-raised; a bare
    RuntimeError is one of DCP's collectives failing, i.e. a lost peer (raised, see :func:`lost_peer_error`;
    ``abort`` is passed on); anything else (DCP reports a rank's own failure as a CheckpointException on every
    rank) is returned as parallm's error (:func:`from_dcp`)."""
    if isinstance(e, KeyboardInterrupt):
        raise e
    if getattr(e, "failures", None) is None and type(e) is RuntimeError:
        raise lost_peer_error(e, what, abort=abort) from e
    return from_dcp(e, what)


def from_dcp(e: BaseException, what: str) -> Exception:
    """A DCP CheckpointException (a BaseException listing each failing rank's exception) as a parallm error
    naming the first failure; any other exception as it is (a BaseException as a ParallelError)."""
    failures = getattr(e, "failures", None)
    if not failures:
        return e if isinstance(e, Exception) else ParallelError(f"{what}: {type(e).__name__}: {e}")
    rank, (inner, _) = sorted(failures.items())[0]
    more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    if isinstance(inner, pickle.UnpicklingError):   # an item torch.load(weights_only=True) refused
        etype = CheckpointError
    else:
        etype = type(inner) if isinstance(inner, (CheckpointError, OSError, ValueError)) else ParallelError
    try:
        return etype(f"{what} failed on rank {rank}{more}: {inner}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return ParallelError(f"{what} failed on rank {rank}{more}: {type(inner).__name__}: {inner}")
