"""`Gateway`: what the routes share, and the way of one generation request through it.

A request of a run takes a turn of its run (run_quota.py: each run's own quota of rollouts in
flight), is admitted within the capacity (or waits, or is refused with 429), waits while the
GPU is lent out in shared mode, resolves its `model` to a version and holds it in flight, is
generated (whole or streamed) and answered in OpenAI's shape with tandem's extension. A turn of
an episode (episodes.py) is planned before it is admitted and saved once it is generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from tandem import deletion
from tandem.errors import BackendUnavailable, RunNotFound
from tandem.registry import Registry
from tandem.runs import RUN_NAME
from tandem.settings import InferenceSettings
from tandem_inference.controller.gpu_sharing import Admission
from tandem_inference.engines.base import Engine, Sampling
from tandem_inference.errors import (
    ClientLeft,
    ContextTooLong,
    EngineClientError,
    ModelNotFound,
    NotResident,
    Overloaded,
    RequestRefused,
)
from tandem_inference.gateway import episodes, generation, prompts
from tandem_inference.gateway.cancellation import unless_client_leaves
from tandem_inference.gateway.capacity import Capacity
from tandem_inference.gateway.episodes import EpisodeStore, Turn
from tandem_inference.gateway.error_replies import error_reply
from tandem_inference.gateway.generation import Generation
from tandem_inference.gateway.metrics import GatewayMetrics, path_of
from tandem_inference.gateway.outputs import Output, usage
from tandem_inference.gateway.responses import ResponseFormat
from tandem_inference.gateway.run_quota import RunPermit, RunQuotas, unbounded
from tandem_inference.gateway.schemas import (
    DEFAULT_MAX_TOKENS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Kind,
    SamplingRequest,
)
from tandem_inference.gateway.streaming import stream_reply
from tandem_inference.routing import RoutingTable, VersionHold, named_run, parse_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandem_inference.controller.service import Controller

log = logging.getLogger(__name__)


class Gateway:
    """What the routes share: engine, routing table, tokenizer, registry, controller, capacity."""

    def __init__(self, settings: InferenceSettings, engine: Engine, table: RoutingTable,
                 tokenizer: PreTrainedTokenizerBase, registry: Registry, controller: Controller | None,
                 admission: Admission | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.settings = settings
        self.admission = admission
        self.capacity = Capacity.from_settings(settings.gateway)
        self.quotas = RunQuotas.from_settings(settings.gateway)
        self.metrics = metrics if metrics is not None else GatewayMetrics(CollectorRegistry())
        self.metrics.watch(self.capacity, self.quotas)
        self.engine = engine
        self.table = table
        self.tokenizer = tokenizer
        self.registry = registry
        self.controller = controller
        """Read for /ready and /metrics only; the inference service runs it (tandem_inference.main)."""
        self.format = ResponseFormat(tokenizer, table.base_model)
        self.vocab_size = len(tokenizer)
        key = settings.gateway.api_key
        self.api_key = key.get_secret_value() if key is not None else None
        """The key clients must send as `Authorization: Bearer KEY`; None: no key needed."""
        self.episodes = EpisodeStore(registry.conn, settings.gateway.episode_ttl_s)
        self._engine_context: int | None = None

    # resolution -------------------------------------------------------------
    async def checkout(self, model: str) -> VersionHold:
        """Resolve `model` and hold its version; a run new to the table is looked up in Redis.

        Only registered runs exist: a name the registry lacks is 404 even if an event named it.
        A registered version the engine does not hold (evicted for room, retired, never loaded
        here) is loaded on demand by the controller (tandem_inference.controller.slots); 429 when
        every engine slot stays busy past `controller.slot_wait_s`.

        In shared mode, while the GPU is lent to the trainer, this waits for it to come back.
        """
        if self.admission is not None:
            await self.admission.wait()
        run = named_run(model)  # a malformed version after '@' still names its run
        try:
            return await self._checkout_known(model)
        except ModelNotFound:
            if self.table.has_run(run):
                raise  # a known run: the error lists its loaded versions, or names the malformed one
        runs = await self.registry_runs()
        if run in runs:
            self.table.add_run(run)
            return await self._checkout_known(model)
        known = [self.table.base_model, *runs]
        raise ModelNotFound(f"unknown model {model!r}: no run {run!r}; known: {self.table.base_model!r} "
                            f"(the base model) and runs {runs}", known=known)

    async def _checkout_known(self, model: str) -> VersionHold:
        """The table's checkout; a version of a known run the engine does not hold now is loaded
        on demand (without a controller it stays a 404)."""
        try:
            return self.table.checkout(model)
        except NotResident as exc:
            if self.controller is None:
                raise
            return await self.controller.checkout_on_demand(exc.run, exc.version, exc)

    async def registry_runs(self) -> list[str]:
        """Registered runs (valid names only); the table's runs, all registered, while Redis is down."""
        try:
            return [r for r in await asyncio.to_thread(self.registry.list_runs) if RUN_NAME.fullmatch(r)]
        except BackendUnavailable as exc:
            log.warning("registry unreachable (%s); using the runs the routing table knows", exc)
            return self.table.runs()

    async def delete_run(self, run: str) -> deletion.Deletion:
        """Delete the run (tandem.deletion), then stop routing to it here at once and unload its
        adapters once no request holds them (the other replicas do on `run_deleted`); ModelNotFound
        (404) when it is not registered, RunBusy (409) while a job of it runs."""
        try:
            removed = await asyncio.to_thread(deletion.delete_run, self.registry.conn, run)
        except RunNotFound as exc:
            raise ModelNotFound(str(exc), known=[self.table.base_model, *await self.registry_runs()]) from exc
        if self.controller is not None:
            self.controller.forget_run(run)
        else:
            self.table.drop_run(run)
        return removed

    async def latest_version(self, run: str) -> int | None:
        """The run's newest registered version; None while Redis is down."""
        try:
            return await asyncio.to_thread(self.registry.latest_version, run)
        except BackendUnavailable:
            return None

    # prompts ----------------------------------------------------------------
    async def chat_ids(self, body: ChatRequest) -> list[int]:
        """The prompt's ids, built in a worker thread (a large one must not stall /health)."""
        limit = await self.context_limit()
        return await asyncio.to_thread(prompts.chat_ids, self.tokenizer, body, limit)

    async def completion_ids(self, body: CompletionRequest) -> list[int]:
        limit = await self.context_limit()
        return await asyncio.to_thread(prompts.completion_ids, self.tokenizer, self.vocab_size, body, limit)

    async def context_limit(self) -> int | None:
        """The engine's context length (asked once; None while the engine has not said)."""
        if self._engine_context is None:
            try:
                context = (await self.engine.info()).context_length
            except EngineClientError:
                return None  # asked again next time
            self._engine_context = context or episodes.DEFAULT_MAX_TOKENS
        return self._engine_context

    def sampling(self, body: SamplingRequest, max_tokens: int | None, field: str = "max_tokens") -> Sampling:
        """How `body` asks to sample; a `max_tokens` (sent as `field`) above the limit is a 422."""
        limit = self.settings.engine.max_new_tokens_limit
        max_tokens = max_tokens or min(DEFAULT_MAX_TOKENS, limit)  # a default never exceeds the limit
        if max_tokens > limit:
            raise RequestRefused(f"{field} {max_tokens} is above the limit {limit} "
                                 f"(settings.engine.max_new_tokens_limit); ask for at most {limit}", param=field)
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        outside = [t for t in body.stop_token_ids or () if t >= self.vocab_size]
        if outside:  # the engine refuses them too, naming no field
            raise RequestRefused(f"stop_token_ids {outside[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                                 "give ids the model's tokenizer gives", param="stop_token_ids")
        return Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=tuple(stop),
            top_logprobs=body.alternatives_per_token,
            stop_token_ids=tuple(body.stop_token_ids or ()),
        )

    def fit_default(self, sampling: Sampling, *, asked: int | None, prompt_tokens: int,
                    param: str = "max_tokens", prompt_param: str = "prompt") -> Sampling:
        """A request that named no max_tokens gets the default only as far as the context leaves
        room after its prompt (OpenAI's rule: the rest of the context); one that named more than
        that room is refused naming `param`, and a prompt that leaves no room naming `prompt_param`
        (the engine would refuse both, naming no field)."""
        context = self._engine_context or 0
        room = context - prompt_tokens
        if context and room < 1:
            raise ContextTooLong(
                f"{prompt_param}: the prompt's {prompt_tokens} tokens leave no room in the model's context length "
                f"{context}; shorten it", param=prompt_param)
        if asked is not None and context and asked > room:
            raise ContextTooLong(
                f"{param} {asked}: the prompt's {prompt_tokens} tokens and {asked} new ones exceed the model's "
                f"context length {context}; ask for at most {room} (or leave {param} out: the rest of the context)",
                param=param)
        if asked is not None or room < 1 or sampling.max_tokens <= room:
            return sampling
        return dataclasses.replace(sampling, max_tokens=room)

    # episodes ---------------------------------------------------------------
    async def episode_turn(self, body: ChatRequest, max_new_tokens: int) -> Turn:
        """The turn `body` asks of its episode; refused (EpisodeRefused) before anything is generated."""
        assert body.episode is not None
        stored = await asyncio.to_thread(self.episodes.get, body.episode)
        turn = await asyncio.to_thread(episodes.plan, self.tokenizer, body, stored,
                                       ttl_s=self.settings.gateway.episode_ttl_s)
        episodes.check_length(turn, max_new_tokens, await self.episode_limit())
        return turn

    async def episode_limit(self) -> int:
        """gateway.episode_max_tokens, else the engine's context length, else episodes.DEFAULT_MAX_TOKENS."""
        if self.settings.gateway.episode_max_tokens is not None:
            return self.settings.gateway.episode_max_tokens
        return await self.context_limit() or episodes.DEFAULT_MAX_TOKENS

    # responses --------------------------------------------------------------
    async def serve(self, request: Request, kind: Kind, body: SamplingRequest, input_ids: list[int],
                    sampling: Sampling, logprobs: bool, episode: Turn | None = None) -> Response:
        """Admit, resolve the version and generate (and save the `episode` turn); 429 beyond
        capacity, 499 when the client left."""
        try:
            serving = self._serve(request, kind, body, input_ids, sampling, logprobs, episode)
            return await unless_client_leaves(request, serving)
        except Overloaded as exc:
            self.metrics.refused.labels(exc.reason).inc()
            refusal = error_reply(429, str(exc), "rate_limit_exceeded", reason=exc.reason)
            refusal.headers["retry-after"] = str(exc.retry_after_s)
            return refusal
        except ClientLeft:
            self.metrics.cancelled.labels(request.url.path).inc()
            log.info("client left %s before its response; its engine calls were closed", request.url.path)
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    async def _turn(self, model: str, n: int) -> RunPermit:
        """A turn of the run `model` names for `n` samples (none for the base model); it waits while
        the run has its quota in flight (run_quota.py), 429 past `gateway.run_queue_timeout_s`."""
        run, _ = parse_model(model)
        if run == self.table.base_model:
            return unbounded()
        return await self.quotas.acquire(run, n)

    async def _serve(self, request: Request, kind: Kind, body: SamplingRequest, input_ids: list[int],
                     sampling: Sampling, logprobs: bool, episode: Turn | None) -> Response:
        turn = await self._turn(body.model, body.n)
        try:
            permit = await self.capacity.acquire(body.n, body.n * sampling.max_tokens)
        except BaseException:
            turn.release()
            raise
        self.metrics.queue_wait.observe(permit.waited_s)
        try:
            hold = await self.checkout(body.model)
        except BaseException:
            permit.release()
            turn.release()
            raise
        gen = Generation(kind, input_ids, sampling, body.n, logprobs, hold, permit, turn)
        route = gen.route
        request.state.tandem_model = route.run or self.table.base_model
        headers = {"x-tandem-run": route.run or "", "x-tandem-version": str(route.version),
                   "x-tandem-replica": self.settings.replica.id}
        fan_out = self.settings.gateway.fan_out_n
        tools = body.tool_names() if isinstance(body, ChatRequest) and body.template_tools() else []
        if body.stream:
            return await stream_reply(self.engine, gen, self.format, fan_out=fan_out, headers=headers,
                                      on_client_left=lambda: self.metrics.cancelled.labels(path_of(kind)).inc(),
                                      tools=tools,
                                      include_usage=body.stream_options is not None and body.stream_options.include_usage)
        try:
            results = await generation.generate(self.engine, gen, fan_out=fan_out)
        finally:
            gen.release()
        outputs = []
        for r in results:
            out = Output()
            out.update(r)
            outputs.append(out)
        choices = [self.format.choice(kind, i, out, logprobs, tools) for i, out in enumerate(outputs)]
        extension = self.format.extension(route, input_ids, outputs, gen.policy_temperature)
        payload = {**self.format.envelope(kind, route, stream=False), "choices": choices,
                   "usage": usage(input_ids, outputs), "tandem": extension}
        if episode is not None:
            reply = ChatMessage.model_validate(choices[0]["message"])
            advanced = episode.advanced(reply, route, outputs[0].token_ids, outputs[0].logprobs,
                                        gen.policy_temperature)
            await asyncio.to_thread(self.episodes.save, advanced, after_turns=episode.episode.turns)
            self.metrics.episode_turns.labels("continue" if episode.episode.turns else "start").inc()
            payload["tandem"]["episode"] = advanced.public()
        return JSONResponse(payload, headers=headers)
