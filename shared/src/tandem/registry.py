"""The run and version registry in Redis: what exists, what is newest, what serves.

The trainer registers each version after publishing it to the store; the controller
records what it serves and holds, and counts its load attempts. Inference reconciles
against this registry at start-up, so even a lost event cannot leave it serving a stale
version.

Every public method raises `BackendUnavailable`, naming the Redis URL, when Redis fails; no
redis-py error leaves this module. A stored value that does not parse (anyone who can write
to Redis can write one) is `ValidationFailed` naming its key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from pydantic import ValidationError

from tandem import keys
from tandem.adapters import Manifest
from tandem.connection import text, translated
from tandem.errors import RunExists, RunNotFound, ValidationFailed
from tandem.runs import RunSpec, tinker_model_hint

T = TypeVar("T")

#: Tries of `create_run` while other writers change what it watches (the run, the deleted runs).
CREATE_ATTEMPTS = 20


def _members(reply: list[bytes | str] | list[tuple[bytes | str, Any]] | list[list[Any]]) -> list[bytes | str]:
    """Members of a sorted-set range read without scores (redis-py types the reply as every shape)."""
    members: list[bytes | str] = []
    for m in reply:
        if not isinstance(m, bytes | str):
            raise TypeError(f"expected a sorted-set member without score, got {m!r}")
        members.append(m)
    return members


def _parsed(key: str, raw: bytes | str, parse: Callable[[bytes | str], T], what: str) -> T:
    """`parse(raw)`, or ValidationFailed naming `key` and what it should hold."""
    try:
        return parse(raw)
    except (ValueError, ValidationError) as exc:  # ValidationError is a ValueError; named for the reader
        raise ValidationFailed(
            f"{key} in Redis holds {raw[:200]!r}, not {what} ({str(exc).splitlines()[0]}); tandem writes it, "
            "so something else did: delete the key, or the value",
            field=key,
        ) from exc


def _version_list(raw: bytes | str) -> list[int]:
    versions = json.loads(raw)
    if not isinstance(versions, list) or not all(type(v) is int for v in versions):
        raise ValueError("expected a JSON list of version numbers")
    return versions


class Registry:
    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    # runs -----------------------------------------------------------------
    def create_run(self, spec: RunSpec, *, exist_ok: bool = True) -> RunSpec:
        """Register a run; an existing run with the same spec is returned as it is.

        A name whose deleted run's versions are still in the store (`keys.DELETED_RUNS`, until the
        trainer removed them) is refused with RunExists; the check and the creation are one
        transaction, so a deletion cannot come between them.
        """
        name = spec.name
        for _ in range(CREATE_ATTEMPTS):
            with translated(self.conn, f"register run {name!r}"), self.conn.pipeline() as pipe:
                try:
                    pipe.watch(keys.run(name), keys.DELETED_RUNS)  # type: ignore[no-untyped-call]
                    if pipe.sismember(keys.DELETED_RUNS, name):
                        raise RunExists(
                            f"run {name!r} was deleted and the trainer has not yet removed its versions from the "
                            "adapter store (a live trainer does within seconds); create it again after that, "
                            "or pick another name")
                    pipe.multi()
                    # SETNX, not SET NX: the client's Redis user may create a key, never overwrite one (tandem.acl)
                    pipe.setnx(keys.run(name), spec.model_dump_json())
                    pipe.sadd(keys.RUNS, name)
                    created, _ = pipe.execute()
                except redis.WatchError:
                    continue  # created, or a run deleted meanwhile: look again
            if created:
                return spec
            break
        existing = self.get_run(name)
        if existing != spec or not exist_ok:
            raise RunExists(
                f"run {name!r} exists with another spec ({existing.model_dump_json()}); "
                "pick another name or open it with the same settings"
            )
        return existing

    def get_run(self, name: str) -> RunSpec:
        with translated(self.conn, f"read run {name!r}"):
            raw = self.conn.get(keys.run(name))
        if raw is None:
            raise RunNotFound(f"unknown run {name!r}; known runs: {self.list_runs()}{tinker_model_hint(name)}")
        try:
            return RunSpec.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the spec"
            raise ValidationFailed(
                f"run {name!r} in Redis ({keys.run(name)}) is not a valid run spec ({exc.error_count()} "
                f"problems, first: {where}: {first['msg']}); delete that key and create the run again",
                field="run",
            ) from exc

    def list_runs(self) -> list[str]:
        with translated(self.conn, "list runs"):
            return sorted(text(m) for m in self.conn.smembers(keys.RUNS))

    def has_run(self, name: str) -> bool:
        """Whether the run is registered (its spec is there)."""
        with translated(self.conn, f"look up run {name!r}"):
            return self.conn.get(keys.run(name)) is not None

    def deleted_runs(self) -> list[str]:
        """Deleted runs whose directories the trainer has yet to remove from the store (tandem.deletion)."""
        with translated(self.conn, f"read {keys.DELETED_RUNS}"):
            return sorted(text(m) for m in self.conn.smembers(keys.DELETED_RUNS))

    def forget_deleted(self, name: str) -> None:
        """The deleted run's directory is gone from the store: its name may be created again."""
        with translated(self.conn, f"remove run {name!r} from {keys.DELETED_RUNS}"):
            self.conn.srem(keys.DELETED_RUNS, name)

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

    def versions(self, run: str) -> list[int]:
        """The registered version numbers, oldest first (retention may have removed older ones)."""
        with translated(self.conn, f"read the versions of run {run!r}"):
            scored = self.conn.zrange(keys.run_versions(run), 0, -1, withscores=True)
        return [int(pair[1]) for pair in scored]

    def versions_of(self, runs: list[str]) -> dict[str, list[int]]:
        """`versions` of each run, in one round trip."""
        with translated(self.conn, f"read the versions of {len(runs)} runs"):
            pipe = self.conn.pipeline(transaction=False)
            for run in runs:
                pipe.zrange(keys.run_versions(run), 0, -1, withscores=True)
            replies = pipe.execute()
        return {run: [int(pair[1]) for pair in scored] for run, scored in zip(runs, replies, strict=True)}

    def manifest(self, run: str, version: int) -> Manifest | None:
        with translated(self.conn, f"read version {version} of run {run!r}"):
            found = _members(self.conn.zrangebyscore(keys.run_versions(run), version, version))
        key = keys.run_versions(run)
        return _parsed(key, found[0], Manifest.model_validate_json, "a version manifest") if found else None

    def manifests(self, run: str) -> list[Manifest]:
        """Every registered version, oldest first."""
        with translated(self.conn, f"read the versions of run {run!r}"):
            found = _members(self.conn.zrange(keys.run_versions(run), 0, -1))
        key = keys.run_versions(run)
        return [_parsed(key, m, Manifest.model_validate_json, "a version manifest") for m in found]

    def retire_version(self, run: str, version: int) -> None:
        """Forget a version the retention policy removes (its manifest); the job that made it stays
        recorded, so that a late retry of that job is refused, never trained again."""
        with translated(self.conn, f"retire version {version} of run {run!r}"):
            self.conn.zremrangebyscore(keys.run_versions(run), version, version)

    def version_of_job(self, run: str, job_id: str) -> int | None:
        with translated(self.conn, f"read the version of job {job_id} of run {run!r}"):
            raw = self.conn.hget(keys.run_jobs(run), job_id)
        return _parsed(keys.run_jobs(run), raw, int, "a version number") if raw is not None else None

    # serving --------------------------------------------------------------
    def set_serving(self, run: str, version: int) -> None:
        with translated(self.conn, f"record that run {run!r} serves version {version}"):
            self.conn.set(keys.run_serving(run), version)

    def serving(self, run: str) -> int:
        """Version the inference side routes the run to (0 = base model)."""
        with translated(self.conn, f"read the serving version of run {run!r}"):
            raw = self.conn.get(keys.run_serving(run))
        return _parsed(keys.run_serving(run), raw, int, "a version number") if raw is not None else 0

    def set_loaded(self, run: str, versions: list[int]) -> None:
        """Record the versions the engine holds for the run (written by the controller)."""
        with translated(self.conn, f"record the loaded versions of run {run!r}"):
            self.conn.set(keys.run_loaded(run), json.dumps(versions))

    def loaded(self, run: str) -> list[int]:
        """The versions the engine holds for the run, as the controller last recorded them."""
        with translated(self.conn, f"read the loaded versions of run {run!r}"):
            raw = self.conn.get(keys.run_loaded(run))
        return _parsed(keys.run_loaded(run), raw, _version_list, "a list of versions") if raw is not None else []

    def next_load_attempt(self, run: str, version: int) -> int:
        """Count one more attempt to load a version into the engine; returns its number (0, 1, ...).

        The count lives in Redis, so a restarted controller never reuses an adapter name that
        the still running engine saw from its predecessor.
        """
        with translated(self.conn, f"count the load attempts of run {run!r} version {version}"):
            return int(self.conn.hincrby(keys.run_load_attempts(run), str(version), 1)) - 1

    def load_attempt_floor(self, run: str, version: int) -> int:
        """The first load attempt of `version` that belongs to the run registered now: those below
        it were made for a deleted run of the same name (tandem.deletion); 0 when none was."""
        with translated(self.conn, f"read the load attempts of run {run!r} version {version}"):
            floor = self.conn.hget(keys.run_load_attempts(run), f"floor:{version}")
        return int(floor) if floor is not None else 0
