"""Blanks: unnamed files of zeros, written between versions, that the next version's weights are
written over.

A version's weights go into a new file, and a new file's pages are allocated while the bytes
are written: page by page the kernel finds memory (reclaiming it when the page cache is full),
and a filesystem like ext4 reserves blocks. Writing over pages that already exist is a copy
alone. On a 2-core machine (`bench/gpu/gpu_write.py`, docs/benchmarks.md) an 8B rank-16
adapter (84 MB) took 14.8 ms over a blank against 23.9 into a new file on ext4 whose pages had
just been freed, and against 211 ms with the last 20 files kept, as a store keeps versions;
on tmpfs 22.3 against 37.1. On a GPU host, where one thread copies only about 3 GB/s, the gain is
smaller: in the suite at 8B the write went from 38.7 to 29.4 ms p50 (2 x H200); at 0.5B there
was none.

So after each publish the trainer writes a blank off the path, in a thread of its own while the
next step trains: a file opened with `O_TMPFILE` in the store, with no name, and as many zero
bytes as the version it follows. The next version links it into its staging directory as
`adapter_model.safetensors` and writes its bytes over it (`adapter_files.write_safetensors`).
A blank has no name until then: a trainer that dies leaves nothing behind, and no reader of the
store ever sees one. Where the filesystem has no `O_TMPFILE` (or the blank is on another
filesystem than the version), versions are written into new files as before.

Durability is unchanged: the version's files are fsynced after its announcement
(publisher.py), and until then a power loss may leave zeros where the weights were to be,
which the checksums refuse as they refuse any torn file.
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: The zeros written at a time.
_CHUNK = 8 << 20
#: Failures that may pass (a full disk, too many open files): the next blank is tried again.
#: Any other (no O_TMPFILE on the filesystem: EOPNOTSUPP, EISDIR; no permission; no /proc; the
#: store on two filesystems: EXDEV) would recur, so blanks are switched off.
_PASSING = {errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN}


@dataclass
class Blank:
    """An open, unnamed file of `size` zero bytes."""

    fd: int
    size: int
    used: bool = False
    """Whether a version's file was written over it (`claim` succeeded)."""
    refused: bool = False
    """Whether it could not be linked where the version's file goes, for a reason that would recur."""

    def claim(self, path: Path) -> int | None:
        """Give the blank the name `path` (a new file on the blank's filesystem) and return its
        descriptor, at offset 0, for the caller to write over and close; None, with the blank
        closed, if it cannot be linked there (the caller then writes a new file)."""
        try:
            parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:  # linkat(..., AT_SYMLINK_FOLLOW): Python asks for it only with a directory descriptor
                os.link(f"/proc/self/fd/{self.fd}", path.name, dst_dir_fd=parent, follow_symlinks=True)
            finally:
                os.close(parent)
        except OSError as exc:
            log.info("blank.unused path=%s: %s; the version is written into a new file", path, exc)
            self.refused = exc.errno not in _PASSING
            self.close()
            return None
        os.lseek(self.fd, 0, os.SEEK_SET)
        fd, self.fd, self.used = self.fd, -1, True
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_blank(directory: Path, size: int) -> Blank:
    """An unnamed file of `size` zero bytes on `directory`'s filesystem. Raises OSError."""
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o644)
    try:
        zeros = memoryview(bytes(min(size, _CHUNK)))
        left = size
        while left:
            left -= os.write(fd, zeros[:min(left, len(zeros))])
    except BaseException:
        os.close(fd)
        raise
    return Blank(fd, size)


class Blanks:
    """The trainer's one blank: written in the background after a publish, taken by the next.

    `take` never waits: a blank still being written is left for the version after (and that
    version is written into a new file, as without blanks)."""

    def __init__(self, directory: Path, *, enabled: bool = True) -> None:
        self.directory = directory
        self.enabled = enabled and hasattr(os, "O_TMPFILE")
        """Off (`backend.blank_adapter_file`, a system or filesystem without `O_TMPFILE`, a blank
        that could not be linked): `take` is always None."""
        self.taken = 0
        """Versions written over a blank so far."""
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future[Blank] | None = None

    def take(self) -> Blank | None:
        """The blank written since the last publish, if it is ready; None otherwise."""
        future = self._next
        if future is None or not future.done():
            return None
        self._next = None
        try:
            blank = future.result()
        except Exception as exc:  # noqa: BLE001 - a blank is an optimisation: never a failed publish
            self._failed(exc)
            return None
        self.taken += 1
        return blank

    def prepare(self, size: int) -> None:
        """Start writing a blank of `size` bytes for the next version, unless one is on its way."""
        if not self.enabled or self._next is not None or size <= 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blank")
        self._next = self._pool.submit(write_blank, self.directory, size)

    def give_back(self, blank: Blank) -> None:
        """Close a blank that `take` gave; one that could not be linked for a reason that would
        recur (no `/proc`, the store on two filesystems) switches blanks off."""
        blank.close()
        if blank.refused and self.enabled:
            self.enabled = False
            log.info("blank.off directory=%s: a blank could not be linked into a version; versions are "
                     "written into new files", self.directory)

    def settle(self) -> None:
        """Wait until the blank on its way (if any) is written or has failed."""
        if self._next is not None:
            try:
                self._next.result()
            except Exception as exc:  # noqa: BLE001 - as in take
                self._next = None
                self._failed(exc)

    def close(self) -> None:
        """Wait for the blank on its way and close it; `prepare` starts anew afterwards."""
        self.settle()
        if self._next is not None:
            self._next.result().close()
            self._next = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _failed(self, exc: Exception) -> None:
        if not isinstance(exc, OSError) or exc.errno not in _PASSING:
            self.enabled = False
            log.info("blank.off directory=%s: %s; versions are written into new files", self.directory, exc)
        else:
            log.warning("blank.failed directory=%s: %s; the next version is written into a new file",
                        self.directory, exc)
