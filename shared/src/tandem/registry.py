"""The run and version registry in Redis: what exists, what is newest, what serves.

The trainer registers each version after publishing it to the store; the controller
records what it serves. Inference reconciles against this registry at start-up, so even a
lost event cannot leave it serving a stale version.

Every public method raises `BackendUnavailable`, naming the Redis URL, when Redis fails; no
redis-py error leaves this module.
"""

from __future__ import annotations

from typing import Any

import redis
from pydantic import ValidationError

from tandem import keys
from tandem.adapters import Manifest
from tandem.connection import translated
from tandem.errors import RunExists, RunNotFound, ValidationFailed
from tandem.runs import RunSpec


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _members(reply: list[bytes | str] | list[tuple[bytes | str, Any]] | list[list[Any]]) -> list[bytes | str]:
    """Members of a sorted-set range read without scores (redis-py types the reply as every shape)."""
    members: list[bytes | str] = []
    for m in reply:
        if not isinstance(m, bytes | str):
            raise TypeError(f"expected a sorted-set member without score, got {m!r}")
        members.append(m)
    return members


class Registry:
    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    # runs -----------------------------------------------------------------
    def create_run(self, spec: RunSpec, *, exist_ok: bool = True) -> RunSpec:
        """Register a run; an existing run with the same spec is returned as it is."""
        raw = spec.model_dump_json()
        with translated(self.conn, f"register run {spec.name!r}"):
            if self.conn.set(keys.run(spec.name), raw, nx=True):
                self.conn.sadd(keys.RUNS, spec.name)
                return spec
        existing = self.get_run(spec.name)
        if existing != spec or not exist_ok:
            raise RunExists(
                f"run {spec.name!r} exists with another spec ({existing.model_dump_json()}); "
                "pick another name or open it with the same settings"
            )
        return existing

    def get_run(self, name: str) -> RunSpec:
        with translated(self.conn, f"read run {name!r}"):
            raw = self.conn.get(keys.run(name))
        if raw is None:
            raise RunNotFound(f"unknown run {name!r}; known runs: {self.list_runs()}")
        try:
            return RunSpec.model_validate_json(raw)
        except ValidationError as exc:
            raise ValidationFailed(
                f"run {name!r} in Redis ({keys.run(name)}) is not a valid run spec ({exc.error_count()} "
                f"problems, first: {exc.errors()[0]['msg']}); delete that key and create the run again",
                field="run",
            ) from exc

    def list_runs(self) -> list[str]:
        with translated(self.conn, "list runs"):
            return sorted(_text(m) for m in self.conn.smembers(keys.RUNS))

    def next_step(self, run: str) -> int:
        """Allocate the next client-side train step number (1, 2, ...)."""
        with translated(self.conn, f"allocate a train step of run {run!r}"):
            return int(self.conn.incr(keys.run_steps(run)))

    # versions -------------------------------------------------------------
    def register_version(self, manifest: Manifest) -> None:
        """Record a published version and the job that made it (idempotent)."""
        with translated(self.conn, f"register version {manifest.version} of run {manifest.run!r}"):
            pipe = self.conn.pipeline()
            pipe.zremrangebyscore(keys.run_versions(manifest.run), manifest.version, manifest.version)
            pipe.zadd(keys.run_versions(manifest.run), {manifest.model_dump_json(): manifest.version})
            pipe.hset(keys.run_jobs(manifest.run), manifest.job_id, manifest.version)
            pipe.execute()

    def latest_version(self, run: str) -> int:
        """Newest registered version (0 = only the base model)."""
        with translated(self.conn, f"read the versions of run {run!r}"):
            top = self.conn.zrevrange(keys.run_versions(run), 0, 0, withscores=True)
        return int(top[0][1]) if top else 0

    def manifest(self, run: str, version: int) -> Manifest | None:
        with translated(self.conn, f"read version {version} of run {run!r}"):
            found = _members(self.conn.zrangebyscore(keys.run_versions(run), version, version))
        return Manifest.model_validate_json(found[0]) if found else None

    def manifests(self, run: str) -> list[Manifest]:
        """Every registered version, oldest first."""
        with translated(self.conn, f"read the versions of run {run!r}"):
            found = _members(self.conn.zrange(keys.run_versions(run), 0, -1))
        return [Manifest.model_validate_json(m) for m in found]

    def version_of_job(self, run: str, job_id: str) -> int | None:
        with translated(self.conn, f"read the version of job {job_id} of run {run!r}"):
            raw = self.conn.hget(keys.run_jobs(run), job_id)
        return int(raw) if raw is not None else None

    # serving --------------------------------------------------------------
    def set_serving(self, run: str, version: int) -> None:
        with translated(self.conn, f"record that run {run!r} serves version {version}"):
            self.conn.set(keys.run_serving(run), version)

    def serving(self, run: str) -> int:
        """Version the inference side routes the run to (0 = base model)."""
        with translated(self.conn, f"read the serving version of run {run!r}"):
            raw = self.conn.get(keys.run_serving(run))
        return int(raw) if raw is not None else 0
