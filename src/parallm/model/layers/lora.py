"""LoRA adapters on the sharded decoder, laid out as PEFT lays them out on the unsharded transformers model.

``add_lora(chunks, LoraConfig(r, alpha, target_modules))`` (or ``build_model(..., lora=...)``) puts a pair of
low-rank factors beside every targeted linear and freezes everything else (``requires_grad=False``: no gradient,
no optimizer state, no gradient bucket). The output of an adapted linear is ``W x + (B (A x)) * alpha / r``, per
HF module as PEFT names them (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``; multi-head latent attention's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``),
dropout 0 only.

Layouts over tensor parallelism (each factor is a parameter with a placement, like every weight):

    column-parallel linear (fused QKV, fused gate/up)   A [r, H] replicated; B [rows / tp, r] split like the
                                                        weight's rows (q / gate / up by rows, k / v as the fused
                                                        QKV holds KV heads: replicated when nkv < tp)
    row-parallel linear (o_proj, down_proj)             A [r, in / tp] split like the weight's columns;
                                                        B [out, r] replicated
    replicated linear (MLA's q_a_proj,                  A [r, in] and B [out, r] replicated, run on the rank's
    kv_a_proj_with_mqa: duplicated on every TP rank)    own tokens, no communication

The fused QKV holds one adapter per HF module: ``q_proj``'s B rows land in the ``q_r`` rows of ``[q_r; k_r;
v_r]``, and so on. The products ``A x`` (``r`` wide) are what crosses the TP ranks: a column adapter's ``A x`` is
all-gathered over the sequence-parallel split (or enters the TP region as a copy), a row adapter's partial
``A_r x_r`` is summed over TP (reduce-scattered under sequence parallelism). Gradients whose TP ranks each see
part of the work are partial sums (``tp_sum``: A of a column adapter and B of a row adapter under sequence
parallelism), summed by ``finalize_grads``.

Multi-head latent attention (DeepSeek-V3, Kimi-K2, Moonlight; :mod:`parallm.model.layers.mla`): parallm holds each
MLA projection as its HF tensor, rows unreordered (q_b / kv_b rows per head, k_nope then v, split over TP by
heads; ``rope_interleave`` permutes activations, not weights), so each adapter is a plain one: ``q_b_proj``,
``q_proj``, ``kv_b_proj`` column (B split by rows), ``o_proj`` row, and the down-projections ``q_a_proj`` /
``kv_a_proj_with_mqa`` replicated. Under sequence parallelism a replicated linear sees this rank's tokens only:
both its factors' gradients are partial sums (``tp_sum``), as the down-projections' own weights' are (their table
rows' ``tp_sum="sp"``); without it every rank's gradients are whole (the up-projections' and the rope key's
backward all-reduce).

gpt-oss's routed experts (``gate_up_proj [E, H, 2 I]``, ``down_proj [E, I, H]``, held as transformers holds them):
PEFT adapts them through ``target_parameters=["gate_up_proj", "down_proj"]`` (``LoraConfig(target_modules=(...,
"gate_up_proj", "down_proj"))`` here): one adapter per expert of rank ``r`` over each, A ``[r, in]``, B ``[out,
r]``; fc1's B rows are gate_up's interleaved columns, split over TP as the weight's columns are.

Routed experts (Qwen3-MoE, Mixtral, DeepSeek-V3; not Qwen2-MoE's: ``PEFT_EXPERT_FAMILIES``): PEFT on transformers
5, whose experts are stacked 3-D parameters, targets them with ``target_parameters``: one adapter per expert over
the fused ``gate_up_proj`` of rank ``2 r`` (alpha ``2 alpha``) and one over ``down_proj`` of rank ``r``;
``gate_proj`` and ``up_proj`` must be targeted together. parallm does the same: per local expert ``fc1 A [2r, H]``
replicated over TP, ``fc1 B [2 I / tp, 2r]`` (rows ``[gate_r; up_r]``), ``fc2 A [r, I / tp]``, ``fc2 B [H, r]``
replicated, stacked over the rank's experts. As in PEFT, the MLP targets then adapt routed experts only (a MoE
model's dense layers and shared expert keep no adapter).
Gemma 4's routed experts (beside the dense MLP): PEFT's ``target_parameters``, rank ``r`` on each, named
``"experts.gate_up_proj"`` / ``"experts.down_proj"`` here (:mod:`.lora_gemma4`), in the same layout.

Gated DeltaNet (Qwen3.5, Qwen3.5-MoE / Qwen3.6, Qwen3-Next: :mod:`.lora_gdn`): one column adapter slot per HF input
projection inside the fused ``in_proj`` (B's rows as that projection's rows of the weight: ``in_proj_qkv``'s
``[q_r; k_r; v_r]``, ``in_proj_z`` / ``_b`` / ``_a``; Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``), ``out_proj``
row parallel.

``A`` starts as PEFT's (Kaiming-uniform, bound ``1 / sqrt(fan_in)``) from a generator seeded per HF module
(``LoraConfig.seed``), so every layout starts from the same full A; ``B`` starts at zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.megatron_import import import_megatron
from ...parallel.state import as_chunks
from .lora_plan import (ALL_LINEAR, HEAD, MLA_LINEAR, PEFT_EXPERT_FAMILIES, SUPPORTED_FAMILIES, V4_ADAPTED, KVRows,
                        LoraConfig, LoraEntry, LoraRow, Slot, _local_rows, global_entries, head_slot,
                        layer_slots, peft_modules)
from .lora_gdn import gdn_names
from .lora_gemma4 import GEMMA4_EXPERT_TARGETS, GEMMA4_FAMILIES
from .lora_layouts import Stacked
from .mla import ReplicatedLinear
from .v4_attention import SplitLinear
from .moe import Experts
from ..params import attach_main_grad_hooks
from ..placement import Placement, place
from ..table import chunk_entries

mtp = import_megatron().tensor_parallel

__all__ = ["ALL_LINEAR", "HEAD", "MLA_LINEAR", "PEFT_EXPERT_FAMILIES", "SUPPORTED_FAMILIES", "KVRows", "LoraConfig",
           "LoraEntry", "LoraRow", "Slot", "Stacked", "add_lora", "adapters_disabled", "chunk_lora_entries",
           "global_entries", "layer_slots", "lora_config_of", "lora_state_of", "set_adapter_rank"]


# -- the adapters ---------------------------------------------------------------------------------------------

class LoraState:
    """Shared by a model's adapters: whether they run (:func:`adapters_disabled` turns them off), and the bank
    (:func:`factors_banked`): while set, a mapping from a factor parameter to the tensor to use in its place."""

    def __init__(self):
        self.enabled = True
        self.bank: dict | None = None

    def factor(self, param: torch.Tensor) -> torch.Tensor:
        """``param``, or what the bank puts in its place."""
        bank = self.bank
        return param if bank is None else bank.get(param, param)


class Adapter(nn.Module):
    """The factors beside one parallel linear: ``lora_A[part]`` / ``lora_B[part]`` per adapted HF module (see the
    module docstring for the layouts); ``kind``: ``"column"`` (output ``[slot_0 rows; slot_1 rows; ...]`` as
    the fused weight's, ``layout`` the local rows of every slot of the weight, adapted or not), ``"row"`` or
    ``"replicated"`` (a linear duplicated on every TP rank: no communication, the rank's own tokens)."""

    def __init__(self, kind: str, slots: list[Slot], local_rows: list[tuple[str, int]], state: LoraState, dims,
                 sp: bool):
        super().__init__()
        self.kind, self.slots, self.local_rows, self.state = kind, slots, local_rows, state
        self.tp, self.tp_group, self.sp = dims.tp, dims.tp_group, sp
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()

    def factors(self, part: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` of one slot as the adapter runs them now (the bank's tensors while one is set)."""
        return self.state.factor(self.lora_A[part]), self.state.factor(self.lora_B[part])

    def forward(self, x):
        slots = self.slots
        a = self.factors(slots[0].part)[0] if len(slots) == 1 else \
            torch.cat([self.factors(s.part)[0] for s in slots])
        z = F.linear(x, a)
        if self.kind in ("replicated", "split"):       # split: B's rows this rank's, x already in the TP region
            s = slots[0]
            return F.linear(z, self.factors(s.part)[1]) * s.scaling
        if self.kind == "column":
            if self.sp:
                z = mtp.gather_from_sequence_parallel_region(z, True, group=self.tp_group)
            elif self.tp > 1:
                z = mtp.copy_to_tensor_model_parallel_region(z, group=self.tp_group)
            zs = dict(zip((s.part for s in slots), z.split([s.r for s in slots], dim=-1)))
            scale = {s.part: s.scaling for s in slots}
            outs = [F.linear(zs[part], self.factors(part)[1]) * scale[part] if part in zs
                    else z.new_zeros(z.shape[:-1] + (rows,)) for part, rows in self.local_rows]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.sp:
            z = mtp.reduce_scatter_to_sequence_parallel_region(z, group=self.tp_group)
        elif self.tp > 1:
            z = mtp.reduce_from_tensor_model_parallel_region(z, group=self.tp_group)
        s = slots[0]
        return F.linear(z, self.factors(s.part)[1]) * s.scaling

    def head_factors(self):
        """``(A, B, scaling)`` of the output head's adapter (one slot) while adapters are enabled, else None: what
        the log-prob head (:mod:`parallm.model.logprobs`) adds to its logits."""
        if not self.state.enabled:
            return None
        s = self.slots[0]
        return (*self.factors(s.part), s.scaling)

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


class LoraReplicatedLinear(ReplicatedLinear):
    """MLA's replicated down-projection with an :class:`Adapter` (``self.lora``, kind ``"replicated"``) added to
    its output."""

    def forward(self, x):
        out = super().forward(x)
        if self.lora.state.enabled:
            out = out + self.lora(x)
        return out


class LoraSplitLinear(SplitLinear):
    """DeepSeek-V4's q_b_proj (split by heads, its input already in the TP region) with an :class:`Adapter`
    (``self.lora``, kind ``"split"``: A replicated, its gradient a partial sum over TP; B split by rows)."""

    def forward(self, x):
        out = super().forward(x)
        if self.lora.state.enabled:
            out = out + self.lora(x)
        return out


class ExpertAdapter(nn.Module):
    """The routed experts' factors of one layer, stacked over the rank's experts: ``lora_A/B["gate_up_proj"]``
    (``[E_local, 2r, H]`` / ``[E_local, 2 I / tp, 2r]``; gpt-oss: rank ``r``, B's rows the interleaved gate / up
    columns of ``[H, 2 I]``) and ``lora_A/B["down_proj"]`` (``[E_local, r, I / tp]`` / ``[E_local, H, r]``).
    ``columns``: the experts hold their weights as ``[in, out]`` (gpt-oss), so a merged update is ``(B A)^T``."""

    def __init__(self, state: LoraState, *, columns: bool = False):
        super().__init__()
        self.state, self.columns = state, columns
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


def expert_lora_delta(x, a, b, counts, offsets, grouped: bool):
    """``B_e (A_e x)`` per expert of rows grouped by expert (a ``[E, r, in]``, b ``[E, out, r]``). On the grouped
    GEMM the rank is zero-padded to a multiple of 16 bytes first (``r = 4`` in bf16 becomes 8): torch._grouped_mm
    needs 16-byte aligned rows, and the zero rows of A / columns of B add exactly nothing, so any rank keeps the
    grouped kernel instead of a loop over the experts. Falls back to the loop only when ``in`` / ``out`` are
    themselves unaligned."""
    if grouped:
        pad = (-a.shape[-2]) % (16 // a.element_size())
        if pad:
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        grouped = _aligned(a, b)
    return _gmm(_gmm(x, a, counts, offsets, grouped), b, counts, offsets, grouped)


class LoraExperts(Experts):
    """The routed experts with their per-expert adapters (``self.lora``, an :class:`ExpertAdapter`): ``fc1`` and
    ``fc2`` each ``W x + B (A x) * scaling`` per expert (biases and activation as the experts' own). The adapters'
    partial sums over TP (A of fc1 sees this rank's fc1 rows only; B of fc2 this rank's fc2 columns) ride on the
    experts' own TP reduction; their gradients are partial sums (``tp_sum``)."""

    def project(self, x, part, groups):
        y = super().project(x, part, groups)
        ad = self.lora
        if not ad.state.enabled or part not in ad.lora_A:
            return y
        counts, offsets, _ = groups
        delta = expert_lora_delta(x, ad.state.factor(ad.lora_A[part]), ad.state.factor(ad.lora_B[part]), counts,
                                  offsets, offsets is not None)
        return y + delta * ad.slots[part].scaling


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
    head_slot(spec, chunks[0].task, config, padded_vocab=chunks[0].padded_vocab_size, sp=False)  # raises alike
    state = LoraState()
    found = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        found += _add_to_chunk(chunk, config, state)
    if found == 0 and _targets_nothing(spec, chunks[0], config):
        raise ValueError(f"LoRA target_modules {config.target_modules!r} match no module of this "
                         f"{spec.architecture} (adaptable: "
                         f"{', '.join(_adaptable(spec) + (HEAD,))})")
    for chunk in chunks:
        chunk.lora_config, chunk.lora_state = config, state
        chunk._parallm_norm_plan = None
    attach_main_grad_hooks(chunks)
    return chunks


def _adaptable(spec) -> tuple[str, ...]:
    if spec.v4 is not None:
        return tuple(V4_ADAPTED) + ("gate_proj", "up_proj", "down_proj")
    if spec.family in GEMMA4_FAMILIES and spec.moe is not None:
        return ALL_LINEAR + GEMMA4_EXPERT_TARGETS
    return ALL_LINEAR + (MLA_LINEAR if spec.mla is not None else ()) + gdn_names(spec)


def _targets_nothing(spec, chunk, config) -> bool:
    return not global_entries(spec, chunk.table, chunk.task, chunk.dims, config, padded_vocab=chunk.padded_vocab_size)


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
        device = module.weight.device
        if kind in ("column", "row", "replicated", "split"):
            local_rows = None
            if kind == "column":
                local_rows = [(p, n) for (_, p), n in zip(peft_modules(spec, entry), _local_rows(spec, entry, tp,
                                                                                                  rank))]
            _attach(chunk, module, kind, slots, local_rows, state, config, device)
        else:
            experts_module = chunk.get_submodule(entry.local.rsplit(".", 2)[0])
            if not isinstance(experts_module, LoraExperts):
                experts_module.__class__ = LoraExperts
                experts_module.lora = ExpertAdapter(state, columns=experts_module.columns)
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
    s = head_slot(spec, chunk.task, config, padded_vocab=chunk.padded_vocab_size, sp=sp) if chunk.post_process \
        else None
    if s is not None:       # the output head (tied at pp = 1: output_layer holds no weight; the embedding's device)
        _attach(chunk, chunk.output_layer, "column", [s], [(HEAD, chunk.padded_vocab_size // tp)], state, config,
                chunk.head_weight().device)
        added += 1
    return added


def _attach(chunk, module, kind, slots, local_rows, state, config, device) -> None:
    """Give the dense linear ``module`` an :class:`Adapter` of ``kind`` with ``slots``' factors (A as PEFT
    initialises it, B zero), each placed by its layout."""
    dims, sp, tp, rank = chunk.dims, chunk.sequence_parallel, chunk.dims.tp, chunk.dims.tp_rank
    dtype = chunk.config.params_dtype
    module.__class__ = {"column": LoraColumnParallelLinear, "row": LoraRowParallelLinear,
                        "replicated": LoraReplicatedLinear, "split": LoraSplitLinear}[kind]
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
                                      layers=chunk.layer_range, head=chunk.post_process,
                                      padded_vocab=chunk.padded_vocab_size):
            out.append((e, chunk))
    return out


# -- ways of using the adapters -------------------------------------------------------------------------------

def set_adapter_rank(chunks, rank: int | None) -> None:
    """Run the model's rank-``R`` adapters (``R``: its LoraConfig's ``r``) as rank-``rank`` ones: every slot's
    scaling becomes PEFT's for the same adapter at rank ``rank``: ``alpha_s / r_s`` with ``r_s = R_s rank / R``
    (``R_s`` / ``alpha_s`` the slot's rank and alpha after the config's patterns; a routed expert's fused gate/up,
    ``2 R`` with ``2 alpha``, becomes ``2 rank``: ``alpha / rank``). The factors are not touched: the caller keeps
    A's rows and B's columns beyond ``r_s`` zero, which then add exactly nothing and get exactly zero gradients
    (the gradient of B's column j is ``g (A x)_j = 0``, of A's row j ``B[:, j]^T g x^T = 0``). ``None`` or ``R``
    restores the configured scaling. Not collective (every rank must call it alike); used by a server whose
    clients choose their rank (integrations/tinker)."""
    chunks = as_chunks(chunks)
    config = lora_config_of(chunks)
    if config is None:
        raise ValueError("set_adapter_rank: the model has no LoRA adapters")
    big = config.r
    rank = big if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= big:
        raise ValueError(f"set_adapter_rank: rank {rank!r} must be an int in [1, {big}] (the adapters' rank)")
    plan = []                   # every adapter's new slots, computed before any is replaced (an error changes none)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (Adapter, ExpertAdapter)):
                if not hasattr(module, "configured_slots"):      # the slots as built: what rank R restores
                    module.configured_slots = module.slots
                plan.append((module, _slots_at_rank(module, config, rank)))
    for module, slots in plan:
        module.slots = slots            # a new list / dict: the built one is never changed


def _slots_at_rank(module, config, rank: int):
    """``module``'s configured slots with the scaling of rank ``rank`` (see :func:`set_adapter_rank`)."""
    big, base = config.r, module.configured_slots
    if rank == big:
        return base

    def one(s):
        if isinstance(module, ExpertAdapter):
            return dataclasses.replace(s, scaling=float(config.alpha) / rank)
        r_s, alpha_s = config.rank_alpha(s.module)
        if (r_s * rank) % big:
            raise ValueError(f"set_adapter_rank: {s.module} has rank {r_s} (rank_pattern); rank {rank} of {big} "
                             "does not divide it")
        return dataclasses.replace(s, scaling=alpha_s / (r_s * rank // big))
    if isinstance(base, dict):
        return {k: one(s) for k, s in base.items()}
    return [one(s) for s in base]


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
