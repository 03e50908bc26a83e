#!/usr/bin/env python3
"""Checkpoints to and from a CUDA GPU: fastckpt against safetensors and torch, in one run.

One run, one file system (``--dir``), one GPU (``--device``). Each round:

* ceilings: the disk's sequential read rate (fio when installed, else fastckpt's own
  parallel O_DIRECT read of the checkpoint into page-locked memory, page cache dropped)
  and the pinned host-to-device copy rate (``torch`` copies of a 1 GiB pinned buffer);
* saves from CUDA, timed until durable (fsync of file and directory):
  ``fastckpt.save``, ``torch.save`` and ``safetensors.torch.save_file`` of the same seeded
  LLM-like state dict living on the GPU; these files are what the loads read;
* loads to CUDA, page cache dropped first (as root; else ``posix_fadvise``), timed until
  every tensor is on the GPU (``torch.cuda.synchronize``): ``fastckpt.load(device=...)``
  through the staging pipeline, the same through GPUDirect Storage (or cuFile's
  compatibility mode, as ``fastckpt.gds.mode()`` says), the raw data-section read into one
  device arena by both paths (the engine without the loader), ``safetensors.torch.load_file(
  device=...)`` and ``torch.load(map_location=...)``.

Every method runs in its own child process (CUDA initialized before the timing). GB/s
counts tensor bytes (1 GB = 1e9 bytes); figures are medians over ``--repeats`` rounds.
Every load's tensors are checked afterwards (the CRC-32 of every tensor against the saved
state's), so a method that loaded wrong bytes is reported. A directory on tmpfs is accepted:
then the "disk" ceiling is fastckpt's read from memory. The table goes to stdout as Markdown.

Targets: fastckpt loads to CUDA at least 2x as fast as safetensors, and within
15% of the slower of the disk's read rate and the pinned host-to-device rate.

Example::

    python benchmarks/bench_cuda.py                       # 8 GiB, 3 rounds, cuda:0
    python benchmarks/bench_cuda.py --size 1G --repeats 1 --json cuda.json
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastckpt.bench.caches import PageCache, drop_page_cache
from fastckpt.bench.children import child_main, spawn
from fastckpt.bench.filesystems import filesystem_of, require_directory
from fastckpt.bench.fio import fio_path, fio_round
from fastckpt.bench.peers import LOADERS, Loader, Skip
from fastckpt.bench.report import fmt, log, machine
from fastckpt.bench.results import Results, rotate, summarize
from fastckpt.bench.timed_runs import child_load, child_save
from fastckpt.bench.units import MiB, format_bytes, median
from fastckpt.config import parse_size
from fastckpt.io.page_cache import MEMORY_FILESYSTEMS

REPO = Path(__file__).resolve().parent.parent

FILES = {
    "fastckpt": "fastckpt.safetensors",
    "torch": "torch.pt",
    "safetensors": "safetensors.safetensors",
}
SAVES = {
    "fastckpt": "fastckpt.save (from CUDA)",
    "torch": "torch.save + fsync",
    "safetensors": "safetensors save_file + fsync",
}
LOADS = {
    "fastckpt": "fastckpt.load(device) pipeline",
    "fastckpt-next": "fastckpt.load(device), the process's second",
    "fastckpt-gds": "fastckpt.load(device) GDS",
    "raw-pipeline": "raw data section -> arena, pipeline",
    "raw-gds": "raw data section -> arena, GDS",
    "safetensors": "safetensors load_file(device)",
    "torch": "torch.load(map_location)",
}
#: The asynchronous saves' rows: eager (a snapshot into page-locked memory in the call) and lazy.
ASYNC = {
    "fastckpt-eager": "fastckpt.async_save (eager) + fence",
    "fastckpt-lazy": "fastckpt.async_save(lazy=True) + fence",
}

LOAD_FILE = {
    "fastckpt": "fastckpt",
    "fastckpt-next": "fastckpt",
    "fastckpt-gds": "fastckpt",
    "raw-pipeline": "fastckpt",
    "raw-gds": "fastckpt",
    "safetensors": "safetensors",
    "torch": "torch",
}

LOAD_VS_SAFETENSORS = 2.0
LOAD_OF_CEILING = 0.85


# ============================================================================ child side


def _warm_cuda(device: str) -> Any:
    import torch

    torch.cuda.init()
    torch.ones(1024, device=device).sum().item()
    torch.cuda.synchronize(device)
    return torch


def _gds_info() -> dict[str, Any]:
    import fastckpt.gds

    info = fastckpt.gds.engine_info()
    if not info.available:
        raise Skip(f"GDS not available: {info.reason}")
    return {"gds_mode": fastckpt.gds.mode()}


def _load_fastckpt(gds: bool) -> Any:
    def setup(path: str, device: str) -> Any:
        import fastckpt

        kwargs: dict[str, Any] = {}
        if gds:
            _gds_info()
            if "gds" in inspect.signature(fastckpt.load).parameters:
                kwargs["gds"] = True
            else:
                os.environ["FASTCKPT_GDS"] = "1"  # read_into_device's switch
        else:
            os.environ["FASTCKPT_GDS"] = "0"
        return lambda: fastckpt.load(path, device=device, **kwargs)

    return setup


def _load_again(path: str, device: str) -> Any:
    """``fastckpt.load(device=)`` after one untimed load in the same process (then the page
    cache is dropped): what a process that loads again pays, its device arena and pinned
    staging buffers allocated already, against the first load's figure."""
    import torch

    import fastckpt

    os.environ["FASTCKPT_GDS"] = "0"
    first = fastckpt.load(path, device=device)
    del first  # its device memory goes back to the caching allocator, as in a serving loop
    torch.cuda.synchronize(device)
    return lambda: fastckpt.load(path, device=device)


def _load_raw(gds: bool) -> Any:
    """The data section read into one device arena by the engine, without the loader."""

    def setup(path: str, device: str) -> Any:
        import torch

        import fastckpt.config
        from fastckpt.io import device_copy
        from fastckpt.io.executor import Executor
        from fastckpt.io.files import File

        if gds:
            _gds_info()
        offset, nbytes = _data_section(path)
        executor = Executor(fastckpt.config.resolve_io(os.path.dirname(path), {}))
        arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        staging = fastckpt.config.staging_bytes()

        def run() -> dict[str, Any]:
            with File(path) as f:
                device_copy.read_into_device(
                    executor, f, offset, nbytes, arena, staging_bytes=staging, gds=gds
                )
            return {"arena": arena}

        return run

    return setup


#: The loads of this benchmark: fastckpt's two paths, the raw engine, and the peers.
CUDA_LOADERS = {
    "fastckpt": Loader(LOADS["fastckpt"], "fastckpt", _load_fastckpt(gds=False)),
    "fastckpt-next": Loader(LOADS["fastckpt-next"], "fastckpt", _load_again),
    "fastckpt-gds": Loader(LOADS["fastckpt-gds"], "fastckpt", _load_fastckpt(gds=True)),
    "raw-pipeline": Loader(LOADS["raw-pipeline"], "fastckpt", _load_raw(gds=False)),
    "raw-gds": Loader(LOADS["raw-gds"], "fastckpt", _load_raw(gds=True)),
    "safetensors": LOADERS["safetensors"],
    "torch": LOADERS["torch"],
}


def _child_save(spec: dict[str, Any]) -> dict[str, Any]:
    _warm_cuda(spec["device"])
    return child_save(spec)


def _child_load(spec: dict[str, Any]) -> dict[str, Any]:
    _warm_cuda(spec["device"])
    return child_load({**spec, "cold": True}, CUDA_LOADERS)


def _data_section(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    start = 8 + n
    return start, os.path.getsize(path) - start


def _child_ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    """Pinned host-to-device copy rate, or the disk's read rate through fastckpt."""
    device = spec["device"]
    torch = _warm_cuda(device)
    if spec["method"] == "h2d":
        n = 1 << 30
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        rates = []
        for _ in range(6):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            rates.append(n / (time.perf_counter() - t0) / 1e9)
        return {"gbps": median(rates[1:]), "seconds": n / median(rates[1:]) / 1e9}
    # disk: the fastckpt file's data section into page-locked memory, 1 GiB at a time
    from fastckpt.aio import aio_handle
    from fastckpt.io.aligned_memory import aligned_tensor

    path = spec["file"]
    offset, nbytes = _data_section(path)
    handle = aio_handle()
    piece = 1 << 30
    buf = aligned_tensor(min(piece, nbytes), lock=True)
    cache = drop_page_cache([path])
    t0 = time.perf_counter()
    pos = 0
    while pos < nbytes:
        n = min(piece, nbytes - pos)
        handle.sync_pread(buf[:n], path, file_offset=offset + pos)
        pos += n
    seconds = time.perf_counter() - t0
    return {"gbps": nbytes / seconds / 1e9, "seconds": seconds, "cache": cache}


def _child_async(spec: dict[str, Any]) -> dict[str, Any]:
    """An ``async_save`` of the state on the GPU (``spec["lazy"]``: lazy, else eager), then
    at once what a training step does first: ``future.fence()``, then an in-place update of
    every tensor. Reports the time the caller was blocked in the call and in the fence, the
    time until the file is durable, the page-locked memory the save went through and the
    device memory the fence cloned, and the digest of the file's tensors (those of the
    state at call time)."""
    from fastckpt.bench.checks import crc_digest, tensor_crc32s
    from fastckpt.bench.synthetic import llm_like_state_dict

    device = spec["device"]
    lazy = bool(spec.get("lazy", True))
    torch = _warm_cuda(device)
    import fastckpt
    from fastckpt.checkpoint import asynchronous

    state = llm_like_state_dict(spec["size"], seed=spec["seed"])
    digest = crc_digest(tensor_crc32s(state))
    state = {k: v.to(device) for k, v in state.items()}
    torch.cuda.synchronize(device)
    os.sync()
    allocated = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    future = fastckpt.async_save(state, spec["file"], lazy=lazy)
    t1 = time.perf_counter()
    future.fence()
    t2 = time.perf_counter()
    clones = torch.cuda.memory_allocated(device) - allocated
    for tensor in state.values():  # the step: queued after the fence's event
        tensor.add_(1)
    future.result()
    t3 = time.perf_counter()
    guard = future._guard  # what a lazy save's fence took (lazy_guard.LazyGuard)
    staging = asynchronous._ring if lazy else asynchronous._pool
    loaded = fastckpt.load(spec["file"])
    # A training loop's later checkpoints: the staging memory exists, so the call is the copy.
    torch.cuda.synchronize(device)
    t4 = time.perf_counter()
    again = fastckpt.async_save(state, spec["file"] + ".next", lazy=lazy)
    t5 = time.perf_counter()
    again.fence()
    t6 = time.perf_counter()
    again.result()
    os.remove(spec["file"] + ".next")
    payload = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "seconds": t3 - t0,
        "call_seconds": t1 - t0,
        "fence_seconds": t2 - t1,
        "next_call_seconds": t5 - t4,
        "next_fence_seconds": t6 - t5,
        "payload_bytes": payload,
        "pinned_bytes": staging.budget if staging is not None else None,
        "device_clone_bytes": guard.device_snapshot_bytes if guard is not None else 0,
        "device_allocated_after_fence": clones,
        "host_snapshot_bytes": guard.snapshot_bytes if guard is not None else payload,
        "digest": crc_digest(tensor_crc32s(loaded)),
        "call_time_digest": digest,
    }


HANDLERS = {
    "save": _child_save,
    "load": _child_load,
    "async": _child_async,
    "ceiling": lambda spec: _child_ceiling(spec),
}


# =========================================================================== parent side


def run_child(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return spawn(__file__, spec, args.child_timeout)


def _async_stats(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of an asynchronous save's blocked times, rate and memory; whether every file
    held the state at call time."""
    stats = summarize(rounds)
    ok = [r for r in rounds if "error" not in r and "skipped" not in r]
    if ok:
        for key in (
            "call_seconds",
            "fence_seconds",
            "next_call_seconds",
            "next_fence_seconds",
            "pinned_bytes",
            "device_clone_bytes",
        ):
            stats[key] = median([r[key] for r in ok])
        stats["same"] = "yes" if all(r["digest"] == r["call_time_digest"] for r in ok) else "NO"
    return stats


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def report_markdown(meta: dict[str, Any], stats: dict[str, Any]) -> str:
    ceiling = stats["ceiling"]
    disk, h2d = ceiling["disk"].get("gbps"), ceiling["h2d"].get("gbps")
    bound = min(x for x in (disk, h2d) if x) if (disk or h2d) else None
    out = [
        f"## fastckpt to and from CUDA — {meta['date']}",
        "",
        f"- GPU: {meta['gpu']} ({meta['device']}); torch {meta['torch']}, safetensors {meta['safetensors']}",
        f"- directory: {meta['dir']} on {meta['filesystem']}",
        f"- state dict: {format_bytes(meta['payload_bytes'])} LLM-like, {meta['repeats']} rounds (medians)",
        f"- {meta['cache_note']}; GDS: {meta['gds']}",
        (
            f"- disk read ceiling: {fmt(disk, '.2f', ' GB/s')} ({meta['disk_how']}); pinned H2D: "
            f"{fmt(h2d, '.2f', ' GB/s')}; the slower: {fmt(bound, '.2f', ' GB/s')}"
        ),
        "",
    ]
    st = stats["load"].get("safetensors", {}).get("gbps")
    out += [
        "### Load to CUDA",
        "",
        "| method | GB/s (median) | GB/s min–max | seconds | × safetensors | % of min(disk, H2D) | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, label in LOADS.items():
        s = stats["load"].get(method, {})
        if not s.get("n"):
            why = "; ".join(s.get("skipped", []) + s.get("errors", [])) or "not run"
            out.append(f"| {label} | — | — | — | — | — | {why} |")
            continue
        mode = f" ({s['gds_mode']})" if s.get("gds_mode") else ""
        out.append(
            f"| {label}{mode} | {s['gbps']:.2f} | {s['gbps_min']:.2f}–{s['gbps_max']:.2f} | "
            f"{s['seconds']:.2f} | {fmt(_ratio(s['gbps'], st), '.2f', '×')} | "
            f"{fmt(_ratio(s['gbps'], bound) and 100 * _ratio(s['gbps'], bound), '.0f', '%')} | "
            f"{fmt(s.get('cpu_seconds'), '.1f')} |"
        )
    out += [
        "",
        "### Save from CUDA (until durable)",
        "",
        "| method | GB/s (median) | GB/s min–max | seconds | fastckpt is × faster | CPU s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    fast = stats["save"].get("fastckpt", {}).get("gbps")
    for method, label in SAVES.items():
        s = stats["save"].get(method, {})
        if not s.get("n"):
            out.append(
                f"| {label} | — | — | — | — | {'; '.join(s.get('errors', [])) or 'not run'} |"
            )
            continue
        out.append(
            f"| {label} | {s['gbps']:.2f} | {s['gbps_min']:.2f}–{s['gbps_max']:.2f} | {s['seconds']:.2f} | "
            f"{fmt(_ratio(fast, s['gbps']), '.2f', '×') if method != 'fastckpt' else '—'} | "
            f"{fmt(s.get('cpu_seconds'), '.1f')} |"
        )
    out += [
        "",
        "### async_save from CUDA (fence and an in-place step right after the call)",
        "",
        "| method | blocked in call (s) | blocked in fence (s) | next save: call + fence (s) | "
        "until durable: GB/s | pinned staging | device clones | file = call-time state |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for method, label in ASYNC.items():
        row = stats["async"].get(method, {})
        if row.get("n"):
            out.append(
                f"| {label} | {row['call_seconds']:.4f} | {row['fence_seconds']:.4f} | "
                f"{row['next_call_seconds']:.4f} + {row['next_fence_seconds']:.4f} | "
                f"{row['gbps']:.2f} | {format_bytes(row['pinned_bytes'])} | "
                f"{format_bytes(row['device_clone_bytes'])} | {row['same']} |"
            )
        else:
            why = "; ".join(row.get("skipped", []) + row.get("errors", [])) or "not run"
            out.append(f"| {label} | — | — | — | — | — | — | {why} |")
    best = max((stats["load"].get(m, {}).get("gbps") or 0) for m in ("fastckpt", "fastckpt-gds"))
    out += [
        "",
        "### Targets",
        "",
        (
            f"- load ≥ {LOAD_VS_SAFETENSORS}× safetensors: {fmt(_ratio(best, st), '.2f', '×')} → "
            f"{'met' if (_ratio(best, st) or 0) >= LOAD_VS_SAFETENSORS else 'NOT met'}"
        ),
        (
            f"- load ≥ {LOAD_OF_CEILING:.0%} of min(disk, H2D): {fmt(_ratio(best, bound), '.0%')} → "
            f"{'met' if (_ratio(best, bound) or 0) >= LOAD_OF_CEILING else 'NOT met'}"
        ),
        "",
    ]
    out += [f"- {n}" for n in meta["notes"]]
    return "\n".join(out)


def parent_main(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print(
            "error: PyTorch is not installed; this benchmark needs PyTorch with CUDA",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print(
            "error: no CUDA GPU here (torch.cuda.is_available() is False); this benchmark loads to and "
            "saves from a GPU — run it on a machine with one",
            file=sys.stderr,
        )
        return 2
    t_start = time.perf_counter()
    base = Path(args.dir).resolve()
    created = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    fs_type, source, mount = filesystem_of(base)
    memory = fs_type in MEMORY_FILESYSTEMS  # tmpfs: the "disk" ceiling is a memory read
    try:
        require_directory(base, 3 * args.size + 256 * MiB, memory=memory)
    except SystemExit:
        if created:
            base.rmdir()
        raise
    workdir = tempfile.mkdtemp(prefix="fastckpt-bench-cuda-", dir=base)
    paths = {k: os.path.join(workdir, v) for k, v in FILES.items()}
    have_fio = fio_path() is not None and not args.no_fio and not memory
    results = Results()
    log(
        f"{format_bytes(args.size)} x {args.repeats} rounds on {args.device}, in {workdir} ({fs_type} {source})"
    )
    base_spec = {"device": args.device, "size": args.size, "seed": args.seed}
    try:
        for rnd in range(args.repeats):
            for method in rotate(SAVES, rnd):
                if os.path.exists(paths[method]):
                    os.remove(paths[method])
                spec = {**base_spec, "op": "save", "method": method, "file": paths[method]}
                results.record("save", method, rnd, run_child(spec, args))
            if have_fio:
                fio = fio_round(workdir, args.size // MiB * MiB, args.child_timeout)
                results.record("ceiling", "disk", rnd, fio["read"])
            elif os.path.exists(paths["fastckpt"]):
                spec = {**base_spec, "op": "ceiling", "method": "disk", "file": paths["fastckpt"]}
                results.record("ceiling", "disk", rnd, run_child(spec, args))
            async_file = os.path.join(workdir, "async.safetensors")
            for method in rotate(ASYNC, rnd):
                lazy = method == "fastckpt-lazy"
                spec = {**base_spec, "op": "async", "method": method, "file": async_file}
                results.record("async", method, rnd, run_child({**spec, "lazy": lazy}, args))
                if os.path.exists(async_file):
                    os.remove(async_file)
            spec = {**base_spec, "op": "ceiling", "method": "h2d"}
            results.record("ceiling", "h2d", rnd, run_child(spec, args))
            for method in rotate(LOADS, rnd):
                path = paths[LOAD_FILE[method]]
                if not os.path.exists(path):
                    res = {"error": f"{os.path.basename(path)} was not saved"}
                else:
                    spec = {**base_spec, "op": "load", "method": method, "file": path}
                    res = run_child(spec, args)
                results.record("load", method, rnd, res)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if created:
            try:
                base.rmdir()
            except OSError:
                pass

    stats = {
        "save": results.stats("save", SAVES),
        "load": results.stats("load", LOADS),
        "ceiling": results.stats("ceiling", ("disk", "h2d")),
        "async": {m: _async_stats(results.pick("async", m)) for m in ASYNC},
    }
    raw = results.raw
    notes = []
    # The raw methods return the data section, not the tensors: their digests differ.
    digests = {r["digest"] for r in raw if "digest" in r and not str(r["method"]).startswith("raw")}
    if len(digests) > 1:
        notes.append(
            f"tensor CRCs differ between methods or rounds ({len(digests)} distinct): some load "
            "or save did not move the right bytes"
        )
    elif digests:
        notes.append("every save and load moved the same bytes (equal CRC-32 of every tensor)")
    caches = {r.get("cache") for r in raw if r["op"] == "load" and "cache" in r}
    if caches - {"drop_caches"}:
        notes.append(f"page cache not dropped for every load (got {sorted(map(str, caches))})")
    if memory:
        notes.append(f"{base} is on {fs_type}: the disk ceiling is a read from memory")

    import fastckpt.gds

    gds_info = fastckpt.gds.engine_info()
    host = machine()
    first = next((r for r in raw if "payload_bytes" in r), {})
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": args.device,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)),
        "torch": host["versions"]["torch"],
        "safetensors": host["versions"]["safetensors"],
        "dir": str(base),
        "filesystem": f"{fs_type} ({source}, mounted at {mount})",
        "payload_bytes": first.get("payload_bytes", args.size),
        "repeats": args.repeats,
        "cache_note": (
            "page cache dropped before each load"
            if PageCache().can_drop
            else "not root: file pages evicted with posix_fadvise(DONTNEED)"
        ),
        "gds": (
            f"{gds_info.reason} (mode {fastckpt.gds.mode()})"
            if gds_info.available
            else f"unavailable ({gds_info.reason})"
        ),
        "disk_how": "fio --rw=read --direct=1 --bs=4M --iodepth=32"
        if have_fio
        else "fastckpt aio_handle parallel O_DIRECT read into locked memory",
        "cpus": host["cpus"],
        "kernel": host["kernel"],
        "wall_seconds": time.perf_counter() - t_start,
        "notes": notes,
    }
    print(report_markdown(meta, stats))
    if args.json:
        results.dump(args.json, meta=meta, medians=stats)
    return 0 if digests else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir",
        default=str(REPO.parent / "bench-tmp"),
        help="directory on the file system to measure (default: %(default)s)",
    )
    parser.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("8G"),
        help="state dict size, e.g. 1G, 8G (default 8G)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds; medians are reported (default 3)"
    )
    parser.add_argument("--device", default="cuda:0", help="the GPU (default cuda:0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    parser.add_argument("--json", metavar="FILE", help="also write the raw results here")
    parser.add_argument(
        "--no-fio",
        action="store_true",
        help="measure the disk with fastckpt even if fio is installed",
    )
    parser.add_argument("--child-timeout", type=float, default=900.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child, HANDLERS)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
