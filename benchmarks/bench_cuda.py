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
Every load's tensors are summed byte by byte on the GPU afterwards and the sums compared,
so a method that loaded wrong bytes is reported. The table goes to stdout as Markdown.

Targets (issue 5): fastckpt loads to CUDA at least 2x as fast as safetensors, and within
15% of the slower of the disk's read rate and the pinned host-to-device rate.

Example::

    python benchmarks/bench_cuda.py                       # 8 GiB, 3 rounds, cuda:0
    python benchmarks/bench_cuda.py --size 1G --repeats 1 --json cuda.json
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402 - found through the sys.path entry above

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
    "fastckpt-gds": "fastckpt.load(device) GDS",
    "raw-pipeline": "raw data section -> arena, pipeline",
    "raw-gds": "raw data section -> arena, GDS",
    "safetensors": "safetensors load_file(device)",
    "torch": "torch.load(map_location)",
}
LOAD_FILE = {
    "fastckpt": "fastckpt",
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


def _digest(torch: Any, tensors: list[Any]) -> int:
    """Sum of every byte of the tensors, on the GPU: equal for equal bytes in any order."""
    total = 0
    for t in tensors:
        if t.numel():
            total += int(t.detach().reshape(-1).view(torch.uint8).sum(dtype=torch.int64))
    return total % (1 << 61)


def _child_save(spec: dict[str, Any]) -> dict[str, Any]:
    device, method, path = spec["device"], spec["method"], spec["file"]
    torch = _warm_cuda(device)
    host = C.llm_like_state_dict(spec["size"], seed=spec["seed"])
    state = {k: v.to(device) for k, v in host.items()}
    del host
    torch.cuda.synchronize(device)
    payload = sum(t.numel() * t.element_size() for t in state.values())
    if method == "fastckpt":
        C.import_repo_package()
        import fastckpt

        def run() -> None:
            fastckpt.save(state, path)
    elif method == "torch":

        def run() -> None:
            torch.save(state, path)
            C.make_durable(path)
    elif method == "safetensors":
        import safetensors.torch

        def run() -> None:
            safetensors.torch.save_file(state, path)
            C.make_durable(path)
    else:
        raise ValueError(f"unknown save method {method!r}")
    os.sync()
    with C.Measure() as m:
        run()
    return {
        **m.as_dict(),
        "payload_bytes": payload,
        "file_bytes": os.path.getsize(path),
        "digest": _digest(torch, list(state.values())),
    }


def _data_section(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    start = 8 + n
    return start, os.path.getsize(path) - start


def _child_load(spec: dict[str, Any]) -> dict[str, Any]:
    device, method, path = spec["device"], spec["method"], spec["file"]
    torch = _warm_cuda(device)
    C.import_repo_package()
    extra: dict[str, Any] = {}
    if method in ("fastckpt", "fastckpt-gds"):
        import fastckpt

        kwargs: dict[str, Any] = {}
        if method == "fastckpt-gds":
            import fastckpt.gds

            info = fastckpt.gds.engine_info()
            if not info.available:
                return {"skipped": f"GDS not available: {info.reason}"}
            extra["gds_mode"] = fastckpt.gds.mode()
            if "gds" in inspect.signature(fastckpt.load).parameters:
                kwargs["gds"] = True
            else:
                os.environ["FASTCKPT_GDS"] = "1"  # read_into_device's switch
                extra["gds_switch"] = "FASTCKPT_GDS=1"
        else:
            os.environ["FASTCKPT_GDS"] = "0"

        def run() -> list[Any]:
            state = fastckpt.load(path, device=device, **kwargs)
            return list(state.values())
    elif method in ("raw-pipeline", "raw-gds"):
        import fastckpt.config
        from fastckpt import cuda as fcuda
        from fastckpt.io.executor import Executor
        from fastckpt.io.files import File

        gds = method == "raw-gds"
        if gds:
            import fastckpt.gds

            info = fastckpt.gds.engine_info()
            if not info.available:
                return {"skipped": f"GDS not available: {info.reason}"}
            extra["gds_mode"] = fastckpt.gds.mode()
        offset, nbytes = _data_section(path)
        cfg = fastckpt.config.resolve_io(os.path.dirname(path), {})
        executor = Executor(cfg)
        arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        staging = fastckpt.config.staging_bytes()
        extra.update(io_config=cfg.__dict__, staging_bytes=staging)

        def run() -> list[Any]:
            with File(path) as f:
                fcuda.read_into_device(
                    executor, f, offset, nbytes, arena, staging_bytes=staging, gds=gds
                )
            return [arena]
    elif method == "safetensors":
        import safetensors.torch

        def run() -> list[Any]:
            return list(safetensors.torch.load_file(path, device=device).values())
    elif method == "torch":
        import io

        buf = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True, map_location=device)

        def run() -> list[Any]:
            return list(torch.load(path, map_location=device, weights_only=True).values())
    else:
        raise ValueError(f"unknown load method {method!r}")
    cache = C.drop_page_cache([path])
    with C.Measure() as m:
        tensors = run()
        torch.cuda.synchronize(device)
    payload = sum(t.numel() * t.element_size() for t in tensors)
    return {
        **m.as_dict(),
        "payload_bytes": payload,
        "digest": _digest(torch, tensors),
        "cache": cache,
        **extra,
    }


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
        return {"gbps": C.median(rates[1:]), "seconds": n / C.median(rates[1:]) / 1e9}
    # disk: the fastckpt file's data section into page-locked memory, 1 GiB at a time
    C.import_repo_package()
    from fastckpt.aio import aio_handle
    from fastckpt.io.aligned_memory import aligned_tensor

    path = spec["file"]
    offset, nbytes = _data_section(path)
    handle = aio_handle()
    piece = 1 << 30
    buf = aligned_tensor(min(piece, nbytes), lock=True)
    cache = C.drop_page_cache([path])
    t0 = time.perf_counter()
    pos = 0
    while pos < nbytes:
        n = min(piece, nbytes - pos)
        handle.sync_pread(buf[:n], path, file_offset=offset + pos)
        pos += n
    seconds = time.perf_counter() - t0
    return {"gbps": nbytes / seconds / 1e9, "seconds": seconds, "cache": cache}


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        op = spec["op"]
        result = (
            _child_save(spec)
            if op == "save"
            else _child_load(spec)
            if op == "load"
            else _child_ceiling(spec)
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on with the others
        result = {"error": f"{type(exc).__name__}: {exc}"}
    C.report(result)
    return 0


# =========================================================================== parent side


def run_child(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    return C.run_child(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        timeout=args.child_timeout,
        env=env,
    )


def _stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r and "skipped" not in r]
    skipped = sorted({r["skipped"] for r in results if "skipped" in r})
    errors = [r["error"] for r in results if "error" in r]
    if not ok:
        return {"n": 0, "errors": errors, "skipped": skipped}
    gbps = [
        r["payload_bytes"] / r["seconds"] / 1e9 if "payload_bytes" in r else r["gbps"] for r in ok
    ]
    return {
        "n": len(ok),
        "gbps": C.median(gbps),
        "gbps_min": min(gbps),
        "gbps_max": max(gbps),
        "seconds": C.median(r.get("seconds") for r in ok),
        "cpu_seconds": C.median(r.get("cpu_seconds") for r in ok),
        "extra_rss": C.median(r.get("extra_rss") for r in ok),
        "errors": errors,
        "skipped": skipped,
        "gds_mode": next((r["gds_mode"] for r in ok if "gds_mode" in r), None),
    }


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
        f"- state dict: {C.human_bytes(meta['payload_bytes'])} LLM-like, {meta['repeats']} rounds (medians)",
        f"- {meta['cache_note']}; GDS: {meta['gds']}",
        (
            f"- disk read ceiling: {C.fmt(disk, '.2f', ' GB/s')} ({meta['disk_how']}); pinned H2D: "
            f"{C.fmt(h2d, '.2f', ' GB/s')}; the slower: {C.fmt(bound, '.2f', ' GB/s')}"
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
            f"{s['seconds']:.2f} | {C.fmt(_ratio(s['gbps'], st), '.2f', '×')} | "
            f"{C.fmt(_ratio(s['gbps'], bound) and 100 * _ratio(s['gbps'], bound), '.0f', '%')} | "
            f"{C.fmt(s.get('cpu_seconds'), '.1f')} |"
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
            f"{C.fmt(_ratio(fast, s['gbps']), '.2f', '×') if method != 'fastckpt' else '—'} | "
            f"{C.fmt(s.get('cpu_seconds'), '.1f')} |"
        )
    best = max((stats["load"].get(m, {}).get("gbps") or 0) for m in ("fastckpt", "fastckpt-gds"))
    out += [
        "",
        "### Targets",
        "",
        (
            f"- load ≥ {LOAD_VS_SAFETENSORS}× safetensors: {C.fmt(_ratio(best, st), '.2f', '×')} → "
            f"{'met' if (_ratio(best, st) or 0) >= LOAD_VS_SAFETENSORS else 'NOT met'}"
        ),
        (
            f"- load ≥ {LOAD_OF_CEILING:.0%} of min(disk, H2D): {C.fmt(_ratio(best, bound), '.0%')} → "
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
    fs_type, source, mount = C.filesystem_of(base)
    if fs_type in C.MEMORY_FILESYSTEMS:
        print(
            f"error: {base} is on {fs_type}; pick a directory on a disk with --dir", file=sys.stderr
        )
        return 2
    need = 3 * args.size + 256 * C.MiB
    if C.free_bytes(base) < need:
        print(
            f"error: {base} has {C.human_bytes(C.free_bytes(base))} free; this run needs about "
            f"{C.human_bytes(need)}",
            file=sys.stderr,
        )
        return 2
    workdir = tempfile.mkdtemp(prefix="fastckpt-bench-cuda-", dir=base)
    paths = {k: os.path.join(workdir, v) for k, v in FILES.items()}
    have_fio = C.fio_path() is not None and not args.no_fio
    raw: list[dict[str, Any]] = []
    C.log(
        f"{C.human_bytes(args.size)} x {args.repeats} rounds on {args.device}, in {workdir} ({fs_type} {source})"
    )

    def record(rnd: int, op: str, method: str, res: dict[str, Any]) -> None:
        raw.append({"round": rnd, "op": op, "method": method, **res})
        if "error" in res or "skipped" in res:
            C.log(f"round {rnd + 1}: {op} {method}: {res.get('error') or res.get('skipped')}")
        else:
            gbps = (
                res["payload_bytes"] / res["seconds"] / 1e9
                if "payload_bytes" in res
                else res["gbps"]
            )
            C.log(f"round {rnd + 1}: {op:7s} {method:14s} {gbps:6.2f} GB/s")

    base_spec = {"device": args.device, "size": args.size, "seed": args.seed}
    try:
        for rnd in range(args.repeats):
            for method in C.rotate(list(SAVES), rnd):
                if os.path.exists(paths[method]):
                    os.remove(paths[method])
                record(
                    rnd,
                    "save",
                    method,
                    run_child(
                        {**base_spec, "op": "save", "method": method, "file": paths[method]}, args
                    ),
                )
            if have_fio:
                fio_file = os.path.join(workdir, "fio.dat")
                C.fio_sequential(
                    "write", fio_file, args.size // C.MiB * C.MiB, timeout=args.child_timeout
                )
                C.drop_page_cache([fio_file])
                res = C.fio_sequential(
                    "read", fio_file, args.size // C.MiB * C.MiB, timeout=args.child_timeout
                )
                os.remove(fio_file)
                record(rnd, "ceiling", "disk", res)
            elif os.path.exists(paths["fastckpt"]):
                record(
                    rnd,
                    "ceiling",
                    "disk",
                    run_child(
                        {**base_spec, "op": "ceiling", "method": "disk", "file": paths["fastckpt"]},
                        args,
                    ),
                )
            record(
                rnd,
                "ceiling",
                "h2d",
                run_child({**base_spec, "op": "ceiling", "method": "h2d"}, args),
            )
            for method in C.rotate(list(LOADS), rnd):
                path = paths[LOAD_FILE[method]]
                if not os.path.exists(path):
                    record(
                        rnd, "load", method, {"error": f"{os.path.basename(path)} was not saved"}
                    )
                    continue
                record(
                    rnd,
                    "load",
                    method,
                    run_child({**base_spec, "op": "load", "method": method, "file": path}, args),
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if created:
            try:
                base.rmdir()
            except OSError:
                pass

    def pick(op: str, method: str) -> list[dict[str, Any]]:
        return [r for r in raw if r["op"] == op and r["method"] == method]

    stats = {
        "save": {m: _stats(pick("save", m)) for m in SAVES},
        "load": {m: _stats(pick("load", m)) for m in LOADS},
        "ceiling": {m: _stats(pick("ceiling", m)) for m in ("disk", "h2d")},
    }
    notes = []
    digests = {r["digest"] for r in raw if "digest" in r and "error" not in r}
    if len(digests) > 1:
        notes.append(
            f"byte sums differ between methods or rounds ({len(digests)} distinct): some load or save "
            "did not move the right bytes"
        )
    elif digests:
        notes.append("every save and load moved the same bytes (equal byte sums on the GPU)")
    caches = {r.get("cache") for r in raw if r["op"] == "load" and "cache" in r}
    if caches - {"drop_caches"}:
        notes.append(f"page cache not dropped for every load (got {sorted(map(str, caches))})")
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    C.import_repo_package()
    import fastckpt.gds

    gds_info = fastckpt.gds.engine_info()
    first = next((r for r in raw if "payload_bytes" in r), {})
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": args.device,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)),
        "torch": version("torch"),
        "safetensors": version("safetensors"),
        "dir": str(base),
        "filesystem": f"{fs_type} ({source}, mounted at {mount})",
        "payload_bytes": first.get("payload_bytes", args.size),
        "repeats": args.repeats,
        "cache_note": (
            "page cache dropped before each load"
            if C.can_drop_caches()
            else "not root: file pages evicted with posix_fadvise(DONTNEED)"
        ),
        "gds": gds_info.reason if gds_info.available else f"unavailable ({gds_info.reason})",
        "disk_how": "fio --rw=read --direct=1 --bs=1M --iodepth=32"
        if have_fio
        else "fastckpt aio_handle parallel O_DIRECT read into locked memory",
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "wall_seconds": time.perf_counter() - t_start,
        "notes": notes,
    }
    print(report_markdown(meta, stats))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "medians": stats, "runs": raw}, f, indent=2)
        C.log(f"raw results written to {args.json}")
    return 0 if any("digest" in r for r in raw) else 1


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
        type=C.parse_size,
        default=C.parse_size("8G"),
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
        return child_main(args.child)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
