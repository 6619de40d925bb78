"""Gemma 3 text (``Gemma3ForCausalLM``) against transformers 5.25 in fp32: the exact reference for the pieces Gemma 4
shares with it (sandwich norms, RoPE per layer type, the softmax scale, scaled embeddings, the tanh GELU, final
logit soft-capping, tied embeddings; docs/families.md).

The tiny model switches every feature on: 4 layers sliding / full / sliding / full (window 4 over rows of 12),
full layers linear-scaled RoPE theta 1e6, sliding ones default theta 1e4, ``query_pre_attn_scalar`` 24 (not
head_dim 16), soft-cap 0.5 (logits of std ~0.6), every norm's weight non-trivial (zero-centred: gains ``1 + w`` around 1).

Without a process group: config -> spec (a 4.x-style config.json too), the refusals by name, the table against
``save_pretrained``'s names. One 2-rank spawn: tp2 padded (logits, log-probs, entropy, bit-exact save, SGD step),
tp2 packed + SP (log-probs + entropy and a step on them), pp2 with 2 microbatches, cp2 packed. Breaks at tp2 and
pp2, each must move the logits: the attention's output norm skipped, every layer on the full layers' RoPE, the
cap off.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import helpers
from parallm.verify.reference import causal_lm_loss, hf_output
from test_gemma4_pieces import rl_loss, stats_of, stats_of_grad

LR = 0.5
TOL = 2e-5
SEQ = 12
GEMMA3 = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=101, sliding_window=4, query_pre_attn_scalar=24, final_logit_softcapping=0.5,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
              bos_token_id=None, eos_token_id=None)


def gemma3_config(**overrides):
    import transformers
    return transformers.Gemma3TextConfig(**dict(GEMMA3, **overrides))


def make_model(seed: int):
    import transformers
    model = transformers.Gemma3ForCausalLM(gemma3_config())
    helpers.randomize_(model, seed=seed)
    with torch.no_grad():       # norms "around 1" for Gemma's zero-centred weights: gains 1 + w around 1, not 2
        for name, p in model.named_parameters():
            if "norm" in name:
                p -= 1.0
    return model.eval()


# -- no process group ----------------------------------------------------------------------------------------

def test_config_table_and_refusals(tmp_path):
    import json
    import os

    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    spec, family = spec_from_config(gemma3_config())
    assert family.name == "gemma3" and spec.sandwich_norms and spec.qk_norm and spec.zero_centered_norm
    assert spec.layer_windows == (4, None, 4, None) and spec.tie_word_embeddings and spec.pad_token_id == 0
    assert spec.rope.kind == "linear" and spec.rope.theta == 1e6
    assert [spec.layer_rope(i).theta for i in range(4)] == [1e4, 1e6, 1e4, 1e6]
    assert spec.attn_scale == 24 ** -0.5 and spec.embed_scale == 8.0 and spec.final_logit_softcap == 0.5
    assert spec.hidden_act == "gelu_pytorch_tanh"
    hub = helpers.hub_state_dict(make_model(0), str(tmp_path / "m"))
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    # a 4.x-style config.json: rope_theta / rope_local_base_freq at the top, no layer_types, defaults left out
    raw = json.loads(open(os.path.join(tmp_path, "m", "config.json")).read())
    for key in ("rope_parameters", "layer_types", "query_pre_attn_scalar", "tie_word_embeddings"):
        raw.pop(key, None)
    raw.update(rope_theta=5e5, rope_local_base_freq=2e4, num_hidden_layers=7)
    old, _ = spec_from_config(raw)
    assert old.rope.theta == 5e5 and old.rope.kind == "default" and old.attn_scale == 256 ** -0.5
    assert [old.layer_rope(i).theta for i in range(7)] == [2e4] * 5 + [5e5, 2e4]
    assert old.layer_windows == (4,) * 5 + (None, 4) and old.tie_word_embeddings
    for bad, match in ((dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                       (dict(use_bidirectional_attention=True), "use_bidirectional_attention")):
        with pytest.raises(ValueError, match=match):
            spec_from_config(dict(raw, **bad))


# -- distributed -----------------------------------------------------------------------------------------------

CASES = [
    ("tp2 padded, step on logits, breaks", dict(tp=2), dict(), "logits"),
    ("tp2 packed+SP, logprobs+entropy, step on them", dict(tp=2), dict(packed=True, sequence_parallel=True), "stats"),
    ("pp2 padded mb2, step on logits, breaks", dict(pp=2, nmb=2), dict(), "logits"),
    ("cp2 packed, logprobs+entropy, step on them", dict(cp=2), dict(packed=True), "stats"),
]


def make_cases(tmp_path):
    cases = []
    for i, (name, layout, build, loss_on) in enumerate(CASES):
        model = make_model(seed=60 + i)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = helpers.hub_state_dict(model, ckpt)
        ids, mask = helpers.padded_batch(101, batch=4, seq=SEQ, seed=i)
        with torch.no_grad():
            ref = hf_output(model, ids, mask)
        lp, ent = stats_of(ref, ids)
        stepped = copy.deepcopy(model)
        layout = dict(layout)
        nmb = layout.pop("nmb", 1)
        size = ids.shape[0] // nmb
        losses = []
        for a in range(0, ids.shape[0], size):
            out = hf_output(stepped, ids[a:a + size], mask[a:a + size])
            losses.append(causal_lm_loss(out, ids[a:a + size], mask[a:a + size]) if loss_on == "logits"
                          else rl_loss(stats_of_grad(out, ids[a:a + size]), ids[a:a + size], mask[a:a + size]))
        loss = torch.stack(losses).mean()
        loss.backward()
        with torch.no_grad():
            norm = torch.stack([p.grad.pow(2).sum() for p in stepped.parameters() if p.grad is not None]).sum().sqrt()
            for p in stepped.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
            after = hf_output(stepped, ids, mask)
        new_sd = helpers.hub_state_dict(stepped, str(tmp_path / f"s{i}"))
        cases.append(dict(name=name, layout=layout, nmb=nmb, ckpt=ckpt, ids=ids, mask=mask, build=build,
                          loss_on=loss_on, ref=ref, ref_sd=ckpt_sd, ref_lp=lp, ref_ent=ent, ref_loss=loss.item(),
                          ref_norm=norm.item(), ref_after=after, ref_new_sd=new_sd))
    return cases


def _breaks(chunks, case) -> dict:
    import parallm
    from parallm.model.decoder import DecoderLayer
    ids, mask, out = case["ids"], case["mask"], {}
    layers = [m for c in chunks for m in c.modules() if isinstance(m, DecoderLayer)]
    kept = [(m.attn_out_norm, m.rope) for m in layers]
    spec = chunks[0].spec
    for key in ("attn_out_norm", "rope", "cap"):
        for m, (norm, rope) in zip(layers, kept):
            if key == "attn_out_norm":
                m.attn_out_norm = torch.nn.Identity()
            elif key == "rope":
                m.rope = spec.rope                  # every layer on the full layers' RoPE
        if key == "cap":
            for c in chunks:
                c.spec = dataclasses.replace(spec, final_logit_softcap=None)
        try:
            out[f"break_{key}"] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
        finally:
            for m, (norm, rope) in zip(layers, kept):
                m.attn_out_norm, m.rope = norm, rope
            for c in chunks:
                c.spec = spec
    return out


def rank_cases(rank, world, cases):
    import parallm
    out = []
    for case in cases:
        parallm.init_parallel(**case["layout"])
        ids, mask = case["ids"], case["mask"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, case["ckpt"])
        res = dict(fwd=helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask))
        keep = (mask[:, 1:] * mask[:, :-1]).bool()
        lp, ent = tuple(parallm.forward(chunks, ids, mask, output="logprobs+entropy"))
        res.update(logprobs=(lp[:, :-1][keep] - case["ref_lp"][:, :-1][keep]).abs().max().item(),
                   entropy=(ent[mask.bool()] - case["ref_ent"][mask.bool()]).abs().max().item())
        if case["loss_on"] == "logits":
            res.update(_breaks(chunks, case))
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            helpers.assert_same_state(sd, case["ref_sd"])
        kw = dict(loss_fn=causal_lm_loss) if case["loss_on"] == "logits" else \
            dict(loss_fn=rl_loss, output="logprobs+entropy")
        loss = parallm.forward_backward(chunks, ids, mask, num_microbatches=case["nmb"], **kw)
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
def test_gemma3_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        worst = {k: max(r[k] for r in per_rank) for k in ("fwd", "logprobs", "entropy", "loss", "norm", "after")}
        print(f"{case['name']:<48} " + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
              + f" weights {per_rank[0]['weights']:.1e}"
              + (" breaks: " + ", ".join(f"{k[6:]} {per_rank[0][k]:.1e}" for k in per_rank[0] if k.startswith("break_"))
                 if "break_cap" in per_rank[0] else ""))
        assert worst["fwd"] < TOL and worst["logprobs"] < TOL and worst["entropy"] < TOL, case["name"]
        assert worst["loss"] < TOL and worst["norm"] < 1e-5 and per_rank[0]["weights"] < TOL, case["name"]
        assert worst["after"] < 1e-4, case["name"]
        if "break_cap" in per_rank[0]:
            for key in ("break_attn_out_norm", "break_rope", "break_cap"):
                assert min(r[key] for r in per_rank) > 1e-2, (case["name"], key)
