"""Tinker's calls over tandem: a model is a run, training calls are trainer jobs in seq_id order,
every optim_step is the run's next version, saves name versions, sampling goes through the gateway.

`TinkerService` holds the Redis connection (as the `tandem-tinker` user) and an HTTP client to the
gateway; the routes (routes.py) parse the SDK's bodies and call it. Futures resolve in futures.py.

A model whose run was deleted (`tandem delete`) is looked up in the registry on each call that
names it, its checkpoints or a sampling session on them: the call is refused with 404 before
anything is queued, and a request of it that waited for its turn fails when its turn comes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import redis
from pydantic import ValidationError
from tinker import types as tt

from tandem import job_quota
from tandem import tinker_jobs as tj
from tandem.engine_card import EngineCard
from tandem.errors import RunNotFound, TandemError
from tandem.registry import Registry
from tandem.runs import LoraConfig, RunSpec
from tandem.settings import TinkerSettings
from tandem_inference.errors import TinkerInvalid, TinkerNotFound, TinkerRefusal
from tandem_inference.tinker import wire
from tandem_inference.tinker.order import Order, Sequencer, checked_seq
from tandem_inference.tinker.state import Future, Kind, ModelRecord, SamplingSession, State, new_id

log = logging.getLogger(__name__)

J = TypeVar("J", tj.ForwardBackwardJob, tj.OptimStepJob, tj.LoadStateJob)
#: A job's fields as the SDK's request names them, for a refusal.
_PARAMS = {"seq": "seq_id", "datums": "data", "adam": "adam_params", "source_version": "path"}

_JOBS: dict[str, type[tj.ForwardBackwardJob] | type[tj.OptimStepJob] | type[tj.LoadStateJob]] = {
    "forward_backward": tj.ForwardBackwardJob, "optim_step": tj.OptimStepJob, "load_weights": tj.LoadStateJob}


class TinkerService:
    def __init__(self, settings: TinkerSettings, conn: redis.Redis, gateway: httpx.Client) -> None:
        self.settings = settings
        self.conn = conn
        self.gateway = gateway
        self.state = State(conn, settings.tinker.future_ttl_s)
        self.registry = Registry(conn)
        self.sequencer = Sequencer(conn, settings.tinker.future_ttl_s)

    # the engine's card --------------------------------------------------------------------------
    def card(self) -> EngineCard:
        """The engine's model as the gateway's /v1/models names it."""
        try:
            resp = self.gateway.get("/v1/models")
            resp.raise_for_status()
            card = EngineCard.of(resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise TinkerRefusal(f"the gateway at {self.settings.tinker.gateway_url} did not say which model it serves "
                                f"({exc}); start it, or set TANDEM_TINKER__GATEWAY_URL") from exc
        if card is None:
            raise TinkerRefusal(f"the gateway at {self.settings.tinker.gateway_url} names no engine model")
        return card

    # models -------------------------------------------------------------------------------------
    def create_model(self, req: tt.CreateModelRequest) -> Future:
        checked_seq(req.model_seq_id, "model_seq_id")
        self.state.touch_session(req.session_id)
        lora = req.lora_config or tt.LoraConfig(rank=32)
        if not (1 <= lora.rank <= self.settings.tinker.max_lora_rank):
            raise TinkerInvalid(f"lora_config.rank {lora.rank} is out of range; give 1 to "
                             f"{self.settings.tinker.max_lora_rank} (tinker.max_lora_rank)", param="lora_config.rank")
        if not (lora.train_attn and lora.train_mlp):
            raise TinkerInvalid("lora_config: tandem trains LoRA on attention and MLP together; leave train_attn and "
                             "train_mlp true", param="lora_config")
        run = f"tinker-{req.model_seq_id}-{new_id('m')[2:14]}"
        card = self.card()  # the gateway away (restarting) is a 503 the SDK retries, not the caller's mistake
        try:
            spec = RunSpec(name=run, base_model=req.base_model,
                           lora=LoraConfig(r=lora.rank, alpha=2.0 * lora.rank), seed=lora.seed or 0)
            spec = card.fit(spec, self.settings.tinker.gateway_url, subject="this model")  # no run made yet
        except (ValidationError, TandemError) as exc:
            raise TinkerInvalid(f"base_model {req.base_model!r} / lora_config cannot be trained here: {exc}",
                                param="base_model") from exc
        self.registry.create_run(spec, exist_ok=False)
        self.state.put_model(ModelRecord(model_id=run, run=run, session_id=req.session_id,
                                         base_model=req.base_model, rank=lora.rank))
        log.info("tinker.create_model model_id=%s base_model=%s rank=%d", run, req.base_model, lora.rank)
        future = Future(request_id=new_id("req"), kind="create_model", model_id=run,
                        result={"model_id": run, "type": "create_model"})
        self.state.put_future(future)
        return future

    def live_model(self, model_id: str) -> ModelRecord:
        """The model, or TinkerNotFound when it is unknown or its run was deleted (one registry look-up)."""
        m = self.state.model(model_id)
        if not self.registry.has_run(m.run):
            raise TinkerNotFound(_deleted(model_id, m.run), param="model_id")
        return m

    def get_info(self, model_id: str) -> dict[str, Any]:
        m = self.live_model(model_id)
        card = self.card()
        return {"type": "get_info", "model_id": model_id, "model_name": m.base_model, "is_lora": True,
                "lora_rank": m.rank, "model_data": {"model_name": m.base_model, "tokenizer_id": card.model}}

    # training calls -----------------------------------------------------------------------------
    def forward_backward(self, model_id: str, seq: int | None, loss_fn: str, config: dict[str, float],
                         datums: list[tj.Datum], forward_only: bool) -> Future:
        seq = checked_seq(seq)
        m = self.live_model(model_id)
        job = _job(tj.ForwardBackwardJob, run=m.run, seq=seq or 0, datums=datums, loss_fn=loss_fn,
                   loss_fn_config=config, forward_only=forward_only)
        return self._submit(m, seq, "forward_backward", {"job": job.model_dump(mode="json")})

    def optim_step(self, req: tt.OptimStepRequest) -> Future:
        checked_seq(req.seq_id)
        m = self.live_model(req.model_id)
        params = req.optim_params
        if not isinstance(params, tt.AdamParams):
            raise TinkerInvalid(f"optimizer {getattr(params, 'type', type(params).__name__)!r} is not supported; "
                             "tandem steps with Adam (AdamParams)", param="adam_params")
        try:
            adam = tj.AdamParams.model_validate(params.model_dump())
        except ValidationError as exc:
            raise wire.invalid(exc, "invalid adam_params", prefix="adam_params") from exc
        job = _job(tj.OptimStepJob, run=m.run, seq=req.seq_id or 0, adam=adam)
        return self._submit(m, req.seq_id, "optim_step", {"job": job.model_dump(mode="json")})

    def save(self, model_id: str, seq: int | None, kind: str, name: str | None,
             sampling_session_seq_id: int | None = None) -> Future:
        seq = checked_seq(seq)
        checked_seq(sampling_session_seq_id, "sampling_session_seq_id")
        m = self.live_model(model_id)
        if name is not None and not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise TinkerInvalid(f"path {name!r}: a checkpoint name is letters, digits, '-', '_' and '.'", param="path")
        return self._submit(m, seq, kind, {"name": name, "sampling_session_seq_id": sampling_session_seq_id})

    def load_weights(self, req: tt.LoadWeightsRequest) -> Future:
        """Load a `weights` checkpoint into a model: an existing one (model_id), or a new one that the
        SDK names `<session_id>:train:<model_seq_id>` (create_training_client_from_state*).

        A checkpoint saved before its model's first optim_step (version 0) names a fresh LoRA, which
        the run's spec seeds: a new model from it is that spec under a new run at version 0, with
        nothing to load. Loading one into an existing model (a reset) is refused, naming what to do."""
        checked_seq(req.seq_id)
        checked_seq(req.model_seq_id, "model_seq_id")
        source_run, version = self.resolve_path(req.path, want="weights")
        if req.model_id is not None:
            if version < 1:
                raise TinkerInvalid(f"path {req.path!r} was saved before its model's first optim_step, so it names "
                                    "a fresh LoRA, which tandem does not load into an existing model; open a new "
                                    "training client from it (create_training_client_from_state)", param="path")
            m = self.live_model(req.model_id)
        elif req.session_id is not None and req.model_seq_id is not None:
            m = self._model_from(req.path, source_run, req.session_id, req.model_seq_id, req.base_model)
        else:
            raise TinkerInvalid("load_weights needs model_id, or session_id with model_seq_id", param="model_id")
        if version < 1:  # nothing to load: its turn passes (_apply)
            return self._submit(m, req.seq_id, "load_weights", {"untrained": True})
        job = _job(tj.LoadStateJob, run=m.run, seq=req.seq_id or 0, source_run=source_run, source_version=version,
                   with_optimizer=req.optimizer)
        return self._submit(m, req.seq_id, "load_weights", {"job": job.model_dump(mode="json"), "path": req.path})

    def _model_from(self, path: str, source_run: str, session_id: str, model_seq_id: int,
                    base_model: str | None) -> ModelRecord:
        """A new model for checkpoint `path` of `source_run`: a run with its spec (base model, LoRA shape)."""
        self.state.touch_session(session_id)
        source = self._source(path, source_run)
        if base_model is not None and base_model != source.base_model:
            self._check_base(base_model)
        run = f"tinker-{model_seq_id}-{new_id('m')[2:14]}"
        spec = source.model_copy(update={"name": run})
        self.registry.create_run(spec, exist_ok=False)
        record = ModelRecord(model_id=f"{session_id}:train:{model_seq_id}", run=run, session_id=session_id,
                             base_model=source.base_model, rank=source.lora.r)
        self.state.put_model(record)
        log.info("tinker.create_model model_id=%s run=%s from=%s", record.model_id, run, source_run)
        return record

    def resolve_path(self, path: str, *, want: str | None = None) -> tuple[str, int]:
        """(run, version) a `tinker://<model_id>/<weights|sampler_weights>/<name>` path names."""
        prefix = "tinker://"
        parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or (want and parts[1] != want):
            kinds = f"{want}" if want else "weights or sampler_weights"
            raise TinkerInvalid(f"path {path!r} is not tinker://<model_id>/{kinds}/<name>", param="path")
        found = self.state.checkpoint(parts[0], f"{parts[1]}/{parts[2]}")
        if found is None:
            raise TinkerNotFound(f"no checkpoint {path!r}: model {parts[0]!r} saved none by that name", param="path")
        if not self.registry.has_run(found[0]):
            raise TinkerNotFound(_gone(path), param="path")
        return found

    def _source(self, path: str, run: str) -> RunSpec:
        """The spec of the run checkpoint `path` names (deleted since resolve_path looked: TinkerNotFound)."""
        try:
            return self.registry.get_run(run)
        except RunNotFound as exc:
            raise TinkerNotFound(_gone(path), param="path") from exc

    def _submit(self, m: ModelRecord, seq: int | None, kind: str, op: dict[str, Any]) -> Future:
        request_id = new_id("req")
        future = Future(request_id=request_id, kind=kind, model_id=m.model_id, seq=seq,
                        applied=False, name=op.get("name"), sampling_session_seq_id=op.get("sampling_session_seq_id"))
        digest = _digest(kind, op)
        op = {**op, "kind": kind, "request_id": request_id}
        self.state.put_future(future)  # before it is ordered: applying it reads it
        got = self.sequencer.submit(m.model_id, seq, request_id, op, self._apply, self._room(m.run), digest)
        return self.state.future(got)

    def skip(self, model_id: str, seq: int, kind: Kind, message: str) -> None:
        """Use up the seq_id of a training call refused before it was ordered (a 422 or 404 naming a
        field): the model's later calls would otherwise wait for it forever. Its number is recorded
        in its turn with the refusal as its future, so a resend of it gets the same error."""
        try:
            m = self.state.model(model_id)
        except TinkerNotFound:
            return  # no such model: it has no order to keep
        request_id = new_id("refused")
        self.state.put_future(Future(request_id=request_id, kind=kind, model_id=m.model_id, seq=seq,
                                     error=message, category="user"))
        self.sequencer.submit(m.model_id, seq, request_id, {"kind": "refused", "request_id": request_id},
                              self._apply, self._room(m.run))
        log.info("tinker.refused model_id=%s seq_id=%d kind=%s: its turn is used up", m.model_id, seq, kind)

    def resume(self, model_id: str) -> None:
        """Apply the model's requests held back by its run's quota of queued jobs, as far as there is room."""
        self.sequencer.resume(model_id, self._apply, self._room(self.state.model(model_id).run))

    def _room(self, run: str) -> Callable[[dict[str, Any]], bool]:
        """Whether a request may be applied now: a training call only while its run has fewer than
        `tinker.run_max_queued_jobs` jobs on the train queue (tandem.job_quota)."""
        limit = self.settings.tinker.run_max_queued_jobs
        return lambda op: op["kind"] not in _JOBS or job_quota.has_room(self.conn, run, limit)

    def _apply(self, op: dict[str, Any], order: Order) -> None:
        """Apply one request in its turn: enqueue its job, or bind its save to the job before it (a
        refused one: nothing, its turn passes)."""
        kind = op["kind"]
        if kind == "refused":
            return
        future = self.state.future(op["request_id"])
        model = self.state.model(future.model_id or "")
        if not self.registry.has_run(model.run):  # deleted while this request waited for its turn
            future.error, future.category, future.applied = _deleted(model.model_id, model.run), "user", True
            self.state.put_future(future)
            return
        if op.get("untrained"):  # a new model at its fresh LoRA: nothing to load, its turn passes
            future.result = {"type": "load_weights", "model_id": model.model_id}
        elif kind in _JOBS:
            payload = dict(op["job"])
            if kind == "optim_step":
                payload["gradients_from"] = order.gradients
                order.gradients = []
            if kind == "load_weights":
                order.gradients = []
            tj.enqueue(self.conn, _JOBS[kind].model_validate(payload))
            if kind == "forward_backward" and not payload.get("forward_only"):
                order.gradients.append(payload["job_id"])
            if kind != "forward_backward":
                order.publisher = payload["job_id"]
            future.job_id = payload["job_id"]
        else:  # a save: the version the job before it publishes, or the newest now
            future.after_job = order.publisher
            if order.publisher is None:
                future.version = self.registry.latest_version(model.run)
        future.applied = True
        self.state.put_future(future)

    # sampling sessions --------------------------------------------------------------------------
    def create_sampling_session(self, base_model: str | None, model_path: str | None) -> SamplingSession:
        if model_path:
            run, version = self.resolve_path(model_path)
            base = self._source(model_path, run).base_model
            session = SamplingSession(sampling_session_id=new_id("sampling"), run=run, version=version,
                                      base_model=base, model_path=model_path)
        elif base_model:
            self._check_base(base_model)
            session = SamplingSession(sampling_session_id=new_id("sampling"), base_model=base_model)
        else:
            raise TinkerInvalid("give model_path (a sampler checkpoint) or base_model", param="model_path")
        self.state.put_sampling_session(session)
        return session

    def sampling_session(self, sampling_session_id: str) -> SamplingSession:
        """The sampling session, or TinkerNotFound when it is unknown or the model it samples was deleted."""
        s = self.state.sampling_session(sampling_session_id)
        if s.run is not None and not self.registry.has_run(s.run):
            raise TinkerNotFound(f"sampling session {sampling_session_id!r} samples "
                                 f"{s.model_path or s.run!r}, whose model was deleted (`tandem delete`); open a "
                                 "sampling client on a checkpoint of a model that exists", param="sampling_session_id")
        return s

    def _check_base(self, base_model: str) -> None:
        card = self.card()  # a 503 while the gateway is away
        try:
            card.fit(RunSpec(name="check", base_model=base_model), self.settings.tinker.gateway_url,
                            subject="the sampler")  # no run is made to sample
        except (ValidationError, TandemError) as exc:
            raise TinkerInvalid(f"base_model {base_model!r} is not served here: {exc}", param="base_model") from exc


def _job(kind: type[J], **fields: Any) -> J:
    """The trainer job, or TinkerInvalid naming the request's field it refuses (never a 500)."""
    try:
        return kind(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc: list[str] = [str(part) for part in first["loc"]]
        param = ".".join([_PARAMS.get(loc[0], loc[0]), *loc[1:]]) if loc else "body"
        raise TinkerInvalid(f"{param}: {first['msg']}, got {first['input']!r:.80}; the trainer cannot take it "
                            f"({kind.__name__})", param=param) from exc


def _digest(kind: str, op: dict[str, Any]) -> str:
    """`kind:hash` of what a training call asks (its job's fields but the job's own id and time), so
    that a resend of it is told from another call under the same seq_id."""
    body = dict(op)
    if isinstance(body.get("job"), dict):
        body["job"] = {k: v for k, v in body["job"].items() if k not in ("job_id", "submitted_at")}
    return f"{kind}:{hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]}"


def _deleted(model_id: str, run: str) -> str:
    return f"model {model_id!r} was deleted (its run {run!r} is gone, `tandem delete`); create a new one"


def _gone(path: str) -> str:
    return (f"checkpoint {path!r} is gone: the model that saved it was deleted (`tandem delete`), and its "
            "checkpoints with it; use a checkpoint of a model that exists")
