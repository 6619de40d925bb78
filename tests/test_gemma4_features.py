"""Gemma 4 text as the released checkpoints run it (issue 57 item 2, docs/families.md "Gemma 4"), against
transformers 5.25's ``Gemma4ForCausalLM`` in fp32, through tests/layout_harness.py.

The tiny model is test_gemma4.py's (8 layers here, sliding / full alternating, window 4, proportional RoPE on the full
layers, softmax scale 1, v_norm, sandwich norms, q / k norms around 0.5, soft-cap 0.5, tied embeddings, layer
scalars U(0.5, 1.5)) with the released checkpoints' features switched on:

* the full layers' own attention shape: ``global_head_dim`` 32 over ``num_global_key_value_heads`` 1 (the
  sliding layers 16 over 2; at tp2 the one global KV head is replicated), their proportional RoPE over 32;
* K = V on the full layers (``attention_k_eq_v``: no ``v_proj``);
* per-layer input embeddings (``hidden_size_per_layer_input`` 16: ``embed_tokens_per_layer [101, 64]``, the model
  projection and its norm, each layer's gate / projection / norm; at pp2 they cross the stage boundary);
* KV sharing (``num_kv_shared_layers`` 2: layer 6 attends with layer 4's keys / values, layer 7 with layer 5's;
  q_proj alone there) with ``use_double_wide_mlp`` (their MLPs 64 wide, the others 32).

Without a process group: config -> spec and the table against ``save_pretrained``'s names. One 2-rank spawn: tp2
padded, tp2 packed + SP (a step on log-probs + entropy), pp2 mb2, cp2 packed; breaks at tp2 and pp2 (each must
move the logits): the cap off, no v_norm (on the K = V layers the values are the raw keys), every layer on the
sliding layers' RoPE, the per-layer inputs skipped (every layer's term; at pp2 the first stage's are still sent),
the wrong layer's keys / values shared (at tp2: layers 2 and 3 for 4 and 5; at pp2 no other layer of the kind is on
the stage). The pp2 split keeps each sharing layer with its source; a split that does not is refused naming both.

The ``gemma4`` wrapper (``Gemma4ForConditionalGeneration`` over the same text config, a 1-layer vision tower, no
audio tower): the table against its checkpoint (``model.language_model.*``, the tower and ``embed_vision`` carried),
tp2 padded and pp2 against its text-only logits, saves and export bit-exact with the tower. With an audio tower
(whose clipped linears hold 0-d bounds, ``input_min`` ... ``output_max``): loaded at tp1 and tp2 in both load modes,
saved and exported bit for bit, a training checkpoint round trip; a 0-d tensor used to stop every load.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import helpers
import layout_harness
from test_gemma4 import GEMMA4

TOL = 2e-5
SEQ = 12
FEATURES = dict(attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1,
                hidden_size_per_layer_input=16, vocab_size_per_layer_input=101,
                num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4,
                num_kv_shared_layers=2, use_double_wide_mlp=True)


def features_config(**overrides):
    import transformers
    base = {k: v for k, v in GEMMA4.items() if k != "per_layer_config"}
    return transformers.Gemma4TextConfig(**dict(base, **dict(FEATURES, **overrides)))


def make_model(seed: int, **overrides):
    import transformers
    model = transformers.Gemma4ForCausalLM(features_config(**overrides))
    helpers.randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():       # transformers' layer scalars are ones: make ignoring them visible
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():     # q / k norm gains around 0.5 (test_gemma4.py says why)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)
    return model.eval()


def test_spec_and_table(tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    spec, family = spec_from_config(features_config())
    assert family.name == "gemma4" and spec.global_layers == (1, 3, 5, 7) and spec.global_k_eq_v
    assert (spec.head_dim, spec.num_kv_heads, spec.global_head_dim, spec.global_kv_heads) == (16, 2, 32, 1)
    assert spec.rope.dim == 32 and spec.layer_rope(0).dim == 16 and spec.kv_head_counts == (1, 2)
    assert spec.per_layer_input_size == 16 and spec.per_layer_input_width == 128 and spec.boundary_width == 192
    hub = helpers.hub_state_dict(make_model(0), str(tmp_path / "m"))
    assert "model.layers.1.self_attn.v_proj.weight" not in hub and "model.layers.0.self_attn.v_proj.weight" in hub
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())
    assert spec.kv_sources == (None,) * 6 + (4, 5) and spec.mlp_width(6) == 64 and spec.mlp_width(5) == 32
    assert "model.layers.6.self_attn.k_proj.weight" not in hub and "model.layers.6.self_attn.k_norm.weight" not in hub
    from parallm.model.layers.kv_sharing import check_kv_sharing_recompute, check_kv_sharing_stages
    check_kv_sharing_stages(spec, [range(0, 4), range(4, 8)])
    with pytest.raises(ValueError, match="layer 6 reuses the keys / values of layer 4"):
        check_kv_sharing_stages(spec, [range(0, 5), range(5, 8)])
    with pytest.raises(ValueError, match="recompute='full' with KV sharing"):
        check_kv_sharing_recompute(spec, "full")
    # K = V with the sliding layers' shape: the full layers are still K = V layers (their own rows)
    same = spec_from_config(features_config(global_head_dim=16, num_global_key_value_heads=2))[0]
    assert same.global_layers == (1, 3, 5, 7) and same.global_k_eq_v and same.global_head_dim == 16


CASES = [
    ("tp2 padded, step on logits, breaks", dict(tp=2), dict(), "logits"),
    ("tp2 packed+SP, logprobs+entropy, step on them", dict(tp=2), dict(packed=True, sequence_parallel=True), "stats"),
    ("pp2 padded mb2, step on logits, breaks", dict(pp=2, nmb=2), dict(), "logits"),
    ("cp2 packed, logprobs+entropy, step on them", dict(cp=2), dict(packed=True), "stats"),
]


def _spread(model, ids, mask, layout, loss_on) -> float:
    """transformers' own spread: its sdpa and eager attention's logits after the same SGD step (the softmax scale 1
    and 8 layers make the step's output sensitive to rounding: 1.3e-5 to 1.5e-4 here)."""
    from test_gemma4 import _step
    pieces = layout.get("nmb", 1) * (2 // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)))
    return helpers.max_diff_real(_step(model, ids, mask, pieces, loss_on, "sdpa")[3],
                                 _step(model, ids, mask, pieces, loss_on, "eager")[3], mask)


def make_cases(tmp_path):
    cases = []
    for i, (name, layout, build, loss_on) in enumerate(CASES):
        model, (ids, mask) = make_model(seed=90 + i), helpers.padded_batch(101, batch=4, seq=SEQ, seed=i)
        cases.append(layout_harness.make_case(name, model, tmp_path, i, ids, mask, layout=layout, build=build,
                                              loss_on=loss_on, breaks=loss_on == "logits",
                                              spread=_spread(model, ids, mask, layout, loss_on)))
    return cases


class SkipPerLayer(torch.nn.Module):
    """A break: the layer's per-layer input term left out."""

    def forward(self, x, inputs):
        return x


def _wrong_sources(layers, spec) -> dict[int, int]:
    """A break: each KV-sharing layer pointed at the last earlier layer of its kind other than its source that
    computes its own keys / values and that this stage holds (layers without one keep theirs)."""
    held = {m.layer_number for m in layers}
    out = {}
    for m in layers:
        src = spec.kv_source(m.layer_number)
        if src is None:
            continue
        kind = (spec.window(src), spec.is_global_layer(src))
        other = [j for j in held if j < src and not spec.is_kv_shared(j)
                 and (spec.window(j), spec.is_global_layer(j)) == kind]
        if other:
            out[m.layer_number] = max(other)
    return out


def _breaks(chunks, case) -> dict:
    import parallm
    from parallm.model.decoder import DecoderLayer
    ids, mask, out = case["ids"], case["mask"], {}
    layers = [m for c in chunks for m in c.modules() if isinstance(m, DecoderLayer)]
    kept = [(m.rope, m.self_attention.v_norm_eps, m.per_layer) for m in layers]
    attn = [(m.self_attention.kv_source, m.self_attention.keeps_kv, m.self_attention.drops_kv) for m in layers]
    spec = chunks[0].spec
    keys = ["cap", "v_norm", "rope", "per_layer"]
    wrong = _wrong_sources(layers, spec)
    if wrong:
        keys.append("kv_source")
    for key in keys:
        if key == "kv_source":
            for m in layers:
                a = m.self_attention
                if m.layer_number in wrong:
                    a.kv_source, a.drops_kv = wrong[m.layer_number], False
                if m.layer_number in wrong.values():
                    a.keeps_kv = True
        for m in layers:
            if key == "v_norm":
                m.self_attention.v_norm_eps = None
            elif key == "rope":
                m.rope = spec.layer_rope(0)         # every layer on the sliding layers' RoPE
            elif key == "per_layer":
                m.per_layer = SkipPerLayer()
        if key == "cap":
            for c in chunks:
                c.spec = dataclasses.replace(spec, final_logit_softcap=None)
        try:
            out[key] = helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref"], mask)
        finally:
            for m, (rope, eps, per_layer), (src, keeps, drops) in zip(layers, kept, attn):
                m.rope, m.self_attention.v_norm_eps, m.per_layer = rope, eps, per_layer
                m.self_attention.kv_source, m.self_attention.keeps_kv, m.self_attention.drops_kv = src, keeps, drops
            for c in chunks:
                c.spec = spec
    return out


def rank_cases(rank, world, cases):
    return layout_harness.rank_cases(rank, world, cases, breaks=_breaks)


@pytest.mark.timeout(600)
def test_gemma4_features_layouts_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases)
    for i, case in enumerate(cases):     # the output after the step: within max(1e-4, 2 x transformers' spread)
        print(f"transformers sdpa vs eager after the step: {case['spread']:.1e}", end="")
        layout_harness.check([case], [[r[i]] for r in results], tol=TOL, break_min=1e-2,
                             after_tol=max(1e-4, 2 * case["spread"]))
    for key in ("break_cap", "break_v_norm", "break_rope", "break_per_layer"):   # measured wherever asked for
        assert all(key in results[0][i] for i, c in enumerate(cases) if c["breaks"]), key
    assert "break_kv_source" in results[0][0]       # tp2: layers 2 and 3 stand in for 4 and 5


# -- the gemma4 wrapper (Gemma4ForConditionalGeneration): the language model trained, the towers carried -------

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)


def wrapper_model(seed: int):
    import transformers
    text = features_config()
    cfg = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=VISION, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(cfg)
    helpers.randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")) and "language_model" in name:
                p.mul_(0.5)
    return model.eval()


def test_wrapper_spec_and_table(tmp_path):
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes
    model = wrapper_model(0)
    spec, family = spec_from_config(model.config)
    assert family.name == "gemma4_vl" and spec.architecture == "Gemma4ForConditionalGeneration"
    assert spec.global_k_eq_v and spec.per_layer_input_size == 16 and spec.kv_sources[6:] == (4, 5)
    hub = helpers.hub_state_dict(model, str(tmp_path / "w"))
    assert any(k.startswith("model.vision_tower.") for k in hub) and any(k.startswith("model.embed_vision.")
                                                                        for k in hub)
    shapes = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    assert set(shapes) == set(hub), sorted(set(shapes) ^ set(hub))[:6]
    assert all(tuple(hub[k].shape) == s for k, s in shapes.items())


WRAPPER_CASES = [
    ("wrapper tp2 padded, step on logits", dict(tp=2), dict(), "logits"),
    ("wrapper pp2 padded mb2, step on logits", dict(pp=2, nmb=2), dict(), "logits"),
]


def make_wrapper_cases(tmp_path):
    cases = []
    for i, (name, layout, build, loss_on) in enumerate(WRAPPER_CASES):
        model, (ids, mask) = wrapper_model(seed=70 + i), helpers.padded_batch(101, batch=4, seq=SEQ, seed=i)
        cases.append(layout_harness.make_case(name, model, tmp_path, i, ids, mask, layout=layout, build=build,
                                              loss_on=loss_on, spread=_spread(model, ids, mask, layout, loss_on)))
    return cases


@pytest.mark.timeout(600)
def test_gemma4_wrapper_layouts_against_transformers(tmp_path):
    cases = make_wrapper_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, 2, cases)
    for i, case in enumerate(cases):
        print(f"transformers sdpa vs eager after the step: {case['spread']:.1e}", end="")
        layout_harness.check([case], [[r[i]] for r in results], tol=TOL, after_tol=max(1e-4, 2 * case["spread"]))


AUDIO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32, conv_kernel_size=3,
             attention_chunk_size=4, attention_context_left=5)


def _audio_rank(rank, world, path, out):
    import parallm
    res = {}
    parallm.init_parallel(tp=world)
    for mode in ("slice", "broadcast"):
        chunks = parallm.build_model(path)
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, path, mode=mode)
        res[mode] = {n: t.clone() for n, t in parallm.export_hf_tensors(chunks)}
    parallm.save_hf_weights(chunks, f"{out}/hf{world}", overwrite=True)
    parallm.save_checkpoint(f"{out}/ckpt{world}", chunks, step=1)
    again = parallm.build_model(path)
    helpers.nan_fill(again)
    parallm.load_checkpoint(f"{out}/ckpt{world}", again)
    res["checkpoint"] = {n: t.clone() for n, t in parallm.export_hf_tensors(again)}
    parallm.destroy_parallel()
    return res if rank == 0 else None


def test_wrapper_with_audio_tower_round_trips(tmp_path):
    import glob

    import transformers
    from safetensors.torch import load_file
    cfg = transformers.Gemma4Config(text_config=features_config().to_dict(), vision_config=VISION, audio_config=AUDIO)
    model = transformers.Gemma4ForConditionalGeneration(cfg)
    helpers.randomize_(model, seed=5)
    hub = helpers.hub_state_dict(model, str(tmp_path / "w"))
    zero_d = [k for k, v in hub.items() if v.dim() == 0]
    assert len(zero_d) >= 8 and all(k.startswith("model.audio_tower.") for k in zero_d), zero_d[:4]
    for world in (1, 2):
        res = helpers.run_ranks(_audio_rank, world, str(tmp_path / "w"), str(tmp_path))[0]
        saved = {}
        for f in glob.glob(str(tmp_path / f"hf{world}" / "*.safetensors")):
            saved.update(load_file(f))
        for what, got in (("saved", saved), *res.items()):
            assert set(got) == set(hub), (world, what, sorted(set(got) ^ set(hub))[:4])
            bad = [k for k in hub if got[k].shape != hub[k].shape or got[k].dtype != hub[k].dtype
                   or not torch.equal(got[k], hub[k])]
            assert not bad, (world, what, bad[:4])
