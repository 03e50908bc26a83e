"""fastckpt.dcp with torch.distributed.checkpoint: real ranks (spawned processes, gloo on
loopback), real files. Each rank builds the same deterministic values, so every process knows
what a checkpoint must hold."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from dcp_ranks import (
    EXTRAS_TARGET,
    PIECE,
    check_full,
    extra_values,
    four_rank_loads,
    full_values,
    run_ranks,
    save_and_die,
    two_rank_cases,
)

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.dcp import FastCkptReader, FastCkptWriter, consolidate
from fastckpt.integrations.dcp import load_full, read_dcp_metadata

# DCP says so whenever a no_dist=True call runs in one process, which these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# -- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One run of 2 ranks for every 2-rank case (see dcp_ranks.two_rank_cases)."""
    base = str(tmp_path_factory.mktemp("two-ranks"))
    run_ranks(2, two_rank_cases, base)
    return base


def _damage_piece(src: str, dst: str, piece: int) -> None:
    """Copies checkpoint ``src`` to ``dst`` with one byte changed in piece ``piece`` of the
    stored tensor "model.wide" of rank 0's file."""
    shutil.copytree(src, dst)
    metadata = read_dcp_metadata(dst)
    (file_name,) = {f for f, name in metadata.storage_data.values() if name == "model.wide"}
    path = os.path.join(dst, file_name)
    with fastckpt.open(path) as r:
        offset = r.info("model.wide").offset + piece * PIECE + 123
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_two_ranks_save_load_resharded(two_rank_run, tmp_path):
    path = os.path.join(two_rank_run, "ckpt")
    files = sorted(os.listdir(path))
    assert files[0] == ".metadata" and len(files) == 3  # one file per rank
    for name in files[1:]:  # each is a valid, checksummed fastckpt file with piece checksums
        with fastckpt.open(os.path.join(path, name)) as r:
            assert r.has_checksums and not r.verify()
            assert r.meta.pieces is not None and r.meta.pieces.piece_size == PIECE
    old = os.path.join(two_rank_run, "no-pieces")
    for name in sorted(os.listdir(old))[1:]:  # written with piece_size=0
        with fastckpt.open(os.path.join(old, name)) as r:
            assert r.has_checksums and r.meta.pieces is None

    # one process, full tensors
    full = {"model": {k: torch.zeros_like(v) for k, v in full_values().items() if k != "plain"}}
    full.update(plain=torch.zeros(7, dtype=torch.int32), **copy.deepcopy(EXTRAS_TARGET))
    dcp.load(full, storage_reader=FastCkptReader(path), no_dist=True)
    check_full(full)

    # four ranks, resharded: each reads half a stored shard; a damaged piece is caught by the
    # rank whose range covers it only; a checkpoint without piece checksums still loads
    base = str(tmp_path)
    shutil.copytree(path, os.path.join(base, "ckpt"))
    shutil.copytree(os.path.join(two_rank_run, "no-pieces"), os.path.join(base, "no-pieces"))
    _damage_piece(path, os.path.join(base, "damaged"), piece=5)
    run_ranks(4, four_rank_loads, base)


def test_async_save_holds_values_at_call_time(two_rank_run):
    path = os.path.join(two_rank_run, "async")
    check_full(load_full(path))
    second = load_full(path + "-second")
    assert torch.equal(second["model"]["sharded"], torch.full((10, 6), -7.0))
    assert second["cfg"]["betas"] == [0.9, 0.99, 0.5] and second["cfg"]["lr"] == 9.0


def test_rank_killed_during_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(2, save_and_die, path)
    before = read_dcp_metadata(path)
    check_full(load_full(path), version=0)  # the first checkpoint, whole
    assert cli(["verify", path]) == 0
    # the next good save replaces it and removes the dead save's leftovers
    writer = FastCkptWriter(path)
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
    assert torch.equal(load_full(path)["w"], torch.ones(2))
    writer.close()  # waits for the removal, which runs beside the caller
    after = read_dcp_metadata(path)
    assert after.storage_meta.save_id != before.storage_meta.save_id
    referenced = {f for f, _ in after.storage_data.values()}
    assert sorted(os.listdir(path)) == sorted({".metadata", *referenced})


def test_replaced_files_are_removed_beside_the_caller_never_a_later_saves(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.zeros(3)}, storage_writer=FastCkptWriter(path), no_dist=True)
    first = set(os.listdir(path))
    second_writer = FastCkptWriter(path)
    dcp.save({"w": torch.ones(3)}, storage_writer=second_writer, no_dist=True)
    # a third save starts while the second one's removal may still run
    third_writer = FastCkptWriter(path)
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=third_writer, no_dist=True)
    second_writer.close()
    third_writer.close()
    referenced = {f for f, _ in read_dcp_metadata(path).storage_data.values()}
    assert sorted(os.listdir(path)) == sorted({".metadata", *referenced})
    assert not (first - {".metadata"}) & set(os.listdir(path))
    assert torch.equal(load_full(path)["w"], torch.full((3,), 2.0))


def test_damaged_file_names_file_and_tensor(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    state = {"w": torch.arange(5000.0), "b": torch.ones(3), "step": 1}
    dcp.save(state, storage_writer=FastCkptWriter(path), no_dist=True)
    (rank_file,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    with fastckpt.open(os.path.join(path, rank_file)) as r:
        offset = r.info("w").offset
    with open(os.path.join(path, rank_file), "r+b") as f:
        f.seek(offset + 64)
        f.write(b"\xde\xad")
    target = {"w": torch.zeros(5000), "b": torch.zeros(3), "step": 0}
    with pytest.raises(dcp.CheckpointException) as info:
        dcp.load(target, storage_reader=FastCkptReader(path), no_dist=True)
    assert rank_file in str(info.value) and "'w'" in str(info.value)
    assert "ChecksumError" in str(info.value)
    assert cli(["verify", path]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_filesystem_writer_checkpoint_converts_both_ways(tmp_path, capsys):
    theirs = str(tmp_path / "theirs")
    state = {"model": {k: v for k, v in full_values().items()}, **extra_values()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs), no_dist=True)
    single = str(tmp_path / "full.safetensors")
    assert cli(["convert", theirs, single]) == 0
    loaded = fastckpt.load(single)
    assert torch.equal(loaded["model"]["half"], full_values()["half"]) and loaded["step"] == 42
    with fastckpt.open(single) as r:  # one plain safetensors file of full tensors
        assert r.info("model/sharded").shape == (10, 6)

    ours = str(tmp_path / "ours")
    assert cli(["convert", "--to-dcp", single, ours]) == 0
    target = {"model": {k: torch.zeros_like(v) for k, v in full_values().items()}}
    target.update(copy.deepcopy(EXTRAS_TARGET))
    dcp.load(target, storage_reader=FastCkptReader(ours), no_dist=True)
    assert torch.equal(target["model"]["sharded"], full_values()["sharded"])
    assert target["cfg"] == extra_values()["cfg"]
    assert cli(["inspect", ours]) == 0
    assert "DCP checkpoint written by fastckpt" in capsys.readouterr().out
    # and the consolidation of ours round-trips
    consolidate(ours, str(tmp_path / "again.safetensors"))
    assert torch.equal(
        fastckpt.load(str(tmp_path / "again.safetensors"))["model"]["plain"], full_values()["plain"]
    )
