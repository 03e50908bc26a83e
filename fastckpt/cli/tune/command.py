"""``fastckpt tune``: find the fastest I/O configuration for a file system, and remember it.

The options are those of DeepSpeed's ``ds_nvme_tune`` (same names), plus ``--engine`` and
``--plot``. Every configuration of the sweep writes ``--io_size`` bytes to a fresh file in
each ``--nvme_dir`` (timed until fsync returns) and reads a prepared file back from a cold
cache. The winner is saved with :func:`fastckpt.config.save_tuned`, keyed by the file
system of each directory; from then on ``aio_handle()`` with no arguments and
``save``/``load`` on that file system use it (explicit arguments still win). The entry
records how much of the sweep was measured: a run that measured less (a ``--budget`` that
ended the sweep early, a smaller ``--io_size``) does not replace it without ``--force``, and
``--reset`` forgets it. Every multi-word option has both spellings (``--io_size``,
``--io-size``).

Example (shell)::

    $ fastckpt tune --nvme_dir /local_nvme --io_size 1G
    Running fastckpt I/O tuning on ['/local_nvme'] ...
    Best performance (GB/sec): read = 3.69, write = 3.18
    ...
    To undo: fastckpt tune --reset --nvme_dir /local_nvme ...

Example (Python):
    >>> from fastckpt.cli import main
    >>> main(["tune", "--help"])  # doctest: +ELLIPSIS
    usage: fastckpt tune ...
    0
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from fastckpt.bench.caches import PageCache
from fastckpt.bench.units import format_bytes
from fastckpt.cli._common import (
    ENGINE_CHOICES,
    USAGE,
    CliError,
    check_engines,
    engine_list_arg,
    make_directory,
    positive_int_arg,
    removed_if_left_empty,
    require_cuda,
    require_gds,
    size_arg,
    spellings,
)
from fastckpt.cli.cache_options import add_cache_options, drop_all_caches
from fastckpt.cli.tune.plot import plot_results, require_matplotlib
from fastckpt.cli.tune.read_modes import measure_read_modes, remember_read_modes
from fastckpt.cli.tune.sweep import (
    QUICK_BUDGET,
    QUICK_DESCRIPTION,
    Result,
    SweepFiles,
    configurations,
    confirmations,
    default_sweep,
    gds_sweep,
    load_sweep_config,
    quick_sweep,
    run_sweep,
)
from fastckpt.cli.tune.sweep_log import SweepLog
from fastckpt.cli.tune.tuned_file import Coverage, Outcome, forget, save_gds_winner, save_winner
from fastckpt.cli.tune.write_modes import measure_write_modes, remember_write_modes
from fastckpt.config import READ_MODES
from fastckpt.progress import progress_bar

__all__ = ["add_parser", "run", "why_winner"]


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
            "$FASTCKPT_CONFIG, else $XDG_CONFIG_HOME/fastckpt/tuned.json), with how much was "
            "measured. A run that measured less than the entry saved there (a --budget that "
            "ended the sweep, a smaller --io_size) does not replace it without --force; "
            "--reset forgets it. Options follow DeepSpeed's ds_nvme_tune (either spelling: "
            "--io_size or --io-size)."
        ),
    )
    parser.add_argument(
        *spellings("--nvme_dir"),
        dest="nvme_dir",
        nargs="+",
        required=True,
        metavar="NVME_DIR",
        help="directory (one or more) in which to perform the I/O tests; a writable "
        "directory on the device to tune (its last component is created when missing, and "
        "removed again when the sweep leaves it empty)",
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
        help=f"a short sweep ({QUICK_DESCRIPTION}) within --budget, "
        f"{QUICK_BUDGET:.0f} s unless given",
    )
    parser.add_argument(
        *spellings("--sweep_config"),
        dest="sweep_config",
        metavar="FILE",
        help='JSON object of value lists per parameter, e.g. {"block_size": ["256K", '
        '"1M"], "queue_depth": [32], "overlap_events": [true]}; keys left out keep '
        "the default lists; DeepSpeed's ds_nvme_tune sweep files are accepted "
        "(sequential_requests, io_parallel, ...)",
    )
    parser.add_argument(
        *spellings("--no_read"), dest="no_read", action="store_true", help="do not measure reads"
    )
    parser.add_argument(
        *spellings("--no_write"),
        dest="no_write",
        action="store_true",
        help="do not measure writes",
    )
    parser.add_argument(
        *spellings("--io_size"),
        dest="io_size",
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
        *spellings("--flush_page_cache"),
        dest="flush_page_cache",
        action="store_true",
        help="--drop-all-caches, and fail when the whole page cache cannot be dropped (needs "
        "root); by default only the files read are evicted from the cache",
    )
    add_cache_options(parser)
    parser.add_argument(
        "--force",
        "--replace",
        dest="replace",
        action="store_true",
        help="save the result even where the file system's tuned entry measured more "
        "(more configurations, or as many with more bytes); without it such an entry is kept",
    )
    parser.add_argument(
        "--reset",
        action="store_true",
        help="measure nothing: forget the tuned entries of the file systems of --nvme_dir, "
        "so saves and loads there go back to the built-in defaults",
    )
    parser.add_argument(
        *spellings("--log_dir"),
        dest="log_dir",
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
        "--busy",
        type=_busy_arg,
        default=None,
        metavar="N",
        help="time the read modes a second time beside N processes running a training-like "
        "CPU loop, and remember that winner for loads that find the cores busy (default: "
        "one per core; 0: no contended pass)",
    )
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


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt tune`` with parsed arguments; returns the exit status. An
    ``--nvme_dir`` it created is removed again when the sweep leaves it empty."""
    with removed_if_left_empty(args.nvme_dir):
        return _tune(args)


def _tune(args: argparse.Namespace) -> int:
    if args.reset:
        return _reset(args.nvme_dir)
    if args.no_read and args.no_write:
        raise CliError("--no_read and --no_write leave nothing to measure", USAGE)
    if args.gds:
        require_gds()
    elif args.gpu:
        require_cuda("--gpu")
    if args.plot:
        require_matplotlib()
        plot_dir = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(plot_dir) or not os.access(plot_dir, os.W_OK):
            raise CliError(f"--plot {args.plot}: cannot write in {plot_dir}", USAGE)
    sweep = _sweep(args)
    budget = args.budget if args.budget is not None else (QUICK_BUDGET if args.quick else None)
    if budget is not None and not budget > 0:
        raise CliError(f"--budget {args.budget}: must be a positive number of seconds", USAGE)
    dirs = _check_dirs(args.nvme_dir, args.io_size)
    read, write = not args.no_read, not args.no_write
    if args.flush_page_cache and args.no_drop_caches:
        raise CliError("--flush_page_cache and --no-drop-caches ask for opposite things", USAGE)
    drop_all = drop_all_caches(args) or args.flush_page_cache
    # Writes need no cold cache: the machine's cache is dropped only when reads are measured.
    cache = PageCache(allow_drop=drop_all and read)
    if args.flush_page_cache and not cache.can_drop:
        raise CliError(f"--flush_page_cache: cannot drop the page cache: {cache.describe()}", USAGE)

    configs = configurations(sweep)
    print(
        f"Running fastckpt I/O tuning on {dirs}: {len(configs)} configurations, "
        f"{format_bytes(args.io_size)} per directory, {args.loops} run(s) each, "
        f"engines: {', '.join(sweep['engine'])}",
        flush=True,
    )
    _print_conditions(dirs, cache, read)

    log = SweepLog.open(args.log_dir, dirs=dirs, io_size=args.io_size) if args.log_dir else None
    started = time.perf_counter()
    files = None
    try:
        files = SweepFiles(dirs, args.io_size, gpu=args.gpu, gds=args.gds, cache=cache)
        if read:
            files.prepare_reads()
        total = len(configs) + confirmations(len(configs))
        with progress_bar(total, "tuning", unit="config") as bar:
            results = run_sweep(
                files,
                configs,
                runs=args.loops,
                read=read,
                write=write,
                deadline=None if budget is None else started + budget,
                observer=_Shown(bar, log, budget, verbose=args.verbose),
            )
    finally:
        if files is not None:
            files.close()
        if log is not None:
            log.close()
    elapsed = time.perf_counter() - started

    good = [r for r in results if not r.error]
    if not good:
        raise CliError(f"every configuration failed; the first: {results[0].summary()}")
    winner = max(good, key=Result.score)
    _report(good, winner, read, write, elapsed)
    if log is not None:
        print(f"Measurements logged to {log.path}")
    coverage = Coverage(len(results), len(configs), args.io_size)
    if args.gds:
        outcomes = save_gds_winner(
            winner, dirs, coverage, read=read, write=write, replace=args.replace
        )
    else:
        outcomes = save_winner(
            winner,
            dirs,
            coverage,
            loops=args.loops,
            gpu=args.gpu,
            cache_dropped=cache.can_drop,
            read=read,
            write=write,
            replace=args.replace,
        )
    _print_outcomes(outcomes, coverage, dirs, gds=args.gds)
    if not args.gds:  # beside a configuration this tune saved (not a kept one)
        saved = [d for d, outcome in zip(dirs, _outcome_per_dir(dirs, outcomes)) if outcome.saved]
        if saved and write:  # the direct saves use the settings just saved
            _tune_write_modes(saved, args)
        if saved and read:
            _tune_read_modes(saved, args, cache)
    if args.plot:
        plot_results(results, sweep, args.plot, read=read, write=write)
        print(f"Plot written to {args.plot}")
    return 0


def _outcome_per_dir(dirs: Sequence[str], outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The outcome of each directory's file system."""
    from fastckpt.config import filesystem_key

    by_key = {outcome.key: outcome for outcome in outcomes}
    return [by_key[filesystem_key(d)] for d in dirs]


def _busy_arg(text: str) -> int:
    """argparse type for ``--busy``: a count of processes, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 0 or a positive integer, got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {text!r}")
    return value


def _tune_read_modes(dirs: Sequence[str], args: argparse.Namespace, cache: PageCache) -> None:
    """Times cold checkpoint loads in each read mode and remembers the fastest per file
    system, on the machine as it is and again beside ``--busy`` training-like processes
    (see :mod:`fastckpt.cli.tune.read_modes`)."""
    from fastckpt.io.cpu_load import cores

    busy = cores() if getattr(args, "busy", None) is None else args.busy
    loops = max(3, args.loops)
    for beside in (0, busy) if busy else (0,):
        how = f", beside {beside} busy processes" if beside else ""
        print(
            f"Measuring cold checkpoint loads per read mode ({', '.join(READ_MODES)}){how}...",
            flush=True,
        )
        figures = measure_read_modes(dirs, args.io_size, cache, loops, busy=beside)
        for one in figures:
            print(f"  {one.describe()}")
        remember_read_modes(figures)


def _tune_write_modes(dirs: Sequence[str], args: argparse.Namespace) -> None:
    """Times checkpoint saves (until durable) with O_DIRECT and through the page cache and
    remembers the fastest per file system (see :mod:`fastckpt.cli.tune.write_modes`)."""
    print("Measuring checkpoint saves per write mode (direct, buffered)...", flush=True)
    figures = measure_write_modes(dirs, args.io_size, max(3, args.loops))
    for one in figures:
        print(f"  {one.describe()}")
    remember_write_modes(figures)


def _engines_to_sweep(args: argparse.Namespace) -> list[str]:
    if args.engine:
        return check_engines(name for group in args.engine for name in group)
    from fastckpt.io.engines import ENGINE_NAMES, engines

    info = engines()
    return [name for name in ENGINE_NAMES if info[name].available]


def _sweep(args: argparse.Namespace) -> dict[str, list[Any]]:
    """The values to sweep, from --gds, --engine, --sweep_config and --quick."""
    if args.gds:
        sweep = gds_sweep()
        if args.sweep_config:
            sweep = load_sweep_config(args.sweep_config, sweep)
        sweep["engine"] = ["gds"]
        return sweep
    engines = _engines_to_sweep(args)
    if args.sweep_config:
        sweep = load_sweep_config(args.sweep_config, default_sweep(engines))
        # --engine overrides the file's engine list.
        sweep["engine"] = engines if args.engine else check_engines(sweep["engine"])
    else:
        sweep = default_sweep(engines)
    return quick_sweep(sweep) if args.quick else sweep


def _print_conditions(dirs: Sequence[str], cache: PageCache, read: bool) -> None:
    """What the figures will mean: memory file systems, cold reads, O_DIRECT refused."""
    from fastckpt.bench.filesystems import direct_io_supported, on_memory_filesystem

    for d in dirs:
        if on_memory_filesystem(d):
            print(f"  {d}: this file system keeps files in memory; its speeds are not a device's")
    if read:
        print(f"Cold reads: {cache.describe()}", flush=True)
        for d in dirs:
            if not direct_io_supported(d):
                print(f"  {d}: the file system refuses O_DIRECT, buffered I/O", flush=True)


class _Shown:
    """The sweep's progress: the bar, --verbose lines and the --log_dir file."""

    def __init__(self, bar: Any, log: Any, budget: float | None, *, verbose: bool) -> None:
        self.bar, self.log, self.budget, self.verbose = bar, log, budget, verbose
        self.best = -1.0

    def measured(self, result: Result, phase: str) -> None:
        if self.log is not None:
            self.log.write(result, phase)
        if self.verbose:
            _emit(self.bar, result.summary() if phase == "sweep" else "again: " + result.summary())
        if phase == "sweep":
            self.best = max(self.best, result.score())
            self.bar.set_postfix_str(f"best {self.best:.2f} GB/s")
        self.bar.update(1)

    def budget_spent(self, measured: int, total: int) -> None:
        _emit(
            self.bar,
            f"Time budget of {self.budget:.0f} s spent after {measured} of "
            f"{total} configurations; choosing among those measured",
        )


def _check_dirs(dirs: Sequence[str], io_size: int) -> list[str]:
    checked: list[str] = []
    for d in dirs:
        if make_directory("--nvme_dir", d):
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


def _undo_command(dirs: Sequence[str]) -> str:
    return "fastckpt tune --reset --nvme_dir " + " ".join(shlex.quote(d) for d in dirs)


def _print_outcomes(
    outcomes: Sequence[Outcome], coverage: Coverage, dirs: Sequence[str], *, gds: bool
) -> None:
    """Where each result went, or why it was not saved, and how to undo it."""
    what = "GPUDirect Storage figures" if gds else "Tuned configuration"
    for outcome in outcomes:
        if outcome.saved:
            replaced = " (replacing the previous entry)" if outcome.existed else ""
            print(
                f"{what} saved for file system {outcome.key} in {outcome.path}{replaced}: "
                f"{coverage.describe()}; from now on the default of saves and loads there"
            )
        else:
            before = outcome.previous.describe() if outcome.previous else "a complete sweep"
            when = f", {outcome.previous_time}" if outcome.previous_time else ""
            print(
                f"NOT saved for file system {outcome.key}: its entry in {outcome.path} measured "
                f"more ({before}{when}) than this run ({coverage.describe()}); it stays the "
                "default there. Pass --force to replace it."
            )
    if not coverage.complete and any(o.saved for o in outcomes):
        print(
            f"Note: the sweep ended early ({coverage.describe()}): the configuration saved is "
            "the best of those measured, not of the whole sweep"
        )
    if any(o.saved for o in outcomes):
        keys = ", ".join(repr(o.key) for o in outcomes if o.saved)
        print(
            f'To undo: {_undo_command(dirs)} (or delete {keys} under "filesystems" in '
            f"{outcomes[0].path})"
        )


def _reset(dirs: Sequence[str]) -> int:
    """``--reset``: forgets the tuned entries of the file systems of ``dirs``."""
    from fastckpt.config import filesystem_key

    keys = list(dict.fromkeys(filesystem_key(d) for d in dirs))
    try:
        path, removed = forget(keys)
    except (OSError, ValueError) as exc:
        raise CliError(f"--reset: cannot rewrite the tuned configuration: {exc}") from None
    for key in keys:
        if key in removed:
            print(f"Forgot the tuned entry of file system {key} in {path}")
        else:
            print(f"No tuned entry for file system {key} in {path}; nothing to forget")
    return 0
