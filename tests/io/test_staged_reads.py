"""Cold reads through the staging pool (read mode "staged"; that every read mode loads,
verifies and finds damage is tests/checkpoint/test_read_path_choice.py's)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from _page_cache import drop_from_page_cache

import fastckpt
from fastckpt.config import IOConfig, force_read_mode
from fastckpt.io.executor import Executor
from fastckpt.io.files import File
from fastckpt.io.parallel_io import Span, read_buffered
from fastckpt.io.staged_reads import read_staged
from fastckpt.io.staging_pool import StagingPool

KIB = 1 << 10


@pytest.fixture
def data_file(tmp_path):
    data = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def _random_spans(rng: random.Random, memory: np.ndarray, size: int) -> list[Span]:
    spans, at = [], rng.randrange(0, 5000)
    while at < size - 1:
        n = min(size - at, rng.randrange(1, 700 * KIB))
        cuts = sorted({rng.randrange(1, n) for _ in range(rng.randrange(0, 4)) if n > 1})
        spans.append(Span(at, memory.ctypes.data + at, n, tuple(cuts)))
        at += n + rng.randrange(0, 3 * KIB)
    return spans


@pytest.mark.parametrize("seed", range(4))
def test_bytes_and_checksums_match_a_buffered_read(data_file, seed):
    path, data = data_file
    rng = random.Random(seed)
    staged, buffered = np.zeros_like(data), np.zeros_like(data)
    spans = _random_spans(rng, staged, data.size)
    twins = [
        Span(s.file_offset, buffered.ctypes.data + s.file_offset, s.nbytes, s.cuts) for s in spans
    ]
    # small buffers: most spans cross several, and pieces start off page boundaries
    pool = StagingPool(256 * KIB, piece=64 * KIB)
    with File(path) as f:
        crcs = read_staged(Executor(IOConfig()), f, spans, pool=pool)
        expected = read_buffered(f, twins)
    assert crcs == expected
    assert np.array_equal(staged, buffered)
    covered = np.zeros(data.size, dtype=bool)
    for s in spans:
        covered[s.file_offset : s.file_offset + s.nbytes] = True
    assert np.array_equal(staged[covered], data[covered])
    assert not staged[~covered].any()  # nothing written outside the spans
    assert pool.in_use() == 0


def test_without_checksums_returns_empty_lists(data_file):
    path, data = data_file
    back = np.zeros_like(data)
    spans = [Span(0, back.ctypes.data, 1 << 20), Span(1 << 20, back.ctypes.data + (1 << 20), 4096)]
    with File(path) as f:
        crcs = read_staged(
            Executor(IOConfig()),
            f,
            spans,
            pool=StagingPool(1 << 20, piece=256 * KIB),
            checksum=False,
        )
    assert crcs == [[], []]
    assert np.array_equal(back[: (1 << 20) + 4096], data[: (1 << 20) + 4096])


def test_a_failed_read_returns_every_buffer(data_file):
    path, data = data_file
    back = np.zeros(data.size + (1 << 20), dtype=np.uint8)
    pool = StagingPool(512 * KIB, piece=128 * KIB)
    past_the_end = [Span(0, back.ctypes.data, back.size)]  # the file is 1 MiB shorter
    executor = Executor(IOConfig())
    with File(path) as f, pytest.raises(OSError) as info:
        read_staged(executor, f, past_the_end, pool=pool)
    assert path in str(info.value)
    assert pool.in_use() == 0 and executor.pending() == 0


def test_an_interrupt_waits_for_the_reads_and_returns_every_buffer(data_file):
    path, data = data_file
    back = np.zeros_like(data)
    pool = StagingPool(512 * KIB, piece=128 * KIB)
    executor = Executor(IOConfig())

    def interrupted(nbytes: int) -> None:
        raise KeyboardInterrupt

    with File(path) as f, pytest.raises(KeyboardInterrupt):
        read_staged(
            executor, f, [Span(0, back.ctypes.data, back.size)], pool=pool, on_progress=interrupted
        )
    assert pool.in_use() == 0 and executor.pending() == 0


def test_staged_loads_and_saves_share_the_pool_without_waiting_on_each_other(tmp_path):
    import concurrent.futures

    from fastckpt.config import set_defaults

    states = [{f"t{i}": torch.randn(256, 1024) for i in range(6)} for _ in range(3)]
    paths = [str(tmp_path / f"s{i}.safetensors") for i in range(3)]
    set_defaults(staging_bytes=4 << 20)  # two buffers for everyone
    try:
        for state, path in zip(states[:2], paths[:2]):
            fastckpt.save(state, path)
            drop_from_page_cache(path)
        force_read_mode("staged")

        def load(i: int) -> dict:
            return fastckpt.load(paths[i], verify=True)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            loads = [pool.submit(load, i) for i in (0, 1, 0, 1)]
            saving = pool.submit(fastckpt.save, states[2], paths[2])
            results = [f.result(timeout=120) for f in loads]
            saving.result(timeout=120)
    finally:
        force_read_mode(None)
        set_defaults(staging_bytes=None)
    for i, back in zip((0, 1, 0, 1), results):
        assert all(torch.equal(back[k], v) for k, v in states[i].items())
    assert all(torch.equal(v, states[2][k]) for k, v in fastckpt.load(paths[2]).items())
