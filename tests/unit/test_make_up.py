"""`make up` chooses the GPU mode from the GPUs nvidia-smi lists: split (2 or more), shared (1),
cpu (none); GPU_MODE (given, or in .env) overrides it, and it says what it chose.

Runs `make -n up` (print the commands, run none) in an empty directory with the repository's
Makefile, and an `nvidia-smi` on PATH that lists N GPUs the way `nvidia-smi -L` does: the
hardware edge is the only thing stood in for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def make_up(tmp_path: Path, gpus: int, env: dict[str, str] | None = None, dotenv: str = "") -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus)))
    smi.chmod(0o755)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env.example")
    if dotenv:
        (tmp_path / ".env").write_text(dotenv)
    base = {k: v for k, v in os.environ.items() if k not in ("GPU_MODE", "STACK", "INFERENCE_GPU", "TRAINER_GPU",
                                                            "TANDEM_IMAGE_PREFIX", "MAKEFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), "up"], cwd=tmp_path, capture_output=True, text=True,
                          env={**base, **(env or {}), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def chosen(lines: list[str]) -> tuple[str, str]:
    """(what `make up` says it chose, the compose command that starts the stack)."""
    said = next(line for line in lines if "make up: GPU_MODE=" in line)
    start = next(line for line in lines if line.rstrip().endswith("up -d"))
    return said, start


def test_two_gpus_or_more_mean_split_mode(tmp_path: Path) -> None:
    said, start = chosen(make_up(tmp_path, 4))
    assert "GPU_MODE=split (4 GPU(s) listed by nvidia-smi); inference on GPU 0 and trainer on GPU 1" in said
    assert start.startswith("GPU_MODE=split INFERENCE_GPU=0 TRAINER_GPU=1 docker compose -f compose.yaml ")
    assert "compose.cpu.yaml" not in start


def test_one_gpu_means_shared_mode_on_that_gpu(tmp_path: Path) -> None:
    said, start = chosen(make_up(tmp_path, 1))
    assert "GPU_MODE=shared (1 GPU(s) listed by nvidia-smi); inference on GPU 0 and trainer on GPU 0" in said
    assert start.startswith("GPU_MODE=shared INFERENCE_GPU=0 TRAINER_GPU=0 docker compose -f compose.yaml ")


def test_no_gpu_means_the_cpu_stack(tmp_path: Path) -> None:
    said, start = chosen(make_up(tmp_path, 0))
    assert "GPU_MODE=cpu (0 GPU(s) listed by nvidia-smi)" in said
    assert "-f compose.yaml -f compose.cpu.yaml" in start


def test_gpu_mode_given_overrides_what_was_found(tmp_path: Path) -> None:
    said, start = chosen(make_up(tmp_path, 2, env={"GPU_MODE": "shared", "INFERENCE_GPU": "1"}))
    assert "GPU_MODE=shared (GPU_MODE given); inference on GPU 1 and trainer on GPU 1" in said
    assert start.startswith("GPU_MODE=shared INFERENCE_GPU=1 TRAINER_GPU=1 ")


def test_gpu_mode_in_dotenv_overrides_what_was_found(tmp_path: Path) -> None:
    said, start = chosen(make_up(tmp_path, 1, dotenv="REDIS_PASSWORD=x\nGPU_MODE=cpu\n"))
    assert "GPU_MODE=cpu (GPU_MODE in .env)" in said
    assert "-f compose.cpu.yaml" in start


def test_published_images_are_pulled_not_built(tmp_path: Path) -> None:
    lines = make_up(tmp_path, 2, dotenv="REDIS_PASSWORD=x\nTANDEM_IMAGE_PREFIX=ghcr.io/acme/\n")
    assert any(" ".join(line.split()).endswith("docker compose -f compose.yaml pull inference trainer")
               for line in lines), lines
    assert not any("build" in line for line in lines), lines


def test_images_are_built_otherwise(tmp_path: Path) -> None:
    lines = make_up(tmp_path, 2)
    assert "SUITE=noble images/build-base.sh tandem-base:noble" in lines
    builds = [" ".join(line.split()) for line in lines if "docker compose -f compose.yaml build" in line]
    assert builds, lines
    # labelled from git: what a platform team checks before it pulls (images/publish.sh refuses an image without)
    for arg in ("VERSION", "REVISION", "CREATED", "SOURCE", "LICENSES"):
        assert f"--build-arg {arg}=" in builds[0], builds
