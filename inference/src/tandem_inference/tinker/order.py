"""One model's requests, applied in their `seq_id` order, whatever order they arrive in.

The SDK numbers a training client's requests (`seq_id` 1, 2, ...) and pipelines them: a
forward_backward and the optim_step after it may arrive in either order, and the chunks of one
forward_backward arrive together. A request whose turn has come is applied at once (its trainer
job enqueued, or its save bound to the job before it); one that arrives early is parked in Redis
(`keys.tinker_order`) and applied when the requests before it have arrived. The same seq_id sent
again (the SDK retries a POST whose answer it lost) gets the future it got the first time, when it
is the same call: one of another kind or body under a used seq_id (a second training client on
the model, numbering from 1 again) is refused naming `seq_id`, never answered with another call's
result (each seq_id's `digest` is kept beside its future).

The train queue is FIFO with one trainer worker, so enqueueing in seq_id order is training in it.
An optim_step applies the forward_backward jobs enqueued since the model's last optim_step
(`gradients_from`), which the order hash keeps.

A training call beyond its run's quota of queued jobs (`tinker.run_max_queued_jobs`,
tandem.job_quota) is not refused: `room` says no, and it stays parked, with the requests after it,
its future pending. `resume` applies the parked requests whose turn has come once there is room;
the service calls it when the SDK polls a future of the model that is not applied yet. A request
without a seq_id, or one numbered again from 1, is applied at once, as before (the SDK numbers
every training call).

A seq_id is a whole number from 0 to `MAX_SEQ` (`checked_seq`); anything else is refused by name
before it is ordered, and uses up no turn (it names none).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import redis

from tandem import keys
from tandem.connection import translated
from tandem_inference.errors import TinkerInvalid

#: The SDK's first seq_id on a model (its request ids count from 0, each sent as id + 1).
FIRST_SEQ = 1
#: The largest seq_id taken: a signed 64-bit integer's. The SDK's protobuf carries an int32 and its
#: JSON a count of the client's requests; a number past this would park a request that never runs.
MAX_SEQ = 2**63 - 1

Apply = Callable[[dict[str, Any], "Order"], None]
"""Applies one parked request (its op) with the model's order state at hand."""
Room = Callable[[dict[str, Any]], bool]
"""Whether a request (its op) may be applied now: False holds it and the requests after it parked."""


def checked_seq(value: object, param: str = "seq_id") -> int | None:
    """`value` as a request's sequence number (None: not numbered), or TinkerInvalid naming it:
    an integer from 0 to MAX_SEQ (not a bool, a string or a float)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise TinkerInvalid(f"{param} {value!r} is not a sequence number; give an integer from 0 to {MAX_SEQ}, "
                            "as the SDK numbers its requests (0, 1, 2, ...), or leave it out", param=param)
    return value


class Order:
    """A model's order state while its lock is held: the forward_backward jobs since the last
    optim_step, and the last job that publishes a version."""

    def __init__(self, raw: dict[str, str]) -> None:
        self.gradients: list[str] = json.loads(raw.get("gradients", "[]"))
        self.publisher: str | None = raw.get("publisher") or None


class Sequencer:
    """Applies each model's requests in seq_id order (one lock per model in this process)."""

    def __init__(self, conn: redis.Redis, ttl_s: int) -> None:
        self.conn = conn
        self.ttl_s = ttl_s
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, model_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(model_id, threading.Lock())

    def submit(self, model_id: str, seq: int | None, request_id: str, op: dict[str, Any], apply: Apply,
               room: Room = lambda op: True, digest: str | None = None) -> str:
        """The request's future id: `request_id`, or the one its seq_id got before when `digest`
        (`kind:hash` of the call) is that request's; TinkerInvalid when it is another call's."""
        key = keys.tinker_order(model_id)
        with self._lock(model_id), translated(self.conn, f"order the requests of model {model_id!r}"):
            raw = {_s(k): _s(v) for k, v in self.conn.hgetall(key).items()}
            if seq is not None and f"seen:{seq}" in raw:
                first = raw.get(f"digest:{seq}")
                if digest is not None and first is not None and first != digest:
                    raise TinkerInvalid(
                        f"seq_id {seq} of model {model_id!r} was used by an earlier {first.split(':')[0]} call with "
                        f"another body, and this {digest.split(':')[0]} call is not a resend of it; number each call "
                        "of a model once (two training clients on one model both number from 1: use one)",
                        param="seq_id")
                return raw[f"seen:{seq}"]
            seen = {f"seen:{seq}": request_id, **({f"digest:{seq}": digest} if digest else {})}
            order = Order(raw)
            if seq is None:
                apply(op, order)
                self._save(key, order, {})
                return request_id
            nxt = int(raw.get("next", FIRST_SEQ))
            if seq < nxt:  # a training client that numbers from 1 again on the same model: apply it now
                apply(op, order)
                self._save(key, order, seen)
                return request_id
            parked = {**seen, f"op:{seq}": json.dumps(op)}
            self._save(key, order, parked)  # parked first: a failure below loses no request
            raw.update(parked)
            self._apply_parked(key, raw, order, apply, room)
            return request_id

    def resume(self, model_id: str, apply: Apply, room: Room) -> None:
        """Apply the model's parked requests whose turn has come, while `room` lets them."""
        key = keys.tinker_order(model_id)
        with self._lock(model_id), translated(self.conn, f"resume the requests of model {model_id!r}"):
            raw = {_s(k): _s(v) for k, v in self.conn.hgetall(key).items()}
            self._apply_parked(key, raw, Order(raw), apply, room)

    def _apply_parked(self, key: str, raw: dict[str, str], order: Order, apply: Apply, room: Room) -> None:
        nxt = int(raw.get("next", FIRST_SEQ))
        while f"op:{nxt}" in raw:  # each applied request is recorded before the next is applied
            op = json.loads(raw[f"op:{nxt}"])
            if not room(op):
                return  # beyond its run's quota: it and the ones after it stay parked
            apply(op, order)
            self._save(key, order, {"next": str(nxt + 1)}, [f"op:{nxt}"])
            nxt += 1

    def _save(self, key: str, order: Order, updates: dict[str, str], drop: list[str] | None = None) -> None:
        fields: dict[Any, Any] = {**updates, "gradients": json.dumps(order.gradients), "publisher": order.publisher or ""}
        with self.conn.pipeline() as pipe:
            pipe.hset(key, mapping=fields)
            for field in drop or []:
                pipe.hdel(key, field)
            pipe.expire(key, self.ttl_s)
            pipe.execute()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
