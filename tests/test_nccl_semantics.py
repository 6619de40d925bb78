"""The pipeline engine's exchanges under NCCL's point-to-point semantics, on CPU, in one process.

gloo buffers sends, so a pipeline exchange that would deadlock on NCCL passes every gloo test. Here the real
engine (``parallel/pipeline.py: run_pipeline``, the real schedules and exchange plan) runs its pipeline ranks as
threads over :class:`Fabric`, a transport that behaves as NCCL does:

* nothing is buffered: a send completes only together with its matching receive, once both are posted;
* a rank's operations run in issue order (one stream per rank): a batch starts once the rank's previous batch has
  completed, and the operations of one batch (``batch_isend_irecv``) progress together;
* operations on a link are matched by order (the k-th send from p to q with the k-th receive on q from p), and a
  matched pair whose shapes or dtypes differ is an error (NCCL would corrupt memory or hang).

When every rank waits and nothing can progress the fabric fails at once on every rank, naming each rank's
blocked operations. The stages are small linear maps (the engine does not care what a chunk computes), checked
against the same computation run sequentially.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

H = 8


class Deadlock(RuntimeError):
    pass


class _Work:
    def __init__(self, fabric, batch):
        self.fabric, self.batch = fabric, batch

    def wait(self):
        self.fabric.wait(self.batch)


class Fabric:
    """NCCL-like point-to-point between ``world`` threads (see the module docstring)."""

    def __init__(self, world: int, deadline_s: float = 60.0):
        self.world, self.deadline = world, time.monotonic() + deadline_s
        self.cv = threading.Condition()
        self.streams = {r: [] for r in range(world)}     # rank -> its batches not yet complete, in issue order
        self.issued = {}                                   # (src, dst, kind) -> operations issued so far
        self.waiting, self.finished = {}, set()           # rank -> the batch it waits for; ranks that ended
        self.failure = None
        self.batches = 0                                   # batches posted (all ranks)

    def endpoint(self, rank: int):
        fabric = self

        class Endpoint:
            ranks = list(range(fabric.world))

            def post(self, ops):
                return [fabric.post(rank, ops)]
        return Endpoint()

    def post(self, rank, ops) -> _Work:
        with self.cv:
            batch = {"rank": rank, "ops": [], "done": False}
            for is_send, tensor, peer in ops:
                src, dst = (rank, peer) if is_send else (peer, rank)
                key = (src, dst, "send" if is_send else "recv")
                seq = self.issued[key] = self.issued.get(key, -1) + 1
                batch["ops"].append({"send": is_send, "src": src, "dst": dst, "seq": seq, "tensor": tensor,
                                     "done": False})
            self.streams[rank].append(batch)
            self.batches += 1
            self._progress()
            return _Work(self, batch)

    def _progress(self):
        moved = True
        while moved:
            moved = False
            heads = {r: s[0] for r, s in self.streams.items() if s}
            for r, head in heads.items():
                for op in head["ops"]:
                    if op["done"]:
                        continue
                    peer = op["dst"] if op["send"] else op["src"]
                    other = heads.get(peer)
                    match = None if other is None else next(
                        (o for o in other["ops"] if not o["done"] and o["send"] != op["send"] and o["src"] == op["src"]
                         and o["dst"] == op["dst"] and o["seq"] == op["seq"]), None)
                    if match is None:
                        continue
                    send, recv = (op, match) if op["send"] else (match, op)
                    if send["tensor"].shape != recv["tensor"].shape or send["tensor"].dtype != recv["tensor"].dtype:
                        self._fail(f"mismatched pair on link {send['src']}->{send['dst']} #{send['seq']}: send "
                                   f"{tuple(send['tensor'].shape)} {send['tensor'].dtype}, receive "
                                   f"{tuple(recv['tensor'].shape)} {recv['tensor'].dtype}")
                        return
                    recv["tensor"].copy_(send["tensor"])
                    op["done"] = match["done"] = True
                    moved = True
            for r, stream in self.streams.items():
                if stream and all(op["done"] for op in stream[0]["ops"]):
                    stream.pop(0)["done"] = True
                    moved = True
        self.cv.notify_all()

    def _fail(self, message):
        if self.failure is None:
            self.failure = message
        self.cv.notify_all()

    def _describe(self):
        lines = []
        for r, stream in sorted(self.streams.items()):
            if not stream:
                continue
            ops = [f"{'send to' if o['send'] else 'recv from'} {o['dst'] if o['send'] else o['src']} "
                   f"#{o['seq']} {tuple(o['tensor'].shape)}" for o in stream[0]["ops"] if not o["done"]]
            lines.append(f"rank {r} blocked on [{', '.join(ops)}] ({len(stream) - 1} more batch(es) queued)")
        return "; ".join(lines)

    def wait(self, batch):
        with self.cv:
            rank = batch["rank"]
            self.waiting[rank] = batch
            try:
                while not batch["done"]:
                    if self.failure is not None:
                        raise Deadlock(self.failure)
                    if all(r in self.finished or (r in self.waiting and not self.waiting[r]["done"])
                           for r in range(self.world)):
                        self._fail(f"deadlock: {self._describe()}")
                        continue
                    if time.monotonic() > self.deadline:
                        self._fail(f"deadline passed: {self._describe()}")
                        continue
                    self.cv.wait(timeout=0.5)
            finally:
                self.waiting.pop(rank, None)

    def finish(self, rank):
        with self.cv:
            self.finished.add(rank)
            self.cv.notify_all()


class Unbatched:
    """Each operation posted on its own, sends first and never waited for, then each receive, waited for at once:
    the shape of an exchange by lone ``isend`` after a step and blocking ``recv`` before the next."""

    def __init__(self, endpoint):
        self.inner, self.ranks = endpoint, endpoint.ranks

    def post(self, ops):
        works = []
        for op in sorted(ops, key=lambda op: not op[0]):
            work = self.inner.post([op])[0]
            if not op[0]:
                work.wait()
            works.append(work)
        return works


# -- a pipeline of small stages ---------------------------------------------------------------------------------

class Stage(nn.Module):
    """Global stage ``k``: ``tanh(x @ W_k)`` (stage 0 embeds ids first; the last stage returns its output)."""

    def __init__(self, k: int, stages: int, dims, vocab: int = 11):
        super().__init__()
        g = torch.Generator().manual_seed(k)
        self.weight = nn.Parameter(torch.randn(H, H, generator=g) / H ** 0.5)
        self.pre_process, self.post_process = k == 0, k == stages - 1
        if self.pre_process:
            self.embedding = nn.Parameter(torch.randn(vocab, H, generator=torch.Generator().manual_seed(99)))
        self.dims = dims
        self.config = type("Config", (), {"params_dtype": torch.float32})()
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t

    def boundary_shapes(self, batches):
        return [(ids.shape[1], ids.shape[0], H) for ids, _ in batches]

    def compute(self, ids, pos, mask, **_):
        x = self.embedding[ids].transpose(0, 1) if self.pre_process else self.input_tensor
        return torch.tanh(x @ self.weight)


def _microbatches(m: int):
    """Microbatches of different lengths (as packed streams have)."""
    g = torch.Generator().manual_seed(m)
    out = []
    for i in range(m):
        s = 3 + (i % 3)
        ids = torch.randint(0, 11, (2, s), generator=g)
        out.append((ids, None, torch.ones_like(ids)))
    return out


def _loss(chunk, out, m):
    return out.pow(2).mean()


def _reference(stages, mbs, backward):
    outs = []
    for ids, _, _ in mbs:
        x = None
        for st in stages:
            st.set_input_tensor(x)
            x = st.compute(ids, None, None)
        outs.append(_loss(None, x, 0) if backward else x)
    if backward:
        (torch.stack(outs).sum() / len(mbs)).backward()
    return [o.detach() for o in outs]


def run_threads(pp: int, vpp: int, m: int, *, backward: bool, unbatched: bool = False):
    """Run the engine on ``pp`` threads over a :class:`Fabric`; returns (per-rank outcome, fabric, reference,
    stages)."""
    from parallm.parallel import pipeline
    from parallm.parallel.state import ParallelDims, layout_generation
    stages_n = pp * vpp
    fabric = Fabric(pp)
    ranks = {}
    for r in range(pp):
        dims = ParallelDims(tp=1, tp_rank=0, pp=pp, pp_rank=r, vpp=vpp, dp=1, dp_rank=0, rank=r, world=pp,
                            generation=layout_generation(), tp_group=None, pp_group=None, dp_group=None)
        ranks[r] = [Stage(v * pp + r, stages_n, dims) for v in range(vpp)]
    mbs = _microbatches(m)
    m_count = len(mbs)
    outcome = {}

    def body(r):
        try:
            transport = fabric.endpoint(r)
            transport = Unbatched(transport) if unbatched else transport
            keep = (lambda chunk, out, m: _loss(chunk, out, m) / m_count) if backward else (lambda chunk, out, m: out)
            outcome[r] = ("ok", pipeline.run_pipeline(ranks[r], mbs, last_stage_fn=keep, backward=backward,
                                                      transport=transport))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome[r] = ("error", e)
        finally:
            fabric.finish(r)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a pipeline thread is still running: the fabric did not end it"
    reference = [Stage(k, stages_n, ranks[k % pp][0].dims) for k in range(stages_n)]
    ref = _reference(reference, mbs, backward)
    return outcome, fabric, ref, ranks, reference


LAYOUTS = [(pp, vpp, m) for pp in (2, 4) for vpp in (1, 2) for m in sorted({1, pp - 1, pp, pp + 1, 2 * pp + 1})]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backward", [True, False], ids=["train", "forward"])
def test_pipeline_completes_under_nccl_semantics(backward):
    """Every layout completes without buffering, with results equal to the sequential computation."""
    failures = []
    for pp, vpp, m in LAYOUTS:
        outcome, fabric, ref, ranks, reference = run_threads(pp, vpp, m, backward=backward)
        errors = {r: o[1] for r, o in outcome.items() if o[0] == "error"}
        if errors:
            failures.append(f"pp={pp} vpp={vpp} m={m}: {errors}")
            continue
        last = outcome[pp - 1][1]
        assert len(last) == m and all(not outcome[r][1] for r in range(pp - 1))
        for got, want in zip(last, ref):
            torch.testing.assert_close(got * (m if backward else 1), want, rtol=0, atol=1e-6)
        if backward:
            for r in range(pp):
                for v, st in enumerate(ranks[r]):
                    want = reference[v * pp + r]
                    torch.testing.assert_close(st.weight.grad, want.weight.grad, rtol=1e-5, atol=1e-7)
        assert fabric.batches > 0
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_fabric_fails_fast_on_an_unbatched_exchange():
    """The same plan with every operation posted alone (lone sends, blocking receives, the exchange this engine
    replaced) deadlocks in the 1F1B steady state under these semantics: the fabric says so at once, on every
    rank, naming the blocked operations; nothing hangs."""
    start = time.monotonic()
    outcome, _, _, _, _ = run_threads(2, 1, 4, backward=True, unbatched=True)
    elapsed = time.monotonic() - start
    assert all(o[0] == "error" for o in outcome.values()), outcome
    messages = [str(o[1]) for o in outcome.values()]
    assert any("deadlock" in msg for msg in messages), messages
    assert any("rank 0 blocked on [send to 1" in msg and "rank 1 blocked on [send to 0" in msg for msg in messages), \
        messages
    assert elapsed < 30, elapsed


@pytest.mark.timeout(60)
def test_fabric_reports_a_mismatched_pair():
    """Two ranks that post differently shaped tensors for the same message: an error, not a silent copy."""
    fabric = Fabric(2)
    errors = []

    def body(r):
        try:
            t = torch.zeros(3) if r == 0 else torch.zeros(4)
            for w in fabric.endpoint(r).post([(r == 0, t, 1 - r)]):
                w.wait()
        except Deadlock as e:
            errors.append(str(e))
        finally:
            fabric.finish(r)
    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 2 and all("mismatched pair" in e for e in errors), errors
