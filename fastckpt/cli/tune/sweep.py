"""The sweep of ``fastckpt tune``: the values tried, the configurations they make, and the
measuring of each (timed raw writes and cold reads through an ``aio_handle``).

Every configuration writes ``io_size`` bytes to a fresh file in each directory (timed until
fsync returns) and reads a prepared file back from a cold cache. The best few are measured
again, and the winner is chosen on the median of all its runs.

Example:
    >>> import tempfile
    >>> from fastckpt.bench.caches import PageCache
    >>> sweep = default_sweep(["threads"])
    >>> sweep.update(block_size=[1 << 20], queue_depth=[8], overlap_events=[True],
    ...              intra_op_parallelism=[1, 2])
    >>> files = SweepFiles([tempfile.mkdtemp()], 1 << 20, gpu=False, gds=False, cache=PageCache())
    >>> files.prepare_reads()
    >>> results = run_sweep(files, configurations(sweep), runs=1, read=True, write=True)
    >>> files.close()
    >>> len(results), all(r.score() > 0 for r in results)
    (2, True)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from fastckpt.bench.caches import PageCache
from fastckpt.bench.units import format_bytes, gbps, median
from fastckpt.cli._common import ENGINE_CHOICES, USAGE, CliError

__all__ = [
    "CONFIRM_RUNS",
    "CONFIRM_TOP",
    "PARAMETERS",
    "QUICK_BUDGET",
    "QUICK_DESCRIPTION",
    "Result",
    "SweepFiles",
    "SweepObserver",
    "configurations",
    "confirmations",
    "default_sweep",
    "gds_sweep",
    "load_sweep_config",
    "measure",
    "quick_sweep",
    "run_sweep",
    "short_name",
    "show",
]

#: The knobs swept besides ``engine``, in the order of ``aio_handle``'s constructor.
PARAMETERS = (
    "block_size",
    "queue_depth",
    "single_submit",
    "overlap_events",
    "intra_op_parallelism",
)
_BOOLEAN = ("single_submit", "overlap_events")

# DeepSpeed's ds_nvme_tune sweep files name ds_io's options; each is read as fastckpt means it.
_ALIASES = {"io_parallel": "intra_op_parallelism"}
# sequential_requests: submit a batch only once the previous one completed, the opposite of
# overlap_events (which keeps the queue full as requests complete).
_INVERTED = {"sequential_requests": "overlap_events"}
# ds_io options that a sweep file may carry and that tune sets otherwise, or has no use for:
# accepted with a note, so that a DeepSpeed sweep file runs unchanged.
_NOT_SWEPT = {
    "handle": "tune always measures through an aio_handle",
    "use_gds": "--gds sweeps GPUDirect Storage",
    "gpu": "--gpu moves the data to and from GPU memory",
    "io_size": "--io_size sets the bytes per run",
    "loops": "--loops sets the runs per configuration",
    "read": "reads and writes are both measured (--no_read, --no_write)",
    "folder": "the directories are --nvme_dir",
    "folder_to_device_mapping": "the directories are --nvme_dir",
    "multi_process": "each directory is measured by one process's handle",
    "validate": "tune does not check the bytes (fastckpt bench --validate does)",
    "verbose": "--verbose prints every measurement",
    "use_accelerator_pin_memory": "the buffers are always page-locked",
    "slow_bounce_buffer": "GPU data always moves through page-locked buffers",
    "torch_legacy_save": "tune measures raw I/O, not torch.save",
    "fast_io_size": "tune measures raw I/O, not torch.save",
}

# The default sweep: 3 engines x 2 x 3 x 3 x 2 = 108 configurations, trimmed so that
# `--io_size 1G` finishes in a few minutes (measured on a 2-core VM with a 2-3 GB/s disk:
# about 1.5 s per configuration at 1 GiB, the I/O itself plus dropping the cache; the
# default run took under 3 minutes, where the untrimmed 162 took 5):
# - block sizes 1M and 4M: in a full sweep 256K was the slowest block size for every
#   engine (writes at half the speed of 4M), since small requests cost more system calls
#   and completions per byte; 1M is DeepSpeed's default, 4M what large files prefer;
# - queue depths 8 / 32 / 128 and 1 / 2 / 4 threads, a factor of four apart, bracket what
#   NVMe drives need without filling the sweep with near-duplicates;
# - single_submit=False only: submitting requests one system call at a time never beats
#   batching them and would double the sweep; overlap_events is swept both ways (a
#   sliding window vs DeepSpeed's batch-at-a-time), as devices differ on it.
# --sweep_config widens any of these (e.g. {"block_size": ["256K", "1M", "4M", "16M"]}).
_DEFAULT_VALUES: dict[str, list[Any]] = {
    "block_size": [1 << 20, 4 << 20],
    "queue_depth": [8, 32, 128],
    "single_submit": [False],
    "overlap_events": [True, False],
    "intra_op_parallelism": [1, 2, 4],
}

# --quick: the values that most often win, and the two that matter most on most devices.
_QUICK_VALUES: dict[str, list[Any]] = {
    "block_size": [4 << 20],
    "queue_depth": [8, 32],
    "single_submit": [False],
    "overlap_events": [True],
    "intra_op_parallelism": [1, 4],
}
QUICK_DESCRIPTION = "block_size 4M, queue_depth 8 or 32, intra_op_parallelism 1 or 4"
QUICK_BUDGET = 30.0

# After the sweep, the best few configurations are measured again and the winner is chosen
# on the median of all its runs: on a noisy device one lucky run should not decide.
CONFIRM_TOP = 3
CONFIRM_RUNS = 2


@dataclasses.dataclass
class Result:
    """What one configuration measured: GB/s per run, read and write.

    Example:
        >>> r = Result({"queue_depth": 8}, read=[2.0, 3.0, 2.5], write=[2.0])
        >>> r.read_gbps, round(r.score(), 3)
        (2.5, 2.222)
    """

    config: dict[str, Any]
    read: list[float] = dataclasses.field(default_factory=list)
    write: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def read_gbps(self) -> float:
        return median(self.read)

    @property
    def write_gbps(self) -> float:
        return median(self.write)

    def score(self) -> float:
        """Harmonic mean of the read and write medians: the throughput of writing some bytes
        and reading them back, the life of a checkpoint. One direction alone when the other
        was not measured; -1 for a failed configuration.
        """
        if self.error:
            return -1.0
        rates = [rate for rate in (self.read_gbps, self.write_gbps) if not math.isnan(rate)]
        if not rates or min(rates) <= 0:
            return -1.0
        return len(rates) / sum(1.0 / rate for rate in rates)

    def summary(self) -> str:
        settings = " ".join(f"{short_name(k)}={show(k, v)}" for k, v in self.config.items())
        if self.error:
            return f"{settings}: failed: {self.error}"
        parts = []
        if self.read:
            parts.append(f"read {self.read_gbps:.2f}")
        if self.write:
            parts.append(f"write {self.write_gbps:.2f}")
        return f"{settings}: {', '.join(parts)} GB/s"


def short_name(key: str) -> str:
    """The short name of a parameter in one-line summaries (``qd`` for queue_depth)."""
    return {
        "block_size": "bs",
        "queue_depth": "qd",
        "single_submit": "ss",
        "overlap_events": "oe",
        "intra_op_parallelism": "par",
    }.get(key, key)


def show(key: str, value: Any) -> str:
    """A parameter's value in one-line summaries and plots (``4M``, ``1``/``0``)."""
    if key == "block_size":
        return format_bytes(value).replace(".00 ", "").replace(" ", "").replace("iB", "")
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# ------------------------------------------------------------------------ the values


def default_sweep(engines: Sequence[str]) -> dict[str, list[Any]]:
    """The default value lists, over ``engines``.

    Example:
        >>> sweep = default_sweep(["threads"])
        >>> sweep["engine"], sweep["queue_depth"]
        (['threads'], [8, 32, 128])
    """
    sweep: dict[str, list[Any]] = {"engine": list(engines)}
    sweep.update({key: list(values) for key, values in _DEFAULT_VALUES.items()})
    return sweep


def _coerce(key: str, value: Any) -> Any:
    if key in _BOOLEAN:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1")
        if value in (0, 1):
            return bool(value)
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    if key == "engine":
        if value not in ENGINE_CHOICES:
            raise ValueError(
                f"engine: unknown engine {value!r}; choose from {', '.join(ENGINE_CHOICES)}"
            )
        return value
    if isinstance(value, str):
        from fastckpt.config import parse_size

        value = parse_size(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key}: expected a positive integer, got {value!r}")
    return value


def load_sweep_config(
    path: str | os.PathLike[str],
    base: dict[str, list[Any]],
    note: Callable[[str], None] = print,
) -> dict[str, list[Any]]:
    """Reads a ``--sweep_config`` file: a JSON object of value lists per parameter.

    Keys are ``aio_handle``'s argument names; sizes may be strings such as ``"1M"``; a
    single value may stand for a one-element list; keys left out keep their lists from
    ``base``. DeepSpeed's ``ds_nvme_tune`` sweep files are read too: ``io_parallel`` is
    ``intra_op_parallelism``, ``sequential_requests`` is ``overlap_events`` negated, and the
    ``ds_io`` options that tune sets otherwise (``handle``, ``loops``, ``use_gds``, ...) are
    passed over, each with one line given to ``note``.

    Raises:
        CliError: (status 2) unreadable file, unknown key (named), a knob given twice under
            two names, or bad value.

    Example:
        >>> import json, tempfile
        >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        >>> json.dump({"block_size": ["64K", "1M"], "io_parallel": 2,
        ...            "sequential_requests": [True, False], "handle": [True]}, f); f.close()
        >>> sweep = load_sweep_config(f.name, default_sweep(["threads"]))  # doctest: +ELLIPSIS
        Note: --sweep_config key 'handle' is not swept: tune always measures through an aio_handle
        >>> sweep["block_size"], sweep["intra_op_parallelism"], sweep["overlap_events"]
        ([65536, 1048576], [2], [False, True])
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CliError(f"--sweep_config {path}: {exc}", USAGE) from None
    if not isinstance(document, dict):
        raise CliError(f"--sweep_config {path}: expected a JSON object of value lists", USAGE)
    sweep = {key: list(values) for key, values in base.items()}
    given: dict[str, str] = {}  # fastckpt's name -> the name the file used
    for raw_key, values in document.items():
        if raw_key in _NOT_SWEPT:
            note(f"Note: --sweep_config key {raw_key!r} is not swept: {_NOT_SWEPT[raw_key]}")
            continue
        key = _ALIASES.get(raw_key) or _INVERTED.get(raw_key) or raw_key
        if key not in sweep:
            known = ", ".join(("engine",) + PARAMETERS + tuple(_ALIASES) + tuple(_INVERTED))
            raise CliError(
                f"--sweep_config {path}: unknown key {raw_key!r} (known: {known}; and "
                f"DeepSpeed's ds_io options {', '.join(_NOT_SWEPT)}, which are not swept)",
                USAGE,
            )
        if key in given:
            raise CliError(
                f"--sweep_config {path}: {given[key]!r} and {raw_key!r} set the same knob "
                f"({key}); give one",
                USAGE,
            )
        given[key] = raw_key
        if not isinstance(values, list):
            values = [values]
        if not values:
            raise CliError(f"--sweep_config {path}: {raw_key} has no values", USAGE)
        try:
            coerced = [_coerce(key, value) for value in values]
        except ValueError as exc:
            named = "" if raw_key == key else f"{raw_key}: "
            raise CliError(f"--sweep_config {path}: {named}{exc}", USAGE) from None
        if raw_key in _INVERTED:
            coerced = [not value for value in coerced]
        sweep[key] = list(dict.fromkeys(coerced))  # drop repeats, keep order
    return sweep


def configurations(sweep: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the values, in the order of ``aio_handle``'s constructor.

    Example:
        >>> len(configurations(default_sweep(["threads", "io_uring"])))
        72
    """
    keys = PARAMETERS + ("engine",)
    return [dict(zip(keys, values)) for values in itertools.product(*(sweep[k] for k in keys))]


# ------------------------------------------------------------------------ measuring


class SweepFiles:
    """The files and buffer of one tuning run: a file to read and one to write in each
    directory, one buffer of ``io_size``; :meth:`close` removes the files."""

    def __init__(
        self, dirs: Sequence[str], io_size: int, *, gpu: bool, gds: bool, cache: PageCache
    ):
        from fastckpt.bench.rawio import make_buffer

        self.dirs, self.io_size, self.gds, self.cache = dirs, io_size, gds, cache
        tag = f"fastckpt-tune-{os.getpid()}"
        self.read_paths = [os.path.join(d, f".{tag}-read.bin") for d in dirs]
        self.write_paths = [os.path.join(d, f".{tag}-write.bin") for d in dirs]
        # One buffer serves every directory: the bytes read are not looked at, and one
        # io_size of locked memory is the most a run should ask for.
        self.buffer = make_buffer(io_size, gpu=gpu or gds)

    def prepare_reads(self) -> None:
        """Writes the files that the reads will read."""
        from fastckpt.bench.rawio import make_handle, timed_write
        from fastckpt.config import IOConfig

        # A GPU buffer is copied to host memory: the read files only need the bytes.
        timed_write(make_handle(IOConfig(engine="auto")), self.buffer.cpu(), self.read_paths)

    def measure(
        self, config: dict[str, Any], runs: int, *, read: bool, write: bool, result: Result
    ) -> None:
        """Adds ``runs`` GB/s figures of ``config`` (reads and/or writes) to ``result``."""
        from fastckpt.bench.rawio import make_handle, timed_read, timed_write
        from fastckpt.config import IOConfig

        handle = make_handle(IOConfig(**config), gds=self.gds)
        total = self.io_size * len(self.dirs)
        for _ in range(runs):
            if write:
                result.write.append(gbps(total, timed_write(handle, self.buffer, self.write_paths)))
            if read:
                result.read.append(
                    gbps(total, timed_read(handle, self.buffer, self.read_paths, self.cache))
                )

    def close(self) -> None:
        """Removes the files."""
        for path in self.read_paths + self.write_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def gds_sweep() -> dict[str, list[Any]]:
    """The sweep of ``--gds``: cuFile sizes its own requests, so of ``gds_handle``'s settings
    only the thread count is swept.

    Example:
        >>> gds_sweep()["intra_op_parallelism"]
        [1, 2, 4, 8]
    """
    sweep = default_sweep(["gds"])
    sweep.update(
        block_size=[1 << 20],
        queue_depth=[32],
        single_submit=[False],
        overlap_events=[True],
        intra_op_parallelism=[1, 2, 4, 8],
    )
    return sweep


def quick_sweep(sweep: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``sweep`` narrowed to the values of ``--quick`` (its engines kept).

    Example:
        >>> quick_sweep(default_sweep(["threads"]))["queue_depth"]
        [8, 32]
    """
    narrowed = {key: list(values) for key, values in sweep.items()}
    narrowed.update({key: list(values) for key, values in _QUICK_VALUES.items()})
    return narrowed


def confirmations(count: int) -> int:
    """How many of ``count`` configurations are measured again after the sweep.

    Example:
        >>> confirmations(1), confirmations(2), confirmations(100)
        (0, 2, 3)
    """
    return min(CONFIRM_TOP, count) if count > 1 else 0


def measure(
    files: SweepFiles, config: dict[str, Any], runs: int, read: bool, write: bool
) -> Result:
    """One configuration measured ``runs`` times; a failure is kept in ``Result.error``,
    except running out of space, which no later configuration could escape.

    Raises:
        CliError: the file system is full (ENOSPC).
    """
    from fastckpt.errors import FastCkptError

    result = Result(dict(config))
    try:
        files.measure(config, runs, read=read, write=write, result=result)
    except (OSError, FastCkptError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: no later configuration can run
            raise CliError(f"out of space: {exc}") from None
        result.error = str(exc)
    return result


class SweepObserver(Protocol):
    """What :func:`run_sweep` tells as it goes (the command shows and logs it)."""

    def measured(self, result: Result, phase: str) -> None:
        """``result`` was measured, in the ``"sweep"`` or again in the ``"confirm"`` phase."""

    def budget_spent(self, measured: int, total: int) -> None:
        """The time budget ended the sweep after ``measured`` of ``total`` configurations."""


class _Silent:
    def measured(self, result: Result, phase: str) -> None:
        pass

    def budget_spent(self, measured: int, total: int) -> None:
        pass


def run_sweep(
    files: SweepFiles,
    configs: Sequence[dict[str, Any]],
    *,
    runs: int,
    read: bool,
    write: bool,
    deadline: float | None = None,
    observer: SweepObserver | None = None,
) -> list[Result]:
    """Measures every configuration, then the best few again (their runs added to theirs).

    No new configuration starts after ``deadline`` (a ``time.perf_counter()`` value) once
    one has been measured; the confirmations are skipped past it.
    """
    observer = observer or _Silent()
    results: list[Result] = []
    for config in configs:
        if deadline is not None and results and time.perf_counter() > deadline:
            observer.budget_spent(len(results), len(configs))
            break
        result = measure(files, config, runs, read, write)
        results.append(result)
        observer.measured(result, "sweep")
    ranked = sorted((r for r in results if not r.error), key=Result.score, reverse=True)
    for result in ranked[: confirmations(len(configs))]:
        if deadline is not None and time.perf_counter() > deadline:
            break  # the sweep's own runs decide
        again = measure(files, result.config, max(CONFIRM_RUNS, runs), read, write)
        if again.error:
            result.error = again.error
        result.read += again.read
        result.write += again.write
        observer.measured(again, "confirm")
    return results
