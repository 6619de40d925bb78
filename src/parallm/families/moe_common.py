"""What the mixture-of-experts families share: the MoE weight-table rows and reading the MoE config fields.

A MoE family's table is the dense decoder table with its MLP rows limited to dense layers (``dense_layer``)
plus the rows below for MoE layers (``moe_layer``). Expert rows are per-expert templates (``{e}`` = global
expert index in the HF names; see :mod:`parallm.model.table`) of two stacked parameters per layer
(``mlp.experts.linear_fc1.weight [E_local, 2 I / tp, H]``, ``linear_fc2.weight [E_local, H, I / tp]``), in the
names transformers' ``save_pretrained`` writes. The rows also name the fused layout transformers 5 keeps in
memory (``mlp.experts.gate_up_proj [E, 2 I, H]``, ``mlp.experts.down_proj [E, H, I]``, Mixtral's router as
``mlp.gate.weight``), so a checkpoint or state dict stored that way loads too.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.spec import MoESpec
from ..model.table import Row
from .llama import DECODER_TABLE

H, EI, SI, E = "hidden_size", "expert_intermediate_size", "shared_expert_intermediate_size", "num_experts"


FUSED_BLOCK = "model.layers.{i}.mlp."   # where transformers 5 keeps a MoE layer's modules in memory


def moe_rows(block: str, *, router: str, gate: str, up: str, down: str, shared: str = "shared_expert.",
             router_bias: str | None = None, fp32_router: bool = False) -> tuple[Row, ...]:
    """``block``: the HF module of a MoE layer (``model.layers.{i}.mlp.``); ``router``: its router weight
    (relative to ``block``); ``gate`` / ``up`` / ``down``: expert e's projections (``{e}`` in them); ``shared``:
    the shared expert's module (Qwen2-MoE ``shared_expert.``, DeepSeek-V3 / GLM-4.5 ``shared_experts.``);
    ``router_bias``: the sigmoid router's fp32 selection bias (``gate.e_score_correction_bias``), a tensor without
    gradient (``tp_sum`` never: nothing to sum), present when the spec's ``score_bias`` says so.
    ``fp32_router``: the router's tensors are fp32 whatever the model dtype (``keep_fp32``: the sigmoid router)."""
    mlp = "layers.{l}.mlp."
    bias = () if router_bias is None else (
        Row(mlp + "router.e_score_correction_bias", (block + router_bias,), "copy", "layer", ((E,),),
            when=("moe_layer", "score_bias"), trained=False, keep_fp32=fp32_router),)
    return (
        Row(mlp + "router.weight", (block + router,), "copy", "layer", ((E, H),), when=("moe_layer",),
            tp_sum="sp", fused=(FUSED_BLOCK + "gate.weight",), keep_fp32=fp32_router),
        *bias,
        Row(mlp + "experts.linear_fc1.weight", (block + gate, block + up), "gate_up", "layer", ((EI, H), (EI, H)),
            when=("moe_layer",), per_expert=True, fused=(FUSED_BLOCK + "experts.gate_up_proj",)),
        Row(mlp + "experts.linear_fc2.weight", (block + down,), "row", "layer", ((H, EI),), when=("moe_layer",),
            per_expert=True, fused=(FUSED_BLOCK + "experts.down_proj",)),
        Row(mlp + "shared_experts.linear_fc1.weight",
            (block + shared + "gate_proj.weight", block + shared + "up_proj.weight"), "gate_up", "layer",
            ((SI, H), (SI, H)), when=("moe_layer", "shared_expert")),
        Row(mlp + "shared_experts.linear_fc2.weight", (block + shared + "down_proj.weight",), "row", "layer",
            ((H, SI),), when=("moe_layer", "shared_expert")),
        Row(mlp + "shared_experts.gate_weight", (block + "shared_expert_gate.weight",), "copy", "layer", ((1, H),),
            when=("moe_layer", "shared_expert_gate"), tp_sum="sp"),
    )


def moe_table(expert_rows: tuple[Row, ...], base: tuple[Row, ...] = DECODER_TABLE) -> tuple[Row, ...]:
    """The dense decoder table ``base`` (its MLP rows now for dense layers only) followed by ``expert_rows``. A
    new table: the shared dense one is not changed."""
    dense = tuple(replace(r, when=r.when + ("dense_layer",)) if ".mlp." in r.local else r for r in base)
    return dense + expert_rows


QWEN_MOE_ROWS = moe_rows("model.layers.{i}.mlp.", router="gate.weight", gate="experts.{e}.gate_proj.weight",
                         up="experts.{e}.up_proj.weight", down="experts.{e}.down_proj.weight")
QWEN_MOE_TABLE = moe_table(QWEN_MOE_ROWS)

# DeepSeek-V3 and GLM-4.5: the router with its selection bias, the shared expert under ``shared_experts.``
GROUPED_MOE_ROWS = moe_rows("model.layers.{i}.mlp.", router="gate.weight", gate="experts.{e}.gate_proj.weight",
                            up="experts.{e}.up_proj.weight", down="experts.{e}.down_proj.weight",
                            shared="shared_experts.", router_bias="gate.e_score_correction_bias",
                            fp32_router=True)


def moe_layers(config, num_experts: int) -> tuple[int, ...]:
    """Qwen-MoE's rule (transformers' ``Qwen*MoeDecoderLayer``): layer i routes over experts unless it is in
    ``mlp_only_layers``, when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``."""
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    only = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i for i in range(int(config.num_hidden_layers))
                 if i not in only and num_experts > 0 and (i + 1) % step == 0)


def num_experts_of(config) -> int:
    """``num_experts`` or ``num_local_experts``: transformers 5 maps one onto the other for Qwen3-MoE and Mixtral
    (``attribute_map``) and writes ``num_local_experts`` to config.json; Hub configs of Qwen-MoE say
    ``num_experts``. 0 when neither is set."""
    for key in ("num_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if value:
            return value
    return 0


def aux_loss_coef(config) -> float:
    """``router_aux_loss_coef`` when the config turns the loss on (``output_router_logits``), else 0."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def moe_spec(config, *, num_experts: int, expert_intermediate_size: int, norm_topk_prob: bool,
             layers: tuple[int, ...], shared_expert_intermediate_size: int = 0,
             shared_expert_gate: bool = False) -> MoESpec | None:
    """The :class:`MoESpec` (None when no layer routes: a dense model), the numbers checked."""
    if not layers:
        return None
    top_k = getattr(config, "num_experts_per_tok", None)
    problems = [f"{k}={v!r}" for k, v in (("num_experts", num_experts), ("num_experts_per_tok", top_k),
                                          ("moe_intermediate_size", expert_intermediate_size))
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if problems:
        raise ValueError(f"invalid mixture-of-experts config: {', '.join(problems)} (positive integers expected)")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds num_experts={num_experts}")
    return MoESpec(num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert_intermediate_size,
                   norm_topk_prob=bool(norm_topk_prob), layers=layers,
                   shared_expert_intermediate_size=shared_expert_intermediate_size,
                   shared_expert_gate=shared_expert_gate, aux_loss_coef=aux_loss_coef(config))
