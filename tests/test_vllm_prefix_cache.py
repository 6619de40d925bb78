"""Pushes into in-process engines with vLLM's prefix cache on (its default), prompts sharing a long system prompt
(300 tokens: two full KV blocks of 128, the CPU build's block size, cached across steps): the engine's log-probs
after a push equal parallm's only if the push resets the cache (the cached blocks hold keys and values computed
with the old weights). One 2-rank spawn, a tied Qwen2 at tp2:

* ``push_weights`` into a plain engine on rank 0: equal before training (the system prompt's blocks now cached),
  far apart after training, equal after the push (new suffixes behind the same system prompt); then, as a
  control, a push whose reset is skipped (the engine's ``reset_prefix_cache`` replaced by a no-op that says
  True) leaves the engine far from the trainer: prefix caching is on and the cached blocks are reused; one more
  push with the reset brings it back;
* ``push_adapter`` into an engine serving LoRA on rank 1 (vLLM keys cached blocks by the adapter's name and
  path, both unchanged between pushes): the same sequence with the adapter's request.

Runs in the vLLM venv (``scripts/test.sh``).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PARALLM_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test.sh runs this file in .venv-vllm)")

import helpers  # noqa: E402
import vllm_engines as ve  # noqa: E402

TOL = 1e-4
SYSTEM = 300
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20, seed=0)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _prompts(system, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [system + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


def _sample(llm, prompts, seed, *, src, lora=None):
    """The engine's samples (and log-probs) on rank ``src``, on every rank."""
    import torch.distributed as dist
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    obj = [None]
    if llm is not None:
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True)
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                           lora_request=lora)
        obj = [[(list(o.outputs[0].token_ids),
                 [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in res]]
    dist.broadcast_object_list(obj, src=src)
    return obj[0]


def _cycle(out, key, chunks, opt, push, sample, system, vocab, seed):
    """Before / stale / after / stale without the reset / after: the diffs under ``key``."""
    diff = lambda s: ve.max_diff(chunks, _prompts(system, vocab, s), sample(_prompts(system, vocab, s), s))  # noqa
    out[f"{key}_before"] = diff(seed)
    ve.train(chunks, opt, vocab, 2, seed=seed + 1)
    out[f"{key}_stale"] = diff(seed + 2)
    push(reset=True)
    out[f"{key}_after"] = diff(seed + 3)
    ve.train(chunks, opt, vocab, 1, seed=seed + 4)
    push(reset=False)
    out[f"{key}_no_reset"] = diff(seed + 5)
    ve.train(chunks, opt, vocab, 1, seed=seed + 6)
    push(reset=True)
    out[f"{key}_after2"] = diff(seed + 7)


def _skipping_reset(llm, reset: bool):
    """The engine's ``reset_prefix_cache``, or (``reset=False``) a stand-in that resets nothing and says True."""
    if llm is not None and reset:
        llm.__dict__.pop("reset_prefix_cache", None)
    elif llm is not None:
        llm.reset_prefix_cache = lambda *args, **kwargs: True


def _rank(rank, world, ckpt):
    import parallm
    from parallm.integrations import vllm as pv
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    vocab = chunks[0].spec.vocab_size
    system = torch.randint(0, vocab, (SYSTEM,), generator=torch.Generator().manual_seed(7)).tolist()
    llm = pv.launch(ckpt, rank=0, **ENGINE)
    if llm is not None:
        cache = llm.llm_engine.vllm_config.cache_config
        out["prefix_caching"] = (bool(cache.enable_prefix_caching), int(cache.block_size))

    def push(reset):
        _skipping_reset(llm, reset)
        pv.push_weights(chunks, llm, rank=0)
    _cycle(out, "full", chunks, parallm.build_optimizer(chunks, lr=2e-2), push,
           lambda p, s: _sample(llm, p, s, src=0), system, vocab, 10)

    lora = parallm.build_model(ckpt, lora=parallm.LoraConfig(8, 16, TARGETS))
    parallm.load_hf_weights(lora, ckpt)
    engine = pv.launch(ckpt, rank=1, enable_lora=True, max_lora_rank=8, max_loras=1, **ENGINE)
    request = [None]

    def push_adapter(reset):
        _skipping_reset(engine, reset)
        request[0] = pv.push_adapter(lora, engine, rank=1)["lora_request"]
    push_adapter(True)
    _cycle(out, "lora", lora, parallm.build_optimizer(lora, lr=2e-2), push_adapter,
           lambda p, s: _sample(engine, p, s, src=1, lora=request[0]), system, vocab, 20)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from parallm import verify
    from parallm.integrations.vllm.serve import remove_shm_files, shm_files
    root = tmp_path_factory.mktemp("vllm_prefix")
    cfg = helpers.tiny_config("qwen2", head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=True,
                              max_position_embeddings=1024)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=5), str(root / "ckpt"))
    before = shm_files()
    try:
        return verify.spawn(_rank, 2, ckpt, timeout=560, collective_timeout=helpers.COLLECTIVE_TIMEOUT_S,
                            preload=("helpers", "vllm_engines"),
                            env={"VLLM_LOGGING_LEVEL": "WARNING", "PARALLM_PROGRESS": "0"})
    finally:
        remove_shm_files(before)          # the LoRA engine's adapter directory (its rank ends by os._exit)
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else ():
            if name.startswith("parallm-lora-") and name not in before:
                import shutil
                shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", ["full", "lora"])
def test_push_resets_the_prefix_cache(runs, key):
    assert runs[0]["prefix_caching"][0] and SYSTEM >= 2 * runs[0]["prefix_caching"][1], runs[0]["prefix_caching"]
    for r in runs:
        assert r[f"{key}_before"] <= TOL, r
        assert r[f"{key}_stale"] > 100 * TOL, r
        assert r[f"{key}_after"] <= TOL, (key, r[f"{key}_after"])
        assert r[f"{key}_no_reset"] > 100 * TOL, (key, r[f"{key}_no_reset"])   # the control: the cache is used
        assert r[f"{key}_after2"] <= TOL, (key, r[f"{key}_after2"])
