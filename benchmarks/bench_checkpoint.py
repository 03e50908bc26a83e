#!/usr/bin/env python3
"""Checkpoint save and load: fastckpt against torch, safetensors and fio, in one run.

One run, one file system (``--dir``). Each round deletes the previous files, runs fio's
sequential write and read figures (the device's ceiling), then every save method, then
every load method, the order rotated from round to round so that disk noise hits all
methods alike. Every save and every load runs in its own child process, so CPU seconds
and peak RSS belong to that method alone:

* save: the child builds the same seeded LLM-like state dict, syncs, then times the save
  until the data is durable: ``fastckpt.save`` (which fsyncs and commits atomically),
  ``torch.save`` and ``safetensors.torch.save_file``, each followed by an fsync of the
  file and of its directory (the savers of ``fastckpt.bench.peers``);
* load: the child drops the page cache (as root; otherwise evicts the file's pages with
  ``posix_fadvise``), then times the load *and* a touch of every page of every tensor, so
  loaders that map the file lazily pay for their reads: ``fastckpt.load`` (default
  verification, and ``verify=False``), ``torch.load(weights_only=True, mmap=False)`` and
  ``safetensors.torch.load_file``.

Figures are medians over ``--repeats`` rounds; GB/s counts the state dict's tensor bytes
(1 GB = 1e9 bytes). The extra peak RSS is the child's peak during the timed section
(``ru_maxrss`` after resetting the peak mark) minus its RSS when the section started,
i.e. above the state dict for saves. The table goes to stdout as Markdown; progress goes
to stderr.

Example::

    python benchmarks/bench_checkpoint.py                      # 2 GiB, 3 repeats, /work/bench-tmp
    python benchmarks/bench_checkpoint.py --size 512M --repeats 1 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from fastckpt.bench.caches import PageCache
from fastckpt.bench.children import child_main, spawn
from fastckpt.bench.comparison import DEVICE_ROW
from fastckpt.bench.comparison import verdict as one_line_verdict
from fastckpt.bench.filesystems import (
    available_memory,
    filesystem_of,
    free_bytes,
    require_directory,
)
from fastckpt.bench.fio import FIO_LOCKED, fio_path, fio_round, fio_version
from fastckpt.bench.report import fmt, log, machine
from fastckpt.bench.results import Results, rotate
from fastckpt.bench.timed_runs import child_load, child_save
from fastckpt.bench.units import MiB, format_bytes
from fastckpt.config import parse_size

REPO = Path(__file__).resolve().parent.parent

# method -> (label, file it writes or reads)
SAVES: dict[str, tuple[str, str]] = {
    "fastckpt": ("fastckpt.save", "fastckpt.safetensors"),
    "torch": ("torch.save + fsync", "torch.pt"),
    "safetensors": ("safetensors save_file + fsync", "safetensors.safetensors"),
}
LOADS: dict[str, tuple[str, str]] = {
    "fastckpt": ("fastckpt.load", "fastckpt.safetensors"),
    "fastckpt-noverify": ("fastckpt.load(verify=False)", "fastckpt.safetensors"),
    # every read path fastckpt can take, forced, beside the one it chose above
    "fastckpt-direct": ("fastckpt.load, O_DIRECT reads", "fastckpt.safetensors"),
    "fastckpt-buffered": ("fastckpt.load, buffered reads", "fastckpt.safetensors"),
    "fastckpt-mapped": ("fastckpt.load, mapped reads", "fastckpt.safetensors"),
    "torch": ("torch.load(mmap=False)", "torch.pt"),
    "safetensors": ("safetensors load_file", "safetensors.safetensors"),
}
FIO_LABELS = {"write": "fio seq write (direct, end_fsync)", "read": "fio seq read (direct)"}

# Targets the figures are read against (reported, not asserted).
SAVE_VS_SAFETENSORS = 2.5
SAVE_VS_TORCH = 5.0
LOAD_VS_SAFETENSORS = 1.2
LOAD_OF_FIO = 0.9
NOISY_SPREAD = 1.5  # max/min GB/s over rounds above which a method is called noisy
RSS_ALLOWANCE = 32 * MiB  # interpreter and engine bookkeeping on top of the staging budget


# ============================================================================ child side

HANDLERS = {"save": child_save, "load": lambda spec: child_load({**spec, "cold": True})}


# =========================================================================== parent side


def run_one(op: str, method: str, workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    name = (SAVES if op == "save" else LOADS)[method][1]
    path = os.path.join(workdir, name)
    if op == "save" and os.path.exists(path):
        os.remove(path)
    spec = {"op": op, "method": method, "file": path, "size": args.size, "seed": args.seed}
    return spawn(__file__, spec, args.child_timeout)


def check_directory(directory: Path, size: int) -> None:
    require_directory(directory, 3 * size + 256 * MiB, memory=False)
    mem = available_memory()
    if mem is not None and mem < 2.5 * size:
        log(
            f"warning: only {format_bytes(mem)} of memory available for a {format_bytes(size)} "
            "state dict; children may be killed or figures skewed by swapping"
        )


def _table(
    title: str,
    rows: list[tuple[str, dict[str, Any]]],
    ref: dict[str, Any],
    fio: dict[str, Any] | None,
) -> list[str]:
    lines = [
        f"### {title}",
        "",
        (
            "| method | GB/s (median) | GB/s min–max | seconds | fastckpt is × faster | % of fio "
            "| CPU s | extra peak RSS (MiB) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ref_gbps = ref.get("gbps")
    fio_gbps = fio.get("gbps") if fio else None
    for label, s in rows:
        if not s.get("n"):
            why = "; ".join(e for e in s.get("errors", []) if e) or "not run"
            lines.append(f"| {label} | failed: {why} | | | | | | |")
            continue
        speedup = ref_gbps / s["gbps"] if ref_gbps else None
        of_fio = 100 * s["gbps"] / fio_gbps if fio_gbps else None
        rss = s.get("extra_rss")
        lines.append(
            f"| {label} | {s['gbps']:.2f} | {s['gbps_min']:.2f}–{s['gbps_max']:.2f} | {s['seconds']:.2f} "
            f"| {fmt(speedup, '.2f', '×')} | {fmt(of_fio, '.0f', '%')} | {fmt(s.get('cpu_seconds'), '.2f')} "
            f"| {fmt(None if rss is None else rss / MiB, '.0f')} |"
        )
    return lines + [""]


def _rounds_table(rounds: dict[str, list[float | None]]) -> list[str]:
    """GB/s of every round, so the spread behind each median is visible."""
    n = max((len(v) for v in rounds.values()), default=0)
    lines = [
        "### GB/s per round (order rotated each round)",
        "",
        "| method | " + " | ".join(f"round {i + 1}" for i in range(n)) + " |",
        "|---|" + "---:|" * n,
    ]
    for label, values in rounds.items():
        cells = [fmt(v, ".2f") for v in values] + [""] * (n - len(values))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def report_markdown(meta: dict[str, Any], stats: dict[str, Any]) -> str:
    saves, loads, fio = stats["save"], stats["load"], stats["fio"]
    fio_w = fio.get("write") if fio else None
    fio_r = fio.get("read") if fio else None
    out = [
        (
            f"## Checkpoint benchmark — {format_bytes(meta['payload_bytes'])} LLM-like "
            f"state dict ({meta['tensors']} tensors, float32 + bfloat16)"
        ),
        "",
    ]
    out.append(
        f"- directory: `{meta['dir']}` on {meta['filesystem']}; free before: {meta['free_before']}"
    )
    out.append(
        f"- {meta['repeats']} repeats, medians; methods interleaved (rotated) per round; each "
        "save/load in its own process"
    )
    out.append(
        f"- reads cold: {meta['cache_note']}; loads timed until every page of every tensor is touched"
    )
    out.append(
        "- saves timed to durability: fsync of file and directory (fastckpt.save does this itself)"
    )
    out.append(
        f"- machine: {meta['cpus']} CPUs, {meta['memory']}, kernel {meta['kernel']}; python "
        f"{meta['python']}, torch {meta['torch']}, safetensors {meta['safetensors']}"
    )
    out.append(f"- fastckpt I/O: {meta['fastckpt_io']}; staging budget {meta['staging_note']}")
    out.append(f"- fio: {meta['fio']}")
    out.append(f"- wall time of the run: {meta['wall_seconds']:.0f} s")
    out.append("")

    def fio_row(kind: str, s: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
        return [(FIO_LABELS[kind], s)] if s is not None else []

    out += _table(
        "Save (timed to durability)",
        [(SAVES[m][0], saves[m]) for m in SAVES] + fio_row("write", fio_w),
        saves["fastckpt"],
        fio_w,
    )
    out += _table(
        "Load (cold cache, every tensor touched)",
        [(LOADS[m][0], loads[m]) for m in LOADS] + fio_row("read", fio_r),
        loads["fastckpt"],
        fio_r,
    )
    if fio is None:
        out += ["fio not installed: no device ceiling.", ""]
    resident = [(m, loads[m].get("resident_max")) for m in LOADS if loads[m].get("n")]
    known = [share for _, share in resident if share is not None]
    if known:
        warm = [LOADS[m][0] for m, share in resident if share is not None and share > 0.01]
        out += [
            f"Cold proved: the most of a file resident before any load was {max(known):.1%} "
            "(mincore, as fincore reports)"
            + (f"; **not cold** for {', '.join(warm)}" if warm else "")
            + ".",
            "",
        ]
    out += _rounds_table(meta["rounds"])

    def gbps(s: dict[str, Any] | None) -> float:
        return float(s["gbps"]) if s and s.get("gbps") else math.nan

    # fio's figures are the device's ceiling here (comparison.py's own is a raw O_DIRECT row)
    medians = {
        "fastckpt": (gbps(saves["fastckpt"]), gbps(loads["fastckpt"])),
        "torch.save/load": (gbps(saves["torch"]), gbps(loads["torch"])),
        "safetensors": (gbps(saves["safetensors"]), gbps(loads["safetensors"])),
        DEVICE_ROW: (gbps(fio_w), gbps(fio_r)),
    }
    out += [f"**Verdict:** {one_line_verdict(medians)} (the device: fio in the same rounds).", ""]

    out += ["### Targets", "", "| target | measured | met |", "|---|---|:-:|"]

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        if not a or not b or not a.get("gbps") or not b.get("gbps"):
            return None
        return a["gbps"] / b["gbps"]

    def verdict(value: float | None, ok: Callable[[float], bool]) -> str:
        return "n/a" if value is None else ("yes" if ok(value) else "**no**")

    r = ratio(saves["fastckpt"], saves["safetensors"])
    out.append(
        f"| save ≥ {SAVE_VS_SAFETENSORS}× safetensors save_file | {fmt(r, '.2f', '×')} "
        f"| {verdict(r, lambda v: v >= SAVE_VS_SAFETENSORS)} |"
    )
    r = ratio(saves["fastckpt"], saves["torch"])
    out.append(
        f"| save ≥ {SAVE_VS_TORCH}× torch.save | {fmt(r, '.2f', '×')} "
        f"| {verdict(r, lambda v: v >= SAVE_VS_TORCH)} |"
    )
    r = ratio(loads["fastckpt"], loads["safetensors"])
    out.append(
        f"| load ≥ {LOAD_VS_SAFETENSORS}× safetensors load_file (touched) | {fmt(r, '.2f', '×')} "
        f"| {verdict(r, lambda v: v >= LOAD_VS_SAFETENSORS)} |"
    )
    r = ratio(loads["fastckpt"], fio_r)
    out.append(
        f"| load within 10% of fio's read (≥ {LOAD_OF_FIO:.0%}) | "
        + (f"{r:.0%} of fio" if r is not None else ("fio not installed" if fio is None else "n/a"))
        + f" | {verdict(r, lambda v: v >= LOAD_OF_FIO)} |"
    )
    budget = meta.get("staging_bytes")
    worst = saves["fastckpt"].get("extra_rss_max")
    if budget and worst is not None:
        limit = budget + RSS_ALLOWANCE
        out.append(
            f"| save extra peak RSS ≤ staging budget ({budget / MiB:.0f} MiB, +{RSS_ALLOWANCE // MiB} MiB "
            f"allowance), not the checkpoint's {meta['payload_bytes'] / MiB:.0f} MiB | worst "
            f"{worst / MiB:.0f} MiB (median {saves['fastckpt']['extra_rss'] / MiB:.0f}) "
            f"| {'yes' if worst <= limit else '**no**'} |"
        )
    else:
        out.append("| save extra peak RSS ≤ staging budget | n/a | n/a |")
    out.append("")
    if meta.get("notes"):
        out += ["Notes:", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    return "\n".join(out)


def parent_main(args: argparse.Namespace) -> int:
    import fastckpt.config

    t_start = time.perf_counter()
    base = Path(args.dir).resolve()
    created_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    try:
        check_directory(base, args.size)
    except SystemExit:
        if created_base:
            base.rmdir()
        raise
    fs_type, source, mount = filesystem_of(base)
    free_before = format_bytes(free_bytes(base))
    workdir = tempfile.mkdtemp(prefix="fastckpt-bench-", dir=base)
    have_fio = fio_path() is not None and not args.no_fio
    fio_bytes = max(MiB, args.size // MiB * MiB)
    results = Results()
    log(f"{format_bytes(args.size)} x {args.repeats} rounds in {workdir} ({fs_type} {source})")
    try:
        for rnd in range(args.repeats):
            for name in {v[1] for v in SAVES.values()}:
                p = os.path.join(workdir, name)
                if os.path.exists(p):
                    os.remove(p)
            if have_fio:
                for kind, res in fio_round(workdir, fio_bytes, args.child_timeout).items():
                    results.record("fio", kind, rnd, res)
            for op, methods in (("save", list(SAVES)), ("load", list(LOADS))):
                for method in rotate(methods, rnd):
                    results.record(op, method, rnd, run_one(op, method, workdir, args))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if created_base:
            try:
                base.rmdir()
            except OSError:
                pass

    stats = {
        "save": results.stats("save", SAVES),
        "load": results.stats("load", LOADS),
        "fio": results.stats("fio", ("write", "read")) if have_fio else None,
    }
    raw = results.raw
    ok = [r for r in raw if r["op"] in ("save", "load") and "seconds" in r]
    notes: list[str] = []
    digests = {r["digest"] for r in ok}
    if len(digests) > 1:
        notes.append(
            "the bytes differ between methods or rounds: some file did not read back what was "
            f"saved ({len(digests)} distinct CRC digests)"
        )
    elif digests:
        notes.append("every load read back the saved bytes (equal CRC-32 of every tensor)")
    noisy = []
    for op, labels in (("save", SAVES), ("load", LOADS), ("fio", FIO_LABELS)):
        for method, st in (stats[op] or {}).items():
            if st.get("n", 0) >= 2 and st["gbps_max"] > NOISY_SPREAD * st["gbps_min"]:
                label = labels[method] if op == "fio" else labels[method][0]
                noisy.append(f"{label} ({st['gbps_min']:.2f}–{st['gbps_max']:.2f})")
    if noisy:
        notes.append(
            f"rounds differ by more than {NOISY_SPREAD}× for: "
            + ", ".join(noisy)
            + "; ratios of medians carry that uncertainty"
        )
    if any(not r.get("peak_was_reset", True) for r in ok):
        notes.append(
            "the peak-RSS mark could not be reset: extra RSS includes what came before the timing"
        )
    caches = {r.get("cache") for r in ok if r["op"] == "load"}
    if caches - {"drop_caches"}:
        notes.append(f"page cache not dropped for every load (got {sorted(map(str, caches))})")
    if stats["fio"] is None:
        notes.append("fio not installed" if fio_path() is None else "fio skipped (--no-fio)")
    first = ok[0] if ok else {}
    io_cfg = fastckpt.config.resolve_io(str(base), {}).__dict__
    budget = fastckpt.config.staging_bytes()
    host = machine()

    rounds = {f"save {SAVES[m][0]}": results.per_round("save", m, args.repeats) for m in SAVES}
    rounds.update(
        {f"load {LOADS[m][0]}": results.per_round("load", m, args.repeats) for m in LOADS}
    )
    if have_fio:
        rounds.update(
            {FIO_LABELS[k]: results.per_round("fio", k, args.repeats) for k in ("write", "read")}
        )
    meta = {
        "rounds": rounds,
        "dir": str(base),
        "filesystem": f"{fs_type} ({source}, mounted at {mount})",
        "free_before": free_before,
        "repeats": args.repeats,
        "size_arg": args.size,
        "payload_bytes": first.get("payload_bytes", args.size),
        "file_bytes": {m: (results.pick("save", m) or [{}])[-1].get("file_bytes") for m in SAVES},
        "tensors": first.get("tensors", "?"),
        "cache_note": (
            "page cache dropped before each load (sync; echo 3 > /proc/sys/vm/drop_caches)"
            if PageCache().can_drop
            else "not root: file pages evicted with posix_fadvise(DONTNEED)"
        ),
        "cpus": host["cpus"],
        "memory": host["memory"],
        "kernel": host["kernel"],
        "python": host["python"],
        "torch": host["versions"]["torch"],
        "safetensors": host["versions"]["safetensors"],
        "fastckpt_io": ", ".join(f"{k}={v}" for k, v in io_cfg.items()),
        "staging_bytes": budget,
        "staging_note": format_bytes(budget) if budget else "n/a",
        "fio": (
            f"{fio_version()}, --rw=write|read --bs=4M --iodepth=32 --direct=1 --ioengine=io_uring "
            f"{' '.join(FIO_LOCKED)} --size={fio_bytes} (writes --end_fsync=1); fio's own runtime"
        )
        if have_fio
        else ("fio not installed" if fio_path() is None else "skipped (--no-fio)"),
        "wall_seconds": time.perf_counter() - t_start,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "notes": notes,
    }
    print(report_markdown(meta, stats))
    if args.json:
        results.dump(args.json, meta=meta, medians=stats)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir",
        default=str(REPO.parent / "bench-tmp"),
        help="directory on the file system to measure (default: %(default)s); "
        "created and removed if it does not exist",
    )
    parser.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("2G"),
        help="state dict size, e.g. 512M, 2G, 8G (default 2G)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds; medians are reported (default 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    parser.add_argument("--json", metavar="FILE", help="also write the raw results here")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even when it is installed")
    parser.add_argument("--child-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child, HANDLERS)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
