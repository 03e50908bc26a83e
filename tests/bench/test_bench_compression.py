"""The compression benchmark runs end to end on tiny sizes (its --smoke flag)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("zstandard")


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_compression", ROOT / "benchmarks" / "bench_compression.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_prints_both_tables(capsys, tmp_path):
    bench = _bench()
    out = tmp_path / "figures.json"
    assert bench.main(["--smoke", "--sink-mbps", "2000", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## Codecs" in printed and "## End to end" in printed
    import json

    figures = json.loads(out.read_text())
    methods = {r["method"] for r in figures["codecs"]}
    assert {"fastckpt byteplane", "fastckpt zstd", "zstd-3"} <= methods
    packed = {r["compress"]: r["file_bytes"] for r in figures["end_to_end"]}
    assert packed["True"] < packed["None"]
