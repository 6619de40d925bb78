"""Tinker's stability protocol (SDK 0.38) without its loss: what ``record_stability_info`` sampling records, and
the provenance spans of training datums checked against it.

- **Sampling.** A request with ``record_stability_info=True`` (a ``SamplingClient`` created with it) gets one
  server-assigned ``sequence_id`` per sample (``seq-`` and 144 random bits: unique, unguessable), returned in the
  ``asample`` acknowledgement's ``sample_sequence_ids``: where SDK 0.38 reads them (its ``_attach_sequence_ids``
  stamps them onto the ``SampledSequence``\\ s; the final ``SampleResponse`` carries none). The store records, per
  id, the sampling session's Tinker session, the request's prompt tokens (shared by its samples) and, once the
  sample is done, the sampled tokens (the stop token that ended it included, as returned).
- **Expiry.** A record lives ``ttl`` seconds (``--stability-ttl``, default one day) after its last use: recording
  it, or a training request naming it that is accepted. The janitor prunes expired records
  (:meth:`StabilityStore.prune`); a lookup refuses an expired one even before that. What was pruned, and why
  (expired, its session ended, its sampling failed), is remembered for another ``ttl`` so that a late request is
  told which (:data:`TOMBSTONES` at most).
- **Training.** A datum may carry ``model_input_spans`` and ``loss_fn_input_spans`` (``Datum.with_provenance``),
  each a list of runs (``PromptProvenanceSpan`` / ``SampledProvenanceSpan``: sequence_id, offset, length) tiling
  the input tokens and ``target_tokens``. :func:`check_provenance` accepts a request only if every run names a
  live id of the training client's own session, lies inside the recorded prompt or sample, and the datum's tokens
  there equal the recorded ones; anything else is a 400 naming the datum, the run and the numbers. Accepted
  requests renew the expiry of every id they name.

Memory: the records hold int32 tokens, at most ``max_tokens`` (``--stability-max-tokens``) in all; a recording
sample request past it is refused with the numbers. The loss itself (``stable_reinforce``) stays refused
(:data:`.losses.REFUSED`): its objective is unpublished.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import threading
import time

import numpy as np

from .protocol import ApiError

__all__ = ["DAY_S", "StabilityStore", "check_provenance", "new_sequence_id"]

DAY_S = 86400.0
TOMBSTONES = 1 << 20            # pruned ids remembered (for the reason a late request is refused)
PREFIX = "seq-"


def new_sequence_id() -> str:
    return PREFIX + secrets.token_urlsafe(18)


@dataclasses.dataclass
class _Record:
    session: str
    prompt: np.ndarray              # int32, shared by the samples of one request
    sampled: np.ndarray | None      # int32; None while the sample runs
    used: float                     # monotonic seconds of the last use
    refs: list                      # [live records sharing ``prompt``], one list per request


class StabilityStore:
    """The recorded sequences of every session (thread-safe)."""

    def __init__(self, *, ttl: float = DAY_S, max_tokens: int = 1 << 28, clock=time.monotonic):
        self.ttl, self.max_tokens, self.clock = float(ttl), int(max_tokens), clock
        self._lock = threading.Lock()
        self._live: dict[str, _Record] = {}
        self._gone: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._tokens = 0

    # -- sampling side ------------------------------------------------------------------------------------------
    def assign(self, session: str, prompt, count: int) -> list[str]:
        """``count`` new ids of one sampling request of ``session``, recording its prompt."""
        prompt = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            if self._tokens + len(prompt) > self.max_tokens:
                raise ApiError(400, f"asample with record_stability_info: the server holds {self._tokens} recorded "
                                    f"tokens; this prompt's {len(prompt)} would pass --stability-max-tokens "
                                    f"{self.max_tokens} (records live {self.ttl:.0f} s after their last use: start "
                                    "the server with a larger --stability-max-tokens or a shorter --stability-ttl)")
            now = self.clock()
            ids = [new_sequence_id() for _ in range(count)]
            refs = [count]
            for i in ids:
                self._live[i] = _Record(session, prompt, None, now, refs)
            self._tokens += len(prompt)
        return ids

    def sampled(self, ids, sequences) -> None:
        """The sampled tokens of ``ids`` (one token list per id, in order)."""
        if not ids:
            return
        with self._lock:
            now = self.clock()
            for i, tokens in zip(ids, sequences, strict=True):
                rec = self._live.get(i)
                if rec is not None and rec.sampled is None:
                    rec.sampled = np.asarray(tokens, dtype=np.int32)
                    rec.used = now
                    self._tokens += len(rec.sampled)

    def settle(self, ids) -> None:
        """After a sample request ended: ids still without sampled tokens failed (they are dropped)."""
        if not ids:
            return
        with self._lock:
            for i in ids:
                rec = self._live.get(i)
                if rec is not None and rec.sampled is None:
                    self._drop(i, "its sampling request failed")

    # -- lifetime ---------------------------------------------------------------------------------------------
    def _drop(self, sid: str, reason: str) -> None:
        rec = self._live.pop(sid)
        self._tokens -= (len(rec.sampled) if rec.sampled is not None else 0)
        rec.refs[0] -= 1
        if rec.refs[0] == 0:
            self._tokens -= len(rec.prompt)
        self._gone[sid] = (reason, self.clock())
        while len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)

    def prune(self) -> int:
        """Drop every record unused for ``ttl`` seconds and forget old tombstones (the janitor calls this);
        the number dropped."""
        with self._lock:
            now = self.clock()
            dead = [i for i, r in self._live.items() if now - r.used > self.ttl]
            for i in dead:
                self._drop(i, self._expired(now - self._live[i].used))
            while self._gone and now - next(iter(self._gone.values()))[1] > self.ttl:
                self._gone.popitem(last=False)
        return len(dead)

    def end_session(self, session: str) -> None:
        with self._lock:
            for i in [i for i, r in self._live.items() if r.session == session]:
                self._drop(i, f"its session {session} ended")

    def _expired(self, idle: float) -> str:
        return f"expired: unused for {idle:.1f} s (records live {self.ttl:g} s after their last use, --stability-ttl)"

    def stats(self) -> dict:
        with self._lock:
            return {"sequences": len(self._live), "tokens": self._tokens}

    # -- training side ------------------------------------------------------------------------------------------
    def lookup(self, sid: str, session: str) -> _Record:
        """The live record of ``sid`` for a training client of ``session``; ValueError naming why not."""
        now = self.clock()
        rec = self._live.get(sid)
        if rec is not None and now - rec.used > self.ttl:
            self._drop(sid, self._expired(now - rec.used))
            rec = None
        if rec is None:
            if sid in self._gone:
                raise ValueError(f"sequence_id {sid!r} is no longer recorded: {self._gone[sid][0]}")
            if not sid.startswith(PREFIX):
                raise ValueError(f"sequence_id {sid!r} was not recorded: only samples made with "
                                 "record_stability_info=True are (their ids start with 'seq-'); create the sampling "
                                 "client with record_stability_info=True")
            raise ValueError(f"sequence_id {sid!r} is unknown to this server (never recorded, or recorded before "
                             "it restarted)")
        if rec.session != session:
            raise ValueError(f"sequence_id {sid!r} was recorded in another session; provenance is session-scoped "
                             f"(this training client's session is {session})")
        return rec

    def check(self, session: str, data) -> None:
        """Every datum's spans (:func:`check_provenance`); on success their ids' expiry renewed."""
        with self._lock:
            named = check_provenance(self.lookup, session, data)
            now = self.clock()
            for sid in named:
                self._live[sid].used = now


def _runs(spans, field: str, tokens: np.ndarray, lookup, named: set) -> None:
    covered = sum(s.length for s in spans)
    if covered != len(tokens):
        raise ValueError(f"{field} cover {covered} positions but the field has {len(tokens)}; the runs must tile "
                         "it exactly (Datum.with_provenance)")
    pos = 0
    for j, s in enumerate(spans):
        if not s.sequence_id.startswith(PREFIX):
            # a sample made without record_stability_info (its id, req-N.k, names no record): the ordinary RL loop
            # (tinker-cookbook's trajectory_to_data) attaches such spans; they carry no stability information and
            # the loss reads none, so they are accepted as they are, unchecked
            pos += s.length
            continue
        what = f"{field}[{j}] ({s.kind} span of {s.sequence_id!r}, offset {s.offset}, length {s.length})"
        try:
            rec = lookup(s.sequence_id)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if s.kind == "sampled" and rec.sampled is None:
            raise ValueError(f"{what}: that sequence is still being sampled")
        source = rec.prompt if s.kind == "prompt" else rec.sampled
        if s.offset + s.length > len(source):
            raise ValueError(f"{what}: positions [{s.offset}, {s.offset + s.length}) lie outside the recorded "
                             f"{'prompt' if s.kind == 'prompt' else 'sampled tokens'} ({len(source)} tokens)")
        got, want = tokens[pos:pos + s.length], source[s.offset:s.offset + s.length]
        diff = np.flatnonzero(got != want)
        if diff.size:
            k = int(diff[0])
            raise ValueError(f"{what}: the datum's token {int(got[k])} at position {pos + k} is not the recorded "
                             f"token {int(want[k])} ({s.kind} position {s.offset + k})")
        named.add(s.sequence_id)
        pos += s.length


def check_provenance(lookup, session: str, data) -> set:
    """The ids the datums' spans name, all valid for ``session``; ``ApiError(400)`` naming the first problem.
    ``lookup(sid, session)`` as :meth:`StabilityStore.lookup`."""
    named: set = set()
    for i, d in enumerate(data):
        if d.spans is None:
            continue
        model_spans, loss_spans = d.spans
        try:
            if not model_spans or not loss_spans:
                raise ValueError("provenance comes as a pair: both model_input_spans and loss_fn_input_spans, or "
                                 "neither (Datum.with_provenance)")
            targets = np.asarray(d.inputs.get("target_tokens", np.zeros(0, np.int64)))
            if targets.ndim != 1:
                raise ValueError(f"target_tokens of shape {list(targets.shape)}: provenance names tokens, so it "
                                 "needs 1-D target_tokens")
            _runs(model_spans, "model_input_spans", d.tokens, lambda sid: lookup(sid, session), named)
            _runs(loss_spans, "loss_fn_input_spans", targets, lambda sid: lookup(sid, session), named)
        except ValueError as e:
            raise ApiError(400, f"forward_backward: datum {i}: {e}") from None
    return named
