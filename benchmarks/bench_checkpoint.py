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
  file and of its directory;
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
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402 - found through the sys.path entry above

# method -> (label, file it writes or reads)
SAVES: dict[str, tuple[str, str]] = {
    "fastckpt": ("fastckpt.save", "fastckpt.safetensors"),
    "torch": ("torch.save + fsync", "torch.pt"),
    "safetensors": ("safetensors save_file + fsync", "safetensors.safetensors"),
}
LOADS: dict[str, tuple[str, str]] = {
    "fastckpt": ("fastckpt.load", "fastckpt.safetensors"),
    "fastckpt-noverify": ("fastckpt.load(verify=False)", "fastckpt.safetensors"),
    "torch": ("torch.load(mmap=False)", "torch.pt"),
    "safetensors": ("safetensors load_file", "safetensors.safetensors"),
}
FIO_LABELS = {"write": "fio seq write (direct, end_fsync)", "read": "fio seq read (direct)"}

# Targets of the issue.
SAVE_VS_SAFETENSORS = 2.5
SAVE_VS_TORCH = 5.0
LOAD_VS_SAFETENSORS = 1.2
LOAD_OF_FIO = 0.9
NOISY_SPREAD = 1.5  # max/min GB/s over rounds above which a method is called noisy
RSS_ALLOWANCE = 32 * C.MiB  # interpreter and engine bookkeeping on top of the staging budget


# ============================================================================ child side


def _child_save(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    method, path = spec["method"], spec["file"]
    state = C.llm_like_state_dict(spec["size"], seed=spec["seed"])
    payload = sum(t.numel() * t.element_size() for t in state.values())
    extra: dict[str, Any] = {}
    if method == "fastckpt":
        C.import_repo_package()
        import fastckpt
        import fastckpt.config

        def run() -> None:
            fastckpt.save(state, path, progress=False)

        cfg = fastckpt.config.resolve_io(os.path.dirname(path), {})
        extra = {
            "staging_bytes": fastckpt.config.staging_bytes(),
            "io_config": cfg.__dict__,
            "fastckpt_file": fastckpt.__file__,
        }
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
    os.sync()  # start from clean writeback state; the destination was deleted by the parent
    with C.Measure() as m:
        run()
    return {
        **m.as_dict(),
        "payload_bytes": payload,
        "file_bytes": os.path.getsize(path),
        "touch_sum": C.touch_tensors(state),
        "tensors": len(state),
        **extra,
    }


def _child_load(spec: dict[str, Any]) -> dict[str, Any]:
    import io

    import torch

    method, path = spec["method"], spec["file"]
    C.touch_tensors({"warm": torch.ones(4096)})  # first-op setup outside the timed section
    if method in ("fastckpt", "fastckpt-noverify"):
        C.import_repo_package()
        import fastckpt

        verify = None if method == "fastckpt" else False

        def run() -> dict[str, Any]:
            return fastckpt.load(path, verify=verify, progress=False)
    elif method == "torch":
        buf = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)  # lazy imports of the unpickler, outside the timing

        def run() -> dict[str, Any]:
            return torch.load(path, weights_only=True, mmap=False)
    elif method == "safetensors":
        import safetensors.torch

        safetensors.torch.load(safetensors.torch.save({"w": torch.ones(2)}))

        def run() -> dict[str, Any]:
            return safetensors.torch.load_file(path)
    else:
        raise ValueError(f"unknown load method {method!r}")
    cache = C.drop_page_cache([path])
    with C.Measure() as m:
        state = run()
        touched = C.touch_tensors(state)
    payload = sum(t.numel() * t.element_size() for t in state.values())
    return {
        **m.as_dict(),
        "payload_bytes": payload,
        "touch_sum": touched,
        "tensors": len(state),
        "cache": cache,
    }


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        result = _child_save(spec) if spec["op"] == "save" else _child_load(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on
        result = {"error": f"{type(exc).__name__}: {exc}"}
    C.report(result)
    return 0


# =========================================================================== parent side


def run_one(op: str, method: str, workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    name = (SAVES if op == "save" else LOADS)[method][1]
    path = os.path.join(workdir, name)
    if op == "save" and os.path.exists(path):
        os.remove(path)
    spec = {"op": op, "method": method, "file": path, "size": args.size, "seed": args.seed}
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    return C.run_child(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        timeout=args.child_timeout,
        env=env,
    )


def check_directory(directory: Path, size: int) -> None:
    fs_type, _, mount = C.filesystem_of(directory)
    if fs_type in C.MEMORY_FILESYSTEMS:
        raise SystemExit(
            f"error: {directory} is on {fs_type} ({mount}), a memory file system; "
            "pick a directory on a disk with --dir"
        )
    need = 3 * size + 256 * C.MiB
    free = C.free_bytes(directory)
    if free < need:
        raise SystemExit(
            f"error: {directory} has {C.human_bytes(free)} free; this run needs about "
            f"{C.human_bytes(need)} (three checkpoints of {C.human_bytes(size)}); "
            "use a smaller --size or another --dir"
        )
    mem = C.available_memory()
    if mem is not None and mem < 2.5 * size:
        C.log(
            f"warning: only {C.human_bytes(mem)} of memory available for a {C.human_bytes(size)} "
            "state dict; children may be killed or figures skewed by swapping"
        )


def _stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"n": 0, "errors": [r.get("error") for r in results]}
    gbps = [
        r["payload_bytes"] / r["seconds"] / 1e9 if "payload_bytes" in r else r["gbps"] for r in ok
    ]
    return {
        "n": len(ok),
        "gbps": C.median(gbps),
        "gbps_min": min(gbps),
        "gbps_max": max(gbps),
        "seconds": C.median(r["seconds"] for r in ok),
        "cpu_seconds": C.median(r.get("cpu_seconds") for r in ok),
        "extra_rss": C.median(r.get("extra_rss") for r in ok),
        "extra_rss_max": max(
            (r["extra_rss"] for r in ok if r.get("extra_rss") is not None), default=None
        ),
        "errors": [r["error"] for r in results if "error" in r],
    }


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
            f"| {C.fmt(speedup, '.2f', '×')} | {C.fmt(of_fio, '.0f', '%')} | {C.fmt(s.get('cpu_seconds'), '.2f')} "
            f"| {C.fmt(None if rss is None else rss / C.MiB, '.0f')} |"
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
        cells = [C.fmt(v, ".2f") for v in values] + [""] * (n - len(values))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def report_markdown(meta: dict[str, Any], stats: dict[str, Any]) -> str:
    saves, loads, fio = stats["save"], stats["load"], stats["fio"]
    fio_w = fio.get("write") if fio else None
    fio_r = fio.get("read") if fio else None
    out = [
        (
            f"## Checkpoint benchmark — {C.human_bytes(meta['payload_bytes'])} LLM-like "
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
    out += _rounds_table(meta["rounds"])

    out += ["### Targets (issue 3)", "", "| target | measured | met |", "|---|---|:-:|"]

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        if not a or not b or not a.get("gbps") or not b.get("gbps"):
            return None
        return a["gbps"] / b["gbps"]

    def verdict(value: float | None, ok: Callable[[float], bool]) -> str:
        return "n/a" if value is None else ("yes" if ok(value) else "**no**")

    r = ratio(saves["fastckpt"], saves["safetensors"])
    out.append(
        f"| save ≥ {SAVE_VS_SAFETENSORS}× safetensors save_file | {C.fmt(r, '.2f', '×')} "
        f"| {verdict(r, lambda v: v >= SAVE_VS_SAFETENSORS)} |"
    )
    r = ratio(saves["fastckpt"], saves["torch"])
    out.append(
        f"| save ≥ {SAVE_VS_TORCH}× torch.save | {C.fmt(r, '.2f', '×')} "
        f"| {verdict(r, lambda v: v >= SAVE_VS_TORCH)} |"
    )
    r = ratio(loads["fastckpt"], loads["safetensors"])
    out.append(
        f"| load ≥ {LOAD_VS_SAFETENSORS}× safetensors load_file (touched) | {C.fmt(r, '.2f', '×')} "
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
            f"| save extra peak RSS ≤ staging budget ({budget / C.MiB:.0f} MiB, +{RSS_ALLOWANCE // C.MiB} MiB "
            f"allowance), not the checkpoint's {meta['payload_bytes'] / C.MiB:.0f} MiB | worst "
            f"{worst / C.MiB:.0f} MiB (median {saves['fastckpt']['extra_rss'] / C.MiB:.0f}) "
            f"| {'yes' if worst <= limit else '**no**'} |"
        )
    else:
        out.append("| save extra peak RSS ≤ staging budget | n/a | n/a |")
    out.append("")
    if meta.get("notes"):
        out += ["Notes:", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    return "\n".join(out)


def parent_main(args: argparse.Namespace) -> int:
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
    fs_type, source, mount = C.filesystem_of(base)
    free_before = C.human_bytes(C.free_bytes(base))
    workdir = tempfile.mkdtemp(prefix="fastckpt-bench-", dir=base)
    have_fio = C.fio_path() is not None and not args.no_fio
    fio_bytes = max(C.MiB, args.size // C.MiB * C.MiB)
    raw: list[dict[str, Any]] = []
    C.log(f"{C.human_bytes(args.size)} x {args.repeats} rounds in {workdir} ({fs_type} {source})")
    try:
        for rnd in range(args.repeats):
            for name in {v[1] for v in SAVES.values()}:
                p = os.path.join(workdir, name)
                if os.path.exists(p):
                    os.remove(p)
            if have_fio:
                fio_file = os.path.join(workdir, "fio.dat")
                for kind in C.rotate(["write", "read"], 0):  # the read needs the written file
                    C.drop_page_cache([fio_file])
                    res = C.fio_sequential(
                        kind,
                        fio_file,
                        fio_bytes,
                        bs="4M",
                        extra=C.FIO_LOCKED,
                        timeout=args.child_timeout,
                    )
                    raw.append({"round": rnd, "op": "fio", "method": kind, **res})
                    C.log(
                        f"round {rnd + 1}: fio {kind:5s} "
                        + (res["error"] if "error" in res else f"{res['gbps']:.2f} GB/s")
                    )
                os.remove(fio_file)
            for op, methods in (("save", list(SAVES)), ("load", list(LOADS))):
                for method in C.rotate(methods, rnd):
                    res = run_one(op, method, workdir, args)
                    raw.append({"round": rnd, "op": op, "method": method, **res})
                    if "error" in res:
                        C.log(f"round {rnd + 1}: {op} {method}: FAILED {res['error']}")
                    else:
                        C.log(
                            f"round {rnd + 1}: {op} {method:17s} {res['seconds']:6.2f} s "
                            f"{res['payload_bytes'] / res['seconds'] / 1e9:5.2f} GB/s "
                            f"cpu {res['cpu_seconds']:5.2f} s  +rss {res['extra_rss'] / C.MiB:6.0f} MiB"
                        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if created_base:
            try:
                base.rmdir()
            except OSError:
                pass

    def pick(op: str, method: str) -> list[dict[str, Any]]:
        return [r for r in raw if r["op"] == op and r["method"] == method]

    stats = {
        "save": {m: _stats(pick("save", m)) for m in SAVES},
        "load": {m: _stats(pick("load", m)) for m in LOADS},
        "fio": {k: _stats(pick("fio", k)) for k in ("write", "read")} if have_fio else None,
    }
    ok = [r for r in raw if r["op"] in ("save", "load") and "error" not in r]
    fast_saves = [r for r in pick("save", "fastckpt") if "error" not in r]
    notes: list[str] = []
    sums = {r["touch_sum"] for r in ok}
    if len(sums) > 1:
        notes.append(
            "the touched bytes differ between methods or rounds: some file did not read back "
            f"what was saved ({len(sums)} distinct sums)"
        )
    elif sums:
        notes.append("every load read back the saved bytes (equal page-sample sums across methods)")
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
        notes.append("fio not installed" if C.fio_path() is None else "fio skipped (--no-fio)")
    first = ok[0] if ok else {}
    io_cfg = fast_saves[0].get("io_config") if fast_saves else None
    budget = fast_saves[0].get("staging_bytes") if fast_saves else None
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    def per_round(op: str, method: str) -> list[float | None]:
        values = []
        for rnd in range(args.repeats):
            r = next((x for x in pick(op, method) if x["round"] == rnd), None)
            if r is None or "error" in r:
                values.append(None)
            else:
                values.append(
                    r["payload_bytes"] / r["seconds"] / 1e9 if "payload_bytes" in r else r["gbps"]
                )
        return values

    rounds = {f"save {SAVES[m][0]}": per_round("save", m) for m in SAVES}
    rounds.update({f"load {LOADS[m][0]}": per_round("load", m) for m in LOADS})
    if have_fio:
        rounds.update({FIO_LABELS[k]: per_round("fio", k) for k in ("write", "read")})
    meta = {
        "rounds": rounds,
        "dir": str(base),
        "filesystem": f"{fs_type} ({source}, mounted at {mount})",
        "free_before": free_before,
        "repeats": args.repeats,
        "size_arg": args.size,
        "payload_bytes": first.get("payload_bytes", args.size),
        "file_bytes": {m: (pick("save", m) or [{}])[-1].get("file_bytes") for m in SAVES},
        "tensors": first.get("tensors", "?"),
        "cache_note": (
            "page cache dropped before each load (sync; echo 3 > /proc/sys/vm/drop_caches)"
            if C.can_drop_caches()
            else "not root: file pages evicted with posix_fadvise(DONTNEED)"
        ),
        "cpus": os.cpu_count(),
        "memory": C.human_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "safetensors": version("safetensors"),
        "fastckpt_io": (", ".join(f"{k}={v}" for k, v in io_cfg.items()) if io_cfg else "n/a"),
        "staging_bytes": budget,
        "staging_note": C.human_bytes(budget) if budget else "n/a",
        "fio": (
            f"{C.fio_version()}, --rw=write|read --bs=4M --iodepth=32 --direct=1 --ioengine=io_uring "
            f"{' '.join(C.FIO_LOCKED)} --size={fio_bytes} (writes --end_fsync=1); fio's own runtime"
        )
        if have_fio
        else ("fio not installed" if C.fio_path() is None else "skipped (--no-fio)"),
        "wall_seconds": time.perf_counter() - t_start,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "notes": notes,
    }
    print(report_markdown(meta, stats))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "medians": stats, "runs": raw}, f, indent=2)
        C.log(f"raw results written to {args.json}")
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
        type=C.parse_size,
        default=C.parse_size("2G"),
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
        return child_main(args.child)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
