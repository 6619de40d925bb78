"""One decoder for every family, on Megatron-core's tensor-parallel layers.

Activations are sequence-first, ``[S, B, H]`` (Megatron's convention; the packed path uses ``[nnz, 1, H]``).
A :class:`DecoderChunk` is one (virtual) pipeline stage: it owns the embedding when it is the first stage
(``pre_process``), the final norm and the head when it is the last (``post_process``), and a run of layers that
each know their global index (``layer.layer_number``).

Tensor-parallel layouts (docs/layouts.md): the fused QKV output on TP rank r is ``[q_r; k_r; v_r]`` (r's query
heads, then the KV heads they use; with fewer KV heads than ranks each rank holds one replicated KV head);
the fused MLP input projection on rank r is ``[gate_r; up_r]``; o_proj and down_proj are row parallel.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..parallel.cpu_compat import enable_megatron_sequence_parallel_on_cpu
from ..parallel.megatron_import import import_megatron
from ..parallel.stages import layer_numbers
from ..parallel.state import as_device
from .chunk_io import ChunkIO
from .context_parallel import ContextSplit, resolve_cp_attn
from .layers.attention import (AttnBackend, Packing, PaddedRows, both_layouts, make_packing, pack_tokens,
                               resolve_attn_impl)
from .layers.gqa import Attention
from .layers.hyper_connections import HyperHead
from .layers.gated_deltanet import GatedDeltaNet, resolve_kernel as resolve_gdn_kernel
from .layers.dsa import DSAttention, check_dsa_stages
from .layers.kv_sharing import check_kv_sharing_recompute, check_kv_sharing_stages
from .layers.mamba2 import Mamba2Mixer, check_mamba_layout, resolve_kernel as resolve_mamba_kernel
from .layers.mla import MLAttention
from .layers.mlp import MLP, no_init
from .layers import per_layer_inputs as ple_io
from .layers.norms import FP32WeightRMSNorm, RMSNorm, ZeroCenteredRMSNorm, norm_class  # noqa: F401
from .layers.moe import MoEAux, MoEBlock
from .layers.moe_beside import DenseBesideMoE
from .layers.routing import RouterReplay, moe_layer_indices, rows_of_tokens
from .placement import attach_placements
from .positions.rope import rope_cos_sin
from .positions.yarn import yarn_cos_sin
from .recompute import RECOMPUTE, mark_selective, recomputed_attention  # noqa: F401 (RECOMPUTE: here too)
from .spec import TASKS, DecoderSpec, check_ep, check_tp, padded_vocab_size
from .table import chunk_entries

_megatron = import_megatron()
ModelParallelConfig = _megatron.ModelParallelConfig
mtp = _megatron.tensor_parallel


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, config: ModelParallelConfig, tp: int, layer_number: int, device, *,
                 backend: AttnBackend, dims=None, cp_attn: str = "allgather", gdn_kernel=None, mamba_kernel=None):
        super().__init__()
        self.layer_number = layer_number  # global index in the full model
        self.recompute_attention = False  # recompute="selective" (mark_selective)
        self.block = spec.block_kind(layer_number)
        if self.block is not None:      # one block per layer (Nemotron-H): norm, then one mixer, residual
            self._one_block(spec, config, tp, device, backend=backend, dims=dims, cp_attn=cp_attn,
                            mamba_kernel=mamba_kernel)
            return
        self.input_layernorm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device)
        cp_group = dims.cp_group if dims is not None and dims.cp > 1 else None
        tp_group = dims.tp_group if dims is not None and dims.tp > 1 else None
        self.linear = spec.is_linear_layer(layer_number)
        if self.linear:              # Gated DeltaNet (Qwen3-Next, Qwen3.5): model/layers/gated_deltanet.py
            self.self_attention = GatedDeltaNet(spec, config, tp, device, kernel=gdn_kernel, cp_group=cp_group)
        elif spec.dsa is not None:     # MLA + DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): layers/dsa.py
            self.self_attention = DSAttention(spec, config, tp, device, backend=backend, norm=RMSNorm,
                                              cp_group=cp_group, cp_attn=cp_attn, layer_number=layer_number)
        elif spec.mla is not None:     # multi-head latent attention (DeepSeek-V3): model/layers/mla.py
            self.self_attention = MLAttention(spec, config, tp, device, backend=backend, norm=RMSNorm,
                                              cp_group=cp_group, cp_attn=cp_attn)
        else:
            self.self_attention = Attention(spec, config, tp, device, backend=backend, cp_group=cp_group,
                                            cp_attn=cp_attn, window=spec.window(layer_number), tp_group=tp_group,
                                            layer=layer_number)
        self.post_attention_layernorm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype,
                                                         device)
        if spec.sandwich_norms:        # Gemma: the attention's and the MLP's outputs normed before the residual
            self.attn_out_norm, self.mlp_out_norm = (
                norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device) for _ in range(2))
        self.rope = spec.layer_rope(layer_number)      # this layer's RoPE (cos / sin per RoPE: compute)
        if spec.layer_scalar:          # Gemma 4: the layer's output times a checkpoint scalar (a buffer there)
            self.layer_scalar = nn.Parameter(torch.empty(1, dtype=config.params_dtype, device=device),
                                             requires_grad=False)
        # The spec says which layers route over experts (model/layers/moe.py); the others keep the dense MLP.
        # Gemma 4's MoE layers run the dense MLP and the routed experts side by side (layers/moe_beside.py).
        moe_block = DenseBesideMoE if spec.moe is not None and spec.moe.beside_mlp else MoEBlock
        self.mlp = moe_block(spec, config, dims, device, layer=layer_number) if spec.is_moe_layer(layer_number) \
            else MLP(spec, config, width=spec.mlp_width(layer_number))
        if spec.per_layer_input_size:      # Gemma 4: the layer's per-layer input (layers/per_layer_inputs.py)
            self.per_layer = ple_io.PerLayerInput(spec, config, layer_number, device)

    def _one_block(self, spec, config, tp, device, *, backend, dims, cp_attn, mamba_kernel):
        """Nemotron-H's layer: ``norm`` then the one mixer of ``spec.block_kind`` (``self_attention``: Mamba-2 or
        attention; ``mlp``: the dense MLP or the routed block)."""
        self.norm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device)
        self.mlp = None
        cp_group = dims.cp_group if dims is not None and dims.cp > 1 else None
        if self.block == "mamba":
            self.self_attention = Mamba2Mixer(spec, config, tp, device, kernel=mamba_kernel, cp_group=cp_group)
        elif self.block == "attention":
            self.self_attention = Attention(spec, config, tp, device, backend=backend, cp_group=cp_group,
                                            cp_attn=cp_attn, window=spec.window(self.layer_number))
        else:
            self.mlp = MoEBlock(spec, config, dims, device, layer=self.layer_number) if self.block == "moe" \
                else MLP(spec, config)

    def _attend(self, h, cos, sin, ctx):
        if self.recompute_attention:        # recompute="selective"
            return recomputed_attention(self.self_attention, h, cos, sin, ctx)
        return self.self_attention(h, cos, sin, ctx)

    def forward(self, x, cos, sin, ctx, tokens=None, routed=None, per_layer=None):
        """``tokens``: real-row mask of ``x`` for a MoE layer's load-balancing loss (None: not computed / all
        real). ``routed``: a MoE layer's replayed experts for the rows of ``x`` (:meth:`MoEBlock.route`).
        ``per_layer``: Gemma 4's per-layer inputs of every layer (``[.., L * P]``; None without them)."""
        if self.block is not None:
            h = self.norm(x)
            if self.mlp is None:
                return x + self._attend(h, cos, sin, ctx)
            return x + (self.mlp(h, tokens, routed) if isinstance(self.mlp, MoEBlock) else self.mlp(h))
        if isinstance(cos, dict):          # RoPE per layer type (Gemma): this layer's tables
            cos, sin = cos[self.rope], sin[self.rope]
        a = self._attend(self.input_layernorm(x), cos, sin, ctx)
        x = x + (self.attn_out_norm(a) if hasattr(self, "attn_out_norm") else a)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, DenseBesideMoE):        # Gemma 4: the router reads the residual
            m = self.mlp(h, tokens, routed, residual=x)
        else:
            m = self.mlp(h, tokens, routed) if isinstance(self.mlp, MoEBlock) else self.mlp(h)
        x = x + (self.mlp_out_norm(m) if hasattr(self, "mlp_out_norm") else m)
        if per_layer is not None:
            x = self.per_layer(x, per_layer)
        return x * self.layer_scalar if hasattr(self, "layer_scalar") else x


class CarriedTensors(nn.ParameterList):
    """``spec.carried``'s tensors, one parameter each (``carried.{j}``), replicated on every TP rank of the first
    pipeline stage (``spec.carried_mtp``'s: ``carried_mtp.{j}`` on the last), without gradient: loaded, saved,
    exported and checkpointed bit for bit, never run."""

    def __init__(self, carried, dtype, device=None):
        super().__init__(nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
                         for _, shape in carried)


class _SharedHead(nn.Module):
    def __init__(self, spec: DecoderSpec, config: ModelParallelConfig, padded_vocab: int, device):
        super().__init__()
        self.norm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device)
        self.head = mtp.ColumnParallelLinear(spec.hidden_size, padded_vocab, config=config, init_method=no_init,
                                             bias=False, gather_output=False)


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (DeepSeek-V3 / GLM-4.5, ``model.layers.{num_layers + j}.*``), carried,
    not run: its embedding copy (vocab-parallel), ``enorm`` / ``hnorm``, ``eh_proj`` (``[H, 2H]``, rows split over
    TP), a decoder layer built like the last one (MLA / attention and MoE, sharded as every layer is) and the
    shared head (``norm``, a vocab-parallel ``head``). Every parameter has ``requires_grad=False``: the optimizer,
    the gradient reductions and clipping pass them by; loading, saving, exporting and training checkpoints carry
    them bit for bit (docs/families.md)."""

    def __init__(self, spec: DecoderSpec, config: ModelParallelConfig, tp: int, layer_number: int, device, *,
                 backend: AttnBackend, dims, padded_vocab: int):
        super().__init__()
        self.layer_number = layer_number
        self.embed_tokens = mtp.VocabParallelEmbedding(padded_vocab, spec.hidden_size, init_method=no_init,
                                                       config=config)
        self.enorm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device)
        self.hnorm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, config.params_dtype, device)
        self.eh_proj = mtp.ColumnParallelLinear(2 * spec.hidden_size, spec.hidden_size, config=config,
                                                init_method=no_init, bias=False, gather_output=False)
        self.layer = DecoderLayer(spec, config, tp, layer_number, device, backend=backend, dims=dims)
        self.shared_head = _SharedHead(spec, config, padded_vocab, device)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("parallm carries multi-token-prediction layers (load, save, export) but does not "
                                  "run them")


class DecoderChunk(ChunkIO, nn.Module):
    """One virtual pipeline stage of the decoder (Megatron's model protocol: pre_process / post_process /
    set_input_tensor). ``forward`` returns, on the last stage, vocab-parallel logits ``[S, B, Vpad/tp]``
    (causal_lm) or values ``[S, B]`` (value); elsewhere the hidden states ``[S, B, H]`` for the next stage."""

    def __init__(self, spec: DecoderSpec, config: ModelParallelConfig, *, task: str, pre_process: bool,
                 post_process: bool, layers: range, vpp_rank: int, table, dims, vocab_multiple: int = 1,
                 packed: bool = False, attn_impl: str = "auto", recompute: str | None = None,
                 cp_attn: str = "auto"):
        """``table``: the family's weight table (each parameter's placement is attached from its row);
        ``dims``: the :class:`parallm.parallel.state.ParallelDims` the chunk is built for (kept as
        ``chunk.dims``); ``attn_impl``: an attention backend of :mod:`parallm.model.layers.attention` or "auto" (the
        resolved name is kept as ``chunk.attn_impl``); ``cp_attn``: the context-parallel attention ("auto",
        "allgather", "ring": :mod:`parallm.model.context_parallel`; kept as ``chunk.cp_attn``, None at cp = 1);
        ``recompute``: None, ``"full"`` to recompute every layer's activations in backward, or ``"moe"`` /
        ``"selective"`` (:func:`mark_selective`)."""
        super().__init__()
        tp = config.tensor_model_parallel_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.spec = spec
        self.task = task
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.vpp_rank = vpp_rank
        self.dims = dims
        self.layer_range = layers
        self.table = table          # the family's weight table (loader, saver and export read it)
        self.packed = packed
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        self.recompute = recompute
        self.sequence_parallel = bool(config.sequence_parallel)
        if self.sequence_parallel and not packed:
            raise ValueError("sequence_parallel=True needs packed=True (the packed token stream is what is split "
                             "over tp ranks)")
        self.padded_vocab_size = padded_vocab_size(spec.vocab_size, tp, vocab_multiple)
        self.share_embeddings_and_output_weights = spec.tie_word_embeddings and task == "causal_lm"
        self.input_tensor = None
        self.weights_loaded = False     # allocated, not initialised: the loaders mark it (model/loaded.py)
        # What Megatron's schedules read from a model: its type (and, from the config, the fields
        # prepare_config adds).
        from megatron.core.enums import ModelType
        self.model_type = ModelType.encoder_or_decoder
        if pre_process and spec.carried:     # tensors held and written back, never run (a vision tower)
            self.carried = CarriedTensors(spec.carried, config.params_dtype, device)
        if pre_process:
            self.embedding = mtp.VocabParallelEmbedding(
                self.padded_vocab_size, spec.hidden_size, init_method=no_init, config=config,
                reduce_scatter_embeddings=self.sequence_parallel)
        if pre_process and spec.per_layer_input_size:    # Gemma 4: every layer's input, from the first stage
            self.per_layer = ple_io.PerLayerInputs(spec, config, self.padded_vocab_size, device)
        backend, cp_kernel, gdn, mamba = self._kernels(spec, config, dims, device, attn_impl=attn_impl,
                                                       packed=packed, cp_attn=cp_attn)
        layer_class = DecoderLayer
        if spec.v4 is not None:          # DeepSeek-V4: hyper-connected layers (model/layers/v4_layer.py)
            from .layers.v4_layer import V4Layer as layer_class
        self.layers = nn.ModuleList(layer_class(spec, config, tp, i, device, backend=backend, dims=dims,
                                                cp_attn=cp_kernel, gdn_kernel=gdn, mamba_kernel=mamba)
                                    for i in layers)
        self.moe_aux = MoEAux()  # load-balancing loss of this chunk's MoE layers (forward_backward turns it on)
        self.router_replay = RouterReplay()   # routed_experts / return_routed_experts (forward, forward_backward)
        moe_index = {layer: j for j, layer in enumerate(moe_layer_indices(spec))}
        for layer in self.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.aux = self.moe_aux
                layer.mlp.replay = self.router_replay
                layer.mlp.moe_index = moe_index[layer.layer_number]
        if post_process:
            self._build_head(spec, config, tp, device, dims=dims, backend=backend)
        # Every parameter's placement (TP layout, partial-sum gradients, tied copies) from its table row, with
        # megatron-core's own attributes.
        experts = dims.expert_range(spec.moe.num_experts) if spec.moe is not None else None
        attach_placements(self, chunk_entries(table, spec, task=task, pp=dims.pp, pre_process=pre_process,
                                              post_process=post_process, layers=layers, experts=experts),
                          pp=dims.pp)
        if recompute in ("moe", "selective"):
            mark_selective(self, attention=recompute == "selective")

    def _kernels(self, spec, config, dims, device, *, attn_impl: str, packed: bool, cp_attn: str):
        """The kernels the layers run (attention backend, CP attention, Gated DeltaNet's, Mamba-2's), kept by name
        on the chunk (``attn_impl``, ``cp_attn``, ``gdn_kernel``, ``mamba_kernel``) and returned for the layers."""
        on, dtype = as_device(device), config.params_dtype
        backend = resolve_attn_impl(attn_impl, packed=packed, device=on, dtype=dtype)
        # A recurrent hybrid (Gated DeltaNet, Mamba-2) built padded runs batches whose rows are padded only at
        # their ends through the packed path inside (ChunkIO.packs_inside): its attention needs both kernels.
        self.pack_inside = not packed and dims.cp == 1 and (spec.linear_attn is not None or spec.mamba is not None)
        if self.pack_inside:
            backend = both_layouts(backend, resolve_attn_impl("auto", packed=True, device=on, dtype=dtype))
        self.attn_impl = backend.name
        cp_kernel = resolve_cp_attn(cp_attn)
        self.cp_attn = cp_kernel if dims.cp > 1 else None
        # Gated DeltaNet layers' kernel (model/layers/gated_deltanet.py; None without them), kept as chunk.gdn_kernel
        gdn = resolve_gdn_kernel(device=on, dtype=dtype) if spec.linear_attn else None
        self.gdn_kernel = gdn.name if gdn is not None else None
        # Mamba-2 layers' kernel (model/layers/mamba2.py; None without them), kept as chunk.mamba_kernel
        mamba = resolve_mamba_kernel(device=on, dtype=dtype) if spec.mamba else None
        self.mamba_kernel = mamba.name if mamba is not None else None
        return backend, cp_kernel, gdn, mamba

    def _build_head(self, spec, config, tp: int, device, *, dims, backend) -> None:
        """The last stage's final norm and head (output layer, value score or none), and the carried
        multi-token-prediction tensors / layers."""
        task, pre_process = self.task, self.pre_process
        # DeepSeek-V4 keeps its final norm's weight in fp32 in a model of any dtype, as transformers does
        norm_dtype = torch.float32 if spec.v4 is not None else config.params_dtype
        self.final_norm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, norm_dtype, device)
        if spec.v4 is not None:          # DeepSeek-V4: the streams collapsed before the final norm
            self.hc_head = HyperHead(spec.hidden_size, spec.v4.hc_mult, eps=spec.v4.hc_eps,
                                     norm_eps=spec.rms_norm_eps, device=device)
        if task == "hidden":
            pass  # a headless model (verl's ParallelLlamaModel): final-normed hidden states
        elif task == "causal_lm":
            # Tied and the embedding lives in this chunk: one parameter used twice. Tied across stages:
            # this chunk owns a copy, loaded from the embedding and kept equal by finalize_grads.
            reuse = self.share_embeddings_and_output_weights and pre_process
            self.output_layer = mtp.ColumnParallelLinear(
                spec.hidden_size, self.padded_vocab_size, config=config, init_method=no_init, bias=False,
                gather_output=False, skip_weight_param_allocation=reuse)
            # Vocab padding columns of this rank's logits (None: no padding here). They are filled with the
            # dtype's lowest value, so a softmax / vocab-parallel cross entropy gives them probability 0.
            per = self.padded_vocab_size // tp
            real = max(0, min(per, spec.vocab_size - dims.tp_rank * per))
            self.real_vocab_columns = real if real < per else None
        else:
            self.score = nn.Linear(spec.hidden_size, 1, bias=False, dtype=config.params_dtype, device=device)
        if spec.carried_mtp:     # a family's listed MTP tensors (Qwen3.5 mtp.*): held, never run
            self.carried_mtp = CarriedTensors(spec.carried_mtp, config.params_dtype, device)
        if spec.carried_mtp_layers:      # carried multi-token-prediction layers: loaded, saved, never run
            self.mtp_layers = nn.ModuleList(
                MTPLayer(spec, config, tp, spec.num_layers + j, device, backend=backend, dims=dims,
                         padded_vocab=self.padded_vocab_size) for j in range(spec.carried_mtp_layers))

    # -- Megatron model protocol -------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self):
        if self.pre_process:
            return self.embedding.weight
        if self.post_process and self.task == "causal_lm":
            return self.output_layer.weight
        return None

    # -- forward -------------------------------------------------------------------------------------------
    def compute(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                stats=None, rope_length=None, cp: ContextSplit | None = None):
        """input_ids / position_ids / attention_mask: ``[B, S]`` (padded layout). parallm's engine calls this;
        ``forward`` is the same unless a subclass (the verl-compatible classes) gives it another signature.

        ``stats``: a :class:`parallm.model.logprobs.StatsRequest`: the last stage of a causal_lm returns next-token
        log-probs (and entropy) ``[B, S]`` computed vocab-parallel from the hidden states instead of logits.

        ``rope_length``: the whole batch's :meth:`rope_length` when this is one microbatch of it (dynamic RoPE
        then scales every microbatch as transformers scales the whole batch); ``None``: this batch's own.

        ``cp``: the batch's :meth:`context_split` (computed here when None and cp > 1). Under context parallelism
        this rank computes its own tokens only and the outputs are gathered over the CP group, so what this
        returns is what it returns at cp = 1 (zeros at padded positions)."""
        split = cp if cp is not None else self.context_split(input_ids, position_ids, attention_mask)
        if split is not None:
            ctx = split
            positions = split.positions.transpose(0, 1)                  # [rows, width]
            if rope_length is None:     # dynamic RoPE: the whole batch's length, not this rank's share
                rope_length = self.rope_length(position_ids, attention_mask)
        elif self.packed or self.packs_inside(attention_mask):
            if not self.packed and rope_length is None:     # dynamic RoPE scales as the padded layout does
                rope_length = self.rope_length(position_ids, attention_mask)
            ctx = make_packing(attention_mask, self.config.tensor_model_parallel_size if self.sequence_parallel
                               else 1)
            positions = pack_tokens(position_ids, ctx)[:, None]            # [T, 1]
        else:
            # each layer kind builds what it needs from the [B, S] mask, once per batch (PaddedRows; no padding:
            # causal attention without a [B, 1, S, S] mask)
            ctx = PaddedRows(attention_mask.bool())
            positions = position_ids.transpose(0, 1)                     # [S, B]
        if self.pre_process:
            if split is not None:
                ids = split.ids                                           # [B, rows] / [1, rows]
            else:
                ids = pack_tokens(input_ids, ctx)[None] if isinstance(ctx, Packing) else input_ids
            x = self.embedding(ids)  # sequence parallel: reduce-scattered to [T/tp, 1, H] already
            if not self.sequence_parallel:
                x = x.transpose(0, 1).contiguous()                       # [S, B, H] / [T, 1, H]
            x = self._streams(self._scale_embeddings(self._no_grad_at_pad_tokens(x, ids)))
            per_layer = self.per_layer(x, ids, transpose=not self.sequence_parallel,
                                       no_grad_at_pad=self._no_grad_at_pad_tokens) \
                if hasattr(self, "per_layer") else None
        else:
            if self.input_tensor is None:
                raise RuntimeError("DecoderChunk without pre_process needs set_input_tensor() before forward")
            x, per_layer = ple_io.split(self.input_tensor, self.spec)   # per-layer inputs travel with it
        if self.spec.v4 is not None:        # DeepSeek-V4: what its attention and hash routing read
            self._v4_context(ctx, input_ids, positions, split)
        if self.spec.yarn is not None:      # YaRN: its frequencies and the cos / sin attention factor
            cos, sin = yarn_cos_sin(self.spec.yarn, positions)
        else:
            cos, sin = rope_cos_sin(self.spec.rope, positions, rope_length)
        cos, sin = cos.to(x.device), sin.to(x.device)
        if self.spec.layer_ropes:       # RoPE per layer type: each RoPE's tables, keyed by its spec
            tables = {r: rope_cos_sin(r, positions, rope_length) for r in set(map(self.spec.layer_rope,
                                                                                  range(self.spec.num_layers)))}
            cos, sin = ({r: t[i].to(x.device) for r, t in tables.items()} for i in (0, 1))
        recompute = self.recompute == "full" and torch.is_grad_enabled()
        if recompute or self.recompute == "selective":    # layers' (attention's) forwards run again in the backward
            ctx.replays_layers = True
        tokens = self._real_tokens(attention_mask, ctx) if self.moe_aux.scale is not None else None
        replay = self.router_replay
        given = replay.current() if replay.active else None      # router replay: [B, S, moe layers, top_k]
        given = rows_of_tokens(given, attention_mask, ctx, share=self._my_rows) if given is not None else None
        ple = () if per_layer is None else (per_layer,)     # Gemma 4's per-layer inputs, for the layers
        for layer in self.layers:
            routed = (given[0][:, layer.mlp.moe_index], given[1]) \
                if given is not None and isinstance(layer.mlp, MoEBlock) else None
            if recompute:
                # Keep only the layer's input; its activations are recomputed in backward (RNG state restored).
                # The recompute replays the layer: MoE load-balancing losses are then not recorded twice.
                x = checkpoint(layer, x, cos, sin, ctx, tokens, routed, *ple, use_reentrant=False,
                               preserve_rng_state=True,
                               context_fn=lambda: (contextlib.nullcontext(), self.moe_aux.replaying()))
            else:
                x = layer(x, cos, sin, ctx, tokens, routed, *ple)
        if replay.recording:
            self._record_routing(attention_mask, ctx)
        if not self.post_process:
            return ple_io.join(x, per_layer)
        if hasattr(self, "hc_head"):
            x = self.hc_head(x)
        return self._head(self.final_norm(x), ctx, split, input_ids, attention_mask, stats)

    def forward(self, input_ids, position_ids, attention_mask):
        return self.compute(input_ids, position_ids, attention_mask)

def make_config(*, tp: int, pp: int, vpp: int | None, dtype: torch.dtype, sequence_parallel: bool):
    from ..parallel.state import group_device
    on_gpu = group_device().type == "cuda"
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,
        gradient_accumulation_fusion=False,
    )


def prepare_config(spec: DecoderSpec, dims, *, task: str, dtype, sequence_parallel: bool) -> ModelParallelConfig:
    """Check that the model runs in the layout ``dims`` (naming the numbers when it does not) and make the
    chunks' shared config. Used by build_chunks and by the verl-compatible classes alike."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if spec.hidden_act not in ("silu", "gelu_pytorch_tanh", "relu2"):
        raise ValueError(f"hidden_act={spec.hidden_act!r} is not supported (parallm implements 'silu', "
                         "'gelu_pytorch_tanh' and, ungated, 'relu2')")
    check_tp(spec, dims.tp)
    check_mamba_layout(spec, tp=dims.tp, cp=dims.cp)
    check_ep(spec, dims.ep)
    # raises with the numbers if the layers do not split (evenly, or as dims.layer_split says)
    layer_numbers(spec.num_layers, dims.pp, dims.vpp, 0, 0, layers_per_stage=dims.layer_split)
    stages = [layer_numbers(spec.num_layers, dims.pp, dims.vpp, p, v, layers_per_stage=dims.layer_split)
              for p in range(dims.pp) for v in range(dims.vpp)]
    check_dsa_stages(spec, stages)
    check_kv_sharing_stages(spec, stages)       # Gemma 4: a KV-sharing layer and its source in one stage
    config = make_config(tp=dims.tp, pp=dims.pp, vpp=dims.vpp if dims.vpp > 1 else None, dtype=dtype,
                         sequence_parallel=sequence_parallel)
    # The TransformerConfig fields Megatron's schedules read from a model's config, set once here: the chunks of
    # a rank share this config (as a Megatron model's chunks share one) and none of them writes to it.
    for name, value in (("hidden_size", spec.boundary_width), ("calculate_per_token_loss", False),
                        ("fine_grained_activation_offloading", False)):
        if not hasattr(config, name):
            setattr(config, name, value)
    if config.sequence_parallel and config.use_cpu_initialization:
        enable_megatron_sequence_parallel_on_cpu()
    return config


def build_chunks(spec: DecoderSpec, *, table, task: str = "causal_lm", dtype=torch.float32,
                 sequence_parallel=False, vocab_multiple: int = 1, packed: bool = False,
                 attn_impl: str = "auto", recompute: str | None = None, cp_attn: str = "auto",
                 pipeline_split: dict | None = None) -> list[DecoderChunk]:
    """Build this rank's chunks (one per virtual stage) for the current parallel layout. ``pipeline_split``: the
    keywords of :meth:`parallm.parallel.state.ParallelDims.with_layer_split` (an uneven pipeline split; the
    chunks' ``dims`` carry it)."""
    from ..parallel.state import current_dims
    dims = current_dims().with_layer_split(spec.num_layers, **(pipeline_split or {}))
    check_kv_sharing_recompute(spec, recompute)
    config = prepare_config(spec, dims, task=task, dtype=dtype, sequence_parallel=sequence_parallel)
    return [DecoderChunk(spec, config, task=task, pre_process=dims.is_first_stage(v),
                         post_process=dims.is_last_stage(v), layers=dims.stage_layers(spec.num_layers, v),
                         vpp_rank=v, table=table, dims=dims, vocab_multiple=vocab_multiple, packed=packed,
                         attn_impl=attn_impl, recompute=recompute, cp_attn=cp_attn)
            for v in range(dims.vpp)]
