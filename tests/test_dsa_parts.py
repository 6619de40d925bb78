"""DeepSeek Sparse Attention's building blocks against transformers 5 itself (fp32), before the decoder:

* config -> spec of DeepSeek-V3.2 and GLM-5 (indexer sizes, the indexer's RoPE layout, GLM's indexer_types and
  the pattern transformers derives, mlp_layer_types), refusals;
* the lightning indexer (``DeepseekV32Indexer``: half-split RoPE; ``GlmMoeDsaIndexer``: interleaved) selects the
  same keys for every real query of a padded batch (left / right / both-sides padding), sequences several times
  longer than ``index_topk`` (16 indexer heads: ties rare);
* the sparse latent attention layer (``DeepseekV32Attention`` / ``GlmMoeDsaAttention``: masked dense attention)
  forward and backward, padded and packed, at tp1; the selection matters (dense attention differs);
* memory linear in S: no operation of the layer's forward or backward makes a tensor of S x S elements.
"""

from __future__ import annotations

import helpers
import pytest
import torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
TOPK = 16


def _common(**overrides):
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, n_shared_experts=2, intermediate_size=96, num_hidden_layers=3,
              first_k_dense_replace=1, vocab_size=101, max_position_embeddings=256, index_topk=TOPK,
              index_head_dim=16, index_n_heads=16, rms_norm_eps=1e-2)
    kw.update(overrides)
    return kw


def v32_config(**overrides):
    """A tiny DeepseekV32Config: yarn (attention factor and softmax mscale non-trivial), biases, 4 groups."""
    from transformers import DeepseekV32Config
    cfg = DeepseekV32Config(**_common(**dict(dict(rope_parameters=dict(YARN), attention_bias=True, n_group=4,
                                                  topk_group=2, architectures=["DeepseekV32ForCausalLM"]),
                                             **overrides)))
    cfg._attn_implementation = "eager"
    return cfg


def glm5_config(**overrides):
    """A tiny GlmMoeDsaConfig (default RoPE, no biases); ``index_topk_freq`` etc. pass through."""
    from transformers import GlmMoeDsaConfig
    cfg = GlmMoeDsaConfig(**_common(**dict(dict(rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                                                architectures=["GlmMoeDsaForCausalLM"]), **overrides)))
    cfg._attn_implementation = "eager"
    return cfg


CONFIGS = {"deepseek_v32": v32_config, "glm_moe_dsa": glm5_config}


# -- config -> spec -------------------------------------------------------------------------------------------

def test_specs():
    from parallm.families import load_config, spec_from_config
    spec, fam = spec_from_config(v32_config())
    assert fam.name == "deepseek_v32" and spec.dsa.rope_interleave is False and spec.dsa.shared == ()
    assert (spec.dsa.n_heads, spec.dsa.head_dim, spec.dsa.topk, spec.dsa.rope_dim) == (16, 16, TOPK, 8)
    assert spec.mla.rope_interleave and spec.yarn is not None and spec.moe.layers == (1, 2)
    spec, fam = spec_from_config(glm5_config(num_hidden_layers=6, index_topk_freq=2, index_skip_topk_offset=1))
    assert fam.name == "glm_moe_dsa" and spec.dsa.rope_interleave is True and spec.dsa.shared == (1, 3, 5)
    assert [spec.dsa.source(i) for i in range(6)] == [0, 0, 2, 2, 4, 4]
    assert [spec.has_indexer(i) for i in range(7)] == [True, False, True, False, True, False, True]  # MTP: own
    # a config.json without indexer_types: transformers' rule, then the pattern form
    cfg = glm5_config(num_hidden_layers=6).to_dict()
    cfg.pop("indexer_types")
    cfg.update(index_topk_freq=3, index_skip_topk_offset=2)
    assert spec_from_config(load_config(cfg))[0].dsa.shared == (2, 3, 5)
    cfg.update(index_topk_pattern="FSFFSS")
    assert spec_from_config(load_config(cfg))[0].dsa.shared == (1, 4, 5)
    cfg.update(mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "dense"])
    assert spec_from_config(load_config(cfg))[0].moe.layers == (1, 3, 4)
    # mlp_layer_types alone (no first_k_dense_replace: GLM-5's default of 3 would leave a 2-layer model dense)
    two = glm5_config(num_hidden_layers=2).to_dict()
    two.pop("first_k_dense_replace", None)
    two.update(mlp_layer_types=["dense", "sparse"])
    assert spec_from_config(load_config(two))[0].moe.layers == (1,)
    cfg.update(index_topk_pattern="SFFFFF")
    with pytest.raises(ValueError, match="layer 0 cannot reuse"):
        spec_from_config(load_config(cfg))
    cfg.update(indexer_types=["full"] * 5)
    with pytest.raises(ValueError, match="indexer_types must hold"):
        spec_from_config(load_config(cfg))


def test_shared_layers_stay_with_their_source():
    from parallm.families import spec_from_config
    from parallm.model.layers.dsa import check_dsa_stages
    spec, _ = spec_from_config(glm5_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1))
    check_dsa_stages(spec, [range(2), range(2, 4)])
    with pytest.raises(ValueError, match=r"layer 3 reuses the top-k selection of layer 2 .* layers 3-3"):
        check_dsa_stages(spec, [range(3), range(3, 4)])


# -- inputs and transformers' modules -------------------------------------------------------------------------

def _batch(hidden, *, seq=100, q_lora=24):
    """x [4, seq, H], q_resid [4, seq, q_lora], a mask (full, left-, right-, both-sides padded), loss weights."""
    g = torch.Generator().manual_seed(7)
    _, mask = helpers.padded_batch(10, batch=4, seq=seq, seed=3)
    return (torch.randn(4, seq, hidden, generator=g), torch.randn(4, seq, q_lora, generator=g), mask,
            torch.randn(4, seq, hidden, generator=g))


def _hf_mask(mask):
    from parallm.model.layers.attention import padded_attention_mask
    allowed = padded_attention_mask(mask)
    return allowed, torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _hf_modules(family):
    if family == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
        return m.GlmMoeDsaIndexer, m.GlmMoeDsaAttention, m.GlmMoeDsaRotaryEmbedding
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m
    return m.DeepseekV32Indexer, m.DeepseekV32Attention, m.DeepseekV32RotaryEmbedding


def _parallm_rope(spec, pos):
    from parallm.model.positions.rope import rope_cos_sin
    from parallm.model.positions.yarn import yarn_cos_sin
    return yarn_cos_sin(spec.yarn, pos) if spec.yarn is not None else rope_cos_sin(spec.rope, pos)


def _load_indexer(indexer, hf_state, prefix=""):
    from parallm.model.layers.indexer import INDEXER_WEIGHTS
    with torch.no_grad():
        for hf, (local, _) in INDEXER_WEIGHTS.items():
            getattr(indexer, local).copy_(hf_state[prefix + hf])


def _selections(index, width):
    """Flat [rows * width, k] selections (int32, -1: empty) -> {(b, s): set of key positions}."""
    assert index.dtype == torch.int32
    out = {}
    rows = index.shape[0] // width
    for s in range(rows):
        for b in range(width):
            t = s * width + b
            out[(b, s)] = {int(i) // width for i in index[t] if i >= 0}
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_indexer_selects_what_transformers_selects(family):
    from parallm.families import spec_from_config
    from parallm.model.layers.attention import PaddedRows
    from parallm.model.layers.indexer import Indexer, key_ranges
    cfg = CONFIGS[family]()
    spec, _ = spec_from_config(cfg)
    hf_indexer, _, hf_rope = _hf_modules(family)
    ref = hf_indexer(cfg, 0)
    helpers.randomize_(ref, seed=5)
    x, q_resid, mask, _ = _batch(cfg.hidden_size)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    allowed, additive = _hf_mask(mask)
    with torch.no_grad():
        want = ref(x, q_resid, hf_rope(cfg)(x, pos), additive[:, 0], pos)                  # [B, S, topk]
    ours = Indexer(spec, torch.float32)
    _load_indexer(ours, ref.state_dict())
    cos, sin = _parallm_rope(spec, pos.transpose(0, 1))
    ctx = PaddedRows(mask.bool())
    index = ours.select(x.transpose(0, 1), q_resid.transpose(0, 1), cos, sin, key_ranges(ctx))
    got = _selections(index, width=4)
    longer = 0
    for b in range(4):
        for s in range(mask.shape[1]):
            if not mask[b, s]:
                continue
            expected = {int(j) for j in want[b, s] if allowed[b, 0, s, j]}
            visible = int(allowed[b, 0, s].sum())
            assert len(expected) == min(TOPK, visible)
            assert got[(b, s)] == expected, (b, s)
            longer += visible > TOPK
    assert longer > 200              # most queries choose among more keys than they keep
    # the RoPE layout matters: the other one selects differently
    other = Indexer(spec, torch.float32)
    _load_indexer(other, ref.state_dict())
    other.interleave = not other.interleave
    swapped = _selections(other.select(x.transpose(0, 1), q_resid.transpose(0, 1), cos, sin, key_ranges(ctx)), 4)
    assert sum(swapped[k] != got[k] for k in got if mask[k[0], k[1]]) > 20


# -- the attention layer --------------------------------------------------------------------------------------

def _hf_attention(family, cfg, x, mask, r, *, topk=None):
    """transformers' DSA attention (layer 0) on the padded batch: (state, output, input gradient, parameter
    gradients) of sum(out * r) over real positions."""
    _, hf_attn, hf_rope = _hf_modules(family)
    if topk is not None:
        cfg.index_topk = topk
    torch.manual_seed(0)
    attn = hf_attn(cfg, 0)
    helpers.randomize_(attn, seed=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    x = x.clone().requires_grad_()
    out = attn(hidden_states=x, position_embeddings=hf_rope(cfg)(x, pos), attention_mask=_hf_mask(mask)[1],
               position_ids=pos)[0]
    (out * r * mask[..., None]).sum().backward()
    state = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    return state, out.detach(), x.grad, {k: p.grad for k, p in attn.named_parameters() if p.grad is not None}


def _rows(t, packing):
    flat = t.reshape((-1,) + tuple(t.shape[2:]))[packing.indices]
    return torch.cat([flat, flat.new_zeros((packing.total - packing.nnz,) + tuple(flat.shape[1:]))])[:, None]


def build_dsa(spec, state, *, tp=1, rank=0, packed=False, sp=False):
    """parallm's DSAttention (layer 0) loaded from the HF ``state`` (MLA tensors through split_mla)."""
    from parallm.model.decoder import RMSNorm, make_config
    from parallm.model.layers.attention import resolve_attn_impl
    from parallm.model.layers.dsa import DSAttention
    from parallm.model.layers.indexer import INDEXER_WEIGHTS
    from parallm.model.layers.mla import MLA_WEIGHTS, split_mla
    from parallm.parallel.cpu_compat import enable_megatron_sequence_parallel_on_cpu
    config = make_config(tp=tp, pp=1, vpp=None, dtype=torch.float32, sequence_parallel=sp)
    if config.sequence_parallel:
        enable_megatron_sequence_parallel_on_cpu()
    backend = resolve_attn_impl("auto", packed=packed, device="cpu", dtype=torch.float32)
    attn = DSAttention(spec, config, tp, backend=backend, norm=RMSNorm, layer_number=0)
    params = dict(attn.named_parameters())
    names = {MLA_WEIGHTS[n][0]: n for n in state if n in MLA_WEIGHTS}
    names.update({"indexer." + local: "indexer." + hf for hf, (local, _) in INDEXER_WEIGHTS.items()})
    assert sorted(params) == sorted(names) and set(names.values()) == set(state), (sorted(params), sorted(state))
    with torch.no_grad():
        for local, hf in names.items():
            full = state[hf]
            params[local].copy_(split_mla(spec, hf, full, tp)[rank] if hf in MLA_WEIGHTS else full)
    return attn


def run_dsa(spec, state, x, mask, r, *, packed, tp=1, rank=0, sp=False):
    from parallm.model.layers.attention import PaddedRows, make_packing, pack_tokens
    attn = build_dsa(spec, state, tp=tp, rank=rank, packed=packed, sp=sp)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    if packed:
        ctx = make_packing(mask, tp if sp else 1)
        xs, rs, pos = _rows(x, ctx), _rows(r * mask[..., None], ctx), pack_tokens(pos, ctx)[:, None]
        if sp:
            xs, rs = xs.chunk(tp)[rank], rs.chunk(tp)[rank]
    else:
        ctx = PaddedRows(mask.bool())
        xs, rs, pos = x.transpose(0, 1), (r * mask[..., None]).transpose(0, 1), pos.transpose(0, 1)
    cos, sin = _parallm_rope(spec, pos)
    xs = xs.clone().requires_grad_()
    out = attn(xs, cos, sin, ctx)
    (out * rs).sum().backward()
    grads = {n: p.grad for n, p in attn.named_parameters()}
    assert all(grads[n] is None for n in grads if n.startswith("indexer."))       # frozen
    return out.detach(), xs.grad, {n: g for n, g in grads.items() if g is not None}


def check_dsa(results, ref, mask, *, packed, sp, spec, tol=2e-5):
    """Every rank's output / input gradient at real positions and merged parameter gradients vs transformers'."""
    from parallm.model.layers.attention import make_packing
    from parallm.model.layers.mla import MLA_WEIGHTS, merge_mla
    state, out_ref, dx_ref, grads_ref = ref
    errors = {}
    if packed:
        idx = make_packing(mask).indices
        want_out, want_dx = out_ref.reshape(-1, out_ref.shape[-1])[idx], dx_ref.reshape(-1, dx_ref.shape[-1])[idx]
        for k, (out, dx, _) in enumerate(results):
            if sp:
                out, dx = torch.cat([res[0] for res in results]), torch.cat([res[1] for res in results])
            errors[f"out{k}"] = (out[:len(idx), 0] - want_out).abs().max().item()
            errors[f"dx{k}"] = (dx[:len(idx), 0] - want_dx).abs().max().item()
    else:
        real = mask.bool().transpose(0, 1)
        for k, (out, dx, _) in enumerate(results):
            errors[f"out{k}"] = (out - out_ref.transpose(0, 1))[real].abs().max().item()
            errors[f"dx{k}"] = (dx - dx_ref.transpose(0, 1))[real].abs().max().item()
    assert set(grads_ref) == {n for n in state if n in MLA_WEIGHTS}, sorted(grads_ref)
    for name in grads_ref:
        shards = [res[2][MLA_WEIGHTS[name][0]] for res in results]
        if MLA_WEIGHTS[name][1] == "copy":
            got = torch.stack(shards).sum(0) if sp else shards[0]
        else:
            got = merge_mla(spec, name, shards)
        errors[name] = (got - grads_ref[name]).abs().max().item() / max(grads_ref[name].abs().max().item(), 1.0)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, bad
    return max(errors.values())


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("packed", [False, True])
def test_dsa_attention_tp1_matches_transformers(world_of_one, family, packed):
    from parallm.families import spec_from_config
    cfg = CONFIGS[family]()
    spec, _ = spec_from_config(cfg)
    x, _, mask, r = _batch(cfg.hidden_size)
    ref = _hf_attention(family, cfg, x, mask, r)
    check_dsa([run_dsa(spec, ref[0], x, mask, r, packed=packed)], ref, mask, packed=packed, sp=False, spec=spec)
    if not packed:      # the selection matters: transformers' dense attention (every key kept) differs
        dense = _hf_attention(family, CONFIGS[family](), x, mask, r, topk=4096)
        assert helpers.max_diff_real(dense[1], ref[1], mask) > 1e-2


# -- memory ---------------------------------------------------------------------------------------------------

def test_no_square_tensor(world_of_one, monkeypatch):
    """S = 2048, topk 16: the largest tensor any operation of the layer's forward and backward makes is below S x
    S / 4 elements (the largest linear ones: the indexer's queries, S x 16 heads x 16 = S x S / 8; the blocks'
    budgets lowered so that a square one would show)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallm.families import spec_from_config
    from parallm.model.layers import dsa, indexer
    from parallm.model.layers.attention import PaddedRows
    monkeypatch.setattr(indexer, "SCORE_BUDGET", 1 << 15)
    monkeypatch.setattr(dsa, "GATHER_BUDGET", 1 << 15)
    cfg = glm5_config()
    spec, _ = spec_from_config(cfg)
    _, hf_attn, _ = _hf_modules("glm_moe_dsa")
    torch.manual_seed(0)
    ref = hf_attn(cfg, 0)
    helpers.randomize_(ref, seed=1)
    attn = build_dsa(spec, {k: v.detach() for k, v in ref.state_dict().items()})
    s = 2048
    x = torch.randn(s, 1, cfg.hidden_size, requires_grad=True)
    cos, sin = _parallm_rope(spec, torch.arange(s)[:, None])

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out

    with Largest():
        attn(x, cos, sin, PaddedRows(torch.ones(1, s, dtype=torch.bool))).sum().backward()
    assert s * s // 8 <= Largest.biggest < s * s // 4, Largest.biggest


def test_inspect_shows_the_indexer(tmp_path):
    """`parallm inspect` (no process group) on a GLM-5 checkpoint with shared indexer layers: the indexer's heads,
    top-k, RoPE layout, shared layers and parameters per layer (those of the checkpoint's indexer tensors)."""
    from parallm import inspect_checkpoint
    from parallm.cli.inspect import render
    model = helpers.make_hf_model(glm5_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1))
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "glm5"))
    report = inspect_checkpoint(ckpt, tp=2, pp=2)
    assert report["problem"] is None, report["problem"]
    d = report["config"]["sparse_attention"]
    state = model.state_dict()
    per_layer = sum(v.numel() for k, v in state.items() if k.startswith("model.layers.0.self_attn.indexer."))
    assert (d["heads"], d["topk"], d["rope"], d["shared_layers"], d["indexer_layers"]) == (16, TOPK, "interleaved",
                                                                                           [1, 3], 2)
    assert d["params_per_layer"] == per_layer
    assert "top-16 keys per query" in render(report)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_table_covers_the_checkpoint(family, tmp_path):
    """Every tensor save_pretrained writes has exactly one table entry of the declared shape (the shared layers'
    missing indexer included), and nothing else."""
    from parallm.families import spec_from_config
    from parallm.model.table import all_entries, expected_hf_shapes
    cfg = CONFIGS[family](num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1) \
        if family == "glm_moe_dsa" else CONFIGS[family]()
    spec, fam = spec_from_config(cfg)
    hub = helpers.hub_state_dict(helpers.make_hf_model(cfg), str(tmp_path / "hub"))
    shapes = expected_hf_shapes(fam.table, spec, task="causal_lm", pp=1)
    assert {k: tuple(v.shape) for k, v in hub.items()} == shapes
    names = [h for e in all_entries(fam.table, spec, task="causal_lm", pp=1) for h in e.hf]
    assert len(names) == len(set(names))
    indexed = sorted({int(k.split(".")[2]) for k in hub if ".indexer." in k})
    assert indexed == [i for i in range(spec.num_layers) if spec.has_indexer(i)]


TP2_RUNS = [("glm_moe_dsa", False, False), ("glm_moe_dsa", True, True), ("deepseek_v32", True, False),
            ("deepseek_v32", False, False)]


def dsa_tp2_rank(rank, world, runs):
    import parallm
    parallm.init_parallel(tp=2)
    try:
        return [run_dsa(spec, state, x, mask, r, packed=packed, tp=2, rank=rank, sp=sp)
                for spec, state, x, mask, r, packed, sp in runs]
    finally:
        parallm.destroy_parallel()


@pytest.mark.timeout(240)
def test_dsa_attention_tp2_matches_transformers():
    """tp2 (two gloo ranks): MLA's heads split, the indexer replicated; padded, packed, packed + sequence
    parallelism (each rank selects for its own tokens' queries, the selections all-gathered). Forward, input and
    parameter gradients (the replicated latent projections' gradients complete on every rank without sequence
    parallelism: the latent key rows enter the TP region as one contiguous copy)."""
    from parallm.families import spec_from_config
    runs, refs = [], []
    for family, packed, sp in TP2_RUNS:
        cfg = CONFIGS[family]()
        spec, _ = spec_from_config(cfg)
        x, _, mask, r = _batch(cfg.hidden_size)
        refs.append(_hf_attention(family, cfg, x, mask, r))
        runs.append((spec, refs[-1][0], x, mask, r, packed, sp))
    per_rank = helpers.run_ranks(dsa_tp2_rank, 2, runs)
    for k, (spec, _, _, mask, _, packed, sp) in enumerate(runs):
        check_dsa([per_rank[0][k], per_rank[1][k]], refs[k], mask, packed=packed, sp=sp, spec=spec)


# -- near-ties at the top-k boundary -------------------------------------------------------------------------

def topk_margin(model, ids, mask) -> float:
    """The smallest relative gap between the last score transformers' indexers keep and the first they drop
    (:func:`parallm.verify.ties.topk_margin`, what ``parallm verify`` names as a near-tie). Two exact computations
    that differ in the last bits (TP reductions, another summation order) may select differently where it is
    tiny; end-to-end tests keep batches whose margin is not (the selection is a discrete choice: no tolerance
    covers a flipped key)."""
    from parallm.verify.reference import hf_output
    from parallm.verify.ties import topk_margin as margin
    return margin(model, ids, mask, lambda: hf_output(model, ids, mask))[0]
