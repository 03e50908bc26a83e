"""fastckpt.save / load / open: round trips, interop with safetensors, commit, bad files."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import textwrap
from collections import OrderedDict

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import fastckpt
from fastckpt import _C, format
from fastckpt.checkpoint import dtypes
from tests.python_processes import run

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample(dtype: torch.dtype, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.randint(0, 1000, shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(-1).view(torch.uint8) if a.numel() else a,
            b.view(-1).view(torch.uint8) if b.numel() else b,
        )
    )


# ---- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips(tmp_path, dtype):
    sd = {"x": sample(dtype), "scalar": sample(dtype, ()), "empty": sample(dtype, (0, 4))}
    fastckpt.save(sd, tmp_path / "a.safetensors")
    back = fastckpt.load(tmp_path / "a.safetensors")
    assert set(back) == set(sd)
    for k in sd:
        assert same(back[k], sd[k]), k
    ref = safetensors.torch.load_file(str(tmp_path / "a.safetensors"))
    for k in sd:
        assert same(ref[k], sd[k]), k


def test_nested_training_state_round_trips_exactly(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "best": float("nan"),
        "limits": (float("inf"), -float("inf"), -0.0),
        "tags": ["a", None, True, 2**70],
        "empty": {},
    }
    fastckpt.save(state, tmp_path / "ckpt.safetensors")
    back = fastckpt.load(tmp_path / "ckpt.safetensors")
    assert type(back["model"]) is OrderedDict
    assert back["model"]._metadata == state["model"]._metadata
    assert list(back["optimizer"]["state"]) == list(state["optimizer"]["state"])  # int keys
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    for k, v in state["model"].items():
        assert same(back["model"][k], v)
    for i, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert same(back["optimizer"]["state"][i][k], v)
    assert back["epoch"] == 3 and math.isnan(back["best"])
    assert back["limits"] == state["limits"] and math.copysign(1, back["limits"][2]) == -1
    assert back["tags"] == state["tags"] and back["empty"] == {}
    # The restored state loads into fresh objects.
    model2 = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2)
    )
    model2.load_state_dict(back["model"])
    opt2 = torch.optim.AdamW(model2.parameters())
    opt2.load_state_dict(back["optimizer"])


def test_non_contiguous_and_views(tmp_path):
    base = torch.randn(64, 48)
    sd = {
        "t": base.t(),
        "strided": base[::3, 1::2],
        "expanded": torch.randn(1, 5).expand(4, 5),
        "conj_free": torch.randn(6),
    }
    fastckpt.save(sd, tmp_path / "v.safetensors")
    back = fastckpt.load(tmp_path / "v.safetensors")
    for k, v in sd.items():
        assert torch.equal(back[k], v) and back[k].is_contiguous()


def test_tied_tensors_come_back_shared(tmp_path):
    w = torch.randn(10, 4)
    state = {"embed.weight": w, "lm_head.weight": w, "other": torch.randn(3)}
    fastckpt.save(state, tmp_path / "tied.safetensors")
    back = fastckpt.load(tmp_path / "tied.safetensors")
    assert back["embed.weight"].data_ptr() == back["lm_head.weight"].data_ptr()
    assert torch.equal(back["lm_head.weight"], w)
    with fastckpt.open(tmp_path / "tied.safetensors") as r:
        assert set(r.keys()) == set(state)
        assert torch.equal(r.get_tensor("lm_head.weight"), w)
    # Stored under both names, so readers that know no aliases see every key; fastckpt
    # reads the bytes once (the tensors share them above).
    plain = safetensors.torch.load_file(str(tmp_path / "tied.safetensors"))
    assert set(plain) == set(state)
    assert torch.equal(plain["lm_head.weight"], w) and torch.equal(plain["embed.weight"], w)


def test_overlapping_views_are_stored_separately(tmp_path):
    base = torch.arange(20.0)
    state = {"a": base[0:10], "b": base[5:15]}
    fastckpt.save(state, tmp_path / "o.safetensors")
    back = fastckpt.load(tmp_path / "o.safetensors")
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
    assert safetensors.torch.load_file(str(tmp_path / "o.safetensors"))["b"].tolist() == list(
        range(5, 15)
    )


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 4).to_sparse(),
        lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.quint8),
        lambda: torch.empty(3, device="meta"),
    ],
    ids=["sparse", "quantized", "meta"],
)
def test_unsupported_tensors_raise_type_error(tmp_path, make):
    with pytest.raises(TypeError, match="x"):
        fastckpt.save({"x": make()}, tmp_path / "bad.safetensors")
    assert os.listdir(tmp_path) == []


def test_unsupported_object_names_where(tmp_path):
    class Thing:
        pass

    with pytest.raises(TypeError, match=r"optimizer.*Thing|Thing.*optimizer"):
        fastckpt.save({"optimizer": {"state": {0: {"x": Thing()}}}}, tmp_path / "bad.safetensors")


def test_allow_pickle_needs_weights_only_false(tmp_path):
    from fractions import Fraction

    fastckpt.save(
        {"w": torch.ones(2), "ratio": Fraction(1, 3)}, tmp_path / "p.safetensors", allow_pickle=True
    )
    with pytest.raises(fastckpt.WeightsOnlyError):
        fastckpt.load(tmp_path / "p.safetensors")
    back = fastckpt.load(tmp_path / "p.safetensors", weights_only=False)
    assert back["ratio"] == Fraction(1, 3)


_names = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12
)
_shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.dictionaries(_names, st.tuples(st.sampled_from(ALL_DTYPES), _shapes), max_size=8),
    st.integers(0, 2**16),
)
def test_generated_state_dicts(tmp_path, spec, seed):
    sd = {
        name: sample(dtype, shape, seed)
        for name, (dtype, shape) in spec.items()
        if name != "__metadata__"
    }
    path = tmp_path / "h.safetensors"
    fastckpt.save(sd, path)
    back = fastckpt.load(path)
    assert set(back) == set(sd)
    for k in sd:
        assert same(back[k], sd[k])
    ref = safetensors.torch.load_file(str(path))
    for k in sd:
        assert same(ref[k], sd[k])


# ---- layout and metadata ------------------------------------------------------------------


def test_layout_is_aligned_and_exact(tmp_path):
    sd = {
        "big": torch.randn(4096, 4),
        "odd": torch.randn(7),
        "bf": torch.randn(1024, 2).bfloat16(),
        "i8": torch.zeros(3, dtype=torch.int8),
    }
    path = tmp_path / "l.safetensors"
    fastckpt.save(sd, path, metadata={"step": "10"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0
    header = json.loads(raw[8 : 8 + n])
    data_size = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert len(raw) == 8 + n + data_size  # no trailing bytes
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        item = dtypes.itemsize(entry["dtype"])
        assert (8 + n + begin) % item == 0
        if (end - begin) % 4096 == 0 and end > begin:
            assert (8 + n + begin) % 4096 == 0
    meta = header["__metadata__"]
    assert meta["format"] == "pt" and meta["step"] == "10"
    crcs = json.loads(meta["fastckpt.crc32c"])
    for name, t in sd.items():
        data = t.contiguous().view(-1).view(torch.uint8)
        assert int(crcs[name], 16) == _C.crc32c(data.data_ptr(), data.numel())
    with fastckpt.open(path) as r:
        assert r.metadata() == {"format": "pt", "step": "10"}


def test_custom_alignment(tmp_path):
    fastckpt.save({"a": torch.randn(100)}, tmp_path / "x.safetensors", alignment=64)
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert (8 + struct.unpack("<Q", raw[:8])[0]) % 64 == 0
    assert torch.equal(
        fastckpt.load(tmp_path / "x.safetensors")["a"],
        safetensors.torch.load_file(str(tmp_path / "x.safetensors"))["a"],
    )


def test_metadata_errors(tmp_path):
    with pytest.raises(TypeError):
        fastckpt.save({"a": torch.ones(1)}, tmp_path / "x.safetensors", metadata={"k": 1})
    with pytest.raises(ValueError, match="reserved"):
        fastckpt.save(
            {"a": torch.ones(1)}, tmp_path / "x.safetensors", metadata={"fastckpt.x": "1"}
        )
    with open(os.devnull, "w") as handle, pytest.raises(TypeError, match="binary"):
        fastckpt.save({"a": torch.ones(1)}, handle)  # a file object, but a text one


# ---- interop ------------------------------------------------------------------------------


def test_safetensors_reads_fastckpt_with_safe_open(tmp_path):
    sd = {"a": torch.randn(300, 300), "b": torch.arange(17, dtype=torch.int16)}
    fastckpt.save(sd, tmp_path / "f.safetensors", metadata={"who": "me"})
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"a", "b"}
        assert f.metadata()["who"] == "me"
        for k in sd:
            assert torch.equal(f.get_tensor(k), sd[k])


def test_fastckpt_reads_safetensors_files(tmp_path):
    sd = {
        "z.last": torch.randn(33, 7),
        "a.first": torch.arange(5, dtype=torch.int8),
        "m": torch.randn(10).half(),
        "d": torch.randn(3).double(),
    }
    path = str(tmp_path / "s.safetensors")
    safetensors.torch.save_file(sd, path, metadata={"k": "v"})
    back = fastckpt.load(path)
    for k in sd:
        assert torch.equal(back[k], sd[k])
    with fastckpt.open(path) as r:
        assert r.metadata() == {"k": "v"} and not r.has_checksums
        assert torch.equal(r.get_tensor("m"), sd["m"])
        got = r.get_tensors(["d", "a.first"])
        assert torch.equal(got["d"], sd["d"]) and torch.equal(got["a.first"], sd["a.first"])
    with pytest.raises(fastckpt.NoChecksumsError, match="records no checksums"):
        fastckpt.load(path, verify=True)


def test_tensor_not_aligned_to_its_dtype_in_a_foreign_file(tmp_path):
    # A writer may place an f32 tensor at an odd offset; the reader must still return it.
    header = {
        "u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "f": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
    }
    blob = json.dumps(header).encode()
    values = torch.tensor([1.5, -2.0, 3.25])
    data = bytes([7]) + values.numpy().tobytes()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    back = fastckpt.load(path)
    assert torch.equal(back["f"], values) and back["u"].item() == 7


# ---- load options -------------------------------------------------------------------------


def test_keys_loads_only_those(tmp_path):
    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(10)}
    sd["alias"] = sd["t3"]
    fastckpt.save(sd, tmp_path / "k.safetensors")
    back = fastckpt.load(tmp_path / "k.safetensors", keys=["t7", "alias"])
    assert list(back) == ["t7", "alias"]
    assert back["t7"][0] == 7 and back["alias"][0] == 3
    with pytest.raises(KeyError, match="nope"):
        fastckpt.load(tmp_path / "k.safetensors", keys=["nope"])
    with pytest.raises(TypeError):
        fastckpt.load(tmp_path / "k.safetensors", keys="t1")


def test_map_location_forms(tmp_path):
    fastckpt.save({"a": torch.ones(3)}, tmp_path / "m.safetensors")
    p = tmp_path / "m.safetensors"
    for loc in [
        None,
        "cpu",
        torch.device("cpu"),
        {"cuda:0": "cpu"},
        lambda storage, location: storage,
    ]:
        assert torch.equal(fastckpt.load(p, map_location=loc)["a"], torch.ones(3))
    assert fastckpt.load(p, device="cpu")["a"].device.type == "cpu"
    with pytest.raises(ValueError, match="either"):
        fastckpt.load(p, map_location="cpu", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            fastckpt.load(p, device="cuda")


def test_pin_memory_locks_the_arena(tmp_path):
    fastckpt.save({"a": torch.randn(5000), "b": torch.randn(7)}, tmp_path / "p.safetensors")
    back = fastckpt.load(tmp_path / "p.safetensors", pin_memory=True)
    assert _C.is_locked(back["a"].data_ptr())
    plain = fastckpt.load(tmp_path / "p.safetensors")
    assert not _C.is_locked(plain["a"].data_ptr())


def test_loaded_tensors_share_one_arena_each_with_its_own_storage(tmp_path):
    fastckpt.save({"a": torch.randn(4096), "b": torch.randn(4096)}, tmp_path / "v.safetensors")
    back = fastckpt.load(tmp_path / "v.safetensors")
    assert abs(back["a"].data_ptr() - back["b"].data_ptr()) == 4096 * 4  # read side by side
    assert back["a"].untyped_storage().data_ptr() != back["b"].untyped_storage().data_ptr()


@pytest.mark.parametrize("engine_name", ["io_uring", "libaio", "threads"])
def test_every_engine_and_tmpfs(io_dir, engine_name):
    if not fastckpt.engines()[engine_name].available:
        pytest.skip(f"{engine_name} unavailable")
    sd = {"w": torch.randn(1024, 257), "b": torch.randn(3)}
    path = os.path.join(io_dir, "e.safetensors")
    fastckpt.save(sd, path, engine=engine_name, block_size=65536, intra_op_parallelism=2)
    back = fastckpt.load(path, engine=engine_name, verify=True)
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])


def test_small_staging_budget_streams_large_checkpoint(tmp_path):
    sd = {f"w{i}": torch.randn(1 << 20) for i in range(5)}  # 20 MiB through 2 MiB of staging
    fastckpt.save(sd, tmp_path / "s.safetensors", staging_bytes=2 << 20)
    back = fastckpt.load(tmp_path / "s.safetensors")
    for k in sd:
        assert torch.equal(back[k], sd[k])


# ---- open ---------------------------------------------------------------------------------


def test_open_reader(tmp_path):
    sd = {"w": torch.randn(20, 30), "b": torch.zeros(30, dtype=torch.bfloat16)}
    fastckpt.save({"model": sd, "step": 5}, tmp_path / "o.safetensors")
    with fastckpt.open(tmp_path / "o.safetensors") as r:
        assert set(r.keys()) == {"model/w", "model/b"}
        info = r.info("model/b")
        assert (info.dtype, info.shape, info.nbytes) == (torch.bfloat16, (30,), 60)
        assert info.offset % 2 == 0
        assert torch.equal(r.get_tensor("model/w"), sd["w"])
        both = r.get_tensors(["model/w", "model/b"])
        assert torch.equal(both["model/b"], sd["b"])
        assert r.has_checksums and r.verify() == []
        with pytest.raises(KeyError):
            r.get_tensor("missing")


# ---- checksums ----------------------------------------------------------------------------


def flip_byte_of(path, name: str) -> None:
    with fastckpt.open(path) as r:
        offset = r.info(name).offset
    with open(path, "r+b") as f:
        f.seek(offset + 1)
        b = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([b[0] ^ 0xFF]))


def test_damaged_tensor_is_named(tmp_path):
    path = tmp_path / "d.safetensors"
    fastckpt.save({"good": torch.randn(100), "bad": torch.randn(100)}, path)
    flip_byte_of(path, "bad")
    with pytest.raises(fastckpt.ChecksumError, match="'bad'") as info:
        fastckpt.load(path)
    assert info.value.tensor == "bad" and info.value.filename == str(path)
    assert fastckpt.load(path, verify=False)["good"].numel() == 100
    with fastckpt.open(path) as r:
        assert r.verify() == ["bad"]


def test_checksum_false_writes_none(tmp_path):
    fastckpt.save({"a": torch.ones(3)}, tmp_path / "n.safetensors", checksum=False)
    with fastckpt.open(tmp_path / "n.safetensors") as r:
        assert not r.has_checksums
    assert torch.equal(fastckpt.load(tmp_path / "n.safetensors")["a"], torch.ones(3))


# ---- atomic commit ------------------------------------------------------------------------


def test_failed_save_keeps_existing_checkpoint(tmp_path):
    path = tmp_path / "c.safetensors"
    fastckpt.save({"v": torch.ones(10)}, path)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        fastckpt.save({"v": torch.zeros(10), "late": {"deep": [1, 2, object()]}}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]


@pytest.mark.parametrize("reserve", [True, False], ids=["preallocated", "no-fallocate"])
def test_write_error_keeps_existing_checkpoint(tmp_path, reserve):
    # A real error from the kernel: the file-size limit fails a 16 MiB save with EFBIG, up
    # front when the file is preallocated, halfway through the data writes where the file
    # system cannot preallocate (simulated by skipping the reservation).
    path = tmp_path / "c.safetensors"
    fastckpt.save({"v": torch.ones(10)}, path)
    before = path.read_bytes()
    script = textwrap.dedent(f"""
        import errno, os, resource, signal, torch, fastckpt, fastckpt.io.commit
        if not {reserve!r}:
            fastckpt.io.commit.AtomicFile.reserve = lambda self, nbytes: None
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            fastckpt.save({{"v": torch.zeros(4 << 20)}}, {str(path)!r}, staging_bytes=4 << 20)
        except OSError as e:
            assert e.errno == errno.EFBIG, e
            assert e.filename and e.filename.endswith(".tmp"), e.filename
            print("failed as expected")
    """)
    out = run([sys.executable, "-c", script], timeout=120)
    assert "failed as expected" in out.stdout, out.stderr
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]


def test_saved_files_are_preallocated_in_one_go(tmp_path):
    # 8 MiB saved with 4 parallel direct writers: without the reservation ext4 allocates
    # blocks in completion order; with it the size and blocks are reserved before the first
    # write. (A small state written in order through the page cache is not reserved.)
    import fastckpt.io.commit

    sizes = []
    original = fastckpt.io.commit.AtomicFile.reserve

    def spy(self, nbytes):
        original(self, nbytes)
        st = os.stat(self.tmp_path)
        sizes.append((nbytes, st.st_size, st.st_blocks * 512))

    fastckpt.io.commit.AtomicFile.reserve = spy
    try:
        fastckpt.save(
            {"v": torch.zeros(2 << 20)},
            tmp_path / "p.safetensors",
            intra_op_parallelism=4,
            direct_io=True,
        )
        fastckpt.async_save({"v": torch.ones(3)}, tmp_path / "q.safetensors").result()
    finally:
        fastckpt.io.commit.AtomicFile.reserve = original
    assert len(sizes) == 2
    for nbytes, size, allocated in sizes:
        assert size == nbytes and allocated >= nbytes


def test_save_into_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        fastckpt.save({"a": torch.ones(1)}, tmp_path / "nope" / "x.safetensors")


# ---- bad files ----------------------------------------------------------------------------


def _file(tmp_path, header, data: bytes = b"", raw_length: int | None = None) -> str:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if raw_length is None else raw_length
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return str(path)


def _raw(tmp_path, content: bytes) -> str:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    return str(path)


BAD_FILES = {
    "not safetensors": lambda p: _raw(p, b"PK\x03\x04 zip file"),
    "empty": lambda p: _raw(p, b""),
    "header too large": lambda p: _file(p, b"{}", raw_length=format.HEADER_LIMIT + 1),
    "truncated header": lambda p: _file(p, b'{"a":', raw_length=1000),
    "bad json": lambda p: _file(p, b'{"a": nope}'),
    "out of range": lambda p: _file(
        p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8
    ),
    "overlapping": lambda p: _file(
        p,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    ),
    "unknown dtype": lambda p: _file(
        p, {"a": {"dtype": "F13", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "shape mismatch": lambda p: _file(
        p, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "truncated data": lambda p: _file(
        p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 15
    ),
    "huge shape": lambda p: _file(
        p, {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "bad alias": lambda p: _file(
        p,
        {
            "__metadata__": {"fastckpt.aliases": '{"x": "missing"}'},
            "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        },
        b"\0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_header_error(tmp_path, case):
    path = BAD_FILES[case](tmp_path)
    with pytest.raises(fastckpt.HeaderError) as info:
        fastckpt.load(path)
    assert path in str(info.value)
    with pytest.raises(fastckpt.HeaderError):
        fastckpt.open(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        fastckpt.load(tmp_path / "missing.safetensors")
    assert info.value.filename == str(tmp_path / "missing.safetensors")


def test_works_in_a_forked_child(tmp_path):
    # DataLoader workers are forked: the child must get its own I/O threads, not hang.
    fastckpt.save({"a": torch.ones(1000)}, tmp_path / "parent.safetensors")
    fastckpt.async_save({"a": torch.ones(10)}, tmp_path / "parent2.safetensors").result()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            back = fastckpt.load(tmp_path / "parent.safetensors")
            fastckpt.save({"b": back["a"] * 2}, tmp_path / "child.safetensors")
            fastckpt.async_save({"c": torch.zeros(3)}, tmp_path / "child2.safetensors").result()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert float(fastckpt.load(tmp_path / "child.safetensors")["b"][0]) == 2.0
