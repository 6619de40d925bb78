"""Six pieces of Gemma 4 (issue 57 item 2) against transformers 5.25 in fp32: final logit soft-capping
(``DecoderSpec.final_logit_softcap``: Gemma 2 / 3 / 4's ``final_logit_softcapping``), proportional RoPE
(``rope_type: "proportional"``, Gemma 4's global layers: RopeSpec kind ``proportional``), scaled embeddings
(``DecoderSpec.embed_scale``, Gemma's ``sqrt(hidden_size)``), the ``gelu_pytorch_tanh`` gated MLP, the softmax scale
(``attn_scale``) and the values' weightless RMSNorm (``v_norm``).

Each piece alone, on a model parallm ran before them (test_gemma3.py / test_gemma4.py run them in their families),
so the reference is transformers' LLaMA with its ``lm_head`` output capped by a forward hook, ``cap * tanh(logits /
cap)`` (what ``Gemma4ForCausalLM.forward`` does to its logits, in that order), and parallm's LLaMA runs with the
spec's cap (and embed scale: transformers' side multiplies the embedding's output by a hook) set
(``spec_from_config`` wrapped in the spawned ranks); LLaMA takes ``hidden_act="gelu_pytorch_tanh"`` as it is. Cap 0.5 against logits of std ~0.6: the tanh
is far from linear. Tied embeddings (Gemma ties them). transformers' LLaMA takes any ``ROPE_INIT_FUNCTIONS``
kind, so the same model runs proportional RoPE (factor 0.25 of head_dim 16: 2 of 8 frequencies rotate) in both.

Without a process group: the vocab-parallel log-prob / entropy head against autograd through the capped logits
(values and the hidden / weight gradients, at temperature 1 and 0.7, token chunks of 3), and the spec's check.

One spawn of 2 ranks: tp2 padded (logits, log-probs, loss, gradient norm, every weight after one SGD step,
output after, ``save_hf_weights`` bit-exact) and tp2 packed + SP (log-probs and entropy, then one SGD step whose
loss reads them: the head's backward through the cap, split over TP and SP). The breaks on purpose, the cap left
off, the RoPE proportion taken as 1 (every frequency rotating), the embeddings unscaled and silu in place of the
tanh GELU, must each move the output far past the tolerance (and the head's backward without the ``1 - tanh^2``
factor fails the head test and the packed + SP step: tried by hand).
Proportional inverse frequencies equal transformers' ``_compute_proportional_rope_parameters`` bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import helpers
import layout_harness
from parallm.verify.reference import causal_lm_loss, hf_output

CAP = 0.5
LR = 0.5
TOL = 2e-5
SEQ = 12
ENT_COEF = 0.3


def cap_hook(module, args, out):
    return torch.tanh(out / CAP) * CAP


ROPE = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


SCALE = 64 ** 0.5       # Gemma's embed scale, sqrt(hidden_size)


def scale_hook(module, args, out):
    """``Gemma4TextScaledWordEmbedding``: the lookup times its fp32 scalar buffer cast to the weight's dtype."""
    return out * torch.tensor(SCALE).to(module.weight.dtype)


ATTN_SCALE = 1.0        # Gemma 4's softmax scale of q . k


def v_norm_hook(cfg):
    """``Gemma4RMSNorm(head_dim, with_scale=False)`` over each value head of v_proj's output."""
    def hook(module, args, out):
        x = out.view(*out.shape[:-1], -1, cfg.head_dim).float()
        x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps, -0.5)
        return x.type_as(out).view(out.shape)
    return hook


def make_model(seed: int):
    cfg = helpers.tiny_config("llama", tie_word_embeddings=True, head_dim=16, rope_parameters=dict(ROPE),
                              hidden_act="gelu_pytorch_tanh")
    assert cfg.rope_parameters["rope_type"] == "proportional"
    model = helpers.make_hf_model(cfg, seed=seed)
    model.lm_head.register_forward_hook(cap_hook)
    model.model.embed_tokens.register_forward_hook(scale_hook)
    for layer in model.model.layers:
        layer.self_attn.scaling = ATTN_SCALE            # Gemma4TextAttention.scaling
        layer.self_attn.v_proj.register_forward_hook(v_norm_hook(cfg))
    return cfg, model


# -- no process group ----------------------------------------------------------------------------------------

def test_spec_checks_the_new_fields():
    from parallm.families import spec_from_config
    spec, _ = spec_from_config(helpers.tiny_config("llama"))
    assert spec.final_logit_softcap is None
    assert dataclasses.replace(spec, final_logit_softcap=30.0).final_logit_softcap == 30.0
    for bad in (0, -1.0, True, "30"):
        with pytest.raises(ValueError, match="final_logit_softcap"):
            dataclasses.replace(spec, final_logit_softcap=bad)
    assert spec.embed_scale is None
    for bad in (0, float("inf"), True, "8"):
        with pytest.raises(ValueError, match="embed_scale"):
            dataclasses.replace(spec, embed_scale=bad)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="attn_scale"):
            dataclasses.replace(spec, attn_scale=bad)
    from test_lora import MLA_CONFIG
    mla, _ = spec_from_config(helpers.tiny_config("deepseek_v3", **MLA_CONFIG))
    with pytest.raises(ValueError, match="grouped-query"):
        dataclasses.replace(mla, v_norm=True)
    # gelu_pytorch_tanh is the dense MLP's: a MoE model with it is refused, not run with silu experts
    moe, _ = spec_from_config(helpers.tiny_config("qwen3_moe"))
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        dataclasses.replace(moe, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        spec_from_config(helpers.tiny_config("qwen3_moe", hidden_act="gelu_pytorch_tanh"))
    assert spec_from_config(helpers.tiny_config("qwen3", hidden_act="gelu_pytorch_tanh"))[0].hidden_act == \
        "gelu_pytorch_tanh"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_head_through_the_cap(temperature):
    from parallm.model.logprobs import StatsRequest, vocab_parallel_stats
    g = torch.Generator().manual_seed(3)
    n, h, v = 10, 8, 13
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (0.8 * torch.randn(v, h, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    req = StatsRequest(entropy=True, temperature=temperature, chunk=3)
    lp, ent = vocab_parallel_stats(hidden, weight, targets, real=v, vocab_start=0, request=req, group=None,
                                   softcap=CAP)
    (lp * gl + ent * ge).sum().backward()
    got = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad, weight.grad = None, None
    z = torch.tanh((hidden @ weight.t()) / CAP) * CAP / temperature
    lsm = z.log_softmax(-1)
    ref_lp = lsm.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    (ref_lp * gl + ref_ent * ge).sum().backward()
    ref = (ref_lp.detach(), ref_ent.detach(), hidden.grad, weight.grad)
    for name, a, b in zip(("logprobs", "entropy", "d hidden", "d weight"), got, ref):
        assert (a - b).abs().max().item() < 1e-5, name
    # without the cap the head computes another distribution (the break the spawn also tries)
    off, _ = vocab_parallel_stats(hidden, weight, targets, real=v, vocab_start=0, request=req, group=None)
    assert (off.detach() - ref[0]).abs().max().item() > 1e-2


@pytest.mark.parametrize("prf,factor,dim,theta", [(0.25, None, 16, 1e4), (0.25, None, 512, 1e6),
                                                 (0.5, 2.0, 64, 1e4), (1.0, None, 16, 1e4), (0.3, None, 20, 1e4)])
def test_proportional_rope_frequencies(prf, factor, dim, theta):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from parallm.model.positions.rope import apply_rope, rope_cos_sin, rope_inv_freq, rope_spec_from_hf_config
    params = dict(rope_type="proportional", rope_theta=theta, partial_rotary_factor=prf)
    if factor is not None:
        params["factor"] = factor
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=dim, rope_parameters=params)
    ref, scaling = ROPE_INIT_FUNCTIONS["proportional"](cfg)
    spec = rope_spec_from_hf_config(cfg, dim)
    assert spec.kind == "proportional" and spec.dim == dim and scaling == 1.0
    assert torch.equal(rope_inv_freq(spec), ref)
    # the non-rotating channels pass unchanged; the rotating ones pair j with j + dim / 2 (not GLM's partial RoPE)
    x = torch.randn(5, 2, dim)
    cos, sin = rope_cos_sin(spec, torch.arange(5))
    y = apply_rope(x, cos, sin)
    angles = int(prf * dim // 2)
    still = torch.ones(dim, dtype=torch.bool)
    still[:angles] = still[dim // 2:dim // 2 + angles] = False
    assert torch.equal(y[..., still], x[..., still]) and (y[1:, :, ~still] - x[1:, :, ~still]).abs().max() > 1e-3


def test_proportional_rope_refusals():
    from parallm.model.positions.rope import RopeSpec
    with pytest.raises(ValueError, match="proportion"):
        RopeSpec(dim=16, theta=1e4, kind="default", proportion=0.5)
    with pytest.raises(ValueError, match="proportion"):
        RopeSpec(dim=16, theta=1e4, kind="proportional", proportion=0.0)


# -- distributed -----------------------------------------------------------------------------------------------

def rl_loss(out, ids, mask):
    """-mean log-prob of the next real tokens - ENT_COEF * mean entropy over real tokens (reads TokenStats)."""
    lp, ent = out
    keep = (mask[:, 1:] * mask[:, :-1]).float()
    real = mask.float()
    return -(lp[:, :-1] * keep).sum() / keep.sum() - ENT_COEF * (ent * real).sum() / real.sum()


def stats_of(logits, ids):
    lsm = logits.float().log_softmax(-1)
    lp = torch.zeros(ids.shape)
    lp[:, :-1] = lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, -(lsm.exp() * lsm).sum(-1)


# name, layout, build kwargs, the step's loss on logits or on log-probs + entropy
CASES = [
    ("tp2 padded, step on logits, break", dict(tp=2), dict(), "logits"),
    ("tp2 packed+SP, logprobs+entropy, step on them", dict(tp=2), dict(packed=True, sequence_parallel=True), "stats"),
    ("pp2 padded mb2, step on logits", dict(pp=2, nmb=2), dict(), "logits"),
    ("cp2 packed, logprobs+entropy, step on them", dict(cp=2), dict(packed=True), "stats"),
]


def make_cases(tmp_path):
    cases = []
    for i, (name, layout, build, loss_on) in enumerate(CASES):
        _, model = make_model(seed=40 + i)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = helpers.hub_state_dict(model, ckpt)
        ids, mask = helpers.padded_batch(101, batch=4, seq=SEQ, seed=i)
        with torch.no_grad():
            ref = hf_output(model, ids, mask)
        lp, ent = stats_of(ref, ids)
        nmb = layout.pop("nmb", 1)
        stepped, loss, norm, after = layout_harness.sgd_step(model, ids, mask, nmb, loss_on, LR, rl=rl_loss)
        new_sd = helpers.hub_state_dict(stepped, str(tmp_path / f"s{i}"))
        cases.append(dict(name=name, layout=layout, nmb=nmb, ckpt=ckpt, ids=ids, mask=mask, build=build, loss_on=loss_on, ref=ref,
                          ref_sd=ckpt_sd, ref_lp=lp, ref_ent=ent, ref_loss=loss, ref_norm=norm,
                          ref_after=after, ref_new_sd=new_sd))
    return cases




def _with_cap(cap):
    import parallm.api.build as build
    from parallm.families import spec_from_config

    def capped(config):
        spec, family = spec_from_config(config)
        return dataclasses.replace(spec, final_logit_softcap=cap, embed_scale=SCALE, attn_scale=ATTN_SCALE,
                                   v_norm=True), family
    build.spec_from_config = capped


def _stats_diffs(chunks, case) -> dict:
    import parallm
    ids, mask = case["ids"], case["mask"]
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    lp, ent = tuple(parallm.forward(chunks, ids, mask, output="logprobs+entropy"))
    return dict(logprobs=(lp[:, :-1][keep] - case["ref_lp"][:, :-1][keep]).abs().max().item(),
                entropy=(ent[mask.bool()] - case["ref_ent"][mask.bool()]).abs().max().item())


def _break(chunks, case) -> dict:
    """The cap left off (the logits and the log-probs of the uncapped model), and every RoPE frequency rotating."""
    import parallm
    spec = chunks[0].spec
    out = {}
    for key, broken in (("cap", dataclasses.replace(spec, final_logit_softcap=None)),
                        ("rope", dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, proportion=1.0))),
                        ("scale", dataclasses.replace(spec, embed_scale=None))):
        for c in chunks:
            c.spec = broken
        try:
            out[f"break_{key}"] = helpers.max_diff_real(parallm.forward(chunks, case["ids"], case["mask"]),
                                                       case["ref"], case["mask"])
            if key == "cap":
                out["break_cap_lp"] = _stats_diffs(chunks, case)["logprobs"]
        finally:
            for c in chunks:
                c.spec = spec
    from parallm.model.layers.gqa import Attention
    from parallm.model.layers.mlp import MLP
    mlps = [m for c in chunks for m in c.modules() if isinstance(m, MLP)]
    attns = [m for c in chunks for m in c.modules() if isinstance(m, Attention)]
    assert mlps and all(m.act is not torch.nn.functional.silu for m in mlps)
    assert attns and all(a.q_factor == 4.0 and a.v_norm_eps is not None for a in attns)
    # attributes the layers read at build time: silu for the tanh GELU, the default softmax scale, no v_norm
    for key, mods, attr, value in (("act", mlps, "act", torch.nn.functional.silu), ("attn_scale", attns, "q_factor", None),
                                   ("v_norm", attns, "v_norm_eps", None)):
        kept = getattr(mods[0], attr)
        for m in mods:
            setattr(m, attr, value)
        try:
            out[f"break_{key}"] = helpers.max_diff_real(parallm.forward(chunks, case["ids"], case["mask"]),
                                                        case["ref"], case["mask"])
        finally:
            for m in mods:
                setattr(m, attr, kept)
    return out


def rank_cases(rank, world, cases):
    import parallm
    _with_cap(CAP)
    out = []
    for case in cases:
        parallm.init_parallel(**case["layout"])
        ids, mask = case["ids"], case["mask"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        assert chunks[0].spec.final_logit_softcap == CAP and chunks[0].spec.rope.kind == "proportional"
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, case["ckpt"])
        res = dict(fwd=helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask))
        res.update(_stats_diffs(chunks, case))
        if case["loss_on"] == "logits":
            res.update(_break(chunks, case))
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            helpers.assert_same_state(sd, case["ref_sd"])
        if case["loss_on"] == "logits":
            loss = parallm.forward_backward(chunks, ids, mask, loss_fn=causal_lm_loss, num_microbatches=case["nmb"])
        else:
            loss = parallm.forward_backward(chunks, ids, mask, loss_fn=rl_loss, output="logprobs+entropy",
                                            num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        norm = parallm.clip_grad_norm_(chunks, float("inf"))
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            res["weights"] = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
        res.update(loss=abs(loss.item() - case["ref_loss"]), norm=abs(norm.item() - case["ref_norm"]) / case["ref_norm"],
                   after=helpers.max_diff_real(after, case["ref_after"], mask))
        out.append(res)
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(600)
def test_softcap_and_proportional_rope_tp2_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        worst = {k: max(r[k] for r in per_rank) for k in ("fwd", "logprobs", "entropy", "loss", "norm", "after")}
        print(f"{case['name']:<48} " + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
              + f" weights {per_rank[0]['weights']:.1e}"
              + (f" breaks: cap off logits {per_rank[0]['break_cap']:.1e} logprobs {per_rank[0]['break_cap_lp']:.1e},"
                 f" every frequency rotating {per_rank[0]['break_rope']:.1e}, embeddings unscaled "
                 f"{per_rank[0]['break_scale']:.1e}, silu for gelu_tanh {per_rank[0]['break_act']:.1e}, "
                 f"default softmax scale {per_rank[0]['break_attn_scale']:.1e}, no v_norm {per_rank[0]['break_v_norm']:.1e}"
                 if "break_cap" in per_rank[0] else ""))
        assert worst["fwd"] < TOL and worst["logprobs"] < TOL and worst["entropy"] < TOL, case["name"]
        assert worst["loss"] < TOL and worst["norm"] < 1e-5 and per_rank[0]["weights"] < TOL, case["name"]
        assert worst["after"] < 1e-4, case["name"]
        if "break_cap" in per_rank[0]:
            for key in ("break_cap", "break_cap_lp", "break_rope", "break_scale", "break_act", "break_attn_scale",
                        "break_v_norm"):
                assert min(r[key] for r in per_rank) > 1e-2, (case["name"], key)
