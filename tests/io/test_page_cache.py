"""fastckpt.io.page_cache: what is resident, by cachestat and by mincore alike."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from fastckpt.io import page_cache
from fastckpt.io.files import require_regular_file


def test_tmpfs_files_are_resident():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/fastckpt-resident-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(b"z" * (1 << 20))
        fd = os.open(path, os.O_RDONLY)
        try:
            assert page_cache.resident_fraction(fd, 0, 1 << 20) == 1.0
            assert page_cache._by_mincore(fd, 0, 1 << 20) == 1.0
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def test_dropped_pages_are_seen_as_missing(tmp_path):
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.read(fd, 4 << 20)  # now resident
        assert page_cache.resident_fraction(fd, 0, 4 << 20) == 1.0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
        for measure in (page_cache._by_cachestat, page_cache._by_mincore):
            found = measure(fd, 0, 4 << 20)
            if found is not None:
                assert found < 0.5, measure.__name__
    finally:
        os.close(fd)


def test_empty_range_is_resident():
    fd = os.open("/proc/self/stat", os.O_RDONLY)
    try:
        assert page_cache.resident_fraction(fd, 0, 0) == 1.0
    finally:
        os.close(fd)


def test_non_regular_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    done = []

    def attempt():
        with pytest.raises(OSError) as info:
            require_regular_file(str(fifo))
        done.append(info.value)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert done, "checking a FIFO blocked"
    assert done[0].errno == errno.EINVAL and "named pipe" in str(done[0])
    assert done[0].filename == str(fifo)
    with pytest.raises(IsADirectoryError) as info:
        require_regular_file(str(tmp_path))
    assert info.value.filename == str(tmp_path)
