"""A training checkpoint's ``extra`` as JSON + tensors (``parallm.checkpoint.training.extra``), without processes:
what is accepted comes back equal through JSON, everything else is refused naming its place, and a damaged
record entry is a CheckpointError. The distributed side (a save / load with tensors, a bad ``extra`` on one rank,
crafted pickles never run) is in test_train_checkpoint.py."""

from __future__ import annotations

import enum
import json

import pytest
import torch

from parallm.checkpoint.training.extra import decode_extra, encode_extra, extra_keys
from parallm.errors import CheckpointError


def same_extra(a, b) -> bool:
    """Equal as values and as types (a tuple is not a list; tensors: dtype, shape and bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_extra(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_extra(x, y) for x, y in zip(a, b))
    return a == b


def through_json(extra):
    """encode, the entry through JSON text as parallm.json holds it, the tensors cloned as DCP reads them back,
    decode."""
    entry, tensors = encode_extra(extra)
    entry = json.loads(json.dumps(entry))
    keys = extra_keys(entry, where_="parallm.json")
    assert keys == list(tensors)
    return decode_extra(entry, {k: t.clone() for k, t in tensors.items()}, where_="parallm.json")


ACCEPTED = [
    None, True, 0, -3, 2 ** 70, 1.5, float("inf"), -0.0, "", "text",
    [], {}, [1, [2, [3, {}]]], {"a": {"b": {"c": [None, False]}}},
    torch.arange(6).view(2, 3),                                     # a tensor alone
    {"t": torch.tensor(3.5), "bf": torch.ones(2, dtype=torch.bfloat16), "b": torch.tensor([True, False]),
     "empty": torch.zeros(0, 4), "c": torch.tensor([1 + 2j]), "i8": torch.tensor([-1], dtype=torch.int8)},
    [torch.zeros(1), [torch.ones(2)], {"x": torch.full((2, 2), 7)}],
    {"param": torch.nn.Parameter(torch.ones(3))},                    # comes back as a plain tensor
]


@pytest.mark.parametrize("extra", ACCEPTED, ids=lambda v: type(v).__name__)
def test_accepted_values_come_back_equal(extra):
    got = through_json(extra)
    if isinstance(extra, dict) and "param" in extra:
        assert type(got["param"]) is torch.Tensor and torch.equal(got["param"], extra["param"].detach())
        return
    assert same_extra(got, extra), (got, extra)


def test_nan_comes_back_as_nan():
    got = through_json({"loss": float("nan")})
    assert got["loss"] != got["loss"]


def test_tensors_keyed_in_order_met_and_detached():
    leaf = torch.ones(2, requires_grad=True)
    entry, tensors = encode_extra({"b": [leaf * 2], "a": torch.zeros(1)})
    assert list(tensors) == ["extra/0", "extra/1"]
    assert [t["at"] for t in entry["tensors"]] == [["b", 0], ["a"]]
    assert entry["value"] == {"b": [None], "a": None}
    assert not tensors["extra/0"].requires_grad


class Color(enum.IntEnum):
    RED = 1


REFUSED = [
    ((0.9, 0.99), "extra is of type tuple", "use a list"),
    ({"sched": {"betas": (1, 2)}}, "extra['sched']['betas'] is of type tuple", "use a list"),
    ({1: "a"}, "extra has the key 1 of type int", "must be strings"),
    ({"a": [{None: 1}]}, "extra['a'][0] has the key None of type NoneType", "must be strings"),
    ({"s": {1, 2}}, "extra['s'] is of type set", "sorted list"),
    ({"f": frozenset()}, "extra['f'] is of type frozenset", "sorted list"),
    ({"b": b"raw"}, "extra['b'] is of type bytes", "uint8 tensor"),
    ({"e": Color.RED}, "extra['e'] is of type test_checkpoint_extra.Color", "JSON values"),
    ({"g": torch.Generator()}, "extra['g'] is of type torch._C.Generator", "JSON values"),
    ({"dt": torch.float32}, "extra['dt'] is of type torch.dtype", "JSON values"),
    ([1, object()], "extra[1] is of type object", "JSON values"),
    ({"sp": torch.zeros(2, 2).to_sparse()}, "extra['sp'] is a tensor of type torch.Tensor, layout torch.sparse_coo",
     "plain dense tensors"),
    ({"m": torch.zeros(2, device="meta")}, "extra['m'] is a tensor of type torch.Tensor, layout torch.strided, "
     "device meta", "plain dense tensors"),
]


@pytest.mark.parametrize("extra, where, hint", REFUSED, ids=[r[1].split(" is ")[0] for r in REFUSED])
def test_refused_values_name_their_place(extra, where, hint):
    with pytest.raises(TypeError) as e:
        encode_extra(extra)
    assert where in str(e.value) and hint in str(e.value), str(e.value)


def test_numpy_value_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"extra\['x'\] is of type numpy.float64"):
        encode_extra({"x": np.float64(1.0)})


DAMAGED = [
    [],                                                                     # not a dict
    {"value": None},                                                        # no tensor list
    {"value": None, "tensors": [], "more": 1},                              # an unknown field
    {"value": [None], "tensors": [{"key": "model/x", "at": [0]}]},          # not an extra key
    {"value": [None], "tensors": [{"key": "extra/0", "at": [True]}]},       # a path step that is no key or index
    {"value": [None, None], "tensors": [{"key": "extra/0", "at": [0]}, {"key": "extra/0", "at": [1]}]},  # twice
]


@pytest.mark.parametrize("entry", DAMAGED, ids=range(len(DAMAGED)))
def test_damaged_entries_refused(entry):
    with pytest.raises(CheckpointError, match="parallm.json: its 'extra' entry is damaged"):
        extra_keys(entry, where_="parallm.json")


@pytest.mark.parametrize("value, at", [([1], [0]), ({"a": None}, ["b"]), ([None], ["a"]), ({"a": [None]}, ["a", 3]),
                                       ([[None]], [0]), ({"a": 1}, ["a", 0])])
def test_tensor_places_that_hold_no_null_refused(value, at):
    entry = {"value": value, "tensors": [{"key": "extra/0", "at": at}]}
    extra_keys(entry, where_="parallm.json")
    with pytest.raises(CheckpointError, match=r"places tensor extra/0 at extra\["):
        decode_extra(entry, {"extra/0": torch.zeros(1)}, where_="parallm.json")
