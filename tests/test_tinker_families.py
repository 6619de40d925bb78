"""Issue 57's families served by ``parallm serve-tinker`` (docs/families.md, "verl, Tinker, vLLM" of each family).

Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS; elsewhere it skips). The tiny checkpoints of
tests/family_checkpoints.py (every feature of the family tests on; the vocabulary widened to the character
tokenizer's 112), each served at tp2 with the parallm sampler (one server per family), and a Tinker SDK LoRA
training client (rank 8, the server's "all-linear") against transformers + PEFT on the same adapter: the forward
of a fresh adapter, one cross-entropy AdamW step (every factor after it), the forward after it, and the sampler's
log-probs of the trained snapshot equal to the training forward.

Qwen3.6 (Qwen3.5-MoE) runs the same check with the targets the server names for it (the attention, Gated
DeltaNet and MLP projections: PEFT's "all-linear" would reach its ``shared_expert_gate``, which parallm does not
adapt; model/layers/lora_gdn.py); PEFT adapts its shared expert, not its stacked routed experts. Gemma 4 runs the full check on its checkpoint with the q / k norm gains
halved and AdamW's eps 1 (``QK_GAIN``, ``ADAM_EPS``): on this tiny model fp32 rounding of the gradients is ~1e-5 of
their largest in transformers itself, which eps 1e-4 would turn into step differences up to lr.

.venv-tinker's transformers is 5.19; it has all four families (``kimi_k25``, ``gemma4_text``, ``minimax_m2``,
``qwen3_5_moe_text``) and PEFT adapts their linear layers (the stacked routed experts it leaves alone, as the
server's "all-linear" does). The checkpoints are written by parallm in 5.25's names and read by 5.19 with nothing
missing or unexpected (checked); that 5.19 computes each family as 5.25 does is what this test's forward
comparison shows (parallm equals 5.25: the family tests).
"""

from __future__ import annotations

import os

import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")

import family_checkpoints as fc  # noqa: E402
import helpers  # noqa: E402
import test_tinker as tt  # noqa: E402
import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(600)
VOCAB = 112
TOKENS = {"eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}
# a module of each family's own the server's "all-linear" adapts (and one it must not)
ADAPTED = {"kimi_k25": (".self_attn.kv_b_proj.lora_A", ".experts.0."),
           "gemma4": (".self_attn.q_proj.lora_A", ".embed_tokens"),
           "minimax_m2": (".self_attn.q_proj.lora_A", ".block_sparse_moe.gate."),
           "qwen3_6": (".linear_attn.in_proj_qkv.lora_A", ".mlp.experts.")}


# AdamW's eps of the step compared with PEFT's, by family (default test_tinker's 1e-8: far below every gradient,
# so an entry moves by ~lr * sign(g) and the gradients' absolute rounding matters little; eps 1e-4 moved Kimi's
# factors by 4.4e-5, rounding amplified by lr / (4 eps)). The first step moves an entry by
# lr * g / (|g| + eps): with eps far below the gradients' rounding an entry whose true gradient is near zero moves by
# up to +-lr on either side, so the step is only as exact as the gradients' absolute rounding over eps. Gemma 4's
# tiny checkpoint (scale-1 attention over 8 layers) rounds its summed-loss gradients (up to ~400) at ~1e-5 of the
# largest even with the gains halved below (transformers' own fp32 against its fp64: 7.2e-4; at eps 1e-4 its own
# fp32 step is 3e-4 from its fp64 step), so its step uses eps 1, where that rounding moves the step by ~2e-6.
ADAM_EPS = {"gemma4": 1.0}
# Gemma 4's q / k norm gains are halved in the checkpoint (as tests/test_gemma4_lora.py does): with the family
# checkpoint's gains (1 + 0.3 N(0, 1)) and scale-1 attention, transformers' own fp32 gradients were 1.9e-4 of the
# largest from its fp64 ones (parallm's 1.2e-4 to 2.4e-4); halved, 1e-5 (parallm's 8e-6)
QK_GAIN = {"gemma4": 0.5}


def _write(rank, world, path, name):
    fc.write(path, fc.CONFIGS[name](VOCAB), seed=3, tokens=TOKENS)
    if name in QK_GAIN:
        from safetensors.torch import load_file, save_file
        file = os.path.join(path, "model.safetensors")
        state = load_file(file)
        scaled = [k for k in state if k.endswith(("q_norm.weight", "k_norm.weight"))]
        assert scaled, sorted(state)
        for k in scaled:
            state[k] = state[k] * QK_GAIN[name]
        save_file(state, file, metadata={"format": "pt"})
    th.write_char_tokenizer(path)
    return sorted(os.listdir(path))


def _reference(model_dir: str, adapter: str):
    """transformers' model of ``model_dir`` (fp32; the ``kimi_k25`` wrapper as its own class), nothing missing or
    unexpected, with the PEFT adapter directory ``adapter``, trainable."""
    import peft
    import torch
    import transformers
    cls = transformers.AutoModelForCausalLM
    if "kimi_k25" in open(os.path.join(model_dir, "config.json")).read():
        cls = transformers.Kimi_K25ForConditionalGeneration
    base, info = cls.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)


@pytest.mark.parametrize("name", fc.FAMILIES)
def test_lora_client_against_transformers_peft(tmp_path, name):
    work = str(tmp_path)
    model = os.path.join(work, "model")
    files = helpers.run_ranks(_write, 1, model, name, timeout=180)[0]
    assert "model.safetensors" in files and "tokenizer.json" in files, files
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=tt.RANK, api_key=tt.KEY, cli=True)
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key=tt.KEY)
        tc = tt._client(srv, 5)
        snapshot = tt._snapshot(srv, tc, "init")
        names = set(th.adapter_tensors(snapshot))
        yes, no = ADAPTED[name]
        assert any(yes in k for k in names), sorted(names)
        assert not any(no in k for k in names), sorted(names)
        ref = _reference(model, snapshot)
        # eps: ADAM_EPS (an entry whose true gradient is near zero moves by lr * g / (|g| + eps))
        before, factors, after = tt.step_against_peft(srv, tc, ref, eps=ADAM_EPS.get(name))
        print(f"{name} over Tinker: {len(names)} adapter tensors, forward {before:.2e} (fresh adapter), factors "
              f"after a step {factors:.2e}, forward after it {after:.2e}")
    finally:
        srv.stop()
