"""The ranks of one model replica (its tensor-, context- and pipeline-parallel ranks) must pass the same batch:
data sharded by global rank instead of by data-parallel rank is a ValueError on every rank naming the ranks
and what differs, at tp2, pp2, tp2 x pp2 and cp2, for forward and forward_backward, positional and batch-mapping
forms, the mapping's other entries and the call's arguments included; data sharded by ``dims.dp_rank`` runs.
After each error the ranks are still in step."""

import time

import pytest
import torch

import helpers

WORLD = 4
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "tp2pp2": dict(tp=2, pp=2), "cp2": dict(cp=2)}
BOUND_S = 20.0
HINT = "shard data by chunks[0].dims.dp_rank (of chunks[0].dims.dp), not by global rank"


def _nll(out, ids, mask):
    lp = out[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return (lp * m).sum() * -1, m.sum()


def _batch(vocab, seed):
    ids, mask = helpers.padded_batch(vocab, batch=4, seq=10, seed=seed)
    adv = torch.randn(4, generator=torch.Generator().manual_seed(seed))
    return ids, mask, adv


def _rank(rank, world, ckpt, vocab):
    import parallm
    out = {}

    def attempt(key, fn):
        t = time.monotonic()
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001 - reported back
            out[key] = (type(e).__name__, str(e), time.monotonic() - t)

    def mapping_loss(o, mb):
        total, n = _nll(o, mb["input_ids"], mb["attention_mask"])
        return total * mb["advantages"].mean(), n

    for name, kw in LAYOUTS.items():
        parallm.init_parallel(**kw)
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        dims = chunks[0].dims
        mine = _batch(vocab, seed=100 + dims.dp_rank)              # right: one batch per replica
        wrong = _batch(vocab, seed=200 + rank)                     # wrong: one per global rank
        ids, mask, adv = mine
        # sharded by dp rank: runs (forward, then a token-mean step in the mapping form)
        attempt(f"{name}/by-dp-rank/forward", lambda: parallm.forward(chunks, ids, mask))
        attempt(f"{name}/by-dp-rank/forward_backward", lambda: parallm.forward_backward(
            chunks, {"input_ids": ids, "attention_mask": mask, "advantages": adv}, loss_fn=mapping_loss,
            num_microbatches=2))
        # sharded by global rank: refused everywhere
        attempt(f"{name}/by-rank/forward", lambda: parallm.forward(chunks, wrong[0], wrong[1]))
        attempt(f"{name}/by-rank/forward_backward", lambda: parallm.forward_backward(
            chunks, wrong[0], wrong[1], loss_fn=_nll))
        # the last rank alone differs: in its mask (positional), in an extra entry (mapping), in the arguments
        last = rank == world - 1
        attempt(f"{name}/mask/forward_backward", lambda: parallm.forward_backward(
            chunks, ids, mask if not last else mask.flip(1), loss_fn=_nll))
        attempt(f"{name}/extra/forward_backward", lambda: parallm.forward_backward(
            chunks, {"input_ids": ids, "attention_mask": mask, "advantages": adv + float(last)},
            loss_fn=mapping_loss))
        attempt(f"{name}/microbatches/forward_backward", lambda: parallm.forward_backward(
            chunks, ids, mask, loss_fn=_nll, num_microbatches=2 if last else 1))
        attempt(f"{name}/output/forward", lambda: parallm.forward(chunks, ids, mask,
                                                                  output="logprobs" if last else None))
        attempt(f"{name}/temperature/forward", lambda: parallm.forward(chunks, ids, mask, output="logprobs",
                                                                       temperature=1.5 if last else 1.0))
        out[f"{name}/replica"] = (dims.dp_rank, rank)
        with torch.no_grad():           # in step afterwards
            out[f"{name}/after"] = parallm.forward(chunks, ids, mask, output="logprobs")
        parallm.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replica")
    cfg = helpers.tiny_config("llama")
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=4), str(tmp / "llama"))
    t = time.monotonic()
    res = helpers.run_ranks(_rank, WORLD, ckpt, cfg.vocab_size, timeout=400)
    print(f"\nspawn: {time.monotonic() - t:.1f}s")
    return res


def _replicas(res, name):
    """{dp rank: [global ranks]} as each rank reported it."""
    out = {}
    for r in res:
        dp_rank, rank = r[f"{name}/replica"]
        out.setdefault(dp_rank, []).append(rank)
    return out


CASES = {   # key -> (what differs, needles)
    "by-rank/forward": ["input_ids"],
    "by-rank/forward_backward": ["input_ids"],
    "mask/forward_backward": ["attention_mask", "position_ids"],
    "extra/forward_backward": ["other batch entries"],
    "microbatches/forward_backward": ["num_microbatches"],
    "output/forward": ["output"],
    "temperature/forward": ["temperature"],
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_replica_one_batch(results, layout):
    replicas = _replicas(results, layout)
    assert sorted(len(v) for v in replicas.values()) == [4 // len(replicas)] * len(replicas), replicas
    for rank, res in enumerate(results):
        for key in ("by-dp-rank/forward", "by-dp-rank/forward_backward"):
            assert res[f"{layout}/{key}"] is None, (rank, key, res[f"{layout}/{key}"])
    first = replicas[0]
    last = next(v for v in replicas.values() if WORLD - 1 in v)
    for key, needles in CASES.items():
        # sharded by global rank, the first replica's second rank is the first to differ; else the last rank
        culprit, leader = (first[1], first[0]) if key.startswith("by-rank") else (WORLD - 1, last[0])
        want = needles + [f"rank {culprit}'s differs from rank {leader}'s", HINT, "tensor-parallel",
                          "context-parallel", "pipeline-parallel"]
        for rank, res in enumerate(results):
            got = res[f"{layout}/{key}"]
            assert got is not None, f"{layout}/{key}: rank {rank} did not raise"
            name, msg, elapsed = got
            assert name == "ValueError", (layout, key, rank, msg)
            missing = [n for n in want if n not in msg]
            assert not missing, (layout, key, rank, missing, msg)
            assert elapsed < BOUND_S, (layout, key, rank, elapsed)
    # in step afterwards: every rank of a replica has the same log-probs, replicas differ
    for ranks in replicas.values():
        for r in ranks[1:]:
            assert torch.equal(results[r][f"{layout}/after"], results[ranks[0]][f"{layout}/after"])
    print(results[0][f"{layout}/extra/forward_backward"][1])


def test_fingerprint_pure(monkeypatch):
    """No process group: every single-element change of any dtype changes the fingerprint (and its fold), the
    checksum does not depend on the slicing that bounds its memory, and a batch entry's name, dtype and shape
    count."""
    from parallm.parallel import batch_check as bc
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 1000, (3, 7), generator=g), torch.randn(3, 7, generator=g),
               torch.randn(3, 7, generator=g).bfloat16(), torch.rand(3, 7, generator=g) > 0.5,
               torch.randn(3, 7, generator=g).double()]
    for t in tensors:
        base = bc.weighted_sum(t)
        for i in range(t.numel()):
            u = t.clone().reshape(-1)
            u[i] = ~u[i] if u.dtype == torch.bool else u[i] + 1
            assert bc.weighted_sum(u.reshape(t.shape)) != base, (t.dtype, i)
        monkeypatch.setattr(bc, "CHUNK", 4)
        assert bc.weighted_sum(t) == base, t.dtype
        monkeypatch.setattr(bc, "CHUNK", 1 << 22)
    ids, mask = helpers.padded_batch(101)
    pos = mask.cumsum(-1)
    extras = {"adv": torch.ones(4), "old": torch.zeros(4, 10)}
    fp = bc.batch_fingerprint(ids, pos, mask, extras=extras, settings=(2, 0))
    variants = [{"adv2": torch.ones(4), "old": extras["old"]},                 # another name
                {"adv": torch.ones(4, dtype=torch.float64), "old": extras["old"]},   # another dtype
                {"adv": torch.ones(4, 1), "old": extras["old"]}, None]             # another shape; none
    for other in variants:
        assert bc.fold(bc.batch_fingerprint(ids, pos, mask, extras=other, settings=(2, 0))) != bc.fold(fp), other
    assert bc.fold(bc.batch_fingerprint(ids, pos, mask, extras=extras, settings=(3, 0))) != bc.fold(fp)
    assert bc.fold(fp) == bc.fold(bc.batch_fingerprint(ids, pos, mask, extras=dict(extras), settings=(2, 0)))
    assert 0 <= bc.fold(fp) < (1 << 61) - 1
