"""One Reader API for every storage: ``fastckpt.open`` of a local file, a ``memory://`` URL, an
``s3://`` URL (a real moto server on loopback) and a sharded directory runs the same tests,
with the same results and the same errors."""

from __future__ import annotations

import io
import json
import uuid

import pytest
import torch

import fastckpt
from fastckpt import storage

KINDS = ["local", "memory", "s3", "sharded"]


def _state() -> dict[str, torch.Tensor]:
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    return {
        "w": w,
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.full((300,), 0.5, dtype=torch.bfloat16),
        "tied": w,  # shares w's storage: stored once, an alias in the header
    }


class Checkpoint:
    """A saved checkpoint somewhere, and how to reach its files."""

    def __init__(self, kind: str, location: str, options: dict | None):
        self.kind, self.location, self.options = kind, location, options

    def open(self, **kwargs):
        return fastckpt.open(self.location, storage_options=self.options, **kwargs)

    def file_of(self, name: str) -> str:
        """The file that holds tensor ``name``."""
        if self.kind != "sharded":
            return self.location
        index = json.loads(
            storage.read_whole(storage.join(self.location, "model.safetensors.index.json"))
        )
        return storage.join(self.location, index["weight_map"][name])

    def damage(self, name: str) -> None:
        """Flips one byte of tensor ``name`` in its file."""
        with self.open() as reader:
            at = reader.info(name).offset + 3
        path = self.file_of(name)
        data = bytearray(storage.read_whole(path, self.options))
        data[at] ^= 0xFF
        storage.write_whole(path, bytes(data), self.options)


@pytest.fixture(params=KINDS)
def ckpt(request, tmp_path) -> Checkpoint:
    state = _state()
    kind = request.param
    if kind == "local":
        location, options = str(tmp_path / "ckpt.safetensors"), None
    elif kind == "memory":
        location, options = f"memory://reader-api-{uuid.uuid4().hex[:8]}/ckpt.safetensors", None
    elif kind == "s3":
        bucket, options, _ = request.getfixturevalue("s3")
        location = f"{bucket}/ckpt.safetensors"
    else:
        location, options = str(tmp_path / "shards"), None
        fastckpt.save(state, location, max_shard_size="8KB", metadata={"run": "7"})
        assert len(storage.list_names(location)) >= 3  # two shards or more, and the index
        return Checkpoint(kind, location, options)
    fastckpt.save(state, location, storage_options=options, metadata={"run": "7"})
    return Checkpoint(kind, location, options)


def test_open_returns_a_reader_with_the_header(ckpt):
    with ckpt.open() as reader:
        assert isinstance(reader, fastckpt.Reader)
        assert sorted(reader.keys()) == ["b", "h", "tied", "w"]
        assert reader.metadata()["run"] == "7"
        info = reader.info("b")
        assert (info.name, info.dtype, info.shape, info.nbytes) == ("b", torch.int64, (5,), 40)
        assert reader.info("tied").shape == (64, 32)
        assert reader.has_checksums
        assert reader.aliases == {"tied": "w"}


def test_tensors_come_back_equal(ckpt):
    state = _state()
    with ckpt.open() as reader:
        assert torch.equal(reader.get_tensor("h"), state["h"])
        got = reader.get_tensors(["tied", "b", "w"], verify=True)
        assert list(got) == ["tied", "b", "w"]
        for name, t in got.items():
            assert torch.equal(t, state[name]), name
        assert reader.bytes_read >= 64 * 32 * 4 + 40
    back = fastckpt.load(ckpt.location, storage_options=ckpt.options)
    assert sorted(back) == ["b", "h", "tied", "w"]
    assert all(torch.equal(back[n], state[n]) for n in back)
    part = fastckpt.load(ckpt.location, storage_options=ckpt.options, keys=["b"])
    assert list(part) == ["b"] and torch.equal(part["b"], state["b"])


def test_slices_and_ranges(ckpt):
    w = _state()["w"]
    with ckpt.open() as reader:
        assert torch.equal(reader.get_slice("w")[3:7], w[3:7])
        assert torch.equal(reader.get_slice("tied", verify=True)[-1, 2:5], w[-1, 2:5])
        raw = reader.read_range("w", 8, 20, verify=True)
        assert raw.dtype == torch.uint8 and torch.equal(raw, w.view(-1).view(torch.uint8)[8:20])
        out = torch.empty(3, dtype=torch.float32)
        assert reader.read_range("w", 4, 16, out=out) is out
        assert out.tolist() == [1.0, 2.0, 3.0]
        with pytest.raises(ValueError, match="not within tensor 'w'"):
            reader.read_range("w", 0, 64 * 32 * 4 + 1)


def test_prefetch_then_read(ckpt):
    state = _state()
    with ckpt.open() as reader:
        reader.prefetch(["w", "b"])
        got = reader.get_tensors(["b", "w"], verify=True)
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_verify_and_read_mode(ckpt):
    with ckpt.open() as reader:
        assert reader.verify() == []
        assert reader.verify(["b"]) == []
        expected = {"local": {"direct", "buffered"}, "sharded": {"direct", "buffered", "mixed"}}
        assert reader.read_mode in expected.get(ckpt.kind, {"ranged"})


def test_same_errors(ckpt):
    reader = ckpt.open()
    with pytest.raises(KeyError, match="nope"):
        reader.get_tensor("nope")
    with pytest.raises(KeyError, match="nope"):
        reader.info("nope")
    with pytest.raises(TypeError, match="not a str"):
        reader.get_tensors("w")
    with pytest.raises(TypeError, match="not a str"):
        reader.prefetch("w")
    if ckpt.kind in ("memory", "s3"):
        with pytest.raises(io.UnsupportedOperation, match="not a local file"):
            reader.map()
    else:
        assert torch.equal(reader.map(["b"], verify=True)["b"], _state()["b"])
    reader.close()
    reader.close()  # harmless
    for read in (
        lambda: reader.get_tensor("w"),
        lambda: reader.read_range("w", 0, 4),
        lambda: reader.prefetch(["w"]),
        lambda: reader.verify(),
    ):
        with pytest.raises(ValueError, match="closed"):
            read()


def test_damage_is_found_and_named(ckpt):
    ckpt.damage("b")
    with ckpt.open() as reader:
        assert reader.verify() == ["b"]
        assert torch.equal(reader.get_tensor("w"), _state()["w"])  # unverified read
        with pytest.raises(fastckpt.ChecksumError, match="tensor 'b' in .* is damaged") as info:
            reader.get_tensors(["w", "b"], verify=True)
        assert info.value.tensor == "b" and info.value.filename == ckpt.file_of("b")
    with pytest.raises(fastckpt.ChecksumError, match="'b'"):
        fastckpt.load(ckpt.location, storage_options=ckpt.options)


def test_prefetched_bytes_are_verified_when_asked(ckpt):
    """A prefetch without verification, then a verified read of the same names: the
    prefetched bytes must be checked, not handed back as they are."""
    ckpt.damage("b")
    with ckpt.open() as reader:
        reader.prefetch(["b", "h"])
        with pytest.raises(fastckpt.ChecksumError, match="'b'"):
            reader.get_tensors(["b", "h"], verify=True)
    with ckpt.open() as reader:
        reader.prefetch(["h", "b"])
        assert torch.equal(reader.get_tensors(["h"], verify=True)["h"], _state()["h"])


def test_gds_is_for_local_files_only(ckpt):
    if ckpt.kind in ("memory", "s3"):
        with pytest.raises(io.UnsupportedOperation, match="GPUDirect Storage"):
            ckpt.open(gds=True)
