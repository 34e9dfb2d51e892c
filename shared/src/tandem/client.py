"""The client SDK: what an RL loop imports (`from tandem import Client`).

    client = Client()                                   # TANDEM_GATEWAY_URL, TANDEM_REDIS__URL
    run = client.create_run("digits", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    completions = run.chat([{"role": "user", "content": "..."}], n=8)
    group = run.group(completions, rewards=[score(c.text) for c in completions])
    result = run.train([group])                         # returns once the new version serves

Rollouts go through the gateway over HTTP (any OpenAI client works there too); train jobs go
on the rq queue in Redis, and completion is observed on the durable event stream, so a
`train()` call notices the new version as soon as the inference side announces it.

Every error user code sees is a `tandem.errors.TandemError`: httpx, redis, rq and pydantic
errors are translated where they enter. A `train()` that waits rides out a Redis outage
shorter than its timeout (it reads on from where it was once Redis answers again).
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
from tandem.connection import ADVICE, call_until, redis_url, retryable
from tandem.errors import (
    BackendUnavailable,
    GatewayError,
    TrainFailed,
    TrainTimeout,
    ValidationFailed,
)
from tandem.events import Event, EventKind, EventPage, EventStream
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec, same_base_model
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
        while time.monotonic() < deadline:
            page = self._read(deadline, timeout)
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
        except Exception:  # noqa: BLE001 - an expired or missing job, or Redis away: its event is enough
            log.debug("job %s has no result in rq; using its adapter_ready event", self.job_id)
        result = None
        if raw:
            try:
                result = jobs.TrainResult.model_validate(raw)
            except ValidationError as exc:  # written by something else than the trainer: use the event
                log.warning("rq result of job %s is not a train result (%s); using its adapter_ready event",
                            self.job_id, jobs.describe(exc))
        if result is None:
            result = self._result_from_ready()
        return result.model_copy(update={"metrics": {**result.metrics, "served_at": served_at}})

    def _result_from_ready(self) -> jobs.TrainResult:
        """The result its `adapter_ready` event tells; fields of an odd shape are left at their defaults
        and metrics that are not numbers are left out (any writer of Redis can append events)."""
        data = self._ready.data if self._ready is not None else {}
        metrics = _numbers(data.get("metrics"))
        base = {"job_id": self.job_id, "run": self.run.name, "step": self.step, "version": self._version or 0,
                "parent": 0, "published_at": self._ready.ts if self._ready is not None else 0.0, "metrics": metrics}
        try:
            return jobs.TrainResult.model_validate({
                **base, "step": data.get("step", self.step), "parent": data.get("parent", 0),
                "train_s": metrics.get("train_s", 0.0), "published_at": data.get("published_at") or base["published_at"],
            })
        except ValidationError as exc:
            log.warning("adapter_ready of job %s has unexpected data (%s); keeping what is certain",
                        self.job_id, jobs.describe(exc))
            return jobs.TrainResult.model_validate(base)

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
        try:
            ext = data["tandem"]
            return [
                Completion(
                    text=choice["message"]["content"] if chat else choice["text"],
                    prompt_ids=ext["prompt_token_ids"],
                    completion_ids=ext["completion_token_ids"][i],
                    logprobs=ext["completion_logprobs"][i],
                    version=ext["version"],
                    finish_reason=choice.get("finish_reason"),
                )
                for i, choice in enumerate(data["choices"])
            ]
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise GatewayError(
                f"{path} answered without tandem's token ids and logprobs (missing or malformed: {exc!r}); "
                f"is TANDEM_GATEWAY_URL ({self.client.settings.gateway_url}) tandem's gateway, not the engine "
                "or another OpenAI server?",
                status_code=200, body=data,
            ) from exc

    @staticmethod
    def group(completions: Sequence[Completion], rewards: Sequence[float]) -> TrajectoryGroup:
        """Pair completions of one prompt with their rewards."""
        if len(completions) != len(rewards):
            raise ValidationFailed(
                f"{len(completions)} completions but {len(rewards)} rewards; give one reward per completion",
                field="rewards",
            )
        try:
            return TrajectoryGroup(trajectories=[c.to_trajectory(r) for c, r in zip(completions, rewards, strict=True)])
        except ValidationError as exc:
            raise ValidationFailed(f"cannot group these completions: {jobs.describe(exc)}", field=_field(exc)) from exc

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
        job = jobs.parse_job(
            {"run": self.name, "groups": list(groups), "timeout_s": int(timeout_s or self.client.settings.train_timeout_s)}
        )
        job = job.model_copy(update={"step": self.client.registry.next_step(self.name)})
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
            last = self._wait_oldest(timeout_s)
        return last

    def _wait_oldest(self, timeout_s: float | None) -> jobs.TrainResult:
        """The oldest pending job's result. It stays pending unless it served, failed or timed out:
        after a Redis outage longer than the timeout the next wait picks it up where it was."""
        handle = self._pending[0]
        try:
            result = handle.result(timeout_s)
        except (TrainFailed, TrainTimeout):
            self._pending.popleft()
            raise
        self._pending.popleft()
        return result

    def wait_all(self, timeout_s: float | None = None) -> list[jobs.TrainResult]:
        """Wait for every pending job to serve."""
        results = []
        while self._pending:
            results.append(self._wait_oldest(timeout_s))
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
        """Create a run, or open it when one with the same settings exists.

        `base_model` must be the model the stack's engine serves (the trainer trains adapters for
        it, the engine applies them to its own model): a run on another model is refused with
        `ValidationFailed` naming both. What counts as the same model is `runs.same_base_model`:
        the engine's model or served name, or a hub id and a local copy of it.
        """
        try:
            spec = RunSpec(
                name=name,
                base_model=base_model,
                lora=lora or LoraConfig(),
                optimizer=optimizer or OptimizerConfig(),
                loss=loss or LossConfig(),
                max_staleness_steps=max_staleness_steps,
                seed=seed,
            )
        except ValidationError as exc:
            raise ValidationFailed(f"invalid run {name!r}: {jobs.describe(exc)}", field=_field(exc)) from exc
        self._check_base_model(spec)
        return Run(self, self.registry.create_run(spec))

    def engine_model(self) -> tuple[str, str] | None:
        """The engine's model (hub id or path) and the name it serves it under, from the gateway's
        `/v1/models` (the card with a `root`); None when the gateway does not say."""
        cards = self.get("/v1/models").get("data")
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and isinstance(card.get("root"), str) and card["root"]:
                return card["root"], str(card.get("id") or "")
        return None

    def _check_base_model(self, spec: RunSpec) -> None:
        engine = self.engine_model()
        if engine is None:
            log.warning("the gateway at %s does not say which model it serves; cannot check base_model %r",
                        self.settings.gateway_url, spec.base_model)
            return
        model, served_name = engine
        if not same_base_model(spec.base_model, model, served_name):
            raise ValidationFailed(
                f"run {spec.name!r} asks for base_model {spec.base_model!r}, but the engine behind "
                f"{self.settings.gateway_url} serves {model!r} (as {served_name!r}); its adapters would "
                f"not fit: create the run with base_model={model!r}, or start the stack with that model "
                "(TANDEM_ENGINE__MODEL)",
                field="base_model",
            )

    def run(self, name: str) -> Run:
        """Open an existing run."""
        return Run(self, self.registry.get_run(name))

    def runs(self) -> list[str]:
        return self.registry.list_runs()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to the gateway; its JSON object answer, or GatewayError / BackendUnavailable."""
        return self._request("POST", path, body)

    def get(self, path: str) -> dict[str, Any]:
        """GET from the gateway; its JSON object answer, or GatewayError / BackendUnavailable."""
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        try:
            resp = self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(
                f"gateway at {self.settings.gateway_url} did not answer {path} ({exc}); "
                "is the stack up? set TANDEM_GATEWAY_URL"
            ) from exc
        try:
            payload: Any = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code >= 400:
            raise GatewayError(f"{path} -> {resp.status_code}: {_message(payload) or resp.text}",
                               status_code=resp.status_code, body=payload)
        if not isinstance(payload, dict):
            raise GatewayError(
                f"{path} -> {resp.status_code} with a body that is not a JSON object ({resp.text[:200]!r}); "
                f"is TANDEM_GATEWAY_URL ({self.settings.gateway_url}) tandem's gateway?",
                status_code=resp.status_code, body=payload,
            )
        return payload

    def close(self) -> None:
        self.http.close()
        self.conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _message(payload: object) -> str | None:
    """The error message of a gateway (OpenAI `error.message`, FastAPI `detail`) or None."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return str(message or payload.get("detail") or "") or None


def _field(exc: ValidationError) -> str | None:
    """Dotted path of the first field pydantic complained about."""
    errors = exc.errors()
    return ".".join(str(x) for x in errors[0]["loc"]) if errors and errors[0]["loc"] else None
