#!/usr/bin/env python3
"""Checkpoints at an S3 URL: fastckpt against safetensors and torch over ``fs.open``, in one run.

The S3 server is moto's (``ThreadedMotoServer``) on loopback, started by this script in the
driver process; every save and load runs in its own child process (through s3fs), so CPU
seconds and peak RSS belong to that method alone. Each round, the order of the methods is
rotated so that the server's noise hits them alike:

* save: ``fastckpt.save(state, "s3://...")`` (CRC32C pass, then header and data streamed
  through ``--parallel`` part buffers of ``--part-size`` as one multipart upload);
  ``safetensors.torch.save`` into ``fs.open(url, "wb")``; ``torch.save`` into
  ``fs.open(url, "wb")``; and the ceiling, ``raw upload``: s3fs's own parallel multipart
  upload (``fs.pipe_file``, same part size and concurrency) of bytes already serialized
  before the clock starts;
* load: ``fastckpt.load(url)`` (parallel ranged reads into one arena, CRC32C verified);
  ``safetensors.torch.load(fs.open(url).read())``; ``torch.load(fs.open(url))``.

Then, on a local file system (``--dir``), a sharded save (``max_shard_size`` a quarter of
the state dict, as 4 GiB into 1 GiB shards) against a single-file ``fastckpt.save`` of the
same state dict, both durable.

Figures are medians over ``--repeats`` rounds; GB/s counts the state dict's tensor bytes
(1 GB = 1e9 bytes); "extra RSS" is the child's peak RSS during the timed section minus its
RSS when the section started (above the state dict for saves). Markdown to stdout, progress
to stderr. moto keeps objects in its own memory and is written in Python: its figures are
far below a real object store's, and it is the same server for every method.

Example::

    python benchmarks/bench_remote.py --size 1G --repeats 3
    python benchmarks/bench_remote.py --size 256M --repeats 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from fastckpt.bench.checks import touch
from fastckpt.bench.children import report, run_child
from fastckpt.bench.filesystems import filesystem_of
from fastckpt.bench.measure import Measure
from fastckpt.bench.report import fmt, log
from fastckpt.bench.results import rotate
from fastckpt.bench.synthetic import llm_like_state_dict
from fastckpt.bench.units import format_bytes, median
from fastckpt.config import parse_size

SAVE_METHODS = ["fastckpt", "safetensors", "torch.save", "raw upload"]
LOAD_METHODS = ["fastckpt", "safetensors", "torch.load"]
SHARD_METHODS = ["single file", "sharded"]
_EXT = {"fastckpt": "fastckpt.safetensors", "safetensors": "st.safetensors", "torch": "pt"}


def _options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "bench",
        "secret": "bench",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
    }


# ----------------------------------------------------------------------------- children


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import fsspec.core
    import torch

    import fastckpt
    from fastckpt.integrations import remote

    torch.set_num_threads(os.cpu_count() or 1)
    options = _options(spec.get("endpoint", ""))
    part, parallel = spec["part_size"], spec["parallel"]
    kind, method = spec["kind"], spec["method"]
    result: dict[str, Any] = {}
    if kind == "save" or kind == "shard":
        state = llm_like_state_dict(spec["size"])
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        if method == "raw upload":
            import safetensors.torch

            data = safetensors.torch.save(state)  # serialized before the clock starts
            del state
        with Measure() as m:
            if kind == "shard":
                target = spec["target"]
                if method == "sharded":
                    fastckpt.save(state, target, max_shard_size=spec["shard_size"])
                else:
                    fastckpt.save(state, target)
            elif method == "fastckpt":
                remote.save(
                    state, spec["url"], storage_options=options, part_size=part, parallel=parallel
                )
            elif method == "raw upload":
                fs, path = fsspec.core.url_to_fs(spec["url"], **options)
                fs.pipe_file(path, data, chunksize=part, max_concurrency=parallel)
            else:
                fs, path = fsspec.core.url_to_fs(spec["url"], **options)
                with fs.open(path, "wb", block_size=part) as f:
                    if method == "safetensors":
                        import safetensors.torch

                        f.write(safetensors.torch.save(state))
                    else:
                        torch.save(state, f)
    else:
        with Measure() as m:
            if method == "fastckpt":
                tensors = remote.load(
                    spec["url"], storage_options=options, part_size=part, parallel=parallel
                )
            else:
                fs, path = fsspec.core.url_to_fs(spec["url"], **options)
                with fs.open(path, "rb", block_size=part) as f:
                    if method == "safetensors":
                        import safetensors.torch

                        tensors = safetensors.torch.load(f.read())
                    else:
                        tensors = torch.load(f, weights_only=True)
            result["checksum"] = touch(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    result.update(m.as_dict(), nbytes=nbytes)
    return result


def _run(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    return run_child(argv, timeout=timeout)


# ------------------------------------------------------------------------------ driver


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


def _start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own: its memory and CPU stay out of the figures
    (a child's peak RSS would otherwise start at its parent's)."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    endpoint = server.stdout.readline().strip()
    if not endpoint.startswith("http://"):
        server.kill()
        raise RuntimeError("the moto S3 server did not start (pip install 'moto[server]')")
    return server, endpoint


def _table(title: str, rows: dict[str, list[dict[str, Any]]], ratio_to: list[str]) -> str:
    lines = [f"### {title}", ""]
    head = "| method | GB/s | seconds | CPU s | extra RSS |" + "".join(
        f" x {r} |" for r in ratio_to
    )
    lines += [head, "|" + "---|" * (5 + len(ratio_to))]
    rates = {}
    for method, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {method} | failed: {runs[0].get('error', '?')} |")
            continue
        rates[method] = median(r["nbytes"] / r["seconds"] / 1e9 for r in ok)
    for method, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            continue
        cells = [
            fmt(rates[method], ".3f"),
            fmt(median(r["seconds"] for r in ok), ".2f"),
            fmt(median(r["cpu_seconds"] for r in ok), ".2f"),
            format_bytes(median(r["extra_rss"] for r in ok)),
        ]
        for other in ratio_to:
            cells.append(fmt(rates[method] / rates[other], ".2f") if other in rates else "n/a")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="1G", help="state dict size (default 1G)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part-size", default="16M", help="upload part / read range size")
    parser.add_argument("--parallel", type=int, default=8, help="parts or ranges in flight")
    parser.add_argument("--dir", default="/work/bench-tmp", help="local directory (sharded)")
    parser.add_argument("--skip-shards", action="store_true")
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args(argv)
    if args.child:
        report(_child(json.loads(args.child)))
        return 0

    size = parse_size(args.size)
    part = parse_size(args.part_size)
    server, endpoint = _start_server()
    import fsspec.core

    fs, _ = fsspec.core.url_to_fs("s3://x", **_options(endpoint))
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    common = dict(endpoint=endpoint, size=size, part_size=part, parallel=args.parallel)
    timeout = 120 + size / 5e6
    saves: dict[str, list] = {m: [] for m in SAVE_METHODS}
    loads: dict[str, list] = {m: [] for m in LOAD_METHODS}
    shards: dict[str, list] = {m: [] for m in SHARD_METHODS}
    url = {k: f"s3://{bucket}/ckpt.{ext}" for k, ext in _EXT.items()}
    url["raw upload"], url["torch.save"], url["torch.load"] = (
        f"s3://{bucket}/raw.bin",
        url["torch"],
        url["torch"],
    )
    for r in range(args.repeats):
        for method in rotate(SAVE_METHODS, r):
            log(f"round {r + 1}: save {method}")
            spec = dict(common, kind="save", method=method, url=url[method])
            saves[method].append(_run(spec, timeout))
            log(f"  {saves[method][-1]}")
        fs.rm(url["raw upload"])
        for method in rotate(LOAD_METHODS, r):
            log(f"round {r + 1}: load {method}")
            spec = dict(common, kind="load", method=method, url=url[method])
            loads[method].append(_run(spec, timeout))
            log(f"  {loads[method][-1]}")
        fs.rm([url["fastckpt"], url["safetensors"], url["torch"]])
        if not args.skip_shards:
            base = Path(args.dir) / f"bench-remote-{uuid.uuid4().hex[:8]}"
            base.mkdir(parents=True)
            try:
                for method in rotate(SHARD_METHODS, r):
                    target = base / ("sharded" if method == "sharded" else "single.safetensors")
                    spec = dict(
                        common,
                        kind="shard",
                        method=method,
                        target=str(target),
                        shard_size=size // 4,
                    )
                    log(f"round {r + 1}: {method} on {args.dir}")
                    shards[method].append(_run(spec, timeout))
                    log(f"  {shards[method][-1]}")
            finally:
                shutil.rmtree(base, ignore_errors=True)
    server.stdin.close()
    server.wait(timeout=60)

    sums = {m: {r.get("checksum") for r in runs if "error" not in r} for m, runs in loads.items()}
    agree = len({s for v in sums.values() for s in v}) <= 1
    print(f"## bench_remote: {format_bytes(size)} state dict, S3 = moto on loopback\n")
    print(
        f"{platform.node()} · {os.cpu_count()} CPUs · Python {platform.python_version()} · "
        f"part {format_bytes(part)} × {args.parallel} in flight · medians of {args.repeats}"
        f" · loaders agree on the bytes: {agree}\n"
    )
    print(_table("Save to S3", saves, ["safetensors", "torch.save", "raw upload"]))
    print(_table("Load from S3", loads, ["safetensors", "torch.load"]))
    if not args.skip_shards:
        fs_type = filesystem_of(args.dir)
        title = f"Sharded save (4 shards) vs one file, on {fs_type[1]} ({args.dir})"
        print(_table(title, shards, ["single file"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"save": saves, "load": loads, "shards": shards}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
