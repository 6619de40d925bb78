"""Process groups: torch.distributed start-up and Megatron-core's model-parallel groups.

parallm never computes global ranks by arithmetic: every "which rank is my peer" question goes to
``megatron.core.parallel_state`` or to ``torch.distributed.get_process_group_ranks`` (a hard-coded rank order
breaks under other group layouts).

The layout a model was built for travels with it: every chunk carries the :class:`ParallelDims` of its build
(``chunk.dims``), and :func:`dims_of` refuses chunks whose layout is gone (``init_parallel`` ran again since).
Which pipeline stage is first or last and which stage owns a layer is decided here, in ParallelDims, alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from .megatron_import import import_megatron, silence_cuda_hints
from .stages import layer_numbers, layer_owner, stage_sizes

DEFAULT_TIMEOUT_S = float(os.environ.get("PARALLM_TIMEOUT_S", "600"))


def _import_parallel_state():
    return import_megatron().parallel_state


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, *, cp: int = 1, ep: int = 1,
                  backend: str | None = None, seed: int | None = None, timeout_s: float | None = None) -> None:
    """Initialise torch.distributed (if needed) and Megatron-core's model-parallel groups.

    torch.distributed is started from the environment (``env://``, as torchrun sets RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT) unless the caller already initialised it, in which case it is used as it is.
    The backend defaults to nccl when CUDA is available and gloo otherwise; any form torch accepts works
    (``"cpu:gloo,cuda:nccl"`` too): models live on CUDA when the group serves CUDA tensors with NCCL
    (:func:`group_device`). ``timeout_s`` (default: env PARALLM_TIMEOUT_S or 600 s) is the timeout of the
    process group parallm creates and of Megatron's groups. parallm's cross-rank agreement (argument and batch
    checks, load / save outcomes) runs on a gloo group with that timeout (:func:`control_group`), so an error
    or a lost peer ends there in an exception. A data-moving collective on NCCL whose peer died ends when
    NCCL's watchdog fires at the timeout (docs/reliability.md).

    ``world_size`` must equal ``tp * cp * pp * dp`` for an integer dp; Megatron's rank order (tp fastest, then
    cp, then dp, then pp: megatron-core's ``tp-cp-ep-dp-pp``) decides which ranks share a group.

    ``cp``: context parallelism (megatron-core's ``context_parallel_size``): the ranks of a context-parallel
    group hold the same model replica and each computes its share of every sequence (docs/context-parallel.md).
    Every rank of a CP group passes the same full batch; outputs are the same as at cp = 1 on every rank.

    ``ep``: expert parallelism for mixture-of-experts models, carved out of the data-parallel x context-parallel
    ranks as in Megatron (``expert_model_parallel_size``): ``ep`` must divide ``dp * cp``; the experts of every
    MoE layer are split over the ``ep`` ranks of an expert-parallel group (ranks with the same tp and pp rank),
    and ranks holding the same experts form the expert-data-parallel group (size ``dp * cp / ep``). Within an
    expert the FFN is split over the tp ranks like a dense MLP (expert-TP = tp).

    ``seed``: None (default) leaves every random number generator as the caller set it. An int seeds as
    Megatron does (:func:`seed_parallel`): torch's global generators (CPU and CUDA) with ``seed`` on every rank,
    so what is replicated across tensor-parallel ranks draws the same numbers, and on CUDA megatron-core's
    model-parallel generator (its ``get_cuda_rng_tracker``) with ``seed + 2718 + tp_rank``, different on every
    TP rank, for what is sharded (dropout inside the TP region). parallm's own layers draw no random numbers.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative integer, got {seed!r}")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"vpp must be a positive integer or None, got {vpp!r}")
        if vpp == 1:
            vpp = None
        elif pp == 1:
            raise ValueError(f"virtual pipeline (vpp={vpp}) needs pipeline parallelism (pp > 1), got pp=1")
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                "parallm.init_parallel: torch.distributed is not initialised and the environment lacks "
                f"{', '.join(missing)}; launch with torchrun, or call torch.distributed.init_process_group first")
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, store=_rendezvous_store(timeout), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        _OWN["process_group"] = True
    world = dist.get_world_size()
    if world % (tp * cp * pp) != 0:
        raise ValueError(f"world size {world} is not tp*cp*pp*dp: tp={tp} x cp={cp} x pp={pp} = {tp * cp * pp} "
                         f"does not divide {world}")
    dp = world // (tp * cp * pp)
    if (dp * cp) % ep:
        what = f"dp={dp} x cp={cp} = {dp * cp}" if cp > 1 else f"dp={dp}"
        raise ValueError(f"ep={ep} does not divide the data-parallel size {what} (world {world} = tp={tp} x "
                         f"{f'cp={cp} x ' if cp > 1 else ''}pp={pp} x dp={dp}); expert-parallel ranks are carved out "
                         f"of the data-parallel{' x context-parallel' if cp > 1 else ''} ranks")
    ps = _import_parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        distributed_timeout_minutes=timeout.total_seconds() / 60,   # megatron-core builds a timedelta of it
        create_gloo_process_groups=False,
    )
    if seed is not None:
        seed_parallel(seed)
    _GROUP_CACHE.clear()
    _STATE["generation"] += 1
    _make_control_group(timeout)
    if group_device().type == "cpu":        # megatron-core's CUDA stream advice means nothing here
        silence_cuda_hints()


def seed_parallel(seed: int) -> None:
    """Megatron's model-parallel seeding (after the groups exist): torch's global generators get ``seed`` on every
    rank (``torch.manual_seed`` seeds the CPU and every CUDA device), and on CUDA megatron-core's
    model-parallel generator ``seed + 2718 + tp_rank`` (``model_parallel_cuda_manual_seed``, which also gives
    the expert-parallel generator its own seed). The CPU has no such tracker in megatron-core; parallm's layers
    draw no random numbers."""
    torch.manual_seed(seed)
    if group_device().type == "cuda":
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _rendezvous_store(timeout: timedelta):
    """The store of a process group parallm creates from the environment (MASTER_ADDR / MASTER_PORT, served by
    rank 0, or by torchrun's agent where it says so), under a prefix of its own for each group this process
    creates. The TCP store is created once
    per process and kept: a second ``init_parallel`` after ``destroy_parallel`` reuses it under a new prefix.
    (Creating a fresh store through ``env://`` instead failed: a rank could reach the store of the previous
    group, read the previous group's addresses and fail with "connection refused".)"""
    key = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]))
    store = _OWN.get("store")
    if store is None or _OWN.get("store_key") != key:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)   # torchrun's agent serves it
        store = dist.TCPStore(key[0], key[1], key[2], is_master=not agent and int(os.environ["RANK"]) == 0,
                              timeout=timeout, multi_tenant=True)
        _OWN.update(store=store, store_key=key, groups=0)
    _OWN["groups"] += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")     # a restarted worker must not read old keys
    return dist.PrefixStore(f"parallm/{restart}/{_OWN['groups']}", store)


def before_destroy(fn) -> None:
    """Register ``fn()`` to run at the start of every :func:`destroy_parallel`, while the groups still exist
    (work that still uses them, such as a pending asynchronous checkpoint, finishes or fails there)."""
    if fn not in _BEFORE_DESTROY:
        _BEFORE_DESTROY.append(fn)


def backends_of(group=None) -> dict[str, str]:
    """The backend serving each device type in ``group`` (default: the world), from
    ``torch.distributed.get_backend``: ``"gloo"`` -> ``{"cpu": "gloo", "cuda": "gloo"}``, ``"nccl"`` ->
    ``{"cuda": "nccl"}``, ``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return {"cuda": name} if name == "nccl" else {"cpu": name, "cuda": name}
    return dict(part.split(":", 1) for part in name.split(","))


def group_device(group=None) -> torch.device:
    """The device parallm computes and communicates on for ``group``: CUDA (this process's current device, which
    ``init_parallel`` sets from ``LOCAL_RANK``) when CUDA is available and the group serves CUDA tensors with
    something other than gloo (NCCL, whatever the backend string's form); else the CPU. A group created as
    ``"gloo"`` keeps CPU models even on a GPU machine, as before."""
    cuda = backends_of(group).get("cuda")
    if cuda is not None and cuda != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def as_device(device) -> torch.device:
    """``device`` as a :class:`torch.device`: None -> the CPU (a model built with megatron-core's CPU
    initialisation), an int -> that CUDA device (what ``torch.cuda.current_device()`` returns), a string or a
    device as it is. Never ``device or "cpu"``: CUDA device 0 is the int 0, which is falsy, and would become the
    CPU on every node's local rank 0."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool):
        raise TypeError(f"device must be None, an int, a string or a torch.device, got {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return device if isinstance(device, torch.device) else torch.device(device)


def _make_control_group(timeout: timedelta) -> None:
    """parallm's cross-rank agreement (errors, load / save / batch checks: :mod:`parallm.parallel.errors`) runs on
    a gloo group over the world with the process-group timeout, never on NCCL: a gloo collective raises when a
    peer dies or the deadline passes, where NCCL waits for its watchdog. When the world group serves CPU tensors
    with gloo already it is used as it is (no second group)."""
    old = _OWN.pop("control", None)
    if old is not None:
        _destroy_group(old)
    if backends_of().get("cpu") != "gloo":
        _OWN["control"] = dist.new_group(backend="gloo", timeout=timeout)


def control_group():
    """The gloo group of the world that agreement runs on: None means the world group itself."""
    return _OWN.get("control")


def _destroy_group(group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - already gone with the default group
        pass


def layout_generation() -> int:
    """Counts init_parallel / destroy_parallel calls (what a cached per-group fact is keyed by)."""
    return _STATE["generation"]


def destroy_parallel() -> None:
    """Destroy Megatron's model-parallel groups, and the default process group if init_parallel created it (a
    process group the caller created stays theirs to destroy). Work registered with :func:`before_destroy` runs
    first; its first error is raised after the groups are gone (they are destroyed either way)."""
    errors = []
    for fn in list(_BEFORE_DESTROY):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - raised below, once the groups are torn down
            errors.append(e)
    _teardown()
    if errors:
        raise errors[0]


def _teardown() -> None:
    ps = _import_parallel_state()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    control = _OWN.pop("control", None)
    if control is not None and dist.is_initialized():
        _destroy_group(control)
    _GROUP_CACHE.clear()
    _STATE["generation"] += 1
    if _OWN.pop("process_group", False) and dist.is_initialized():
        dist.destroy_process_group()


def require_initialized(what: str) -> None:
    ps = _import_parallel_state()
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        raise RuntimeError(f"{what} needs parallel groups: call parallm.init_parallel(tp=..., pp=...) first")


@dataclass(frozen=True)
class ParallelDims:
    """This rank's coordinates in the parallel layout, read from parallel_state (never computed from the global
    rank), and the groups to talk over. ``generation`` counts ``init_parallel`` / ``destroy_parallel`` calls: a
    model built under one generation cannot run under another (its layers hold that generation's groups)."""
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    vpp: int
    dp: int
    dp_rank: int
    rank: int
    world: int
    generation: int
    tp_group: object = field(compare=False, repr=False)
    pp_group: object = field(compare=False, repr=False)
    dp_group: object = field(compare=False, repr=False)
    # expert parallelism: ep ranks (data-parallel ranks with the same tp / pp rank) split the experts; edp ranks
    # (size dp / ep) hold the same experts and average their gradients
    ep: int = 1
    ep_rank: int = 0
    edp: int = 1
    edp_rank: int = 0
    ep_group: object = field(default=None, compare=False, repr=False)
    edp_group: object = field(default=None, compare=False, repr=False)
    # context parallelism: cp ranks (same tp / pp / dp rank) hold the same replica and split every sequence;
    # dp_cp_group: the data-parallel ranks with their context-parallel ranks (size dp * cp), over which replicated
    # parameters' gradients are summed; dp_cp_rank 0 is the one that writes / reports for all of them
    cp: int = 1
    cp_rank: int = 0
    dp_cp_rank: int = 0
    cp_group: object = field(default=None, compare=False, repr=False)
    dp_cp_group: object = field(default=None, compare=False, repr=False)
    tp_cp_group: object = field(default=None, compare=False, repr=False)   # the ranks sharing one sequence
    # an uneven pipeline split: layers per virtual stage (order vpp_rank * pp + pp_rank), set by build_model for
    # the chunks it builds (:meth:`with_layer_split`); None: the even split
    layer_split: tuple[int, ...] | None = None

    @classmethod
    def current(cls) -> "ParallelDims":
        ps = _import_parallel_state()
        return cls(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                   vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                   dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                   rank=dist.get_rank(), world=dist.get_world_size(), generation=_STATE["generation"],
                   tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
                   dp_group=ps.get_data_parallel_group(),
                   ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
                   edp=ps.get_expert_data_parallel_world_size(), edp_rank=ps.get_expert_data_parallel_rank(),
                   ep_group=ps.get_expert_model_parallel_group(), edp_group=ps.get_expert_data_parallel_group(),
                   cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                   dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
                   cp_group=ps.get_context_parallel_group(),
                   dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
                   tp_cp_group=ps.get_tensor_and_context_parallel_group())

    @property
    def dp_cp(self) -> int:
        """Size of the data-parallel x context-parallel group (the ranks holding the same model shard)."""
        return self.dp * self.cp

    def describe(self) -> str:
        vpp = f" x vpp={self.vpp}" if self.vpp > 1 else ""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        return f"tp={self.tp}{cp} x pp={self.pp}{vpp} x dp={self.dp}{ep}"

    # -- experts: decided here only ---------------------------------------------------------------------------
    def expert_range(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (of every MoE layer): expert-parallel rank r holds
        ``[r * E / ep, (r + 1) * E / ep)``."""
        per = num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    # -- pipeline stages: decided here only ------------------------------------------------------------------
    def is_first_stage(self, vpp_rank: int) -> bool:
        """Virtual stage ``vpp_rank`` of this rank is the model's first (it owns the embedding)."""
        return self.pp_rank == 0 and vpp_rank == 0

    def is_last_stage(self, vpp_rank: int) -> bool:
        """Virtual stage ``vpp_rank`` of this rank is the model's last (final norm and head)."""
        return self.pp_rank == self.pp - 1 and vpp_rank == self.vpp - 1

    def stage_layers(self, num_layers: int, vpp_rank: int) -> range:
        """Global layer indices of this rank's virtual stage ``vpp_rank`` (Megatron's interleaving; the uneven
        split of :attr:`layer_split` when set)."""
        return layer_numbers(num_layers, self.pp, self.vpp, self.pp_rank, vpp_rank, layers_per_stage=self.layer_split)

    def owner_pp_rank(self, stage: str, layer: int | None, num_layers: int) -> int:
        """Pipeline rank owning a weight-table row's parameter: ``stage`` "first" / "last" / "layer"."""
        if stage == "first":
            return 0
        if stage == "last":
            return self.pp - 1
        return layer_owner(num_layers, self.pp, self.vpp, layer, layers_per_stage=self.layer_split)[0]

    def with_layer_split(self, num_layers: int, *, num_layers_in_first_pipeline_stage: int | None = None,
                         num_layers_in_last_pipeline_stage: int | None = None,
                         layers_per_stage=None) -> "ParallelDims":
        """This layout with the pipeline split of a ``num_layers`` model (:func:`parallm.parallel.stages.
        stage_sizes`: Megatron's ``num_layers_in_first/last_pipeline_stage`` or an explicit ``layers_per_stage``;
        none given: the even split). An impossible split is a ValueError naming the numbers."""
        if num_layers_in_first_pipeline_stage is None and num_layers_in_last_pipeline_stage is None \
                and layers_per_stage is None:
            stage_sizes(num_layers, self.pp, self.vpp)        # raises, with a hint, if it does not divide evenly
            return replace(self, layer_split=None)
        sizes = stage_sizes(num_layers, self.pp, self.vpp,
                            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
                            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
                            layers_per_stage=layers_per_stage)
        return replace(self, layer_split=sizes)


def current_dims() -> ParallelDims:
    return ParallelDims.current()


def as_chunks(chunks) -> list:
    """The public API accepts a list of chunks or a single chunk."""
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def dims_of(chunks) -> ParallelDims:
    """The layout ``chunks`` were built for, checked against the live one: chunks built before the last
    ``init_parallel`` / ``destroy_parallel`` are an error that says what changed (rebuild the model)."""
    built = chunks[0].dims
    if built.generation != _STATE["generation"]:
        ps = _import_parallel_state()
        now = current_dims().describe() if dist.is_initialized() and ps.model_parallel_is_initialized() \
            else "no parallel groups"
        raise RuntimeError(f"this model was built for {built.describe()}, but init_parallel / destroy_parallel "
                           f"has run since (now: {now}); build the model again under the current layout")
    return built


_STATE = {"generation": 0}
_GROUP_CACHE: dict = {}
_BEFORE_DESTROY: list = []
_OWN: dict = {}   # what parallm created (so destroy_parallel leaves the caller's process group alone)


def kv_replica_group(num_kv_heads: int):
    """The group of TP ranks holding the same replicated KV head (nkv < tp), or None when KV heads are not
    replicated. Every rank must call this (group creation is collective over the world)."""
    layout = current_dims()
    tp = layout.tp
    if num_kv_heads >= tp:
        return None
    key = ("kv", num_kv_heads, tp)
    if key not in _GROUP_CACHE:
        rep = tp // num_kv_heads
        mine = None
        # Enumerate every TP group in the world so all ranks create the same groups in the same order.
        all_tp = [None] * layout.world
        dist.all_gather_object(all_tp, dist.get_process_group_ranks(layout.tp_group))
        seen = []
        for ranks in all_tp:
            if ranks not in seen:
                seen.append(ranks)
        for ranks in seen:
            for block in range(num_kv_heads):
                members = ranks[block * rep:(block + 1) * rep]
                group = dist.new_group(members)
                if layout.rank in members:
                    mine = group
        _GROUP_CACHE[key] = mine
    return _GROUP_CACHE[key]
