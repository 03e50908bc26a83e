"""The mount table: which file system holds a path, read from ``/proc/self/mountinfo``.

Stdlib only, and importing nothing of fastckpt, so that every layer can ask it (the tuned
configuration is keyed by file system in :mod:`fastckpt.config`, the lowest layer but one).

A line of ``mountinfo`` (see proc(5)) is::

    36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
    (1)(2) (3)  (4)   (5)    (6)        (7)    (8) (9)   (10)       (11)

Fields (7) are optional (zero or more) and end at the lone ``-`` (8); the kernel writes a
space, tab, newline or backslash in a path as an octal escape (``\\040`` for a space).

Example:
    >>> line = r"36 35 98:0 / /mnt/my\\040disk rw,noatime shared:1 master:2 - ext4 /dev/sda1 rw"
    >>> parse_mountinfo(line)
    [Mount(mount_point='/mnt/my disk', fs_type='ext4', source='/dev/sda1')]
    >>> mount_of("/proc/self").fs_type
    'proc'
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["MOUNTINFO", "UNKNOWN", "Mount", "mount_of", "parse_mountinfo", "read_mounts"]

#: Where the kernel lists this process's mounts.
MOUNTINFO = "/proc/self/mountinfo"

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
# Fields before the optional ones: id, parent id, major:minor, root, mount point, options.
_FIXED_FIELDS = 6


class Mount(NamedTuple):
    """One mounted file system: where it is mounted, its type and its source (device)."""

    mount_point: str
    fs_type: str
    source: str


#: What :func:`mount_of` answers where the mount table cannot be read.
UNKNOWN = Mount("/", "unknown", "unknown")


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Every mount listed in ``text`` (the contents of a ``mountinfo`` file), in order.

    Lines that do not have the shape of proc(5) are skipped, not guessed at.

    Example:
        >>> text = '''22 1 8:1 / / rw - ext4 /dev/sda1 rw
        ... 23 22 0:5 / /dev/shm rw,nosuid - tmpfs tmpfs rw
        ... garbage'''
        >>> [(m.mount_point, m.fs_type) for m in parse_mountinfo(text)]
        [('/', 'ext4'), ('/dev/shm', 'tmpfs')]
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            separator = fields.index("-", _FIXED_FIELDS)
        except ValueError:
            continue
        if len(fields) < separator + 3:
            continue
        fs_type, source = fields[separator + 1], fields[separator + 2]
        mounts.append(Mount(_unescape(fields[4]), _unescape(fs_type), _unescape(source)))
    return mounts


def read_mounts(path: str | os.PathLike[str] = MOUNTINFO) -> list[Mount]:
    """This process's mounts (:func:`parse_mountinfo` of ``path``); empty where unreadable.

    Example:
        >>> any(m.mount_point == "/" for m in read_mounts())
        True
        >>> read_mounts("/no/such/mountinfo")
        []
    """
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


def mount_of(path: str | os.PathLike[str], mounts: Sequence[Mount] | None = None) -> Mount:
    """The mount holding ``path`` (which need not exist yet: its nearest existing parent
    decides), after symbolic links are resolved; :data:`UNKNOWN` where none is listed.

    Of nested mounts the innermost wins; of mounts stacked on one point, the last listed
    (the one on top). ``mounts`` defaults to :func:`read_mounts`.

    Example:
        >>> table = parse_mountinfo('''1 0 8:1 / / rw - ext4 /dev/sda1 rw
        ... 2 1 0:5 / /proc rw - proc proc rw''')
        >>> mount_of("/proc/self/no-such-file", table).fs_type
        'proc'
        >>> mount_of("/processes-no-such-dir", table).fs_type
        'ext4'
    """
    p = Path(os.path.abspath(os.fspath(path)))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, best_len = UNKNOWN, -1
    for mount in read_mounts() if mounts is None else mounts:
        point = mount.mount_point
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = mount, len(point)
    return best
