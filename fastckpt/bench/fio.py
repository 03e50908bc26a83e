"""fio's figures for a directory: the device's own sequential write and read ceilings.

Example:
    >>> fio_path() is None or fio_path().endswith("fio")
    True
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from fastckpt.bench.caches import drop_page_cache

__all__ = ["FIO_LOCKED", "fio_path", "fio_round", "fio_sequential", "fio_version"]


def fio_path() -> str | None:
    return shutil.which("fio")


def fio_version() -> str | None:
    path = fio_path()
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


#: fio options for page-locked, registered buffers: the best fio does on a virtual machine,
#: where pinning ordinary pages for every direct transfer is slow (fastckpt's are locked).
FIO_LOCKED = ("--thread", "--lockmem=256M", "--fixedbufs")


def fio_sequential(
    rw: str,
    filename: str,
    nbytes: int,
    *,
    bs: str = "1M",
    iodepth: int = 32,
    ioengine: str = "io_uring",
    extra: Sequence[str] = (),
    timeout: float = 600,
) -> dict[str, Any]:
    """One sequential fio job (``rw`` = "write" or "read") with O_DIRECT; fio's own figures.

    Writes end with ``end_fsync=1``. Returns seconds (fio's job runtime), bytes, GB/s and CPU
    seconds (fio's usr+sys share of its runtime), or ``{"error": ...}``.
    """
    path = fio_path()
    if path is None:
        return {"error": "fio not installed"}
    cmd = [
        path,
        f"--name=seq{rw}",
        f"--filename={filename}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--iodepth={iodepth}",
        "--direct=1",
        f"--ioengine={ioengine}",
        f"--size={nbytes}",
        "--numjobs=1",
        "--output-format=json",
        *extra,
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"fio timed out after {timeout:.0f} s"}
    try:
        job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
        side = job[rw]
        seconds, moved = side["runtime"] / 1000.0, side["io_bytes"]
    except (ValueError, KeyError, IndexError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"fio failed (status {proc.returncode}): " + " | ".join(tail)}
    if job.get("error") or not seconds:
        return {"error": f"fio job error {job.get('error')}"}
    return {
        "seconds": seconds,
        "bytes": moved,
        "gbps": moved / seconds / 1e9,
        "cpu_seconds": (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * seconds,
        "command": " ".join(cmd),
    }


def fio_round(directory: str, nbytes: int, timeout: float = 600) -> dict[str, dict[str, Any]]:
    """fio's sequential write then read (page cache dropped before each) of ``nbytes`` in a
    scratch file of ``directory``, 4 MiB blocks, locked buffers: the device's ceilings.
    Returns ``{"write": ..., "read": ...}`` as :func:`fio_sequential` does."""
    path = os.path.join(directory, "fio.dat")
    out = {}
    try:
        for kind in ("write", "read"):  # the read needs the written file
            drop_page_cache([path])
            out[kind] = fio_sequential(
                kind, path, nbytes, bs="4M", extra=FIO_LOCKED, timeout=timeout
            )
    finally:
        if os.path.exists(path):
            os.remove(path)
    return out
