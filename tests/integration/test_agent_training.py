"""Multi-turn trajectories from rollout to loss, on the tiny model with a real Redis.

The trainer: masked-out tokens (the messages between turns) neither change the loss nor its
gradient, and a job fails naming the field when a loss mask cannot be right (a length that
differs from the completion, all zeros, a turn-start token in a trained span). The client:
episodes through a real gateway and engine, whose trajectories hold exactly the ids the engine
sampled, turn after turn.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from tandem import Client, Run
from tandem.acl import Role
from tandem.adapters import AdapterStore
from tandem.errors import GatewayError, ValidationFailed
from tandem.registry import Registry
from tandem.runs import LoraConfig, OptimizerConfig, RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.errors import JobRejected
from tandem_trainer.grpo import grpo_loss
from tandem_trainer.jobs.runner import Trainer
from tandem_trainer.microbatch import Sample, build_microbatches
from tandem_trainer.turns import turn_start

pytestmark = pytest.mark.integration

RUN = "agent"
TURN_START = 1  # `<|im_start|>` in the tiny model's tokenizer


@pytest.fixture(scope="module")
def backend() -> PeftBackend:
    return PeftBackend("cpu")


@pytest.fixture
def trainer(role_urls: dict[Role, str], redis_conn: redis.Redis, backend: PeftBackend, tmp_path: Path,
            tiny_model: Path) -> Iterator[Trainer]:
    """The trainer's job runner, as the trainer's Redis user."""
    settings = TrainerSettings(redis={"url": role_urls[Role.TRAINER]}, store={"root": tmp_path / "adapters"},
                               backend={"micro_batch_tokens": 256})
    settings.store.root.mkdir(parents=True)
    Registry(redis_conn).create_run(RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
                                            optimizer=OptimizerConfig(lr=1e-2)))
    conn = settings.redis.connect()
    yield Trainer(settings, conn, backend, AdapterStore(settings.store.root))
    conn.close()


def episode(rng: random.Random, turns: int = 3) -> dict[str, Any]:
    """A made-up episode: sampled turns (mask 1) with template-shaped messages between (mask 0)."""
    ids: list[int] = []
    mask: list[int] = []
    for turn in range(turns):
        if turn:
            between = [2, 5, TURN_START, 7, 5] + [rng.randrange(3, 500) for _ in range(4)] + [2, 5, TURN_START, 9, 5]
            ids += between
            mask += [0] * len(between)
        sampled = [rng.randrange(3, 500) for _ in range(rng.randint(2, 6))] + [2]
        ids += sampled
        mask += [1] * len(sampled)
    return {"prompt_ids": [TURN_START, 8, 5, *[rng.randrange(3, 500) for _ in range(5)], 2, 5, TURN_START, 9, 5],
            "completion_ids": ids, "loss_mask": mask,
            "rollout_logprobs": [-6.2 if m else 0.0 for m in mask], "reward": rng.random()}


def job(job_id: str, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    groups = [{"trajectories": [episode(rng) for _ in range(3)]} for _ in range(2)]
    return {"job_id": job_id, "run": RUN, "step": 1, "groups": groups, "timeout_s": 60}


def test_the_tiny_template_opens_each_message_with_im_start(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    assert turn_start(AutoTokenizer.from_pretrained(tiny_model)) == (TURN_START, "<|im_start|>")


def test_multi_turn_episodes_train(trainer: Trainer) -> None:
    result = trainer.train(job("ep-job"))
    assert result.version == 1
    masks = [t["loss_mask"] for g in job("ep-job")["groups"] for t in g["trajectories"]]
    assert result.metrics["tokens"] == sum(map(sum, masks))


def _loss_and_grads(backend: PeftBackend, samples: list[Sample]) -> tuple[float, list[torch.Tensor]]:
    (mb,) = build_microbatches(samples, budget=10_000)
    terms = grpo_loss(backend.forward(mb).logprobs, mb.rollout_logprobs, mb.advantages, mb.mask,
                      clip_low=0.2, clip_high=0.28)
    terms.loss.backward()
    params = [p for p in backend._require_model().parameters() if p.requires_grad]
    grads = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return float(terms.loss.detach()), grads


def test_masked_out_tokens_change_neither_the_loss_nor_its_gradient(backend: PeftBackend, tiny_model: Path) -> None:
    backend.activate(RunSpec(name="masking", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0)), 0, None)
    rng = random.Random(3)
    eps = [episode(rng) for _ in range(2)]

    def samples(logprob_at_mask0: float, trailing: int) -> list[Sample]:
        out = []
        for e, adv in zip(eps, (1.0, -1.0), strict=True):
            ids, mask = list(e["completion_ids"]), list(e["loss_mask"])
            lps = [lp if m else logprob_at_mask0 for lp, m in zip(e["rollout_logprobs"], mask, strict=True)]
            # a tool result after the last turn: more context, nothing trained
            ids, mask, lps = ids + [7] * trailing, mask + [0] * trailing, lps + [logprob_at_mask0] * trailing
            out.append(Sample(e["prompt_ids"], ids, lps, mask, adv))
        return out

    loss, grads = _loss_and_grads(backend, samples(0.0, 0))
    assert any(float(g.abs().sum()) > 0 for g in grads), "the sampled tokens carry a gradient"
    for logprob, trailing in ((-30.0, 0), (0.0, 9), (-3.0, 5)):
        other_loss, other_grads = _loss_and_grads(backend, samples(logprob, trailing))
        assert other_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
        for g, h in zip(grads, other_grads, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-7)


def _mask_too_short(j: dict[str, Any]) -> None:
    j["groups"][0]["trajectories"][1]["loss_mask"].pop()


def _mask_all_zero(j: dict[str, Any]) -> None:
    traj = j["groups"][1]["trajectories"][2]
    traj["loss_mask"] = [0] * len(traj["completion_ids"])


def _tool_message_trained(j: dict[str, Any]) -> None:
    traj = j["groups"][1]["trajectories"][0]
    traj["loss_mask"] = [1] * len(traj["completion_ids"])
    traj["rollout_logprobs"] = [-6.2] * len(traj["completion_ids"])


BAD_MASKS = {
    "mask_length": (_mask_too_short, "groups.0.trajectories.1", ["loss_mask", "completion_ids"]),
    "mask_all_zero": (_mask_all_zero, "groups.1.trajectories.2.loss_mask", ["loss_mask", "trained on"]),
    "turn_start_in_trained_span": (_tool_message_trained, "groups.1.trajectories.0.loss_mask",
                                   ["groups.1.trajectories.0.loss_mask", "<|im_start|>", "completion token"]),
}


@pytest.mark.parametrize("case", sorted(BAD_MASKS))
def test_a_mask_that_cannot_be_right_fails_the_job_naming_the_field(case: str, trainer: Trainer,
                                                                   redis_conn: redis.Redis) -> None:
    mutate, field, words = BAD_MASKS[case]
    bad = job(f"bad-{case.replace('_', '-')}")
    mutate(bad)
    with pytest.raises(JobRejected) as info:
        trainer.train(bad)
    assert info.value.field == field
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert Registry(redis_conn).latest_version(RUN) == 0


def test_the_position_of_a_turn_start_in_a_trained_span_is_named(trainer: Trainer) -> None:
    bad = job("bad-position")
    traj = bad["groups"][0]["trajectories"][0]
    first_between = traj["loss_mask"].index(0)
    traj["loss_mask"][first_between + 2] = 1  # the `<|im_start|>` of the tool message
    with pytest.raises(JobRejected, match=f"completion token {first_between + 2} is '<\\|im_start\\|>'"):
        trainer.train(bad)


def test_a_single_turn_completion_without_a_mask_is_trained_whatever_it_sampled(trainer: Trainer) -> None:
    plain = job("plain")
    for group in plain["groups"]:
        for traj in group["trajectories"]:
            del traj["loss_mask"]
            traj["rollout_logprobs"] = [-6.2] * len(traj["completion_ids"])
    assert trainer.train(plain).version == 1


@pytest.fixture
def base_run(servers: Any, client_conn: redis.Redis, tiny_model: Path) -> Iterator[Run]:
    """The base model behind a real gateway and engine, as a run the client (its Redis user) samples from."""
    from helpers.servers import BASE

    client = Client(servers.gateway, conn=client_conn)
    yield Run(client, RunSpec(name=BASE, base_model=str(tiny_model)))
    client.close()


def test_episode_ids_are_the_engines_turn_after_turn(base_run: Run, tokenizer: Any) -> None:
    """Every turn's prompt is the episode's ids so far and its sampled ids land in the episode as
    they came (mask 1, their logprobs); a re-render of the same conversation is not those ids."""
    rerendered_differs = []
    for e in range(3):
        ep = base_run.episode([{"role": "system", "content": "Open drawers."}, {"role": "user", "content": "Which one?"}])
        for turn in range(3):
            if turn:
                ep.add({"role": "tool", "content": f"drawer {turn}: empty"}, {"role": "user", "content": "Next?"})
            before = ep.state.prompt_ids + ep.state.completion_ids if ep.state else None
            sampled = ep.sample(max_tokens=6, temperature=1.0)
            state = ep.state
            assert state is not None and state.turns == turn + 1
            ids = state.prompt_ids + state.completion_ids
            if before is not None:
                assert sampled.prompt_ids[: len(before)] == before, "a turn starts from every id before it"
            assert sampled.prompt_ids == ids[: len(sampled.prompt_ids)]
            start = len(sampled.prompt_ids) - len(state.prompt_ids)
            span = slice(start, start + len(sampled.completion_ids))
            assert ids[len(sampled.prompt_ids):] == sampled.completion_ids
            assert state.loss_mask[span] == [1] * len(sampled.completion_ids)
            assert state.rollout_logprobs[span] == pytest.approx(sampled.rollout_logprobs)
            if turn:
                assert state.loss_mask[start - 1] == 0, "the new messages' template ids are not trained"
        trajectory = ep.trajectory(reward=float(e))
        assert trajectory.completion_ids == ep.fetch().completion_ids and trajectory.version == 0
        assert sum(trajectory.mask) == sum(len(t.completion_ids) for t in ep.turns)
        naive = tokenizer.apply_chat_template(ep.messages, tokenize=False)
        rerendered_differs.append(tokenizer(naive, add_special_tokens=False).input_ids
                                  != trajectory.prompt_ids + trajectory.completion_ids)
        ep.close()
        with pytest.raises(GatewayError) as gone:  # deleted at the gateway
            base_run.client.get(f"/v1/episodes/{ep.id}")
        assert gone.value.status_code == 404
        with pytest.raises(ValidationFailed, match="was closed"):  # and the client says so before asking
            ep.fetch()
    assert any(rerendered_differs), "re-rendering the conversation gives other ids than the ones sampled"
