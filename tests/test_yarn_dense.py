"""YaRN RoPE (``rope_type: "yarn"``, Qwen2.5 / Qwen3 long-context configs) in the LLaMA-like families, against
transformers' own models in fp32: logits at tp2 and at cp2 (each rank rotating its own share of the positions),
with sequences longer than ``original_max_position_embeddings`` so that the interpolated band is reached, and
the attention factor (``attention_factor``, or yarn's default ``0.1 ln(factor) + 1``) applied to cos / sin."""

import pytest
import torch

import helpers

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CASES = {
    "qwen2": ("qwen2", dict(YARN)),
    "qwen3-attention-factor": ("qwen3", dict(YARN, attention_factor=0.8, beta_fast=16.0)),
    "llama-no-truncate": ("llama", dict(YARN, factor=8.0, truncate=False)),
}


def _rank(rank, world, cases):
    import parallm
    out = {}
    for layout in (dict(tp=2), dict(cp=2)):
        parallm.init_parallel(**layout)
        for key, (ckpt, ids, mask) in cases.items():
            chunks = parallm.build_model(ckpt)
            parallm.load_hf_weights(chunks, ckpt)
            with torch.no_grad():
                out[key, tuple(layout)] = parallm.forward(chunks, ids, mask)
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_yarn_dense_families_match_transformers(tmp_path):
    cases, want, plain = {}, {}, {}
    for key, (family, rope) in CASES.items():
        shape = dict(num_hidden_layers=2, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                     hidden_size=128, max_position_embeddings=64)
        cfg = helpers.tiny_config(family, **shape, rope_parameters=rope)
        assert cfg.rope_parameters["rope_type"] == "yarn", cfg.rope_parameters
        model = helpers.make_hf_model(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        want[key] = helpers.hf_logits(model, ids, mask)
        other = helpers.make_hf_model(helpers.tiny_config(family, **shape))
        other.load_state_dict(model.state_dict())
        plain[key] = helpers.hf_logits(other, ids, mask)       # the same weights without yarn
        cases[key] = (helpers.save_checkpoint(model, str(tmp_path / key)), ids, mask)
    res = helpers.run_ranks(_rank, 2, cases)
    for key in CASES:
        assert (want[key] - plain[key]).abs().max() > 1e-2, key    # yarn changes transformers' output
        for layout in ("tp", "cp"):
            for r in res:
                diff = (r[key, (layout,)] - want[key]).abs().max().item()
                assert diff < 2e-5, (key, layout, diff)
