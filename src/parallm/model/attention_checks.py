"""The checks :class:`~parallm.model.spec.DecoderSpec` makes of its per-layer attention fields (Gemma 4's global
layers with their own head shape and K = V, KV sharing between layers)."""

from __future__ import annotations


def check_attention_per_layer(spec) -> None:
    """ValueError naming what is wrong with ``spec``'s ``global_layers`` / ``global_k_eq_v`` / ``kv_sources``."""
    _check_global_layers(spec)
    _check_kv_sources(spec)


def _check_kv_sources(spec) -> None:
    bad = [(i, s) for i, s in enumerate(spec.kv_sources) if s is not None and (
        not 0 <= s < i or spec.kv_source(s) is not None or spec.is_global_layer(s) != spec.is_global_layer(i)
        or spec.window(s) != spec.window(i))]
    if bad:
        raise ValueError(f"kv_sources: layer i reuses the keys / values of an earlier layer of its own kind "
                         f"that computes its own; got (layer, source) {bad}")
    if spec.kv_sources and (spec.mla is not None or spec.linear_attn is not None or spec.layer_blocks
                            or spec.v4 is not None or spec.qk_norm_whole):
        raise ValueError("KV sharing is implemented for grouped-query attention layers only")


def _check_global_layers(spec) -> None:
    if spec.global_k_eq_v and not spec.global_layers:
        raise ValueError("global_k_eq_v (K = V) applies to the layers of global_layers: none is given")
    if not spec.global_layers:
        return
    if spec.mla is not None or spec.linear_attn is not None or spec.layer_blocks or spec.qk_norm_whole \
            or spec.attn_output_gate or spec.yarn is not None:
        raise ValueError("a head shape per layer (global_layers) is implemented for plain grouped-query "
                         "attention layers only")
    if spec.global_head_dim < 1 or spec.global_kv_heads < 1 or \
            any(not 0 <= i < spec.num_layers for i in spec.global_layers):
        raise ValueError(f"global_layers={spec.global_layers} needs global_head_dim ({spec.global_head_dim}) "
                         f"and global_kv_heads ({spec.global_kv_heads}) >= 1 and layers in [0, "
                         f"{spec.num_layers})")
