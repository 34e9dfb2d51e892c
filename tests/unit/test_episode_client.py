"""The client's episodes against a gateway that speaks the episode contract, at the network edge.

The gateway is an `httpx.MockTransport` holding episodes in a dict: it checks that each request
repeats the episode's messages so far, appends stand-in template ids (mask 0) for the new
messages and sampled ids (mask 1) for the turn, and answers as tandem's gateway does.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
import redis
from helpers.loopback import free_port

from tandem import Client, Episode, EpisodeState, Origin, Run, Trajectory
from tandem.errors import GatewayError, ValidationFailed
from tandem.runs import RunSpec

pytestmark = pytest.mark.unit

GATEWAY = "http://gateway.test"
TOOL = {"type": "function", "function": {"name": "open_drawer", "parameters": {"type": "object"}}}


class FakeGateway:
    """The episode contract in a few lines: ids per message, prefix checks, mask and versions."""

    def __init__(self, versions: list[int] | None = None, tool_call_on: int | None = None,
                 runs: list[str | None] | None = None) -> None:
        self.episodes: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.versions = versions or [1, 1, 1, 1]
        self.tool_call_on = tool_call_on
        self.runs = runs
        """The run that serves each turn, as tandem's gateway says it; None: a gateway that says none."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        path = request.url.path
        if path.startswith("/v1/episodes/"):
            eid = path.rsplit("/", 1)[1]
            if request.method == "DELETE":
                self.episodes.pop(eid, None)
                return httpx.Response(204)
            if eid not in self.episodes:
                return httpx.Response(404, json={"error": {"message": f"episode {eid!r} is unknown"}})
            return httpx.Response(200, json=self.public(eid))
        return self.chat(body)

    def public(self, eid: str) -> dict[str, Any]:
        return {k: v for k, v in self.episodes[eid].items() if k != "messages"}

    def chat(self, body: dict[str, Any]) -> httpx.Response:
        eid, messages = body["episode"], body["messages"]
        ep = self.episodes.setdefault(eid, {"id": eid, "turns": 0, "prompt_ids": [], "completion_ids": [],
                                            "loss_mask": [], "rollout_logprobs": [], "versions": [],
                                            "temperatures": [], "messages": []})
        held = ep["messages"]
        if messages[: len(held)] != held:
            return httpx.Response(409, json={"error": {"message": "messages do not start with the episode's"}})
        new = messages[len(held):]
        delta = [100 + len(held) + i for i in range(len(new))]
        if ep["turns"] == 0:
            ep["prompt_ids"] = delta
        else:
            ep["completion_ids"] += delta
            ep["loss_mask"] += [0] * len(delta)
            ep["rollout_logprobs"] += [0.0] * len(delta)
        turn = ep["turns"]
        sampled = [10 * (turn + 1), 10 * (turn + 1) + 1]
        prompt_ids = ep["prompt_ids"] + ep["completion_ids"]
        ep["completion_ids"] += sampled
        ep["loss_mask"] += [1, 1]
        ep["rollout_logprobs"] += [-0.5, -0.25]
        ep["versions"].append(self.versions[turn])
        origin: dict[str, Any] = {}
        if self.runs is not None:
            run, version = self.runs[turn], self.versions[turn]
            origin = {"run": run, "adapter": f"{run}-v{version}" if run and version else None}
            ep.setdefault("runs", []).append(origin["run"])
            ep.setdefault("adapters", []).append(origin["adapter"])
        temperature = body.get("temperature") or 1.0  # the gateway's rule: greedy is under T = 1
        ep["temperatures"].append(temperature)
        ep["turns"] += 1
        message: dict[str, Any] = {"role": "assistant", "content": f"turn {turn}"}
        finish = "stop"
        if turn == self.tool_call_on:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "open_drawer", "arguments": '{"d": 3}'}}]}
            finish = "tool_calls"
        ep["messages"] = [*messages, message]
        return httpx.Response(200, json={
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "tandem": {**origin, "version": self.versions[turn], "prompt_token_ids": prompt_ids,
                       "completion_token_ids": [sampled], "completion_logprobs": [[-0.5, -0.25]],
                       "temperature": temperature, "episode": self.public(eid)},
        })


def run_on(gateway: Any) -> Run:
    http = httpx.Client(base_url=GATEWAY, transport=httpx.MockTransport(gateway))
    client = Client(GATEWAY, http=http, conn=redis.Redis(port=free_port(), socket_connect_timeout=1))
    return Run(client, RunSpec(name="agent", base_model="m"))


def test_three_turns_repeat_every_message_and_train_only_sampled_ids() -> None:
    gateway = FakeGateway(versions=[4, 3, 4], tool_call_on=0)
    run = run_on(gateway)
    ep = run.episode([{"role": "user", "content": "find the coin"}], tools=[TOOL], episode_id="ep-1")
    first = ep.sample(max_tokens=8)
    assert first.tool_calls[0]["function"]["name"] == "open_drawer" and first.finish_reason == "tool_calls"
    assert first.completion_ids == [10, 11] and first.version == 4
    ep.add({"role": "tool", "tool_call_id": "call_1", "content": "drawer 3: empty"})
    second = ep.sample(max_tokens=8)
    assert second.text == "turn 1" and second.tool_calls == []
    ep.add({"role": "user", "content": "where is it?"})
    ep.sample(max_tokens=8)

    bodies = [body for method, _, body in gateway.requests if method == "POST"]
    assert [b["episode"] for b in bodies] == ["ep-1"] * 3 and all("n" not in b for b in bodies)
    assert bodies[0]["tools"] == [TOOL]
    # each request starts with the last one's messages plus the reply exactly as the gateway gave it
    assert bodies[1]["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "open_drawer", "arguments": '{"d": 3}'}}]}
    assert bodies[2]["messages"][: len(bodies[1]["messages"])] == bodies[1]["messages"]
    assert len(ep.messages) == 6 and ep.messages[-1]["role"] == "assistant"

    trajectory = ep.trajectory(reward=1.0)
    assert trajectory.prompt_ids == [100]
    assert trajectory.completion_ids == [10, 11, 102, 20, 21, 104, 30, 31]
    assert trajectory.mask == [1, 1, 0, 1, 1, 0, 1, 1]
    assert trajectory.rollout_logprobs == [-0.5, -0.25, 0.0, -0.5, -0.25, 0.0, -0.5, -0.25]
    assert trajectory.version == 3, "an episode is as stale as its oldest turn"
    assert ep.state is not None and ep.state.versions == [4, 3, 4]


def test_episodes_of_one_start_make_a_group_and_close_deletes_them() -> None:
    gateway = FakeGateway()
    run = run_on(gateway)
    episodes = [run.episode([{"role": "user", "content": "hi"}]) for _ in range(3)]
    assert len({ep.id for ep in episodes}) == 3
    for ep in episodes:
        ep.sample()
    group = run.group(episodes, [0.0, 0.5, 1.0])
    assert [t.reward for t in group.trajectories] == [0.0, 0.5, 1.0]
    with episodes[0] as ep:
        pass
    assert ("DELETE", f"/v1/episodes/{ep.id}", None) in gateway.requests
    ep.close()  # idempotent: nothing more is asked of the gateway
    assert gateway.requests.count(("DELETE", f"/v1/episodes/{ep.id}", None)) == 1
    for use in (lambda: ep.trajectory(1.0), lambda: ep.sample(), lambda: run.group([ep], [1.0]),
                lambda: ep.add({"role": "user", "content": "more"})):
        with pytest.raises(ValidationFailed, match="was closed") as info:  # not the gateway's "unknown or expired"
            use()
        assert info.value.field == "episode"
    fresh = run.episode([{"role": "user", "content": "z"}])
    sent = len(gateway.requests)
    with pytest.raises(ValidationFailed, match="has no sampled turn.*call sample\\(\\) first"):
        run.group([fresh], [1.0])
    assert len(gateway.requests) == sent  # nothing asked of the gateway


@pytest.mark.parametrize("episode_id", ["", "a/b", "x" * 129, "white space", "ep\n"])
def test_a_bad_episode_id_is_refused_before_anything_is_sent(episode_id: str) -> None:
    gateway = FakeGateway()
    with pytest.raises(ValidationFailed) as info:
        run_on(gateway).episode([{"role": "user", "content": "hi"}], episode_id=episode_id)
    assert info.value.field == "episode_id" and repr(episode_id) in str(info.value)
    assert gateway.requests == []


def test_assistant_messages_come_only_from_sample() -> None:
    run = run_on(FakeGateway())
    with pytest.raises(ValidationFailed, match="assistant") as info:
        run.episode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert info.value.field == "messages"
    ep = run.episode([{"role": "user", "content": "a"}])
    with pytest.raises(ValidationFailed, match="sample"):
        ep.add({"role": "assistant", "content": "made up"})
    with pytest.raises(ValidationFailed, match="empty"):
        run.episode([])
    for bad in ("wizard", "Assistant", "function"):  # kept, it made every later turn fail with a 422
        with pytest.raises(ValidationFailed, match=f"role '{bad}'.*system, developer, user, tool") as info:
            ep.add({"role": bad, "content": "x"})
        assert info.value.field == "messages"
    assert ep.messages == [{"role": "user", "content": "a"}]
    ep.add({"role": "tool", "content": "42"}, {"role": "developer", "content": "d"})  # the roles it takes


@pytest.mark.parametrize(("message", "said"), [
    ({"role": "user"}, "has content None"),
    ({"role": "user", "content": None}, "has content None"),
    ({"role": "user", "content": 5}, "has content 5"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "has content"),
    ({"role": "user", "content": [{"type": "text"}]}, "has content"),
    ({"role": "tool", "content": "r", "tool_call_id": 7}, "tool_call_id 7"),
    ({"role": "user", "content": "u", "tool_calls": []}, "with tool_calls"),
])
def test_a_message_the_gateway_would_refuse_is_refused_by_add_and_not_kept(message: dict, said: str) -> None:
    """Kept, it made every later sample() of the episode a 422, and only editing `messages` by hand
    got the episode going again."""
    ep = run_on(FakeGateway()).episode([{"role": "user", "content": "a"}])
    with pytest.raises(ValidationFailed, match=re.escape(said)) as info:
        ep.add({"role": "user", "content": "fine"}, message)
    assert info.value.field == "messages"
    assert ep.messages == [{"role": "user", "content": "a"}]  # not even the call's good message
    ep.add({"role": "user", "content": [{"type": "text", "text": "parts"}]},
           {"role": "tool", "content": "r", "tool_call_id": "call_1"})  # what the gateway takes


def test_an_episode_without_a_turn_cannot_become_a_trajectory() -> None:
    gateway = FakeGateway()
    run = run_on(gateway)
    ep = run.episode([{"role": "user", "content": "a"}])
    gateway.episodes[ep.id] = {"id": ep.id, "turns": 0, "prompt_ids": [1], "completion_ids": [],
                               "loss_mask": [], "rollout_logprobs": [], "versions": [], "temperatures": [],
                               "messages": []}
    with pytest.raises(ValidationFailed, match="sample") as info:
        ep.trajectory(1.0)
    assert info.value.field == "turns"


def test_a_changed_history_is_the_gateways_409_as_a_gateway_error() -> None:
    run = run_on(FakeGateway())
    ep = run.episode([{"role": "user", "content": "a"}])
    ep.sample()
    ep.messages[1] = {"role": "assistant", "content": "rewritten"}
    with pytest.raises(GatewayError) as info:
        ep.sample()
    assert info.value.status_code == 409


@pytest.mark.parametrize("answer", [
    {"choices": [{"message": {"content": "x"}}], "tandem": {"prompt_token_ids": [1], "completion_token_ids": [[2]],
                                                           "completion_logprobs": [[-0.1]], "version": 0,
                                                           "temperature": 1.0}},
    {"choices": [{"message": {"content": "x"}}], "tandem": {
        "prompt_token_ids": [1], "completion_token_ids": [[2]], "completion_logprobs": [[-0.1]], "version": 0,
        "temperature": 1.0,
        "episode": {"id": "e", "turns": 1, "prompt_ids": [1], "completion_ids": [2], "loss_mask": [1, 1],
                    "rollout_logprobs": [-0.1], "versions": [0], "temperatures": [1.0]}}},
])
def test_a_turn_answered_without_a_sound_episode_is_a_gateway_error(answer: dict[str, Any]) -> None:
    run = run_on(lambda _: httpx.Response(200, json=answer))
    ep = run.episode([{"role": "user", "content": "a"}])
    with pytest.raises(GatewayError, match="episode"):
        ep.sample()
    assert len(ep.messages) == 1, "a failed turn appends nothing"


def test_an_all_zero_loss_mask_is_refused_naming_loss_mask() -> None:
    with pytest.raises(ValueError, match="loss_mask") as info:
        Trajectory(prompt_ids=[1], completion_ids=[2, 3], rollout_logprobs=[0.0, 0.0], loss_mask=[0, 0], reward=1.0)
    assert "trained on" in str(info.value)
    run = run_on(FakeGateway())
    gateway_state = {"id": "e", "turns": 1, "prompt_ids": [1], "completion_ids": [2], "loss_mask": [0],
                     "rollout_logprobs": [0.0], "versions": [0], "temperatures": [1.0]}
    ep = Episode(run, [{"role": "user", "content": "a"}], episode_id="e")
    run.client.http = httpx.Client(base_url=GATEWAY, transport=httpx.MockTransport(
        lambda _: httpx.Response(200, json=gateway_state)))
    with pytest.raises(ValidationFailed) as failed:
        ep.trajectory(1.0)
    assert failed.value.field == "loss_mask"


def test_an_episode_sampled_at_two_temperatures_is_refused_naming_them() -> None:
    """One trajectory's logprobs are under one temperature (tandem.logprobs): the trainer scales by it."""
    run = run_on(FakeGateway())
    ep = run.episode([{"role": "user", "content": "a"}])
    assert ep.sample(temperature=0.7).temperature == 0.7
    ep.add({"role": "user", "content": "b"})
    ep.sample(temperature=0.7)
    assert ep.trajectory(1.0).temperature == 0.7
    ep.add({"role": "user", "content": "c"})
    ep.sample(temperature=1.0)
    with pytest.raises(ValidationFailed, match=r"temperatures \[0.7, 0.7, 1.0\]") as info:
        ep.trajectory(1.0)
    assert info.value.field == "temperatures"


def test_an_episodes_trajectory_carries_the_run_and_adapter_of_its_oldest_turn() -> None:
    run = run_on(FakeGateway(versions=[4, 3, 4], runs=["agent"] * 3))
    ep = run.episode([{"role": "user", "content": "a"}])
    assert ep.sample().origin == Origin(run="agent", adapter="agent-v4")
    ep.add({"role": "user", "content": "b"})
    ep.sample()
    ep.add({"role": "user", "content": "c"})
    ep.sample()
    assert ep.state is not None and ep.state.runs == ["agent"] * 3
    assert ep.state.adapters == ["agent-v4", "agent-v3", "agent-v4"]
    trajectory = ep.trajectory(1.0)
    assert (trajectory.version, trajectory.origin) == (3, Origin(run="agent", adapter="agent-v3"))
    base = run_on(FakeGateway(versions=[0], runs=[None])).episode([{"role": "user", "content": "a"}])
    base.sample()
    assert base.trajectory(1.0).origin == Origin(run=None)  # the base model asked for by its own name


def test_an_episode_from_a_gateway_that_names_no_run_trains_as_before() -> None:
    run = run_on(FakeGateway())
    ep = run.episode([{"role": "user", "content": "a"}])
    assert ep.sample().origin is None
    assert ep.trajectory(1.0).origin is None


def test_an_episode_whose_turns_name_two_runs_is_refused_naming_them() -> None:
    """tandem's gateway keeps one run per episode (409); an episode state built by hand may not."""
    state = EpisodeState(id="e", turns=2, prompt_ids=[1], completion_ids=[2, 3], loss_mask=[1, 1],
                         rollout_logprobs=[-0.5, -0.5], versions=[1, 1], temperatures=[1.0, 1.0],
                         runs=["agent", "other"], adapters=["agent-v1", "other-v1"])
    with pytest.raises(ValidationFailed, match=r"runs \['agent', 'other'\]") as info:
        state.to_trajectory(1.0)
    assert info.value.field == "runs"
    with pytest.raises(ValueError, match="2 turns but 1 adapters"):
        EpisodeState.model_validate({**state.model_dump(), "runs": ["agent"] * 2, "adapters": ["agent-v1"]})
