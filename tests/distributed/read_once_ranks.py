"""Rank-side code of the read-once tests: the checkpoints' values, the spawned ranks' entry
point and the cases they run (each rank asserts; a failed assertion fails the test). Kept
apart from the test module so each spawned process imports only torch and fastckpt."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastckpt

# -- values -------------------------------------------------------------------------------------

#: Tensors of awkward sizes and every kind of dtype, about 10 MiB in all: more than one piece
#: per rank (pieces are at least 4 MiB), so reads and broadcasts overlap across rounds.
SIZES = (0, 1, 199, 4095, 4097, 65536)
BIG = 1 << 18  # f32 elements: 1 MiB
DAMAGED = "layers.3.weight"


def flat_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    values: dict[str, torch.Tensor] = {}
    for i in range(8):
        values[f"layers.{i}.weight"] = torch.randn(BIG // 512, 512, generator=g)
    for n in SIZES:
        values[f"f32.{n}"] = torch.randn(n, generator=g)
        values[f"bf16.{n}"] = torch.randn(n, generator=g).to(torch.bfloat16)
        values[f"i64.{n}"] = torch.randint(-(2**40), 2**40, (n,), generator=g)
        values[f"bool.{n}"] = torch.rand(n, generator=g) > 0.5
    values["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    values["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
    return values


def nested_values() -> dict:
    flat = flat_values()
    tied = torch.arange(1000, dtype=torch.int16)
    return {
        "model": {k: v for k, v in flat.items() if not k.startswith("bool")},
        "opt": [flat["bool.4097"], {"step": 12, "lr": 0.5, "name": "adam"}],
        "tied_a": tied,
        "tied_b": tied,
        "extra": None,
    }


def write_checkpoints(base: str) -> None:
    """What the ranks read, written by the test process: a nested checkpoint, a flat one, a
    Hugging Face sharded directory of the flat one, a copy with one byte of DAMAGED flipped,
    and another checkpoint with different tensors."""
    fastckpt.save(nested_values(), f"{base}/nested.safetensors")
    fastckpt.save(flat_values(), f"{base}/flat.safetensors")
    fastckpt.save(flat_values(), f"{base}/sharded", max_shard_size=3 << 20)
    with open(f"{base}/flat.safetensors", "rb") as f:
        data = bytearray(f.read())
    with fastckpt.open(f"{base}/flat.safetensors") as r:
        data[r.info(DAMAGED).offset + 1000] ^= 0x10
    with open(f"{base}/damaged.safetensors", "wb") as f:
        f.write(data)
    fastckpt.save({"other": torch.zeros(3)}, f"{base}/other.safetensors")
    changed = flat_values()
    changed["layers.5.weight"] += 1  # the rest refer to flat.safetensors
    fastckpt.save(changed, f"{base}/incremental.safetensors", base=f"{base}/flat.safetensors")


# -- checks -------------------------------------------------------------------------------------


def same(a, b, where: str = "") -> None:
    """Bit-identical: the same structure, types, dtypes, shapes and bytes (NaNs included)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        if a.numel():
            assert torch.equal(
                a.contiguous().reshape(-1).view(torch.uint8),
                b.contiguous().reshape(-1).view(torch.uint8),
            ), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def total(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def unique_bytes(path: str, names=None) -> int:
    with fastckpt.open(path) as r:
        stored = [n for n in r.keys() if n not in r.aliases] if names is None else names
        return sum(r.info(n).nbytes for n in set(r.aliases.get(n, n) for n in stored))


# -- the cases ----------------------------------------------------------------------------------


def read_once_cases(rank: int, world: int, base: str) -> None:
    nested, flat = f"{base}/nested.safetensors", f"{base}/flat.safetensors"

    # load: the same object as a rank reading alone, tied tensors still one tensor
    alone = fastckpt.load(nested)
    shared = fastckpt.load(nested, group=True)
    same(shared, alone)
    assert shared["tied_a"] is shared["tied_b"]
    assert shared["model"]["f32.4097"].storage_offset() == 0  # a storage of its own

    with fastckpt.open(nested) as r:  # a reader opened by the caller, left open
        same(fastckpt.load(r, group=True), alone)
        assert r.keys()

    # every unique byte read from storage once across the group; N times without a group
    with fastckpt.open(flat, group=True) as r:
        same(r.read(), fastckpt.open(flat).read())
        assert total(r.bytes_read) == unique_bytes(flat)
    with fastckpt.open(flat) as r:
        r.read()
        assert total(r.bytes_read) == world * unique_bytes(flat)

    # each rank its own tensors (point-to-point where not every rank wants a piece)
    names = sorted(flat_values())
    keys = [n for i, n in enumerate(names) if i % world == rank] + ["layers.0.weight"]
    with fastckpt.open(flat, group=True) as r:
        got = r.get_tensors(keys, verify=True)
        assert total(r.bytes_read) == unique_bytes(flat, names)
    same(got, {k: fastckpt.load(flat, keys=[k])[k] for k in keys})
    same(fastckpt.load(flat, keys=keys, group=True), fastckpt.load(flat, keys=keys))

    # load_into: every rank's own model filled in place, dtypes converted
    values = flat_values()
    into = {k: torch.zeros_like(v) for k, v in values.items()}
    into["f32.4095"] = torch.zeros(4095, dtype=torch.float64)  # converted by copy_
    before = into["layers.1.weight"].data_ptr()
    result = fastckpt.load_into(into, flat, group=True)
    assert result == ([], []), result
    assert into["layers.1.weight"].data_ptr() == before
    expected = dict(values, **{"f32.4095": values["f32.4095"].double()})
    same(into, expected)
    model = torch.nn.Linear(512, 512)
    fastckpt.save(model.state_dict(), f"{base}/linear.{rank}.safetensors")  # each its own
    dist.barrier()
    model2 = torch.nn.Linear(512, 512)
    fastckpt.load_into(model2, f"{base}/linear.0.safetensors", group=True)
    reference = torch.nn.Linear(512, 512)
    fastckpt.load_into(reference, f"{base}/linear.0.safetensors")
    same(dict(model2.state_dict()), dict(reference.state_dict()))

    # a Hugging Face sharded directory
    same(fastckpt.load(f"{base}/sharded", group=True), fastckpt.load(f"{base}/sharded"))
    with fastckpt.open(f"{base}/sharded", group=True) as r:
        r.read()
        assert total(r.bytes_read) == sum(v.nbytes for v in values.values())

    # an incremental checkpoint: its own tensors and its base's, each read once
    incremental = f"{base}/incremental.safetensors"
    same(fastckpt.load(incremental, group=True), fastckpt.load(incremental))
    with fastckpt.open(incremental, group=True) as r:
        r.read()
        assert total(r.bytes_read) == sum(v.nbytes for v in values.values())

    # a damaged tensor: ChecksumError naming it on every rank, whichever rank read it
    for attempt in (
        lambda: fastckpt.load(f"{base}/damaged.safetensors", group=True),
        lambda: fastckpt.load_into(
            {k: torch.zeros_like(v) for k, v in values.items()},
            f"{base}/damaged.safetensors",
            group=True,
        ),
    ):
        try:
            attempt()
        except fastckpt.ChecksumError as e:
            assert e.tensor == DAMAGED, e.tensor
            assert e.filename.endswith("damaged.safetensors"), e.filename
        else:
            raise AssertionError("the damaged tensor was not noticed")
    with fastckpt.open(f"{base}/damaged.safetensors", group=True) as r:
        assert r.verify() == [DAMAGED]

    # a file missing on one rank: FileNotFoundError on every rank, naming the file
    missing = f"{base}/nowhere.safetensors"
    try:
        fastckpt.load(missing if rank == world - 1 else flat, group=True)
    except FileNotFoundError as e:
        assert e.filename == missing, e.filename
    else:
        raise AssertionError("the missing file was not noticed")

    # a destination one rank cannot fill (its elements share memory): raised on every rank
    bad = torch.zeros(1).expand(4095) if rank == 0 else torch.zeros(4095)
    try:
        fastckpt.load_into({"f32.4095": bad}, flat, strict=False, group=True)
    except RuntimeError as e:
        assert "memory location" in str(e), e
    else:
        raise AssertionError("the failed copy was not noticed")

    # a name one rank asks for that the checkpoint lacks: KeyError on every rank
    try:
        fastckpt.load(flat, keys=["no.such.tensor"] if rank == 0 else ["scalar"], group=True)
    except KeyError as e:
        assert "no.such.tensor" in str(e), e
    else:
        raise AssertionError("the unknown name was not noticed")

    # ranks that opened different checkpoints stop, all of them
    try:
        fastckpt.load(f"{base}/other.safetensors" if rank == 0 else flat, group=True)
    except ValueError as e:
        assert "differ" in str(e), e
    else:
        raise AssertionError("different checkpoints were not noticed")


def dcp_cases(rank: int, world: int, base: str) -> None:
    """FastCkptReader(group=True): a replicated tensor and a row-sharded one saved by every
    rank, loaded back column-sharded (every stored shard is wanted in part by every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastckpt.dcp import FastCkptReader, FastCkptWriter

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    full = {
        "wide": torch.randn(96, 1 << 12, generator=g),
        "repl": torch.randn(1 << 16, generator=g),
    }
    state = {
        "wide": distribute_tensor(full["wide"], mesh, [Shard(0)]),
        "repl": full["repl"].clone(),
        "step": 5,
    }
    path = f"{base}/dcp-{world}"
    dcp.save(state, storage_writer=FastCkptWriter(path))

    def fresh() -> dict:
        wide = distribute_tensor(torch.zeros_like(full["wide"]), mesh, [Shard(1)])
        return {"wide": wide, "repl": torch.zeros_like(full["repl"]), "step": 0}

    shared, alone = fresh(), fresh()
    reader, alone_reader = FastCkptReader(path, group=True), FastCkptReader(path)
    dcp.load(shared, storage_reader=reader)
    dcp.load(alone, storage_reader=alone_reader)
    same(shared["wide"].to_local(), alone["wide"].to_local())
    same(shared["wide"].full_tensor(), full["wide"])
    same(shared["repl"], full["repl"])
    assert shared["step"] == 5
    # every stored tensor byte once; the pickled "step" (a few hundred bytes) each rank reads
    stored = full["wide"].nbytes + full["repl"].nbytes
    assert stored <= total(reader.bytes_read) < stored + world * 4096, total(reader.bytes_read)
    # alone, every rank reads the replicated tensor
    assert total(alone_reader.bytes_read) >= stored + (world - 1) * full["repl"].nbytes

    # a damaged stored shard: ChecksumError naming it on every rank
    if rank == 0:
        from fastckpt.integrations.dcp import read_dcp_metadata

        metadata = read_dcp_metadata(path)
        file_name, name = next(v for k, v in metadata.storage_data.items() if k.fqn == "wide")
        with fastckpt.open(f"{path}/{file_name}") as r:
            offset = r.info(name).offset + 77
        with open(f"{path}/{file_name}", "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    try:
        dcp.load(fresh(), storage_reader=FastCkptReader(path, group=True))
    except BaseException as e:  # DCP's CheckpointException (a BaseException) wraps it
        assert "ChecksumError" in str(e) and "'wide'" in str(e), str(e)
    else:
        raise AssertionError("the damaged shard was not noticed")


def manager_case(rank: int, world: int, root: str) -> None:
    """A multi-rank restore from the root reads once across the ranks by default: the
    restored state is what was saved, and the ranks' file reads (counted by the kernel) hold
    one copy of the replicated tensor where reading alone takes one per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # reads by pread, which the kernel counts in rchar (io_uring's are not counted there)
    os.environ.update(FASTCKPT_ENGINE="threads", FASTCKPT_DIRECT_IO="0")
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(5)
    full = {"rows": torch.randn(64, 1024, generator=g), "repl": torch.randn(1 << 20, generator=g)}

    def state(values: dict) -> dict:
        return {"rows": distribute_tensor(values["rows"], mesh, [Shard(0)]), "repl": values["repl"]}

    with fastckpt.CheckpointManager(root) as manager:
        manager.save(1, state(full))
        manager.wait()
        reads = {}
        for way, options in (("default", {}), ("alone", {"group": None})):
            target = state({k: torch.zeros_like(v) for k, v in full.items()})
            before = _read_chars()
            step, restored = manager.restore(state=target, **options)
            reads[way] = total(_read_chars() - before)
            assert step == 1
            same(restored["rows"].full_tensor(), full["rows"])
            same(restored["repl"], full["repl"])
    # alone, every rank reads the replicated tensor; by default one rank does
    assert reads["alone"] >= (world - 1) * full["repl"].nbytes, reads
    assert reads["alone"] - reads["default"] >= (world - 1) * full["repl"].nbytes * 0.9, reads


def _read_chars() -> int:
    """Bytes this process has passed through read()/pread() (the kernel's count)."""
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


# -- running ranks ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, fn, args) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    os.environ["FASTCKPT_NODE"] = str(rank)
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
    """Runs ``fn(rank, world, *args)`` in ``world`` processes forked from a fork server that
    imported torch and fastckpt once; raises what any rank raised."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "fastckpt.api", __name__])
    mp.start_processes(
        rank_main, args=(world, free_port(), fn, args), nprocs=world, start_method="forkserver"
    )
