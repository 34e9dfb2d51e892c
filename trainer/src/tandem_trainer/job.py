"""One train job, end to end: validate, lock the run, train one GRPO step, publish, announce.

The job is the unit of idempotency. A job that already published (the registry maps its id
to a version) returns that version again, and a version that reached the store but not the
registry is adopted (publisher.py); only otherwise does it train. A per-run lock in Redis
(run_lock.py) makes sure two workers never train one run at once, and everything that could
make a job fail the same way every time is checked before any work, so bad input fails fast
with a message that names the field.

The queue carries a job as the JSON form of a `tandem.jobs.TrainJob`; `Trainer.train`
validates it once, with pydantic. A caller that holds a `TrainJob` passes it as it is.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
import torch
from pydantic import JsonValue
from rq.timeouts import JobTimeoutException

from tandem.adapters import AdapterStore, Manifest
from tandem.errors import AdapterRejected, RunNotFound, TandemError, ValidationFailed, VersionExists
from tandem.events import Event, EventKind, EventStream
from tandem.jobs import TrainJob, TrainResult, groups_digest, parse_job
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer import failpoints
from tandem_trainer.adapter_files import StagedAdapter
from tandem_trainer.backends.base import Backend, ModelInfo
from tandem_trainer.errors import CheckpointError, JobRejected, RanksLost, TrainStepFailed
from tandem_trainer.gpu_sharing import SharedGpu
from tandem_trainer.grpo import group_advantages, reward_stats, rollout_stats
from tandem_trainer.metrics import TrainerMetrics
from tandem_trainer.microbatch import Sample
from tandem_trainer.parallel import Group
from tandem_trainer.publisher import Publisher
from tandem_trainer.run_lock import RunLock
from tandem_trainer.stage_clock import StageClock
from tandem_trainer.step import StepOrder, train_step
from tandem_trainer.tracking import Tracker
from tandem_trainer.turns import check_trained_spans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    """A step's outcome before it is published: the version's manifest and its staged adapter."""

    manifest: Manifest
    adapter: StagedAdapter
    train_s: float
    stepped_at: float
    """Wall clock when the optimizer step was done on the device."""
    stage_ms: float
    """How long staging the adapter in host memory took: the device copy (`adapter.copy_ms`) and
    what the backend does before it (finding the adapter's tensors)."""


def _names(payload: TrainJob | JsonValue, queued_as: str | None) -> tuple[str, str | None]:
    """The run and job id a payload names, read before it is validated (for its failure event)."""
    if isinstance(payload, TrainJob):
        return payload.run, payload.job_id
    run = payload.get("run") if isinstance(payload, dict) else None
    named = payload.get("job_id") if isinstance(payload, dict) else None
    return (run if isinstance(run, str) else "", named if isinstance(named, str) else queued_as)


class Trainer:
    """Runs train jobs against one backend (the resident model), store and Redis."""

    def __init__(
        self,
        settings: TrainerSettings,
        conn: redis.Redis,
        backend: Backend,
        store: AdapterStore | None = None,
        *,
        owner: str = "trainer",
        holder_alive: Callable[[str], bool] = lambda owner: True,
        entropy: bool = True,
        gpu: SharedGpu | None = None,
        group: Group | None = None,
        metrics: TrainerMetrics | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        self.settings, self.conn, self.backend = settings, conn, backend
        self.gpu = gpu
        """Shared mode: the GPU lease held around each job's compute (None in split/cpu mode)."""
        self.group = group
        """Data-parallel training: this process is rank 0 of these ranks (step.py)."""
        self.store = store or AdapterStore(settings.store.root)
        self.registry, self.events = Registry(conn), EventStream(conn)
        self.publisher = Publisher(conn, self.store)
        self.owner, self.holder_alive, self.entropy = owner, holder_alive, entropy
        self.metrics = metrics or TrainerMetrics()
        """Prometheus metrics of the jobs (metrics.py); the worker serves them on /metrics."""
        self.tracker = tracker
        """The experiment tracker each published step is logged to (tracking.py), if any."""

    # the job ------------------------------------------------------------------
    def train(self, payload: TrainJob | JsonValue, *, retries_left: int = 0,
              job_id: str | None = None) -> TrainResult:
        """Train one job (or find what it already published); raise JobRejected on bad input.

        `payload` is a TrainJob, or its JSON form as the queue carries it. `retries_left` is
        how often the queue will run the job again if it fails for a reason other than its
        input; it goes into the `train_failed` event so that a client can tell a final
        failure from one that a retry may still fix. `job_id` (the queue's id of the job)
        names the job in that event when the payload does not.
        """
        started = time.perf_counter()
        run, job_id = _names(payload, job_id)
        log.info("train.start run=%s job_id=%s", run, job_id)
        version: int | None = None
        self.metrics.in_progress.set(1)
        try:
            job = payload if isinstance(payload, TrainJob) else self._parse(payload)
            result = self.publisher.reused(job)
            if result is None:
                spec = self._run(job.run)
                info = self.backend.model_info(spec.base_model)
                self._check_tokens(job, info)
                self._check_rewards(job, spec)
                lock = RunLock(self.conn, job.run, self.owner, self.holder_alive)
                lock.acquire(ttl_ms=job.timeout_s * 1000, wait_s=job.timeout_s)
                failpoints.hit("lock_taken")
                try:
                    result = self.publisher.adopt_orphans(job)
                    if result is None:
                        latest = self.registry.latest_version(job.run)
                        version = latest + 1
                        parent = self._resume_point(job.run, latest)
                        self._check_versions(job, spec, latest, parent)
                        digest = groups_digest(job)  # before the step: not between it and the files
                        if self.gpu is None:
                            trained = self._train(job, spec, info, latest, parent, digest)
                        else:
                            with self.gpu.held() as waited:
                                trained = self._train(job, spec, info, latest, parent, digest, gpu_wait_s=waited)
                        # in shared mode the GPU is back with inference while the files are written
                        result = self._publish(job, trained)
                        # off the path to serving: after the announcement
                        self._save_state(job, version, result.parent)
                        self.metrics.record_step(job.run, result.version, result.metrics)
                        if self.tracker is not None:
                            self._track(job, spec, result, trained.stepped_at)
                finally:
                    lock.release()
        except Exception as exc:
            if not isinstance(exc, JobRejected):
                self._invalidate()  # partial gradients or a half-done step: reload next time
            failure = self._translate(exc)
            field = failure.field if isinstance(failure, ValidationFailed) else None
            log.warning(
                "train.failed run=%s job_id=%s duration_s=%.3f field=%s error=%s message=%s",
                run, job_id, time.perf_counter() - started, field, type(failure).__name__,
                " ".join(str(failure).splitlines()),  # one event, one line (a hub error spans several)
            )
            self.events.append(Event(
                kind=EventKind.TRAIN_FAILED, run=run, version=version, job_id=job_id,
                data={"message": str(failure), "field": field,
                      "retries_left": 0 if not_retried(exc) else retries_left},
            ))
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self.metrics.in_progress.set(0)
            self.metrics.job_seconds.observe(time.perf_counter() - started)
        log.info(
            "train.end run=%s job_id=%s version=%d parent=%d reused=%s duration_s=%.3f loss=%.5f "
            "reward_mean=%.4f",
            result.run, result.job_id, result.version, result.parent, result.reused,
            time.perf_counter() - started, result.metrics.get("loss", 0.0),
            result.metrics.get("reward_mean", 0.0),
        )
        return result

    @staticmethod
    def _translate(exc: Exception) -> Exception:
        if isinstance(exc, torch.OutOfMemoryError):
            return TrainStepFailed(
                f"out of memory while training ({exc}); lower TANDEM_BACKEND__MICRO_BATCH_TOKENS"
            )
        if isinstance(exc, JobTimeoutException):
            return TrainStepFailed(f"{exc}: the job ran out of its time and is not retried; submit it again with "
                                   "a larger timeout_s (run.train(..., timeout_s=...) or the client's "
                                   "train_timeout_s)")
        return exc

    # validation ---------------------------------------------------------------
    @staticmethod
    def _parse(payload: JsonValue) -> TrainJob:
        try:
            return parse_job(payload)
        except ValidationFailed as exc:
            raise JobRejected(str(exc), field=exc.field) from exc

    def _run(self, name: str) -> RunSpec:
        try:
            return self.registry.get_run(name)
        except RunNotFound as exc:
            raise JobRejected(f"run: {exc}; create the run before training it", field="run") from exc

    @staticmethod
    def _check_tokens(job: TrainJob, info: ModelInfo) -> None:
        for g, group in enumerate(job.groups):
            for t, traj in enumerate(group.trajectories):
                path = f"groups.{g}.trajectories.{t}"
                for name, ids in (("prompt_ids", traj.prompt_ids), ("completion_ids", traj.completion_ids)):
                    bad = max(ids)
                    if bad >= info.vocab_size:
                        raise JobRejected(
                            f"{path}.{name}: token id {bad} is outside the vocabulary of "
                            f"{info.base_model} (vocab_size {info.vocab_size}); ids must be below it",
                            field=f"{path}.{name}",
                        )
                total = len(traj.prompt_ids) + len(traj.completion_ids)
                if total > info.max_positions:
                    raise JobRejected(
                        f"{path}: prompt_ids ({len(traj.prompt_ids)}) + completion_ids "
                        f"({len(traj.completion_ids)}) = {total} tokens, longer than the context of "
                        f"{info.base_model} (max_position_embeddings {info.max_positions})",
                        field=f"{path}.completion_ids",
                    )
        if info.turn_start_id is not None:
            check_trained_spans(job, info.turn_start_id, info.turn_start)
        if not any(any(traj.mask) for group in job.groups for traj in group.trajectories):
            raise JobRejected("groups: every completion token is masked out; nothing to train on",
                              field="groups")

    @staticmethod
    def _check_rewards(job: TrainJob, spec: RunSpec) -> None:
        """Advantages the loss can hold: any finite rewards normalise, but without normalize_std they
        are the rewards' own scale. Checked before the run's lock and the GPU are taken."""
        if spec.loss.normalize_std:
            return
        for g, group in enumerate(job.groups):
            adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float64), normalize_std=False)
            if not bool(torch.isfinite(adv).all()):
                raise JobRejected(
                    f"groups.{g}: rewards {group.rewards} give advantages beyond float32 (|a| > 3.4e38) with "
                    f"run {spec.name!r}'s loss.normalize_std off; scale the rewards down, or create the run "
                    "with normalize_std on", field=f"groups.{g}.trajectories",
                )

    def _check_versions(self, job: TrainJob, spec: RunSpec, latest: int, parent: int) -> None:
        """Each trajectory's version against `parent`, the version this job trains from: the newest
        registered one (`latest`), or an older one when newer ones cannot be trained from (their
        files gone or not verifying). Distance is counted from `parent`, the policy the step updates
        (the importance ratio corrects for the sampling policy either way, within
        max_staleness_steps), so a run whose newest version is broken goes on from the one before."""
        for g, group in enumerate(job.groups):
            for t, traj in enumerate(group.trajectories):
                field = f"groups.{g}.trajectories.{t}.version"
                if traj.version > latest:
                    raise JobRejected(
                        f"{field}: version {traj.version} is newer than run {spec.name!r}'s latest "
                        f"version {latest}; it cannot have sampled this trajectory", field=field,
                    )
                if traj.version - parent > spec.max_staleness_steps:
                    raise JobRejected(
                        f"{field}: the trajectory comes from version {traj.version}, but run {spec.name!r} "
                        f"trains from version {parent}: the files of version(s) {parent + 1}-{latest} are "
                        "gone from the store or do not verify (the trainer's log says which), and a step "
                        f"from version {parent} is {traj.version - parent} versions from it, more than "
                        f"max_staleness_steps={spec.max_staleness_steps}; sample again from version {parent} "
                        f"(pin model '{spec.name}@v{parent}')", field=field,
                    )
                if parent - traj.version > spec.max_staleness_steps:
                    raise JobRejected(
                        f"{field}: the trajectory comes from version {traj.version}, "
                        f"{parent - traj.version} versions older than version {parent} this job trains "
                        f"from; run {spec.name!r} allows max_staleness_steps={spec.max_staleness_steps}"
                        + self._not_serving(spec.name, parent),
                        field=field,
                    )

    def _not_serving(self, run: str, parent: int) -> str:
        """Why a client may have no newer rollouts: the version the job trains from does not serve."""
        try:
            serving = self.registry.serving(run)
        except TandemError:
            return ""
        if serving >= parent:
            return ""
        return (f"; version {parent} does not serve (inference serves version {serving}: its adapter_rejected "
                "event says why, e.g. the engine's adapter slots are full), so no rollout of it can exist; "
                "fix that and restart the inference service, which loads the newest version, or allow "
                "staler rollouts with a new run")

    # training -----------------------------------------------------------------
    def _resume_point(self, run: str, latest: int) -> int:
        """The version training starts from: the newest registered one, or, when its files are
        gone from the store (a directory deleted by hand), the newest one below it whose files
        are all there (0: a fresh adapter). The new version's manifest names it as parent."""
        if latest == 0 or self.backend.active == (run, latest):
            return latest
        if not self.store.run_dir(run).is_dir():
            # not one version deleted by hand: the run's whole directory (or the store) is not there,
            # as when a volume failed to mount; starting over from the base model would throw the
            # run's training away without a word
            raise CheckpointError(
                f"run {run!r} has {latest} registered version(s) but its directory {self.store.run_dir(run)} "
                f"is not in the adapter store {self.store.root} (a volume not mounted?); mount the store the "
                "run was trained in, or create a new run to start over from the base model")
        for version in range(latest, 0, -1):
            missing = self._missing(run, version)
            if missing is None:
                if version != latest:
                    log.warning("train.resumed run=%s from_version=%d newest=%d: the newer versions' files "
                                "are gone from the store or do not verify", run, version, latest)
                return version
            log.warning("train.skip run=%s version=%d: %s", run, version, missing)
        return 0

    def _missing(self, run: str, version: int) -> str | None:
        """Why a version's files cannot be trained from (its manifest or a file it lists is
        missing, or a checksum does not match: a version torn by a power loss before its
        files reached the disk), or None."""
        try:
            self.store.verify(run, version)
        except AdapterRejected as exc:
            return str(exc)
        return None

    def _train(self, job: TrainJob, spec: RunSpec, info: ModelInfo, latest: int, parent: int, digest: str,
               gpu_wait_s: float | None = None) -> Trained:
        """One step from `parent` (the run's newest intact version), staged in host memory as version
        `latest + 1`: everything of the job that needs the device. `digest` is the job's
        `groups_digest`, for the manifest.

        `gpu_wait_s` (shared mode: how long the job waited for the GPU) goes into the version's
        metrics with the rest, so `adapter_ready` carries it too: a client that takes its result
        from the event, before rq has the job's, sees the same metrics.
        """
        started = time.perf_counter()
        samples: list[Sample] = []
        rewards: list[float] = []
        flat_groups = 0
        for group in job.groups:
            adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float64),
                                   normalize_std=spec.loss.normalize_std)
            flat_groups += int(not adv.any())
            rewards += group.rewards
            samples += [
                Sample(t.prompt_ids, t.completion_ids, t.rollout_logprobs, t.mask, float(a), t.temperature)
                for t, a in zip(group.trajectories, adv, strict=True)
            ]
        order = StepOrder(
            spec=spec, parent=parent, samples=samples, pad_id=info.pad_id, entropy=self.entropy,
            version_dir=str(self.store.version_dir(job.run, parent)) if parent else None,
            budget=self.settings.backend.micro_batch_tokens,
        )
        clock = StageClock(self.backend.synchronize if self.settings.backend.step_breakdown else None)
        if self.group is not None:
            with clock.stage("order"):
                self.group.send("step", order=order.model_dump(mode="json"))
        step = train_step(self.backend, order, self.group, clock)
        train_s = time.perf_counter() - started
        stepped_at = time.time()
        staging = time.perf_counter()
        with clock.stage("stage_adapter"):
            adapter = self.backend.stage_adapter()
        stage_ms = (time.perf_counter() - staging) * 1000
        metrics = {
            **step.stats.metrics(), **reward_stats(rewards), **rollout_stats(job.groups, latest),
            "grad_norm": step.grad_norm,
            "tokens": float(step.tokens), "sequences": float(len(samples)),
            "sequence_tokens": float(sum(s.length for s in samples)),
            "groups": float(len(job.groups)), "zero_advantage_groups": float(flat_groups),
            "microbatches": float(step.microbatches), "epochs": float(spec.loss.epochs), "train_s": train_s,
            "ranks": float(self.group.world if self.group is not None else 1),
        }
        if gpu_wait_s is not None:
            metrics["gpu_wait_s"] = gpu_wait_s
        metrics.update(clock.metrics())
        unwritable = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        if unwritable:  # JSON has no inf or NaN: the manifest would not read back
            log.warning("train.metrics run=%s job_id=%s not finite, left out of the manifest: %s",
                        job.run, job.job_id, {k: metrics.pop(k) for k in unwritable})
        manifest = Manifest(
            run=job.run, version=latest + 1, parent=parent, step=job.step, job_id=job.job_id,
            job_digest=digest, base_model=spec.base_model, lora_rank=spec.lora.r, metrics=metrics,
        )
        return Trained(manifest, adapter, train_s=train_s, stepped_at=stepped_at, stage_ms=stage_ms)

    def _publish(self, job: TrainJob, trained: Trained) -> TrainResult:
        t0 = time.perf_counter()
        result = self.publisher.publish(job, trained.manifest, trained.adapter, train_s=trained.train_s,
                                        stepped_at=trained.stepped_at, stage_ms=trained.stage_ms)
        self.metrics.stage_seconds.labels("publish").observe(time.perf_counter() - t0)
        version_dir = self.store.version_dir(job.run, result.version)
        self.backend.mark_active(job.run, result.version, version_dir)
        self._tell("published", run=job.run, version=result.version, version_dir=str(version_dir))
        return result

    def _invalidate(self) -> None:
        """Forget the version in memory, on every rank."""
        self.backend.invalidate()
        self._tell("invalidate")

    def _tell(self, kind: str, **body: JsonValue) -> None:
        """Tell the other ranks how the job ended; when they are gone, they restart anyway and
        the job's outcome stands (the worker then stops, see worker.py)."""
        if self.group is None or self.group.broken:
            return
        try:
            self.group.send(kind, **body)
        except RanksLost as exc:
            log.warning("the other ranks are gone (%s); the worker stops after this job", exc)

    def _track(self, job: TrainJob, spec: RunSpec, result: TrainResult, stepped_at: float) -> None:
        """Log the step to the experiment tracker; a tracker that fails costs only its curve."""
        assert self.tracker is not None
        t0 = time.perf_counter()
        try:
            self.tracker.log_step(spec, result, stepped_at, self.events)
        except Exception as exc:  # noqa: BLE001 - the version is out; the tracker is not on its path
            self.metrics.tracker_errors.inc()
            log.warning("tracker.failed run=%s version=%d: %s", job.run, result.version, exc, exc_info=True)
            return
        log.info("tracker.logged run=%s version=%d step=%d duration_s=%.3f", job.run, result.version, job.step,
                 time.perf_counter() - t0)

    def _save_state(self, job: TrainJob, version: int, parent: int) -> None:
        """Attach the optimizer state to the published version; a failure costs only the state."""
        state: dict[str, JsonValue] = {"run": job.run, "version": version, "parent": parent, "step": job.step,
                                    "job_id": job.job_id}
        t0 = time.perf_counter()
        try:
            with self.store.trainer_state(job.run, version) as state_dir:
                self.backend.save_state(state_dir, trainer_state=state)
                failpoints.hit("state_written")
            log.info("state.saved run=%s version=%d state_ms=%.1f", job.run, version, (time.perf_counter() - t0) * 1000)
            self.metrics.stage_seconds.labels("state").observe(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - the version is already out; only its state is lost
            unexpected = not isinstance(exc, CheckpointError | OSError | VersionExists)
            log.warning("trainer state of %s v%d not saved (%s); resuming from it starts the optimizer fresh",
                        job.run, version, exc, exc_info=unexpected)
            if unexpected:
                self._invalidate()  # e.g. a device error: reload from the store next time


def not_retried(exc: BaseException) -> bool:
    """A failure that a retry would meet again: bad input, or the job running out of its time (rq's
    timeout; the client has given up on the job by then)."""
    return isinstance(exc, JobRejected | JobTimeoutException) or isinstance(exc.__cause__, JobTimeoutException)
