"""The Trainer on the tiny model with a real Redis: publish, resume, idempotency, bad input, learning."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import keys
from tandem.adapters import AdapterStore
from tandem.events import EventKind, EventStream
from tandem.jobs import TrainJob
from tandem.registry import Registry
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec
from tandem.settings import TrainerSettings
from tandem_trainer.backends.peft import PeftBackend
from tandem_trainer.errors import CheckpointError, JobRejected, LockTimeout
from tandem_trainer.jobs.runner import Trainer

pytestmark = pytest.mark.integration

RUN = "digits"


#: The trainer's device; `cuda` exercises bf16 and gradient checkpointing where a GPU is.
DEVICE = os.environ.get("TANDEM_TEST_TRAINER_DEVICE", "cpu")


@pytest.fixture(scope="module")
def backend() -> PeftBackend:
    """One resident model for the module, as in a worker."""
    return PeftBackend(DEVICE, gradient_checkpointing=DEVICE == "cuda")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> TrainerSettings:
    return TrainerSettings(
        redis={"url": redis_url}, store={"root": tmp_path / "adapters"}, backend={"micro_batch_tokens": 128}
    )


@pytest.fixture
def store(settings: TrainerSettings) -> AdapterStore:
    settings.store.root.mkdir(parents=True, exist_ok=True)
    return AdapterStore(settings.store.root)


@pytest.fixture
def trainer(settings: TrainerSettings, redis_conn, backend: PeftBackend, store: AdapterStore) -> Trainer:
    return Trainer(settings, redis_conn, backend, store)


@pytest.fixture
def run(redis_conn, tiny_model: Path) -> RunSpec:
    spec = RunSpec(
        name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
        optimizer=OptimizerConfig(lr=1e-2), max_staleness_steps=1,
    )
    return Registry(redis_conn).create_run(spec)


def make_job(job_id: str = "job-1", *, groups: int = 2, size: int = 4, seed: int = 0, step: int = 1,
             version: int = 0) -> dict[str, Any]:
    """A valid job of made-up tokens (ids 3..500, below the tiny vocab of 512)."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(3, 8))]
        trajs = []
        for _ in range(size):
            n = rng.randint(2, 10)
            trajs.append({
                "prompt_ids": prompt, "completion_ids": [rng.randrange(3, 500) for _ in range(n)],
                "rollout_logprobs": [-6.2] * n, "reward": float(rng.random()), "version": version,
            })
        out.append({"trajectories": trajs})
    return {"job_id": job_id, "run": RUN, "step": step, "groups": out, "timeout_s": 60}


def events(redis_conn, kind: EventKind) -> list:
    return [e for e in EventStream(redis_conn).history() if e.kind is kind]


def test_first_job_publishes_v1(trainer: Trainer, run: RunSpec, store: AdapterStore, redis_conn) -> None:
    result = trainer.train(make_job())
    assert (result.version, result.parent, result.step, result.reused) == (1, 0, 1, False)
    assert result.train_s > 0 and result.published_at <= time.time()
    for key in ("loss", "reward_mean", "reward_std", "clip_frac", "approx_kl", "ratio_mean", "entropy",
                "grad_norm"):
        assert math.isfinite(result.metrics[key]), key
    assert result.metrics["tokens"] > 0 and result.metrics["sequences"] == 8

    manifest = store.verify(RUN, 1)  # checksums hold
    assert (manifest.run, manifest.version, manifest.parent, manifest.job_id) == (RUN, 1, 0, "job-1")
    assert manifest.lora_rank == 4 and manifest.base_model == run.base_model
    adapter = store.adapter_dir(RUN, 1)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["use_rslora"] is False
    assert config["peft_type"] == "LORA" and not config.get("modules_to_save")
    assert sorted((store.version_dir(RUN, 1) / "trainer").iterdir())  # optimizer state is there

    registry = Registry(redis_conn)
    assert registry.latest_version(RUN) == 1 and registry.version_of_job(RUN, "job-1") == 1
    ready = events(redis_conn, EventKind.ADAPTER_READY)
    assert len(ready) == 1
    event = ready[0]
    assert (event.run, event.version, event.job_id) == (RUN, 1, "job-1")
    assert event.data["path"] == f"{RUN}/v000001/adapter"
    assert store.resolve(event.data["path"]) == adapter
    assert event.data["step"] == 1 and event.data["parent"] == 0
    assert event.data["metrics"]["loss"] == pytest.approx(result.metrics["loss"])
    assert event.data["published_at"] == pytest.approx(result.published_at)
    # the stages between the optimizer step and the version in place, which together make it up
    stages = event.data["stages_ms"]
    assert set(stages) == {"stage", "copy", "prepare", "write", "hash", "weights", "config", "rename"}
    assert 0 < stages["copy"] <= stages["stage"] and stages["prepare"] >= 0
    assert 0 < stages["hash"] + stages["weights"] + stages["config"] <= stages["write"]  # its parts, inside it
    whole = (event.data["published_at"] - event.data["stepped_at"]) * 1000
    parts = stages["stage"] + stages["prepare"] + stages["write"] + stages["rename"]
    assert parts == pytest.approx(whole, abs=1.0)


def test_a_train_job_object_trains_as_it_is(trainer: Trainer, run: RunSpec) -> None:
    job = TrainJob.model_validate(make_job())
    result = trainer.train(job)
    assert (result.job_id, result.version, result.reused) == ("job-1", 1, False)
    assert trainer.train(job).reused


def test_a_job_id_used_again_with_other_groups_is_refused_naming_it(trainer: Trainer, run: RunSpec,
                                                                     redis_conn) -> None:
    """A retry sends the same groups and gets the version back; other groups under that id are
    another step, which would be silently dropped if answered with the old version."""
    first = trainer.train(make_job("job-7", seed=1))
    assert trainer.train(make_job("job-7", seed=1)).reused  # the retry
    with pytest.raises(JobRejected) as info:
        trainer.train(make_job("job-7", seed=2, groups=3))
    assert info.value.field == "job_id" and "job-7" in str(info.value) and "new job_id" in str(info.value)
    assert Registry(redis_conn).latest_version(RUN) == first.version  # nothing trained, nothing lost


def test_an_adapter_that_cannot_be_written_is_a_checkpoint_error(trainer: Trainer, backend: PeftBackend,
                                                                 run: RunSpec, tmp_path: Path) -> None:
    trainer.train(make_job())  # an adapter is active
    gone = tmp_path / "no-such-dir"
    with pytest.raises(CheckpointError, match="no-such-dir"):
        backend.stage_adapter().write(gone)
    with pytest.raises(CheckpointError, match="no-such-dir"):
        backend.save_state(gone, trainer_state={})


def test_the_staged_adapter_is_peft_state_dict_step_after_step(trainer: Trainer, backend: PeftBackend,
                                                                 run: RunSpec) -> None:
    from peft.utils import get_peft_model_state_dict

    for step in (1, 2):  # the file keys are found once per activation, the values read each time
        trainer.train(make_job(f"job-{step}", step=step, version=step - 1))
        staged = backend.stage_adapter().tensors
        reference = get_peft_model_state_dict(backend._require_model())
        assert staged.keys() == reference.keys()
        for key, tensor in reference.items():
            assert torch.equal(staged[key], tensor.to(staged[key].dtype)), key


def test_published_adapter_loads_in_plain_peft(trainer: Trainer, run: RunSpec, store: AdapterStore) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer.train(make_job())
    base = AutoModelForCausalLM.from_pretrained(run.base_model)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = base(ids).logits
    model = PeftModel.from_pretrained(base, str(store.adapter_dir(RUN, 1)))
    after = model(ids).logits
    assert not torch.allclose(before, after)  # the trained update is in the files


def _adam_steps(store: AdapterStore, version: int) -> set[int]:
    state = torch.load(store.version_dir(RUN, version) / "trainer" / "optimizer.pt", weights_only=True,
                       map_location="cpu")
    return {int(s["step"]) for s in state["state"].values()}


def test_second_job_trains_on_top_of_v1(trainer: Trainer, backend: PeftBackend, run: RunSpec,
                                        store: AdapterStore) -> None:
    trainer.train(make_job("job-1", seed=1))
    assert backend.active == (RUN, 1)  # kept in memory for the next step
    backend.invalidate()  # force the resume path: weights and optimizer state from disk
    result = trainer.train(make_job("job-2", seed=2, step=2, version=1))
    assert (result.version, result.parent) == (2, 1)
    assert store.read_manifest(RUN, 2).parent == 1
    assert _adam_steps(store, 1) == {1} and _adam_steps(store, 2) == {2}  # optimizer state resumed
    assert backend.active == (RUN, 2)
    result = trainer.train(make_job("job-3", seed=3, step=3, version=2))  # from memory this time
    assert (result.version, result.parent) == (3, 2) and _adam_steps(store, 3) == {3}


def test_narrow_adapter_keeps_float32_master_weights(settings, redis_conn, store: AdapterStore, run: RunSpec) -> None:
    """A bf16 adapter halves the bytes on the path to serving; resuming uses the fp32 master copy."""
    from safetensors.torch import load_file

    narrow = PeftBackend(DEVICE, adapter_dtype="bfloat16")
    trainer = Trainer(settings, redis_conn, narrow, store)
    trainer.train(make_job("job-1", seed=1))
    published = load_file(str(store.adapter_dir(RUN, 1) / "adapter_model.safetensors"))
    master = load_file(str(store.version_dir(RUN, 1) / "trainer" / "lora_master.safetensors"))
    assert published.keys() == master.keys()
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert all(torch.equal(published[k], master[k].to(torch.bfloat16)) for k in master)
    narrow.invalidate()  # resume from disk: the master weights, not the rounded ones
    narrow.activate(run, 1, store.version_dir(RUN, 1))
    from peft import get_peft_model_state_dict

    resumed = get_peft_model_state_dict(narrow._require_model())
    assert all(torch.equal(resumed[k].cpu(), master[k]) for k in master)


def test_same_job_twice_publishes_one_version(trainer: Trainer, run: RunSpec, store: AdapterStore,
                                              redis_conn) -> None:
    first = trainer.train(make_job())
    again = trainer.train(make_job())
    assert again.reused and not first.reused
    assert (again.version, again.parent, again.job_id) == (1, 0, "job-1")
    assert again.metrics == pytest.approx(first.metrics)
    assert store.versions(RUN) == [1] and Registry(redis_conn).latest_version(RUN) == 1
    assert len(events(redis_conn, EventKind.ADAPTER_READY)) == 1


def _forget_registration(redis_conn) -> None:
    """What a crash between the store's rename and register_version leaves behind."""
    redis_conn.delete(keys.run_versions(RUN), keys.run_jobs(RUN), keys.EVENTS)


def test_staged_but_unregistered_version_is_adopted(trainer: Trainer, run: RunSpec, store: AdapterStore,
                                                    redis_conn) -> None:
    trainer.train(make_job())
    _forget_registration(redis_conn)
    registry = Registry(redis_conn)
    assert registry.latest_version(RUN) == 0 and store.versions(RUN) == [1]

    result = trainer.train(make_job())  # the retry of the crashed job
    assert result.reused and (result.version, result.parent) == (1, 0)
    assert registry.latest_version(RUN) == 1 and registry.version_of_job(RUN, "job-1") == 1
    assert store.versions(RUN) == [1]
    ready = events(redis_conn, EventKind.ADAPTER_READY)
    assert [(e.version, e.job_id) for e in ready] == [(1, "job-1")]


def test_orphan_is_adopted_by_the_next_job_of_the_run(trainer: Trainer, run: RunSpec, store: AdapterStore,
                                                      redis_conn) -> None:
    trainer.train(make_job("job-1"))
    _forget_registration(redis_conn)
    result = trainer.train(make_job("job-2", seed=5, step=2, version=0))  # queued before job-1's retry
    assert (result.version, result.parent) == (2, 1)  # trained on top of the adopted v1
    ready = events(redis_conn, EventKind.ADAPTER_READY)
    assert [(e.version, e.job_id) for e in ready] == [(1, "job-1"), (2, "job-2")]
    retry = trainer.train(make_job("job-1"))
    assert retry.reused and retry.version == 1
    assert store.versions(RUN) == [1, 2]


def test_a_version_deleted_by_hand_is_skipped_by_the_next_job(trainer: Trainer, backend: PeftBackend, run: RunSpec,
                                                               store: AdapterStore, redis_conn) -> None:
    trainer.train(make_job("job-1"))
    trainer.train(make_job("job-2", seed=1, step=2, version=1))
    shutil.rmtree(store.version_dir(RUN, 2))  # the served version's directory, deleted by hand
    backend.invalidate()  # as after a restart: v2 is no longer in memory

    result = trainer.train(make_job("job-3", seed=2, step=3, version=2))
    assert (result.version, result.parent) == (3, 1)  # resumed from the newest intact version
    assert store.verify(RUN, 3).parent == 1
    [ready] = [e for e in events(redis_conn, EventKind.ADAPTER_READY) if e.job_id == "job-3"]
    assert ready.data["parent"] == 1
    assert trainer.train(make_job("job-4", seed=3, step=4, version=3)).parent == 3  # back on the chain


def test_an_on_policy_run_goes_on_from_the_version_before_a_broken_newest(
    trainer: Trainer, backend: PeftBackend, store: AdapterStore, redis_conn, tiny_model: Path
) -> None:
    """max_staleness_steps=0 (the demo's): once the newest version cannot be trained from, rollouts of
    the one before it train (counted from the version the step updates, not the newest registered)."""
    Registry(redis_conn).create_run(RunSpec(name="strict", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
                                            max_staleness_steps=0))

    def job(job_id: str, step: int, version: int) -> dict[str, Any]:
        return {**make_job(job_id, seed=step, step=step, version=version), "run": "strict"}

    trainer.train(job("s-1", 1, 0))
    trainer.train(job("s-2", 2, 1))
    (store.version_dir("strict", 2) / "adapter" / "adapter_config.json").write_text("{}")  # v2 no longer verifies
    backend.invalidate()
    with pytest.raises(JobRejected) as newer:
        trainer.train(job("s-3-v2", 3, 2))  # rollouts of v2, which this job cannot train from
    assert "trains from version 1" in str(newer.value) and "'strict@v1'" in str(newer.value)
    result = trainer.train(job("s-3", 3, 1))  # rollouts of v1, the version it trains from
    assert (result.version, result.parent) == (3, 1)
    assert trainer.train(job("s-4", 4, 3)).parent == 3


def test_a_stale_rollout_of_a_run_whose_newest_does_not_serve_says_so(trainer: Trainer, run: RunSpec,
                                                                     redis_conn) -> None:
    """v2 does not serve yet: still loading (the common case: jobs pipelined with wait=False) or
    refused. The message says both, not only "refused, restart inference"."""
    trainer.train(make_job("job-1"))
    trainer.train(make_job("job-2", seed=1, version=1))
    redis_conn.set(keys.run_serving(RUN), 1)
    job = make_job("job-3", seed=2, version=0)
    with pytest.raises(JobRejected) as info:
        trainer.train(job)
    message = str(info.value)
    assert f"max_staleness_steps=1: sample again with model {RUN!r} (its newest version)" in message
    assert "inference serves version 1, not yet version 2: it may still be loading" in message
    assert "an adapter_rejected event of version 2 says why it will not" in message


def test_a_run_whose_directory_is_not_in_the_store_is_not_started_over_from_the_base_model(
    trainer: Trainer, backend: PeftBackend, run: RunSpec, store: AdapterStore, redis_conn, tmp_path: Path
) -> None:
    """One version deleted by hand is skipped; the whole run missing (a volume not mounted) is an error
    that names the directory, and nothing is published until the store is back."""
    trainer.train(make_job("job-1"))
    away = tmp_path / "unmounted"
    shutil.move(store.run_dir(RUN), away)
    backend.invalidate()
    with pytest.raises(CheckpointError) as info:
        trainer.train(make_job("job-2", seed=1, version=1))
    assert str(store.run_dir(RUN)) in str(info.value) and "not mounted" in str(info.value)
    assert Registry(redis_conn).latest_version(RUN) == 1 and not store.run_dir(RUN).exists()
    shutil.move(away, store.run_dir(RUN))
    assert trainer.train(make_job("job-2", seed=1, version=1)).parent == 1


def test_a_lock_whose_set_went_through_unanswered_is_ours(settings, redis_conn, run) -> None:
    from tandem_trainer.run_lock import RunLock

    lock = RunLock(redis_conn, RUN, "me#1", holder_alive=lambda owner: True)
    redis_conn.set(keys.run_lock(RUN), lock.value, px=600_000)  # a SET NX whose reply a dropped connection lost
    started = time.monotonic()
    lock.acquire(ttl_ms=60_000, wait_s=5)
    assert time.monotonic() - started < 1.0
    lock.release()
    assert redis_conn.get(keys.run_lock(RUN)) is None


def test_a_retry_announces_only_what_was_not_announced(trainer: Trainer, run: RunSpec, redis_conn) -> None:
    trainer.train(make_job())
    redis_conn.delete(keys.EVENTS)  # a crash between register and announce: registered, no adapter_ready
    for i in range(1500):  # other events since: more than one page of the stream to look through
        redis_conn.xadd(keys.EVENTS, {"kind": "adapter_loaded", "run": "other", "version": str(i), "job_id": "",
                                      "ts": "0", "data": "{}"})
    again = trainer.train(make_job())
    assert again.reused and again.version == 1

    def ready() -> list:
        return [e for e in EventStream(redis_conn).history(count=5000) if e.kind is EventKind.ADAPTER_READY]

    assert [(e.version, e.job_id, e.data["path"]) for e in ready()] == [(1, "job-1", f"{RUN}/v000001/adapter")]
    trainer.train(make_job())  # announced now, behind those 1500 entries: nothing more
    assert len(ready()) == 1


def _nan_reward(job: dict) -> None:
    job["groups"][0]["trajectories"][1]["reward"] = float("nan")


def _inf_reward(job: dict) -> None:
    job["groups"][1]["trajectories"][0]["reward"] = float("inf")


def _bad_token(job: dict) -> None:
    job["groups"][1]["trajectories"][2]["completion_ids"][0] = 9999


def _bad_prompt_token(job: dict) -> None:
    job["groups"][0]["trajectories"][0]["prompt_ids"][-1] = 512


def _short_logprobs(job: dict) -> None:
    job["groups"][0]["trajectories"][3]["rollout_logprobs"].pop()


def _too_long(job: dict) -> None:
    traj = job["groups"][0]["trajectories"][1]
    traj["prompt_ids"] = [7] * 1000
    traj["completion_ids"] = [8] * 30
    traj["rollout_logprobs"] = [-1.0] * 30


def _bad_reward_type(job: dict) -> None:
    job["groups"][0]["trajectories"][0]["reward"] = "abc"


def _bad_ids_type(job: dict) -> None:
    job["groups"][0]["trajectories"][0]["completion_ids"] = "x"


def _another_runs_rollout(job: dict) -> None:
    job["groups"][0]["trajectories"][3]["origin"] = {"run": "alpha", "adapter": None}


BAD_INPUTS = {
    # case: (mutation, expected field, words the message must hold)
    "no_groups": (lambda j: j.update(groups=[]), "groups", ["groups", "no groups"]),
    "group_of_one": (lambda j: j["groups"][1].update(trajectories=j["groups"][1]["trajectories"][:1]),
                     "groups.1", ["groups.1", "at least 2"]),
    "nan_reward": (_nan_reward, "groups.0.trajectories.1", ["groups.0.trajectories.1", "reward", "nan"]),
    "inf_reward": (_inf_reward, "groups.1.trajectories.0", ["groups.1.trajectories.0", "reward", "inf"]),
    "token_outside_vocab": (_bad_token, "groups.1.trajectories.2.completion_ids",
                            ["groups.1.trajectories.2.completion_ids", "9999", "512"]),
    "prompt_token_outside_vocab": (_bad_prompt_token, "groups.0.trajectories.0.prompt_ids",
                                   ["groups.0.trajectories.0.prompt_ids", "512"]),
    "logprobs_length_mismatch": (_short_logprobs, "groups.0.trajectories.3",
                                 ["groups.0.trajectories.3", "rollout_logprobs", "completion_ids"]),
    "over_context": (_too_long, "groups.0.trajectories.1.completion_ids",
                     ["groups.0.trajectories.1", "1000", "30", "1030", "1024", "max_position_embeddings"]),
    "unknown_run": (lambda j: j.update(run="nope"), "run", ["nope", RUN]),
    "reward_not_a_number": (_bad_reward_type, "groups.0.trajectories.0.reward",
                            ["groups.0.trajectories.0.reward", "number"]),
    "completion_ids_not_a_list": (_bad_ids_type, "groups.0.trajectories.0.completion_ids",
                                  ["groups.0.trajectories.0.completion_ids", "list"]),
    "another_runs_rollout": (_another_runs_rollout, "groups.0.trajectories.3.origin.run",
                             ["group 0 sample 3 was sampled from run 'alpha' (v0)", f"this job trains run '{RUN}'",
                              "train each run on its own rollouts"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_rejected_naming_the_field(case: str, trainer: Trainer, run: RunSpec,
                                                store: AdapterStore, redis_conn) -> None:
    mutate, field, words = BAD_INPUTS[case]
    job = make_job(f"bad-{case.replace('_', '-')}")
    mutate(job)
    with pytest.raises(JobRejected) as info:
        trainer.train(job)
    message = str(info.value)
    assert info.value.field == field
    for word in words:
        assert word in message, (word, message)

    failed = events(redis_conn, EventKind.TRAIN_FAILED)
    assert len(failed) == 1
    assert failed[0].job_id == job["job_id"] and failed[0].run == job["run"]
    assert failed[0].data == {"message": message, "field": field, "retries_left": 0}
    assert store.versions(RUN) == [] and Registry(redis_conn).latest_version(RUN) == 0


def test_rewards_of_any_finite_size_train_as_their_ranking(trainer: Trainer, run: RunSpec, redis_conn,
                                                            store: AdapterStore) -> None:
    """Advantages are normalised within the group, so 1e308 and -1e308 are as good as 1 and -1 (the
    squares of such rewards overflow, and so do their sums); the version they make reads back, with
    finite statistics, and a retry of the job finds it."""
    job = make_job("huge")
    for g, group in enumerate(job["groups"]):
        for t, traj in enumerate(group["trajectories"]):
            traj["reward"] = 1e308 if t % 2 else 1.7e308 * (-1) ** g
    assert trainer.train(job).version == 1
    assert [e.job_id for e in events(redis_conn, EventKind.TRAIN_FAILED)] == []
    for manifest in (Registry(redis_conn).manifest(RUN, 1), store.read_manifest(RUN, 1)):
        assert manifest is not None and all(math.isfinite(v) for v in manifest.metrics.values())
        assert 1e307 < manifest.metrics["reward_std"] < 1.8e308 and manifest.metrics["reward_group_std"] > 1e307
    assert [m.version for m in Registry(redis_conn).manifests(RUN)] == [1]
    assert trainer.train(job).reused


def test_unnormalised_advantages_beyond_float32_are_refused_naming_the_group(
    trainer: Trainer, redis_conn, tiny_model: Path, store: AdapterStore
) -> None:
    Registry(redis_conn).create_run(RunSpec(name="raw", base_model=str(tiny_model), lora=LoraConfig(r=4, alpha=8.0),
                                            loss=LossConfig(normalize_std=False)))
    job = {**make_job("raw-1"), "run": "raw"}
    job["groups"][1]["trajectories"][0]["reward"] = 1e39
    with pytest.raises(JobRejected) as info:
        trainer.train(job)
    assert info.value.field == "groups.1.trajectories"
    assert "1e+39" in str(info.value) and "normalize_std" in str(info.value)
    assert store.versions("raw") == [] and Registry(redis_conn).latest_version("raw") == 0


def test_trajectory_older_than_allowed_is_rejected(trainer: Trainer, run: RunSpec, redis_conn) -> None:
    trainer.train(make_job("job-1"))
    trainer.train(make_job("job-2", seed=1, version=1))  # one version stale: allowed
    job = make_job("job-3", seed=2, version=1)
    job["groups"][1]["trajectories"][2]["version"] = 0  # two versions behind parent 2
    with pytest.raises(JobRejected) as info:
        trainer.train(job)
    assert info.value.field == "groups.1.trajectories.2.version"
    assert "max_staleness_steps=1" in str(info.value) and "version 0" in str(info.value)
    failed = events(redis_conn, EventKind.TRAIN_FAILED)
    assert [(e.job_id, e.version, e.data["field"]) for e in failed] == [("job-3", 3, info.value.field)]


def test_run_lock_of_a_dead_worker_is_taken_over(settings, redis_conn, backend, store, run) -> None:
    redis_conn.set(keys.run_lock(RUN), "dead-worker#1|abc", px=600_000)
    trainer = Trainer(settings, redis_conn, backend, store, owner="me#1",
                      holder_alive=lambda owner: owner != "dead-worker#1")
    assert trainer.train(make_job()).version == 1
    assert redis_conn.get(keys.run_lock(RUN)) is None  # released after the job


def test_run_lock_of_a_live_worker_is_waited_for(settings, redis_conn, backend, store, run) -> None:
    redis_conn.set(keys.run_lock(RUN), "busy-worker#1|abc", px=600_000)
    trainer = Trainer(settings, redis_conn, backend, store, owner="me#1")
    job = make_job()
    job["timeout_s"] = 1
    started = time.monotonic()
    with pytest.raises(LockTimeout):
        trainer.train(job)
    assert time.monotonic() - started >= 1.0
    failed = events(redis_conn, EventKind.TRAIN_FAILED)
    assert len(failed) == 1 and "busy-worker" in failed[0].data["message"] and failed[0].data["field"] is None
    assert store.versions(RUN) == []


# learning -----------------------------------------------------------------------
def _digit_ids(tokenizer) -> set[int]:
    ids = set()
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if text and text.isdigit():
            ids.add(i)
    return ids


@torch.no_grad()
def _sample(model, prompts: list[list[int]], per_prompt: int, max_new: int, eos: int,
            gen: torch.Generator) -> list[list[tuple[list[int], list[float]]]]:
    """Plain ancestral sampling at temperature 1: exactly the policy the loss scores."""
    groups = []
    for prompt in prompts:
        ids = torch.tensor([prompt] * per_prompt)
        new, logps = [], []
        for _ in range(max_new):
            logits = model(input_ids=ids).logits[:, -1].float()
            logp = torch.log_softmax(logits, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            new.append(tok)
            logps.append(logp.gather(-1, tok))
            ids = torch.cat([ids, tok], dim=1)
        toks, lps = torch.cat(new, 1).tolist(), torch.cat(logps, 1).tolist()
        group = []
        for t, lp in zip(toks, lps, strict=True):
            end = t.index(eos) + 1 if eos in t else len(t)
            group.append((t[:end], lp[:end]))
        groups.append(group)
    return groups


def test_digit_reward_rises_within_25_steps(settings, redis_conn, backend, store, tiny_model) -> None:
    """The toy task: reward = share of digit tokens. The loss is right if the policy learns it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = RunSpec(name=RUN, base_model=str(tiny_model), lora=LoraConfig(r=8, alpha=16.0),
                   optimizer=OptimizerConfig(lr=5e-3), loss=LossConfig(), max_staleness_steps=0, seed=1)
    Registry(redis_conn).create_run(spec)
    trainer = Trainer(settings, redis_conn, backend, store)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    digits = _digit_ids(tokenizer)
    assert len(digits) >= 10
    texts = ["Write numbers", "Count to ten", "What is the price?", "List the years"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    prompts = [tokenizer(chat, add_special_tokens=False).input_ids for chat in chats]
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    policy, gen = base, torch.Generator().manual_seed(0)
    started, history = time.monotonic(), []
    for step in range(1, 26):
        groups = _sample(policy, prompts, per_prompt=8, max_new=12, eos=tokenizer.eos_token_id, gen=gen)
        job_groups, rewards = [], []
        for prompt, group in zip(prompts, groups, strict=True):
            trajs = []
            for completion, logps in group:
                reward = sum(t in digits for t in completion) / len(completion)
                rewards.append(reward)
                trajs.append({"prompt_ids": prompt, "completion_ids": completion, "rollout_logprobs": logps,
                              "reward": reward, "version": step - 1})
            job_groups.append({"trajectories": trajs})
        history.append(sum(rewards) / len(rewards))
        if len(history) >= 4 and sum(history[-3:]) / 3 - history[0] >= 0.2:
            break  # the mean of the last three batches is 0.2 above the base model's
        result = trainer.train({"job_id": f"learn-{step}", "run": RUN, "step": step, "groups": job_groups})
        assert result.version == step
        # Sample the next batch from the version just published, loaded like an engine would.
        if isinstance(policy, PeftModel):
            policy = policy.unload()
        policy = PeftModel.from_pretrained(base, str(store.adapter_dir(RUN, result.version))).eval()
    elapsed = time.monotonic() - started
    gain = sum(history[-3:]) / 3 - history[0]
    print(f"digit reward by step: {[round(h, 3) for h in history]} gain={gain:.3f} in {elapsed:.1f}s")
    assert gain >= 0.2, history
