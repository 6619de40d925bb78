"""Shared pieces of the DeepSeek-V4 attention tests (tests/test_v4_attention*.py): a tiny transformers config,
parallm's spec of it, transformers' ``DeepseekV4Attention`` run on each row alone (the reference), parallm's
``V4Attention`` loaded from its weights and run on a padded / packed / sequence-parallel / TP layout."""

from __future__ import annotations

import torch

KINDS = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
LAYER = {"sliding": 0, "csa": 1, "hca": 2}

# HF module parameter (of DeepseekV4Attention) -> parallm's V4Attention parameter (where they differ)
RENAMES = {
    "compressor.indexer.kv_proj.weight": "indexer.compressor.kv_proj.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.gate_proj.weight",
    "compressor.indexer.position_bias": "indexer.compressor.position_bias",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.kv_norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.q_b_proj.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
}
SPLIT0 = ("q_b_proj.weight", "sinks", "o_a_proj.weight")      # split along dim 0 over TP
SPLIT1 = ("o_b_proj.weight",)                                  # along dim 1


def hf_config(*, yarn: bool = False, window: int = 4, topk: int = 2, csa_rate: int = 2, hca_rate: int = 4,
              heads: int = 4, o_groups: int = 2):
    from transformers import DeepseekV4Config
    # the checkpoints' flat form: transformers nests it into "main" (default, rope_theta) and "compress" (the
    # yarn parameters, compress_rope_theta, attention_factor 1)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1} if yarn else {"rope_type": "default"}
    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=heads, head_dim=16, q_lora_rank=12,
        o_groups=o_groups, o_lora_rank=8, sliding_window=window, index_n_heads=3, index_head_dim=8,
        index_topk=topk, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=2,
        layer_types=list(KINDS.values()), partial_rotary_factor=0.5, mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": csa_rate, "heavily_compressed_attention": hca_rate},
        rope_parameters=rope, rope_theta=10000.0, compress_rope_theta=160000.0,
        max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return cfg


def parallm_spec(cfg):
    """parallm's DecoderSpec (attention fields) of the HF config, built by hand (the family file is the lead's)."""
    from parallm.model.layer_specs import V4Spec
    from parallm.model.positions.rope import RopeSpec
    from parallm.model.positions.yarn import yarn_spec_from_params
    from parallm.model.spec import DecoderSpec
    rope_dim = cfg.qk_rope_head_dim
    comp = cfg.rope_parameters["compress"]
    compress = yarn_spec_from_params(dict(comp, attention_factor=comp.get("attention_factor", 1.0)), dim=rope_dim,
                                     max_position_embeddings=cfg.max_position_embeddings) \
        if comp["rope_type"] == "yarn" else RopeSpec(dim=rope_dim, theta=comp["rope_theta"], kind="default")
    v4 = V4Spec(layer_kinds=tuple(LAYER), q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
                o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window, rope_dim=rope_dim,
                main_rope=RopeSpec(dim=rope_dim, theta=cfg.rope_parameters["main"]["rope_theta"], kind="default"),
                compress_rope=compress, csa_rate=cfg.compress_rates["compressed_sparse_attention"],
                hca_rate=cfg.compress_rates["heavily_compressed_attention"], index_heads=cfg.index_n_heads,
                index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, hc_mult=cfg.hc_mult,
                hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps)
    return DecoderSpec(family="deepseek_v4", architecture="DeepseekV4ForCausalLM", model_type="deepseek_v4",
                       hidden_size=cfg.hidden_size, num_layers=3, num_heads=cfg.num_attention_heads, num_kv_heads=1,
                       head_dim=cfg.head_dim, intermediate_size=16, vocab_size=64, rms_norm_eps=cfg.rms_norm_eps,
                       rope=RopeSpec(dim=rope_dim, theta=10000.0, kind="default"), v4=v4)


def hf_layer(cfg, kind: str, seed: int = 1):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    from parallm.verify.reference import randomize_weights
    torch.manual_seed(0)
    layer = DeepseekV4Attention(cfg, LAYER[kind])
    randomize_weights(layer, seed)
    with torch.no_grad():
        layer.sinks.mul_(10.0)             # sinks that weigh: ~N(0, 0.8)
    return layer


def hf_mask(n: int, window: int) -> torch.Tensor:
    i = torch.arange(n)
    ok = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    return torch.zeros(n, n).masked_fill(~ok, float("-inf"))[None, None]


def hf_reference(layer, cfg, x, lengths, r):
    """transformers on each row alone (its first ``lengths[b]`` tokens), fp32: (out ``[B, S, H]`` zeros at
    padding, x grad, parameter grads summed over rows) of the loss ``sum(out * r)``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    rotary = DeepseekV4RotaryEmbedding(cfg)
    layer.zero_grad()
    out = torch.zeros_like(x)
    gx = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        xb = x[b:b + 1, :n].clone().requires_grad_()
        pos = torch.arange(n)[None]
        emb = {t: rotary(xb, pos, layer_type=t) for t in ("main", "compress")}
        o, _ = layer(xb, emb, pos, hf_mask(n, cfg.sliding_window))
        (o * r[b:b + 1, :n]).sum().backward()
        out[b, :n] = o[0].detach()
        gx[b, :n] = xb.grad[0]
    grads = {RENAMES.get(k, k): p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None}
    state = {RENAMES.get(k, k): v.detach().clone() for k, v in layer.state_dict().items()}
    return out, gx, grads, state


def build(spec, state, layer: int, *, tp: int = 1, rank: int = 0, sp: bool = False, cp_group=None):
    from parallm.model.decoder import make_config
    from parallm.model.layers.v4_attention import V4Attention
    from parallm.parallel.cpu_compat import enable_megatron_sequence_parallel_on_cpu
    config = make_config(tp=tp, pp=1, vpp=None, dtype=torch.float32, sequence_parallel=sp)
    if config.sequence_parallel:
        enable_megatron_sequence_parallel_on_cpu()
    attn = V4Attention(spec, config, tp, layer_number=layer, cp_group=cp_group)
    params = dict(attn.named_parameters())
    assert sorted(params) == sorted(state), (sorted(params), sorted(state))
    with torch.no_grad():
        for name, p in params.items():
            full = state[name]
            if name in SPLIT0:
                full = full.chunk(tp, 0)[rank]
            elif name in SPLIT1:
                full = full.chunk(tp, 1)[rank]
            p.copy_(full)
    return attn


def merge_grads(per_rank: list[dict], tp: int) -> dict:
    """Full parameter gradients from every TP rank's (split ones concatenated, replicated ones from rank 0)."""
    out = {}
    for name in per_rank[0]:
        gs = [g[name] for g in per_rank]
        out[name] = torch.cat(gs, 0) if name in SPLIT0 else torch.cat(gs, 1) if name in SPLIT1 else gs[0]
    return out


def run(spec, state, layer, x, lengths, r, *, packed: bool, tp: int = 1, rank: int = 0, sp: bool = False):
    """parallm's layer on the batch (padded ``[S, B]`` or packed), loss ``sum(out * r)``: (out ``[B, S, H]`` zeros
    at padding, x grad likewise, parameter grads), this rank's."""
    from parallm.model.layers.attention import PaddedRows, make_packing, pack_tokens, unpack_tokens
    b, s, h = x.shape
    mask = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    attn = build(spec, state, layer, tp=tp, rank=rank, sp=sp)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if packed:
        ctx = make_packing(mask, tp if sp else 1)
        xs = torch.stack([pack_tokens(x[..., k], ctx) for k in range(h)], -1)[:, None]
        rs = torch.stack([pack_tokens(r[..., k], ctx) for k in range(h)], -1)[:, None]
        ctx.positions = pack_tokens(pos, ctx)[:, None]
        if sp:
            xs, rs = xs.chunk(tp)[rank], rs.chunk(tp)[rank]
    else:
        ctx = PaddedRows(mask)
        ctx.positions = pos.transpose(0, 1)
        xs, rs = x.transpose(0, 1), r.transpose(0, 1)
    xs = xs.detach().clone().requires_grad_()
    out = attn(xs, None, None, ctx)
    (out * rs * _real(ctx, out, packed, sp, tp, rank)).sum().backward()
    grads = {n: p.grad for n, p in attn.named_parameters()}
    assert all(grads[n] is None for n in grads if n.startswith("indexer.")), "the indexer must stay frozen"
    grads = {n: g for n, g in grads.items() if g is not None}
    if packed:
        if sp:
            return out.detach(), xs.grad, grads, ctx
        return unpack_tokens(out[:, 0].detach(), ctx).transpose(0, 1), \
            unpack_tokens(xs.grad[:, 0], ctx).transpose(0, 1), grads, ctx
    return out.detach().transpose(0, 1), xs.grad.transpose(0, 1), grads, ctx


def _real(ctx, out, packed, sp, tp, rank):
    """1 at real tokens, 0 at padding, in out's layout (the loss counts real tokens only)."""
    if not packed:
        return ctx.keep.transpose(0, 1)[..., None].to(out.dtype)
    real = (torch.arange(ctx.total) < ctx.nnz).to(out.dtype)[:, None, None]
    return real.chunk(tp)[rank] if sp else real


def max_err(a, b, mask=None) -> float:
    if mask is not None:
        a, b = a[mask], b[mask]
    return float((a - b).abs().max()) if a.numel() else 0.0
