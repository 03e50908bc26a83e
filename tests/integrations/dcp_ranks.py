"""Rank-side code of the DCP tests: deterministic values, the spawned ranks' entry point and
the functions they run. Kept apart from the test module so each spawned process imports only
torch, DCP and fastckpt (not pytest or the CLI)."""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import os
import signal
import socket
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fastckpt.dcp import FastCkptReader, FastCkptWriter

# -- values -------------------------------------------------------------------------------------

#: "wide" is 256 rows of 4 KiB; saved by 2 ranks, each file holds 128 rows (512 KiB) in 8
#: checksummed pieces of PIECE bytes; loaded by 4 ranks, each wants 64 rows: 4 pieces.
WIDE_ROWS, WIDE_COLS = 256, 1024
PIECE = 64 << 10
STORED_SHARD = WIDE_ROWS // 2 * WIDE_COLS * 4
#: What the other values of the state take to read: a few small tensors and pickled extras.
SMALL_VALUES = 16 << 10


def full_values(version: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "sharded": torch.randn(10, 6, generator=g),  # 10 rows: uneven over 4 ranks
        "repl": torch.randn(4, 3, generator=g),
        "half": torch.randn(8, 2, generator=g).to(torch.bfloat16),
        "plain": torch.arange(7, dtype=torch.int32) + version,
        "wide": torch.randn(WIDE_ROWS, WIDE_COLS, generator=g),
    }


# DCP loads the keys the target state dict has: these stand in for the non-tensor values.
EXTRAS_TARGET = {"step": 0, "cfg": {"lr": 0.0, "betas": None, "name": ""}}


def extra_values(version: int = 0) -> dict:
    return {"step": 42 + version, "cfg": {"lr": 0.1, "betas": [0.9, 0.99], "name": "run-a"}}


def make_state(mesh, version: int = 0) -> dict:
    full = full_values(version)
    return {
        "model": {
            "sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
            "repl": distribute_tensor(full["repl"], mesh, [Replicate()]),
            "half": distribute_tensor(full["half"], mesh, [Shard(0)]),
            "wide": distribute_tensor(full["wide"], mesh, [Shard(0)]),
        },
        "plain": full["plain"].clone(),
        **extra_values(version),
    }


def empty_like_full(mesh, placements: dict[str, list]) -> dict:
    full = full_values()
    model = {
        k: distribute_tensor(torch.zeros_like(full[k]), mesh, placements[k])
        for k in ("sharded", "repl", "half", "wide")
    }
    return {
        "model": model,
        "plain": torch.zeros(7, dtype=torch.int32),
        **copy.deepcopy(EXTRAS_TARGET),
    }


def check_loaded(state: dict, version: int = 0) -> None:
    full = full_values(version)
    for key in ("sharded", "repl", "half", "wide"):
        value = state["model"][key]
        assert isinstance(value, DTensor)
        assert torch.equal(value.full_tensor(), full[key]), key
    assert torch.equal(state["plain"], full["plain"])
    extras = extra_values(version)
    assert state["step"] == extras["step"]
    assert state["cfg"] == extras["cfg"]


def check_full(state: dict, version: int = 0) -> None:
    full = full_values(version)
    for key in ("sharded", "repl", "half", "wide"):
        assert torch.equal(state["model"][key], full[key]), key
    assert torch.equal(state["plain"], full["plain"])
    assert {k: state[k] for k in ("step", "cfg")} == extra_values(version)


# -- running ranks ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, fn, args) -> None:
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
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """Runs ``fn(rank, world, *args)`` in ``world`` new processes; raises what any raised.

    The processes are forked from a fork server that has imported torch, DCP and this module
    once (not from the test process, whose threads must not be forked), so each rank starts
    in a fraction of a second instead of importing torch again.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed.checkpoint", __name__])
    mp.start_processes(
        rank_main, args=(world, free_port(), fn, args), nprocs=world, start_method="forkserver"
    )


def make_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


# -- rank functions (module level: spawn imports them by name) ----------------------------------


def two_rank_cases(rank, world, base):
    """Everything the 2-rank tests need, in one set of processes: a checkpoint loaded back
    sharded another way, one written without piece checksums, and two async saves."""
    save_then_load_other_sharding(rank, world, base + "/ckpt")
    mesh = make_mesh(world)
    dcp.save(make_state(mesh), storage_writer=FastCkptWriter(base + "/no-pieces", piece_size=0))
    async_save_then_mutate(rank, world, base + "/async")


def save_then_load_other_sharding(rank, world, path):
    dcp.save(make_state(make_mesh(world)), storage_writer=FastCkptWriter(path, piece_size=PIECE))
    dist.barrier()
    # columns of row-sharded shards: regions that are not contiguous bytes
    other = {"sharded": [Shard(1)], "repl": [Shard(0)], "half": [Replicate()], "wide": [Shard(1)]}
    load_resharded(rank, world, path, other)


def load_resharded(rank, world, path, placements, **options) -> FastCkptReader:
    state = empty_like_full(make_mesh(world), placements)
    reader = FastCkptReader(path, **options)
    dcp.load(state, storage_reader=reader)
    check_loaded(state)
    if placements["sharded"] == [Shard(0)]:  # each rank holds only its rows
        local = state["model"]["sharded"].to_local()
        rows = [3, 3, 3, 1][rank] if world == 4 else local.shape[0]
        assert local.shape == (rows, 6)
    return reader


def _read_chars() -> int:
    """Bytes this process has passed through read()/pread() so far (the kernel's count)."""
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


ROWS = {"sharded": [Shard(0)], "repl": [Shard(0)], "half": [Shard(0)], "wide": [Shard(0)]}


def four_rank_loads(rank, world, base):
    """Loads the 2-rank checkpoints with 4 ranks, counting the bytes each rank reads."""
    # A checkpoint without piece checksums is read a whole stored shard at a time (this
    # first load also imports what loading needs, which the kernel's count below would see).
    reader = load_resharded(rank, world, base + "/no-pieces", ROWS)
    assert STORED_SHARD <= reader.bytes_read <= STORED_SHARD + SMALL_VALUES, reader.bytes_read
    # Each rank wants half of one stored shard of "wide": only that half is read (the other
    # tensors are a few hundred bytes). Counted by the reader and by the kernel.
    before = _read_chars()
    reader = load_resharded(rank, world, base + "/ckpt", ROWS, direct_io=False)
    kernel = _read_chars() - before
    half = STORED_SHARD // 2
    assert half <= reader.bytes_read <= half + SMALL_VALUES, reader.bytes_read
    assert kernel < STORED_SHARD * 3 // 4, kernel  # the reader's own count is not the only proof
    # One byte damaged in piece 5 of rank 0's file: rank 1 reads pieces 4-7 and fails naming
    # the piece; rank 0 reads pieces 0-3 of the same file and succeeds.
    state = empty_like_full(make_mesh(world), ROWS)
    try:
        dcp.load(state, storage_reader=FastCkptReader(base + "/damaged"))
    except CheckpointException as exc:
        assert set(exc.failures) == {1}, str(exc)
        error, _ = exc.failures[1]
        message = str(error)
        assert "piece 5 of 8" in message and "model.wide" in message, message
        assert f"tensor bytes [{5 * PIECE}, {6 * PIECE})" in message, message
    else:
        raise AssertionError("a damaged piece was not detected")


def async_save_then_mutate(rank, world, path, **writer_options):
    state = make_state(make_mesh(world))
    writer = FastCkptWriter(path, **writer_options)
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


class DieMidSave(DefaultSavePlanner):
    """Kills its own process (SIGKILL, no cleanup) while rank 1 is writing its file."""

    def resolve_data(self, write_item):
        if dist.get_rank() == 1 and write_item.index.fqn == "model.repl":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def save_and_die(rank, world, path):
    dcp.save(make_state(make_mesh(world), 0), storage_writer=FastCkptWriter(path))
    dist.barrier()
    dcp.save(
        make_state(make_mesh(world), 1), storage_writer=FastCkptWriter(path), planner=DieMidSave()
    )


# -- checkpoints at URLs (a moto S3 server in the test process) -----------------------------------


class RaiseMidSave(DefaultSavePlanner):
    """Makes rank 1's write fail (an OSError, as a refused upload raises) after rank 0's
    file went out whole: the coordinator must not commit the save."""

    def resolve_data(self, write_item):
        if dist.get_rank() == 1 and write_item.index.fqn == "model.repl":
            raise OSError(5, "write refused (test)")
        return super().resolve_data(write_item)


def s3_two_rank_cases(rank, world, base, options):
    """2 ranks at ``base`` (an s3:// URL): a checkpoint for the loads, two async saves, and a
    save that fails on rank 1 over a committed checkpoint."""
    mesh = make_mesh(world)
    writer = FastCkptWriter(base + "/ckpt", piece_size=PIECE, storage_options=options)
    dcp.save(make_state(mesh), storage_writer=writer)
    async_save_then_mutate(rank, world, base + "/async", storage_options=options)
    path = base + "/failed"
    dcp.save(make_state(mesh, 0), storage_writer=FastCkptWriter(path, storage_options=options))
    try:
        dcp.save(
            make_state(mesh, 1),
            storage_writer=FastCkptWriter(path, storage_options=options),
            planner=RaiseMidSave(),
        )
    except CheckpointException as exc:
        assert set(exc.failures) == {1}, str(exc)
    else:
        raise AssertionError("the save with a failing rank did not fail")


def s3_four_rank_loads(rank, world, base, options):
    """4 ranks load the 2-rank checkpoint at ``base``: each fetches half a stored shard of
    "wide"; a damaged piece is caught by the one rank whose range covers it, naming the URL."""
    reader = load_resharded(rank, world, base + "/ckpt", ROWS, storage_options=options)
    half = STORED_SHARD // 2
    assert half <= reader.bytes_read <= half + SMALL_VALUES, reader.bytes_read
    state = empty_like_full(make_mesh(world), ROWS)
    try:
        dcp.load(state, storage_reader=FastCkptReader(base + "/damaged", storage_options=options))
    except CheckpointException as exc:
        assert set(exc.failures) == {1}, str(exc)
        message = str(exc.failures[1][0])
        assert "piece 5 of 8" in message and "model.wide" in message, message
        assert f"{base}/damaged/__0_" in message, message
    else:
        raise AssertionError("a damaged piece was not detected")


# -- commit safety: saves running at once, saves that fail -------------------------------------

CONCURRENT_SAVES = 12


def _saver_values(rank: int, step: int) -> dict:
    return {"w": torch.full((4096,), float(rank * 1000 + step)), "who": [rank, step]}


def concurrent_saves(rank, world, path):
    """Every rank saves into the same directory at once, each as a one-process save of its
    own: every save must succeed, and the directory must end holding one whole checkpoint."""
    dist.barrier()  # start together, so the saves overlap
    for step in range(CONCURRENT_SAVES):
        writer = FastCkptWriter(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(_saver_values(rank, step), storage_writer=writer, no_dist=True)
        writer.close()
    dist.barrier()
    from fastckpt.integrations.dcp import load_full

    loaded = load_full(path)  # whichever save published last, whole
    saver, step = loaded["who"]
    assert torch.equal(loaded["w"], _saver_values(saver, step)["w"]), (saver, step)
    dist.barrier()  # every rank has loaded before anything is replaced again


def save_then_fail(rank, world, path):
    """A 2-rank save over a committed checkpoint fails on rank 1: the old checkpoint stays
    loadable and its files and ``.metadata`` unchanged."""
    mesh = make_mesh(world)
    dcp.save(make_state(mesh, 0), storage_writer=FastCkptWriter(path))
    dist.barrier()
    before = {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)}
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = f.read()
    dist.barrier()
    writer = FastCkptWriter(path)
    try:
        dcp.save(make_state(mesh, 1), storage_writer=writer, planner=RaiseMidSave())
    except CheckpointException as exc:
        assert set(exc.failures) == {1}, str(exc)
    else:
        raise AssertionError("the save with a failing rank did not fail")
    dist.barrier()
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert f.read() == metadata
    after = {n: os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)}
    assert all(after.get(n) == t for n, t in before.items()), (before, after)
    state = empty_like_full(mesh, ROWS)
    dcp.load(state, storage_reader=FastCkptReader(path))
    check_loaded(state, version=0)
    writer.close()


def commit_cases(rank, world, base):
    """The commit-safety cases in one set of processes: a failed save, then saves at once."""
    save_then_fail(rank, world, base + "/failed")
    dist.barrier()
    concurrent_saves(rank, world, base + "/concurrent")
