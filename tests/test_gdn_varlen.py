"""Gated DeltaNet on varlen kernels (fla) for every layout, checked on CPU with the kernel emulated.

fla's kernels need CUDA; what is parallm's and can be checked here is the plumbing around them: a padded batch
(the default layout) and the padded context-parallel layout run their linear-attention layers on the kernel's
packed (varlen) path, each row's span of real tokens one document (holes included, as transformers runs them),
the varlen metadata made once per batch (every layer gets the same ``cu_seqlens`` tensor, so fla's metadata cache
hits), and ``auto`` never picks fla for an fp32 model (its Triton dots run TF32). The emulated kernel is
parallm's own torch varlen functions registered under the name "fla" (they are exact to transformers per
document: tests/test_qwen3_5.py); scripts/gpu_checks/gated_deltanet.py runs the real kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from test_qwen3_5 import hybrid_config, make_model

SEQ = 150             # three 64-token chunks, not a multiple of one
TOL = 5e-5            # transformers' own chunked-vs-recurrent spread is ~3e-5 at this length


def test_auto_takes_fla_for_half_precision_only(monkeypatch):
    from parallm.model.layers import gated_deltanet as gdn
    monkeypatch.setattr(gdn, "_fla_chunk", object())
    monkeypatch.delenv(gdn.KERNEL_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    assert gdn.resolve_kernel(device=cuda, dtype=torch.float32).name == "torch"
    assert gdn.resolve_kernel(device=cuda, dtype=torch.bfloat16).name == "fla"
    assert gdn.resolve_kernel(device=cuda, dtype=torch.float16).name == "fla"
    assert gdn.resolve_kernel("fla", device=cuda, dtype=torch.float32).name == "fla"     # asked for: runs
    assert gdn.resolve_kernel(device="cpu", dtype=torch.bfloat16).name == "torch"


def test_padded_rows_as_documents():
    from parallm.model.layers.attention import PaddedRows
    keep = torch.tensor([[0, 0, 1, 1, 1],        # left padding
                         [1, 1, 0, 1, 0],        # a hole, then right padding
                         [0, 0, 0, 0, 0],        # no real token: no document
                         [1, 1, 1, 1, 1]], dtype=torch.bool)
    index, cu, longest = PaddedRows(keep).spans()
    b = keep.shape[0]
    want = [(0, [2, 3, 4]), (1, [0, 1, 2, 3]), (3, [0, 1, 2, 3, 4])]       # (row, positions in the row)
    assert cu.tolist() == [0, 3, 7, 12] and longest == 5
    assert index.tolist() == [p * b + row for row, ps in want for p in ps]          # [S, B] s-major places


def _spy_kernel(calls):
    """parallm's torch varlen conv and rule registered as "fla", recording the cu_seqlens tensor of each call."""
    from parallm.model.layers import gated_deltanet as gdn

    def conv(x, weight, cu):
        calls.append(("conv", id(cu), cu.dtype))
        return gdn.causal_conv_packed(x, weight, cu)

    def rule(q, k, v, g, beta, cu):
        calls.append(("rule", id(cu), cu.dtype))
        return gdn.torch_packed_rule(q, k, v, g, beta, cu)

    return gdn.GDNKernel("fla", conv=conv, rule=rule)


def rank_varlen(rank, world, cases):
    import os

    import parallm
    from parallm.model.layers import gated_deltanet as gdn
    calls = []
    gdn.KERNELS["fla"] = _spy_kernel(calls)
    os.environ[gdn.KERNEL_ENV] = "fla"
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], cp=case.get("cp", 1))
        chunks = parallm.build_model(case["ckpt"])
        assert all(c.gdn_kernel == "fla" for c in chunks)
        parallm.load_hf_weights(chunks, case["ckpt"])
        calls.clear()
        got = parallm.forward(chunks, case["ids"], case["mask"])
        linear = sum(1 for c in chunks for layer in c.layers if layer.linear)
        assert len(calls) == 2 * linear, (case["name"], calls)          # every linear layer on the varlen path
        assert len({c[1] for c in calls}) == 1 and {c[2] for c in calls} == {torch.int64}, calls   # one cu
        out.append(helpers.max_diff_real(got, case["ref"], case["mask"]))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(400)
def test_padded_and_cp_padded_layouts_on_the_varlen_kernel(tmp_path):
    """Qwen3.5 and Qwen3-Next at tp2 padded (left padding, right padding, a hole between real tokens) and at cp2
    padded, with the emulated varlen kernel: transformers' logits on every real position."""
    cases = []
    for i, (model_type, layout) in enumerate([("qwen3_5_text", dict(tp=2)), ("qwen3_next", dict(tp=2)),
                                              ("qwen3_5_text", dict(tp=1, cp=2))]):
        cfg = hybrid_config(model_type)
        model = make_model(cfg, seed=40 + i)
        ckpt = helpers.save_checkpoint(model, str(tmp_path / f"m{i}"))
        ids, mask = helpers.padded_batch(cfg.vocab_size, batch=3, seq=SEQ, seed=i)
        mask[:] = 1
        mask[0, :37] = 0                    # left padding
        mask[1, SEQ - 29:] = 0              # right padding
        if "cp" not in layout:              # context parallelism compacts rows: holes are another question
            mask[2, 70:75] = 0              # a hole: transformers runs the conv and the decay through it
        ref = helpers.hf_logits(model, ids, mask)
        cases.append(dict(name=f"{model_type} {layout}", ckpt=ckpt, ids=ids, mask=mask, ref=ref, **layout))
    results = helpers.run_ranks(rank_varlen, 2, cases, timeout=400)
    for case, diff in zip(cases, results[0]):
        assert diff < TOL, (case["name"], diff)


def test_empty_documents_anywhere_in_a_stream():
    """Zero-length documents (first, between, last) take no room and reset nothing: the same output as the
    stream without them (a trailing one used to index past the chunk table)."""
    from parallm.model.layers import gated_deltanet as gdn
    g = torch.Generator().manual_seed(0)
    total = 100
    q, k = (torch.randn(total, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(total, 4, 8, generator=g)
    decay, beta = -torch.rand(total, 4, generator=g), torch.rand(total, 4, generator=g)
    want = gdn.torch_packed_rule(q, k, v, decay, beta, torch.tensor([0, 70, 100]))
    for cu in ([0, 0, 70, 100], [0, 70, 70, 100], [0, 70, 100, 100]):
        got = gdn.torch_packed_rule(q, k, v, decay, beta, torch.tensor(cu))
        assert torch.equal(got, want), cu


@pytest.mark.parametrize("decay_scale", [0.5, 15.0])
def test_packed_rule_with_realistic_decays(decay_scale):
    """The varlen recurrence against transformers' token-by-token form per document with decays as large as real
    checkpoints give (exp(A_log) up to ~15 times softplus: log decays down to -15 per token, where the chunked
    form's exp(cumsum) differences are at their hardest), documents across chunk boundaries."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from parallm.model.layers import gated_deltanet as gdn
    g = torch.Generator().manual_seed(1)
    docs = [(0, 130), (130, 131), (131, 200)]
    total = docs[-1][1]
    q, k = (torch.randn(total, 2, 16, generator=g) for _ in range(2))
    v = torch.randn(total, 4, 16, generator=g)
    decay = -torch.rand(total, 4, generator=g) * decay_scale
    beta = torch.rand(total, 4, generator=g)
    cu = torch.tensor([0] + [b for _, b in docs])
    got = gdn.torch_packed_rule(q, k, v, decay, beta, cu)
    want = torch.cat([hf.torch_recurrent_gated_delta_rule(*(t[a:b][None] for t in (q, k, v, decay, beta)),
                                                          initial_state=None, output_final_state=False,
                                                          use_qk_l2norm_in_kernel=True)[0][0] for a, b in docs])
    assert (got - want).abs().max() < 2e-5, (got - want).abs().max()


def rank_holes(rank, world, ckpt, ids, mask):
    import parallm
    out = []
    for layout, build in ((dict(cp=2), {}), (dict(cp=2), {"packed": True}), ({}, {"packed": True})):
        parallm.init_parallel(**layout)
        chunks = parallm.build_model(ckpt, **build)
        parallm.load_hf_weights(chunks, ckpt)
        try:
            parallm.forward(chunks, ids, mask)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
        parallm.destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_holed_rows_refused_where_the_hole_would_be_removed(tmp_path):
    """A row with padding between its real tokens: the packed and context-parallel layouts remove the hole,
    which transformers runs through (conv and decay), so they refuse the row on every rank, naming it; the padded
    layout runs it exactly (test_padded_and_cp_padded_layouts_on_the_varlen_kernel)."""
    cfg = hybrid_config("qwen3_5_text")
    ckpt = helpers.save_checkpoint(make_model(cfg, seed=7), str(tmp_path / "m"))
    ids, mask = helpers.padded_batch(cfg.vocab_size, batch=2, seq=40, seed=2)
    mask[:] = 1
    mask[1, 10:13] = 0
    for rank_msgs in helpers.run_ranks(rank_holes, 2, ckpt, ids, mask, timeout=300):
        for msg in rank_msgs:
            assert msg is not None and "row 1 of the batch has padding between its real tokens" in msg, msg
            assert "linear-attention" in msg, msg
