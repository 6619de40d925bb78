"""The frozen description of a decoder that the one generic implementation runs.

A family file (``parallm.families.*``) turns a Hugging Face config into a :class:`DecoderSpec`; the decoder reads
only the spec, never the architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rope import RopeSpec

TASKS = ("causal_lm", "value", "hidden")   # "hidden": headless (final-normed hidden states)


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
    """
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    aux_loss_coef: float = 0.0


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
    sliding_window: int | None = None   # Mistral: sequences longer than this are refused (full attention below)
    moe: MoESpec | None = None  # mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral); None: every MLP dense

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` runs the routed-experts block instead of the dense MLP."""
        return self.moe is not None and layer in self.moe.layers

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
    def shared_expert_intermediate_size(self) -> int:
        return self.moe.shared_expert_intermediate_size if self.moe else 0


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
    dense = spec.moe is None or len(spec.moe.layers) < spec.num_layers
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
