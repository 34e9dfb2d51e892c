"""tandem's patches to an engine's environment (images/patches/): each file checked by sha256 before
and after, with GNU patch applying them. `make check-patches` runs the real patches against the
locked wheel's files; these tests run apply.sh itself on a file of their own."""

from __future__ import annotations

import difflib
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

PATCHES = Path(__file__).resolve().parents[2] / "images" / "patches"
pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed (apt-get install patch)")

BEFORE = "def load(x):\n    return x\n"
AFTER = "def load(x):\n    copy(x)\n    return x\n"
TARGET = "pkg/mod.py"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def patches(tmp_path: Path) -> Path:
    """A copy of apply.sh beside one patch of pkg/mod.py and its SHA256SUMS."""
    d = tmp_path / "patches"
    d.mkdir()
    shutil.copy(PATCHES / "apply.sh", d / "apply.sh")
    diff = difflib.unified_diff(BEFORE.splitlines(True), AFTER.splitlines(True), f"a/{TARGET}", f"b/{TARGET}")
    (d / "mod.patch").write_text("What the patch does, before the diff.\n\n" + "".join(diff))
    (d / "SHA256SUMS").write_text(f"# comment\nengine mod.patch {TARGET} {sha256(BEFORE)} {sha256(AFTER)}\n")
    return d


def site_with(tmp_path: Path, text: str) -> Path:
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / TARGET).write_text(text)
    return site


def apply(patches: Path, site: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(patches / "apply.sh"), *flags, "engine", str(site)], capture_output=True, text=True,
                          timeout=30)


def test_a_patch_applies_to_the_file_it_was_made_for_and_only_once(patches: Path, tmp_path: Path) -> None:
    site = site_with(tmp_path, BEFORE)
    first = apply(patches, site)
    assert first.returncode == 0, first.stderr
    assert (site / TARGET).read_text() == AFTER
    assert "mod.patch: applied" in first.stdout and "1 patch(es) applied" in first.stdout
    again = apply(patches, site)
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (site / TARGET).read_text() == AFTER


def test_reverse_takes_a_patch_back_to_the_locked_file_by_the_same_checks(patches: Path, tmp_path: Path) -> None:
    site = site_with(tmp_path, BEFORE)
    assert apply(patches, site).returncode == 0
    back = apply(patches, site, "--reverse")
    assert back.returncode == 0, back.stderr
    assert (site / TARGET).read_text() == BEFORE
    assert "mod.patch: taken back" in back.stdout and "1 patch(es) taken back" in back.stdout
    again = apply(patches, site, "--reverse")
    assert again.returncode == 0 and "already taken back" in again.stdout
    assert apply(patches, site).returncode == 0  # and on again
    assert (site / TARGET).read_text() == AFTER


def test_reverse_refuses_a_file_the_patch_did_not_leave(patches: Path, tmp_path: Path) -> None:
    other = "def load(x):\n    return x  # another release\n"
    site = site_with(tmp_path, other)
    result = apply(patches, site, "--reverse")
    assert result.returncode == 1
    assert f"has sha256 {sha256(other)}, not the {sha256(AFTER)} that mod.patch leaves" in result.stderr
    assert (site / TARGET).read_text() == other


def test_a_file_of_another_release_is_refused_and_left_as_it_is(patches: Path, tmp_path: Path) -> None:
    other = "def load(x):\n    return x  # another release\n"
    site = site_with(tmp_path, other)
    result = apply(patches, site)
    assert result.returncode == 1
    assert f"has sha256 {sha256(other)}, not the {sha256(BEFORE)} that mod.patch was made for" in result.stderr
    assert (site / TARGET).read_text() == other


def test_a_missing_file_names_the_site_packages_to_check(patches: Path, tmp_path: Path) -> None:
    result = apply(patches, tmp_path / "nowhere")
    assert result.returncode == 1
    assert f"{tmp_path}/nowhere/{TARGET} not found: is {tmp_path}/nowhere engine's site-packages?" in result.stderr


def test_each_listed_patch_changes_the_file_its_line_names() -> None:
    lines = [line.split() for line in (PATCHES / "SHA256SUMS").read_text().splitlines() if not line.startswith("#")]
    assert lines
    for engine, patch, target, before, after in lines:
        text = (PATCHES / patch).read_text()
        assert f"--- a/{target}\n" in text and f"+++ b/{target}\n" in text, patch
        assert len(before) == len(after) == 64 and before != after
        # made for the release the lock pins (check-patches proves it against that wheel's file)
        locked = re.search(rf"^{engine}==(\S+)", (PATCHES.parent / "locks" / f"{engine}.txt").read_text(), re.M)
        assert locked is not None and patch.startswith(f"{engine}-{locked.group(1)}-"), patch


def test_a_benchmark_report_says_which_patches_the_engine_it_ran_had(tmp_path: Path) -> None:
    """bench.benchlib.engine_patches: each patch of SHA256SUMS by the sha256 of the file it changes,
    in the package that the engine's interpreter imports."""
    import sys

    from bench.benchlib import engine_patches

    lines = [line.split() for line in (PATCHES / "SHA256SUMS").read_text().splitlines() if not line.startswith("#")]
    sglang = {p: t for e, p, t, _, _ in lines if e == "sglang"}
    target = next(iter(sglang.values()))
    site = tmp_path / "site"
    (site / target).parent.mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / target).write_text("# a file of another release\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    # one file of another release, the others absent: none of the patches is there
    assert engine_patches(str(python), "sglang") == dict.fromkeys(sglang, "other")
    assert engine_patches(str(tmp_path / "no-python"), "sglang") == {}


def test_with_two_patches_a_file_of_another_release_stops_both_before_either_changes(
    patches: Path, tmp_path: Path,
) -> None:
    other_target, other_before = "pkg/other.py", "x = 1\n"
    diff = difflib.unified_diff(other_before.splitlines(True), ["x = 2\n"], f"a/{other_target}", f"b/{other_target}")
    (patches / "other.patch").write_text("".join(diff))
    with (patches / "SHA256SUMS").open("a") as f:
        f.write(f"engine other.patch {other_target} {sha256(other_before)} {sha256('x = 2' + chr(10))}\n")
    site = site_with(tmp_path, BEFORE)
    (site / other_target).write_text("x = 3  # another release\n")
    result = apply(patches, site)
    assert result.returncode == 1 and "other.patch was made for" in result.stderr
    assert (site / TARGET).read_text() == BEFORE  # the first patch was not applied either
    (site / other_target).write_text(other_before)
    both = apply(patches, site)
    assert both.returncode == 0 and "2 patch(es) applied" in both.stdout
    assert (site / TARGET).read_text() == AFTER and (site / other_target).read_text() == "x = 2\n"
