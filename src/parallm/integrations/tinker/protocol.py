"""The wire format of the ``tinker`` SDK 0.38 (the REST protocol its ``ServiceClient`` speaks), both ways.

Requests are JSON bodies validated by the SDK's own pydantic request types (``tinker.types``, which forbid
unknown fields: a client whose protocol differs fails there with a message naming the field), except
``forward_backward``, which arrives as the SDK's protobuf (``tinker.proto.tinker_public_pb2``, zstd-compressed
when the client was told to compress; a datum's provenance spans decoded as :class:`Span` runs and checked by
:mod:`.stability`). Responses are JSON, except the two results the SDK only accepts as
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

__all__ = ["DEFAULT_MAX_BODY", "ApiError", "Datum", "FwdBwdRequest", "SDK_LINE", "Span", "check_sdk_version",
           "decode_forward_backward", "encode_forward_backward_output", "encode_sample_response", "json_body", "parse", "proto_module",
           "request_ids", "unzstd"]

DEFAULT_MAX_BODY = 128 << 20      # bytes of one request body (parallm serve-tinker --max-body-mb)
ZSTD_RATIO = 256                  # a zstd body may expand at most this many times (and never past the cap)
SPARSE_WIDTH = 128                # a sparse tensor densifies to at most max(rows x this, 32 x what it stores)
SDK_LINE = "0.38."          # the SDK minor line whose protocol this server speaks (pyproject: parallm[tinker])
PROTO = "application/x-protobuf"


class ApiError(Exception):
    """A request refused with an HTTP status and the SDK's error body; ``category`` is Tinker's
    ``RequestErrorCategory`` (``"user"`` for bad input, ``"server"`` for a failure of the server)."""

    def __init__(self, status: int, message: str, *, category: str = "user", ids: tuple | None = None):
        super().__init__(message)
        self.status, self.message, self.category = status, message, category
        self.ids = ids          # (model_id, seq_id) of the ordered request it refuses, when known

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


def request_ids(body) -> tuple | None:
    """``(model_id, seq_id)`` of a JSON request that names both (an ordered training-client request), else
    None; read from the raw body so that a request refused by validation still consumes its seq id."""
    if isinstance(body, dict):
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool):
            return model_id, seq_id
    return None


def json_body(raw: bytes, *, route: str) -> dict:
    try:
        return json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"{route}: the body is not JSON ({e})") from None


# -- forward_backward: the SDK's protobuf -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Span:
    """One provenance run (the SDK's ``PromptProvenanceSpan`` / ``SampledProvenanceSpan``)."""
    kind: str                       # "prompt" | "sampled"
    sequence_id: str
    offset: int
    length: int


@dataclasses.dataclass
class Datum:
    tokens: np.ndarray              # int64 [N]: the model input
    inputs: dict                    # loss_fn_inputs: name -> numpy array (float32 / int64), densified
    spans: tuple | None = None      # (model_input_spans, loss_fn_input_spans): lists of Span, or None (no provenance)


@dataclasses.dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict
    forward_only: bool
    data: list


def _tensor(pb, msg, *, what: str, rows: int) -> np.ndarray:
    """One ``loss_fn_inputs`` tensor as numpy. A sparse CSR tensor's declared shape is checked before anything
    is allocated: ``rows`` (the datum's tokens) rows, and at most ``max(rows * SPARSE_WIDTH, 32 * stored
    entries)`` elements once dense, so a small body cannot make the server allocate a large array."""
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise ApiError(400, f"{what}: unsupported tensor dtype {msg.dtype} (float32 / int64)")
    dt = np.dtype(dtypes[msg.dtype])
    shape = tuple(int(s) for s in msg.shape)
    try:
        if msg.HasField("sparse_csr"):
            csr = msg.sparse_csr
            if len(shape) != 2 or shape[0] != rows or shape[1] < 1:
                raise ValueError(f"a sparse tensor must be [{rows}, K] (the datum's {rows} tokens)")
            stored = len(csr.values) // dt.itemsize + len(csr.crow_indices) // 8
            if shape[0] * shape[1] > max(rows * SPARSE_WIDTH, 32 * stored):
                raise ValueError(f"{shape[0] * shape[1]} elements once dense from {stored} stored entries: too "
                                 f"sparse to accept (at most {SPARSE_WIDTH} per token, or 32 per stored entry)")
            values = np.frombuffer(csr.values, dtype=dt)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(crow) != shape[0] + 1 or len(col) != len(values) or \
                    (len(col) and (col.min() < 0 or col.max() >= shape[1])) or crow[-1] != len(values) or \
                    crow[0] != 0 or (np.diff(crow) < 0).any():
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


def unzstd(raw: bytes, *, limit: int) -> bytes:
    """A zstd body decompressed as a stream, refused (413) once its output passes ``limit`` bytes or
    ``ZSTD_RATIO`` times its own size: memory grows with what is read, never with what a frame header claims."""
    import io

    import zstandard
    limit = min(limit, max(1 << 20, ZSTD_RATIO * len(raw)))
    out, size = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as reader:
            while True:
                piece = reader.read(1 << 20)
                if not piece:
                    break
                size += len(piece)
                if size > limit:
                    raise ApiError(413, f"forward_backward: the zstd body expands past {limit} bytes (from "
                                        f"{len(raw)}): refused")
                out.append(piece)
    except zstandard.ZstdError as e:
        raise ApiError(400, f"forward_backward: the zstd body does not decompress ({e})") from None
    return b"".join(out)


def decode_forward_backward(raw: bytes, *, encoding: str | None, max_body: int = DEFAULT_MAX_BODY) -> FwdBwdRequest:
    """The SDK's ``ForwardBackwardRequest`` protobuf -> :class:`FwdBwdRequest`. Only text chunks are supported
    (image / audio chunks are a 400 saying so); sparse CSR tensors are densified with 0 (bounded: :func:`_tensor`).
    An error found once the message parsed carries its ``(model_id, seq_id)`` (``ApiError.ids``)."""
    pb = proto_module()
    if encoding == "zstd":
        raw = unzstd(raw, limit=max_body)
    elif encoding not in (None, "", "identity"):
        raise ApiError(400, f"forward_backward: unsupported Content-Encoding {encoding!r}")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ApiError(400, f"forward_backward: the body is not the SDK's ForwardBackwardRequest ({e})") from None
    try:
        return _request_of(pb, msg)
    except ApiError as e:
        e.ids = (msg.model_id, int(msg.seq_id))
        raise


def _request_of(pb, msg) -> FwdBwdRequest:
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
        inputs = {k: _tensor(pb, t, what=f"forward_backward: datum {i} loss_fn_inputs[{k!r}]", rows=len(ids))
                  for k, t in d.loss_fn_inputs.items()}
        data.append(Datum(ids, inputs, _spans(d, i)))
    return FwdBwdRequest(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                         loss_fn_config=config, forward_only=bool(msg.forward_only), data=data)


def _spans(d, i: int) -> tuple | None:
    """A datum's provenance spans (the wire has no None: no span in either list is no provenance)."""
    if not len(d.model_input_spans) and not len(d.loss_fn_input_spans):
        return None
    out = []
    for field in ("model_input_spans", "loss_fn_input_spans"):
        runs = []
        for j, msg in enumerate(getattr(d, field)):
            kind = msg.WhichOneof("span")
            if kind is None:
                raise ApiError(400, f"forward_backward: datum {i} {field}[{j}] is neither a prompt nor a sampled span")
            arm = getattr(msg, kind)
            if arm.offset < 0 or arm.length < 0 or not arm.sequence_id:
                raise ApiError(400, f"forward_backward: datum {i} {field}[{j}]: offset {arm.offset} and length "
                                    f"{arm.length} must be >= 0 and the sequence_id non-empty")
            runs.append(Span("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, int(arm.offset),
                             int(arm.length)))
        out.append(runs)
    return tuple(out)


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


TOPK_EMPTY = -99999.0        # the SDK's sentinel log-prob of an empty top-k cell (token id 0)


def _topk(msg, topk) -> None:
    """``topk``: ``(ids, logprobs)``, int / float arrays ``[N, K]`` (empty cells: id 0, :data:`TOPK_EMPTY`)."""
    ids, lps = np.asarray(topk[0], np.int32), np.asarray(topk[1], np.float32)
    msg.token_ids, msg.logprobs = ids.tobytes(), lps.tobytes()
    msg.length, msg.k = int(ids.shape[0]), int(ids.shape[1])


def encode_sample_response(sequences: list, prompt_logprobs: np.ndarray | None, *, topk_sampled=None,
                           topk_prompt=None) -> bytes:
    """``sequences``: ``(tokens, logprobs, stop_reason)`` per sample (``stop_reason`` ``"stop"`` / ``"length"``);
    ``prompt_logprobs``: float32 per prompt token, NaN where none (the first); ``topk_sampled``: per sample the
    top-k ``(ids, logprobs)`` of each sampled token's distribution, ``topk_prompt`` the prompt's (row 0 empty)
    -> the SDK's ``SampleResponse``."""
    pb = proto_module()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for i, (tokens, logprobs, reason) in enumerate(sequences):
        seq = out.sequences.add(stop_reason=reasons[reason],
                                tokens=np.asarray(tokens, dtype=np.int32).tobytes())
        if logprobs is not None:
            seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        if topk_sampled is not None:
            _topk(seq.topk_sampled_logprobs, topk_sampled[i])
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        _topk(out.topk_prompt_logprobs, topk_prompt)
    return out.SerializeToString()
