"""The multi-file commit (fastckpt.io.commit_set) and the sharded saves built on it.

Every test uses real files and real processes: a second save that the kernel stops with
RLIMIT_FSIZE, readers and writers in separate processes, and SIGKILL at each step of a
publish (the child kills itself at the chosen system call, so each crash point is hit).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import fastckpt  # noqa: E402
from fastckpt.integrations import hf_shards  # noqa: E402
from fastckpt.io import commit_set  # noqa: E402
from fastckpt.io.commit import AtomicFile  # noqa: E402

INDEX = hf_shards.INDEX_NAME


def _run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _state(value: float, count: int = 6, numel: int = 2048) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((numel,), float(value)) for i in range(count)}


def _generation(directory: Path) -> float:
    """The one value every tensor of a load carries; fails on a mix of saves."""
    loaded = fastckpt.load(directory)
    values = {float(t[0]) for t in loaded.values()} | {
        float(t[-1]) for t in loaded.values() if t.numel()
    }
    assert len(values) == 1, f"a load mixes saves: {sorted(values)}"
    return values.pop()


def _shard_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if hf_shards._belongs(n) or ".tmp" in n)


# --------------------------------------------------------------------------- the module


def _marker_set(directory: Path):
    """A small set kind: files ``part-*.bin`` listed by a JSON marker ``MARKER``."""

    def referenced() -> set[str]:
        try:
            return set(json.loads((directory / "MARKER").read_bytes()))
        except FileNotFoundError:
            return set()

    def publish(names: list[str]) -> None:
        commit_set.write_atomically(directory / "MARKER", json.dumps(names).encode())

    def belongs(name: str) -> bool:
        return name.startswith("part-") and name.endswith(".bin")

    return referenced, publish, belongs


def _commit(directory: Path, payloads: list[bytes], **options) -> list[str]:
    referenced, publish, belongs = _marker_set(directory)
    with commit_set.CommitSet(directory, **options) as files:
        for i, payload in enumerate(payloads):
            out = files.stage(f"part-{i}.bin", direct=False)
            out.file.pwrite_all(payload, 0)
        return files.publish(
            lambda taken: [
                commit_set.fresh_name(f"part-{i}", ".bin", taken) for i in range(len(payloads))
            ],
            publish,
            referenced,
            belongs,
        )


def test_publish_replaces_the_set_and_removes_the_old_files(tmp_path):
    first = _commit(tmp_path, [b"a", b"b"])
    second = _commit(tmp_path, [b"c"])
    assert not set(first) & set(second)
    assert sorted(os.listdir(tmp_path)) == sorted(["MARKER", *second])
    assert (tmp_path / second[0]).read_bytes() == b"c"


def test_failed_staging_leaves_the_old_set_and_no_new_file(tmp_path):
    first = _commit(tmp_path, [b"a", b"b"])
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(RuntimeError, match="disk on fire"):
        with commit_set.CommitSet(tmp_path) as files:
            files.stage("part-0.bin", direct=False).file.pwrite_all(b"new", 0)
            raise RuntimeError("disk on fire")
    assert sorted(os.listdir(tmp_path)) == before
    assert json.loads((tmp_path / "MARKER").read_bytes()) == first


def test_failed_publish_step_removes_the_renamed_files(tmp_path):
    first = _commit(tmp_path, [b"a"])
    referenced, _, belongs = _marker_set(tmp_path)

    def failing_step(names: list[str]) -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "MARKER"))

    with commit_set.CommitSet(tmp_path) as files:
        files.stage("part-0.bin", direct=False).file.pwrite_all(b"new", 0)
        with pytest.raises(OSError, match="No space"):
            files.publish(
                lambda taken: [commit_set.fresh_name("part-0", ".bin", taken)],
                failing_step,
                referenced,
                belongs,
            )
    assert sorted(os.listdir(tmp_path)) == sorted(["MARKER", *first])


def test_clean_up_spares_live_writers_and_removes_dead_ones(tmp_path):
    dead = tmp_path / "part-9.bin.0123456789ab.tmp"
    dead.write_bytes(b"left by a killed writer")
    referenced, _, belongs = _marker_set(tmp_path)
    live = AtomicFile(tmp_path / "part-5.bin", direct=False)  # holds its lock
    try:
        _commit(tmp_path, [b"x"])
        assert not dead.exists()
        assert os.path.exists(live.tmp_path)
    finally:
        live.abort()


def test_read_only_file_of_the_set_is_refused_unless_asked(tmp_path):
    first = _commit(tmp_path, [b"a"])
    os.chmod(tmp_path / first[0], 0o444)
    with pytest.raises(PermissionError, match="read-only") as info:
        _commit(tmp_path, [b"b"])
    assert info.value.filename == str(tmp_path / first[0])
    assert sorted(os.listdir(tmp_path)) == sorted(["MARKER", *first])
    second = _commit(tmp_path, [b"b"], overwrite_readonly=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["MARKER", *second])


# --------------------------------------------------------------------------- single files


def test_save_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    target = tmp_path / "x.safetensors"
    fastckpt.save({"w": torch.ones(3)}, target)
    os.chmod(target, 0o600)
    fastckpt.save({"w": torch.zeros(3)}, target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert fastckpt.load(target)["w"].sum() == 0


def test_save_refuses_a_read_only_file_unless_asked(tmp_path):
    target = tmp_path / "x.safetensors"
    fastckpt.save({"w": torch.ones(3)}, target)
    os.chmod(target, 0o444)
    with pytest.raises(PermissionError, match="overwrite_readonly") as info:
        fastckpt.save({"w": torch.zeros(3)}, target)
    assert info.value.filename == str(target)
    assert fastckpt.load(target)["w"].sum() == 3
    assert os.listdir(tmp_path) == ["x.safetensors"]
    fastckpt.save({"w": torch.zeros(3)}, target, overwrite_readonly=True)
    assert fastckpt.load(target)["w"].sum() == 0
    assert stat.S_IMODE(target.stat().st_mode) == 0o444


def test_sharded_save_refuses_read_only_shards(tmp_path):
    fastckpt.save(_state(1), tmp_path, max_shard_size="20KB")
    shard = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-"))[0]
    os.chmod(tmp_path / shard, 0o444)
    with pytest.raises(PermissionError, match="read-only"):
        fastckpt.save(_state(2), tmp_path, max_shard_size="20KB")
    assert _generation(tmp_path) == 1.0
    fastckpt.save(_state(2), tmp_path, max_shard_size="20KB", overwrite_readonly=True)
    assert _generation(tmp_path) == 2.0


class _Wrapper(torch.Tensor):
    """A wrapper subclass with no storage of its own, as DTensor is."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, _Wrapper) else x  # noqa: E731
        out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return _Wrapper(out) if isinstance(out, torch.Tensor) else out


def test_tensor_subclass_is_refused_naming_the_key(tmp_path):
    state = {"a": torch.ones(4), "b.weight": _Wrapper(torch.ones(4))}
    with pytest.raises(TypeError, match=r"'b\.weight' is a _Wrapper.*full_tensor"):
        fastckpt.save(state, tmp_path / "sharded", max_shard_size="1KB")
    with pytest.raises(TypeError, match=r"_Wrapper.*b\.weight"):
        fastckpt.save(state, tmp_path / "one.safetensors")
    fastckpt.save({"p": torch.nn.Parameter(torch.ones(2))}, tmp_path / "p", max_shard_size="1KB")


def test_dtensor_in_a_sharded_save_names_the_key(tmp_path):
    out = _run(
        """
        import sys, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor
        import fastckpt
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        state = {"w": distribute_tensor(torch.ones(8), mesh)}
        try:
            fastckpt.save(state, sys.argv[2], max_shard_size="1KB")
        except TypeError as exc:
            print("TypeError:", exc)
        dist.destroy_process_group()
        """,
        tmp_path / "store",
        tmp_path / "ckpt",
    )
    assert "TypeError: entry 'w' is a DTensor" in out.stdout, out.stdout + out.stderr[-2000:]


# --------------------------------------------------------------------------- sharded saves

_SAVE_WITH_FSIZE_LIMIT = """
import resource, signal, sys, torch, fastckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
state = {f"layers.{i}.weight": torch.full((2048,), 2.0) for i in range(6)}
state["big"] = torch.full((64 << 10,), 2.0)  # 256 KiB: its shard passes the limit
try:
    fastckpt.save(state, sys.argv[1], max_shard_size="20KB")
    print("saved")
except OSError as exc:
    print("OSError", exc.errno)
"""


def test_failed_second_save_leaves_the_first_set_loading_exactly(tmp_path):
    first = _state(1)
    first["big"] = torch.full((64 << 10,), 1.0)
    fastckpt.save(first, tmp_path, max_shard_size="20KB")
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    out = _run(_SAVE_WITH_FSIZE_LIMIT, tmp_path, 128 << 10)
    assert out.stdout.strip() == "OSError 27", out.stdout + out.stderr[-2000:]  # EFBIG
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    assert after == before  # every old file as it was, no new file left
    loaded = fastckpt.load(tmp_path)
    assert sorted(loaded) == sorted(first) and all(torch.equal(loaded[k], first[k]) for k in first)


def test_resave_over_a_set_uses_names_it_does_not_reference(tmp_path):
    fastckpt.save(_state(1), tmp_path, max_shard_size="20KB")
    first = set(json.loads((tmp_path / INDEX).read_text())["weight_map"].values())
    assert first == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    fastckpt.save(_state(2), tmp_path, max_shard_size="20KB")
    second = set(json.loads((tmp_path / INDEX).read_text())["weight_map"].values())
    assert not first & second
    assert all(hf_shards._SHARD_PATTERN.fullmatch(n) for n in second)
    assert _shard_files(tmp_path) == sorted(second | {INDEX})
    assert _generation(tmp_path) == 2.0
    fastckpt.save(_state(3, count=1), tmp_path, max_shard_size="20KB")  # one file: no index
    assert _shard_files(tmp_path) == ["model.safetensors"]
    fastckpt.save(_state(4), tmp_path, max_shard_size="20KB")
    assert _generation(tmp_path) == 4.0 and "model.safetensors" not in os.listdir(tmp_path)


_WRITER = """
import sys, time, torch, fastckpt
directory, writer, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
count = 4 + writer  # writers differ in shard counts, so in names too
end, generation, last = time.monotonic() + seconds, 0, None
while time.monotonic() < end:
    generation += 1
    value = float(writer * 100000 + generation)
    state = {f"layers.{i}.weight": torch.full((32768,), value) for i in range(count)}
    # one shard at a time: each is a separate commit, so the window for a mix is wide
    fastckpt.save(state, directory, max_shard_size="300KB", parallel=1)
    last = value
print(generation, last, flush=True)
"""

_READER = """
import sys, time, fastckpt
import os
directory, stop = sys.argv[1], sys.argv[2]
fastckpt.load(directory)  # the first load starts the I/O machinery
print("ready", flush=True)
whole, mixed, missing = 0, 0, 0
while not os.path.exists(stop):
    try:
        loaded = fastckpt.load(directory)
    except FileNotFoundError:  # its set was removed under it by a newer publish
        missing += 1
        continue
    values = {float(t[0]) for t in loaded.values()} | {float(t[-1]) for t in loaded.values()}
    if len(values) == 1:
        whole += 1
    else:
        mixed += 1
        print("mixed", sorted(values), file=sys.stderr)
print(whole, mixed, missing, flush=True)
"""


def _spawn(code: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_reader_during_resaves_sees_only_whole_sets(tmp_path):
    fastckpt.save(_state(0.0, count=5, numel=32768), tmp_path, max_shard_size="300KB")
    stop = tmp_path.parent / f"{tmp_path.name}.stop"
    reader = _spawn(_READER, tmp_path, stop)
    assert reader.stdout.readline() == "ready\n"
    writer = _spawn(_WRITER, tmp_path, 1, 3)
    w_out, w_err = writer.communicate(timeout=120)
    stop.touch()
    r_out, r_err = reader.communicate(timeout=120)
    assert writer.returncode == 0 and reader.returncode == 0, w_err[-2000:] + r_err[-2000:]
    whole, mixed, _missing = map(int, r_out.split())
    assert mixed == 0, r_err[-2000:]
    assert whole > 0 and int(w_out.split()[0]) > 1
    assert _generation(tmp_path) == float(w_out.split()[1])


@pytest.mark.slow
def test_two_writers_into_one_directory_end_with_one_whole_set(tmp_path):
    writers = [_spawn(_WRITER, tmp_path, w, 3) for w in (1, 2)]
    results = [w.communicate(timeout=120) for w in writers]
    for w, (_, err) in zip(writers, results):
        assert w.returncode == 0, err[-3000:]  # every save of both reported success
    lasts = {float(out.split()[1]) for out, _ in results}
    final = _generation(tmp_path)
    assert final in lasts  # one writer's last save, whole
    index = json.loads((tmp_path / INDEX).read_text())
    assert _shard_files(tmp_path) == sorted(set(index["weight_map"].values()) | {INDEX})


_KILL_AT = """
import os, signal, sys, torch, fastckpt
directory, call, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
real, seen = getattr(os, call), [0]
def dying(*args, **kwargs):
    name = os.path.basename(str(args[-1] if call == "replace" else args[0]))
    if name.startswith("model"):
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9, at this very step
    return real(*args, **kwargs)
setattr(os, call, dying)
state = {f"layers.{i}.weight": torch.full((2048,), 2.0) for i in range(5)}
fastckpt.save(state, directory, max_shard_size="20KB")
print("finished")
"""


@pytest.mark.parametrize(
    "call, nth",
    [("replace", 1), ("replace", 3), ("replace", 4), ("unlink", 1), ("unlink", 3)],
    ids=["first-rename", "third-rename", "index-rename", "first-removal", "third-removal"],
)
def test_kill_during_publish_or_removal_leaves_a_whole_set(tmp_path, call, nth):
    fastckpt.save(_state(1, count=8), tmp_path, max_shard_size="20KB")  # 4 shards
    out = _run(_KILL_AT, tmp_path, call, nth)
    assert out.returncode == -9, out.stdout + out.stderr[-2000:]
    assert _generation(tmp_path) in (1.0, 2.0)
    fastckpt.save(_state(3), tmp_path, max_shard_size="20KB")  # cleans up
    index = json.loads((tmp_path / INDEX).read_text())
    assert _shard_files(tmp_path) == sorted(set(index["weight_map"].values()) | {INDEX})
    assert _generation(tmp_path) == 3.0


@pytest.mark.slow
def test_kill_at_random_times_during_sharded_saves(tmp_path):
    import random

    rng = random.Random(0)
    fastckpt.save(_state(0.0, count=5, numel=32768), tmp_path, max_shard_size="300KB")
    seen = set()
    for _ in range(8):
        before = (tmp_path / INDEX).read_bytes()
        writer = _spawn(_WRITER, tmp_path, 1, 60)
        deadline = time.monotonic() + 60
        while (tmp_path / INDEX).read_bytes() == before and time.monotonic() < deadline:
            time.sleep(0.01)  # until its first save is published: then it saves in a loop
        time.sleep(rng.uniform(0.0, 0.3))
        writer.kill()
        writer.communicate()
        seen.add(_generation(tmp_path))
    assert len(seen) > 1


def test_index_mode_is_kept_across_resaves(tmp_path):
    fastckpt.save(_state(1), tmp_path, max_shard_size="20KB")
    os.chmod(tmp_path / INDEX, 0o600)
    fastckpt.save(_state(2), tmp_path, max_shard_size="20KB")
    assert stat.S_IMODE((tmp_path / INDEX).stat().st_mode) == 0o600


def test_url_resave_publishes_by_the_index_and_a_failure_keeps_the_old_set():
    import uuid

    import fsspec

    url = f"memory://commit-set-{uuid.uuid4().hex}/model"
    fs = fsspec.filesystem("memory")
    listing = lambda: sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False))  # noqa: E731
    fastckpt.save(_state(1), url, max_shard_size="20KB")
    first = listing()
    assert first == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX]
    broken = _state(2)
    broken["layers.5.weight"] = torch.zeros(2048, device="meta")  # fails the last shard
    with pytest.raises(TypeError):
        fastckpt.save(broken, url, max_shard_size="20KB", parallel=1)
    assert listing() == first
    assert {float(t[0]) for t in fastckpt.load(url).values()} == {1.0}
    fastckpt.save(_state(2), url, max_shard_size="20KB")
    second = listing()
    assert not set(first[:-1]) & set(second) and INDEX in second and len(second) == 4
    assert {float(t[0]) for t in fastckpt.load(url).values()} == {2.0}
