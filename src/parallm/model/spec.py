"""The frozen description of a decoder that the one generic implementation runs.

A family file (``parallm.families.*``) turns a Hugging Face config into a :class:`DecoderSpec`; the decoder reads
only the spec, never the architecture name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layer_specs import (ACTIVATIONS, EXPERT_LAYOUTS, ROUTERS, DSASpec, GatedDeltaNetSpec,  # noqa: F401
                          Mamba2Spec, MLASpec, MoESpec, V4Spec)
from .attention_checks import check_attention_per_layer
from .positions.rope import RopeSpec
from .positions.yarn import YarnSpec

TASKS = ("causal_lm", "value", "hidden")   # "hidden": headless (final-normed hidden states)
BLOCK_KINDS = ("mamba", "attention", "mlp", "moe")


@dataclass(frozen=True)
class DecoderSpec:
    family: str                 # registry key, e.g. "llama", "qwen2"
    architecture: str           # HF architecture of the checkpoint, e.g. "LlamaForCausalLM"
    model_type: str             # HF model_type, e.g. "llama"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int               # config.head_dim when given; may differ from hidden_size / num_heads
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    qkv_bias: bool = False      # Qwen2: True; LLaMA: attention_bias
    o_bias: bool = False        # LLaMA: attention_bias
    mlp_bias: bool = False      # LLaMA: mlp_bias
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None   # transformers' nn.Embedding(padding_idx=...): lookups of it get no gradient
    hidden_act: str = "silu"
    qk_norm: bool = False       # Qwen3: RMSNorm over head_dim on every query / key head, before RoPE
    # MiniMax-M2: one RMSNorm over the whole q / k projection of a token (all heads at once, weights
    # [num_heads * head_dim] / [num_kv_heads * head_dim]), before RoPE; its mean spans the TP ranks
    # (model/layers/qk_norm.py). Exclusive with qk_norm.
    qk_norm_whole: bool = False
    # Sliding-window attention per layer: layer i's queries see the layer_windows[i] keys up to their own
    # (transformers' sliding_window: i - w < j <= i), None: full causal attention; () (or a layer past the end):
    # no window anywhere. Families build it from the config (Mistral: every layer; Qwen2 / Qwen3:
    # use_sliding_window + max_window_layers or layer_types), so the decoder reads only this tuple.
    layer_windows: tuple[int | None, ...] = ()
    moe: MoESpec | None = None  # mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral); None: every MLP dense
    # Multi-head latent attention instead of GQA (DeepSeek-V3 family); head_dim is then its q_head_dim and
    # num_kv_heads == num_heads (MLA expands keys and values to every head).
    mla: MLASpec | None = None
    # YaRN RoPE: when set, cos / sin come from parallm.model.positions.yarn.yarn_cos_sin(yarn, ...) and ``rope``
    # holds only the rotary dim and theta (kind "default"); None: ``rope`` is the whole story.
    yarn: YarnSpec | None = None
    # num_nextn_predict_layers: the checkpoint may carry that many multi-token-prediction layers after the last
    # decoder layer (model.layers.{num_layers + j}.*); the decoder does not run them (transformers drops them).
    mtp_layers: int = 0
    # how many of them this model carries (build_model(mtp=...)): held on the last pipeline stage, sharded like a
    # decoder layer, loaded, saved and exported, never run nor trained (requires_grad=False); 0: none
    carried_mtp_layers: int = 0
    # Hybrid models (Qwen3-Next, Qwen3.5): the Gated DeltaNet layers; None: every layer runs attention
    linear_attn: GatedDeltaNetSpec | None = None
    # the attention layers' sigmoid output gate (Qwen3-Next, Qwen3.5): q_proj's rows are per head [q_h; gate_h]
    # and the attention output is multiplied by sigmoid(gate) before o_proj
    attn_output_gate: bool = False
    # a learned attention-sink logit per query head (gpt-oss): one more logit in every softmax's denominator, with
    # no value (``self_attn.sinks [num_heads]``, split over TP with the query heads)
    attn_sinks: bool = False
    # zero-centred RMSNorm, ``x_normed * (1 + w)`` computed in fp32 (Qwen3-Next, Qwen3.5: every RMSNorm but the
    # Gated DeltaNet's gated one)
    zero_centered_norm: bool = False
    # HF tensors the model holds on its first pipeline stage, loads, saves and exports unchanged but never runs
    # nor trains (a vision-language checkpoint's vision tower): (HF name, shape) pairs
    carried: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # HF tensors the model holds on its last pipeline stage, replicated, loads, saves and exports unchanged but
    # never runs nor trains: multi-token-prediction tensors a family lists from the checkpoint's headers
    # (Qwen3.5 / Qwen3-Next ``mtp.*``: build_model(mtp=...)), (HF name, shape) pairs
    carried_mtp: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the MLA layers' lightning indexer; None: dense attention
    dsa: DSASpec | None = None
    # One block per layer (Nemotron-H): layer i is a pre-norm residual block of one kind, layer_blocks[i] in
    # BLOCK_KINDS ("mamba": spec.mamba's mixer, "attention", "mlp": the dense MLP, "moe": the routed block);
    # (): every layer is attention then MLP (every other family)
    layer_blocks: tuple[str, ...] = ()
    mamba: Mamba2Spec | None = None
    # attention without positions (Nemotron-H's attention layers: no RoPE)
    nope: bool = False
    # RMSNorm multiplying its weight in fp32 before the cast back (Nemotron-H's NemotronHRMSNorm); False: the
    # weight times the normed input cast back (LLaMA's)
    norm_weight_fp32: bool = False
    # final logit soft-capping (Gemma 2 / 3 / 4's ``final_logit_softcapping``): the head's logits become
    # ``cap * tanh(logits / cap)`` before anything reads them (the logits output, the vocab-parallel log-prob /
    # entropy head, the loss); None: raw logits
    final_logit_softcap: float | None = None
    # the token embeddings times this scalar before the first layer (Gemma: ``sqrt(hidden_size)``); None: unscaled
    embed_scale: float | None = None
    # the attention softmax scale of q . k (Gemma 4: 1.0); None: head_dim ** -0.5 (grouped-query attention only)
    attn_scale: float | None = None
    # a weightless RMSNorm over each value head (Gemma 4's ``v_norm``), in fp32 (grouped-query attention only)
    v_norm: bool = False
    # Gemma's sandwich norms: the attention's and the MLP's outputs each RMS-normed before their residual add
    # (``attn_out_norm`` / ``mlp_out_norm``; the pre-MLP norm stays ``post_attention_layernorm``)
    sandwich_norms: bool = False
    # RoPE per layer (Gemma: one per layer type, e.g. sliding theta 1e4, full 1e6): layer i rotates by
    # layer_ropes[i] (None, or a layer past the end: ``rope``); (): every layer ``rope``. Not with yarn / MLA.
    layer_ropes: tuple[RopeSpec | None, ...] = ()
    # Gemma 4: each layer's output times its checkpoint scalar ``layer_scalar [1]`` (held, loaded, saved, never
    # trained: transformers keeps it as a buffer)
    layer_scalar: bool = False
    # Gemma 4's RMSNorm: ``pow(mean + eps, -0.5)`` and the fp32 weight (layers/norms.py PowRMSNorm)
    norm_pow: bool = False
    # DeepSeek-V4 (families/deepseek_v4.py): its attention kinds and hyper-connection streams; None: other families
    v4: V4Spec | None = None
    # Gemma 4's full-attention layers' own attention shape (``global_head_dim``, ``num_global_key_value_heads``:
    # transformers' ``per_layer_config``): the layers in ``global_layers`` run ``num_heads`` heads of
    # ``global_head_dim`` over ``global_kv_heads`` KV heads (their table rows: the ``global_attn`` condition; the
    # others ``local_attn``), every other layer ``head_dim`` / ``num_kv_heads``; (): one shape everywhere
    global_layers: tuple[int, ...] = ()
    global_head_dim: int = 0
    global_kv_heads: int = 0
    # K = V on those layers (Gemma 4's ``attention_k_eq_v``): no v projection; the values are the keys' projection
    # before the k norm and RoPE (then ``v_norm``); their table rows have the ``k_eq_v`` condition
    global_k_eq_v: bool = False
    # Gemma 4's per-layer input embeddings (``hidden_size_per_layer_input``): P columns of every layer's input
    # (model/layers/per_layer_inputs.py; their own vocabulary, here the token vocabulary's size); 0: none
    per_layer_input_size: int = 0
    # Gemma 4's KV sharing (``num_kv_shared_layers``, model/layers/kv_sharing.py): layer i attends with the keys /
    # values of layer kv_sources[i] (None, or a layer past the end: its own); those layers have only q_proj (table
    # condition ``kv_shared_layer``), and with ``double_wide_mlp`` an MLP of twice the intermediate size
    kv_sources: tuple[int | None, ...] = ()
    double_wide_mlp: bool = False

    @property
    def stream_width(self) -> int:
        """The width of the hidden state between layers (what crosses a pipeline stage): ``hidden_size``, or
        DeepSeek-V4's ``hc_mult`` hyper-connection streams of it."""
        return self.hidden_size * self.hc_mult

    @property
    def per_layer_input_width(self) -> int:
        """Every layer's per-layer input side by side, ``num_layers * per_layer_input_size`` (0 without them)."""
        return self.num_layers * self.per_layer_input_size

    @property
    def boundary_width(self) -> int:
        """The width of what crosses a pipeline-stage boundary: the hidden state (:attr:`stream_width`) and, with
        Gemma 4's per-layer inputs, every layer's input beside it."""
        return self.stream_width + self.per_layer_input_width

    @property
    def hc_mult(self) -> int:
        """DeepSeek-V4's hyper-connection streams (1 for every other family)."""
        return self.v4.hc_mult if self.v4 is not None else 1

    @property
    def hc_mix_width(self) -> int:
        """The rows of a V4 hyper-connection's projection: ``pre``, ``post`` and ``comb``, ``(2 + n) n``."""
        return (2 + self.hc_mult) * self.hc_mult

    def __post_init__(self):
        # only the fields that existing families never set are checked here (tests replace() sizes freely)
        if self.yarn is not None and (self.rope.kind != "default" or self.rope.dim != self.yarn.dim):
            raise ValueError(f"with yarn RoPE, rope must be the default kind of the same dim (got {self.rope})")
        bad = [w for w in self.layer_windows if w is not None and (isinstance(w, bool) or not isinstance(w, int)
                                                                  or w < 1)]
        if bad:
            raise ValueError(f"layer_windows holds a window (a positive integer) or None per layer; got "
                             f"{self.layer_windows}")
        cap = self.final_logit_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"final_logit_softcap={cap!r} must be a positive number (None: no soft-capping)")
        scale = self.embed_scale
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale == 0):
            raise ValueError(f"embed_scale={scale!r} must be a finite non-zero number (None: unscaled)")
        att = self.attn_scale
        if att is not None and (isinstance(att, bool) or not isinstance(att, (int, float)) or not math.isfinite(att)
                                or att <= 0):
            raise ValueError(f"attn_scale={att!r} must be a finite positive number (None: head_dim ** -0.5)")
        if (att is not None or self.v_norm) and (self.mla is not None or self.dsa is not None):
            raise ValueError("attn_scale / v_norm are implemented for grouped-query attention layers only (not "
                             "with multi-head latent attention)")
        if self.layer_ropes and (self.yarn is not None or self.mla is not None
                                 or any(r is not None and r.kind == "dynamic" for r in self.layer_ropes)):
            raise ValueError("RoPE per layer needs plain RoPE (not yarn, dynamic NTK or MLA)")
        check_attention_per_layer(self)      # Gemma 4's global layers and KV sharing (attention_checks.py)
        bad = [i for i in range(self.num_layers) if self.layer_ropes and self.layer_rope(i).dim != (
            self.head_dim_of(i) if self.global_layers else self.rope.dim)]
        if bad:
            raise ValueError(f"RoPE per layer rotates each layer's whole head: layers {bad} have a rotary dim other "
                             "than their head dim")
        if self.hidden_act == "gelu_pytorch_tanh" and self.moe is not None and self.moe.activation != "gelu_tanh":
            raise ValueError("hidden_act='gelu_pytorch_tanh' is implemented for the dense MLP only (the routed "
                             "experts run it only as activation='gelu_tanh'); a mixture-of-experts model with it is "
                             "not supported")
        if self.qk_norm and self.qk_norm_whole:
            raise ValueError("qk_norm (per head) and qk_norm_whole (over the whole projection) exclude each other")
        if self.attn_sinks and (self.mla is not None or self.linear_attn is not None):
            raise ValueError("attention sinks are implemented for grouped-query attention layers only (not with "
                             "multi-head latent attention or Gated DeltaNet layers)")
        if self.mla is not None and self.sliding_window is not None:
            raise ValueError("sliding-window attention with multi-head latent attention is not supported")
        if not 0 <= self.carried_mtp_layers <= self.mtp_layers:
            raise ValueError(f"carried_mtp_layers={self.carried_mtp_layers} must lie in [0, mtp_layers="
                             f"{self.mtp_layers}]")
        if self.dsa is not None and (self.mla is None or self.mla.q_lora_rank is None):
            raise ValueError("the sparse-attention indexer reads the q LoRA latent: it needs multi-head latent "
                             "attention with q_lora_rank set")
        if self.mla is not None:
            if self.rotary_dim != self.mla.qk_rope_head_dim:
                raise ValueError(f"rotary dim {self.rotary_dim} != qk_rope_head_dim={self.mla.qk_rope_head_dim}")
            if self.num_kv_heads != self.num_heads or self.head_dim != self.mla.q_head_dim:
                raise ValueError("a multi-head latent attention spec has num_kv_heads == num_heads and head_dim == "
                                 f"q_head_dim (got {self.num_kv_heads}, {self.head_dim})")

    def is_global_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` runs the global attention shape (``global_head_dim`` /
        ``global_kv_heads``)."""
        return layer in self.global_layers

    def head_dim_of(self, layer: int) -> int:
        """Layer ``layer``'s attention head dim."""
        return self.global_head_dim if self.is_global_layer(layer) else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """Layer ``layer``'s KV-head count."""
        return self.global_kv_heads if self.is_global_layer(layer) else self.num_kv_heads

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys / values layer ``layer`` reuses (None: it computes its own)."""
        return self.kv_sources[layer] if layer < len(self.kv_sources) else None

    def is_kv_shared(self, layer: int) -> bool:
        return self.kv_source(layer) is not None

    def mlp_width(self, layer: int) -> int:
        """Layer ``layer``'s dense MLP width: doubled on Gemma 4's KV-sharing layers with ``double_wide_mlp``."""
        return self.intermediate_size * (2 if self.double_wide_mlp and self.is_kv_shared(layer) else 1)

    @property
    def kv_head_counts(self) -> tuple[int, ...]:
        """The KV-head counts of the layers, sorted (two with Gemma 4's global layers of their own count)."""
        return tuple(sorted({self.num_kv_heads} | ({self.global_kv_heads} if self.global_layers else set())))

    @property
    def global_q_size(self) -> int:
        return self.num_heads * self.global_head_dim

    @property
    def global_kv_size(self) -> int:
        return self.global_kv_heads * self.global_head_dim

    def has_indexer(self, layer: int) -> bool:
        """Whether global layer ``layer`` runs a sparse-attention indexer of its own (MTP layers do)."""
        return self.dsa is not None and layer not in self.dsa.shared

    # shapes the indexer rows name (0 without one)
    @property
    def index_q_size(self) -> int:
        return self.dsa.n_heads * self.dsa.head_dim if self.dsa else 0

    @property
    def index_head_dim(self) -> int:
        return self.dsa.head_dim if self.dsa else 0

    @property
    def index_n_heads(self) -> int:
        return self.dsa.n_heads if self.dsa else 0
    def block_kind(self, layer: int) -> str | None:
        """The one block of global layer ``layer`` (:data:`BLOCK_KINDS`; a one-block-per-layer model, Nemotron-H),
        or None: the layer is attention then MLP."""
        if not self.layer_blocks:
            return None
        return self.layer_blocks[layer] if layer < len(self.layer_blocks) else "attention"

    def is_mamba_layer(self, layer: int) -> bool:
        return self.mamba is not None and layer in self.mamba.layers

    # shapes the Mamba-2 rows name (0 without Mamba-2 layers)
    @property
    def mamba_in_proj_size(self) -> int:
        return self.mamba.in_proj_size if self.mamba else 0

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba.conv_dim if self.mamba else 0

    @property
    def mamba_inner(self) -> int:
        return self.mamba.inner if self.mamba else 0

    @property
    def mamba_heads(self) -> int:
        return self.mamba.num_heads if self.mamba else 0

    @property
    def mamba_conv_kernel(self) -> int:
        return self.mamba.conv_kernel if self.mamba else 0

    @property
    def moe_latent_size(self) -> int:
        return (self.moe.latent_size or 0) if self.moe else 0

    @property
    def expert_input_size(self) -> int:
        """The routed experts' input width: the latent size (Nemotron-3's ``moe_latent_size``) or hidden."""
        return self.moe_latent_size or self.hidden_size

    def is_linear_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` is a Gated DeltaNet layer (else attention; MTP layers are attention)."""
        return self.linear_attn is not None and layer in self.linear_attn.layers

    @property
    def q_proj_size(self) -> int:
        """q_proj's rows: ``q_size``, doubled by the output gate's per-head ``[q_h; gate_h]``."""
        return self.q_size * (2 if self.attn_output_gate else 1)

    # shapes the Gated DeltaNet rows name (0 without linear layers)
    @property
    def gdn_key_dim(self) -> int:
        return self.linear_attn.key_dim if self.linear_attn else 0

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_attn.value_dim if self.linear_attn else 0

    @property
    def gdn_conv_dim(self) -> int:
        """The conv's channels, ``in_proj_qkv``'s rows: ``[q; k; v]``."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_qkvz_size(self) -> int:
        return self.gdn_conv_dim + self.gdn_value_dim

    @property
    def gdn_value_heads(self) -> int:
        return self.linear_attn.num_value_heads if self.linear_attn else 0

    @property
    def gdn_ba_size(self) -> int:
        return 2 * self.gdn_value_heads

    @property
    def gdn_value_head_dim(self) -> int:
        return self.linear_attn.value_head_dim if self.linear_attn else 0

    @property
    def gdn_conv_kernel(self) -> int:
        return self.linear_attn.conv_kernel if self.linear_attn else 0

    def layer_rope(self, layer: int) -> RopeSpec:
        """Global layer ``layer``'s RoPE (``layer_ropes[layer]``, else ``rope``)."""
        r = self.layer_ropes[layer] if layer < len(self.layer_ropes) else None
        return self.rope if r is None else r

    def window(self, layer: int) -> int | None:
        """Global layer ``layer``'s sliding window (None: full causal attention)."""
        return self.layer_windows[layer] if layer < len(self.layer_windows) else None

    @property
    def sliding_window(self) -> int | None:
        """The smallest window of any layer (None: no layer has one)."""
        return min((w for w in self.layer_windows if w is not None), default=None)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` runs the routed-experts block instead of the dense MLP. A
        multi-token-prediction layer (``layer >= num_layers``) is built like the last decoder layer (DeepSeek-V3's
        and GLM-4.5's are MoE layers)."""
        if self.moe is None:
            return False
        return layer in self.moe.layers or (layer >= self.num_layers and self.num_layers - 1 in self.moe.layers)

    @property
    def mtp_eh_proj_in(self) -> int:
        """The input width of an MTP layer's ``eh_proj``: ``[enorm(embedding); hnorm(hidden)]``."""
        return 2 * self.hidden_size

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE rotates: ``head_dim`` unless partial (GLM-4.5) or MLA (its rope part)."""
        return self.yarn.dim if self.yarn is not None else self.rope.dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # shapes the MoE weight-table rows name
    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe.expert_intermediate_size if self.moe else 0

    @property
    def expert_gate_up_size(self) -> int:
        """An expert's fused gate / up output width, ``2 I`` (gpt-oss's ``gate_up_proj [E, H, 2 I]``)."""
        return 2 * self.expert_intermediate_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe.shared_expert_intermediate_size if self.moe else 0

    @property
    def moe_top_k(self) -> int:
        """Experts per token (DeepSeek-V4's ``tid2eid [vocab, top_k]`` rows name it)."""
        return self.moe.top_k if self.moe else 0

    # shapes the multi-head latent attention rows name (0 without MLA)
    @property
    def q_lora_rank(self) -> int:
        return (self.mla.q_lora_rank or 0) if self.mla else 0

    @property
    def kv_lora_rank(self) -> int:
        return self.mla.kv_lora_rank if self.mla else 0

    @property
    def mla_kv_a_size(self) -> int:
        """``kv_a_proj_with_mqa``'s rows: the latent, then the rope part of the shared key."""
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim if self.mla else 0

    @property
    def mla_kv_b_size(self) -> int:
        """``kv_b_proj``'s rows: per head ``[k_nope; v]``."""
        return self.num_heads * (self.mla.qk_nope_head_dim + self.mla.v_head_dim) if self.mla else 0

    @property
    def mla_v_size(self) -> int:
        """``o_proj``'s columns: every head's value."""
        return self.num_heads * self.mla.v_head_dim if self.mla else 0


def check_tp(spec: DecoderSpec, tp: int) -> None:
    """Raise ValueError when the model cannot be split over ``tp`` ranks, naming the numbers."""
    problems = []
    if spec.num_heads % tp:
        problems.append(f"num_attention_heads={spec.num_heads} is not divisible by tp={tp}")
    kv_counts = [("num_key_value_heads", spec.num_kv_heads)]
    if spec.global_layers:
        kv_counts.append(("num_global_key_value_heads", spec.global_kv_heads))
    for name, nkv in kv_counts:
        if nkv >= tp and nkv % tp:
            problems.append(f"{name}={nkv} is not divisible by tp={tp}")
        if nkv < tp and tp % nkv:
            problems.append(f"{name}={nkv} < tp={tp} and tp is not a multiple of it "
                            "(KV heads can only be replicated in equal blocks)")
        if spec.num_heads % nkv:
            problems.append(f"num_attention_heads={spec.num_heads} is not a multiple of {name}={nkv}")
    la = spec.linear_attn
    if la is not None:
        for name, n in (("linear_num_key_heads", la.num_key_heads), ("linear_num_value_heads", la.num_value_heads)):
            if n % tp:
                problems.append(f"{name}={n} is not divisible by tp={tp} (Gated DeltaNet layers split by heads)")
    mb = spec.mamba
    if mb is not None:
        if mb.num_heads % tp:
            problems.append(f"mamba_num_heads={mb.num_heads} is not divisible by tp={tp} (Mamba-2 layers split by "
                            "heads)")
        if mb.n_groups % tp:
            problems.append(f"n_groups={mb.n_groups} is not divisible by tp={tp} (each TP rank holds whole B / C "
                            "groups with the heads that read them, as megatron-core's Mamba layer; groups "
                            "replicated over TP ranks are not supported: use tp dividing n_groups)")
    dense = any(not spec.is_moe_layer(i) and spec.block_kind(i) in (None, "mlp") for i in range(spec.num_layers))
    if dense and spec.intermediate_size % tp:
        problems.append(f"intermediate_size={spec.intermediate_size} is not divisible by tp={tp}")
    if spec.moe is not None:
        for name, size in (("moe_intermediate_size", spec.moe.expert_intermediate_size),
                           ("shared_expert_intermediate_size", spec.moe.shared_expert_intermediate_size)):
            if size % tp:
                problems.append(f"{name}={size} is not divisible by tp={tp}")
    if problems:
        raise ValueError(f"{spec.architecture} cannot be split with tp={tp}: " + "; ".join(problems))


def check_ep(spec: DecoderSpec, ep: int) -> None:
    """Raise ValueError when the experts cannot be split over ``ep`` expert-parallel ranks (a dense model runs
    under any ep: expert parallelism then changes nothing)."""
    if spec.moe is not None and spec.moe.num_experts % ep:
        raise ValueError(f"{spec.architecture} cannot be split with ep={ep}: num_experts={spec.moe.num_experts} "
                         f"is not divisible by ep={ep}")


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Vocab rows after padding to a multiple of ``multiple * tp`` (padded rows are zeros, never in outputs)."""
    unit = multiple * tp
    return -(-vocab_size // unit) * unit
