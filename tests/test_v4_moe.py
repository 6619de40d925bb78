"""DeepSeek-V4's MoE block (parallm's MoEBlock with the sqrtsoftplus router, hash routing, clamped SiLU experts and
shared expert) against transformers 5.25's ``DeepseekV4SparseMoeBlock``, weights copied, fp32: outputs and the
gradients of the inputs and of every parameter, a hash layer and a top-k layer, the correction bias changing the
choice, the clamps active, the load-balancing loss as transformers defines it (hash layers left out); then tp 2,
ep 2, tp2·ep2 (padded, and packed + sequence parallelism) on 4 gloo ranks. Breaks that must fail: a hash layer
routed by the router, the clamp dropped, the bias used in the weights."""

from __future__ import annotations

import pytest
import torch

import helpers

E, K, H, I, V = 8, 2, 32, 16, 40
LIMIT = 1.5
LAYER_TYPES = ["hash_moe", "moe", "moe"]
TOL = 1e-5


def v4_config(**overrides):
    import transformers
    kw = dict(vocab_size=V, hidden_size=H, moe_intermediate_size=I, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, q_lora_rank=16, n_routed_experts=E, num_experts_per_tok=K,
              hc_mult=2, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=4,
              sliding_window=8, mlp_layer_types=list(LAYER_TYPES), swiglu_limit=LIMIT, routed_scaling_factor=1.5,
              output_router_logits=True, router_aux_loss_coef=0.01)
    kw.update(overrides)
    return transformers.DeepseekV4Config(**kw)


def decoder_spec(cfg):
    from parallm.families.deepseek_v4_moe import v4_moe_spec
    from parallm.model.positions.rope import RopeSpec
    from parallm.model.spec import DecoderSpec
    return DecoderSpec(family="deepseek_v4", architecture="DeepseekV4ForCausalLM", model_type="deepseek_v4",
                       hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=2, num_kv_heads=1,
                       head_dim=16, intermediate_size=cfg.moe_intermediate_size, vocab_size=cfg.vocab_size,
                       rms_norm_eps=1e-6, rope=RopeSpec(dim=16, theta=10000.0, kind="default"),
                       moe=v4_moe_spec(cfg))


def hf_block(cfg, layer: int, seed: int = 0):
    """transformers' block of ``layer``, weights drawn large enough that the clamps bite, a random correction
    bias (top-k layers) or tid2eid table (hash layers)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock
    g = torch.Generator().manual_seed(seed + 100 * layer)
    block = DeepseekV4SparseMoeBlock(cfg, layer)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if block.is_hash:
            block.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    return block


def _shard(t, dim, tp, rank):
    return t.chunk(tp, dim=dim)[rank]


def hf_pieces(block, *, tp=1, rank=0, experts=None):
    """parallm's tensors (by local name) for TP rank ``rank`` of ``tp`` holding ``experts``, from the HF block."""
    experts = range(E) if experts is None else experts
    gu = block.experts.gate_up_proj.detach()[list(experts)]           # [E_local, 2I, H]
    gate, up = gu.chunk(2, dim=1)
    shared = block.shared_experts
    out = {"router.weight": block.gate.weight.detach(),
           "experts.linear_fc1.weight": torch.cat([_shard(gate, 1, tp, rank), _shard(up, 1, tp, rank)], dim=1),
           "experts.linear_fc2.weight": _shard(block.experts.down_proj.detach()[list(experts)], 2, tp, rank),
           "shared_experts.linear_fc1.weight": torch.cat([_shard(shared.gate_proj.weight.detach(), 0, tp, rank),
                                                          _shard(shared.up_proj.weight.detach(), 0, tp, rank)]),
           "shared_experts.linear_fc2.weight": _shard(shared.down_proj.weight.detach(), 1, tp, rank)}
    if block.is_hash:
        out["router.tid2eid"] = block.gate.tid2eid.detach()
    else:
        out["router.e_score_correction_bias"] = block.gate.e_score_correction_bias.detach()
    return out


def hf_grads(block, *, tp=1, rank=0, experts=None):
    """The HF block's parameter gradients as parallm's shards (same mapping as :func:`hf_pieces`)."""
    experts = range(E) if experts is None else experts
    gate, up = block.experts.gate_up_proj.grad[list(experts)].chunk(2, dim=1)
    shared = block.shared_experts
    return {"router.weight": block.gate.weight.grad,
            "experts.linear_fc1.weight": torch.cat([_shard(gate, 1, tp, rank), _shard(up, 1, tp, rank)], dim=1),
            "experts.linear_fc2.weight": _shard(block.experts.down_proj.grad[list(experts)], 2, tp, rank),
            "shared_experts.linear_fc1.weight": torch.cat([_shard(shared.gate_proj.weight.grad, 0, tp, rank),
                                                           _shard(shared.up_proj.weight.grad, 0, tp, rank)]),
            "shared_experts.linear_fc2.weight": _shard(shared.down_proj.weight.grad, 1, tp, rank)}


def parallm_block(cfg, layer, hf, *, tp=1, rank=0, sequence_parallel=False):
    from megatron.core import ModelParallelConfig

    from parallm.model.layers.moe import MoEBlock
    from parallm.parallel.state import current_dims
    dims = current_dims()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                 params_dtype=torch.float32, use_cpu_initialization=True,
                                 perform_initialization=False)
    if sequence_parallel:
        from parallm.parallel.cpu_compat import enable_megatron_sequence_parallel_on_cpu
        enable_megatron_sequence_parallel_on_cpu()
    block = MoEBlock(decoder_spec(cfg), config, dims, None, layer=layer)
    pieces = hf_pieces(hf, tp=tp, rank=rank, experts=block.experts_held)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(pieces.pop(name))
    assert not pieces, f"not loaded: {sorted(pieces)}"
    return block


def batch(seed=0, b=2, s=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, H, generator=g) * scale
    ids = torch.randint(0, V, (b, s), generator=g)
    grad = torch.randn(b, s, H, generator=g)
    return x, ids, grad


def run_hf(block, x, ids, grad):
    x = x.clone().requires_grad_()
    block.zero_grad()
    out = block(x, input_ids=ids)
    out.backward(grad)
    return out.detach(), x.grad


def run_parallm(block, x, ids, grad):
    """[B, S, H] -> parallm's [S, B, H] rows; returns output and input gradient back in [B, S, H]."""
    xs = x.transpose(0, 1).contiguous().requires_grad_()
    block.zero_grad()
    out = block(xs, token_ids=ids.transpose(0, 1).contiguous())
    out.backward(grad.transpose(0, 1))
    return out.detach().transpose(0, 1), xs.grad.transpose(0, 1)


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
@pytest.mark.parametrize("layer", [0, 1], ids=["hash_moe", "moe"])
def test_block_matches_transformers(world_of_one, layer, kernel, monkeypatch):
    """Outputs, input gradients and every parameter's gradient equal transformers' to 1e-5 (fp32), with the
    clamps active on the routed and the shared experts, on both expert kernels."""
    monkeypatch.setenv("PARALLM_MOE_EXPERTS", kernel)
    cfg = v4_config()
    hf = hf_block(cfg, layer)
    block = parallm_block(cfg, layer, hf)
    assert block.experts.kernel == kernel
    assert block.is_hash == (layer == 0) and (block.router.tid2eid is not None) == (layer == 0)
    x, ids, grad = batch(scale=1.0)
    pre = torch.cat([x.reshape(-1, H) @ hf.experts.gate_up_proj[e].detach().T for e in range(E)])
    assert (pre.abs() > LIMIT).float().mean() > 0.2, "the clamp must be active"
    out_hf, dx_hf = run_hf(hf, x, ids, grad)
    out, dx = run_parallm(block, x, ids, grad)
    errs = {"out": _err(out, out_hf), "dx": _err(dx, dx_hf)}
    want = hf_grads(hf)
    for name, p in block.named_parameters():
        if p.requires_grad:
            errs[name] = _err(p.grad, want[name])
        else:
            assert p.grad is None and name in ("router.tid2eid", "router.e_score_correction_bias")
    print(f"layer {layer}: max errors {errs}")
    assert max(errs.values()) <= TOL, errs
    assert block.router.tid2eid is None or block.router.tid2eid.dtype == torch.int64


def test_hash_layer_routes_by_token_id(world_of_one):
    """The hash layer's experts are tid2eid of the token ids: other token ids, other output; no token ids: an
    error; and (break) a hash layer routed by its router differs from transformers."""
    cfg = v4_config()
    hf = hf_block(cfg, 0)
    block = parallm_block(cfg, 0, hf)
    x, ids, grad = batch(seed=1)
    out_hf, _ = run_hf(hf, x, ids, grad)
    out, _ = run_parallm(block, x, ids, grad)
    assert _err(out, out_hf) <= TOL
    with pytest.raises(ValueError, match="token_ids"):
        block(x.transpose(0, 1))
    with pytest.raises(ValueError, match="shape"):
        block(x.transpose(0, 1), token_ids=ids)               # [B, S] for an [S, B, H] input
    other, _ = run_parallm(block, x, (ids + 1) % V, grad)
    assert _err(other, out_hf) > 1e-3
    # break: route the hash layer with its router (top-k of the scores)
    block.router.is_hash = False
    block.router.e_score_correction_bias = torch.nn.Parameter(torch.zeros(E), requires_grad=False)
    broken, _ = run_parallm(block, x, ids, grad)
    assert _err(broken, out_hf) > 1e-3


def test_correction_bias_chooses_and_does_not_weight(world_of_one, monkeypatch):
    """A bias that changes which experts win: still transformers' output; (break) the bias used in the weights
    differs."""
    from parallm.model.layers.routing import ScoreRouter, sigmoid_weights, sqrtsoftplus
    cfg = v4_config()
    hf = hf_block(cfg, 1)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.zero_()
        hf.gate.e_score_correction_bias[3] = 5.0             # expert 3 wins for every token
    block = parallm_block(cfg, 1, hf)
    x, ids, grad = batch(seed=2)
    h = x.transpose(0, 1).reshape(-1, H)
    scores = sqrtsoftplus(block.router.logits(h))
    chosen = block.router.choose(scores, None)
    plain = torch.topk(scores, K, dim=-1).indices
    assert (chosen == 3).any(-1).all() and not (plain == 3).any(-1).all(), "the bias must change the choice"
    out_hf, _ = run_hf(hf, x, ids, grad)
    out, _ = run_parallm(block, x, ids, grad)
    assert _err(out, out_hf) <= TOL

    def biased(self, scores, experts):
        return sigmoid_weights(scores + self.e_score_correction_bias, experts, norm_topk_prob=True,
                               routed_scaling_factor=self.routed_scaling_factor)
    monkeypatch.setattr(ScoreRouter, "weights", biased)
    broken, _ = run_parallm(block, x, ids, grad)
    assert _err(broken, out_hf) > 1e-3


def test_clamp_dropped_differs(world_of_one):
    """(break) the routed experts' or the shared expert's clamp dropped: no longer transformers' output."""
    cfg = v4_config()
    hf = hf_block(cfg, 1)
    x, ids, grad = batch(seed=3)
    out_hf, _ = run_hf(hf, x, ids, grad)
    block = parallm_block(cfg, 1, hf)
    block.experts.activation = "silu"
    broken, _ = run_parallm(block, x, ids, grad)
    assert _err(broken, out_hf) > 1e-3
    block = parallm_block(cfg, 1, hf)
    block.shared_experts.limit = None
    broken, _ = run_parallm(block, x, ids, grad)
    assert _err(broken, out_hf) > 1e-3


def _aux_run(cfg, blocks, hfs, inputs, mask, mode):
    """parallm's load-balancing loss over the layers (one microbatch), its value and the router gradients of
    ``sum(out) + coef * aux``."""
    from parallm.model.layers.moe_aux import AuxScales, MoEAux
    coef = cfg.router_aux_loss_coef
    aux = MoEAux()
    aux.mode, aux.num_layers = mode, len(decoder_spec(cfg).moe.balanced_layers)
    aux.start(AuxScales(coef, 1))
    aux.scales.tokens[0] = -1                  # a scalar loss: weight coef / num_microbatches
    tokens = mask.transpose(0, 1).reshape(-1)
    total = 0
    for block, (x, ids) in zip(blocks, inputs):
        block.aux = aux
        block.zero_grad()
        total = total + block(x.transpose(0, 1), tokens, token_ids=ids.transpose(0, 1)).sum()
    total.backward()
    values = aux.stop()
    return sum(v for _, v in values), [b.router.weight.grad.clone() for b in blocks]


@pytest.mark.parametrize("mode", ["pooled", "per_layer"])
def test_load_balancing_loss_is_transformers(world_of_one, mode):
    """transformers' ``load_balancing_loss_func`` over the top-k layers' router logits (softmax and its top-k,
    not the routed experts), padded rows masked, the hash layer left out: ``pooled`` equals it (value and router
    gradients of ``coef * aux``); ``per_layer`` (Megatron's) is the sum of each layer's own."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4TopKRouter,
                                                                      load_balancing_loss_func)
    cfg = v4_config()
    hfs = [hf_block(cfg, layer) for layer in range(3)]
    blocks = [parallm_block(cfg, layer, hf) for layer, hf in enumerate(hfs)]
    inputs = [batch(seed=10 + layer)[:2] for layer in range(3)]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    logits = []
    hooks = [m.register_forward_hook(lambda mod, args, out: logits.append(out[0]))
             for hf in hfs for m in hf.modules() if isinstance(m, DeepseekV4TopKRouter)]
    total = sum(hf(x, input_ids=ids).sum() for hf, (x, ids) in zip(hfs, inputs))
    for hook in hooks:
        hook.remove()
    assert len(logits) == 2                       # the hash layer's logits are not recorded
    if mode == "pooled":
        want = load_balancing_loss_func(tuple(logits), E, K, mask)
    else:
        want = sum(load_balancing_loss_func((lg,), E, K, mask) for lg in logits)
    (total + cfg.router_aux_loss_coef * want).backward()
    got, grads = _aux_run(cfg, blocks, hfs, inputs, mask, mode)
    errs = [abs(float(got) - float(want))] + [_err(g, hf.gate.weight.grad) for g, hf in zip(grads, hfs)]
    print(f"{mode}: aux {float(got):.6f} vs {float(want):.6f}, errors {errs}")
    assert max(errs) <= TOL, errs
    # (break) the routed experts counted instead of the softmax's top-k: another value
    from parallm.model.layers.moe import MoEBlock
    real = MoEBlock.route_scores

    def routed_counted(self, *args):
        probs, _, weights, choices = real(self, *args)
        return probs, choices, weights, choices
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MoEBlock, "route_scores", routed_counted)
        broken, _ = _aux_run(cfg, blocks, hfs, inputs, mask, mode)
    assert abs(float(broken) - float(want)) > 1e-4


def test_router_replay_of_a_hash_layer(world_of_one):
    """Router replay: a hash layer records tid2eid's experts like any MoE layer, and replaying them gives the
    same bits; replaying other experts routes with those (weights: the router's scores of them)."""
    from parallm.model.layers.routing import RouterReplay
    cfg = v4_config()
    hf = hf_block(cfg, 0)
    block = parallm_block(cfg, 0, hf)
    block.replay = RouterReplay()
    block.replay.start(None, record=True)
    x, ids, _ = batch(seed=4)
    xs, tok = x.transpose(0, 1), ids.transpose(0, 1)
    with torch.no_grad():
        out = block(xs, token_ids=tok)
        recorded = block.replay.rows[0]
        block.replay.start(None, record=False)
        assert torch.equal(recorded, hf.gate.tid2eid[tok.reshape(-1)])
        real = torch.ones(recorded.shape[0], dtype=torch.bool)
        assert torch.equal(block(xs, routed=(recorded, real), token_ids=tok), out)
        other = (recorded + 1) % E
        replayed = block(xs, routed=(other, real), token_ids=tok)
        with torch.no_grad():
            hf.gate.tid2eid.copy_((hf.gate.tid2eid + 1) % E)
        assert _err(replayed, hf(x, input_ids=ids).transpose(0, 1)) <= TOL


def test_spec_reads_and_refuses():
    from parallm.families.deepseek_v4_moe import V4_MOE_ROWS, v4_moe_spec
    spec = v4_moe_spec(v4_config())
    assert (spec.router, spec.activation, spec.hash_layers, spec.balanced_layers, spec.layers) == \
        ("sqrtsoftplus", "clamped_silu", (0,), (1, 2), (0, 1, 2))
    assert (spec.swiglu_limit, spec.shared_expert_limit, spec.routed_scaling_factor, spec.score_bias,
            spec.shared_expert_intermediate_size, spec.aux_loss_coef) == (LIMIT, LIMIT, 1.5, True, I, 0.01)
    for change, needle in ((dict(scoring_func="softmax"), "scoring_func"), (dict(n_shared_experts=2), "n_shared"),
                           (dict(swiglu_limit=0.0), "swiglu_limit"), (dict(num_experts_per_tok=9), "exceeds")):
        cfg = v4_config()
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match=needle):
            v4_moe_spec(cfg)
    cfg = v4_config()
    cfg.mlp_layer_types = ["hash_moe", "moe"]
    with pytest.raises(ValueError, match="mlp_layer_types"):
        v4_moe_spec(cfg)
    names = {r.local: r.hf for r in V4_MOE_ROWS}
    assert names["layers.{l}.mlp.router.tid2eid"] == ("model.layers.{i}.ffn.gate.tid2eid",)
    assert names["layers.{l}.mlp.experts.linear_fc1.weight"] == ("model.layers.{i}.ffn.experts.{e}.w1.weight",
                                                                 "model.layers.{i}.ffn.experts.{e}.w3.weight")


def test_table_rows_cover_what_save_pretrained_writes(tmp_path):
    """Every MoE tensor transformers' save_pretrained writes is named by exactly one V4_MOE_ROWS row of its layer
    (the hash layer's tid2eid, the others' bias), with its shape."""
    import transformers
    from safetensors import safe_open

    from parallm.families.deepseek_v4_moe import V4_MOE_ROWS
    from parallm.model.table import resolve_shape
    cfg = v4_config()
    transformers.DeepseekV4ForCausalLM(cfg).save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            saved.update({k: st.get_tensor(k) for k in st.keys() if ".ffn." in k})
    spec = decoder_spec(cfg)
    named = {}
    for row in V4_MOE_ROWS:
        for layer in range(3):
            if not (row.applies(spec, "causal_lm", 1) and row.applies_to_layer(spec, layer)):
                continue
            for hf, shape in zip(row.hf, row.shapes):
                for e in (range(E) if row.per_expert else [None]):
                    name = hf.format(i=layer, e=e)
                    assert name not in named
                    named[name] = resolve_shape(shape, spec)
    assert set(named) == set(saved), (set(named) ^ set(saved))
    for name, shape in named.items():
        assert tuple(saved[name].shape) == shape, name
    assert saved["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64


# -- distributed: tp 2, ep 2, tp2·ep2 (padded, packed + SP) on 4 gloo ranks ---------------------------------------

LAYOUTS = [dict(tp=2, ep=1, packed=False, sp=False), dict(tp=1, ep=2, packed=False, sp=False),
           dict(tp=2, ep=2, packed=False, sp=False), dict(tp=2, ep=2, packed=True, sp=True)]


def _rank_case(cfg, layer, lay, dims):
    """This rank's output / input-gradient rows and parameter gradients, and the HF references."""
    tp, rank = lay["tp"], dims.tp_rank
    hf = hf_block(cfg, layer)
    block = parallm_block(cfg, layer, hf, tp=tp, rank=rank, sequence_parallel=lay["sp"])
    x, ids, grad = batch(seed=20 + dims.dp_rank, b=2, s=6)
    out_hf, dx_hf = run_hf(hf, x, ids, grad)
    own = hf_grads(hf, tp=tp, rank=rank, experts=block.experts_held)
    if lay["packed"]:          # [T, 1, H] rows, T / tp of them on this rank under SP
        rows = lambda t: t.reshape(-1, 1, *t.shape[2:]).chunk(tp)[rank]      # noqa: E731
        xs, tok, g = rows(x).contiguous().requires_grad_(), rows(ids).contiguous(), rows(grad)
        want_out, want_dx = rows(out_hf), rows(dx_hf)
    else:
        xs = x.transpose(0, 1).contiguous().requires_grad_()
        tok, g = ids.transpose(0, 1).contiguous(), grad.transpose(0, 1)
        want_out, want_dx = out_hf.transpose(0, 1), dx_hf.transpose(0, 1)
    out = block(xs, token_ids=tok)
    out.backward(g)
    grads = {n: p.grad for n, p in block.named_parameters() if p.requires_grad}
    if lay["sp"]:              # the router's gradient is a partial sum over TP under SP
        torch.distributed.all_reduce(grads["router.weight"], group=dims.tp_group)
    errs = {"out": _err(out, want_out), "dx": _err(xs.grad, want_dx)}
    # expert gradients: summed over the expert-parallel group's batches (each rank's own batch elsewhere)
    expert_names = ("experts.linear_fc1.weight", "experts.linear_fc2.weight")
    every = hf_grads(hf, tp=tp, rank=rank)                 # every expert's gradient on this rank's batch
    held = torch.tensor(list(block.experts_held))
    for n in expert_names:
        want = every[n].clone()
        if dims.ep > 1:
            torch.distributed.all_reduce(want, group=dims.ep_group)
        errs[n] = _err(grads[n], want.index_select(0, held))
    for n in grads:
        if n not in expert_names:
            errs[n] = _err(grads[n], own[n])
    return errs


def rank_layouts(rank, world, layouts):
    import parallm
    from parallm.parallel.state import current_dims
    cfg = v4_config()
    results = []
    for lay in layouts:
        parallm.init_parallel(tp=lay["tp"], ep=lay["ep"])
        try:
            dims = current_dims()
            for layer in (0, 1):
                results.append((str(lay), layer, _rank_case(cfg, layer, lay, dims)))
        finally:
            parallm.destroy_parallel()
    return results


@pytest.mark.timeout(600)
def test_layouts_match_transformers():
    results = helpers.run_ranks(rank_layouts, 4, LAYOUTS, timeout=560)
    worst = {}
    for rank_results in results:
        for lay, layer, errs in rank_results:
            key = (lay, layer)
            worst[key] = max(worst.get(key, 0.0), max(errs.values()))
            assert max(errs.values()) <= TOL, (lay, layer, errs)
    print("max errors per layout / layer:", worst)


# -- tid2eid through the weight paths (an int64 ``integer`` row, never cast) --------------------------------------

def _tid2eid_entry():
    from types import SimpleNamespace

    from parallm.families.deepseek_v4_moe import V4_MOE_ROWS
    row = next(r for r in V4_MOE_ROWS if r.local.endswith("tid2eid"))
    return row, SimpleNamespace(row=row, hf=("model.layers.0.ffn.gate.tid2eid",))


def test_tid2eid_row_is_int64_on_every_weight_path():
    """The loader's broadcast wire carries int64 as int64 (a float shard for it, or int64 for a float parameter,
    is refused); a float checkpoint tensor is refused for it; the directory save's header says I64; the export
    stream carries its bits (any wire dtype) and views them back as int64; the stream metadata says int64."""
    from parallm.checkpoint.cast import copy_cast_
    from parallm.checkpoint.export_plan import bit_dtypes
    from parallm.checkpoint.loader import _wire
    from parallm.checkpoint.saver import plan_files
    from parallm.errors import CheckpointError
    from parallm.model.table import row_dtype
    row, entry = _tid2eid_entry()
    assert row.integer and not row.trained and row_dtype(row, torch.bfloat16) == torch.int64
    table = torch.randint(0, E, (V, K))
    wire = _wire(table, row_dtype(row, torch.bfloat16), entry.hf, "cpu")
    assert wire.dtype == torch.int64 and torch.equal(wire, table)
    with pytest.raises(CheckpointError, match="checkpoint dtype"):
        _wire(table.float(), torch.int64, entry.hf, "cpu")
    with pytest.raises(CheckpointError, match="checkpoint dtype"):
        _wire(table, torch.bfloat16, entry.hf, "cpu")
    dst = torch.zeros(V, K, dtype=torch.int64)
    copy_cast_(dst, table, entry.hf)
    assert torch.equal(dst, table)
    with pytest.raises(CheckpointError, match="not a integer|not an integer|integer type"):
        copy_cast_(dst, table.float(), entry.hf)
    (f,) = plan_files([(entry.hf[0], (V, K)), ("x.weight", (4, 4))], torch.bfloat16, 1 << 30,
                      fp32={entry.hf[0]: torch.int64})
    assert f["data_bytes"] == V * K * 8 + 16 * 2 and b'"I64"' in f["header"]
    for wire_dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert bit_dtypes([entry], wire_dtype) == {entry.hf[0]: torch.int64}
        bits = table.contiguous().view(wire_dtype)           # what the stream carries, then views back
        assert torch.equal(bits.clone().view(torch.int64), table)


def test_random_init_zeros_an_integer_row():
    from parallm.checkpoint.random_init import RandomSource
    src = RandomSource("model.layers.0.ffn.gate.tid2eid", (V, K), kind="normal", std=0.02, seed=0, dtype=torch.int64)
    assert not src.is_floating
    got = src.read(0, 0, V)
    assert got.dtype == torch.int64 and not got.any()


# -- a whole model with V4's MoE rows: tid2eid loaded, saved, exported bit for bit (a test family: LLaMA attention
#    and norms around DeepSeek-V4's MoE; the real V4 family is the lead's) ------------------------------------------

TEST_ARCH = "V4MoeTestForCausalLM"


def _test_family():
    from parallm.families.deepseek_v4_moe import V4_MOE_ROWS, v4_moe_spec
    from parallm.families.moe_common import moe_table
    from parallm.families.registry import FAMILIES, Family, base_spec_kwargs, register
    from parallm.model.spec import DecoderSpec
    if "v4moe_test" not in FAMILIES:
        register(Family(name="v4moe_test", model_types=("v4moe_test",), architectures=(TEST_ARCH,),
                        spec=lambda c: DecoderSpec(**base_spec_kwargs(c, "v4moe_test"), moe=v4_moe_spec(c)),
                        table=moe_table(V4_MOE_ROWS), causal_architecture=TEST_ARCH, value_architecture=TEST_ARCH))


def test_model_config():
    import transformers
    return transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=3,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    architectures=[TEST_ARCH], n_routed_experts=E, num_experts_per_tok=K,
                                    moe_intermediate_size=I, swiglu_limit=LIMIT, routed_scaling_factor=1.5,
                                    mlp_layer_types=list(LAYER_TYPES), n_shared_experts=1,
                                    scoring_func="sqrtsoftplus")


test_model_config.__test__ = False


def _checkpoint(chunks):
    """A random model's state dict with a random tid2eid and correction bias."""
    import parallm
    sd = parallm.save_hf_weights(chunks)
    g = torch.Generator().manual_seed(7)
    sd["model.layers.0.ffn.gate.tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)])
    for layer in (1, 2):
        sd[f"model.layers.{layer}.ffn.gate.bias"] = torch.randn(E, generator=g)
    return sd


def _same(got: dict, want: dict):
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_whole_model_carries_tid2eid_bit_for_bit(world_of_one, tmp_path):
    """build_model (random init: tid2eid zeros, int64) -> load a state dict -> the dict save, a bf16 directory
    save and a bf16 export give tid2eid back as int64, bit for bit; it has no gradient."""
    import parallm
    from safetensors.torch import load_file
    _test_family()
    chunks = parallm.build_model(test_model_config(), init="random")
    router = chunks[0].layers[0].mlp.router
    assert router.tid2eid.dtype == torch.int64 and not router.tid2eid.requires_grad and not router.tid2eid.any()
    assert chunks[0].layers[1].mlp.router.tid2eid is None
    assert chunks[0].moe_aux.num_layers == 2
    sd = _checkpoint(chunks)
    parallm.load_hf_weights(chunks, sd)
    assert torch.equal(router.tid2eid, sd["model.layers.0.ffn.gate.tid2eid"])
    _same(parallm.save_hf_weights(chunks), sd)
    parallm.save_hf_weights(chunks, tmp_path / "bf16", dtype=torch.bfloat16)
    saved = {}
    for f in (tmp_path / "bf16").glob("*.safetensors"):
        saved.update(load_file(str(f)))
    for k in ("model.layers.0.ffn.gate.tid2eid", "model.layers.1.ffn.gate.bias"):
        assert saved[k].dtype == sd[k].dtype and torch.equal(saved[k], sd[k]), k
    exported = {n: t.clone() for n, t in parallm.export_hf_tensors(chunks, dtype=torch.bfloat16)}
    for k in ("model.layers.0.ffn.gate.tid2eid", "model.layers.2.ffn.gate.bias"):
        assert exported[k].dtype == sd[k].dtype and torch.equal(exported[k], sd[k]), k
    meta = {m.name: m.dtype for m in parallm.export_metadata(chunks, dtype=torch.bfloat16)}
    assert meta["model.layers.0.ffn.gate.tid2eid"] == torch.int64


def rank_broadcast(rank, world, sd, ckpt):
    """tp2·ep2: broadcast load, export, dict save, an optimizer and a training checkpoint; then tp1·ep4 loads the
    training checkpoint."""
    import parallm
    from parallm.train.optim import build_optimizer
    _test_family()
    parallm.init_parallel(tp=2, ep=2)
    try:
        chunks = parallm.build_model(test_model_config())
        report = parallm.load_hf_weights(chunks, sd if rank == 0 else {}, mode="broadcast")
        table = chunks[0].layers[0].mlp.router.tid2eid.clone()
        exported = {n: t.clone() for n, t in parallm.export_hf_tensors(chunks, dtype=torch.bfloat16)
                    if n.endswith("tid2eid") or n.endswith("gate.bias")}
        saved = parallm.save_hf_weights(chunks)
        optimizer = build_optimizer(chunks, lr=1e-3)
        owned = [p for p, _ in optimizer.owned()]
        assert not any(p is chunks[0].layers[0].mlp.router.tid2eid for p in owned)
        parallm.save_checkpoint(ckpt, chunks, optimizer, step=3)
    finally:
        parallm.destroy_parallel()
    parallm.init_parallel(tp=1, ep=4)
    try:
        chunks = parallm.build_model(test_model_config())
        parallm.load_checkpoint(ckpt, chunks, build_optimizer(chunks, lr=1e-3))
        reloaded = chunks[0].layers[0].mlp.router.tid2eid.clone()
    finally:
        parallm.destroy_parallel()
    return report.mode, table, exported, {k: v for k, v in saved.items() if ".gate." in k}, reloaded


@pytest.mark.timeout(300)
def test_tid2eid_broadcast_load_export_and_training_checkpoint(world_of_one, tmp_path):
    """tp2·ep2: the broadcast load sends tid2eid as int64; the bf16 export and the dict save give it back bit for
    bit; the optimizer leaves it out; a training checkpoint saved at tp2·ep2 loads it at tp1·ep4 bit for bit, and
    its offline bf16 conversion (checkpoint_to_hf) writes it as int64."""
    import parallm
    _test_family()
    sd = _checkpoint(parallm.build_model(test_model_config(), init="random"))
    results = helpers.run_ranks(rank_broadcast, 4, sd, str(tmp_path / "ckpt"), timeout=280)
    want = sd["model.layers.0.ffn.gate.tid2eid"]
    for rank, (mode, table, exported, saved, reloaded) in enumerate(results):
        assert mode == "broadcast" and table.dtype == torch.int64 and torch.equal(table, want), rank
        assert reloaded.dtype == torch.int64 and torch.equal(reloaded, want), rank
        for k, t in exported.items():
            assert t.dtype == sd[k].dtype and torch.equal(t, sd[k]), (rank, k)
    _same(results[0][3], {k: v for k, v in sd.items() if ".gate." in k})
    from safetensors.torch import load_file
    parallm.checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.bfloat16)
    offline = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        offline.update(load_file(str(f)))
    k = "model.layers.0.ffn.gate.tid2eid"
    assert offline[k].dtype == torch.int64 and torch.equal(offline[k], sd[k])
