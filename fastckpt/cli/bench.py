"""``fastckpt bench``: measure one I/O configuration, or checkpoints against torch and safetensors.

Raw mode takes the options of DeepSpeed's ``ds_io`` (same names): it writes (or with
``--read`` reads) ``--io_size`` bytes in ``--folder`` through an ``aio_handle``, ``--loops``
times, and prints GB/s per loop and the median. Options left out come from the tuned
configuration of that file system (``fastckpt tune``), else the defaults.

``--checkpoint SIZE`` saves and loads a synthetic LLM-like state dict of SIZE with
fastckpt, ``torch.save``/``torch.load`` and safetensors in one run, on the same file
system: saves timed until the data is durable (fsync), loads from a cold cache and until
every tensor has been touched. It prints a table of GB/s, CPU seconds and how many times
faster fastckpt is.

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
import math
import os
import shutil
import time
from typing import Any

from fastckpt.cli._common import (
    ENGINE_CHOICES,
    FAILURE,
    USAGE,
    CliError,
    PageCache,
    bool_arg,
    check_engines,
    direct_io_supported,
    format_bytes,
    gbps,
    median,
    positive_int_arg,
    require_cuda,
    require_gds,
    size_arg,
    warn,
)

__all__ = ["LIBRARIES", "MEMORY_PEERS", "add_parser", "run", "run_checkpoint", "run_raw"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``bench`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "bench",
        help="measure one I/O configuration, or checkpoint save/load against torch and safetensors",
        description=(
            "Raw mode (the options of DeepSpeed's ds_io): write, or with --read read, --io_size "
            "bytes in --folder with one aio_handle configuration and print GB/s per loop and the "
            "median. Settings left out come from `fastckpt tune`'s result for that file system. "
            "--checkpoint SIZE instead saves and loads a synthetic LLM-like state dict with "
            "fastckpt, torch and safetensors and prints a comparison table; --regime memory "
            "makes it a memory-speed comparison (files in tmpfs or the page cache) with more peers."
        ),
    )
    parser.add_argument(
        "--folder",
        metavar="DIR",
        help="directory to do I/O in (default: the current directory; /dev/shm with "
        "--regime memory)",
    )
    parser.add_argument(
        "--io_size",
        type=size_arg,
        default=size_arg("400M"),
        help="bytes per loop in raw mode, e.g. 400M, 1G (default 400M)",
    )
    parser.add_argument("--block_size", type=size_arg, help="bytes per I/O request, e.g. 1M")
    parser.add_argument(
        "--queue_depth", type=positive_int_arg, help="requests in flight per thread"
    )
    parser.add_argument(
        "--intra_op_parallelism",
        "--io_parallel",
        dest="intra_op_parallelism",
        type=positive_int_arg,
        help="threads each operation is split across",
    )
    parser.add_argument(
        "--single_submit",
        nargs="?",
        const=True,
        type=bool_arg,
        metavar="BOOL",
        help="submit requests one at a time (alone: true)",
    )
    parser.add_argument(
        "--overlap_events",
        nargs="?",
        const=True,
        type=bool_arg,
        metavar="BOOL",
        help="submit new requests as others complete (alone: true)",
    )
    parser.add_argument("--engine", choices=("auto",) + ENGINE_CHOICES, help="I/O engine")
    parser.add_argument("--read", action="store_true", help="measure reads (default: writes)")
    parser.add_argument(
        "--loops",
        type=positive_int_arg,
        default=3,
        help="repetitions; the median is reported (default 3)",
    )
    parser.add_argument(
        "--gpu", action="store_true", help="move data to/from GPU memory (needs CUDA)"
    )
    parser.add_argument(
        "--gds",
        action="store_true",
        help="use NVIDIA GPUDirect Storage (needs CUDA and cuFile; raw mode only)",
    )
    parser.add_argument(
        "--validate", action="store_true", help="check the bytes after every loop (untimed)"
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
    """The measured directory, created (with its parents) when it does not exist yet."""
    if not os.path.exists(folder):
        try:
            os.makedirs(folder)
        except OSError as exc:
            raise CliError(f"--folder {folder}: cannot create it: {exc.strerror}", USAGE) from None
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
    """Runs ``fastckpt bench`` with parsed arguments; returns the exit status."""
    if args.folder is None:
        memory = args.regime == "memory" and os.path.isdir("/dev/shm")
        args.folder = "/dev/shm" if memory else "."
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
    from fastckpt.cli._rawio import check_pattern, make_buffer, make_handle, timed_read, timed_write
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
    cache = PageCache()
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
            print(f"Loop {loop}: {op} {rates[-1]:.3g} GB/s ({seconds:.3f} s)", flush=True)
            if args.validate:
                where = check_pattern(buffer) if args.read else _check_file(path)
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
    print(f"Median {op}: {median(rates):.3g} GB/s")
    return 0


def _check_file(path: str) -> int:
    """Offset of the first byte of the file that differs from the fill pattern, or -1."""
    import torch

    from fastckpt.cli._rawio import PATTERN_BLOCK, pattern_block

    block = pattern_block()
    offset = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(PATTERN_BLOCK)
            if not chunk:
                return -1
            got = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
            diff = torch.nonzero(got != block[: got.numel()])
            if diff.numel():
                return offset + int(diff[0])
            offset += len(chunk)


# ------------------------------------------------------------------------ checkpoints

#: (row name, file suffix, saver, loader) of the libraries compared: names in
#: :data:`fastckpt.cli.peers.SAVERS` and :data:`~fastckpt.cli.peers.LOADERS`.
LIBRARIES: list[tuple[str, str, str, str]] = [
    ("fastckpt", ".safetensors", "fastckpt", "fastckpt"),
    ("torch.save/load", ".pt", "torch", "torch"),
    ("safetensors", ".st.safetensors", "safetensors", "safetensors"),
]

#: Rows added by ``--regime memory``: loaders of the safetensors row's file (no save).
MEMORY_PEERS: list[tuple[str, str]] = [
    ("runai-streamer", "runai"),
    ("fastsafetensors", "fastsafetensors"),
    ("preadv-ceiling", "preadv"),
]


def _rows(regime: str, device: str) -> list[tuple[str, str | None, str, str]]:
    """(row, saver or None, loader, file key) of each row whose library is installed."""
    from fastckpt.cli.peers import LOADERS, Skip

    rows: list[tuple[str, str | None, str, str]] = []
    for name, _, saver, loader in LIBRARIES:
        if saver == "safetensors":
            try:
                import safetensors.torch  # noqa: F401
            except ImportError:
                warn("safetensors is not installed: its row is left out (pip install safetensors)")
                continue
        rows.append((name, saver, loader, name))
    if regime == "memory" and any(r[0] == "safetensors" for r in rows):
        for name, loader in MEMORY_PEERS:
            try:
                LOADERS[loader].setup(os.devnull, device)
            except Skip as why:
                warn(f"{name}: left out: {why}")
                continue
            except Exception:  # noqa: BLE001 - os.devnull is no checkpoint; setup got this far
                pass
            rows.append((name, None, loader, "safetensors"))
    return rows


def run_checkpoint(args: argparse.Namespace) -> int:
    """``--checkpoint SIZE``: the comparison table of fastckpt, torch and safetensors (and,
    with ``--regime memory``, the Run:ai streamer, fastsafetensors and the preadv ceiling)."""
    from fastckpt.cli.measure import MEMORY_FILESYSTEMS, filesystem_of, touch, warm_page_cache
    from fastckpt.cli.peers import LOADERS, SAVERS
    from fastckpt.cli.synthetic import MIN_NBYTES, llm_like_state_dict, state_dict_nbytes
    from fastckpt.config import set_defaults

    if args.checkpoint < MIN_NBYTES:
        raise CliError(f"--checkpoint must be at least {MIN_NBYTES} bytes", USAGE)
    memory = args.regime == "memory"
    device = "cuda" if args.gpu else "cpu"
    rows = _rows(args.regime, device)
    folder = _check_folder(args.folder, 2 * args.checkpoint + (64 << 20))
    explicit = _explicit_io(args)
    set_defaults(**explicit)  # fastckpt.save/load take the I/O settings given here

    state = llm_like_state_dict(args.checkpoint)
    nbytes = state_dict_nbytes(state)
    if args.gpu:
        state = {name: tensor.to(device) for name, tensor in state.items()}
    cache = PageCache()
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.values()})
    fs_type = filesystem_of(folder)[0]
    print(
        f"fastckpt bench --checkpoint: {format_bytes(nbytes)} in {len(state)} tensors "
        f"({' + '.join(dtypes)}), {args.loops} loop(s), {device} tensors, in {folder} ({fs_type})",
        flush=True,
    )
    if memory:
        where = "a memory file system" if fs_type in MEMORY_FILESYSTEMS else "the page cache"
        reads = f"memory regime: every load reads its file from {where}"
    else:
        reads = f"cold reads: {cache.describe()}"
    print(
        f"Saves timed until fsync returns; loads until every tensor is touched; {reads}", flush=True
    )
    if explicit:
        print(f"fastckpt I/O settings: {json.dumps(explicit)}", flush=True)

    tag = f".fastckpt-bench-{os.getpid()}"
    paths = {name: os.path.join(folder, tag + suffix) for name, suffix, _, _ in LIBRARIES}
    timings: dict[str, dict[str, list[float]]] = {
        row: {"save": [], "load": [], "save_cpu": [], "load_cpu": []} for row, *_ in rows
    }
    from fastckpt.progress import progress_bar

    try:
        with progress_bar(args.loops * len(rows), "benchmarking", unit="run") as bar:
            # Libraries take turns within each loop, so a drifting device treats all alike.
            for _loop in range(args.loops):
                for row, saver, loader, file_key in rows:
                    path = paths[file_key]
                    if saver is not None:
                        save = SAVERS[saver].setup(state, path)
                        wall, cpu = time.perf_counter(), time.process_time()
                        save()  # returns once the file is durable
                        timings[row]["save"].append(time.perf_counter() - wall)
                        timings[row]["save_cpu"].append(time.process_time() - cpu)
                    load = LOADERS[loader].setup(path, device)
                    if memory:
                        warm_page_cache([path])
                    else:
                        cache.drop([path])
                    wall, cpu = time.perf_counter(), time.process_time()
                    loaded = load()
                    touch(loaded)
                    timings[row]["load"].append(time.perf_counter() - wall)
                    timings[row]["load_cpu"].append(time.process_time() - cpu)
                    if args.validate:
                        _validate_loaded(row, state, loaded, path)
                    del loaded
                    bar.update(1)
    finally:
        set_defaults(**{key: None for key in explicit})
        for path in paths.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    _print_table(timings, nbytes)
    if args.validate:
        print("Validation passed: every library loaded back exactly what was saved")
    return 0


def _validate_loaded(name: str, state: dict[str, Any], loaded: Any, path: str) -> None:
    import torch

    if set(loaded) == {"file"}:  # the preadv ceiling: the whole file's bytes
        with open(path, "rb") as f:
            if loaded["file"].numpy().tobytes() != f.read():
                raise CliError(f"validation failed: {name} read other bytes than the file holds")
        return
    if not isinstance(loaded, dict) or set(loaded) != set(state):
        raise CliError(f"validation failed: {name} loaded other keys than were saved")
    for key, tensor in state.items():
        got = loaded[key]
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(got, tensor):
            raise CliError(f"validation failed: {name} loaded tensor {key!r} differently")


def _print_table(timings: dict[str, dict[str, list[float]]], nbytes: int) -> None:
    def rate(seconds: list[float]) -> float:
        return gbps(nbytes, median(seconds)) if seconds else math.nan

    def num(value: float, spec: str) -> str:
        # A row without a save (a loader only) shows a dash, aligned like a number.
        return format("—", spec.split(".")[0]) if math.isnan(value) else format(value, spec)

    def ratio(base: float, value: float) -> str:
        return "—" if math.isnan(value) or math.isnan(base) else f"{base / value:.2f}x"

    rows = [
        (name, rate(t["save"]), rate(t["load"]), median(t["save_cpu"]), median(t["load_cpu"]))
        for name, t in timings.items()
    ]
    base_save, base_load = rows[0][1], rows[0][2]
    header = (
        f"{'library':<16}  {'save GB/s':>9}  {'load GB/s':>9}  {'save CPU s':>10}  "
        f"{'load CPU s':>10}  fastckpt speedup (save / load)"
    )
    print()
    print(header)
    print("-" * len(header))
    for name, save, load, save_cpu, load_cpu in rows:
        print(
            f"{name:<16}  {num(save, '>9.3g')}  {num(load, '>9.3g')}  {num(save_cpu, '>10.2f')}  "
            f"{num(load_cpu, '>10.2f')}  {ratio(base_save, save)} / {ratio(base_load, load)}"
        )
    print(
        "\nGB/s: 10^9 bytes of tensor data per second, median of the loops. CPU s: CPU time of "
        "this process (all threads). Speedup: fastckpt's GB/s over the library's."
    )
