"""Tests of fastckpt.format (header codec and layout) and fastckpt.checkpoint.dtypes."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastckpt import format as fmt
from fastckpt.checkpoint import dtypes
from fastckpt.errors import HeaderError

DTYPES = sorted(fmt.ITEMSIZE)


# --------------------------------------------------------------------------- helpers


def parse_file(data: bytes) -> fmt.Header:
    """The whole read-side pipeline on an in-memory file."""
    length = fmt.parse_header_length(data[:8], len(data))
    header = fmt.parse_header(data[8 : 8 + length], len(data))
    fmt.split_metadata(header.metadata)
    return header


def raw_file(header: object, data: bytes = b"") -> bytes:
    """A file with ``header`` (a JSON-able object, or raw bytes) and ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype: str = "U8", shape: object = (2,), offsets: object = (0, 2)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


names = st.text(min_size=0, max_size=12).filter(lambda name: name != fmt.METADATA_KEY)
shapes = st.lists(st.integers(0, 40), max_size=3).map(tuple)
block_shapes = st.integers(1, 4).map(lambda blocks: (blocks * 64,))  # often fills blocks
specs_strategy = st.dictionaries(
    names, st.tuples(st.sampled_from(DTYPES), st.one_of(shapes, block_shapes)), max_size=12
).map(lambda table: [(name, dtype, shape) for name, (dtype, shape) in table.items()])
alignments = st.sampled_from([8, 16, 64, 256, 4096])


# --------------------------------------------------------------------------- dtypes


def test_dtype_table_matches_torch_and_safetensors():
    for name in fmt.ITEMSIZE:
        dtype = dtypes.to_torch(name)
        assert dtype.itemsize == fmt.ITEMSIZE[name] == dtypes.itemsize(name)
        assert dtypes.to_safetensors(dtype) == name


def test_dtype_errors():
    with pytest.raises(TypeError, match="complex128"):
        dtypes.to_safetensors(torch.complex128)
    with pytest.raises(HeaderError, match="F6_E2M3.*no torch dtype"):
        dtypes.to_torch("F6_E2M3")
    with pytest.raises(HeaderError, match="unknown dtype 'F2'"):
        dtypes.to_torch("F2")
    with pytest.raises(HeaderError, match="nope"):
        dtypes.itemsize("nope")


# --------------------------------------------------------------------------- layout


@given(specs=specs_strategy, alignment=alignments)
def test_layout_properties(specs, alignment):
    entries = fmt.plan_layout(specs, alignment)
    assert sorted(e.name for e in entries) == sorted(name for name, _, _ in specs)
    offset = 0
    for e in entries:
        assert e.begin == offset, "tensors must be contiguous"
        assert e.begin % fmt.ITEMSIZE[e.dtype] == 0
        if e.nbytes and e.nbytes % alignment == 0:
            assert e.begin % alignment == 0
        offset = e.end
    sizes = {name: fmt.ITEMSIZE[dtype] * _numel(shape) for name, dtype, shape in specs}
    assert offset == sum(sizes.values())
    # Block-sized tensors first; each group by element size, then name.
    keys = [
        (not (e.nbytes and e.nbytes % alignment == 0), -fmt.ITEMSIZE[e.dtype], e.name)
        for e in entries
    ]
    assert keys == sorted(keys)


def _numel(shape):
    count = 1
    for dim in shape:
        count *= dim
    return count


def test_layout_example():
    entries = fmt.plan_layout(
        [("c", "U8", (3,)), ("a", "F32", (1024,)), ("b", "I64", (2,)), ("d", "F16", (2048,))]
    )
    assert [(e.name, e.begin, e.end) for e in entries] == [
        ("a", 0, 4096),
        ("d", 4096, 8192),
        ("b", 8192, 8208),
        ("c", 8208, 8211),
    ]


@pytest.mark.parametrize("alignment", [0, 1, 2, 4, 6, 12, 4095, -8, 4096.0, True])
def test_layout_rejects_bad_alignment(alignment):
    with pytest.raises(ValueError, match="alignment"):
        fmt.plan_layout([], alignment)


@pytest.mark.parametrize(
    "specs, match",
    [
        ([("a", "U8", (1,)), ("a", "U8", (1,))], "duplicate"),
        ([("__metadata__", "U8", (1,))], "name"),
        ([(1, "U8", (1,))], "name"),
        ([("a", "F2", (1,))], "dtype"),
        ([("a", "F4", (3,))], "byte boundary"),
        ([("a", "U8", (-1,))], "shape"),
        ([("a", "U8", (1.0,))], "shape"),
        ([("a", "U8", (2**40, 2**40, 0))], "overflows"),
    ],
)
def test_layout_rejects_bad_specs(specs, match):
    with pytest.raises(ValueError, match=match):
        fmt.plan_layout(specs)


# --------------------------------------------------------------------------- encode / parse


@given(
    specs=specs_strategy,
    alignment=alignments,
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_encode_parse_round_trip(specs, alignment, metadata):
    entries = fmt.plan_layout(specs, alignment)
    header = fmt.encode_header(entries, metadata, alignment)
    assert len(header) % alignment == 0
    data_size = entries[-1].end if entries else 0
    file_size = len(header) + data_size
    parsed = parse_file(header + b"\0" * data_size)
    assert parsed.data_offset == len(header)
    assert parsed.data_size == data_size
    assert parsed.metadata == metadata
    # File order is offset order; zero-size entries may swap among equal offsets.
    assert sorted(parsed.entries.values(), key=lambda e: (e.begin, e.end, e.name)) == sorted(
        entries, key=lambda e: (e.begin, e.end, e.name)
    )
    assert fmt.parse_header_length(header[:8], file_size) == len(header) - 8


@pytest.mark.parametrize("alignment", [8, 64, 4096, 1 << 20])
def test_header_padding(alignment):
    entries = fmt.plan_layout([("x", "F32", (3,)), ("y", "U8", (1,))])
    header = fmt.encode_header(entries, {"format": "pt"}, alignment)
    length = struct.unpack("<Q", header[:8])[0]
    assert (8 + length) % alignment == 0 and len(header) == 8 + length
    text = header[8:].decode()
    assert text.startswith('{"__metadata__":{"format":"pt"},"x":')
    assert ": " not in text and ", " not in text  # compact
    body = text.rstrip(" ")
    assert json.loads(body) == json.loads(text)
    assert len(text) - len(body) < alignment


def test_encode_header_validation(monkeypatch):
    entries = fmt.plan_layout([("x", "F32", (3,))])
    with pytest.raises(TypeError, match="'k'"):
        fmt.encode_header(entries, {"k": 1})
    with pytest.raises(TypeError, match="3"):
        fmt.encode_header(entries, {3: "v"})
    gap = [fmt.TensorEntry("x", "F32", (3,), 4, 16)]
    with pytest.raises(ValueError, match="contiguous"):
        fmt.encode_header(gap)
    wrong = [fmt.TensorEntry("x", "F32", (3,), 0, 8)]
    with pytest.raises(ValueError, match="do not match"):
        fmt.encode_header(wrong)
    with pytest.raises(ValueError, match="Unicode"):
        fmt.encode_header(fmt.plan_layout([("\ud800", "U8", (1,))]))
    from fastckpt.format import layout

    monkeypatch.setattr(layout, "HEADER_LIMIT", 1000)
    with pytest.raises(ValueError, match="limit"):
        fmt.encode_header(entries, {"k": "v" * 2000}, alignment=8)


# --------------------------------------------------------------------------- safetensors interop


def _all_dtype_tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for index, name in enumerate(DTYPES):
        dtype = dtypes.to_torch(name)
        tensors[f"t.{name}"] = random_tensor(dtype, (3, 5), index)
        tensors[f"block.{name}"] = random_tensor(dtype, (4096 // dtype.itemsize,), index)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 3)
    tensors["noncontiguous"] = torch.arange(12.0).reshape(3, 4).t()
    tensors["ünïcode/näme"] = torch.ones(7, dtype=torch.int16)
    return tensors


def test_safetensors_reads_our_files(tmp_path):
    tensors = _all_dtype_tensors()
    specs = [(n, dtypes.to_safetensors(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    entries = fmt.plan_layout(specs)
    metadata = fmt.build_metadata({"note": "hi"}, crcs={"scalar": 7}, aliases={"alias": "scalar"})
    path = tmp_path / "ours.safetensors"
    with open(path, "wb") as out:
        out.write(fmt.encode_header(entries, metadata))
        for e in entries:
            out.write(tensor_bytes(tensors[e.name]))

    loaded = safetensors.torch.load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert tensor_bytes(loaded[name]) == tensor_bytes(tensor), name
    with safetensors.safe_open(path, "pt") as handle:
        stored = handle.metadata()
    assert len(stored.pop(fmt.KEY_HEADER_CRC)) == 8
    assert stored == metadata
    parse_file(path.read_bytes())


def test_we_read_safetensors_files(tmp_path):
    tensors = {name: t.contiguous() for name, t in _all_dtype_tensors().items()}
    path = tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "k": "v"})
    data = path.read_bytes()
    header = parse_file(data)
    assert header.metadata == {"format": "pt", "k": "v"}
    assert set(header.entries) == set(tensors)
    offsets = [(e.begin, e.end) for e in header.entries.values()]
    assert offsets == sorted(offsets), "entries come in file order"
    for name, e in header.entries.items():
        blob = data[header.data_offset + e.begin : header.data_offset + e.end]
        assert e.dtype == dtypes.to_safetensors(tensors[name].dtype)
        assert e.shape == tuple(tensors[name].shape)
        assert blob == tensor_bytes(tensors[name]), name
    split = fmt.split_metadata(header.metadata)
    assert split.version is None and split.crcs is None and split.tree is None


def test_zero_size_tensors_share_offsets():
    header = {
        "z0": entry("F32", (0,), (0, 0)),
        "a": entry("U8", (2,), (0, 2)),
        "z2": entry("U8", (0, 5), (2, 2)),
    }
    parsed = parse_file(raw_file(header, b"xy"))
    assert list(parsed.entries) == ["z0", "a", "z2"]


def test_zero_size_dims_must_fit_int64():
    # Zero elements, but torch cannot hold such a shape: refused before torch.empty sees it.
    shape = (0, 2**30, 2**32)
    assert parse_file(raw_file({"a": entry("F64", shape, (0, 0))})).entries["a"].shape == shape
    for huge in ((0, 2**40, 2**40), (2**63, 0), (0, 2**53 + 1, 2**32)):
        with pytest.raises(HeaderError, match="int64"):
            parse_file(raw_file({"a": entry("F64", huge, (0, 0))}))


def test_empty_file_and_null_metadata():
    assert parse_file(raw_file({})).entries == {}
    assert parse_file(raw_file({"__metadata__": None})).metadata == {}


# --------------------------------------------------------------------------- hostile input

BIG = b"9" * 5000  # more digits than Python's int() accepts from text
HOSTILE = {
    "empty file": b"",
    "7 bytes": b"\x01" * 7,
    "zero length": struct.pack("<Q", 0) + b"{}",
    "length over limit": struct.pack("<Q", fmt.HEADER_LIMIT + 1) + b"{}",
    "length max u64": b"\xff" * 8 + b"{}",
    "truncated": struct.pack("<Q", 100) + b"{}",
    "not an object": raw_file(b"[]"),
    "leading space": raw_file(b' {"a":1}'),
    "bom": raw_file(b"\xef\xbb\xbf{}"),
    "bad utf-8": raw_file(b'{"\xff":1}'),
    "bad json": raw_file(b'{"a":'),
    "nan constant": raw_file(b'{"a":NaN}'),
    "trailing nul": raw_file(b"{}\0"),
    "duplicate key": raw_file(
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        b"x",
    ),
    "deep nesting": raw_file(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "entry not object": raw_file({"a": 1}),
    "entry list": raw_file({"a": []}),
    "missing dtype": raw_file({"a": {"shape": [2], "data_offsets": [0, 2]}}, b"xy"),
    "missing shape": raw_file({"a": {"dtype": "U8", "data_offsets": [0, 2]}}, b"xy"),
    "missing offsets": raw_file({"a": {"dtype": "U8", "shape": [2]}}, b"xy"),
    "extra key": raw_file({"a": {**entry(), "x": 1}}, b"xy"),
    "unknown dtype": raw_file({"a": entry(dtype="F2")}, b"xy"),
    "F4 off a byte boundary": raw_file({"a": entry(dtype="F4", shape=(3,))}, b"xy"),
    "dtype not str": raw_file({"a": entry(dtype=4)}, b"xy"),
    "dtype lowercase": raw_file({"a": entry(dtype="u8")}, b"xy"),
    "shape not list": raw_file({"a": {**entry(), "shape": 2}}, b"xy"),
    "shape negative": raw_file({"a": entry(shape=(-2,))}, b"xy"),
    "shape float": raw_file({"a": entry(shape=(2.0,))}, b"xy"),
    "shape bool": raw_file({"a": entry(shape=(True, 2))}, b"xy"),
    "shape str": raw_file({"a": entry(shape=("2",))}, b"xy"),
    "shape huge product": raw_file({"a": entry(shape=(2**62, 2**62, 4))}, b"xy"),
    "shape huge int": raw_file(
        b'{"a":{"dtype":"U8","shape":[' + BIG + b'],"data_offsets":[0,2]}}', b"xy"
    ),
    "shape dim over u64": raw_file({"a": entry(shape=(2**64, 0), offsets=(0, 0))}),
    "shape overflow before zero": raw_file({"a": entry(shape=(2**40, 2**40, 0), offsets=(0, 0))}),
    "shape bytes overflow": raw_file({"a": entry("F64", shape=(2**62, 1), offsets=(0, 0))}),
    "offsets three": raw_file({"a": entry(offsets=(0, 1, 2))}, b"xy"),
    "offsets one": raw_file({"a": entry(offsets=(2,))}, b"xy"),
    "offsets negative": raw_file({"a": entry(offsets=(-1, 1))}, b"xy"),
    "offsets float": raw_file({"a": entry(offsets=(0, 2.0))}, b"xy"),
    "offsets bool": raw_file({"a": entry(shape=(1,), offsets=(False, True))}, b"x"),
    "offsets not list": raw_file({"a": {**entry(), "data_offsets": "0,2"}}, b"xy"),
    "offsets reversed": raw_file({"a": entry(offsets=(2, 0))}, b"xy"),
    "offsets past end": raw_file({"a": entry(shape=(4,), offsets=(0, 4))}, b"xy"),
    "offsets huge": raw_file({"a": entry(offsets=(2**64, 2**64 + 2))}, b"xy"),
    "size mismatch": raw_file({"a": entry(dtype="F32", shape=(1,), offsets=(0, 2))}, b"xy"),
    "overlap": raw_file({"a": entry(), "b": entry(offsets=(1, 3))}, b"xyz"),
    "same range twice": raw_file({"a": entry(), "b": entry()}, b"xy"),
    "zero size inside": raw_file({"a": entry(), "z": entry(shape=(0,), offsets=(1, 1))}, b"xy"),
    "gap at start": raw_file({"a": entry(offsets=(1, 3))}, b"xyz"),
    "gap between": raw_file({"a": entry(), "b": entry(offsets=(3, 5))}, b"xyzvw"),
    "trailing bytes": raw_file({"a": entry()}, b"xyz"),
    "data but no tensors": raw_file({}, b"x"),
    "zero size past end": raw_file({"a": entry(), "z": entry(shape=(0,), offsets=(3, 3))}, b"xy"),
    "metadata not object": raw_file({"__metadata__": ["a"]}),
    "metadata int value": raw_file({"__metadata__": {"a": 1}}),
    "metadata null value": raw_file({"__metadata__": {"a": None}}),
    "surrogate name": raw_file(
        b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"
    ),
    "surrogate metadata": raw_file(b'{"__metadata__":{"a":"\\udfff"}}'),
    "crc not json": raw_file({"__metadata__": {"fastckpt.version": "1", "fastckpt.crc32c": "{"}}),
    "crc not object": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.crc32c": "[]"}}
    ),
    "crc uppercase": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.crc32c": '{"a":"DEADBEEF"}'}}
    ),
    "crc short": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.crc32c": '{"a":"beef"}'}}
    ),
    "crc int": raw_file({"__metadata__": {"fastckpt.version": "1", "fastckpt.crc32c": '{"a":12}'}}),
    "aliases not object": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.aliases": '"a"'}}
    ),
    "alias target int": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.aliases": '{"a":1}'}}
    ),
    "tree not json": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.checkpoint.tree": "{'t': 1}"}}
    ),
    "tree null": raw_file(
        {"__metadata__": {"fastckpt.version": "1", "fastckpt.checkpoint.tree": "null"}}
    ),
    "tree deep": raw_file(
        {
            "__metadata__": {
                "fastckpt.version": "1",
                "fastckpt.checkpoint.tree": "[" * 50_000 + "]" * 50_000,
            }
        }
    ),
}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_files_raise_header_error(data):
    with pytest.raises(HeaderError):
        parse_file(data)


def test_error_messages_say_what_and_where():
    cases = {
        "size mismatch": ["'a'", "[1]", "F32", "[0, 2]"],
        "overlap": ["'b'", "overlaps", "'a'"],
        "gap between": ["gap", "'b'"],
        "trailing bytes": ["1 bytes after the last tensor"],
        "truncated": ["truncated", "100"],
        "missing shape": ["'a'", "shape"],
        "crc uppercase": ["fastckpt.crc32c", "DEADBEEF"],
        "shape huge product": ["'a'", "[4611686018427387904, 4611686018427387904, 4]"],
        "shape overflow before zero": ["'a'", "overflows"],
    }
    for case, fragments in cases.items():
        with pytest.raises(HeaderError) as info:
            parse_file(HOSTILE[case])
        for fragment in fragments:
            assert fragment in str(info.value), (case, str(info.value))
        assert len(str(info.value)) < 300


def test_parse_header_length_checks():
    assert fmt.parse_header_length(struct.pack("<Q", 2) + b"junk", 10) == 2
    with pytest.raises(HeaderError, match="not a safetensors file"):
        fmt.parse_header_length(b"\x02\0\0", 3)
    assert fmt.parse_header_length(struct.pack("<Q", fmt.HEADER_LIMIT), 2**40) == fmt.HEADER_LIMIT


def _valid_file() -> bytes:
    specs = [("w", "F32", (4, 4)), ("b", "F16", (3,)), ("i", "I64", (2,)), ("z", "U8", (0,))]
    entries = fmt.plan_layout(specs, alignment=64)
    metadata = fmt.build_metadata({"k": "v"}, crcs={"w": 1}, aliases={"v": "w"}, tree=[1])
    return fmt.encode_header(entries, metadata, alignment=64) + b"\x01" * entries[-1].end


VALID = _valid_file()


@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    with contextlib.suppress(HeaderError):
        parse_file(data)


@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, len(VALID) - 1),
            st.sampled_from(["set", "del", "ins"]),
            st.binary(min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=6,
    ),
    cut=st.integers(0, 16),
)
def test_fuzz_mutated_bytes(edits, cut):
    data = bytearray(VALID)
    for position, action, blob in edits:
        position %= max(len(data), 1)
        if action == "set":
            data[position : position + len(blob)] = blob
        elif action == "del":
            del data[position : position + len(blob)]
        else:
            data[position:position] = blob
    data = bytes(data[: len(data) - cut])
    try:
        header = parse_file(data)
    except HeaderError:
        return
    _assert_consistent(header, len(data))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@given(
    target=st.sampled_from(["w", "b", "i", "z", "__metadata__"]),
    field=st.sampled_from(["dtype", "shape", "data_offsets", "k", "fastckpt.crc32c", None]),
    value=json_values,
    as_text=st.booleans(),
)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_mutated_json(target, field, value, as_text):
    length = struct.unpack("<Q", VALID[:8])[0]
    document = json.loads(VALID[8 : 8 + length])
    data_part = VALID[8 + length :]
    if as_text:
        value = json.dumps(value)
    if field is None:
        document[target] = value
    else:
        document[target][field] = value
    data = raw_file(json.dumps(document).encode(), data_part)
    try:
        header = parse_file(data)
    except HeaderError:
        return
    _assert_consistent(header, len(data))


def _assert_consistent(header: fmt.Header, file_size: int) -> None:
    offset = 0
    for e in header.entries.values():
        assert e.begin == offset
        assert e.nbytes == fmt.ITEMSIZE[e.dtype] * _numel(e.shape)
        offset = e.end
    assert header.data_offset + offset == file_size


# --------------------------------------------------------------------------- metadata


def test_build_and_split_metadata():
    tree = {"t": "dict", "k": ["a"], "v": [1.5]}
    meta = fmt.build_metadata(
        {"step": "3"}, crcs={"w": 0xDEADBEEF, "b": 0}, aliases={"v": "w"}, tree=tree
    )
    assert meta["format"] == "pt" and meta["fastckpt.version"] == fmt.FORMAT_VERSION
    assert json.loads(meta["fastckpt.crc32c"]) == {"w": "deadbeef", "b": "00000000"}
    assert all(type(value) is str for value in meta.values())
    split = fmt.split_metadata(meta)
    assert split.user == {"format": "pt", "step": "3"}
    assert split.crcs == {"w": 0xDEADBEEF, "b": 0}
    assert split.aliases == {"v": "w"}
    assert split.tree == tree
    assert split.version == fmt.FORMAT_VERSION


def test_build_metadata_rules():
    assert fmt.build_metadata({"format": "np"})["format"] == "np"
    minimal = fmt.build_metadata()
    assert minimal == {"format": "pt", "fastckpt.version": fmt.FORMAT_VERSION}
    with pytest.raises(ValueError, match=r"fastckpt\.mine"):
        fmt.build_metadata({"fastckpt.mine": "x"})
    with pytest.raises(TypeError, match="'n'"):
        fmt.build_metadata({"n": 1})
    with pytest.raises(ValueError, match="'w'"):
        fmt.build_metadata(crcs={"w": 2**32})
    with pytest.raises(ValueError):
        fmt.build_metadata(tree=float("nan"))


def test_split_metadata_ignores_unknown_fastckpt_keys():
    split = fmt.split_metadata({"fastckpt.future": "x", "a": "b"})
    assert split.user == {"a": "b"} and split.version is None and split.aliases == {}
