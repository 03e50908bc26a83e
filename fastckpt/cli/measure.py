"""Measuring tools shared by ``fastckpt bench`` and the scripts in ``benchmarks/``.

One place for what every benchmark needs: file systems and free space, cold and hot page
caches, durability, a timed section's wall and CPU seconds and peak RSS, the threads a
section keeps busy, measurements in fresh child processes, medians, fio's figures, the
parallel-``preadv`` ceiling of a file, byte checks of loaded tensors, and Markdown tables.

Nothing here imports torch at module level, so ``fastckpt --help`` and a benchmark's
driver process stay light; functions that need torch import it when called.

Example:
    >>> with Measure() as m:
    ...     _ = bytearray(8 << 20)
    >>> m.seconds >= 0 and m.cpu_seconds >= 0
    True
    >>> median([3.0, None, 1.0])
    2.0
    >>> rotate(["a", "b", "c"], 1)
    ['b', 'c', 'a']
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

from fastckpt.cli._common import PageCache, format_bytes, fsync_path, gbps, median
from fastckpt.config import parse_size

__all__ = [
    "GiB",
    "KiB",
    "MEMORY_FILESYSTEMS",
    "MiB",
    "Measure",
    "PageCache",
    "Results",
    "ThreadSampler",
    "available_memory",
    "child_main",
    "drop_page_cache",
    "file_crc32",
    "filesystem_of",
    "fio_path",
    "fio_round",
    "fio_sequential",
    "fio_version",
    "fmt",
    "format_bytes",
    "free_bytes",
    "fsync_path",
    "gbps",
    "log",
    "machine",
    "make_durable",
    "markdown_table",
    "median",
    "parse_size",
    "preadv_file",
    "rate_of",
    "report",
    "require_directory",
    "rotate",
    "run_child",
    "summarize",
    "tensor_crc32s",
    "touch",
    "version_of",
    "warm_page_cache",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = mmap.PAGESIZE

#: Prefix of the one stdout line a child process reports its result on.
RESULT_MARK = "@@BENCH-RESULT "

# ------------------------------------------------------------------------- file systems

#: File systems that keep files in memory (no device behind them).
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


def filesystem_of(path: str | os.PathLike[str]) -> tuple[str, str, str]:
    """(type, source, mount point) of the file system holding ``path`` (which may not exist).

    Example:
        >>> filesystem_of("/proc/self")[0]
        'proc'
    """
    p = Path(os.path.abspath(os.fspath(path)))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, best_len = ("unknown", "unknown", "/"), -1
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best_len:
            best, best_len = (tail[0], tail[1], mount), len(mount)
    return best


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system holding ``path``."""
    return shutil.disk_usage(path).free


def available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- caches, durability

_page_cache: PageCache | None = None


def drop_page_cache(files: Sequence[str | os.PathLike[str]] = ()) -> str:
    """Makes the next reads of ``files`` come from the device; returns how.

    As root the whole cache is dropped ("drop_caches"); otherwise each file's clean pages
    are evicted with ``posix_fadvise(DONTNEED)`` ("fadvise"). See :class:`PageCache`.
    """
    global _page_cache
    if _page_cache is None:
        _page_cache = PageCache()
    _page_cache.drop(files)
    return "drop_caches" if _page_cache.can_drop else "fadvise"


def warm_page_cache(files: Iterable[str | os.PathLike[str]], chunk: int = 8 * MiB) -> int:
    """Reads every byte of ``files`` once, so the next reads find them in the page cache.

    The reads go through a small reused buffer, so the caller's RSS does not grow.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"x" * 10000); f.flush()
        ...     warm_page_cache([f.name])
        10000
    """
    total = 0
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def make_durable(path: str | os.PathLike[str]) -> None:
    """fsync of the file and of its directory (so its name survives a crash too)."""
    fsync_path(path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------- measuring


def current_rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE


def peak_rss() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``), so the peak
    describes one timed section; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread (native I/O threads too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Measure:
    """Times a section: wall seconds, CPU seconds (all threads), peak RSS above the entry RSS.

    Example:
        >>> with Measure() as m:
        ...     _ = bytearray(8 << 20)
        >>> sorted(m.as_dict())[:3]
        ['cpu_seconds', 'extra_rss', 'peak_rss']
    """

    def __enter__(self) -> Measure:
        gc.collect()
        self.peak_was_reset = reset_peak_rss()
        self.rss_before = current_rss()
        self._cpu0 = cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = cpu_seconds() - self._cpu0
        self.peak = peak_rss()
        self.extra_rss = max(0, self.peak - self.rss_before)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "rss_before": self.rss_before,
            "peak_rss": self.peak,
            "extra_rss": self.extra_rss,
            "peak_was_reset": self.peak_was_reset,
        }


class ThreadSampler:
    """Counts, every ``interval`` seconds, this process's threads that are running or waiting
    on the device (state R or D in ``/proc/self/task/*/stat``), its own thread left out.

    ``streams`` is the mean count over the samples: how many independent streams of work a
    section keeps busy. Sampling costs a little CPU, so use it outside timed sections.

    Example:
        >>> with ThreadSampler() as s:
        ...     sum(range(3_000_000)) > 0
        True
        >>> s.samples > 0 and s.streams >= 0
        True
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples = 0
        self.busy_total = 0
        self.busy_max = 0
        self._stop = threading.Event()

    def _count(self, own: int) -> int:
        busy = 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) == own:
                continue
            try:
                with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            busy += state in ("R", "D")
        return busy

    def _run(self) -> None:
        own = threading.get_native_id()
        while not self._stop.is_set():
            busy = self._count(own)
            self.samples += 1
            self.busy_total += busy
            self.busy_max = max(self.busy_max, busy)
            self._stop.wait(self.interval)

    def __enter__(self) -> ThreadSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def streams(self) -> float:
        return self.busy_total / self.samples if self.samples else 0.0


# ------------------------------------------------------------------- reading, checking


def touch(obj: Any) -> int:
    """Reads one byte of every page of every tensor in ``obj`` (dicts, lists, tuples), so
    that lazily loaded (memory-mapped) tensors are really read before a clock stops;
    returns the sum of the bytes read.

    Example:
        >>> import torch
        >>> touch({"a": torch.ones(3, dtype=torch.uint8), "b": [torch.zeros(2)]})
        1
    """
    import torch

    tensors = _tensors(obj)
    total = 0
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum(dtype=torch.int64))
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()
    return total


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def tensor_crc32s(tensors: Mapping[str, Any]) -> dict[str, int]:
    """CRC-32 of every byte of every tensor of a flat ``name -> tensor`` mapping (CPU).

    Two loads that agree on every name's CRC returned the same bytes.

    Example:
        >>> import torch
        >>> tensor_crc32s({"w": torch.zeros(2, dtype=torch.uint8)})
        {'w': 1104745215}
    """
    import torch

    out = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out[name] = zlib.crc32(memoryview(flat.numpy()))
    return out


def file_crc32(path: str | os.PathLike[str], start: int = 0, chunk: int = 8 * MiB) -> int:
    """CRC-32 of a file's bytes from ``start`` to its end.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(bytes(2)); f.flush()
        ...     file_crc32(f.name)
        1104745215
    """
    crc = 0
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def preadv_file(
    path: str | os.PathLike[str],
    threads: int,
    *,
    start: int = 0,
    chunk: int = 16 * MiB,
    prefault: bool = False,
) -> tuple[mmap.mmap, float]:
    """The parallel-``preadv`` ceiling: ``threads`` threads read the file from ``start`` to
    its end with ``os.preadv`` into one anonymous buffer, in ``chunk`` pieces taken in turn.

    The buffer is allocated before the clock starts; its pages are faulted in by the reads
    (as a loader's fresh memory is) unless ``prefault`` writes them first. Returns the
    buffer and the seconds the reads took.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"ab" * 5000); f.flush()
        ...     buf, seconds = preadv_file(f.name, 2, chunk=1024)
        >>> bytes(buf[:4]), len(buf), seconds > 0
        (b'abab', 10000, True)
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        nbytes = os.fstat(fd).st_size - start
        buffer = mmap.mmap(-1, max(nbytes, 1))
        if prefault:
            for offset in range(0, nbytes, PAGE):
                buffer[offset] = 0
        view = memoryview(buffer)
        pieces = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        errors: list[BaseException] = []

        def worker(first: int) -> None:
            try:
                for off, n in pieces[first::threads]:
                    done = 0
                    while done < n:
                        got = os.preadv(fd, [view[off + done : off + n]], start + off + done)
                        if got == 0:
                            raise EOFError(f"{path}: file ended at {start + off + done}")
                        done += got
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        view.release()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return buffer, seconds


def pwrite_file(
    path: str | os.PathLike[str],
    buffers: Sequence[Any],
    threads: int,
    *,
    chunk: int = 8 * MiB,
) -> float:
    """The write ceiling of one file: ``threads`` threads ``os.pwrite`` the bytes of
    ``buffers`` (objects with the buffer protocol) back to back into a new file at ``path``,
    in ``chunk`` pieces taken in turn, then the file is made durable. No header, no
    checksum: the kernel's own cost of putting these bytes into this file. Returns seconds.

    Example:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as d:
        ...     seconds = pwrite_file(f"{d}/f", [b"ab" * 700, b"c"], 2, chunk=512)
        ...     pathlib.Path(d, "f").read_bytes() == b"ab" * 700 + b"c"
        True
    """
    views = [memoryview(b).cast("B") for b in buffers]
    pieces: list[tuple[memoryview, int]] = []
    offset = 0
    for view in views:
        pieces += [(view[at : at + chunk], offset + at) for at in range(0, len(view), chunk)]
        offset += len(view)
    errors: list[BaseException] = []
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def worker(first: int) -> None:
            try:
                for piece, at in pieces[first::threads]:
                    done = 0
                    while done < len(piece):
                        done += os.pwrite(fd, piece[done:], at + done)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    make_durable(path)
    return time.perf_counter() - t0


# ------------------------------------------------------------------- child processes


def report(result: dict[str, Any]) -> None:
    """Called in a child: hands ``result`` to the parent (one marked JSON line on stdout)."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs ``argv`` and returns the dict it :func:`report` ed, or ``{"error": ...}``.

    Example:
        >>> code = "from fastckpt.cli.measure import report; report({'x': 1})"
        >>> run_child([sys.executable, "-c", code], timeout=60)
        {'x': 1}
    """
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit status {proc.returncode}: " + " | ".join(tail)}


def child_main(spec_json: str, handlers: Mapping[str, Callable[[dict[str, Any]], dict]]) -> int:
    """A benchmark's child side: runs ``handlers[spec["op"]](spec)`` and reports its dict
    (or the exception as ``{"error": ...}``, so the parent goes on with the other methods).
    """
    spec = json.loads(spec_json)
    try:
        result = handlers[spec["op"]](spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {exc}"}
    report(result)
    return 0


def spawn(script: str | os.PathLike[str], spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs ``python script --child SPEC`` (progress bars off) and returns what it reported."""
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    argv = [sys.executable, os.fspath(script), "--child", json.dumps(spec)]
    return run_child(argv, timeout=timeout, env=env)


# ------------------------------------------------------------------------------- fio


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


# ------------------------------------------------------------------- results, tables


def summarize(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians (and GB/s spread) of one method's rounds; errors and skips collected.

    A round counts when it has neither ``error`` nor ``skipped``; its GB/s is
    ``payload_bytes / seconds`` (or its own ``gbps``).

    Example:
        >>> s = summarize([{"payload_bytes": 2e9, "seconds": 1.0, "cpu_seconds": 0.5},
        ...                {"payload_bytes": 2e9, "seconds": 2.0, "cpu_seconds": 1.5},
        ...                {"error": "boom"}])
        >>> s["n"], s["gbps"], s["cpu_seconds"], s["errors"]
        (2, 1.5, 1.0, ['boom'])
    """
    ok = [r for r in results if "error" not in r and "skipped" not in r]
    errors = [r["error"] for r in results if "error" in r]
    skipped = sorted({r["skipped"] for r in results if "skipped" in r})
    if not ok:
        return {"n": 0, "errors": errors, "skipped": skipped}
    rates = [rate_of(r) for r in ok]
    rss = [r.get("extra_rss") for r in ok]
    return {
        "n": len(ok),
        "gbps": median(rates),
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "seconds": median([r.get("seconds") for r in ok]),
        "cpu_seconds": median([r.get("cpu_seconds") for r in ok]),
        "extra_rss": median(rss) if any(v is not None for v in rss) else None,
        "extra_rss_max": max((v for v in rss if v is not None), default=None),
        "errors": errors,
        "skipped": skipped,
    }


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table; ``align`` holds one letter per column (``l`` or ``r``, default r
    for all but the first).

    Example:
        >>> print(markdown_table(["method", "GB/s"], [["a", "1.00"]]))
        | method | GB/s |
        |---|---:|
        | a | 1.00 |
    """
    align = align or "l" + "r" * (len(header) - 1)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``suffix``), or "n/a" when it was not measured.

    Example:
        >>> fmt(1.234, ".2f", "x"), fmt(None, ".2f")
        ('1.23x', 'n/a')
    """
    if value is None or value != value:  # None or NaN
        return "n/a"
    return format(value, spec) + suffix


def rotate(items: Sequence[str], k: int) -> list[str]:
    """``items`` started at position ``k``: each round runs the methods in another order."""
    items = list(items)
    k %= len(items)
    return items[k:] + items[:k]


def log(message: str) -> None:
    """A timestamped progress line on stderr (tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def version_of(distribution: str) -> str:
    """The installed version of a distribution, or "not installed".

    Example:
        >>> version_of("no-such-distribution-here")
        'not installed'
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def rate_of(result: Mapping[str, Any]) -> float:
    """GB/s of one measured result: ``payload_bytes / seconds``, or its own ``gbps`` (fio)."""
    if "payload_bytes" in result:
        return result["payload_bytes"] / result["seconds"] / 1e9
    return result["gbps"]


class Results:
    """Every child's result of a benchmark run, tagged (op, method, round, more) and logged.

    Example:
        >>> r = Results(quiet=True)
        >>> r.record("load", "a", 0, {"payload_bytes": 1e9, "seconds": 0.5})
        >>> r.record("load", "a", 1, {"error": "boom"})
        >>> r.stats("load", ["a"])["a"]["gbps"], r.per_round("load", "a", 2)
        (2.0, [2.0, None])
    """

    def __init__(self, quiet: bool = False) -> None:
        self.raw: list[dict[str, Any]] = []
        self.quiet = quiet

    def record(
        self, op: str, method: str, rnd: int, result: Mapping[str, Any], **tags: Any
    ) -> None:
        """Keeps one result; logs it on stderr (round -1: an extra, untimed round)."""
        self.raw.append({**tags, "op": op, "method": method, "round": rnd, **result})
        if self.quiet:
            return
        head = " ".join(str(v) for v in tags.values())
        when = "sampled" if rnd < 0 else f"round {rnd + 1}"
        head = f"{head + ' ' if head else ''}{when}: {op} {method:17s}"
        if "error" in result or "skipped" in result:
            log(f"{head} {result.get('error') or 'skipped: ' + result['skipped']}")
            return
        extra = ""
        if result.get("cpu_seconds") is not None:
            extra += f"  cpu {result['cpu_seconds']:5.2f} s"
        if result.get("extra_rss") is not None:
            extra += f"  +rss {result['extra_rss'] / MiB:6.0f} MiB"
        if result.get("wrong"):
            extra += f"  WRONG BYTES {result['wrong']}"
        log(f"{head} {rate_of(result):6.2f} GB/s{extra}")

    def pick(self, op: str, method: str, *, sampled: bool = False, **tags: Any) -> list[dict]:
        """The results of one method (timed rounds, or with ``sampled`` the extra round)."""
        return [
            r
            for r in self.raw
            if r["op"] == op
            and r["method"] == method
            and (r["round"] < 0) == sampled
            and all(r.get(k) == v for k, v in tags.items())
        ]

    def stats(self, op: str, methods: Iterable[str], **tags: Any) -> dict[str, dict[str, Any]]:
        """:func:`summarize` of each method's timed rounds."""
        return {m: summarize(self.pick(op, m, **tags)) for m in methods}

    def per_round(self, op: str, method: str, rounds: int, **tags: Any) -> list[float | None]:
        """GB/s of each round (None where it failed), so the spread behind a median shows."""
        values: list[float | None] = []
        for rnd in range(rounds):
            r = next((x for x in self.pick(op, method, **tags) if x["round"] == rnd), None)
            ok = r is not None and "error" not in r and "skipped" not in r
            values.append(rate_of(r) if ok else None)
        return values

    def dump(self, path: str, **more: Any) -> None:
        """Writes every result (and ``more``) as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**more, "runs": self.raw}, f, indent=2)
        log(f"raw results written to {path}")


def require_directory(path: str | os.PathLike[str], need: int, *, memory: bool) -> str:
    """Checks a benchmark's directory: on a memory file system or not (as ``memory`` asks),
    with ``need`` bytes free. Returns a description; raises SystemExit with the reason.
    """
    fs_type, source, mount = filesystem_of(path)
    if (fs_type in MEMORY_FILESYSTEMS) != memory:
        kind = "a memory file system" if memory else "a disk"
        raise SystemExit(f"error: {path} is on {fs_type} ({mount}); this needs {kind}")
    free = free_bytes(path)
    if free < need:
        raise SystemExit(
            f"error: {path} has {format_bytes(free)} free; this run needs about "
            f"{format_bytes(need)}: use a smaller --size or another directory"
        )
    return f"{fs_type} ({source}, mounted at {mount})"


def machine() -> dict[str, Any]:
    """The machine and the versions a benchmark's figures belong to."""
    import platform

    return {
        "cpus": len(os.sched_getaffinity(0)),
        "memory": format_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {
            d: version_of(d)
            for d in (
                "fastckpt-io",
                "torch",
                "safetensors",
                "runai-model-streamer",
                "fastsafetensors",
            )
        },
    }
