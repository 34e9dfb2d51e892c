"""Data-parallel pieces that need no second process: the split of a job, settings, failpoints, torchrun's arguments."""

from __future__ import annotations

import importlib
import random

import pytest
from pydantic import ValidationError

from tandem.settings import GpuSettings, ParallelSettings, TrainerSettings
from tandem_trainer.errors import TrainerConfigError
from tandem_trainer.launcher import launch_env, torchrun_args
from tandem_trainer.microbatch import pack, split_budget
from tandem_trainer.parallel import Group

pytestmark = pytest.mark.unit


def group(rank: int, world: int) -> Group:
    return Group(rank=rank, world=world, local_rank=rank, device_index=None, orders=None)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_micro_batch_goes_to_exactly_one_rank_and_the_loads_are_even(world: int) -> None:
    rng = random.Random(world)
    costs = [rng.randint(50, 4000) for _ in range(37)]
    shares = [group(r, world).share(costs) for r in range(world)]
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    loads = [sum(costs[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(costs)  # greedy, largest first: within one micro-batch


def test_more_ranks_than_micro_batches_leaves_some_ranks_without_work() -> None:
    shares = [group(r, 4).share([100, 300]) for r in range(4)]
    assert shares == [[1], [0], [], []]


def test_the_split_budget_gives_each_rank_some_of_the_job() -> None:
    lengths = [40] * 8  # 320 tokens: one micro-batch of 8 rows under a budget of 4096
    assert len(pack(lengths, split_budget(lengths, 4096, 1))) == 1
    two = pack(lengths, split_budget(lengths, 4096, 2))
    assert len(two) == 2 and all(len(g) == 4 for g in two)
    assert split_budget(lengths, 100, 2) == 100  # never above the configured budget
    assert split_budget([500, 10, 10], 4096, 8) == 500  # never below the longest sequence


def test_ranks_default_to_one_per_trainer_gpu_in_split_mode() -> None:
    assert ParallelSettings().world(GpuSettings(mode="split", inference=[0], trainer=[1, 2, 3])) == 3
    assert ParallelSettings().world(GpuSettings(mode="cpu")) == 1
    assert ParallelSettings(ranks=2).world(GpuSettings(mode="cpu")) == 2


def test_ranks_that_do_not_fit_the_gpus_are_refused_with_both_values_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GPUS__MODE", "split")
    monkeypatch.setenv("TANDEM_GPUS__INFERENCE", "[0]")
    monkeypatch.setenv("TANDEM_GPUS__TRAINER", "[1,2]")
    monkeypatch.setenv("TANDEM_PARALLEL__RANKS", "3")
    with pytest.raises(ValidationError, match=r"parallel.ranks=3 but gpus.trainer=\[1, 2\]"):
        TrainerSettings()
    monkeypatch.setenv("TANDEM_GPUS__MODE", "shared")
    monkeypatch.setenv("TANDEM_PARALLEL__RANKS", "2")
    with pytest.raises(ValidationError, match="needs split mode"):
        TrainerSettings()


def test_torchrun_starts_the_trainer_module_once_per_rank_on_this_machine() -> None:
    args = torchrun_args(ParallelSettings(ranks=4, max_restarts=7), 4, ["--burst"], "127.0.0.1:41234")
    # the ranks of one machine meet on loopback, at the store the launcher hosts there
    assert args[:6] == ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:41234", "--rdzv-id=tandem-trainer",
                        "--nnodes=1", "--rdzv-conf=join_timeout=900,read_timeout=60,is_host=false", "--local-addr=127.0.0.1"]
    assert args[6:8] == ["--nproc-per-node=4", "--max-restarts=7"]
    assert args[-3:] == ["--module", "tandem_trainer.main", "--burst"]
    env = launch_env(ParallelSettings(ranks=4))
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # rank 0 hosts the ranks' store, not torchrun's agent


def test_several_nodes_meet_at_the_rendezvous_endpoint_instead_of_on_loopback() -> None:
    parallel = ParallelSettings(ranks=2, nodes=3, rendezvous_endpoint="trainer-0.trainer-ranks:29400",
                                rendezvous_id="run-a", node_address="10.0.0.7", rendezvous_timeout_s=60,
                                rendezvous_read_timeout_s=15)
    args = torchrun_args(parallel, 2, [], "trainer-0.trainer-ranks:29400")
    assert args[:6] == ["--rdzv-backend=c10d", "--rdzv-endpoint=trainer-0.trainer-ranks:29400", "--rdzv-id=run-a",
                        "--nnodes=3", "--rdzv-conf=join_timeout=60,read_timeout=15,is_host=false", "--local-addr=10.0.0.7"]
    assert "--nproc-per-node=2" in args
    assert parallel.total(GpuSettings(mode="cpu")) == 6
    env = launch_env(parallel)
    assert "GLOO_SOCKET_IFNAME" not in env and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_several_nodes_without_an_endpoint_or_with_a_bad_one_are_refused() -> None:
    with pytest.raises(ValidationError, match="parallel.nodes=2 but parallel.rendezvous_endpoint is unset"):
        ParallelSettings(nodes=2)
    with pytest.raises(ValidationError, match="rendezvous_endpoint"):
        ParallelSettings(nodes=2, rendezvous_endpoint="trainer-0")  # no port
    with pytest.raises(ValidationError, match="rendezvous_endpoint"):
        ParallelSettings(nodes=2, rendezvous_endpoint="http://trainer-0:29400")


def test_every_rank_names_its_start_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem_trainer.parallel import start_key

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("MASTER_ADDR", "trainer-0")
    monkeypatch.setenv("MASTER_PORT", "41234")
    assert start_key() == "trainer-0:41234"  # a new store and port per start, not a node's restart count


def test_a_failpoint_named_for_a_rank_fires_in_that_rank_and_only_in_its_first_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem_trainer.failpoints as failpoints

    def armed(env: dict[str, str]) -> frozenset[str]:
        for key in ("RANK", "TORCHELASTIC_RESTART_COUNT"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return failpoints._armed("mid_training@rank1,after_register")

    assert armed({"RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}) == {"mid_training", "after_register"}
    assert armed({"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}) == {"after_register"}
    assert armed({"RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}) == {"after_register"}
    with pytest.raises(TrainerConfigError, match="a rank is a number"):
        failpoints._armed("mid_training@rankone")
    with pytest.raises(TrainerConfigError, match="unknown failpoint"):
        failpoints._armed("mid_trainin@rank1")
    importlib.reload(failpoints)  # ARMED as the environment of this process says


def test_a_cuda_trainer_with_fewer_gpus_than_ranks_exits_before_torchrun(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    env = {**os.environ, "TANDEM_GPUS__MODE": "split", "TANDEM_GPUS__INFERENCE": "[0]", "TANDEM_GPUS__TRAINER": "[1,2]",
           "TANDEM_BACKEND__DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "", "TANDEM_REDIS__URL": "redis://127.0.0.1:1/0",
           "TANDEM_METRICS__ENABLED": "false"}
    done = subprocess.run([sys.executable, "-m", "tandem_trainer.main"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert "torch sees no CUDA device" in done.stderr or "torch sees 0 GPU(s)" in done.stderr, done.stderr[-2000:]
    assert "torch.distributed.run" not in done.stderr and "trainer.launch" not in done.stderr
