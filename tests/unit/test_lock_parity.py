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
