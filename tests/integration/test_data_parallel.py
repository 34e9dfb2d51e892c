"""Data-parallel training on the CPU: the real worker under torchrun, two ranks over gloo, the tiny model.

The same jobs train the same adapters with two ranks as with one process; a rank killed in
the middle of a step fails its job with a message that says so, torchrun starts the ranks
again, and the job's retry and the next job train.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.jobs import make_job, status, uneven_job
from helpers.workers import WorkerProcess, wait_for
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from safetensors.torch import load_file

from tandem.adapters import AdapterStore
from tandem.events import EventKind, EventStream
from tandem.jobs import TrainJob, TrainResult, enqueue
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TWO_RANKS = {"TANDEM_PARALLEL__RANKS": "2", "TANDEM_BACKEND__MICRO_BATCH_TOKENS": "256"}
ONE_PROCESS = {"TANDEM_BACKEND__MICRO_BATCH_TOKENS": "256"}


def create_run(conn, name: str, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    Registry(conn).create_run(RunSpec(
        name=name, base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
        optimizer=OptimizerConfig(lr=1e-2), loss=LossConfig(epochs=2), max_staleness_steps=4,
    ))


def train(conn, worker: WorkerProcess, run: str, steps: int) -> list[TrainResult]:  # type: ignore[no-untyped-def]
    """Train `steps` jobs of run `run`, one after the other (each from the version before)."""
    # several micro-batches of different sizes to share between the ranks
    return train_jobs(conn, worker, [uneven_job(run, step) for step in range(1, steps + 1)])


def train_jobs(conn, worker: WorkerProcess, jobs: list[TrainJob]) -> list[TrainResult]:  # type: ignore[no-untyped-def]
    """Train `jobs` one after the other."""
    results = []
    for job in jobs:
        enqueue(conn, job)
        wait_for(lambda job=job: status(conn, job.job_id) == JobStatus.FINISHED, 180, f"job {job.job_id}", worker)
        done = Job.fetch(job.job_id, connection=conn, serializer=JSONSerializer).return_value()
        results.append(TrainResult.model_validate(done))
    return results


def weights(root: Path, run: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(AdapterStore(root).version_dir(run, version) / "adapter" / "adapter_model.safetensors"))


def test_two_ranks_train_the_adapters_one_process_trains(workers, redis_conn, tiny_model: Path,
                                                         tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    create_run(redis_conn, "single", tiny_model)
    create_run(redis_conn, "ranks", tiny_model)

    single = workers(ONE_PROCESS)
    one = train(redis_conn, single, "single", steps=3)
    assert single.stop() == 0

    ranked = workers(TWO_RANKS)
    two = train(redis_conn, ranked, "ranks", steps=3)
    # the rendezvous, the ranks' store, gloo and /metrics: on loopback only
    assert ranked.listening_on() == {"127.0.0.1"}
    log = ranked.log()
    assert "parallel.start rank=0 world=2" in log and "parallel.start rank=1 world=2" in log
    assert "rank.follow rank=1 world=2" in log

    for a, b in zip(one, two, strict=True):
        assert (a.version, a.parent) == (b.version, b.parent)
        assert b.metrics["ranks"] == 2.0 and a.metrics["ranks"] == 1.0
        assert b.metrics["microbatches"] >= 2  # the job was split between the ranks
        # the same per-token means over every token of the job, summed in another order
        for key in ("loss", "approx_kl", "ratio_mean", "entropy", "grad_norm", "tokens"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
        wa, wb = weights(root, "single", a.version), weights(root, "ranks", b.version)
        assert wa.keys() == wb.keys()
        moved = max(float((wa[k] - weights(root, "single", a.parent)[k]).abs().max()) if a.parent else
                    float(wa[k].abs().max()) for k in wa)
        assert moved > 1e-3  # the step did train
        for k in wa:
            # float32 sums in another order; Adam's first steps divide by |g|, so where a gradient
            # is near zero the step can differ by up to lr: allow 1e-3 of lr=1e-2 and below
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5, msg=k)

    assert ranked.stop() == 0  # SIGTERM: torchrun stops both ranks; rank 0 warm, rank 1 on its order
    log = ranked.log()
    assert "rank.stop rank=1: rank 0 stopped" in log


def test_ranks_that_switch_runs_keep_them_in_memory_alike(workers, redis_conn, tiny_model: Path,
                                                         tmp_path: Path) -> None:
    """Every rank sets a run aside when another comes and switches back to it from memory (each rank
    is told the same: the step's order, `published`, `invalidate`), and trains what one process
    trains that reads every switch from the store."""
    root = tmp_path / "adapters"
    for name in ("one-a", "one-b", "two-a", "two-b"):
        create_run(redis_conn, name, tiny_model)

    def interleaved(a: str, b: str) -> list[TrainJob]:  # b's job differs from a's: b's state is not a's
        return [uneven_job(a, 1), uneven_job(b, 2), uneven_job(a, 2)]

    single = workers({**ONE_PROCESS, "TANDEM_BACKEND__RESIDENT_RUNS": "1"})
    one = train_jobs(redis_conn, single, interleaved("one-a", "one-b"))
    assert "run=one-a version=1 loaded=True resident=miss" in single.log()
    assert single.stop() == 0
    ranked = workers(TWO_RANKS)
    two = train_jobs(redis_conn, ranked, interleaved("two-a", "two-b"))
    assert ranked.log().count("run=two-a version=1 loaded=True resident=hit") == 2  # on rank 0 and rank 1
    for a, b in zip(one, two, strict=True):
        assert (a.version, a.parent) == (b.version, b.parent)
        wa, wb = weights(root, a.run, a.version), weights(root, b.run, b.version)
        for k in wa:  # the parity test's tolerance: float32 sums in another order
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5, msg=k)
    assert ranked.stop() == 0


def test_a_killed_rank_fails_its_job_and_the_ranks_restart(workers, redis_conn, tiny_model: Path) -> None:
    create_run(redis_conn, "restart", tiny_model)
    ranked = workers({**TWO_RANKS, "TANDEM_TRAINER_FAILPOINTS": "mid_training@rank1"})
    first = make_job("restart-1", run="restart", step=1, groups=2, size=4, seed=1)
    enqueue(redis_conn, first)

    # rank 1 kills itself in its first backward; rank 0 fails the job and stops; torchrun starts
    # both ranks again and the job's retry trains
    wait_for(lambda: status(redis_conn, "restart-1") == JobStatus.FINISHED, 240, "the retried job", ranked)
    failures = [e for e in EventStream(redis_conn).history() if e.kind is EventKind.TRAIN_FAILED]
    assert [e.job_id for e in failures] == ["restart-1"]
    message = failures[0].data["message"]
    assert isinstance(message, str) and "lost the other ranks" in message and "torchrun starts every rank" in message
    assert failures[0].data["retries_left"] == 3  # not final: rq runs the job again
    log = ranked.log()
    assert "failpoint mid_training: the trainer kills itself" in log
    assert "failed (exitcode: -9) local_rank: 1" in log  # torchrun saw rank 1 die...
    assert log.count("parallel.start rank=1 world=2") == 2  # ...and started the ranks again
    result = TrainResult.model_validate(
        Job.fetch("restart-1", connection=redis_conn, serializer=JSONSerializer).return_value())
    assert (result.version, result.parent, result.metrics["ranks"]) == (1, 0, 2.0)

    # the next job trains on the new ranks, from the version the retry published
    enqueue(redis_conn, make_job("restart-2", run="restart", step=2, groups=2, size=4, seed=2, version=1))
    wait_for(lambda: status(redis_conn, "restart-2") == JobStatus.FINISHED, 120, "the next job", ranked)
    second = TrainResult.model_validate(
        Job.fetch("restart-2", connection=redis_conn, serializer=JSONSerializer).return_value())
    assert (second.version, second.parent) == (2, 1)
    assert [m.version for m in Registry(redis_conn).manifests("restart")] == [1, 2]
    assert ranked.stop() == 0


def test_a_killed_rank_0_leaves_its_job_to_the_restarted_ranks(workers, redis_conn, tiny_model: Path) -> None:
    create_run(redis_conn, "leader", tiny_model)
    ranked = workers({**TWO_RANKS, "TANDEM_TRAINER_FAILPOINTS": "mid_training@rank0"})
    enqueue(redis_conn, make_job("leader-1", run="leader", step=1, groups=2, size=4, seed=3))

    # rank 0, the rq worker, dies with the job started and the run locked; the new rank 0 finds
    # the job abandoned (its liveness key expired), requeues it and trains it once
    wait_for(lambda: status(redis_conn, "leader-1") == JobStatus.FINISHED, 240, "the recovered job", ranked)
    log = ranked.log()
    assert "failpoint mid_training: the trainer kills itself" in log
    assert "failed (exitcode: -9) local_rank: 0" in log
    assert log.count("parallel.start rank=0 world=2") == 2
    result = TrainResult.model_validate(
        Job.fetch("leader-1", connection=redis_conn, serializer=JSONSerializer).return_value())
    assert (result.version, result.parent, result.metrics["ranks"]) == (1, 0, 2.0)
    assert [m.version for m in Registry(redis_conn).manifests("leader")] == [1]
    assert ranked.stop() == 0


def test_a_config_error_in_a_rank_ends_the_trainer_instead_of_restarting_it(workers, redis_conn) -> None:
    """Rank 0 finds its worker name held by a live trainer (a configuration error that only a rank
    meets): the launcher stops every rank and exits with 2 and the message, not after
    `max_restarts` starts."""
    from tandem import keys

    redis_conn.set(keys.trainer_alive("taken"), "another-trainer", ex=600)
    ranked = workers({**TWO_RANKS, "TANDEM_WORKER_NAME": "taken", "TANDEM_PARALLEL__MAX_RESTARTS": "100"})
    assert ranked.wait_dead(180) == 2
    log = ranked.log()
    assert "trainer cannot run: rank 0: a trainer worker named 'taken' is alive" in log
    assert "a configuration error is not restarted" in log
    assert log.count("parallel.start rank=0 world=2") <= 2  # the start that met it, at most one more


@pytest.mark.parametrize(("env", "message"), [
    ({"TANDEM_BACKEND__KIND": "unsloth"}, "backend.kind='unsloth' cannot be used: the Unsloth backend needs CUDA"),
    ({"TANDEM_REDIS__URL": "redis://127.0.0.1:1/0", "TANDEM_REDIS_OUTAGE_S": "1"},
     "Redis at 'redis://127.0.0.1:1/0' does not answer"),
])
def test_what_every_rank_would_fail_on_ends_the_trainer_before_torchrun(workers, env: dict[str, str],
                                                                          message: str) -> None:
    ranked = workers({**TWO_RANKS, **env})
    assert ranked.wait_dead(120) == 2
    log = ranked.log()
    assert "trainer cannot run:" in log and message in log, log[-3000:]
    assert "trainer.launch" not in log and "parallel.start" not in log
