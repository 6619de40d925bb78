"""The caller's ``extra`` in a training checkpoint: a JSON value, with tensors stored beside the model's.

``extra`` is never pickled: unpickling runs whatever code the pickle names, so loading a checkpoint from someone
else would run their code. It is a JSON value (dicts with string keys, lists, strings, ints, floats, bools,
None) in which tensors may appear anywhere. The JSON goes into ``parallm.json`` with ``null`` where a tensor
was, and a list of where the tensors go; each tensor is a DCP item of its own (``extra/0``, ``extra/1``, ...,
in the order met), written and CRC-checked like every model tensor and read with DCP's
``torch.load(weights_only=True)``. DCP rather than a separate file: one format, one integrity check, one atomic
move into place, and an asynchronous save copies these tensors at its call with the rest.

Exact round trip: whatever :func:`encode_extra` accepts, :func:`decode_extra` gives back equal (tensors on the
CPU, same dtype, shape and values). So values JSON would change are refused, not converted: a tuple (it would
come back a list), a dict key that is not a string (it would come back a string), subclasses of the plain types
(an ``IntEnum`` would come back an int), and anything else (sets, bytes, numpy values, objects).
"""

from __future__ import annotations

import torch

from ...errors import CheckpointError

PREFIX = "extra/"   # DCP keys of extra's tensors

_HINTS = {tuple: "use a list (JSON has no tuples; it would come back as a list)",
          set: "use a sorted list", frozenset: "use a sorted list",
          bytes: "store a uint8 tensor (torch.frombuffer) or a string"}


def where(path) -> str:
    """``extra['a'][0]`` for path ``['a', 0]``."""
    return "extra" + "".join(f"[{p!r}]" for p in path)


def _type_name(value) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def encode_extra(extra) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(entry, tensors)``: the record's ``"extra"`` entry (``{"value": JSON with null for each tensor,
    "tensors": [{"key": DCP key, "at": path}, ...]}``) and the tensors by DCP key (detached, where they are).

    Raises TypeError naming the first value (by its path in ``extra``) that is not a JSON value or a tensor."""
    tensors: dict[str, torch.Tensor] = {}
    placed: list[dict] = []

    def walk(value, path):
        kind = type(value)
        if value is None or kind in (bool, int, float, str):
            return value
        if kind is list:
            return [walk(v, path + [i]) for i, v in enumerate(value)]
        if kind is dict:
            for k in value:
                if type(k) is not str:
                    raise TypeError(f"{where(path)} has the key {k!r} of type {_type_name(k)}: the keys of a "
                                    f"checkpoint's extra must be strings (JSON would turn it into {str(k)!r})")
            return {k: walk(v, path + [k]) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            if kind not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided or value.is_meta:
                raise TypeError(f"{where(path)} is a tensor of type {_type_name(value)}, layout {value.layout}, "
                                f"device {value.device}: a checkpoint's extra holds plain dense tensors with data")
            key = f"{PREFIX}{len(tensors)}"
            tensors[key] = value.detach()
            placed.append({"key": key, "at": list(path)})
            return None
        hint = _HINTS.get(kind)
        raise TypeError(f"{where(path)} is of type {_type_name(value)}: a checkpoint's extra holds JSON values "
                        "(dicts with string keys, lists, str, int, float, bool, None) and tensors only"
                        + (f"; {hint}" if hint else ""))

    value = walk(extra, [])
    return {"value": value, "tensors": placed}, tensors


def extra_keys(entry, *, where_: str) -> list[str]:
    """The DCP keys of the tensors a record's ``"extra"`` entry names, the entry checked first (a damaged or
    crafted ``parallm.json`` is a CheckpointError naming ``where_``)."""
    bad = CheckpointError(f"{where_}: its 'extra' entry is damaged")
    if not isinstance(entry, dict) or set(entry) != {"value", "tensors"} or not isinstance(entry["tensors"], list):
        raise bad
    keys = []
    for t in entry["tensors"]:
        if (not isinstance(t, dict) or set(t) != {"key", "at"} or not isinstance(t["key"], str)
                or not t["key"].startswith(PREFIX) or not isinstance(t["at"], list)
                or not all(type(p) in (str, int) for p in t["at"])):
            raise bad
        keys.append(t["key"])
    if len(set(keys)) != len(keys):
        raise bad
    return keys


def decode_extra(entry, tensors: dict[str, torch.Tensor], *, where_: str):
    """The ``extra`` object: ``entry["value"]`` (changed in place) with each tensor of ``tensors`` (by DCP key)
    put at its path. ``entry`` passed :func:`extra_keys`; a path that does not lead to a null is a
    CheckpointError naming ``where_``."""
    value = entry["value"]
    for t in entry["tensors"]:
        path, tensor = t["at"], tensors[t["key"]]
        if not path:
            value = tensor
            continue
        node = value
        try:
            for p in path[:-1]:
                node = node[p]
            if node[path[-1]] is not None:   # every tensor's place holds null
                raise KeyError(path[-1])
            node[path[-1]] = tensor
        except (KeyError, IndexError, TypeError):
            raise CheckpointError(f"{where_}: its 'extra' entry places tensor {t['key']} at {where(path)}, which "
                                  "is not a null in the stored value (the record is damaged)") from None
    return value
