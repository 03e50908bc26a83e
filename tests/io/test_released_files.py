"""A save over a large file frees the old file's blocks on a background thread: the old file
is gone once released, never held by a forked child, and links are never followed."""

from __future__ import annotations

import os

import torch

import fastckpt
from fastckpt.io import released_files


def _open_inodes() -> set[tuple[int, int]]:
    """(device, inode) of every file this process holds open."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        found.add((st.st_dev, st.st_ino))
    return found


def _big_state() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(released_files.RELEASE_LATER_BYTES // 4 + 1024)}


def test_a_save_over_a_large_file_releases_the_old_one(tmp_path):
    path = tmp_path / "x.safetensors"
    fastckpt.save(_big_state(), path)
    old = os.stat(path)
    fastckpt.save({"w": torch.zeros(3)}, path)
    released_files.wait()
    assert (old.st_dev, old.st_ino) not in _open_inodes()  # its space went back
    assert fastckpt.load(path)["w"].tolist() == [0.0, 0.0, 0.0]


def test_only_a_regular_file_with_one_link_is_held(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(released_files.RELEASE_LATER_BYTES)
    link = tmp_path / "link.bin"
    os.symlink(big, link)
    assert released_files.hold_replaced(str(link)) == -1  # a link is never followed
    os.link(big, tmp_path / "second-name.bin")
    assert released_files.hold_replaced(str(big)) == -1  # a rename frees nothing here
    assert released_files.hold_replaced(str(tmp_path / "missing")) == -1
    os.mkfifo(tmp_path / "fifo")
    assert released_files.hold_replaced(str(tmp_path / "fifo")) == -1


def test_a_forked_child_holds_none_of_the_parents_descriptors(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(released_files.RELEASE_LATER_BYTES)
    fd = released_files.hold_replaced(str(big))
    assert fd >= 0
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: is the descriptor still open here?
            try:
                os.fstat(fd)
                os.write(write_end, b"open")
            except OSError:
                os.write(write_end, b"closed")
            os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        assert os.read(read_end, 16) == b"closed"
        os.close(read_end)
    finally:
        released_files.release_later(fd)
        released_files.wait()
