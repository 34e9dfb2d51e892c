"""What the Tinker service keeps in Redis, so that any of its processes (or its restart) answers
for a future: sessions, models, the order of each model's requests, futures and checkpoint names.

A future is a `Future` record under `keys.tinker_future(request_id)`: its kind, the model it
belongs to, and what it waits on — the rq job of a training call, the job whose version a save
names, or nothing once its `result` (or `error`) is stored. Nothing lives only in memory.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import redis
from pydantic import BaseModel, Field

from tandem import keys
from tandem.connection import translated
from tandem_inference.errors import TinkerNotFound

Kind = Literal["create_model", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
               "load_weights", "sample"]


class Future(BaseModel):
    request_id: str
    kind: Kind
    model_id: str | None = None
    session_id: str | None = None
    """The sampling session of a sample (retrieve_futures lists only its own)."""
    seq: int | None = None
    applied: bool = True
    """False while the request waits for its turn (an earlier seq_id has not arrived)."""
    job_id: str | None = None
    """The trainer job this future is the result of."""
    after_job: str | None = None
    """A save: the job whose published version it names (None: the run's newest at its turn)."""
    version: int | None = None
    name: str | None = None
    """A save's checkpoint name; a sampler save with `sampling_session_seq_id` has none."""
    sampling_session_seq_id: int | None = None
    result: dict[str, Any] | None = None
    proto: str | None = None
    """A result the SDK reads as protobuf, hex-encoded (forward_backward, sample)."""
    error: str | None = None
    category: Literal["user", "server", "unknown"] = "server"
    created_at: float = Field(default_factory=time.time)


class ModelRecord(BaseModel):
    model_id: str
    run: str
    session_id: str
    base_model: str
    rank: int


class SamplingSession(BaseModel):
    sampling_session_id: str
    run: str | None = None
    version: int = 0
    """0: the run's base model (or the base model itself when `run` is None)."""
    base_model: str
    model_path: str | None = None
    """The sampler checkpoint it was opened on (`tinker://...`), as GET /samplers/{id} tells it."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class State:
    """The service's Redis records; every method raises BackendUnavailable when Redis fails."""

    def __init__(self, conn: redis.Redis, ttl_s: int) -> None:
        self.conn = conn
        self.ttl_s = ttl_s

    def _put(self, key: str, model: BaseModel) -> None:
        with translated(self.conn, f"write {key}"):
            self.conn.set(key, model.model_dump_json(), ex=self.ttl_s)

    def _get(self, key: str) -> bytes | None:
        with translated(self.conn, f"read {key}"):
            raw = self.conn.get(key)
        return raw if isinstance(raw, bytes) or raw is None else str(raw).encode()

    # sessions -----------------------------------------------------------------------------------
    def create_session(self, sdk_version: str) -> str:
        session_id = new_id("session")
        with translated(self.conn, "create a session"):
            self.conn.set(keys.tinker_session(session_id), json.dumps({"sdk_version": sdk_version,
                                                                       "created_at": time.time()}), ex=self.ttl_s)
        return session_id

    def touch_session(self, session_id: str) -> None:
        with translated(self.conn, f"renew session {session_id!r}"):
            if not self.conn.expire(keys.tinker_session(session_id), self.ttl_s):
                raise TinkerNotFound(f"unknown session_id {session_id!r}; create a session first", param="session_id")

    # models -------------------------------------------------------------------------------------
    def put_model(self, record: ModelRecord) -> None:
        self._put(keys.tinker_model(record.model_id), record)

    def model(self, model_id: str) -> ModelRecord:
        raw = self._get(keys.tinker_model(model_id))
        if raw is None:
            raise TinkerNotFound(f"unknown model_id {model_id!r}; create it with create_model (or create_lora_training_client)",
                           param="model_id")
        return ModelRecord.model_validate_json(raw)

    # futures ------------------------------------------------------------------------------------
    def put_future(self, future: Future) -> None:
        self._put(keys.tinker_future(future.request_id), future)

    def future(self, request_id: str) -> Future:
        raw = self._get(keys.tinker_future(request_id))
        if raw is None:
            raise TinkerNotFound(f"unknown request_id {request_id!r}: no such future (or it expired)", param="request_id")
        return Future.model_validate_json(raw)

    # sampling sessions --------------------------------------------------------------------------
    def put_sampling_session(self, s: SamplingSession) -> None:
        self._put(keys.tinker_sampling_session(s.sampling_session_id), s)

    def sampling_session(self, sampling_session_id: str) -> SamplingSession:
        raw = self._get(keys.tinker_sampling_session(sampling_session_id))
        if raw is None:
            raise TinkerNotFound(f"unknown sampling_session_id {sampling_session_id!r}; create one with "
                           "create_sampling_session or save_weights_and_get_sampling_client", param="sampling_session_id")
        return SamplingSession.model_validate_json(raw)

    def add_session_future(self, sampling_session_id: str, request_id: str) -> None:
        key = keys.tinker_session_futures(sampling_session_id)
        with translated(self.conn, f"record a future of {sampling_session_id!r}"):
            self.conn.rpush(key, request_id)
            self.conn.expire(key, self.ttl_s)

    def session_futures(self, sampling_session_id: str) -> list[str]:
        with translated(self.conn, f"list the futures of {sampling_session_id!r}"):
            return [m.decode() if isinstance(m, bytes) else str(m)
                    for m in self.conn.lrange(keys.tinker_session_futures(sampling_session_id), 0, -1)]

    # checkpoints --------------------------------------------------------------------------------
    def put_checkpoint(self, model_id: str, path: str, version: int, run: str) -> None:
        key = keys.tinker_checkpoints(model_id)
        with translated(self.conn, f"name checkpoint {path!r}"):
            self.conn.hset(key, path, json.dumps({"version": version, "run": run, "at": time.time()}))

    def checkpoint(self, model_id: str, path: str) -> tuple[str, int] | None:
        with translated(self.conn, f"read checkpoint {path!r}"):
            raw = self.conn.hget(keys.tinker_checkpoints(model_id), path)
        if raw is None:
            return None
        data = json.loads(raw)
        return str(data["run"]), int(data["version"])
