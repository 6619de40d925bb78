"""The plan of a model's LoRA adapters, pure (no modules, no process groups): the config
(:class:`LoraConfig`), which factors each table entry's linear gets (:func:`layer_slots`: HF module, shapes, rank,
scaling, TP layouts; the layouts no weight has: :mod:`.lora_layouts`), and every factor of the model
as a weight-table-like entry (:func:`global_entries`) for checkpoints and the PEFT files. The adapters themselves:
:mod:`parallm.model.layers.lora`."""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass, field

from ..sharding import PartsSplit, Replicated, Split, TPLayout, VocabSplit, kv_heads_of_rank
from ..spec import padded_vocab_size
from ..table import chunk_entries, resolve_shape
from .lora_gdn import GDN_ADAPTED, HYBRID_FAMILIES, check_hybrid_targets, check_shared_gate_targets, gdn_slots
from .lora_gemma4 import GEMMA4_FAMILIES, check_gemma4_targets, gemma4_expert_hit
from .lora_layouts import KVRows

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# multi-head latent attention's own projections (transformers' DeepseekV3Attention; q_proj and o_proj are above)
MLA_LINEAR = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# PEFT's name of the output head. Not part of "all-linear" (PEFT's "all-linear" leaves the output layer out): name
# it, alone or beside "all-linear" in a tuple (("all-linear", "lm_head")). Its adapter: head_slot
HEAD = "lm_head"
# families whose layers parallm can adapt (plain GQA or multi-head latent attention; experts as transformers 5
# stacks them)
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3",
                      "gpt_oss", "deepseek_v32", "glm_moe_dsa", "nemotron_h", "minimax_m2", "kimi_k25",
                      "deepseek_v4", "gemma4", "gemma4_vl") + HYBRID_FAMILIES
# (the hybrid Gated DeltaNet families Qwen3.5, Qwen3.5-MoE / Qwen3.6, Qwen3-Next, and the language model of the
# Qwen3.5 / Qwen3.6 vision-language wrappers qwen3_5_vl / qwen3_5_moe_vl: see lora_gdn)
# (gemma4_vl, the wrapper: its language model only; a saved adapter excludes the towers, GEMMA4_VL_PEFT_EXCLUDE)
# Mamba-2's input projection (Nemotron-H): adapted like a column-parallel linear whose rows are the in_proj's
# [z; x; B; C; dt] parts, B's rows split over TP as the weight's (PEFT refuses out_proj / conv1d on Mamba models)
MAMBA_LINEAR = ("in_proj",)
# DeepSeek-V4's attention projections (transformers' DeepseekV4Attention, PEFT's names: q_a_proj / q_b_proj are
# above) -> the kind of their adapter. o_a_proj (a DeepseekV4GroupedLinear, an nn.Linear subclass whose forward
# is block-diagonal) is no target: PEFT 0.21 wraps it as a plain Linear and its forward fails ("The size of tensor
# a (o_lora_rank) must match the size of tensor b (o_groups * o_lora_rank)"), so "all-linear" leaves it and naming
# it is refused. The compressor's and the indexer's projections are never adapted (see v4_slots)
V4_LINEAR = ("kv_proj", "o_b_proj")
V4_ADAPTED = {"q_a_proj": "replicated", "kv_proj": "replicated", "q_b_proj": "split", "o_b_proj": "row"}
V4_REFUSED = "o_a_proj"
# what a saved V4 adapter_config.json excludes, so that PEFT (whose "all-linear" and leaf names reach the
# compressor's and indexer's kv_proj / gate_proj / q_b_proj / weights_proj too) adapts exactly what parallm did
V4_PEFT_EXCLUDE = r".*\.self_attn\.(compressor|o_a_proj)(\..*)?"
# MoE families whose MLP target names PEFT 0.21 retargets to the stacked routed experts on transformers 5
# (peft.utils.transformers_weight_conversion: a conversion pattern for the model type; deepseek_v3 shares
# qwen2_moe's pattern in transformers' table, as qwen3_moe does). Their dense MLPs and shared experts then get no
# adapter. Qwen2-MoE has no pattern there: PEFT adapts its nn.Linear MLPs (dense layers, shared expert) and not its
# routed experts, and so does parallm.
PEFT_EXPERT_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "minimax_m2",
                        "qwen3_next")
# (Qwen3-Next: transformers maps qwen3_next to qwen2_moe's pattern. Qwen3.5-MoE / Qwen3.6 is not among them:
# qwen3_5_moe_text maps to qwen3_5_text's, which has no expert pattern in PEFT 0.21, so PEFT adapts its shared
# expert's nn.Linear MLP and leaves the routed experts, as Qwen2-MoE; see lora_gdn)
# (MiniMax-M2: transformers maps minimax_m2 to mixtral's pattern, w1 / w3 / w2 -> gate_up_proj / down_proj)
# (Kimi-K2.5 / K2.6 is not among them: PEFT 0.21 has no pattern for the kimi_k25 wrapper, so on its language model
# it adapts the dense layers' and the shared experts' nn.Linear MLPs and leaves the INT4 routed experts alone, as
# Qwen2-MoE; so does parallm)
# (DeepSeek-V3.2 and GLM-5 too: transformers maps both to qwen2_moe's pattern, as deepseek_v3. Their indexer is
# never adapted: frozen, run without gradient; its wq_b / wk / weights_proj are no target name of parallm's)
# parallm's MLA parameters (in a layer's self_attention) -> the kind of their adapter (see layer_slots)
MLA_ADAPTED = {"linear_q_down_proj": "replicated", "linear_kv_down_proj": "replicated",
               "linear_q_up_proj": "column", "linear_q_proj": "column", "linear_kv_up_proj": "column",
               "linear_proj": "row"}


@dataclass(frozen=True)
class LoraConfig:
    """``r``: rank; ``alpha``: scaling numerator (PEFT's ``lora_alpha``: the update is ``B A x * alpha / r``);
    ``target_modules``: HF module names as PEFT matches them (a name equals the module's last component or a
    dotted suffix of its path; a string is a regex the whole path must match; ``"all-linear"``: every projection
    of a layer, as PEFT's, not the output head; a tuple may hold ``"all-linear"`` beside names, e.g.
    ``("all-linear", "lm_head")``: the layers' projections and the head); ``dropout``: 0 only (RL fine-tuning
    runs without it; anything else is a ValueError); ``rank_pattern`` / ``alpha_pattern``: PEFT's per-module overrides (key: a regex matched against the end of
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

    @property
    def all_linear(self) -> bool:
        """Whether ``target_modules`` is, or holds, ``"all-linear"``."""
        t = self.target_modules
        return t == "all-linear" or (not isinstance(t, str) and "all-linear" in t)

    def targets(self, module: str) -> bool:
        """Whether HF module ``module`` (``model.layers.0.self_attn.q_proj``) is targeted (PEFT's rule)."""
        t = self.target_modules
        linear = module.rsplit(".", 1)[-1] in ALL_LINEAR + MLA_LINEAR + MAMBA_LINEAR + V4_LINEAR
        if t == "all-linear":
            return linear
        if isinstance(t, str):
            return re.fullmatch(t, module) is not None
        return any(module == x or module.endswith("." + x) or (x == "all-linear" and linear) for x in t)

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


# DeepSeek-V4: parallm's attention parameter (under layers.{l}.self_attention.) -> transformers' module path under
# model.layers.{i}.self_attn. (the indexer sits inside the compressor there)
_V4_MEMORY = (("indexer.compressor.", "compressor.indexer."), ("indexer.weights_proj", "compressor.indexer.scorer."
                                                                                     "weights_proj"),
              ("indexer.q_b_proj", "compressor.indexer.q_b_proj"))


def peft_modules(spec, entry) -> list[tuple[str, str]]:
    """``[(module path, leaf)]`` of the HF modules in a table entry's parameter, as PEFT names them: the
    checkpoint's names, except DeepSeek-V4's, whose checkpoint names (``attn.wq_a``, ``ffn.shared_experts.w1``)
    differ from transformers' in-memory modules (``self_attn.q_a_proj``, ``mlp.shared_experts.gate_proj``)."""
    if spec.v4 is None:
        return [_leaf(h) for h in entry.hf]
    local = entry.local.split(".", 2)[-1]
    if local.startswith("self_attention."):
        name = local.removeprefix("self_attention.")
        for old, new in _V4_MEMORY:
            if name.startswith(old):
                name = new + name[len(old):]
        return [_leaf(f"model.layers.{entry.layer}.self_attn.{name}")]
    if entry.row.fused:
        return [_leaf(f.format(i=entry.layer)) for f in entry.row.fused]
    return [_leaf(h) for h in entry.hf]


def _v4_explicit(config: LoraConfig, module: str, shared_leaves: tuple[str, ...]) -> bool:
    """Whether ``config`` names ``module`` by more than ``"all-linear"`` or a bare leaf in ``shared_leaves`` (a
    leaf that names an adaptable projection as well: kv_proj, q_b_proj, gate_proj...)."""
    t = config.target_modules
    if isinstance(t, str):
        return t != "all-linear" and re.fullmatch(t, module) is not None
    return any(x != "all-linear" and x not in shared_leaves and (module == x or module.endswith("." + x)) for x in t)


def _v4_slots(spec, entry, config: LoraConfig, local: str, *, sp: bool):
    """DeepSeek-V4's attention projections (:data:`V4_ADAPTED`): q_a_proj / kv_proj replicated (the rank's
    gathered tokens), q_b_proj split by heads (its input already in the TP region: A's gradient is a partial sum
    over TP), o_b_proj row parallel. o_a_proj, the compressor's and the indexer's projections are refused when
    named (the compressor's / indexer's by a bare leaf they share with the attention's own projections, or by
    ``"all-linear"``, are left alone, as the issue asks; PEFT's would adapt them)."""
    if not local.endswith("proj.weight"):
        return None
    (m, p), = peft_modules(spec, entry)
    name = local.removeprefix("self_attention.").removesuffix(".weight")
    if "." in name:
        if _v4_explicit(config, m, tuple(V4_ADAPTED) + ALL_LINEAR):
            raise ValueError(f"LoRA on {m} is not supported: parallm never adapts DeepSeek-V4's compressor or its "
                             "(frozen) indexer; adaptable: q_a_proj, q_b_proj, kv_proj, o_b_proj of self_attn and "
                             "the shared experts' gate/up/down_proj (a regex target must not match the compressor)")
        return None
    if name == V4_REFUSED:
        if _v4_explicit(config, m, ()):
            raise ValueError(f"LoRA on {m} is not supported: o_a_proj is a grouped (block-diagonal) linear, on "
                             "which PEFT 0.21's Linear adapter fails; adaptable: q_a_proj, q_b_proj, kv_proj, "
                             "o_b_proj and the shared experts' gate/up/down_proj")
        return None
    if name not in V4_ADAPTED or not config.targets(m):
        return None
    rows, cols = resolve_shape(entry.row.shapes[0], spec)
    kind = V4_ADAPTED[name]
    a_lay, b_lay, a_sum, b_sum = {"replicated": (Replicated(), Replicated(), sp, sp),
                                  "split": (Replicated(), Split(0), True, False),
                                  "row": (Split(1), Replicated(), False, sp)}[kind]
    return kind, [Slot(m, p, rows, cols, *config.rank_alpha_scaled(m), a_lay, b_lay, a_sum, b_sum)]


def _expert_rank_alpha(config: LoraConfig, modules) -> tuple[int, float]:
    """A routed expert's ``(r, alpha)``: the config's (patterns are for dense modules: PEFT rewrites the experts'
    own into ``gate_up_proj`` patterns of its own making)."""
    for m, _ in modules:
        if config.rank_alpha(m) != (config.r, float(config.alpha)):
            raise ValueError(f"LoRA: rank_pattern / alpha_pattern match the routed expert module {m}; routed experts "
                             "take the config's r and alpha (gate_up_proj: 2 r and 2 alpha, as PEFT)")
    return config.r, float(config.alpha)


def head_slot(spec, task: str, config: LoraConfig, *, padded_vocab: int, sp: bool) -> Slot | None:
    """The output head's adapter when ``config`` targets ``lm_head`` (None otherwise): A ``[r, H]`` replicated over
    TP, B ``[V, r]`` laid out as the head's rows (:class:`VocabSplit`: padded with zero rows to ``padded_vocab``,
    split over TP by vocabulary, the padding stripped on save). Like a column-parallel linear's: A's gradient is a
    partial sum over TP under sequence parallelism only (``A x`` enters the TP region as the head's input does).
    A model without an lm_head (task ``value`` / ``hidden``) targeting it is a ValueError."""
    if not config.targets(HEAD):
        return None
    if task != "causal_lm":
        raise ValueError(f"LoRA on lm_head: a {task} model has no lm_head (its output is "
                         f"{'the value head, score' if task == 'value' else 'the hidden states'}); drop 'lm_head' "
                         "from target_modules")
    r, scaling = config.rank_alpha_scaled(HEAD)
    return Slot(HEAD, HEAD, spec.vocab_size, spec.hidden_size, r, scaling, Replicated(),
                VocabSplit(spec.vocab_size, padded_vocab), sp, False)


def layer_slots(spec, entry, config: LoraConfig, *, tp: int, sp: bool) -> tuple[str, list[Slot]] | None:
    """``(kind, slots)`` of the table entry's linear (``"column"``, ``"row"``, ``"replicated"``: MLA's
    down-projections, ``"split"``: DeepSeek-V4's q_b_proj, ``"experts_fc1"``, ``"experts_fc2"``), None when nothing
    of it is targeted. Raises for targeted modules parallm cannot adapt."""
    local = entry.local.split(".", 2)[-1]          # drop "layers.{l}."
    _check_family_targets(spec, config)
    if spec.v4 is not None and local.startswith("self_attention."):
        return _v4_slots(spec, entry, config, local, sp=sp)
    modules = peft_modules(spec, entry)
    if spec.family in HYBRID_FAMILIES and local in GDN_ADAPTED:
        return gdn_slots(spec, entry, config, modules, sp=sp, slot_cls=Slot)
    hit = [config.targets(m) for m, _ in modules]
    if spec.mla is not None and local.startswith("self_attention.") and local.endswith(".weight") \
            and local.split(".")[1] in MLA_ADAPTED:
        return _mla_slots(spec, entry, config, modules, hit, local, sp=sp)
    if local == "self_attention.linear_qkv.weight":
        if not any(hit):
            return None
        q, nkv, d = _attention_shape(spec, entry.layer)      # Gemma 4's global layers: their own shape
        rows = (q, nkv * d, nkv * d)          # a K = V or KV-sharing layer's modules: q / k or q alone (zip)
        kv = KVRows(nkv, d)
        layouts = (Split(0), kv, kv)
        return "column", [Slot(m, p, n, spec.hidden_size, *config.rank_alpha_scaled(m), Replicated(), lay, sp, False)
                          for (m, p), n, lay, h in zip(modules, rows, layouts, hit) if h]
    if spec.mamba is not None and local in ("self_attention.in_proj.weight", "self_attention.out_proj.weight"):
        if not hit[0]:
            return None
        (m, p), = modules
        if p != "in_proj":
            raise ValueError(f"LoRA on {m} is not supported: PEFT refuses out_proj and conv1d on Mamba models "
                             "(nemotron_h), and so does parallm (adaptable: in_proj, q/k/v/o_proj, up/down_proj)")
        rows, cols = resolve_shape(entry.row.shapes[0], spec)
        mb = spec.mamba
        parts = PartsSplit((mb.inner, mb.inner, mb.bc_size, mb.bc_size, mb.num_heads))
        return "column", [Slot(m, p, rows, cols, *config.rank_alpha_scaled(m), Replicated(), parts, sp, False)]
    if local == "self_attention.linear_proj.weight":
        if not hit[0]:
            return None
        (m, p), = modules
        return "row", [Slot(m, p, spec.hidden_size, spec.num_heads * spec.head_dim_of(entry.layer),
                            *config.rank_alpha_scaled(m), Split(1), Replicated(), False, sp)]
    return _mlp_slots(spec, entry, config, modules, hit, local, tp=tp, sp=sp)


def _check_family_targets(spec, config) -> None:
    """The families whose PEFT "all-linear" (or named targets) reach modules parallm does not adapt: refused."""
    if spec.family in GEMMA4_FAMILIES:
        check_gemma4_targets(spec, config)
    if spec.family == "qwen2_moe" and spec.moe is not None and spec.moe.shared_expert_gate:
        check_shared_gate_targets(spec, config)
    if spec.family in HYBRID_FAMILIES:
        check_hybrid_targets(spec, config)


def _mla_slots(spec, entry, config, modules, hit, local: str, *, sp: bool):
    """Multi-head latent attention's projections (:data:`MLA_ADAPTED`)."""
    if not hit[0]:
        return None
    (m, p), = modules
    rows, cols = resolve_shape(entry.row.shapes[0], spec)
    kind = MLA_ADAPTED[local.split(".")[1]]
    # A / B layouts and which gradients are partial sums over TP under sequence parallelism: a replicated
    # (duplicated) linear runs on this rank's tokens only, both factors partial as its own weight (tp_sum "sp")
    a_lay, b_lay, a_sum, b_sum = {"replicated": (Replicated(), Replicated(), sp, sp),
                                  "column": (Replicated(), Split(0), sp, False),
                                  "row": (Split(1), Replicated(), False, sp)}[kind]
    return kind, [Slot(m, p, rows, cols, *config.rank_alpha_scaled(m), a_lay, b_lay, a_sum, b_sum)]


def _mlp_slots(spec, entry, config, modules, hit, local: str, *, tp: int, sp: bool):
    """The dense MLPs, shared experts and routed experts; anything else targeted is refused."""
    moe = spec.moe is not None
    if moe and spec.moe.expert_layout == "interleaved_columns" and local.startswith("mlp.experts."):
        return _column_expert_slots(spec, entry, config, modules, hit, tp=tp)
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
    if spec.family in GEMMA4_FAMILIES and local.startswith("mlp.experts."):      # PEFT's target_parameters
        hit = [gemma4_expert_hit(config, entry.row.fused[0].format(i=entry.layer))] * len(modules)
        return _routed_expert_slots(spec, entry, config, modules, hit, local=local, tp=tp, fused_rank=1)
    if local.startswith("mlp.experts.") and spec.family not in PEFT_EXPERT_FAMILIES:
        return None            # PEFT leaves them: transformers 5's stacked experts are no nn.Linear
    if local in ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"):
        return _routed_expert_slots(spec, entry, config, modules, hit, local=local, tp=tp)
    if entry.hf and entry.hf[0].endswith(".weight") and any(hit):
        raise ValueError(f"LoRA on {', '.join(m for (m, _), h in zip(modules, hit) if h)} is not supported: parallm "
                         "adapts q/k/v/o_proj, gate/up/down_proj, routed experts, multi-head latent attention's "
                         "q_a/q_b/kv_a/kv_b projections and the Gated DeltaNet's projections only")
    return None


def _attention_shape(spec, layer: int) -> tuple[int, int, int]:
    """``(q rows, KV heads, head dim)`` of layer ``layer``'s fused QKV (the q rows doubled with an output gate)."""
    d = spec.head_dim_of(layer)
    return spec.num_heads * d * (2 if spec.attn_output_gate else 1), spec.kv_heads_of(layer), d


def _routed_expert_slots(spec, entry, config, modules, hit, *, local: str, tp: int, fused_rank: int = 2):
    """The routed experts' fc1 (``[gate; up]``, stacked as transformers' ``gate_up_proj``) or fc2 (``down_proj``)
    as PEFT adapts them in the families of :data:`PEFT_EXPERT_FAMILIES` (its conversion: fc1 of rank ``2 r``,
    alpha ``2 alpha``) or, ``fused_rank=1``, through ``target_parameters`` (Gemma 4: rank ``r`` on each); None
    when not targeted."""
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
        return "experts_fc1", [Slot(fused, "gate_up_proj", 2 * width, spec.hidden_size, fused_rank * r, alpha / r,
                                    Replicated(), PartsSplit((width, width)), tp > 1, False)]
    if local == "mlp.experts.linear_fc2.weight":
        if not hit[0]:
            return None
        fused = entry.row.fused[0].format(i=entry.layer).removesuffix(".down_proj")
        r, alpha = _expert_rank_alpha(config, modules)
        return "experts_fc2", [Slot(fused, "down_proj", spec.hidden_size, spec.moe.expert_intermediate_size, r,
                                    alpha / r, Split(1), Replicated(), False, tp > 1)]
    return None


def _column_expert_slots(spec, entry, config, modules, hit, *, tp: int):
    """gpt-oss's experts as PEFT adapts them (``target_parameters`` ``gate_up_proj`` / ``down_proj``: a
    ``ParamWrapper`` per stacked parameter, ``[E, in, out]`` read as ``in -> out``): rank ``r`` on each, fc1's B
    rows the interleaved gate / up columns (split over TP as the weight's columns), fc2's A columns split as its
    rows. The experts' biases take no adapter."""
    if not entry.local.endswith(".weight") or not hit[0]:
        return None
    part = entry.row.fused[0].rsplit(".", 1)[-1]
    fused = entry.row.fused[0].format(i=entry.layer).removesuffix("." + part)
    r, alpha = _expert_rank_alpha(config, modules)
    width, hidden = spec.moe.expert_intermediate_size, spec.hidden_size
    if part == "gate_up_proj":
        return "experts_fc1", [Slot(fused, part, 2 * width, hidden, r, alpha / r, Replicated(), Split(0), tp > 1,
                                    False)]
    return "experts_fc2", [Slot(fused, part, hidden, width, r, alpha / r, Split(1), Replicated(), False, tp > 1)]


def _local_rows(spec, entry, tp, rank) -> list[int]:
    """This TP rank's rows of each HF module fused in a column-parallel weight (qkv: ``q_r, k_r, v_r``; gate/up)."""
    if entry.local.endswith("linear_qkv.weight"):
        q, nkv, d = _attention_shape(spec, entry.layer)
        kv = len(kv_heads_of_rank(rank, tp, nkv)) * d
        return [q // tp, kv, kv]
    return [resolve_shape(sh, spec)[0] // tp for sh in entry.row.shapes]


def global_entries(spec, table, task, dims, config: LoraConfig, *, experts=None, layers=None, head=None,
                   padded_vocab=None) -> list[tuple[LoraEntry, Slot, str]]:
    """Every factor of the model (``layers``: those layers only; ``experts``: those experts only), in model order:
    ``(entry, slot, "A" | "B")``, the output head's last (``head``: whether to include it; default: when
    ``layers`` is None; ``padded_vocab``: the head's padded rows, default ``padded_vocab_size(V, tp)``)."""
    out = []
    head = layers is None if head is None else head
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
    s = head_slot(spec, task, config, sp=False,
                  padded_vocab=padded_vocab or padded_vocab_size(spec.vocab_size, dims.tp)) if head else None
    for which in ("A", "B") if s is not None else ():
        hf = f"{HEAD}.lora_{which}.weight"
        shape = (s.r, s.cols) if which == "A" else (s.rows, s.r)
        out.append((LoraEntry(LoraRow(hf), f"output_layer.lora.lora_{which}.{HEAD}", (hf,), spec.num_layers,
                              None, shape), s, which))
    return out
