"""The lock files (images/locks/<env>.txt) against what they were compiled from.

The GPU images' environments (sglang, vllm, trainer, tandem: Python 3.12) and the development / CPU one
(dev: .venv and CI; cpu-inference, cpu-trainer and rq-dashboard, the CPU images' subsets of it,
compiled with dev.txt as constraints: Python 3.11), and cookbook (.venv-cookbook: tinker-cookbook's loops,
compiled on its own, as it asks for an older transformers than dev.txt pins; Python 3.11).

Each lock is compiled by `make locks` from images/locks/<env>.in: local packages (`./trainer[unsloth]`,
whose pyproject's dependencies count) and plain requirements (the engine pins), with
<env>.overrides replacing what some package asks for. A pyproject or .in that asks for something
its lock does not pin, or pins at a version outside the range, is drift: the image would install
something else than the pyproject says. Offline and cheap: no resolver, only `packaging`.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "images" / "locks"
# What the locks are compiled for (the Makefile's LOCK_FLAGS and DEV_LOCK_FLAGS): Linux x86-64,
# CPython 3.12 for the GPU images, 3.11 for the development / CPU environment.
DEV_ENVS = ["clients", "cookbook", "cpu-inference", "cpu-trainer", "dev", "rq-dashboard", "tools"]
TARGET = {
    "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "platform_release": "", "platform_version": "",
    "implementation_version": "3.12.3",
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def read_lock(path: Path) -> dict[str, tuple[Version, int]]:
    """name -> (pinned version, number of --hash entries)."""
    pins: dict[str, tuple[Version, int]] = {}
    name = ""
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            name = canonicalize_name(m[1])
            pins[name] = (Version(m[2]), 0)
        elif "--hash=sha256:" in line and name:
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
    return pins


def requirement_lines(path: Path) -> list[str]:
    return [line.split(" #")[0].strip() for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def target(env: str) -> dict[str, str]:
    if env not in DEV_ENVS:
        return TARGET
    return {**TARGET, "python_version": "3.11", "python_full_version": "3.11.2", "implementation_version": "3.11.2"}


def applies(req: Requirement, extras: set[str], env: str = "sglang") -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**target(env), "extra": extra}) for extra in (extras or {""}))


def hashes(path: Path) -> dict[str, set[str]]:
    """name -> the sha256 digests the lock allows for it."""
    found: dict[str, set[str]] = {}
    name = ""
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            name = canonicalize_name(m[1])
            found[name] = set()
        elif m := re.search(r"--hash=sha256:([0-9a-f]{64})", line):
            found[name].add(m[1])
    return found


def drift(env: str, root: Path = ROOT) -> list[str]:
    """Every disagreement between images/locks/<env>.in (and the pyprojects it names) and <env>.txt."""
    locks = root / "images" / "locks"
    lock_path = locks / f"{env}.txt"
    pins = read_lock(lock_path)
    overrides = locks / f"{env}.overrides"
    override_lines = requirement_lines(overrides) if overrides.exists() else []
    overridden = {canonicalize_name(Requirement(line).name) for line in override_lines}
    wanted: list[tuple[str, Requirement, set[str]]] = []  # (where it comes from, requirement, extras it is under)
    local: set[str] = set()
    for line in requirement_lines(locks / f"{env}.in"):
        if line.startswith("."):
            path, _, extras = line.partition("[")
            pyproject = root / path / "pyproject.toml"
            project = tomllib.loads(pyproject.read_text())["project"]
            local.add(canonicalize_name(project["name"]))
            names = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
            for dep in project.get("dependencies", []):
                wanted.append((str(pyproject.relative_to(root)), Requirement(dep), set()))
            for extra in names:
                for dep in project.get("optional-dependencies", {})[extra]:
                    wanted.append((f"{pyproject.relative_to(root)} [{extra}]", Requirement(dep), {extra}))
        else:
            wanted.append((f"images/locks/{env}.in", Requirement(line), set()))
    problems = []
    for source, req, extras in wanted:
        name = canonicalize_name(req.name)
        if name in local or name in overridden or not applies(req, extras, env):
            continue
        if name not in pins:
            problems.append(f"{source} asks for {req}, which {lock_path.name} does not pin: run `make locks`")
        elif not req.specifier.contains(pins[name][0], prereleases=True):
            problems.append(f"{source} asks for {req}, but {lock_path.name} pins {name}=={pins[name][0]}: run `make locks`")
    for line in override_lines:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if not applies(req, set(), env):
            if name in pins:
                problems.append(f"{overrides.name} leaves {name} out, but {lock_path.name} pins it: run `make locks`")
        elif name in pins and not req.specifier.contains(pins[name][0], prereleases=True):
            problems.append(f"{overrides.name} says {req}, but {lock_path.name} pins {name}=={pins[name][0]}: run `make locks`")
    problems += [f"{lock_path.name} pins {name}=={v} without a hash" for name, (v, hashes) in pins.items() if hashes == 0]
    problems += [f"{lock_path.name} pins tandem's own {name}: it is installed from the source tree"
                 for name in pins if name in local]
    return problems


ENVS = sorted(p.stem for p in LOCKS.glob("*.in"))


def test_there_is_a_lock_per_environment() -> None:
    assert ENVS == sorted(["sglang", "tandem", "trainer", "vllm", *DEV_ENVS])
    assert all((LOCKS / f"{env}.txt").is_file() for env in ENVS)


@pytest.mark.parametrize("env", ["clients", "cpu-inference", "cpu-trainer", "rq-dashboard"])
def test_the_cpu_images_install_exactly_what_make_test_ran(env: str) -> None:
    dev, image = read_lock(LOCKS / "dev.txt"), read_lock(LOCKS / f"{env}.txt")
    dev_hashes, image_hashes = hashes(LOCKS / "dev.txt"), hashes(LOCKS / f"{env}.txt")
    shared = set(image) & set(dev)
    if env in ("cpu-inference", "cpu-trainer"):  # the dashboard and the clients bring their own; tandem's images nothing
        assert shared == set(image), f"{env}.txt pins what dev.txt does not: run `make locks`"
    assert {"redis", "rq"} <= shared or env == "clients"
    assert {n: image[n][0] for n in shared} == {n: dev[n][0] for n in shared}
    assert all(image_hashes[n] == dev_hashes[n] for n in shared)


def test_every_environment_installs_from_its_lock_with_hashes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q --require-hashes -r images/locks/dev.txt" in makefile
    assert "pip install -q --require-hashes --no-deps -r $(VENV)/torch.txt" in makefile  # torch alone first
    assert "pip install -q --require-hashes -r images/locks/cookbook.txt" in makefile
    assert "pip install -q --require-hashes --no-deps -r $(COOKBOOK_VENV)/torch.txt" in makefile
    assert makefile.count("--extra-index-url $(TORCH_INDEX)") == 3  # asked for torch alone, never for a lock
    assert "--no-deps --no-build-isolation -e shared" in makefile, "tandem's own packages add nothing unhashed"
    images = [("inference-cpu", "cpu-inference"), ("trainer-cpu", "cpu-trainer"), ("rq-dashboard", "rq-dashboard")]
    for dockerfile, lock in images:
        text = (ROOT / "images" / f"{dockerfile}.Dockerfile").read_text()
        # the lock is copied in (to /tmp, or kept in /opt/locks for the image's SBOM) and installed from
        copied = [line.split()[-1] for line in text.splitlines() if line.startswith(f"COPY images/locks/{lock}.txt ")]
        assert copied and set(copied) <= {"/tmp/lock.txt", f"/opt/locks/{lock}.txt"}, (dockerfile, copied)
        assert any(f"-r {path}" in text for path in copied), (dockerfile, copied)
        installs = [line for line in text.splitlines() if "pip install" in line]
        assert all("--require-hashes" in line or "--no-deps" in line for line in installs), (dockerfile, installs)
    # the torch every CPU environment pins is one build
    torches = {read_lock(LOCKS / f"{env}.txt")["torch"][0] for env in ["dev", "cookbook", "cpu-inference", "cpu-trainer"]}
    assert len(torches) == 1 and next(iter(torches)).local == "cpu"


@pytest.mark.parametrize("env", ENVS)
def test_lock_matches_its_inputs(env: str) -> None:
    assert drift(env) == []


def test_the_locks_pin_the_engines_they_are_for() -> None:
    assert read_lock(LOCKS / "sglang.txt")["sglang"][0] == Version("0.5.23")
    vllm = read_lock(LOCKS / "vllm.txt")
    assert vllm["vllm"][0] == Version("0.33.0") and vllm["torch"][0] == Version("2.14.0")
    assert "sglang" not in vllm and "vllm" not in read_lock(LOCKS / "sglang.txt"), "each engine in its own environment"
    trainer = read_lock(LOCKS / "trainer.txt")
    assert trainer["unsloth"][0] == Version("2026.10.9")
    assert "torch" not in read_lock(LOCKS / "tandem.txt"), "tandem's light environment never holds torch"


def copy_inputs(tmp_path: Path) -> Path:
    for name in ("shared", "inference", "trainer"):
        (tmp_path / name).mkdir()
        shutil.copy(ROOT / name / "pyproject.toml", tmp_path / name / "pyproject.toml")
    shutil.copytree(LOCKS, tmp_path / "images" / "locks")
    return tmp_path


def test_a_pyproject_that_moves_past_its_lock_is_drift(tmp_path: Path) -> None:
    root = copy_inputs(tmp_path)
    pyproject = root / "inference" / "pyproject.toml"
    text = pyproject.read_text()
    assert '"transformers>=4.51",' in text
    pyproject.write_text(text.replace('"transformers>=4.51",', '"transformers>=99", "leftpad>=1.0",'))
    problems = drift("tandem", root)
    assert len(problems) == 2, problems
    assert "inference/pyproject.toml asks for transformers>=99, but tandem.txt pins transformers==" in problems[0]
    assert "leftpad>=1.0, which tandem.txt does not pin" in problems[1]
    assert all("make locks" in p for p in problems)


def test_an_extra_and_an_engine_pin_are_checked_too(tmp_path: Path) -> None:
    root = copy_inputs(tmp_path)
    pyproject = root / "trainer" / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"unsloth>=2026.10.9"', '"unsloth>=2027.1"'))
    engine_in = root / "images" / "locks" / "sglang.in"
    engine_in.write_text(engine_in.read_text().replace("sglang==0.5.23", "sglang==0.5.24"))
    assert drift("trainer", root) == [
        "trainer/pyproject.toml [unsloth] asks for unsloth>=2027.1, but trainer.txt pins unsloth==2026.10.9: run `make locks`"]
    assert drift("sglang", root) == [
        "images/locks/sglang.in asks for sglang==0.5.24, but sglang.txt pins sglang==0.5.23: run `make locks`"]


def test_a_pin_without_a_hash_or_an_override_ignored_is_drift(tmp_path: Path) -> None:
    root = copy_inputs(tmp_path)
    lock = root / "images" / "locks" / "trainer.txt"
    text = lock.read_text()
    # Drop certifi's hashes, and pin xformers, which trainer.overrides leaves out.
    text = re.sub(r"^(certifi==\S+) \\\n(    --hash=\S+( \\)?\n)+", r"\1\n", text, flags=re.M)
    lock.write_text(text + "xformers==0.0.33 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    assert sorted(drift("trainer", root)) == [
        "trainer.overrides leaves xformers out, but trainer.txt pins it: run `make locks`",
        "trainer.txt pins certifi==2026.10.18 without a hash",
    ]

