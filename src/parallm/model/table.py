"""Declarative weight tables: which shard parameter comes from which HF tensors, and how.

A family's table is a tuple of :class:`Row`. A row names the chunk-local parameter (``{l}`` = local layer index
inside the chunk), its HF source names (``{i}`` = global layer index), the layout transform (``kind``), the stage
that owns it, and conditions on the spec / task / pipeline under which it exists. Loader, saver and the coverage
tests all read the same table; tied embeddings and value heads *filter* rows, nothing mutates a table.

Layout kinds (see :mod:`parallm.model.sharding`; the decoder attaches each row's placement to its parameter,
see :mod:`parallm.model.placement`):
    copy     replicated on every TP rank
    vocab    split along dim 0 over TP after padding the vocabulary with zero rows
    column   split along dim 0 (column-parallel output)
    row      split along dim 1 (row-parallel input)
    qkv      three HF tensors (q, k, v) fused per rank as [q_r; k_r; v_r] (KV heads replicated when nkv < tp)
    qkv_global  the same for a layer of spec.global_layers (global_head_dim, global_kv_heads: Gemma 4)
    qk_global   K = V on those layers (spec.global_k_eq_v): two HF tensors (q, k) fused per rank as [q_r; k_r]
    gate_up  two HF tensors (gate, up) fused per rank as [gate_r; up_r]
    gate_up_rows  one HF tensor [gate; up] (Gemma 4's stacked experts' slab) split per rank as [gate_r; up_r]
    gdn_conv a Gated DeltaNet's [q; k; v] channels (in one HF tensor) split by heads, per rank [q_r; k_r; v_r]
    gdn_in   a Gated DeltaNet's input projections fused per rank (Qwen3.5 [q_r; k_r; v_r; z_r; b_r; a_r],
             Qwen3-Next [qkvz_r; ba_r])
    mamba_in   a Mamba-2 in_proj's [z; x; B; C; dt] rows, per rank [z_r; x_r; B_r; C_r; dt_r] (heads, groups)
    mamba_conv a Mamba-2 conv's [x; B; C] channels, per rank [x_r; B_r; C_r]
    kv_heads   rows of the KV heads split as the fused QKV's k rows (replicated when nkv < tp): MiniMax-M2's k_norm

Mixture of experts: a row with ``per_expert=True`` is a template for every expert of a layer (``{e}`` in its HF
names = global expert index). Its local name is one parameter that stacks the experts a rank holds along dim 0
(``[E_local, ...]``, see :class:`parallm.model.sharding.ExpertStack`). :func:`select_rows` expands the template
into one row per expert (``expert`` set, HF names filled in), so every (row, layer) pair still names the HF
tensors of one expert, in the Hub's per-expert format; :func:`chunk_entries` keeps the experts a rank owns and
gives each entry its ``index``: the expert's place along dim 0 of the stacked parameter (:func:`entry_view`
returns that slab and its per-expert layout). Layer conditions (``moe_layer`` / ``dense_layer``) pick the rows
of each layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from .placement import placement_of
from .spec import DecoderSpec

KINDS = ("copy", "vocab", "column", "row", "qkv", "qkv_global", "qk_global", "gate_up", "gate_up_rows", "gdn_conv",
         "gdn_in", "mamba_in", "mamba_conv",
         "kv_heads")
# "mtp": a multi-token-prediction layer's own tensors ({l}: its index j among them, {i}: its HF layer index
# num_layers + j), held by the chunk with post_process; the decoder layer inside it takes the "layer" rows
STAGES = ("first", "layer", "last", "mtp")
MTP_MODULE = "mtp_layers"       # the last chunk's module of carried MTP layers: mtp_layers.{j}.layer.* etc.
# the last chunk's module of spec.carried_mtp (carried_mtp.{c}: one parameter per listed tensor); the first
# chunk's spec.carried are "carried.{c}"
CARRIED_MTP_MODULE = "carried_mtp"
TP_SUM = ("never", "sp", "always")

# Conditions a row may require (all must hold).
CONDITIONS = {
    "qkv_bias": lambda spec, task, pp: spec.qkv_bias,
    "o_bias": lambda spec, task, pp: spec.o_bias,
    "mlp_bias": lambda spec, task, pp: spec.mlp_bias,
    "qk_norm": lambda spec, task, pp: spec.qk_norm,
    "qk_norm_whole": lambda spec, task, pp: spec.qk_norm_whole,
    "causal_lm": lambda spec, task, pp: task == "causal_lm",
    "value": lambda spec, task, pp: task == "value",
    "untied": lambda spec, task, pp: not spec.tie_word_embeddings,
    # tied and the head lives on another stage than the embedding: the last stage keeps a copy
    "tied_copy": lambda spec, task, pp: spec.tie_word_embeddings and pp > 1,
    "shared_expert": lambda spec, task, pp: spec.moe is not None and spec.moe.shared_expert_intermediate_size > 0,
    "shared_expert_gate": lambda spec, task, pp: spec.moe is not None and spec.moe.shared_expert_gate,
    # the sigmoid group-limited router's fp32 selection bias (e_score_correction_bias: DeepSeek-V3, GLM-4.5)
    "score_bias": lambda spec, task, pp: spec.moe is not None and spec.moe.score_bias,
    # gpt-oss: the router's trained bias, the experts' biases, the attention sinks
    "router_bias": lambda spec, task, pp: spec.moe is not None and spec.moe.router_bias,
    "expert_bias": lambda spec, task, pp: spec.moe is not None and spec.moe.expert_bias,
    "attn_sinks": lambda spec, task, pp: spec.attn_sinks,
    "layer_scalar": lambda spec, task, pp: spec.layer_scalar,
    # Gemma 4's K = V on its global layers (no v projection there) or not
    "k_eq_v": lambda spec, task, pp: spec.global_k_eq_v,
    "not_k_eq_v": lambda spec, task, pp: not spec.global_k_eq_v,
    # Gemma 4's per-layer input embeddings (model/layers/per_layer_inputs.py)
    "per_layer_inputs": lambda spec, task, pp: spec.per_layer_input_size > 0,
    # multi-head latent attention (DeepSeek-V3): with / without a q LoRA, the down-projections' bias
    "q_lora": lambda spec, task, pp: spec.mla is not None and spec.mla.q_lora_rank is not None,
    "no_q_lora": lambda spec, task, pp: spec.mla is not None and spec.mla.q_lora_rank is None,
    "down_bias": lambda spec, task, pp: spec.mla is not None and spec.mla.down_proj_bias,
    # the model carries tensors it never runs (spec.carried: a vision tower; spec.carried_mtp: MTP tensors)
    "carried": lambda spec, task, pp: bool(spec.carried),
    "carried_mtp": lambda spec, task, pp: bool(spec.carried_mtp),
    # the model carries multi-token-prediction layers (build_model(mtp=...))
    "mtp": lambda spec, task, pp: spec.carried_mtp_layers > 0,
    # Mamba-2 layers (Nemotron-H): in_proj / out_proj biases, the conv's bias; the MoE's latent projections
    "mamba_proj_bias": lambda spec, task, pp: spec.mamba is not None and spec.mamba.proj_bias,
    "mamba_conv_bias": lambda spec, task, pp: spec.mamba is not None and spec.mamba.conv_bias,
    "moe_latent": lambda spec, task, pp: spec.moe is not None and bool(spec.moe.latent_size),
}

# Conditions on the global layer index (all must hold for the row to exist in that layer).
LAYER_CONDITIONS = {
    "moe_layer": lambda spec, layer: spec.is_moe_layer(layer),
    "dense_layer": lambda spec, layer: not spec.is_moe_layer(layer),
    # DeepSeek-V4: MoE layers whose experts come from the token ids (tid2eid), and the top-k ones (correction bias)
    "hash_layer": lambda spec, layer: spec.is_moe_layer(layer) and spec.moe.is_hash_layer(layer),
    "topk_layer": lambda spec, layer: spec.is_moe_layer(layer) and not spec.moe.is_hash_layer(layer),
    # hybrid models (Qwen3-Next, Qwen3.5): Gated DeltaNet layers and the attention layers between them
    "linear_layer": lambda spec, layer: spec.is_linear_layer(layer),
    "attention_layer": lambda spec, layer: not spec.is_linear_layer(layer),
    # DeepSeek Sparse Attention: a layer with an indexer of its own (not one of GLM-5's shared layers)
    "indexer_layer": lambda spec, layer: spec.has_indexer(layer),
    # one block per layer (Nemotron-H): the layer's one block
    "mamba_block": lambda spec, layer: spec.block_kind(layer) == "mamba",
    "attention_block": lambda spec, layer: spec.block_kind(layer) == "attention",
    "mlp_block": lambda spec, layer: spec.block_kind(layer) == "mlp",
    # DeepSeek-V4's attention kinds (spec.v4.layer_kinds): compressed (csa or hca), csa (with an indexer), hca
    "v4_compressed": lambda spec, layer: spec.v4 is not None and spec.v4.kind(layer) in ("csa", "hca"),
    "v4_csa": lambda spec, layer: spec.v4 is not None and spec.v4.kind(layer) == "csa",
    "v4_hca": lambda spec, layer: spec.v4 is not None and spec.v4.kind(layer) == "hca",
    # Gemma 4: the full-attention layers with their own head shape (spec.global_layers) and the others
    "global_attn": lambda spec, layer: spec.is_global_layer(layer),
    "local_attn": lambda spec, layer: not spec.is_global_layer(layer),
    # Gemma 4's KV sharing: the layers reusing an earlier layer's keys / values (q_proj only), the others; and the
    # doubled MLP of the sharing layers (double_wide_mlp)
    "kv_shared_layer": lambda spec, layer: spec.is_kv_shared(layer),
    "kv_layer": lambda spec, layer: not spec.is_kv_shared(layer),
    "wide_mlp": lambda spec, layer: spec.mlp_width(layer) != spec.intermediate_size,
    "plain_mlp": lambda spec, layer: spec.mlp_width(layer) == spec.intermediate_size,
}


@dataclass(frozen=True)
class Row:
    local: str                      # parameter name inside a DecoderChunk
    hf: tuple[str, ...]             # HF source names
    kind: str
    stage: str
    shapes: tuple[tuple, ...] = ()  # full HF shape per source: ints or DecoderSpec attribute names
    when: tuple[str, ...] = ()      # CONDITIONS that must all hold
    save: bool = True               # False: loaded but not written back (e.g. the tied head copy)
    tp_sum: str = "never"           # gradient is a partial sum over TP: "never", "sp" (under sequence
                                    # parallelism: fed 1/tp of the tokens), "always" (per-head q/k norms)
    tied: str | None = None         # tied embeddings across stages: "embedding" (first stage) / "copy" (head)
    per_expert: bool = False        # a template expanded per expert by select_rows ({e} in the HF names; the
                                    # local name is the stacked parameter of the rank's experts)
    expert: int | None = None       # the global expert index of an expanded per-expert row
    fused: tuple[str, ...] = ()     # the names in a checkpoint that stores experts fused (FusedPart)
    trained: bool = True            # False: a parameter without gradient (requires_grad=False: the router's
                                    # selection bias, updated by a rule, never by the optimizer)
    save_fused: bool = False        # a per-expert row whose checkpoint format is the stacked tensor fused[0]
    #                                 ([E, *shape], gpt-oss): loads read expert e's slab of it, the dict and
    #                                 directory saves write every expert stacked into it; the per-expert names
    #                                 (hf) are what the export stream and training checkpoints use
    integer: bool = False           # an int64 tensor (DeepSeek-V4's tid2eid): held, loaded, saved and exported
    #                                 as int64 bit for bit, never cast (row_dtype); needs trained=False
    keep_fp32: bool = False         # held, saved and exported in fp32 whatever the model's / requested dtype
    #                                 (DeepSeek's router and selection bias, Gated DeltaNet's A_log)
                                    # (the sigmoid router's weight and bias: transformers'
                                    # _keep_in_fp32_modules_strict; a bf16 bias changes which experts win)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.stage not in STAGES:
            raise ValueError(f"unknown stage {self.stage!r}")
        if len(self.shapes) != len(self.hf):
            raise ValueError(f"row {self.local}: {len(self.hf)} sources but {len(self.shapes)} shapes")
        if self.tp_sum not in TP_SUM:
            raise ValueError(f"row {self.local}: tp_sum must be one of {TP_SUM}, got {self.tp_sum!r}")
        if self.tied not in (None, "embedding", "copy"):
            raise ValueError(f"row {self.local}: tied must be None, 'embedding' or 'copy', got {self.tied!r}")
        for c in self.when:
            if c not in CONDITIONS and c not in LAYER_CONDITIONS:
                raise ValueError(f"unknown condition {c!r}")
        if self.stage == "mtp" and "mtp" not in self.when:
            raise ValueError(f"row {self.local}: an mtp-stage row needs the condition 'mtp'")
        if self.per_expert and self.stage != "layer":
            raise ValueError(f"row {self.local}: per-expert rows are layer rows")
        if self.integer and (self.trained or self.keep_fp32):
            raise ValueError(f"row {self.local}: an integer row is a frozen tensor (trained=False, not keep_fp32)")
        if self.save_fused and not (self.per_expert or self.expert is not None) or self.save_fused and not self.fused:
            raise ValueError(f"row {self.local}: save_fused is for per-expert rows with a fused (stacked) name")
        if self.fused and (self.stage != "layer" or len(self.fused) != (1 if self.per_expert or self.expert is not None
                                                                        else len(self.hf))):
            raise ValueError(f"row {self.local}: fused names are one per source of a layer row, or one stacked "
                             f"tensor for a per-expert row; got {self.fused}")

    def applies(self, spec: DecoderSpec, task: str, pp: int) -> bool:
        return all(CONDITIONS[c](spec, task, pp) for c in self.when if c in CONDITIONS)

    def applies_to_layer(self, spec: DecoderSpec, layer: int) -> bool:
        return all(LAYER_CONDITIONS[c](spec, layer) for c in self.when if c in LAYER_CONDITIONS)


@dataclass(frozen=True)
class Entry:
    """A row made concrete for one parameter (layer indices filled in)."""
    row: Row
    local: str                      # parameter name inside its chunk
    hf: tuple[str, ...]
    layer: int | None               # global layer index, None for non-layer rows
    index: int | None = None        # a routed expert's place along dim 0 of its stacked parameter

    @property
    def kind(self) -> str:
        return self.row.kind

    @property
    def expert(self) -> int | None:
        """Global expert index of an expert's tensor, None for everything else."""
        return self.row.expert


def _expand_experts(row: Row, num_experts: int) -> list[Row]:
    """One row per expert: HF names with ``{e}`` filled in (``{i}`` left for the layer), ``expert`` set."""
    return [replace(row, per_expert=False, expert=e,
                    hf=tuple(h.replace("{e}", str(e)) for h in row.hf)) for e in range(num_experts)]


def select_rows(table, spec: DecoderSpec, task: str, pp: int) -> list[Row]:
    """The rows that apply to this model, per-expert templates expanded (experts in order, each template's
    experts where the template stands)."""
    out = []
    for r in table:
        if not r.applies(spec, task, pp):
            continue
        if "{c}" in r.local:        # a template for every carried tensor (spec.carried / carried_mtp), in order
            carried = spec.carried_mtp if r.local.startswith(CARRIED_MTP_MODULE + ".") else spec.carried
            out.extend(replace(r, local=r.local.replace("{c}", str(j)), hf=(name,), shapes=(tuple(shape),))
                       for j, (name, shape) in enumerate(carried))
        elif r.per_expert:
            if spec.moe is not None:
                out.extend(_expand_experts(r, spec.moe.num_experts))
        else:
            out.append(r)
    return out


def chunk_entries(table, spec: DecoderSpec, *, task: str, pp: int, pre_process: bool, post_process: bool,
                  layers, experts: range | None = None) -> list[Entry]:
    """Entries owned by one chunk, in table order (layer rows for every layer of the chunk, in order), then, on
    the chunk with ``post_process``, those of the carried multi-token-prediction layers (``spec.
    carried_mtp_layers``): for layer ``j`` (HF index ``num_layers + j``) the layer rows under
    ``mtp_layers.{j}.layer.`` and the ``mtp`` rows. ``experts``: the global expert indices this rank holds (its
    expert-parallel share); None: every expert."""
    out = []
    rows = select_rows(table, spec, task, pp)
    for row in rows:
        if row.stage == "first" and pre_process or row.stage == "last" and post_process:
            out.append(Entry(row, row.local, row.hf, None))
    layer_rows = [r for r in rows if r.stage == "layer"
                  and (r.expert is None or experts is None or r.expert in experts)]
    first_expert = 0 if experts is None else experts.start
    for local_idx, global_idx in enumerate(layers):
        for row in layer_rows:
            if not row.applies_to_layer(spec, global_idx):
                continue
            index = None if row.expert is None else row.expert - first_expert
            out.append(Entry(row, row.local.format(l=local_idx), tuple(h.format(i=global_idx) for h in row.hf),
                             global_idx, index))
    if post_process:
        mtp_rows = [r for r in rows if r.stage == "mtp"]
        for j in range(spec.carried_mtp_layers):
            global_idx = spec.num_layers + j
            for row in layer_rows:
                if not row.applies_to_layer(spec, global_idx):
                    continue
                index = None if row.expert is None else row.expert - first_expert
                local = f"{MTP_MODULE}.{j}.layer." + row.local.removeprefix("layers.{l}.")
                out.append(Entry(row, local, tuple(h.format(i=global_idx) for h in row.hf), global_idx, index))
            for row in mtp_rows:
                out.append(Entry(row, row.local.format(l=j), tuple(h.format(i=global_idx) for h in row.hf),
                                 global_idx))
    return out


def is_trained(entry: Entry) -> bool:
    """Whether the optimizer trains the parameter of ``entry``: not for a row marked ``trained=False`` (the
    selection bias), nor for anything of a carried multi-token-prediction layer (held, never run)."""
    return entry.row.trained and not entry.local.startswith(MTP_MODULE + ".")


def all_entries(table, spec: DecoderSpec, *, task: str, pp: int) -> list[Entry]:
    """Every entry of the whole model (as if one chunk held everything, every expert included)."""
    return chunk_entries(table, spec, task=task, pp=pp, pre_process=True, post_process=True,
                         layers=range(spec.num_layers))


@dataclass(frozen=True)
class FusedPart:
    """Where an HF tensor lies in a checkpoint that stores a layer's experts fused, as transformers 5 holds them in
    memory (``mlp.experts.gate_up_proj [E, 2 I, H]`` = every expert's ``[gate; up]``, ``mlp.experts.down_proj
    [E, H, I]``, Mixtral's ``block_sparse_moe.`` renamed ``mlp.``): rows block ``part`` of ``parts`` equal blocks
    of ``name[expert]``; ``expert`` None: the whole tensor ``name`` (a rename)."""
    name: str
    expert: int | None = None
    part: int = 0
    parts: int = 1


def fused_layout(table, spec: DecoderSpec, *, task: str, pp: int) -> dict[str, FusedPart]:
    """HF name -> its :class:`FusedPart`, for every tensor whose row declares ``fused`` names (``{i}`` = layer)."""
    out = {}
    for e in all_entries(table, spec, task=task, pp=pp):
        if not e.row.fused:
            continue
        if e.expert is None:
            for name, alt in zip(e.hf, e.row.fused):
                out[name] = FusedPart(alt.format(i=e.layer))
        else:
            stacked = e.row.fused[0].format(i=e.layer)
            for k, name in enumerate(e.hf):
                out[name] = FusedPart(stacked, e.expert, k, len(e.hf))
    return out


def stacked_saves(everything) -> dict[str, tuple[str, int]]:
    """Per-expert HF name -> ``(the stacked tensor it is saved into, its expert index)`` for the entries of
    ``save_fused`` rows (gpt-oss: ``mlp.experts.{e}.gate_up_proj`` is slab ``e`` of ``mlp.experts.gate_up_proj``):
    what the dict and directory saves write instead of the per-expert names. ``everything``: a model's entry list
    (:func:`all_entries`)."""
    out = {}
    for e in everything:
        if e.row.save_fused and e.expert is not None:
            for name in e.hf:
                out[name] = (e.row.fused[0].format(i=e.layer), e.expert)
    return out


def stack_experts(state: dict, stacked: dict[str, tuple[str, int]]) -> dict:
    """``state`` (HF name -> tensor) with the per-expert tensors of :func:`stacked_saves` replaced by their stacked
    tensors ``[E, ...]`` (experts in order, each at the place of its expert 0's tensor in the dict's order); a
    missing expert is a RuntimeError naming it."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, (fused, e) in stacked.items():
        groups.setdefault(fused, {})[e] = name
    out = {}
    for name, tensor in state.items():
        if name not in stacked:
            out[name] = tensor
            continue
        fused, e = stacked[name]
        if fused in out:
            continue
        names = groups[fused]
        lost = [names[k] for k in sorted(names) if names[k] not in state]
        if lost or sorted(names) != list(range(len(names))):
            raise RuntimeError(f"internal error: {fused} cannot be stacked: {lost[:3]} missing")
        out[fused] = torch.stack([state[names[k]] for k in range(len(names))])
    return out


def row_dtype(row: Row, dtype: torch.dtype) -> torch.dtype:
    """The dtype a row's tensors are held, loaded, saved and exported in when the model's (or the requested) dtype
    is ``dtype``: int64 for an ``integer`` row, float32 for a ``keep_fp32`` row, else ``dtype``."""
    if row.integer:
        return torch.int64
    return torch.float32 if row.keep_fp32 else dtype


def _spec_value(term: str, spec: DecoderSpec) -> int:
    if term.isdigit():
        return int(term)
    value = spec
    for part in term.split("."):
        value = getattr(value, part)
    return int(value)


def resolve_dim(dim, spec: DecoderSpec) -> int:
    """One declared dimension as a number: an int, a DecoderSpec attribute name (dotted: ``"v4.q_lora_rank"``), or
    a product / exact quotient of those and integer literals (``"2*head_dim"``, ``"q_size/v4.o_groups"``, left
    to right)."""
    if isinstance(dim, int):
        return dim
    tokens = re.split(r"([*/])", dim.replace(" ", ""))
    value = _spec_value(tokens[0], spec)
    for op, term in zip(tokens[1::2], tokens[2::2]):
        n = _spec_value(term, spec)
        if op == "/" and value % n:
            raise ValueError(f"shape {dim!r}: {value} is not divisible by {n}")
        value = value * n if op == "*" else value // n
    return value


def resolve_shape(shape, spec: DecoderSpec) -> tuple[int, ...]:
    """A row's declared shape (ints, DecoderSpec attribute names or products of them: :func:`resolve_dim`) as
    numbers."""
    return tuple(resolve_dim(d, spec) for d in shape)


def expected_hf_shapes(table, spec: DecoderSpec, *, task: str, pp: int) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every tensor the model reads, from the rows' declared shapes."""
    out = {}
    for e in all_entries(table, spec, task=task, pp=pp):
        for name, shape in zip(e.hf, e.row.shapes):
            out[name] = resolve_shape(shape, spec)
    return out


def integer_hf_names(table, spec: DecoderSpec, *, task: str, pp: int) -> frozenset:
    """The HF names of the model's ``integer`` rows (int64 in the checkpoint, never weights to cast)."""
    return frozenset(name for e in all_entries(table, spec, task=task, pp=pp) if e.row.integer for name in e.hf)


def model_entries(chunks, layout):
    """(entry, chunk) pairs owned by this rank (of a MoE layer's experts, only those of its expert-parallel
    rank), plus the whole model's entry list (global order, every expert). ``layout``: the chunks'
    :class:`parallm.parallel.state.ParallelDims`; the table is the one the chunks were built from."""
    spec, task = chunks[0].spec, chunks[0].task
    table = chunks[0].table
    experts = layout.expert_range(spec.moe.num_experts) if spec.moe is not None else None
    mine = []
    for chunk in chunks:
        for e in chunk_entries(table, spec, task=task, pp=layout.pp, pre_process=chunk.pre_process,
                               post_process=chunk.post_process, layers=chunk.layer_range, experts=experts):
            mine.append((e, chunk))
    return mine, all_entries(table, spec, task=task, pp=layout.pp)


def entry_view(chunk, entry: Entry):
    """``(tensor, layout)`` of what ``entry`` names in ``chunk``: its parameter and the parameter's TP layout, or,
    for a routed expert, the expert's slab ``param[entry.index]`` of the stacked parameter (a view of the
    parameter's storage, without autograd history: writing it writes the parameter) and the per-expert layout
    of that slab. Loaders, savers and the export stream move one entry at a time through this view."""
    param = chunk.get_parameter(entry.local)
    layout = placement_of(param).layout
    if entry.index is None:
        return param, layout
    return param.detach()[entry.index], layout.inner


def entry_tensor(chunk, entry: Entry):
    """The tensor of :func:`entry_view` alone."""
    return entry_view(chunk, entry)[0]


def held_params(mine, everything) -> tuple[list[int], dict]:
    """Which of the model's entries (indices into ``everything``) this rank holds, as the 0/1 row every rank
    contributes to an exchange, and their tensors by index (:func:`entry_tensor`: a routed expert's slab of its
    stacked parameter)."""
    order = {(e.row, e.layer): i for i, e in enumerate(everything)}
    holds, params = [0] * len(everything), {}
    for e, chunk in mine:
        holds[order[(e.row, e.layer)]] = 1
        params[order[(e.row, e.layer)]] = entry_tensor(chunk, e)
    return holds, params
