"""Multi-turn episodes: the token ids of an agent's conversation, kept so that they stay the ids
the model sampled.

A chat request that names an `episode` starts it (an id the store does not hold, messages
without an assistant turn: the prompt is rendered as for any chat request) or continues it.
A continuation sends the whole conversation, as agents do, but only the messages after the
episode's last assistant turn are rendered, as a delta (prompts.delta_ids); what came before
stays the ids the episode holds. The engine samples from all of them, and the episode grows by
the delta (loss mask 0, logprob 0) and the sampled ids (mask 1, their rollout logprobs), with
the run, version and adapter that served the turn. A trainer gets every id, the mask and the
logprobs from the reply's `tandem.episode` or from `GET /v1/episodes/{id}`.

Episodes live in Redis (keys.episode), one JSON value each, expiring `gateway.episode_ttl_s`
after their last turn, and each run's episode ids in a set (keys.run_episodes) that deleting the
run reads (tandem.deletion); a turn is saved only if no other turn was saved since it began, so two
racing requests cannot interleave one episode. A refused turn changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from pydantic import BaseModel, ValidationError

from tandem import keys
from tandem.connection import translated
from tandem.logprobs import policy_temperature
from tandem_inference.errors import EngineResponseError, EpisodeConflict, EpisodeNotFound, EpisodeRefused, EpisodeTooLong
from tandem_inference.gateway import prompts
from tandem_inference.gateway.schemas import ChatMessage, ChatRequest
from tandem_inference.routing import Route, parse_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MAX_TOKENS = 32768
"""An episode's most ids when neither gateway.episode_max_tokens nor the engine says."""


class Episode(BaseModel):
    """What the store keeps of one episode."""

    id: str
    run: str
    """The run (or base model) the episode's `model` names; every turn names the same."""
    tools: list[dict[str, Any]] | None
    """The tools its prompt rendered; every turn renders the same."""
    messages: list[str]
    """Each message so far as canonical JSON (ChatMessage.canonical), replies as the gateway sent them."""
    prompt_ids: list[int]
    completion_ids: list[int] = []
    loss_mask: list[int] = []
    rollout_logprobs: list[float] = []
    versions: list[int] = []
    """The version that served each turn."""
    temperatures: list[float] = []
    """The temperature each turn's logprobs are under (`policy_temperature`)."""
    runs: list[str | None] = []
    """The run that served each turn (None: the base model asked for by its own name)."""
    adapters: list[str | None] = []
    """The adapter that served each turn (None: version 0, the base model)."""

    @property
    def turns(self) -> int:
        return len(self.versions)

    def public(self) -> dict[str, Any]:
        """The episode as replies and `GET /v1/episodes/{id}` show it. `runs` and `adapters` only
        when every turn has them (an episode begun by a gateway older than them has not)."""
        shown = {"id": self.id, "turns": self.turns, "prompt_ids": self.prompt_ids,
                 "completion_ids": self.completion_ids, "loss_mask": self.loss_mask,
                 "rollout_logprobs": self.rollout_logprobs, "versions": self.versions,
                 "temperatures": self.temperatures}
        if len(self.runs) == len(self.adapters) == self.turns:
            shown |= {"runs": self.runs, "adapters": self.adapters}
        return shown

    def last_sampled(self) -> list[int]:
        """The ids the last turn sampled: the completion's trailing run of mask 1."""
        k = len(self.loss_mask)
        while k > 0 and self.loss_mask[k - 1] == 1:
            k -= 1
        return self.completion_ids[k:]


class EpisodeStore:
    """Episodes in Redis; every Redis error leaves as `BackendUnavailable` naming the URL."""

    def __init__(self, conn: redis.Redis, ttl_s: float) -> None:
        self.conn = conn
        self.ttl_ms = max(1, round(ttl_s * 1000))

    def get(self, episode_id: str) -> Episode | None:
        """The episode, or None if it is unknown or expired."""
        key = keys.episode(episode_id)
        with translated(self.conn, f"read episode {episode_id!r}"):
            raw = self.conn.get(key)
        return None if raw is None else _parsed(episode_id, raw)

    def save(self, episode: Episode, *, after_turns: int) -> None:
        """Store `episode` if the store still holds it after `after_turns` turns (none: absent),
        and restart its expiry; else EpisodeConflict (or EpisodeNotFound if it expired meanwhile)."""
        key = keys.episode(episode.id)
        with translated(self.conn, f"save episode {episode.id!r}"), self.conn.pipeline() as pipe:
            try:
                pipe.watch(key)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                raw = pipe.get(key)
                stored = 0 if raw is None else _parsed(episode.id, raw).turns
                if raw is None and after_turns:
                    raise EpisodeNotFound(f"episode {episode.id!r} expired while its turn was generated; "
                                          "start a new episode", param="episode")
                if stored != after_turns:
                    raise _advanced(episode.id)
                pipe.multi()
                pipe.set(key, episode.model_dump_json(), px=self.ttl_ms)
                pipe.sadd(keys.run_episodes(episode.run), episode.id)  # what deleting the run finds
                pipe.pexpire(keys.run_episodes(episode.run), self.ttl_ms)
                pipe.execute()
            except redis.WatchError as exc:
                raise _advanced(episode.id) from exc

    def delete(self, episode_id: str) -> None:
        with translated(self.conn, f"delete episode {episode_id!r}"):
            self.conn.delete(keys.episode(episode_id))


def _advanced(episode_id: str) -> EpisodeConflict:
    return EpisodeConflict(f"another request advanced episode {episode_id!r} while this turn was generated; "
                           "send one turn of an episode at a time", param="episode")


def _parsed(episode_id: str, raw: bytes | str) -> Episode:
    try:
        return Episode.model_validate_json(raw)
    except ValidationError as exc:
        raise EpisodeConflict(f"episode {episode_id!r} in Redis does not parse ({exc.errors()[0]['msg']}); "
                              f"DELETE /v1/episodes/{episode_id} and start a new episode", param="episode") from exc


@dataclass
class Turn:
    """One turn of an episode before it is sampled: the ids to sample from, and what it adds."""

    episode: Episode
    """The episode as it was (a new one holds its prompt and no turn)."""
    delta: list[int]
    """Ids the new messages add before the turn is sampled (none on the first turn)."""
    messages: list[str]
    """The request's messages, canonical."""

    @property
    def input_ids(self) -> list[int]:
        return [*self.episode.prompt_ids, *self.episode.completion_ids, *self.delta]

    def advanced(self, reply: ChatMessage, route: Route, ids: Sequence[int], logprobs: Sequence[float],
                 temperature: float) -> Episode:
        """The episode after the version of `route` sampled `ids` (with `logprobs` under
        `temperature`) and answered `reply`."""
        ep = self.episode
        if len(logprobs) != len(ids):
            raise EngineResponseError(f"the engine sent {len(logprobs)} logprobs for {len(ids)} sampled ids",
                                      status_code=200)
        return ep.model_copy(update={
            "messages": [*self.messages, reply.canonical()],
            "completion_ids": [*ep.completion_ids, *self.delta, *ids],
            "loss_mask": [*ep.loss_mask, *[0] * len(self.delta), *[1] * len(ids)],
            "rollout_logprobs": [*ep.rollout_logprobs, *[0.0] * len(self.delta), *logprobs],
            "versions": [*ep.versions, route.version],
            "temperatures": [*ep.temperatures, temperature],
            "runs": [*ep.runs, route.run],
            "adapters": [*ep.adapters, route.adapter],
        })


def plan(tokenizer: PreTrainedTokenizerBase, body: ChatRequest, episode: Episode | None, *,
         ttl_s: float) -> Turn:
    """The turn `body` asks of `episode` (None: the store holds no episode under its id)."""
    assert body.episode is not None
    if body.n != 1:
        raise EpisodeRefused(f"n={body.n}: an episode turn samples one reply; send n=1, or several "
                             "episodes for several replies", param="n")
    if body.stream:
        raise EpisodeRefused("stream=true: episode turns are not streamed; send stream=false", param="stream")
    run, tools = parse_model(body.model)[0], body.template_tools()
    sent = [m.canonical() for m in body.messages]
    if episode is None:
        if any(m.role == "assistant" for m in body.messages):
            raise EpisodeNotFound(
                f"episode {body.episode!r} is unknown or has expired (gateway.episode_ttl_s = {ttl_s:g} s); "
                "start a new episode", param="episode")
        new = Episode(id=body.episode, run=run, tools=tools, messages=[], prompt_ids=prompts.chat_ids(tokenizer, body))
        return Turn(new, [], sent)
    if run != episode.run:
        raise EpisodeConflict(f"model {body.model!r} names run {run!r}, but episode {episode.id!r} is served by "
                              f"{episode.run!r}; keep one run for an episode", param="model")
    if tools != episode.tools:
        raise EpisodeConflict(f"the tools differ from those episode {episode.id!r} started with; an episode "
                              "keeps the tools (and tool_choice 'none' or not) of its first turn", param="tools")
    temperature = policy_temperature(body.temperature)
    if episode.temperatures and temperature != episode.temperatures[-1]:
        raise EpisodeConflict(
            f"temperature {body.temperature!r}: episode {episode.id!r} sampled its turns under temperature "
            f"{episode.temperatures[-1]:g}, and one trajectory trains under one temperature (its logprobs are "
            "under it); sample every turn of an episode at the same temperature (greedy counts as 1)",
            param="temperature")
    for i, held in enumerate(episode.messages):
        if i >= len(sent) or sent[i] != held:
            # never quote the held message: an id that collides with another conversation's must not read it
            what = "is missing" if i >= len(sent) else "differs from the episode's message at that place"
            raise EpisodeConflict(
                f"messages[{i}] {what}; a turn of episode {episode.id!r} must send every earlier message "
                "and each assistant reply exactly as the gateway returned it, then the new messages",
                param="messages")
    fresh = body.messages[len(episode.messages):]
    for i, m in enumerate(fresh, start=len(episode.messages)):
        if m.role == "assistant":
            raise EpisodeRefused(f"messages[{i}] is an assistant message the episode did not sample; only the "
                                 f"gateway adds assistant turns to episode {episode.id!r}", param="messages")
    return Turn(episode, prompts.delta_ids(tokenizer, fresh, tools, episode.last_sampled()), sent)


def check_length(turn: Turn, max_new_tokens: int, limit: int) -> None:
    """EpisodeTooLong if the turn's ids and what it may sample would pass `limit`."""
    held = len(turn.input_ids)
    if held >= limit:  # the messages alone fill it: no max_tokens fits
        raise EpisodeTooLong(
            f"the new messages of episode {turn.episode.id!r} ({len(turn.delta)} ids) bring it to {held} ids, "
            f"above gateway.episode_max_tokens = {limit} before anything is sampled; shorten them (a long tool "
            f"result), or end the episode (its ids are in GET /v1/episodes/{turn.episode.id}) and start a new one",
            param="messages")
    if held + max_new_tokens > limit:
        raise EpisodeTooLong(
            f"this turn of episode {turn.episode.id!r} would hold {held} ids plus max_tokens {max_new_tokens}, "
            f"above gateway.episode_max_tokens = {limit}; lower max_tokens, or end the episode (its ids "
            f"are in GET /v1/episodes/{turn.episode.id}) and start a new one", param="max_tokens")
