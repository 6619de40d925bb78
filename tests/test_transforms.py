"""Pure layout transforms, layer maps and split checks (no process group).

``merge(split(x)) == x`` bit for bit (torch.equal) for every kind and every valid tp, plus the exact per-rank
layouts docs/layouts.md promises (so a transform that round-trips but lays shards out differently from what
the decoder and vLLM/verl expect is still caught).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallm.model import sharding as T
from parallm.families import spec_from_config
from parallm.model.spec import check_tp, padded_vocab_size
from parallm.parallel.stages import layer_numbers

from helpers import tiny_config

TPS = (1, 2, 4, 8)


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _shards(fn, tp, *args, **kwargs):
    return [fn(*args, r, tp, **kwargs) for r in range(tp)]


# -- copy / column / row --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
def test_copy_roundtrip(tp):
    x = _rand(24, 16)
    shards = [T.shard_copy(x, r, tp) for r in range(tp)]
    assert all(torch.equal(s, x) for s in shards)
    (merged,) = T.merge_shards("copy", shards, spec=None)
    assert torch.equal(merged, x)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("shape", [(24, 16), (24,)])
def test_column_roundtrip(tp, shape):
    x = _rand(*shape)
    shards = [T.shard_dim(x, 0, r, tp) for r in range(tp)]
    per = shape[0] // tp
    for r, s in enumerate(shards):
        assert torch.equal(s, x[r * per:(r + 1) * per])
    assert torch.equal(T.merge_dim(shards, 0), x)
    assert torch.equal(T.merge_shards("column", shards, spec=None)[0], x)
    assert torch.equal(T.make_shard("column", [x], 1 % tp, tp, None, 0), shards[1 % tp])


@pytest.mark.parametrize("tp", TPS)
def test_row_roundtrip(tp):
    x = _rand(16, 24)
    shards = [T.shard_dim(x, 1, r, tp) for r in range(tp)]
    per = 24 // tp
    for r, s in enumerate(shards):
        assert torch.equal(s, x[:, r * per:(r + 1) * per])
    assert torch.equal(T.merge_shards("row", shards, spec=None)[0], x)


def test_split_not_divisible_names_numbers():
    with pytest.raises(ValueError, match=r"size 10 is not divisible by tp=4"):
        T.shard_dim(_rand(10, 3), 0, 0, 4)


# -- vocab ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("vocab", [101, 96, 7])
@pytest.mark.parametrize("multiple", [1, 4])
def test_vocab_roundtrip_with_padding(tp, vocab, multiple):
    x = _rand(vocab, 8)
    padded = padded_vocab_size(vocab, tp, multiple)
    assert padded >= vocab and padded % (tp * multiple) == 0 and padded - vocab < tp * multiple
    shards = [T.shard_vocab(x, r, tp, padded) for r in range(tp)]
    assert all(s.shape == (padded // tp, 8) for s in shards)
    full = torch.cat(shards, 0)
    assert torch.equal(full[:vocab], x)
    assert torch.count_nonzero(full[vocab:]) == 0, "vocab padding rows must be zero"
    assert torch.equal(T.merge_vocab(shards, vocab), x)

    class S:  # merge_shards reads spec.vocab_size only
        vocab_size = vocab
    assert torch.equal(T.merge_shards("vocab", shards, S)[0], x)
    assert torch.equal(T.make_shard("vocab", [x], tp - 1, tp, S, padded), shards[-1])


def test_vocab_shard_entirely_padding():
    # vocab 5, tp 8, padded 8: ranks 5..7 hold only padding rows
    x = _rand(5, 3)
    shards = [T.shard_vocab(x, r, 8, 8) for r in range(8)]
    for r in range(5, 8):
        assert shards[r].shape == (1, 3) and torch.count_nonzero(shards[r]) == 0
    assert torch.equal(T.merge_vocab(shards, 5), x)


def test_vocab_bad_padding_rejected():
    with pytest.raises(ValueError, match="padded vocab 100 must be >= 101"):
        T.shard_vocab(_rand(101, 2), 0, 4, 100)
    with pytest.raises(ValueError, match="divisible by tp=4"):
        T.shard_vocab(_rand(101, 2), 0, 4, 102)


def test_padded_vocab_size():
    assert padded_vocab_size(101, 1) == 101
    assert padded_vocab_size(101, 2) == 102
    assert padded_vocab_size(101, 4) == 104
    assert padded_vocab_size(100, 4) == 100
    assert padded_vocab_size(99, 8) == 104
    assert padded_vocab_size(101, 2, 64) == 128
    assert padded_vocab_size(128, 2, 64) == 128


# -- qkv ------------------------------------------------------------------------------------------------------

def test_kv_heads_of_rank():
    # nkv >= tp: contiguous blocks
    assert [list(T.kv_heads_of_rank(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(T.kv_heads_of_rank(r, 4, 4)) for r in range(4)] == [[0], [1], [2], [3]]
    assert list(T.kv_heads_of_rank(0, 1, 3)) == [0, 1, 2]
    # nkv < tp: one head, floor(r * nkv / tp), blocks of tp/nkv replicas
    assert [list(T.kv_heads_of_rank(r, 4, 2)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(T.kv_heads_of_rank(r, 4, 1)) for r in range(4)] == [[0]] * 4
    assert [list(T.kv_heads_of_rank(r, 8, 2)) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert [list(T.kv_heads_of_rank(r, 8, 4)) for r in range(8)] == [[0], [0], [1], [1], [2], [2], [3], [3]]


QKV_CASES = [  # (num_heads, num_kv_heads, head_dim)
    (8, 8, 4),   # MHA
    (8, 4, 4),
    (8, 2, 6),
    (8, 1, 4),   # MQA
    (16, 4, 3),
]


VALID_QKV = [(nh, nkv, d, tp) for nh, nkv, d in QKV_CASES for tp in TPS   # only splits parallm accepts
             if not (nh % tp or (nkv >= tp and nkv % tp) or (nkv < tp and tp % nkv))]


@pytest.mark.parametrize("nh,nkv,d,tp", VALID_QKV)
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_roundtrip_and_layout(nh, nkv, d, tp, bias):
    hidden = 5
    tail = () if bias else (hidden,)
    q = _rand(nh * d, *tail, seed=1)
    k = _rand(nkv * d, *tail, seed=2)
    v = _rand(nkv * d, *tail, seed=3)
    kw = dict(num_heads=nh, num_kv_heads=nkv, head_dim=d)
    shards = [T.shard_qkv(q, k, v, r, tp, **kw) for r in range(tp)]
    q_per = nh // tp
    kv_per = max(1, nkv // tp)
    for r, s in enumerate(shards):
        assert s.shape == ((q_per + 2 * kv_per) * d, *tail)
        sq, sk, sv = s.split([q_per * d, kv_per * d, kv_per * d], 0)
        assert torch.equal(sq, q[r * q_per * d:(r + 1) * q_per * d])
        # the KV heads rank r holds are the ones its query heads use (GQA group = head // (nh / nkv))
        groups = sorted({h // (nh // nkv) for h in range(r * q_per, (r + 1) * q_per)})
        assert groups == list(T.kv_heads_of_rank(r, tp, nkv))
        h0 = groups[0]
        assert torch.equal(sk, k[h0 * d:(h0 + kv_per) * d])
        assert torch.equal(sv, v[h0 * d:(h0 + kv_per) * d])
    mq, mk, mv = T.merge_qkv(shards, **kw)
    assert torch.equal(mq, q) and torch.equal(mk, k) and torch.equal(mv, v)

    class S:
        num_heads, num_kv_heads, head_dim = nh, nkv, d
    assert all(torch.equal(a, b) for a, b in zip(T.merge_shards("qkv", shards, S), (q, k, v)))
    assert torch.equal(T.make_shard("qkv", [q, k, v], tp - 1, tp, S, 0), shards[-1])


def test_qkv_merge_writes_replicated_head_once():
    # nkv=2 < tp=4: ranks (0,1) hold head 0, ranks (2,3) head 1; merge must give [nkv*d] not [tp*d], and
    # take each head from a rank that holds it
    d = 3
    q, k, v = _rand(4 * d, 2), _rand(2 * d, 2, seed=5), _rand(2 * d, 2, seed=6)
    shards = [T.shard_qkv(q, k, v, r, 4, num_heads=4, num_kv_heads=2, head_dim=d) for r in range(4)]
    for r, s in enumerate(shards):  # each rank: its query head, then the one KV head it uses
        h = r // 2
        assert torch.equal(s, torch.cat([q[r * d:(r + 1) * d], k[h * d:(h + 1) * d], v[h * d:(h + 1) * d]]))
    mq, mk, mv = T.merge_qkv(shards, num_heads=4, num_kv_heads=2, head_dim=d)
    assert torch.equal(mq, q) and torch.equal(mk, k) and torch.equal(mv, v)


# -- gate / up ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_roundtrip_and_layout(tp, bias):
    inter, hidden = 24, 6
    tail = () if bias else (hidden,)
    gate, up = _rand(inter, *tail, seed=7), _rand(inter, *tail, seed=8)
    shards = [T.shard_gate_up(gate, up, r, tp) for r in range(tp)]
    per = inter // tp
    for r, s in enumerate(shards):
        g, u = s.split([per, per], 0)
        assert torch.equal(g, gate[r * per:(r + 1) * per]) and torch.equal(u, up[r * per:(r + 1) * per])
    mg, mu = T.merge_gate_up(shards)
    assert torch.equal(mg, gate) and torch.equal(mu, up)
    assert all(torch.equal(a, b) for a, b in zip(T.merge_shards("gate_up", shards, None), (gate, up)))


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown kind 'bogus'"):
        T.make_shard("bogus", [_rand(2)], 0, 1, None, 0)
    with pytest.raises(ValueError, match="unknown kind 'bogus'"):
        T.merge_shards("bogus", [_rand(2)], None)


# -- safetensors slice reads == in-memory shards ----------------------------------------------------------------

def test_slice_source_matches_tensor_source(tmp_path):
    from parallm.checkpoint.hf_dir import SliceSource
    tensors = {"q": _rand(32, 8, seed=1), "k": _rand(8, 8, seed=2), "v": _rand(8, 8, seed=3),
               "emb": _rand(101, 8, seed=4), "o": _rand(8, 32, seed=5), "b": _rand(32, seed=6)}
    path = os.path.join(tmp_path, "m.safetensors")
    save_file(tensors, path)
    with safe_open(path, framework="pt") as h:
        src = {n: SliceSource(h, n) for n in tensors}
        assert src["emb"].shape == (101, 8)
        for tp in (1, 2, 4):
            for r in range(tp):
                a = T.shard_qkv(src["q"], src["k"], src["v"], r, tp, num_heads=8, num_kv_heads=2, head_dim=4)
                b = T.shard_qkv(tensors["q"], tensors["k"], tensors["v"], r, tp, num_heads=8, num_kv_heads=2,
                                head_dim=4)
                assert torch.equal(a, b)
                pv = padded_vocab_size(101, tp)
                assert torch.equal(T.shard_vocab(src["emb"], r, tp, pv), T.shard_vocab(tensors["emb"], r, tp, pv))
                assert torch.equal(T.shard_dim(src["o"], 1, r, tp), T.shard_dim(tensors["o"], 1, r, tp))
                assert torch.equal(T.shard_dim(src["b"], 0, r, tp), T.shard_dim(tensors["b"], 0, r, tp))
        assert torch.equal(src["emb"].full(), tensors["emb"])


# -- layer maps -----------------------------------------------------------------------------------------------

def test_layer_numbers_no_vpp():
    assert [list(layer_numbers(8, 1, 1, 0, 0))] == [list(range(8))]
    assert [list(layer_numbers(8, 2, 1, p, 0)) for p in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(layer_numbers(8, 4, 1, p, 0)) for p in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_layer_numbers_vpp_interleaving():
    # Megatron: offset = vpp_rank * (L / vpp) + pp_rank * (L / pp / vpp)
    own = {(p, v): list(layer_numbers(8, 2, 2, p, v)) for p in range(2) for v in range(2)}
    assert own == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    own = {(p, v): list(layer_numbers(8, 4, 2, p, v)) for p in range(4) for v in range(2)}
    assert own[(0, 0)] == [0] and own[(3, 0)] == [3] and own[(0, 1)] == [4] and own[(3, 1)] == [7]
    own = {(p, v): list(layer_numbers(12, 2, 3, p, v)) for p in range(2) for v in range(3)}
    assert own[(0, 0)] == [0, 1] and own[(1, 0)] == [2, 3] and own[(0, 1)] == [4, 5] and own[(1, 2)] == [10, 11]
    # every layer exactly once
    for L, pp, vpp in ((8, 2, 2), (8, 4, 2), (12, 2, 3), (16, 2, 4), (4, 4, 1)):
        got = sorted(i for p in range(pp) for v in range(vpp) for i in layer_numbers(L, pp, vpp, p, v))
        assert got == list(range(L))


def test_layer_numbers_uneven_error():
    with pytest.raises(ValueError, match=r"32 layers do not split into pp=3 x vpp=2 = 6 equal stages"):
        layer_numbers(32, 3, 2, 0, 0)
    with pytest.raises(ValueError, match=r"2 layers do not split into pp=4 x vpp=1"):
        layer_numbers(2, 4, 1, 0, 0)


# -- check_tp -------------------------------------------------------------------------------------------------

_SPEC_FIELDS = dict(num_attention_heads="num_heads", num_key_value_heads="num_kv_heads", head_dim="head_dim",
                    intermediate_size="intermediate_size")


def _spec(**overrides):
    """A DecoderSpec with the given HF-named sizes (set on the spec: transformers itself rejects some of them)."""
    spec, _ = spec_from_config(tiny_config("llama"))
    return dataclasses.replace(spec, **{_SPEC_FIELDS[k]: v for k, v in overrides.items()})


def test_check_tp_valid():
    for overrides, tps in [(dict(num_attention_heads=4, num_key_value_heads=2), (1, 2, 4)),
                           (dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8), (1, 2, 4, 8)),
                           (dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=128),
                            (1, 2, 4, 8))]:
        for tp in tps:
            check_tp(_spec(**overrides), tp)


@pytest.mark.parametrize("overrides,tp,needles", [
    (dict(num_attention_heads=4, num_key_value_heads=4), 8,
     ["num_attention_heads=4 is not divisible by tp=8"]),
    (dict(num_attention_heads=12, num_key_value_heads=6, intermediate_size=96), 4,
     ["num_key_value_heads=6 is not divisible by tp=4"]),
    (dict(num_attention_heads=12, num_key_value_heads=3, intermediate_size=96), 4,
     ["num_key_value_heads=3 < tp=4", "tp is not a multiple"]),
    (dict(intermediate_size=90), 4, ["intermediate_size=90 is not divisible by tp=4"]),
    (dict(num_attention_heads=4, num_key_value_heads=3, intermediate_size=91), 2,
     ["num_attention_heads=4 is not a multiple of num_key_value_heads=3",
      "num_key_value_heads=3 is not divisible by tp=2", "intermediate_size=91 is not divisible by tp=2"]),
])
def test_check_tp_errors_name_numbers(overrides, tp, needles):
    spec = _spec(**overrides)
    with pytest.raises(ValueError) as info:
        check_tp(spec, tp)
    msg = str(info.value)
    assert f"tp={tp}" in msg
    for n in needles:
        assert n in msg, msg


# -- shard_blocks: the layout of make_shard as data (used by the direct-write saver) ----------------------------

def _blocks_cases():
    from types import SimpleNamespace
    spec_mha = SimpleNamespace(num_heads=8, num_kv_heads=8, head_dim=4, vocab_size=101)
    spec_gqa = SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=4, vocab_size=101)
    spec_mqa = SimpleNamespace(num_heads=8, num_kv_heads=1, head_dim=4, vocab_size=101)
    g = torch.Generator().manual_seed(7)
    h = 6
    for tp in (1, 2, 4, 8):
        yield "copy", tp, spec_mha, [torch.randn(h, generator=g)], 0
        yield "vocab", tp, spec_mha, [torch.randn(101, h, generator=g)], -(-101 // tp) * tp
        yield "column", tp, spec_mha, [torch.randn(16, h, generator=g)], 0
        yield "row", tp, spec_mha, [torch.randn(h, 16, generator=g)], 0
        yield "gate_up", tp, spec_mha, [torch.randn(16, h, generator=g), torch.randn(16, h, generator=g)], 0
        for spec in (spec_mha, spec_gqa, spec_mqa):
            if spec.num_kv_heads >= tp and spec.num_kv_heads % tp or spec.num_kv_heads < tp and tp % spec.num_kv_heads:
                continue
            q = torch.randn(spec.num_heads * 4, h, generator=g)
            kv = [torch.randn(spec.num_kv_heads * 4, h, generator=g) for _ in range(2)]
            yield "qkv", tp, spec, [q, *kv], 0


@pytest.mark.parametrize("case", list(_blocks_cases()), ids=lambda c: f"{c[0]}-tp{c[1]}-nkv{c[2].num_kv_heads}")
def test_shard_blocks_describe_make_shard(case):
    """Rebuilding each shard from its blocks equals make_shard, and the primary blocks tile every HF tensor
    exactly once (so a direct writer writes each element exactly once)."""
    from parallm.model.sharding import make_shard, shard_blocks
    kind, tp, spec, sources, padded = case
    covered = [torch.zeros(s.shape, dtype=torch.int32) for s in sources]
    for rank in range(tp):
        shard = make_shard(kind, sources, rank, tp, spec, padded)
        rebuilt = torch.zeros_like(shard)
        for src, dim, a, b, la, lb, primary in shard_blocks(kind, rank, tp, spec, [s.shape for s in sources],
                                                            padded):
            rebuilt.narrow(dim, la, lb - la).copy_(sources[src].narrow(dim, a, b - a))
            if primary:
                covered[src].narrow(dim, a, b - a).add_(1)
        assert torch.equal(rebuilt, shard), (kind, tp, rank)
    for c in covered:
        assert torch.equal(c, torch.ones_like(c)), kind


@pytest.mark.parametrize("case", list(_blocks_cases()), ids=lambda c: f"{c[0]}-tp{c[1]}-nkv{c[2].num_kv_heads}")
def test_primary_slices_count_every_element_once(case):
    """Marking each rank's primary_slices in its shard and merging the marks covers every HF element exactly
    once (what grad-norm clipping relies on), and replica_rows are exactly the rows other ranks also hold."""
    from parallm.model.sharding import make_layout
    kind, tp, spec, sources, padded = case
    layout = make_layout(kind, spec, padded)
    marks = []
    for rank in range(tp):
        shard = layout.shard(sources, rank, tp)
        mark = torch.zeros(shard.shape, dtype=torch.int32)
        for dim, a, b in layout.primary_slices(rank, tp, tuple(shard.shape)):
            mark.narrow(dim, a, b - a).add_(1)
        marks.append(mark)
        rows = layout.replica_rows(rank, tp)
        if kind == "qkv" and spec.num_kv_heads < tp:
            nq = spec.num_heads // tp * spec.head_dim
            assert rows == (nq, shard.shape[0])
        else:
            assert rows is None
    assert sum(int(m.sum()) for m in marks) == sum(src.numel() for src in sources), (kind, tp)
    for merged, src in zip(layout.merge(marks), sources):
        assert torch.equal(merged, torch.ones_like(merged, dtype=torch.int32)), (kind, tp)
        assert merged.shape == src.shape


@pytest.mark.parametrize("layers,pp,vpp", [(8, 2, 2), (8, 4, 1), (12, 2, 3), (4, 1, 1), (16, 4, 2)])
def test_layer_owner_inverts_layer_numbers(layers, pp, vpp):
    from parallm.parallel.stages import layer_numbers, layer_owner
    for p in range(pp):
        for v in range(vpp):
            for i in layer_numbers(layers, pp, vpp, p, v):
                assert layer_owner(layers, pp, vpp, i) == (p, v)
