"""Tinker's protobuf wire format, read and written with the SDK's own definitions (`tinker.proto`).

`forward_backward` bodies arrive as `application/x-protobuf` (optionally `Content-Encoding: zstd`)
or as JSON; either becomes a `tandem.tinker_jobs.ForwardBackwardJob`'s datums. Results the SDK
asks for as protobuf (`ForwardBackwardOutput`, `SampleResponse`: `Accept: application/x-protobuf`)
are written here. Anything the trainer cannot take (images, audio, sparse tensors of another
shape, a tensor whose length is not the datum's) is refused with `TinkerInvalid` naming it.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb

from tandem.tinker_jobs import LOSSES, Datum
from tandem_inference.errors import TinkerInvalid
from tandem_inference.tinker.order import FIRST_SEQ, MAX_SEQ

PROTO = "application/x-protobuf"

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent before `Content-Encoding` (zstd or none), at most `limit` bytes."""
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise TinkerInvalid(f"Content-Encoding {encoding!r} is not supported; send zstd or none", param="content-encoding")
    try:  # streamed and bounded: a frame's own size claim is not trusted (a small body may inflate far)
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise TinkerInvalid(f"the body is not zstd ({exc}); send zstd or no Content-Encoding",
                            param="content-encoding") from exc
    if len(out) > limit:
        raise TinkerInvalid(f"the body inflates past {limit} bytes (tinker.max_body_bytes); send fewer datums per call",
                            param="body")
    return bytes(out)


def loads(body: bytes) -> Any:
    """A JSON body, or TinkerInvalid (422 `body`): not JSON, not UTF-8, or nested past what the
    parser follows (json's RecursionError, which is no ValueError)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise TinkerInvalid(f"the body is not JSON ({why}); send one JSON object, UTF-8", param="body") from exc


def json_tensor(where: str, t: Any) -> list[float]:
    """A loss input as the SDK's JSON `TensorData` carries it: dense, int64 or float32, one value per token."""
    if not isinstance(t, dict) or not isinstance(t.get("data"), list):
        raise TinkerInvalid(f"{where} is not a TensorData ({{'data': [...], 'dtype': 'int64' or 'float32'}})",
                            param=where)
    if t.get("dtype") not in ("int64", "float32"):
        raise TinkerInvalid(f"{where} has dtype {t.get('dtype')!r}; send float32 or int64", param=where)
    if t.get("sparse_crow_indices") is not None or t.get("sparse_col_indices") is not None:
        raise TinkerInvalid(f"{where} is sparse; tandem takes dense tensors", param=where)
    data, shape = t["data"], t.get("shape")
    if shape is not None and shape != [len(data)]:
        raise TinkerInvalid(f"{where} has shape {shape!r:.60} for {len(data)} values; tandem takes one value per "
                            f"token, shape [{len(data)}] or none", param=where)
    try:
        values = [float(x) for x in data]
    except (TypeError, ValueError) as exc:
        raise TinkerInvalid(f"{where} holds a value that is not a number ({exc})", param=where) from exc
    if t["dtype"] == "int64" and not all(v.is_integer() for v in values if np.isfinite(v)):
        raise TinkerInvalid(f"{where} is int64 but holds a fraction; send whole numbers or dtype float32", param=where)
    return values


def parse_forward_backward(body: bytes) -> tuple[str, int | None, str, dict[str, float], list[Datum], bool]:
    """(model_id, seq_id, loss_fn, loss_fn_config, datums, forward_only) of a protobuf request."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise TinkerInvalid(f"the body is not a Tinker ForwardBackwardRequest in protobuf ({exc})") from exc
    loss_fn = check_loss(msg.loss_fn)  # first: a loss tandem does not compute is named before its config
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise TinkerInvalid(f"loss_fn_config.{key} is text ({value.text!r}); tandem's losses take numbers",
                             param=f"loss_fn_config.{key}")
    datums = [_datum(i, d) for i, d in enumerate(msg.data)]
    return msg.model_id, (msg.seq_id or None), loss_fn, config, datums, msg.forward_only


def request_ids(body: bytes, content_type: str, encoding: str | None, limit: int) -> tuple[str, int] | None:
    """(model_id, seq_id) of a training call's body, JSON or protobuf, or None where the body does not
    say them (a refused request's seq_id still has to be used up: tandem_inference.tinker.order)."""
    try:
        raw = decompress(body, encoding, limit)
        if PROTO in content_type:
            msg = pb.ForwardBackwardRequest()
            msg.ParseFromString(raw)
            model_id, seq = msg.model_id, msg.seq_id
        else:
            fields = json.loads(raw)
            model_id, seq = fields.get("model_id"), fields.get("seq_id")
    except (TinkerInvalid, DecodeError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(model_id, str) or not model_id or not isinstance(seq, int) or isinstance(seq, bool):
        return None
    if not FIRST_SEQ <= seq <= MAX_SEQ:  # 0 is not ordered; one out of range is refused, and names no turn
        return None
    return model_id, seq


def check_loss(name: str) -> str:
    """`name` if the trainer computes that loss; else TinkerInvalid naming it and the losses it computes.

    The SDK also names `dro`, `gspo`, `stable_reinforce` (which needs sampling-time provenance the
    sampler does not record) and `custom` (a loss uploaded with `create_custom_loss`); a loss of the
    caller's own runs through `forward_backward_custom`, which sends only `cross_entropy`."""
    if name not in LOSSES:
        raise TinkerInvalid(f"loss_fn {name!r} is not supported; tandem computes {', '.join(LOSSES)} (a loss of "
                            "your own: TrainingClient.forward_backward_custom, which computes it client-side)",
                            param="loss_fn")
    return name


def _datum(i: int, d: Any) -> Datum:
    tokens: list[int] = []
    for j, chunk in enumerate(d.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise TinkerInvalid(f"data.{i}.model_input.chunks.{j} is a {kind or 'chunk of no kind'}; tandem trains on "
                             "token chunks (EncodedTextChunk) only", param=f"data.{i}.model_input")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: _tensor(f"data.{i}.loss_fn_inputs.{name}", t) for name, t in d.loss_fn_inputs.items()}
    return datum(i, tokens, inputs)


def datum(i: int, tokens: list[int], inputs: dict[str, list[float]]) -> Datum:
    """A trainer datum, each input as long as the tokens (Tinker's `target_tokens` convention)."""
    if not tokens:
        raise TinkerInvalid(f"data.{i}.model_input has no tokens", param=f"data.{i}.model_input")
    if "target_tokens" not in inputs:
        raise TinkerInvalid(f"data.{i}.loss_fn_inputs has no target_tokens", param=f"data.{i}.loss_fn_inputs")
    for name, values in inputs.items():
        if len(values) != len(tokens):
            raise TinkerInvalid(f"data.{i}.loss_fn_inputs.{name} has {len(values)} values for {len(tokens)} tokens; "
                             "give one per input token", param=f"data.{i}.loss_fn_inputs.{name}")
        if not all(np.isfinite(values)):
            raise TinkerInvalid(f"data.{i}.loss_fn_inputs.{name} holds a value that is not finite",
                             param=f"data.{i}.loss_fn_inputs.{name}")
    return Datum(tokens=tokens, inputs=inputs)


def _tensor(where: str, t: Any) -> list[float]:
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise TinkerInvalid(f"{where} has dtype {t.dtype}; send float32 or int64", param=where)
    if t.HasField("sparse_csr"):
        raise TinkerInvalid(f"{where} is sparse; tandem takes dense tensors", param=where)
    if len(t.dense) % np.dtype(dtype).itemsize:
        raise TinkerInvalid(f"{where} has {len(t.dense)} bytes, not whole {np.dtype(dtype).name} values", param=where)
    arr = np.frombuffer(t.dense, dtype=dtype)
    if len(t.shape) > 1 or (len(t.shape) == 1 and t.shape[0] != len(arr)):
        raise TinkerInvalid(f"{where} has shape {list(t.shape)} for {len(arr)} values; tandem takes one value per "
                            "token", param=where)
    return [float(v) for v in arr.tolist()]


def forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput` in protobuf: one ArrayRecord of float32 fields, one slice per datum."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    if outputs:
        record = msg.loss_fn_outputs.add(num_datums=len(outputs))
        for name in outputs[0]:
            arrays = [np.asarray(o.get(name, []), dtype=np.float32) for o in outputs]
            offsets = np.cumsum([0, *[a.nbytes for a in arrays]]).astype(np.int64)
            field = record.fields[name]
            field.dtype = pb.DTYPE_FLOAT32
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = offsets.tobytes()
    return bytes(msg.SerializeToString())


def sample_response(sequences: list[tuple[list[int], list[float], str]]) -> bytes:
    """A `SampleResponse` in protobuf: per sample its tokens, logprobs and stop reason."""
    msg = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        if logprobs:
            seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    return bytes(msg.SerializeToString())


#: pydantic's errors for a value that should have been a number.
NUMBER_ERRORS = frozenset({"float_type", "int_type", "float_parsing", "int_parsing", "finite_number"})


def invalid(exc: ValidationError, subject: str, prefix: str = "") -> TinkerInvalid:
    """pydantic's refusal as a 422 naming the first bad field (under `prefix`) and what is wrong with it."""
    first = exc.errors()[0]
    # a union's member is named in the location by its class (`AdamParams`): fields are lower case
    loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and p[:1].isupper())]
    where = ".".join([prefix] * bool(prefix) + loc) or "body"
    given = first.get("input")
    if isinstance(given, float) and not math.isfinite(given):
        what = f"{given!r} is not a finite number; give a finite one"
    elif given is None and first["type"] in NUMBER_ERRORS:  # the SDK sends NaN and infinity as null
        what = "null is not a number (NaN and infinity reach the server as null); give a finite number"
    else:
        what = first["msg"] + ("" if first["type"] == "missing" else f", got {given!r:.80}")
    return TinkerInvalid(f"{subject}: {where}: {what} ({exc.error_count()} problem(s))", param=where)
