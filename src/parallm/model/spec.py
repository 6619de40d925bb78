"""The frozen description of a decoder that the one generic implementation runs.

A family file (``parallm.families.*``) turns a Hugging Face config into a :class:`DecoderSpec`; the decoder reads
only the spec, never the architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .positions.rope import RopeSpec
from .layers.routing import check_grouping
from .positions.yarn import YarnSpec

TASKS = ("causal_lm", "value", "hidden")   # "hidden": headless (final-normed hidden states)
ROUTERS = ("softmax", "sigmoid_grouped", "topk_softmax")
# what the routed experts compute between their two projections (:mod:`parallm.model.layers.moe`)
ACTIVATIONS = ("silu", "clamped_swiglu", "relu2")   # relu2: relu(up x)^2, no gate (Nemotron-H)
# how a routed expert's weights are held and named (one expert's slab of the stacked parameter)
EXPERT_LAYOUTS = ("rows", "interleaved_columns")


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of a decoder (None on :class:`DecoderSpec` for dense models).

    Layers listed in ``layers`` (global indices) replace the dense MLP by a routed block: an fp32 router
    (``[num_experts, H]``, no bias) picks ``top_k`` experts per token from the softmax of its logits (weights
    renormalised to sum to 1 when ``norm_topk_prob``), every expert is a gated SiLU MLP of width
    ``expert_intermediate_size``, and the token's output is the weighted sum of its experts' outputs (dropless: no
    capacity limit). ``shared_expert_intermediate_size`` > 0 adds an always-on MLP of that width, scaled by
    ``sigmoid(shared_expert_gate(x))`` when ``shared_expert_gate`` (Qwen2-MoE). ``aux_loss_coef`` > 0 adds the
    load-balancing loss to ``forward_backward``'s loss (HF ``output_router_logits=True``; docs/moe.md).

    ``router``: ``"softmax"`` (the above: Qwen-MoE, Mixtral) or ``"sigmoid_grouped"`` (DeepSeek-V3, Kimi-K2,
    Moonlight, GLM-4.5; :mod:`parallm.model.layers.routing`): sigmoid scores, plus the fp32 selection bias
    ``e_score_correction_bias`` when ``score_bias``, choose the ``top_k`` experts among the ``topk_group`` best of
    ``n_group`` groups; the weights are the unbiased scores (renormalised when ``norm_topk_prob``) times
    ``routed_scaling_factor``. The shared expert of those families is one ungated MLP of ``n_shared_experts *
    moe_intermediate_size`` (``shared_expert_intermediate_size``), as transformers builds it; their dense-first
    layers (``first_k_dense_replace``) are the layers not in ``layers``. ``"topk_softmax"`` (gpt-oss): the
    router's logits (``router_bias``: plus a trained bias ``[E]``) choose the ``top_k`` largest, and the weights
    are the softmax over those ``k`` logits (they always sum to 1; ``norm_topk_prob`` is not read).

    The experts (gpt-oss): ``expert_bias`` gives both projections a bias per expert; ``activation``
    ``"clamped_swiglu"`` is ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate,
    max=limit)`` (``swiglu_limit``, ``swiglu_alpha``), as transformers' ``GptOssExperts._apply_gate``;
    ``expert_layout`` ``"interleaved_columns"`` holds an expert's ``gate_up`` as ``[H, 2 I]`` with gate / up in
    the even / odd columns and ``down`` as ``[I, H]`` (transformers' gpt-oss layout: no transpose or de-interleave
    on the way in or out), ``"rows"`` as ``[gate; up]`` ``[2 I, H]`` and ``[H, I]`` (every other family).
    """
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    aux_loss_coef: float = 0.0
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    expert_layout: str = "rows"
    # Nemotron-3: the routed experts work in a latent space, fc1_latent_proj [latent, H] before them and
    # fc2_latent_proj [H, latent] after (the router and the shared expert see the hidden states); None: no latent
    latent_size: int | None = None
    latent_bias: bool = False

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {self.expert_layout!r}")
        clamp = (self.swiglu_limit, self.swiglu_alpha)
        if self.activation == "clamped_swiglu":
            bad = [f"{k}={v!r}" for k, v in zip(("swiglu_limit", "swiglu_alpha"), clamp)
                   if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
            if bad:
                raise ValueError(f"the clamped SwiGLU needs positive {', '.join(bad)}")
        elif clamp != (None, None):
            raise ValueError(f"swiglu_limit / swiglu_alpha apply to activation='clamped_swiglu' only (got "
                             f"{self.activation!r})")
        if self.router_bias and self.router != "topk_softmax":
            raise ValueError(f"a trained router bias is the topk_softmax router's (got router={self.router!r})")
        if self.router in ("softmax", "topk_softmax"):
            extras = {k: v for k, v in (("n_group", self.n_group != 1), ("topk_group", self.topk_group != 1),
                                        ("routed_scaling_factor", self.routed_scaling_factor != 1.0),
                                        ("score_bias", self.score_bias)) if v}
            if extras:
                raise ValueError(f"the {self.router} router takes none of {sorted(extras)} (sigmoid_grouped "
                                 "does)")
        else:
            check_grouping(self.num_experts, self.top_k, self.n_group, self.topk_group)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight; transformers' ``DeepseekV3Attention``).

    Queries: ``q_b(norm(q_a(x)))`` with a ``q_lora_rank`` latent, or ``q_proj(x)`` when ``q_lora_rank`` is None
    (Moonlight); keys and values: ``kv_a_proj_with_mqa(x)`` gives a ``kv_lora_rank`` latent, normed and expanded
    per head by ``kv_b`` into ``[k_nope; v]``, plus one ``qk_rope_head_dim`` key part shared by every head. RoPE
    rotates the rope part of queries and keys only (interleaved pairs when ``rope_interleave``). The latent norms
    use ``latent_norm_eps`` (transformers builds them with the default 1e-6, whatever ``rms_norm_eps`` says).
    ``down_proj_bias``: ``q_a_proj`` / ``kv_a_proj_with_mqa`` carry a bias (``attention_bias``; o_proj's bias is
    :attr:`DecoderSpec.o_bias`). ``softmax_scale``: as ``DeepseekV3Attention.scaling`` (yarn's mscale squared
    included, :func:`parallm.model.positions.yarn.mla_softmax_scale`); None: ``q_head_dim ** -0.5``.

    Naming trap: :attr:`q_head_dim` (nope + rope) is transformers' ``qk_head_dim``; megatron-core's
    ``qk_head_dim`` is the nope part alone (its rope part is ``qk_pos_emb_head_dim``).
    """
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True
    softmax_scale: float | None = None
    latent_norm_eps: float = 1e-6
    down_proj_bias: bool = False

    def __post_init__(self):
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                 "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise ValueError(f"invalid multi-head latent attention sizes: {', '.join(bad)} (positive integers)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @property
    def q_head_dim(self) -> int:
        """nope + rope: transformers' ``qk_head_dim`` (megatron-core: ``qk_head_dim + qk_pos_emb_head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.q_head_dim ** (-0.5)


@dataclass(frozen=True)
class DSASpec:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5; :mod:`parallm.model.layers.indexer`):
    per query, ``n_heads`` heads of width ``head_dim`` (their first ``rope_dim`` channels rotated, interleaved
    pairs when ``rope_interleave`` (GLM-5) else rotate_half (DeepSeek-V3.2)) score every earlier key against one
    shared key head; the ReLU'd scores weighted per head and summed pick the ``topk`` keys the multi-head latent
    attention then sees. ``shared``: the layers that run no indexer of their own and reuse the selection of the
    last ``full`` layer before them (GLM's ``indexer_types``); every other layer has its own."""
    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int
    rope_interleave: bool
    shared: tuple[int, ...] = ()

    def __post_init__(self):
        sizes = {"index_n_heads": self.n_heads, "index_head_dim": self.head_dim, "index_topk": self.topk}
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise ValueError(f"invalid sparse-attention indexer sizes: {', '.join(bad)} (positive integers)")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"the indexer rotates qk_rope_head_dim={self.rope_dim} channels of index_head_dim="
                             f"{self.head_dim} (an even number up to it is needed)")
        if 0 in self.shared:
            raise ValueError("layer 0 cannot reuse another layer's top-k selection (indexer_types[0] must be "
                             "'full')")

    def source(self, layer: int) -> int:
        """The layer whose selection ``layer`` uses: itself, or for a shared layer the last full one before it."""
        while layer in self.shared:
            layer -= 1
        return layer


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """The Gated DeltaNet (linear attention) layers of a hybrid model (Qwen3-Next, Qwen3.5:
    :mod:`parallm.model.layers.gated_deltanet`). ``layers``: the global indices of the layers that run it (the
    others run full attention); ``num_key_heads`` / ``num_value_heads`` of widths ``key_head_dim`` / ``value_head_dim``
    (value heads a multiple of key heads); ``conv_kernel``: the depthwise conv's window. ``interleaved``: the
    checkpoint's input projections are Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (rows grouped by key
    head) rather than Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[int, ...]
    interleaved: bool = False

    def __post_init__(self):
        sizes = {"linear_num_key_heads": self.num_key_heads, "linear_num_value_heads": self.num_value_heads,
                 "linear_key_head_dim": self.key_head_dim, "linear_value_head_dim": self.value_head_dim,
                 "linear_conv_kernel_dim": self.conv_kernel}
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise ValueError(f"invalid Gated DeltaNet sizes: {', '.join(bad)} (positive integers)")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_key_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class Mamba2Spec:
    """The Mamba-2 layers of a hybrid model (Nemotron-H / Nemotron-3: :mod:`parallm.model.layers.mamba2`).
    ``layers``: their global indices; ``num_heads`` heads of ``head_dim`` channels (``d_inner = num_heads *
    head_dim``); ``n_groups`` groups of B / C of ``state_size`` each (head ``h`` reads group ``h // (num_heads /
    n_groups)``); ``conv_kernel``: the depthwise conv's window over ``[x; B; C]``; ``chunk_size``: the SSD scan's
    chunk; ``time_step_limit``: dt is clamped to it after softplus; ``conv_bias`` / ``proj_bias``: the conv's
    bias, in_proj / out_proj biases (``use_conv_bias`` / ``use_bias``); ``norm_eps``: the gated norm's."""
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    layers: tuple[int, ...]
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self):
        sizes = {"mamba_num_heads": self.num_heads, "mamba_head_dim": self.head_dim, "n_groups": self.n_groups,
                 "ssm_state_size": self.state_size, "conv_kernel": self.conv_kernel, "chunk_size": self.chunk_size}
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if bad:
            raise ValueError(f"invalid Mamba-2 sizes: {', '.join(bad)} (positive integers)")
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def bc_size(self) -> int:
        """One of B / C: ``n_groups * state_size`` channels."""
        return self.n_groups * self.state_size

    @property
    def conv_dim(self) -> int:
        """The conv's channels ``[x; B; C]``."""
        return self.inner + 2 * self.bc_size

    @property
    def in_proj_size(self) -> int:
        """in_proj's rows ``[z; x; B; C; dt]``."""
        return 2 * self.inner + 2 * self.bc_size + self.num_heads


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

    def __post_init__(self):
        # only the fields that existing families never set are checked here (tests replace() sizes freely)
        if self.yarn is not None and (self.rope.kind != "default" or self.rope.dim != self.yarn.dim):
            raise ValueError(f"with yarn RoPE, rope must be the default kind of the same dim (got {self.rope})")
        bad = [w for w in self.layer_windows if w is not None and (isinstance(w, bool) or not isinstance(w, int)
                                                                  or w < 1)]
        if bad:
            raise ValueError(f"layer_windows holds a window (a positive integer) or None per layer; got "
                             f"{self.layer_windows}")
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
    nkv = spec.num_kv_heads
    if nkv >= tp and nkv % tp:
        problems.append(f"num_key_value_heads={nkv} is not divisible by tp={tp}")
    if nkv < tp and tp % nkv:
        problems.append(f"num_key_value_heads={nkv} < tp={tp} and tp is not a multiple of it "
                        "(KV heads can only be replicated in equal blocks)")
    if spec.num_heads % nkv:
        problems.append(f"num_attention_heads={spec.num_heads} is not a multiple of num_key_value_heads={nkv}")
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
