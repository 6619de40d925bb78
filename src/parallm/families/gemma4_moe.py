"""Gemma 4's MoE block (``enable_moe_block``, the 26B-A4B checkpoint): config -> :class:`MoESpec` and the weight
table's rows (docs/families.md, "Gemma 4"; the layer: :mod:`parallm.model.layers.moe_beside`).

Every layer routes when the block is on (transformers' ``Gemma4TextDecoderLayer``): ``num_experts`` experts of
``moe_intermediate_size``, ``top_k_experts`` per token, beside the layer's dense MLP of ``intermediate_size``.
The checkpoint's tensors, as transformers 5.25 saves them (per layer, no ``mlp.`` prefix)::

    model.layers.{i}.router.proj.weight [E, H]   router.scale [H]   router.per_expert_scale [E]
    model.layers.{i}.experts.gate_up_proj [E, 2 I, H] ([gate; up] rows)   experts.down_proj [E, H, I]
    model.layers.{i}.post_feedforward_layernorm_1 / _2.weight, pre_feedforward_layernorm_2.weight [H]

Per expert the table names a slab ``experts.{e}.gate_up_proj`` / ``experts.{e}.down_proj`` (the export stream's
and the training checkpoints' names, as gpt-oss's); loads read the slabs of the stacked tensors, saves write the
stacked tensors back (``save_fused``). Each TP rank holds ``[gate_r; up_r]`` of an expert (kind
``gate_up_rows``) and its ``down`` columns.
"""

from __future__ import annotations

from ..model.spec import MoESpec
from ..model.table import Row

H, E, EI = "hidden_size", "num_experts", "expert_intermediate_size"
LAYER = "model.layers.{i}."
MLP = "layers.{l}.mlp."


def _expert_row(local: str, name: str, kind: str, shape: tuple) -> Row:
    return Row(MLP + local, (LAYER + "experts.{e}." + name,), kind, "layer", (shape,), when=("moe_layer",),
               per_expert=True, fused=(LAYER + "experts." + name,), save_fused=True)


def _replicated(local: str, hf: str, shape: tuple) -> Row:
    return Row(MLP + local, (LAYER + hf,), "copy", "layer", (shape,), when=("moe_layer",), tp_sum="sp")


MOE_ROWS = (
    _replicated("router.weight", "router.proj.weight", (E, H)),
    _replicated("router.scale", "router.scale", (H,)),
    _replicated("router.per_expert_scale", "router.per_expert_scale", (E,)),
    _expert_row("experts.linear_fc1.weight", "gate_up_proj", "gate_up_rows", ("2*" + EI, H)),
    _expert_row("experts.linear_fc2.weight", "down_proj", "row", (H, EI)),
    _replicated("out_norm_1.weight", "post_feedforward_layernorm_1.weight", (H,)),
    _replicated("out_norm_2.weight", "post_feedforward_layernorm_2.weight", (H,)),
    _replicated("pre_norm_2.weight", "pre_feedforward_layernorm_2.weight", (H,)),
)


def gemma4_moe_spec(raw: dict) -> MoESpec | None:
    """The MoE block's spec from a Gemma 4 text config dict (None without ``enable_moe_block``); the numbers
    checked, a ValueError naming them otherwise."""
    if not raw.get("enable_moe_block"):
        return None
    n, k, width = raw.get("num_experts"), raw.get("top_k_experts"), raw.get("moe_intermediate_size")
    bad = [f"{key}={v!r}" for key, v in (("num_experts", n), ("top_k_experts", k), ("moe_intermediate_size", width))
           if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad:
        raise ValueError(f"Gemma 4 with enable_moe_block=True needs positive integers: {', '.join(bad)}")
    if k > n:
        raise ValueError(f"Gemma 4: top_k_experts={k} exceeds num_experts={n}")
    return MoESpec(num_experts=n, top_k=k, expert_intermediate_size=width, norm_topk_prob=True,
                   layers=tuple(range(int(raw["num_hidden_layers"]))), router="gemma4", activation="gelu_tanh",
                   beside_mlp=True)
