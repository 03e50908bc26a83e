"""``fastckpt tune``: find the fastest I/O configuration for a file system, and remember it.

The options are those of DeepSpeed's ``ds_nvme_tune`` (same names), plus ``--engine`` and
``--plot``. Every configuration of the sweep writes ``--io_size`` bytes to a fresh file in
each ``--nvme_dir`` (timed until fsync returns) and reads a prepared file back from a cold
cache. The winner is saved with :func:`fastckpt.config.save_tuned`, keyed by the file
system of each directory; from then on ``aio_handle()`` with no arguments and
``save``/``load`` on that file system use it (explicit arguments still win).

Example (shell)::

    $ fastckpt tune --nvme_dir /local_nvme --io_size 1G
    Running fastckpt I/O tuning on ['/local_nvme'] ...
    Best performance (GB/sec): read = 3.69, write = 3.18
    ...

Example (Python):
    >>> from fastckpt.cli import main
    >>> main(["tune", "--help"])  # doctest: +ELLIPSIS
    usage: fastckpt tune ...
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fastckpt.cli._common import (
    ENGINE_CHOICES,
    USAGE,
    CliError,
    PageCache,
    check_engines,
    direct_io_supported,
    engine_list_arg,
    format_bytes,
    gbps,
    median,
    positive_int_arg,
    require_cuda,
    require_gds,
    size_arg,
)

__all__ = ["Result", "add_parser", "default_sweep", "load_sweep_config", "plot_results", "run"]

#: The knobs swept besides ``engine``, in the order of ``aio_handle``'s constructor.
PARAMETERS = (
    "block_size",
    "queue_depth",
    "single_submit",
    "overlap_events",
    "intra_op_parallelism",
)
_ALIASES = {"io_parallel": "intra_op_parallelism"}
_BOOLEAN = ("single_submit", "overlap_events")

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
_QUICK_DESCRIPTION = "block_size 4M, queue_depth 8 or 32, intra_op_parallelism 1 or 4"
_QUICK_BUDGET = 30.0

# After the sweep, the best few configurations are measured again and the winner is chosen
# on the median of all its runs: on a noisy device one lucky run should not decide.
_CONFIRM_TOP = 3
_CONFIRM_RUNS = 2


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
        settings = " ".join(f"{_short_name(k)}={_show(k, v)}" for k, v in self.config.items())
        if self.error:
            return f"{settings}: failed: {self.error}"
        parts = []
        if self.read:
            parts.append(f"read {self.read_gbps:.2f}")
        if self.write:
            parts.append(f"write {self.write_gbps:.2f}")
        return f"{settings}: {', '.join(parts)} GB/s"


def _short_name(key: str) -> str:
    return {
        "block_size": "bs",
        "queue_depth": "qd",
        "single_submit": "ss",
        "overlap_events": "oe",
        "intra_op_parallelism": "par",
    }.get(key, key)


def _show(key: str, value: Any) -> str:
    if key == "block_size":
        return format_bytes(value).replace(".00 ", "").replace(" ", "").replace("iB", "")
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# ------------------------------------------------------------------------ the sweep


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
    path: str | os.PathLike[str], base: dict[str, list[Any]]
) -> dict[str, list[Any]]:
    """Reads a ``--sweep_config`` file: a JSON object of value lists per parameter.

    Keys are ``aio_handle``'s argument names (DeepSpeed's ``io_parallel`` is accepted for
    ``intra_op_parallelism``); sizes may be strings such as ``"1M"``; a single value may
    stand for a one-element list; keys left out keep their lists from ``base``.

    Raises:
        CliError: (status 2) unreadable file, unknown key, or bad value.

    Example:
        >>> import json, tempfile
        >>> f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        >>> json.dump({"block_size": ["64K", "1M"], "io_parallel": 2}, f); f.close()
        >>> sweep = load_sweep_config(f.name, default_sweep(["threads"]))
        >>> sweep["block_size"], sweep["intra_op_parallelism"]
        ([65536, 1048576], [2])
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CliError(f"--sweep_config {path}: {exc}", USAGE) from None
    if not isinstance(document, dict):
        raise CliError(f"--sweep_config {path}: expected a JSON object of value lists", USAGE)
    sweep = {key: list(values) for key, values in base.items()}
    for raw_key, values in document.items():
        key = _ALIASES.get(raw_key, raw_key)
        if key not in sweep:
            known = ", ".join(("engine",) + PARAMETERS)
            raise CliError(
                f"--sweep_config {path}: unknown key {raw_key!r} (known: {known})", USAGE
            )
        if not isinstance(values, list):
            values = [values]
        if not values:
            raise CliError(f"--sweep_config {path}: {raw_key} has no values", USAGE)
        try:
            coerced = [_coerce(key, value) for value in values]
        except ValueError as exc:
            raise CliError(f"--sweep_config {path}: {exc}", USAGE) from None
        sweep[key] = list(dict.fromkeys(coerced))  # drop repeats, keep order
    return sweep


def _configurations(sweep: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = PARAMETERS + ("engine",)
    return [dict(zip(keys, values)) for values in itertools.product(*(sweep[k] for k in keys))]


# ------------------------------------------------------------------------ measuring


class _Bench:
    """The files and buffer of one tuning run; removes its files on close."""

    def __init__(
        self, dirs: Sequence[str], io_size: int, *, gpu: bool, gds: bool, cache: PageCache
    ):
        from fastckpt.cli._rawio import make_buffer

        self.dirs, self.io_size, self.gds, self.cache = dirs, io_size, gds, cache
        tag = f"fastckpt-tune-{os.getpid()}"
        self.read_paths = [os.path.join(d, f".{tag}-read.bin") for d in dirs]
        self.write_paths = [os.path.join(d, f".{tag}-write.bin") for d in dirs]
        # One buffer serves every directory: the bytes read are not looked at, and one
        # io_size of locked memory is the most a run should ask for.
        self.buffer = make_buffer(io_size, gpu=gpu or gds)

    def prepare_reads(self) -> None:
        from fastckpt.cli._rawio import make_handle, timed_write
        from fastckpt.config import IOConfig

        # A GPU buffer is copied to host memory: the read files only need the bytes.
        timed_write(make_handle(IOConfig(engine="auto")), self.buffer.cpu(), self.read_paths)

    def measure(
        self, config: dict[str, Any], runs: int, *, read: bool, write: bool, result: Result
    ) -> None:
        from fastckpt.cli._rawio import make_handle, timed_read, timed_write
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
        for path in self.read_paths + self.write_paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _check_dirs(dirs: Sequence[str], io_size: int) -> list[str]:
    checked: list[str] = []
    for d in dirs:
        if not os.path.exists(d):
            try:
                os.makedirs(d)
            except OSError as exc:
                raise CliError(f"--nvme_dir {d}: cannot create it: {exc.strerror}", USAGE) from None
            print(f"Created --nvme_dir {d}", flush=True)
        if not os.path.isdir(d):
            raise CliError(f"--nvme_dir {d}: not a directory", USAGE)
        if not os.access(d, os.W_OK | os.X_OK):
            raise CliError(f"--nvme_dir {d}: not writable", USAGE)
        free = shutil.disk_usage(d).free
        if free < 2 * io_size + (64 << 20):
            raise CliError(
                f"--nvme_dir {d}: {format_bytes(free)} free, the sweep needs "
                f"{format_bytes(2 * io_size)} (a read file and a write file of --io_size)",
                USAGE,
            )
        real = os.path.realpath(d)
        if real not in checked:
            checked.append(real)
    return checked


def _emit(bar: Any, line: str) -> None:
    writer = getattr(bar, "write", None)
    if writer is not None:
        writer(line, file=sys.stdout)
    else:
        print(line, flush=True)


# ------------------------------------------------------------------------ the command


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``tune`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "tune",
        help="find the fastest I/O configuration for a file system and remember it",
        description=(
            "Sweeps engine x block_size x queue_depth x intra_op_parallelism x single_submit x "
            "overlap_events, writing and reading --io_size bytes in each --nvme_dir; prints the "
            "best read and write GB/s and the winning aio_handle configuration as JSON, and "
            "saves it for the file system of each directory (see fastckpt.config: "
            "$FASTCKPT_CONFIG, else $XDG_CONFIG_HOME/fastckpt/tuned.json). Options follow "
            "DeepSpeed's ds_nvme_tune."
        ),
    )
    parser.add_argument(
        "--nvme_dir",
        nargs="+",
        required=True,
        metavar="NVME_DIR",
        help="directory (one or more) in which to perform the I/O tests; a writable "
        "directory on the device to tune (created when missing)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="stop starting new configurations after this many seconds and pick the best "
        "measured so far (default: no limit; the full sweep can take minutes)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short sweep ({_QUICK_DESCRIPTION}) within --budget, "
        f"{_QUICK_BUDGET:.0f} s unless given",
    )
    parser.add_argument(
        "--sweep_config",
        metavar="FILE",
        help='JSON object of value lists per parameter, e.g. {"block_size": ["256K", '
        '"1M"], "queue_depth": [32], "overlap_events": [true]}; keys left out keep '
        "the default lists",
    )
    parser.add_argument("--no_read", action="store_true", help="do not measure reads")
    parser.add_argument("--no_write", action="store_true", help="do not measure writes")
    parser.add_argument(
        "--io_size",
        type=size_arg,
        default=size_arg("400M"),
        help="bytes read and written per directory and run, e.g. 400M, 1G (default 400M)",
    )
    parser.add_argument(
        "--gpu", action="store_true", help="move data between GPU memory and the files (needs CUDA)"
    )
    parser.add_argument(
        "--gds", action="store_true", help="sweep NVIDIA GPUDirect Storage (needs CUDA and cuFile)"
    )
    parser.add_argument(
        "--flush_page_cache",
        action="store_true",
        help="insist on dropping the page cache before every read (needs root); "
        "without it the cache is dropped when permitted, else reads rely on O_DIRECT",
    )
    parser.add_argument(
        "--log_dir",
        metavar="DIR",
        help="write one JSON line per measured configuration to a file in DIR",
    )
    parser.add_argument(
        "--loops",
        type=positive_int_arg,
        default=1,
        help="runs of each configuration (default 1; the best few are run again)",
    )
    parser.add_argument("--verbose", action="store_true", help="print every measurement")
    parser.add_argument(
        "--engine",
        action="append",
        type=engine_list_arg,
        metavar="NAME[,NAME]",
        help=f"sweep only these engines ({', '.join(ENGINE_CHOICES)}); repeatable "
        "or a comma list; default: every engine available here",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw GB/s against each swept parameter, per engine (needs matplotlib)",
    )
    parser.set_defaults(run=run)
    return parser


def _engines_to_sweep(args: argparse.Namespace) -> list[str]:
    if args.gds:
        return ["gds"]
    if args.engine:
        return check_engines(name for group in args.engine for name in group)
    from fastckpt.io.engines import ENGINE_NAMES, engines

    info = engines()
    return [name for name in ENGINE_NAMES if info[name].available]


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt tune`` with parsed arguments; returns the exit status."""
    if args.no_read and args.no_write:
        raise CliError("--no_read and --no_write leave nothing to measure", USAGE)
    if args.gds:
        require_gds()
    elif args.gpu:
        require_cuda("--gpu")
    if args.plot:
        _require_matplotlib()
        plot_dir = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(plot_dir) or not os.access(plot_dir, os.W_OK):
            raise CliError(f"--plot {args.plot}: cannot write in {plot_dir}", USAGE)
    engines = _engines_to_sweep(args)
    if args.gds:
        # cuFile sizes its own requests: of gds_handle's settings only the thread count acts.
        sweep = default_sweep(["gds"])
        sweep.update(
            block_size=[1 << 20],
            queue_depth=[32],
            single_submit=[False],
            overlap_events=[True],
            intra_op_parallelism=[1, 2, 4, 8],
        )
        if args.sweep_config:
            sweep = load_sweep_config(args.sweep_config, sweep)
        sweep["engine"] = ["gds"]
    elif args.sweep_config:
        sweep = load_sweep_config(args.sweep_config, default_sweep(engines))
        # --engine overrides the file's engine list.
        sweep["engine"] = engines if args.engine else check_engines(sweep["engine"])
    else:
        sweep = default_sweep(engines)
    if args.quick and not args.gds:
        sweep.update({key: list(values) for key, values in _QUICK_VALUES.items()})
    budget = args.budget if args.budget is not None else (_QUICK_BUDGET if args.quick else None)
    if budget is not None and not budget > 0:
        raise CliError(f"--budget {args.budget}: must be a positive number of seconds", USAGE)
    dirs = _check_dirs(args.nvme_dir, args.io_size)
    cache = PageCache()
    if args.flush_page_cache and not cache.can_drop:
        raise CliError(f"--flush_page_cache: cannot drop the page cache: {cache.describe()}", USAGE)

    configs = _configurations(sweep)
    read, write = not args.no_read, not args.no_write
    print(
        f"Running fastckpt I/O tuning on {dirs}: {len(configs)} configurations, "
        f"{format_bytes(args.io_size)} per directory, {args.loops} run(s) each, "
        f"engines: {', '.join(sweep['engine'])}",
        flush=True,
    )
    from fastckpt.config import filesystem_key

    for d in dirs:
        if filesystem_key(d).split(":", 1)[0] in ("tmpfs", "ramfs"):
            print(f"  {d}: this file system keeps files in memory; its speeds are not a device's")
    if read:
        print(f"Cold reads: {cache.describe()}", flush=True)
        for d in dirs:
            if not direct_io_supported(d):
                note = "" if cache.can_drop else "; reads may come from memory"
                print(f"  {d}: the file system refuses O_DIRECT, buffered I/O{note}", flush=True)

    log = _open_log(args.log_dir)
    started = time.perf_counter()
    bench = _Bench(dirs, args.io_size, gpu=args.gpu, gds=args.gds, cache=cache)
    results: list[Result] = []
    try:
        if read:
            bench.prepare_reads()
        confirm = min(_CONFIRM_TOP, len(configs)) if len(configs) > 1 else 0
        from fastckpt.progress import progress_bar

        with progress_bar(len(configs) + confirm, "tuning", unit="config") as bar:
            best = -1.0
            for config in configs:
                if budget is not None and results and time.perf_counter() - started > budget:
                    _emit(
                        bar,
                        f"Time budget of {budget:.0f} s spent after {len(results)} of "
                        f"{len(configs)} configurations; choosing among those measured",
                    )
                    break
                result = _measure(bench, config, args.loops, read, write)
                results.append(result)
                _log(log, result, dirs, args.io_size, "sweep")
                if args.verbose:
                    _emit(bar, result.summary())
                best = max(best, result.score())
                bar.set_postfix_str(f"best {best:.2f} GB/s")
                bar.update(1)
            ranked = sorted((r for r in results if not r.error), key=Result.score, reverse=True)
            for result in ranked[:confirm]:
                if budget is not None and time.perf_counter() - started > budget:
                    break  # the sweep's own runs decide
                again = _measure(bench, result.config, max(_CONFIRM_RUNS, args.loops), read, write)
                if again.error:
                    result.error = again.error
                result.read += again.read
                result.write += again.write
                _log(log, again, dirs, args.io_size, "confirm")
                if args.verbose:
                    _emit(bar, "again: " + again.summary())
                bar.update(1)
    finally:
        bench.close()
        if log is not None:
            log.close()
    elapsed = time.perf_counter() - started

    good = [r for r in results if not r.error]
    if not good:
        raise CliError(f"every configuration failed; the first: {results[0].summary()}")
    winner = max(good, key=Result.score)
    _report(good, winner, read, write, elapsed)
    if log is not None:
        print(f"Measurements logged to {log.name}")
    if args.gds:
        _save_gds(winner, dirs, read, write)
    else:
        _save(winner, dirs, args, cache, read, write)
    if args.plot:
        plot_results(results, sweep, args.plot, read=read, write=write)
        print(f"Plot written to {args.plot}")
    return 0


def _measure(bench: _Bench, config: dict[str, Any], runs: int, read: bool, write: bool) -> Result:
    from fastckpt.errors import FastCkptError

    result = Result(dict(config))
    try:
        bench.measure(config, runs, read=read, write=write, result=result)
    except (OSError, FastCkptError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: no later configuration can run
            raise CliError(f"out of space: {exc}") from None
        result.error = str(exc)
    return result


def _report(good: list[Result], winner: Result, read: bool, write: bool, elapsed: float) -> None:
    best_read = max(good, key=lambda r: r.read_gbps) if read else None
    best_write = max(good, key=lambda r: r.write_gbps) if write else None
    parts = []
    if best_read is not None:
        parts.append(f"read = {best_read.read_gbps:5.2f}")
    if best_write is not None:
        parts.append(f"write = {best_write.write_gbps:5.2f}")
    print(f"Tuning took {elapsed:.1f} s")
    print(f"Best performance (GB/sec): {', '.join(parts)}")
    if best_read is not None:
        print(f"  best read:  {best_read.summary()}")
    if best_write is not None:
        print(f"  best write: {best_write.summary()}")
    print(f"Winning configuration: {winner.summary()}")
    print(f"  Why: {why_winner(winner, best_read, best_write)}")
    print(json.dumps(winner.config, indent=2))


def why_winner(winner: Result, best_read: Result | None, best_write: Result | None) -> str:
    """One sentence on why ``winner`` won, naming what the best-read and best-write
    configurations scored when they are other configurations.

    Example:
        >>> a = Result({"queue_depth": 8}, read=[3.0], write=[1.0])
        >>> b = Result({"queue_depth": 32}, read=[2.0], write=[2.0])
        >>> print(why_winner(b, a, b))  # doctest: +NORMALIZE_WHITESPACE
        highest combined score 2.00 GB/s (the harmonic mean of read 2.00 and write 2.00: the
        speed of writing a checkpoint and reading it back); the best read alone (3.00 GB/s)
        scores 1.50 because its write is 1.00 GB/s
    """
    if best_read is None or best_write is None:
        only = "read" if best_write is None else "write"
        return f"highest median {only} speed ({winner.score():.2f} GB/s); the other direction was not measured"
    text = (
        f"highest combined score {winner.score():.2f} GB/s (the harmonic mean of read "
        f"{winner.read_gbps:.2f} and write {winner.write_gbps:.2f}: the speed of writing a "
        "checkpoint and reading it back)"
    )
    if best_read is not winner:
        text += (
            f"; the best read alone ({best_read.read_gbps:.2f} GB/s) scores "
            f"{best_read.score():.2f} because its write is {best_read.write_gbps:.2f} GB/s"
        )
    if best_write is not winner:
        text += (
            f"; the best write alone ({best_write.write_gbps:.2f} GB/s) scores "
            f"{best_write.score():.2f} because its read is {best_write.read_gbps:.2f} GB/s"
        )
    return text


def _save(
    winner: Result,
    dirs: Sequence[str],
    args: argparse.Namespace,
    cache: PageCache,
    read: bool,
    write: bool,
) -> None:
    from fastckpt.config import filesystem_key, save_tuned

    measured: dict[str, Any] = {
        "io_size": args.io_size,
        "loops": args.loops,
        "gpu": bool(args.gpu),
        "dirs": list(dirs),
        "cold_reads": "drop_caches" if cache.can_drop else "o_direct",
    }
    if read:
        measured["read_gbps"] = round(winner.read_gbps, 3)
    if write:
        measured["write_gbps"] = round(winner.write_gbps, 3)
    saved: dict[str, Path] = {}
    for d in dirs:
        key = filesystem_key(d)
        if key not in saved:
            saved[key] = save_tuned(key, winner.config, measured)
    for key, path in saved.items():
        print(f"Saved for file system {key} in {path}")


def _save_gds(winner: Result, dirs: Sequence[str], read: bool, write: bool) -> None:
    """Records GDS's figures per file system: loads to CUDA use GDS there when it read faster
    than the staging pipeline measured by ``fastckpt tune --gpu`` (gds_handle's own settings
    are arguments, so no configuration is saved)."""
    from fastckpt.config import filesystem_key, save_tuned_gds

    measured: dict[str, Any] = {"intra_op_parallelism": winner.config.get("intra_op_parallelism")}
    if read:
        measured["read_gbps"] = round(winner.read_gbps, 3)
    if write:
        measured["write_gbps"] = round(winner.write_gbps, 3)
    for key in dict.fromkeys(filesystem_key(d) for d in dirs):
        path = save_tuned_gds(key, measured)
        print(f"Saved GPUDirect Storage figures for file system {key} in {path}")


def _open_log(log_dir: str | None) -> Any:
    if not log_dir:
        return None
    try:
        os.makedirs(log_dir, exist_ok=True)
        name = time.strftime("tune-%Y%m%d-%H%M%S") + f"-{os.getpid()}.jsonl"
        return open(os.path.join(log_dir, name), "w", encoding="utf-8")
    except OSError as exc:
        raise CliError(f"--log_dir {log_dir}: {exc}", USAGE) from None


def _log(log: Any, result: Result, dirs: Sequence[str], io_size: int, phase: str) -> None:
    if log is None:
        return
    record: dict[str, Any] = {
        "phase": phase,
        **result.config,
        "io_size": io_size,
        "dirs": list(dirs),
    }
    record["read_gbps"] = [round(x, 4) for x in result.read]
    record["write_gbps"] = [round(x, 4) for x in result.write]
    if result.error:
        record["error"] = result.error
    log.write(json.dumps(record) + "\n")
    log.flush()


# ------------------------------------------------------------------------ plotting


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'fastckpt[plot]')",
            USAGE,
        ) from None


def plot_results(
    results: Iterable[Result],
    sweep: dict[str, list[Any]],
    path: str,
    *,
    read: bool = True,
    write: bool = True,
) -> None:
    """Draws GB/s against each swept parameter, one line per engine and direction.

    Each point is the best median over the other parameters at that value: how far the
    device can go with the parameter set so. Parameters with a single value are left out
    (with none left, GB/s is drawn per engine).

    Example:
        >>> import tempfile, os
        >>> rs = [Result({"block_size": b, "queue_depth": 8, "single_submit": False,
        ...               "overlap_events": True, "intra_op_parallelism": 1, "engine": "threads"},
        ...              read=[b / 1e6], write=[b / 2e6]) for b in (1 << 18, 1 << 20)]
        >>> sweep = {"block_size": [1 << 18, 1 << 20], "queue_depth": [8], "engine": ["threads"],
        ...          "single_submit": [False], "overlap_events": [True], "intra_op_parallelism": [1]}
        >>> out = os.path.join(tempfile.mkdtemp(), "sweep.png")
        >>> plot_results(rs, sweep, out)  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in results if not r.error]
    panels = [p for p in PARAMETERS if len(sweep.get(p, [])) > 1] or ["engine"]
    directions = [d for d, on in (("read", read), ("write", write)) if on]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, param in zip(axes[0], panels):
        values = sweep[param]
        positions = list(range(len(values)))
        lines = (
            [(engine, d) for engine in sweep["engine"] for d in directions]
            if param != "engine"
            else [(None, d) for d in directions]
        )
        colors = {engine: f"C{i}" for i, engine in enumerate(sweep["engine"])}
        for engine, direction in lines:
            ys = []
            for value in values:
                rates = [
                    getattr(r, f"{direction}_gbps")
                    for r in good
                    if r.config[param] == value and (engine is None or r.config["engine"] == engine)
                ]
                ys.append(max(rates) if rates else math.nan)
            label = f"{engine} {direction}" if engine else direction
            ax.plot(
                positions,
                ys,
                marker="o",
                linestyle="-" if direction == "read" else "--",
                color=colors.get(engine, "C0" if direction == "read" else "C1"),
                label=label,
            )
        ax.set_xticks(positions)
        ax.set_xticklabels(
            [str(v).lower() if isinstance(v, bool) else _show(param, v) for v in values]
        )
        ax.set_xlabel(param)
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle("fastckpt tune: best GB/s at each setting")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
