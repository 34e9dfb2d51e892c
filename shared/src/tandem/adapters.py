"""The adapter store: immutable, atomically published versions on the shared volume.

Layout under the store root::

    <run>/v000007/manifest.json     run, version, parent, step, job id, sha256 of every adapter file
    <run>/v000007/adapter/          what the engine loads (adapter_config.json + weights)
    <run>/v000007/trainer/          what the trainer resumes from (optimizer state, master weights)
    <run>/.tmp-v000007-<uuid>/      a version being written; never read
    <run>/.tmp-state-v000007-<uuid>/  trainer state being written; never read

A version becomes visible only by `rename` of a complete directory, so a crash of a process
while writing never leaves a partial version behind. `publish` fsyncs before that rename
unless told not to; the trainer renames first and calls `sync` after the announcement, off
the path to serving (docs/architecture.md, "Checksums and durability"): a power loss in between can
leave a visible version with torn files, which the checksums refuse wherever it is opened.
`adapter/` and the manifest never change once published; `trainer/` is attached once, later,
by its own rename of an fsynced directory (it carries no checksums: a crash leaves either all
of it or none). Every path that comes from Redis or a request is resolved inside the root;
anything outside it is refused.

`check` is the one place that decides whether an engine may open a version: the event's
path must be the version's `adapter/`, no component from the root down may be a symlink, the
manifest must name the version, and `adapter/` must hold exactly the files the manifest lists,
all regular files. It reads no file contents, so it runs before any engine sees the version;
`verify` adds the checksums, which detect torn or corrupt writes (they are not a signature:
whoever can write the store can rewrite the manifest too). New versions use xxh3-128, which
costs a few milliseconds per hundred megabytes; manifests from before name none and are sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, Field

from tandem.errors import AdapterNotVisible, AdapterRejected, VersionExists
from tandem.runs import adapter_name, check_run_name

MANIFEST = "manifest.json"
ADAPTER_DIR = "adapter"
TRAINER_DIR = "trainer"

#: The checksum of the files of a manifest; new versions get `CHECKSUM`.
Checksum = Literal["sha256", "xxh3_128"]
CHECKSUM: Checksum = "xxh3_128"
_READ_CHUNK = 8 << 20


class Manifest(BaseModel):
    """What a published version is, and the checksums that prove its files."""

    run: str
    version: int = Field(ge=1)
    parent: int = Field(ge=0)
    """Version the training started from (0 = the base model)."""
    step: int = Field(ge=0)
    """Client-side train step that produced it."""
    job_id: str
    """Train job that produced it; a retried job finds its version by this id."""
    job_digest: str | None = None
    """`tandem.jobs.groups_digest` of that job: the same id with other groups is refused, not
    answered with this version (manifests written before it have none)."""
    base_model: str
    lora_rank: int = Field(ge=1)
    created_at: float = Field(default_factory=time.time)
    files: dict[str, str] = Field(default_factory=dict)
    """Path relative to the version directory -> its checksum, hex."""
    checksum: Checksum = "sha256"
    """The algorithm of `files` (manifests written before it was named are sha256)."""
    metrics: dict[str, float] = Field(default_factory=dict)

    @property
    def adapter_name(self) -> str:
        return adapter_name(self.run, self.version)


def new_hasher(algorithm: Checksum) -> Any:
    """A streaming hasher (`update`, `hexdigest`) of `algorithm`."""
    return xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.sha256()


def file_checksum(path: Path, algorithm: Checksum = CHECKSUM) -> str:
    """The checksum of a file's bytes, hex."""
    h = new_hasher(algorithm)
    with path.open("rb", buffering=0) as f:
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            h.update(view[:n])
    return str(h.hexdigest())


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """A LoRA adapter's `adapter_config.json`, checked for what every reader of it relies on.

    It must be a readable JSON object whose rank `r` and every `rank_pattern` value are
    positive integers. The controller (through `AdapterStore.adapter_config`) and the engine
    both read adapter configs here. Raises AdapterRejected naming the file and what to do.
    """
    file = Path(directory) / "adapter_config.json"
    fix = "save the adapter with peft's save_pretrained"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterRejected(f"no adapter_config.json in {str(directory)!r}; {fix}") from None
    except (OSError, ValueError) as exc:
        raise AdapterRejected(f"{file} is unreadable ({exc}); {fix}") from exc
    if not isinstance(config, dict):
        raise AdapterRejected(f"{file} is not a JSON object (got {type(config).__name__}); {fix}")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise AdapterRejected(f"{file}: rank_pattern is not a mapping of module to rank ({pattern!r:.80}); {fix}")
    ranks = [config.get("r"), *pattern.values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise AdapterRejected(f"{file} has no valid LoRA rank 'r' ({str(ranks):.80}); ranks are integers >= 1")
    return config


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync(Path(dirpath, name))
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    """fsync a file, or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AdapterStore:
    """Publish, find and verify adapter versions under one root directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def resolve(self, path: str | Path) -> Path:
        """`path` (relative to the root, or absolute) if it lies inside the root; else refuse."""
        try:
            candidate = (self.root / path).resolve()
        except (OSError, ValueError) as exc:  # a NUL byte, a symlink loop, a name too long
            raise AdapterRejected(f"path {str(path)[:200]!r} cannot be resolved ({exc}); give a path "
                                  "inside the adapter store") from exc
        if candidate != self.root and not candidate.is_relative_to(self.root):
            raise AdapterRejected(
                f"path {str(path)!r} resolves to {candidate}, outside the adapter store "
                f"{self.root}; adapter paths must stay inside the store"
            )
        return candidate

    def run_dir(self, run: str) -> Path:
        try:
            check_run_name(run)
        except ValueError as exc:
            raise AdapterRejected(str(exc)) from exc
        return self.resolve(run)

    def version_dir(self, run: str, version: int) -> Path:
        return self.run_dir(run) / f"v{version:06d}"

    def adapter_dir(self, run: str, version: int) -> Path:
        return self.version_dir(run, version) / ADAPTER_DIR

    def versions(self, run: str) -> list[int]:
        """Published versions of a run on disk, oldest first."""
        d = self.run_dir(run)
        if not d.is_dir():
            return []
        found = [int(p.name[1:]) for p in d.iterdir() if p.name.startswith("v") and p.name[1:].isdigit()]
        return sorted(found)

    def confined(self, path: Path, what: str) -> Path:
        """`path` (absolute, under the root) if no component of it below the root is a symlink.

        A symlink that leaves the store is refused as outside it; one that stays inside is
        refused too, since a published version holds real files and directories only.
        """
        try:
            resolved = path.resolve()
        except (OSError, ValueError) as exc:
            raise AdapterRejected(f"{what} {path} cannot be resolved: {exc}") from exc
        if resolved == path:
            return path
        if resolved != self.root and not resolved.is_relative_to(self.root):
            raise AdapterRejected(
                f"{what} {path} resolves to {resolved}, outside the adapter store {self.root}; "
                "adapter files must be real files inside the store, never symlinks out of it"
            )
        raise AdapterRejected(
            f"{what} {path} is a symlink (to {resolved}); a published version holds real files and "
            "directories only"
        )

    def read_manifest(self, run: str, version: int) -> Manifest:
        path = self.confined(self.version_dir(run, version) / MANIFEST, f"{run} v{version}: manifest")
        try:
            return Manifest.model_validate_json(path.read_text())
        except FileNotFoundError as exc:
            raise AdapterNotVisible(f"{run} v{version}: no manifest at {path}") from exc
        except ValueError as exc:
            raise AdapterRejected(f"{run} v{version}: unreadable manifest at {path}: {exc}") from exc

    @contextmanager
    def staging(self, run: str, version: int) -> Iterator[Path]:
        """A private directory to write a version into; removed if the block raises."""
        tmp = self.run_dir(run) / f".tmp-v{version:06d}-{uuid.uuid4().hex[:8]}"
        (tmp / ADAPTER_DIR).mkdir(parents=True)
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @contextmanager
    def trainer_state(self, run: str, version: int) -> Iterator[Path]:
        """A private directory for the trainer's state of a published version; on success it
        is fsynced and renamed into place as `<version>/trainer/`, never seen half-written.

        The state (optimizer moments, often twice the adapter's size) is written after the
        version is announced, off the path to serving. A version without it is still whole:
        training resumed from it starts the optimizer fresh.
        """
        final = self.version_dir(run, version) / TRAINER_DIR
        if final.exists():
            raise VersionExists(f"{run} v{version} already has trainer state at {final}")
        tmp = self.run_dir(run) / f".tmp-state-v{version:06d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            yield tmp
            _fsync_tree(tmp)
            os.rename(tmp, final)
            _fsync(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def publish(
        self, staged: Path, manifest: Manifest, *, checksums: dict[str, str] | None = None, durable: bool = True
    ) -> Manifest:
        """Checksum and rename a staged directory into place as `manifest.version`.

        `checksums` (path relative to `staged` -> xxh3-128 hex) are those its writer computed
        from the bytes it wrote; every other file is read and hashed here. `durable`: fsync
        the files before the rename, so the version is on disk once visible; with False the
        caller must `sync` it, and until then a power loss may leave it torn (its checksums
        then refuse it). Raises VersionExists when that version is already published
        (versions are immutable).
        """
        final = self.version_dir(manifest.run, manifest.version)
        given = checksums or {}
        with ThreadPoolExecutor(max_workers=1) as pool:
            synced = pool.submit(_fsync_tree, staged) if durable else None  # to disk while hashed
            files = {}
            for p in sorted(staged.rglob("*")):
                if p.is_file() and p.name != MANIFEST:
                    rel = str(p.relative_to(staged))
                    files[rel] = given.get(rel) or file_checksum(p)
            if synced is not None:
                synced.result()
        manifest = manifest.model_copy(update={"files": files, "checksum": CHECKSUM, "created_at": time.time()})
        (staged / MANIFEST).write_text(manifest.model_dump_json(indent=2))
        if durable:
            _fsync(staged / MANIFEST)
            _fsync(staged)
        if final.exists():
            shutil.rmtree(staged, ignore_errors=True)
            raise VersionExists(f"{manifest.run} v{manifest.version} is already published at {final}")
        os.rename(staged, final)
        if durable:
            _fsync(final.parent)
        return manifest

    def sync(self, run: str, version: int) -> None:
        """fsync a published version's files and directories, and its entry in the run's
        directory: afterwards a power loss cannot tear it. Cheap when already on disk."""
        vdir = self.version_dir(run, version)
        _fsync_tree(vdir)
        _fsync(vdir.parent)

    def check(
        self, run: str, version: int, *, path: str | Path | None = None, only: str | None = None
    ) -> Manifest:
        """Everything about a version but its checksums; raise AdapterRejected naming what is wrong.

        `path` (from an event) must resolve to the version's adapter directory. The version
        directory, the manifest and every file it lists (under `only`, a subdirectory, when
        given) must be real and inside the store; `adapter/`, which an engine opens whole, must
        hold exactly the files the manifest lists. No file is read but the manifest, so this
        is cheap enough to run before every load.
        """
        if version < 1:
            raise AdapterRejected(f"{run} v{version}: versions start at 1 (0 is the base model)")
        vdir = self.version_dir(run, version)
        adapter = vdir / ADAPTER_DIR
        if path is not None:
            resolved = self.resolve(path)
            if resolved != adapter:
                raise AdapterRejected(
                    f"{run} v{version}: path {str(path)[:200]!r} resolves to {resolved}, not the "
                    f"version's adapter directory {adapter}"
                )
        self.confined(vdir, f"{run} v{version}: version directory")
        if not vdir.is_dir():
            raise AdapterNotVisible(f"{run} v{version}: no directory {vdir}")
        manifest = self.read_manifest(run, version)
        if manifest.run != run or manifest.version != version:
            raise AdapterRejected(
                f"{vdir}: manifest says {manifest.run} v{manifest.version}, expected {run} v{version}"
            )
        for rel in manifest.files:
            parts = PurePosixPath(rel).parts
            if PurePosixPath(rel).is_absolute() or ".." in parts or not parts:
                raise AdapterRejected(f"{run} v{version}: manifest path {rel[:200]!r} leaves {vdir} "
                                      "(absolute, empty or with '..')")
            if only is not None and parts[0] != only:
                continue
            file = self.confined(vdir / rel, f"{run} v{version}: file {rel}")
            if not file.is_file():
                raise AdapterNotVisible(f"{run} v{version}: file {rel} is missing")
        self.confined(adapter, f"{run} v{version}: adapter directory")
        for dirpath, dirnames, filenames in os.walk(adapter):
            for name in [*dirnames, *filenames]:
                entry = Path(dirpath, name)
                rel = str(entry.relative_to(vdir))
                self.confined(entry, f"{run} v{version}: {rel}")
                if name in filenames and rel not in manifest.files:
                    raise AdapterRejected(
                        f"{run} v{version}: {rel} is not in the manifest; a version's {ADAPTER_DIR}/ "
                        "holds exactly the files its manifest lists"
                    )
        config = adapter / "adapter_config.json"
        if f"{ADAPTER_DIR}/adapter_config.json" not in manifest.files or not config.is_file():
            raise AdapterNotVisible(f"{run} v{version}: adapter/adapter_config.json is missing")
        return manifest

    def plain(self, run: str, version: int, *, path: str | Path | None = None) -> bool:
        """Whether `check` can run without touching anything outside the store: `path` (from an
        event), as written and without `..`, names the version's adapter directory; the run's and
        version's directories and the manifest are no symlinks and lie on the root's device; and
        `adapter/` holds no symlink and no directory. Found without following a link or resolving
        a path. False where anything is missing or odd: `check` then says why."""
        try:
            check_run_name(run)
        except ValueError:
            return False
        vdir = self.root / run / f"v{version:06d}"
        adapter = vdir / ADAPTER_DIR
        if path is not None and (".." in PurePosixPath(path).parts or self.root / path != adapter):
            return False
        try:
            device = os.lstat(self.root).st_dev
            for part in (vdir.parent, vdir, adapter, vdir / MANIFEST):
                st = os.lstat(part)
                if stat.S_ISLNK(st.st_mode) or st.st_dev != device:
                    return False
            with os.scandir(adapter) as entries:
                return not any(entry.is_symlink() or entry.is_dir(follow_symlinks=False) for entry in entries)
        except (OSError, ValueError):
            return False

    def verify(self, run: str, version: int, *, only: str | None = None) -> Manifest:
        """`check`, then the checksums of every file (under `only`) against the manifest.

        `only` limits the checks to the files under one subdirectory (the inference side
        checks `adapter/`, which is what it loads). A file that cannot be read is a rejection
        too, never another kind of error.
        """
        manifest = self.check(run, version, only=only)
        vdir = self.version_dir(run, version)
        for rel, digest in manifest.files.items():
            if only is not None and PurePosixPath(rel).parts[0] != only:
                continue
            try:
                actual = file_checksum(vdir / rel, manifest.checksum)
            except OSError as exc:
                raise AdapterRejected(f"{run} v{version}: cannot read {rel}: {exc}") from exc
            if actual != digest:
                raise AdapterRejected(f"{run} v{version}: checksum of {rel} does not match the manifest")
        return manifest

    def adapter_config(self, run: str, version: int) -> dict[str, Any]:
        """The version's adapter config (see `read_adapter_config`); raises AdapterRejected."""
        return read_adapter_config(self.adapter_dir(run, version))

    def remove_stale_staging(self, run: str) -> int:
        """Delete leftovers of writes that crashed; returns how many were removed."""
        d = self.run_dir(run)
        if not d.is_dir():
            return 0
        stale = [p for p in d.iterdir() if p.name.startswith(".tmp-")]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return len(stale)
