"""fastckpt.mounts: the one parser of /proc/self/mountinfo, on sample text and on this machine."""

from __future__ import annotations

import pytest

from fastckpt import config
from fastckpt.mounts import UNKNOWN, Mount, mount_of, parse_mountinfo, read_mounts

# proc(5)'s example line, then lines with no optional field, several optional fields, and
# paths the kernel escaped: a space (\040), a tab (\011), a backslash (\134).
SAMPLE = r"""36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
23 22 0:5 / /dev/shm rw,nosuid,nodev shared:2 master:7 propagate_from:3 unbindable - tmpfs tmpfs rw
24 22 8:17 / /mnt/my\040data rw shared:9 - xfs /dev/sdb1 rw,attr2
25 22 8:18 / /mnt/tab\011and\134slash rw - btrfs /dev/my\040disk rw
26 22 0:44 / /weird - name rw - fuse.sshfs user@host:/ rw
""".replace("/weird - name", r"/weird\040-\040name")


def test_parse_sample_with_optional_fields_and_escapes():
    assert parse_mountinfo(SAMPLE) == [
        Mount("/mnt2", "ext3", "/dev/root"),
        Mount("/", "ext4", "/dev/sda1"),
        Mount("/dev/shm", "tmpfs", "tmpfs"),
        Mount("/mnt/my data", "xfs", "/dev/sdb1"),
        Mount("/mnt/tab\tand\\slash", "btrfs", "/dev/my disk"),
        Mount("/weird - name", "fuse.sshfs", "user@host:/"),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "garbage",
        "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 ext3 /dev/root rw",  # no separator
        "36 35 98:0 /mnt1 /mnt2 rw - ext3",  # no source after the type
        "36 35 - /mnt1 /mnt2 rw ext3 /dev/root rw",  # a dash among the fixed fields
    ],
)
def test_malformed_lines_are_skipped(line):
    assert parse_mountinfo(line + "\n22 1 8:1 / / rw - ext4 /dev/sda1 rw") == [
        Mount("/", "ext4", "/dev/sda1")
    ]


def test_mount_of_takes_the_innermost_and_the_topmost(tmp_path):
    inner = tmp_path / "data"
    (inner / "sub").mkdir(parents=True)
    table = [
        Mount("/", "ext4", "/dev/sda1"),
        Mount(str(inner), "xfs", "/dev/sdb1"),
        Mount(str(inner), "tmpfs", "tmpfs"),  # mounted over the xfs one
        Mount(str(tmp_path / "dat"), "nfs", "server:/"),  # a prefix of the name, not a parent
    ]
    assert mount_of(inner / "sub" / "not-yet.safetensors", table).fs_type == "tmpfs"
    assert mount_of(tmp_path / "dat", table).fs_type == "ext4"  # does not exist: / holds it
    assert mount_of(tmp_path, []) == UNKNOWN


def test_mount_of_follows_symbolic_links(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    table = [Mount("/", "ext4", "/dev/sda1"), Mount(str(target), "xfs", "/dev/sdb1")]
    assert mount_of(tmp_path / "link" / "file", table).fs_type == "xfs"


def test_this_machine(tmp_path):
    mounts = read_mounts()
    assert any(m.mount_point == "/" for m in mounts)
    assert mount_of("/proc/self").fs_type == "proc"
    assert read_mounts(tmp_path / "missing") == []


@pytest.mark.parametrize("where", ["tmp", "/dev/shm", "/proc/self", "/no/such/dir/file"])
def test_config_filesystem_key_names_the_same_mount(tmp_path, where):
    """config's tuned-file key describes the mount fastckpt.mounts finds (one parser's view)."""
    path = tmp_path if where == "tmp" else where
    mount = mount_of(path)
    assert config.filesystem_key(path) == f"{mount.fs_type}:{mount.source}:{mount.mount_point}"
