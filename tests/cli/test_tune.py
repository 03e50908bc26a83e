"""`fastckpt tune`, run as a user runs it: in a subprocess, on tiny sizes and sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastckpt.config import IO_KEYS, filesystem_key

# Non-default values everywhere, so that a handle showing them proves the tuning was used.
TINY_SWEEP = {
    "engine": ["threads"],
    "block_size": ["64K"],
    "queue_depth": [4, 8],
    "intra_op_parallelism": [3],
    "single_submit": [True],
    "overlap_events": [False],
}


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *map(str, args)],
        capture_output=True,
        check=False,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
    )


def printed_config(stdout: str) -> dict:
    """The JSON block tune prints: from a line '{' to the next line '}'."""
    lines = stdout.splitlines()
    start = lines.index("{")
    end = lines.index("}", start)
    return json.loads("\n".join(lines[start : end + 1]))


@pytest.fixture
def sweep_file(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(TINY_SWEEP))
    return path


def test_tune_saves_a_configuration_that_new_handles_use(tmp_path, sweep_file):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    logs = tmp_path / "logs"
    result = run_cli(
        "tune",
        "--nvme_dir",
        nvme,
        "--io_size",
        "1M",
        "--sweep_config",
        sweep_file,
        "--log_dir",
        logs,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Best performance (GB/sec): read =" in out and "write =" in out
    assert "Cold reads:" in out
    config = printed_config(out)
    assert list(config) == list(IO_KEYS)
    assert set(config) == {
        "block_size",
        "queue_depth",
        "single_submit",
        "overlap_events",
        "intra_op_parallelism",
        "engine",
    }
    assert config["block_size"] == 65536 and config["queue_depth"] in (4, 8)
    assert config["single_submit"] is True and config["overlap_events"] is False
    assert config["intra_op_parallelism"] == 3 and config["engine"] == "threads"

    # Saved where FASTCKPT_CONFIG says, keyed by the file system measured.
    saved_path = os.environ["FASTCKPT_CONFIG"]
    assert saved_path in out
    saved = json.loads(Path(saved_path).read_text())["filesystems"]
    assert saved[filesystem_key(nvme)]["config"] == config

    # Real checkpoint saves were timed in each write mode, and the winner recorded with the
    # settings its direct saves used.
    assert "saves until durable, GB/s (min-max): direct" in out
    write = saved[filesystem_key(nvme)]["write"]
    assert write["mode"] in ("direct", "buffered") and set(write["gbps"]) == {"direct", "buffered"}
    assert write["mode"] == max(write["gbps"], key=write["gbps"].get)
    assert write["settings"]["block_size"] == 65536

    # The test files are gone; the log has one JSON line per measurement.
    assert list(nvme.iterdir()) == []
    (log,) = logs.iterdir()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(1 for r in records if r["phase"] == "sweep") == 2
    assert all(len(r["read_gbps"]) >= 1 and len(r["write_gbps"]) >= 1 for r in records)

    # A new process: aio_handle() with no arguments picks the tuning up; explicit
    # arguments still win.
    probe = (
        "import json; from fastckpt.aio import aio_handle; h = aio_handle(); "
        "print(json.dumps([h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), "
        "h.get_overlap_events(), h.get_intra_op_parallelism(), h.get_engine(), "
        "aio_handle(queue_depth=16).get_queue_depth()]))"
    )
    probed = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        check=False,
        text=True,
        cwd=nvme,
        timeout=60,
    )
    assert probed.returncode == 0, probed.stderr
    assert json.loads(probed.stdout) == [config[k] for k in IO_KEYS] + [16]


# The cases below call the same main() as the console script, in-process: a subprocess
# per case would spend most of its time importing torch.


def run_main(capsys, *args) -> tuple[int, str, str]:
    from fastckpt.cli import main

    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_tune_reads_only_with_engine_flag(tmp_path, capsys, sweep_file):
    status, out, err = run_main(
        capsys,
        "tune",
        "--nvme_dir",
        tmp_path,
        "--io_size",
        "256K",
        "--sweep_config",
        sweep_file,
        "--no_write",
        "--engine",
        "threads",
        "--verbose",
        "--loops",
        "2",
    )
    assert status == 0, err
    assert "read =" in out and "write =" not in out
    assert "qd=4" in out and "qd=8" in out  # --verbose lines
    assert printed_config(out)["engine"] == "threads"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fastckpt-tune")]


def test_tune_plot(tmp_path, capsys, sweep_file):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    status, _, err = run_main(
        capsys,
        "tune",
        "--nvme_dir",
        tmp_path,
        "--io_size",
        "256K",
        "--sweep_config",
        sweep_file,
        "--plot",
        png,
    )
    assert status == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_plot_without_matplotlib(tmp_path, capsys, monkeypatch, sweep_file):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    status, _, err = run_main(
        capsys,
        "tune",
        "--nvme_dir",
        tmp_path,
        "--io_size",
        "256K",
        "--sweep_config",
        sweep_file,
        "--plot",
        tmp_path / "x.png",
    )
    assert status == 2
    assert "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--nvme_dir", "{tmp}", "--no_read", "--no_write"],
        ["--nvme_dir", "{tmp}/unknown_key.json/missing"],  # cannot be created
        ["--nvme_dir", "{tmp}", "--engine", "warp_drive"],
        ["--nvme_dir", "{tmp}", "--engine", "threads,warp_drive"],
        ["--nvme_dir", "{tmp}", "--io_size", "lots"],
        ["--nvme_dir", "{tmp}", "--loops", "0"],
        ["--nvme_dir", "{tmp}", "--sweep_config", "{tmp}/unknown_key.json"],
        ["--nvme_dir", "{tmp}", "--sweep_config", "{tmp}/bad_value.json"],
        ["--nvme_dir", "{tmp}", "--sweep_config", "{tmp}/missing.json"],
    ],
)
def test_tune_usage_errors(tmp_path, capsys, args):
    from fastckpt.cli import main

    (tmp_path / "unknown_key.json").write_text(json.dumps({"num_threads": [1, 2]}))
    (tmp_path / "bad_value.json").write_text(json.dumps({"queue_depth": [0]}))
    assert main(["tune", *[a.format(tmp=tmp_path) for a in args]]) == 2
    assert "error" in capsys.readouterr().err
    assert not os.path.exists(os.environ["FASTCKPT_CONFIG"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fastckpt")]


def test_tune_gpu_without_cuda(tmp_path, capsys):
    import torch

    from fastckpt.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for flag in ("--gpu", "--gds"):
        assert main(["tune", "--nvme_dir", str(tmp_path), flag]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_sweep_measures_then_confirms_and_stops_at_its_deadline(tmp_path):
    """The sweep, without the command: every configuration once, then the best again; past
    the deadline only the first configuration is measured (one is always needed)."""
    import time

    from fastckpt.bench.caches import PageCache
    from fastckpt.cli.tune.sweep import SweepFiles, configurations, default_sweep, run_sweep

    sweep = default_sweep(["threads"])
    sweep.update(block_size=[1 << 16], queue_depth=[4, 8], overlap_events=[True])
    sweep.update(intra_op_parallelism=[1])
    configs = configurations(sweep)
    seen: list[tuple[str, int]] = []

    class Observer:
        def measured(self, result, phase):
            seen.append((phase, result.config["queue_depth"]))

        def budget_spent(self, measured, total):
            seen.append(("budget", measured))

    files = SweepFiles([str(tmp_path)], 1 << 18, gpu=False, gds=False, cache=PageCache())
    try:
        files.prepare_reads()
        results = run_sweep(files, configs, runs=1, read=True, write=True, observer=Observer())
        assert [p for p, _ in seen] == ["sweep", "sweep", "confirm", "confirm"]
        assert all(len(r.read) == 3 and len(r.write) == 3 for r in results)  # 1 + 2 again
        seen.clear()
        late = run_sweep(
            files,
            configs,
            runs=1,
            read=False,
            write=True,
            deadline=time.perf_counter() - 1,
            observer=Observer(),
        )
        assert len(late) == 1 and seen == [("sweep", 4), ("budget", 1)]
        assert late[0].read == [] and len(late[0].write) == 1
    finally:
        files.close()
    assert list(tmp_path.iterdir()) == []


def test_tuned_file_keeps_the_format_config_reads(tmp_path):
    from fastckpt.cli.tune.sweep import Result
    from fastckpt.cli.tune.tuned_file import Coverage, save_gds_winner, save_winner
    from fastckpt.config import load_tuned, resolve_io

    config = {
        "block_size": 1 << 16,
        "queue_depth": 12,
        "single_submit": False,
        "overlap_events": True,
        "intra_op_parallelism": 3,
        "engine": "threads",
    }
    winner = Result(config, read=[2.0, 3.0], write=[1.5])
    (outcome,) = save_winner(
        winner,
        [str(tmp_path), str(tmp_path / "missing")],
        Coverage(2, 3, 1 << 20),
        loops=1,
        gpu=True,
        cache_dropped=False,
        read=True,
        write=True,
    )
    key = outcome.key
    assert key == filesystem_key(tmp_path) and str(outcome.path) == os.environ["FASTCKPT_CONFIG"]
    assert outcome.saved and not outcome.existed
    entry = load_tuned()[key]
    assert entry["config"] == config and set(entry) == {"config", "measured", "time"}
    # How much was measured rides inside "measured", which config's readers pass over.
    assert entry["measured"] == {
        "io_size": 1 << 20,
        "loops": 1,
        "gpu": True,
        "dirs": [str(tmp_path), str(tmp_path / "missing")],
        "cold_reads": "fadvise",
        "configurations_measured": 2,
        "configurations_total": 3,
        "read_gbps": 2.5,
        "write_gbps": 1.5,
    }
    assert resolve_io(tmp_path, {}).queue_depth == 12
    save_gds_winner(
        Result({"intra_op_parallelism": 4}, read=[9.0]),
        [str(tmp_path)],
        Coverage(1, 4, 1 << 20),
        read=True,
        write=False,
    )
    entry = load_tuned()[key]
    assert entry["config"] == config
    assert {k: v for k, v in entry["gds"].items() if k != "time"} == {
        "intra_op_parallelism": 4,
        "configurations_measured": 1,
        "configurations_total": 4,
        "io_size": 1 << 20,
        "read_gbps": 9.0,
    }


def test_an_entry_that_does_not_say_how_much_it_measured_gives_way_only_to_a_full_sweep(
    tmp_path,
):
    """Entries written before the counts were recorded hold a full sweep as far as anyone
    knows: a partial run keeps them, a complete one replaces them."""
    from fastckpt.cli.tune.sweep import Result
    from fastckpt.cli.tune.tuned_file import Coverage, save_winner
    from fastckpt.config import load_tuned, save_tuned

    key = filesystem_key(tmp_path)
    save_tuned(key, {"queue_depth": 64}, {"io_size": 1 << 30, "read_gbps": 3.0})
    winner = Result({"queue_depth": 8}, read=[1.0], write=[1.0])

    def save(coverage):
        kwargs = dict(loops=1, gpu=False, cache_dropped=False, read=True, write=True)
        (outcome,) = save_winner(winner, [str(tmp_path)], coverage, **kwargs)
        return outcome

    kept = save(Coverage(2, 108, 1 << 20))
    assert not kept.saved and kept.existed and kept.previous is None
    assert load_tuned()[key]["config"] == {"queue_depth": 64}
    assert save(Coverage(4, 4, 1 << 20)).saved
    assert load_tuned()[key]["config"] == {"queue_depth": 8}


# ---------------------------------------------------------------- what a first hour runs into


def saved_entries() -> dict:
    return json.loads(Path(os.environ["FASTCKPT_CONFIG"]).read_text())["filesystems"]


def test_a_partial_tune_keeps_a_more_complete_entry_unless_forced(tmp_path, capsys, sweep_file):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    key, path = filesystem_key(nvme), os.environ["FASTCKPT_CONFIG"]
    common = ["tune", "--nvme_dir", nvme, "--io_size", "256K", "--no-drop-caches"]
    status, out, err = run_main(capsys, *common, "--sweep_config", sweep_file)
    assert status == 0, err
    assert f"saved for file system {key} in {path}: 2 of 2 configurations measured" in out
    assert f"To undo: fastckpt tune --reset --nvme_dir {nvme}" in out
    complete = saved_entries()[key]

    # A budget that ends the sweep after its first configuration: 1 of 4 measured.
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps(dict(TINY_SWEEP, intra_op_parallelism=[1, 3])))
    partial = [*common, "--sweep_config", wider, "--budget", "0.001"]
    status, out, err = run_main(capsys, *partial)
    assert status == 0, err
    assert f"NOT saved for file system {key}" in out
    assert "2 of 2 configurations measured" in out and "1 of 4 configurations measured" in out
    assert "--force" in out and "To undo" not in out
    assert saved_entries()[key] == complete

    status, out, err = run_main(capsys, *partial, "--force")
    assert status == 0, err
    assert "replacing the previous entry" in out and "the sweep ended early" in out
    measured = saved_entries()[key]["measured"]
    assert (measured["configurations_measured"], measured["configurations_total"]) == (1, 4)

    # The undo the output names.
    status, out, err = run_main(capsys, "tune", "--reset", "--nvme_dir", nvme)
    assert status == 0, err
    assert f"Forgot the tuned entry of file system {key} in {path}" in out
    assert key not in saved_entries()
    status, out, _ = run_main(capsys, "tune", "--reset", "--nvme_dir", nvme)
    assert status == 0 and "nothing to forget" in out


def test_tune_creates_only_the_last_component_of_its_directories(tmp_path, capsys, sweep_file):
    typo = tmp_path / "typo"
    base = ["tune", "--io_size", "256K", "--sweep_config", sweep_file, "--no_read"]
    status, _, err = run_main(capsys, *base, "--nvme_dir", typo / "nvme")
    assert status == 2
    assert f"the parent directory {typo} does not exist" in err
    status, _, err = run_main(capsys, *base, "--nvme_dir", tmp_path, "--log_dir", typo / "logs")
    assert status == 2 and f"--log_dir {typo / 'logs'}: the parent directory {typo}" in err
    assert not typo.exists()

    status, out, err = run_main(capsys, *base, "--nvme_dir", tmp_path / "nvme")
    assert status == 0, err
    assert f"Created --nvme_dir {tmp_path / 'nvme'}" in out
    assert not (tmp_path / "nvme").exists()  # created, then removed: the sweep left it empty


def test_tune_drops_the_page_cache_only_for_reads_and_when_allowed(
    tmp_path, capsys, monkeypatch, sweep_file
):
    from fastckpt.bench.caches import PageCache

    # A stand-in for /proc/sys/vm/drop_caches: a real file, so the test empties no cache.
    knob = tmp_path / "drop_caches"
    knob.write_text("")
    monkeypatch.setattr(PageCache, "PATH", str(knob))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = ["tune", "--nvme_dir", nvme, "--io_size", "256K", "--sweep_config", sweep_file]

    for default in ([], ["--no-drop-caches"]):  # only the files read are evicted
        status, out, err = run_main(capsys, *args, "--no_write", *default)
        assert status == 0, err
        assert knob.read_text() == ""
        assert "Cold reads: the files read are evicted from the page cache" in out
        assert "the rest of the machine's cache is left alone" in out
    status, out, err = run_main(capsys, *args, "--no_read", "--drop-all-caches")
    assert status == 0, err
    assert knob.read_text() == ""  # writes need no cold cache
    status, out, err = run_main(capsys, *args, "--no_write", "--drop_all_caches")
    assert status == 0, err
    assert knob.read_text() == "3\n" and "Cold reads: the whole page cache dropped" in out

    status, _, err = run_main(capsys, *args, "--no-drop-caches", "--flush_page_cache")
    assert status == 2 and "--no-drop-caches" in err


def test_tune_runs_a_deepspeed_sweep_file_with_hyphenated_options(tmp_path, capsys):
    # The keys of a ds_nvme_tune sweep file, with DeepSpeed's own names and values.
    deepspeed_sweep = {
        "block_size": ["64K"],
        "queue_depth": [4],
        "sequential_requests": [True],
        "single_submit": [False],
        "io_parallel": [2],
        "handle": [True],
    }
    sweep = tmp_path / "ds_sweep.json"
    sweep.write_text(json.dumps(deepspeed_sweep))
    status, out, err = run_main(
        capsys,
        "tune",
        "--nvme-dir",
        tmp_path,
        "--io-size",
        "256K",
        "--sweep-config",
        sweep,
        "--no-read",
        "--engine",
        "threads",
        "--no-drop-caches",
    )
    assert status == 0, err
    assert "Note: --sweep_config key 'handle' is not swept" in out
    config = printed_config(out)
    assert config["overlap_events"] is False  # sequential requests: no overlap
    assert config["intra_op_parallelism"] == 2 and config["block_size"] == 65536

    # Unknown keys are still refused, by name; so is one knob under two names.
    for document, named in [
        ({"num_threads": [1]}, "'num_threads'"),
        ({"sequential_requests": [True], "overlap_events": [True]}, "'sequential_requests'"),
        ({"io_parallel": [1], "intra_op_parallelism": [2]}, "'io_parallel'"),
    ]:
        sweep.write_text(json.dumps(document))
        status, _, err = run_main(capsys, "tune", "--nvme_dir", tmp_path, "--sweep_config", sweep)
        assert status == 2 and named in err


def test_every_multi_word_tune_option_has_both_spellings():
    from fastckpt.cli import build_parser

    parser = build_parser().commands["tune"]
    names = {name for action in parser._actions for name in action.option_strings}
    multi_word = {name for name in names if "_" in name or "-" in name[2:]}
    assert "--io_size" in multi_word and "--no-drop-caches" in multi_word
    for name in multi_word:
        body = name[2:]
        assert {"--" + body.replace("-", "_"), "--" + body.replace("_", "-")} <= names, name
