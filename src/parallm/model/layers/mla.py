"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, Moonlight) on megatron-core's parallel layers,
equal to transformers' ``DeepseekV3Attention``.

For ``n`` heads (``n / tp`` per TP rank), ``x`` ``[S, B, H]`` (packed: ``[T, 1, H]``; sequence parallel: this
rank's ``[T / tp, 1, H]``)::

    q      = q_b(norm_q(q_a x))   or q_proj(x) without a q LoRA     [.., n/tp, nope + rope]
    c, k_r = split(kv_a x, [kv_lora_rank, rope])                    latent and the one shared rope key
    k_n, v = split(kv_b(norm_kv(c)), [nope, v])                     per head
    q = [q_nope; rope(q_rope)], k = [k_n; rope(k_r) for every head]
    out    = o_proj(softmax(q k^T * scale) v)

Parameters and their TP layout (megatron-core's MLA names; the HF tensors of each, :data:`MLA_WEIGHTS`)::

    linear_q_down_proj.weight  [q_lora_rank, H]          q_a_proj            replicated (tp_sum under SP)
    q_layernorm.weight         [q_lora_rank]             q_a_layernorm       replicated (tp_sum under SP)
    linear_q_up_proj.weight    [n/tp * (nope+rope), q_lora_rank]   q_b_proj  column-parallel by heads
    linear_q_proj.weight       [n/tp * (nope+rope), H]   q_proj (no q LoRA)  column-parallel by heads
    linear_kv_down_proj.weight [kv_lora_rank + rope, H]  kv_a_proj_with_mqa  replicated (tp_sum under SP)
    kv_layernorm.weight        [kv_lora_rank]            kv_a_layernorm      replicated (tp_sum under SP)
    linear_kv_up_proj.weight   [n/tp * (nope+v), kv_lora_rank]     kv_b_proj  column-parallel; per head k_nope, v
    linear_proj.weight         [H, n/tp * v]             o_proj              row-parallel

The down-projections and their norms are replicated (megatron-core's ``TELinear(parallel_mode="duplicated")``,
which it marks ``sequence_parallel``): under sequence parallelism each TP rank runs them on its own tokens, so
their gradients are partial sums over TP, which ``finalize_grads`` adds (the table rows say ``tp_sum="sp"``).
The up-projections all-gather their input (megatron-core's sequence-parallel ColumnParallelLinear), and the
shared rope key is all-gathered explicitly (backward: a reduce-scatter of its per-rank partial gradients).
Without sequence parallelism the rope key enters the TP region through ``copy_to_tensor_model_parallel_region``
(backward: the sum over TP of each rank's heads' gradients), so every replicated parameter's gradient is
complete on every rank.

RoPE: ``cos`` / ``sin`` as the decoder passes them (``cat((freqs, freqs), -1)``, fp32, the yarn attention factor
already applied: :func:`parallm.model.positions.yarn.yarn_cos_sin`), ``qk_rope_head_dim`` wide; interleaved pairs when
``rope_interleave`` (:func:`apply_rope_interleaved`, transformers' ``apply_rotary_pos_emb_interleave``), else the
rotate_half layout.

Softmax scale: :attr:`parallm.model.spec.MLASpec.scale` (yarn's ``mscale(factor, mscale_all_dim) ** 2`` times
``q_head_dim ** -0.5``). The attention kernels of :mod:`parallm.model.layers.attention` scale by
``q_head_dim ** -0.5`` themselves, so the queries are multiplied by ``scale * sqrt(q_head_dim)`` first (skipped
when that is 1): the same logits up to rounding. The flash-attn kernel and the context-parallel kernels need the
values as wide as the keys: they are zero-padded for them and the output cut back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.megatron_import import import_megatron
from ...parallel.state import as_device
from .attention import AttnBackend, Packing
from .blocks import block_kernel
from ..context_parallel import CP_KERNELS, ContextSplit
from .mlp import no_init
from ..positions.rope import apply_rope
from ..sharding import Replicated, Split, TPLayout
from ..spec import DecoderSpec

mtp = import_megatron().tensor_parallel


# -- the weights: HF tensor <-> this module's parameters, and their TP layout -----------------------------------

# HF name (after "model.layers.{i}.self_attn.") -> (parameter name in MLAttention, layout kind, tp_sum, condition)
# kinds are parallm.model.sharding's ("copy" replicated, "column" split along dim 0, "row" along dim 1); the
# condition says when the tensor exists: "q_lora" / "no_q_lora" (q_lora_rank set or None), "down_bias" (the down
# projections' bias: attention_bias), "o_bias".
MLA_WEIGHTS: dict[str, tuple[str, str, str, str | None]] = {
    "q_a_proj.weight": ("linear_q_down_proj.weight", "copy", "sp", "q_lora"),
    "q_a_proj.bias": ("linear_q_down_proj.bias", "copy", "sp", "q_lora+down_bias"),
    "q_a_layernorm.weight": ("q_layernorm.weight", "copy", "sp", "q_lora"),
    "q_b_proj.weight": ("linear_q_up_proj.weight", "column", "never", "q_lora"),
    "q_proj.weight": ("linear_q_proj.weight", "column", "never", "no_q_lora"),
    "kv_a_proj_with_mqa.weight": ("linear_kv_down_proj.weight", "copy", "sp", None),
    "kv_a_proj_with_mqa.bias": ("linear_kv_down_proj.bias", "copy", "sp", "down_bias"),
    "kv_a_layernorm.weight": ("kv_layernorm.weight", "copy", "sp", None),
    "kv_b_proj.weight": ("linear_kv_up_proj.weight", "column", "never", None),
    "o_proj.weight": ("linear_proj.weight", "row", "never", None),
    "o_proj.bias": ("linear_proj.bias", "copy", "sp", "o_bias"),
}


def _holds(spec: DecoderSpec, condition: str | None) -> bool:
    mla = spec.mla
    tests = {"q_lora": mla.q_lora_rank is not None, "no_q_lora": mla.q_lora_rank is None,
             "down_bias": mla.down_proj_bias, "o_bias": spec.o_bias}
    return condition is None or all(tests[c] for c in condition.split("+"))


def mla_hf_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """The full HF shape of every MLA tensor this spec has (keys as in :data:`MLA_WEIGHTS`)."""
    m, n, h = spec.mla, spec.num_heads, spec.hidden_size
    shapes = {
        "q_a_proj.weight": (m.q_lora_rank, h), "q_a_proj.bias": (m.q_lora_rank,),
        "q_a_layernorm.weight": (m.q_lora_rank,), "q_b_proj.weight": (n * m.q_head_dim, m.q_lora_rank),
        "q_proj.weight": (n * m.q_head_dim, h),
        "kv_a_proj_with_mqa.weight": (spec.mla_kv_a_size, h), "kv_a_proj_with_mqa.bias": (spec.mla_kv_a_size,),
        "kv_a_layernorm.weight": (m.kv_lora_rank,), "kv_b_proj.weight": (spec.mla_kv_b_size, m.kv_lora_rank),
        "o_proj.weight": (h, spec.mla_v_size), "o_proj.bias": (h,),
    }
    return {k: shapes[k] for k, (_, _, _, cond) in MLA_WEIGHTS.items() if _holds(spec, cond)}


def check_mla_tp(spec: DecoderSpec, tp: int) -> None:
    """ValueError unless every head stays whole on one TP rank (``num_heads % tp == 0``)."""
    if spec.num_heads % tp:
        raise ValueError(f"multi-head latent attention splits heads over TP: num_attention_heads={spec.num_heads} "
                         f"is not divisible by tp={tp}")


def mla_layout(spec: DecoderSpec, name: str) -> TPLayout:
    """The layout kind of HF tensor ``name`` (a key of :data:`MLA_WEIGHTS`): Replicated, Split(0) (by heads:
    each head's rows are contiguous, k_nope then v for kv_b) or Split(1) (o_proj's per-head columns)."""
    if name not in MLA_WEIGHTS:
        raise KeyError(f"{name!r} is not a multi-head latent attention tensor ({sorted(MLA_WEIGHTS)})")
    return {"copy": Replicated(), "column": Split(0), "row": Split(1)}[MLA_WEIGHTS[name][1]]


def split_mla(spec: DecoderSpec, name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Every TP rank's shard (rank order) of the full HF tensor ``name`` (shape checked, heads kept whole)."""
    shapes = mla_hf_shapes(spec)
    if name not in shapes:
        raise KeyError(f"{name!r} is not a tensor of this multi-head latent attention ({sorted(shapes)})")
    if tuple(tensor.shape) != shapes[name]:
        raise ValueError(f"{name}: shape {list(tensor.shape)}, expected {list(shapes[name])}")
    check_mla_tp(spec, tp)
    layout = mla_layout(spec, name)
    return [layout.shard([tensor], r, tp) for r in range(tp)]


def merge_mla(spec: DecoderSpec, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full HF tensor ``name`` from every TP rank's shard (inverse of :func:`split_mla`, bit for bit)."""
    return mla_layout(spec, name).merge(list(shards))[0]


# -- RoPE on the rope part ------------------------------------------------------------------------------------

def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE, transformers' ``apply_rotary_pos_emb_interleave`` bit for bit: channel pairs
    ``(x0, x1), (x2, x3), ...`` each rotate by one frequency (the first half of ``cos`` / ``sin``, which are
    ``cat((freqs, freqs), -1)``), and the result is laid out de-interleaved, ``[x_even'; x_odd']`` (queries and
    keys alike, so their products are unchanged). ``x`` ``[..., heads, d]``, ``cos`` / ``sin`` ``[..., d]``."""
    if cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"apply_rope_interleaved: x has {x.shape[-1]} rope channels, cos {cos.shape[-1]}")
    half = cos.shape[-1] // 2
    cos = cos[..., :half].to(x.dtype).unsqueeze(-2)
    sin = sin[..., :half].to(x.dtype).unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# -- the module ----------------------------------------------------------------------------------------------

class ReplicatedLinear(nn.Module):
    """``F.linear`` with a weight replicated over TP (megatron-core's duplicated linear, marked
    ``sequence_parallel`` like a norm and ``allreduce`` like a linear: parallm's placement kind
    ``"replicated_linear"``)."""
    parallm_param_kind = "replicated_linear"

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class MLAttention(nn.Module):
    """Multi-head latent attention of one decoder layer (see the module docstring), called like the decoder's
    ``Attention``: ``forward(x, cos, sin, ctx)``.

    ``norm``: the RMSNorm class to build the two latent norms with (the decoder's ``RMSNorm``, signature
    ``(size, eps, dtype, device)``), passed in so this module does not import the decoder."""

    def __init__(self, spec: DecoderSpec, config, tp: int, device=None, *, backend: AttnBackend, norm,
                 cp_group=None, cp_attn: str = "allgather"):
        super().__init__()
        self.cp_group = cp_group            # context parallelism: keys and values reach the other ranks' tokens
        self.cp_fn = CP_KERNELS[cp_attn]
        self.cp_block = block_kernel(backend, as_device(device))
        if spec.mla is None:
            raise ValueError(f"{spec.architecture} has no multi-head latent attention (spec.mla is None)")
        check_mla_tp(spec, tp)
        m = spec.mla
        dtype = config.params_dtype
        self.backend = backend
        self.tp = tp
        self.sequence_parallel = bool(config.sequence_parallel)
        self.heads = spec.num_heads // tp
        self.nope, self.rope_dim, self.v_dim, self.kv_lora = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                                                               m.kv_lora_rank)
        self.q_head_dim = m.q_head_dim
        self.interleave = m.rope_interleave
        # the kernels scale by q_head_dim ** -0.5: fold the rest of the scale (yarn's mscale^2) into the queries
        factor = m.scale * math.sqrt(m.q_head_dim)
        self.q_factor = None if abs(factor - 1.0) < 1e-12 else factor
        n = spec.num_heads
        if m.q_lora_rank is not None:
            self.linear_q_down_proj = ReplicatedLinear(spec.hidden_size, m.q_lora_rank, bias=m.down_proj_bias,
                                                       dtype=dtype, device=device)
            self.q_layernorm = norm(m.q_lora_rank, m.latent_norm_eps, dtype, device)
            self.linear_q_up_proj = mtp.ColumnParallelLinear(m.q_lora_rank, n * m.q_head_dim, config=config,
                                                             init_method=no_init, bias=False, gather_output=False)
        else:
            self.linear_q_proj = mtp.ColumnParallelLinear(spec.hidden_size, n * m.q_head_dim, config=config,
                                                          init_method=no_init, bias=False, gather_output=False)
        self.linear_kv_down_proj = ReplicatedLinear(spec.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim,
                                                    bias=m.down_proj_bias, dtype=dtype, device=device)
        self.kv_layernorm = norm(m.kv_lora_rank, m.latent_norm_eps, dtype, device)
        self.linear_kv_up_proj = mtp.ColumnParallelLinear(m.kv_lora_rank, n * (m.qk_nope_head_dim + m.v_head_dim),
                                                          config=config, init_method=no_init, bias=False,
                                                          gather_output=False)
        self.linear_proj = mtp.RowParallelLinear(n * m.v_head_dim, spec.hidden_size, config=config,
                                                 init_method=no_init, bias=spec.o_bias, input_is_parallel=True,
                                                 skip_bias_add=False)

    def _rope(self, x, cos, sin):
        return apply_rope_interleaved(x, cos, sin) if self.interleave else apply_rope(x, cos, sin)

    def _attend(self, q, k, v, ctx):
        """q, k ``[S, B, h, q_head_dim]``, v ``[S, B, h, v_dim]`` -> ``[S, B, h, v_dim]`` through the backend."""
        if self.q_factor is not None:
            q = q * self.q_factor
        if isinstance(ctx, ContextSplit):
            # the context-parallel kernels move keys and values together and attend in one width: the values
            # zero-padded to the keys' width (the padded channels of the output are zeros, cut off)
            pad = self.q_head_dim - self.v_dim
            if pad < 0:
                raise ValueError(f"context parallelism needs v_head_dim ({self.v_dim}) <= the key width "
                                 f"({self.q_head_dim})")
            out = self.cp_fn(q, k, F.pad(v, (0, pad)) if pad else v, ctx, self.cp_group, self.cp_block)
            return out[..., :self.v_dim] if pad else out
        pad = self.q_head_dim - self.v_dim if self.backend.for_ctx(ctx).name == "flash-attn" else 0
        if pad > 0:
            v = F.pad(v, (0, pad))
        elif pad < 0:
            raise ValueError(f"flash-attn needs v_head_dim ({self.v_dim}) <= the key width ({self.q_head_dim})")
        if isinstance(ctx, Packing):
            out = self.backend.fn(q[:, 0], k[:, 0], v[:, 0], ctx).unsqueeze(1)
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = self.backend.fn(q, k, v, ctx).permute(2, 0, 1, 3)
        return out[..., :self.v_dim] if pad else out

    def forward(self, x, cos, sin, ctx):
        """x: ``[S, B, H]`` (or this rank's ``[T / tp, 1, H]`` under sequence parallelism); cos / sin:
        ``[S, B, rope]`` / ``[T, 1, rope]`` fp32 for every position; ctx: a boolean mask ``[B, 1, S, S]`` or None
        (padded), a :class:`Packing` (packed), or a :class:`ContextSplit` (context parallelism: this rank's share
        of every sequence, either layout). Returns ``[S, B, H]`` (sequence parallel: ``[T / tp, 1, H]``)."""
        if hasattr(self, "linear_q_down_proj"):
            q, _ = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))   # SP: gathered here
        else:
            q, _ = self.linear_q_proj(x)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora, self.rope_dim], dim=-1)
        return self.dense_attention(q, self.kv_layernorm(latent), k_rope, cos, sin, ctx)

    def dense_attention(self, q, latent, k_rope, cos, sin, ctx):
        """The rest of :meth:`forward` from the queries ``q`` (every token's under sequence parallelism), this
        rank's normed latent and rope key: keys and values expanded per head, attention over every visible key,
        the output projection."""
        kv, _ = self.linear_kv_up_proj(latent)                                          # SP: gathered here
        if self.sequence_parallel:
            k_rope = mtp.gather_from_sequence_parallel_region(k_rope.contiguous(), tensor_parallel_output_grad=True)
        elif self.tp > 1:
            k_rope = mtp.copy_to_tensor_model_parallel_region(k_rope)
        s, b = q.shape[:2]
        h = self.heads
        q_nope, q_rope = q.view(s, b, h, self.q_head_dim).split([self.nope, self.rope_dim], dim=-1)
        k_nope, v = kv.view(s, b, h, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, self._rope(q_rope, cos, sin)], dim=-1)
        k_rope = self._rope(k_rope.unsqueeze(-2), cos, sin)                              # [S, B, 1, rope]
        k = torch.cat([k_nope, k_rope.expand(s, b, h, self.rope_dim)], dim=-1)
        out = self._attend(q, k, v, ctx)
        out, _ = self.linear_proj(out.reshape(s, b, h * self.v_dim))
        return out
