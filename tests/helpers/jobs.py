"""Train jobs of random tokens (what a client would send after its rollouts), and their state on rq's queue."""

from __future__ import annotations

import random

import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem.jobs import TrainJob

RUN = "worker-run"


def make_job(job_id: str | None = None, *, run: str = RUN, step: int = 1, version: int | None = None,
             groups: int = 2, size: int = 4, prompt: int = 6, completion: int = 8, seed: int = 0) -> TrainJob:
    """A job of `groups` groups of `size` trajectories with random token ids below 500 (any tiny-model id).

    `version` marks every trajectory as sampled from that version (what the trainer checks
    staleness against); without it the trajectories carry none.
    """
    rng = random.Random(seed)
    marked = {} if version is None else {"version": version}
    out = []
    for _ in range(groups):
        p = [rng.randrange(3, 500) for _ in range(prompt)]
        out.append({"trajectories": [
            {"prompt_ids": p, "completion_ids": [rng.randrange(3, 500) for _ in range(completion)],
             "rollout_logprobs": [-6.2] * completion, "reward": rng.random(), **marked}
            for _ in range(size)
        ]})
    given = {} if job_id is None else {"job_id": job_id}
    return TrainJob.model_validate({**given, "run": run, "step": step, "groups": out, "timeout_s": 300})


def status(conn: redis.Redis, job_id: str) -> JobStatus | None:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status()


def uneven_job(run: str, step: int) -> TrainJob:
    """Step `step` of the data-parallel parity tests: 3 groups of 4, prompts and completions of
    uneven lengths, so that a job packs into several micro-batches of different sizes to share."""
    job = make_job(f"{run}-{step}", run=run, step=step, groups=3, size=4, prompt=5 + 3 * step,
                   completion=6 + step, seed=step)
    for g, group in enumerate(job.groups):
        for t, traj in enumerate(group.trajectories):
            traj.completion_ids = traj.completion_ids[: 3 + (g * 4 + t) % 6]
            traj.rollout_logprobs = traj.rollout_logprobs[: len(traj.completion_ids)]
    return job
