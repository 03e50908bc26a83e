"""Hostile and damaged headers: the header checksum, format versions, int64 shapes, the
bounds on parsing, and torch.save files recognised."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import textwrap

import pytest

import fastckpt.format as fmt
from fastckpt.errors import HeaderError

NESTED_META = fmt.build_metadata(
    {"step": "3"},
    crcs={"a": 1, "b": 2},
    aliases={"tied": "a"},
    tree={"t": "dict", "k": ["lr", "w"], "v": [0.1, {"t": "tensor", "n": "a"}]},
)
ENTRIES = fmt.plan_layout([("a", "F32", (2, 2)), ("b", "I64", (3,))])


def _file(metadata=NESTED_META) -> bytes:
    return fmt.encode_header(ENTRIES, metadata, alignment=64) + bytes(ENTRIES[-1].end)


def _parse(blob: bytes):
    n = fmt.parse_header_length(blob[:8], len(blob))
    header = fmt.parse_header(blob[8 : 8 + n], len(blob))
    return header, fmt.split_metadata(header.metadata)


def _with_document(blob: bytes, change) -> bytes:
    """The same file with its decoded header changed by ``change`` (no checksum fix)."""
    (n,) = struct.unpack("<Q", blob[:8])
    document = json.loads(blob[8 : 8 + n])
    change(document)
    text = json.dumps(document, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + n :]


def test_written_headers_carry_a_checksum_that_parses():
    header, meta = _parse(_file())
    assert len(header.metadata[fmt.KEY_HEADER_CRC]) == 8
    assert meta.version == fmt.FORMAT_VERSION == "2"
    assert meta.user == {"format": "pt", "step": "3"}  # the checksum is not the user's


def test_every_single_bit_flip_in_the_json_is_refused_or_harmless():
    blob = _file()
    (n,) = struct.unpack("<Q", blob[:8])
    end = 8 + len(blob[8 : 8 + n].rstrip(b" "))
    reference = _parse(blob)
    changed = 0
    for bit in range(8 * 8, 8 * end):  # the JSON text, every bit
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            parsed = _parse(bytes(flipped))
        except HeaderError:
            continue
        changed += parsed != reference
    assert changed == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["__metadata__"].update(step="4"),  # user metadata
        lambda d: d["a"]["shape"].reverse() or d["a"].update(shape=[4, 1]),  # a shape
        lambda d: d["__metadata__"].update({"fastckpt.aliases": '{"tied":"b"}'}),
        lambda d: d["__metadata__"].pop(fmt.KEY_HEADER_CRC),
        lambda d: d["__metadata__"].update({fmt.KEY_HEADER_CRC: "0000000g"}),
        # the key that once switched every checksum off
        lambda d: d["__metadata__"].update(
            {"fastckpt.crc32C": d["__metadata__"].pop(fmt.KEY_CRC32C)}
        ),
        lambda d: d["__metadata__"].update({"fastckpt.version": "1"}),
        lambda d: d["__metadata__"].pop("fastckpt.version"),
    ],
)
def test_changed_headers_are_refused(change):
    with pytest.raises(HeaderError, match="damaged|checksum|hex"):
        _parse(_with_document(_file(), change))


def test_newer_versions_say_so_and_legacy_version_1_still_reads():
    newer = _with_document(_file(), lambda d: d["__metadata__"].update({"fastckpt.version": "4"}))
    with pytest.raises(HeaderError, match="written by a newer fastckpt"):
        _parse(newer)
    legacy = {k: v for k, v in NESTED_META.items() if k != fmt.KEY_HEADER_CRC}
    legacy["fastckpt.version"] = "1"
    blob = _with_document(
        _file(),
        lambda d: d.update(__metadata__=legacy),
    )
    assert _parse(blob)[1].crcs == {"a": 1, "b": 2}


def test_plain_safetensors_headers_need_no_checksum():
    header, meta = _parse(_file({"format": "pt"}))
    assert meta.version is None and fmt.KEY_HEADER_CRC not in header.metadata


@pytest.mark.parametrize("shape", [[2**63, 0], [0, 2**53 + 1, 2**32], [0, 2**31, 2**32]])
def test_zero_size_shapes_beyond_int64_are_header_errors(shape):
    blob = _with_document(
        _file({"format": "pt"}),
        lambda d: d.update(z={"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}),
    )
    with pytest.raises(HeaderError, match="int64"):
        _parse(blob)
    with pytest.raises(ValueError, match="int64"):
        fmt.plan_layout([("z", "U8", shape)])


def test_torch_save_files_are_recognised(tmp_path):
    torch = pytest.importorskip("torch")
    for legacy in (False, True):
        path = tmp_path / f"model{legacy}.pt"
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=not legacy)
        data = path.read_bytes()
        with pytest.raises(HeaderError, match="torch.save file .*fastckpt convert"):
            fmt.parse_header_length(data[:8], len(data))
    # A real header length may start with the same bytes: only impossible lengths are hints.
    assert fmt.parse_header_length(b"\x80\x02" + bytes(6), 10_000) == 0x280


_MEASURE = textwrap.dedent(
    """
    import re, resource, sys, time
    import fastckpt.format as fmt
    from fastckpt.errors import HeaderError
    kind, size = sys.argv[1], int(sys.argv[2])
    if kind == "lists":
        body = "[" + "[]," * (size // 3) + "[]]"
        meta = {"fastckpt.version": "2", "fastckpt.checkpoint.tree": body}
        text = ('{"__metadata__":' + __import__("json").dumps(meta) + "}").encode()
    elif kind == "dicts":
        text = b'{"a":[' + b"{}," * (size // 3) + b"{}]}"
    else:
        entry = b'"%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
        text = b"{" + b",".join(entry % i for i in range(size // 48)) + b"}"
    vm = lambda: int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
    limit = vm() + 10 * len(text)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    started = time.process_time()
    try:
        fmt.parse_header(text, len(text) + 8)
        print("parsed")
    except HeaderError as exc:
        print("HeaderError", exc)
    print(time.process_time() - started)
    """
)


@pytest.mark.parametrize("kind", ["lists", "dicts", "tensors"])
def test_hostile_headers_parse_within_10x_their_size(kind):
    # 8 MB stand-ins for the 90 MB originals (benchmarks/torture.py runs the full size).
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, kind, str(8 << 20)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, seconds = out.stdout.splitlines()
    assert first.startswith("HeaderError") and "more than" in first, first
    assert float(seconds) < 30  # generous: the machine may be busy; work is linear


def test_node_limit_leaves_real_headers_alone():
    rng = random.Random(0)
    specs = [
        (f"layers.{i}.w{rng.randrange(9)}", "BF16", (1, 2)) for i in range(70_000)
    ]  # ~79 bytes per entry
    entries = fmt.plan_layout(specs)
    header = fmt.encode_header(entries, fmt.build_metadata(), alignment=64)
    total = len(header) + entries[-1].end
    n = fmt.parse_header_length(header[:8], total)
    assert len(fmt.parse_header(header[8 : 8 + n], total).entries) == 70_000
