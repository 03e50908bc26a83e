"""Helpers shared by the scripts in ``benchmarks/``: sizes, file systems, cold caches,
durability, per-process measurements (wall, CPU, peak RSS), child processes, fio, and a
synthetic LLM-like state dict.

Nothing here imports torch at module level, so a driver process stays small; the
functions that need torch import it when called (in the measuring child processes).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: Prefix of the one stdout line a child process reports its result on.
RESULT_MARK = "@@BENCH-RESULT "

# ----------------------------------------------------------------------------- sizes


def parse_size(text: str) -> int:
    """``"2G"``, ``"512M"``, ``"64K"``, ``"4096"`` (powers of 1024) -> bytes."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    units = {"K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}
    if value and value[-1] in units:
        scale, value = units[value[-1]], value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 512M, 2G)") from None
    if number <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(number * scale)


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# ----------------------------------------------------------------------- file systems


def filesystem_of(path: str | os.PathLike[str]) -> tuple[str, str, str]:
    """(type, source, mount point) of the file system holding ``path`` (which may not exist yet)."""
    p = Path(os.path.abspath(os.fspath(path)))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best = ("unknown", "unknown", "/")
    best_len = -1
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


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


def free_bytes(path: str | os.PathLike[str]) -> int:
    return shutil.disk_usage(path).free


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return None


# ------------------------------------------------------------------ caches, durability

_DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(_DROP_CACHES, os.W_OK)


_page_cache: Any = None


def drop_page_cache(files: Sequence[str | os.PathLike[str]] = ()) -> str:
    """Makes the next reads of ``files`` come from the device; returns how.

    As root: ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches`` (whole machine); else each
    file's clean pages are evicted with ``posix_fadvise(DONTNEED)``. The same rules as
    ``fastckpt tune``/``bench`` (``fastckpt.cli._common.PageCache``).
    """
    global _page_cache
    from fastckpt.cli._common import PageCache

    if _page_cache is None:
        _page_cache = PageCache()
    _page_cache.drop(files)
    return "drop_caches" if _page_cache.can_drop else "fadvise"


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(path: str | os.PathLike[str]) -> None:
    """fsync of the file and of its directory (so its name survives a crash too)."""
    fsync_file(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# ------------------------------------------------------------------------ measurement


def current_rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process (``ru_maxrss``, KiB on Linux) in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0).

    Resetting it lets ``ru_maxrss`` describe one timed section rather than the whole
    process; without it, the peak may include what happened before the section.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_seconds() -> float:
    # RUSAGE_SELF covers every thread of the process, native I/O threads included.
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Measure:
    """Times a section: wall seconds, CPU seconds (user + sys, all threads), extra peak RSS.

    ``extra_rss`` is the section's peak RSS minus the RSS on entry.

    Example:
        >>> with Measure() as m:
        ...     _ = bytearray(8 << 20)
        >>> m.seconds >= 0 and m.cpu_seconds >= 0
        True
    """

    def __enter__(self) -> Measure:
        gc.collect()
        self.peak_was_reset = reset_peak_rss()
        self.rss_before = current_rss()
        self._cpu0 = _cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = _cpu_seconds() - self._cpu0
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


# -------------------------------------------------------------------- child processes


def report(result: dict[str, Any]) -> None:
    """Called in a child: hands ``result`` to the parent (one marked JSON line on stdout)."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs ``argv`` and returns the dict it :func:`report`\\ ed, or ``{"error": ...}``."""
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


# ------------------------------------------------------------------------------- fio


def fio_path() -> str | None:
    return shutil.which("fio")


def fio_version() -> str | None:
    path = fio_path()
    if path is None:
        return None
    try:
        return subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


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

    Writes end with ``end_fsync=1``; ``extra`` adds fio options. Returns seconds (fio's job runtime), bytes, GB/s,
    CPU seconds (fio's usr+sys share of its runtime), or ``{"error": ...}``.
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
    ]
    cmd += list(extra)
    if rw == "write":
        cmd.append("--end_fsync=1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"fio timed out after {timeout:.0f} s"}
    try:
        data = json.loads(proc.stdout[proc.stdout.index("{") :])
        job = data["jobs"][0]
        side = job[rw]
        seconds = side["runtime"] / 1000.0
        moved = side["io_bytes"]
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


# ------------------------------------------------------------------- synthetic weights


def llm_like_layout(nbytes: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of a LLaMA-like state dict of at most ``nbytes`` bytes.

    Hidden size 4096, MLP 11008, vocabulary 32000 (the 7B shapes) whenever one layer fits;
    the hidden size is halved until it does for small sizes. Token embedding in bfloat16,
    output head in float32, layer matrices in bfloat16, norms and rotary frequencies
    (small 1-D tensors, some not a multiple of 4 KiB) in float32. Layers are added tensor
    by tensor while they fit, so the last one may be partial.
    """
    size = {"float32": 4, "bfloat16": 2}
    for d in (4096, 2048, 1024, 512, 256, 128, 64, 32):
        ff, vocab = d * 11008 // 4096, d * 32000 // 4096
        fixed = vocab * d * 2 + vocab * d * 4 + d * 4
        if fixed + 4 * d * d * 2 <= nbytes:
            break
    else:
        raise ValueError(f"an LLM-like state dict needs more than {human_bytes(nbytes)}")
    head = [("model.embed_tokens.weight", "bfloat16", (vocab, d))]
    tail = [("model.norm.weight", "float32", (d,)), ("lm_head.weight", "float32", (vocab, d))]

    def nb(entry: tuple[str, str, tuple[int, ...]]) -> int:
        n = size[entry[1]]
        for dim in entry[2]:
            n *= dim
        return n

    budget = nbytes - sum(nb(e) for e in head + tail)
    layers: list[tuple[str, str, tuple[int, ...]]] = []
    i = 0
    while True:
        p = f"model.layers.{i}."
        layer = [(p + f"self_attn.{x}_proj.weight", "bfloat16", (d, d)) for x in "qkvo"]
        layer += [
            (p + "self_attn.rotary_emb.inv_freq", "float32", (d // 64,)),
            (p + "mlp.gate_proj.weight", "bfloat16", (ff, d)),
            (p + "mlp.up_proj.weight", "bfloat16", (ff, d)),
            (p + "mlp.down_proj.weight", "bfloat16", (d, ff)),
            (p + "input_layernorm.weight", "float32", (d,)),
            (p + "post_attention_layernorm.weight", "float32", (d,)),
        ]
        added = False
        for entry in layer:
            if nb(entry) <= budget:
                layers.append(entry)
                budget -= nb(entry)
                added = True
        if not added or budget < 2 * d * d:
            break
        i += 1
    return head + layers + tail


def llm_like_state_dict(nbytes: int, seed: int = 0) -> dict[str, Any]:
    """A deterministic ``str -> Tensor`` dict laid out by :func:`llm_like_layout`, filled
    like ``fastckpt bench --checkpoint``'s (the same bytes for the same seed)."""
    from fastckpt.cli.synthetic import state_dict_from_shapes

    state = state_dict_from_shapes({n: (d, s) for n, d, s in llm_like_layout(nbytes)}, seed)
    gc.collect()
    return state


def touch_tensors(tensors: dict[str, Any], page: int = 4096) -> int:
    """Reads one byte of every page of every tensor (and its last byte); returns their sum.

    Cheap (one byte per page) and the same for every loader, so loaders that map files
    lazily pay for their reads here; equal sums also show that the data read back agree.
    """
    import torch

    total = 0
    for t in tensors.values():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        b = t.reshape(-1).view(torch.uint8)
        total += int(b[::page].sum(dtype=torch.int64)) + int(b[-1])
    return total


# --------------------------------------------------------------------- driver helpers


def log(message: str) -> None:
    """A timestamped progress line on stderr (the tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rotate(items: list[str], k: int) -> list[str]:
    """``items`` started at position ``k``: each round runs the methods in another order."""
    k %= len(items)
    return items[k:] + items[:k]


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``suffix``), or "n/a" when it was not measured."""
    return "n/a" if value is None else format(value, spec) + suffix


def import_repo_package() -> None:
    """Makes ``import fastckpt`` find this checkout's package, whatever else is installed."""
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(1, repo)
