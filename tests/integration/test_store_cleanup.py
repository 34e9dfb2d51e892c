"""The trainer's removals from the adapter store, against a real redis-server and real store
directories: deleted runs' directories, versions retired by the retention policy, and jobs of a
run deleted under them. Nothing of another run is touched: its files byte for byte, its keys as
Redis serializes them. Each side talks to Redis as its role's user (tandem.acl); the admin sets
the scene and looks.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import redis
from helpers.adapters import publish
from helpers.jobs import make_job
from helpers.waiting import wait_until

from tandem import keys
from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.deletion import delete_run
from tandem.errors import RunExists
from tandem.registry import Registry
from tandem.replicas import Replicas, ReplicaState, RunHolding
from tandem.runs import LoraConfig, RunSpec
from tandem.settings import RetentionSettings, TrainerSettings
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.errors import JobRejected
from tandem_trainer.jobs.runner import Trainer
from tandem_trainer.store_cleanup import remove_deleted_runs, retire_old_versions

pytestmark = pytest.mark.integration


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    (tmp_path / "adapters").mkdir()
    return AdapterStore(tmp_path / "adapters")


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by its path relative to it."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def untouched(conn: redis.Redis, store: AdapterStore, run: str) -> tuple[dict[str, bytes], dict[str, bytes | None]]:
    """What another run's deletion or retention must leave alone: its files, and its keys as Redis
    serializes them (DUMP)."""
    return files(store.root / run), {key: conn.dump(key) for key in keys.run_state(run)}


def make_run(conns: dict[Role, redis.Redis], store: AdapterStore, tiny_model: Path, run: str, versions: int) -> None:
    """Create `run` (as the client) and publish `versions` versions of it (as the trainer)."""
    Registry(conns[Role.CLIENT]).create_run(RunSpec(name=run, base_model=str(tiny_model)))
    for version in range(1, versions + 1):
        publish(store, Registry(conns[Role.TRAINER]), tiny_model, run, version)


def test_a_deleted_runs_directory_is_removed_and_no_other_runs(
    redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis], store: AdapterStore, tiny_model: Path
) -> None:
    for run in ("gone", "kept"):
        make_run(role_conns, store, tiny_model, run, 2)
    kept = untouched(redis_conn, store, "kept")
    delete_run(role_conns[Role.INFERENCE], "gone")
    registry, trainer = Registry(redis_conn), role_conns[Role.TRAINER]

    # a job of the run holds its lock: the removal waits for it
    redis_conn.set(keys.run_lock("gone"), "other#1|n0nce")
    assert remove_deleted_runs(trainer, store, "me#1", lambda owner: True) == []
    assert store.versions("gone") == [1, 2] and registry.deleted_runs() == ["gone"]
    redis_conn.delete(keys.run_lock("gone"))

    assert remove_deleted_runs(trainer, store, "me#1", lambda owner: True) == ["gone"]
    assert not (store.root / "gone").exists() and sorted(os.listdir(store.root)) == ["kept"]
    assert registry.deleted_runs() == [] and not redis_conn.exists(keys.run_lock("gone"))
    assert untouched(redis_conn, store, "kept") == kept


def test_removal_follows_no_symlink_and_spares_a_registered_run(
    redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis], store: AdapterStore, tiny_model: Path
) -> None:
    make_run(role_conns, store, tiny_model, "kept", 1)
    kept_files = files(store.root / "kept")
    (store.root / "link").symlink_to(store.root / "kept")
    redis_conn.sadd(keys.DELETED_RUNS, "link", "kept")  # entries nobody's deletion wrote

    assert remove_deleted_runs(role_conns[Role.TRAINER], store, "me#1", lambda owner: True) == ["kept"]
    assert files(store.root / "kept") == kept_files and Registry(redis_conn).has_run("kept")
    assert (store.root / "link").is_symlink()  # refused, left for an operator, and tried again
    assert Registry(redis_conn).deleted_runs() == ["link"]


def test_retention_keeps_the_newest_the_served_the_held_and_the_pinned(
    redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis], store: AdapterStore, tiny_model: Path
) -> None:
    make_run(role_conns, store, tiny_model, "r", 7)
    make_run(role_conns, store, tiny_model, "other", 3)
    other = untouched(redis_conn, store, "other")
    registry = Registry(role_conns[Role.TRAINER])
    Registry(role_conns[Role.INFERENCE]).set_loaded("r", [3])  # the controller's record
    heartbeat = ReplicaState(id="rep-1", url="http://rep-1:8000", ready=True, started_at=time.time(),
                             runs={"r": RunHolding(serving=2, loaded=[2])})
    Replicas(role_conns[Role.INFERENCE]).beat(heartbeat, ttl_s=60)

    assert retire_old_versions(store, registry, "r", 7, RetentionSettings(keep_versions=0)) == []
    policy = RetentionSettings(keep_versions=2, pinned=["r@v1", "other@v2"])
    assert retire_old_versions(store, registry, "r", 7, policy) == [4, 5]
    assert store.versions("r") == [1, 2, 3, 6, 7]
    assert [m.version for m in registry.manifests("r")] == [1, 2, 3, 6, 7]
    assert registry.version_of_job("r", "job-r-4") == 4  # the job stays recorded
    assert not [p for p in (store.root / "r").iterdir() if p.name.startswith(".tmp-")]
    assert untouched(redis_conn, store, "other") == other
    for version in (1, 2, 3, 6, 7):
        store.verify("r", version)


# the trainer ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend() -> PeftBackend:
    return PeftBackend("cpu")


def trainer_of(role_urls: dict[Role, str], conns: dict[Role, redis.Redis], backend: PeftBackend, store: AdapterStore,
               tiny_model: Path, **kwargs: object) -> Trainer:
    """A Trainer as the trainer's Redis user, keeping 1 version, and its run `t` (created by the client)."""
    settings = TrainerSettings(redis={"url": role_urls[Role.TRAINER]}, store={"root": store.root},
                               backend={"micro_batch_tokens": 128}, retention={"keep_versions": 1})
    Registry(conns[Role.CLIENT]).create_run(RunSpec(name="t", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0)))
    return Trainer(settings, conns[Role.TRAINER], backend, store, **kwargs)  # type: ignore[arg-type]


def test_the_trainer_retires_after_each_publish_and_refuses_a_retired_jobs_retry(
    role_urls: dict[Role, str], redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis], backend: PeftBackend,
    store: AdapterStore, tiny_model: Path,
) -> None:
    trainer = trainer_of(role_urls, role_conns, backend, store, tiny_model)
    for step in (1, 2, 3):
        assert trainer.train(make_job(f"job-{step}", run="t", step=step, version=step - 1)).version == step
    assert store.versions("t") == [3] and [m.version for m in Registry(redis_conn).manifests("t")] == [3]
    assert (store.version_dir("t", 3) / "trainer").is_dir()
    with pytest.raises(JobRejected, match="retention policy") as refused:
        trainer.train(make_job("job-1", run="t", step=1, version=0))  # a late retry of the first job
    assert refused.value.field == "job_id"
    assert store.versions("t") == [3]


def test_a_job_that_waited_for_the_lock_of_a_run_deleted_meanwhile_writes_nothing(
    role_urls: dict[Role, str], redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis], backend: PeftBackend,
    store: AdapterStore, tiny_model: Path,
) -> None:
    waiting = threading.Event()

    def alive(owner: str) -> bool:  # the trainer asks while it waits for the lock
        waiting.set()
        return True

    trainer = trainer_of(role_urls, role_conns, backend, store, tiny_model, holder_alive=alive)
    redis_conn.set(keys.run_lock("t"), "dead#1|n0nce")  # a trainer's lock whose liveness key is gone
    outcome: list[BaseException] = []

    def train() -> None:
        try:
            trainer.train(make_job("late", run="t"))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    assert waiting.wait(60), "the job never waited for the run's lock"
    delete_run(role_conns[Role.INFERENCE], "t")  # the lock's holder is dead: the run goes, with the lock
    thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], JobRejected) and "deleted" in str(outcome[0])
    assert not any(redis_conn.exists(k) for k in keys.run_state("t"))
    assert not (store.root / "t").exists()

    with pytest.raises(JobRejected, match="create the run"):  # a job enqueued after the deletion
        trainer.train(make_job("later", run="t"))
    assert not any(redis_conn.exists(k) for k in keys.run_state("t"))


def test_the_worker_removes_a_deleted_runs_directory(
    workers, redis_conn: redis.Redis, role_conns: dict[Role, redis.Redis], tmp_path: Path, tiny_model: Path
) -> None:
    store = AdapterStore(tmp_path / "adapters")  # the workers fixture's store
    make_run(role_conns, store, tiny_model, "gone", 1)
    make_run(role_conns, store, tiny_model, "kept", 1)
    kept_files = files(store.root / "kept")
    worker = workers()
    worker.wait_listening()
    delete_run(role_conns[Role.INFERENCE], "gone")
    wait_until(lambda: not (store.root / "gone").exists() and not Registry(redis_conn).deleted_runs(),
               timeout_s=30, what="the worker removed the deleted run's directory")
    assert files(store.root / "kept") == kept_files
    assert "store.run_removed run=gone removed=True" in worker.log()


def test_a_deleted_name_is_created_again_once_the_trainer_removed_its_versions(
    role_conns: dict[Role, redis.Redis], store: AdapterStore, tiny_model: Path
) -> None:
    client = Registry(role_conns[Role.CLIENT])
    spec = RunSpec(name="again", base_model=str(tiny_model))
    make_run(role_conns, store, tiny_model, "again", 1)
    delete_run(role_conns[Role.INFERENCE], "again")
    with pytest.raises(RunExists, match="trainer has not yet removed"):
        client.create_run(spec)  # its v1 would meet the deleted run's v1 in the store
    assert remove_deleted_runs(role_conns[Role.TRAINER], store, "me#1", lambda owner: True) == ["again"]
    assert client.create_run(spec) == spec and client.latest_version("again") == 0
    assert store.versions("again") == []
