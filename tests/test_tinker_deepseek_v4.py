"""DeepSeek-V4 served by ``parallm serve-tinker`` (docs/families.md, "DeepSeek-V4: verl and Tinker").

Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS; elsewhere it skips). The tiny V4 of
tests/test_deepseek_v4.py (sliding / CSA / HCA layers, hash and routed MoE, 2 hyper-connection streams; its
vocabulary widened to the character tokenizer's 112) served at tp2 with the parallm sampler; a Tinker SDK LoRA
training client (rank 8: the server's "all-linear" on V4, q_a / q_b / kv / o_b_proj and the shared experts) against
transformers + PEFT on the same adapter (.venv-tinker's transformers 5.19 computes this V4 exactly as 5.25 does:
0 apart on its logits): the forward of a fresh adapter, one cross-entropy AdamW step (the factors after it), the
forward after it, and the sampler's log-probs of the trained snapshot equal to the training forward.
"""

from __future__ import annotations

import os

import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")

import helpers  # noqa: E402
import test_tinker as tt  # noqa: E402
import tinker_helpers as th  # noqa: E402
from test_deepseek_v4 import make_model, v4_config  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _v4_model(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    n = th.write_char_tokenizer(path)
    model = make_model(v4_config(vocab_size=max(n, 112), eos_token_id=1, bos_token_id=2, pad_token_id=0,
                                 max_position_embeddings=512), seed=3)
    helpers.hub_state_dict(model, path)
    return path


def test_v4_lora_client_against_transformers_peft(tmp_path):
    work = str(tmp_path)
    model = _v4_model(os.path.join(work, "model"))
    srv = th.Server(model, work, tp=2, sampler="parallm", lora_rank=tt.RANK, api_key=tt.KEY, cli=True)
    try:
        srv.model, srv.work = model, work
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key=tt.KEY)
        tc = tt._client(srv, 5)
        snapshot = tt._snapshot(srv, tc, "init")
        names = set(th.adapter_tensors(snapshot))
        assert any(".self_attn.q_b_proj.lora_A" in k for k in names), sorted(names)
        assert not any(".compressor." in k or "o_a_proj" in k for k in names), sorted(names)
        ref = th.peft_model(model, snapshot)
        before, factors, after = tt.step_against_peft(srv, tc, ref)
        print(f"V4 over Tinker: forward {before:.2e} (fresh adapter), factors after a step {factors:.2e}, "
              f"forward after it {after:.2e}")
    finally:
        srv.stop()
