"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention whose queries each see only the
keys their layer's lightning indexer selected (:mod:`parallm.model.layers.indexer`), exact to transformers'
masked dense attention (``DeepseekV32Attention`` / ``GlmMoeDsaAttention``) and with memory linear in S.

**Sparse attention in the latent space.** With ``W_uk`` / ``W_uv`` a head's rows of ``kv_b_proj`` (``k_nope = W_uk
c``, ``v = W_uv c`` for the normed latent ``c``), a query's score against key ``j`` is ``q_nope . W_uk c_j + q_rope
. k_rope_j = [W_uk^T q_nope; q_rope] . [c_j; k_rope_j]`` and its output ``W_uv sum_j p_j c_j``. So the queries are
taken into the latent space once (``[.., heads, kv_lora_rank + rope]``), every head shares one key row per token
(``[c; k_rope]``, ``kv_lora_rank + rope`` wide), and attention runs over the selected rows only
(:class:`SparseLatentAttention`): blocks of queries gather their selected rows, attend (fp32 softmax with its
log-sum-exp), and the backward recomputes each block from the saved log-sum-exp. Kept for the backward: the
latent-space queries and outputs and the key rows, linear in S; no ``[S, S]`` score or mask exists. The same
products as the dense path, summed in another order: fp32 results agree to rounding.

A layer whose batch has no query that sees more than ``topk`` keys selects every visible key: it runs MLA's dense
path (:meth:`MLAttention.dense_attention`), the same result. GLM-5's ``shared`` layers run no indexer and reuse
the selection of the last ``full`` layer before them, kept on the batch's layer context until its last reader
(under recomputation, until the source layer's replay, which reuses it); a shared layer and its source must
therefore sit in the same pipeline stage (:func:`check_dsa_stages`).

**Layouts.** TP: MLA's heads split as for DeepSeek-V3 (each rank's heads' ``W_uk`` / ``W_uv`` rows); the latent
key rows enter the TP region as a copy (under sequence parallelism: all-gathered, gradients reduce-scattered).
Context parallelism: the key rows (``kv_lora_rank + rope`` values a token) are all-gathered over the CP group and
put in global order (backward: gradients reduce-scattered onto their owners), whichever ``cp_attn`` the model
was built with; each rank's queries attend to their selected rows. Packed streams: the indexer selects within
each document.

**Kernels** (:data:`SPARSE_KERNELS`, chosen at build: :func:`resolve_sparse_kernel`, kept as ``kernel`` and
compared across ranks like the other kernel choices): ``"torch"``, the blocked gather kernel above, on any device
and dtype (fp32 accumulation); ``"flash-mla"`` on CUDA in bf16 where the ``flash_mla`` package is installed:
FlashMLA's sparse prefill (``flash_mla_sparse_fwd``) for the forward when the shapes fit it (value width 512;
the heads per rank padded with zero heads to 64 or 128, as tp 4 / 8 leave 8-32, and discarded; the top-k padded
with empty slots to a multiple of 64; otherwise the torch kernel, with a warning naming why, once), the torch
kernel's blocked backward (FlashMLA has none). ``kernel_ran``: what the layer's last sparse call ran. The
FlashMLA path is written and tested on CPU with the kernel emulated, not run on a GPU (scripts/gpu_checks/dsa.py
checks it on a device).

**Selections** are int32 ``[queries, topk]`` with -1 in empty slots (FlashMLA's form). A layer's selection is
kept on the layer context only while a later ``shared`` layer needs it (see :meth:`DSAttention._selection`).
"""

from __future__ import annotations

import warnings

import torch

from ...parallel.megatron_import import import_megatron
from ..context_parallel import ContextSplit
from .attention import PaddedRows
from .blocks import add_sink, sink_grad
from .indexer import Indexer, key_ranges
from .mla import MLAttention
from .sparse_union import UNION_ROWS, union_backward, union_forward, union_of

mtp = import_megatron().tensor_parallel

# fp32 elements of the gathered key rows of one block of queries in the sparse attention
GATHER_BUDGET = 1 << 24


def _block_rows(topk: int, width: int, budget: int | None) -> int:
    return max(1, (GATHER_BUDGET if budget is None else budget) // max(1, topk * width))


def _gather_rows(kv, index):
    """The key rows ``[b, k, D]`` (fp32) of the selection ``index`` ``[b, k]`` (int32, -1: an empty slot, whose
    row is row 0, masked by the caller) and the mask of the slots that hold a key."""
    valid = index >= 0
    rows = kv.index_select(0, index.clamp_min(0).reshape(-1)).view(index.shape + (kv.shape[-1],)).float()
    return rows, valid


def _block_forward(q, kv, index, scale: float, dv: int):
    """One block: q ``[b, h, D]``, the key rows ``kv`` ``[N, D]``, index ``[b, k]`` (-1: empty) -> (out ``[b, h,
    dv]`` fp32, lse ``[b, h]`` fp32)."""
    rows, valid = _gather_rows(kv, index)                                                       # [b, k, D]
    scores = torch.bmm(q.float(), rows.transpose(1, 2)) * scale                                 # [b, h, k]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    den = p.sum(-1, keepdim=True)
    out = torch.bmm(p, rows[..., :dv]) / den.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m + torch.log(den)).squeeze(-1)                                 # -inf for a query that sees nothing
    return out, lse


class SparseLatentAttention(torch.autograd.Function):
    """``out[t, h] = softmax_j(scale * q[t, h] . kv[index[t, j]]) over valid j, of kv[index[t, j], :dv]`` (with a
    per-head ``sink`` logit in the denominator when given).

    q ``[Q, h, D]``, kv ``[N, D]`` (one key row per token, shared by every head; its first ``dv`` channels are the
    value), index ``[Q, k]`` int32 (-1: an empty slot, FlashMLA's form; or any object with ``.shape`` whose
    ``index[a:e]`` makes those rows' int32 index, block by block: DeepSeek-V4's, never whole). Returns ``[Q, h,
    dv]`` in q's dtype (fp32 softmax and accumulation); a query without a valid key gets zeros. Blocks of
    queries: at most :data:`GATHER_BUDGET` gathered elements at a time; the backward recomputes each block from
    the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, q, kv, index, scale, dv, budget, sink=None, paths=None):
        n_q, h, _ = q.shape
        out = torch.empty(n_q, h, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_q, h, dtype=torch.float32, device=q.device)
        step = _block_rows(index.shape[1], kv.shape[-1], budget)
        union = paths is not None         # blocks on the union path where it pays (sparse_union)
        if union:
            step = min(step, UNION_ROWS)
        for rows, idx in _blocks(index, n_q, step, union):
            plan = union_of(idx) if union else None
            if plan is None:
                out[rows], lse[rows] = _block_forward(q[rows], kv, idx, scale, dv)
            else:
                out[rows], lse[rows] = union_forward(q[rows], kv, *plan, scale, dv)
            if union:
                key = "gathered" if plan is None else "union"
                paths[key] = paths.get(key, 0) + 1
        if sink is not None:         # each head's sink logit in the denominator: out and lse corrected once
            out, lse = add_sink(out, lse, sink)
        lazy = not isinstance(index, torch.Tensor)      # an index made block by block (index[a:e], .shape)
        ctx.save_for_backward(q, kv, None if lazy else index, out, lse, sink)
        ctx.scale, ctx.dv, ctx.step, ctx.lazy, ctx.union = scale, dv, step, index if lazy else None, union
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        *saved, sink = ctx.saved_tensors
        if ctx.lazy is not None:
            saved[2] = ctx.lazy
        ctx.saved = tuple(saved)
        dq, dkv, *rest = _sparse_backward(ctx, grad)
        dsink = None
        if sink is not None and ctx.needs_input_grad[6]:
            dsink = sink_grad(saved[3], saved[4], grad, sink).to(sink.dtype)
        return (dq, dkv, *rest, dsink, None)


def _blocks(index, n_q: int, step: int, union: bool):
    """The kernel's blocks: ``(rows, index rows)``, rows a slice of ``step`` queries; on the union path, where
    the index has an ``order`` (V4's padded batches: the queries document by document), ``step`` queries of that
    order (a long tensor), so that a block's queries share their keys."""
    order = getattr(index, "order", None) if union else None
    for a in range(0, n_q, step):
        if order is None:
            yield slice(a, a + step), index[a:a + step]
        else:
            rows = order[a:a + step]
            yield rows, index.take(rows)


def _sparse_backward(ctx, grad):
    """The blocked backward of the sparse latent attention from ``ctx.saved`` = (q, kv, index, out fp32, lse fp32):
    each block's gathered rows and probabilities recomputed."""
    q, kv, index, out, lse = ctx.saved
    del ctx.saved       # kept on ctx, ``out`` (this node's own output in fp32) would hold the node: never freed
    scale, dv, step = ctx.scale, ctx.dv, ctx.step
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    g_all = grad.float()
    union = getattr(ctx, "union", False)
    for qr, idx in _blocks(index, q.shape[0], step, union):
        plan = union_of(idx) if union else None
        if plan is not None:                  # the union path (the forward's choice: the same index)
            dq[qr], drows = union_backward(q[qr], kv, *plan, out[qr], lse[qr], g_all[qr], scale, dv)
            dkv.index_add_(0, plan[0], drows)
            continue
        rows, ok = _gather_rows(kv, idx)
        qb = q[qr].float()
        scores = (torch.bmm(qb, rows.transpose(1, 2)) * scale).masked_fill(~ok[:, None, :], float("-inf"))
        base = lse[qr]
        base = torch.where(torch.isinf(base), torch.zeros_like(base), base)
        p = torch.exp(scores - base[..., None])                                  # [b, h, k]
        g = g_all[qr]
        dp = torch.bmm(g, rows[..., :dv].transpose(1, 2))                       # [b, h, k]
        delta = (g * out[qr]).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[qr] = torch.bmm(ds, rows)
        drows = torch.bmm(ds.transpose(1, 2), qb)                                # [b, k, D]
        drows[..., :dv] += torch.bmm(p.transpose(1, 2), g)
        dkv.index_add_(0, idx.clamp_min(0).reshape(-1), drows.reshape(-1, kv.shape[-1]))   # empty slots: ds = 0
    return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None


def sparse_latent_attention(q, kv, index, *, scale: float, dv: int, budget: int | None = None, sink=None,
                            paths: dict | None = None):
    """:class:`SparseLatentAttention` (the ``"torch"`` kernel). ``sink``: None, or each head's sink logit ``[h]``
    (fp32) counted once in every query's softmax denominator (gpt-oss / DeepSeek-V4 sinks; its gradient
    ``-sum_t p_sink[t, h] * (grad[t, h] . out[t, h])``). ``paths``: None (every block gathered), or a dict: blocks
    of :data:`~parallm.model.layers.sparse_union.UNION_ROWS` queries each take the union path where it pays
    (:func:`~parallm.model.layers.sparse_union.union_of`), and ``paths["union"]`` / ``paths["gathered"]`` count
    the forward's blocks of each."""
    return SparseLatentAttention.apply(q, kv, index, scale, dv, budget, sink, paths)


try:  # optional CUDA kernel: FlashMLA's sparse prefill (forward only)
    from flash_mla import flash_mla_sparse_fwd as _flash_mla_sparse_fwd
except Exception:  # noqa: BLE001 - not installed / no CUDA
    _flash_mla_sparse_fwd = None


FLASH_MLA_DEVICE = "cuda"       # where FlashMLA runs (tests emulate the kernel on "cpu")
_warned: set[str] = set()


def flash_mla_unusable(q, kv, index, dv: int) -> str | None:
    """Why FlashMLA's sparse prefill cannot take these shapes (None: it can): it needs the package, a CUDA bf16
    query, value width 512 and key rows 512 or 576 wide. The heads per rank are padded to 64 / 128 (any count)
    and the top-k to a multiple of 64 (empty slots) by :func:`flash_mla_sparse`."""
    if _flash_mla_sparse_fwd is None:
        return "the flash_mla package is not installed"
    if q.device.type != FLASH_MLA_DEVICE or q.dtype != torch.bfloat16:
        return f"FlashMLA runs on CUDA in bf16 (the queries are {q.dtype} on {q.device.type})"
    if dv != 512 or kv.shape[-1] not in (512, 576):
        return (f"FlashMLA's sparse prefill needs kv_lora_rank 512 and key rows 512 / 576 wide (this layer: "
                f"{dv}, {kv.shape[-1]})")
    return None


def _pad_heads(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """q ``[T, h, D]`` with zero heads appended up to 64 (h <= 64) or 128 (else, per slice of 128: see
    :class:`FlashMLASparse`); returns (padded q, h)."""
    h = q.shape[1]
    want = 64 if h <= 64 else 128 * -(-h // 128)
    return (q if want == h else torch.cat([q, q.new_zeros(q.shape[0], want - h, q.shape[2])], 1)), h


def _flash_forward(q, kv, index, scale: float, dv: int) -> torch.Tensor:
    """FlashMLA's sparse prefill on q ``[T, h, D]`` of any head count (zero heads up to 64 / 128, 128 at a time,
    discarded) and a top-k padded with empty slots (-1) to a multiple of 64: out ``[T, h, dv]``."""
    qp, h = _pad_heads(q)
    k = index.shape[1]
    if k % 64:
        index = torch.cat([index, index.new_full((index.shape[0], 64 - k % 64), -1)], 1)
    kv3, idx3 = kv[:, None].contiguous(), index[:, None, :].to(torch.int32).contiguous()
    step = 64 if qp.shape[1] == 64 else 128
    outs = [_flash_mla_sparse_fwd(qp[:, a:a + step].contiguous(), kv3, idx3, scale, d_v=dv)[0]
            for a in range(0, qp.shape[1], step)]
    return torch.cat(outs, 1)[:, :h] if len(outs) > 1 else outs[0][:, :h]


class FlashMLASparse(torch.autograd.Function):
    """FlashMLA's sparse prefill for the forward (``flash_mla_sparse_fwd(q, kv[:, None], indices, scale,
    d_v=512)``, empty slots -1; heads padded: :func:`_flash_forward`); the backward is
    :class:`SparseLatentAttention`'s blocked recomputation, its log-sum-exp recomputed too (nothing taken from
    FlashMLA's base-2 lse). Written, not run on a GPU (tested on CPU with the kernel emulated)."""

    @staticmethod
    def forward(ctx, q, kv, index, scale, dv, budget):
        out = _flash_forward(q, kv, index, scale, dv)
        ctx.save_for_backward(q, kv, index, out)
        ctx.scale, ctx.dv, ctx.step = scale, dv, _block_rows(index.shape[1], kv.shape[-1], budget)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kv, index, out = ctx.saved_tensors
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for a in range(0, q.shape[0], ctx.step):
            lse[a:a + ctx.step] = _block_forward(q[a:a + ctx.step], kv, index[a:a + ctx.step], ctx.scale, ctx.dv)[1]
        ctx.saved = (q, kv, index, out.float(), lse)
        return _sparse_backward(ctx, grad)


def flash_mla_sparse(q, kv, index, *, scale: float, dv: int, budget: int | None = None):
    """FlashMLA's forward where it can run (:func:`flash_mla_unusable`), else the torch kernel, with a warning
    naming why (once per reason)."""
    why = flash_mla_unusable(q, kv, index, dv)
    if why is not None:
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"sparse attention: the 'flash-mla' kernel falls back to 'torch': {why}", stacklevel=2)
        return sparse_latent_attention(q, kv, index, scale=scale, dv=dv, budget=budget)
    return FlashMLASparse.apply(q, kv, index, scale, dv, budget)


# the sparse attention kernels: "torch" (any device, any dtype) and "flash-mla" (FlashMLA's sparse prefill forward
# where installed and the shapes fit, else torch; CUDA, bf16)
SPARSE_KERNELS = {"torch": sparse_latent_attention, "flash-mla": flash_mla_sparse}


def resolve_sparse_kernel(device, dtype) -> str:
    """"flash-mla" on CUDA in bf16 with FlashMLA installed, else "torch"."""
    from ...parallel.state import as_device
    cuda = as_device(device).type == "cuda"
    return "flash-mla" if _flash_mla_sparse_fwd is not None and cuda and dtype == torch.bfloat16 else "torch"


def check_dsa_stages(spec, stage_layers) -> None:
    """ValueError unless every shared-indexer layer sits in the same pipeline stage as the layer whose selection
    it reuses. ``stage_layers``: every (virtual) stage's layers (ranges), the same list on every rank, so every
    rank raises alike."""
    if spec.dsa is None or not spec.dsa.shared:
        return
    for layers in stage_layers:
        for layer in layers:
            source = spec.dsa.source(layer)
            if layer in spec.dsa.shared and source not in layers:
                raise ValueError(f"layer {layer} reuses the top-k selection of layer {source} (indexer_types: "
                                 f"'shared'), which another pipeline stage holds (this stage: layers "
                                 f"{layers.start}-{layers.stop - 1}); choose a split that starts every stage on "
                                 "a 'full' layer (build_model(layers_per_stage=[...]))")


class DSAttention(MLAttention):
    """Multi-head latent attention with DeepSeek Sparse Attention (see the module docstring): MLA's parameters,
    plus ``indexer`` (:class:`~parallm.model.layers.indexer.Indexer`) on layers that run their own (None on
    GLM-5's shared layers). Called like :class:`MLAttention`; ``layer_number``: the global layer index."""

    def __init__(self, spec, config, tp, device=None, *, backend, norm, cp_group=None, cp_attn="allgather",
                 layer_number: int):
        super().__init__(spec, config, tp, device, backend=backend, norm=norm, cp_group=cp_group,
                         cp_attn=cp_attn)
        self.layer_number = layer_number
        self.source = spec.dsa.source(layer_number)
        # the last shared layer that reads this layer's (a shared layer: its source's) selection; None: none
        readers = [i for i in spec.dsa.shared if spec.dsa.source(i) == self.source]
        self.last_reader = max(readers) if readers else None
        self.topk = spec.dsa.topk
        self.indexer = Indexer(spec, config.params_dtype, device) if spec.has_indexer(layer_number) else None
        self.kernel = resolve_sparse_kernel(device if device is not None else "cpu", config.params_dtype)
        self.kernel_ran = None        # the kernel the last sparse call ran ("flash-mla" may fall back to "torch")
        self.scale = spec.mla.scale          # the softmax scale, yarn's mscale^2 included

    def forward(self, x, cos, sin, ctx):
        """As :meth:`MLAttention.forward`; ctx: a :class:`PaddedRows` (None: a batch without padding), a
        :class:`Packing` or a :class:`ContextSplit`."""
        if ctx is None:
            ctx = PaddedRows(torch.ones(x.shape[1], x.shape[0], dtype=torch.bool, device=x.device))
        q_resid = self.q_layernorm(self.linear_q_down_proj(x))
        q, _ = self.linear_q_up_proj(q_resid)                                            # SP: gathered here
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora, self.rope_dim], dim=-1)
        latent = self.kv_layernorm(latent)
        ranges = key_ranges(ctx)
        if ranges.longest <= self.topk:          # every visible key is selected: the dense path is the same
            return self.dense_attention(q, latent, k_rope, cos, sin, ctx)
        index = self._selection(x, q_resid, cos, sin, ctx, ranges)
        return self._sparse(q, latent, k_rope, cos, sin, ctx, index)

    def _selection(self, x, q_resid, cos, sin, ctx, ranges):
        """This layer's (or, shared, its source layer's) selection ``[rows * width, topk]`` int32 (-1: empty) for
        every query row. Kept on ``ctx`` (``_dsa_selected``) only while a later shared layer needs it: without
        recomputation the last reader drops it; under recomputation (``ctx.replays_layers``) the readers' replays
        in the backward read it too, and the source's own replay, which comes after theirs, takes it back (no
        second indexer run) and drops it."""
        held = ctx.__dict__.setdefault("_dsa_selected", {})
        if self.indexer is None:
            if self.source not in held:
                raise RuntimeError(f"layer {self.layer_number} reuses layer {self.source}'s top-k selection, which "
                                   "this batch has not computed (it must run first, in the same stage)")
            index = held[self.source]
            if self.layer_number == self.last_reader and not getattr(ctx, "replays_layers", False):
                del held[self.source]
            return index
        if self.layer_number in held:        # this layer's replay under recomputation: its readers' came before
            return held.pop(self.layer_number)
        cp = isinstance(ctx, ContextSplit)
        sp_group = _tp_group() if self.sequence_parallel else None
        index = self.indexer.select(x, q_resid, cos, sin, ranges, sp_group=sp_group, cp_split=ctx if cp else None,
                                    cp_group=self.cp_group if cp else None)
        if self.last_reader is not None:
            held[self.layer_number] = index
        return index

    def _kv_b_weight(self):
        """``kv_b_proj``'s local rows as the layer uses them: with a LoRA adapter (enabled), plus its update."""
        linear = self.linear_kv_up_proj
        w = linear.weight
        lora = getattr(linear, "lora", None)
        if lora is not None and lora.state.enabled:
            slot = lora.slots[0]
            a, b = lora.factors(slot.part)
            if not self.sequence_parallel and self.tp > 1:
                # A is replicated and each rank's rows of B use it: its gradient is the sum over TP of every
                # rank's part (as the adapter's own path makes it; under sequence parallelism finalize_grads sums
                # it, its placement saying tp_sum)
                a = mtp.copy_to_tensor_model_parallel_region(a)
            w = w + ((b.float() @ a.float()) * slot.scaling).to(w.dtype)
        return w

    def _sparse(self, q, latent, k_rope, cos, sin, ctx, index):
        from ...parallel.comm import gather_rows_sum_back
        if self.sequence_parallel:
            latent = mtp.gather_from_sequence_parallel_region(latent.contiguous(), tensor_parallel_output_grad=True)
            k_rope = mtp.gather_from_sequence_parallel_region(k_rope.contiguous(), tensor_parallel_output_grad=True)
        s, b = q.shape[:2]
        h, dl = self.heads, self.kv_lora
        q_nope, q_rope = q.view(s, b, h, self.q_head_dim).split([self.nope, self.rope_dim], dim=-1)
        w_uk, w_uv = self._kv_b_weight().view(h, self.nope + self.v_dim, dl).split([self.nope, self.v_dim], dim=1)
        q_lat = torch.einsum("sbhn,hnd->sbhd", q_nope, w_uk)
        q = torch.cat([q_lat, self._rope(q_rope, cos, sin)], dim=-1).reshape(s * b, h, dl + self.rope_dim)
        keys = torch.cat([latent, self._rope(k_rope.unsqueeze(-2), cos, sin).squeeze(-2)], dim=-1)   # [S, B, D]
        if not self.sequence_parallel and self.tp > 1:
            # into the TP region after the concatenation: the copy's backward all-reduces its gradient in place,
            # which must be a whole tensor (the halves of a concatenation's gradient are strided views, and an
            # in-place all-reduce of one leaves it unreduced)
            keys = mtp.copy_to_tensor_model_parallel_region(keys)
        if isinstance(ctx, ContextSplit):
            keys = gather_rows_sum_back(keys, self.cp_group).index_select(0, ctx.order)
        kv = keys.reshape(-1, keys.shape[-1])
        self.kernel_ran = self.kernel if self.kernel != "flash-mla" or flash_mla_unusable(q, kv, index, dl) is None \
            else "torch"
        out = SPARSE_KERNELS[self.kernel](q, kv, index, scale=self.scale, dv=dl)
        out = torch.einsum("thd,hvd->thv", out, w_uv).reshape(s, b, h * self.v_dim)
        out, _ = self.linear_proj(out)
        return out


def _tp_group():
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_group()
