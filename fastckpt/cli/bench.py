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

Example (Python):
    >>> from fastckpt.cli import main
    >>> main(["bench", "--help"])  # doctest: +ELLIPSIS
    usage: fastckpt bench ...
    0
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import time
from typing import Any, Callable

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
    fsync_path,
    gbps,
    median,
    positive_int_arg,
    require_cuda,
    require_gds,
    size_arg,
    warn,
)

__all__ = ["LIBRARIES", "add_parser", "run", "run_checkpoint", "run_raw"]


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
            "fastckpt, torch and safetensors and prints a comparison table."
        ),
    )
    parser.add_argument(
        "--folder",
        default=".",
        metavar="DIR",
        help="directory to do I/O in (default: the current directory)",
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


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def touch(obj: Any) -> int:
    """Reads one byte of every 4 KiB page of every tensor in ``obj``, so that lazily loaded
    (memory-mapped) tensors are really read before the clock stops; returns the byte sum.

    Example:
        >>> import torch
        >>> touch({"a": torch.ones(3, dtype=torch.uint8), "b": [torch.zeros(2)]})
        1
    """
    import torch

    total = 0
    for tensor in _tensors(obj):
        if tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        total += int(flat[:: mmap.PAGESIZE].sum())
    if any(t.is_cuda for t in _tensors(obj)):
        torch.cuda.synchronize()
    return total


def _fastckpt_save(state: Any, path: str) -> None:
    import fastckpt

    fastckpt.save(state, path, progress=False)


def _fastckpt_load(path: str, device: str) -> Any:
    import fastckpt

    return fastckpt.load(path, map_location=device, progress=False)


def _torch_save(state: Any, path: str) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: str, device: str) -> Any:
    import torch

    return torch.load(path, map_location=device, weights_only=True)


def _safetensors_save(state: Any, path: str) -> None:
    from safetensors.torch import save_file

    save_file(state, path)


def _safetensors_load(path: str, device: str) -> Any:
    from safetensors.torch import load_file

    return load_file(path, device=device)


#: (name, file suffix, save(state, path), load(path, device)) of each library compared.
LIBRARIES: list[tuple[str, str, Callable[[Any, str], None], Callable[[str, str], Any]]] = [
    ("fastckpt", ".safetensors", _fastckpt_save, _fastckpt_load),
    ("torch.save/load", ".pt", _torch_save, _torch_load),
    ("safetensors", ".st.safetensors", _safetensors_save, _safetensors_load),
]


def _libraries() -> list[tuple[str, str, Callable[[Any, str], None], Callable[[str, str], Any]]]:
    chosen = []
    for entry in LIBRARIES:
        if entry[0] == "safetensors":
            try:
                import safetensors.torch  # noqa: F401
            except ImportError:
                warn("safetensors is not installed: its row is left out (pip install safetensors)")
                continue
        chosen.append(entry)
    return chosen


def run_checkpoint(args: argparse.Namespace) -> int:
    """``--checkpoint SIZE``: the comparison table of fastckpt, torch and safetensors."""
    from fastckpt.cli.synthetic import MIN_NBYTES, llm_like_state_dict, state_dict_nbytes
    from fastckpt.config import set_defaults

    if args.checkpoint < MIN_NBYTES:
        raise CliError(f"--checkpoint must be at least {MIN_NBYTES} bytes", USAGE)
    libraries = _libraries()
    folder = _check_folder(args.folder, 2 * args.checkpoint + (64 << 20))
    explicit = _explicit_io(args)
    set_defaults(**explicit)  # fastckpt.save/load take the I/O settings given here
    device = "cuda" if args.gpu else "cpu"

    state = llm_like_state_dict(args.checkpoint)
    nbytes = state_dict_nbytes(state)
    if args.gpu:
        state = {name: tensor.to(device) for name, tensor in state.items()}
    cache = PageCache()
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.values()})
    print(
        f"fastckpt bench --checkpoint: {format_bytes(nbytes)} in {len(state)} tensors "
        f"({' + '.join(dtypes)}), {args.loops} loop(s), {device} tensors, in {folder}",
        flush=True,
    )
    print(
        f"Saves timed until fsync returns; loads until every tensor is touched. Cold reads: "
        f"{cache.describe()}",
        flush=True,
    )
    if explicit:
        print(f"fastckpt I/O settings: {json.dumps(explicit)}", flush=True)

    tag = f".fastckpt-bench-{os.getpid()}"
    paths = {name: os.path.join(folder, tag + suffix) for name, suffix, _, _ in libraries}
    timings: dict[str, dict[str, list[float]]] = {
        name: {"save": [], "load": [], "save_cpu": [], "load_cpu": []} for name, *_ in libraries
    }
    from fastckpt.progress import progress_bar

    try:
        with progress_bar(args.loops * len(libraries), "benchmarking", unit="run") as bar:
            # Libraries take turns within each loop, so a drifting device treats all alike.
            for _loop in range(args.loops):
                for name, _, save, load in libraries:
                    path = paths[name]
                    wall, cpu = time.perf_counter(), time.process_time()
                    save(state, path)
                    fsync_path(path)
                    timings[name]["save"].append(time.perf_counter() - wall)
                    timings[name]["save_cpu"].append(time.process_time() - cpu)

                    cache.drop([path])
                    wall, cpu = time.perf_counter(), time.process_time()
                    loaded = load(path, device)
                    touch(loaded)
                    timings[name]["load"].append(time.perf_counter() - wall)
                    timings[name]["load_cpu"].append(time.process_time() - cpu)
                    if args.validate:
                        _validate_loaded(name, state, loaded)
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


def _validate_loaded(name: str, state: dict[str, Any], loaded: Any) -> None:
    import torch

    if not isinstance(loaded, dict) or set(loaded) != set(state):
        raise CliError(f"validation failed: {name} loaded other keys than were saved")
    for key, tensor in state.items():
        got = loaded[key]
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(got, tensor):
            raise CliError(f"validation failed: {name} loaded tensor {key!r} differently")


def _print_table(timings: dict[str, dict[str, list[float]]], nbytes: int) -> None:
    rows = []
    for name, t in timings.items():
        rows.append(
            (
                name,
                gbps(nbytes, median(t["save"])),
                gbps(nbytes, median(t["load"])),
                median(t["save_cpu"]),
                median(t["load_cpu"]),
            )
        )
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
            f"{name:<16}  {save:>9.3g}  {load:>9.3g}  {save_cpu:>10.2f}  {load_cpu:>10.2f}  "
            f"{base_save / save:.2f}x / {base_load / load:.2f}x"
        )
    print(
        "\nGB/s: 10^9 bytes of tensor data per second, median of the loops. CPU s: CPU time of "
        "this process (all threads). Speedup: fastckpt's GB/s over the library's."
    )
