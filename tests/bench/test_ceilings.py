"""The device ceiling of `fastckpt bench --checkpoint`: raw O_DIRECT writes and reads (fio's
own figures where fio is installed), on real files."""

from __future__ import annotations

import os

import pytest
import torch

from fastckpt.bench.ceilings import direct_preadv_file, direct_pwrite_file
from fastckpt.bench.fio import fio_path
from fastckpt.bench.peers import LOADERS, SAVERS, Skip, Timed


def _o_direct_or_skip(path):
    try:
        direct_pwrite_file(path, 4096)
    except OSError as exc:
        pytest.skip(f"no O_DIRECT here: {exc}")


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, (9 << 20) + 5])
def test_threads_ceiling_writes_whole_pages_and_reads_them(tmp_path, nbytes):
    path = tmp_path / "d.bin"
    _o_direct_or_skip(path)
    assert direct_pwrite_file(path, nbytes) > 0
    assert os.path.getsize(path) == -(-nbytes // 4096) * 4096
    assert direct_preadv_file(path) > 0


def test_device_row_times_itself_with_fio(tmp_path):
    if fio_path() is None:
        pytest.skip("fio is not installed")
    path = str(tmp_path / "d.bin")
    _o_direct_or_skip(path)
    state = {"w": torch.zeros((64 << 20) // 4 + 3)}  # not a whole number of fio's blocks
    try:
        timed = SAVERS["direct"].setup(state, path)()
    except Skip as why:
        pytest.skip(str(why))
    assert isinstance(timed, Timed) and timed.seconds > 0
    assert os.path.getsize(path) % (4 << 20) == 0 and os.path.getsize(path) >= state["w"].nbytes
    read = LOADERS["direct"].setup(path, "cpu")()
    assert isinstance(read, Timed) and read.seconds > 0
