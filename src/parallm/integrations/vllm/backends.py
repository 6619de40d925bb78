"""parallm's worker-side weight-transfer backends for vLLM: ``parallm_shm`` and ``parallm_gloo``.

vLLM (0.32) lets a trainer push weights into an engine's workers through its weight-transfer API: every worker of
an engine started with ``weight_transfer_config={"backend": NAME}`` builds the backend registered under NAME
(``WeightTransferEngineFactory``) and serves ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``. None of vLLM's own backends runs on CPU (NCCL, CUDA IPC). parallm
registers its own from the ``vllm.general_plugins`` entry point (pyproject.toml -> :func:`register`), which vLLM
loads in every process before the model, so an engine started after ``pip install parallm`` knows them:

* ``parallm_shm``: engines on the trainer's host. The sender owns a shared-memory file of two slots; the export
  stream writes a bucket into one slot while the engines load the other, and each ``update_weights`` names the
  slot and where each tensor lies in it. The worker loads from views of the slot (the model's own loader copies
  them into its parameters: that is the one copy out of the slot). vLLM's layer-wise reload keeps a layer's
  tensors until the layer is complete (a layer split across two buckets, a vocabulary-padded embedding until
  ``finish_weight_update``), and the sender reuses the slot once the update returns: so after each update the
  worker replaces the tensors the reload still holds that are views of the slot by copies of their own
  (:func:`own_held`; a few tensors per update, not the bucket).
* ``parallm_gloo``: engines on any host. A gloo group per engine (the sending trainer rank at rank 0, the
  engine's workers at ``rank_offset + worker rank``; a ``TCPStore`` rendezvous at ``master_address`` /
  ``master_port`` as vLLM's NCCL backend), made without torch.distributed's default group, with a timeout so
  that a dead peer raises instead of hanging. Each ``update_weights`` announces one packed buffer (names,
  dtypes, shapes, bytes) that the sender then broadcasts.

  A group per engine, not vLLM's NCCL layout of one group over the trainer and every engine's workers (each
  engine at its rank offset). The reason is what a failure does. A gloo collective cannot leave a member out:
  in one group a dead engine makes the broadcast fail for every member still in it, so the healthy engines'
  ``update_weights`` raise halfway through the push, and vLLM cannot take another update after a failed one
  (stale worker replies): every engine would need a restart, where the push promises that the others receive
  every tensor and finish. With a group per engine only the dead engine's group fails. Rebuilding one group
  over the survivors afterwards would not save the push under way. The cost: the sender posts one broadcast
  per engine per bucket, so the bytes leaving the trainer grow with the number of engines (at least one copy
  of each bucket per engine, where one group needs at least one in all, and can relay through the engines'
  workers); on one host that is memory bandwidth (``parallm_shm`` is the route there), across hosts the
  trainer's network link. Not measured.
* ``parallm``: either of the two, chosen by the trainer at ``init_weight_transfer_engine`` (a server started
  with it serves both).

Both do vLLM's layer-wise reload (``initialize_layerwise_reload`` in ``start_weight_update``,
``finalize_layerwise_reload`` in ``finish_weight_update``, the model's own ``load_weights`` in between, tensors in
checkpoint format with HF names) and carry parallm's CPU fixes into the worker (:mod:`.fixes`): the MoE experts'
repack after the reload, and a tied model's ``lm_head.weight`` loaded from the embedding the trainer sends.

Besides the transport, ``init_weight_transfer_engine({"verify": {...}})`` checks what a push will bring (names,
shapes, dtype) against the worker's model, read through parallm's table, and raises naming every difference:
the trainer calls it before ``start_weight_update``, so a mismatch leaves the engine untouched (raised by the
engine's last worker only, see ``_verify``). Any other failure inside a worker (a transport that cannot be
opened, an update that fails) leaves an engine with more than one worker unusable in vLLM 0.32 (stale replies of
the other workers): the trainer reports such an engine as needing a restart.

The wire (JSON over vLLM's HTTP routes or ``collective_rpc``):

    init   {"transport": "shm", "path": str, "slot_bytes": int, "slots": int, "secret": str}
           {"transport": "gloo", "master_address": str, "master_port": int, "rank_offset": int,
            "world_size": int, "group": "parallm/<secret>/...", "timeout_s": float, "secret": str}
           {"verify": {"names": [...], "shapes": [[...], ...], "dtype": "float32"}}
    update {"transport": "shm" | "gloo", "names": [...], "dtypes": [...], "shapes": [[...], ...],
            "offsets": [bytes, ...], "nbytes": int, "slot": int, "path": str (shm only), "secret": str}

What a worker accepts (the trust model, docs/rl.md): a shared-memory file only if it is a ``parallm_wt_*`` regular
file of the worker's own user, mode 0600, in the shared-memory directory (:func:`.transport.allowed_shm_file`);
a gloo rendezvous only at a store that holds the secret the init request names, in a group under that secret;
an update only with the secret of the init that set its transport up. This guards against mistakes and against
other users' files and stores; it does not make vLLM's dev-mode routes safe to expose (whoever reaches them can
also call ``/collective_rpc``).

A worker keeps one transport of each kind (the last init of that kind): a shared-memory connection and a gloo
connection to the same engine (two trainers' connections, or a benchmark's) both work, each update naming its
own.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from dataclasses import dataclass, field

import torch

from .fixes import TIED_HEAD, TIED_SOURCE, SinkWriter, cpu_experts_repacked, engine_tensors, mismatch
from .transport import allowed_shm_file, gloo_options, route_address

__all__ = ["BACKENDS", "own_held", "register"]

BACKENDS = {"parallm": ("shm", "gloo"), "parallm_shm": ("shm",), "parallm_gloo": ("gloo",)}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register parallm's backends with vLLM's factory. vLLM may load
    plugins several times in one process; registering again is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    for name in BACKENDS:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, __name__, "ParallmWeightTransferEngine")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"parallm weight transfer: unknown dtype {name!r}")
    return dtype


def unpack(buffer: torch.Tensor, info: dict) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs an update describes, as views of ``buffer`` (bytes)."""
    out = []
    for name, dtype, shape, offset in zip(info["names"], info["dtypes"], info["shapes"], info["offsets"]):
        dtype = _dtype(dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append((name, buffer[offset:offset + nbytes].view(dtype).view(shape)))
    return out


@dataclass
class ParallmInitInfo:
    """One init request (see the module docstring); ``transport`` None for a ``verify`` request."""
    transport: str | None = None
    path: str | None = None
    slot_bytes: int = 0
    slots: int = 2
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int = 1
    world_size: int = 0
    group: str = "parallm"
    timeout_s: float = 300.0
    verify: dict | None = None
    secret: str | None = None


@dataclass
class ParallmUpdateInfo:
    names: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    nbytes: int = 0
    slot: int | None = None
    transport: str | None = None
    path: str | None = None
    secret: str | None = None


def own_held(model, region: torch.Tensor) -> int:
    """After a load from views of ``region``: every tensor vLLM's layer-wise reload still holds for a layer that
    is not complete yet (``LAYERWISE_INFO[layer].loaded_weights``, the loader's bound arguments, kept until the
    layer's last tensor arrives) that lies in ``region``'s memory is replaced by a copy of its own, so that the
    sender may overwrite the region. Returns the bytes copied. vLLM 0.32's reload module; a vLLM without it
    holds nothing this way (0)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return 0
    base = region.untyped_storage().data_ptr()
    copied = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        for _, bound in (info.loaded_weights if info is not None else ()):
            for key, value in list(bound.arguments.items()):
                if (isinstance(value, torch.Tensor) and value.device == region.device
                        and value.untyped_storage().data_ptr() == base):
                    bound.arguments[key] = value.clone()
                    copied += value.numel() * value.element_size()
    return copied


def _join_gloo(info: ParallmInitInfo, worker: int, *, what: str):
    """This worker's gloo group with the sender (rank ``rank_offset + worker``), after checking that the
    sender's store holds the connection's secret (``parallm/<secret>/auth``, set by the sender before any init)
    and that the group's keys lie under it; the worker's gloo connections use its address on the interface that
    routes to ``master_address``. Returns (group, store)."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=info.timeout_s)
    root = f"parallm/{info.secret}"
    if not info.secret or not str(info.group).startswith(root + "/"):
        raise ValueError(f"{what}: a gloo init request without the connection's secret (or with a group outside "
                         "it): refused; connect with parallm.integrations.vllm.connect")
    store = dist.TCPStore(info.master_address, info.master_port, info.world_size, is_master=False, timeout=timeout)
    if not store.check([f"{root}/auth"]):
        raise ValueError(f"{what}: the store at {info.master_address}:{info.master_port} does not hold the secret "
                         "of the init request: not the trainer that sent it; refused")
    opts = gloo_options(route_address(info.master_address, info.master_port), info.timeout_s)
    group = dist.ProcessGroupGloo(dist.PrefixStore(info.group, store), info.rank_offset + worker, info.world_size,
                                  opts)
    return group, store


def _worker_rank(parallel_config) -> int:
    """This worker's rank among all the engine's workers (every data-parallel replica), as vLLM's NCCL backend
    counts it."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def __getattr__(name: str):
    """``ParallmWeightTransferEngine`` is made on first use (vLLM's factory looks it up by name), so that this
    module imports without vLLM (the trainer's process reads :data:`BACKENDS` from it)."""
    if name == "ParallmWeightTransferEngine":
        global _ENGINE
        if _ENGINE is None:
            _ENGINE = _engine_class()
        return _ENGINE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ENGINE = None


def _engine_class():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    return type("ParallmWeightTransferEngine", (_EngineMethods, WeightTransferEngine),
                {"__module__": __name__, "__doc__": _EngineMethods.__doc__})


class _EngineMethods:
    """The worker side of ``parallm_shm`` / ``parallm_gloo`` (see the module docstring): the methods of
    ``ParallmWeightTransferEngine``, a subclass of vLLM's ``WeightTransferEngine`` made when vLLM asks for it."""

    init_info_cls = ParallmInitInfo
    update_info_cls = ParallmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)  # vLLM's WeightTransferEngine
        self.name = config.backend
        self.shm = None                 # the mapped file (uint8), slots back to back
        self.slot_bytes, self.shm_path = 0, None
        self.group = None               # gloo
        self.store = None
        self.repack = None
        self.sinks = None               # gpt-oss's attention sinks of the update in progress (fixes.SinkWriter)
        self.held_bytes = 0             # bytes copied out of the slots by own_held (see receive_weights)
        self.secrets = {}               # transport -> the secret of the connection that initialised it

    # -- init / verify ---------------------------------------------------------------------------------------
    def parse_init_info(self, init_dict):
        try:
            return ParallmInitInfo(**init_dict)
        except TypeError as e:
            raise ValueError(f"{self.name}: invalid init_weight_transfer_engine info ({e}); this engine runs "
                             f"parallm's backend {self.name!r}: connect with parallm.integrations.vllm.connect")\
                from None

    def init_transfer_engine(self, init_info: ParallmInitInfo) -> None:
        if init_info.verify is not None:
            self._verify(init_info.verify)
            return
        allowed = BACKENDS.get(self.name, ("shm", "gloo"))
        if init_info.transport not in allowed:
            raise ValueError(f"{self.name}: this engine was started with weight-transfer backend {self.name!r}, "
                             f"which takes {' or '.join(allowed)}; the trainer asked for {init_info.transport!r} "
                             "(start the engine with backend 'parallm' to take both)")
        if init_info.transport == "shm":
            self.shm = None
            size = init_info.slot_bytes * init_info.slots
            try:
                path = allowed_shm_file(init_info.path, size)
            except ValueError as e:
                raise ValueError(f"{self.name}: {e}") from None
            self.shm = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self.slot_bytes, self.shm_path = init_info.slot_bytes, path
        else:
            self.group = self.store = None
            self.group, self.store = _join_gloo(init_info, _worker_rank(self.parallel_config), what=self.name)
        self.secrets[init_info.transport] = init_info.secret

    def _verify(self, verify: dict) -> None:
        """What the push brings against this worker's model: names, shapes, dtype (the engine's). Every worker
        finds the same differences; only the engine's last worker raises them. vLLM 0.32's multiprocessing
        executor reads its workers' replies in rank order and raises at the first failure, leaving the later
        workers' replies queued, where the engine's next call reads them (a stale reply: the engine is then
        unusable); a failure of the last worker alone leaves nothing behind, so a mismatch changes nothing in
        the engine."""
        engine, tied = engine_tensors(self.model_config.hf_config, what=self.name)
        pushed = dict(zip(verify["names"], (tuple(s) for s in verify["shapes"])))
        if tied:
            pushed.setdefault(TIED_HEAD, pushed.get(TIED_SOURCE))
        problems = []
        if str(self.model_config.dtype).removeprefix("torch.") != verify["dtype"]:
            problems.append(f"dtype mismatch: the engine runs {self.model_config.dtype}, the push brings "
                            f"torch.{verify['dtype']} (push_weights(..., dtype=...) converts)")
        problem = mismatch(pushed, engine)
        if problem:
            problems.append(problem)
        if problems and self.parallel_config.rank == self.parallel_config.world_size - 1:
            raise ValueError(f"{self.name}: the engine's model does not match the trainer's: {'; '.join(problems)}")

    # -- one update ------------------------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        if self.shm is None and self.group is None:
            raise RuntimeError(f"{self.name}: start_weight_update before init_weight_transfer_engine")
        self.sinks = SinkWriter(self.model)
        self.repack = cpu_experts_repacked(self.model)
        self.repack.start()
        try:
            initialize_layerwise_reload(self.model)
        except BaseException:
            self.repack.abort()
            self.repack = None
            raise

    def update_weights(self, update_info) -> None:
        """vLLM's base class synchronises the accelerator after each update, which raises on CPU; the copies here
        are synchronous on CPU, and a CUDA device is synchronised."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device is not None and getattr(self.device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, info: ParallmUpdateInfo) -> None:
        transport = info.transport or ("gloo" if info.slot is None else "shm")
        if self.secrets.get(transport) is not None and info.secret != self.secrets[transport]:
            raise ValueError(f"{self.name}: the {transport} update does not carry the secret of the connection "
                             "that initialised this engine (another connection's, or none): refused")
        if transport == "shm" and self.shm is not None:
            if info.path is not None and info.path != self.shm_path:
                raise ValueError(f"{self.name}: the update is in {info.path}, but this engine reads "
                                 f"{self.shm_path}: another connection initialised it since (one shared-memory "
                                 "connection per engine; connect again)")
            if info.slot is None or not 0 <= info.slot * self.slot_bytes + info.nbytes <= self.shm.numel():
                raise ValueError(f"{self.name}: update names slot {info.slot} with {info.nbytes} bytes, outside "
                                 f"the {self.shm.numel()}-byte region")
            start = info.slot * self.slot_bytes
            buffer = self.shm[start:start + info.nbytes]      # views of the slot: loaded from there (one copy)
        elif transport == "gloo" and self.group is not None:
            buffer = torch.empty(info.nbytes, dtype=torch.uint8)
            self.group.broadcast(buffer, 0).wait()
        else:
            raise RuntimeError(f"{self.name}: a {transport} update before a {transport} "
                               "init_weight_transfer_engine")
        buffer = buffer.to(self.device) if getattr(self.device, "type", "cpu") != "cpu" else buffer
        weights = unpack(buffer, vars(info))
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        weights += [(TIED_HEAD, t) for n, t in weights if tied and n == TIED_SOURCE]
        try:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        except ImportError:
            disable_mtp_completeness_check = contextlib.nullcontext
        if self.sinks is not None:
            weights = list(self.sinks.divert(weights))
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        if transport == "shm":
            self.held_bytes += own_held(self.model, self.shm)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        repack, self.repack = self.repack, None
        sinks, self.sinks = self.sinks, None
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            if repack is not None:
                repack.abort()
            raise
        if repack is not None:
            repack.finish()
        if sinks is not None:
            sinks.apply()

    def shutdown(self) -> None:
        self.shm = None
        self.group = self.store = None
