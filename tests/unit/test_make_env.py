"""`make .env`: a new .env from .env.example with every secret random (mode 0600), and on an existing
.env only the secrets it lacks added -- an .env from before the Redis roles gains their passwords and
keeps everything else.

Runs the repository's Makefile in an empty directory holding a copy of .env.example.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("REDIS_PASSWORD", "REDIS_CLIENT_PASSWORD", "REDIS_INFERENCE_PASSWORD", "REDIS_TRAINER_PASSWORD", "REDIS_TINKER_PASSWORD",
           "ENGINE_ADMIN_KEY")


def make_env(tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    shutil.copy(ROOT / ".env.example", tmp_path / ".env.example")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), ".env"], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def values(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)=(.*)$", path.read_text(), flags=re.M))


def test_a_new_env_has_every_secret_random_and_private(tmp_path: Path) -> None:
    said = make_env(tmp_path)
    got = values(tmp_path / ".env")
    assert all(re.fullmatch(r"[0-9a-f]{32}", got[name]) for name in SECRETS), got
    assert len({got[name] for name in SECRETS}) == len(SECRETS)
    assert (tmp_path / ".env").stat().st_mode & 0o777 == 0o600
    assert "wrote .env" in said
    example = [line for line in (ROOT / ".env.example").read_text().splitlines() if not line.startswith(SECRETS)]
    assert [line for line in (tmp_path / ".env").read_text().splitlines() if not line.startswith(SECRETS)] == example


def test_an_env_from_before_the_redis_roles_gains_their_passwords_and_keeps_the_rest(tmp_path: Path) -> None:
    older = "REDIS_PASSWORD=kept\nENGINE_ADMIN_KEY=key\nGPU_MODE=cpu\n# a comment\n"
    (tmp_path / ".env").write_text(older)
    said = make_env(tmp_path)
    text = (tmp_path / ".env").read_text()
    assert text.startswith(older)
    got = values(tmp_path / ".env")
    assert {got[f"REDIS_{role}_PASSWORD"] != "" for role in ("CLIENT", "INFERENCE", "TRAINER")} == {True}
    assert "REDIS_CLIENT_PASSWORD REDIS_INFERENCE_PASSWORD REDIS_TRAINER_PASSWORD" in said
    assert make_env(tmp_path) == "" and (tmp_path / ".env").read_text() == text  # nothing lacking: untouched


def test_an_empty_secret_is_filled_where_it_stands(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("REDIS_PASSWORD=\nREDIS_CLIENT_PASSWORD=c\nREDIS_INFERENCE_PASSWORD=i\n"
                                   "REDIS_TRAINER_PASSWORD=t\nREDIS_TINKER_PASSWORD=x\nENGINE_ADMIN_KEY=k\n")
    make_env(tmp_path)
    lines = (tmp_path / ".env").read_text().splitlines()
    assert re.fullmatch(r"REDIS_PASSWORD=[0-9a-f]{32}", lines[0]) and lines[1:] == [
        "REDIS_CLIENT_PASSWORD=c", "REDIS_INFERENCE_PASSWORD=i", "REDIS_TRAINER_PASSWORD=t", "REDIS_TINKER_PASSWORD=x",
        "ENGINE_ADMIN_KEY=k"]
