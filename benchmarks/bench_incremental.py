"""Checkpoints of a fine-tune that changes little of its state: bytes written, save time and
restore time, full saves against incremental ones.

Parts (``--parts``, default all; each is its own function, reporting one JSON-able dict):

- ``incremental``: a LoRA-like fine-tune -- a frozen base of ``--base-size`` bytes (an
  LLM-like state dict), ``--trainable`` of its parameter count as float32 adapters, their
  Adam state (``exp_avg``, ``exp_avg_sq``) and a step counter -- checkpointed
  ``--checkpoints`` times, each after one "optimizer step" that changes every trainable
  tensor. Modes, each in its own directory:

  - ``full``: ``fastckpt.save(state, path)``, every tensor written each time;
  - ``hash``: ``save(state, path, base=previous)`` with the process's records forgotten
    before each save, so every tensor is hashed (XXH3-128) and compared with the base's;
  - ``default``: the same with the records kept (the default behaviour): tensors whose
    version counter moved on the same memory since the last save are written without being
    hashed first; every other tensor is hashed and compared (a counter never says
    "unchanged");
  - ``frozen``: ``base=previous, frozen=<the base's names>``: the frozen tensors are referred
    to unread, on the caller's word.
  - ``compressed``: ``default`` with ``compress=True``: the tensors that changed are
    written compressed (byte planes), for storage where bytes are expensive.

  Reported per mode: bytes written and seconds per checkpoint (each save is durable: fsync
  and rename), medians and the first checkpoint apart (it is a full save in every mode), and
  the time to restore the last checkpoint with ``fastckpt.load`` against a full load of the
  same state (the page cache dropped before each read when running as root, else the files'
  pages evicted with posix_fadvise), medians of ``--repeats`` loads.

- ``s3``: the same series, modes and figures against an S3 server on loopback (moto's
  ``ThreadedMotoServer``, started by this script in a process of its own), each checkpoint
  an object ``s3://<bucket>/<mode>/step-NNNN/state.safetensors`` written with
  ``base=`` the previous one's URL: bytes uploaded (the objects' sizes) and seconds per
  checkpoint, and the restore of the last checkpoint (its references resolved through the
  URL storage: ranged reads of every object it needs) against a full load. moto keeps
  objects in its own memory and is written in Python, so its absolute figures are far below
  a real object store's; the ratios between the modes are the point. Skipped (and said so)
  without ``moto[server]`` and ``s3fs``.

Run: python benchmarks/bench_incremental.py [--parts incremental,s3] [--base-size 2G]
     [--trainable 0.015] [--checkpoints 10] [--dir DIR] [--repeats 3] [--json out.json]
     python benchmarks/bench_incremental.py --smoke   # seconds: a tiny state, 2 checkpoints
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from fastckpt.bench.units import format_bytes
from fastckpt.config import parse_size

INCREMENTAL_MODES = ("full", "hash", "default", "frozen", "compressed")


# -- the incremental part -----------------------------------------------------------------


def lora_like_state(base_size: int, trainable: float) -> tuple[dict[str, Any], list[str]]:
    """A frozen LLM-like base of ``base_size`` bytes, adapters of ``trainable`` times its
    parameter count (float32) with their Adam state, and a step counter; with the base's
    names."""
    import torch

    from fastckpt.bench.synthetic import llm_like_state_dict

    base = llm_like_state_dict(base_size)
    frozen = sorted(base)
    params = sum(t.numel() for t in base.values())
    matrices = [n for n in frozen if base[n].dim() == 2]
    per_matrix = max(2, int(params * trainable) // max(1, len(matrices)))
    state: dict[str, Any] = dict(base)
    generator = torch.Generator().manual_seed(1)
    for name in matrices:
        rows, cols = base[name].shape
        rank = max(1, per_matrix // (rows + cols))
        stem = name.removesuffix(".weight")
        for suffix, shape in (("lora_A", (rank, cols)), ("lora_B", (rows, rank))):
            value = torch.randn(shape, generator=generator) * 0.01
            state[f"{stem}.{suffix}"] = value
            state[f"optimizer.{stem}.{suffix}.exp_avg"] = torch.zeros(shape)
            state[f"optimizer.{stem}.{suffix}.exp_avg_sq"] = torch.zeros(shape)
    state["optimizer.step"] = torch.tensor(0.0)
    return state, frozen


def optimizer_step(state: dict[str, Any], frozen: set[str]) -> None:
    """Changes every trainable tensor in place as an Adam step does, from a random gradient
    (version bumps, and values as varied as real moments: a compressor finds no shortcut)."""
    import torch

    generator = torch.Generator().manual_seed(int(state["optimizer.step"]) + 1)
    for name, t in state.items():
        if name in frozen or name.startswith("optimizer.") or name == "optimizer.step":
            continue
        grad = torch.randn(t.shape, generator=generator) * 1e-3
        m, v = state[f"optimizer.{name}.exp_avg"], state[f"optimizer.{name}.exp_avg_sq"]
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        t.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-4)
    state["optimizer.step"].add_(1)


def _checkpoint_series(
    mode: str,
    state: dict[str, Any],
    frozen: list[str],
    location: Callable[[int], str],
    count: int,
    *,
    size: Callable[[str], int] = os.path.getsize,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``count`` checkpoints of ``state`` in ``mode`` at ``location(i)`` (a path or URL);
    bytes (``size(location)``) and seconds of each."""
    import fastckpt
    from fastckpt.checkpoint import tensor_records

    frozen_set = set(frozen)
    written, seconds, paths = [], [], []
    url = {} if storage_options is None else {"storage_options": storage_options}
    for i in range(count):
        optimizer_step(state, frozen_set)
        path = location(i)
        options: dict[str, Any] = dict(url)
        if mode != "full" and paths:
            options["base"] = paths[-1]
            if mode == "frozen":
                options["frozen"] = frozen_set
            if mode == "compressed":
                options["compress"] = True
            if mode == "hash":
                tensor_records.forget()
        started = time.perf_counter()
        fastckpt.save(state, path, **options)
        seconds.append(time.perf_counter() - started)
        written.append(size(path))
        paths.append(path)
    return {"written": written, "seconds": seconds, "last": str(paths[-1])}


def _timed_loads(
    path: str,
    repeats: int,
    cold: Callable[[list[str]], None],
    storage_options: dict[str, Any] | None = None,
) -> list[float]:
    import fastckpt
    from fastckpt.checkpoint.incremental import dependencies

    url = storage_options is not None
    files = [] if url else [path, *dependencies(path)]
    times = []
    for _ in range(repeats):
        cold(files)
        started = time.perf_counter()
        if url:
            fastckpt.load(path, storage_options=storage_options)
        else:
            fastckpt.load(path)
        times.append(time.perf_counter() - started)
    return times


def _summary(series: dict[str, Any]) -> dict[str, Any]:
    later = series["seconds"][1:] or series["seconds"]
    return {
        "first_seconds": series["seconds"][0],
        "first_bytes": series["written"][0],
        "median_seconds": statistics.median(later),
        "median_bytes": statistics.median(series["written"][1:] or series["written"]),
        "total_bytes": sum(series["written"]),
        "seconds": series["seconds"],
        "written": series["written"],
    }


def _restores(
    results: dict[str, Any], lasts: dict[str, str], loads: Callable[[str], list[float]]
) -> None:
    """Each mode's restore time of its last checkpoint, and a full load's over it."""
    for mode, last in lasts.items():
        results["modes"][mode]["restore_seconds"] = statistics.median(loads(last))
    if "full" in lasts:
        full_time = results["modes"]["full"]["restore_seconds"]
        for entry in results["modes"].values():
            entry["restore_vs_full"] = full_time / entry["restore_seconds"]


def incremental_part(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """The incremental part: see the module's docstring."""
    from fastckpt.bench.caches import PageCache

    cache = PageCache(allow_drop=not args.no_drop_caches)
    results: dict[str, Any] = {"cache": cache.describe(), "modes": {}}
    lasts = {}
    for mode in args.modes:
        # each mode starts from the same state, so every series saves the same values
        state, frozen = lora_like_state(args.base_size, args.trainable)
        (directory / mode).mkdir(parents=True, exist_ok=True)
        series = _checkpoint_series(
            mode,
            state,
            frozen,
            lambda i, mode=mode: str(directory / mode / f"step-{i:04d}.safetensors"),
            args.checkpoints,
        )
        lasts[mode] = series["last"]
        results["modes"][mode] = _summary(series)
        del state
    _restores(results, lasts, lambda last: _timed_loads(last, args.repeats, cache.drop))
    return results


_SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("http://%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # runs until the driver closes the pipe
server.stop()
"""


def _start_s3() -> tuple[subprocess.Popen[str], dict[str, Any]] | str:
    """moto's S3 server in a process of its own (its CPU stays out of the save's process)
    and the storage options reaching it; or why not."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as exc:
        return f"needs moto[server] and s3fs ({exc.name} is missing)"
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    endpoint = server.stdout.readline().strip()
    if not endpoint.startswith("http://"):
        server.kill()
        return "the moto S3 server did not start"
    options = {
        "key": "bench",
        "secret": "bench",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return server, options


def s3_part(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """The s3 part: the incremental series at an S3 server on loopback (see the module)."""
    del directory
    started = _start_s3()
    if isinstance(started, str):
        return {"skipped": started}
    server, options = started
    try:
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs.call_s3("create_bucket", Bucket=bucket)
        results: dict[str, Any] = {"endpoint": options["endpoint_url"], "modes": {}}
        lasts = {}
        for mode in args.modes:
            state, frozen = lora_like_state(args.base_size, args.trainable)
            series = _checkpoint_series(
                mode,
                state,
                frozen,
                lambda i, mode=mode: f"s3://{bucket}/{mode}/step-{i:04d}/state.safetensors",
                args.checkpoints,
                size=lambda url: int(fs.size(url)),
                storage_options=options,
            )
            lasts[mode] = series["last"]
            results["modes"][mode] = _summary(series)
            del state
        _restores(
            results,
            lasts,
            lambda last: _timed_loads(last, args.repeats, lambda files: None, options),
        )
        return results
    finally:
        assert server.stdin is not None
        server.stdin.close()  # the server stops when its input ends
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def print_incremental(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nincremental: {format_bytes(args.base_size)} frozen base, {args.trainable:.1%} "
        f"trainable (+ Adam state), {args.checkpoints} checkpoints; {results['cache']}"
    )
    _print_modes(results, "bytes/ckpt", "total written")


def print_s3(results: dict[str, Any], args: argparse.Namespace) -> None:
    if "skipped" in results:
        print(f"\ns3: skipped: {results['skipped']}")
        return
    print(
        f"\ns3 (moto on loopback, {results['endpoint']}): {format_bytes(args.base_size)} frozen "
        f"base, {args.trainable:.1%} trainable (+ Adam state), {args.checkpoints} checkpoints"
    )
    _print_modes(results, "uploaded/ckpt", "total uploaded")


def _print_modes(results: dict[str, Any], per_checkpoint: str, total: str) -> None:
    print(
        f"  {'mode':10} {per_checkpoint:>13} {'s/ckpt':>8} {total:>15} "
        f"{'restore s':>10} {'full/restore':>13}"
    )
    for mode, r in results["modes"].items():
        ratio = r.get("restore_vs_full")
        print(
            f"  {mode:10} {format_bytes(r['median_bytes']):>13} {r['median_seconds']:8.3f} "
            f"{format_bytes(r['total_bytes']):>15} {r['restore_seconds']:10.3f} "
            f"{'' if ratio is None else f'{ratio:.2f}x':>13}"
        )
    print("  (per-checkpoint figures: medians of checkpoints 2..N; the first is a full save)")


# -- driver -------------------------------------------------------------------------------

#: name -> (run, print); other parts add themselves here.
PARTS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[..., None]]] = {
    "incremental": (incremental_part, print_incremental),
    "s3": (s3_part, print_s3),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run")
    p.add_argument("--base-size", type=parse_size, default=parse_size("2G"))
    p.add_argument("--trainable", type=float, default=0.015, help="fraction of base params")
    p.add_argument("--checkpoints", type=int, default=10)
    p.add_argument("--modes", default=",".join(INCREMENTAL_MODES))
    p.add_argument("--repeats", type=int, default=3, help="loads timed per restore")
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: temp)")
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.base_size, args.checkpoints, args.repeats = parse_size("2M"), 2, 1
        args.no_drop_caches = True
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(INCREMENTAL_MODES)
    if unknown:
        p.error(f"unknown mode {sorted(unknown)[0]!r} (modes: {', '.join(INCREMENTAL_MODES)})")
    args.parts = [part for part in args.parts.split(",") if part]
    for part in args.parts:
        if part not in PARTS:
            p.error(f"unknown part {part!r} (parts: {', '.join(PARTS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-incremental-"))
    results: dict[str, Any] = {}
    try:
        for part in args.parts:
            run, show = PARTS[part]
            results[part] = run(args, root / part)
            show(results[part], args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
