"""``fastckpt bench``: measure one I/O configuration, or checkpoints against torch and safetensors.

``--checkpoint SIZE`` saves and loads a synthetic LLM-like state dict of SIZE with
fastckpt, ``torch.save``/``torch.load`` and safetensors in one run, on the same file
system: saves timed until the data is durable (fsync), loads from a cold cache and until
every tensor has been touched. In the disk regime the device's ceiling (a raw O_DIRECT
write + fsync and cold read of as many bytes) runs in the same loops. It prints a table of
GB/s (10**9 bytes per second) with the spread of the loops, CPU seconds, how many times
faster fastckpt is, and a one-line verdict (e.g. "save: all at the disk's limit"). The
memory regime adds ``fastckpt.load(mmap=True)`` and says that safetensors' figure is a lazy
mapping set against fastckpt's copy.

Without ``--checkpoint``, raw mode takes the options of DeepSpeed's ``ds_io`` (same names):
it writes (or with ``--read`` reads) ``--io_size`` bytes in ``--folder`` through an
``aio_handle``, ``--loops`` times, and prints the throughput per loop and the median in GB/s (10**9 bytes per second)
and, beside it, in GiB/s (2**30 bytes per second): the unit of the figures ``ds_io`` prints
as "GB/sec", so the two compare directly. Options left out come from the tuned
configuration of that file system (``fastckpt tune``), else the defaults.

Cold reads: before each, the files about to be read are written back and evicted from the
page cache (``posix_fadvise(DONTNEED)``), leaving the rest of the machine's cache alone;
``--drop-all-caches`` also drops the whole machine's page cache, as root.
``--folder`` creates its last component only, never missing parents, and a folder it created
is removed again when the run leaves it empty. Every multi-word option
has both spellings (``--io_size``, ``--io-size``).

Example (shell)::

    $ fastckpt bench --folder /local_nvme --io_size 1G --read --loops 5
    $ fastckpt bench --folder /local_nvme --checkpoint 2G
    $ fastckpt bench --checkpoint 1G --regime memory     # in /dev/shm, with more peers

Example (Python):
    >>> from fastckpt.cli import main
    >>> main(["bench", "--help"])  # doctest: +ELLIPSIS
    usage: fastckpt bench ...
    0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

from fastckpt.bench.units import GiB, format_bytes, gbps, gibps, median
from fastckpt.cli._common import (
    ENGINE_CHOICES,
    FAILURE,
    USAGE,
    CliError,
    bool_arg,
    check_engines,
    make_directory,
    positive_int_arg,
    removed_if_left_empty,
    require_cuda,
    require_gds,
    size_arg,
    spellings,
    warn,
)
from fastckpt.cli.cache_options import add_cache_options, drop_all_caches

__all__ = ["add_parser", "run", "run_checkpoint", "run_raw"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``bench`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "bench",
        help="measure one I/O configuration, or checkpoint save/load against torch and safetensors",
        description=(
            "--checkpoint SIZE saves and loads a synthetic LLM-like state dict with fastckpt, "
            "torch and safetensors in --folder and prints a comparison table; --regime memory "
            "makes it a memory-speed comparison (files in tmpfs or the page cache) with more "
            "peers. Without --checkpoint, raw mode (the options of DeepSpeed's ds_io): write, or "
            "with --read read, --io_size bytes in --folder with one aio_handle configuration and "
            "print GB/s (10^9 bytes/s) per loop and the median, with GiB/s (2^30 bytes/s, the "
            "unit of ds_io's 'GB/sec') beside them. I/O settings left out come from `fastckpt "
            "tune`'s result for that file system."
        ),
    )
    parser.add_argument(
        "--checkpoint",
        type=size_arg,
        metavar="SIZE",
        help="compare checkpoint save/load of a synthetic LLM-like state dict of "
        "SIZE (e.g. 1G) across fastckpt, torch and safetensors",
    )
    parser.add_argument(
        "--regime",
        choices=("disk", "memory"),
        default="disk",
        help="with --checkpoint: disk (cold reads, the default) or memory (loads from tmpfs or "
        "the page cache, --folder defaulting to /dev/shm, plus the Run:ai streamer, "
        "fastsafetensors and the parallel-preadv ceiling where installed)",
    )
    parser.add_argument(
        "--folder",
        metavar="DIR",
        help="directory to do I/O in (default: the current directory; /dev/shm with "
        "--regime memory); created when missing (its last component), and removed again "
        "when the run leaves it empty",
    )
    parser.add_argument(
        "--loops",
        type=positive_int_arg,
        default=3,
        help="repetitions; the median is reported (default 3)",
    )
    parser.add_argument(
        "--validate", action="store_true", help="check the bytes after every loop (untimed)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="move data to/from GPU memory (needs CUDA)"
    )
    add_cache_options(parser)
    raw = parser.add_argument_group(
        "I/O settings, the options of DeepSpeed's ds_io (--io_size, --read, --gds: raw mode "
        "only; the others also set fastckpt's I/O under --checkpoint)"
    )
    raw.add_argument(
        *spellings("--io_size"),
        dest="io_size",
        type=size_arg,
        default=size_arg("400M"),
        help="bytes per loop in raw mode, e.g. 400M, 1G (default 400M)",
    )
    raw.add_argument(
        *spellings("--block_size"),
        dest="block_size",
        type=size_arg,
        help="bytes per I/O request, e.g. 1M",
    )
    raw.add_argument(
        *spellings("--queue_depth"),
        dest="queue_depth",
        type=positive_int_arg,
        help="requests in flight per thread",
    )
    raw.add_argument(
        *spellings("--intra_op_parallelism", "--io_parallel"),
        dest="intra_op_parallelism",
        type=positive_int_arg,
        help="threads each operation is split across",
    )
    raw.add_argument(
        *spellings("--single_submit"),
        dest="single_submit",
        nargs="?",
        const=True,
        type=bool_arg,
        metavar="BOOL",
        help="submit requests one at a time (alone: true)",
    )
    raw.add_argument(
        *spellings("--overlap_events"),
        dest="overlap_events",
        nargs="?",
        const=True,
        type=bool_arg,
        metavar="BOOL",
        help="submit new requests as others complete (alone: true)",
    )
    raw.add_argument("--engine", choices=("auto",) + ENGINE_CHOICES, help="I/O engine")
    raw.add_argument("--read", action="store_true", help="measure reads (default: writes)")
    raw.add_argument(
        "--gds",
        action="store_true",
        help="use NVIDIA GPUDirect Storage (needs CUDA and cuFile; raw mode only)",
    )
    parser.set_defaults(run=run)
    return parser


def _explicit_io(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "block_size",
        "queue_depth",
        "single_submit",
        "overlap_events",
        "intra_op_parallelism",
        "engine",
    )
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _check_folder(folder: str, needed: int) -> str:
    """The measured directory, its last component created when missing (not its parents)."""
    if make_directory("--folder", folder):
        print(f"Created --folder {folder}", flush=True)
    if not os.path.isdir(folder):
        raise CliError(f"--folder {folder}: not a directory", USAGE)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"--folder {folder}: not writable", USAGE)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise CliError(
            f"--folder {folder}: {format_bytes(free)} free, this needs {format_bytes(needed)}",
            USAGE,
        )
    return os.path.realpath(folder)


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt bench`` with parsed arguments; returns the exit status. A ``--folder``
    it created is removed again when the run leaves it empty (as it leaves every folder)."""
    if args.folder is None:
        memory = args.regime == "memory" and os.path.isdir("/dev/shm")
        args.folder = "/dev/shm" if memory else "."
    with removed_if_left_empty([args.folder]):
        return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    if args.regime == "memory" and args.checkpoint is None:
        raise CliError("--regime applies to --checkpoint", USAGE)
    if args.gds:
        require_gds()
    elif args.gpu:
        require_cuda("--gpu")
    if args.engine and args.engine != "auto":
        check_engines([args.engine])
    if args.checkpoint is not None:
        if args.read:
            raise CliError("--read selects raw reads; --checkpoint measures saves and loads", USAGE)
        if args.gds:
            raise CliError("--gds applies to raw I/O, not to --checkpoint", USAGE)
        return run_checkpoint(args)
    return run_raw(args)


# ------------------------------------------------------------------------ raw I/O


def run_raw(args: argparse.Namespace) -> int:
    """Raw mode: one configuration, ``--loops`` timed writes or reads of ``--io_size`` bytes."""
    from fastckpt.bench.caches import PageCache
    from fastckpt.bench.filesystems import direct_io_supported
    from fastckpt.bench.rawio import (
        check_file,
        check_pattern,
        make_buffer,
        make_handle,
        timed_read,
        timed_write,
    )
    from fastckpt.config import IOConfig, resolve_io

    folder = _check_folder(args.folder, args.io_size + (16 << 20))
    config = resolve_io(folder, _explicit_io(args))
    handle = make_handle(config, gds=args.gds)
    settings = {
        k: getattr(config, k)
        for k in (
            "block_size",
            "queue_depth",
            "single_submit",
            "overlap_events",
            "intra_op_parallelism",
        )
    }
    settings["engine"] = "gds" if args.gds else handle.get_engine()
    op = "read" if args.read else "write"
    memory = "GPU" if (args.gpu or args.gds) else "locked host"
    print(
        f"fastckpt bench: {op} {format_bytes(args.io_size)} in {folder}, {args.loops} loop(s), "
        f"{memory} memory",
        flush=True,
    )
    print(f"Configuration: {json.dumps(settings)}", flush=True)
    if not direct_io_supported(folder):
        print(
            "Note: this file system refuses O_DIRECT; I/O goes through the page cache", flush=True
        )
    # Writes need no cold cache: the machine's cache is dropped only for reads.
    cache = PageCache(allow_drop=drop_all_caches(args) and args.read)
    if args.read:
        print(f"Cold reads: {cache.describe()}", flush=True)

    path = os.path.join(folder, f".fastckpt-bench-{os.getpid()}.bin")
    buffer = make_buffer(args.io_size, gpu=args.gpu or args.gds)
    rates: list[float] = []
    try:
        if args.read:
            timed_write(make_handle(IOConfig(engine="auto")), buffer.cpu(), [path])
        for loop in range(1, args.loops + 1):
            if args.read:
                if args.validate:
                    buffer.zero_()
                seconds = timed_read(handle, buffer, [path], cache)
            else:
                seconds = timed_write(handle, buffer, [path])
            rates.append(gbps(args.io_size, seconds))
            print(
                f"Loop {loop}: {op} {rates[-1]:.3g} GB/s = "
                f"{gibps(args.io_size, seconds):.3g} GiB/s ({seconds:.3f} s)",
                flush=True,
            )
            if args.validate:
                where = check_pattern(buffer) if args.read else check_file(path)
                if where >= 0:
                    print(f"Validation FAILED: first wrong byte at offset {where} of {path}")
                    return FAILURE
        if args.validate:
            print(f"Validation passed ({args.loops} loop(s))")
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    middle = median(rates)
    print(f"Median {op}: {middle:.3g} GB/s = {middle * 1e9 / GiB:.3g} GiB/s")
    print("GB/s: 10^9 bytes per second. GiB/s: 2^30 bytes per second, what ds_io prints as GB/sec.")
    return 0


# ------------------------------------------------------------------------ checkpoints


def run_checkpoint(args: argparse.Namespace) -> int:
    """``--checkpoint SIZE``: the comparison table of fastckpt, torch and safetensors (and,
    with ``--regime memory``, the Run:ai streamer, fastsafetensors and the preadv ceiling);
    see :mod:`fastckpt.bench.comparison`."""
    from fastckpt.bench.caches import PageCache
    from fastckpt.bench.comparison import (
        available_rows,
        compare,
        comparison_table,
        validate_loaded,
    )
    from fastckpt.bench.filesystems import filesystem_of
    from fastckpt.bench.synthetic import MIN_NBYTES, llm_like_state_dict, state_dict_nbytes
    from fastckpt.config import set_defaults
    from fastckpt.io.page_cache import MEMORY_FILESYSTEMS
    from fastckpt.progress import progress_bar

    if args.checkpoint < MIN_NBYTES:
        raise CliError(f"--checkpoint must be at least {MIN_NBYTES} bytes", USAGE)
    memory = args.regime == "memory"
    device = "cuda" if args.gpu else "cpu"
    rows = available_rows(memory, device, warn)
    folder = _check_folder(args.folder, 2 * args.checkpoint + (64 << 20))
    explicit = _explicit_io(args)

    state = llm_like_state_dict(args.checkpoint)
    nbytes = state_dict_nbytes(state)
    if args.gpu:
        state = {name: tensor.to(device) for name, tensor in state.items()}
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.values()})
    fs_type = filesystem_of(folder)[0]
    print(
        f"fastckpt bench --checkpoint: {format_bytes(nbytes)} in {len(state)} tensors "
        f"({' + '.join(dtypes)}), {args.loops} loop(s), {device} tensors, in {folder} ({fs_type})",
        flush=True,
    )
    cache = None if memory else PageCache(allow_drop=drop_all_caches(args))
    if cache is None:
        where = "a memory file system" if fs_type in MEMORY_FILESYSTEMS else "the page cache"
        reads = f"memory regime: every load reads its file from {where}"
    else:
        reads = f"cold reads: {cache.describe()}"
    print(
        f"Saves timed until fsync returns; loads until every tensor is touched; {reads}", flush=True
    )
    if explicit:
        print(f"fastckpt I/O settings: {json.dumps(explicit)}", flush=True)

    def check(row: Any, loaded: Any, path: str) -> None:
        wrong = validate_loaded(row.name, state, loaded, path)
        if wrong is not None:
            raise CliError(f"validation failed: {wrong}")

    set_defaults(**explicit)  # fastckpt's save and load take the I/O settings given here
    try:
        with progress_bar(args.loops * len(rows), "benchmarking", unit="run") as bar:
            timings = compare(
                rows,
                state,
                folder,
                loops=args.loops,
                memory=memory,
                device=device,
                check=check if args.validate else None,
                advance=lambda: bar.update(1),
                cache=cache,
                running=bar.set_postfix_str,  # the bar names what runs now
            )
    finally:
        set_defaults(**{key: None for key in explicit})
    print(comparison_table(timings, nbytes, memory=memory))
    if args.validate:
        print("Validation passed: every library loaded back exactly what was saved")
    return 0
