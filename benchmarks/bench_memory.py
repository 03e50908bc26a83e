#!/usr/bin/env python3
"""Checkpoints at memory speed: fastckpt against its peers from tmpfs and the page cache.

The regimes (``--regime``, comma-separated; default ``tmpfs,hot``):

* ``tmpfs``: the files live in a memory file system (``--shm``, default /dev/shm);
* ``hot``: the files live on a disk (``--dir``) and were read once, so every load finds
  them in the page cache (they are read again before each round to keep them there);
* ``cold``: the files on the disk, the page cache dropped before every load (as root;
  otherwise the file's pages are evicted with ``posix_fadvise``); fio's read is the ceiling.

Loads, each in a fresh child process (so RSS and caches are its own), timed until every
page of every tensor has been touched, then checked: the CRC-32 of every tensor must equal
that of the tensor saved. Methods: ``fastckpt.load``, ``fastckpt.load(mmap=True)`` (when
this fastckpt has it), safetensors ``load_file`` (its default mmap backend, and
``backend="pread"`` where this safetensors has it) and ``safe_open``, ``torch.load`` and
``torch.load(mmap=True)`` of a ``torch.save`` file, the Run:ai model streamer,
fastsafetensors (nogds, CPU), and the parallel-``preadv`` ceiling (one thread per core
reading the safetensors file into one buffer, faulted in by the reads; and the same into a
prefaulted buffer). Peers that are not installed are skipped with the reason.

Saves (``fastckpt.save``, ``safetensors.torch.save_file``, ``torch.save``), each in a
fresh child that builds the state dict first, timed until durable (fsync of the file and
its directory), in every regime's directory.

Beside training (``--busy N``, a comma list; ``--busy`` alone: one per core): every regime is
measured again with N processes running a training-like CPU loop (float32 matmuls on one
torch thread each, :class:`~fastckpt.bench.training_load.TrainingLoad`), started before the
regime's first round and running through its last; ``0`` is the quiet machine. The load
averages at the start and end of each pass are printed with its tables.

Rounds interleave the methods (the order rotates), figures are medians of ``--repeats``
rounds. Printed per regime: GB/s (10^9 bytes of tensor data per second), how many times
faster fastckpt is, CPU seconds per GB, peak RSS above the checkpoint's size, and the
threads a load keeps busy (mean count of threads running or in I/O wait, sampled every
2 ms in one extra, untimed round).

Peers install (torch pinned, so no CUDA build is pulled)::

    pip install -c benchmarks/constraints.txt -e ".[bench]"

Example::

    python benchmarks/bench_memory.py --size 1G --repeats 5
    python benchmarks/bench_memory.py --size 8M --repeats 1 --regime tmpfs --json out.json
    python benchmarks/bench_memory.py --size 1G --regime tmpfs,hot,cold --busy 0,2 \
        --loads fastckpt,safetensors,fastsafetensors,runai,preadv --saves none
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastckpt.bench.caches import drop_page_cache, warm_page_cache
from fastckpt.bench.checks import file_crc32, tensor_crc32s
from fastckpt.bench.children import child_main, spawn
from fastckpt.bench.filesystems import filesystem_of, free_bytes
from fastckpt.bench.fio import FIO_LOCKED, fio_path, fio_sequential
from fastckpt.bench.peers import LOADERS, SAVERS, Skip
from fastckpt.bench.report import fmt, log, markdown_table, version_of
from fastckpt.bench.results import rotate, summarize
from fastckpt.bench.timed_runs import child_load, child_save
from fastckpt.bench.training_load import TrainingLoad, load_average
from fastckpt.bench.units import MiB, format_bytes
from fastckpt.config import parse_size
from fastckpt.io.page_cache import MEMORY_FILESYSTEMS

REPO = Path(__file__).resolve().parent.parent
FILES = {
    "fastckpt": "fastckpt.safetensors",
    "safetensors": "st.safetensors",
    "torch": "torch.pt",
    "raw": "raw.bin",  # the write ceilings' bytes: saved, never loaded
}
REGIMES = ("tmpfs", "hot", "cold")
DEFAULT_LOADS = tuple(m for m in LOADERS if m != "fastckpt-noverify")
# fastckpt.load copies into fresh memory, as these do; load(mmap=True) maps, as those do.
COPYING_PEERS = ("runai", "fastsafetensors", "safetensors-pread", "torch")
MAPPING_PEERS = ("safetensors", "safe_open", "torch-mmap")
#: fio's cold reads: into registered (pinned, reused) buffers, and into plain ones.
FIO_READS = {"read": FIO_LOCKED, "read-plain": ()}

# Targets the numbers are read against (none is asserted).
LOAD_VS_BEST_PEER = 1.0
LOAD_OF_PREADV = 0.8
LOAD_OF_FIO = 0.9
SAVE_VS_SAFETENSORS_TMPFS = 1.5
LOAD_RSS_ALLOWANCE = 64 * MiB
SAVE_EXTRA_RSS = 256 * MiB


# ============================================================================ child side


def _state(spec: dict[str, Any]) -> dict[str, Any]:
    from fastckpt.bench.synthetic import llm_like_state_dict

    return llm_like_state_dict(spec["size"], seed=spec["seed"])


def child_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """Writes the three files the loads read and the CRC-32s they are checked against."""
    state = _state(spec)
    directory = spec["dir"]
    for name, saver in SAVERS.items():
        if saver.file not in {loader.file for loader in LOADERS.values()}:
            continue
        try:
            saver.setup(state, os.path.join(directory, FILES[saver.file]))()
        except Skip as why:
            if name == "safetensors":  # the peers read this file
                raise RuntimeError(f"cannot write the peers' file: {why}") from None
    crcs = {
        "tensors": tensor_crc32s(state),
        "file": file_crc32(os.path.join(directory, FILES["safetensors"])),
    }
    with open(spec["crc_file"], "w", encoding="utf-8") as f:
        json.dump(crcs, f)
    return {
        "payload_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state),
    }


HANDLERS = {"prepare": child_prepare, "save": child_save, "load": child_load}


# =========================================================================== parent side


class Run:
    """The parent's state: arguments, the results of every child, the log."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.raw: list[dict[str, Any]] = []
        self.busy = 0  # training-like processes running beside the current pass
        # (regime, busy) -> the load averages at the start and end of that pass
        self.load_averages: dict[tuple[str, int], list[tuple[float, float, float]]] = {}

    def child(self, spec: dict[str, Any]) -> dict[str, Any]:
        return spawn(__file__, spec, self.args.child_timeout)

    def record(self, regime: str, rnd: int, op: str, method: str, res: dict[str, Any]) -> None:
        self.raw.append(
            {"regime": regime, "busy": self.busy, "round": rnd, "op": op, "method": method, **res}
        )
        when = "sampled" if rnd < 0 else f"round {rnd + 1}"
        beside = f" busy {self.busy}" if self.busy else ""
        head = f"{regime:5s}{beside} {when}: {op} {method:15s}"
        if "error" in res or "skipped" in res:
            log(f"{head} {res.get('error') or 'skipped: ' + res['skipped']}")
            return
        rate = (
            res["payload_bytes"] / res["seconds"] / 1e9 if "payload_bytes" in res else res["gbps"]
        )
        wrong = f"  WRONG BYTES {res['wrong']}" if res.get("wrong") else ""
        log(f"{head} {rate:6.2f} GB/s  cpu {res.get('cpu_seconds', 0):5.2f} s{wrong}")


def regime_dir(regime: str, args: argparse.Namespace) -> Path:
    return Path(args.shm if regime == "tmpfs" else args.dir).resolve()


def check_regime_dir(regime: str, base: Path, size: int) -> None:
    fs_type, _, mount = filesystem_of(base)
    memory = fs_type in MEMORY_FILESYSTEMS
    if regime == "tmpfs" and not memory:
        raise SystemExit(f"error: --shm {base} is on {fs_type} ({mount}), not a memory file system")
    if regime != "tmpfs" and memory:
        raise SystemExit(f"error: --dir {base} is on {fs_type} ({mount}); pick a disk for {regime}")
    need = 4 * size + 64 * MiB
    if free_bytes(base) < need:
        raise SystemExit(
            f"error: {base} has {format_bytes(free_bytes(base))} free; the {regime} regime "
            f"needs about {format_bytes(need)}"
        )


def run_regime(run: Run, regime: str, workdir: str) -> dict[str, Any]:
    """Prepares the files, then for each ``--busy`` level (training-like processes started
    before the first round, stopped after the last) the rounds of :func:`run_rounds`."""
    args = run.args
    crc_file = os.path.join(workdir, "crc.json")
    base = {"size": args.size, "seed": args.seed, "dir": workdir, "crc_file": crc_file}
    prep = run.child({**base, "op": "prepare"})
    if "error" in prep:
        raise SystemExit(f"error: preparing the {regime} files failed: {prep['error']}")
    for busy in args.busy:
        run.busy = busy
        with TrainingLoad(busy):
            averages = run.load_averages.setdefault((regime, busy), [])
            averages.append(load_average())
            log(f"{regime}: {busy} busy processes; load average {averages[0]}")
            run_rounds(run, regime, workdir, base, prep)
            averages.append(load_average())
    run.busy = 0
    return prep


def run_rounds(
    run: Run, regime: str, workdir: str, base: dict[str, Any], prep: dict[str, Any]
) -> None:
    """``--repeats`` rounds of saves and loads, then one sampled round."""
    args = run.args
    files = [os.path.join(workdir, FILES[kind]) for kind in {m.file for m in LOADERS.values()}]
    fio = None
    if regime == "cold" and fio_path() and not args.no_fio:
        fio = os.path.join(workdir, "fio.dat")
    loads = [m for m in args.loads if m in LOADERS]
    saves = list(args.saves)
    for rnd in range(args.repeats + (0 if args.no_streams else 1)):
        sample = rnd == args.repeats  # the extra round: thread counts, not timings
        if not sample:
            for method in rotate(saves, rnd) if saves else []:
                path = os.path.join(workdir, "save-" + FILES[SAVERS[method].file])
                res = run.child({**base, "op": "save", "method": method, "file": path})
                run.record(regime, rnd, "save", method, res)
                if "skipped" in res:
                    saves.remove(method)
                if os.path.exists(path):
                    os.remove(path)
            if fio:
                for kind in ("write", *FIO_READS):
                    drop_page_cache([fio])
                    res = fio_sequential(
                        kind.split("-")[0],
                        fio,
                        args.size // MiB * MiB,
                        bs="4M",
                        extra=FIO_READS.get(kind, FIO_LOCKED),
                    )
                    run.record(regime, rnd, "fio", kind, res)
                os.remove(fio)
        if regime == "hot":
            warm_page_cache(files)
        for method in list(rotate(loads, rnd)):
            path = os.path.join(workdir, FILES[LOADERS[method].file])
            spec = {
                **base,
                "op": "load",
                "method": method,
                "file": path,
                "cold": regime == "cold",
                "sample": sample,
                "payload_bytes": prep["payload_bytes"],
            }
            res = run.child(spec)
            run.record(regime, -1 if sample else rnd, "load", method, res)
            if "skipped" in res:  # it cannot run here: no need to ask again
                loads.remove(method)


def regime_report(
    run: Run, regime: str, prep: dict[str, Any], where: str, busy: int = 0
) -> tuple[str, list[str]]:
    """The Markdown tables of one regime (at one ``--busy`` level) and the lines of its
    target checks."""
    args = run.args
    nbytes = prep["payload_bytes"]
    gb = nbytes / 1e9
    averages = run.load_averages.get((regime, busy), [])
    beside = f" beside {busy} busy processes" if busy else " (quiet)"
    if averages:
        beside += "; load average " + " → ".join(f"{a[0]:.2f}" for a in averages)
    title = f"{regime}, busy {busy}" if busy else regime

    def pick(op: str, method: str, sampled: bool = False) -> list[dict[str, Any]]:
        return [
            r
            for r in run.raw
            if r["regime"] == regime
            and r.get("busy", 0) == busy
            and r["op"] == op
            and r["method"] == method
            and (r["round"] < 0) == sampled
        ]

    loads = {m: summarize(pick("load", m)) for m in args.loads}
    saves = {m: summarize(pick("save", m)) for m in args.saves}
    fio = {k: summarize(pick("fio", k)) for k in ("write", *FIO_READS)}
    streams = {}
    for m in args.loads:
        s = [r for r in pick("load", m, sampled=True) if "streams" in r]
        streams[m] = (s[0]["streams"], s[0]["streams_max"]) if s else None
    wrong = {m for m in args.loads for r in pick("load", m) if r.get("wrong")}

    def why_not(s: dict[str, Any]) -> str:
        return "; ".join(s.get("skipped", []) + s.get("errors", [])) or "not run"

    fast_load = loads.get("fastckpt", {}).get("gbps")
    rows = []
    for m in args.loads:
        s = loads[m]
        if not s.get("n"):
            rows.append([LOADERS[m].label, "—", "—", "—", "—", "—", "—", f"skipped: {why_not(s)}"])
            continue
        ratio = fast_load / s["gbps"] if fast_load else None
        over = (s["extra_rss_max"] - nbytes) / MiB if s.get("extra_rss_max") is not None else None
        st = streams.get(m)
        rows.append(
            [
                LOADERS[m].label,
                f"{s['gbps']:.2f}",
                f"{s['gbps_min']:.2f}–{s['gbps_max']:.2f}",
                fmt(ratio, ".2f", "×"),
                fmt(s["cpu_seconds"] / gb, ".2f"),
                fmt(over, "+.0f"),
                f"{st[0]:.1f} (max {st[1]})" if st else "n/a",
                "**WRONG BYTES**" if m in wrong else "yes",
            ]
        )
    for kind, label in (("read", "registered"), ("read-plain", "plain")):
        f = fio[kind]
        if not f.get("n"):
            continue
        rows.append(
            [
                f"fio seq read (O_DIRECT, 4 MiB × 32, {label} buffers)",
                f"{f['gbps']:.2f}",
                f"{f['gbps_min']:.2f}–{f['gbps_max']:.2f}",
                fmt(fast_load / f["gbps"] if fast_load else None, ".2f", "×"),
                fmt(f["cpu_seconds"] / (f["seconds"] * f["gbps"]), ".2f"),
                "",
                "",
                "",
            ]
        )
    cache = {
        "tmpfs": "files in tmpfs",
        "hot": "page-cache-hot files",
        "cold": "page cache dropped",
    }[regime]
    out = [
        f"### {title}: load ({cache}; {where}){beside}",
        "",
        markdown_table(
            [
                "method",
                "GB/s",
                "min–max",
                "fastckpt is ×",
                "CPU s/GB",
                "peak RSS − size (MiB)",
                "busy threads",
                "bytes verified",
            ],
            rows,
            "lrrrrrrl",
        ),
        "",
    ]
    fast_save = saves.get("fastckpt", {}).get("gbps")
    rows = []
    for m in args.saves:
        s = saves[m]
        if not s.get("n"):
            rows.append([SAVERS[m].label, "—", "—", "—", "—", f"skipped: {why_not(s)}"])
            continue
        rows.append(
            [
                SAVERS[m].label,
                f"{s['gbps']:.2f}",
                fmt(fast_save / s["gbps"] if fast_save else None, ".2f", "×"),
                fmt(s["cpu_seconds"] / gb, ".2f"),
                fmt(
                    s["extra_rss_max"] / MiB if s.get("extra_rss_max") is not None else None,
                    ".0f",
                ),
                "",
            ]
        )
    if fio["write"].get("n"):
        f = fio["write"]
        rows.append(
            [
                "fio seq write (O_DIRECT, end_fsync)",
                f"{f['gbps']:.2f}",
                fmt(fast_save / f["gbps"] if fast_save else None, ".2f", "×"),
                "",
                "",
                "",
            ]
        )
    if rows:
        out += [
            f"### {title}: save (timed until durable)",
            "",
            markdown_table(
                ["method", "GB/s", "fastckpt is ×", "CPU s/GB", "extra peak RSS (MiB)", "note"],
                rows,
                "lrrrrl",
            ),
            "",
        ]

    # Targets: ratios, read against the goals (nothing asserted).
    checks = []

    def check(
        text: str, value: float | None, goal: float, spec: str = ".2f", suffix: str = "×", low=True
    ) -> None:
        met = (
            "n/a"
            if value is None
            else ("met" if (value >= goal if low else value <= goal) else "NOT met")
        )
        checks.append(f"- {title}: {text}: {fmt(value, spec, suffix)} → {met}")

    def best_of(methods: tuple[str, ...]) -> float | None:
        rates = [loads[m]["gbps"] for m in methods if m in loads and loads[m].get("n")]
        return max(rates) if rates else None

    best = best_of(COPYING_PEERS)
    check(
        f"load ≥ {LOAD_VS_BEST_PEER}× the best copying loader (Run:ai, fastsafetensors, "
        "safetensors pread, torch.load)",
        fast_load / best if fast_load and best else None,
        LOAD_VS_BEST_PEER,
    )
    best = best_of(MAPPING_PEERS)
    mapped = loads.get("fastckpt-mmap", {}).get("gbps")
    check(
        f"load(mmap=True) ≥ {LOAD_VS_BEST_PEER}× the best mapping loader (safetensors, "
        "torch.load(mmap=True), every page touched)",
        mapped / best if mapped and best else None,
        LOAD_VS_BEST_PEER,
    )
    ceiling = loads.get("preadv", {}).get("gbps")
    check(
        f"load ≥ {LOAD_OF_PREADV}× the parallel-preadv ceiling",
        fast_load / ceiling if fast_load and ceiling else None,
        LOAD_OF_PREADV,
    )
    if regime == "cold":
        for kind, label in (("read", "registered"), ("read-plain", "plain")):
            r = fio[kind].get("gbps")
            check(
                f"cold load ≥ {LOAD_OF_FIO}× fio read ({label} buffers)",
                fast_load / r if fast_load and r else None,
                LOAD_OF_FIO,
            )
        w = fio["write"].get("gbps")
        check(
            f"save to disk ≥ {LOAD_OF_FIO}× fio write",
            fast_save / w if fast_save and w else None,
            LOAD_OF_FIO,
        )
    if regime == "tmpfs":
        st = saves.get("safetensors", {}).get("gbps")
        check(
            f"save to tmpfs ≥ {SAVE_VS_SAFETENSORS_TMPFS}× safetensors save_file",
            fast_save / st if fast_save and st else None,
            SAVE_VS_SAFETENSORS_TMPFS,
        )
    for method in ("pwrite-1", "pwrite"):
        ceiling = saves.get(method, {}).get("gbps")
        if ceiling:
            check(
                f"save ≥ {LOAD_OF_PREADV}× the {SAVERS[method].label}",
                fast_save / ceiling if fast_save else None,
                LOAD_OF_PREADV,
            )
    worst = loads.get("fastckpt", {}).get("extra_rss_max")
    check(
        f"load peak RSS ≤ size + {LOAD_RSS_ALLOWANCE // MiB} MiB (worst round, above size)",
        None if worst is None else (worst - nbytes) / MiB,
        LOAD_RSS_ALLOWANCE / MiB,
        "+.0f",
        " MiB",
        low=False,
    )
    mm = loads.get("fastckpt-mmap", {})
    if mm.get("n"):
        check(
            "mmap load: peak RSS beyond the touched pages (= size)",
            (mm["extra_rss_max"] - nbytes) / MiB,
            LOAD_RSS_ALLOWANCE / MiB,
            "+.0f",
            " MiB",
            low=False,
        )
    worst = saves.get("fastckpt", {}).get("extra_rss_max")
    check(
        f"save extra RSS ≤ {SAVE_EXTRA_RSS // MiB} MiB (worst round)",
        None if worst is None else worst / MiB,
        SAVE_EXTRA_RSS / MiB,
        ".0f",
        " MiB",
        low=False,
    )
    return "\n".join(out), checks


def parent_main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    started = load_average()
    run = Run(args)
    made: list[Path] = []
    reports, checks, prep = [], [], {}
    for regime in args.regime:
        base = regime_dir(regime, args)
        if not base.exists():
            base.mkdir(parents=True)
            made.append(base)
        check_regime_dir(regime, base, args.size)
    log(f"{format_bytes(args.size)} x {args.repeats} rounds, regimes {', '.join(args.regime)}")
    try:
        for regime in args.regime:
            base = regime_dir(regime, args)
            workdir = tempfile.mkdtemp(prefix=f"fastckpt-bench-{regime}-", dir=base)
            try:
                prep = run_regime(run, regime, workdir)
                fs_type, source, _ = filesystem_of(workdir)
                for busy in args.busy:
                    text, more = regime_report(
                        run, regime, prep, f"{base} on {fs_type} {source}", busy
                    )
                    reports.append(text)
                    checks += more
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    finally:
        for path in reversed(made):
            try:
                path.rmdir()  # only if empty: another run may use it meanwhile
            except OSError:
                pass
    cores = len(os.sched_getaffinity(0))
    print(
        f"## Memory-speed checkpoint benchmark — {format_bytes(prep.get('payload_bytes', args.size))} "
        f"LLM-like state dict ({prep.get('tensors', '?')} tensors, float32 + bfloat16)"
    )
    print()
    print(
        f"- {datetime.datetime.now().isoformat(timespec='seconds')}; {cores} cores, "
        f"{format_bytes(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} memory, kernel {platform.release()}"
    )
    versions = ", ".join(
        f"{d} {version_of(d)}"
        for d in ("fastckpt-io", "torch", "safetensors", "runai-model-streamer", "fastsafetensors")
    )
    print(f"- {versions}")
    print(
        f"- {args.repeats} rounds, medians; methods rotated each round; every save and load in a "
        "fresh process; loads timed until every page of every tensor is touched, then every "
        "tensor's CRC-32 compared with the saved one; saves timed until durable (fsync)"
    )
    print(
        "- fastckpt is ×: fastckpt's GB/s over the method's; CPU s/GB: user+system seconds of the "
        "process (all threads) per 10^9 bytes; peak RSS − size: the load's peak RSS above its "
        "starting RSS, minus the checkpoint's size (0 = one copy, nothing more); busy threads: "
        f"mean (max) threads running or in I/O wait during one extra load, sampled every 2 ms; "
        f"preadv ceiling: {cores} threads"
    )
    print(f"- wall time {time.perf_counter() - t0:.0f} s")
    ended = load_average()
    print(
        "- load average (1, 5, 15 min) at the start: "
        + ", ".join(f"{v:.2f}" for v in started)
        + "; at the end: "
        + ", ".join(f"{v:.2f}" for v in ended)
    )
    print()
    for text in reports:
        print(text)
    print("### Targets (measured, not asserted)")
    print()
    print("\n".join(checks), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": run.raw}, f, indent=2)
        log(f"raw results written to {args.json}")
    bad = [r for r in run.raw if r.get("wrong")]
    return 1 if bad or not any(r["op"] == "load" and "seconds" in r for r in run.raw) else 0


def _names(valid: tuple[str, ...] | dict[str, Any], *, none: bool = False) -> Any:
    """An argparse type: a comma list of names from ``valid`` (``"none"``: an empty list,
    where ``none`` allows it)."""

    def parse(text: str) -> list[str]:
        if none and text.strip() == "none":
            return []
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(valid)}; got {text!r}")
        return names

    return parse


def _counts(text: str) -> list[int]:
    """An argparse type: a comma list of process counts (0 or more)."""
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 0,2; got {text!r}") from None
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected counts like 0,2; got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", type=parse_size, default=parse_size("1G"), help="state dict size (default 1G)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds; medians are reported (default 5)"
    )
    parser.add_argument(
        "--regime",
        type=_names(REGIMES),
        default=["tmpfs", "hot"],
        help="comma list of tmpfs, hot, cold (default tmpfs,hot)",
    )
    parser.add_argument(
        "--shm", default="/dev/shm", help="memory file system directory (default /dev/shm)"
    )
    parser.add_argument(
        "--dir",
        default=str(REPO.parent / "bench-tmp"),
        help="directory on a disk for hot and cold (default %(default)s)",
    )
    parser.add_argument(
        "--loads",
        type=_names(LOADERS),
        default=list(DEFAULT_LOADS),
        help=f"comma list of load methods (default: {','.join(DEFAULT_LOADS)})",
    )
    parser.add_argument(
        "--saves",
        type=_names(SAVERS, none=True),
        default=list(SAVERS),
        help=f"comma list of save methods, or none (default all: {','.join(SAVERS)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    parser.add_argument("--json", metavar="FILE", help="also write every round's results here")
    parser.add_argument(
        "--no-streams", action="store_true", help="skip the extra round that counts busy threads"
    )
    parser.add_argument("--no-fio", action="store_true", help="skip fio in the cold regime")
    parser.add_argument(
        "--busy",
        type=_counts,
        nargs="?",
        const=[os.cpu_count() or 1],
        default=[0],
        metavar="N[,N]",
        help="measure beside N processes running a training-like CPU loop (a comma list, "
        "0 = quiet; --busy alone: one per core); default 0",
    )
    parser.add_argument("--child-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child, HANDLERS)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if "fastckpt" not in args.loads:
        args.loads.insert(0, "fastckpt")  # every ratio is against it
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
