"""`tandem-doctor`: an image's environments checked against the lock files they came from.

The images install each Python environment from a hash-pinned lock (images/locks/, copied
to /opt/locks/<env>.txt) into /opt/<env> (the CPU images' cpu-inference and cpu-trainer into
/opt/tandem). Run inside an image (no GPU needed)::

    docker run --rm tandem-inference:dev tandem-doctor

For every lock it compares the distributions installed in that environment with the pins
(missing, another version, installed but not locked), imports what the environment is for
with the environment's own interpreter (sglang or vllm; torch, peft, transformers; tandem's services),
then says whether it runs as root (the images do not) and what the image's healthcheck runs
(TANDEM_HEALTHCHECK, which the Dockerfile's HEALTHCHECK executes). Exit status 0 when every
check passed, else 1. The images run it at the end of their build, so an image whose
environment left its lock does not build. Standard library only: it runs in any of them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# What each environment exists for: imported with its own interpreter. Unsloth is left out: it
# needs a GPU to import.
IMPORTS: dict[str, tuple[str, ...]] = {
    "sglang": ("sglang", "torch", "transformers"),
    "vllm": ("vllm", "torch", "transformers"),
    "trainer": ("torch", "peft", "transformers", "tandem_trainer.main"),
    "tandem": ("tandem_inference.main", "tandem_inference.engines.sglang_launcher",
               "tandem_inference.engines.vllm_launcher"),
    "cpu-inference": ("torch", "transformers", "tandem_inference.main", "tandem_inference.engines.transformers.server"),
    "cpu-trainer": ("torch", "peft", "transformers", "tandem_trainer.main", "tandem_trainer.tiny_model"),
}
# Environments that do not live in /opt/<env>: the CPU images install their one lock into /opt/tandem.
VENVS: dict[str, str] = {"cpu-inference": "/opt/tandem", "cpu-trainer": "/opt/tandem"}
# Installed on purpose without a pin: tandem's own packages (from the source tree) and the pip a
# venv is created with.
UNLOCKED = {"pip", "tandem", "tandem-trainer", "tandem-inference"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m, json, sys\n"
    "out = {}\n"
    "for d in m.distributions():\n"
    "    out.setdefault(d.metadata['Name'] or '', d.version)\n"
    "print(json.dumps({'python': sys.version.split()[0], 'dists': out}))\n"
)
# `-P`: the working directory is not put on sys.path, so only the environment's own packages count.
IMPORT_ONE = "import importlib, sys; m = importlib.import_module(sys.argv[1]); print(getattr(m, '__version__', ''))"


def normalize(name: str) -> str:
    """PEP 503: `Foo_Bar.baz` and `foo-bar-baz` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """Pinned name (normalized) -> version, from a `name==version \\` lock (uv pip compile, pip-compile)."""
    return {normalize(m[1]): m[2] for line in path.read_text().splitlines() if (m := PIN.match(line))}


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failed: bool = False

    def ok(self, what: str) -> None:
        self.lines.append(f"  ok    {what}")

    def fail(self, what: str) -> None:
        self.lines.append(f"  FAIL  {what}")
        self.failed = True

    def note(self, what: str) -> None:
        self.lines.append(f"        {what}")


def compare(pins: dict[str, str], installed: dict[str, str], report: Report) -> None:
    """Installed distributions against the lock's pins; every difference is named."""
    have = {normalize(n): (n, v) for n, v in installed.items() if n}
    missing = sorted(n for n in pins if n not in have)
    other = sorted(f"{n} {have[n][1]} (lock: {pins[n]})" for n in pins if n in have and have[n][1] != pins[n])
    extra = sorted(f"{have[n][0]} {have[n][1]}" for n in have if n not in pins and n not in UNLOCKED)
    matched = len(pins) - len(missing) - len(other)
    if missing or other:
        report.fail(f"{matched} of {len(pins)} locked packages installed at the locked version")
    else:
        report.ok(f"{matched} of {len(pins)} locked packages installed at the locked version")
    if missing:
        report.fail("missing: " + ", ".join(missing))
    if other:
        report.fail("another version: " + ", ".join(other))
    if extra:
        report.fail("installed but not in the lock: " + ", ".join(extra))
    unlocked = sorted(f"{have[n][0]} {have[n][1]}" for n in have if n in UNLOCKED)
    if unlocked:
        report.note("outside the lock, on purpose: " + ", ".join(unlocked))


def check_env(name: str, lock: Path, python: str, report: Report, timeout_s: float = 300.0) -> None:
    pins = read_lock(lock)
    report.lines.append(f"{name}: {lock} ({len(pins)} pins) against {python}")
    try:
        listed = subprocess.run([python, "-P", "-c", LIST_DISTRIBUTIONS], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        report.fail(f"cannot run {python}: {exc}")
        return
    if listed.returncode != 0:
        report.fail(f"{python} could not list its packages: {listed.stderr.strip()[-500:]}")
        return
    found = json.loads(listed.stdout)
    report.note(f"Python {found['python']}")
    compare(pins, found["dists"], report)
    for module in IMPORTS.get(name, ()):
        try:
            done = subprocess.run([python, "-P", "-c", IMPORT_ONE, module], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            report.fail(f"import {module}: no answer within {timeout_s:.0f} s")
            continue
        if done.returncode == 0:
            version = done.stdout.strip().splitlines()[-1:] or [""]
            report.ok(f"import {module}" + (f" ({version[0]})" if version[0] else ""))
        else:
            report.fail(f"import {module}: {(done.stderr.strip().splitlines() or ['(no message)'])[-1]}")


def check_user(uid: int, report: Report) -> None:
    if uid == 0:
        report.fail("runs as root: the images run as the user tandem (uid 10001); drop `--user 0`")
    else:
        report.ok(f"runs as uid {uid}, not root")


def environments(locks: Path, pythons: dict[str, str]) -> list[tuple[str, Path, str]]:
    """(name, lock, interpreter) for every <name>.txt in `locks`; the interpreter is /opt/<name>/bin/python
    (VENVS: another directory) unless given."""
    return [(p.stem, p, pythons.get(p.stem, f"{VENVS.get(p.stem, '/opt/' + p.stem)}/bin/python"))
            for p in sorted(locks.glob("*.txt"))]


def run(locks: Path, pythons: dict[str, str], uid: int, healthcheck: str | None) -> Report:
    report = Report()
    envs = environments(locks, pythons)
    if not envs:
        report.lines.append(f"locks: none in {locks}")
        report.fail("no lock files: is this a tandem image? (tandem-doctor --locks DIR)")
    for name, lock, python in envs:
        check_env(name, lock, python, report)
    report.lines.append("user:")
    check_user(uid, report)
    report.lines.append("healthcheck:")
    if healthcheck:
        report.note(healthcheck)
    else:
        report.note("TANDEM_HEALTHCHECK is not set: this image declares no healthcheck of its own")
    report.lines.append("result: " + ("FAILED" if report.failed else "ok"))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem-doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=Path, default=Path("/opt/locks"), help="the directory of <env>.txt lock files")
    parser.add_argument("--python", action="append", default=[], metavar="ENV=PATH",
                        help="the interpreter of an environment (default /opt/ENV/bin/python); repeatable")
    args = parser.parse_args(argv)
    pythons = {}
    for item in args.python:
        env, sep, path = item.partition("=")
        if not sep or not env or not path:
            parser.error(f"--python {item!r}: expected ENV=PATH, e.g. --python sglang=/opt/sglang/bin/python")
        pythons[env] = path
    report = run(args.locks, pythons, os.geteuid(), os.environ.get("TANDEM_HEALTHCHECK"))
    print("\n".join(report.lines))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
