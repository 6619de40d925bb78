"""Tinker's stability protocol without its loss (issue 58, item 6), the tinker SDK 0.38 as the client: sampling
clients made with ``record_stability_info=True`` get server-assigned ``sequence_id``s; tinker-cookbook's own
``trajectory_to_data`` turns a two-turn rollout into a datum whose provenance spans name them, and
``forward_backward`` accepts it (its loss equal to the same datum without spans); a wrong offset, a wrong token,
another session's id, an unknown `seq-` id, a miscounted tiling are refused (400) and the client goes on (spans
naming a plain sample's unrecorded `req-` id are accepted unchecked: the cookbook's RL loop sends them);
an id expires (``--stability-ttl``) unless used, and use renews it; ``stable_reinforce`` stays refused, naming
what is in place. Then the store itself on a fake clock (expiry, renewal, pruning, reasons, token accounting).
One tp1 server (parallm sampler) for the module. Runs in .venv-tinker (scripts/test.sh's TINKER_TESTS)."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if os.environ.get("PARALLM_REQUIRE_TINKER") != "1" else __import__("tinker")
from tinker import types  # noqa: E402

import tinker_helpers as th  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RANK = 4
TTL = 10.0
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("stability"))
    model = th.tiny_model(os.path.join(work, "model"), seed=11)
    srv = th.Server(model, work, tp=1, sampler="parallm", lora_rank=RANK, extra=("--stability-ttl", str(TTL)))
    try:
        srv.model = model
        srv.client = tinker.ServiceClient(base_url=srv.url, api_key="tml-stability")
        yield srv
    finally:
        srv.stop()


def _client(srv, client=None, seed=1):
    return (client or srv.client).create_lora_training_client(base_model=srv.model, rank=RANK, seed=seed).result()


def _rollout(sc, prompt):
    """A two-turn rollout (tinker-cookbook's Trajectory): turn 2's prompt extends turn 1's prompt and sample."""
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.rl.types import Trajectory, Transition
    turns, ob = [], list(prompt)
    for extra in ([], [40, 41, 42]):
        ob = ob + extra
        s = sc.sample(types.ModelInput.from_ints(ob), 1, PARAMS).result().sequences[0]
        ac = TokensWithLogprobs(tokens=s.tokens, maybe_logprobs=s.logprobs, sequence_id=s.sequence_id)
        turns.append(Transition(ob=types.ModelInput.from_ints(ob), ac=ac, reward=0.0, episode_done=bool(extra)))
        ob = ob + s.tokens
    return Trajectory(transitions=turns, final_ob=types.ModelInput.empty())


def _datum(traj):
    """tinker-cookbook's datum of ``traj``, its ``mask`` dropped as its train loop does (provenance kept)."""
    from tinker_cookbook.rl.data_processing import trajectory_to_data
    (d,) = trajectory_to_data(traj, 1.0)
    assert d.model_input_spans is not None
    inputs = {k: v for k, v in d.loss_fn_inputs.items() if k != "mask"}
    return dataclasses.replace(d, loss_fn_inputs=inputs)


def _bare(d):
    return types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs)


def _respan(d, model_spans=None, loss_spans=None, tokens=None):
    """``d`` with other spans or input tokens, built without ``with_provenance`` (whose tiling check would stop a
    miscounted list on the client)."""
    mi = d.model_input if tokens is None else types.ModelInput.from_ints(tokens)
    return types.Datum(model_input=mi, loss_fn_inputs=d.loss_fn_inputs,
                       model_input_spans=model_spans or d.model_input_spans,
                       loss_fn_input_spans=loss_spans or d.loss_fn_input_spans)


def _refused(tc, d, match):
    with pytest.raises(tinker.BadRequestError, match=match):
        tc.forward_backward([d], "importance_sampling").result()


@pytest.fixture(scope="module")
def recorded(server):
    tc = _client(server)
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    traj = _rollout(sc, [10, 11, 12, 13, 14])
    return tc, sc, traj, _datum(traj)


def test_ids_round_trip_into_forward_backward(server, recorded):
    tc, sc, traj, d = recorded
    ids = [t.ac.sequence_id for t in traj.transitions]
    many = sc.sample(types.ModelInput.from_ints([20, 21]), 3, PARAMS).result()
    ids += [s.sequence_id for s in many.sequences]
    assert len(set(ids)) == 5 and all(i.startswith("seq-") and len(i) >= 28 for i in ids)
    kinds = [(type(s).__name__, s.sequence_id == ids[0]) for s in d.model_input_spans]
    assert kinds == [("PromptProvenanceSpan", True), ("SampledProvenanceSpan", True),
                     ("PromptProvenanceSpan", False), ("SampledProvenanceSpan", False)]
    with_spans = tc.forward([d], "importance_sampling").result()
    without = tc.forward([_bare(d)], "importance_sampling").result()
    assert with_spans.metrics["loss:sum"] == without.metrics["loss:sum"]
    out = tc.forward_backward([d], "importance_sampling").result()
    assert out.metrics["loss:sum"] == with_spans.metrics["loss:sum"]
    plain = tc.create_sampling_client(tc.save_weights_for_sampler("plain").result().path).result()
    unrecorded = plain.sample(types.ModelInput.from_ints([20, 21]), 1, PARAMS).result().sequences[0].sequence_id
    assert not unrecorded.startswith("seq-")       # not recorded: the SDK still gets an id, which names nothing
    # spans naming such ids (what tinker-cookbook's RL loop sends from ordinary sampling clients) are accepted
    # unchecked: they carry no stability information, and the loss is the datum's without spans
    plain_spans = [dataclasses.replace(s, sequence_id=unrecorded) for s in d.model_input_spans]
    plain_loss = [dataclasses.replace(s, sequence_id=unrecorded) for s in d.loss_fn_input_spans]
    accepted = tc.forward([_respan(d, model_spans=plain_spans, loss_spans=plain_loss)], "importance_sampling").result()
    assert accepted.metrics["loss:sum"] == without.metrics["loss:sum"]


def test_wrong_spans_are_refused(server, recorded):
    tc, sc, traj, d = recorded
    spans, tokens = list(d.model_input_spans), d.model_input.to_ints()
    first = spans[0]
    # a wrong offset: the prompt run shifted by one (still inside the prompt, so its tokens differ)
    shifted = [dataclasses.replace(first, offset=1, length=first.length - 1),
               dataclasses.replace(spans[1], length=spans[1].length + 1)] + spans[2:]
    _refused(tc, _respan(d, model_spans=shifted), r"model_input_spans\[0\].*is not the recorded token")
    # past the end of the recorded prompt
    past = [dataclasses.replace(first, offset=3)] + spans[1:]
    _refused(tc, _respan(d, model_spans=past), r"positions \[3, 8\) lie outside the recorded prompt \(5 tokens\)")
    # a wrong token inside a sampled run
    k = first.length + 1
    changed = tokens[:k] + [(tokens[k] + 1) % 100] + tokens[k + 1:]
    _refused(tc, _respan(d, tokens=changed), rf"token {changed[k]} at position {k} is not the recorded token "
                                             rf"{tokens[k]} \(sampled position 1\)")
    # a miscounted tiling (built past the SDK's own check)
    _refused(tc, _respan(d, loss_spans=list(d.loss_fn_input_spans)[:-1]), "runs must tile it exactly")
    # an id that was never assigned
    fake = [dataclasses.replace(first, sequence_id="seq-" + "A" * 24)] + spans[1:]
    _refused(tc, _respan(d, model_spans=fake), "unknown to this server")
    # another session's training client naming these ids
    other = tinker.ServiceClient(base_url=server.url, api_key="tml-stability")
    _refused(_client(server, other, seed=2), d, "recorded in another session; provenance is session-scoped")
    # every refusal consumed its seq id: the client goes on at once
    assert tc.forward_backward([d], "importance_sampling").result().metrics["loss:sum"] != 0


def test_stable_reinforce_stays_refused(server, recorded):
    tc, sc, traj, d = recorded
    with pytest.raises(tinker.RequestFailedError, match="objective is unpublished.*In place: sampling with "
                                                        "record_stability_info=True"):
        tc.forward_backward([d], "stable_reinforce", {"kl_coeff": 0.01}).result()


def test_expiry_renewed_by_use(server):
    tc = _client(server, seed=3)
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    used = _datum(_rollout(sc, [30, 31, 32]))
    idle = _datum(_rollout(sc, [33, 34, 35]))
    sampled = time.monotonic()
    time.sleep(TTL * 0.5)
    renewing = time.monotonic()                                         # the server renews after this
    tc.forward([used], "importance_sampling").result()                 # renews `used` only
    time.sleep(max(0.0, sampled + TTL + 1 - time.monotonic()))
    assert time.monotonic() - sampled > TTL and time.monotonic() - renewing < TTL - 0.5
    tc.forward([used], "importance_sampling").result()                 # alive: its use renewed it
    with pytest.raises(tinker.BadRequestError, match=r"no longer recorded: expired: unused for \d+\.\d s"):
        tc.forward([idle], "importance_sampling").result()
    time.sleep(TTL + 6)                                                 # the janitor (every 5 s) prunes it
    with pytest.raises(tinker.BadRequestError, match="no longer recorded: expired"):
        tc.forward([used], "importance_sampling").result()
    assert tc.forward([_bare(used)], "importance_sampling").result().metrics["loss:sum"] != 0


# -- the store on a fake clock ------------------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@dataclasses.dataclass
class _D:
    tokens: np.ndarray
    inputs: dict
    spans: tuple | None


def _store_datum(prompt, sample, sid):
    from parallm.integrations.tinker.protocol import Span
    x = np.asarray(prompt + sample, np.int64)
    spans = ([Span("prompt", sid, 0, len(prompt)), Span("sampled", sid, 0, len(sample) - 1)],
             [Span("prompt", sid, 1, len(prompt) - 1), Span("sampled", sid, 0, len(sample))])
    return _D(x[:-1], {"target_tokens": x[1:]}, spans)


def test_store_expiry_renewal_and_reasons():
    from parallm.integrations.tinker.protocol import ApiError
    from parallm.integrations.tinker.stability import StabilityStore
    clock = _Clock()
    store = StabilityStore(ttl=100.0, max_tokens=30, clock=clock)
    a, b = store.assign("s1", [5, 6, 7], 2)
    store.sampled([a, b], [[8, 9], [10, 11, 12]])
    assert store.stats() == {"sequences": 2, "tokens": 3 + 2 + 3}
    with pytest.raises(ApiError, match="still being sampled"):
        (c,) = store.assign("s1", [1, 2], 1)
        store.check("s1", [_store_datum([1, 2], [3, 4], c)])
    store.settle([c])                                                   # its sampling failed
    with pytest.raises(ApiError, match="its sampling request failed"):
        store.check("s1", [_store_datum([1, 2], [3, 4], c)])
    clock.t = 90.0
    store.check("s1", [_store_datum([5, 6, 7], [8, 9], a)])             # renews a at 90
    clock.t = 150.0
    assert store.prune() == 1                                           # b: unused since 0
    with pytest.raises(ApiError, match="expired: unused for 150.0 s"):
        store.check("s1", [_store_datum([5, 6, 7], [10, 11, 12], b)])
    with pytest.raises(ApiError, match="another session"):
        store.check("s2", [_store_datum([5, 6, 7], [8, 9], a)])
    store.check("s1", [_store_datum([5, 6, 7], [8, 9], a)])
    assert store.stats() == {"sequences": 1, "tokens": 3 + 2}
    with pytest.raises(ApiError, match="would pass --stability-max-tokens 30"):
        store.assign("s1", list(range(26)), 1)
    store.end_session("s1")
    assert store.stats() == {"sequences": 0, "tokens": 0}
    with pytest.raises(ApiError, match="its session s1 ended"):
        store.check("s1", [_store_datum([5, 6, 7], [8, 9], a)])
    clock.t = 1000.0
    store.prune()                                                       # the reasons are forgotten after a ttl
    with pytest.raises(ApiError, match="unknown to this server"):
        store.check("s1", [_store_datum([5, 6, 7], [8, 9], a)])
