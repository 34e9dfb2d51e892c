"""One train job, end to end: validate, lock the run, train one GRPO step, publish, announce.

The job is the unit of idempotency. A job that already published (the registry maps its id
to a version) returns that version again, appending its `adapter_ready` if a crash between
register and announce left the stream without it; a job whose version reached the store but
not the registry (a crash between rename and register) has that version adopted; only
otherwise does it train. A per-run lock in Redis makes sure two workers never train one run at once,
and everything that could make a job fail the same way every time is checked before any
work, so bad input fails fast with a message that names the field.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import torch

from tandem import keys
from tandem.adapters import ADAPTER_DIR, AdapterStore, Manifest
from tandem.errors import AdapterRejected, RunNotFound, ValidationFailed, VersionExists
from tandem.events import Event, EventKind, EventStream
from tandem.jobs import TrainJob, TrainResult, parse_job
from tandem.registry import Registry
from tandem.runs import RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer import failpoints
from tandem_trainer.backend import Backend, ModelInfo
from tandem_trainer.errors import JobRejected, LockTimeout, TrainStepFailed
from tandem_trainer.grpo import LossStats, group_advantages, grpo_loss, reward_stats
from tandem_trainer.microbatch import Sample, accumulation_weights, build_microbatches
from tandem_trainer.sharing import SharedGpu

log = logging.getLogger(__name__)

#: How far the trainer's clock may run ahead of Redis's, in seconds, when looking for an
#: announcement in the stream (entry ids are Redis's milliseconds).
ANNOUNCE_SKEW_S = 60.0

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_STEAL = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3]) end return false"
)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class RunLock:
    """SET NX PX lock on one run; a holder whose worker is gone is taken over at once.

    The value is `<owner>|<nonce>`; `holder_alive(owner)` says whether that worker still
    lives (worker.py answers from its liveness keys), so a worker killed while training does
    not block the run until the lock's TTL runs out.
    """

    def __init__(
        self, conn: redis.Redis, run: str, owner: str, holder_alive: Callable[[str], bool]
    ) -> None:
        self.conn, self.key, self.holder_alive = conn, keys.run_lock(run), holder_alive
        self.value = f"{owner}|{uuid.uuid4().hex[:12]}"

    def acquire(self, ttl_ms: int, wait_s: float) -> None:
        deadline, pause = time.monotonic() + wait_s, 0.05
        while True:
            if self.conn.set(self.key, self.value, nx=True, px=ttl_ms):
                return
            raw = self.conn.get(self.key)
            held = raw.decode() if isinstance(raw, bytes) else raw
            if held == self.value:
                return  # our own SET went through; its reply was lost to a dropped connection
            if held is not None and not self.holder_alive(held.split("|")[0]):
                if self.conn.eval(_STEAL, 1, self.key, held, self.value, ttl_ms):
                    log.warning("run lock %s taken over from dead holder %s", self.key, held)
                    return
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.key} stayed held by {held!r} for {wait_s:.0f}s; retry later")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def release(self) -> None:
        self.conn.eval(_RELEASE, 1, self.key, self.value)


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
    ) -> None:
        self.settings, self.conn, self.backend = settings, conn, backend
        self.gpu = gpu
        """Shared mode: the GPU lease held around each job's compute (None in split/cpu mode)."""
        self.store = store or AdapterStore(settings.store.root)
        self.registry, self.events = Registry(conn), EventStream(conn)
        self.owner, self.holder_alive, self.entropy = owner, holder_alive, entropy

    # the job ------------------------------------------------------------------
    def train(self, payload: TrainJob | dict[str, Any], *, retries_left: int = 0,
              job_id: str | None = None) -> TrainResult:
        """Train one job (or find what it already published); raise JobRejected on bad input.

        `retries_left` is how often the queue will run the job again if it fails for a reason
        other than its input; it goes into the `train_failed` event so that a client can tell
        a final failure from one that a retry may still fix. `job_id` (the queue's id of the
        job) names the job in that event when the payload does not.
        """
        started = time.perf_counter()
        raw = payload.model_dump(mode="json") if isinstance(payload, TrainJob) else payload
        run = raw.get("run") if isinstance(raw, dict) else None
        named = raw.get("job_id") if isinstance(raw, dict) else None
        run, job_id = run if isinstance(run, str) else "", named if isinstance(named, str) else job_id
        log.info("train.start run=%s job_id=%s", run, job_id)
        version: int | None = None
        try:
            job = self._parse(raw)
            result = self._reused(job)
            if result is None:
                spec = self._run(job.run)
                info = self.backend.model_info(spec.base_model)
                self._check_tokens(job, info)
                lock = RunLock(self.conn, job.run, self.owner, self.holder_alive)
                lock.acquire(ttl_ms=job.timeout_s * 1000, wait_s=job.timeout_s)
                failpoints.hit("lock_taken")
                try:
                    result = self._adopt_orphans(job)
                    if result is None:
                        latest = self.registry.latest_version(job.run)
                        version = latest + 1
                        self._check_versions(job, spec, latest)
                        if self.gpu is None:
                            result = self._train(job, spec, info, latest)
                        else:
                            with self.gpu.held() as waited:
                                result = self._train(job, spec, info, latest)
                            result.metrics["gpu_wait_s"] = waited
                        # off the path to serving: after the announcement, and after the GPU went
                        # back to inference in shared mode
                        self._save_state(job, version, result.parent)
                finally:
                    lock.release()
        except Exception as exc:
            if not isinstance(exc, JobRejected):
                self.backend.invalidate()  # partial gradients or a half-done step: reload next time
            failure = self._translate(exc)
            field = failure.field if isinstance(failure, ValidationFailed) else None
            log.warning(
                "train.failed run=%s job_id=%s duration_s=%.3f field=%s error=%s message=%s",
                run, job_id, time.perf_counter() - started, field, type(failure).__name__, failure,
            )
            self.events.append(Event(
                kind=EventKind.TRAIN_FAILED, run=run, version=version, job_id=job_id,
                data={"message": str(failure), "field": field,
                      "retries_left": 0 if isinstance(failure, JobRejected) else retries_left},
            ))
            if failure is exc:
                raise
            raise failure from exc
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
        return exc

    # validation ---------------------------------------------------------------
    @staticmethod
    def _parse(raw: Any) -> TrainJob:
        try:
            return parse_job(raw)
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
        if not any(any(traj.mask) for group in job.groups for traj in group.trajectories):
            raise JobRejected("groups: every completion token is masked out; nothing to train on",
                              field="groups")

    @staticmethod
    def _check_versions(job: TrainJob, spec: RunSpec, parent: int) -> None:
        for g, group in enumerate(job.groups):
            for t, traj in enumerate(group.trajectories):
                field = f"groups.{g}.trajectories.{t}.version"
                if traj.version > parent:
                    raise JobRejected(
                        f"{field}: version {traj.version} is newer than run {spec.name!r}'s latest "
                        f"version {parent}; it cannot have sampled this trajectory", field=field,
                    )
                if parent - traj.version > spec.max_staleness_steps:
                    raise JobRejected(
                        f"{field}: the trajectory comes from version {traj.version}, "
                        f"{parent - traj.version} versions older than version {parent} this job trains "
                        f"from; run {spec.name!r} allows max_staleness_steps={spec.max_staleness_steps}",
                        field=field,
                    )

    # idempotency --------------------------------------------------------------
    def _reused(self, job: TrainJob) -> TrainResult | None:
        """The version this job already published, announced (again, if a crash cut that off)."""
        version = self.registry.version_of_job(job.run, job.job_id)
        manifest = self.registry.manifest(job.run, version) if version is not None else None
        if manifest is None:
            return None
        if not self._announced(manifest):
            log.warning("announce.resumed run=%s version=%d job_id=%s: registered but never announced",
                        manifest.run, manifest.version, manifest.job_id)
            self._append_ready(manifest, published_at=manifest.created_at)
        return self._result(manifest, reused=True)

    def _announced(self, manifest: Manifest) -> bool:
        """Whether the stream holds this version's `adapter_ready`.

        It was appended after the version's publish, so only entries since then (less a margin
        for clock skew between the trainer and Redis) are read. A stream trimmed past it reads
        as not announced, and the version is announced again: harmless to consumers.
        """
        since = max(0, int((manifest.created_at - ANNOUNCE_SKEW_S) * 1000))
        start, page = f"{since}-0", 1000
        want = {"kind": EventKind.ADAPTER_READY.value, "run": manifest.run, "version": str(manifest.version)}
        while True:
            entries = self.conn.xrange(keys.EVENTS, min=start, count=page) or []
            for entry_id, raw in entries:
                fields = {_text(k): _text(v) for k, v in (raw or {}).items()}
                if all(fields.get(k) == v for k, v in want.items()):
                    return True
                if entry_id is not None:
                    start = f"({_text(entry_id)}"  # exclusive: the next page starts after it
            if len(entries) < page:
                return False

    def _save_state(self, job: TrainJob, version: int, parent: int) -> None:
        """Attach the optimizer state to the published version; a failure costs only the state."""
        state = {"run": job.run, "version": version, "parent": parent, "step": job.step, "job_id": job.job_id}
        t0 = time.perf_counter()
        try:
            with self.store.trainer_state(job.run, version) as state_dir:
                self.backend.save_state(state_dir, trainer_state=state)
                failpoints.hit("state_written")
            log.info("state.saved run=%s version=%d state_ms=%.1f", job.run, version, (time.perf_counter() - t0) * 1000)
        except Exception as exc:  # noqa: BLE001 - the version is already out; only its state is lost
            unexpected = not isinstance(exc, (OSError, VersionExists))
            log.warning("trainer state of %s v%d not saved (%s); resuming from it starts the optimizer fresh",
                        job.run, version, exc, exc_info=unexpected)
            if unexpected:
                self.backend.invalidate()  # e.g. a device error: reload from the store next time

    def _adopt_orphans(self, job: TrainJob) -> TrainResult | None:
        """Register versions that reached the store but not the registry; ours is returned.

        Only a crash between rename and register leaves such a version, and it always sits
        above the newest registered one. Adopting every one in order (whoever's job made it)
        keeps the version chain linear, and the job that made it finds it on retry.
        """
        result = self._reused(job)
        if result is not None:
            return result
        latest = self.registry.latest_version(job.run)
        for version in self.store.versions(job.run):
            if version <= latest:
                continue
            try:
                manifest = self.store.verify(job.run, version)
            except AdapterRejected as exc:
                vdir = self.store.version_dir(job.run, version)
                vdir.rename(vdir.with_name(f".tmp-rejected-{vdir.name}-{uuid.uuid4().hex[:8]}"))
                log.warning("orphan %s v%d failed verification (%s); moved aside", job.run, version, exc)
                break
            self._announce(manifest, published_at=time.time())
            log.info("orphan.adopted run=%s version=%d job_id=%s", job.run, version, manifest.job_id)
        return self._reused(job)

    def _announce(self, manifest: Manifest, *, published_at: float, stepped_at: float | None = None) -> None:
        """Register the version and append `adapter_ready`.

        `stepped_at` (the last optimizer step) and `published_at` (the version renamed into
        place) let anyone reading the stream time each stage of the sync path.
        """
        self.registry.register_version(manifest)
        failpoints.hit("after_register")
        self._append_ready(manifest, published_at=published_at, stepped_at=stepped_at)

    def _append_ready(self, manifest: Manifest, *, published_at: float, stepped_at: float | None = None) -> None:
        adapter = self.store.adapter_dir(manifest.run, manifest.version)
        self.events.append(Event(
            kind=EventKind.ADAPTER_READY, run=manifest.run, version=manifest.version, job_id=manifest.job_id,
            data={
                "path": str(adapter.relative_to(self.store.root)),
                "step": manifest.step, "parent": manifest.parent, "metrics": manifest.metrics,
                "published_at": published_at, "stepped_at": stepped_at,
            },
        ))

    @staticmethod
    def _result(manifest: Manifest, *, reused: bool, train_s: float = 0.0,
                published_at: float | None = None) -> TrainResult:
        return TrainResult(
            job_id=manifest.job_id, run=manifest.run, step=manifest.step, version=manifest.version,
            parent=manifest.parent, metrics=manifest.metrics, train_s=train_s,
            published_at=manifest.created_at if published_at is None else published_at, reused=reused,
        )

    # training -----------------------------------------------------------------
    def _resume_point(self, run: str, latest: int) -> int:
        """The version training starts from: the newest registered one, or, when its files are
        gone from the store (a directory deleted by hand), the newest one below it whose files
        are all there (0: a fresh adapter). The new version's manifest names it as parent."""
        if latest == 0 or self.backend.active == (run, latest):
            return latest
        for version in range(latest, 0, -1):
            missing = self._missing(run, version)
            if missing is None:
                if version != latest:
                    log.warning("train.resumed run=%s from_version=%d newest=%d: the newer versions' files "
                                "are gone from the store", run, version, latest)
                return version
            log.warning("train.skip run=%s version=%d: %s", run, version, missing)
        return 0

    def _missing(self, run: str, version: int) -> str | None:
        """What is missing from a version's directory (its manifest, a file it lists), or None."""
        try:
            manifest = self.store.read_manifest(run, version)
        except AdapterRejected as exc:
            return str(exc)
        vdir = self.store.version_dir(run, version)
        gone = sorted(rel for rel in manifest.files if not (vdir / rel).is_file())
        return f"{run} v{version}: {', '.join(gone)} missing" if gone else None

    def _train(self, job: TrainJob, spec: RunSpec, info: ModelInfo, latest: int) -> TrainResult:
        """One step from the run's newest intact version; publishes version `latest + 1`."""
        started = time.perf_counter()
        parent = self._resume_point(job.run, latest)
        samples, rewards, flat_groups = [], [], 0
        for group in job.groups:
            adv = group_advantages(torch.tensor(group.rewards), normalize_std=spec.loss.normalize_std)
            flat_groups += int(not adv.any())
            rewards += group.rewards
            samples += [
                Sample(t.prompt_ids, t.completion_ids, t.rollout_logprobs, t.mask, float(a))
                for t, a in zip(group.trajectories, adv, strict=True)
            ]
        self.backend.activate(spec, parent, self.store.version_dir(job.run, parent) if parent else None)
        batches = build_microbatches(samples, self.settings.backend.micro_batch_tokens, pad_id=info.pad_id)
        weights = accumulation_weights([mb.tokens for mb in batches])
        stats, grad_norms = LossStats(), []
        for _ in range(spec.loss.epochs):
            for mb, weight in zip(batches, weights, strict=True):
                if weight == 0:
                    continue
                mb = mb.to(self.backend.device)
                fwd = self.backend.forward(mb, entropy=self.entropy)
                ref = self.backend.reference_logprobs(mb) if spec.loss.kl_coef > 0 else None
                terms = grpo_loss(
                    fwd.logprobs, mb.rollout_logprobs, mb.advantages, mb.mask,
                    clip_low=spec.loss.clip_low, clip_high=spec.loss.clip_high,
                    ref_logprobs=ref, kl_coef=spec.loss.kl_coef,
                )
                loss_value = float(terms.loss.detach())
                if not math.isfinite(loss_value):
                    raise TrainStepFailed(f"the loss is {loss_value} on micro-batch {mb.indices}")
                (terms.loss * weight).backward()
                failpoints.hit("mid_training")
                stats.add(terms.sums)
                if fwd.entropy is not None:
                    stats.add({"entropy": float((fwd.entropy * mb.mask).sum())})
            grad_norms.append(self.backend.step(spec.optimizer.max_grad_norm))
        train_s = time.perf_counter() - started
        stepped_at = time.time()
        metrics = {
            **stats.metrics(), **reward_stats(rewards), "grad_norm": grad_norms[-1],
            "tokens": float(sum(mb.tokens for mb in batches)), "sequences": float(len(samples)),
            "groups": float(len(job.groups)), "zero_advantage_groups": float(flat_groups),
            "microbatches": float(len(batches)), "epochs": float(spec.loss.epochs), "train_s": train_s,
        }
        return self._publish(job, spec, latest + 1, parent, metrics, train_s, stepped_at)

    def _publish(self, job: TrainJob, spec: RunSpec, version: int, parent: int, metrics: dict[str, float],
                 train_s: float, stepped_at: float) -> TrainResult:
        removed = self.store.remove_stale_staging(job.run)
        if removed:
            log.info("store.staging.cleaned run=%s removed=%d", job.run, removed)
        manifest = Manifest(
            run=job.run, version=version, parent=parent, step=job.step, job_id=job.job_id,
            base_model=spec.base_model, lora_rank=spec.lora.r, metrics=metrics,
        )
        t0 = time.perf_counter()
        with self.store.staging(job.run, version) as staged:
            failpoints.hit("staging_created")
            self.backend.save_adapter(staged / ADAPTER_DIR)
            failpoints.hit("weights_written")
            t1 = time.perf_counter()
            manifest = self.store.publish(staged, manifest)
        failpoints.hit("after_rename")
        published_at = time.time()
        t2 = time.perf_counter()
        self._announce(manifest, published_at=published_at, stepped_at=stepped_at)
        failpoints.hit("after_announce")
        log.info("publish run=%s version=%d save_ms=%.1f checksum_fsync_rename_ms=%.1f announce_ms=%.1f",
                 job.run, version, (t1 - t0) * 1000, (t2 - t1) * 1000, (time.perf_counter() - t2) * 1000)
        self.backend.mark_active(job.run, version, self.store.version_dir(job.run, version))
        return self._result(manifest, reused=False, train_s=train_s, published_at=published_at)
