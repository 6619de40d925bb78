"""DeepSeek-V4's attention layer (transformers' ``DeepseekV4Attention``), training path, equal to transformers'
eager attention and with memory linear in S.

For ``n`` heads of ``head_dim`` (``n / tp`` per TP rank), x ``[S, B, H]`` (packed ``[T, 1, H]``; sequence
parallel: this rank's ``[T / tp, 1, H]``)::

    q_resid = q_a_norm(q_a_proj(x))                           weighted RMSNorm, q_lora_rank wide
    q       = rope(rms(q_b_proj(q_resid)))                    [.., n/tp, head_dim], a weightless RMSNorm per head
    kv      = rope(kv_norm(kv_proj(x)))                        one key = value head of head_dim
    keys    = [kv of every token; the compressor's entries]   (sliding layers: kv only)
    out     = sum_j softmax_j(q . keys_j / sqrt(head_dim), the head's sink logit in the denominator) keys_j
    out     = o_b_proj(o_a_proj(rope^-1(out)))                 o_a: per group of n / o_groups heads

over each query's keys: the raw ``kv`` of its sliding window (``i - sliding_window < j <= i``, its document's)
and, on ``hca`` layers, every compressed entry of its document it sees (``e < (i + 1) // hca_rate``), on ``csa``
layers the indexer's top ``index_topk`` of those (:mod:`parallm.model.layers.v4_compress`). RoPE: interleaved
pairs on the trailing ``rope_dim`` channels, ``main_rope`` on sliding layers, ``compress_rope`` on the others, at
``ctx.positions`` (the decoder's ``cos`` / ``sin`` are not used); the output is rotated back by the conjugate
(``-sin``) at the query's position.

**Sparse attention.** Every query's keys are rows of one matrix (the raw kv rows of the key stream, then the
compressed entries): an int32 index ``[queries, window + entries]`` (-1: empty) into it, attended by DSA's
blocked gather kernel (:func:`parallm.model.layers.dsa.sparse_latent_attention`, K = V, ``dv = head_dim``, with
the per-head sink): fp32 softmax, blocks of queries, the backward recomputed from the saved log-sum-exp. No
``[S, S]`` tensor: the index is ``S x (sliding_window + index_topk)`` on CSA layers and ``S x (sliding_window +
S / hca_rate)`` on HCA layers (every query sees every earlier entry).

**Parameters and TP** (local names; the checkpoint's in :mod:`parallm.families.deepseek_v4_attention`)::

    q_a_proj.weight [q_lora, H], q_a_norm.weight, kv_proj.weight [hd, H], kv_norm.weight   replicated
    q_b_proj.weight [n/tp * hd, q_lora]          split by heads
    sinks [n/tp]                                 split by heads
    o_a_proj.weight [o_groups/tp * o_lora, n * hd / o_groups]   split by groups (tp | o_groups)
    o_b_proj.weight [H, o_groups/tp * o_lora]    row parallel (megatron-core's RowParallelLinear)
    compressor.{kv_proj, gate_proj}.weight, compressor.position_bias, compressor.kv_norm.weight   replicated
    indexer.compressor.*, indexer.q_b_proj.weight, indexer.weights_proj.weight   replicated, frozen

Without sequence parallelism ``q_resid`` and the keys enter the TP region by
``copy_to_tensor_model_parallel_region`` (backward: the sum over TP of every rank's heads' gradients), so every
replicated gradient is whole on every rank. Under sequence parallelism the layer all-gathers ``x`` first
(backward: reduce-scattered) and runs the replicated parts on every token, each rank's gradients of them then a
partial sum over its heads (the table rows say ``tp_sum="sp"``); ``o_b_proj`` reduce-scatters the output.
Context parallelism: the key stream's tokens (``x``) are all-gathered over the CP group in global order (backward:
gradients summed onto their owners); each rank's queries attend to their keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...parallel.comm import gather_rows_sum_back
from ...parallel.megatron_import import import_megatron
from ..context_parallel import ContextSplit
from .dsa import sparse_latent_attention
from .mla import ReplicatedLinear
from .mlp import no_init
from .v4_compress import V4Compressor, V4Indexer, V4RMSNorm, rope_tail, v4_cos_sin
from .v4_compress import rope_tail as _rotate    # the backward's rotations (rope_tail: the forward's)
from .v4_layout import V4Index, v4_layout

mtp = import_megatron().tensor_parallel


class SplitLinear(nn.Module):
    """A weight split over TP along dim 0 (heads, groups), applied by the layer itself (megatron-core's column
    parallel weight: placement kind ``"linear"``)."""
    parallm_param_kind = "linear"

    def __init__(self, rows: int, cols: int, *, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))

    def forward(self, x):
        return F.linear(x, self.weight)


def check_v4_tp(spec, tp: int) -> None:
    """ValueError unless heads and output groups split evenly over TP."""
    v = spec.v4
    if spec.num_heads % tp or v.o_groups % tp or spec.num_heads % v.o_groups:
        raise ValueError(f"DeepSeek-V4 attention splits heads and output groups over TP: num_attention_heads="
                         f"{spec.num_heads} and o_groups={v.o_groups} must be divisible by tp={tp} (and heads by "
                         "o_groups)")


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (see the module docstring), called like every attention layer:
    ``forward(x, cos, sin, ctx)`` with ``ctx.positions`` set (cos / sin unused). ``layer_number``: the global
    layer index (its kind: ``spec.v4.kind``); ``cp_group``: the context-parallel group (a ContextSplit's keys
    are gathered over it); ``tp_group``: given to ``o_b_proj`` (None: megatron-core's default TP group)."""

    def __init__(self, spec, config, tp: int, device=None, *, layer_number: int, cp_group=None, tp_group=None):
        super().__init__()
        if spec.v4 is None:
            raise ValueError(f"{spec.architecture} is no DeepSeek-V4 model (spec.v4 is None)")
        check_v4_tp(spec, tp)
        v = spec.v4
        dtype = config.params_dtype
        self.kind = v.kind(layer_number)
        self.layer_number, self.tp, self.cp_group, self.tp_group = layer_number, tp, cp_group, tp_group
        self.sequence_parallel = bool(config.sequence_parallel)
        self.heads, self.groups, self.head_dim = spec.num_heads // tp, v.o_groups // tp, spec.head_dim
        self.o_lora, self.window, self.eps = v.o_lora_rank, v.sliding_window, spec.rms_norm_eps
        self.rope = v.main_rope if self.kind == "sliding" else v.compress_rope
        self.rate = {"csa": v.csa_rate, "hca": v.hca_rate}.get(self.kind)
        h, hd = spec.hidden_size, spec.head_dim
        self.q_a_proj = ReplicatedLinear(h, v.q_lora_rank, bias=False, dtype=dtype, device=device)
        self.q_a_norm = V4RMSNorm(v.q_lora_rank, spec.rms_norm_eps, device)
        self.q_b_proj = SplitLinear(self.heads * hd, v.q_lora_rank, dtype=dtype, device=device)
        self.kv_proj = ReplicatedLinear(h, hd, bias=False, dtype=dtype, device=device)
        self.kv_norm = V4RMSNorm(hd, spec.rms_norm_eps, device)
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=torch.float32, device=device))    # fp32 always
        self.o_a_proj = SplitLinear(self.groups * v.o_lora_rank, spec.num_heads * hd // v.o_groups, dtype=dtype,
                                    device=device)
        self.o_b_proj = mtp.RowParallelLinear(v.o_groups * v.o_lora_rank, h, config=config, init_method=no_init,
                                              bias=False, input_is_parallel=True, skip_bias_add=False,
                                              tp_group=tp_group)
        self.compressor = None if self.rate is None else V4Compressor(
            h, hd, self.rate, overlap=self.kind == "csa", eps=spec.rms_norm_eps, dtype=dtype, device=device)
        self.indexer = V4Indexer(spec, dtype, device) if self.kind == "csa" else None
        # the kernel's blocks by path ("union" / "gathered", summed over calls) and the CSA calls whose indexer
        # ran ("indexer"; skipped where no query sees more than index_topk entries)
        self.paths: dict = {}

    def forward(self, x, cos, sin, ctx):
        """x ``[S, B, H]`` / ``[T, 1, H]`` (sequence parallel: this rank's ``[T / tp, 1, H]``), ctx a
        :class:`PaddedRows`, :class:`Packing` or :class:`ContextSplit` with ``positions`` (``[S, B]`` / ``[T, 1]`` /
        the split's). Returns x's shape."""
        lay = v4_layout(ctx)
        if self.sequence_parallel:
            x = mtp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        s, b, hidden = x.shape
        xf = x.reshape(s * b, hidden)
        positions = _positions(ctx, s, b)
        cos, sin = v4_cos_sin(self.rope, positions)
        q_resid = self.q_a_norm(self.q_a_proj(xf))
        q_in = mtp.copy_to_tensor_model_parallel_region(q_resid) if self.tp > 1 and not self.sequence_parallel \
            else q_resid
        # recomputed in the backward: q_b_proj's output and the normed q are not kept (the kernel keeps q)
        q = checkpoint(self._queries, q_in, cos, sin, use_reentrant=False)
        keys_x = xf
        if isinstance(ctx, ContextSplit):         # every rank's tokens, in global order (backward: to their owners)
            keys_x = gather_rows_sum_back(x, self.cp_group).index_select(0, ctx.order).reshape(-1, hidden)
        keys = self._keys(keys_x, positions, lay)
        index = self._index(lay, xf, q_resid, cos, sin, keys_x)
        out = sparse_latent_attention(q, keys, index, scale=self.head_dim ** -0.5, dv=self.head_dim,
                                      sink=self.sinks, paths=self.paths)
        w = self.o_a_proj.weight.view(self.groups, self.o_lora, -1)
        mixed = _DerotateGroups.apply(out, cos, sin, w).reshape(s, b, self.groups * self.o_lora)
        out, _ = self.o_b_proj(mixed)
        return out

    def _queries(self, q_in, cos, sin):
        """``rope(rms(q_b_proj(q_in)))`` ``[T, heads, head_dim]``."""
        q = self.q_b_proj(q_in).view(q_in.shape[0], self.heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        return rope_tail(q, cos[:, None], sin[:, None])

    def _keys(self, keys_x, positions, lay):
        """The key matrix: the raw kv rows of the key stream, then the compressed entries (into the TP region
        after the concatenation, without sequence parallelism)."""
        kc, ks = v4_cos_sin(self.rope, positions if lay.key_pos is None else lay.key_pos)
        keys = rope_tail(self.kv_norm(self.kv_proj(keys_x)), kc, ks)
        if self.compressor is not None:
            keys = torch.cat([keys, self.compressor(keys_x, lay, self.rope)])
        if self.tp > 1 and not self.sequence_parallel:
            keys = mtp.copy_to_tensor_model_parallel_region(keys)
        return keys

    def _index(self, lay, xf, q_resid, cos, sin, keys_x) -> V4Index:
        """Each query's rows of the key matrix (:class:`V4Index`, made block by block by the kernel)."""
        if self.kind == "csa" and lay.entries(self.rate).most > self.indexer.topk:
            sel = self.indexer.select(xf, q_resid, cos, sin, lay, self.rope, keys_x=keys_x)
            self.paths["indexer"] = self.paths.get("indexer", 0) + 1
            return V4Index(lay, self.window, selected=sel)
        # HCA, and CSA where no query sees more than index_topk entries: the top-k would take every entry a
        # query sees, so every one is attended (the same keys; the indexer, frozen, is not run)
        return V4Index(lay, self.window, rate=self.rate)


class _DerotateGroups(torch.autograd.Function):
    """The attention output ``[T, heads, head_dim]`` de-rotated at its query's position (``rope_tail`` with
    ``-sin``), then ``o_a_proj`` per group (``w`` ``[groups, o_lora, heads * head_dim / groups]``): ``[T, groups,
    o_lora]``. Keeps only its input (which the kernel keeps anyway), not the de-rotated copy: the backward
    recomputes it for ``w``'s gradient and rotates the input's gradient back (``+sin``, the transpose)."""

    @staticmethod
    def forward(ctx, out, cos, sin, w):
        ctx.save_for_backward(out, cos, sin, w)
        grouped = rope_tail(out, cos[:, None], -sin[:, None]).reshape(out.shape[0], w.shape[0], -1)
        return torch.einsum("tgi,goi->tgo", grouped, w)

    @staticmethod
    def backward(ctx, grad):
        out, cos, sin, w = ctx.saved_tensors
        dout = dw = None
        if ctx.needs_input_grad[0]:
            dgrouped = torch.einsum("tgo,goi->tgi", grad, w).reshape(out.shape)
            dout = _rotate(dgrouped, cos[:, None], sin[:, None])
        if ctx.needs_input_grad[3]:
            grouped = _rotate(out, cos[:, None], -sin[:, None]).reshape(out.shape[0], w.shape[0], -1)
            dw = torch.einsum("tgo,tgi->goi", grad, grouped)
        return dout, None, None, dw


def _positions(ctx, s: int, b: int) -> torch.Tensor:
    """``ctx.positions`` flattened to the activations' rows ``[s * b]`` (long)."""
    pos = getattr(ctx, "positions", None)
    if pos is None:
        raise ValueError("DeepSeek-V4 attention needs ctx.positions (the chunk sets it: [S, B] padded, [T, 1] "
                         "packed, the split's under context parallelism)")
    if isinstance(ctx, ContextSplit):
        pos = ctx.slot_values(pos) if pos.shape == (ctx.width, ctx.rows) else pos.reshape(-1)
    pos = pos.reshape(-1)
    if pos.numel() != s * b:
        raise ValueError(f"ctx.positions has {pos.numel()} entries for {s} x {b} activation rows")
    return pos.long()
