#!/usr/bin/env python3
"""Compressed checkpoints: ratio and speed of fastckpt's codecs against zipnn and plain zstd,
and end-to-end saves and loads through a slow sink, with and without compression.

Part 1, codecs, on four kinds of tensors of ``--size`` bytes each, synthesized as training
leaves them: ``bf16 weights`` and ``fp32 weights`` (normal, a scale per row as trained
matrices have, rounded to the dtype), and Adam's ``exp_avg`` (small, signed) and
``exp_avg_sq`` (small, positive) in fp32. With ``--model`` the weights of a small
randomly initialised transformers model are measured too (when transformers is installed).
Methods, all on the same bytes in the same run:

* ``fastckpt byteplane``: byte planes (exponent plane entropy-coded, mantissa planes raw
  where they do not shrink), 2 MiB chunks;
* ``fastckpt zstd``: zstd level 3 per 2 MiB chunk;
* ``zstd-3``: plain zstd level 3 over the whole buffer (one frame);
* ``zipnn``: zipnn's ZipNN for the dtype (when installed: ``pip install zipnn``).

Ratio is compressed / raw bytes (lower is better). Speeds are GB/s of raw bytes per core:
every method runs on one thread (fastckpt with ``threads=1``), median of ``--repeats``; and
GB per CPU-second of the process, which a machine shared with other jobs inflates less than
wall time.
Every round trip is checked to give back the same bytes.

Part 2, end-to-end: ``fastckpt.save`` of an LLM-like state (bf16 weights and fp32 Adam
states) into a sink that accepts ``--sink-mbps`` MB/s (a file object that sleeps to hold the
rate, as an upload to an object store does), and ``fastckpt.load`` back from a source read
at the same rate; with ``compress=None`` and ``compress=True``, on every core. A compressed save
compresses while it writes (the sink takes the first frames while the next ones compress),
and a compressed load decompresses the chunks read while it reads the next ones.

Markdown to stdout, progress to stderr. The machine is shared: compare only figures from
one run.

Example::

    python benchmarks/bench_compression.py --size 64M --repeats 3 --sink-mbps 200 50
    python benchmarks/bench_compression.py --smoke
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastckpt.bench.report import log, markdown_table
from fastckpt.bench.units import median
from fastckpt.checkpoint import load as checkpoint_load
from fastckpt.checkpoint import stream_save
from fastckpt.codec import frames
from fastckpt.config import parse_size

KINDS = ["bf16 weights", "fp32 weights", "adam exp_avg", "adam exp_avg_sq"]


def weights(nbytes: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A trained-looking matrix: normal values, one scale per row, rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    cols = 4096 if nbytes >= 4096 * 4 * 64 else 256
    rows = max(1, nbytes // (cols * torch.finfo(dtype).bits // 8))
    scale = torch.rand(rows, 1, generator=g) * 0.05 + 0.005
    return (torch.randn(rows, cols, generator=g) * scale).to(dtype)


def tensor_of(kind: str, nbytes: int) -> torch.Tensor:
    if kind == "bf16 weights":
        return weights(nbytes, torch.bfloat16, 1)
    if kind == "fp32 weights":
        return weights(nbytes, torch.float32, 2)
    if kind == "adam exp_avg":  # an EMA of gradients: small, signed, a scale per row
        return weights(nbytes, torch.float32, 3) * 1e-3
    if kind == "adam exp_avg_sq":  # an EMA of squared gradients: small and positive
        return (weights(nbytes, torch.float32, 4) * 1e-3) ** 2
    raise ValueError(kind)


def model_tensors(limit: int) -> list[tuple[str, torch.Tensor]]:
    """The bf16 weights of a small random transformers model (empty without transformers)."""
    try:
        import transformers
    except ImportError:
        return []
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])[: limit // 2]
    return [("llama (random init) bf16", flat.contiguous())]


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    return _time_cpu(fn, repeats)[::2]


def _time_cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, Any, float]:
    """Median wall seconds, the last result, and median CPU seconds of this process (every
    thread): on a shared machine the CPU time still says what the work costs."""
    times, cpu, result = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return median(times), result, median(cpu)


def codec_methods(dtype: torch.dtype) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """name -> (compress(raw bytes array) -> blob, decompress(blob) -> bytes)."""
    import zstandard

    itemsize = torch.empty(0, dtype=dtype).element_size()
    methods: dict[str, Any] = {}
    for codec in ("byteplane", "zstd"):

        def pack(data: np.ndarray, codec: str = codec) -> Any:
            return frames.compress(data, codec, itemsize, threads=1)

        def unpack(packed: Any, n: int) -> np.ndarray:
            out = np.empty(n, np.uint8)
            frames.decompress(packed[0], out, itemsize, crc32c=packed[1], where="bench", threads=1)
            return out

        methods[f"fastckpt {codec}"] = (pack, unpack)
    methods["zstd-3"] = (
        lambda data: zstandard.ZstdCompressor(level=3).compress(data),
        lambda blob, n: np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), np.uint8),
    )
    try:
        with warnings.catch_warnings():  # zipnn's import uses torch.jit.script, deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            import zipnn
    except ImportError:
        log("zipnn is not installed (pip install zipnn): left out")
        return methods
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if dtype in names:
        zn = zipnn.ZipNN(input_format="byte", bytearray_dtype=names[dtype], threads=1)
        methods["zipnn"] = (
            lambda data: zn.compress(data.tobytes()),
            lambda blob, n: np.frombuffer(zn.decompress(blob), np.uint8),
        )
    return methods


def _size_of(packed: Any) -> int:
    return len(packed[0]) if isinstance(packed, tuple) else len(packed)


def bench_codecs(tensors: list[tuple[str, torch.Tensor]], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for kind, t in tensors:
        data = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        for method, (pack, unpack) in codec_methods(t.dtype).items():
            log(f"{kind}: {method}")
            c_s, packed, c_cpu = _time_cpu(functools.partial(pack, data), repeats)
            d_s, back, d_cpu = _time_cpu(functools.partial(unpack, packed, data.nbytes), repeats)
            if not np.array_equal(np.asarray(back).reshape(-1)[: data.nbytes], data):
                raise AssertionError(f"{method} did not give back the bytes of {kind}")
            rows.append(
                {
                    "tensor": kind,
                    "method": method,
                    "raw_bytes": data.nbytes,
                    "ratio": _size_of(packed) / data.nbytes,
                    "compress_gbps_per_core": data.nbytes / c_s / 1e9,
                    "decompress_gbps_per_core": data.nbytes / d_s / 1e9,
                    "compress_gb_per_cpu_s": data.nbytes / c_cpu / 1e9,
                    "decompress_gb_per_cpu_s": data.nbytes / d_cpu / 1e9,
                }
            )
    return rows


class RateLimited(io.BytesIO):
    """An in-memory file that accepts writes and serves reads at ``mbps`` MB/s at most."""

    def __init__(self, mbps: float, data: bytes = b""):
        super().__init__(data)
        self._rate = mbps * 1e6
        self._start = time.perf_counter()
        self._moved = 0

    def _hold(self, nbytes: int) -> None:
        self._moved += nbytes
        due = self._start + self._moved / self._rate
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)

    def write(self, data: Any) -> int:  # type: ignore[override]
        written = super().write(data)
        self._hold(written)
        return written

    def readinto(self, buffer: Any) -> int:  # type: ignore[override]
        got = super().readinto(buffer)
        self._hold(got)
        return got

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self._hold(len(data))
        return data


def training_state(nbytes: int) -> dict[str, torch.Tensor]:
    """bf16 weights and their fp32 Adam states, ``nbytes`` in all (weights a fifth of it)."""
    share = nbytes // 5
    state = {}
    for i in range(2):
        state[f"layers.{i}.weight"] = weights(share // 2, torch.bfloat16, 10 + i)
        state[f"layers.{i}.exp_avg"] = tensor_of("adam exp_avg", share)
        state[f"layers.{i}.exp_avg_sq"] = tensor_of("adam exp_avg_sq", share)
    return state


def _save_through(state: dict[str, torch.Tensor], mbps: float, compress: Any) -> RateLimited:
    out = RateLimited(mbps)
    stream_save.save_to_stream(state, out, compress=compress)
    return out


def bench_end_to_end(nbytes: int, mbps: float, repeats: int) -> list[dict[str, Any]]:
    state = training_state(nbytes)
    raw = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    for compress in (None, True):
        log(f"end to end: compress={compress}")
        save_s, sink, save_cpu = _time_cpu(
            functools.partial(_save_through, state, mbps, compress), repeats
        )
        stored = sink.getvalue()
        load_s, back, load_cpu = _time_cpu(
            lambda: checkpoint_load.load(RateLimited(mbps, stored)),  # noqa: B023
            repeats,
        )
        for name, t in state.items():
            if not torch.equal(back[name], t):
                raise AssertionError(f"{name} did not load back")
        rows.append(
            {
                "compress": str(compress),
                "raw_bytes": raw,
                "file_bytes": len(stored),
                "sink_mbps": mbps,
                "save_s": save_s,
                "load_s": load_s,
                "save_gbps": raw / save_s / 1e9,
                "load_gbps": raw / load_s / 1e9,
                "save_cpu_s": save_cpu,
                "load_cpu_s": load_cpu,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="64M", help="bytes per tensor of the codec part")
    parser.add_argument("--state-size", default="256M", help="bytes of the end-to-end state")
    parser.add_argument(
        "--sink-mbps", type=float, nargs="+", default=[200.0], help="sink and source rates"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", action="store_true", help="also a transformers model")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args(argv)
    size, state_size, repeats = parse_size(args.size), parse_size(args.state_size), args.repeats
    if args.smoke:
        size, state_size, repeats = 1 << 20, 4 << 20, 1
    tensors = [(kind, tensor_of(kind, size)) for kind in KINDS]
    if args.model:
        tensors += model_tensors(size)
    codecs = bench_codecs(tensors, repeats)
    print(f"## Codecs ({os.cpu_count()} cores here; one thread per method)\n")
    print(
        markdown_table(
            [
                "tensor",
                "method",
                "ratio",
                "compress GB/s/core",
                "decompress GB/s/core",
                "compress GB/CPU-s",
                "decompress GB/CPU-s",
            ],
            [
                [
                    r["tensor"],
                    r["method"],
                    f"{r['ratio']:.4f}",
                    f"{r['compress_gbps_per_core']:.2f}",
                    f"{r['decompress_gbps_per_core']:.2f}",
                    f"{r['compress_gb_per_cpu_s']:.2f}",
                    f"{r['decompress_gb_per_cpu_s']:.2f}",
                ]
                for r in codecs
            ],
        )
    )
    ends = []
    for mbps in args.sink_mbps:
        rows = bench_end_to_end(state_size, mbps, repeats)
        ends += rows
        print(f"\n## End to end through a {mbps:g} MB/s sink\n")
        print(
            markdown_table(
                [
                    "compress",
                    "file / raw",
                    "save s",
                    "load s",
                    "save GB/s",
                    "load GB/s",
                    "save CPU s",
                    "load CPU s",
                ],
                [
                    [
                        r["compress"],
                        f"{r['file_bytes'] / r['raw_bytes']:.3f}",
                        f"{r['save_s']:.2f}",
                        f"{r['load_s']:.2f}",
                        f"{r['save_gbps']:.3f}",
                        f"{r['load_gbps']:.3f}",
                        f"{r['save_cpu_s']:.2f}",
                        f"{r['load_cpu_s']:.2f}",
                    ]
                    for r in rows
                ],
            )
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"codecs": codecs, "end_to_end": ends}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
