"""`fastckpt bench` on tiny sizes, run as a user runs it (in a subprocess) and in-process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.python_processes import run


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    return run([sys.executable, "-m", "fastckpt", *map(str, args)], env=env, timeout=120)


def loop_rates(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^Loop \d+: \w+ ([0-9.e+-]+) GB/s", stdout, re.MULTILINE)]


def test_bench_write_and_read_with_validation(tmp_path):
    write = run_cli(
        "bench",
        "--folder",
        tmp_path,
        "--io_size",
        "1M",
        "--loops",
        "2",
        "--validate",
        "--engine",
        "threads",
        "--block_size",
        "64K",
        "--queue_depth",
        "4",
        "--io_parallel",
        "3",
        "--single_submit",
        "--overlap_events",
        "false",
    )
    assert write.returncode == 0, write.stderr
    assert len(loop_rates(write.stdout)) == 2 and all(r > 0 for r in loop_rates(write.stdout))
    assert "Median write:" in write.stdout and "Validation passed" in write.stdout
    # The configuration measured is the one asked for.
    assert (
        '"block_size": 65536, "queue_depth": 4, "single_submit": true, "overlap_events": false, '
        '"intra_op_parallelism": 3, "engine": "threads"'
    ) in write.stdout

    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_bench_read_with_validation(tmp_path, capsys):
    # In-process, through the same main() as the console script (a subprocess would spend
    # most of its time importing torch).
    from fastckpt.cli import main

    args = ["--folder", tmp_path, "--io_size", "1M", "--loops", "2", "--read", "--validate"]
    status = main(["bench", *map(str, args), "--intra_op_parallelism", "2"])
    out = capsys.readouterr().out
    assert status == 0
    assert "Median read:" in out and "Cold reads:" in out and "Validation passed" in out
    assert '"intra_op_parallelism": 2' in out
    assert len(loop_rates(out)) == 2
    assert list(tmp_path.iterdir()) == []


def test_bench_checkpoint_table(tmp_path):
    result = run_cli(  # the ceiling row and the verdict come from this same run
        "bench", "--folder", tmp_path, "--checkpoint", "512K", "--loops", "1", "--validate"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("fastckpt", "torch.save/load", "safetensors")
    }
    assert set(rows) == {"fastckpt", "torch.save/load", "safetensors"}
    for cells in rows.values():
        # save and load GB/s, each with the min-max of the loops beside it
        assert float(cells[1]) > 0 and float(cells[3]) > 0
        assert all(float(x) > 0 for x in cells[2].split("-") + cells[4].split("-"))
    assert rows["fastckpt"][-3:] == ["1.00x", "/", "1.00x"]
    # the device's ceiling ran in the same loops, and the verdict reads the figures against it
    ceiling = table_rows(out).get("device(O_DIRECT)")
    if ceiling is not None:  # (a file system refusing O_DIRECT has none)
        assert float(ceiling[1]) > 0 and float(ceiling[3]) > 0
        assert "the device" in out.split("Verdict: ")[1]
    assert out.count("Verdict: ") == 1
    assert "Validation passed" in out
    assert list(tmp_path.iterdir()) == []


def test_bench_usage_errors(tmp_path, capsys):
    import torch

    from fastckpt.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    work = tmp_path / "work"
    work.mkdir()
    cases = [
        ["--folder", str(blocker)],
        ["--folder", str(work), "--loops", "0"],
        ["--folder", str(work), "--engine", "warp_drive"],
        ["--folder", str(work), "--io_size", "-1M"],
        ["--folder", str(work), "--overlap_events", "maybe"],
        ["--folder", str(work), "--checkpoint", "1M", "--read"],
        ["--folder", str(work), "--checkpoint", "10"],
    ]
    if not torch.cuda.is_available():
        cases += [["--folder", str(work), "--gpu"], ["--folder", str(work), "--gds"]]
    for args in cases:
        assert main(["bench", *args]) == 2, args
        assert "error" in capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_bench_creates_only_the_last_component_of_folder(tmp_path, capsys):
    from fastckpt.cli import main

    folder = tmp_path / "demo"
    assert main(["bench", "--folder", str(folder), "--io_size", "1M", "--loops", "1"]) == 0
    assert not folder.exists()  # created, then removed: the run left it empty
    out = capsys.readouterr().out
    assert f"Created --folder {folder}" in out and "GB/s" in out

    # A typo in a parent fails, naming it, instead of growing a tree.
    typo = tmp_path / "tpyo"
    for extra in ([], ["--checkpoint", "512K"]):
        args = ["bench", "--folder", str(typo / "demo"), "--io_size", "1M", *extra]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"--folder {typo / 'demo'}: the parent directory {typo} does not exist" in err
    assert not typo.exists()


def test_bench_drops_the_page_cache_only_for_cold_reads_and_when_allowed(
    tmp_path, capsys, monkeypatch
):
    from fastckpt.bench.caches import PageCache
    from fastckpt.cli import main

    # A stand-in for /proc/sys/vm/drop_caches: a real file, so the test empties no cache.
    knob = tmp_path / "drop_caches"
    knob.write_text("")
    monkeypatch.setattr(PageCache, "PATH", str(knob))
    work = tmp_path / "work"
    work.mkdir()
    raw = ["bench", "--folder", str(work), "--io_size", "256K", "--loops", "1"]

    # By default (and with --no-drop-caches, the default spelled out) only the files read
    # are evicted: the machine's other cached files are not this run's to drop.
    for default in ([], ["--no-drop-caches"]):
        assert main([*raw, "--read", *default]) == 0
        out = capsys.readouterr().out
        assert knob.read_text() == ""
        assert "Cold reads: the files read are evicted from the page cache" in out
        assert "the rest of the machine's cache is left alone" in out
    assert main([*raw, "--checkpoint", "512K", "--no_drop_caches"]) == 0
    assert knob.read_text() == "" and "the files read are evicted" in capsys.readouterr().out
    assert main([*raw, "--drop-all-caches"]) == 0  # writes need no cold cache
    assert knob.read_text() == ""
    assert main([*raw, "--read", "--drop-all-caches"]) == 0
    assert knob.read_text() == "3\n"
    assert "Cold reads: the whole page cache dropped before every read" in capsys.readouterr().out
    assert main([*raw, "--read", "--drop-all-caches", "--no-drop-caches"]) == 2
    assert "ask for opposite things" in capsys.readouterr().err
    assert list(work.iterdir()) == []


def test_bench_accepts_hyphenated_options(tmp_path, capsys):
    from fastckpt.cli import build_parser, main

    parser = build_parser().commands["bench"]
    names = {name for action in parser._actions for name in action.option_strings}
    multi_word = {name for name in names if "_" in name or "-" in name[2:]}
    assert "--io_parallel" in multi_word and "--no-drop-caches" in multi_word
    for name in multi_word:
        body = name[2:]
        assert {"--" + body.replace("-", "_"), "--" + body.replace("_", "-")} <= names, name

    args = ["--folder", tmp_path, "--io-size", "256K", "--loops", "1", "--block-size", "64K"]
    args += ["--queue-depth", "4", "--io-parallel", "2", "--single-submit", "--overlap-events"]
    args += ["false", "--engine", "threads"]
    assert main(["bench", *map(str, args)]) == 0
    assert (
        '"block_size": 65536, "queue_depth": 4, "single_submit": true, "overlap_events": false, '
        '"intra_op_parallelism": 2, "engine": "threads"'
    ) in capsys.readouterr().out


def test_synthetic_state_dict_is_llm_like():
    import torch

    from fastckpt.bench.synthetic import (
        MIN_NBYTES,
        llm_like_state_dict,
        plan_shapes,
        state_dict_nbytes,
    )

    for nbytes in (MIN_NBYTES, 100_000, 3 << 20):
        sd = llm_like_state_dict(nbytes)
        d = sd["model.norm.weight"].shape[0]
        assert 0 <= nbytes - state_dict_nbytes(sd) < 8 * d
        assert {t.dtype for t in sd.values()} == {torch.float32, torch.bfloat16}
        assert any(t.dim() == 1 for t in sd.values()) and any(t.dim() == 2 for t in sd.values())
    plan = plan_shapes(16 << 30)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == ("bfloat16", (4096, 4096))
    assert plan["model.layers.0.mlp.up_proj.weight"] == ("bfloat16", (11008, 4096))
    with pytest.raises(ValueError):
        plan_shapes(MIN_NBYTES - 1)


def table_rows(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines() if line.split()}


def test_bench_checkpoint_memory_regime_adds_the_peers(tmp_path):
    result = run_cli(
        "bench",
        "--folder",
        tmp_path,
        "--checkpoint",
        "512K",
        "--loops",
        "1",
        "--regime",
        "memory",
        "--validate",
    )
    assert result.returncode == 0, result.stderr
    assert "memory regime: every load reads its file from the page cache" in result.stdout
    rows = table_rows(result.stdout)
    expected = {"fastckpt", "torch.save/load", "safetensors", "preadv-ceiling"}
    for module, row in (
        ("runai_model_streamer", "runai-streamer"),
        ("fastsafetensors", "fastsafetensors"),
    ):
        try:
            __import__(module)
        except ImportError:
            assert f"{row}: left out" in result.stderr
        else:
            expected.add(row)
    assert expected <= set(rows)
    assert rows["preadv-ceiling"][1] == "—" and float(rows["preadv-ceiling"][3]) > 0  # load only
    # fastckpt's own mapping beside safetensors', and the table says what the latter is
    assert float(rows["fastckpt(mmap=True)"][3]) > 0
    assert "safetensors' load is a lazy mapping of the file" in result.stdout
    assert "mappings: fastckpt(mmap=True)" in result.stdout.split("Verdict: ")[1]
    assert "Validation passed" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_bench_regime_needs_checkpoint(capsys):
    from fastckpt.cli import main

    assert main(["bench", "--regime", "memory"]) == 2
    assert "--regime applies to --checkpoint" in capsys.readouterr().err


def test_preadv_file_reads_every_byte(tmp_path):
    from fastckpt.bench.ceilings import preadv_file

    data = os.urandom(3 * 65536 + 123)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    for threads, prefault in ((1, False), (3, True)):
        buffer, seconds = preadv_file(path, threads, chunk=65536, prefault=prefault)
        assert bytes(buffer[: len(data)]) == data and seconds > 0
    buffer, _ = preadv_file(path, 2, start=100, chunk=4000)
    assert bytes(buffer[: len(data) - 100]) == data[100:]


def test_thread_sampler_sees_a_busy_thread():
    import hashlib
    import threading
    import time

    from fastckpt.bench.measure import ThreadSampler

    stop = threading.Event()

    def spin() -> None:
        block = bytes(1 << 20)
        while not stop.is_set():
            hashlib.sha256(block).digest()  # releases the GIL while it hashes

    worker = threading.Thread(target=spin)
    with ThreadSampler(interval=0.001) as sampler:
        worker.start()
        time.sleep(0.3)
        stop.set()
        worker.join()
    assert sampler.samples > 10 and sampler.busy_max >= 1 and sampler.streams > 0


def test_tensor_checks_tell_wrong_bytes():
    import torch

    from fastckpt.bench.checks import crc_digest, tensor_crc32s

    state = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    good = tensor_crc32s(state)
    state["a"][7] = 0.5
    bad = tensor_crc32s(state)
    assert good["b"] == bad["b"] and good["a"] != bad["a"]
    assert crc_digest(good) != crc_digest(bad)


@pytest.mark.slow
def test_memory_benchmark_smoke(tmp_path):
    """benchmarks/bench_memory.py at a tiny size: it runs, checks the bytes and cleans up."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_memory.py")
    out = tmp_path / "raw.json"
    before = {p for p in os.listdir(shm) if p.startswith("fastckpt-bench-tmpfs-")}
    result = subprocess.run(
        [
            sys.executable,
            script,
            "--size",
            "4M",
            "--repeats",
            "1",
            "--regime",
            "tmpfs",
            "--shm",
            shm,
            "--loads",
            "fastckpt,preadv",
            "--saves",
            "fastckpt",
            "--no-streams",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split(" | ")[0].lstrip("| "): line for line in result.stdout.splitlines()}
    assert lines["fastckpt.load"].endswith("| yes |") and lines["parallel preadv ceiling"].endswith(
        "| yes |"
    )
    assert "fastckpt.save" in lines and "### Targets" in result.stdout
    runs = json.loads(out.read_text())["runs"]
    assert {(r["op"], r["method"]) for r in runs} == {
        ("load", "fastckpt"),
        ("load", "preadv"),
        ("save", "fastckpt"),
    }
    assert {p for p in os.listdir(shm) if p.startswith("fastckpt-bench-tmpfs-")} <= before


def test_cold_reads_evict_the_files_read_and_leave_other_files_cached(tmp_path):
    """The default eviction, checked with the kernel's own count of resident pages
    (cachestat/mincore, as fincore reports): the file about to be read leaves the page
    cache, another file stays in it."""
    from fastckpt.bench.caches import PageCache, warm_page_cache
    from fastckpt.bench.filesystems import on_memory_filesystem
    from fastckpt.io.page_cache import resident_fraction

    if on_memory_filesystem(str(tmp_path)):
        pytest.skip("a memory file system keeps its files in memory")
    read, other = tmp_path / "read.bin", tmp_path / "other.bin"
    for path in (read, other):
        path.write_bytes(os.urandom(4 << 20))  # dirty pages: the eviction writes them back

    def resident(path) -> float | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return resident_fraction(fd, 0, os.path.getsize(path))
        finally:
            os.close(fd)

    warm_page_cache([read, other])
    if resident(read) is None:
        pytest.skip("the kernel does not say which pages are resident here")
    cache = PageCache()
    assert not cache.can_drop and not cache.asked  # nothing machine-wide by default
    cache.drop([read])
    assert resident(read) < 0.05
    assert resident(other) > 0.95
