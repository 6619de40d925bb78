"""The local-rank launcher's reports (``parallm.verify.launch``) are read without unpickling code: a report that
carries a pickled object never runs it, and a rank whose result holds a type the launcher does not read says
so (the rest of the launcher: test_verify.py)."""

from __future__ import annotations

import types

import pytest
import torch

from parallm.verify import SpawnError, launch


class Payload:
    """Unpickling this creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_report_carrying_a_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"status": "ok", "value": Payload(str(marker))}, tmp_path / "result-0.pt")
    outcome = launch._outcome(0, types.SimpleNamespace(exitcode=0), str(tmp_path), None, False)
    assert outcome.status == "error" and "cannot read this rank's report" in outcome.message, outcome
    assert "Unsupported global" in outcome.message and not marker.exists()
    # the payload is live: a plain unpickling creates the marker
    torch.load(tmp_path / "result-0.pt", weights_only=False)
    assert marker.exists()


def test_plain_reports_are_read(tmp_path):
    value = {"t": torch.arange(3), "n": [1, 2.5, None, "s", (1, 2), {3}], "d": torch.bfloat16}
    torch.save({"status": "ok", "value": value}, tmp_path / "result-0.pt")
    outcome = launch._outcome(0, types.SimpleNamespace(exitcode=0), str(tmp_path), None, False)
    assert outcome.status == "ok" and torch.equal(outcome.value["t"], value["t"])
    assert outcome.value["n"] == value["n"] and outcome.value["d"] is torch.bfloat16


class Result:
    """A rank result of a type the launcher does not unpickle."""


def _returns_an_object(rank, world):
    return {"fine": 1, "not": Result()}


@pytest.mark.timeout(120)
def test_a_result_of_another_type_is_the_ranks_error():
    with pytest.raises(SpawnError, match=r"cannot be sent back to the launcher: it holds "
                                         r"test_launch_reports\.Result, which the launcher does not unpickle"):
        launch.spawn(_returns_an_object, 1, timeout=60)
