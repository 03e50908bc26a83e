"""Loads beside a busy machine: the run queue is read from /proc/loadavg, the rule that calls
the cores busy, and the read mode a cold local file gets on a busy machine (untuned, tuned
quietly, tuned beside training), with the busy signal passed in, never mocked."""

from __future__ import annotations

import torch
from _page_cache import drop_from_page_cache

import fastckpt
from fastckpt.config import filesystem_key, save_tuned_read_mode
from fastckpt.io.cpu_load import CpuLoad, contended_mode, cpu_load, is_busy, machine_busy
from fastckpt.storage.local import LocalStorage


def test_the_run_queue_is_read_from_a_loadavg_file(tmp_path):
    sample = tmp_path / "loadavg"
    sample.write_text("6.02 3.10 1.50 7/412 12345\n")
    assert cpu_load(str(sample)) == CpuLoad(runnable=7, load_1min=6.02)
    sample.write_text("garbage\n")
    assert cpu_load(str(sample)) is None
    assert cpu_load(str(tmp_path / "absent")) is None
    assert machine_busy() in (True, False)  # this machine's, whatever it is now


def test_busy_means_other_runnable_threads_fill_the_cores_now_and_on_average():
    # runnable counts the caller itself: 3 runnable on 2 cores is 2 others
    assert is_busy(CpuLoad(runnable=3, load_1min=2.0), cores=2)
    assert not is_busy(CpuLoad(runnable=2, load_1min=6.0), cores=2)  # one other thread now
    assert not is_busy(CpuLoad(runnable=9, load_1min=1.2), cores=2)  # a passing burst
    assert is_busy(CpuLoad(runnable=17, load_1min=16.5), cores=16)
    assert not is_busy(CpuLoad(runnable=9, load_1min=16.5), cores=16)
    assert not is_busy(None, cores=2)


def test_only_the_staged_copy_gives_way_on_a_busy_machine():
    for mode in ("direct", "buffered", "mapped"):
        assert contended_mode(mode, busy=True)[0] == mode
        assert contended_mode(mode, busy=False)[0] == mode
    assert contended_mode("staged", busy=False)[0] == "staged"
    mode, why = contended_mode("staged", busy=True)
    assert mode == "direct" and "busy" in why


def _cold_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    fastckpt.save(state, path)
    drop_from_page_cache(path)
    return path, state


def test_an_untuned_cold_load_reads_direct_when_busy_and_staged_when_not(tmp_path):
    path, state = _cold_file(tmp_path)
    with LocalStorage(path) as storage:
        if storage.file.direct_fd < 0:  # a file system without O_DIRECT reads buffered
            return
        quiet, _ = storage._wanted_mode(busy=False)
        busy, why = storage._wanted_mode(busy=True)
    assert (quiet, busy) == ("staged", "direct")
    assert "no read mode tuned here" in why and "busy" in why
    assert torch.equal(fastckpt.load(path)["w"], state["w"])


def test_a_busy_load_takes_the_contended_winner_tune_recorded(tmp_path):
    path, _ = _cold_file(tmp_path)
    key = filesystem_key(tmp_path)
    save_tuned_read_mode(key, "staged", {"staged": 2.0, "direct": 1.6})
    with LocalStorage(path) as storage:
        # tuned on a quiet machine only: the staged winner gives way when busy
        assert storage._wanted_mode(busy=False)[0] == "staged"
        assert storage._wanted_mode(busy=True)[0] == "direct"
        save_tuned_read_mode(
            key, "mapped", {"staged": 0.5, "direct": 0.7, "mapped": 0.9}, contended=True
        )
        mode, why = storage._wanted_mode(busy=True)
        assert mode == "mapped" and "beside a busy machine" in why
        assert storage._wanted_mode(busy=False)[0] == "staged"  # the quiet winner stays
