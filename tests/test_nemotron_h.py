"""Nemotron-H / Nemotron-3 (``nemotron_h``): Mamba-2 + attention + MLP / MoE hybrids against transformers.

Without a process group: the chunked SSD scan against transformers' torch scan (rows over several chunks, not a
multiple of the chunk) and a token-by-token recurrence; the packed scan and the packed conv (with its bias)
against transformers run per document (and the leak they would show without the resets); the Mamba-2 TP
layouts; the spec and table of dense and MoE configs against the checkpoint transformers writes; the refusals.

One spawn of 4 ranks runs every case of CASES in turn (``init_parallel(tp, pp, ep=...)`` per case). Per case:
fp32 logits (and log-probs) against transformers, a bit-exact save and export stream against the Hub
checkpoint, a broadcast load giving the same outputs, one SGD step (loss, gradient norm, stepped weights, output
after) against transformers' step on the same microbatches.
"""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch

import helpers
from parallm.verify.reference import causal_lm_loss, hf_output, value_loss

LR = 0.1
WORLD = 4
TOL = 2e-5

# hidden 64; Mamba-2: 8 heads of 8, 2 groups of B / C of 16, conv 4, chunks of 8 tokens (rows span several);
# attention: 4 heads of 16, 2 KV heads; MLP 96; MoE: 4 relu2 experts of 32 top-2 in a 32-wide latent, two
# groups (topk_group 1), a shared expert of 48
BASE = dict(hidden_size=64, vocab_size=101, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
            conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, max_position_embeddings=128,
            attn_implementation="eager")
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=2, topk_group=1,
           routed_scaling_factor=1.5, norm_topk_prob=True)
DENSE_PATTERN = "M-*M-M"
MOE_PATTERN = "ME*ME"


def nemotron_config(pattern: str, **overrides):
    from transformers import NemotronHConfig
    extra = MOE if "E" in pattern else {}
    return NemotronHConfig(hybrid_override_pattern=pattern, **{**BASE, **extra, **overrides})


def make_model(cfg, *, seed: int):
    """:func:`helpers.make_hf_model` (norms ~1 + 0.2 N, matrices ~0.08 N), then the Mamba-2 parameters as they
    look in a trained model (``A_log`` about ``log(1..heads)``, ``D`` about 1), the final norm ``norm_f`` about 1
    (the shared randomiser matches ``norm.weight``) and a non-zero router selection bias (a buffer it leaves at
    0)."""
    model = helpers.make_hf_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)) + 0.1 * torch.randn(
                    p.shape, generator=g))
            elif name.endswith(".D"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm_f.weight"):       # the final norm, around 1 like the others
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


# -- no process group ----------------------------------------------------------------------------------------

def _ssd_inputs(rows, length, *, heads=8, p=4, groups=2, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, heads, p, generator=g)
    dt_raw = torch.randn(rows, length, heads, generator=g)
    a = -torch.rand(heads, generator=g) * 2 - 0.1
    b, c = (torch.randn(rows, length, groups, n, generator=g) for _ in range(2))
    d = torch.randn(heads, generator=g)
    bias = torch.randn(heads, generator=g) * 0.5
    return x, dt_raw, a, b, c, d, bias


def _recurrence(x, dt, a, b, c, d):
    """The Mamba-2 recurrence token by token: ``S = exp(dt A) S + dt x B^T``, ``y = S C + D x`` (one row)."""
    length, heads, p = x.shape
    rep = heads // b.shape[1]
    bh, ch = b.repeat_interleave(rep, dim=1), c.repeat_interleave(rep, dim=1)
    state = torch.zeros(heads, p, b.shape[-1], dtype=torch.float64)
    out = []
    for t in range(length):
        da = torch.exp(dt[t].double() * a.double())[:, None, None]
        state = state * da + (dt[t].double()[:, None, None] * x[t].double()[..., None] * bh[t].double()[:, None])
        out.append((state @ ch[t].double()[..., None])[..., 0] + d.double()[:, None] * x[t].double())
    return torch.stack(out).float()


def test_ssd_scan_matches_transformers_and_the_recurrence():
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    from parallm.model.layers import mamba2
    x, dt_raw, a, b, c, d, bias = _ssd_inputs(2, 21)          # 21 tokens: two whole chunks of 8 and a part
    ref = hf.mamba2_chunk_scan(x, dt_raw, a, b, c, chunk_size=8, D=d, dt_bias=bias, dt_softplus=True)
    dt = torch.nn.functional.softplus(dt_raw + bias)
    mine = mamba2.ssd_scan(x, dt, a, b, c, chunk=8, d=d)
    assert (mine - ref).abs().max() < 1e-5
    rec = torch.stack([_recurrence(x[r], dt[r], a, b[r], c[r], d) for r in range(2)])
    assert (mine - rec).abs().max() < 1e-4
    # the skip D x is part of the output
    assert (mamba2.ssd_scan(x, dt, a, b, c, chunk=8) - mine).abs().max() > 1e-2


def test_packed_scan_and_conv_start_every_document_afresh():
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    from parallm.model.layers import mamba2
    docs = [(0, 19), (19, 22), (22, 40), (40, 41)]            # several chunks, a 3- and a 1-token document
    cu = torch.tensor([0] + [e for _, e in docs], dtype=torch.int32)
    x, dt_raw, a, b, c, d, bias = _ssd_inputs(1, 41, seed=1)
    dt = torch.nn.functional.softplus(dt_raw + bias)
    packed = mamba2.scan_packed(x[0], dt[0], a, b[0], c[0], d, cu, chunk=8)
    alone = torch.cat([hf.mamba2_chunk_scan(x[:, s:e], dt_raw[:, s:e], a, b[:, s:e], c[:, s:e], chunk_size=8, D=d,
                                            dt_bias=bias, dt_softplus=True)[0] for s, e in docs])
    assert (packed - alone).abs().max() < 1e-5
    whole = hf.mamba2_chunk_scan(x, dt_raw, a, b, c, chunk_size=8, D=d, dt_bias=bias, dt_softplus=True)[0]
    assert (whole[19:] - alone[19:]).abs().max() > 1e-2       # without the resets the documents would leak
    # the conv (with its bias): windows never reach into an earlier document
    g = torch.Generator().manual_seed(3)
    xs, w, cb = torch.randn(41, 10, generator=g), torch.randn(10, 1, 4, generator=g), torch.randn(10, generator=g)
    conv = mamba2.conv_packed(xs, w, cb, cu)
    alone = torch.cat([hf.causal_conv1d_fn(xs[s:e].T[None], w[:, 0], cb, activation="silu")[0].T for s, e in docs])
    assert (conv - alone).abs().max() < 1e-5
    whole = hf.causal_conv1d_fn(xs.T[None], w[:, 0], cb, activation="silu")[0].T
    assert (whole[19:22] - alone[19:22]).abs().max() > 1e-2
    assert torch.equal(mamba2.conv_padded(xs.T[None], w, cb)[0].T, whole)


def test_mamba_layouts_split_heads_with_their_groups():
    from parallm.families import spec_from_config
    from parallm.model.sharding import TensorSource, make_layout
    spec, _ = spec_from_config(nemotron_config(DENSE_PATTERN, n_groups=4))
    mb = spec.mamba                                           # inner 64, B / C 4 x 16, 8 heads
    sizes = (mb.inner, mb.inner, mb.bc_size, mb.bc_size, mb.num_heads)
    full = torch.arange(sum(sizes), dtype=torch.float32)[:, None].expand(-1, 3).clone()
    layout = make_layout("mamba_in", spec, 0)
    for tp in (1, 2, 4):
        shards = [layout.shard([TensorSource(full)], r, tp) for r in range(tp)]
        assert torch.equal(layout.merge(shards)[0], full)
        for r, shard in enumerate(shards):          # rank r: heads and groups [r/tp, (r+1)/tp) of every part
            want, at = [], 0
            for size in sizes:
                want += list(range(at + r * size // tp, at + (r + 1) * size // tp))
                at += size
            assert shard[:, 0].long().tolist() == want, (tp, r)
    conv = make_layout("mamba_conv", spec, 0)
    w = torch.randn(mb.conv_dim, 1, 4)
    assert torch.equal(conv.merge([conv.shard([TensorSource(w)], r, 2) for r in range(2)])[0], w)
    # rank 1 of 2: x channels of heads 4..7, then group 2..3 of B, then of C
    got = conv.shard([TensorSource(torch.arange(mb.conv_dim))], 1, 2).tolist()
    assert got == list(range(32, 64)) + list(range(96, 128)) + list(range(160, 192))


@pytest.mark.parametrize("pattern", [DENSE_PATTERN, MOE_PATTERN])
def test_spec_and_table_cover_the_checkpoint(pattern, tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.spec import check_tp
    from parallm.model.table import expected_hf_shapes
    cfg = nemotron_config(pattern)
    model = make_model(cfg, seed=0)
    spec, family = spec_from_config(cfg)
    assert family.name == "nemotron_h" and spec.layer_blocks == tuple(
        {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}[ch] for ch in pattern)
    assert spec.nope and not spec.tie_word_embeddings and spec.mamba.chunk_size == 8
    hub = helpers.hub_state_dict(model, str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    # the same spec from the config.json transformers wrote (layers_block_type, no hybrid_override_pattern)
    assert spec_from_config(str(tmp_path / "m"))[0] == spec
    if spec.moe is not None:
        assert spec.moe.latent_size == 32 and spec.moe.activation == "relu2" and spec.moe.router == "sigmoid_grouped"
    with pytest.raises(ValueError, match="n_groups=2 is not divisible by tp=4"):
        check_tp(spec, 4)


def test_inspect_shows_the_blocks_and_counts_tp_by_the_mamba_groups(tmp_path, capsys):
    import parallm
    from parallm.cli import main
    path = str(tmp_path / "m")
    make_model(nemotron_config(MOE_PATTERN, n_groups=2, mamba_num_heads=8), seed=0).save_pretrained(path)
    info = parallm.inspect_checkpoint(path, tp=2, ep=2)
    assert info["config"]["blocks"].startswith("ME*ME (Mamba-2: 8 heads x 8, 2 groups of B / C x 16")
    assert info["valid_tp"] == [1, 2] and info["problem"] is None      # 2 groups of B / C: not tp 4
    wider = str(tmp_path / "g4")
    make_model(nemotron_config(MOE_PATTERN, n_groups=4, mamba_num_heads=8), seed=0).save_pretrained(wider)
    assert parallm.inspect_checkpoint(wider)["valid_tp"] == [1, 2, 4]
    assert info["moe"]["activation"] == "relu2" and info["moe"]["tensors_per_layer"] == 8
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "blocks        ME*ME (Mamba-2" in out
    # no RoPE: its attention layers have no positional embedding, and inspect says so (not "rope default")
    assert info["config"]["rope"] == "none" and info["config"]["rope_theta"] is None
    assert "no rope (no positional embedding)" in out and "theta" not in out


def test_context_parallel_needs_heads_and_groups_divisible_by_tp_times_cp():
    from parallm.families import spec_from_config
    from parallm.model.layers.mamba2 import check_mamba_layout
    spec, _ = spec_from_config(nemotron_config(DENSE_PATTERN))        # 8 heads, 2 groups
    with pytest.raises(ValueError, match=r"n_groups=2 / tp=2 = 1 is not divisible by cp=2"):
        check_mamba_layout(spec, tp=2, cp=2)
    check_mamba_layout(spec, tp=1, cp=2)
    check_mamba_layout(spec, tp=2, cp=1)


def test_balanced_split_costs_the_block_kinds():
    """Nemotron-3-Nano-like shapes (hidden 2688, 64 Mamba-2 heads of 64 in 8 groups, state 128, 32 heads x 128
    attention, 128 relu2 experts top-6, vocab 131072) over a 52-layer pattern of its kind (23 Mamba-2, 23 MoE, 6
    attention): a Mamba-2 layer's mixing is its scan (independent of the length), an attention layer's its scores,
    an MLP / MoE layer's nothing; the balanced split over 4 stages is the cheapest of every split (brute force),
    and at 8k tokens it is not the split the weights alone give (whose dearest stage is dearer)."""
    import itertools

    from parallm.api import balanced_layers_per_stage
    from parallm.families import spec_from_config
    from parallm.model.stage_costs import balance_costs, forward_costs, mixing_costs
    from parallm.parallel.stages import balanced_sizes
    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    cfg = nemotron_config(pattern, hidden_size=2688, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
                          ssm_state_size=128, chunk_size=128, num_attention_heads=32, num_key_value_heads=2,
                          head_dim=128, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                          moe_shared_expert_intermediate_size=3712, moe_latent_size=None, n_group=1, topk_group=1,
                          vocab_size=131072, max_position_embeddings=262144)
    spec, family = spec_from_config(cfg)
    mix = mixing_costs(spec, seq_len=8192)
    scan = 64 * (128 * (128 + 64) + 2 * 64 * 128) + spec.mamba.conv_dim * 4
    assert [mix[i] for i, ch in enumerate(pattern) if ch == "M"] == [scan] * pattern.count("M")
    assert all(mix[i] == 0 for i, ch in enumerate(pattern) if ch == "E")
    assert mix[5] == 32 * 256 * 8193 // 2 and mixing_costs(spec, seq_len=64)[0] == scan
    costs, head = balance_costs(family.table, spec, task="causal_lm", seq_len=8192)

    def dearest(sizes):
        ends = list(itertools.accumulate(sizes))
        stages = [sum(costs[a:b]) for a, b in zip([0] + ends, ends)]
        stages[-1] += head
        return max(stages)

    n = len(pattern)
    split = balanced_layers_per_stage(spec, task="causal_lm", pp=4, seq_len=8192)
    best = min(dearest((a, b - a, c - b, n - c)) for a, b, c in itertools.combinations(range(1, n), 3))
    assert dearest(split) == best
    weights, _ = forward_costs(family.table, spec, task="causal_lm")
    by_weights = list(balanced_sizes(weights, head, 4))
    assert by_weights != list(split) and dearest(by_weights) > dearest(split), (split, by_weights)


# -- distributed: parity, round trip, one step -----------------------------------------------------------------

# name, pattern, config overrides, layout (tp, pp, ep, nmb), build kwargs, options
CASES = [
    ("dense tp2 dp2 padded, 21-token rows over 3 chunks, recompute", DENSE_PATTERN, {},
     dict(tp=2, pp=1, ep=1, nmb=1), {"recompute": "full"}, dict(seq=21, logprobs=True)),
    ("dense packed+SP tp2 dp2, docs of up to 30 tokens", DENSE_PATTERN, {}, dict(tp=2, pp=1, ep=1, nmb=2),
     {"packed": True, "sequence_parallel": True}, dict(seq=30, logprobs=True)),
    ("moe tp2 ep2 padded (bf16 build, router replay, checkpoint -> pp2 ep2)", MOE_PATTERN, {},
     dict(tp=2, pp=1, ep=2, nmb=1), {}, dict(seq=13, bf16=True, replay=True, reshard=dict(tp=1, pp=2, ep=2),
          reshard_build={"num_layers_in_first_pipeline_stage": 2})),
    ("moe packed+SP tp2 ep2", MOE_PATTERN, {}, dict(tp=2, pp=1, ep=2, nmb=1),
     {"packed": True, "sequence_parallel": True}, dict(seq=19, logprobs=True)),
    ("dense tp2 pp2 uneven [0] [1..5] mb2, MTP tensors carried", DENSE_PATTERN, {}, dict(tp=2, pp=2, ep=1, nmb=2),
     {"num_layers_in_first_pipeline_stage": 1, "mtp": True}, dict(seq=11, split=[[0], [1, 2, 3, 4, 5]], mtp=True)),
    ("dense pp2 vpp2 dp2 mb2, 8 layers M-*MM-*M", "M-*MM-*M", {}, dict(tp=1, pp=2, vpp=2, ep=1, nmb=2), {},
     dict(seq=11)),
    ("moe pp2 ep2 uneven [0 1 2] [3 4]", MOE_PATTERN, {}, dict(tp=1, pp=2, ep=2, nmb=1),
     {"num_layers_in_first_pipeline_stage": 3}, dict(seq=11, split=[[0, 1, 2], [3, 4]])),
    ("dense value tp2 dp2 packed", DENSE_PATTERN, {}, dict(tp=2, pp=1, ep=1, nmb=1),
     {"task": "value", "packed": True}, dict(seq=17)),
    # context parallelism: Mamba-2 layers head-parallel over the CP group (all-to-all), attention as ever
    ("dense cp2 dp2 packed, docs of up to 30 tokens", DENSE_PATTERN, {}, dict(tp=1, pp=1, cp=2, ep=1, nmb=1),
     {"packed": True}, dict(seq=30, logprobs=True)),
    ("moe tp2 cp2 padded, 4 groups", MOE_PATTERN, dict(n_groups=4), dict(tp=2, pp=1, cp=2, ep=1, nmb=1), {},
     dict(seq=21)),
    ("dense tp2 cp2 packed+SP ring, 4 groups", DENSE_PATTERN, dict(n_groups=4), dict(tp=2, pp=1, cp=2, ep=1, nmb=1),
     {"packed": True, "sequence_parallel": True, "cp_attn": "ring"}, dict(seq=30)),
]


class ValueModel(torch.nn.Module):
    """The value reference: transformers' backbone and a ``score`` ``[1, H]`` head (transformers 5.25 has no
    Nemotron-H sequence-classification class); what :func:`hf_output` reads as ``model`` / ``score``."""

    def __init__(self, causal, seed: int):
        super().__init__()
        self.causal = causal
        self.model = causal.model
        self.score = torch.nn.Linear(causal.config.hidden_size, 1, bias=False)
        with torch.no_grad():
            self.score.weight.copy_(0.08 * torch.randn(self.score.weight.shape,
                                                       generator=torch.Generator().manual_seed(seed)))


def hub_state(model, tmp: str) -> dict:
    if isinstance(model, ValueModel):
        sd = helpers.hub_state_dict(model.causal, tmp)
        sd.pop("lm_head.weight")
        sd["score.weight"] = model.score.weight.detach().clone()
        return sd
    return helpers.hub_state_dict(model, tmp)


def write_checkpoint(model, path: str) -> dict:
    sd = hub_state(model, path)
    if isinstance(model, ValueModel):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["architectures"] = ["NemotronHForSequenceClassification"]
        helpers.write_ckpt(path, sd, config)
        for name in os.listdir(path):
            if name.endswith(".safetensors") and name != "model.safetensors" or name.endswith(".index.json"):
                os.remove(os.path.join(path, name))
    return sd


def reference_step(model, ids, mask, pieces, task, tmp):
    """Mean over ``pieces`` equal slices of the batch of the task loss; SGD step; (loss, Hub state dict after,
    output after, gradient norm)."""
    import copy
    model = copy.deepcopy(model)
    model.zero_grad()
    loss_fn = value_loss if task == "value" else causal_lm_loss
    size = ids.shape[0] // pieces
    loss = torch.stack([loss_fn(hf_output(model, ids[i:i + size], mask[i:i + size], task=task), ids[i:i + size],
                                mask[i:i + size]) for i in range(0, ids.shape[0], size)]).mean()
    loss.backward()
    with torch.no_grad():
        norm = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum().sqrt()
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = hf_output(model, ids, mask, task=task)
    return loss.item(), hub_state(model, tmp), after, norm.item()


def chunk_spread(model, ids, mask, task) -> float:
    """How far transformers' own output moves when its scan takes chunks of 5 tokens instead of 8 (the same
    math in another float order): the floor of any fp32 comparison here (parallm starts every packed document
    at a chunk boundary, transformers' padded rows do not)."""
    with torch.no_grad():
        base = hf_output(model, ids, mask, task=task)
        mixers = [m for m in model.modules() if hasattr(m, "chunk_size") and hasattr(m, "A_log")]
        for m in mixers:
            m.chunk_size = 5
        try:
            other = hf_output(model, ids, mask, task=task)
        finally:
            for m in mixers:
                m.chunk_size = 8
    return helpers.max_diff_real(base, other, mask)


def make_cases(tmp_path, specs=CASES):
    cases = []
    for i, (name, pattern, overrides, layout, build, opts) in enumerate(specs):
        task = build.get("task", "causal_lm")
        model = make_model(nemotron_config(pattern, **overrides), seed=70 + i)
        if task == "value":
            model = ValueModel(model, seed=170 + i)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = write_checkpoint(model, ckpt)
        mtp = add_mtp(ckpt, ckpt_sd, seed=i) if opts.get("mtp") else {}
        ckpt_sd.update(mtp)
        ids, mask = helpers.padded_batch(101, batch=8, seq=opts.get("seq", 9), seed=i)
        dp = WORLD // (layout["tp"] * layout["pp"] * layout.get("cp", 1))
        loss, new_sd, after, norm = reference_step(model, ids, mask, dp * layout["nmb"], task, str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref = hf_output(model, ids, mask, task=task)
        new_sd.update(mtp)              # carried, never trained: unchanged by the step
        case = dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, task=task, ref=ref, ref_sd=ckpt_sd,
                    spread=chunk_spread(model, ids, mask, task), ref_loss=loss, ref_new_sd=new_sd, ref_after=after,
                    ref_norm=norm, opts=opts, **layout)
        if opts.get("logprobs"):
            lp = ref[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            case["ref_logprobs"] = torch.cat([lp, torch.zeros(ids.shape[0], 1)], dim=1)
        cases.append(case)
    return cases


def add_mtp(ckpt: str, hub: dict, *, seed: int) -> dict:
    """Multi-token-prediction tensors written into ``ckpt``'s safetensors (``mtp.*``, as Nemotron-3 checkpoints
    carry them and transformers drops them: an attention block and a MoE-shaped block after two norms and a
    projection; names and shapes illustrative), random values; returns them."""
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(seed)
    h = hub["backbone.norm_f.weight"].shape[0]
    shapes = {"mtp.layers.0.enorm.weight": (h,), "mtp.layers.0.hnorm.weight": (h,),
              "mtp.layers.0.eh_proj.weight": (h, 2 * h), "mtp.layers.0.norm.weight": (h,),
              "mtp.layers.0.mixer.q_proj.weight": (h, h), "mtp.layers.0.mixer.o_proj.weight": (h, h),
              "mtp.layers.1.norm.weight": (h,), "mtp.layers.1.final_layernorm.weight": (h,),
              "mtp.layers.1.mixer.up_proj.weight": (2 * h, h), "mtp.layers.1.mixer.down_proj.weight": (h, 2 * h)}
    tensors = {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}
    path = os.path.join(ckpt, "model.safetensors")
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    return tensors


def _load(chunks, ckpt, mode):
    import parallm
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, ckpt, mode=mode)


def _save_and_export(chunks, case, rank):
    import parallm
    sd = parallm.save_hf_weights(chunks)
    if rank == 0:
        helpers.assert_same_state(sd, case["ref_sd"])
    else:
        assert sd == {}
    names = []
    for name, t in parallm.export_hf_tensors(chunks):
        names.append(name)
        assert torch.equal(t, case["ref_sd"][name]), (case["name"], name)
    dup = [n for n, k in collections.Counter(names).items() if k > 1]
    assert not dup and set(names) == set(case["ref_sd"]), (case["name"], dup)


FP32_TENSORS = ("A_log", ".D", "dt_bias", "gate.weight", "e_score_correction_bias")


def _check_bf16_keeps_fp32(case, rank):
    """A bf16 model of the case's layout: ``A_log``, ``D``, ``dt_bias`` (and the router's tensors) are fp32
    parameters bit-equal to the checkpoint, every other parameter bf16; a bf16 save writes them fp32, bit-exact."""
    import parallm
    chunks = parallm.build_model(case["ckpt"], dtype=torch.bfloat16, **case["build"])
    _load(chunks, case["ckpt"], "slice")
    kinds = collections.Counter()
    for c in chunks:
        for name, p in c.named_parameters():
            fp32 = name.endswith(("A_log", ".D", "dt_bias", "router.weight", "e_score_correction_bias"))
            assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), (name, p.dtype)
            kinds[fp32] += 1
    assert kinds[True] and kinds[False]
    sd = parallm.save_hf_weights(chunks, dtype=torch.bfloat16)
    if rank == 0:
        for name, t in case["ref_sd"].items():
            if name.endswith(FP32_TENSORS):
                assert sd[name].dtype == torch.float32 and torch.equal(sd[name], t), name
            else:
                assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], t.bfloat16()), name


def rank_cases(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), cp=case.get("cp", 1), ep=case["ep"])
        lay = current_dims()
        opts, ids, mask = case["opts"], case["ids"], case["mask"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        if "split" in opts:
            assert [list(c.layer_range) for c in chunks] == [opts["split"][lay.pp_rank]], case["name"]
        assert all(c.mamba_kernel == "torch" for c in chunks)
        _load(chunks, case["ckpt"], "slice")
        got = parallm.forward(chunks, ids, mask)
        res = dict(fwd=helpers.max_diff_real(got, case["ref"], mask))
        if case["build"].get("packed"):
            assert torch.all(got[mask == 0] == 0)
            holed = mask.clone()
            holed[0, 3:5] = 0               # padding between real tokens: refused in the packed layout
            with pytest.raises(ValueError, match=r"row 0 .*padding between its real tokens.*Mamba-2"):
                parallm.forward(chunks, ids, holed)
        if opts.get("logprobs"):
            lp = parallm.forward(chunks, ids, mask, output="logprobs")
            keep = (mask[:, 1:] * mask[:, :-1]).bool()
            res["logprobs"] = (lp[:, :-1][keep] - case["ref_logprobs"][:, :-1][keep]).abs().max().item()
        _save_and_export(chunks, case, rank)
        other = parallm.build_model(case["ckpt"], **case["build"])
        _load(other, case["ckpt"], "broadcast")
        assert torch.equal(parallm.forward(other, ids, mask), got), case["name"]
        del other
        per = ids.shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        loss_fn = value_loss if case["task"] == "value" else causal_lm_loss
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_fn, num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        norm = parallm.clip_grad_norm_(chunks, float("inf"))      # the unsharded model's gradient norm
        res["norm"] = abs(norm.item() - case["ref_norm"]) / case["ref_norm"]
        with torch.no_grad():
            for c in chunks:
                for n, p in c.named_parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
                    else:       # the carried MTP tensors, the router's selection bias: no gradient, not stepped
                        assert p.grad is None and (n.startswith("carried_mtp.") and opts.get("mtp")
                                                   or n.endswith("e_score_correction_bias")), (case["name"], n)
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            res["weights"] = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
            res["worst"] = max(ref_new, key=lambda k: (new_sd[k] - ref_new[k]).abs().max().item())
        res.update(loss=abs(loss.item() - case["ref_loss"]),
                   after=helpers.max_diff_real(after, case["ref_after"], mask))
        if opts.get("replay"):      # router replay: the experts the model chose give back the same output
            own, routed = parallm.forward(chunks, ids, mask, return_routed_experts=True)
            assert torch.equal(parallm.forward(chunks, ids, mask, routed_experts=routed), own), case["name"]
        if opts.get("bf16"):
            _check_bf16_keeps_fp32(case, rank)
        if opts.get("reshard"):     # a training checkpoint of the stepped model, loaded at another layout
            path = os.path.join(os.path.dirname(case["ckpt"]), "train_ckpt")
            parallm.save_checkpoint(path, chunks, step=1, overwrite=True)
            parallm.destroy_parallel()
            parallm.init_parallel(**opts["reshard"])
            other = parallm.build_model(case["ckpt"], **case["build"], **opts["reshard_build"])
            helpers.nan_fill(other)
            assert parallm.load_checkpoint(path, other)["step"] == 1
            resharded = parallm.save_hf_weights(other)
            if rank == 0:
                helpers.assert_same_state(resharded, new_sd)
        out.append(res)
        parallm.destroy_parallel()
    return out


def check(cases, results):
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd, loss = max(r["fwd"] for r in per_rank), max(r["loss"] for r in per_rank)
        after, wdiff = max(r["after"] for r in per_rank), per_rank[0]["weights"]
        lp = max(r.get("logprobs", 0.0) for r in per_rank)
        norm = max(r["norm"] for r in per_rank)
        print(f"{case['name']:<62} fwd {fwd:.1e} (transformers' chunk spread {case['spread']:.1e}) loss {loss:.1e} "
              f"norm {norm:.1e} weights {wdiff:.1e} ({per_rank[0]['worst']}) after {after:.1e} logprobs {lp:.1e}")
        assert fwd < max(TOL, 2 * case["spread"]), case["name"]
        assert loss < TOL, case["name"]
        assert wdiff < TOL, case["name"]
        assert after < 1e-4, case["name"]
        assert norm < 1e-5, case["name"]
        assert lp < max(TOL, 2 * case["spread"]), case["name"]


@pytest.mark.timeout(600)
def test_nemotron_h_parity_round_trip_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path)
    check(cases, helpers.run_ranks(rank_cases, WORLD, cases, timeout=580))
