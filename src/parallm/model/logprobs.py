"""Next-token log-probs and entropy straight from the last hidden states: vocab-parallel and in token chunks.

RL trainers need, per token, the log-prob of the next (sampled) token and the entropy of the distribution,
never the distribution itself. With the vocabulary split over TP ranks (rank r holds head rows
``[r*Vp/tp, (r+1)*Vp/tp)``), each rank computes, for its own columns only,

    m_r = max_j z_j,   S_r = sum_j exp(z_j - m_r),   A_r = sum_j exp(z_j - m_r) (z_j - m_r),
    t_r = z_target if the target column is one of r's columns else 0,        with z = logits / temperature

and the ranks combine these per-token numbers: the max is all-reduced (MAX), then ``S`` / ``A`` rescaled to the
global max and all-reduced (SUM) together with ``t``. That is O(tokens) traffic; no rank ever holds a gathered
``[..., V]``. Then ``logZ = m + log S``, ``logprob = t - logZ`` and ``entropy = log S - A / S``.

Token chunks: the logits of at most ``chunk`` tokens by ``V/tp`` columns exist at any time, in the forward and
in the backward. The backward recomputes a chunk's logits from the saved hidden states (one extra matmul)
instead of keeping them; per token it keeps only ``logZ`` and the entropy. The gradient with respect to the
scaled logits of token t is ``g_lp (onehot_t - p) - g_H p (log p + H)``.

Vocabulary padding columns (``Vp > V``) are never part of the sums: each rank uses only its real rows of the
head weight.

Final logit soft-capping (``DecoderSpec.final_logit_softcap``, Gemma's ``final_logit_softcapping``): each chunk's
logits are capped, ``cap * tanh(logits / cap)``, before the temperature and everything above reads them (as
transformers caps its ``logits``); the backward multiplies the capped logits' gradient by ``1 - tanh^2``.

A LoRA adapter on the head (``lm_head``: :mod:`parallm.model.layers.lora`) adds ``(u B^T) * scaling`` to every
chunk's logits, with ``u = A x`` ``[N, r]`` computed before the TP region and entering it as the hidden states
do (B: this rank's ``[Vp/tp, r]`` rows, its padding rows never used); the backward gives ``u`` and B their
gradients from the same recomputed chunks (``g_u = s g_z B``, ``g_B = s g_z^T u``).

The hidden states enter through megatron-core's TP mappings (identity forward, all-reduce of the partial input
gradient backward; under sequence parallelism: all-gather forward, reduce-scatter backward), as a
ColumnParallelLinear's input does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .params import grad_of

OUTPUTS = (None, "logprobs", "logprobs+entropy")

# Default token chunk, by the bytes of one chunk's fp32 logits ([chunk, V/tp]) buffer, per device type. Smaller
# chunks cost matmul efficiency (CPU bench: 512 x 76k x 256 head, 55-token chunks 1.22x the time of 256-token
# ones), and every chunk re-reads the head weight: on a GPU a few MiB would re-read a 152k-vocab head every ~55
# tokens, so the GPU budget is large (2 GiB: about 3.5k tokens at V/tp = 152k); on CPU 32 MiB keeps the buffer
# in reach of the caches.
DEFAULT_CHUNK_BYTES = {"cpu": 32 << 20, "cuda": 2 << 30}


class TokenStats(NamedTuple):
    """``output="logprobs+entropy"``: both fp32 ``[B, S]``. ``logprobs[b, t]`` is the log-prob of
    ``input_ids[b, t+1]`` (0 at ``t = S-1``), ``entropy[b, t]`` the entropy of the next-token distribution."""
    logprobs: torch.Tensor
    entropy: torch.Tensor


@dataclass(frozen=True)
class StatsRequest:
    """What the last stage computes instead of logits."""
    entropy: bool
    temperature: float
    chunk: int | None = None   # tokens per chunk (None: DEFAULT_CHUNK_BYTES of fp32 logits for the device)
    # Add the head weight's gradient straight into its existing fp32 main_grad / grad (what forward_backward
    # asks for; see _VocabParallelStats.backward), instead of returning it to autograd.
    accumulate: bool = False


def check_output(output, temperature, *, task: str, token_chunk=None) -> StatsRequest | None:
    """Validate ``output`` / ``temperature`` / ``token_chunk`` for a model of ``task``; raise ValueError naming
    the value. Returns the request for the head (None: plain logits / values)."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if token_chunk is not None and (isinstance(token_chunk, bool) or not isinstance(token_chunk, int)
                                    or token_chunk < 1):
        raise ValueError(f"token_chunk must be a positive integer or None, got {token_chunk!r}")
    if task != "causal_lm":
        if output is not None:
            raise ValueError(f"output={output!r} needs a causal_lm model; this is a {task} model, whose only "
                             "output is its values (output=None)")
        if temperature != 1.0:
            raise ValueError(f"temperature={temperature!r} applies to causal_lm log-probs; a {task} model "
                             "takes temperature=1.0")
        return None
    if output is None:
        return None
    return StatsRequest(entropy=output == "logprobs+entropy", temperature=float(temperature), chunk=token_chunk)


def chunk_tokens(request: StatsRequest, columns: int, device) -> int:
    """Tokens per head chunk: ``request.chunk``, or as many as fit :data:`DEFAULT_CHUNK_BYTES` of fp32 logits
    over ``columns`` vocabulary columns on ``device``'s type (other devices: the CUDA budget)."""
    if request.chunk is not None:
        return request.chunk
    budget = DEFAULT_CHUNK_BYTES.get(torch.device(device).type, DEFAULT_CHUNK_BYTES["cuda"])
    return max(1, budget // (4 * max(columns, 1)))


class _VocabParallelStats(torch.autograd.Function):
    """hidden ``[N, H]`` (every TP rank the same tokens), weight ``[Vp/tp, H]`` (this rank's head rows, of which
    the first ``real`` are real vocabulary), targets ``[N]`` (global token ids) -> logprobs ``[N]``, entropy
    ``[N]`` (fp32; entropy all zeros unless requested). The gradient of the hidden states is this rank's partial
    (its columns only): the caller's TP mapping sums it. ``u`` ``[N, r]`` / ``lora_b`` ``[Vp/tp, r]``
    / ``scaling``: a head adapter's (None, None, 1.0 without one); u's gradient is this rank's partial too."""

    @staticmethod
    def forward(ctx, hidden, weight, u, lora_b, scaling, targets, real, vocab_start, temperature, want_entropy, chunk,
                group, accumulate, softcap):
        n = hidden.shape[0]
        device = hidden.device
        w = weight[:real]
        lora = (u, lora_b[:real], scaling) if u is not None else None
        m_loc = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
        sums = torch.zeros(3, n, dtype=torch.float32, device=device)   # S_r, A_r, t_r
        local = targets - vocab_start
        in_range = (local >= 0) & (local < real)
        local = local.clamp(0, max(real - 1, 0))
        if real > 0:
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                z, _ = _scaled_logits(hidden[a:b], w, temperature, lora, a, b, softcap=softcap)
                m = z.max(dim=1).values
                z.sub_(m[:, None])                                        # z - m_r
                sums[2, a:b] = z.gather(1, local[a:b, None]).squeeze(1).add_(m)
                if want_entropy:
                    e = torch.exp(z)
                    sums[0, a:b] = e.sum(dim=1)
                    # row-wise dot product: sum_j e_j (z_j - m_r), without a third [chunk, V/tp] buffer
                    sums[1, a:b] = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)
                    del e
                else:
                    sums[0, a:b] = z.exp_().sum(dim=1)
                m_loc[a:b] = m
                del z
        sums[2].masked_fill_(~in_range, 0.0)
        m = m_loc.clone()
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # rescale to the global max (a rank without real columns contributes nothing)
        has = sums[0] > 0
        delta = torch.where(has, m_loc - m, torch.zeros_like(m))
        scale = torch.where(has, torch.exp(delta), torch.zeros_like(m))
        sums[1] = scale * (sums[1] + delta * sums[0])
        sums[0] = scale * sums[0]
        if group is not None:
            dist.all_reduce(sums, group=group)
        log_s = torch.log(sums[0])
        logz = m + log_s
        logprobs = sums[2] - logz
        entropy = log_s - sums[1] / sums[0] if want_entropy else torch.zeros_like(logz)
        ctx.save_for_backward(hidden, weight, u, lora_b, local, in_range, logz, entropy)
        ctx.args = (real, temperature, want_entropy, chunk, accumulate, scaling, softcap)
        ctx.mark_non_differentiable(*(() if want_entropy else (entropy,)))
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        hidden, weight, u, lora_b, local, in_range, logz, entropy = ctx.saved_tensors
        real, temperature, want_entropy, chunk, accumulate, scaling, softcap = ctx.args
        n = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        lora = (u, lora_b[:real], scaling) if u is not None else None
        # always a tensor where one is wanted: the TP mappings' backward collectives run on every rank
        grad_u = torch.zeros_like(u) if ctx.needs_input_grad[2] else None
        grad_b = torch.zeros(lora_b.shape, dtype=torch.float32, device=lora_b.device) \
            if ctx.needs_input_grad[3] else None
        grad_weight, fused = None, False
        if ctx.needs_input_grad[1]:
            # Gradient accumulation fusion (as megatron-core's): when the weight already has an fp32 gradient
            # buffer, add into it and hand autograd nothing, so no second [V/tp, H] buffer exists. Not under
            # Megatron's DDP (it tracks its own main_grad additions), and only when the caller asked for it.
            existing = _existing_fp32_grad(weight) if accumulate else None
            if existing is not None:
                grad_weight, fused = existing, True
            else:
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        nones = [None] * 10

        def grads():
            return (grad_hidden, None if fused else _as_param_grad(grad_weight, weight), grad_u,
                    _as_param_grad(grad_b, lora_b), *nones)
        if real == 0 or (g_lp is None and g_h is None):
            return grads()
        if g_lp is None:
            g_lp = torch.zeros_like(logz)
        use_h = want_entropy and g_h is not None
        # the target's gradient on this rank's columns only
        g_target = g_lp.masked_fill(~in_range, 0.0)
        w = weight[:real]
        gw = grad_weight[:real] if grad_weight is not None else None
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            z, slope = _scaled_logits(hidden[a:b], w, temperature, lora, a, b, softcap=softcap, slope=True)
            z.sub_(logz[a:b, None])                                       # log p
            if use_h:
                p = torch.exp(z)
                # -p (g_lp + g_H (log p + H))
                z.add_(entropy[a:b, None]).mul_(g_h[a:b, None]).add_(g_lp[a:b, None]).mul_(p).neg_()
                del p
            else:
                z.exp_().mul_(g_lp[a:b, None].neg())                      # -p g_lp
            grad_z = z
            grad_z.scatter_add_(1, local[a:b, None], g_target[a:b, None])
            if temperature != 1.0:
                grad_z.div_(temperature)
            if slope is not None:                                         # through cap * tanh(z / cap)
                grad_z.mul_(slope)
                del slope
            gz = grad_z.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(gz, w, out=grad_hidden[a:b])
            if gw is not None:
                _add_outer(gw, gz, hidden[a:b])
            if lora is not None:
                _lora_grads(gz, lora, a, b, grad_u, grad_b)
            del grad_z, gz
        return grads()


def _add_outer(acc: torch.Tensor, gz: torch.Tensor, x: torch.Tensor) -> None:
    """``acc += gz^T x`` (acc fp32; the product in gz's dtype)."""
    if acc.dtype == gz.dtype and x.dtype == gz.dtype:
        acc.addmm_(gz.t(), x)
    else:
        acc.add_((gz.t() @ x.to(gz.dtype)).float())


def _lora_grads(gz, lora, a: int, b: int, grad_u, grad_b) -> None:
    """The head adapter's share of one token chunk's gradient ``gz`` ``[chunk, real]`` (the logits' dtype): with
    ``z += (u B^T) s``, ``g_u = (s g_z) B`` and ``g_B += (s g_z)^T u`` (B's real rows; its padding rows get 0)."""
    u, lora_b, scaling = lora
    gzs = gz * scaling
    if grad_u is not None:
        grad_u[a:b] = gzs @ lora_b
    if grad_b is not None:
        _add_outer(grad_b[:lora_b.shape[0]], gzs, u[a:b])


def _existing_fp32_grad(weight: torch.Tensor) -> torch.Tensor | None:
    if hasattr(weight, "grad_added_to_main_grad"):      # Megatron's DDP owns this parameter's main_grad
        return None
    g = grad_of(weight)
    if g is not None and g.dtype == torch.float32 and g.shape == weight.shape and g.is_contiguous():
        return g
    return None


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, lora=None, a: int = 0,
                   b: int = 0, *, softcap: float | None = None, slope: bool = False):
    """fp32 ``hidden @ weight.T / temperature`` (the matmul in the parameters' dtype, as transformers' head), plus
    a head adapter's ``(u[a:b] B^T) * scaling`` (``lora``: ``(u, B's real rows, scaling)``; added in the logits'
    dtype, as PEFT adds it to the base layer's output), soft-capped to ``softcap * tanh(z / softcap)`` before the
    temperature when ``softcap`` is set. Returns ``(z, d capped / d z)``: the slope ``1 - tanh^2`` when
    ``slope`` and ``softcap`` are set, else None."""
    z = hidden @ weight.t()
    if lora is not None:
        u, lora_b, scaling = lora
        z = z + (u[a:b] @ lora_b.t()) * scaling
    if z.dtype != torch.float32:
        z = z.float()
    grad = None
    if softcap is not None:
        z = z.div(softcap).tanh_()
        if slope:
            grad = 1.0 - z * z
        z.mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z, grad


def _as_param_grad(grad: torch.Tensor | None, weight: torch.Tensor):
    return grad if grad is None or grad.dtype == weight.dtype else grad.to(weight.dtype)


def vocab_parallel_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, real: int,
                         vocab_start: int, request: StatsRequest, group, lora=None,
                         softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logprobs, entropy), fp32 ``[N]``; see the module docstring. ``group``: the TP group (None or a
    group of one: no communication). ``lora``: ``(u [N, r], B [Vp/tp, r], scaling)`` of a head adapter, or
    None. ``softcap``: the final logit soft-cap (None: raw logits)."""
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    chunk = chunk_tokens(request, real, hidden.device)
    u, lora_b, scaling = lora if lora is not None else (None, None, 1.0)
    return _VocabParallelStats.apply(hidden, weight, u, lora_b, scaling, targets, real, vocab_start,
                                     request.temperature, request.entropy, chunk, group, request.accumulate,
                                     softcap)


def token_stats_head(chunk, x: torch.Tensor, packing, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     request: StatsRequest, *, split=None):
    """The last stage's head for ``output="logprobs"`` / ``"logprobs+entropy"``.

    ``x``: the final-normed hidden states, ``[S, B, H]`` (padded), ``[T, 1, H]`` (packed) or ``[T/tp, 1, H]``
    (packed + sequence parallel); ``packing``: the chunk's :class:`Packing` (packed) or None. Only real tokens
    (attention_mask 1) are computed; padded positions are 0. Returns fp32 ``[B, S]`` logprobs, or a
    :class:`TokenStats`.

    ``split``: under context parallelism, this rank's :class:`parallm.model.context_parallel.ContextSplit`
    (``x`` then holds its slots): its real tokens are computed with the next-token targets the split took from
    the full batch, and only the ``[B, S]`` results are gathered over the CP group.
    """
    from ..parallel.megatron_import import import_megatron
    mtp = import_megatron().tensor_parallel

    group = chunk.dims.tp_group
    factors = _head_adapter(chunk)
    if split is not None:
        return _split_stats(chunk, x, split, request, mtp, factors)
    b, s = input_ids.shape
    # next-token targets in [B, S]; the last position has none (its log-prob is 0)
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    has_next = torch.ones_like(input_ids, dtype=torch.bool)
    has_next[:, -1] = False
    if packing is not None:
        def enter(t):               # into the TP region: every rank all tokens, the backward sums over TP
            if chunk.sequence_parallel:
                t = mtp.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
            else:
                t = mtp.copy_to_tensor_model_parallel_region(t, group=group)
            return t[:packing.nnz, 0]
        flat = packing.indices                                 # real tokens, row by row, into [B*S]
        targets, has_next = targets.reshape(-1)[flat], has_next.reshape(-1)[flat]
    else:
        # [S, B, H]: the real tokens in [S, B] order
        flat = attention_mask.t().reshape(-1).nonzero(as_tuple=False).squeeze(-1)
        x = x.reshape(s * b, x.shape[-1]).index_select(0, flat)

        def enter(t):
            return mtp.copy_to_tensor_model_parallel_region(t, group=group)
        targets, has_next = targets.t().reshape(-1)[flat], has_next.t().reshape(-1)[flat]
    hidden, lora = enter(x), _lora_input(factors, x, enter)
    logprobs, entropy = _head_stats(chunk, hidden, targets, has_next, request, group, lora)

    def place(values):
        out = values.new_zeros(b * s).index_put((flat,), values)
        return out.view(b, s) if packing is not None else out.view(s, b).t().contiguous()

    if not request.entropy:
        return place(logprobs)
    return TokenStats(place(logprobs), place(entropy))


def _head_adapter(chunk):
    """``(A, B, scaling)`` of the head's LoRA adapter while it runs (the output layer's ``lora``, an adapter of
    :mod:`parallm.model.layers.lora`), else None."""
    adapter = getattr(chunk.output_layer, "lora", None)
    return adapter.head_factors() if adapter is not None else None


def _lora_input(factors, x, enter):
    """``(u, B, scaling)`` for :func:`vocab_parallel_stats`: ``u = A x`` of the tokens ``x`` before they enter the
    TP region, entered by ``enter`` as the hidden states are (A's gradient then as a column-parallel adapter's:
    whole on every rank, a partial sum under sequence parallelism); None without an adapter."""
    if factors is None:
        return None
    a, b, scaling = factors
    return enter(torch.nn.functional.linear(x, a)), b, scaling


def _head_stats(chunk, hidden, targets, has_next, request: StatsRequest, group, lora=None):
    """Log-probs (0 where no next token) and entropy of ``hidden`` [N, H] (this rank's real tokens) against this
    tp rank's vocabulary columns of the head (``lora``: the head adapter's inputs, :func:`_lora_input`)."""
    per = chunk.padded_vocab_size // chunk.dims.tp
    real = chunk.real_vocab_columns if chunk.real_vocab_columns is not None else per
    logprobs, entropy = vocab_parallel_stats(hidden, chunk.head_weight(), targets, real=real,
                                             vocab_start=chunk.dims.tp_rank * per, request=request, group=group,
                                             lora=lora, softcap=chunk.spec.final_logit_softcap)
    return logprobs.masked_fill(~has_next, 0.0), entropy


def _split_stats(chunk, x, split, request: StatsRequest, mtp, factors=None):
    """:func:`token_stats_head` under context parallelism."""
    group = chunk.dims.tp_group
    flat = split.slot_values(split.real).nonzero(as_tuple=False).squeeze(-1)     # this rank's real slots

    def enter(t):                   # [slots (/ tp), ..., width] -> this rank's real slots, in the TP region
        if chunk.sequence_parallel:
            t = mtp.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
        t = t.reshape(split.slots, t.shape[-1]).index_select(0, flat)
        return t if chunk.sequence_parallel else mtp.copy_to_tensor_model_parallel_region(t, group=group)
    targets = split.slot_values(split.targets).index_select(0, flat)
    has_next = split.slot_values(split.has_next).index_select(0, flat)
    lora = _lora_input(factors, x, enter)
    logprobs, entropy = _head_stats(chunk, enter(x), targets, has_next, request, group, lora)
    values = torch.stack([logprobs, entropy], dim=1) if request.entropy else logprobs[:, None]
    local = values.new_zeros((split.slots, values.shape[1])).index_put((flat,), values)
    out = split.place(local, chunk.dims.cp_group)                     # [B, S, 1 or 2]
    if not request.entropy:
        return out[..., 0]
    return TokenStats(out[..., 0], out[..., 1])
