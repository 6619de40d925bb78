"""Packed (remove-padding) execution, sequence parallelism and value models against transformers."""

import pytest
import torch

import helpers
from test_pipeline import check_results, make_cases, rank_cases

P = {"packed": True}
SP = {"packed": True, "sequence_parallel": True}
VALUE_SP = {"packed": True, "sequence_parallel": True, "task": "value"}

CASES = [
    ("llama packed tp2 pp2 mb2", "llama", dict(num_hidden_layers=4, attention_bias=True),
     dict(tp=2, pp=2, vpp=None, nmb=2), {"build": P}),
    ("qwen2 packed tp1 pp2 dp2 tied", "qwen2", dict(num_hidden_layers=4, tie_word_embeddings=True),
     dict(tp=1, pp=2, vpp=None, nmb=1), {"build": P}),
    ("llama packed tp1 dp4", "llama", dict(), dict(tp=1, pp=1, vpp=None, nmb=1), {"build": P}),
    ("llama packed+SP tp2 dp2 biases", "llama", dict(vocab_size=99, attention_bias=True, mlp_bias=True),
     dict(tp=2, pp=1, vpp=None, nmb=1), {"build": SP}),
    ("qwen2 packed+SP tp2 pp2 tied nkv1 mb2", "qwen2",
     dict(num_hidden_layers=4, tie_word_embeddings=True, num_key_value_heads=1),
     dict(tp=2, pp=2, vpp=None, nmb=2), {"build": SP}),
    ("qwen2 value packed+SP tp2 pp2", "qwen2", dict(num_hidden_layers=4),
     dict(tp=2, pp=2, vpp=None, nmb=2), {"build": VALUE_SP}),
    ("llama value padded tp4", "llama", dict(num_key_value_heads=1), dict(tp=4, pp=1, vpp=None, nmb=1),
     {"build": {"task": "value"}}),
    # config.pad_token_id set and that token at real positions: transformers' embedding (padding_idx) sends it
    # no gradient from the lookup, while a tied head still trains the row
    ("qwen2 packed+SP tp2 pp2 tied, pad token in the text", "qwen2",
     dict(num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=5), dict(tp=2, pp=2, vpp=None, nmb=2),
     {"build": SP, "pad_token": 5}),
    ("llama tp2 dp2 untied, pad token in the text", "llama", dict(pad_token_id=7),
     dict(tp=2, pp=1, vpp=None, nmb=1), {"pad_token": 7}),
]


@pytest.mark.timeout(600)
def test_packed_sp_value_parity_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path, CASES)
    # the value models also save an HF directory that transformers must reload bit-exactly
    for case in cases:
        if case["loss"] == "value":
            case["save_dir"] = str(tmp_path / (case["ckpt"].rsplit("/", 1)[-1] + "-saved"))
    results = helpers.run_ranks(rank_cases, 4, cases)
    check_results(cases, results)
    import transformers
    for idx, case in enumerate(cases):
        if not case.get("save_dir"):
            continue
        reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(case["save_dir"])
        assert type(reloaded).__name__.endswith("ForSequenceClassification")
        assert reloaded.config.num_labels == 1
        saved = results[0][idx]["saved"]
        sd = reloaded.state_dict()
        assert set(sd) == set(saved), set(sd) ^ set(saved)
        for k, v in saved.items():
            assert torch.equal(sd[k], v), k


def rank_value_from_causal(rank, world, ckpt, hidden_ref, ids, mask):
    """A causal-LM checkpoint loaded as a value model: the head is initialised (documented) and warned about."""
    import warnings

    import parallm
    from parallm.checkpoint.load_checks import VALUE_HEAD_INIT_SEED
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt, task="value", packed=True, sequence_parallel=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = parallm.load_hf_weights(chunks, ckpt)
    assert report.initialised == ("score.weight",)
    told = any("score.weight" in str(w.message) for w in caught)
    values = parallm.forward(chunks, ids, mask)
    g = torch.Generator().manual_seed(VALUE_HEAD_INIT_SEED)
    head = torch.randn(1, hidden_ref.shape[-1], generator=g) * 0.02
    expected = (hidden_ref @ head.T).squeeze(-1)
    return told, helpers.max_diff_real(values, expected, mask)


@pytest.mark.timeout(300)
def test_value_model_from_causal_checkpoint(tmp_path):
    cfg = helpers.tiny_config("llama", initializer_range=0.02)
    model = helpers.make_hf_model(cfg, seed=3)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "c"))
    ids, mask = helpers.padded_batch(cfg.vocab_size)
    import parallm
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask,
                             position_ids=parallm.default_position_ids(mask)).last_hidden_state
    res = helpers.run_ranks(rank_value_from_causal, 2, ckpt, hidden, ids, mask)
    assert any(told for told, _ in res)
    assert max(d for _, d in res) < 1e-5
