"""Rank-side code of the read-once tests: the checkpoints' values, the spawned ranks' entry
point and the cases they run (each rank asserts; a failed assertion fails the test). Kept
apart from the test module so each spawned process imports only torch and fastckpt."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import resource
import shutil
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastckpt
from fastckpt.distributed.group_reader import GroupReader, read_into_shared
from fastckpt.distributed.groups import checkpoint_group

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


# -- checkpoints alike in shape, not in content -------------------------------------------------


def step_values(step: int) -> dict[str, torch.Tensor]:
    """Step ``step`` of a run: the same names, dtypes and shapes at every step; step 2 differs
    from step 1 in one tensor only (so in one shard of a sharded directory)."""
    g = torch.Generator().manual_seed(11)
    values = {f"layers.{i}.weight": torch.randn(64, 512, generator=g) for i in range(8)}
    if step == 2:
        values["layers.5.weight"] += 1
    return values


def write_steps(base: str) -> None:
    """Two steps of a run as single files, copies, sharded directories (a tensor a shard),
    incremental files and files without checksums (their step in their metadata)."""
    for step in (1, 2):
        values = step_values(step)
        fastckpt.save(values, f"{base}/step{step}.safetensors")
        fastckpt.save(values, f"{base}/sharded{step}", max_shard_size=128 << 10)
        changed = dict(values, **{"layers.0.weight": values["layers.0.weight"] * 2})
        fastckpt.save(
            changed, f"{base}/incremental{step}.safetensors", base=f"{base}/step{step}.safetensors"
        )
        fastckpt.save(
            values, f"{base}/plain{step}.safetensors", checksum=False, metadata={"step": str(step)}
        )
    shutil.copyfile(f"{base}/step1.safetensors", f"{base}/copy1.safetensors")
    shutil.copyfile(f"{base}/step1.safetensors", f"{base}/replaced.safetensors")
    shutil.copytree(f"{base}/sharded1", f"{base}/resaved")


def _lower_open_files(soft: int) -> None:
    """The soft limit on open files of this rank: its reads must fit ``soft`` descriptors."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _refused(rank: int, attempt, *named: str) -> str:
    """``attempt()`` raises ValueError on this rank, naming every one of ``named``."""
    try:
        attempt()
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: a mix of {named} was not noticed")
    for text in named:
        assert text in message, (rank, text, message)
    return message


def differing_content_cases(rank: int, world: int, base: str) -> None:
    """Ranks that opened checkpoints with the same names, dtypes and shapes but other bytes
    (two steps of a run; a file saved over the path between their opens) stop, every rank,
    with an error naming the ranks and both files; copies of one checkpoint still agree."""
    _lower_open_files(256)
    others = f"ranks {list(range(1, world))}"

    def mine(kind: str) -> str:
        return f"{base}/{kind}{1 if rank == 0 else 2}"

    # copies of one checkpoint at other paths: one shared read
    copy = f"{base}/step1.safetensors" if rank == 0 else f"{base}/copy1.safetensors"
    same(fastckpt.load(copy, group=True), step_values(1))

    # two steps of a run: every way of sharing a read refuses, on every rank
    step = mine("step") + ".safetensors"
    zeros = {k: torch.zeros(64, 512) for k in step_values(1)}
    steps = (f"{base}/step1.safetensors", f"{base}/step2.safetensors", others, "CRC32C")

    def read_all() -> None:
        with fastckpt.open(step, group=True) as r:
            r.read()

    def verify_all() -> None:
        with fastckpt.open(step, group=True) as r:
            r.verify()

    for attempt in (
        lambda: fastckpt.load(step, group=True),
        lambda: fastckpt.load_into(zeros, step, group=True),
        read_all,
        verify_all,
    ):
        _refused(rank, attempt, *steps)
    assert all(not t.any() for t in zeros.values())  # nothing read into the model

    # a sharded directory: the shard that differs, in both directories
    with open(f"{base}/sharded1/model.safetensors.index.json") as f:
        shard = json.load(f)["weight_map"]["layers.5.weight"]
    _refused(
        rank,
        lambda: fastckpt.load(mine("sharded"), group=True),
        f"shard {shard}",
        f"{base}/sharded1/{shard}",
        f"{base}/sharded2/{shard}",
    )

    # incremental files: the file of the chain that differs
    incremental = mine("incremental") + ".safetensors"
    _refused(
        rank,
        lambda: fastckpt.load(incremental, group=True),
        "chain file 1",
        f"{base}/incremental1.safetensors",
        f"{base}/incremental2.safetensors",
    )

    # files without checksums: their whole headers compared (their metadata differs here)
    plain = mine("plain") + ".safetensors"
    _refused(
        rank,
        lambda: fastckpt.load(plain, group=True),
        f"{base}/plain1.safetensors",
        f"{base}/plain2.safetensors",
        "headers differ",
    )

    # a file saved over the path after rank 0 opened it, before the others did
    path = f"{base}/replaced.safetensors"
    reader = fastckpt.open(path) if rank == 0 else None
    dist.barrier()
    if rank == 0:
        fastckpt.save(step_values(2), path)
    dist.barrier()
    if reader is None:
        reader = fastckpt.open(path)
    inode = os.fstat(reader.storage.local_file().fd).st_ino
    inodes = [None] * world
    dist.all_gather_object(inodes, inode)
    assert len(set(inodes)) == 2, inodes
    shared = GroupReader(reader, checkpoint_group())
    named = (path, others, f"inode {inodes[0]}", f"inode {inodes[-1]}")
    _refused(rank, lambda: fastckpt.load(reader, group=True), *named)
    _refused(rank, shared.verify, *named)
    _refused(rank, lambda: read_into_shared(zeros, reader, shared.group), *named)
    assert all(not t.any() for t in zeros.values())
    reader.close()

    # a sharded directory removed and saved again after rank 0 opened it
    directory = f"{base}/resaved"
    reader = fastckpt.open(directory) if rank == 0 else None
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory)
        fastckpt.save(step_values(2), directory, max_shard_size=128 << 10)
    dist.barrier()
    if reader is None:
        reader = fastckpt.open(directory)
    _refused(
        rank,
        lambda: fastckpt.load(reader, group=True),
        f"shard {shard}",
        f"{directory}/{shard}",
        others,
    )
    reader.close()


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
