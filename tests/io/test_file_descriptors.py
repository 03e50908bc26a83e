"""A file that fails to open never closes a descriptor twice: the second close would hit
whatever another thread opened under the same number meanwhile (a manager's step file
beside ``fastckpt ls --verify``, for one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Run in a child: it lowers RLIMIT_NOFILE so that exactly one more descriptor can be
# opened, which makes File's second open (the O_DIRECT twin) fail with EMFILE every time.
_SCRIPT = textwrap.dedent(
    """
    import gc, os, resource, sys
    from fastckpt.io import files

    path = sys.argv[1]
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    probe = os.open(path, os.O_RDONLY)
    os.close(probe)  # the lowest free descriptor number: File's first open takes it
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe + 1, hard))
    error = None
    try:
        files.File(path)
    except OSError as exc:
        error = exc  # keeps the half-made File alive until after the next open
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert error is not None and error.errno == 24, error
    someone_elses = os.open(path, os.O_RDONLY)
    assert someone_elses == probe
    del error
    gc.collect()  # the half-made File is finalized here
    os.fstat(someone_elses)  # EBADF if the finalizer closed the number again
    print("intact")
    """
)


def test_a_failed_open_does_not_close_another_descriptor_later(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "f.bin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "intact", out.stderr[-2000:]


def test_the_direct_twin_is_the_file_opened_even_once_another_is_renamed_over_it(
    tmp_path, monkeypatch
):
    # A reader opening a checkpoint while another process saves a new one over it must read
    # header and data from one file (the torture's concurrent readers once got a header from
    # one save and data from the next).
    from fastckpt.io import files

    path, other = tmp_path / "ckpt.bin", tmp_path / "new.bin"
    path.write_bytes(b"a" * 8192)
    other.write_bytes(b"b" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.rename(other, path)  # the atomic replace, between the two opens
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        twin = files._open_twin(fd, str(path), flags)
        try:
            assert os.fstat(twin).st_ino == os.fstat(fd).st_ino
        finally:
            os.close(twin)
        real_open = os.open

        def no_proc(p, *args, **kwargs):
            if str(p).startswith("/proc/self/fd/"):
                raise FileNotFoundError(p)
            return real_open(p, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_proc)
        assert files._open_twin(fd, str(path), flags) == -1  # replaced: no twin at all
    finally:
        os.close(fd)
