"""The staging pool: buffers handed out as soon as each exists, pool buffers allocated on a
thread of the pool's own (stand-ins meanwhile), small saves that never allocate the pool,
the budget kept whatever a caller gets, and fork() during a background allocation."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.io import staging_pool
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT
from fastckpt.io.staging_pool import (
    ONE_OFF,
    POOLED,
    STAND_IN,
    StagingPool,
    default_pool,
    warm_up,
)

MIB = 1 << 20
_budgets = itertools.count(1)


@pytest.fixture(autouse=True)
def slow_memory(monkeypatch):
    """Every pool buffer counts as slow to allocate (as where huge pages need compaction),
    so that callers of a background pool take stand-ins after the first."""
    monkeypatch.setattr(staging_pool, "SLOW_FIRST_TOUCH", float("inf"))


def _fresh_budget(base: int = 64 * MIB) -> int:
    """A budget no other test used: its default pool is new, nothing allocated."""
    return base + next(_budgets) * BUFFER_ALIGNMENT


def _slots(counters: dict[str, int]) -> int:
    return (
        counters["pooled"] + counters["stand_ins"] + counters["one_offs"] + counters["allocating"]
    )


def _save_and_check(state: dict[str, torch.Tensor], path, budget: int) -> None:
    fastckpt.save(state, path, direct_io=True, staging_bytes=budget)
    loaded = fastckpt.load(path, verify=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_first_save_with_the_pool_not_yet_allocated_round_trips(tmp_path):
    budget = _fresh_budget(96 * MIB)
    pool = default_pool(budget)
    assert pool.counters()["pooled"] == 0 and pool.background
    state = {"a": torch.randn(10 * MIB // 4), "b": torch.randn(30 * MIB // 4 + 3)}
    _save_and_check(state, tmp_path / "first.safetensors", budget)
    assert pool.wait_warm(timeout=60)
    after_first = pool.counters()
    # the stand-ins it took went back (freed); pool buffers took their place, made by the
    # pool's thread, as many as the save held at once
    assert after_first["stand_ins"] == 0 and after_first["in_use"] == 0
    assert 1 <= after_first["pooled"] <= pool.capacity
    assert after_first["stand_ins_made"] >= 1 and after_first["made_in_background"] >= 1
    state["b"].mul_(2)
    _save_and_check(state, tmp_path / "second.safetensors", budget)
    assert pool.wait_warm(timeout=60)
    assert pool.counters()["stand_ins"] == 0 and pool.counters()["in_use"] == 0


def test_where_pool_buffers_are_quick_to_allocate_saves_allocate_them(tmp_path, monkeypatch):
    monkeypatch.setattr(staging_pool, "SLOW_FIRST_TOUCH", 1e-3)
    budget = _fresh_budget(96 * MIB)
    pool = default_pool(budget)
    _save_and_check({"w": torch.randn(70 * MIB // 4)}, tmp_path / "q.safetensors", budget)
    counters = pool.counters()
    assert counters["stand_ins_made"] == 0 and counters["pooled"] >= 2
    assert counters["made_in_background"] == 0 and pool.wait_warm(timeout=0)


def test_saves_in_a_row_reuse_the_stand_ins_until_the_pool_settles(tmp_path):
    budget = _fresh_budget(96 * MIB)
    pool = default_pool(budget)
    state = {"w": torch.randn(70 * MIB // 4)}
    _save_and_check(state, tmp_path / "a.safetensors", budget)
    made = pool.counters()["stand_ins_made"]
    assert made >= 1
    _save_and_check(state, tmp_path / "b.safetensors", budget)  # within the settling time
    counters = pool.counters()
    assert counters["stand_ins_made"] + counters["made_in_background"] <= pool.capacity
    assert pool.wait_warm(timeout=60)
    counters = pool.counters()
    assert counters["stand_ins"] == 0 and counters["pooled"] >= 1


@pytest.mark.parametrize("nbytes", [4, 4092, 4100, 3 * MIB + 12])
def test_a_small_first_save_does_not_allocate_the_pool(tmp_path, nbytes):
    budget = _fresh_budget()
    pool = default_pool(budget)
    state = {"w": torch.randn(nbytes // 4)}
    _save_and_check(state, tmp_path / "small.safetensors", budget)
    counters = pool.counters()
    assert counters["pooled"] == 0 and counters["made_in_background"] == 0
    assert counters["one_offs_made"] == 1 and counters["in_use"] == 0
    assert pool.wait_warm(timeout=0)  # no allocation was started
    # the next small save reuses it
    _save_and_check(state, tmp_path / "again.safetensors", budget)
    counters = pool.counters()
    assert counters["one_offs_made"] == 1 and counters["one_offs"] == 1
    assert counters["pooled"] == 0 and counters["stand_ins"] == 0


def test_a_small_save_takes_a_pool_buffer_when_one_is_free(tmp_path):
    budget = _fresh_budget()
    pool = warm_up(budget)
    assert pool.wait_warm(timeout=60)
    assert pool.counters()["pooled"] == pool.capacity
    _save_and_check({"w": torch.randn(1000)}, tmp_path / "s.safetensors", budget)
    assert pool.counters()["one_offs_made"] == 0


def test_concurrent_first_saves_from_two_threads_keep_the_budget(tmp_path):
    budget = _fresh_budget(48 * MIB)
    pool = default_pool(budget)
    states = [{"w": torch.randn(40 * MIB // 4), "b": torch.randn(5)} for _ in range(2)]
    start = threading.Barrier(3)
    errors: list[BaseException] = []
    most = [0]
    done = threading.Event()

    def saving(i: int) -> None:
        try:
            start.wait()
            _save_and_check(states[i], tmp_path / f"t{i}.safetensors", budget)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def watching() -> None:
        start.wait()
        while not done.is_set():
            most[0] = max(most[0], _slots(pool.counters()))
            time.sleep(0.001)

    threads = [threading.Thread(target=saving, args=(i,)) for i in range(2)]
    watcher = threading.Thread(target=watching)
    for t in [*threads, watcher]:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    watcher.join()
    assert not errors, errors
    assert 0 < most[0] <= pool.capacity
    assert pool.wait_warm(timeout=60)
    counters = pool.counters()
    assert counters["in_use"] == 0 and counters["stand_ins"] == 0
    assert _slots(counters) <= pool.capacity


def test_stand_ins_and_one_offs_take_slots_and_are_freed_when_given_back():
    pool = StagingPool(8 * MIB, piece=4 * MIB, background=True)
    first, second = pool.acquire(), pool.acquire()
    assert {first.kind, second.kind} <= {POOLED, STAND_IN}
    assert pool.try_acquire() is None and pool.try_acquire(need=100) is None  # budget: 2
    pool.release(first)
    pool.release(second)
    assert pool.wait_warm(timeout=60)
    counters = pool.counters()
    assert counters["stand_ins"] == 0 and counters["in_use"] == 0 and counters["pooled"] >= 1
    pool.trim()
    assert pool.counters()["pooled"] == 0
    small = pool.acquire(need=5000)
    assert small.kind == ONE_OFF and small.nbytes == 2 * BUFFER_ALIGNMENT
    pool.release(small)
    assert pool.acquire(need=8192) is small  # kept, and fits
    pool.release(small)
    assert pool.counters()["one_offs"] == 1 and pool.wait_warm(timeout=0)
    # a kept one-off gives its slot up to a larger buffer
    large = [pool.acquire(), pool.acquire()]
    assert pool.counters()["one_offs"] == 0 and all(b.nbytes == 4 * MIB for b in large)
    for buf in large:
        pool.release(buf)
    pool.trim()
    assert pool.counters()["pooled"] == pool.counters()["one_offs"] == 0


def test_trim_stops_a_background_allocation_and_frees_every_idle_buffer():
    pool = StagingPool(64 * MIB, piece=MIB)
    pool.warm_up()
    pool.trim()
    assert pool.counters() | {"made_in_background": 0} == {
        "pooled": 0,
        "stand_ins": 0,
        "one_offs": 0,
        "free": 0,
        "in_use": 0,
        "allocating": 0,
        "made_in_background": 0,
        "stand_ins_made": 0,
        "one_offs_made": 0,
    }


def test_prepare_allocates_pool_buffers_not_stand_ins():
    pool = StagingPool(8 * MIB, piece=2 * MIB, background=True)
    assert pool.prepare(6 * MIB) >= 6 * MIB
    counters = pool.counters()
    assert counters["stand_ins"] == 0 and counters["pooled"] >= 3
    assert counters["made_in_background"] == 0
    pool.trim()


def _wait_child(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9


def test_forks_during_a_background_allocation_leave_both_sides_a_working_pool(tmp_path):
    # A child has no filler thread (nor any allocation under way): its copy of the pool must
    # not count their slots, nor hold a lock one of them held; the parent's allocation goes on.
    pool = StagingPool(128 * MIB, piece=MIB)
    pool.warm_up()
    forks = 0
    while forks < 3 or not pool.wait_warm(timeout=0):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                taken = [pool.acquire(timeout=10) for _ in range(pool.capacity)]
                for buf in taken:
                    buf.array[::BUFFER_ALIGNMENT] = 7
                    pool.release(buf)
                code = 0 if pool.counters()["allocating"] == 0 else 2
            finally:
                os._exit(code)
        assert _wait_child(pid, 60) == 0
        forks += 1
    assert pool.wait_warm(timeout=60)
    counters = pool.counters()
    assert counters["pooled"] == pool.capacity and counters["allocating"] == 0
    assert counters["made_in_background"] == pool.capacity
    pool.trim()


def test_forks_during_a_first_save_neither_hang_nor_damage_it(tmp_path):
    budget = _fresh_budget(96 * MIB)
    state = {"w": torch.randn(90 * MIB // 4)}
    errors: list[BaseException] = []
    done = threading.Event()

    def saving() -> None:
        try:
            _save_and_check(state, tmp_path / "f.safetensors", budget)
            default_pool(budget).wait_warm(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    saver = threading.Thread(target=saving)
    saver.start()
    forks = 0
    while not done.is_set():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        assert _wait_child(pid, 60) == 0
        forks += 1
    saver.join(timeout=120)
    assert not saver.is_alive() and not errors, errors
    assert forks > 0


def test_importing_fastckpt_allocates_no_staging_memory():
    code = (
        "import threading, fastckpt, fastckpt.io.staging_pool as sp\n"
        "assert len(sp._live_pools) == 0, list(sp._live_pools)\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
