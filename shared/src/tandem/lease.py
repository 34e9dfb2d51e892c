"""The GPU lease of shared mode: one GPU, two services, never both at once.

The trainer takes the lease before a job and gives it back after; the inference side,
seeing the lease requested, drains its requests, releases GPU memory and acknowledges; the
trainer trains only after that acknowledgement; when the lease ends, inference resumes. The
lease has an expiry that its holder renews, so a trainer that dies holding it cannot keep
the GPU from inference for longer than one TTL.

Redis layout (key `tandem:gpu:lease`, a hash): holder, state (`requested` -> `granted`),
expires_at. Expiry is Redis' own (PEXPIRE), renewed by the holder. Each side also has a bell,
a list of at most one entry (`tandem:gpu:lease:bell:<side>`) that the other side rings on a
change it waits for (request and release ring inference's, grant rings the trainer's), so a
waiter blocks on the bell and wakes at once instead of polling; the lease itself stays the
truth, and a waiter looks at it again after every ring or timeout. Every public method raises
`BackendUnavailable`, naming the Redis URL, when Redis fails; no redis-py error leaves this
module.
"""

from __future__ import annotations

import time
import uuid
from enum import StrEnum

import redis

from tandem import keys
from tandem.connection import text, translated
from tandem.errors import LeaseTimeout, ValidationFailed

#: The two sides of the lease, as their bells name them.
TRAINER, INFERENCE = "trainer", "inference"


class LeaseState(StrEnum):
    REQUESTED = "requested"
    """The trainer wants the GPU; inference must release its memory."""
    GRANTED = "granted"
    """Inference released its memory; the trainer may use the GPU."""


class GpuLease:
    """Both sides of the lease; the trainer calls acquire/renew/release, inference the rest."""

    def __init__(self, conn: redis.Redis, *, ttl_s: float = 60.0, holder: str | None = None) -> None:
        self.conn = conn
        self.ttl_ms = int(ttl_s * 1000)
        self.holder = holder or f"trainer-{uuid.uuid4().hex[:8]}"
        self.key = keys.gpu_lease()

    # trainer side -----------------------------------------------------------
    def request(self) -> bool:
        """Ask for the GPU; False while another live holder has it."""
        with translated(self.conn, f"request the GPU lease {self.key}"):
            pipe = self.conn.pipeline()
            pipe.hsetnx(self.key, "holder", self.holder)
            pipe.hget(self.key, "holder")
            _, holder = pipe.execute()
            if holder is None or text(holder) != self.holder:
                return False
            if self.conn.hsetnx(self.key, "state", LeaseState.REQUESTED.value):
                self.ring(INFERENCE)
            self.conn.pexpire(self.key, self.ttl_ms)
        return True

    def acquire(self, *, wait_s: float, poll_s: float = 0.5) -> float:
        """Request the GPU and wait until inference granted it; returns seconds waited.

        Between looks at the lease it waits for the trainer's bell, at most `poll_s`."""
        t0 = time.monotonic()
        deadline = t0 + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if self.request() and self.state() is LeaseState.GRANTED:
                return time.monotonic() - t0
            self.wait_bell(TRAINER, min(poll_s, left))
        self.release()
        raise LeaseTimeout(
            f"inference did not release the GPU within {wait_s:.0f} s (lease {self.key}); "
            "is the inference service running in shared mode?"
        )

    def renew(self) -> bool:
        """Push the expiry out by one TTL; False if the lease is no longer ours."""
        with translated(self.conn, f"renew the GPU lease {self.key}"):
            holder = self.conn.hget(self.key, "holder")
            if holder is None or text(holder) != self.holder:
                return False
            return bool(self.conn.pexpire(self.key, self.ttl_ms))

    def release(self) -> None:
        """Give the GPU back (only if we hold it)."""
        with translated(self.conn, f"release the GPU lease {self.key}"):
            holder = self.conn.hget(self.key, "holder")
            if holder is not None and text(holder) == self.holder:
                self.conn.delete(self.key)
                self.ring(INFERENCE)

    # inference side ------------------------------------------------------------
    def state(self) -> LeaseState | None:
        """None when nobody holds or wants the GPU (or the lease expired)."""
        with translated(self.conn, f"read the GPU lease {self.key}"):
            raw = self.conn.hget(self.key, "state")
        if not raw:
            return None
        try:
            return LeaseState(text(raw))
        except ValueError as exc:  # written by something else than tandem, or not UTF-8
            raise ValidationFailed(
                f"the GPU lease {self.key} has state {raw!r}, not one of {[s.value for s in LeaseState]}; "
                f"delete {self.key} (the trainer requests it again)",
                field="state",
            ) from exc

    def grant(self) -> None:
        """Say the GPU memory is released; the requester may train."""
        with translated(self.conn, f"grant the GPU lease {self.key}"):
            if self.conn.exists(self.key):
                self.conn.hset(self.key, "state", LeaseState.GRANTED.value)
                self.ring(TRAINER)

    # bells -------------------------------------------------------------------
    def ring(self, side: str) -> None:
        """Wake whoever waits on `side`'s bell (one pending ring is kept, for a minute)."""
        bell = keys.gpu_lease_bell(side)
        with translated(self.conn, f"ring the GPU lease bell {bell}"):
            pipe = self.conn.pipeline()
            pipe.lpush(bell, "1")
            pipe.ltrim(bell, 0, 0)
            pipe.pexpire(bell, 60_000)
            pipe.execute()

    def wait_bell(self, side: str, timeout_s: float) -> bool:
        """Block until `side`'s bell rings or `timeout_s` passes; whether it rang."""
        bell = keys.gpu_lease_bell(side)
        with translated(self.conn, f"wait for the GPU lease bell {bell}"):
            return self.conn.blpop([bell], timeout=max(timeout_s, 0.01)) is not None
