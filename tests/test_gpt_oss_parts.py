"""gpt-oss's parts against transformers 5.25 in one process (no process group): the config -> spec reading, the weight
table against a real checkpoint, the expert layouts (``merge(split(x)) == x`` bit for bit, blocks that describe
each shard), the stacked save, the router, the clamped SwiGLU and the biased experts (grouped GEMM and loop).
The model end to end at every layout: tests/test_gpt_oss.py."""

from __future__ import annotations

import pytest
import torch

import helpers

from parallm.families import spec_from_config
from parallm.model.table import all_entries, expected_hf_shapes, fused_layout, stack_experts, stacked_saves

YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32, rope_theta=150000.0)


def gpt_oss_config(**overrides):
    """A tiny gpt-oss: hidden 64, 4 heads of 16 (2 KV heads), 4 experts of 32 top-2, window 4 on the even layers,
    YaRN, and a SwiGLU limit small enough that the tiny model's activations reach it (``swiglu_limit`` 0.3)."""
    base = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=4,
                num_hidden_layers=2, max_position_embeddings=128, rope_parameters=dict(YARN), swiglu_limit=0.3)
    return helpers.tiny_config("gpt_oss", **dict(base, **overrides))


def test_spec_reads_every_gpt_oss_field():
    spec, family = spec_from_config(gpt_oss_config(num_hidden_layers=4).to_dict())
    assert family.name == "gpt_oss" and spec.attn_sinks and spec.qkv_bias and spec.o_bias
    assert spec.layer_windows == (4, None, 4, None)
    moe = spec.moe
    assert (moe.router, moe.router_bias, moe.expert_bias, moe.activation) == ("topk_softmax", True, True,
                                                                              "clamped_swiglu")
    assert (moe.swiglu_limit, moe.swiglu_alpha, moe.expert_layout) == (0.3, 1.702, "interleaved_columns")
    assert moe.layers == (0, 1, 2, 3) and moe.num_experts == 4 and moe.top_k == 2
    assert moe.expert_intermediate_size == 32 and moe.aux_loss_coef == 0.0
    assert spec.yarn is not None and spec.yarn.truncate is False and spec.yarn.factor == 4.0
    # without layer_types (a dict config written by hand) the even layers slide, as GptOssConfig fills them in
    raw = gpt_oss_config(num_hidden_layers=3).to_dict()
    raw.pop("layer_types")
    assert spec_from_config(raw)[0].layer_windows == (4, None, 4)
    raw = gpt_oss_config(output_router_logits=True, router_aux_loss_coef=0.01).to_dict()
    assert spec_from_config(raw)[0].moe.aux_loss_coef == 0.01


@pytest.mark.parametrize("change,match", [
    (dict(num_local_experts=0), "num_local_experts=0"),
    (dict(num_experts_per_tok=5), "exceeds num_local_experts=4"),
    (dict(swiglu_limit=-1.0), "swiglu_limit=-1.0"),
    (dict(swiglu_alpha=0), "swiglu_alpha=0"),
    (dict(layer_types=["sliding_attention"] * 3), "3 layer_types for num_hidden_layers=2"),
])
def test_bad_configs_are_refused_by_name(change, match):
    raw = dict(gpt_oss_config().to_dict(), **change)
    with pytest.raises(ValueError, match=match):
        spec_from_config(raw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = helpers.make_hf_model(gpt_oss_config(num_hidden_layers=3))
    root = tmp_path_factory.mktemp("gpt_oss")
    return model, helpers.hub_state_dict(model, str(root / "ckpt"))


@pytest.mark.parametrize("task", ["causal_lm", "value"])
def test_table_reads_every_checkpoint_tensor_in_its_stacked_form(checkpoint, task):
    """Per expert the table names ``mlp.experts.{e}.gate_up_proj`` etc.; each is expert e's slab of the stacked
    tensor the checkpoint holds (what the loader reads), and stacking the per-expert tensors gives back exactly
    the checkpoint's key set and shapes (what the saves write)."""
    model, hub = checkpoint
    spec, family = spec_from_config(model.config)
    everything = all_entries(family.table, spec, task=task, pp=1)
    expected = expected_hf_shapes(family.table, spec, task=task, pp=1)
    fused = fused_layout(family.table, spec, task=task, pp=1)
    stacked = stacked_saves(everything)
    assert set(stacked) == set(fused) and all(fused[n].name == stacked[n][0] and fused[n].expert == stacked[n][1]
                                              for n in stacked)
    per_expert = {}
    for name in expected:
        if name in fused:
            part = fused[name]
            per_expert[name] = hub[part.name][part.expert]
            assert tuple(per_expert[name].shape) == expected[name], name
        elif name != "score.weight":
            per_expert[name] = hub[name]
            assert tuple(hub[name].shape) == expected[name], name
    want = {k: v for k, v in hub.items() if task == "causal_lm" or k != "lm_head.weight"}
    got = stack_experts(per_expert, stacked)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sum(n.endswith(".self_attn.sinks") for n in expected) == spec.num_layers


def test_expert_layouts_round_trip_and_blocks_describe_each_shard():
    """The gpt-oss per-expert layouts, stacked: gate_up ``[H, 2I]`` by columns, its bias and down ``[I, H]`` by
    rows, the down bias replicated (TP rank 0 its only owner): ``merge(shard(x)) == x`` bit for bit at tp 1, 2,
    4, and every block names exactly the piece of the shard it describes."""
    from parallm.model.sharding import ExpertStack, Replicated, Split
    g = torch.Generator().manual_seed(0)
    count, hidden, width = 3, 6, 8
    cases = ((Split(1), (hidden, 2 * width)), (Split(0), (2 * width,)), (Split(0), (width, hidden)),
             (Replicated(), (hidden,)))
    for inner, shape in cases:
        layout = ExpertStack(inner, count)
        sources = [torch.randn(shape, generator=g) for _ in range(count)]
        for tp in (1, 2, 4):
            shards = [layout.shard(sources, r, tp) for r in range(tp)]
            assert all(torch.equal(a, b) for a, b in zip(layout.merge(shards), sources))
            for r, shard in enumerate(shards):
                covered = torch.zeros(shard.shape, dtype=torch.bool)
                for b in layout.blocks(r, tp, [tuple(x.shape) for x in sources]):
                    local = shard[b.source].narrow(b.dim, b.local_start, b.local_stop - b.local_start)
                    assert torch.equal(local, sources[b.source].narrow(b.dim, b.hf_start, b.hf_stop - b.hf_start))
                    assert b.primary == (inner.tp_dim is not None or r == 0)
                    covered[b.source].narrow(b.dim, b.local_start, b.local_stop - b.local_start).fill_(True)
                assert covered.all()
                primary = layout.primary_slices(r, tp, tuple(shard.shape))
                assert primary == ([(0, 0, count)] if inner.tp_dim is not None or r == 0 else [])
            if inner.tp_dim is None:
                assert layout.tp_dim is None and all(torch.equal(s, shards[0]) for s in shards)
            else:
                assert layout.tp_dim == inner.tp_dim + 1


def test_interleaved_tp_split_keeps_gate_up_pairs_together():
    """Columns ``[r 2I/tp, (r+1) 2I/tp)`` of the interleaved ``gate_up`` are exactly the gate / up pairs of the
    intermediate rows ``[r I/tp, (r+1) I/tp)``, which the same rank's ``down`` rows multiply: so TP rank r's
    shard computes the TP shard of the expert."""
    from parallm.model.sharding import Split
    hidden, width, tp = 4, 6, 3
    gate, up = torch.randn(hidden, width), torch.randn(hidden, width)
    gate_up = torch.stack([gate, up], dim=-1).reshape(hidden, 2 * width)      # gate even, up odd
    for r in range(tp):
        shard = Split(1).shard([gate_up], r, tp)
        rows = slice(r * width // tp, (r + 1) * width // tp)
        assert torch.equal(shard[:, 0::2], gate[:, rows]) and torch.equal(shard[:, 1::2], up[:, rows])


def test_clamped_swiglu_is_transformers_apply_gate_bit_for_bit(checkpoint):
    from parallm.model.layers.moe import clamped_swiglu
    model, _ = checkpoint
    experts = model.model.layers[0].mlp.experts
    h = (torch.randn(64, 2 * 32) * 0.5).requires_grad_()
    want = experts._apply_gate(h)
    g = torch.randn_like(want)
    (dh_want,) = torch.autograd.grad(want, h, g)
    got = clamped_swiglu(h[..., 0::2], h[..., 1::2], limit=experts.limit, alpha=experts.alpha)
    (dh_got,) = torch.autograd.grad(got, h, g)
    assert torch.equal(got, want) and torch.equal(dh_got, dh_want)
    clamped = ((h[..., 0::2] > experts.limit).sum() + (h[..., 1::2].abs() > experts.limit).sum()).item()
    assert clamped > 10     # the clamp is active on these values
    # the ``+ 1`` on up and the clamp each change the result
    assert not torch.allclose(got, clamped_swiglu(h[..., 0::2], h[..., 1::2] - 1, limit=0.3, alpha=1.702))
    assert not torch.allclose(got, clamped_swiglu(h[..., 0::2], h[..., 1::2], limit=1e9, alpha=1.702))


def _parallm_experts(kernel, experts_hf, *, tp=1, rank=0):
    """parallm's Experts of TP rank ``rank`` of ``tp`` holding transformers' experts' shards."""
    from parallm.model.layers.moe import Experts
    num, hidden, two_w = experts_hf.gate_up_proj.shape
    mine = Experts(num, hidden, two_w // 2 // tp, torch.float32, "cpu", layout="interleaved_columns", bias=True,
                   add_down_bias=rank == 0, activation="clamped_swiglu", limit=experts_hf.limit,
                   alpha=experts_hf.alpha)
    mine.kernel = kernel
    w = two_w // tp
    with torch.no_grad():
        mine.linear_fc1.weight.copy_(experts_hf.gate_up_proj[:, :, rank * w:(rank + 1) * w])
        mine.linear_fc1.bias.copy_(experts_hf.gate_up_proj_bias[:, rank * w:(rank + 1) * w])
        mine.linear_fc2.weight.copy_(experts_hf.down_proj[:, rank * w // 2:(rank + 1) * w // 2])
        mine.linear_fc2.bias.copy_(experts_hf.down_proj_bias)
    return mine


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_biased_experts_equal_transformers(checkpoint, kernel):
    """Rows grouped by expert (one expert chosen by nobody) through parallm's experts, TP-split in two with the
    down bias on rank 0 only and the partial sums added, against transformers' ``GptOssExperts`` eager loop on
    the same tokens, each token sent to one expert with weight 1: outputs and every gradient within 1e-6."""
    model, _ = checkpoint
    experts_hf = model.model.layers[1].mlp.experts
    torch.manual_seed(0)
    counts = [5, 0, 3, 4]
    x = torch.randn(sum(counts), experts_hf.hidden_size)
    idx = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    eager = type(experts_hf).forward.__wrapped__
    x_hf = x.clone().requires_grad_()
    want = eager(experts_hf, x_hf, idx[:, None], torch.ones(len(idx), 1))
    grad = torch.randn_like(want)
    want.backward(grad)
    outs, xs, shards = [], [], []
    for rank in range(2):
        mine = _parallm_experts(kernel, experts_hf, tp=2, rank=rank)
        xr = x.clone().requires_grad_()
        out = mine(xr, counts, torch.tensor(counts))
        out.backward(grad)
        outs.append(out)
        xs.append(xr)
        shards.append(mine)
    got = outs[0] + outs[1]
    assert (got - want).abs().max() < 1e-6
    assert (xs[0].grad + xs[1].grad - x_hf.grad).abs().max() < 1e-6
    gu = torch.cat([s.linear_fc1.weight.grad for s in shards], dim=2)
    assert (gu - experts_hf.gate_up_proj.grad).abs().max() < 1e-6
    gub = torch.cat([s.linear_fc1.bias.grad for s in shards], dim=1)
    assert (gub - experts_hf.gate_up_proj_bias.grad).abs().max() < 1e-6
    down = torch.cat([s.linear_fc2.weight.grad for s in shards], dim=1)
    assert (down - experts_hf.down_proj.grad).abs().max() < 1e-6
    # the down bias: added by rank 0 only, so its gradient there is the whole one and rank 1's is zero
    assert (shards[0].linear_fc2.bias.grad - experts_hf.down_proj_bias.grad).abs().max() < 1e-6
    assert shards[1].linear_fc2.bias.grad is None or not shards[1].linear_fc2.bias.grad.any()
    assert not gu[1].any() and not down[1].any() and not gub[1].any()     # nobody chose expert 1
    model.zero_grad(set_to_none=True)


def test_router_is_transformers_topk_then_softmax(checkpoint):
    """``route``: transformers' ``GptOssTopKRouter`` (its bias in the logits, top-k of the logits, softmax over
    those k) on the same tokens: same experts, weights within 1e-7; replaying given experts weighs them by the
    softmax over their own logits."""
    from parallm.model.layers.moe import MoEBlock, Router
    model, _ = checkpoint
    router = model.model.layers[0].mlp.router
    block = MoEBlock.__new__(MoEBlock)
    torch.nn.Module.__init__(block)
    block.router = Router(tuple(router.weight.shape), torch.float32, "cpu", bias=tuple(router.bias.shape))
    with torch.no_grad():
        block.router.weight.copy_(router.weight)
        block.router.bias.copy_(router.bias)
    block.router_kind, block.top_k = "topk_softmax", router.top_k
    h = torch.randn(50, router.hidden_dim)
    logits, scores, idx = router(h)
    probs, weights, choices = block.route(h)
    assert torch.equal(choices, idx) and (weights - scores).abs().max() < 1e-7
    assert torch.allclose(probs, logits.softmax(-1))
    given = torch.stack([(idx[:, 0] + 1) % 4, (idx[:, 0] + 2) % 4], dim=1)
    _, w2, c2 = block.route(h, (given, torch.ones(50, dtype=torch.bool)))
    assert torch.equal(c2, given) and torch.allclose(w2, logits.gather(1, given).softmax(-1))


# -- MXFP4 ---------------------------------------------------------------------------------------------------------

def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked expert tensor ``[E, C, R]`` as MXFP4 ``blocks [E, R, C/32, 16]`` / ``scales [E, R, C/32]`` by the
    OCP MX definition (one E8M0 scale ``2^(floor(log2 amax) - 2)`` per 32 values, each value rounded to the
    nearest E2M1 value, saturating at 6; low nibble first), as gpt-oss's checkpoints store them. transformers'
    own quantiser needs its Triton kernels (not installable here); the reference is its dequantisation."""
    from parallm.checkpoint.mxfp4 import FP4_VALUES
    x = w.transpose(1, 2).float()
    e, r, c = x.shape
    groups = x.reshape(e, r, c // 32, 32)
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    grid = torch.tensor(FP4_VALUES[:8])
    code = ((scaled.abs().clamp(max=6.0).unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (scaled < 0).long())
    code = code.to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), (exp + 127).to(torch.uint8).contiguous()


def _random_mxfp4(e=3, r=10, g=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, r, g, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (e, r, g), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254            # the scale range's ends (tiny and huge values)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_transformers_bit_for_bit(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from parallm.checkpoint.mxfp4 import Mxfp4Source, dequantize
    from parallm.model.sharding import SlabSource, TensorSource
    blocks, scales = _random_mxfp4()
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)                  # [E, G * 32, R]
    assert torch.equal(dequantize(blocks, scales).transpose(1, 2).to(dtype), want)
    src = Mxfp4Source(TensorSource(blocks), TensorSource(scales))
    assert src.shape == tuple(want.shape)
    assert torch.equal(src.read(0, 1, 3).to(dtype), want[1:3])
    full = want.float() if dtype == torch.bfloat16 else want
    for e in range(3):
        slab = SlabSource(src, e)
        for dim, a, b in ((0, 0, 128), (0, 40, 72), (0, 5, 37), (1, 0, 10), (1, 3, 8)):
            got = slab.read(dim, a, b)
            assert torch.equal(got.to(dtype).float(), full[e].narrow(dim, a, b - a).float()), (e, dim, a, b)


def test_mxfp4_plan_refuses_what_would_load_wrong_weights():
    from parallm.checkpoint.mxfp4 import mxfp4_plan
    from parallm.errors import CheckpointError
    u8 = torch.uint8
    good = {"x.gate_up_proj_blocks": (2, 8, 4, 16), "x.gate_up_proj_scales": (2, 8, 4), "x.norm": (8,)}
    types = {"x.gate_up_proj_blocks": u8, "x.gate_up_proj_scales": u8, "x.norm": torch.float32}
    assert mxfp4_plan(good, types, True, where="ckpt") == {
        "x.gate_up_proj": ("x.gate_up_proj_blocks", "x.gate_up_proj_scales")}
    assert mxfp4_plan({"x.norm": (8,)}, types, True, where="ckpt") == {}     # a dequantised checkpoint
    with pytest.raises(CheckpointError, match="no quantization_config with quant_method 'mxfp4'"):
        mxfp4_plan(good, types, False, where="ckpt")
    lonely = {k: v for k, v in good.items() if not k.endswith("_scales")}
    with pytest.raises(CheckpointError, match="x.gate_up_proj_blocks has no x.gate_up_proj_scales"):
        mxfp4_plan(lonely, types, True, where="ckpt")
    with pytest.raises(CheckpointError, match="do not pair up"):
        mxfp4_plan(dict(good, **{"x.gate_up_proj_scales": (2, 8, 5)}), types, True, where="ckpt")
    with pytest.raises(CheckpointError, match="are torch.float32 / torch.uint8"):
        mxfp4_plan(good, dict(types, **{"x.gate_up_proj_blocks": torch.float32}), True, where="ckpt")
    with pytest.raises(CheckpointError, match="both unquantised and as MXFP4"):
        mxfp4_plan(dict(good, **{"x.gate_up_proj": (2, 128, 8)}), types, True, where="ckpt")


def test_inspect_shows_the_layer_pattern_and_the_experts_format(tmp_path, checkpoint):
    """``parallm inspect`` on an MXFP4 gpt-oss checkpoint: no problem (the pairs read as the loader reads them),
    the parameters counted as the model holds them, the window / full pattern and the sinks, MXFP4 experts
    dequantised into the unquantised tensors' dtype; the same checkpoint stored unquantised: its dtype."""
    from parallm import inspect_checkpoint
    from parallm.cli.inspect import render          # the text the command prints (render is the CLI's)
    model, hub = checkpoint
    config = model.config.to_dict()
    mx = {}
    for name, t in hub.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mx[name + "_blocks"], mx[name + "_scales"] = quantize_mxfp4(t)
        else:
            mx[name] = t
    helpers.write_ckpt(str(tmp_path / "mx"), mx, dict(config, quantization_config={"quant_method": "mxfp4"}))
    helpers.write_ckpt(str(tmp_path / "bf"), hub, config)
    quantized = inspect_checkpoint(str(tmp_path / "mx"), tp=2, ep=2, dp=2)
    plain = inspect_checkpoint(str(tmp_path / "bf"))
    assert quantized["problem"] is None and plain["problem"] is None
    assert quantized["parameters"] == plain["parameters"] == sum(t.numel() for t in hub.values())
    assert quantized["dtype"] == "float32" and "mxfp4" in quantized["dtypes"]
    text = render(quantized)
    assert "layers        window 4 on 2 layers (0, 2); full attention on 1 layer (1); a learned attention sink " \
           "per head" in text
    assert "expert format MXFP4 in the checkpoint" in text and "dequantised on load into float32" in text
    assert "router bias, expert biases, clamped SwiGLU (limit 0.3, alpha 1.702)" in text
    assert "expert format float32; router bias" in render(plain)
    assert any("MXFP4" in n for n in quantized["notes"])
    undeclared = str(tmp_path / "undeclared")
    helpers.write_ckpt(undeclared, mx, config)
    assert "no quantization_config with quant_method 'mxfp4'" in inspect_checkpoint(undeclared)["problem"]
