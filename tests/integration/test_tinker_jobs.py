"""Tinker's training calls as trainer jobs, on the tiny model with a real Redis: forward_backward
holds gradients with the run (across calls, and across switches to other runs), optim_step applies
exactly those and publishes, load_state copies a version; bad input is rejected naming the field.
The last test runs them through the real worker process and the queue's guard."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import redis
import torch
from helpers.jobs import make_job, status
from helpers.store_reads import counted_reads
from helpers.workers import wait_for
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem import keys
from tandem.adapters import AdapterStore
from tandem.events import EventKind, EventStream
from tandem.jobs import train_queue
from tandem.registry import Registry
from tandem.runs import LoraConfig, OptimizerConfig, RunSpec
from tandem.settings import TrainerSettings
from tandem.tinker_jobs import (
    AdamParams,
    Datum,
    ForwardBackwardJob,
    ForwardBackwardResult,
    LoadStateJob,
    LoadStateResult,
    LossName,
    OptimStepJob,
    OptimStepResult,
    enqueue,
)
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.backends.resident import ResidentBudget
from tandem_trainer.errors import JobRejected, LockTimeout
from tandem_trainer.jobs.runner import Trainer

pytestmark = pytest.mark.integration

DEVICE = os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> TrainerSettings:
    (tmp_path / "adapters").mkdir()
    return TrainerSettings(redis={"url": redis_url}, store={"root": tmp_path / "adapters"},
                           backend={"micro_batch_tokens": 128})


def create_runs(conn: redis.Redis, base: Path, *names: str, seed: int = 0, r: int = 4) -> None:
    for name in names:  # one seed: the runs start from the same fresh adapter
        Registry(conn).create_run(RunSpec(name=name, base_model=str(base), lora=LoraConfig(r=r, alpha=8.0),
                                          optimizer=OptimizerConfig(lr=1e-2), seed=seed))


def make_datum(seed: int, n: int = 10, *, rl: bool = False) -> Datum:
    rng = random.Random(seed)
    tokens = [rng.randrange(3, 500) for _ in range(n + 1)]
    inputs: dict[str, list[float]] = {"target_tokens": [float(t) for t in tokens[1:]]}
    if rl:
        inputs |= {"logprobs": [-6.0] * n, "advantages": [rng.uniform(-1, 1) for _ in range(n)]}
    else:
        inputs["weights"] = [0.0] * 3 + [1.0] * (n - 3)
    return Datum(tokens=tokens[:-1], inputs=inputs)


def forward_backward(trainer: Trainer, run: str, job_id: str, datums: list[Datum], *,
                     loss_fn: LossName = "cross_entropy", forward_only: bool = False) -> ForwardBackwardResult:
    job = ForwardBackwardJob(job_id=job_id, run=run, datums=datums, loss_fn=loss_fn, forward_only=forward_only)
    result = trainer.run("forward_backward", job.model_dump(mode="json"))  # as the queue carries it
    assert isinstance(result, ForwardBackwardResult)
    return result


def optim_step(trainer: Trainer, run: str, job_id: str, gradients_from: list[str]) -> OptimStepResult:
    job = OptimStepJob(job_id=job_id, run=run, gradients_from=gradients_from, adam=AdamParams(learning_rate=1e-2))
    result = trainer.run("optim_step", job.model_dump(mode="json"))
    assert isinstance(result, OptimStepResult)
    return result


def grads(backend: PeftBackend) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in backend.trainable_parameters()]


def adapter(store: AdapterStore, run: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(store.version_dir(run, version) / "adapter" / "adapter_model.safetensors"))


def optimizer_state(store: AdapterStore, run: str, version: int) -> dict:  # type: ignore[type-arg]
    state: dict = torch.load(store.version_dir(run, version) / "trainer" / "optimizer.pt",  # type: ignore[type-arg]
                             weights_only=True, map_location="cpu")["state"]
    return state


@pytest.fixture
def trainer(settings: TrainerSettings, redis_conn: redis.Redis) -> Trainer:
    return Trainer(settings, redis_conn, PeftBackend(DEVICE), AdapterStore(settings.store.root))


def test_forward_backward_then_optim_step_publishes_version_1_with_new_weights(trainer, redis_conn, tiny_model) -> None:
    create_runs(redis_conn, tiny_model, "a")
    datums = [make_datum(1), make_datum(2, n=7)]
    fb = forward_backward(trainer, "a", "fb-1", datums)
    assert [len(out["logprobs"]) for out in fb.loss_fn_outputs] == [10, 7]
    expected = -sum(lp * w for d, out in zip(datums, fb.loss_fn_outputs, strict=True)
                    for lp, w in zip(out["logprobs"], d.inputs["weights"], strict=True))
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)  # Tinker's sum, not a mean
    assert all(lp < 0 for out in fb.loss_fn_outputs for lp in out["logprobs"])
    assert trainer.backend.gradient_jobs() == ["fb-1"] and Registry(redis_conn).latest_version("a") == 0

    step = optim_step(trainer, "a", "step-1", ["fb-1"])
    assert (step.version, step.run, step.job_id) == (1, "a", "step-1") and step.metrics["grad_norm"] > 0
    store = trainer.store
    assert store.verify("a", 1).job_id == "step-1" and Registry(redis_conn).latest_version("a") == 1
    weights = adapter(store, "a", 1)
    lora_b = [t for key, t in weights.items() if "lora_B" in key]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # a fresh adapter's B is zero: the step moved it
    assert optimizer_state(store, "a", 1)  # the optimizer's moments beside the version
    ready = [e for e in EventStream(redis_conn).history() if e.kind is EventKind.ADAPTER_READY]
    assert [(e.run, e.version, e.job_id) for e in ready] == [("a", 1, "step-1")]
    assert trainer.backend.gradient_jobs() == []

    again = optim_step(trainer, "a", "step-1", ["fb-1"])  # a retry: the version its first attempt published
    assert again.version == 1 and Registry(redis_conn).latest_version("a") == 1


def test_forward_only_gives_the_models_logprobs_and_changes_nothing(trainer, redis_conn, tiny_model) -> None:
    create_runs(redis_conn, tiny_model, "a")
    datums = [make_datum(3), make_datum(4, n=5)]
    fwd = forward_backward(trainer, "a", "fwd-1", datums, forward_only=True)
    assert trainer.backend.gradient_jobs() == []
    assert all(p.grad is None for p in trainer.backend.trainable_parameters())
    assert Registry(redis_conn).latest_version("a") == 0 and trainer.store.versions("a") == []

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # a fresh LoRA adds nothing
    for d, out in zip(datums, fwd.loss_fn_outputs, strict=True):
        with torch.no_grad():
            logits = base(input_ids=torch.tensor([d.tokens])).logits[0].float()
        targets = torch.tensor([int(t) for t in d.inputs["target_tokens"]])
        direct = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        tolerance = 1e-5 if DEVICE == "cpu" else 5e-2  # a GPU's backend runs the model in bfloat16
        torch.testing.assert_close(torch.tensor(out["logprobs"]), direct, rtol=tolerance * 10, atol=tolerance)

    fb = forward_backward(trainer, "a", "fb-1", datums)  # the same weights, now with a backward pass
    assert fb.loss_fn_outputs == fwd.loss_fn_outputs and fb.metrics == fwd.metrics


def test_two_forward_backwards_hold_the_sum_of_their_gradients(trainer, redis_conn, tiny_model) -> None:
    create_runs(redis_conn, tiny_model, "a", "b")  # the same seed: the same fresh adapter
    d1, d2 = make_datum(5, rl=True), make_datum(6, n=8, rl=True)
    forward_backward(trainer, "a", "a-1", [d1], loss_fn="ppo")
    forward_backward(trainer, "a", "a-2", [d2], loss_fn="ppo")
    assert trainer.backend.gradient_jobs() == ["a-1", "a-2"]
    separately = grads(trainer.backend)
    forward_backward(trainer, "b", "b-1", [d1, d2], loss_fn="ppo")  # both datums in one call
    together = grads(trainer.backend)
    assert all(g is not None for g in separately) and len(separately) == len(together)
    for one, other in zip(separately, together, strict=True):
        torch.testing.assert_close(one, other, rtol=1e-4, atol=1e-6)

    # and the steps on them agree
    assert optim_step(trainer, "b", "b-step", ["b-1"]).version == 1
    assert optim_step(trainer, "a", "a-step", ["a-1", "a-2"]).version == 1
    a, b = adapter(trainer.store, "a", 1), adapter(trainer.store, "b", 1)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-5)


def test_interleaved_runs_keep_their_own_gradients_and_read_nothing(trainer, redis_conn, tiny_model,
                                                                    monkeypatch) -> None:
    create_runs(redis_conn, tiny_model, "a", "b")
    for run in ("a", "b"):  # each at v1, published: a switch could read it from the store
        forward_backward(trainer, run, f"{run}-0", [make_datum(0)])
        optim_step(trainer, run, f"{run}-step-1", [f"{run}-0"])
    backend = trainer.backend
    with counted_reads(monkeypatch, trainer.store) as reads:
        forward_backward(trainer, "a", "a-1", [make_datum(7)])
        held_a = grads(backend)
        forward_backward(trainer, "b", "b-1", [make_datum(8)])  # a is set aside with its gradients
        held_b = grads(backend)
        assert backend.gradient_jobs() == ["b-1"]
        forward_backward(trainer, "a", "a-peek", [make_datum(9)], forward_only=True)  # back to a: restored
        assert backend.gradient_jobs() == ["a-1"]
        for mine, restored in zip(held_a, grads(backend), strict=True):
            assert torch.equal(mine, restored)  # type: ignore[arg-type]
        forward_backward(trainer, "a", "a-2", [make_datum(10)])
        forward_backward(trainer, "b", "b-peek", [make_datum(9)], forward_only=True)
        for mine, restored in zip(held_b, grads(backend), strict=True):
            assert torch.equal(mine, restored)  # type: ignore[arg-type]  # nothing of a's in b's
        assert optim_step(trainer, "a", "a-step-2", ["a-1", "a-2"]).version == 2
        assert optim_step(trainer, "b", "b-step-2", ["b-1"]).version == 2
        assert reads == {}


def test_gradients_survive_a_switch_when_no_run_is_kept_in_memory(settings, redis_conn, tiny_model) -> None:
    backend = PeftBackend(DEVICE, resident=ResidentBudget(runs=1))
    trainer = Trainer(settings, redis_conn, backend, AdapterStore(settings.store.root))
    create_runs(redis_conn, tiny_model, "a", "b")
    forward_backward(trainer, "a", "a-1", [make_datum(1)])
    held = grads(backend)
    forward_backward(trainer, "b", "b-1", [make_datum(2)])
    forward_backward(trainer, "a", "a-2", [make_datum(3)], forward_only=True)
    assert backend.gradient_jobs() == ["a-1"]
    for mine, restored in zip(held, grads(backend), strict=True):
        assert torch.equal(mine, restored)  # type: ignore[arg-type]


def test_an_optim_step_naming_other_gradients_is_refused_and_the_next_calls_work(trainer, redis_conn,
                                                                                  tiny_model) -> None:
    create_runs(redis_conn, tiny_model, "a")
    forward_backward(trainer, "a", "fb-1", [make_datum(1)])
    with pytest.raises(JobRejected) as err:
        optim_step(trainer, "a", "step-1", ["fb-0", "fb-1"])  # fb-0's gradients are not held (a restart)
    assert err.value.field == "gradients_from"
    message = str(err.value)
    assert "['fb-0'] were lost" in message and "send the forward_backward calls again" in message
    assert Registry(redis_conn).latest_version("a") == 0 and trainer.backend.gradient_jobs() == []
    failed = [e for e in EventStream(redis_conn).history() if e.kind is EventKind.TRAIN_FAILED]
    assert [(e.job_id, e.data["field"], e.data["retries_left"]) for e in failed] == [("step-1", "gradients_from", 0)]

    forward_backward(trainer, "a", "fb-2", [make_datum(2)])
    with pytest.raises(JobRejected, match=r"held gradients of job\(s\) \['fb-2'\] that the step does not name"):
        optim_step(trainer, "a", "step-2", [])
    forward_backward(trainer, "a", "fb-3", [make_datum(3)])
    assert optim_step(trainer, "a", "step-3", ["fb-3"]).version == 1


def test_gradients_a_restart_lost_are_computed_again_from_their_jobs_and_step_as_if_held(
        trainer, redis_conn, tiny_model, caplog) -> None:
    """The trainer restarted between a forward_backward and its optim_step (its gradients were in
    memory): the step computes them again from the jobs rq keeps, on the same version, and lands
    where a trainer that never restarted lands."""
    create_runs(redis_conn, tiny_model, "lost", "kept")
    for run in ("lost", "kept"):
        for k in (1, 2):
            job = ForwardBackwardJob(job_id=f"{run}-fb-{k}", run=run, datums=[make_datum(k)], loss_fn="cross_entropy")
            enqueue(redis_conn, job)  # as the Tinker service puts it on the queue (its payload stays in rq)
            trainer.run("forward_backward", job.model_dump(mode="json"))  # as the worker runs it,
            Job.fetch(job.job_id, connection=redis_conn, serializer=JSONSerializer).set_status(JobStatus.FINISHED)
        if run == "lost":
            trainer.backend.drop_gradients("the trainer restarted")
        caplog.set_level("WARNING", logger="tandem_trainer.jobs.optim_step")
        assert optim_step(trainer, run, f"{run}-step", [f"{run}-fb-1", f"{run}-fb-2"]).version == 1
    assert "optim_step.recomputed run=lost job_id=lost-step gradients_of=['lost-fb-1', 'lost-fb-2']" in caplog.text
    lost, kept = adapter(trainer.store, "lost", 1), adapter(trainer.store, "kept", 1)
    assert lost.keys() == kept.keys()
    for key, tensor in kept.items():
        assert torch.allclose(lost[key], tensor, atol=1e-6), key  # both jobs' gradients, once each


def test_a_step_leaves_out_failed_forward_backwards_and_refuses_one_not_run_yet(trainer, redis_conn, tiny_model) -> None:
    """A forward_backward that failed (refused, out of retries) added nothing: the step applies the
    others. One still on the queue (a retry after the step) is neither computed here nor dropped silently."""
    create_runs(redis_conn, tiny_model, "a")
    refused = ForwardBackwardJob(job_id="fb-bad", run="a", datums=[make_datum(1)], loss_fn="cross_entropy")
    enqueue(redis_conn, refused)
    Job.fetch("fb-bad", connection=redis_conn, serializer=JSONSerializer).set_status(JobStatus.FAILED)  # as the worker
    forward_backward(trainer, "a", "fb-1", [make_datum(2)])
    assert optim_step(trainer, "a", "step-1", ["fb-bad", "fb-1"]).metrics["gradient_jobs"] == 1.0

    enqueue(redis_conn, ForwardBackwardJob(job_id="fb-later", run="a", datums=[make_datum(3)], loss_fn="cross_entropy"))
    forward_backward(trainer, "a", "fb-2", [make_datum(4)])
    with pytest.raises(JobRejected, match=r"\['fb-later'\] have not finished \(queued\)") as err:
        optim_step(trainer, "a", "step-2", ["fb-later", "fb-2"])
    assert err.value.field == "gradients_from" and Registry(redis_conn).latest_version("a") == 1


def test_a_job_that_never_got_its_runs_lock_drops_no_gradients(trainer, redis_conn, tiny_model) -> None:
    create_runs(redis_conn, tiny_model, "a", "b")
    forward_backward(trainer, "a", "fb-1", [make_datum(1)])
    redis_conn.set(keys.run_lock("b"), "busy-worker#1|abc", px=600_000)  # a live worker holds b
    job = ForwardBackwardJob(run="b", datums=[make_datum(2)], loss_fn="cross_entropy", timeout_s=1)
    with pytest.raises(LockTimeout):
        trainer.run("forward_backward", job)
    assert trainer.backend.gradient_jobs() == ["fb-1"]  # the backend was never touched: nothing dropped
    assert optim_step(trainer, "a", "step-1", ["fb-1"]).version == 1


def test_a_grpo_train_job_drops_the_runs_held_gradients_and_says_so(trainer, redis_conn, tiny_model, caplog) -> None:
    create_runs(redis_conn, tiny_model, "a")
    forward_backward(trainer, "a", "fb-1", [make_datum(1)])
    caplog.set_level("WARNING", logger="tandem_trainer.backends")
    assert trainer.train(make_job("grpo-1", run="a", step=1)).version == 1  # its own gradients only
    assert "gradients.dropped run=a jobs=['fb-1']" in caplog.text and trainer.backend.gradient_jobs() == []
    with pytest.raises(JobRejected, match=r"\['fb-1'\] were lost"):
        optim_step(trainer, "a", "step-2", ["fb-1"])


def test_load_state_copies_a_versions_weights_and_optimizer(trainer, redis_conn, tiny_model, tmp_path) -> None:
    create_runs(redis_conn, tiny_model, "a", "c")
    create_runs(redis_conn, tiny_model, "wide", r=8)
    (tmp_path / "other-model").symlink_to(tiny_model)
    create_runs(redis_conn, tmp_path / "other-model", "other")
    forward_backward(trainer, "a", "a-fb", [make_datum(1)])
    optim_step(trainer, "a", "a-step", ["a-fb"])
    forward_backward(trainer, "c", "c-fb", [make_datum(2)])  # pending: dropped by the load

    job = LoadStateJob(job_id="load-1", run="c", source_run="a", source_version=1)
    loaded = trainer.run("load_state", job.model_dump(mode="json"))
    assert loaded == LoadStateResult(job_id="load-1", run="c", version=1)
    assert trainer.backend.gradient_jobs() == []
    store = trainer.store
    assert adapter(store, "c", 1).keys() == adapter(store, "a", 1).keys()
    for key, tensor in adapter(store, "a", 1).items():
        assert torch.equal(adapter(store, "c", 1)[key], tensor)
    source, copied = optimizer_state(store, "a", 1), optimizer_state(store, "c", 1)
    assert source.keys() == copied.keys()
    for index, moments in source.items():
        for name, tensor in moments.items():
            assert torch.equal(copied[index][name], tensor)
    assert trainer.run("load_state", job.model_dump(mode="json")) == loaded  # a retry: the same version

    fresh = LoadStateJob(job_id="load-2", run="c", source_run="a", source_version=1, with_optimizer=False)
    assert trainer.run("load_state", fresh).version == 2  # type: ignore[attr-defined]
    assert optimizer_state(store, "c", 2) == {}
    assert torch.equal(adapter(store, "c", 2)[next(iter(adapter(store, "a", 1)))],
                       adapter(store, "a", 1)[next(iter(adapter(store, "a", 1)))])

    for source_run, version, field in (("other", 1, "source_run"), ("wide", 1, "source_run"),
                                       ("gone", 1, "source_run"), ("a", 2, "source_version")):
        bad = LoadStateJob(job_id=f"bad-{source_run}", run="c", source_run=source_run, source_version=version)
        with pytest.raises(JobRejected) as err:
            trainer.run("load_state", bad)
        assert err.value.field == field, str(err.value)
    assert Registry(redis_conn).latest_version("c") == 2


def test_bad_input_is_rejected_naming_the_field_and_the_held_gradients_stay(trainer, redis_conn, tiny_model) -> None:
    create_runs(redis_conn, tiny_model, "a")
    forward_backward(trainer, "a", "fb-1", [make_datum(1)])
    good = ForwardBackwardJob(run="a", datums=[make_datum(2, rl=True)], loss_fn="ppo").model_dump(mode="json")
    short = make_datum(3).model_dump()
    short["inputs"]["weights"] = short["inputs"]["weights"][:-1]
    cases = [
        ({**good, "loss_fn": "dpo"}, "loss_fn"),
        ({**good, "loss_fn": "cross_entropy"}, "datums.0.inputs.weights"),  # an RL datum has no weights
        ({**good, "datums": [good["datums"][0], short], "loss_fn": "cross_entropy"}, "datums.0.inputs.weights"),
        ({**good, "datums": [short], "loss_fn": "cross_entropy"}, "datums.0.inputs.weights"),
        ({**good, "loss_fn_config": {"clip_low_threshold": 2.0}}, "loss_fn_config.clip_low_threshold"),
        ({**good, "run": "nobody"}, "run"),
    ]
    for payload, field in cases:
        with pytest.raises(JobRejected) as err:
            trainer.run("forward_backward", payload)
        assert err.value.field == field, (payload, str(err.value))
    assert trainer.backend.gradient_jobs() == ["fb-1"]  # a rejected job drops nothing
    assert optim_step(trainer, "a", "step-1", ["fb-1"]).version == 1


def test_the_worker_runs_tinkers_jobs_from_the_queue(workers, redis_conn, tiny_model: Path, tmp_path: Path) -> None:
    create_runs(redis_conn, tiny_model, "a")
    enqueue(redis_conn, ForwardBackwardJob(job_id="fb-1", run="a", datums=[make_datum(1)], loss_fn="cross_entropy"))
    enqueue(redis_conn, OptimStepJob(job_id="step-0", run="a", gradients_from=["fb-0", "fb-1"]))  # refused
    enqueue(redis_conn, ForwardBackwardJob(job_id="fb-2", run="a", datums=[make_datum(2, rl=True)], loss_fn="cispo"))
    enqueue(redis_conn, OptimStepJob(job_id="step-1", run="a", gradients_from=["fb-2"]))
    train_queue(redis_conn).enqueue("tandem_trainer.worker.setup", {"run": "a"}, job_id="hostile")
    worker = workers()

    def done(job_id: str) -> bool:
        return status(redis_conn, job_id) in (JobStatus.FINISHED, JobStatus.FAILED)

    # the queue takes jobs in fair turns across runs: the hostile job (no run) need not go last
    wait_for(lambda: all(done(j) for j in ("fb-1", "step-0", "fb-2", "step-1", "hostile")), 120,
             "the queue to drain", worker)
    fetch = lambda job_id: Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)  # noqa: E731
    fb = ForwardBackwardResult.model_validate(fetch("fb-1").return_value())
    assert len(fb.loss_fn_outputs[0]["logprobs"]) == 10 and "loss:sum" in fb.metrics
    refused = fetch("step-0")
    assert refused.get_status() == JobStatus.FAILED and refused.retries_left == 0
    assert "['fb-0'] were lost" in (refused.latest_result().exc_string or "")  # type: ignore[union-attr]
    step = OptimStepResult.model_validate(fetch("step-1").return_value())
    assert step.version == 1 and Registry(redis_conn).latest_version("a") == 1
    AdapterStore(tmp_path / "adapters").verify("a", 1)
    hostile = fetch("hostile")
    assert hostile.get_status() == JobStatus.FAILED
    assert "is not allowed" in (hostile.latest_result().exc_string or "")  # type: ignore[union-attr]
    assert worker.stop() == 0
