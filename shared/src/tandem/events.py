"""The durable event stream: Redis Streams entries, not pub/sub messages.

A consumer that was down catches up, because each consumer keeps its own cursor (the id of
the last entry it handled) in Redis and reads on from there. Events are small: the kind,
the run and version they concern, a timestamp, and a JSON `data` object.

Every entry is untrusted input: anyone who can write to Redis can append one. An entry that
does not parse (a missing or unknown kind, a version or timestamp that is not a number, `data`
that is not a JSON object, bytes that are not UTF-8) is logged and skipped: `read` returns a
page whose `last_id` moves past it, so no consumer stops on it or reads it again.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from enum import StrEnum
from typing import Any

import redis
from pydantic import BaseModel, Field, ValidationError
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from tandem import keys
from tandem.connection import text, translated
from tandem.errors import MalformedEvent

log = logging.getLogger(__name__)

#: Entries kept in the stream (approximate trimming); old entries are history only.
MAX_LEN = 100_000


class EventKind(StrEnum):
    ADAPTER_READY = "adapter_ready"
    """The trainer published and registered a version."""
    ADAPTER_HELD = "adapter_held"
    """An inference replica (`data.replica`) loaded a version and waits for the other replicas to hold it."""
    ADAPTER_LOADED = "adapter_loaded"
    """An inference replica (`data.replica`) loaded a version and routes the run to it."""
    ADAPTER_REJECTED = "adapter_rejected"
    """The inference side refused a version; the previous one keeps serving."""
    TRAIN_FAILED = "train_failed"
    """A train job failed; `data.message` says why."""
    RUN_DELETED = "run_deleted"
    """A run was deleted (tandem.deletion): every inference replica stops routing to it and unloads its
    adapters. A claim only: a replica acts on it for a run the registry no longer has."""


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
        """Parse one stream entry; raise `MalformedEvent` naming the entry and the bad field."""
        eid = text(entry_id)  # Redis makes entry ids: ASCII
        try:
            f = {text(k): text(v) for k, v in raw.items()}
        except UnicodeDecodeError as exc:
            raise MalformedEvent(eid, f"a field is not UTF-8 ({exc})") from exc
        for name in ("kind", "run", "ts"):
            if name not in f:
                raise MalformedEvent(eid, f"the field {name!r} is missing")
        try:
            kind = EventKind(f["kind"])
        except ValueError as exc:
            raise MalformedEvent(eid, f"kind {f['kind']!r} is not one of {[k.value for k in EventKind]}") from exc
        version: int | None = None
        if f.get("version"):
            # ASCII digits only (int() refuses '²', which isdigit() accepts) and a bounded length
            # (int() refuses more than 4300 digits)
            if not (f["version"].isascii() and f["version"].isdigit() and len(f["version"]) <= 18):
                raise MalformedEvent(eid, f"version {f['version'][:40]!r} is not a non-negative integer")
            version = int(f["version"])
        try:
            ts = float(f["ts"])
        except ValueError as exc:
            raise MalformedEvent(eid, f"ts {f['ts']!r} is not a number of seconds") from exc
        if not math.isfinite(ts):
            raise MalformedEvent(eid, f"ts {f['ts']!r} is not a finite number of seconds")
        try:
            data = json.loads(f.get("data") or "{}")
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
            raise MalformedEvent(eid, f"data is not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise MalformedEvent(eid, f"data is a JSON {type(data).__name__}, not an object")
        try:
            return cls(id=eid, kind=kind, run=f["run"], version=version, job_id=f.get("job_id") or None,
                       ts=ts, data=data)
        except ValidationError as exc:
            raise MalformedEvent(eid, str(exc)) from exc


class EventPage(list[Event]):
    """What one read of the stream returned: a list of the events that parsed, plus the entries
    that did not (`malformed`) and the id to read after next time (`last_id`, past both)."""

    def __init__(self, events: list[Event], last_id: str, malformed: list[MalformedEvent] | None = None) -> None:
        super().__init__(events)
        self.last_id = last_id
        """Id of the last entry read, parsed or not; the `after` of the next read."""
        self.malformed = malformed or []

    @classmethod
    def parse(cls, after: str, entries: list[Any]) -> EventPage:
        page = cls([], after)
        for eid, raw in entries:
            if eid is None or raw is None:
                continue
            try:
                page.append(Event.from_entry(eid, raw))
            except MalformedEvent as exc:
                log.warning("skipping a malformed entry of %s: %s", keys.EVENTS, exc)
                page.malformed.append(exc)
            page.last_id = text(eid)
        return page

    def newest_ready(self) -> dict[str, int]:
        """Each run's newest version an `adapter_ready` of this page announces."""
        newest: dict[str, int] = {}
        for e in self:
            if e.kind is EventKind.ADAPTER_READY and e.version is not None:
                newest[e.run] = max(e.version, newest.get(e.run, 0))
        return newest


class EventStream:
    """Append to and read from `tandem:events`."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def append(self, event: Event) -> str:
        """Append an event; returns its entry id."""
        with translated(self.conn, f"append {event.kind} to {keys.EVENTS}"):
            entry_id = self.conn.xadd(keys.EVENTS, _fields(event), maxlen=MAX_LEN, approximate=True)
        return text(entry_id)

    @staticmethod
    def append_in(pipe: Pipeline, event: Event) -> None:
        """Queue the event's append in `pipe`, so that it is appended with the rest of a transaction."""
        pipe.xadd(keys.EVENTS, _fields(event), maxlen=MAX_LEN, approximate=True)

    def last_id(self) -> str:
        """Id of the newest entry, or '0-0' for an empty stream; read after it to see only new events."""
        with translated(self.conn, f"read {keys.EVENTS}"):
            newest = self.conn.xrevrange(keys.EVENTS, count=1)
        entry_id = newest[0][0] if newest else None
        return text(entry_id) if entry_id is not None else "0-0"

    def read(self, after: str, *, block_ms: int | None = None, count: int = 100) -> EventPage:
        """Entries after entry id `after`, waiting up to `block_ms` when there are none.

        Malformed entries are logged and left out of `events`; read on from the page's `last_id`.
        """
        with translated(self.conn, f"read {keys.EVENTS}"):
            resp = self.conn.xread({keys.EVENTS: after}, count=count, block=block_ms)
        if not resp:
            return EventPage([], after)
        if not isinstance(resp, list):
            raise TypeError(f"expected a RESP2 XREAD reply (a list), got {type(resp).__name__}")
        return EventPage.parse(after, resp[0][1])

    def unread(self, after: str, *, limit: int = 10_000, page: int = 1000) -> EventPage:
        """The events already in the stream after entry id `after`, oldest first, without waiting
        for more; at most `limit` entries are read (a consumer that far behind gets the oldest).
        The page's `last_id` is the last entry read (`after` when there was none)."""
        events = EventPage([], after)
        read = 0
        while read < limit:
            got = self.read(events.last_id, count=min(page, limit - read))
            if got.last_id == events.last_id:
                break
            read += max(1, len(got) + len(got.malformed))
            events.extend(got)
            events.malformed.extend(got.malformed)
            events.last_id = got.last_id
        return events

    def history(self, *, run: str | None = None, count: int = 1000) -> list[Event]:
        """Newest `count` events, oldest first, optionally for one run (malformed entries left out)."""
        with translated(self.conn, f"read {keys.EVENTS}"):
            entries = self.conn.xrevrange(keys.EVENTS, count=count)
        events = EventPage.parse("0-0", list(reversed(entries or [])))
        return [e for e in events if run is None or e.run == run]

    def since(self, ts: float, *, page: int = 1000) -> Iterator[Event]:
        """Every event appended from wall-clock time `ts` (seconds since the epoch) on, oldest first,
        read a page at a time (malformed entries left out)."""
        start = f"{max(0, int(ts * 1000))}-0"
        while True:
            with translated(self.conn, f"read {keys.EVENTS}"):
                entries = self.conn.xrange(keys.EVENTS, min=start, count=page) or []
            parsed = EventPage.parse(start, entries)
            yield from parsed
            if len(entries) < page:
                return
            start = f"({parsed.last_id}"  # exclusive: the next page starts after it

    def follow(
        self, after: str, *, block_ms: int = 1000, deadline: float | None = None
    ) -> Iterator[Event]:
        """Yield events after `after` as they arrive, until `deadline` (time.monotonic)."""
        while deadline is None or time.monotonic() < deadline:
            wait = block_ms
            if deadline is not None:
                wait = max(1, min(block_ms, int((deadline - time.monotonic()) * 1000)))
            page = self.read(after, block_ms=wait)
            yield from page
            after = page.last_id


def _fields(event: Event) -> dict[FieldT, EncodableT]:
    # xadd takes dict[FieldT, EncodableT] and dict is invariant, so build one of that type.
    return {k: v for k, v in event.fields().items()}


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (`<ms>-<seq>`) as a pair that sorts the way Redis orders the entries."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Cursor:
    """A consumer's persisted position in the stream."""

    def __init__(self, conn: redis.Redis, consumer: str) -> None:
        self.conn = conn
        self.key = keys.cursor(consumer)

    def get(self, default: str = "0-0") -> str:
        """The committed position; `default` when the consumer never committed one."""
        with translated(self.conn, f"read the cursor {self.key}"):
            raw = self.conn.get(self.key)
        return text(raw) if raw else default

    def commit(self, entry_id: str) -> None:
        with translated(self.conn, f"write the cursor {self.key}"):
            self.conn.set(self.key, entry_id)
