"""The wire format of the ``tinker`` SDK 0.38 (the REST protocol its ``ServiceClient`` speaks), both ways.

Requests are JSON bodies validated by the SDK's own pydantic request types (``tinker.types``, which forbid
unknown fields: a client whose protocol differs fails there with a message naming the field), except
``forward_backward``, which arrives as the SDK's protobuf (``tinker.proto.tinker_public_pb2``, zstd-compressed
when the client was told to compress). Responses are JSON, except the two results the SDK only accepts as
protobuf: ``ForwardBackwardOutput`` and ``SampleResponse`` (the SDK asks with ``Accept: application/x-protobuf``).

Errors have the SDK's shape: an HTTP error status with a JSON body ``{"error": message, "category": "user" |
"server" | "unknown"}`` for a refused call, and the same body as a future's result (``RequestFailedResponse``)
for work that failed after it was accepted; the SDK raises ``tinker.BadRequestError`` /
``tinker.NotFoundError`` / ... and ``tinker.RequestFailedError`` with the message.

Version: every SDK request carries ``X-Stainless-Package-Version`` and the session / config requests its
``sdk_version``; a version outside :data:`SDK_LINE` is refused with a message naming both.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

__all__ = ["ApiError", "Datum", "FwdBwdRequest", "SDK_LINE", "check_sdk_version", "decode_forward_backward",
           "encode_forward_backward_output", "encode_sample_response", "parse", "proto_module"]

SDK_LINE = "0.38."          # the SDK minor line whose protocol this server speaks (pyproject: parallm[tinker])
PROTO = "application/x-protobuf"


class ApiError(Exception):
    """A request refused with an HTTP status and the SDK's error body; ``category`` is Tinker's
    ``RequestErrorCategory`` (``"user"`` for bad input, ``"server"`` for a failure of the server)."""

    def __init__(self, status: int, message: str, *, category: str = "user"):
        super().__init__(message)
        self.status, self.message, self.category = status, message, category

    def body(self) -> dict:
        return {"error": self.message, "category": self.category}


def check_sdk_version(version: str | None) -> None:
    if version is None:
        return
    if not str(version).startswith(SDK_LINE):
        raise ApiError(400, f"parallm's Tinker server speaks the REST protocol of the tinker SDK {SDK_LINE}x "
                            f"(pip install 'parallm[tinker]', i.e. tinker>=0.38,<0.39); this client is tinker "
                            f"{version}, whose protocol may differ: install the 0.38 SDK")


def proto_module():
    from tinker.proto import tinker_public_pb2
    return tinker_public_pb2


def parse(model_cls, body, *, route: str):
    """``body`` (a dict) validated as the SDK's request type ``model_cls``; a mismatch is a 400 naming the
    fields (a newer SDK sending fields this server does not know lands here too)."""
    import pydantic
    if not isinstance(body, dict):
        raise ApiError(400, f"{route}: expected a JSON object")
    try:
        return model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(body)'}: {x['msg']}" for x in e.errors()[:8])
        raise ApiError(400, f"{route}: the request does not match tinker {SDK_LINE}x's {model_cls.__name__} "
                            f"({problems})") from None


def json_body(raw: bytes, *, route: str) -> dict:
    try:
        return json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"{route}: the body is not JSON ({e})") from None


# -- forward_backward: the SDK's protobuf -----------------------------------------------------------------------

@dataclasses.dataclass
class Datum:
    tokens: np.ndarray              # int64 [N]: the model input
    inputs: dict                    # loss_fn_inputs: name -> numpy array (float32 / int64), densified


@dataclasses.dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict
    forward_only: bool
    data: list


def _tensor(pb, msg, *, what: str) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise ApiError(400, f"{what}: unsupported tensor dtype {msg.dtype} (float32 / int64)")
    dt = np.dtype(dtypes[msg.dtype])
    shape = tuple(int(s) for s in msg.shape)
    try:
        if msg.HasField("sparse_csr"):
            csr = msg.sparse_csr
            values = np.frombuffer(csr.values, dtype=dt)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or \
                    (len(col) and (col.min() < 0 or col.max() >= shape[1])) or crow[-1] != len(values):
                raise ValueError("inconsistent CSR indices")
            dense = np.zeros(shape, dtype=dt)
            rows = np.repeat(np.arange(shape[0]), np.diff(crow))
            dense[rows, col] = values
            arr = dense
        else:
            arr = np.frombuffer(msg.dense, dtype=dt)
            arr = arr.reshape(shape if shape else (arr.size,))
    except ValueError as e:
        raise ApiError(400, f"{what}: malformed tensor (shape {list(shape)}): {e}") from None
    return arr.astype(np.int64) if arr.dtype == np.int32 else arr.copy()


def decode_forward_backward(raw: bytes, *, encoding: str | None) -> FwdBwdRequest:
    """The SDK's ``ForwardBackwardRequest`` protobuf -> :class:`FwdBwdRequest`. Only text chunks are supported
    (image / audio chunks are a 400 saying so); sparse CSR tensors are densified with 0."""
    pb = proto_module()
    if encoding == "zstd":
        import zstandard
        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 34)
        except zstandard.ZstdError as e:
            raise ApiError(400, f"forward_backward: the zstd body does not decompress ({e})") from None
    elif encoding not in (None, "", "identity"):
        raise ApiError(400, f"forward_backward: unsupported Content-Encoding {encoding!r}")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ApiError(400, f"forward_backward: the body is not the SDK's ForwardBackwardRequest ({e})") from None
    config = {}
    for k, v in msg.loss_fn_config.items():
        config[k] = float(v)
    for k, v in msg.loss_fn_config_v2.items():        # servers prefer v2 (the SDK mirrors numbers into v1)
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ApiError(400, f"forward_backward: datum {i} has a {kind} chunk; parallm's Tinker server "
                                    "takes text (token) chunks only")
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
        inputs = {k: _tensor(pb, t, what=f"forward_backward: datum {i} loss_fn_inputs[{k!r}]")
                  for k, t in d.loss_fn_inputs.items()}
        data.append(Datum(ids, inputs))
    return FwdBwdRequest(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                         loss_fn_config=config, forward_only=bool(msg.forward_only), data=data)


def encode_forward_backward_output(outputs: list, metrics: dict) -> bytes:
    """Per-datum outputs (name -> float32 array, leading dim the datum's tokens) and metrics (``"name:reduction"``
    keys, as the SDK's chunk combiner requires) -> the SDK's ``ForwardBackwardOutput`` protobuf."""
    pb = proto_module()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add(num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        trailing = arrays[0].shape[1:]
        if any(a.shape[1:] != trailing for a in arrays):     # ragged trailing shapes: one record per datum
            return _encode_per_datum(pb, outputs, metrics)
        sizes = np.array([0] + [a.nbytes for a in arrays], dtype=np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = np.cumsum(sizes).astype(np.int64).tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
        bt.trailing_shape.extend(int(s) for s in trailing)
    return out.SerializeToString()


def _encode_per_datum(pb, outputs, metrics) -> bytes:
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    for o in outputs:
        record = out.loss_fn_outputs.add(num_datums=1)
        for name, a in o.items():
            a = np.ascontiguousarray(a, dtype=np.float32)
            bt = record.fields[name]
            bt.data = a.tobytes()
            bt.offsets = np.array([0, a.nbytes], dtype=np.int64).tobytes()
            bt.dtype = pb.DTYPE_FLOAT32
            bt.trailing_shape.extend(int(s) for s in a.shape[1:])
    return out.SerializeToString()


def encode_sample_response(sequences: list, prompt_logprobs: np.ndarray | None) -> bytes:
    """``sequences``: ``(tokens, logprobs, stop_reason)`` per sample (``stop_reason`` ``"stop"`` / ``"length"``);
    ``prompt_logprobs``: float32 per prompt token, NaN where none (the first) -> the SDK's ``SampleResponse``."""
    pb = proto_module()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = out.sequences.add(stop_reason=reasons[reason],
                                tokens=np.asarray(tokens, dtype=np.int32).tobytes())
        if logprobs is not None:
            seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
