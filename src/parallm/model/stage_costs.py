"""What each decoder layer and the head cost, for balancing the pipeline's stages (``build_model(pipeline_split=
"balanced")``): parameters read from the weight table, plus the attention / mixing work at a sequence length."""

from __future__ import annotations

from fractions import Fraction

from .spec import DecoderSpec
from .table import chunk_entries, resolve_shape


def forward_costs(table, spec: DecoderSpec, *, task: str) -> tuple[list[int], int]:
    """Multiply-adds per token of each decoder layer's forward and of the head, estimated from the weights the
    table declares: every matrix of a layer costs its size (a linear), a routed expert's matrices ``top_k /
    num_experts`` of theirs (a token visits ``top_k`` experts), vectors (norms, biases) nothing; the head costs
    ``vocab x hidden`` (causal_lm), ``hidden`` (value) or nothing (hidden). Not counted: the attention scores
    themselves (``~ seq x head_dim`` per head, the same in every layer, so long sequences make the layers
    relatively dearer than this says), elementwise work, the embedding lookup and the carried MTP layers (never
    run). What :func:`parallm.parallel.stages.balanced_sizes` balances."""
    layers = [Fraction(0)] * spec.num_layers
    for e in chunk_entries(table, spec, task=task, pp=1, pre_process=False, post_process=False,
                           layers=range(spec.num_layers)):
        share = Fraction(spec.moe.top_k, spec.moe.num_experts) if e.expert is not None else Fraction(1)
        for shape in e.row.shapes:
            full = resolve_shape(shape, spec)
            if len(full) == 2:
                layers[e.layer] += share * full[0] * full[1]
    head = {"causal_lm": spec.vocab_size * spec.hidden_size, "value": spec.hidden_size}.get(task, 0)
    return [round(c) for c in layers], head


# Tokens per sequence at which balance_costs counts the attention scores when none is given: a typical training
# length (capped by the model's max_position_embeddings), not a measured optimum.
BALANCE_SEQ_LEN = 4096


def mamba_mixing_cost(mb) -> int:
    """Multiply-adds per token of a Mamba-2 layer's chunked SSD scan beyond its weights, per head: within the
    chunk the ``C B^T`` scores and their weighted inputs, ``c (n + p)`` (chunk ``c``), the chunk state written and
    read, ``2 p n``; plus the depthwise conv, ``conv_dim x kernel``. Independent of the length."""
    c, n, p = mb.chunk_size, mb.state_size, mb.head_dim
    return mb.num_heads * (c * (n + p) + 2 * p * n) + mb.conv_dim * mb.conv_kernel


def mixing_costs(spec: DecoderSpec, *, seq_len: int) -> list[int]:
    """Multiply-adds per token of each layer's token mixing beyond its weights, for sequences of ``seq_len``
    tokens: an attention layer's scores and weighted values, ``heads x (qk_dim + v_dim) x keys``, ``keys`` the
    keys a query sees on average (``(seq_len + 1) / 2`` causal, fewer under a sliding window); a Gated DeltaNet
    layer's chunked gated delta rule per value head, ``3 dk dv`` (reading, correcting and updating the ``dk x dv``
    state) ``+ C (3 dk + 2 dv) + C^2 / 3`` (the within-chunk products and the triangular solve, chunk ``C`` =
    64), plus its depthwise conv, ``conv_dim x kernel``, independent of the length. At long sequences an
    attention layer costs far more than a Gated DeltaNet layer of the same weights, which is what a hybrid
    model's pipeline split must know. One-block layers (Nemotron-H): a Mamba-2 layer :func:`mamba_mixing_cost`,
    an MLP / MoE layer nothing."""
    from .layers.gated_deltanet import CHUNK
    lin = spec.linear_attn
    gdn_layers = set(lin.layers) if lin is not None else set()
    if lin is not None:
        dk, dv, hv, hk, c = lin.key_head_dim, lin.value_head_dim, lin.num_value_heads, lin.num_key_heads, CHUNK
        gdn = hv * (3 * dk * dv + c * (3 * dk + 2 * dv) + c * c // 3) + (2 * hk * dk + hv * dv) * lin.conv_kernel
    if spec.mla is not None:
        qk, v = spec.mla.qk_rope_head_dim + spec.mla.qk_nope_head_dim, spec.mla.v_head_dim
    else:
        qk = v = spec.head_dim
    out = []
    for i in range(spec.num_layers):
        if i in gdn_layers:
            out.append(gdn)
            continue
        kind = spec.block_kind(i)
        if kind in ("mlp", "moe"):          # one-block layers (Nemotron-H): no token mixing
            out.append(0)
            continue
        if kind == "mamba":
            out.append(mamba_mixing_cost(spec.mamba))
            continue
        w = spec.layer_windows[i] if i < len(spec.layer_windows) else None
        n = seq_len
        keys = Fraction(n + 1, 2) if w is None or w >= n else Fraction(w * (w + 1), 2 * n) + Fraction((n - w) * w, n)
        out.append(round(spec.num_heads * (qk + v) * keys))
    return out


def balance_costs(table, spec: DecoderSpec, *, task: str, seq_len: int | None = None) -> tuple[list[int], int]:
    """Per layer and for the head, multiply-adds per token: :func:`forward_costs` (the weights) plus
    :func:`mixing_costs` at ``seq_len`` (None: :data:`BALANCE_SEQ_LEN`, at most the model's
    ``max_position_embeddings``). What ``layers_per_stage="balanced"`` evens out."""
    if seq_len is None:
        seq_len = min(BALANCE_SEQ_LEN, spec.rope.max_position_embeddings or BALANCE_SEQ_LEN)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive whole number of tokens, got {seq_len!r}")
    layers, head = forward_costs(table, spec, task=task)
    return [a + b for a, b in zip(layers, mixing_costs(spec, seq_len=seq_len))], head
