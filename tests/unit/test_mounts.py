"""Which filesystem a path lies on, from a mount table in the kernel's format."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.mounts import filesystem_type, is_local

# id parent major:minor root mount-point options [optional fields] - type source options (the
# devices are made up: no real path here lies on them, so the longest mount point decides)
MOUNTINFO = """\
22 1 908:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 900:40 / /tandem-mounts-test/shared rw,relatime shared:7 - nfs4 filer:/export rw,vers=4.2
31 30 908:2 / /tandem-mounts-test/shared/scratch rw,relatime - xfs /dev/sdb1 rw
32 22 900:41 / /tandem-mounts-test/my\\040store rw,nosuid - fuse.sshfs host:/data rw
33 22 900:42 / /tandem-mounts-test/over rw - tmpfs tmpfs rw
34 22 900:43 / /tandem-mounts-test/over rw master:3 - nfs filer:/other rw
"""


@pytest.fixture
def mountinfo(tmp_path: Path) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return path


@pytest.mark.parametrize(("path", "kind", "local"), [
    ("/tandem-mounts-test/elsewhere/store", "ext4", True),  # only the root above it
    ("/tandem-mounts-test/shared/store", "nfs4", False),  # the longest mount point above it
    ("/tandem-mounts-test/shared/scratch/store", "xfs", True),  # a local mount inside a network one
    ("/tandem-mounts-test/shared-not/store", "ext4", True),  # a prefix of the name is not a parent
    ("/tandem-mounts-test/my store/adapters", "fuse.sshfs", False),  # the kernel's octal escapes read back
    ("/tandem-mounts-test/over/store", "nfs", False),  # mounted over: the later mount is the one seen
])
def test_the_longest_mount_point_above_the_path_names_its_filesystem(
    mountinfo: Path, path: str, kind: str, local: bool
) -> None:
    assert filesystem_type(Path(path), mountinfo) == kind
    assert is_local(Path(path), mountinfo) is local


def test_a_mount_of_the_paths_own_device_wins_over_a_deeper_one_it_does_not_lie_on(tmp_path: Path) -> None:
    """A mount point deeper than the path's real mount (hidden since by another mount, say) is
    passed over when the path's own device (`st_dev`) has a mount above it."""
    store = tmp_path / "deep" / "store"
    store.mkdir(parents=True)
    dev = store.stat().st_dev
    table = tmp_path / "mountinfo"
    table.write_text(f"22 1 {os.major(dev)}:{os.minor(dev)} / / rw - ext4 /dev/sda1 rw\n"
                     f"40 22 901:7 / {tmp_path / 'deep'} rw - nfs filer:/x rw\n")
    assert filesystem_type(store, table) == "ext4"


def test_an_unreadable_mount_table_is_unknown_and_not_local(tmp_path: Path) -> None:
    missing = tmp_path / "no-mountinfo"
    assert filesystem_type(Path("/"), missing) is None
    assert not is_local(Path("/"), missing)


def test_this_machines_root_is_found() -> None:
    if not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /proc/self/mountinfo: not Linux")
    assert filesystem_type(Path("/")) is not None
