"""Multi-turn episodes: an agent's conversation sampled turn by turn, trained as one trajectory.

    ep = run.episode([{"role": "user", "content": "Open a drawer."}], tools=[OPEN_DRAWER])
    turn = ep.sample(max_tokens=64)                 # the assistant turn, appended to ep.messages
    ep.add({"role": "tool", "tool_call_id": turn.tool_calls[0]["id"], "content": "a coin"})
    ep.sample(max_tokens=64)
    trajectory = ep.trajectory(reward=1.0)          # every token, mask 1 only where the model sampled

The gateway keeps the episode's token ids (in Redis, under the episode's id). Each turn is
sampled from those ids plus the template's tokens of the messages added since the last turn
(never a re-render of the whole conversation, which can tokenise the model's own reply
differently from how it was sampled), so the trajectory's ids are the ids the engine saw and
returned, and the rollout logprobs fit them. Any OpenAI client gets the same by sending
`extra_body={"episode": id}`; `GET /v1/episodes/{id}` returns the ids, mask and logprobs.

Staleness: one episode may span adapter versions when a new one starts serving between two
turns. A trajectory carries one version, so an episode is as stale as its OLDEST turn
(`version = min(versions)`): the trainer's `max_staleness_steps` check then holds for every
token in it, and the importance ratio uses each token's own rollout logprob anyway. Its origin
(the run and adapter, `tandem.trajectories.Origin`) is that turn's too; every turn of an episode
is served by one run (the gateway refuses a turn that names another).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tandem.errors import GatewayError, ValidationFailed, invalid
from tandem.session import SessionRun
from tandem.trajectories import Completion, Origin, Trajectory

__all__ = ["EPISODE_ID", "Episode", "EpisodeState", "Turn"]

#: What an episode id may look like (the gateway refuses anything else with a 422).
EPISODE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class Turn(Completion):
    """One sampled assistant turn: its text and tool calls, its ids and logprobs, its version.

    `prompt_ids` are every id before this turn (earlier turns included), `completion_ids` the
    ids sampled in it.
    """

    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    """OpenAI `tool_calls` parsed from the turn (`id`, `type`, `function.name`, `function.arguments`)."""
    message: dict[str, Any]
    """The assistant message as the gateway returned it; what the next request must repeat."""


class EpisodeState(BaseModel):
    """An episode as the gateway stores it (`tandem.episode`, `GET /v1/episodes/{id}`)."""

    model_config = ConfigDict(frozen=True)

    id: str
    turns: int = Field(ge=0)
    """Assistant turns sampled so far."""
    prompt_ids: list[int]
    """Ids of the first request's messages (and tools), chat template applied."""
    completion_ids: list[int]
    """Every id after `prompt_ids`: sampled turns and the template's ids of later messages."""
    loss_mask: list[int]
    """Per completion id: 1 where the model sampled it, 0 for the messages between turns."""
    rollout_logprobs: list[float]
    """Per completion id: the sampling policy's logprob (0.0 where the mask is 0)."""
    versions: list[int]
    """Per turn: the adapter version that sampled it."""
    temperatures: list[float]
    """Per turn: the temperature its logprobs are under (1 for greedy)."""
    runs: list[str | None] | None = None
    """Per turn: the run that served it (None in the list: the base model asked for by its own
    name); None when the gateway did not say (one older than the field)."""
    adapters: list[str | None] | None = None
    """Per turn: the adapter that served it (None in the list: version 0); None when not said."""

    @model_validator(mode="after")
    def _aligned(self) -> EpisodeState:
        n = len(self.completion_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(f"completion_ids has {n} ids but loss_mask {len(self.loss_mask)} and "
                             f"rollout_logprobs {len(self.rollout_logprobs)}; they must align")
        if len(self.versions) != self.turns or len(self.temperatures) != self.turns:
            raise ValueError(f"{self.turns} turns but {len(self.versions)} versions and "
                             f"{len(self.temperatures)} temperatures")
        for name, per_turn in (("runs", self.runs), ("adapters", self.adapters)):
            if per_turn is not None and len(per_turn) != self.turns:
                raise ValueError(f"{self.turns} turns but {len(per_turn)} {name}")
        return self

    def _origin(self) -> Origin | None:
        """What sampled the episode's oldest turn (the trajectory's version); None when the gateway did not say."""
        if self.runs is None or not self.turns:
            return None
        if len(set(self.runs)) > 1:
            raise ValidationFailed(
                f"episode {self.id!r} was sampled from runs {self.runs}; one trajectory is one run's rollout: "
                "sample every turn of an episode from the run it trains", field="runs")
        oldest = self.versions.index(min(self.versions))
        return Origin(run=self.runs[oldest], adapter=self.adapters[oldest] if self.adapters else None)

    def to_trajectory(self, reward: float) -> Trajectory:
        """The whole episode with its reward, as one trajectory; version and origin = its oldest turn's."""
        if not self.turns:
            raise ValidationFailed(f"episode {self.id!r} has no sampled turn; call sample() before "
                                   "trajectory()", field="turns")
        if len(set(self.temperatures)) > 1:
            raise ValidationFailed(
                f"episode {self.id!r} sampled its turns at temperatures {self.temperatures}; one trajectory "
                "trains at one temperature (its logprobs are under it): sample every turn of an episode "
                "at the same temperature", field="temperatures")
        try:
            return Trajectory(prompt_ids=self.prompt_ids, completion_ids=self.completion_ids,
                              rollout_logprobs=self.rollout_logprobs, loss_mask=self.loss_mask,
                              version=min(self.versions), temperature=self.temperatures[0],
                              origin=self._origin(), reward=reward)
        except ValidationError as exc:
            raise invalid(f"episode {self.id!r} cannot be trained on", exc) from exc


class Episode:
    """One conversation of an agent with its environment, sampled through the gateway.

    `messages` grows as the conversation does: `sample()` appends the assistant turn exactly as
    the gateway returned it, `add()` the environment's tool and user messages. A request that
    does not start with the episode's messages so far is refused by the gateway (409).
    """

    def __init__(
        self,
        run: SessionRun,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        episode_id: str | None = None,
    ) -> None:
        self.id = episode_id if episode_id is not None else uuid.uuid4().hex
        if not EPISODE_ID.fullmatch(self.id):
            raise ValidationFailed(f"episode_id {self.id!r} must be 1-128 letters, digits or '_.:-'",
                                   field="episode_id")
        _check_messages(messages, "messages")
        if not messages:
            raise ValidationFailed("messages is empty; an episode starts from at least one message",
                                   field="messages")
        self.run = run
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.tools = [dict(t) for t in tools] if tools else None
        self.turns: list[Turn] = []
        self.state: EpisodeState | None = None
        """The gateway's episode after the last turn (None before the first)."""
        self._given_id = episode_id is not None
        """An id of the caller's: the episode may have turns another process sampled."""
        self._closed = False

    def _check_open(self, doing: str, *, needs_turn: bool = False) -> None:
        """ValidationFailed for what the gateway would answer with "unknown or expired" (404): an
        episode this object closed, or one it never sampled (and nobody else did: its id is new)."""
        if self._closed:
            raise ValidationFailed(f"episode {self.id!r} was closed (close() or the end of its `with`); it cannot "
                                   f"{doing}: start a new episode", field="episode")
        if needs_turn and not self.turns and not self._given_id:
            raise ValidationFailed(f"episode {self.id!r} has no sampled turn, so the gateway holds nothing of it to "
                                   f"{doing}; call sample() first", field="turns")

    def sample(
        self,
        *,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        version: int | None = None,
    ) -> Turn:
        """Sample the next assistant turn from the episode's ids and append it to `messages`."""
        self._check_open("sample a turn")
        body: dict[str, Any] = {
            "model": self.run.name if version is None else f"{self.run.name}@v{version}",
            "messages": self.messages, "episode": self.id, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "stop": stop, "tools": self.tools,
            "tool_choice": tool_choice,
        }
        data = self.run.client.post("/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
        turn, state = _parse_turn(data, self.run.client.settings.gateway_url)
        self.messages.append(turn.message)
        self.turns.append(turn)
        self.state = state
        return turn

    def add(self, *messages: dict[str, Any]) -> Episode:
        """Append the environment's messages (tool results, user turns) for the next turn to read;
        a message the gateway would refuse is refused here, and none of the call's is kept."""
        self._check_open("take messages")
        _check_messages(messages, f"messages[{len(self.messages)}:]")
        self.messages += [dict(m) for m in messages]
        return self

    def fetch(self) -> EpisodeState:
        """The gateway's episode now (`GET /v1/episodes/{id}`); GatewayError 404 once it expired."""
        self._check_open("be read", needs_turn=True)
        data = self.run.client.get(f"/v1/episodes/{self.id}")
        try:
            return EpisodeState.model_validate(data)
        except ValidationError as exc:
            raise GatewayError(f"/v1/episodes/{self.id} answered with a malformed episode: {exc}",
                               status_code=200, body=data) from exc

    def trajectory(self, reward: float) -> Trajectory:
        """The episode as the gateway holds it, with `reward`: one trajectory to put in a group."""
        return self.fetch().to_trajectory(reward)

    to_trajectory = trajectory
    """So that `run.group(episodes, rewards)` takes episodes as it takes completions."""

    def close(self) -> None:
        """Drop the episode from the gateway's store (it would expire on its own); closing it again
        does nothing."""
        if self._closed:
            return
        self.run.client.delete(f"/v1/episodes/{self.id}")
        self._closed = True

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_messages(messages: Sequence[dict[str, Any]], where: str) -> None:
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str):
            raise ValidationFailed(f"{where} #{i} has no role: {message!r}", field="messages")
        if role == "assistant":
            raise ValidationFailed(
                f"{where} #{i} is an assistant message; an episode's assistant turns come from "
                "sample(), so that their ids are the ones the model sampled", field="messages")
        if role not in MESSAGE_ROLES:
            raise ValidationFailed(
                f"{where} #{i} has role {role[:40]!r}; an episode takes {', '.join(MESSAGE_ROLES)} messages (kept, it "
                "would make every later turn of the episode fail)", field="messages")
        # the gateway's rules for these roles: kept, a message it refuses would fail every later turn
        content = message.get("content")
        if not isinstance(content, str) and not (
            isinstance(content, list)
            and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
        ):
            raise ValidationFailed(
                f"{where} #{i} ({role}) has content {content!r:.60}; give text, or a list of "
                '{"type": "text", "text": ...} parts (the gateway takes no other content)', field="messages")
        if "tool_calls" in message:
            raise ValidationFailed(f"{where} #{i} is a {role} message with tool_calls; only the assistant turns "
                                   "sample() makes carry them", field="messages")
        if "tool_call_id" in message and not isinstance(message["tool_call_id"], str):
            raise ValidationFailed(f"{where} #{i} has tool_call_id {message['tool_call_id']!r:.60}; give the id "
                                   "of the call it answers, as text", field="messages")


#: The roles of the messages an episode takes from the caller (the gateway's, less `assistant`).
MESSAGE_ROLES = ("system", "developer", "user", "tool")


def _parse_turn(data: dict[str, Any], gateway_url: str) -> tuple[Turn, EpisodeState]:
    try:
        ext, choice = data["tandem"], data["choices"][0]
        returned = choice["message"]
        message: dict[str, Any] = {"role": "assistant", "content": returned.get("content")}
        if returned.get("tool_calls"):
            message["tool_calls"] = returned["tool_calls"]
        state = EpisodeState.model_validate(ext["episode"])
        turn = Turn(
            text=returned.get("content") or "", tool_calls=list(returned.get("tool_calls") or []),
            message=message, finish_reason=choice.get("finish_reason"),
            prompt_ids=ext["prompt_token_ids"], completion_ids=ext["completion_token_ids"][0],
            rollout_logprobs=ext["completion_logprobs"][0], version=ext["version"],
            temperature=ext["temperature"], origin=Origin.of(ext),
        )
    except (KeyError, IndexError, TypeError, AttributeError, ValidationError) as exc:
        raise GatewayError(
            f"/v1/chat/completions answered an episode turn without tandem's episode (missing or "
            f"malformed: {exc!r}); is {gateway_url} tandem's gateway, with episodes?",
            status_code=200, body=data,
        ) from exc
    return turn, state
