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
