"""A file that fails to open never closes a descriptor twice: the second close would hit
whatever another thread opened under the same number meanwhile (a manager's step file
beside ``fastckpt ls --verify``, for one)."""

from __future__ import annotations

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
