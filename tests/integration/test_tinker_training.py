"""The Tinker SDK's training loop end to end on tandem: the real `tinker` SDK against the Tinker
service, a real trainer worker on the tiny model, and the gateway with its controller in front of
the tiny model's engine, all on loopback with a real Redis.

forward_backward and optim_step pipeline into trainer jobs; the optim_step publishes version 1;
save_weights_and_get_sampling_client completes once version 1 serves and samples from it;
save_weights names it, and create_training_client_from_state_with_optimizer makes a new model of it
(a run whose version 1 is that state) which trains on; a datum the
trainer refuses comes back as the SDK's RequestFailedError with the trainer's message.
forward_backward_custom runs a client-side loss through the service (a forward, then a
cross_entropy forward_backward weighted by the loss's gradient), checked against a hand computation.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers.servers import gateway, inference_settings
from helpers.tinker_service import API_KEY, tinker_service
from helpers.workers import WorkerProcess

from tandem.acl import Role
from tandem.registry import Registry

tinker = pytest.importorskip("tinker")
from tinker import types as tt  # noqa: E402

# NOTE: tinker 0.38.0's ServiceClient leaves sockets of its background event loop open after
# close() (ResourceWarning: unclosed transport); the SDK's, not the service's.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture
def stack(workers: Callable[..., WorkerProcess], role_urls: dict[Role, str], tmp_path: Path, engine_url: str,
          tiny_model: Path, tokenizer: Any, redis_conn: redis.Redis) -> Iterator[str]:
    """A trainer worker, the gateway with its controller (one adapter store), the Tinker service: its URL."""
    workers()
    settings = inference_settings(role_urls[Role.INFERENCE], tmp_path / "adapters", engine_url, tiny_model)
    with gateway(settings, tokenizer) as gateway_url, \
            tinker_service(role_urls[Role.TINKER], gateway_url, poll_wait_s=1.0) as url:
        yield url


@pytest.fixture
def sdk(stack: str) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=stack, api_key=f"tml-{API_KEY}")
    yield client
    client.close("success").result()
    with warnings.catch_warnings():  # the SDK's leaked sockets (NOTE above), collected while ignored
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def datum(tokens: list[int]) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_train_save_sample_and_load_through_the_sdk(stack: str, sdk: Any, tiny_model: Path,
                                                   redis_conn: redis.Redis) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    data = [datum([5, 6, 7, 8, 9]), datum([10, 11, 12])]
    fb = tc.forward_backward(data, "cross_entropy")  # pipelined: both are sent before either is awaited
    step = tc.optim_step(tt.AdamParams(learning_rate=1e-2))
    out = fb.result(timeout=300)
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [4, 2]
    assert all(lp <= 0 for o in out.loss_fn_outputs for lp in o["logprobs"].tolist())
    step.result(timeout=300)
    registry = Registry(redis_conn)
    assert registry.latest_version(tc.model_id) == 1

    sampler = tc.save_weights_and_get_sampling_client().result()  # completes once version 1 serves
    assert 1 in registry.loaded(tc.model_id)  # as the controller recorded it (no replica heartbeats here)
    got = sampler.sample(prompt=tt.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                         sampling_params=tt.SamplingParams(max_tokens=3, temperature=0.0)).result(timeout=120)
    seq = got.sequences[0]
    assert 1 <= len(seq.tokens) <= 3 and len(seq.logprobs) == len(seq.tokens)

    named = tc.save_weights_for_sampler("first").result(timeout=120)
    assert named.path == f"tinker://{tc.model_id}/sampler_weights/first"
    # a client opened on the path (the cookbook's checkpoints): the SDK asks GET /samplers/{id} first
    opened = sdk.create_sampling_client(model_path=named.path).result(timeout=120)
    again = opened.sample(prompt=tt.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                          sampling_params=tt.SamplingParams(max_tokens=3, temperature=0.0)).result(timeout=120)
    assert again.sequences[0].tokens == seq.tokens  # version 1, greedy: what the first sampler gave
    rest = tinker.RestClient(base_url=stack, api_key=f"tml-{API_KEY}")
    try:
        info = rest.get_sampler(opened._sampling_session_id).result(timeout=60)
    finally:
        rest.holder.run_coroutine_threadsafe(rest.holder.aclose()).result()
    assert info.model_path == named.path and info.base_model == str(tiny_model)
    saved = tc.save_state("resume-here").result(timeout=120)
    assert saved.path == f"tinker://{tc.model_id}/weights/resume-here"
    resumed = sdk.create_training_client_from_state_with_optimizer(saved.path).result(timeout=300)
    run = resumed.model_id  # the SDK names it <session>:train:<n>; the service made it a run of its own
    loaded = [r for r in registry.list_runs() if r != tc.model_id]
    assert len(loaded) == 1 and registry.latest_version(loaded[0]) == 1  # the checkpoint, as its version 1
    step = resumed.forward_backward(data, "cross_entropy")
    resumed.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=300)
    assert step.result(timeout=300).loss_fn_outputs and registry.latest_version(loaded[0]) == 2
    assert run.endswith(":train:1")


def test_a_datum_the_trainer_refuses_fails_its_future_with_the_trainers_message_and_adds_nothing(
        sdk: Any, tiny_model: Path) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="target_tokens") as failed:
        tc.forward_backward([datum([5, 6, 10**7])], "cross_entropy").result(timeout=300)
    assert failed.value.category == tt.RequestErrorCategory.User  # the caller's to fix, not the service's
    # the model goes on: the next call trains
    out = tc.forward_backward([datum([5, 6, 7])], "cross_entropy").result(timeout=300)
    assert len(out.loss_fn_outputs) == 1
    seen = tc.forward([datum([5, 6, 7])], "cross_entropy").result(timeout=300)  # forward only: the same logprobs
    assert seen.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(out.loss_fn_outputs[0]["logprobs"].tolist(),
                                                                         abs=1e-5)
    # the step applies the forward_backward that trained, not the refused one: it used to count it
    # as lost, compute it again without the checks that refused it, and fail (or train on it)
    stepped = tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=300)
    assert stepped.metrics["gradient_jobs"] == 1.0 and stepped.metrics["grad_norm"] > 0


def scaled(tokens: list[int], scale: list[float]) -> tt.Datum:
    """A datum for a custom loss: its targets and a per-token `scale` of the loss's own (the SDK sends
    only target_tokens and weights to the server; the loss reads the rest client-side)."""
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "scale": tt.TensorData(data=scale, dtype="float32", shape=[len(scale)])})


def squared_logprobs(data: list[tt.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
    """C = sum over datums and tokens of scale * logprob**2 / 2: its gradient, scale * logprob, is
    what the SDK sends back negated as the cross_entropy weights."""
    import torch

    loss = sum(((d.loss_fn_inputs["scale"].to_torch() * lp**2) / 2).sum() for d, lp in zip(data, logprobs, strict=True))
    assert isinstance(loss, torch.Tensor)
    return loss, {"tokens:sum": float(sum(lp.numel() for lp in logprobs))}


def test_forward_backward_custom_trains_on_a_client_side_loss(sdk: Any, tiny_model: Path,
                                                             redis_conn: redis.Redis) -> None:
    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    seqs, scales = [[5, 6, 7, 8, 9], [10, 11, 12]], [[1.0, 0.5, 2.0, 1.0], [3.0, 0.25]]
    weighted = [datum(s) for s in seqs]  # the same tokens, for plain forward passes

    def logprobs() -> list[list[float]]:
        return [o["logprobs"].tolist() for o in tc.forward(weighted, "cross_entropy").result(timeout=300).loss_fn_outputs]

    def by_hand(lps: list[list[float]]) -> float:
        return sum(s * lp * lp / 2 for ss, ls in zip(scales, lps, strict=True) for s, lp in zip(ss, ls, strict=True))

    before = logprobs()
    custom = tc.forward_backward_custom([scaled(s, c) for s, c in zip(seqs, scales, strict=True)], squared_logprobs)
    step = tc.optim_step(tt.AdamParams(learning_rate=1e-2))  # pipelined behind both of its requests
    out = custom.result(timeout=300)
    step.result(timeout=300)

    # the server's pass saw the same weights: its logprobs are the forward's
    got = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
    assert [len(g) for g in got] == [4, 2]
    assert got[0] == pytest.approx(before[0], abs=1e-5) and got[1] == pytest.approx(before[1], abs=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(by_hand(before), rel=1e-4)  # C, computed by the SDK
    assert out.metrics["tokens:sum"] == 6.0  # the loss's own metrics come back
    # the server's cross_entropy with weights -dC/dlogprob = -scale * logprob: sum(scale * logprob**2) = 2C
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(2 * by_hand(before), rel=1e-4)

    assert Registry(redis_conn).latest_version(tc.model_id) == 1  # the step published the run's first version
    after = logprobs()
    assert all(abs(a - b) > 1e-3 for la, lb in zip(after, before, strict=True) for a, b in zip(la, lb, strict=True))
    assert by_hand(after) < by_hand(before)  # the weights moved, down the custom loss's gradient


def test_a_checkpoint_saved_before_the_first_step_opens_a_new_client_at_the_same_fresh_lora(
        sdk: Any, tiny_model: Path, redis_conn: redis.Redis) -> None:
    data = [datum([5, 6, 7, 8])]

    def one_step(client: Any) -> list[float]:
        """Logprobs after one identical step: a fresh LoRA's B is zero, so only a step shows its A (the seed)."""
        client.forward_backward(data, "cross_entropy")
        client.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=300)
        return list(client.forward(data, "cross_entropy").result(timeout=300).loss_fn_outputs[0]["logprobs"].tolist())

    tc = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=3).result()
    saved = tc.save_state("step-0").result(timeout=120)
    resumed = sdk.create_training_client_from_state(saved.path).result(timeout=120)
    assert resumed.model_id != tc.model_id
    stepped = one_step(resumed)  # its calls go on in order from the load
    assert stepped == pytest.approx(one_step(tc), abs=1e-5)  # the same seed's fresh LoRA, stepped alike
    other = sdk.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=4).result()
    assert one_step(other) != pytest.approx(stepped, abs=1e-5)  # the control: another seed steps elsewhere
    registry = Registry(redis_conn)
    assert sorted(registry.latest_version(r) for r in registry.list_runs()) == [1, 1, 1]

    # into an existing model it would be a reset, which is refused naming the way that works
    with pytest.warns(FutureWarning, match="load_state"), \
            pytest.raises(tinker.UnprocessableEntityError, match="create_training_client_from_state"):
        tc.load_state(saved.path).result(timeout=120)  # (the SDK deprecates load_state, but still sends it)
    assert tc.forward(data, "cross_entropy").result(timeout=300).loss_fn_outputs  # its next call is not held back
