"""fastckpt.dcp with torch.distributed.checkpoint: real ranks (spawned processes, gloo on
loopback), real files. Each rank builds the same deterministic values, so every process knows
what a checkpoint must hold."""

from __future__ import annotations

import copy
import datetime
import os
import signal
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fastckpt
from fastckpt.cli import main as cli
from fastckpt.dcp import FastCkptReader, FastCkptWriter, consolidate
from fastckpt.integrations.dcp import load_full, read_dcp_metadata

# DCP says so whenever a no_dist=True call runs in one process, which these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# -- values -------------------------------------------------------------------------------------


def _full(version: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "sharded": torch.randn(10, 6, generator=g),  # 10 rows: uneven over 4 ranks
        "repl": torch.randn(4, 3, generator=g),
        "half": torch.randn(8, 2, generator=g).to(torch.bfloat16),
        "plain": torch.arange(7, dtype=torch.int32) + version,
    }


# DCP loads the keys the target state dict has: these stand in for the non-tensor values.
_EXTRAS_TARGET = {"step": 0, "cfg": {"lr": 0.0, "betas": None, "name": ""}}


def _extras(version: int = 0) -> dict:
    return {"step": 42 + version, "cfg": {"lr": 0.1, "betas": [0.9, 0.99], "name": "run-a"}}


def _state(mesh, version: int = 0) -> dict:
    full = _full(version)
    return {
        "model": {
            "sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
            "repl": distribute_tensor(full["repl"], mesh, [Replicate()]),
            "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
        },
        "plain": full["plain"].clone(),
        **_extras(version),
    }


def _empty_like_full(mesh, placements: dict[str, list]) -> dict:
    full = _full()
    model = {
        k: distribute_tensor(torch.zeros_like(full[k]), mesh, placements[k])
        for k in ("sharded", "repl", "half")
    }
    return {
        "model": model,
        "plain": torch.zeros(7, dtype=torch.int32),
        **copy.deepcopy(_EXTRAS_TARGET),
    }


def _check_loaded(state: dict, version: int = 0) -> None:
    full = _full(version)
    for key in ("sharded", "repl", "half"):
        value = state["model"][key]
        assert isinstance(value, DTensor)
        assert torch.equal(value.full_tensor(), full[key]), key
    assert torch.equal(state["plain"], full["plain"])
    extras = _extras(version)
    assert state["step"] == extras["step"]
    assert state["cfg"] == extras["cfg"]


def _check_full(state: dict, version: int = 0) -> None:
    full = _full(version)
    for key in ("sharded", "repl", "half"):
        assert torch.equal(state["model"][key], full[key]), key
    assert torch.equal(state["plain"], full["plain"])
    assert {k: state[k] for k in ("step", "cfg")} == _extras(version)


# -- running ranks ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args) -> None:
    # DCP and DTensor warn about things these tests do on purpose; the children are not
    # under pytest's warning filters, so keep their output to what matters.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*overwriting.*", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _run(world: int, fn, *args) -> None:
    """Runs ``fn(rank, world, *args)`` in ``world`` spawned processes; raises what any raised."""
    mp.start_processes(
        _rank_main, args=(world, _free_port(), fn, args), nprocs=world, start_method="spawn"
    )


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


# -- rank functions (module level: spawn imports them by name) ----------------------------------


def _save_then_load_other_sharding(rank, world, path):
    dcp.save(_state(_mesh(world)), storage_writer=FastCkptWriter(path))
    dist.barrier()
    other = {"sharded": [Shard(1)], "repl": [Shard(0)], "half": [Replicate()]}
    _load_resharded(rank, world, path, other)


def _load_resharded(rank, world, path, placements):
    state = _empty_like_full(_mesh(world), placements)
    dcp.load(state, storage_reader=FastCkptReader(path))
    _check_loaded(state)
    if placements["sharded"] == [Shard(0)]:  # each rank holds only its rows
        local = state["model"]["sharded"].to_local()
        rows = [3, 3, 3, 1][rank] if world == 4 else local.shape[0]
        assert local.shape == (rows, 6)


def _async_save_then_mutate(rank, world, path):
    state = _state(_mesh(world))
    writer = FastCkptWriter(path)
    future = dcp.async_save(state, storage_writer=writer)
    # change everything at once: the checkpoint must hold the values at call time
    for value in state["model"].values():
        value.to_local().fill_(-7)
    state["plain"].zero_()
    state["cfg"]["betas"].append(0.5)
    state["cfg"]["lr"] = 9.0
    future.result()
    # a second save through the same writer, of the mutated values, commits too
    dcp.async_save(state, storage_writer=writer, checkpoint_id=path + "-second").result()
    writer.close()


class _DieMidSave(DefaultSavePlanner):
    """Kills its own process (SIGKILL, no cleanup) while rank 1 is writing its file."""

    def resolve_data(self, write_item):
        if dist.get_rank() == 1 and write_item.index.fqn == "model.repl":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def _save_and_die(rank, world, path):
    dcp.save(_state(_mesh(world), 0), storage_writer=FastCkptWriter(path))
    dist.barrier()
    dcp.save(_state(_mesh(world), 1), storage_writer=FastCkptWriter(path), planner=_DieMidSave())


# -- tests --------------------------------------------------------------------------------------


def test_two_ranks_save_load_resharded(tmp_path):
    path = str(tmp_path / "ckpt")
    # two ranks save, then load it back sharded another way
    _run(2, _save_then_load_other_sharding, path)
    files = sorted(os.listdir(path))
    assert files[0] == ".metadata" and len(files) == 3  # one file per rank
    for name in files[1:]:  # each is a valid, checksummed fastckpt file
        with fastckpt.open(os.path.join(path, name)) as r:
            assert r.has_checksums and not r.verify()

    # one process, full tensors
    full = {"model": {k: torch.zeros_like(v) for k, v in _full().items() if k != "plain"}}
    full.update(plain=torch.zeros(7, dtype=torch.int32), **copy.deepcopy(_EXTRAS_TARGET))
    dcp.load(full, storage_reader=FastCkptReader(path), no_dist=True)
    _check_full(full)

    # four ranks, resharded
    _run(4, _load_resharded, path, {"sharded": [Shard(0)], "repl": [Shard(0)], "half": [Shard(0)]})


def test_async_save_holds_values_at_call_time(tmp_path):
    path = str(tmp_path / "ckpt")
    _run(2, _async_save_then_mutate, path)
    _check_full(load_full(path))
    second = load_full(path + "-second")
    assert torch.equal(second["model"]["sharded"], torch.full((10, 6), -7.0))
    assert second["cfg"]["betas"] == [0.9, 0.99, 0.5] and second["cfg"]["lr"] == 9.0


def test_rank_killed_during_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(mp.ProcessExitedException):
        _run(2, _save_and_die, path)
    before = read_dcp_metadata(path)
    _check_full(load_full(path), version=0)  # the first checkpoint, whole
    assert cli(["verify", path]) == 0
    # the next good save replaces it and removes the dead save's leftovers
    dcp.save({"w": torch.ones(2)}, storage_writer=FastCkptWriter(path), no_dist=True)
    assert torch.equal(load_full(path)["w"], torch.ones(2))
    after = read_dcp_metadata(path)
    assert after.storage_meta.save_id != before.storage_meta.save_id
    referenced = {f for f, _ in after.storage_data.values()}
    assert sorted(os.listdir(path)) == sorted({".metadata", *referenced})


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
    state = {"model": {k: v for k, v in _full().items()}, **_extras()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs), no_dist=True)
    single = str(tmp_path / "full.safetensors")
    assert cli(["convert", theirs, single]) == 0
    loaded = fastckpt.load(single)
    assert torch.equal(loaded["model"]["half"], _full()["half"]) and loaded["step"] == 42
    with fastckpt.open(single) as r:  # one plain safetensors file of full tensors
        assert r.info("model/sharded").shape == (10, 6)

    ours = str(tmp_path / "ours")
    assert cli(["convert", "--to-dcp", single, ours]) == 0
    target = {"model": {k: torch.zeros_like(v) for k, v in _full().items()}}
    target.update(copy.deepcopy(_EXTRAS_TARGET))
    dcp.load(target, storage_reader=FastCkptReader(ours), no_dist=True)
    assert torch.equal(target["model"]["sharded"], _full()["sharded"])
    assert target["cfg"] == _extras()["cfg"]
    assert cli(["inspect", ours]) == 0
    assert "DCP checkpoint written by fastckpt" in capsys.readouterr().out
    # and the consolidation of ours round-trips
    consolidate(ours, str(tmp_path / "again.safetensors"))
    assert torch.equal(
        fastckpt.load(str(tmp_path / "again.safetensors"))["model"]["plain"], _full()["plain"]
    )
