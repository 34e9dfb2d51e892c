"""A submitted train job, and waiting for the version it publishes to serve.

`Run.train(..., wait=False)` returns a `TrainHandle`; `handle.result()` reads the durable event
stream from just before the job was submitted until the inference side announces that the
job's version (or a newer one) serves on every ready inference replica (tandem.replicas), or
that the job failed, or that its version was refused by every replica that answered and served
by none. A ready replica that a serving replica left behind (its `adapter_loaded` names it in
`without`: it did not hold the version within `replica.agree_s`) is not waited for unless it
has said that it holds the version: the replicas decided without it. It rides out a Redis
outage shorter than its timeout: once Redis answers again it reads on from where it was. A
failure that left no event (a worker killed with no retries left) is caught in rq's record of
the job. A deletion of the run after the job was submitted ends the wait with TrainFailed: the
version never serves, whether the job was queued, running or already published.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from pydantic import ValidationError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.connection import ADVICE, call_until, redis_url, retryable
from tandem.errors import BackendUnavailable, TrainFailed, TrainTimeout, describe
from tandem.events import Event, EventKind, EventPage
from tandem.jobs import CANCELLED, TrainResult, claim
from tandem.replicas import Replicas
from tandem.session import SessionRun

log = logging.getLogger(__name__)


@dataclass
class TrainHandle:
    """A submitted train job; `result()` waits until its version serves."""

    run: SessionRun
    job_id: str
    step: int
    after: str
    """Event id read before submitting; the job's events come after it."""
    submitted_at: float = field(default_factory=time.time)
    thread: int = field(default_factory=threading.get_ident)
    """The thread that submitted it: a failure is raised to it, not to another thread sharing the Run."""
    _result: TrainResult | None = None
    _version: int | None = None
    _ready: Event | None = None
    _served: dict[str, float] = field(default_factory=dict)
    """Replica -> when it announced that it serves the version (or a newer one)."""
    _refused: dict[str, str] = field(default_factory=dict)
    """Replica -> why it refused the version."""
    _held: set[str] = field(default_factory=set)
    """Replicas that said they hold the version (`adapter_held`): they take part."""
    _left_behind: set[str] = field(default_factory=set)
    """Replicas a serving replica served the version without (`without` of its `adapter_loaded`)."""
    _not_waited: set[str] = field(default_factory=set)
    """Replicas already named in a warning as not waited for."""
    _first_served: float | None = None
    """Monotonic time the first replica was seen serving the version."""
    _failure: TrainFailed | None = None
    """The job's failure, once seen: raised again to every later waiter."""
    _waiting: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """One thread reads the stream for this job at a time (threads may share a Run)."""

    def done(self) -> bool:
        """Whether its version served (`result()` returns it at once)."""
        return self._result is not None

    def settled(self) -> bool:
        """Whether its outcome is known: its version served, or it failed."""
        return self._result is not None or self._failure is not None

    def result(self, timeout_s: float | None = None) -> TrainResult:
        """Block until the version this job published serves; raise TrainFailed if it failed."""
        timeout = timeout_s if timeout_s is not None else self.run.client.settings.train_timeout_s
        deadline = time.monotonic() + timeout
        if not self._waiting.acquire(timeout=timeout):
            raise TrainTimeout(
                f"job {self.job_id} (run {self.run.name!r}, step {self.step}) did not serve within "
                f"{timeout:g} s while another thread waited on it; check the trainer and inference logs, "
                "or raise train_timeout_s", job_id=self.job_id, handle=self)
        try:
            return self._wait(timeout, deadline)
        except TrainFailed as exc:
            self._failure = exc
            raise
        finally:
            self._waiting.release()

    def _wait(self, timeout: float, deadline: float) -> TrainResult:
        if self._result is not None:
            return self._result
        if self._failure is not None:
            raise self._failure
        while time.monotonic() < deadline:
            page = self._read(deadline, timeout)
            for event in page:
                self.after = event.id or self.after
                self._handle(event)
            self.after = page.last_id
            if self._settled(deadline):
                assert self._result is not None
                return self._result
            self._check_rq()
        running, what = self._give_up()
        raise TrainTimeout(
            f"job {self.job_id} (run {self.run.name!r}, step {self.step}) did not serve within "
            f"{timeout:g} s; {what}; check the trainer and inference logs, or raise train_timeout_s",
            running=running, job_id=self.job_id, handle=self,
        )

    def behind(self, earlier: TrainHandle, timeout: float) -> TrainTimeout:
        """The timeout of this job's wait, which ended on `earlier` (a job before it, still running):
        this job is given up as `result()` gives it up (cancelled unless the trainer took it)."""
        running, what = self._give_up()
        return TrainTimeout(
            f"job {self.job_id} (run {self.run.name!r}, step {self.step}) did not serve within {timeout:g} s: it "
            f"waits behind job {earlier.job_id} (step {earlier.step}), which did not serve in that time and may "
            f"still publish; this job: {what}; check the trainer and inference logs, or raise train_timeout_s",
            running=running, job_id=self.job_id, handle=self,
        )

    def _give_up(self) -> tuple[bool, str]:
        """After a timeout: cancel the job if the trainer has not started it (so that submitting the
        same groups again trains them once); (whether it runs on, what was done)."""
        if self._version is not None:
            return True, (f"its version {self._version} is published and not yet served everywhere: wait on it "
                          "again (handle.result() or run.wait_all())")
        try:
            job = Job.fetch(self.job_id, connection=self.run.client.conn, serializer=JSONSerializer)
            status = job.get_status()
            if status in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
                # a worker may have taken it off the queue already: whoever claims it first decides
                if claim(self.run.client.conn, job.key, CANCELLED) == CANCELLED:
                    job.cancel()
                    return False, "it had not started and is cancelled, so the same groups may be submitted again"
                status = JobStatus.STARTED
        except Exception as exc:  # noqa: BLE001 - a missing job or Redis away: say what is known
            return False, f"its state could not be read ({type(exc).__name__}: {exc}); it may still run"
        if status is JobStatus.STARTED:
            return True, ("the trainer is running it and it may still publish: wait on it again "
                          "(handle.result() or run.wait_all()) instead of submitting the same groups again")
        return False, f"rq has it as {status.value if status else 'unknown'}"

    def _read(self, deadline: float, timeout: float) -> EventPage:
        """The next page of the stream after `self.after`, riding out a Redis outage until `deadline`."""
        stream = self.run.client.events

        def read() -> EventPage:
            return stream.read(self.after, block_ms=max(1, min(1000, int((deadline - time.monotonic()) * 1000))))

        try:
            return call_until(deadline, read, what=f"waiting for job {self.job_id}")
        except BackendUnavailable as exc:
            if not retryable(exc):
                raise
            raise BackendUnavailable(
                f"job {self.job_id} (run {self.run.name!r}, step {self.step}) is still pending: Redis at "
                f"{redis_url(self.run.client.conn)} did not answer within {timeout:.0f} s ({exc.__cause__}); "
                f"{ADVICE}, then wait on the job again with run.wait_all() or handle.result()"
            ) from exc

    def _handle(self, event: Event) -> None:
        if event.run != self.run.name:
            return
        if event.kind is EventKind.RUN_DELETED:  # after this job was submitted: its version never serves
            when = (f"after its version {self._version} was published, before it served" if self._version is not None
                    else "before its version was published")
            raise TrainFailed(f"step {self.step} will not serve: run {self.run.name!r} was deleted {when}; create "
                              "the run again (Client.create_run) to train under its name", field="run")
        if (
            event.kind is EventKind.TRAIN_FAILED
            and event.job_id == self.job_id
            and not event.data.get("retries_left")  # rq retries it: wait for the retry
        ):
            field = event.data.get("field")
            raise TrainFailed(f"step {self.step} failed: {event.data.get('message', 'no message')}",
                              field=field if isinstance(field, str) else None)
        if event.kind is EventKind.ADAPTER_READY and event.job_id == self.job_id:
            self._version = event.version
            self._ready = event
        if event.kind is EventKind.ADAPTER_HELD and self._version is not None and event.version == self._version:
            self._held.add(str(event.data.get("replica") or ""))
        if event.kind is EventKind.ADAPTER_REJECTED and self._version is not None and event.version == self._version:
            self._refused[str(event.data.get("replica") or "")] = str(event.data.get("message"))
        if (
            event.kind is EventKind.ADAPTER_LOADED
            and self._version is not None
            and event.version is not None
            and event.version >= self._version
        ):
            replica = str(event.data.get("replica") or "")
            self._served[replica] = max(self._served.get(replica, 0.0), event.ts)
            without = event.data.get("without")
            if isinstance(without, list):
                self._left_behind.update(str(r) for r in without)

    def _settled(self, deadline: float) -> bool:
        """True once every ready replica serves the version (those that refused it aside), with
        the result set; TrainFailed once every ready replica refused it and none serves it.

        A ready replica that has said nothing of the version (no `adapter_held`, `adapter_loaded`
        or `adapter_rejected`) is not waited for once a serving replica served without it (after
        `replica.agree_s`), and at most `silent_replica_s` after the first one serves it: a
        heartbeat alone (a forged one, a replica stuck before loading) cannot hold train() to
        its timeout."""
        if not self._served and not self._refused:
            return False
        replicas = call_until(deadline, Replicas(self.run.client.conn, prune=False).live,
                              what=f"reading the inference replicas for job {self.job_id}")
        needed = {r.id for r in replicas if r.ready}
        left = needed & (self._left_behind - self._held - self._served.keys() - self._refused.keys())
        if left - self._not_waited:
            log.warning("job %s: not waiting for replicas %s: they did not hold v%s within replica.agree_s "
                        "and the replicas serving it went on without them (a stale or forged heartbeat, or "
                        "a replica that lags: it leaves rotation until it catches up)",
                        self.job_id, sorted(left - self._not_waited), self._version)
            self._not_waited |= left
        needed -= left
        if self._served:
            self._first_served = self._first_served or time.monotonic()
            if time.monotonic() - self._first_served > self.run.client.settings.silent_replica_s:
                silent = needed - self._held - self._served.keys() - self._refused.keys()
                if silent:
                    log.warning("job %s: not waiting for replicas %s, which said nothing of v%s in %.0f s "
                                "(silent_replica_s)", self.job_id, sorted(silent), self._version,
                                self.run.client.settings.silent_replica_s)
                needed -= silent
        if self._served and needed <= self._served.keys() | self._refused.keys():
            self._result = self._fetch_result(served_at=max(self._served.values()))
            return True
        if not self._served and needed <= self._refused.keys():
            reasons = "; ".join(m if len(self._refused) == 1 else f"replica {r}: {m}"
                                for r, m in sorted(self._refused.items()))
            raise TrainFailed(f"version {self._version} was rejected by inference: {reasons}")
        return False

    def _fetch_result(self, served_at: float) -> TrainResult:
        """The job's own result if rq has it; otherwise what its `adapter_ready` said (the job
        writes its optimizer state after announcing, so it may still be running)."""
        raw = None
        try:
            raw = Job.fetch(self.job_id, connection=self.run.client.conn, serializer=JSONSerializer).return_value()
        except Exception:  # noqa: BLE001 - an expired or missing job, or Redis away: its event is enough
            log.debug("job %s has no result in rq; using its adapter_ready event", self.job_id)
        result = None
        if raw:
            try:
                result = TrainResult.model_validate(raw)
            except ValidationError as exc:  # written by something else than the trainer: use the event
                log.warning("rq result of job %s is not a train result (%s); using its adapter_ready event",
                            self.job_id, describe(exc))
        if result is None:
            result = self._result_from_ready()
        return result.model_copy(update={"metrics": {**result.metrics, "served_at": served_at}})

    def _result_from_ready(self) -> TrainResult:
        """The result its `adapter_ready` event tells; fields of an odd shape are left at their defaults
        and metrics that are not numbers are left out (any writer of Redis can append events)."""
        data = self._ready.data if self._ready is not None else {}
        metrics = _numbers(data.get("metrics"))
        base = {"job_id": self.job_id, "run": self.run.name, "step": self.step, "version": self._version or 0,
                "parent": 0, "published_at": self._ready.ts if self._ready is not None else 0.0, "metrics": metrics}
        try:
            return TrainResult.model_validate({
                **base, "step": data.get("step", self.step), "parent": data.get("parent", 0),
                "train_s": metrics.get("train_s", 0.0), "published_at": data.get("published_at") or base["published_at"],
            })
        except ValidationError as exc:
            log.warning("adapter_ready of job %s has unexpected data (%s); keeping what is certain",
                        self.job_id, describe(exc))
            return TrainResult.model_validate(base)

    def _check_rq(self) -> None:
        """Catch failures that left no event (e.g. a worker killed with no retries left)."""
        try:
            job = Job.fetch(self.job_id, connection=self.run.client.conn, serializer=JSONSerializer)
            failed = job.get_status() == JobStatus.FAILED and not job.retries_left
            last_line = (job.exc_info or "").strip().splitlines()[-1:] if failed else []
        except Exception:  # noqa: BLE001 - a missing job, or Redis away (the next read rides it out), is no failure
            return
        if failed:
            raise TrainFailed(f"step {self.step} failed: {last_line}")


def _numbers(raw: object) -> dict[str, float]:
    """The entries of a `metrics` mapping that are numbers; anything else is left out."""
    if not isinstance(raw, dict):
        return {}
    out: dict[str, float] = {}
    for key, value in raw.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                out[str(key)] = float(value)
            except OverflowError:  # an int beyond float's range
                continue
    return out


