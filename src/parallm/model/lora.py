"""LoRA adapters on the sharded decoder, laid out as PEFT lays them out on the unsharded transformers model.

``add_lora(chunks, LoraConfig(r, alpha, target_modules))`` (or ``build_model(..., lora=...)``) puts a pair of
low-rank factors beside every targeted linear and freezes everything else (``requires_grad=False``: no gradient,
no optimizer state, no gradient bucket). The output of an adapted linear is ``W x + (B (A x)) * alpha / r``, per
HF module as PEFT names them (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``), dropout 0 only.

Layouts over tensor parallelism (each factor is a parameter with a placement, like every weight):

    column-parallel linear (fused QKV, fused gate/up)   A [r, H] replicated; B [rows / tp, r] split like the
                                                        weight's rows (q / gate / up by rows, k / v as the fused
                                                        QKV holds KV heads: replicated when nkv < tp)
    row-parallel linear (o_proj, down_proj)             A [r, in / tp] split like the weight's columns;
                                                        B [out, r] replicated

The fused QKV holds one adapter per HF module: ``q_proj``'s B rows land in the ``q_r`` rows of ``[q_r; k_r;
v_r]``, and so on. The products ``A x`` (``r`` wide) are what crosses the TP ranks: a column adapter's ``A x`` is
all-gathered over the sequence-parallel split (or enters the TP region as a copy), a row adapter's partial
``A_r x_r`` is summed over TP (reduce-scattered under sequence parallelism). Gradients whose TP ranks each see
part of the work are partial sums (``tp_sum``: A of a column adapter and B of a row adapter under sequence
parallelism), summed by ``finalize_grads``.

Routed experts (Qwen3-MoE, Qwen2-MoE, Mixtral): PEFT on transformers 5, whose experts are stacked 3-D
parameters, targets them with ``target_parameters``: one adapter per expert over the fused ``gate_up_proj`` of rank
``2 r`` (alpha ``2 alpha``) and one over ``down_proj`` of rank ``r``; ``gate_proj`` and ``up_proj`` must be targeted
together. parallm does the same: per local expert ``fc1 A [2r, H]`` replicated over TP, ``fc1 B [2 I / tp, 2r]``
(rows ``[gate_r; up_r]``), ``fc2 A [r, I / tp]``, ``fc2 B [H, r]`` replicated, stacked over the rank's experts. As
in PEFT, the MLP targets then adapt routed experts only (a MoE model's dense layers and shared expert keep no
adapter). Multi-head latent attention and Gated DeltaNet projections are refused by name.

``A`` starts as PEFT's (Kaiming-uniform, bound ``1 / sqrt(fan_in)``) from a generator seeded per HF module
(``LoraConfig.seed``), so every layout starts from the same full A; ``B`` starts at zero.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import KW_ONLY, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.megatron_import import import_megatron
from ..parallel.state import as_chunks
from .moe import Experts, swiglu
from .params import attach_main_grad_hooks
from .placement import Placement, place
from .sharding import (Block, PartsSplit, Replicated, Split, TPLayout, _as_source, kv_heads_of_rank)
from .table import chunk_entries, resolve_shape

mtp = import_megatron().tensor_parallel

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# families whose layers parallm can adapt (their attention is plain GQA; experts as transformers 5 stacks them)
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
# MoE families whose MLP target names PEFT 0.21 retargets to the stacked routed experts on transformers 5
# (peft.utils.transformers_weight_conversion: a conversion pattern for the model type). Their dense MLPs and
# shared experts then get no adapter. Qwen2-MoE has no pattern there: PEFT adapts its nn.Linear MLPs (dense
# layers, shared expert) and not its routed experts, and so does parallm.
PEFT_EXPERT_FAMILIES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class LoraConfig:
    """``r``: rank; ``alpha``: scaling numerator (PEFT's ``lora_alpha``: the update is ``B A x * alpha / r``);
    ``target_modules``: HF module names as PEFT matches them (a name equals the module's last component or a
    dotted suffix of its path; a string is a regex the whole path must match; ``"all-linear"``: every projection
    of a layer); ``dropout``: 0 only (RL fine-tuning runs without it; anything else is a ValueError);
    ``rank_pattern`` / ``alpha_pattern``: PEFT's per-module overrides (key: a regex matched against the end of
    the module path); ``seed``: A's initialisation."""
    r: int
    alpha: float
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    _: KW_ONLY
    dropout: float = 0.0
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoraConfig: r must be a positive int, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"LoraConfig: alpha must be a positive number, got {self.alpha!r}")
        if self.dropout != 0.0:
            raise ValueError(f"LoraConfig: dropout={self.dropout} is not supported; parallm's adapters run without "
                             "dropout (dropout=0.0)")
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
            if not self.target_modules:
                raise ValueError("LoraConfig: target_modules is empty")
        object.__setattr__(self, "rank_pattern", dict(self.rank_pattern or {}))
        object.__setattr__(self, "alpha_pattern", dict(self.alpha_pattern or {}))
        for name, pat in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for k, v in pat.items():
                if not isinstance(v, (int, float)) or v <= 0:
                    raise ValueError(f"LoraConfig: {name}[{k!r}] must be positive, got {v!r}")

    def targets(self, module: str) -> bool:
        """Whether HF module ``module`` (``model.layers.0.self_attn.q_proj``) is targeted (PEFT's rule)."""
        t = self.target_modules
        if t == "all-linear":
            return module.rsplit(".", 1)[-1] in ALL_LINEAR
        if isinstance(t, str):
            return re.fullmatch(t, module) is not None
        return any(module == x or module.endswith("." + x) for x in t)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """``(r, alpha)`` of ``module`` after the patterns (PEFT's: the first key matching the path's end)."""
        def pick(pattern, default):
            for key, value in pattern.items():
                if re.match(rf"(.*\.)?({key})$", module):
                    return value
            return default
        return int(pick(self.rank_pattern, self.r)), float(pick(self.alpha_pattern, self.alpha))

    def rank_alpha_scaled(self, module: str) -> tuple[int, float]:
        """``(r, alpha / r)`` of ``module``."""
        r, alpha = self.rank_alpha(module)
        return r, alpha / r

    def to_dict(self) -> dict:
        t = self.target_modules
        return {"r": self.r, "alpha": self.alpha, "target_modules": t if isinstance(t, str) else list(t),
                "dropout": self.dropout, "rank_pattern": self.rank_pattern, "alpha_pattern": self.alpha_pattern,
                "seed": self.seed}


# -- layouts of the factors that no weight has ---------------------------------------------------------------

class KVRows(TPLayout):
    """Rows of a ``k_proj`` / ``v_proj``-shaped tensor (``[nkv * d, ...]``) as the fused QKV holds its k (or v)
    part: rank r's KV heads (:func:`kv_heads_of_rank`), replicated over ``tp / nkv`` ranks when nkv < tp (the
    first of them is the primary holder; the others' gradient rows are partial sums: ``replica_rows``)."""
    name = "kv"
    tp_dim = 0

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.nkv, self.d = num_kv_heads, head_dim

    def _rows(self, rank, tp):
        kv = kv_heads_of_rank(rank, tp, self.nkv)
        first = self.nkv >= tp or rank % (tp // self.nkv) == 0
        return kv.start * self.d, kv.stop * self.d, first

    def shard(self, sources, rank, tp):
        a, b, _ = self._rows(rank, tp)
        return _as_source(sources[0]).read(0, a, b)

    def merge(self, shards):
        tp = len(shards)
        return [torch.cat([s for r, s in enumerate(shards) if self._rows(r, tp)[2]], dim=0)]

    def blocks(self, rank, tp, hf_shapes):
        a, b, first = self._rows(rank, tp)
        return [Block(0, 0, a, b, 0, b - a, primary=first)]

    def primary_slices(self, rank, tp, local_shape):
        return [(0, 0, local_shape[0])] if self._rows(rank, tp)[2] else []

    def replica_rows(self, rank, tp):
        if self.nkv >= tp:
            return None
        a, b, _ = self._rows(rank, tp)
        return 0, b - a


class Stacked(TPLayout):
    """A rank's experts' factors stacked along a new dim 0 (``shard[x]``: local expert x's factor in the
    per-expert layout ``inner``); unlike the weights' ``ExpertStack`` the inner layout may be replicated over TP
    (then only TP rank 0 counts it in norms)."""
    name = "stacked"

    def __init__(self, inner: TPLayout, count: int):
        self.inner, self.count = inner, count
        self.sources = inner.sources * count
        self.tp_dim = None if inner.tp_dim is None else inner.tp_dim + 1
        self.stride = inner.stride

    def shard(self, sources, rank, tp):
        n = self.inner.sources
        return torch.stack([self.inner.shard(sources[x * n:(x + 1) * n], rank, tp) for x in range(self.count)])

    def merge(self, shards):
        return [t for x in range(self.count) for t in self.inner.merge([s[x] for s in shards])]

    def blocks(self, rank, tp, hf_shapes):
        n = self.inner.sources
        return [b._replace(source=x * n + b.source) for x in range(self.count)
                for b in self.inner.blocks(rank, tp, hf_shapes[x * n:(x + 1) * n])]

    def primary_slices(self, rank, tp, local_shape):
        whole = self.inner.primary_slices(rank, tp, tuple(local_shape[1:]))
        return [(0, 0, local_shape[0])] if whole and local_shape else []


# -- the global plan: which factors exist, their names, full shapes and layouts ------------------------------

@dataclass(frozen=True)
class LoraRow:
    """What a training checkpoint reads of a factor's entry (weight-table rows have the same fields)."""
    local: str
    save: bool = True
    trained: bool = True


@dataclass(frozen=True)
class LoraEntry:
    """One factor as a weight-table entry: ``local`` its parameter in the chunk, ``hf`` its name in training
    checkpoints (the HF module path + ``.lora_A.weight``; a routed expert's per expert,
    ``model.layers.{i}.mlp.experts.{e}.gate_up_proj.lora_A.weight``), ``index`` an expert's slab."""
    row: LoraRow
    local: str
    hf: tuple[str, ...]
    layer: int
    index: int | None = None
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Slot:
    """One HF module adapted inside a parallel linear: ``module`` its HF path, ``part`` its leaf (the key of
    the factors in the adapter), ``rows`` its full output rows, ``cols`` its full input, ``r`` / ``scaling``,
    ``b_layout`` / ``a_layout`` the factors' TP layouts."""
    module: str
    part: str
    rows: int
    cols: int
    r: int
    scaling: float
    a_layout: TPLayout
    b_layout: TPLayout
    a_tp_sum: bool
    b_tp_sum: bool


def _leaf(hf_weight: str) -> tuple[str, str]:
    module = hf_weight.removesuffix(".weight")
    return module, module.rsplit(".", 1)[-1]


def _expert_rank_alpha(config: LoraConfig, modules) -> tuple[int, float]:
    """A routed expert's ``(r, alpha)``: the config's (patterns are for dense modules: PEFT rewrites the experts'
    own into ``gate_up_proj`` patterns of its own making)."""
    for m, _ in modules:
        if config.rank_alpha(m) != (config.r, float(config.alpha)):
            raise ValueError(f"LoRA: rank_pattern / alpha_pattern match the routed expert module {m}; routed experts "
                             "take the config's r and alpha (gate_up_proj: 2 r and 2 alpha, as PEFT)")
    return config.r, float(config.alpha)


def layer_slots(spec, entry, config: LoraConfig, *, tp: int, sp: bool) -> tuple[str, list[Slot]] | None:
    """``(kind, slots)`` of the table entry's linear (``"column"``, ``"row"``, ``"experts_fc1"``,
    ``"experts_fc2"``), None when nothing of it is targeted. Raises for targeted modules parallm cannot adapt."""
    local = entry.local.split(".", 2)[-1]          # drop "layers.{l}."
    modules = [_leaf(h) for h in entry.hf]
    hit = [config.targets(m) for m, _ in modules]
    moe = spec.moe is not None
    if local == "self_attention.linear_qkv.weight":
        if not any(hit):
            return None
        rows = (spec.q_size * (2 if spec.attn_output_gate else 1), spec.kv_size, spec.kv_size)
        kv = KVRows(spec.num_kv_heads, spec.head_dim)
        layouts = (Split(0), kv, kv)
        return "column", [Slot(m, p, n, spec.hidden_size, *config.rank_alpha_scaled(m), Replicated(), lay, sp, False)
                          for (m, p), n, lay, h in zip(modules, rows, layouts, hit) if h]
    if local == "self_attention.linear_proj.weight":
        if not hit[0]:
            return None
        (m, p), = modules
        return "row", [Slot(m, p, spec.hidden_size, spec.q_size, *config.rank_alpha_scaled(m), Split(1), Replicated(),
                            False, sp)]
    mlp = local in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc1.weight",
                    "mlp.shared_experts.linear_fc2.weight")
    if mlp and (not moe or spec.family not in PEFT_EXPERT_FAMILIES):
        if not any(hit):
            return None
        shapes = [resolve_shape(sh, spec) for sh in entry.row.shapes]
        if local.endswith("linear_fc1.weight"):      # [gate; up], column-parallel
            return "column", [Slot(m, p, sh[0], sh[1], *config.rank_alpha_scaled(m), Replicated(), Split(0), sp,
                                   False) for (m, p), sh, h in zip(modules, shapes, hit) if h]
        ((m, p),), (sh,) = modules, shapes
        return "row", [Slot(m, p, sh[0], sh[1], *config.rank_alpha_scaled(m), Split(1), Replicated(), False, sp)]
    if mlp:
        return None            # PEFT on transformers 5 retargets these families' MLP names to the routed experts
    if local.startswith("mlp.experts.") and spec.family not in PEFT_EXPERT_FAMILIES:
        return None            # PEFT leaves them: transformers 5's stacked experts are no nn.Linear
    if local == "mlp.experts.linear_fc1.weight":
        if not any(hit):
            return None
        if not all(hit):
            raise ValueError(f"LoRA: {', '.join(p for (m, p), h in zip(modules, hit) if h)} of the routed experts "
                             f"cannot be targeted without {', '.join(p for (m, p), h in zip(modules, hit) if not h)}: "
                             "transformers stacks them into one gate_up_proj (PEFT refuses the same)")
        fused = entry.row.fused[0].format(i=entry.layer).removesuffix(".gate_up_proj")
        r, alpha = _expert_rank_alpha(config, modules)
        width = spec.moe.expert_intermediate_size
        return "experts_fc1", [Slot(fused, "gate_up_proj", 2 * width, spec.hidden_size, 2 * r, alpha / r,
                                    Replicated(), PartsSplit((width, width)), tp > 1, False)]
    if local == "mlp.experts.linear_fc2.weight":
        if not hit[0]:
            return None
        fused = entry.row.fused[0].format(i=entry.layer).removesuffix(".down_proj")
        r, alpha = _expert_rank_alpha(config, modules)
        return "experts_fc2", [Slot(fused, "down_proj", spec.hidden_size, spec.moe.expert_intermediate_size, r,
                                    alpha / r, Split(1), Replicated(), False, tp > 1)]
    if entry.hf and entry.hf[0].endswith(".weight") and any(hit):
        raise ValueError(f"LoRA on {', '.join(m for (m, _), h in zip(modules, hit) if h)} is not supported: parallm "
                         "adapts q/k/v/o_proj, gate/up/down_proj and routed experts only (not multi-head latent "
                         "attention, Gated DeltaNet or other projections)")
    return None


# -- the adapters ---------------------------------------------------------------------------------------------

class LoraState:
    """Shared by a model's adapters: whether they run (:func:`adapters_disabled` turns them off)."""

    def __init__(self):
        self.enabled = True


class Adapter(nn.Module):
    """The factors beside one parallel linear: ``lora_A[part]`` / ``lora_B[part]`` per adapted HF module (see the
    module docstring for the layouts); ``kind``: ``"column"`` (output ``[slot_0 rows; slot_1 rows; ...]`` as
    the fused weight's, ``layout`` the local rows of every slot of the weight, adapted or not) or ``"row"``."""

    def __init__(self, kind: str, slots: list[Slot], local_rows: list[tuple[str, int]], state: LoraState, dims,
                 sp: bool):
        super().__init__()
        self.kind, self.slots, self.local_rows, self.state = kind, slots, local_rows, state
        self.tp, self.tp_group, self.sp = dims.tp, dims.tp_group, sp
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()

    def forward(self, x):
        slots = self.slots
        a = self.lora_A[slots[0].part] if len(slots) == 1 else torch.cat([self.lora_A[s.part] for s in slots])
        z = F.linear(x, a)
        if self.kind == "column":
            if self.sp:
                z = mtp.gather_from_sequence_parallel_region(z, True, group=self.tp_group)
            elif self.tp > 1:
                z = mtp.copy_to_tensor_model_parallel_region(z, group=self.tp_group)
            zs = dict(zip((s.part for s in slots), z.split([s.r for s in slots], dim=-1)))
            scale = {s.part: s.scaling for s in slots}
            outs = [F.linear(zs[part], self.lora_B[part]) * scale[part] if part in zs
                    else z.new_zeros(z.shape[:-1] + (rows,)) for part, rows in self.local_rows]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.sp:
            z = mtp.reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group)
        elif self.tp > 1:
            z = mtp.reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        s = slots[0]
        return F.linear(z, self.lora_B[s.part]) * s.scaling

    def delta(self, part: str) -> torch.Tensor:
        """``B A * scaling`` of one slot in fp32: this rank's shard of the update of its weight rows (column) or
        columns (row)."""
        s = next(s for s in self.slots if s.part == part)
        return (self.lora_B[part].float() @ self.lora_A[part].float()) * s.scaling


class LoraColumnParallelLinear(mtp.ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear with an :class:`Adapter` (``self.lora``) added to its output."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        if self.lora.state.enabled:
            out = out + self.lora(input_)
        return out, bias


class LoraRowParallelLinear(mtp.RowParallelLinear):
    """megatron-core's RowParallelLinear with an :class:`Adapter` (``self.lora``) added to its reduced output."""

    def forward(self, input_):
        out, bias = super().forward(input_)
        if self.lora.state.enabled:
            out = out + self.lora(input_)
        return out, bias


class ExpertAdapter(nn.Module):
    """The routed experts' factors of one layer, stacked over the rank's experts: ``lora_A/B["gate_up_proj"]``
    (``[E_local, 2r, H]`` / ``[E_local, 2 I / tp, 2r]``) and ``lora_A/B["down_proj"]`` (``[E_local, r, I / tp]`` /
    ``[E_local, H, r]``)."""

    def __init__(self, state: LoraState):
        super().__init__()
        self.state = state
        self.slots: dict[str, Slot] = {}
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()


def _gmm(x, w, counts, offsets, grouped):
    """Per-expert ``x_e @ w[e]^T`` of rows grouped by expert: one grouped GEMM, or a loop."""
    if grouped:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return torch.cat([F.linear(part, we) for part, we in zip(x.split(counts, dim=0), w.unbind(0))], dim=0)


def _aligned(*tensors) -> bool:
    return all((t.shape[-1] * t.element_size()) % 16 == 0 and (t.shape[-2] * t.element_size()) % 16 == 0
               for t in tensors)


class LoraExperts(Experts):
    """The routed experts with their per-expert adapters (``self.lora``, an :class:`ExpertAdapter`): ``fc1`` and
    ``fc2`` each ``W x + B (A x) * scaling`` per expert. The adapters' partial sums over TP (A of fc1 sees this
    rank's fc1 rows only; B of fc2 this rank's fc2 columns) ride on the experts' own TP reduction; their
    gradients are partial sums (``tp_sum``)."""

    def forward(self, rows, counts, counts_device):
        ad = self.lora
        if not ad.state.enabled:
            return super().forward(rows, counts, counts_device)
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        grouped = self.kernel == "grouped_mm"
        offsets = counts_device.cumsum(0).to(torch.int32) if grouped else None

        def linear(x, w, part):
            y = _gmm(x, w, counts, offsets, grouped)
            if part in ad.lora_A:
                a, b = ad.lora_A[part], ad.lora_B[part]
                fast = grouped and _aligned(a, b)
                y = y + _gmm(_gmm(x, a, counts, offsets, fast), b, counts, offsets, fast) * ad.slots[part].scaling
            return y

        return linear(swiglu(linear(rows, w1, "gate_up_proj")), w2, "down_proj")


# -- building -------------------------------------------------------------------------------------------------

def _init_a(module: str, r: int, cols: int, seed: int) -> torch.Tensor:
    """PEFT's default A (``kaiming_uniform_(a=sqrt(5))``: uniform in ``±1 / sqrt(fan_in)``), the full tensor,
    from a generator seeded by ``seed`` and the module's name: the same at every layout."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(module.encode())) % (2 ** 63))
    bound = 1.0 / math.sqrt(cols)
    return (torch.rand(r, cols, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _new_param(full_sources, layout, rank, tp, dtype, device):
    t = layout.shard(full_sources, rank, tp)
    return nn.Parameter(t.to(device=device, dtype=dtype).contiguous())


def lora_state_of(chunks) -> LoraState | None:
    return getattr(as_chunks(chunks)[0], "lora_state", None)


def lora_config_of(chunks) -> LoraConfig | None:
    return getattr(as_chunks(chunks)[0], "lora_config", None)


def add_lora(chunks, config: LoraConfig):
    """Freeze ``chunks`` and add the adapters ``config`` describes (module docstring); returns the chunks. Not
    collective (every rank computes the same plan): errors (a target that matches nothing, an unsupported
    module) are raised on every rank alike. Once per model."""
    chunks = as_chunks(chunks)
    if not isinstance(config, LoraConfig):
        raise TypeError(f"add_lora takes a parallm.LoraConfig, got {type(config).__name__}")
    if lora_config_of(chunks) is not None:
        raise ValueError("the model already has LoRA adapters")
    if getattr(chunks[0], "_parallm_grad_buffers", None) is not None or getattr(chunks[0], "_parallm_optimizer_built",
                                                                                 False):
        raise ValueError("add_lora after build_optimizer: the optimizer holds the base's parameters; add the "
                         "adapters first (build_model(..., lora=...)), then build the optimizer")
    spec = chunks[0].spec
    if spec.family not in SUPPORTED_FAMILIES:
        raise ValueError(f"LoRA is not supported for the {spec.family} family yet (supported: "
                         f"{', '.join(SUPPORTED_FAMILIES)})")
    state = LoraState()
    found = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        found += _add_to_chunk(chunk, config, state)
    if found == 0 and _targets_nothing(spec, chunks[0], config):
        raise ValueError(f"LoRA target_modules {config.target_modules!r} match no module of this "
                         f"{spec.architecture} (adaptable: {', '.join(ALL_LINEAR)})")
    for chunk in chunks:
        chunk.lora_config, chunk.lora_state = config, state
        chunk._parallm_norm_plan = None
    attach_main_grad_hooks(chunks)
    return chunks


def _targets_nothing(spec, chunk, config) -> bool:
    return not global_entries(spec, chunk.table, chunk.task, chunk.dims, config)


def _add_to_chunk(chunk, config, state) -> int:
    dims, spec = chunk.dims, chunk.spec
    tp, rank, sp = dims.tp, dims.tp_rank, chunk.sequence_parallel
    dtype = chunk.config.params_dtype
    experts = dims.expert_range(spec.moe.num_experts) if spec.moe is not None else None
    added = 0
    for entry in chunk_entries(chunk.table, spec, task=chunk.task, pp=dims.pp, pre_process=False, post_process=False,
                               layers=chunk.layer_range, experts=experts):
        if entry.index not in (None, 0):
            continue
        found = layer_slots(spec, entry, config, tp=tp, sp=sp)
        if found is None:
            continue
        kind, slots = found
        module = chunk.get_submodule(entry.local.removesuffix(".weight"))
        weight = module.weight
        device = weight.device
        if kind in ("column", "row"):
            if kind == "column":
                local_rows = [(_leaf(h)[1], n) for h, n in zip(entry.hf, _local_rows(spec, entry, tp, rank))]
                module.__class__ = LoraColumnParallelLinear
            else:
                local_rows = None
                module.__class__ = LoraRowParallelLinear
            ad = Adapter(kind, slots, local_rows, state, dims, sp)
            for s in slots:
                a = _init_a(s.module, s.r, s.cols, config.seed)
                b = torch.zeros(s.rows, s.r)
                ad.lora_A[s.part] = _new_param([a], s.a_layout, rank, tp, dtype, device)
                ad.lora_B[s.part] = _new_param([b], s.b_layout, rank, tp, dtype, device)
                for p, lay, tp_sum in ((ad.lora_A[s.part], s.a_layout, s.a_tp_sum),
                                       (ad.lora_B[s.part], s.b_layout, s.b_tp_sum)):
                    place(p, Placement(layout=lay, tp_sum=tp_sum and tp > 1), module_kind="other",
                          sequence_parallel=sp, expert_parallel=dims.ep > 1)
            module.lora = ad
        else:
            experts_module = chunk.get_submodule(entry.local.rsplit(".", 2)[0])
            if not isinstance(experts_module, LoraExperts):
                experts_module.__class__ = LoraExperts
                experts_module.lora = ExpertAdapter(state)
            ad = experts_module.lora
            (s,) = slots
            ad.slots[s.part] = s
            held = list(experts)
            a = [_init_a(f"{s.module}.{e}.{s.part}", s.r, s.cols, config.seed) for e in held]
            b = [torch.zeros(s.rows, s.r) for _ in held]
            for key, srcs, lay, tp_sum in (("A", a, s.a_layout, s.a_tp_sum), ("B", b, s.b_layout, s.b_tp_sum)):
                stacked = Stacked(lay, len(held))
                p = _new_param(srcs, stacked, rank, tp, dtype, device)
                (ad.lora_A if key == "A" else ad.lora_B)[s.part] = p
                place(p, Placement(layout=stacked, tp_sum=tp_sum and tp > 1, expert=experts), module_kind="other",
                      sequence_parallel=sp, expert_parallel=dims.ep > 1)
        added += 1
    return added


def _local_rows(spec, entry, tp, rank) -> list[int]:
    """This TP rank's rows of each HF module fused in a column-parallel weight (qkv: ``q_r, k_r, v_r``; gate/up)."""
    if entry.local.endswith("linear_qkv.weight"):
        q = spec.q_size * (2 if spec.attn_output_gate else 1) // tp
        kv = len(kv_heads_of_rank(rank, tp, spec.num_kv_heads)) * spec.head_dim
        return [q, kv, kv]
    return [resolve_shape(sh, spec)[0] // tp for sh in entry.row.shapes]


def global_entries(spec, table, task, dims, config: LoraConfig, *, experts=None, layers=None,
                   holder=None) -> list[tuple[LoraEntry, Slot, str]]:
    """Every factor of the model (``layers``: those layers only; ``experts``: those experts only), in model order:
    ``(entry, slot, "A" | "B")``. The entries' ``local`` names are chunk-local when ``holder`` (a chunk) is
    given (its layers), else use the global layer index."""
    out = []
    layers = range(spec.num_layers) if layers is None else layers
    for entry in chunk_entries(table, spec, task=task, pp=dims.pp, pre_process=False, post_process=False,
                               layers=layers, experts=experts):
        if entry.index not in (None, 0):
            continue
        found = layer_slots(spec, entry, config, tp=dims.tp, sp=False)
        if found is None:
            continue
        kind, slots = found
        base = entry.local.removesuffix(".weight")
        if kind.startswith("experts"):
            base = base.rsplit(".", 1)[0]          # layers.{l}.mlp.experts
        held = [None] if not kind.startswith("experts") else \
            (list(experts) if experts is not None else list(range(spec.moe.num_experts)))
        for s in slots:
            for which in ("A", "B"):
                local = f"{base}.lora.lora_{which}.{s.part}"
                shape = (s.r, s.cols) if which == "A" else (s.rows, s.r)
                for x, e in enumerate(held):
                    hf = f"{s.module}.lora_{which}.weight" if e is None else \
                        f"{s.module}.{e}.{s.part}.lora_{which}.weight"
                    out.append((LoraEntry(LoraRow(hf), local, (hf,), entry.layer, None if e is None else x, shape),
                                s, which))
    return out


def chunk_lora_entries(chunks) -> list[tuple[LoraEntry, object]]:
    """``(entry, chunk)`` of every factor this rank holds (training checkpoints and the optimizer read them as
    weight-table entries)."""
    chunks = as_chunks(chunks)
    config = lora_config_of(chunks)
    if config is None:
        return []
    out = []
    for chunk in chunks:
        spec, dims = chunk.spec, chunk.dims
        experts = dims.expert_range(spec.moe.num_experts) if spec.moe is not None else None
        for e, _, _ in global_entries(spec, chunk.table, chunk.task, dims, config, experts=experts,
                                      layers=chunk.layer_range):
            out.append((e, chunk))
    return out


# -- ways of using the adapters -------------------------------------------------------------------------------

@contextlib.contextmanager
def adapters_disabled(chunks):
    """Inside, the model runs without its adapters: the base model (an RL reference policy without a second
    model). Restores the previous state on exit, also after an error. Not collective: every rank of the model
    must enter it around the same calls."""
    state = lora_state_of(chunks)
    if state is None:
        raise ValueError("adapters_disabled: the model has no LoRA adapters (build_model(..., lora=...) or "
                         "parallm.add_lora)")
    before, state.enabled = state.enabled, False
    try:
        yield
    finally:
        state.enabled = before


def adapted_weights(chunks):
    """``(weight, adapter)`` of every adapted base weight of this rank (an expert weight's adapter as
    ``(ExpertAdapter, part)``): what :func:`merged_weights` merges."""
    for chunk in as_chunks(chunks):
        for module in chunk.modules():
            if isinstance(module, (LoraColumnParallelLinear, LoraRowParallelLinear)):
                yield module.weight, module.lora
            elif isinstance(module, LoraExperts):
                yield module.linear_fc1.weight, (module.lora, "gate_up_proj")
                yield module.linear_fc2.weight, (module.lora, "down_proj")


@torch.no_grad()
def _deltas(weight, what):
    """``[(view of weight, fp32 delta)]`` for one adapted weight."""
    if isinstance(what, Adapter):
        if what.kind == "row":
            return [(weight, what.delta(what.slots[0].part))]
        out, at = [], 0
        for part, rows in what.local_rows:
            if part in what.lora_A:
                out.append((weight[at:at + rows], what.delta(part)))
            at += rows
        return out
    ad, part = what
    if part not in ad.lora_A:
        return []
    delta = torch.bmm(ad.lora_B[part].float(), ad.lora_A[part].float()) * ad.slots[part].scaling
    return [(weight, delta)]


@contextlib.contextmanager
def merged_weights(chunks):
    """Inside, every adapted base weight holds ``W + B A * scaling`` (computed in fp32, rounded once into the
    weight's dtype): what an engine without LoRA serves. On exit the original bits are copied back (each
    adapted weight is copied aside first: extra memory of one copy of the adapted weights of this rank). No
    collectives: each rank merges its own shards."""
    saved = []
    try:
        with torch.no_grad():
            for weight, what in adapted_weights(chunks):
                pieces = _deltas(weight, what)
                if not pieces:
                    continue
                saved.append((weight, weight.detach().clone()))
                for view, delta in pieces:
                    view.copy_((view.float() + delta).to(view.dtype))
        yield
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.detach().copy_(original)
