"""The filesystem a path lies on, read from /proc/self/mountinfo (Linux): whether a call that
touches it answers from a local device or memory, or may wait on a network."""

from __future__ import annotations

import os
import re
from pathlib import Path

#: Filesystems on a local device or in memory: their metadata calls answer in microseconds.
#: Anything else (NFS, SMB, FUSE mounts, cluster filesystems) may wait on a network, or hang.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "zfs", "tmpfs", "ramfs",
                               "overlay"})

MOUNTINFO = Path("/proc/self/mountinfo")


def filesystem_type(path: Path, mountinfo: Path = MOUNTINFO) -> str | None:
    """The type of the filesystem `path` lies on: of the mounts whose mount point is a prefix of
    the resolved path, those of the path's own device (`st_dev`) where any is, and of them the
    last with the longest mount point (a later mount hides an earlier one). None where the mount
    table cannot be read (not Linux) or names no mount above it."""
    try:
        lines = os.fsdecode(mountinfo.read_bytes()).splitlines()
    except (OSError, ValueError):
        return None
    target = path.resolve()
    device = _device(target)
    above: list[tuple[bool, int, str]] = []  # (the path's device, depth, type), in the table's order
    for line in lines:
        # id parent major:minor root mount-point options [optional fields ...] - type source options
        fields = line.split(" ")
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        point = Path(_unescaped(fields[4]))
        if len(fields) > sep + 1 and target.is_relative_to(point):
            above.append((fields[2] == device, len(point.parts), fields[sep + 1]))
    if not above:
        return None
    ours = [m for m in above if m[0]] or above
    deepest = max(depth for _, depth, _ in ours)
    return [kind for _, depth, kind in ours if depth == deepest][-1]


def is_local(path: Path, mountinfo: Path = MOUNTINFO) -> bool:
    """Whether `path` lies on a local filesystem (LOCAL_FILESYSTEMS); False where it is unknown."""
    return filesystem_type(path, mountinfo) in LOCAL_FILESYSTEMS


def _device(path: Path) -> str | None:
    """`major:minor` of the device of `path`, or of its nearest parent that exists."""
    for candidate in (path, *path.parents):
        try:
            st_dev = os.stat(candidate).st_dev
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:  # a mount that answers with an error (a dead FUSE mount, a stale NFS handle)
            return None
        return f"{os.major(st_dev)}:{os.minor(st_dev)}"
    return None


def _unescaped(field: str) -> str:
    """A mount point as the kernel writes it, its space, tab, newline and backslash in octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
