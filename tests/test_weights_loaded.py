"""A model whose weights were never loaded is refused (forward, forward_backward, the saves and exports, verl's
compat forward) on every rank, naming the fix; what fills every parameter marks it loaded (load_hf_weights,
load_checkpoint, init="random", mark_loaded), what does not (load_hf_adapter, a failed load) does not.
``build_model(init="random")``: the same model at every layout for a seed (bit for bit), norms 1, biases 0,
matrices N(0, initializer_range), and transformers runs the saved directory to parallm's logits.
Also build_model's smaller contract: dtype names, a missing directory, a relative path taken for a Hub id."""

import json
import os
import time

import pytest
import torch

import helpers

NEEDLES = ["never loaded", "parallm.load_hf_weights(chunks, ckpt)", "init='random'", "parallm.mark_loaded(chunks)"]
REFUSED = ("forward", "forward_backward", "save_hf_weights", "save_hf_weights/dict", "export_hf_tensors",
           "save_checkpoint", "compat_forward", "after_failed_load/forward", "adapter_only/forward")
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict(tp=1)}
BOUND_S = 20.0


def _attempt(out, key, fn):
    t = time.monotonic()
    try:
        fn()
        out[key] = None
    except Exception as e:  # noqa: BLE001 - reported back
        out[key] = (type(e).__name__, str(e), time.monotonic() - t,
                    isinstance(e, FileNotFoundError), isinstance(e, ValueError))


def _never_loaded(parallm, rank, s, out):
    """At tp2: every refusal, then what marks and what does not."""
    from megatron.core import ModelParallelConfig

    from parallm.compat import verl
    ids, mask, ckpt, tmp = s["ids"], s["mask"], s["qwen2"], s["tmp"]
    parallm.init_parallel(tp=2)
    empty = parallm.build_model(ckpt)
    out["built_mark"] = empty[0].weights_loaded
    _attempt(out, "forward", lambda: parallm.forward(empty, ids, mask))
    _attempt(out, "forward_backward", lambda: parallm.forward_backward(
        empty, {"input_ids": ids, "attention_mask": mask}, loss_fn=lambda o, b: o.sum()))
    _attempt(out, "save_hf_weights", lambda: parallm.save_hf_weights(empty, os.path.join(tmp, "never")))
    _attempt(out, "save_hf_weights/dict", lambda: parallm.save_hf_weights(empty))
    _attempt(out, "export_hf_tensors", lambda: list(parallm.export_hf_tensors(empty)))
    _attempt(out, "save_checkpoint", lambda: parallm.save_checkpoint(os.path.join(tmp, "never_ckpt"), empty, step=0))
    compat = verl.ParallelQwen2ForCausalLM(s["qwen2_config"], ModelParallelConfig(tensor_model_parallel_size=2))
    _attempt(out, "compat_forward", lambda: compat(input_ids=ids, attention_mask=mask))
    out["nothing_written"] = not os.path.exists(os.path.join(tmp, "never")) and \
        not os.path.exists(os.path.join(tmp, "never_ckpt"))
    # filled by hand, then mark_loaded: runs, and equals the loaded model
    loaded = parallm.build_model(ckpt)
    parallm.load_hf_weights(loaded, ckpt)
    ref = parallm.forward(loaded, ids, mask)
    import warnings
    with warnings.catch_warnings(record=True) as caught:    # megatron's CUDA stream hint: silenced on CPU groups
        warnings.simplefilter("always")
        parallm.forward_backward(loaded, ids, mask, loss_fn=lambda o, i, m: o.float().mean())
    out["cuda_hint"] = [str(w.message) for w in caught if "CUDA_DEVICE_MAX_CONNECTIONS" in str(w.message)]
    with torch.no_grad():
        for c, d in zip(empty, loaded):
            for p, q in zip(c.parameters(), d.parameters()):
                p.copy_(q)
    parallm.mark_loaded(empty)
    out["manual_equal"] = torch.equal(parallm.forward(empty, ids, mask), ref)
    # a load failing while it writes (a value float16 cannot hold, found by the filling copy) unmarks; one
    # failing before anything is written (a missing directory) does not
    f16 = parallm.build_model(ckpt, dtype=torch.float16)
    parallm.load_hf_weights(f16, ckpt)
    _attempt(out, "overflow_load", lambda: parallm.load_hf_weights(f16, s["overflow"]))
    _attempt(out, "after_failed_load/forward", lambda: parallm.forward(f16, ids, mask))
    _attempt(out, "missing_load", lambda: parallm.load_hf_weights(empty, os.path.join(tmp, "nowhere")))
    out["after_missing_equal"] = torch.equal(parallm.forward(empty, ids, mask), ref)
    # a full training checkpoint marks; a PEFT adapter alone does not (the base is still unloaded)
    parallm.save_checkpoint(os.path.join(tmp, "full_ckpt"), loaded, step=1, overwrite=True)
    fresh = parallm.build_model(ckpt)
    parallm.load_checkpoint(os.path.join(tmp, "full_ckpt"), fresh)
    out["checkpoint_equal"] = torch.equal(parallm.forward(fresh, ids, mask), ref)
    adapted = parallm.build_model(ckpt, lora=parallm.LoraConfig(4, 8, ("q_proj", "v_proj")), init="random")
    with warnings.catch_warnings(record=True) as caught:    # its TP all-gather: torch 2.13's new name, no warning
        warnings.simplefilter("always")
        parallm.save_hf_adapter(adapted, os.path.join(tmp, "adapter"), overwrite=True)
    out["adapter_warnings"] = [str(w.message) for w in caught]
    bare = parallm.build_model(ckpt)
    parallm.load_hf_adapter(bare, os.path.join(tmp, "adapter"))
    _attempt(out, "adapter_only/forward", lambda: parallm.forward(bare, ids, mask))


def _random_models(parallm, rank, s, out):
    """init="random" at three layouts (two models, one tied), another seed, bf16 by name; the tp2 model saved."""
    ids, mask = s["ids"], s["mask"]
    for lay, kw in LAYOUTS.items():
        parallm.init_parallel(**kw)
        for name in ("qwen2", "tied"):
            chunks = parallm.build_model(s[name], init="random", seed=3)
            out[f"{name}/{lay}"] = parallm.save_hf_weights(chunks)
            if lay == "tp2":
                out[f"{name}/logits"] = parallm.forward(chunks, ids, mask)
                parallm.save_hf_weights(chunks, os.path.join(s["tmp"], f"random-{name}"), overwrite=True)
        if lay == "tp2":
            out["qwen2/seed4"] = parallm.save_hf_weights(parallm.build_model(s["qwen2"], init="random", seed=4))
            bf16 = parallm.build_model(s["qwen2"], init="random", seed=3, dtype="bf16")
            out["bf16_dtypes"] = sorted({str(p.dtype) for c in bf16 for p in c.parameters()})
            out["qwen2/bf16"] = parallm.save_hf_weights(bf16)
            _attempt(out, "dtype_bad", lambda: parallm.build_model(s["qwen2"], dtype="float8"))
            _attempt(out, "init_bad", lambda: parallm.build_model(s["qwen2"], init="zeros"))
        if lay != "pp2":       # experts: split over tp2, and over ep2
            parallm.init_parallel(**kw, ep=1 if lay == "tp2" else 2)
            out[f"moe/{lay}"] = parallm.save_hf_weights(parallm.build_model(s["moe"], init="random", seed=3))


def _paths(parallm, s, out):
    """build_model on a missing directory, an empty one, and a relative name that looks like a Hub id."""
    parallm.init_parallel(tp=2)
    os.chdir(s["tmp"])
    _attempt(out, "missing_dir", lambda: parallm.build_model("no/such/dir"))
    os.makedirs(os.path.join(s["tmp"], "empty"), exist_ok=True)
    _attempt(out, "empty_dir", lambda: parallm.build_model(os.path.join(s["tmp"], "empty")))
    _attempt(out, "hub_like", lambda: parallm.build_model("tiny-nope"))
    model = parallm.build_model(s["qwen2"])
    _attempt(out, "hub_like_load", lambda: parallm.load_hf_weights(model, "tiny-nope"))


def _rank(rank, world, s):
    import parallm
    out = {}
    _never_loaded(parallm, rank, s, out)
    _random_models(parallm, rank, s, out)
    _paths(parallm, s, out)
    parallm.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loaded")
    cfg = helpers.tiny_config("qwen2")
    qwen2 = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=1), str(tmp / "qwen2"))
    tied = helpers.save_checkpoint(helpers.make_hf_model(helpers.tiny_config("llama", tie_word_embeddings=True),
                                                         seed=2), str(tmp / "tied"))
    moe = helpers.save_checkpoint(helpers.make_hf_model(helpers.tiny_config("qwen3_moe"), seed=3), str(tmp / "moe"))
    sd = helpers.hf_state_dict(helpers.make_hf_model(helpers.tiny_config("qwen2"), seed=1))
    sd["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e6       # float16 cannot hold it
    with open(os.path.join(qwen2, "config.json")) as f:
        overflow = helpers.write_ckpt(tmp / "overflow", sd, json.load(f))
    ids, mask = helpers.padded_batch(cfg.vocab_size)
    s = dict(tmp=str(tmp), qwen2=qwen2, tied=tied, moe=moe, overflow=overflow, ids=ids, mask=mask,
             qwen2_config=cfg)
    t = time.monotonic()
    res = helpers.run_ranks(_rank, 2, s, timeout=300)
    print(f"\nspawn: {time.monotonic() - t:.1f}s")
    return s, res


@pytest.mark.timeout(400)
def test_never_loaded_is_refused_everywhere(run):
    s, res = run
    for r, out in enumerate(res):
        assert out["built_mark"] is False
        for key in REFUSED:
            got = out[key]
            assert got is not None, f"rank {r}: {key} ran on a model never loaded"
            name, msg, elapsed = got[:3]
            assert name == "RuntimeError", (r, key, name, msg)
            assert all(n in msg for n in NEEDLES), (r, key, msg)
            assert elapsed < BOUND_S, (r, key, elapsed)
        assert out["overflow_load"][0] == "CheckpointError" and "overflow" in out["overflow_load"][1], out["overflow_load"]
        assert out["missing_load"][0] == "MissingCheckpointError", out["missing_load"]
        assert out["nothing_written"], r
        assert out["manual_equal"] and out["after_missing_equal"] and out["checkpoint_equal"], r
        assert not out["adapter_warnings"], out["adapter_warnings"]
        assert not out["cuda_hint"], out["cuda_hint"]
    print(res[1]["forward"][1])


@pytest.mark.timeout(400)
def test_random_init_is_one_model_at_every_layout(run):
    import transformers
    s, res = run
    out = res[0]
    for name in ("qwen2", "tied"):
        ref = out[f"{name}/tp2"]
        for lay in LAYOUTS:
            helpers.assert_same_state(out[f"{name}/{lay}"], ref)
    helpers.assert_same_state(out["moe/dp2"], out["moe/tp2"])
    assert "lm_head.weight" not in out["tied/tp2"]
    # the values: as transformers initialises (initializer_range of the config, 0.02)
    sd = out["qwen2/tp2"]
    std = s["qwen2_config"].initializer_range
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        elif v.dim() == 1:
            assert torch.equal(v, torch.zeros_like(v)), k
        else:
            assert abs(v.std().item() / std - 1) < 0.15 and abs(v.mean().item()) < 0.2 * std, (k, v.std(), v.mean())
    # the matrices differ from each other and from another seed's
    mats = [v for v in sd.values() if v.dim() == 2]
    assert len({float(v.flatten()[:8].sum()) for v in mats}) == len(mats)
    assert all(not torch.equal(sd[k], out["qwen2/seed4"][k]) for k, v in sd.items() if v.dim() == 2)
    # bf16 by name: the same values, rounded
    assert res[0]["bf16_dtypes"] == ["torch.bfloat16"]
    for k, v in sd.items():
        assert torch.equal(out["qwen2/bf16"][k], v.bfloat16()), k
    for key, needles in (("dtype_bad", ["dtype", "'bf16'", "'float8'"]), ("init_bad", ["init", "'random'", "'zeros'"])):
        name, msg = out[key][:2]
        assert name == "ValueError" and all(n in msg for n in needles), (key, msg)
    # transformers runs the saved random model to parallm's logits
    for name in ("qwen2", "tied"):
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(s["tmp"], f"random-{name}"),
                                                                  dtype=torch.float32)
        diff = helpers.max_diff_real(helpers.hf_logits(model.eval(), s["ids"], s["mask"]), out[f"{name}/logits"],
                                     s["mask"])
        assert diff < 1e-5, (name, diff)


@pytest.mark.timeout(400)
def test_build_model_paths(run):
    s, res = run
    for out in res:
        name, msg, _, is_fnf, is_value = out["missing_dir"]
        assert name == "MissingCheckpointError" and is_fnf and is_value, out["missing_dir"]
        assert "no/such/dir" in msg and "does not exist" in msg and f"current directory {s['tmp']}" in msg, msg
        name, msg, _, is_fnf, _ = out["empty_dir"]
        assert name == "MissingCheckpointError" and is_fnf and "has no config.json" in msg, msg
        for key in ("hub_like", "hub_like_load"):
            name, msg = out[key][:2]
            assert name == "CheckpointError" and f"current directory {s['tmp']}" in msg and "'tiny-nope'" in msg, msg
