"""tinker-cookbook's own loops, unmodified, against `tandem up`'s Tinker API on the CPU.

The RL loop (`tinker_cookbook.rl.train.main`, examples/tinker_rl.py: the digits task) must raise
the mean reward by at least 0.3 within 40 steps with `importance_sampling` and with `ppo`; the SL
loop (`tinker_cookbook.supervised.train.main`, examples/tinker_sl.py: a local JSONL of chats) must
lower the loss. The loops run as they would for a user: the examples as processes of
.venv-cookbook (`make cookbook`, images/locks/cookbook.txt; the cookbook asks for an older
transformers than tandem's environment has), the SDK pointed at the stack by the
`TINKER_BASE_URL` of the stack's client.env (and a `TINKER_API_KEY`, see `tinker_endpoint`).

They skip, saying why, where the cookbook's environment is missing (`make test` builds it first), and
fail where the stack serves no Tinker API (its client.env names no TINKER_BASE_URL: `tinker`, which the
dev lock pins, is not installed in tandem's environment).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.dev.composition import StackConfig
from tandem.dev.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_PYTHON = Path(os.environ.get("COOKBOOK_PYTHON", ROOT / ".venv-cookbook" / "bin" / "python"))
REWARD_KEY = "env/all/reward/total"
LOSS_KEY = "train_mean_nll"
RUN_TIMEOUT_S = 1800  # a bound on a hung loop, not a measurement


def read_env_file(path: Path) -> dict[str, str]:
    """NAME=value lines of an env file (client.env), comments and blank lines left out."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def cookbook_missing() -> str | None:
    """Why the cookbook's environment cannot run the examples, or None when it can."""
    if not COOKBOOK_PYTHON.exists():
        return f"no {COOKBOOK_PYTHON}: `make cookbook` builds tinker-cookbook's environment (or set COOKBOOK_PYTHON)"
    probe = subprocess.run([str(COOKBOOK_PYTHON), "-c", "import tinker, tinker_cookbook.rl.train"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        return f"{COOKBOOK_PYTHON} cannot import tinker_cookbook: `make cookbook` ({probe.stderr.strip()[-300:]})"
    return None


def tinker_endpoint(client_env: Path) -> tuple[str, str] | None:
    """The stack's Tinker API (base URL, key) as its client.env names it, or None.

    The service takes the gateway's key (`tml-` + TANDEM_GATEWAY__API_KEY); a stack whose gateway has
    none (the local one, on loopback) takes any key with the `tml-` prefix the SDK insists on.
    """
    env = read_env_file(client_env)
    if not env.get("TINKER_BASE_URL"):
        return None
    gateway_key = os.environ.get("TANDEM_GATEWAY__API_KEY")
    key = env.get("TINKER_API_KEY") or (f"tml-{gateway_key}" if gateway_key else "tml-local-stack")
    return env["TINKER_BASE_URL"], key


def no_tinker_api_reason(state: Path) -> str:
    return (f"tandem's stack serves no Tinker API here: its client.env ({state / 'client.env'}) names no "
            "TINKER_BASE_URL (`tandem up` starts the Tinker service where the `tinker` package is installed: make install)")


@pytest.fixture(scope="module")
def tinker_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """`tandem up`'s stack on the tiny model; its Tinker API's base URL and key."""
    if reason := cookbook_missing():
        pytest.skip(reason)
    probe = Stack(StackConfig(state_dir=tmp_path_factory.mktemp("probe"), gateway_port=0))
    if tinker_endpoint(probe.write_client_env()) is None:  # before paying for a whole stack
        pytest.fail(no_tinker_api_reason(probe.state))  # `tinker` is in the dev lock: its absence is a defect
    state = tmp_path_factory.mktemp("stack")
    with Stack(StackConfig(state_dir=state, model=str(tiny_model), gateway_port=0)) as stack:
        endpoint = tinker_endpoint(stack.state / "client.env")
        if endpoint is None:
            pytest.fail(no_tinker_api_reason(stack.state))
        yield endpoint


def run_example(script: str, endpoint: tuple[str, str], args: list[str], log_path: Path) -> list[dict]:
    """Run an example with the cookbook's interpreter against the stack; the rows of its metrics.jsonl."""
    base_url, api_key = endpoint
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": api_key, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(COOKBOOK_PYTHON), str(ROOT / "examples" / script), *args, "--log-path", str(log_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{script} {' '.join(args)} exited {done.returncode}:\n{output}"
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_the_cookbooks_rl_loop_raises_the_reward(tinker_stack: tuple[str, str], tiny_model: Path,
                                                 loss_fn: str, tmp_path: Path) -> None:
    # 2 groups of 8 a step, half the example's default: sampling is most of a step, and the reward
    # still rises by about 0.75 (docs/tinker.md)
    # ppo also checkpoints every 10 steps as the cookbook does by default: its sampling client is
    # then opened on the saved path (create_sampling_client(path))
    saves = ["--save-every", "10"] if loss_fn == "ppo" else []
    rows = run_example("tinker_rl.py", tinker_stack, ["--model", str(tiny_model.resolve()), "--loss-fn", loss_fn,
                                                      "--steps", "40", "--min-rise", "0.3",
                                                      "--groups-per-batch", "2", *saves], tmp_path / "rl")
    rewards = [float(row[REWARD_KEY]) for row in rows if REWARD_KEY in row]
    assert len(rewards) == 40, f"the loop logged {len(rewards)} steps, not 40"
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last - first >= 0.3, f"{loss_fn}: the reward went from {first:.3f} (first 5 steps) to {last:.3f} (last 5): {rewards}"


def test_the_cookbooks_sl_loop_lowers_the_loss(tinker_stack: tuple[str, str], tiny_model: Path, tmp_path: Path) -> None:
    rows = run_example("tinker_sl.py", tinker_stack, ["--model", str(tiny_model.resolve()), "--epochs", "4"],
                       tmp_path / "sl")
    losses = [float(row[LOSS_KEY]) for row in rows if LOSS_KEY in row]
    assert len(losses) == 20, f"40 chats in batches of 8 for 4 epochs are 20 steps; the loop logged {len(losses)}"
    first, last = statistics.fmean(losses[:3]), statistics.fmean(losses[-3:])
    assert last < first - 0.1, f"the loss went from {first:.3f} (first 3 steps) to {last:.3f} (last 3): {losses}"
