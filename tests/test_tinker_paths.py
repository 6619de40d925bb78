"""The Tinker server's checkpoint store never reaches outside its root (issue 54, item 7): model ids and names of
``.``, ``..``, empty or with separators are refused, and every directory it lists, reads, loads or deletes lies
under the root after ``realpath`` (a symbolic link inside the root that points out is refused too). No server,
no SDK: runs in the main suite; tests/test_tinker_hostile.py drives the same through the live server's routes."""

from __future__ import annotations

import json
import os

import pytest

from parallm.integrations.tinker.checkpoints import CheckpointStore
from parallm.integrations.tinker.protocol import ApiError


def _checkpoint(directory, **meta):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tinker.json"), "w") as f:
        json.dump({"time": "2026-01-01T00:00:00+00:00", **meta}, f)
    return directory


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "srv" / "ckpt"
    s = CheckpointStore(str(root))
    _checkpoint(os.path.join(s.root, "m1", "weights", "ok"))
    # a victim beside the root, shaped like a checkpoint: nothing may list, read or delete it
    victim = _checkpoint(str(tmp_path / "srv" / "weights" / "victim"), base_model="secret")
    _checkpoint(str(tmp_path / "srv" / "m2" / "weights" / "victim2"))
    s.victim = victim
    return s


@pytest.mark.parametrize("path", ["tinker://../weights/victim", "tinker://./weights/ok",
                                  "tinker:///weights/ok", "tinker://m1/weights/..", "tinker://m1/weights/.",
                                  "tinker://m1/weights/", "tinker://_parallm_init/weights/template",
                                  "tinker://m1/weights/../../weights/victim"])
def test_resolve_refuses_paths_leaving_the_root(store, path):
    with pytest.raises(ApiError) as e:
        store.resolve(path)
    assert e.value.status == 400, e.value.message
    assert os.path.isdir(store.victim)


@pytest.mark.parametrize("model_id", ["..", ".", "", "a/b", "_parallm_init"])
def test_listing_and_delete_refuse_bad_model_ids(store, model_id):
    with pytest.raises(ApiError) as e:
        store.listing(model_id)
    assert e.value.status == 400
    with pytest.raises(ApiError):
        store.delete(model_id, "weights/victim")
    assert os.path.isdir(store.victim)


@pytest.mark.parametrize("checkpoint_id", ["weights/../../weights/victim", "weights/..", "weights/", "weights/.",
                                           "../weights/victim"])
def test_delete_refuses_names_leaving_the_root(store, checkpoint_id):
    with pytest.raises(ApiError):
        store.delete("m1", checkpoint_id)
    assert os.path.isdir(store.victim) and os.path.isdir(os.path.join(store.root, "m1", "weights", "ok"))


def test_symlinks_out_of_the_root_are_refused(store, tmp_path):
    os.symlink(str(tmp_path / "srv" / "m2"), os.path.join(store.root, "m2"))                 # a run dir link
    os.symlink(store.victim, os.path.join(store.root, "m1", "weights", "linked"))            # a checkpoint link
    for path in ("tinker://m2/weights/victim2", "tinker://m1/weights/linked"):
        with pytest.raises(ApiError) as e:
            store.resolve(path)
        assert e.value.status == 400 and "outside" in e.value.message
    with pytest.raises(ApiError):
        store.listing("m2")
    assert [c["checkpoint_id"] for c in store.listing("m1")] == ["weights/ok"]      # the link is not listed
    with pytest.raises(ApiError):
        store.delete("m1", "weights/linked")
    assert os.path.isdir(store.victim)


def test_good_paths_still_work(store):
    model_id, segment, name, directory = store.resolve("tinker://m1/weights/ok")
    assert (model_id, segment, name) == ("m1", "weights", "ok") and os.path.isdir(directory)
    store.delete("m1", "weights/ok")
    assert not os.path.exists(directory)
