"""What a decoder chunk reads and writes around its layers (a mixin of
:class:`parallm.model.decoder.DecoderChunk`): the output head (logits, values, log-probs, the context-parallel
gather), the batch-level context (RoPE's length, the CP split), the activation shapes that cross a pipeline
boundary, the real-token masks, and router replay's recording. Every method reads the chunk's own attributes
(``spec``, ``task``, ``dims``, ``packed``, ``sequence_parallel``, the head's modules)."""

from __future__ import annotations

import torch

from ..parallel.megatron_import import import_megatron
from .context_parallel import ContextSplit, split_batch
from .layers.attention import Packing, pack_tokens, unpack_tokens
from .layers.hyper_connections import expand_streams
from .layers.routing import moe_layer_indices, tokens_of_rows
from .logprobs import token_stats_head

mtp = import_megatron().tensor_parallel


class ChunkIO:
    """The head and the batch-level bookkeeping of a :class:`~parallm.model.decoder.DecoderChunk`."""

    def head_weight(self) -> torch.Tensor:
        """The output layer's weight ``[Vp/tp, H]`` (the embedding itself when tied within this chunk)."""
        if self.share_embeddings_and_output_weights and self.pre_process:
            return self.embedding.weight
        return self.output_layer.weight

    def rope_length(self, position_ids: torch.Tensor, attention_mask: torch.Tensor) -> int | None:
        """The sequence length dynamic NTK RoPE scales for, of a whole ``[B, S]`` batch (``None`` for every other
        RoPE kind): ``max(position_ids) + 1`` over the positions this layout rotates (every slot when padded, the
        real tokens when packed), as :meth:`compute` on the whole batch would take it."""
        if self.spec.rope.kind != "dynamic":
            return None
        pos = position_ids[attention_mask.bool()] if self.packed else position_ids
        return int(pos.max()) + 1 if pos.numel() else None

    def packs_inside(self, attention_mask: torch.Tensor) -> bool:
        """Whether this chunk, built padded, runs the ``[B, S]`` batch through the packed path inside: a recurrent
        hybrid (``pack_inside``: Gated DeltaNet or Mamba-2 layers, cp = 1) and a batch with padding, all of it at
        the rows' ends. Such rows give what the padded layout gives at every real token (a row's leading padding
        leaves a recurrent state at zero, as transformers' masked padding does), with neither compute nor
        activations spent on padding; rows with a hole keep the padded layout (transformers runs the hole). The
        answer depends on the mask alone, so every stage of a pipeline agrees on it; one host sync."""
        return self.pack_inside and bool(self._packs_inside_flag(attention_mask).item())

    @staticmethod
    def _packs_inside_flag(attention_mask: torch.Tensor) -> torch.Tensor:
        """:meth:`packs_inside`'s test of the mask, on the device (a 0-d bool tensor)."""
        keep = attention_mask.bool()
        if not keep.numel():
            return torch.zeros((), dtype=torch.bool, device=keep.device)
        runs = (keep[:, 1:] & ~keep[:, :-1]).sum(-1) + keep[:, 0]      # runs of real tokens in each row
        return (runs <= 1).all() & ~keep.all()

    def context_split(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor) -> ContextSplit | None:
        """This rank's share of a ``[B, S]`` batch under context parallelism (None at cp = 1): see
        :mod:`parallm.model.context_parallel`. The same on every chunk of a rank, so the engine computes it once
        per microbatch and hands it to :meth:`compute` (``cp=``)."""
        if self.dims.cp == 1:
            return None
        return split_batch(input_ids, position_ids, attention_mask, cp=self.dims.cp, rank=self.dims.cp_rank,
                           packed=self.packed, multiple=self.dims.tp if self.sequence_parallel else 1)

    def _head(self, x, ctx, split, input_ids, attention_mask, stats):
        """The last stage's output from the final-normed hidden states ``x``: log-probs (``stats``), logits,
        values or hidden states, as :meth:`compute` returns them."""
        if stats is not None and self.task == "causal_lm":
            return token_stats_head(self, x, ctx if isinstance(ctx, Packing) else None, input_ids,
                                    attention_mask, stats, split=split)
        if split is not None:
            return self._cp_output(x, split)
        if self.task == "causal_lm":
            weight = self.head_weight()
            if isinstance(ctx, Packing):
                out, _ = self.output_layer(x, weight=weight)  # sequence parallel: input all-gathered inside
            else:
                # The logits are the largest activation: compute them batch-first ([B, S, V], contiguous, what
                # a loss over [B, S, V] wants) and hand back the [S, B, V] view Megatron's convention expects.
                out, _ = self.output_layer(x.transpose(0, 1), weight=weight)
            out = self._softcap(out)
            if self.real_vocab_columns is not None:
                pad = torch.arange(out.shape[-1], device=out.device) >= self.real_vocab_columns
                out = out.masked_fill(pad, torch.finfo(out.dtype).min)
            if not isinstance(ctx, Packing):
                return out.transpose(0, 1)
        else:
            out = self.score(x).squeeze(-1) if self.task == "value" else x
            if self.sequence_parallel:
                # Every TP rank computes the same loss on the gathered output: the backward keeps the local slice.
                out = mtp.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        if isinstance(ctx, Packing):
            out = unpack_tokens(out[:, 0], ctx)                           # [S, B, ...], zeros at padding
        return out

    def _streams(self, x):
        """DeepSeek-V4: the embeddings copied into the hyper-connection streams, ``[.., hc_mult * H]``; else
        ``x``."""
        return x if self.spec.v4 is None else expand_streams(x, self.spec.v4.hc_mult)

    def _v4_context(self, ctx, input_ids, positions, split) -> None:
        """What DeepSeek-V4's layers read from the batch context: ``ctx.positions`` (the positions the chunk
        rotates by: ``[S, B]`` padded, ``[T, 1]`` packed, the CP share's) and ``ctx.token_ids`` (the token id of
        each row of the activations, with their leading shape: this TP rank's share under sequence parallelism),
        on every pipeline stage."""
        if split is not None:
            ids = split.ids
        elif isinstance(ctx, Packing):
            ids = pack_tokens(input_ids, ctx)[None]
        else:
            ids = input_ids
        ctx.positions = positions
        ctx.token_ids = self._my_rows(ids.transpose(0, 1))

    def _scale_embeddings(self, x):
        """The embeddings times the spec's embed_scale (Gemma's ``sqrt(hidden_size)``), a scalar tensor cast to the
        activations' dtype first as transformers' ``Gemma4TextScaledWordEmbedding`` casts its buffer), or ``x``."""
        scale = self.spec.embed_scale
        if scale is None:
            return x
        return x * torch.tensor(scale, dtype=torch.float32, device=x.device).to(x.dtype)

    def _softcap(self, logits):
        """``cap * tanh(logits / cap)`` (the spec's final_logit_softcap, in the logits' dtype, as transformers'
        Gemma heads), or the logits unchanged without a cap."""
        cap = self.spec.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def _record_routing(self, attention_mask, ctx) -> None:
        """Router replay's recording: the experts this chunk's MoE layers routed the running microbatch with, as
        ``router_replay.recorded[m]`` ``[B, S, moe layers, top_k]`` int64 (-1 at padding positions and in the
        columns of MoE layers other chunks hold), the same on every rank of the TP / CP group (collective)."""
        replay = self.router_replay
        b, s = attention_mask.shape
        out = torch.full((b, s, len(moe_layer_indices(self.spec)), self.spec.moe.top_k), -1, dtype=torch.long,
                         device=attention_mask.device)
        sp_group = self.dims.tp_group if self.sequence_parallel else None
        cp_group = self.dims.cp_group if self.dims.cp > 1 else None
        for j, rows in sorted(replay.rows.items()):
            out[:, :, j] = tokens_of_rows(rows, attention_mask, ctx, sp_group=sp_group, cp_group=cp_group)
        replay.rows = {}
        replay.recorded[replay.microbatch] = out

    def _cp_output(self, x, split: ContextSplit):
        """Under context parallelism: this rank's logits / values / hidden states of its slots, gathered over the
        CP group and placed into ``[S, B, ...]`` as at cp = 1 (zeros at padded positions)."""
        if self.task == "causal_lm":
            out, _ = self.output_layer(x, weight=self.head_weight())    # sequence parallel: all-gathered inside
            out = self._softcap(out)
            if self.real_vocab_columns is not None:
                pad = torch.arange(out.shape[-1], device=out.device) >= self.real_vocab_columns
                out = out.masked_fill(pad, torch.finfo(out.dtype).min)
        else:
            out = self.score(x).squeeze(-1) if self.task == "value" else x
            if self.sequence_parallel:
                out = mtp.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        out = out.reshape((split.slots,) + tuple(out.shape[2:]))
        return split.place(out, self.dims.cp_group).transpose(0, 1)

    def boundary_shapes(self, batches) -> list[tuple[int, int, int]]:
        """The shape of the activation (and of its gradient) that crosses a pipeline-stage boundary for each
        ``(input_ids, attention_mask)`` (or ``(input_ids, attention_mask, context_split)``) of ``batches``:
        ``[S, B, H]`` padded (H: the spec's ``boundary_width``); ``[T, 1, H]`` packed (or packed inside: :meth:`packs_inside`), ``T`` the real
        tokens rounded up as :func:`make_packing` rounds them, divided by tp under sequence parallelism; under
        context parallelism this rank's share (``[rows, width, H]`` of the split, rows / tp under sequence
        parallelism). Every rank of a pipeline computes it from the batch it holds; one host sync for all of them
        when packed or packing inside."""
        h = self.spec.boundary_width
        tp = self.config.tensor_model_parallel_size
        multiple = tp if self.sequence_parallel else 1
        splits = [batch[2] if len(batch) > 2 else None for batch in batches]
        if any(sp is not None for sp in splits):     # context parallelism: this rank's share
            return [(sp.rows // multiple, sp.width, h) for sp in splits]
        batches = [batch[:2] for batch in batches]
        if not self.packed and not self.pack_inside:
            return [(ids.shape[1], ids.shape[0], h) for ids, _ in batches]
        if not batches:
            return []
        # [real tokens, packed?] of each batch, one host sync for all of them
        facts = torch.stack([torch.stack([mask.bool().sum(), mask.new_ones((), dtype=torch.long) if self.packed
                                          else self._packs_inside_flag(mask).long()]) for _, mask in batches])
        return [(-(-max(n, 1) // multiple), 1, h) if packed else (ids.shape[1], ids.shape[0], h)
                for (ids, _), (n, packed) in zip(batches, facts.tolist())]     # total / tp: ceil(n / multiple)

    def _no_grad_at_pad_tokens(self, x, ids):
        """transformers builds the embedding with ``padding_idx=config.pad_token_id``: positions holding that token
        send no gradient into the embedding (a tied head still trains that row). Same here: those positions of the
        lookup's output are detached. ``x``: ``[S, B, H]`` / ``[T, 1, H]``, or this TP rank's ``[T / tp, 1, H]``
        under sequence parallelism; ``ids``: ``[B, S]`` / ``[1, T]``."""
        pad = self.spec.pad_token_id
        if pad is None or not torch.is_grad_enabled():
            return x
        at_pad = self._my_rows((ids == pad).transpose(0, 1))             # [S, B] / [T (/ tp), 1]
        return torch.where(at_pad.unsqueeze(-1), x.detach(), x)

    def _my_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism, this TP rank's share of ``t``'s rows (the packed stream, split along dim 0
        in rank order as megatron-core's reduce-scatter splits the activations); else ``t``."""
        return t.tensor_split(self.dims.tp)[self.dims.tp_rank] if self.sequence_parallel else t

    def _real_tokens(self, attention_mask, ctx) -> torch.Tensor:
        """1.0 for each real token among this rank's activation rows, in row order: ``[S * B]`` (s-major) in the
        padded layout; this rank's slice of the packed stream (padding tail 0) when packed; this rank's slots
        under context parallelism."""
        if isinstance(ctx, ContextSplit):
            return self._my_rows(ctx.slot_values(ctx.real).float())
        if not isinstance(ctx, Packing):
            return attention_mask.transpose(0, 1).reshape(-1).float()
        return self._my_rows((torch.arange(ctx.total, device=attention_mask.device) < ctx.nnz).float())
