"""Open descriptors stay bounded whatever the number of files: sharded saves, loads and
opens of 5,000 shards, and a one-process load of a 1,024-rank DCP checkpoint, each in a
child process whose limit on open files is 256 (a save or load that opened every file at
once would fail with EMFILE). A thread of the child counts ``/proc/self/fd`` throughout
and the test checks the peaks it saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd"
)

#: The child's limit on open files (soft and hard): a quarter of the common 1024.
LIMIT = 256
#: Readers keep at most this many files open (fastckpt.config.open_files' default) and
#: each holds at most two descriptors (buffered and O_DIRECT).
OPEN_FILES = 64

_PRELUDE = """
    import json, os, resource, sys, threading, time
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
    import torch

    peak = [0]

    def count():
        return len(os.listdir("/proc/self/fd"))

    def sample():  # the most descriptors open at once while a step runs
        while True:
            peak[0] = max(peak[0], count())
            time.sleep(0.0005)

    threading.Thread(target=sample, daemon=True).start()
    figures = {{}}

    def step(name, work):
        peak[0] = 0
        start = time.perf_counter()
        result = work()
        figures[name] = {{"peak": max(peak[0], count()), "seconds": time.perf_counter() - start}}
        return result
"""


def _child(body: str, *args: str, setup: str = "") -> dict:
    """Runs ``setup`` then ``body`` after the prelude in a child limited to LIMIT open
    files; the figures it printed."""
    code = "".join(textwrap.dedent(part) for part in (_PRELUDE.format(limit=LIMIT), setup, body))
    code += "\nfigures['after'] = count()\nprint(json.dumps(figures))\n"
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_5000_shards_save_load_and_open_under_256_open_files(tmp_path):
    figures = _child(
        """
        import fastckpt
        directory = sys.argv[1]
        state = {f"t{i:05d}": torch.full((4,), float(i)) for i in range(5000)}
        figures["before"] = count()
        step("save", lambda: fastckpt.save(state, directory, max_shard_size=16))
        figures["files"] = len(os.listdir(directory))
        loaded = step("load", lambda: fastckpt.load(directory))
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())

        def read_some():
            with fastckpt.open(directory) as reader:
                assert len(reader.keys()) == 5000
                for name in ("t04999", "t00000", "t02500"):
                    assert torch.equal(reader.get_tensor(name), state[name])
                assert torch.equal(reader.get_slice("t00007")[1:3], state["t00007"][1:3])
                assert reader.open_count <= 64

        step("open", read_some)
        """,
        str(tmp_path / "shards"),
    )
    assert figures["files"] == 5001  # 5,000 shards and the index
    base = figures["before"]
    assert figures["save"]["peak"] <= base + 32, figures  # the set's lock + files being written
    for name in ("load", "open"):
        assert figures[name]["peak"] <= base + 2 * OPEN_FILES + 32, figures
    assert figures["after"] <= base + 4, figures  # every shard closed again


_FAKE_RANKS = """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from fastckpt.dcp import FastCkptWriter, load_full

    def write_ranks(path, ranks):
        # One process plays every rank of a save: each rank plans its own state (a tensor
        # and a pickled int of its own), the coordinator plans globally, then each rank
        # writes its file and the coordinator publishes the metadata.
        writer = FastCkptWriter(path)
        planners, plans = [], []
        for rank in range(ranks):
            planner = DefaultSavePlanner()
            state = {f"w{rank}": torch.full((4,), float(rank)), f"n{rank}": rank}
            planner.set_up_planner(state, is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank)
            planners.append(planner)
            plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        plans, metadata = planners[0].create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
        results = []
        for rank in range(ranks):
            writer.set_up_storage_writer(rank == 0, rank=rank)
            plan = planners[rank].finish_plan(plans[rank])
            results.append(writer.write_data(plan, planners[rank]).wait())
        writer.set_up_storage_writer(True, rank=0)
        writer.finish(metadata, results)
"""


def test_a_1024_rank_dcp_checkpoint_loads_under_256_open_files(tmp_path):
    figures = _child(
        """
        directory = sys.argv[1]
        figures["before"] = count()
        step("save", lambda: write_ranks(directory, 1024))
        figures["files"] = len([n for n in os.listdir(directory) if n.endswith(".safetensors")])
        state = step("load", lambda: load_full(directory))
        assert len(state) == 2048
        for rank in (0, 511, 1023):
            assert torch.equal(state[f"w{rank}"], torch.full((4,), float(rank)))
            assert state[f"n{rank}"] == rank
        """,
        str(tmp_path / "dcp"),
        setup=_FAKE_RANKS,
    )
    assert figures["files"] == 1024
    base = figures["before"]
    assert figures["save"]["peak"] <= base + 32, figures
    assert figures["load"]["peak"] <= base + 2 * OPEN_FILES + 32, figures
    assert figures["after"] <= base + 4, figures


def test_a_shard_replaced_after_opening_is_named_not_read_by_the_old_header(tmp_path):
    """A shard closed by the bounded cache and replaced before it is opened again raises
    FileNotFoundError naming it: another file's bytes are never read by the old header."""
    import torch

    import fastckpt
    from fastckpt.config import set_defaults

    state = {f"t{i}": torch.full((4,), float(i)) for i in range(4)}
    fastckpt.save(state, tmp_path, max_shard_size=16)
    set_defaults(open_files=1)
    try:
        with fastckpt.open(tmp_path) as reader:
            assert reader.open_count == 1
            first = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))[0]
            fastckpt.save({"t0": torch.zeros(8)}, tmp_path / "other.safetensors")
            os.replace(tmp_path / "other.safetensors", tmp_path / first)
            with pytest.raises(FileNotFoundError, match="replaced") as caught:
                reader.get_tensor("t0")
            assert caught.value.filename == str(tmp_path / first)
            assert torch.equal(reader.get_tensor("t3"), state["t3"])
    finally:
        set_defaults(open_files=None)


def _shard_of(directory, name: str):
    """The shard file of a sharded directory that holds tensor ``name``."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def _steps():
    import torch

    old = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    return old, {k: v + 100 for k, v in old.items()}


@pytest.mark.parametrize("checksum", [True, False])
def test_a_sharded_directory_saved_again_is_refused_not_read_by_the_old_headers(tmp_path, checksum):
    """The directory removed and saved again with the same shapes (the file system may hand
    the freed inode numbers out again): every shard the bounded cache closed raises when it
    is read, naming it and saying to open the checkpoint again; no new byte is returned."""
    import shutil

    import torch

    import fastckpt
    from fastckpt.config import set_defaults

    old, new = _steps()
    directory = tmp_path / "ckpt"
    fastckpt.save(old, directory, max_shard_size=4096, checksum=checksum)
    set_defaults(open_files=1)
    try:
        with fastckpt.open(directory) as reader:
            for name in old:  # each opened and closed again; t3's shard is left open
                assert torch.equal(reader.get_tensor(name), old[name])
            shutil.rmtree(directory)
            fastckpt.save(new, directory, max_shard_size=4096, checksum=checksum)
            # the shard still open reads the file it opened (removed, alive while open)
            assert torch.equal(reader.get_tensor("t3"), old["t3"])
            for name in ("t0", "t1", "t2", "t3"):
                with pytest.raises(FileNotFoundError, match="since the checkpoint was opened"):
                    reader.get_tensor(name)
            with pytest.raises(FileNotFoundError, match="open the checkpoint again") as caught:
                reader.read(["t1"])
            assert caught.value.filename == str(_shard_of(directory, "t1"))
        with fastckpt.open(directory) as reader:  # opened again: the new checkpoint
            assert all(torch.equal(reader.get_tensor(n), new[n]) for n in new)
    finally:
        set_defaults(open_files=None)


@pytest.mark.parametrize("checksum", [True, False])
def test_a_shard_rewritten_in_place_is_refused_not_read_by_its_old_header(tmp_path, checksum):
    """One shard overwritten in place (same inode, same size; without checksums even the same
    header) while a reader holds the directory: reading it once the cache closed it raises,
    naming it; the other shards read as before."""
    import time

    import torch

    import fastckpt
    from fastckpt.config import set_defaults

    old, new = _steps()
    fastckpt.save(old, tmp_path / "ckpt", max_shard_size=4096, checksum=checksum)
    fastckpt.save(new, tmp_path / "new", max_shard_size=4096, checksum=checksum)
    shard = _shard_of(tmp_path / "ckpt", "t0")
    set_defaults(open_files=1)
    try:
        with fastckpt.open(tmp_path / "ckpt") as reader:
            for name in old:  # t0's shard is closed again by the time t3's is read
                assert torch.equal(reader.get_tensor(name), old[name])
            inode = shard.stat().st_ino
            time.sleep(0.05)  # file times tick at the kernel's clock tick: let one pass
            with open(shard, "r+b") as f:
                f.write(_shard_of(tmp_path / "new", "t0").read_bytes())
            assert shard.stat().st_ino == inode
            with pytest.raises(FileNotFoundError, match="changed in place") as caught:
                reader.get_tensor("t0")
            assert caught.value.filename == str(shard)
            assert "open the checkpoint again" in str(caught.value)
            for name in ("t1", "t2", "t3"):
                assert torch.equal(reader.get_tensor(name), old[name])
    finally:
        set_defaults(open_files=None)


def test_reads_of_more_files_than_the_bound_wait_for_a_free_reader(tmp_path):
    """Eight threads reading eight files through a cache of two: never more than two open
    (a read of another file waits for a lease to end), each read gets its own file, and a
    read nested in another (one thread, two files) opens past the bound instead of waiting
    on itself."""
    import concurrent.futures
    import time

    import torch

    import fastckpt
    from fastckpt.checkpoint.open_readers import ReaderCache
    from fastckpt.checkpoint.read import open_checkpoint

    paths = [str(tmp_path / f"{i}.safetensors") for i in range(8)]
    for i, path in enumerate(paths):
        fastckpt.save({"x": torch.full((4,), float(i))}, path)
    cache = ReaderCache(open_checkpoint, limit=2)
    seen = []

    def read(i: int) -> float:
        def work(reader) -> float:
            seen.append(cache.open_count)
            time.sleep(0.01)  # the others' reads overlap this one
            return reader.get_tensor("x")[0].item()

        return cache.call(paths[i], work)

    order = list(range(8)) * 3
    single = ReaderCache(open_checkpoint, limit=1)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(read, order)) == [float(i) for i in order]
        assert max(seen) <= 2, seen

        def first(a) -> list[float]:
            return single.call(paths[5], lambda b: [r.get_tensor("x")[0].item() for r in (a, b)])

        assert single.call(paths[0], first) == [0.0, 5.0]
        assert single.open_count == 1
    finally:
        cache.close()
        single.close()


def test_an_8_shard_load_fits_a_soft_limit_of_20_open_files(tmp_path):
    """The cache's bound follows the soft limit on open files, read when it is used: a load
    and reads of an 8-shard directory in a process whose soft limit was lowered to 20 after
    it started (EMFILE if every shard were kept open)."""
    import torch

    import fastckpt

    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(8)}
    fastckpt.save(state, tmp_path / "ckpt", max_shard_size=4096)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 8
    code = textwrap.dedent(
        """
        import os, resource, sys
        import torch, fastckpt

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (20, hard))
        directory = sys.argv[1]
        loaded = fastckpt.load(directory)
        assert sorted(loaded) == [f"t{i}" for i in range(8)]
        assert all(torch.equal(v, torch.full((1024,), float(k[1:]))) for k, v in loaded.items())
        with fastckpt.open(directory) as reader:
            assert reader.open_count <= 4, reader.open_count
            assert torch.equal(reader.get_tensor("t0"), loaded["t0"])
            assert all(torch.equal(reader.read()[k], v) for k, v in loaded.items())
            assert reader.open_count <= 4, reader.open_count
        print("fds", len(os.listdir("/proc/self/fd")))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FASTCKPT_NO_PROGRESS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("fds"), done.stdout


def test_a_group_member_lives_while_its_anchor_is_locked(tmp_path):
    """A staged file that holds no descriptor is kept alive by its set's one lock: cleaners
    leave it while the writer lives and remove the whole set once the writer is gone."""
    from fastckpt.io import commit, commit_set

    files = commit_set.CommitSet(tmp_path)
    anchor, member = files.stage("a.bin"), files.stage("b.bin")
    for out in (anchor, member):
        out.file.pwrite_all(b"data", 0)
        out.make_durable()
    assert member.member and not anchor.member
    assert member._lock_fd < 0 and anchor._lock_fd >= 0
    assert commit.remove_stale_temporaries(str(tmp_path / "b.bin")) == []
    assert commit_set.remove_unreferenced(str(tmp_path), lambda n: n.endswith(".bin"), set()) == []
    os.close(anchor._lock_fd)  # the writer is gone: its lock with it
    anchor._lock_fd = -1
    removed = commit_set.remove_unreferenced(str(tmp_path), lambda n: n.endswith(".bin"), set())
    assert sorted(removed) == sorted(os.path.basename(out.tmp_path) for out in (anchor, member))
    assert os.listdir(tmp_path) == []
    files.abort()  # nothing left to remove


def test_open_files_is_configured_like_every_setting(monkeypatch):
    from fastckpt import config

    monkeypatch.setenv("FASTCKPT_OPEN_FILES", "16")
    assert config.open_files() == 16 and config.open_files(4) == 4
    monkeypatch.setenv("FASTCKPT_OPEN_FILES", "many")
    with pytest.raises(ValueError, match="FASTCKPT_OPEN_FILES"):
        config.open_files()
    with pytest.raises(ValueError, match="positive int"):
        config.open_files(0)


def test_a_publish_keeps_a_concurrent_sets_closed_files(tmp_path):
    """A set staged with its files closed survives another set's publish (whose clean-up
    removes abandoned temporaries) and then publishes whole: the later publisher wins."""
    import json

    from fastckpt.io import commit_set

    def referenced() -> set[str]:
        try:
            return set(json.loads((tmp_path / "MARKER").read_text()))
        except FileNotFoundError:
            return set()

    def publish(names: list[str]) -> None:
        commit_set.write_atomically(tmp_path / "MARKER", json.dumps(names).encode())

    def belongs(name: str) -> bool:
        return name.startswith("part")

    def fresh(count: int):
        return lambda taken: [commit_set.fresh_name("part", ".bin", taken) for _ in range(count)]

    with commit_set.CommitSet(tmp_path) as slow:
        for i in range(50):
            out = slow.stage(f"part{i}.bin")
            out.file.pwrite_all(b"slow%d" % i, 0)
            out.make_durable()
        with commit_set.CommitSet(tmp_path) as fast:
            out = fast.stage("part0.bin")
            out.file.pwrite_all(b"fast", 0)
            fast.publish(fresh(1), publish, referenced, belongs)
        assert len([n for n in os.listdir(tmp_path) if n.endswith(".tmp")]) == 50
        names = slow.publish(fresh(50), publish, referenced, belongs)
    assert referenced() == set(names)
    assert sorted(os.listdir(tmp_path)) == sorted([*names, "MARKER"])
    assert [(tmp_path / n).read_bytes() for n in names] == [b"slow%d" % i for i in range(50)]
