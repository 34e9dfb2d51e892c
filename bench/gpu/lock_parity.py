"""Environments identical to the GPU images' lock files on a machine that cannot download.

An offline GPU host has no network and already holds many packages (torch, the NVIDIA CUDA
wheels, triton, ...). To run the GPU check on the images' own bits there, every package of each
lock (images/locks/<env>.txt) is either staged as the exact wheel (its sha256 among the lock's
hashes) or shown identical to the copy the machine already has: every file the wheel's RECORD
lists is on the machine with the same sha256 (the file itself is hashed, not only its RECORD
line). Three steps:

    # on the GPU machine: what is installed there, with the sha256 of every file of each
    # distribution a lock names (RECORD paths relative to its site-packages)
    python3 bench/gpu/lock_parity.py inventory --out $OUT/inventory.json.gz
    # here: the wheels of every lock, hash-checked (pip download --require-hashes), against it
    python bench/gpu/lock_parity.py compare --wheels DIR --inventory inventory.json.gz --report parity.md --stage-list stage.txt
    # here: the wheels to stage, packed into folders of at most 58 MiB to copy over one at a time
    python bench/gpu/lock_parity.py pack --wheels DIR --stage-list stage.txt --prefix .lstage --first sglang,trainer,tandem,bench

Without a new inventory, the last parity table plans the staging (what it found identical on the
machine stays there; every small wheel is staged all the same, for a machine that lost one since):

    # here: every locked wheel for CPython 3.12 on x86-64 Linux, hash-checked
    python bench/gpu/lock_parity.py requirements --out-dir req      # req/<env>.txt, req/bench.txt
    for f in req/*.txt; do   # one download a lock: two locks may pin one package at two versions
      pip download --no-deps --require-hashes --only-binary :all: -d DIR -r "$f" \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        $(for i in $(seq 17 40); do printf -- "--platform manylinux_2_%s_x86_64 " $i; done) \
        --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any
    done
    python bench/gpu/lock_parity.py plan --wheels DIR --parity docs/results/<last>/parity.md --stage-list stage.txt
    python bench/gpu/lock_parity.py pack --wheels DIR --stage-list stage.txt --prefix .lstage --first sglang,trainer,tandem,bench

`bench/gpu/gpu_env.sh` installs the staged wheels into one folder per environment on the machine.
A machine that has lost a package since its inventory would leave an environment short; there
`fill` takes the pin from another environment's staged wheel of the same hash, or names what is
missing before anything is imported:

    python3 bench/gpu/lock_parity.py fill --env sglang --stage /tmp/lstage   # the wheels to add, one a line
"""

from __future__ import annotations

import argparse
import base64
import csv
import gzip
import hashlib
import io
import json
import os
import re
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "images" / "locks"
ENVS = ("sglang", "vllm", "trainer", "tandem")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
LIMIT = 58 * 2**20


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, the sha256 hex digests the lock allows)."""
    pins: dict[str, tuple[str, set[str]]] = {}
    name = ""
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            name = normalize(m[1])
            pins[name] = (m[2], set())
        for digest in HASH.findall(line):
            pins[name][1].add(digest)
    return pins


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def file_record_hash(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


# --- on the GPU machine ------------------------------------------------------------------------------


def inventory(out: Path) -> None:
    """Every distribution python3 sees; for those a lock names, each RECORD file with its hash on disk."""
    wanted = {name for env in ENVS if (LOCKS / f"{env}.txt").exists() for name in read_lock(LOCKS / f"{env}.txt")}
    dists: dict[str, dict] = {}
    jobs = []
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if not name or name in dists:
            continue  # the first on sys.path wins, as for imports
        base = Path(str(dist.locate_file("")))
        entry = {"name": dist.metadata["Name"], "version": dist.version, "location": str(base), "files": {}}
        dists[name] = entry
        if name in wanted and dist.files:
            for f in dist.files:
                jobs.append((entry, str(f), base / f))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        for (entry, rel, _), digest in zip(jobs, pool.map(lambda j: file_record_hash(j[2]), jobs), strict=True):
            entry["files"][rel] = digest
    body = {"python": sys.version.split()[0], "executable": sys.executable, "dists": dists}
    with gzip.open(out, "wt") as f:
        json.dump(body, f)
    print(f"inventory: {len(dists)} distributions, {len(jobs)} files hashed -> {out}")


def installed_versions() -> dict[str, str]:
    """name -> version of every distribution python3 sees (the first on sys.path, as for imports)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name and name not in out:
            out[name] = dist.version
    return out


def fill(lock: Path, stage: Path, env: str, installed: dict[str, str]) -> tuple[list[Path], list[str]]:
    """What the staged folder must add to `env` beyond the wheels envs.txt gives it: (wheels, missing pins).

    The stage list was made against an inventory of the machine; a machine that has changed since
    (a package gone, or another version) would leave the environment short, and its first import
    would fail. Each pin neither staged for `env` nor installed at its version here is taken from
    any staged wheel of that name and version whose sha256 is among the lock's hashes (another
    environment's); what none covers is returned as missing."""
    own = set()
    for line in (stage / "envs.txt").read_text().splitlines():
        wheel, envs = line.split()
        if env in envs.split(","):
            own.add(wheel_key(wheel))
    index = wheel_index(stage)
    borrowed: list[Path] = []
    missing: list[str] = []
    for name, (version, hashes) in sorted(read_lock(lock).items()):
        if (name, version) in own or installed.get(name) == version:
            continue
        wheel = index.get((name, version))
        if wheel is not None and sha256_hex(wheel) in hashes:
            borrowed.append(wheel)
        else:
            missing.append(f"{name}=={version} (this machine: {installed.get(name, 'none')})")
    return borrowed, missing


# --- here --------------------------------------------------------------------------------------------


def wheel_key(filename: str) -> tuple[str, str]:
    """(name, version) of a wheel, from its file name."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


def wheel_index(wheels: Path) -> dict[tuple[str, str], Path]:
    """(name, version) -> wheel file, from the wheel file names."""
    return {wheel_key(w.name): w for w in wheels.glob("*.whl")}


def sha256_hex(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_record(wheel: Path) -> dict[str, str]:
    """The wheel's RECORD as installed paths -> hash (`.data/purelib|platlib` moved to the root, as pip does)."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
        rows = csv.reader(io.StringIO(z.read(record).decode()))
        out = {}
        for row in rows:
            if not row or not row[1]:
                continue  # RECORD lists itself without a hash
            path = re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", row[0])
            out[path] = row[1]
        return out


def wheel_info(wheel: Path, cache: dict[str, dict]) -> dict:
    """The wheel's sha256 and RECORD, remembered in `cache` (a wheelhouse of several GB takes a while)."""
    key = f"{wheel.name}:{wheel.stat().st_size}"
    if key not in cache:
        cache[key] = {"sha256": sha256_hex(wheel), "record": wheel_record(wheel)}
    return cache[key]


def compare_one(pin: tuple[str, set[str]], name: str, wheel: Path | None, machine: dict | None,
                cache: dict[str, dict]) -> tuple[str, str]:
    """(how it is proven: identical | stage | missing-wheel, the detail for the table)."""
    version, hashes = pin
    if wheel is None:
        return "missing-wheel", f"no wheel of {name}=={version} in the wheelhouse"
    info = wheel_info(wheel, cache)
    if info["sha256"] not in hashes:
        return "missing-wheel", f"{wheel.name}: sha256 not among the lock's hashes"
    if machine is None:
        return "stage", "not on the machine"
    rows = info["record"]
    scripts = {p for p in rows if re.match(r"^[^/]+\.data/(scripts|data|headers)/", p)}
    on_disk = machine["files"]
    differ = sorted(p for p in rows if p not in scripts and on_disk.get(p) != rows[p])
    if not differ:
        note = f"{len(rows) - len(scripts)} files, each sha256 on disk = the wheel's RECORD"
        if machine["version"] != version:
            note += f" (installed as {machine['version']})"
        if scripts:
            note += f"; {len(scripts)} scripts rewritten by pip at install, not compared"
        return "identical", note
    shown = ", ".join(differ[:3]) + (f", … ({len(differ)} in all)" if len(differ) > 3 else "")
    return "stage", f"machine has {machine['version']}; {len(differ)} of {len(rows)} files differ: {shown}"


def compare(wheels: Path, inventory_path: Path, report: Path, stage_list: Path, staged_path: Path | None = None,
            envs: tuple[str, ...] = ENVS) -> int:
    """The parity table. With `staged_path` (what was copied over: `<wheel> <envs>` lines), a wheel that
    needed staging but was not copied is reported as a difference, not as staged."""
    with gzip.open(inventory_path, "rt") as f:
        inv = json.load(f)
    index = wheel_index(wheels)
    cache_path = wheels / "wheel-records.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    staged = None
    if staged_path is not None:
        staged = {(w, e) for line in staged_path.read_text().splitlines() for w, envs in [line.split()] for e in envs.split(",")}
    lines = ["| environment | package | locked | proven by | detail |", "|---|---|---|---|---|"]
    stage: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for env in envs:
        for name, pin in sorted(read_lock(LOCKS / f"{env}.txt").items()):
            wheel = index.get((name, pin[0]))
            how, detail = compare_one(pin, name, wheel, inv["dists"].get(name), cache)
            counts[how] = counts.get(how, 0) + 1
            if how == "stage" and wheel is not None:
                if staged is not None and (wheel.name, env) not in staged:
                    how = "not-staged"
                    counts["stage"] -= 1
                    counts[how] = counts.get(how, 0) + 1
                    detail = f"**absent**: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB) was not copied over; " + detail
                else:
                    stage.setdefault(wheel.name, set()).add(env)
                    detail = f"staged: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB, sha256 in the lock); " + detail
            label = {"identical": "identical to the machine's", "stage": "staged wheel", "missing-wheel": "**not proven**",
                     "not-staged": "**not installed**"}[how]
            lines.append(f"| {env} | {name} | {pin[0]} | {label} | {detail} |")
    cache_path.write_text(json.dumps(cache))
    staged_mib = sum((wheels / w).stat().st_size for w in stage) / 2**20
    summary = (f"{sum(counts.values())} pins: {counts.get('identical', 0)} identical to the machine's, "
               f"{counts.get('stage', 0)} staged ({len(stage)} wheels, {staged_mib:.0f} MiB), "
               f"{counts.get('not-staged', 0)} not installed, {counts.get('missing-wheel', 0)} not proven")
    report.write_text(f"Python on the machine: {inv['python']} ({inv['executable']})\n\n{summary}\n\n" + "\n".join(lines) + "\n")
    stage_list.write_text("".join(f"{w} {','.join(sorted(envs))}\n" for w, envs in sorted(stage.items())))
    print(summary)
    return 0 if not counts.get("missing-wheel") else 1


#: What the bench driver adds to tandem's environment (gpu_env.sh's `bench`), pinned as dev.txt pins it.
BENCH_DEPS = ROOT / "bench" / "gpu" / "gpu-deps.txt"


def lock_blocks(path: Path) -> dict[str, str]:
    """name -> the lock's whole entry for it (the pin and its hashes, comments left out)."""
    blocks: dict[str, str] = {}
    name = ""
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            name = normalize(m.group(1))
            blocks[name] = line + "\n"
        elif name and line.strip().startswith("--hash="):
            blocks[name] += line + "\n"
        elif not line.startswith(" "):
            name = ""
    return blocks


def requirements(envs: tuple[str, ...] = ENVS) -> dict[str, str]:
    """One requirements file a lock (the lock's pins with their hashes, no comments), and `bench`:
    the bench driver's pins (gpu-deps.txt) with dev.txt's hashes. One file each: two locks may pin
    one package at two versions, which one `pip download` would refuse as a conflict."""
    files = {env: "".join(lock_blocks(LOCKS / f"{env}.txt").values()) for env in envs}
    dev = lock_blocks(LOCKS / "dev.txt")
    bench = []
    for line in BENCH_DEPS.read_text().splitlines():
        if m := PIN.match(line):
            name, version = normalize(m.group(1)), m.group(2)
            pinned = PIN.match(dev.get(name, ""))
            if pinned is None or pinned.group(2) != version:
                raise SystemExit(f"lock_parity requirements: {line} is not pinned so in images/locks/dev.txt")
            bench.append(dev[name])
    files["bench"] = "".join(bench)
    return files


def plan(wheels: Path, parity: Path, small: int = 3 * 2**20) -> dict[str, set[str]]:
    """wheel file -> the environments to stage it for, from the last parity table: every pin it did
    not find identical on the machine, and every wheel smaller than `small` bytes (a machine that
    lost a small package since is covered); the bench driver's pins always."""
    labels: dict[tuple[str, str], str] = {}
    for line in parity.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and cells[1] in ENVS:
            labels[(cells[1], normalize(cells[2]))] = cells[4]
    index = wheel_index(wheels)
    stage: dict[str, set[str]] = {}
    missing = []
    for env in ENVS:
        for name, (version, _) in read_lock(LOCKS / f"{env}.txt").items():
            wheel = index.get((name, version))
            if wheel is None:
                missing.append(f"{env}: {name}=={version}")
            elif labels.get((env, name)) != "identical to the machine's" or wheel.stat().st_size < small:
                stage.setdefault(wheel.name, set()).add(env)
    for line in BENCH_DEPS.read_text().splitlines():
        if m := PIN.match(line):
            wheel = index.get((normalize(m.group(1)), m.group(2)))
            if wheel is None:
                missing.append(f"bench: {m.group(0)}")
            else:
                stage.setdefault(wheel.name, set()).add("bench")
    if missing:
        raise SystemExit(f"lock_parity plan: no wheel in {wheels} for {len(missing)} pin(s): {', '.join(missing[:10])}; "
                         "download them first (lock_parity.py requirements, then pip download)")
    return stage


def pack(wheels: Path, stage_list: Path, prefix: str, limit: int = LIMIT, first: frozenset[str] = frozenset()) -> None:
    """Pack the listed wheels (big ones split into parts) into prefix1, prefix2, ... of at most `limit` bytes.

    With `first`, the wheels any of those environments take fill the first folders and the rest
    follow, so a session that needs only them copies the first folders and stops
    (prefix0/groups.txt says where they end)."""
    leading: list[tuple[int, Path, int, str]] = []
    trailing: list[tuple[int, Path, int, str]] = []
    for line in stage_list.read_text().splitlines():
        name, envs = line.split()[0], set(line.split()[1].split(","))
        path = wheels / name
        size = path.stat().st_size
        group = leading if envs & first else trailing
        if size <= limit:
            group.append((size, path, 0, name))
        else:
            for i, off in enumerate(range(0, size, limit)):
                group.append((min(limit, size - off), path, off, f"{name}.part{i:02d}"))
    bins = first_fit(leading, limit)
    split = len(bins)
    bins += first_fit(trailing, limit)
    for old in ROOT.glob(f"{prefix}[0-9]*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    for i, (_, ps) in enumerate(bins, 1):
        d = ROOT / f"{prefix}{i}"
        d.mkdir()
        for size, src, off, name in ps:
            with open(src, "rb") as r, open(d / name, "wb") as w:
                r.seek(off)
                w.write(r.read(size))
        print(f"{d.name}: {sum(p[0] for p in ps) / 2**20:.1f} MiB, {len(ps)} files")
    (ROOT / f"{prefix}0").mkdir(exist_ok=True)
    (ROOT / f"{prefix}0" / "envs.txt").write_text(stage_list.read_text())
    groups = f"{','.join(sorted(first))}: {prefix}1-{prefix}{split}\n" if first and split else ""
    (ROOT / f"{prefix}0" / "groups.txt").write_text(groups + f"all: {prefix}1-{prefix}{len(bins)}\n")


def first_fit(pieces: list[tuple[int, Path, int, str]], limit: int) -> list[list]:
    """The pieces in bins of at most `limit` bytes, largest first: [[bytes, [piece, ...]], ...]."""
    bins: list[list] = []
    for piece in sorted(pieces, key=lambda p: p[0], reverse=True):
        for b in bins:
            if b[0] + piece[0] <= limit:
                b[0] += piece[0]
                b[1].append(piece)
                break
        else:
            bins.append([piece[0], [piece]])
    return bins


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inventory")
    a.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("compare")
    b.add_argument("--wheels", type=Path, required=True)
    b.add_argument("--inventory", type=Path, required=True)
    b.add_argument("--report", type=Path, required=True)
    b.add_argument("--stage-list", type=Path, required=True)
    b.add_argument("--staged", type=Path, default=None, help="what was copied over (.lstage0/envs.txt)")
    b.add_argument("--envs", default=",".join(ENVS), help="the locks to prove, comma-separated")
    d = sub.add_parser("fill", help="on the GPU machine: the staged wheels an environment lacks beyond envs.txt")
    d.add_argument("--env", choices=ENVS, required=True)
    d.add_argument("--stage", type=Path, required=True, help="the folder the staged wheels were copied to")
    r = sub.add_parser("requirements", help="each lock's pins and the bench driver's, with hashes, for pip download")
    r.add_argument("--out-dir", type=Path, required=True, help="<env>.txt for each, and bench.txt")
    r.add_argument("--envs", default=",".join(ENVS), help="the locks, comma-separated")
    q = sub.add_parser("plan", help="the stage list from the last parity table, without a new inventory")
    q.add_argument("--wheels", type=Path, required=True)
    q.add_argument("--parity", type=Path, required=True, help="a parity.md that compare wrote on the same kind of machine")
    q.add_argument("--stage-list", type=Path, required=True)
    q.add_argument("--small-mib", type=float, default=3.0, help="wheels below this are staged even where identical")
    c = sub.add_parser("pack")
    c.add_argument("--wheels", type=Path, required=True)
    c.add_argument("--stage-list", type=Path, required=True)
    c.add_argument("--prefix", default=".lstage")
    c.add_argument("--limit-mib", type=int, default=LIMIT // 2**20, help="size of a folder: one copy to the host")
    c.add_argument("--first", default="", help="environments whose wheels fill the first folders, comma-separated "
                                               "(sglang,trainer,tandem,bench: a session without vLLM stops earlier)")
    args = p.parse_args()
    if args.cmd == "inventory":
        inventory(args.out)
        return 0
    if args.cmd == "fill":
        borrowed, missing = fill(LOCKS / f"{args.env}.txt", args.stage, args.env, installed_versions())
        for wheel in borrowed:
            print(wheel)
            print(f"lock_parity fill: {args.env}: {wheel.name} from another environment's staged wheels "
                  "(this machine lacks its pin)", file=sys.stderr)
        if missing:
            print(f"lock_parity fill: {args.env}: {len(missing)} locked package(s) neither staged for it nor on this "
                  f"machine: {', '.join(missing)}. The machine changed since its inventory: run PART=env's "
                  "inventory, lock_parity.py compare and pack again, and stage the new folders.", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "requirements":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in requirements(tuple(args.envs.split(","))).items():
            (args.out_dir / f"{name}.txt").write_text(text)
        return 0
    if args.cmd == "plan":
        stage = plan(args.wheels, args.parity, int(args.small_mib * 2**20))
        args.stage_list.write_text("".join(f"{w} {','.join(sorted(e))}\n" for w, e in sorted(stage.items())))
        mib = sum((args.wheels / w).stat().st_size for w in stage) / 2**20
        print(f"{len(stage)} wheels to stage, {mib:.0f} MiB")
        return 0
    if args.cmd == "compare":
        envs = tuple(args.envs.split(","))
        unknown = sorted(set(envs) - set(ENVS))
        if unknown:
            p.error(f"--envs: {unknown} unknown; choose from {', '.join(ENVS)}")
        return compare(args.wheels, args.inventory, args.report, args.stage_list, args.staged, envs)
    first = frozenset(e for e in args.first.split(",") if e)
    known = {*ENVS, "bench"}  # bench: what the bench driver adds (gpu_env.sh)
    if first - known:
        p.error(f"--first: {sorted(first - known)} unknown; choose from {', '.join(sorted(known))}")
    pack(args.wheels, args.stage_list, args.prefix, args.limit_mib * 2**20, first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
