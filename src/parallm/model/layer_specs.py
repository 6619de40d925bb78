"""The parts of a :class:`~parallm.model.spec.DecoderSpec` that describe one layer kind: the mixture-of-experts
block (:class:`MoESpec`), multi-head latent attention (:class:`MLASpec`) and its DeepSeek sparse-attention indexer
(:class:`DSASpec`), and the two recurrent kinds, Gated DeltaNet (:class:`GatedDeltaNetSpec`) and Mamba-2
(:class:`Mamba2Spec`). Frozen; read by the layers of :mod:`parallm.model.layers`. Re-exported by
:mod:`parallm.model.spec`."""

from __future__ import annotations

from dataclasses import dataclass

from .layers.routing import check_grouping

ROUTERS = ("softmax", "sigmoid_grouped", "topk_softmax", "sqrtsoftplus", "gemma4")
# what the routed experts compute between their two projections (:mod:`parallm.model.layers.moe`)
# relu2: relu(up x)^2, no gate (Nemotron-H); clamped_silu: silu(clamp(gate, max=L)) * clamp(up, -L, L) (DeepSeek-V4)
# gelu_tanh: gelu_tanh(gate x) * up x (Gemma 4's experts, transformers' GELUTanh)
ACTIVATIONS = ("silu", "clamped_swiglu", "relu2", "clamped_silu", "gelu_tanh")
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

    DeepSeek-V4 (``router="sqrtsoftplus"``, :func:`parallm.families.deepseek_v4_moe.v4_moe_spec`): scores
    ``sqrt(softplus(x W^T))``, the ``top_k`` experts of ``scores + e_score_correction_bias`` (``score_bias``),
    weights the chosen scores / (their sum + 1e-20) * ``routed_scaling_factor`` (always renormalised: no groups,
    ``norm_topk_prob`` must be True). ``hash_layers`` (a subset of ``layers``): their experts are the frozen int64
    table ``tid2eid[token_id]`` ``[vocab, top_k]`` (no correction bias there), the weights computed as above from
    the learned router; :meth:`MoEBlock.forward` needs the token ids there. ``activation="clamped_silu"``:
    ``silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)`` (``swiglu_limit``, no alpha);
    ``shared_expert_limit``: the same clamps on the shared expert (V4's ``DeepseekV4MLP``). The load-balancing
    loss of this router reads ``softmax(logits)`` and its top-k (transformers' ``load_balancing_loss_func`` on
    the recorded router logits), of the non-hash layers only (:attr:`balanced_layers`).

    Gemma 4 (``router="gemma4"``, ``beside_mlp``; :mod:`parallm.model.layers.moe_beside`): the routed block runs
    beside the dense MLP, not instead of it. Its router reads the layer's residual (not the experts' input):
    weightless RMSNorm, times ``scale`` ``[H]`` and ``H^-0.5``, logits, softmax, top-k renormalised, times
    ``per_expert_scale[e]``; the experts (``activation="gelu_tanh"``) read ``pre_feedforward_layernorm_2`` of the
    residual; the two outputs are normed apart and summed.
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
    # DeepSeek-V4: the MoE layers whose experts come from the token ids (tid2eid), and the shared expert's clamp
    hash_layers: tuple[int, ...] = ()
    shared_expert_limit: float | None = None
    # Gemma 4: the routed block beside the dense MLP (its own norms; the router on the residual)
    beside_mlp: bool = False

    @property
    def balanced_layers(self) -> tuple[int, ...]:
        """The MoE layers whose router the load-balancing loss reads: all but the hash layers (transformers
        records the router logits of ``DeepseekV4TopKRouter`` only)."""
        return tuple(layer for layer in self.layers if layer not in self.hash_layers)

    def is_hash_layer(self, layer: int) -> bool:
        return layer in self.hash_layers

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {self.expert_layout!r}")
        clamp = (self.swiglu_limit, self.swiglu_alpha)
        self._check_v4()
        if self.activation == "clamped_silu":
            pass
        elif self.activation == "clamped_swiglu":
            bad = [f"{k}={v!r}" for k, v in zip(("swiglu_limit", "swiglu_alpha"), clamp)
                   if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
            if bad:
                raise ValueError(f"the clamped SwiGLU needs positive {', '.join(bad)}")
        elif clamp != (None, None):
            raise ValueError(f"swiglu_limit / swiglu_alpha apply to activation='clamped_swiglu' only (got "
                             f"{self.activation!r})")
        if self.router == "sqrtsoftplus":
            return
        if self.router_bias and self.router != "topk_softmax":
            raise ValueError(f"a trained router bias is the topk_softmax router's (got router={self.router!r})")
        if self.beside_mlp != (self.router == "gemma4"):
            raise ValueError(f"beside_mlp={self.beside_mlp} goes with router='gemma4' only (got router="
                             f"{self.router!r})")
        if self.router in ("softmax", "topk_softmax", "gemma4"):
            extras = {k: v for k, v in (("n_group", self.n_group != 1), ("topk_group", self.topk_group != 1),
                                        ("routed_scaling_factor", self.routed_scaling_factor != 1.0),
                                        ("score_bias", self.score_bias)) if v}
            if extras:
                raise ValueError(f"the {self.router} router takes none of {sorted(extras)} (sigmoid_grouped "
                                 "does)")
        else:
            check_grouping(self.num_experts, self.top_k, self.n_group, self.topk_group)

    def _check_v4(self) -> None:
        """DeepSeek-V4's fields: the clamped SiLU's limit, the sqrtsoftplus router's options, the hash layers."""
        def positive(v):
            return not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0
        if self.activation == "clamped_silu" and (not positive(self.swiglu_limit) or self.swiglu_alpha is not None):
            raise ValueError(f"the clamped SiLU needs a positive swiglu_limit and no swiglu_alpha (got swiglu_limit="
                             f"{self.swiglu_limit!r}, swiglu_alpha={self.swiglu_alpha!r})")
        if self.shared_expert_limit is not None and not (positive(self.shared_expert_limit)
                                                         and self.shared_expert_intermediate_size > 0):
            raise ValueError(f"shared_expert_limit={self.shared_expert_limit!r} needs a positive limit and a shared "
                             f"expert (shared_expert_intermediate_size={self.shared_expert_intermediate_size})")
        if self.router == "sqrtsoftplus":
            extras = {k for k, v in (("n_group", self.n_group != 1), ("topk_group", self.topk_group != 1),
                                     ("router_bias", self.router_bias), ("norm_topk_prob=False",
                                                                         not self.norm_topk_prob)) if v}
            if extras:
                raise ValueError(f"the sqrtsoftplus router takes none of {sorted(extras)} (it always "
                                 "renormalises, has no groups and no trained bias)")
            if self.top_k > self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.top_k} exceeds n_routed_experts={self.num_experts}")
        if self.hash_layers:
            if self.router != "sqrtsoftplus":
                raise ValueError(f"hash layers route with the sqrtsoftplus router's weights (got router="
                                 f"{self.router!r})")
            stray = sorted(set(self.hash_layers) - set(self.layers))
            if stray:
                raise ValueError(f"hash layers {stray} are not MoE layers (MoE layers: {list(self.layers)})")


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


V4_LAYER_KINDS = ("sliding", "csa", "hca")


@dataclass(frozen=True)
class V4Spec:
    """DeepSeek-V4's attention and residual streams (``families/deepseek_v4.py``; transformers'
    ``DeepseekV4Attention`` / ``DeepseekV4HyperConnection``).

    Attention, every layer: multi-query attention with one key = value head of ``head_dim`` (the decoder spec's),
    queries through a low-rank ``q_lora_rank`` bottleneck (``q_a_proj``, weighted RMSNorm, ``q_b_proj``, then a
    weightless RMSNorm per head), a learned sink logit per head, a sliding window of ``sliding_window`` raw keys
    (the query's own included) and the grouped low-rank output projection (``o_groups`` groups of heads, each to
    ``o_lora_rank``, then ``o_b_proj``). RoPE is interleaved (pairs of adjacent channels) on the trailing
    ``rope_dim`` channels of each head, and undone (``-sin``) on the attention output. ``layer_kinds[i]``:
    ``"sliding"`` (that only; RoPE ``main_rope``), ``"csa"`` (compressed sparse attention: every ``csa_rate``
    tokens pooled into one compressed key over an overlapping window of ``2 * csa_rate``, of which the lightning
    indexer's ``index_topk`` per query are attended, ``index_heads`` x ``index_head_dim``), ``"hca"`` (heavily
    compressed: every ``hca_rate`` tokens pooled into one compressed key, all visible ones attended); compressed
    layers rotate queries, keys and compressed keys by ``compress_rope`` (a RopeSpec, or a YarnSpec with
    ``attention_factor`` 1).

    Hyper-connections: the residual is ``hc_mult`` streams of ``H`` (``[.., hc_mult, H]`` between layers, flattened
    to ``hc_mult * H`` where a tensor of fixed width is needed: the pipeline's send / receive), mixed before and
    after attention and the MLP by weights from a learned projection, the mixing matrix made doubly stochastic by
    ``hc_sinkhorn_iters`` Sinkhorn steps (``hc_eps``); the last stage collapses the streams (``hc_head``) before
    the final norm."""
    layer_kinds: tuple[str, ...]
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_dim: int
    main_rope: object          # RopeSpec (model.positions.rope)
    compress_rope: object      # RopeSpec or YarnSpec (model.positions.yarn)
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    def __post_init__(self):
        bad = [k for k in self.layer_kinds if k not in V4_LAYER_KINDS]
        if bad:
            raise ValueError(f"DeepSeek-V4 layer kinds must be among {V4_LAYER_KINDS}, got {bad}")
        sizes = {k: getattr(self, k) for k in ("q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                                               "rope_dim", "csa_rate", "hca_rate", "index_heads",
                                               "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters")}
        wrong = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
        if wrong:
            raise ValueError(f"invalid DeepSeek-V4 config: {', '.join(wrong)} (positive integers expected)")
        if self.rope_dim % 2:
            raise ValueError(f"DeepSeek-V4 rotates rope_dim={self.rope_dim} channels (an even number is needed)")

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer]
