"""The durable event stream: Redis Streams entries, not pub/sub messages.

A consumer that was down catches up, because each consumer keeps its own cursor (the id of
the last entry it handled) in Redis and reads on from there. Events are small: the kind,
the run and version they concern, a timestamp, and a JSON `data` object.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from enum import StrEnum
from typing import Any

import redis
from pydantic import BaseModel, Field
from redis.typing import EncodableT, FieldT

from tandem import keys
from tandem.errors import BackendUnavailable

#: Entries kept in the stream (approximate trimming); old entries are history only.
MAX_LEN = 100_000


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class EventKind(StrEnum):
    ADAPTER_READY = "adapter_ready"
    """The trainer published and registered a version."""
    ADAPTER_LOADED = "adapter_loaded"
    """The inference side loaded a version and routes the run to it."""
    ADAPTER_REJECTED = "adapter_rejected"
    """The inference side refused a version; the previous one keeps serving."""
    TRAIN_FAILED = "train_failed"
    """A train job failed; `data.message` says why."""


class Event(BaseModel):
    """One entry of the stream."""

    kind: EventKind
    run: str
    version: int | None = None
    job_id: str | None = None
    ts: float = Field(default_factory=time.time)
    """Wall-clock time the event was appended, in seconds since the epoch."""
    data: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None
    """Stream entry id, filled in when read back."""

    def fields(self) -> dict[str, str]:
        return {
            "kind": self.kind.value,
            "run": self.run,
            "version": "" if self.version is None else str(self.version),
            "job_id": self.job_id or "",
            "ts": repr(self.ts),
            "data": json.dumps(self.data),
        }

    @classmethod
    def from_entry(cls, entry_id: bytes | str, raw: Mapping[bytes | str, bytes | str]) -> Event:
        f = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            id=_text(entry_id),
            kind=EventKind(f["kind"]),
            run=f["run"],
            version=int(f["version"]) if f.get("version") else None,
            job_id=f.get("job_id") or None,
            ts=float(f["ts"]),
            data=json.loads(f.get("data") or "{}"),
        )


class EventStream:
    """Append to and read from `tandem:events`."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def append(self, event: Event) -> str:
        """Append an event; returns its entry id."""
        try:
            # xadd takes dict[FieldT, EncodableT] and dict is invariant, so build one of that type.
            fields: dict[FieldT, EncodableT] = {k: v for k, v in event.fields().items()}
            entry_id = self.conn.xadd(keys.EVENTS, fields, maxlen=MAX_LEN, approximate=True)
        except redis.RedisError as exc:
            raise BackendUnavailable(f"cannot append {event.kind} to {keys.EVENTS}: {exc}") from exc
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def last_id(self) -> str:
        """Id of the newest entry, or '0-0' for an empty stream; read after it to see only new events."""
        newest = self.conn.xrevrange(keys.EVENTS, count=1)
        if not newest:
            return "0-0"
        entry_id = newest[0][0]
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def read(self, after: str, *, block_ms: int | None = None, count: int = 100) -> list[Event]:
        """Events after entry id `after`, waiting up to `block_ms` when there are none."""
        resp = self.conn.xread({keys.EVENTS: after}, count=count, block=block_ms)
        if not resp:
            return []
        if not isinstance(resp, list):
            raise TypeError(f"expected a RESP2 XREAD reply (a list), got {type(resp).__name__}")
        return [Event.from_entry(eid, raw) for eid, raw in resp[0][1]]

    def history(self, *, run: str | None = None, count: int = 1000) -> list[Event]:
        """Newest `count` events, oldest first, optionally for one run."""
        entries = self.conn.xrevrange(keys.EVENTS, count=count)
        events = [
            Event.from_entry(eid, raw) for eid, raw in reversed(entries or []) if eid is not None and raw is not None
        ]
        return [e for e in events if run is None or e.run == run]

    def follow(
        self, after: str, *, block_ms: int = 1000, deadline: float | None = None
    ) -> Iterator[Event]:
        """Yield events after `after` as they arrive, until `deadline` (time.monotonic)."""
        while deadline is None or time.monotonic() < deadline:
            wait = block_ms
            if deadline is not None:
                wait = max(1, min(block_ms, int((deadline - time.monotonic()) * 1000)))
            for event in self.read(after, block_ms=wait):
                after = event.id or after
                yield event


class Cursor:
    """A consumer's persisted position in the stream."""

    def __init__(self, conn: redis.Redis, consumer: str) -> None:
        self.conn = conn
        self.key = keys.cursor(consumer)

    def get(self) -> str:
        raw = self.conn.get(self.key)
        return _text(raw) if raw else "0-0"

    def commit(self, entry_id: str) -> None:
        self.conn.set(self.key, entry_id)
