from __future__ import annotations

import math

import pytest

from tandem.errors import ValidationFailed
from tandem.jobs import TrainJob, parse_job
from tandem.runs import RunSpec, adapter_name, check_run_name
from tandem.trajectories import Trajectory, TrajectoryGroup


def traj(**kw):
    base = dict(prompt_ids=[1, 2], completion_ids=[3, 4], rollout_logprobs=[-0.5, -1.0], reward=1.0)
    return {**base, **kw}


def job(groups):
    return {"run": "r1", "groups": groups}


@pytest.mark.parametrize("name", ["digits", "a", "run-1.b_c"])
def test_valid_run_names(name: str) -> None:
    assert check_run_name(name) == name


# "a\n": a trailing newline passes a `$`-anchored `re.match`; it would reach headers and logs
@pytest.mark.parametrize("name", ["", "a:b", "a@b", "../x", "-x", "a/b", "x" * 64, "a\n", "a\nb"])
def test_invalid_run_names_are_refused_with_the_name(name: str) -> None:
    with pytest.raises(ValueError, match="run name"):
        check_run_name(name)


def test_a_tinker_model_id_of_a_restored_model_says_where_its_run_is() -> None:
    """The tinker SDK names a model it opens from a checkpoint `<session_id>:train:<n>`; its run has
    another name, which the refusal says how to find."""
    model_id = "session-6770aa:train:1"
    with pytest.raises(ValueError, match=r"tinker SDK gives a model opened from a checkpoint.*tinker-<n>-<hex>.*"
                                         r"`tandem status`.*tinker.create_model model_id=session-6770aa:train:1 run="):
        check_run_name(model_id)
    with pytest.raises(ValueError) as plain:
        check_run_name("a:b")
    assert "tinker" not in str(plain.value)


def test_adapter_names_are_unique_per_version_and_colon_free() -> None:
    names = {adapter_name("r", v) for v in range(1, 50)}
    assert len(names) == 49 and not any(":" in n for n in names)


def test_run_spec_defaults_are_plain_lora() -> None:
    spec = RunSpec(name="r", base_model="m")
    assert spec.lora.r == 16 and "q_proj" in spec.lora.target_modules
    with pytest.raises(ValueError, match="base_model"):
        RunSpec(name="r", base_model=" ")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"loss": {"kl_coef": math.inf}}, "loss.kl_coef"),
        ({"optimizer": {"weight_decay": math.inf}}, "optimizer.weight_decay"),
        ({"optimizer": {"max_grad_norm": math.nan}}, "optimizer.max_grad_norm"),
        ({"optimizer": {"betas": (math.nan, 0.5)}}, "optimizer.betas.0"),
        ({"optimizer": {"betas": (0.9, 5.0)}}, "optimizer.betas.1"),
        ({"lora": {"alpha": math.inf}}, "lora.alpha"),
        ({"lora": {"alpha": 1e30}}, "lora.alpha"),  # accepted, every step's gradient norm was inf
        ({"seed": 2**64}, "seed"),
        # a bool or a string is no count: pydantic took True as 1 and "2" as 2
        ({"max_staleness_steps": True}, "max_staleness_steps"),
        ({"max_staleness_steps": "2"}, "max_staleness_steps"),
        ({"lora": {"r": True}}, "lora.r"),
        ({"loss": {"epochs": "3"}}, "loss.epochs"),
        ({"loss": {"normalize_std": "no"}}, "loss.normalize_std"),
    ],
)
def test_run_specs_that_would_not_read_back_or_train_are_refused_naming_the_field(spec: dict, field: str) -> None:
    """JSON has no inf or NaN (pydantic would store null, and the run could never be read again)."""
    with pytest.raises(ValueError) as info:
        RunSpec.model_validate({"name": "r", "base_model": "m", **spec})
    assert field in str(info.value).replace("\n", " ").split()[0:20].__str__() or field in str(info.value)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (job([]), "groups"),
        (job([{"trajectories": [traj()]}]), "groups.0"),
        (job([{"trajectories": [traj(reward=math.nan), traj()]}]), "reward"),
        (job([{"trajectories": [traj(reward=math.inf), traj()]}]), "reward"),
        (job([{"trajectories": [traj(rollout_logprobs=[-1.0]), traj()]}]), "rollout_logprobs"),
        (job([{"trajectories": [traj(reward="abc"), traj()]}]), "reward"),
        (job([{"trajectories": [traj(completion_ids="x"), traj()]}]), "completion_ids"),
        ({"run": "bad:name", "groups": []}, "run"),
    ],
)
def test_bad_jobs_fail_naming_the_field(payload: dict, field: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_job(payload)
    assert field in str(info.value)


def test_a_good_job_round_trips_through_json() -> None:
    j = parse_job(job([{"trajectories": [traj(), traj(reward=0.0, loss_mask=[1, 0])]}]))
    again = TrainJob.model_validate_json(j.model_dump_json())
    assert again == j
    assert again.groups[0].trajectories[1].mask == [1, 0]
    assert isinstance(again.groups[0], TrajectoryGroup)
    assert Trajectory.model_validate(traj()).mask == [1, 1]


def test_a_completion_that_cannot_be_trained_on_is_validation_failed_naming_the_field() -> None:
    from tandem import Completion

    empty = Completion(prompt_ids=[1], completion_ids=[], rollout_logprobs=[], version=0)
    with pytest.raises(ValidationFailed) as info:
        empty.to_trajectory(1.0)
    assert info.value.field == "completion_ids" and "completion_ids" in str(info.value)
    fine = Completion(prompt_ids=[1], completion_ids=[2], rollout_logprobs=[-0.5], version=3, text="2")
    with pytest.raises(ValidationFailed, match="reward"):
        fine.to_trajectory(math.nan)
    assert fine.to_trajectory(0.5, loss_mask=[1]) == Trajectory(prompt_ids=[1], completion_ids=[2],
                                                                rollout_logprobs=[-0.5], version=3, reward=0.5,
                                                                loss_mask=[1])
    assert fine.logprobs == fine.rollout_logprobs


# run identity of rollouts ---------------------------------------------------------------------
def test_a_completion_keeps_what_sampled_it_and_one_without_reads_as_before() -> None:
    from tandem import Completion, Origin

    sampled = Completion(prompt_ids=[1], completion_ids=[2], rollout_logprobs=[-0.5], version=2,
                         origin=Origin.of({"run": "alpha", "version": 2, "adapter": "alpha-v2-a1"}))
    trajectory = sampled.to_trajectory(1.0)
    assert trajectory.origin == Origin(run="alpha", adapter="alpha-v2-a1")
    assert TrainJob.model_validate_json(parse_job(job([{"trajectories": [
        trajectory.model_dump(), trajectory.model_dump()]}])).model_dump_json()).groups[0].trajectories[0] == trajectory
    # without one (by hand, an older client) the JSON is what it was: older trainers read it, digests hold
    assert "origin" not in Trajectory.model_validate(traj()).model_dump_json()
    assert Trajectory.model_validate(traj()).origin is None
    assert Origin.of({"version": 0}) is None  # a reply that names no run at all
    assert Origin.of({"run": None, "version": 0, "adapter": None}) == Origin(run=None)  # the base model


@pytest.mark.parametrize(
    ("origin", "version", "words"),
    [
        ({"run": None}, 2, ["origin.run is None", "version is 2"]),
        ({"run": "alpha", "adapter": "beta-v2"}, 2, ["'beta-v2'", "run 'alpha' (v2)"]),
        ({"run": "alpha", "adapter": "alpha-v1"}, 2, ["'alpha-v1'", "run 'alpha' (v2)"]),
        ({"run": "alpha", "adapter": "alpha-v0"}, 0, ["'alpha-v0'", "version is 0"]),
        ({"run": "alpha", "adapter": "tuned"}, 3, ["'tuned'"]),
        ({"run": "a:b"}, 1, ["run name"]),
        ({"run": "alpha", "version": 2}, 2, ["version"]),  # extra field
    ],
)
def test_an_origin_that_does_not_fit_the_sample_is_refused(origin: dict, version: int, words: list[str]) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_job(job([{"trajectories": [traj(version=version, origin=origin), traj()]}]))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_another_runs_rollout_is_refused_naming_the_sample_and_both_runs() -> None:
    from tandem.jobs import check_origins

    beta = {"run": "beta", "adapter": "beta-v2"}
    alpha = {"run": "alpha", "adapter": "alpha-v2"}
    foreign = parse_job({"run": "beta", "groups": [
        {"trajectories": [traj(version=2, origin=beta), traj(version=2, origin=beta)]},
        {"trajectories": [traj(version=2, origin=beta)] * 3 + [traj(version=2, origin=alpha)]},
    ]})
    with pytest.raises(ValidationFailed) as info:
        check_origins(foreign)
    assert info.value.field == "groups.1.trajectories.3.origin.run"
    assert str(info.value) == (
        "groups.1.trajectories.3.origin.run: group 1 sample 3 was sampled from run 'alpha' (v2); this job trains "
        "run 'beta': train each run on its own rollouts (sampled with model 'beta')")
    # another run's version 0 is still that run's rollout
    with pytest.raises(ValidationFailed, match="run 'alpha' \\(v0\\)"):
        check_origins(parse_job({"run": "beta", "groups": [
            {"trajectories": [traj(origin={"run": "alpha"}), traj()]}]}))


def test_the_runs_own_the_base_models_and_unmarked_rollouts_are_accepted() -> None:
    from tandem.jobs import check_origins

    check_origins(parse_job({"run": "beta", "groups": [{"trajectories": [
        traj(version=2, origin={"run": "beta", "adapter": "beta-v2"}),
        traj(version=1, origin={"run": "beta"}),  # hand-built: the run, no adapter name
        traj(origin={"run": None}),  # the base model by its own name
        traj(),  # no origin: an older client, or built by hand
    ]}]}))
