"""DeepSeek-V4 and parallm's vLLM integration (docs/families.md, "DeepSeek-V4: vLLM"): refused with the reason
(:mod:`parallm.integrations.vllm.unsupported`) before an engine starts or a tensor moves: ``launch`` and ``serve``
of a V4 checkpoint directory, ``push_weights`` (into an in-process engine or a connection) and ``push_adapter`` of
V4 chunks, on every rank alike. No vLLM needed (the refusals come first); what vLLM 0.32's CPU build does with V4
is tests/test_vllm_deepseek_v4.py's (run in .venv-vllm)."""

from __future__ import annotations

import pytest

import helpers
from test_deepseek_v4 import make_model, v4_config

REASON = "DeepSeek-V4 is not supported by parallm's vLLM integration"


def rank_push(rank, world, ckpt):
    import parallm
    from parallm.integrations import vllm as pv
    parallm.init_parallel(tp=world)
    chunks = parallm.build_model(ckpt, lora=parallm.LoraConfig(2, 4, "all-linear"))
    out = {}
    for name, call in (("push_weights", lambda: pv.push_weights(chunks, None, rank=0)),
                       ("push_adapter", lambda: pv.push_adapter(chunks, None, rank=0))):
        try:
            call()
            out[name] = "not refused"
        except ValueError as e:
            out[name] = str(e)
    parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_vllm_integration_refuses_deepseek_v4(tmp_path):
    from parallm.integrations import vllm as pv
    ckpt = str(tmp_path / "v4")
    make_model(v4_config(), seed=0).save_pretrained(ckpt)
    for call in (lambda: pv.launch(ckpt), lambda: pv.serve(ckpt, python="/nonexistent/python")):
        with pytest.raises(ValueError, match=REASON + ".*compute_token_to_req_indices"):
            call()
    for rank, out in enumerate(helpers.run_ranks(rank_push, 2, ckpt, timeout=280)):
        for name, msg in out.items():
            assert msg.startswith(f"{name}: {REASON}"), (rank, name, msg)
