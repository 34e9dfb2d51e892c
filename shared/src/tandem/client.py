"""The client SDK: what an RL loop imports (`from tandem import Client`).

    client = Client()                                   # TANDEM_GATEWAY_URL, TANDEM_REDIS__URL
    run = client.create_run("digits", base_model="Qwen/Qwen2.5-0.5B-Instruct")
    completions = run.chat([{"role": "user", "content": "..."}], n=8)
    group = run.group(completions, rewards=[score(c.text) for c in completions])
    episode = run.episode([{"role": "user", "content": "..."}], tools=[...])  # multi-turn: episodes.py
    result = run.train([group])                         # returns once the new version serves

Rollouts go through the gateway over HTTP (any OpenAI client works there too); train jobs go
on the rq queue in Redis, and completion is observed on the durable event stream, so a
`train()` call notices the new version as soon as the inference side announces it.

Every error user code sees is a `tandem.errors.TandemError`: httpx, redis, rq and pydantic
errors are translated where they enter. A `train()` that waits rides out a Redis outage
shorter than its timeout (it reads on from where it was once Redis answers again).

The connections to the gateway and Redis are a `Session`'s (session.py); a new run is checked
against the engine's card (engine_card.py); waiting on a job is its `TrainHandle`'s (handles.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from tandem import job_quota, jobs
from tandem.deletion import Deletion
from tandem.engine_card import EngineCard
from tandem.episodes import Episode
from tandem.errors import (
    BackendUnavailable,
    GatewayError,
    RunBusy,
    RunNotFound,
    TrainFailed,
    TrainTimeout,
    ValidationFailed,
    invalid,
)
from tandem.events import Event, EventKind
from tandem.handles import TrainHandle
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec, check_run_name
from tandem.session import Session
from tandem.trajectories import Completion, Origin, Trajectory, TrajectoryGroup

__all__ = ["Client", "Completion", "Episode", "Run", "TrainHandle"]

log = logging.getLogger(__name__)

JOB_MIN_LIMIT_S = 1800
"""A train job's own time limit is never below this (the job's default), whatever its caller waits."""
JOB_MAX_LIMIT_S = 86400
"""Nor above a day (what a job takes)."""

DELETE_AFTER_PUBLISH_S = 5.0
"""How long `delete_run` waits for a job whose version is already published to end: the trainer
finishes its bookkeeping after `train()` has returned."""


class Scorable(Protocol):
    """What a group is made of: a `Completion` or an `Episode`."""

    def to_trajectory(self, reward: float) -> Trajectory: ...


class Run:
    """A run as seen from user code: roll out, build groups, train."""

    def __init__(self, client: Client, spec: RunSpec) -> None:
        self.client = client
        self.spec = spec
        self.name = spec.name
        self._pending: deque[TrainHandle] = deque()
        self._pending_lock = threading.Lock()  # threads may share a Run: each takes off only what it waited on

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
                    rollout_logprobs=ext["completion_logprobs"][i],
                    version=ext["version"],
                    temperature=ext["temperature"],
                    origin=Origin.of(ext),
                    finish_reason=choice.get("finish_reason"),
                )
                for i, choice in enumerate(data["choices"])
            ]
        except (KeyError, IndexError, TypeError, AttributeError, ValidationError) as exc:
            raise GatewayError(
                f"{path} answered without tandem's token ids and logprobs (missing or malformed: {exc!r}); "
                f"is TANDEM_GATEWAY_URL ({self.client.settings.gateway_url}) tandem's gateway, not the engine "
                "or another OpenAI server?",
                status_code=200, body=data,
            ) from exc

    def episode(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        episode_id: str | None = None,
    ) -> Episode:
        """Start a multi-turn episode from `messages` (no assistant message among them).

        Nothing is sent until its first `sample()`; `episode_id` defaults to a random hex id.
        """
        return Episode(self, messages, tools=tools, episode_id=episode_id)

    @staticmethod
    def group(completions: Sequence[Scorable], rewards: Sequence[float]) -> TrajectoryGroup:
        """Pair completions (or episodes) of one start with their rewards."""
        for field, given in (("completions", completions), ("rewards", rewards)):
            if isinstance(given, (str, bytes)) or not hasattr(given, "__len__"):
                raise ValidationFailed(f"{field}: got {type(given).__name__}; give a list (completions from "
                                       "Run.chat/complete or episodes, and one reward per completion)", field=field)
        if len(completions) != len(rewards):
            raise ValidationFailed(
                f"{len(completions)} completions but {len(rewards)} rewards; give one reward per completion",
                field="rewards",
            )
        for i, reward in enumerate(rewards):
            if isinstance(reward, (bool, str, bytes)) or not isinstance(reward, (int, float)) \
                    or not math.isfinite(reward):
                raise ValidationFailed(f"rewards[{i}] is {reward!r:.60}; give each completion a finite number "
                                       "(a float or an int)", field="rewards")
        trajectories = [c.to_trajectory(r) for c, r in zip(completions, rewards, strict=True)]
        if len(trajectories) < 2:
            raise ValidationFailed(f"{len(trajectories)} completion(s) to group; GRPO compares completions of one "
                                   "start, so give each group at least 2", field="completions")
        try:
            return TrajectoryGroup(trajectories=trajectories)
        except ValidationError as exc:
            raise invalid("cannot group these completions", exc) from exc

    # training -------------------------------------------------------------
    def train(
        self, groups: Sequence[TrajectoryGroup], *, wait: bool = True, timeout_s: float | None = None
    ) -> jobs.TrainResult | TrainHandle:
        """Submit one train step.

        wait=True: return the result once the new version serves. wait=False: return a handle
        at once, after making sure at most `max_staleness_steps` jobs are still unserved, so
        rollouts that follow are never older than the run allows. Rollouts another run sampled
        are refused (ValidationFailed naming them) before anything is enqueued. While the run has
        `run_max_queued_jobs` jobs on the queue it waits for the trainer to take one (RunQueueFull
        past `queue_wait_s`).

        `timeout_s` (default `train_timeout_s`) is how long this call waits, any number of seconds
        above 0. The job's own time limit, after which the trainer stops it, is that rounded up, but
        never below `JOB_MIN_LIMIT_S` nor above a day: a short wait does not cut the step short, and
        a job the trainer runs when the wait ends may still publish (`TrainTimeout.running`).
        """
        conn = self.client.conn
        timeout = self.client.settings.train_timeout_s if timeout_s is None else timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValidationFailed(f"timeout_s {timeout_s!r}: give the seconds to wait, a number above 0 (None: "
                                   f"train_timeout_s, {self.client.settings.train_timeout_s:g})", field="timeout_s")
        whole = min(max(math.ceil(timeout), JOB_MIN_LIMIT_S), JOB_MAX_LIMIT_S)
        if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
            raise ValidationFailed(f"groups: got {type(groups).__name__}; give a list of groups (Run.group)",
                                   field="groups")
        job = jobs.parse_job({"run": self.name, "groups": list(groups), "timeout_s": whole})
        jobs.check_origins(job)
        try:  # Redis away before the job is queued: nothing was submitted, and the error says so
            jobs.check_incarnation(job, self.client.registry.load_attempt_floor)
            settings = self.client.settings  # beyond the run's quota of queued jobs, wait for room (job_quota)
            job_quota.wait_for_room(conn, self.name, settings.run_max_queued_jobs, settings.queue_wait_s)
            job = job.model_copy(update={"step": self.client.registry.next_step(self.name)})
            after = self.client.events.last_id()
        except BackendUnavailable as exc:
            raise BackendUnavailable(f"train() submitted nothing for run {self.name!r}: {exc}; submit the same "
                                     "groups again once Redis answers") from exc
        jobs.enqueue(conn, job)
        handle = TrainHandle(run=self, job_id=job.job_id, step=job.step, after=after)
        with self._pending_lock:
            self._pending.append(handle)
        if wait:
            return self._wait_through(handle, timeout_s)
        try:
            self._drain(self.spec.max_staleness_steps, timeout_s)
        except (TrainFailed, TrainTimeout) as exc:  # an earlier job's: this call's own job is queued, say so
            raise _with_submitted(exc, handle) from exc
        return handle

    def _wait_through(self, mine: TrainHandle, timeout_s: float | None) -> jobs.TrainResult:
        """Wait on the jobs pending before `mine`, oldest first, then on `mine`; take each off that
        settled. A failure raises when it is `mine`'s or an earlier job's of this thread (its own
        pipelined steps); another thread's failed job stays pending for that thread to take (threads
        sharing a Run each hear of their own jobs), and jobs submitted after `mine` are not waited on."""
        with self._pending_lock:
            pending = list(self._pending)
        before = pending[: pending.index(mine)] if mine in pending else []
        for handle in before:
            try:
                handle.result(timeout_s)
            except (TrainFailed, TrainTimeout) as exc:
                if isinstance(exc, TrainTimeout) and exc.running:  # it may still publish: it stays pending
                    timeout = self.client.settings.train_timeout_s if timeout_s is None else timeout_s
                    given_up = mine.behind(handle, timeout)  # the error names the job this call submitted
                    if not given_up.running:
                        self._take_off(mine)
                    raise given_up from exc
                if handle.thread == mine.thread and self._take_off(handle):  # this thread's earlier step's
                    raise _with_submitted(exc, mine) from exc
                continue
            self._take_off(handle)
        try:
            result = mine.result(timeout_s)
        except TrainTimeout as exc:
            if not exc.running:  # it may still publish: it stays pending
                self._take_off(mine)
            raise
        except TrainFailed:
            self._take_off(mine)
            raise
        self._take_off(mine)
        return result

    def _drain(self, keep: int, timeout_s: float | None) -> jobs.TrainResult | None:
        """Wait on the oldest pending jobs until at most `keep` remain; return the last result."""
        last = None
        while len(self._pending) > keep:
            result = self._wait_oldest(timeout_s)
            if result is None:  # another thread took the last ones off
                break
            last = result
        return last

    def _wait_oldest(self, timeout_s: float | None) -> jobs.TrainResult | None:
        """The oldest pending job's result (None: none is pending). It stays pending unless it
        served, failed or timed out before the trainer started it (then it is cancelled): after a
        Redis outage longer than the timeout, or a step longer than it, the next wait picks it up
        where it was. Threads sharing the Run may wait on the same job: its outcome
        goes to the one that takes it off, and the others go on to the next."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    return None
                handle = self._pending[0]
            try:
                result = handle.result(timeout_s)
            except (TrainFailed, TrainTimeout) as exc:
                if isinstance(exc, TrainTimeout) and exc.running:  # it may still publish: it stays pending
                    raise
                if self._take_off(handle):
                    raise
                continue
            if self._take_off(handle):
                return result

    def _take_off(self, handle: TrainHandle) -> bool:
        """Remove `handle` from the pending jobs; False when another thread already did."""
        with self._pending_lock:
            try:
                self._pending.remove(handle)
            except ValueError:
                return False
        return True

    def wait_all(self, timeout_s: float | None = None) -> list[jobs.TrainResult]:
        """Wait for every pending job to serve."""
        results = []
        while (result := self._wait_oldest(timeout_s)) is not None:
            results.append(result)
        return results

    # status ---------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The newest and serving versions, and the jobs this Run submitted that have not settled
        (served or failed); RunNotFound once the run is deleted."""
        reg = self.client.registry
        if not reg.has_run(self.name):
            raise RunNotFound(f"run {self.name!r} was deleted; create it again (Client.create_run) to use the name")
        return {
            "run": self.name,
            "latest_version": reg.latest_version(self.name),
            "serving_version": reg.serving(self.name),
            "pending_jobs": [h.job_id for h in list(self._pending) if not h.settled()],
        }

    def history(self) -> list[Event]:
        """This run's events still in the stream, oldest first. A run deleted and created again
        under its name starts a history of its own: the events up to its last `run_deleted` are
        left out (they stay in the stream: `Client().events.history(run=name)`); an event of the
        deleted run appended after its deletion (a late job's `train_failed`) cannot be told apart
        and stays in. A deleted run's history runs up to its deletion and what followed it."""
        events = self.client.events.history(run=self.name)
        cuts = [i for i, e in enumerate(events) if e.kind is EventKind.RUN_DELETED]
        if not self.client.registry.has_run(self.name):
            cuts = cuts[:-1]  # its own deletion stays in (and what came after it: a refused late job)
        return events[cuts[-1] + 1:] if cuts else events


class Client(Session):
    """Entry point of the SDK; one per process, shared by its threads (a Run's pending jobs are taken off by one thread each).

    Its connections (the gateway, Redis) and their settings are a `Session`'s.
    """

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
            raise invalid(f"invalid run {name!r}", exc) from exc
        card = EngineCard.of(self.get("/v1/models"))
        if card is None:
            log.warning("the gateway at %s does not say which model it serves; cannot check base_model %r",
                        self.settings.gateway_url, spec.base_model)
        else:
            spec = card.fit(spec, self.settings.gateway_url)
        return Run(self, self.registry.create_run(spec))

    def engine_model(self) -> tuple[str, str] | None:
        """The engine's model (hub id or path) and the name it serves it under, from the gateway's
        `/v1/models` (the card with a `root`); None when the gateway does not say."""
        card = EngineCard.of(self.get("/v1/models"))
        return (card.model, card.served_name) if card else None

    def run(self, name: str) -> Run:
        """Open an existing run."""
        return Run(self, self.registry.get_run(name))

    def runs(self) -> list[str]:
        return self.registry.list_runs()

    def delete_run(self, name: str) -> Deletion:
        """Delete a run through the gateway (DELETE /v1/runs/<name>): its versions, queued jobs, registry
        keys and episodes, and the engine stops serving it (tandem.deletion says what is kept).

        RunNotFound when no such run is registered (deleting twice is an error, not a no-op);
        RunBusy, naming the job, while a job of the run runs. A job whose version is published
        already (its `train()` has returned) is waited on for up to `DELETE_AFTER_PUBLISH_S`.
        ValidationFailed for a name no run can have, before anything is sent.
        """
        try:
            check_run_name(name)
        except ValueError as exc:
            raise ValidationFailed(str(exc), field="name") from exc
        deadline = time.monotonic() + DELETE_AFTER_PUBLISH_S
        while True:
            try:
                return self._delete_run(name)
            except RunBusy as exc:
                ending = exc.job_id is not None and self.registry.version_of_job(name, exc.job_id) is not None
                if not ending or time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _delete_run(self, name: str) -> Deletion:
        try:
            return Deletion.model_validate(self.delete(f"/v1/runs/{name}"))
        except GatewayError as exc:
            if exc.status_code == 404:
                raise RunNotFound(str(exc)) from exc
            if exc.status_code == 409:
                error = exc.body.get("error") if isinstance(exc.body, dict) else None
                job = error.get("job_id") if isinstance(error, dict) else None
                raise RunBusy(str(exc), job_id=job if isinstance(job, str) else None) from exc
            raise
        except ValidationError as exc:
            raise GatewayError(f"DELETE /v1/runs/{name} answered without what it deleted: {exc}",
                               status_code=200) from exc


def _with_submitted(exc: TrainFailed | TrainTimeout, handle: TrainHandle) -> TrainFailed | TrainTimeout:
    """An earlier job's failure or timeout, raised by a train() that had queued its own job first:
    the same error, saying so, with that job's handle (`.submitted`) to wait on."""
    said = (f"{exc} (an earlier job's; this call's own job {handle.job_id}, step {handle.step}, was submitted and "
            "is pending: the exception's .submitted is its handle; do not submit the same groups again)")
    if isinstance(exc, TrainTimeout):
        return TrainTimeout(said, running=exc.running, job_id=exc.job_id, handle=exc.handle, submitted=handle)
    return TrainFailed(said, field=exc.field, submitted=handle)
