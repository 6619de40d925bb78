"""DeepSeek-V4's attention rows of the weight table (:data:`V4_ATTENTION_ROWS`): parallm's
:class:`~parallm.model.layers.v4_attention.V4Attention` parameters (``layers.{l}.self_attention.*``) and the
checkpoint tensors transformers' ``DeepseekV4ForCausalLM.save_pretrained`` writes (``model.layers.{i}.attn.*``,
the original release's names).

Every layer: ``wq_a`` / ``q_norm`` / ``wkv`` / ``norm`` replicated (their gradients partial sums over TP under
sequence parallelism: ``tp_sum="sp"``), ``wq_b`` and ``attn_sink`` split by heads, ``wo_a`` split by output
groups, ``wo_b`` row parallel. Compressed layers (layer conditions ``v4_compressed`` / ``v4_csa`` / ``v4_hca``):
``compressor.{wkv, wgate, ape, norm}`` (CSA's two series make ``wkv`` / ``wgate`` / ``ape`` twice as wide), and
on CSA layers the frozen indexer ``indexer.{wq_b, weights_proj}`` and its own compressor
``indexer.compressor.{wkv, wgate, ape, norm}`` (``trained=False``). The sinks, the position biases (``ape``) and
every norm of the attention are fp32 in a model of any dtype (``keep_fp32``: transformers'
``_keep_in_fp32_modules_strict``).
"""

from __future__ import annotations

from ..model.table import Row

_L = "layers.{l}.self_attention."
_HF = "model.layers.{i}.attn."
H, HD, Q = "hidden_size", "head_dim", "v4.q_lora_rank"
O_ROWS = "v4.o_groups*v4.o_lora_rank"
IDX = "v4.index_head_dim"


def _row(local, hf, kind, shape, *, when=(), tp_sum="never", trained=True):
    # fp32 whatever the model's dtype: transformers' _keep_in_fp32_modules_strict (sinks, position_bias, q_a_norm,
    # kv_norm: every norm and position bias of the attention, the compressors' and the indexer's too)
    fp32 = local.endswith(("norm.weight", "position_bias")) or local == "sinks"
    return Row(_L + local, (_HF + hf,), kind, "layer", (shape,), when=when, tp_sum=tp_sum, trained=trained,
               keep_fp32=fp32)


def _compressor(local: str, hf: str, *, width: str, rate: str, when: tuple, tp_sum: str, trained: bool):
    return (
        _row(f"{local}kv_proj.weight", f"{hf}wkv.weight", "copy", (width, H), when=when, tp_sum=tp_sum,
             trained=trained),
        _row(f"{local}gate_proj.weight", f"{hf}wgate.weight", "copy", (width, H), when=when, tp_sum=tp_sum,
             trained=trained),
        _row(f"{local}position_bias", f"{hf}ape", "copy", (rate, width), when=when, tp_sum=tp_sum, trained=trained),
    )


V4_ATTENTION_ROWS: tuple[Row, ...] = (
    _row("q_a_proj.weight", "wq_a.weight", "copy", (Q, H), tp_sum="sp"),
    _row("q_a_norm.weight", "q_norm.weight", "copy", (Q,), tp_sum="sp"),
    _row("q_b_proj.weight", "wq_b.weight", "column", ("q_size", Q)),
    _row("kv_proj.weight", "wkv.weight", "copy", (HD, H), tp_sum="sp"),
    _row("kv_norm.weight", "norm.weight", "copy", (HD,), tp_sum="sp"),
    _row("sinks", "attn_sink", "column", ("num_heads",)),
    _row("o_a_proj.weight", "wo_a.weight", "column", (O_ROWS, "q_size/v4.o_groups")),
    _row("o_b_proj.weight", "wo_b.weight", "row", (H, O_ROWS)),
    *_compressor("compressor.", "compressor.", width="2*head_dim", rate="v4.csa_rate", when=("v4_csa",),
                 tp_sum="sp", trained=True),
    *_compressor("compressor.", "compressor.", width=HD, rate="v4.hca_rate", when=("v4_hca",), tp_sum="sp",
                 trained=True),
    _row("compressor.kv_norm.weight", "compressor.norm.weight", "copy", (HD,), when=("v4_compressed",),
         tp_sum="sp"),
    *_compressor("indexer.compressor.", "indexer.compressor.", width=f"2*{IDX}", rate="v4.csa_rate",
                 when=("v4_csa",), tp_sum="never", trained=False),
    _row("indexer.compressor.kv_norm.weight", "indexer.compressor.norm.weight", "copy", (IDX,), when=("v4_csa",),
         trained=False),
    _row("indexer.q_b_proj.weight", "indexer.wq_b.weight", "copy", (f"v4.index_heads*{IDX}", Q), when=("v4_csa",),
         trained=False),
    _row("indexer.weights_proj.weight", "indexer.weights_proj.weight", "copy", ("v4.index_heads", H),
         when=("v4_csa",), trained=False),
)
