"""Torture fastckpt as an attacker and as bad luck would: hostile files, bit flips, kill -9
during saves, a full disk, concurrent savers and loaders, and huge headers; and for
checkpoints of several files (Hugging Face shards + index, DCP rank files + .metadata):
kill -9 during saves and during the removal of old files, two writers and a reader at once.

Every risky call runs in a child process with time and memory limits. Cases are batched
(many per child); a child reports each outcome on its own line, so when a case crashes or
hangs the child is killed, that case is recorded, and a fresh child goes on with the rest.

Outcomes are counted by exception type. Clean: loaded, or one of HeaderError,
ChecksumError, OSError, ValueError, KeyError, WeightsOnlyError. Bad: a crash (signal), a
hang, MemoryError, any other exception, ``fastckpt verify`` saying OK for a file that load
rejects, or (for bit flips) a load that succeeds with different values. For multi-file
sets: a load mixing two saves, a set that does not load, a lost update, a changed file
beside the checkpoint, a planted pickle that runs, a writer that fails. For a checkpoint
manager's fast tier (``manager-readers``): a step whose mapped bytes change under a reader
while the tier reuses its deleted files as spares. For a series in a hostile tree
(``hostile-trees``, :mod:`torture_trees`): a file outside the tiers changed, a committed step
lost, an unreadable marker deleted. For simulated nodes lost with ``replicas=1``
(``node-kills``, :mod:`torture_nodes`): a committed step lost while a copy survives, a
state restored that is not the saved one, ranks restoring different steps. For ranks that
disagree or call on a subset (``adversarial-ranks``, :mod:`torture_ranks`): a silent wrong
state, a rank going on alone, a hang past the configured timeouts, a file outside the tiers
changed.

Usage::

    python benchmarks/torture.py                       # everything, default counts
    python benchmarks/torture.py --only fuzz --cases 500
    python benchmarks/torture.py --flips 200 --kills 20 --bounds-mb 100
    python benchmarks/torture.py --only shard-kills --only shard-concurrency --set-kills 12

Exit status 0 when no bad outcome was seen, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torture_collective
import torture_mutations
import torture_nodes
import torture_ranks
import torture_trees

CLEAN = {
    "ok",
    "HeaderError",
    "ChecksumError",
    "OSError",
    "FileNotFoundError",
    "ValueError",
    "KeyError",
    "WeightsOnlyError",
}
#: Per-case time limit (seconds without a reported outcome) and address-space limit.
CASE_TIMEOUT = 20.0
CHILD_MEMORY = 6 << 30

# --------------------------------------------------------------------------- children

_CHILD = textwrap.dedent(
    r"""
    import json, resource, sys, warnings
    warnings.simplefilter("ignore")
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    mode = sys.argv[2]
    import torch, fastckpt
    from fastckpt.cli.verify import verify_file

    def same(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.dtype == b.dtype and a.shape == b.shape
                    and type(a) is type(b) and bool(torch.equal(a, b)))
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, float) and a != a:
            return b != b
        return a == b

    baseline = fastckpt.load(sys.argv[3]) if mode == "flips" else None
    for line in open(sys.argv[4]):
        path = line.strip()
        try:
            obj = fastckpt.load(path)
            outcome = "ok"
            if mode == "flips" and not same(obj, baseline):
                outcome = "CHANGED"
            del obj
        except BaseException as exc:
            outcome = type(exc).__name__
        verdict = verify_file(path, progress=False).status if mode == "fuzz" else ""
        print(json.dumps([path, outcome, verdict]), flush=True)
    """
)


def run_cases(paths: list[str], mode: str, baseline: str = "") -> dict[str, tuple[str, str]]:
    """Outcome per path, running as few children as possible."""
    results: dict[str, tuple[str, str]] = {}
    todo = list(paths)
    listing = Path(tempfile.mkdtemp(prefix="fastckpt-torture-list-")) / "cases.txt"
    while todo:
        listing.write_text("".join(p + "\n" for p in todo))  # a file: no pipe to fill up
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(CHILD_MEMORY), mode, baseline or "-", str(listing)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert child.stdout is not None
        # The first case also waits for torch's import.
        deadline = time.monotonic() + CASE_TIMEOUT + 30
        while todo:
            ready, _, _ = select.select([child.stdout], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                child.kill()
                results[todo.pop(0)] = ("HANG", "")
                break
            line = child.stdout.readline()
            if not line:  # died: the case in progress crashed it
                code = child.wait()
                results[todo.pop(0)] = (f"CRASH({code})", "")
                break
            path, outcome, verdict = json.loads(line)
            results[path] = (outcome, verdict)
            todo.remove(path)
            deadline = time.monotonic() + CASE_TIMEOUT
        child.wait()
        child.stdout.close()
    shutil.rmtree(listing.parent, ignore_errors=True)
    return results


# --------------------------------------------------------------------------- checkpoints


def nested_state(scale: int = 1) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    model = {
        "fc.weight": torch.randn(16 * scale, 8, generator=gen),
        "fc.bias": torch.randn(16 * scale, generator=gen),
        "emb": torch.randint(0, 100, (10, 4), generator=gen),
        "empty": torch.zeros(0, 3),
    }
    model["tied"] = model["fc.weight"]
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(16 * scale, 8)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "name": "g"}],
        },
        "epoch": 3,
        "note": "hello",
        "flags": [True, None, 1.5],
    }


def header_span(path: Path) -> tuple[int, int]:
    """(start, end) of the JSON text (without padding) in a safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return 8, 8 + len(data[8 : 8 + n].rstrip(b" "))


def rewrite_header(data: bytes, document: dict, fix_crc: bool) -> bytes:
    """A file with ``document`` as its header (same data section), the header checksum
    recomputed when asked so that deeper checks are reached."""
    from fastckpt.format.schema import KEY_HEADER_CRC, METADATA_KEY, canonical_crc

    (n,) = struct.unpack("<Q", data[:8])
    meta = document.get(METADATA_KEY)
    if fix_crc and isinstance(meta, dict):
        meta.pop(KEY_HEADER_CRC, None)
        try:
            meta[KEY_HEADER_CRC] = canonical_crc(document)
        except (TypeError, ValueError, UnicodeEncodeError):
            pass
    text = json.dumps(document, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


# --------------------------------------------------------------------------- fuzzing

_JUNK = [
    0,
    -1,
    2**63,
    2**64,
    2**70,
    1.5,
    "x",
    "",
    None,
    True,
    [],
    {},
    [2**63, 0],
    [0, 2**53 + 1, 2**32],
    "\u202e\x1b[2J",
    "F32",
    "BOOL",
    "F4",
    [0, 1],
    [1, 0],
    {"t": "tensor", "n": "model/fc.weight"},
]


def _mutate_json(doc: Any, rng: random.Random, depth: int = 0) -> Any:
    """One random change somewhere inside a decoded header or tree."""
    if isinstance(doc, dict) and doc and rng.random() < 0.7 and depth < 30:
        key = rng.choice(list(doc))
        roll = rng.random()
        if roll < 0.15:
            del doc[key]
        elif roll < 0.25:
            doc[key + rng.choice(["x", "/", "\x00"])] = doc.pop(key)
        elif roll < 0.4:
            doc[key] = rng.choice(_JUNK)
        else:
            doc[key] = _mutate_json(doc[key], rng, depth + 1)
        return doc
    if isinstance(doc, list) and doc and rng.random() < 0.7 and depth < 30:
        i = rng.randrange(len(doc))
        roll = rng.random()
        if roll < 0.2:
            doc.pop(i)
        elif roll < 0.3:
            doc.append(doc[i])
        elif roll < 0.5:
            doc[i] = rng.choice(_JUNK)
        else:
            doc[i] = _mutate_json(doc[i], rng, depth + 1)
        return doc
    if isinstance(doc, str) and doc[:1] in "{[" and rng.random() < 0.8:
        try:  # fastckpt's JSON-in-a-string keys: mutate inside
            return json.dumps(_mutate_json(json.loads(doc), rng, depth + 1), separators=(",", ":"))
        except ValueError:
            pass
    if isinstance(doc, int) and not isinstance(doc, bool) and rng.random() < 0.5:
        return doc + rng.choice([-1, 1, 4, 2**32, 2**63])
    return rng.choice(_JUNK)


def hostile_files(base: Path, out: Path, count: int, rng: random.Random) -> list[str]:
    data = base.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    document = json.loads(data[8 : 8 + n])
    start, end = header_span(base)
    paths = []
    for i in range(count):
        kind = i % 8
        if kind == 0:  # random bytes in the header
            buf = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                buf[rng.randrange(start, end)] = rng.randrange(256)
            blob = bytes(buf)
        elif kind == 1:  # truncation or extension
            cut = rng.randrange(len(data) + 64)
            blob = data[:cut] if cut <= len(data) else data + bytes(cut - len(data))
        elif kind == 2:  # a wrong header length
            length = rng.choice([0, 1, n - 1, n + 1, 2**63, 2**64 - 1, 100 << 20, len(data)])
            blob = struct.pack("<Q", length) + data[8:]
        elif kind in (3, 4, 5):  # structural change, checksum recomputed or not
            mutated = _mutate_json(json.loads(json.dumps(document)), rng)
            if not isinstance(mutated, dict):
                mutated = {"__metadata__": mutated}
            blob = rewrite_header(data, mutated, fix_crc=kind != 5)
        elif kind == 6:  # other writers' files and garbage
            blob = rng.choice(
                [
                    b"PK\x03\x04" + os.urandom(200),
                    b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8" + os.urandom(100),
                    b"hello everyone\n" * 10,
                    b"",
                    b"\x00" * 7,
                    os.urandom(rng.randrange(1, 5000)),
                ]
            )
        else:  # nesting and size attacks on a small scale
            depth = rng.choice([100, 1000, 100_000])
            tree = "[" * depth + "]" * depth
            meta = {"fastckpt.version": "2", "fastckpt.checkpoint.tree": tree}
            doc = {"__metadata__": meta}
            if rng.random() < 0.5:
                doc["z"] = {
                    "dtype": "F32",
                    "shape": rng.choice(_JUNK[12:14]),
                    "data_offsets": [0, 0],
                }
            blob = rewrite_header(b"\x00" * 8, doc, fix_crc=True)
        path = out / f"case{i:05d}.safetensors"
        path.write_bytes(blob)
        paths.append(str(path))
    return paths


def _hostile_run(
    work: Path, name: str, base: Path, make: Any, count: int, seed: int, mode: str
) -> tuple[dict[str, tuple[str, str]], float]:
    """Writes ``count`` hostile variants of ``base`` with ``make(base, folder, count, rng)``,
    loads each in a child (``mode`` as :func:`run_cases`), removes them; the outcome per
    path and the seconds the loads took."""
    cases = work / name
    cases.mkdir()
    paths = make(base, cases, count, random.Random(seed))
    started = time.perf_counter()
    results = run_cases(paths, mode, str(base) if mode == "flips" else "")
    shutil.rmtree(cases)
    return results, time.perf_counter() - started


def fuzz(work: Path, count: int, seed: int) -> dict[str, Any]:
    import fastckpt

    base = work / "base.safetensors"
    fastckpt.save(nested_state(), base)
    results, seconds = _hostile_run(work, "fuzz", base, hostile_files, count, seed, "fuzz")
    outcomes = collections.Counter(outcome for outcome, _ in results.values())
    verify_lies = sum(
        1 for outcome, verdict in results.values() if verdict == "OK" and outcome != "ok"
    )
    bad = sum(n for outcome, n in outcomes.items() if outcome not in CLEAN) + verify_lies
    return {
        "cases tried": len(results),
        "clean outcomes": sum(n for outcome, n in outcomes.items() if outcome in CLEAN),
        "bad outcomes": bad,
        "verify OK while load fails": verify_lies,
        "by outcome": dict(outcomes.most_common()),
        "seconds": round(seconds, 1),
    }


# --------------------------------------------------------------------------- compressed frames


def _compressed_base(path: Path) -> None:
    """A compressed checkpoint with each codec's frames: bf16 and fp32 byte planes (probed
    rotations, several chunks), a small fp16 one (its dtype's rotation) and int64 (zstd)."""
    import torch

    import fastckpt

    g = torch.Generator().manual_seed(0)
    state = {
        "w": (torch.randn(1536, 1024, generator=g) * 0.02).to(torch.bfloat16),
        "f": torch.randn(256, 1024, generator=g) * 1e-3,
        "h": torch.randn(64, 64, generator=g).half(),
        "i": torch.arange(50_000),
    }
    fastckpt.save(state, path, compress=True)


def hostile_frames(base: Path, out: Path, count: int, rng: random.Random) -> list[str]:
    """Files whose compressed frames were changed: their heads (codec, planes, rotation,
    sizes), chunk tables and stored bytes. Two cases in three drop the stored bytes' CRC32Cs
    (and hashes) from the header, which is then re-checksummed, so the frame checks and the
    decompressor meet the hostile bytes themselves; the raw bytes' CRC32Cs stay."""
    from fastckpt.format import compressed as layout

    data = base.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    document = json.loads(data[8 : 8 + n])
    frames = {k: v["data_offsets"] for k, v in document.items() if k != "__metadata__"}
    names = sorted(frames)
    paths = []
    for i in range(count):
        name = names[i % len(names)]
        lo, hi = (8 + n + x for x in frames[name])
        buf = bytearray(data)
        kind = rng.randrange(6)
        if kind == 0:  # random bytes in the 32-byte head
            for _ in range(rng.randint(1, 4)):
                buf[lo + rng.randrange(layout.HEAD_BYTES)] = rng.randrange(256)
        elif kind == 1:  # another rotation
            value = rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 31, 32, 63, 64, 0xFFFF])
            struct.pack_into("<H", buf, lo + 6, value)
        elif kind == 2:  # another codec or plane count
            buf[lo + rng.choice([4, 5])] = rng.choice([0, 1, 2, 3, 4, 8, 255])
        elif kind == 3:  # a chunk table entry off by a little or a lot
            (chunks,) = struct.unpack_from("<I", buf, lo + 24)
            at = lo + layout.HEAD_BYTES + 4 * rng.randrange(max(1, chunks * buf[lo + 5]))
            (length,) = struct.unpack_from("<I", buf, at)
            change = rng.choice([-1, 1, -length, 2**31, 7])
            struct.pack_into("<I", buf, at, max(0, min(2**32 - 1, length + change)))
        elif kind == 4:  # stored bytes changed
            for _ in range(rng.randint(1, 8)):
                buf[rng.randrange(lo + layout.HEAD_BYTES, hi)] ^= 1 << rng.randrange(8)
        else:  # the raw size or the chunk size
            field = rng.choice([(8, "<I"), (16, "<Q")])
            (value,) = struct.unpack_from(field[1], buf, lo + field[0])
            new = rng.choice([0, 1, value - 2, value + 2, value * 2, 2**31])
            struct.pack_into(field[1], buf, lo + field[0], max(0, new) % 2**32)
        blob = bytes(buf)
        if i % 3:
            mutated = json.loads(json.dumps(document))
            for key in ("fastckpt.crc32c", "fastckpt.piece_crc32c", "fastckpt.xxh3_128"):
                mutated["__metadata__"].pop(key, None)
            blob = rewrite_header(blob, mutated, fix_crc=True)
        path = out / f"frame{i:05d}.safetensors"
        path.write_bytes(blob)
        paths.append(str(path))
    return paths


def frames_fuzz(work: Path, count: int, seed: int) -> dict[str, Any]:
    base = work / "compressed-base.safetensors"
    _compressed_base(base)
    results, seconds = _hostile_run(work, "frames", base, hostile_frames, count, seed, "flips")
    outcomes = collections.Counter(outcome for outcome, _ in results.values())
    return {
        "cases tried": len(results),
        "changed values undetected": outcomes.get("CHANGED", 0),
        "bad outcomes": sum(n for o, n in outcomes.items() if o not in CLEAN and o != "CHANGED"),
        "by outcome": dict(outcomes.most_common()),
        "seconds": round(seconds, 1),
    }


# --------------------------------------------------------------------------- bit flips


def flips(work: Path, count: int, seed: int) -> dict[str, Any]:
    import fastckpt

    base = work / "flip-base.safetensors"
    fastckpt.save(nested_state(), base)
    data = base.read_bytes()
    start, end = header_span(base)
    rng = random.Random(seed)
    folder = work / "flips"
    folder.mkdir()
    paths, where = [], {}
    (n,) = struct.unpack("<Q", data[:8])
    regions = {"header JSON": (0, end), "header padding": (end, 8 + n), "data": (8 + n, len(data))}
    names = list(regions)
    for i in range(count):
        region = names[i % 3] if i % 3 != 1 else names[rng.choice([0, 1])]  # header JSON: 1/2
        low, high = regions[region]
        buf = bytearray(data)
        buf[rng.randrange(low, high)] ^= 1 << rng.randrange(8)
        path = folder / f"flip{i:05d}.safetensors"
        path.write_bytes(bytes(buf))
        paths.append(str(path))
        where[str(path)] = region
    results = run_cases(paths, "flips", str(base))
    report: dict[str, Any] = {"flips": count}
    for region in names:
        outcomes = collections.Counter(o for p, (o, _) in results.items() if where[p] == region)
        report[region] = dict(outcomes.most_common())
    report["changed values undetected"] = sum(1 for o, _ in results.values() if o == "CHANGED")
    report["bad outcomes"] = sum(
        1 for o, _ in results.values() if o not in CLEAN and o != "CHANGED"
    )
    shutil.rmtree(folder)
    return report


# --------------------------------------------------------------------------- kill -9

_SAVER = textwrap.dedent(
    """
    import sys, torch, fastckpt
    path, mode, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = {"w": torch.zeros(mb << 18), "step": torch.tensor(0)}
    i, future = 0, None
    print("ready", flush=True)
    while True:
        i += 1
        if future is not None:
            future.fence()  # a lazy save still streaming: hold the update off
        state["w"].fill_(i)  # every value says which step it belongs to
        state["step"].fill_(i)
        if mode == "async":
            fastckpt.async_save(state, path).result()
        elif mode == "lazy":  # training goes on while it streams; waited one step later
            if future is not None:
                future.result()
            future = fastckpt.async_save(state, path, lazy=True, staging_bytes=8 << 20)
        else:
            fastckpt.save(state, path)
    """
)


def _temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def kills(work: Path, count: int, seed: int, mb: int = 64) -> dict[str, Any]:
    import fastckpt

    rng = random.Random(seed)
    folder = work / "kills"
    folder.mkdir()
    target = folder / "ckpt.safetensors"
    torn, mixed, most_left = 0, 0, 0
    for i in range(count):
        mode = ("sync", "async", "lazy")[i % 3]
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(target), mode, str(mb)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        child.stdout.readline()
        time.sleep(rng.uniform(0.0, 1.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        if target.exists():
            try:
                back = fastckpt.load(target, verify=True)
            except Exception:
                torn += 1
            else:  # the values of one step only, never a mix of two
                mixed += int(not bool((back["w"] == back["step"].float()).all()))
        most_left = max(most_left, len(_temporaries(folder)))
    left_before = _temporaries(folder)
    bytes_before = sum(p.stat().st_blocks * 512 for p in left_before)
    fastckpt.save({"w": fastckpt_zeros()}, target)  # the next save cleans up
    left_after = _temporaries(folder)
    report = {
        "kills": count,
        "torn checkpoints": torn,
        "checkpoints mixing two steps": mixed,
        "temp files left before the next save (most at once)": most_left,
        "temp files left before the next save": len(left_before),
        "bytes in them": bytes_before,
        "temp files left after the next save": len(left_after),
        "bytes leaked": sum(p.stat().st_blocks * 512 for p in left_after),
    }
    shutil.rmtree(folder)
    return report


_MANAGED_RUN = textwrap.dedent(
    """
    import json, sys, torch, fastckpt
    root, fast, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    incremental, lazy = sys.argv[4] == "incremental", sys.argv[4] == "lazy"
    manager = fastckpt.CheckpointManager(
        root, fast=fast, keep_last=2, drain_bytes_per_second=64 << 20, storage_options=options,
        incremental=incremental, full_every=3,
    )
    frozen = torch.arange(4 << 20, dtype=torch.float32)  # incremental steps refer to it
    step = max(manager.steps(), default=0)
    # lazy: one tensor, saved with fence=optimizer, whose every step adds 1 at once
    w = torch.full((4 << 20,), float(step + 1))
    w.grad = torch.full_like(w, -1.0)
    optimizer = torch.optim.SGD([w], lr=1.0)
    while True:
        step += 1
        if lazy:
            manager.save(step, {"w": w, "step": step}, fence=optimizer)
            optimizer.step()  # w == step + 1: after the fence took what was not yet copied
        else:
            state = {"w": torch.full((4 << 20,), float(step)), "step": step}
            if incremental:
                state["frozen"] = frozen
            manager.save(step, state)
        if step % 2 == 0:
            manager.wait()  # drained: durable in root from here on
            print("durable", step, flush=True)
    """
)


def manager_kills(work: Path, count: int, seed: int) -> dict[str, Any]:
    """kill -9 a run of CheckpointManager saves and drains at random times; the next manager
    must restore a whole step, never older than the last one reported durable in root. Run
    with root a local directory (the fast tier on /dev/shm where there is one), the same
    with lazy saves (``fence=optimizer``, the state changed right after each save), then with
    incremental steps (every kept step must load with
    its bases), then (when moto's server and s3fs are installed) an s3:// prefix on a local S3
    server, where kills also land mid-upload."""
    # The first run's fast tier is in memory where it can be: saves there write over spare
    # files, the snapshot being the file itself (fastckpt.io.spare_files).
    memory = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    fast, fast_lazy = (
        [Path(tempfile.mkdtemp(prefix="torture-fast-", dir="/dev/shm")) for _ in range(2)]
        if memory
        else [work / "managed-fast", work / "managed-lazy-fast"]
    )
    try:
        report = _manager_kill_runs(work / "managed-root", fast, None, count, seed)
        # lazy saves (fence=optimizer) over the in-memory fast tier's spare files: read
        # through the fence straight into the file (fastckpt.checkpoint.file_snapshot)
        lazy = _manager_kill_runs(
            work / "managed-lazy-root", fast_lazy, None, count, seed, flavor="lazy"
        )
        report.update({f"{k} (lazy)": v for k, v in lazy.items()})
    finally:
        if memory:
            shutil.rmtree(fast, ignore_errors=True)
            shutil.rmtree(fast_lazy, ignore_errors=True)
    incremental = _manager_kill_runs(
        work / "managed-incremental-root",
        work / "managed-incremental-fast",
        None,
        count,
        seed,
        flavor="incremental",
    )
    report.update({f"{k} (incremental)": v for k, v in incremental.items()})
    try:
        from moto.server import ThreadedMotoServer

        from fastckpt.storage import url_to_fs
    except ImportError:
        report["s3 root"] = "skipped: needs moto[server] and s3fs"
        return report
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {
            "key": "torture",
            "secret": "torture",
            "endpoint_url": f"http://{host}:{port}",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        fs, _ = url_to_fs("s3://x", options)
        fs.call_s3("create_bucket", Bucket="managed")
        s3 = _manager_kill_runs("s3://managed/run", work / "managed-s3-fast", options, count, seed)
    finally:
        server.stop()
    report.update({f"{k} (s3 root)": v for k, v in s3.items()})
    return report


def _manager_kill_runs(
    root: Any,
    fast: Path,
    options: dict[str, Any] | None,
    count: int,
    seed: int,
    *,
    flavor: str = "full",
) -> dict[str, Any]:
    """``count`` runs of ``_MANAGED_RUN`` in ``flavor`` ("full", "incremental" or "lazy"),
    each killed at a random time, then checked by the next manager."""
    import torch

    from fastckpt.api import load
    from fastckpt.series import steps as layout
    from fastckpt.series.manager import CheckpointManager

    rng = random.Random(seed)
    tier = layout.Tier(str(root), options)
    lost, partial, unrestorable, left, broken = 0, 0, 0, 0, 0
    frozen = torch.arange(4 << 20, dtype=torch.float32)
    for _ in range(count):
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _MANAGED_RUN,
                str(root),
                str(fast),
                json.dumps(options),
                flavor,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(rng.uniform(0.5, 3.0))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        durable = [int(line.split()[1]) for line in out.splitlines() if line.startswith("durable")]
        with CheckpointManager(root, fast=fast, keep_last=2, storage_options=options) as manager:
            manager.wait()
            left += len(layout.uncommitted_dirs(tier)) + len(layout.uncommitted_dirs(str(fast)))
            try:
                step, state = manager.restore()
            except FileNotFoundError:
                unrestorable += int(bool(durable))
                continue
            if durable and max(layout.committed_steps(tier), default=0) < durable[-1]:
                lost += 1
            if state["step"] != step or not bool((state["w"] == float(step)).all()):
                partial += 1
            for t in (tier, layout.Tier(str(fast))):  # every kept step loads whole
                for s in layout.committed_steps(t):
                    path = layout.join(layout.step_dir(t, s), layout.STATE_FILE)
                    try:
                        kept = load(path, verify=True, storage_options=t.storage_options)
                    except FileNotFoundError:  # a base missing: a kept step that cannot load
                        broken += 1
                        continue
                    if flavor == "incremental" and not bool((kept["frozen"] == frozen).all()):
                        partial += 1
                    if kept["step"] != s or not bool((kept["w"] == float(s)).all()):
                        partial += 1  # a kept step holding another step's values
    return {
        "kills": count,
        "durable steps lost": lost,
        "partial or mixed steps restored": partial,
        "runs with nothing restorable": unrestorable,
        "uncommitted step directories left": left,
        "kept steps that do not load": broken,
    }


def fastckpt_zeros() -> Any:
    import torch

    return torch.zeros(1024)


# --------------------------------------------------------------------------- ENOSPC


def enospc(work: Path) -> dict[str, Any]:
    import errno

    import torch

    import fastckpt

    mount = work / "small-fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        return {"skipped": f"cannot mount a small tmpfs: {done.stderr.strip()}"}
    try:
        target = mount / "big.safetensors"
        outcomes = collections.Counter()
        run = mount / "run"
        manager = fastckpt.CheckpointManager(run, keep_last=3)
        manager.save(0, {"w": torch.ones(1024)}).result()  # a small step that must survive
        # a fast tier on the small file system, root on the disk: after three small steps the
        # fast tier holds a spare file, which the big save grows over (into memory, in the
        # call: its blocks must be allocated before a byte is copied, or the copy faults)
        fast = fastckpt.CheckpointManager(work / "fast-root", fast=mount / "fast", keep_last=2)
        for step in (1, 2, 3):
            fast.save(step, {"w": torch.full((2 << 20,), float(step))}).result()
            fast.wait()
        had_spare = (mount / "fast" / ".spare.safetensors").exists()
        saves = {
            "save": fastckpt.save,
            "async_save": lambda s, p: fastckpt.async_save(s, p).result(),
            "async_save(lazy)": lambda s, p: fastckpt.async_save(s, p, lazy=True).result(),
            "manager.save": lambda s, p: manager.save(1, s).result(),
            "manager.save (fast tier, over its spare)": lambda s, p: fast.save(4, s).result(),
        }
        for name, save in saves.items():
            try:
                save({"w": torch.randn(12 << 20)}, target)  # 48 MB into 32 MB
                outcomes[f"{name}: saved (unexpected)"] += 1
            except OSError as exc:
                got = "ENOSPC" if exc.errno == errno.ENOSPC else f"errno {exc.errno}"
                outcomes[f"{name}: {got}"] += 1
            except Exception as exc:  # noqa: BLE001 - counted as bad
                outcomes[f"{name}: {type(exc).__name__}"] += 1
        for each in (manager, fast):
            try:
                each.close()  # raises the failed step's error once more: wait() reports it
            except OSError:
                pass
        with fastckpt.CheckpointManager(work / "fast-root", fast=mount / "fast") as reopened:
            fast_step, fast_state = reopened.restore()
        fast_restored = fast_step == 3 and bool((fast_state["w"] == 3.0).all())
        fast_left = sorted(p.name for p in (mount / "fast").iterdir())
        left = [p.name for p in mount.iterdir() if p.name not in ("run", "fast")]
        used = shutil.disk_usage(mount).used
        with fastckpt.CheckpointManager(run, keep_last=3) as reopened:
            step, state = reopened.restore()
            steps_left = [p.name for p in run.iterdir() if p.name.startswith("step-")]
        fastckpt.save({"w": torch.randn(1 << 20)}, mount / "small.safetensors")
        fastckpt.load(mount / "small.safetensors", verify=True)
        return {
            "outcomes": dict(outcomes),
            "files left after the failed saves": len(left),
            "bytes used after the failed saves": used,
            "manager: step restored after the failed step": step,
            "manager: step directories left": steps_left,
            "fast tier: a spare file before the big save": had_spare,
            "fast tier: step 3 restored after the failed step 4": fast_restored,
            "fast tier: files left": fast_left,
            "a small save afterwards": "ok",
        }
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# --------------------------------------------------------------------------- concurrency

_WRITER = textwrap.dedent(
    """
    import sys, time, torch, fastckpt
    path, value, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    lazy = sys.argv[4] == "lazy"  # lazy async saves, several in flight, against plain ones
    state = {"w": torch.full((1 << 20,), value), "v": torch.tensor(value)}
    end, n, pending = time.monotonic() + seconds, 0, []
    while time.monotonic() < end:
        if lazy:
            pending.append(fastckpt.async_save(state, path, lazy=True, max_pending=3))
            if len(pending) == 3:
                pending.pop(0).result()
        else:
            fastckpt.save(state, path)
        n += 1
    for future in pending:
        future.result()
    print(n)
    """
)
_READER = textwrap.dedent(
    """
    import os, sys, time, torch, fastckpt
    path, seconds = sys.argv[1], float(sys.argv[2])
    end, good, bad = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        if not os.path.exists(path):
            continue
        try:
            # cold, so the file is read in FASTCKPT_READ_MODE (staged, direct) and not
            # copied out of the page cache
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except FileNotFoundError:  # replaced meanwhile: the next round opens the new one
            pass
        try:
            s = fastckpt.load(path, verify=True)
            v = float(s["v"])
            ok = v in (1.0, 2.0) and bool((s["w"] == v).all())
        except Exception as exc:
            ok = False
            print(os.environ.get("FASTCKPT_READ_MODE"), type(exc).__name__, exc, file=sys.stderr)
        good, bad = good + ok, bad + (not ok)
    print(good, bad)
    """
)


def concurrency(work: Path, seconds: float = 5.0) -> dict[str, Any]:
    folder = work / "concurrent"
    folder.mkdir()
    target = str(folder / "shared.safetensors")
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, target, str(v), str(seconds), how],
            stdout=subprocess.PIPE,
            text=True,
        )
        for v, how in ((1, "save"), (2, "lazy"))
    ]
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, target, str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "FASTCKPT_READ_MODE": mode},
        )
        for mode in ("staged", "direct")
    ]
    saves = sum(int(w.communicate()[0]) for w in writers)
    loads = [tuple(map(int, r.communicate()[0].split())) for r in readers]
    report = {
        "saves": saves,
        "good loads": sum(g for g, _ in loads),
        "torn or mixed loads": sum(b for _, b in loads),
        "temp files left": len(_temporaries(folder)),
    }
    shutil.rmtree(folder)
    return report


# A fast tier's readers. A deleted fast step's file becomes the spare, and the next save
# writes over it through the mapping the tier keeps of it (fastckpt.io.kept_mappings); the
# write lease asked on that mapping's own descriptor must still see every other opener, or
# a reader would watch a step's bytes turn into a later step's. Readers map the newest fast
# step (load(mmap=True): pages shared with the file until written) and check, after a pause,
# that every value is still that step's.

_FAST_SAVER = textwrap.dedent(
    """
    import os, sys, torch, fastckpt
    from fastckpt.series import steps as layout
    root, fast, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    inodes = set()
    with fastckpt.CheckpointManager(root, fast=fast, keep_last=1) as manager:
        for step in range(1, steps + 1):
            manager.save(step, {"w": torch.full((4 << 20,), float(step))}).result()
            path = layout.join(layout.step_dir(fast, step), layout.STATE_FILE)
            inodes.add(os.stat(path).st_ino)  # a reused spare keeps its inode
            if step % 3 == 0:
                manager.wait()  # drained: the fast tier's older steps go, spares appear
    print(steps - len(inodes), flush=True)
    """
)

_FAST_READER = textwrap.dedent(
    """
    import os, sys, time, fastckpt
    from fastckpt.series import steps as layout
    fast, stop = sys.argv[1], sys.argv[2]
    good = changed = gone = 0
    while not os.path.exists(stop):
        steps = layout.committed_steps(fast)
        if not steps:
            continue
        path = layout.join(layout.step_dir(fast, steps[-1]), layout.STATE_FILE)
        try:
            w = fastckpt.load(path, mmap=True)["w"]
        except (OSError, ValueError, fastckpt.FastCkptError):
            gone += 1  # deleted or not yet there: never a wrong value
            continue
        first = float(w[0])
        time.sleep(0.02)  # the saver retires, reuses, writes meanwhile
        if first == steps[-1] and bool((w == first).all()):
            good += 1
        else:
            changed += 1
        del w
    print(good, changed, gone, flush=True)
    """
)


def manager_readers(work: Path, steps: int = 60) -> dict[str, Any]:
    """A manager saving into a fast tier on /dev/shm while two processes map and check its
    newest step: a file must never be reused under a reader."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        return {"skipped": "needs /dev/shm"}
    fast = Path(tempfile.mkdtemp(prefix="torture-readers-", dir="/dev/shm"))
    stop = work / "readers-stop"
    try:
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", _FAST_READER, str(fast), str(stop)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        saver = subprocess.run(
            [sys.executable, "-c", _FAST_SAVER, str(work / "readers-root"), str(fast), str(steps)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        stop.touch()
        counts = [tuple(map(int, r.communicate(timeout=60)[0].split())) for r in readers]
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    report: dict[str, Any] = {
        "saves": steps,
        "files reused as spares": int(saver.stdout.split()[0]) if saver.returncode == 0 else 0,
        "reads that held a whole step": sum(c[0] for c in counts),
        "reads whose step changed under them": sum(c[1] for c in counts),
        "reads of a step already gone": sum(c[2] for c in counts),
    }
    if saver.returncode:
        report["saver error"] = saver.stderr[-1500:]
    return report


# --------------------------------------------------------------------------- multi-file sets
#
# A sharded directory (Hugging Face shards + index) and a DCP checkpoint (rank files +
# .metadata) are sets of files; each save writes every tensor with one value, the save's
# generation (writer * 100000 + count), so a load that holds two values mixes two saves.
# Counted: mixed sets (a load, or the directory after a kill, holding two saves), lost
# updates (the directory at the end is not a writer's last successful save), writes into
# other files (files beside the checkpoint changed), pickles run without consent (a
# planted pickle executed by a load). Kills are random in time, or placed exactly: the
# child SIGKILLs itself at its n-th rename or unlink of a checkpoint file.

_SET_SAVER = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    kind, path, writer, seconds, kill_at = sys.argv[1:6]
    writer, seconds = int(writer), float(seconds)
    if kill_at != "-":
        call, nth = kill_at.split(":")
        real, seen = getattr(os, call), [0]
        def dying(*args, **kwargs):
            seen[0] += 1
            if seen[0] == int(nth):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        setattr(os, call, dying)
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp
        from fastckpt.dcp import FastCkptWriter
        def save(state):
            dcp.save(state, storage_writer=FastCkptWriter(path), no_dist=True)
    else:
        import fastckpt
        def save(state):
            fastckpt.save(state, path, max_shard_size="300KB")
    count = 4 + writer
    print("ready", flush=True)
    end, generation = time.monotonic() + seconds, 0
    while True:
        generation += 1
        value = float(writer * 100000 + generation)
        save({f"layers.{i}.weight": torch.full((32768,), value) for i in range(count)})
        print("saved", value, flush=True)
        if time.monotonic() > end:
            break
    """
)

_SET_READER = textwrap.dedent(
    """
    import os, sys, torch
    kind, path, stop = sys.argv[1:4]
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp
        from fastckpt.dcp import FastCkptReader, load_full
        def load():
            return load_full(path)
    else:
        import fastckpt
        def load():
            return fastckpt.load(path)
    counts = {"whole": 0, "mixed": 0, "missing": 0, "errors": 0}
    first = True
    while first or not os.path.exists(stop):
        try:
            load_once = load()
            seen = {float(t.reshape(-1)[0]) for t in load_once.values()}
            seen |= {float(t.reshape(-1)[-1]) for t in load_once.values()}
            counts["whole" if len(seen) == 1 else "mixed"] += 1
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, FileNotFoundError) or "FileNotFoundError" in str(exc):
                counts["missing"] += 1  # its set was removed under it by a newer save
            else:
                counts["errors"] += 1
                print(type(exc).__name__, str(exc)[-300:], file=sys.stderr)  # the cause ends it
        if first:
            print("ready", flush=True)
            first = False
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    """
)

_CANARY = "pickle-canary-ran"


def _plant_bystanders(folder: Path) -> dict[str, bytes]:
    """Files a checkpoint directory may hold beside the checkpoint: they must stay as they
    are. One is a pickle whose loading creates a canary file."""
    import pickle

    class Canary:
        def __reduce__(self):  # unpickling opens (creates) the canary file
            return (open, (str(folder / _CANARY), "w"))

    files = {
        "config.json": b'{"model_type": "llama"}\n',
        "pytorch_model.bin": pickle.dumps(Canary()),
        "model-00001-of-00002.safetensors.bak": b"a user's backup",
        "notes.safetensors": b"not a checkpoint",
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _changed_bystanders(folder: Path, files: dict[str, bytes]) -> int:
    return sum(
        1
        for name, data in files.items()
        if not (folder / name).is_file() or (folder / name).read_bytes() != data
    )


def _set_values(kind: str, path: Path) -> set[float]:
    """The generations a load of the set finds (one for a whole set)."""
    if kind == "dcp":
        from fastckpt.dcp import load_full

        loaded = load_full(str(path))
    else:
        import fastckpt

        loaded = fastckpt.load(path)
    return {float(t.reshape(-1)[0]) for t in loaded.values()} | {
        float(t.reshape(-1)[-1]) for t in loaded.values()
    }


def _checkpoint_exception() -> type[BaseException]:
    """DCP's load error, a BaseException (not an Exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _spawn(code: str, *args: Any) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _saved(out: str) -> list[float]:
    return [float(line.split()[1]) for line in out.splitlines() if line.startswith("saved ")]


def set_kills(work: Path, kind: str, count: int, seed: int) -> dict[str, Any]:
    """kill -9 during saves of a multi-file set: at random times, and at each rename and
    unlink of a save (the publish step and the removal of the old files)."""
    rng = random.Random(seed)
    folder = work / f"{kind}-kills"
    bystanders = _plant_bystanders(folder)
    target = folder
    first = subprocess.run(
        [sys.executable, "-c", _SET_SAVER, kind, str(target), "1", "0", "-"],
        capture_output=True,
        text=True,
    )
    report: collections.Counter = collections.Counter()
    if first.returncode:
        return {"error": first.stderr[-500:]}
    last = _saved(first.stdout)[-1]
    for i in range(count):
        kill_at = "-" if i % 3 == 0 else f"{'replace' if i % 3 == 1 else 'unlink'}:{1 + i // 3 % 4}"
        child = _spawn(_SET_SAVER, kind, target, 2 + i, 0 if kill_at != "-" else 30, kill_at)
        if kill_at == "-":
            assert child.stdout is not None
            child.stdout.readline()
            time.sleep(rng.uniform(0.0, 1.0))
            child.kill()
        out, _ = child.communicate()
        saved = _saved(out)
        try:
            found = _set_values(kind, target)
        except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - counted
            report[f"unloadable ({type(exc).__name__})"] += 1
            continue
        # the set published before the child, one it reported, or the next one, which it
        # may have published before dying
        allowed = {last, *saved, (saved[-1] if saved else (2 + i) * 100000.0) + 1}
        if len(found) != 1:
            report["mixed sets"] += 1
        elif not found <= allowed:
            report["lost updates"] += 1
        last = max(found)
    report = {
        "kills": count,
        "mixed sets": report.pop("mixed sets", 0),
        "lost updates": report.pop("lost updates", 0),
        **dict(report),
        "writes into other files": _changed_bystanders(folder, bystanders),
        "pickles run without consent": int((folder / _CANARY).exists()),
    }
    shutil.rmtree(folder)
    return report


_LOAD_PLANTED = textwrap.dedent(
    """
    import sys, fastckpt
    try:
        fastckpt.load(sys.argv[1])
    except BaseException as exc:
        print(type(exc).__name__)
    """
)


_LAZY_CUDA = textwrap.dedent(
    """
    import json, os, sys, torch, fastckpt
    from fastckpt.bench.synthetic import llm_like_state_dict
    folder, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
    for r in range(rounds):
        size = sizes[(r + seed) % len(sizes)]
        host = llm_like_state_dict(size, seed=r)
        state = {k: v.to("cuda") for k, v in host.items()}
        torch.cuda.synchronize()
        path = os.path.join(folder, f"lazy-{seed}-{r}.safetensors")
        # an optimizer over the state (never stepped) owns it: the save reads it lazily
        owner = torch.optim.SGD(list(state.values()), lr=0.0)
        future = fastckpt.async_save(state, path, fence=owner)
        future.fence()
        for t in state.values():  # the step, right after the fence
            t.add_(1)
        future.result()
        back = fastckpt.load(path)
        wrong = [k for k in host if not torch.equal(back[k], host[k])]
        stepped = [k for k in wrong if torch.equal(back[k], (host[k].cuda() + 1).cpu())]
        print(json.dumps([size, len(host), wrong[:5], len(wrong), len(stepped)]), flush=True)
        os.remove(path)
    """
)


def lazy_cuda(work: Path, rounds: int, processes: int = 4) -> dict[str, Any]:
    """Lazy saves of CUDA state fenced and changed right after the call, in ``processes``
    processes sharing the GPU at once: every file must hold the state at call time. Tensors
    that differ are counted, and those holding the stepped values (+1) apart."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU here"}
    children = [_spawn(_LAZY_CUDA, work, rounds, seed) for seed in range(processes)]
    report: dict[str, Any] = {
        "saves": 0,
        "files not the call-time state": 0,
        "tensors differing": 0,
        "of them holding the step's values": 0,
        "errors": [],
    }
    for child in children:
        out, err = child.communicate(timeout=1800)
        for line in out.splitlines():
            size, count, wrong, n_wrong, n_stepped = json.loads(line)
            report["saves"] += 1
            report["files not the call-time state"] += bool(n_wrong)
            report["tensors differing"] += n_wrong
            report["of them holding the step's values"] += n_stepped
            if n_wrong:
                report.setdefault("examples", []).append([size, count, wrong])
        if child.returncode:
            report["errors"].append(err.strip().splitlines()[-1:] or [f"exit {child.returncode}"])
    return report


def planted_pickles(work: Path) -> int:
    """How many of ``fastckpt.load``'s paths run a pickle planted in a checkpoint directory
    (a hostile DCP ``.metadata``, a ``pytorch_model.bin`` beside an index) without
    ``allow_pickle``/``weights_only=False``."""
    import pickle

    import torch

    import fastckpt

    ran = 0
    for case in ("dcp", "shard"):
        folder = work / f"planted-{case}"
        folder.mkdir()
        canary = folder / _CANARY

        class Canary:
            def __reduce__(self, target: str = str(canary)):
                return (open, (target, "w"))

        if case == "dcp":
            (folder / ".metadata").write_bytes(pickle.dumps(Canary()))
        else:
            fastckpt.save({"w": torch.ones(4), "v": torch.ones(4)}, folder, max_shard_size="16B")
            (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Canary()))
        subprocess.run([sys.executable, "-c", _LOAD_PLANTED, str(folder)], capture_output=True)
        ran += canary.exists()
        shutil.rmtree(folder)
    return ran


def set_concurrency(work: Path, kind: str, seconds: float) -> dict[str, Any]:
    """Two writers re-saving one set and a reader loading it meanwhile."""
    folder = work / f"{kind}-concurrent"
    bystanders = _plant_bystanders(folder)
    target = folder
    subprocess.run(
        [sys.executable, "-c", _SET_SAVER, kind, str(target), "9", "0", "-"],
        check=True,
        capture_output=True,
    )
    stop = work / f"{kind}-stop"
    reader = _spawn(_SET_READER, kind, target, stop)
    assert reader.stdout is not None
    reader.stdout.readline()
    writers = [_spawn(_SET_SAVER, kind, target, w, seconds, "-") for w in (1, 2)]
    outputs = [w.communicate() for w in writers]
    stop.touch()
    r_out, r_err = reader.communicate()
    counts = dict(item.split("=") for item in r_out.split()) if r_out else {}
    lasts = {_saved(out)[-1] for out, _ in outputs if _saved(out)}
    failed = sum(1 for w in writers if w.returncode)
    if reader.returncode:
        counts["errors"] = int(counts.get("errors", 0)) + 1  # the reader itself died
    try:
        found = _set_values(kind, target)
        final_mixed, lost = int(len(found) != 1), int(len(found) == 1 and not found <= lasts)
    except (Exception, _checkpoint_exception()):  # noqa: BLE001 - counted as a broken set
        final_mixed, lost = 1, 0
    report = {
        "saves": sum(len(_saved(out)) for out, _ in outputs),
        "failed writers": failed,
        "loads": sum(int(counts.get(k, 0)) for k in ("whole", "mixed", "missing")),
        "loads that lost their set to a newer save (FileNotFoundError)": int(
            counts.get("missing", 0)
        ),
        "mixed sets": int(counts.get("mixed", 0)) + final_mixed,
        "other load errors": int(counts.get("errors", 0)),
        "lost updates": lost,
        "writes into other files": _changed_bystanders(folder, bystanders),
        "pickles run without consent": int((folder / _CANARY).exists()),
    }
    if failed or report["other load errors"]:
        report["reader stderr"] = r_err[:1500]
        report["writer stderr"] = "".join(err for _, err in outputs)[-400:]
    shutil.rmtree(folder)
    return report


def _set_bad(report: dict[str, Any]) -> int:
    keys = ("mixed sets", "lost updates", "writes into other files", "pickles run without consent")
    return (
        sum(report.get(k, 0) for k in keys)
        + sum(v for k, v in report.items() if k.startswith("unloadable"))
        + report.get("failed writers", 0)
        + report.get("other load errors", 0)
        + int("error" in report)
    )


# --------------------------------------------------------------------------- huge headers

_PARSER = textwrap.dedent(
    """
    import json, os, resource, sys, time
    path, limit = sys.argv[1], int(sys.argv[2])
    from fastckpt.format import parse_header, parse_header_length, split_metadata
    from fastckpt.errors import HeaderError
    import re
    hwm = lambda: int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    base_rss = hwm()
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = parse_header_length(f.read(8), size)
            header = parse_header(f.read(n), size)
        split_metadata(header.metadata)
        outcome = "parsed"
    except HeaderError as exc:
        outcome = "HeaderError: " + str(exc)[:90]
    except MemoryError:
        outcome = "MemoryError"
    print(json.dumps({"outcome": outcome, "wall_s": round(time.perf_counter() - t0, 2),
                      "cpu_s": round(time.process_time() - c0, 2),
                      "peak_rss_growth_x_file": round((hwm() - base_rss) * 1024 / size, 1)}))
    """
)


def _baseline_vm() -> int:
    """Address space of a child that imported fastckpt.format, before any parsing."""
    code = (
        "import fastckpt.format, re\n"
        "print(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout) * 1024


def _write_header_file(path: Path, text: bytes) -> None:
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)


def bounds(work: Path, megabytes: int) -> dict[str, Any]:
    """Parse huge hostile headers in a child limited to 10x the file's size of memory."""
    from fastckpt.format.schema import KEY_HEADER_CRC, canonical_crc

    size = megabytes << 20
    cases: dict[str, bytes] = {}
    lists = (size - 200) // 3
    tree = "[" + "[]," * (lists - 1) + "[]]"
    meta = {"fastckpt.version": "2", "fastckpt.checkpoint.tree": tree}
    meta[KEY_HEADER_CRC] = canonical_crc({"__metadata__": meta})
    cases["tree of empty lists"] = json.dumps(
        {"__metadata__": meta}, separators=(",", ":")
    ).encode()
    cases["header of {}"] = b'{"__metadata__":{"k":"v"},"a":[' + b"{}," * (size // 3 - 20) + b"{}]}"
    zero = b'"%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    cases["1.5M zero-size tensors"] = b"{" + b",".join(zero % i for i in range(1_500_000)) + b"}"
    # The worst that is accepted: the most tensors, in the fewest bytes allowed for them.
    from fastckpt.format.schema import MAX_TENSORS, MIN_BYTES_PER_TENSOR

    text = b"{" + b",".join(zero % i for i in range(MAX_TENSORS)) + b"}"
    cases["the most zero-size tensors allowed"] = text + b" " * max(
        MAX_TENSORS * MIN_BYTES_PER_TENSOR - len(text), 0
    )
    real = b'"model.layers.%d.mlp.weight":{"dtype":"BF16","shape":[0,4096],"data_offsets":[0,0]}'
    cases["the most real-looking tensors allowed"] = (
        b"{" + b",".join(real % i for i in range(MAX_TENSORS)) + b"}"
    )
    baseline = _baseline_vm()
    report = {}
    for name, text in cases.items():
        path = work / "huge.safetensors"
        _write_header_file(path, text)
        del text
        file_size = path.stat().st_size
        limit = baseline + 10 * file_size
        try:
            out = subprocess.run(
                [sys.executable, "-c", _PARSER, str(path), str(limit)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            result = (
                json.loads(out.stdout)
                if out.returncode == 0
                else {"outcome": f"CRASH {out.returncode}: {out.stderr[-200:]}"}
            )
        except subprocess.TimeoutExpired:
            result = {"outcome": "HANG"}
        result["file_mb"] = round(file_size / (1 << 20), 1)
        report[name] = result
        path.unlink()
    cases.clear()
    return report


# --------------------------------------------------------------------------- main


PARTS = [
    "fuzz",
    "frames",
    "flips",
    "kills",
    "enospc",
    "concurrency",
    "shard-kills",
    "shard-concurrency",
    "dcp-kills",
    "dcp-concurrency",
    "planted-pickles",
    "manager-kills",
    "manager-readers",
    "bounds",
    "lazy-cuda",
    "mutation-kills",
    "hostile-trees",
    "collective-kills",
    "node-kills",
    "adversarial-ranks",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000, help="hostile files (default 5000)")
    parser.add_argument(
        "--frame-cases", type=int, default=600, help="hostile compressed frames (default 600)"
    )
    parser.add_argument("--flips", type=int, default=200, help="bit flips (default 200)")
    parser.add_argument(
        "--cuda-rounds",
        type=int,
        default=40,
        help="lazy CUDA saves per process (default 40; skipped without a GPU)",
    )
    parser.add_argument("--kills", type=int, default=20, help="kill -9 during saves (default 20)")
    parser.add_argument(
        "--bounds-mb", type=int, default=100, help="size of the huge headers (default 100)"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="concurrency run length")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--collective-kills",
        type=int,
        default=50,
        help="runs of asynchronous multi-rank saves, one rank killed in each (default 50)",
    )
    parser.add_argument(
        "--set-kills", type=int, default=12, help="kill -9 per multi-file kind (default 12)"
    )
    parser.add_argument(
        "--tree-rounds",
        type=int,
        default=3,
        help="rounds of every hostile series tree, and a race each (default 3)",
    )
    parser.add_argument(
        "--node-rounds",
        type=int,
        default=4,
        help="simulated nodes lost at random points, replicas=1 (default 4)",
    )
    parser.add_argument(
        "--rank-rounds",
        type=int,
        default=1,
        help="rounds of every adversarial-ranks scenario (default 1)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=PARTS,
        help="run only these parts (repeatable)",
    )
    parser.add_argument("--dir", help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    parts = args.only or PARTS
    work = Path(tempfile.mkdtemp(prefix="fastckpt-torture-", dir=args.dir))
    bad = 0
    try:
        for part in parts:
            started = time.perf_counter()
            if part == "fuzz":
                report = fuzz(work, args.cases, args.seed)
                bad += report["bad outcomes"]
            elif part == "frames":
                report = frames_fuzz(work, args.frame_cases, args.seed)
                bad += report["bad outcomes"] + report["changed values undetected"]
            elif part == "flips":
                report = flips(work, args.flips, args.seed)
                bad += report["bad outcomes"] + report["changed values undetected"]
            elif part == "kills":
                report = kills(work, args.kills, args.seed)
                bad += report["torn checkpoints"] + report["checkpoints mixing two steps"]
                bad += report["temp files left after the next save"]
            elif part == "enospc":
                report = enospc(work)
                outcomes = report.get("outcomes", {}).items()
                bad += sum(v for k, v in outcomes if not k.endswith(": ENOSPC"))
                bad += report.get("files left after the failed saves", 0)
                bad += len(report.get("manager: step directories left", [])) > 1
                bad += report.get("fast tier: a spare file before the big save") is False
                bad += report.get("fast tier: step 3 restored after the failed step 4") is False
                bad += sum(  # a temporary file or a spare left behind
                    not (n.startswith("step-") or n == ".fastckpt-manager.lock")
                    for n in report.get("fast tier: files left", [])
                )
            elif part in ("shard-kills", "dcp-kills"):
                report = set_kills(work, part.split("-")[0], args.set_kills, args.seed)
                bad += _set_bad(report)
            elif part == "manager-kills":
                report = manager_kills(work, args.set_kills, args.seed)
                bad += sum(
                    v for k, v in report.items() if not k.startswith("kills") and isinstance(v, int)
                )
            elif part == "manager-readers":
                report = manager_readers(work)
                bad += report.get("reads whose step changed under them", 0)
                bad += "saver error" in report
                # a run that reused no file, or read nothing whole, checked nothing
                if "skipped" not in report:
                    bad += not report["files reused as spares"]
                    bad += not report["reads that held a whole step"]
            elif part == "lazy-cuda":
                report = lazy_cuda(work, args.cuda_rounds)
                bad += report.get("files not the call-time state", 0) + len(
                    report.get("errors", [])
                )
            elif part == "mutation-kills":
                report = torture_mutations.mutation_kills(work, args.set_kills, args.seed)
                bad += torture_mutations.bad_outcomes(report)
            elif part == "collective-kills":
                report = torture_collective.collective_kills(work, args.collective_kills, args.seed)
                bad += torture_collective.bad_outcomes(report)
            elif part == "hostile-trees":
                report = torture_trees.hostile_trees(work, args.tree_rounds, args.seed)
                bad += torture_trees.bad_outcomes(report)
            elif part == "node-kills":
                report = torture_nodes.node_kills(work, args.node_rounds, args.seed)
                bad += torture_nodes.bad_outcomes(report)
            elif part == "adversarial-ranks":
                report = torture_ranks.adversarial_ranks(work, args.rank_rounds)
                bad += torture_ranks.bad_outcomes(report)
            elif part == "planted-pickles":
                report = {"pickles run without consent": planted_pickles(work)}
                bad += report["pickles run without consent"]
            elif part in ("shard-concurrency", "dcp-concurrency"):
                report = set_concurrency(work, part.split("-")[0], args.seconds)
                bad += _set_bad(report)
            elif part == "concurrency":
                report = concurrency(work, args.seconds)
                bad += report["torn or mixed loads"] + report["temp files left"]
            else:
                report = bounds(work, args.bounds_mb)
                bad += sum(
                    1
                    for r in report.values()
                    if r["outcome"].startswith(("CRASH", "HANG", "MemoryError"))
                )
            report["part seconds"] = round(time.perf_counter() - started, 1)
            print(f"== {part}", json.dumps(report, indent=2), sep="\n", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"bad outcomes in total: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
