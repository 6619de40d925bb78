"""parallm.integrations.vllm.fixes.SinkWriter without vLLM (main suite): gpt-oss's attention sinks taken out of a
push's stream and written into an engine-shaped model's parameters after the reload, split over the engine's
tensor-parallel ranks. tests/test_vllm_gpt_oss.py checks it inside vLLM's CPU build."""

from __future__ import annotations

import pytest
import torch

from parallm.integrations.vllm import fixes


def _engine(layers: int, heads: int):
    """vLLM's gpt-oss module tree, in the parts the writer reads: ``model.layers.{i}.attn.sinks`` (+ others)."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    for _ in range(layers):
        block = torch.nn.Module()
        block.attn = torch.nn.Module()
        block.attn.sinks = torch.nn.Parameter(torch.zeros(heads, dtype=torch.bfloat16), requires_grad=False)
        block.attn.qkv = torch.nn.Linear(4, 4)
        block.attn.norm = torch.nn.LayerNorm(4)
        root.model.layers.append(block)
    return root


def _stream(layers: int, heads: int):
    out = []
    for i in range(layers):
        out.append((f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(4, 4)))
        out.append((f"model.layers.{i}.self_attn.sinks", torch.randn(heads)))
    return out


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_sinks_diverted_and_written(monkeypatch, rank, size):
    monkeypatch.setattr(fixes, "_tp_rank_size", lambda: (rank, size))
    heads = 4
    engine = _engine(3, heads // size)
    stream = _stream(3, heads)
    sent = {n: t.clone() for n, t in stream}
    writer = fixes.SinkWriter(engine)
    passed = list(writer.divert(iter(stream)))
    assert [n for n, _ in passed] == [n for n, _ in stream if not n.endswith("sinks")]
    for _, t in stream:           # the stream's memory is reused after it is read: the writer kept copies
        t.zero_()
    assert writer.apply() == 3
    local = heads // size
    for i, block in enumerate(engine.model.layers):
        want = sent[f"model.layers.{i}.self_attn.sinks"][rank * local:(rank + 1) * local].to(torch.bfloat16)
        assert torch.equal(block.attn.sinks.data, want)
    assert writer.apply() == 0    # applied once


def test_no_sinks_passes_through():
    engine = torch.nn.Linear(4, 4)
    writer = fixes.SinkWriter(engine)
    stream = _stream(1, 4)
    assert list(writer.divert(stream)) == stream       # a model without sinks: untouched, nothing diverted
    assert writer.apply() == 0


def test_mismatch_raises(monkeypatch):
    monkeypatch.setattr(fixes, "_tp_rank_size", lambda: (0, 1))
    writer = fixes.SinkWriter(_engine(1, 2))
    list(writer.divert([("model.layers.0.self_attn.sinks", torch.ones(4))]))
    with pytest.raises(ValueError, match="4 heads"):
        writer.apply()
    writer = fixes.SinkWriter(_engine(1, 2))
    list(writer.divert([("model.layers.5.self_attn.sinks", torch.ones(2))]))
    with pytest.raises(ValueError, match=r"layer\(s\) \[5\]"):
        writer.apply()
