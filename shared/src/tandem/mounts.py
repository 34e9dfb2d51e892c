"""The filesystem a path lies on, read from /proc/self/mountinfo (Linux): whether a call that
touches it answers from a local device or memory, or may wait on a network."""

from __future__ import annotations

import re
from pathlib import Path

#: Filesystems on a local device or in memory: their metadata calls answer in microseconds.
#: Anything else (NFS, SMB, FUSE mounts, cluster filesystems) may wait on a network, or hang.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "f2fs", "zfs", "tmpfs", "ramfs",
                               "overlay"})

MOUNTINFO = Path("/proc/self/mountinfo")


def filesystem_type(path: Path, mountinfo: Path = MOUNTINFO) -> str | None:
    """The type of the filesystem `path` lies on: that of the last mount whose mount point is
    the longest prefix of the resolved path. None where the mount table cannot be read (not
    Linux) or names no mount above it."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = path.resolve()
    depth, kind = -1, None
    for line in lines:
        # id parent major:minor root mount-point options [optional fields ...] - type source options
        fields = line.split(" ")
        if "-" not in fields[5:]:
            continue
        point = Path(_unescaped(fields[4]))
        sep = fields.index("-", 5)
        if len(fields) > sep + 1 and target.is_relative_to(point) and len(point.parts) >= depth:
            depth, kind = len(point.parts), fields[sep + 1]
    return kind


def is_local(path: Path, mountinfo: Path = MOUNTINFO) -> bool:
    """Whether `path` lies on a local filesystem (LOCAL_FILESYSTEMS); False where it is unknown."""
    return filesystem_type(path, mountinfo) in LOCAL_FILESYSTEMS


def _unescaped(field: str) -> str:
    """A mount point as the kernel writes it, its space, tab, newline and backslash in octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
