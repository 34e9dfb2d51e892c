"""The client SDK: what an RL loop imports (`from tandem import Client`).

    client = Client()                                   # TANDEM_GATEWAY_URL, TANDEM_REDIS__URL
    run = client.create_run("digits", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    completions = run.chat([{"role": "user", "content": "..."}], n=8)
    group = run.group(completions, rewards=[score(c.text) for c in completions])
    result = run.train([group])                         # returns once the new version serves

Rollouts go through the gateway over HTTP (any OpenAI client works there too); train jobs go
on the rq queue in Redis, and completion is observed on the durable event stream, so a
`train()` call notices the new version as soon as the inference side announces it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
from pydantic import ValidationError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem import jobs
from tandem.errors import (
    BackendUnavailable,
    GatewayError,
    TrainFailed,
    TrainTimeout,
)
from tandem.events import Event, EventKind, EventStream
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec
from tandem.settings import ClientSettings
from tandem.trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One sampled completion with everything training needs."""

    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    """Adapter version that served it (0 = base model)."""
    finish_reason: str | None = None

    def to_trajectory(self, reward: float, loss_mask: list[int] | None = None) -> Trajectory:
        return Trajectory(
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            rollout_logprobs=self.logprobs,
            loss_mask=loss_mask,
            reward=reward,
            version=self.version,
        )


@dataclass
class TrainHandle:
    """A submitted train job; `result()` waits until its version serves."""

    run: Run
    job_id: str
    step: int
    after: str
    """Event id read before submitting; the job's events come after it."""
    submitted_at: float = field(default_factory=time.time)
    _result: jobs.TrainResult | None = None
    _version: int | None = None
    _ready: Event | None = None

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout_s: float | None = None) -> jobs.TrainResult:
        """Block until the version this job published serves; raise TrainFailed if it failed."""
        if self._result is not None:
            return self._result
        timeout = timeout_s if timeout_s is not None else self.run.client.settings.train_timeout_s
        deadline = time.monotonic() + timeout
        stream = self.run.client.events
        while time.monotonic() < deadline:
            wait_ms = max(1, min(1000, int((deadline - time.monotonic()) * 1000)))
            page = stream.read(self.after, block_ms=wait_ms)
            for event in page:
                self.after = event.id or self.after
                if self._handle(event):
                    assert self._result is not None
                    return self._result
            self.after = page.last_id
            self._check_rq()
        raise TrainTimeout(
            f"job {self.job_id} (run {self.run.name!r}, step {self.step}) did not serve within "
            f"{timeout:.0f} s; check the trainer and inference logs, or raise train_timeout_s"
        )

    def _handle(self, event: Event) -> bool:
        if event.run != self.run.name:
            return False
        if (
            event.kind is EventKind.TRAIN_FAILED
            and event.job_id == self.job_id
            and not event.data.get("retries_left")  # rq retries it: wait for the retry
        ):
            raise TrainFailed(f"step {self.step} failed: {event.data.get('message', 'no message')}")
        if event.kind is EventKind.ADAPTER_READY and event.job_id == self.job_id:
            self._version = event.version
            self._ready = event
        if event.kind is EventKind.ADAPTER_REJECTED and self._version is not None and event.version == self._version:
            raise TrainFailed(f"version {self._version} was rejected by inference: {event.data.get('message')}")
        if (
            event.kind is EventKind.ADAPTER_LOADED
            and self._version is not None
            and event.version is not None
            and event.version >= self._version
        ):
            self._result = self._fetch_result(served_at=event.ts)
            return True
        return False

    def _fetch_result(self, served_at: float) -> jobs.TrainResult:
        """The job's own result if rq has it; otherwise what its `adapter_ready` said (the job
        writes its optimizer state after announcing, so it may still be running)."""
        raw = None
        try:
            raw = Job.fetch(self.job_id, connection=self.run.client.conn, serializer=JSONSerializer).return_value()
        except Exception:  # noqa: BLE001 - an expired or missing job still has its event
            log.debug("job %s has no result in rq; using its adapter_ready event", self.job_id)
        if raw:
            result = jobs.TrainResult.model_validate(raw)
        else:
            result = self._result_from_ready()
        return result.model_copy(update={"metrics": {**result.metrics, "served_at": served_at}})

    def _result_from_ready(self) -> jobs.TrainResult:
        data = self._ready.data if self._ready is not None else {}
        metrics = data.get("metrics") or {}
        base = {"job_id": self.job_id, "run": self.run.name, "step": self.step, "version": self._version or 0,
                "parent": 0, "published_at": self._ready.ts if self._ready is not None else 0.0}
        try:
            return jobs.TrainResult.model_validate({
                **base, "step": data.get("step", self.step), "parent": data.get("parent", 0), "metrics": metrics,
                "train_s": metrics.get("train_s", 0.0), "published_at": data.get("published_at") or base["published_at"],
            })
        except (ValidationError, AttributeError) as exc:  # an event from another writer: keep what is certain
            log.warning("adapter_ready of job %s has unexpected data (%s); result without metrics", self.job_id, exc)
            return jobs.TrainResult.model_validate(base)

    def _check_rq(self) -> None:
        """Catch failures that left no event (e.g. a worker killed with no retries left)."""
        try:
            job = Job.fetch(self.job_id, connection=self.run.client.conn, serializer=JSONSerializer)
        except Exception:  # noqa: BLE001 - a missing job is not a failure by itself
            return
        if job.get_status() == JobStatus.FAILED and not job.retries_left:
            raise TrainFailed(f"step {self.step} failed: {(job.exc_info or '').strip().splitlines()[-1:]}")


class Run:
    """A run as seen from user code: roll out, build groups, train."""

    def __init__(self, client: Client, spec: RunSpec) -> None:
        self.client = client
        self.spec = spec
        self.name = spec.name
        self._pending: deque[TrainHandle] = deque()

    # rollouts -------------------------------------------------------------
    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        n: int = 1,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        version: int | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of a chat prompt from the newest (or a pinned) version."""
        body = {"messages": messages, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "stop": stop}
        return self._rollout("/v1/chat/completions", body, version, chat=True)

    def complete(
        self,
        prompt: str | list[int],
        *,
        n: int = 1,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        version: int | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of a raw prompt (text or token ids)."""
        body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "stop": stop}
        return self._rollout("/v1/completions", body, version, chat=False)

    def _rollout(self, path: str, body: dict[str, Any], version: int | None, *, chat: bool) -> list[Completion]:
        body["model"] = self.name if version is None else f"{self.name}@v{version}"
        data = self.client.post(path, {k: v for k, v in body.items() if v is not None})
        ext = data["tandem"]
        out = []
        for i, choice in enumerate(data["choices"]):
            out.append(
                Completion(
                    text=choice["message"]["content"] if chat else choice["text"],
                    prompt_ids=ext["prompt_token_ids"],
                    completion_ids=ext["completion_token_ids"][i],
                    logprobs=ext["completion_logprobs"][i],
                    version=ext["version"],
                    finish_reason=choice.get("finish_reason"),
                )
            )
        return out

    @staticmethod
    def group(completions: Sequence[Completion], rewards: Sequence[float]) -> TrajectoryGroup:
        """Pair completions of one prompt with their rewards."""
        if len(completions) != len(rewards):
            raise ValueError(f"{len(completions)} completions but {len(rewards)} rewards")
        return TrajectoryGroup(trajectories=[c.to_trajectory(r) for c, r in zip(completions, rewards, strict=False)])

    # training -------------------------------------------------------------
    def train(
        self, groups: Sequence[TrajectoryGroup], *, wait: bool = True, timeout_s: float | None = None
    ) -> jobs.TrainResult | TrainHandle:
        """Submit one train step.

        wait=True: return the result once the new version serves. wait=False: return a handle
        at once, after making sure at most `max_staleness_steps` jobs are still unserved, so
        rollouts that follow are never older than the run allows.
        """
        conn = self.client.conn
        job = jobs.TrainJob(
            run=self.name,
            step=self.client.registry.next_step(self.name),
            groups=list(groups),
            timeout_s=int(timeout_s or self.client.settings.train_timeout_s),
        )
        after = self.client.events.last_id()
        jobs.enqueue(conn, job)
        handle = TrainHandle(run=self, job_id=job.job_id, step=job.step, after=after)
        self._pending.append(handle)
        if wait:
            self._drain(0, timeout_s)  # earlier async jobs, then this one (its result is kept)
            return handle.result(timeout_s)
        self._drain(self.spec.max_staleness_steps, timeout_s)
        return handle

    def _drain(self, keep: int, timeout_s: float | None) -> jobs.TrainResult | None:
        """Wait on the oldest pending jobs until at most `keep` remain; return the last result."""
        last = None
        while len(self._pending) > keep:
            last = self._pending.popleft().result(timeout_s)
        return last

    def wait_all(self, timeout_s: float | None = None) -> list[jobs.TrainResult]:
        """Wait for every pending job to serve."""
        results = []
        while self._pending:
            results.append(self._pending.popleft().result(timeout_s))
        return results

    # status ---------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        reg = self.client.registry
        return {
            "run": self.name,
            "latest_version": reg.latest_version(self.name),
            "serving_version": reg.serving(self.name),
            "pending_jobs": [h.job_id for h in self._pending],
        }

    def history(self) -> list[Event]:
        """Every event of this run still in the stream, oldest first."""
        return self.client.events.history(run=self.name)


class Client:
    """Entry point of the SDK; one per process."""

    def __init__(
        self,
        gateway_url: str | None = None,
        redis_url: str | None = None,
        *,
        api_key: str | None = None,
        settings: ClientSettings | None = None,
        http: httpx.Client | None = None,
        conn: redis.Redis | None = None,
    ) -> None:
        settings = settings or ClientSettings()
        updates: dict[str, Any] = {}
        if gateway_url:
            updates["gateway_url"] = gateway_url
        if redis_url:
            updates["redis"] = settings.redis.model_copy(update={"url": redis_url})
        self.settings = settings.model_copy(update=updates)
        key = api_key or (self.settings.api_key.get_secret_value() if self.settings.api_key else None)
        self.http = http or httpx.Client(
            base_url=self.settings.gateway_url,
            timeout=httpx.Timeout(self.settings.request_timeout_s, connect=10.0),
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        self.conn = conn or self.settings.redis.connect()
        self.registry = Registry(self.conn)
        self.events = EventStream(self.conn)

    def create_run(
        self,
        name: str,
        base_model: str,
        *,
        lora: LoraConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        loss: LossConfig | None = None,
        max_staleness_steps: int = 1,
        seed: int = 0,
    ) -> Run:
        """Create a run, or open it when one with the same settings exists."""
        spec = RunSpec(
            name=name,
            base_model=base_model,
            lora=lora or LoraConfig(),
            optimizer=optimizer or OptimizerConfig(),
            loss=loss or LossConfig(),
            max_staleness_steps=max_staleness_steps,
            seed=seed,
        )
        return Run(self, self.registry.create_run(spec))

    def run(self, name: str) -> Run:
        """Open an existing run."""
        return Run(self, self.registry.get_run(name))

    def runs(self) -> list[str]:
        return self.registry.list_runs()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"gateway at {self.settings.gateway_url} did not answer {path} ({exc}); "
                "is the stack up? set TANDEM_GATEWAY_URL"
            ) from exc
        if resp.status_code >= 400:
            try:
                payload = resp.json()
                message = payload.get("error", {}).get("message") or payload.get("detail") or resp.text
            except ValueError:
                payload, message = resp.text, resp.text
            raise GatewayError(f"{path} -> {resp.status_code}: {message}", status_code=resp.status_code, body=payload)
        data: dict[str, Any] = resp.json()
        return data

    def close(self) -> None:
        self.http.close()
        self.conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
