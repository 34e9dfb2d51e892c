"""Resolving a future: its stored result, or what it waits on now (a trainer job, a version to serve).

A training call's future resolves from its rq job: finished, its result in Tinker's type; failed,
`RequestFailedResponse{error, category}` with the trainer's message. A save resolves once the
job it follows has published (the version is its result) and, for a sampler save, once that
version serves on a ready inference replica (or the controller records it loaded). Whatever
resolves is stored in the future's record, so the answer is the same from any process.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from tandem import tinker_jobs as tj
from tandem.connection import translated
from tandem.replicas import Replicas
from tandem_inference.tinker import wire
from tandem_inference.tinker.service import TinkerService
from tandem_inference.tinker.state import Future, SamplingSession, new_id

log = logging.getLogger(__name__)

_FAILED = (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED)


def resolve(svc: TinkerService, future: Future) -> Future | None:
    """The future with its result or error stored, or None while it is pending."""
    if future.result is not None or future.error is not None or future.proto is not None:
        return future
    if not future.applied and future.model_id:
        svc.resume(future.model_id)  # held back by its run's quota of queued jobs: room now?
        future = svc.state.future(future.request_id)
    if not future.applied:
        return None
    if future.job_id is not None:
        done = _from_job(svc, future)
    else:
        done = _save(svc, future)
    if done is not None:
        svc.state.put_future(done)
    return done


def _job(svc: TinkerService, job_id: str) -> tuple[str, Any]:
    """('finished', result) | ('failed', message) | ('pending', None) of an rq job."""
    try:
        with translated(svc.conn, f"read job {job_id}"):
            job = Job.fetch(job_id, connection=svc.conn, serializer=JSONSerializer)
            status = job.get_status()
            if status == JobStatus.FINISHED:
                return "finished", job.return_value()
            if status in _FAILED and not job.retries_left:
                latest = job.latest_result()
                lines = ((latest.exc_string if latest is not None else None) or "").strip().splitlines()
                return "failed", lines[-1] if lines else f"the job ended {status}"
    except NoSuchJobError:
        return "failed", f"trainer job {job_id} is gone from the queue (expired or deleted)"
    return "pending", None


#: The trainer's errors for what a request asked (a field, a value): a failed job whose last
#: traceback line names one of these is the caller's to fix, Tinker's category `user`.
USER_ERRORS = frozenset({"ValidationFailed", "JobRefused", "JobRejected"})


def user_caused(line: str) -> bool:
    """Whether a failed job's last traceback line (`module.Class: message`) names a refusal of its input."""
    head = line.split(":", 1)[0].strip()
    return " " not in head and head.rsplit(".", 1)[-1] in USER_ERRORS


def _failed(future: Future, message: str, *, user: bool = False) -> Future:
    return future.model_copy(update={"error": message, "category": "user" if user else "server"})


def _from_job(svc: TinkerService, future: Future) -> Future | None:
    state, value = _job(svc, future.job_id or "")
    if state == "pending":
        return None
    if state == "failed":
        return _failed(future, f"{future.kind} failed in the trainer: {value}", user=user_caused(value))
    try:
        if future.kind == "forward_backward":
            fb = tj.ForwardBackwardResult.model_validate(value)
            return future.model_copy(update={"proto": wire.forward_backward_output(fb.loss_fn_outputs, fb.metrics).hex()})
        if future.kind == "optim_step":
            step = tj.OptimStepResult.model_validate(value)
            return future.model_copy(update={"version": step.version,
                                             "result": {"metrics": {**step.metrics, "version": float(step.version)}}})
        loaded = tj.LoadStateResult.model_validate(value)
        return future.model_copy(update={"version": loaded.version,
                                         "result": {"type": "load_weights", "model_id": future.model_id}})
    except ValidationError as exc:
        return _failed(future, f"the trainer's result of {future.kind} job {future.job_id} is not its type ({exc})")


def _save(svc: TinkerService, future: Future) -> Future | None:
    version = future.version
    if future.after_job is not None and version is None:
        state, value = _job(svc, future.after_job)
        if state == "pending":
            return None
        if state == "failed":
            return _failed(future, f"the step before this save failed, so there is no version to save: {value}",
                           user=user_caused(value))
        try:
            version = int(value["version"])
        except (TypeError, KeyError, ValueError):
            return _failed(future, f"job {future.after_job}'s result names no version ({value!r})")
        future = future.model_copy(update={"version": version})
        svc.state.put_future(future)
    model = svc.state.model(future.model_id or "")
    version = version or 0
    if future.kind == "save_weights_for_sampler" and version > 0 and not serves(svc, model.run, version):
        return None
    return _named(svc, future, model.model_id, model.run, version)


def _named(svc: TinkerService, future: Future, model_id: str, run: str, version: int) -> Future:
    """Record the checkpoint's name (`tinker://<model_id>/<kind>/<name>` -> run, version) and answer it."""
    kind = "weights" if future.kind == "save_weights" else "sampler_weights"
    name = future.name or (f"step-{version}" if kind == "weights" else f"ephemeral-v{version}")
    svc.state.put_checkpoint(model_id, f"{kind}/{name}", version, run)
    result: dict[str, Any] = {"path": f"tinker://{model_id}/{kind}/{name}", "type": future.kind}
    if kind == "sampler_weights" and future.name is None:
        # save_weights_and_get_sampling_client: an ephemeral save and a sampling session pinned to it
        session = SamplingSession(sampling_session_id=new_id("sampling"), run=run, version=version,
                                  base_model=svc.state.model(model_id).base_model, model_path=result["path"])
        svc.state.put_sampling_session(session)
        result["sampling_session_id"] = session.sampling_session_id
    return future.model_copy(update={"result": result})


def serves(svc: TinkerService, run: str, version: int) -> bool:
    """Whether a ready inference replica holds the run's version (or, with no replica heartbeats,
    whether the controller recorded it loaded), or serves a newer one: a controller behind the
    trainer loads each run's newest version and skips the ones it overtook, and a sampler pinned
    to a skipped version has it loaded on demand by its first request."""
    replicas = [r for r in Replicas(svc.conn, prune=False).live() if r.ready]
    if replicas:
        return any(run in r.runs and (version in r.runs[run].loaded or r.runs[run].serving > version)
                   for r in replicas)
    return version in svc.registry.loaded(run) or svc.registry.serving(run) > version


def answer(future: Future) -> tuple[dict[str, Any] | None, bytes | None]:
    """A resolved future as the SDK reads it: a JSON object, or protobuf bytes."""
    if future.error is not None:
        return {"error": future.error, "category": future.category}, None
    if future.proto is not None:
        return None, bytes.fromhex(future.proto)
    return future.result, None


def try_again(request_id: str) -> dict[str, Any]:
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
