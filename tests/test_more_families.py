"""Qwen3 (qk-norm) and Mistral: each a small family file over the same decoder and weight table (Mistral's
sliding window at sequences longer than it: tests/test_sliding_window.py)."""

import pytest

import helpers
from test_pipeline import check_results, make_cases, rank_cases

CASES = [
    ("qwen3 tp2 pp2 tied nkv1 hd32 mb2", "qwen3",
     dict(num_hidden_layers=4, tie_word_embeddings=True, num_key_value_heads=1, head_dim=32),
     dict(tp=2, pp=2, vpp=None, nmb=2), {}),
    ("qwen3 packed+SP tp4 nkv2", "qwen3", dict(num_key_value_heads=2), dict(tp=4, pp=1, vpp=None, nmb=1),
     {"build": {"packed": True, "sequence_parallel": True}}),
    ("qwen3 value tp2 dp2 attention_bias", "qwen3", dict(attention_bias=True), dict(tp=2, pp=1, vpp=None, nmb=1),
     {"build": {"task": "value"}}),
    ("mistral tp2 pp2 window 64", "mistral", dict(num_hidden_layers=4, sliding_window=64, vocab_size=99),
     dict(tp=2, pp=2, vpp=None, nmb=1), {}),
]


@pytest.mark.timeout(400)
def test_qwen3_and_mistral_parity_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path, CASES)
    check_results(cases, helpers.run_ranks(rank_cases, 4, cases))
