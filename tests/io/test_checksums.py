"""StreamingVerifier: checksums carried across pieces that do not line up with tensors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt import _C, format
from fastckpt.errors import ChecksumError
from fastckpt.io.checksums import StreamingVerifier


def _layout(sizes: list[int]) -> tuple[np.ndarray, list[format.TensorEntry], dict[str, int]]:
    data = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes), dtype=np.uint8)
    entries, crcs, pos = [], {}, 0
    for i, n in enumerate(sizes):
        entries.append(format.TensorEntry(f"t{i}", "U8", (n,), pos, pos + n))
        crcs[f"t{i}"] = _C.crc32c(data.ctypes.data + pos, n) if n else 0
        pos += n
    return data, entries, crcs


def _feed_in_pieces(verifier: StreamingVerifier, data: np.ndarray, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *[c for c in cuts if 0 < c < len(data)]})
    for lo, hi in zip(bounds, bounds[1:]):
        verifier.feed(lo, data.ctypes.data + lo, hi - lo)
    verifier.finish()


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 2400), max_size=10),
)
def test_any_split_into_pieces_verifies(sizes, cuts):
    data, entries, crcs = _layout(sizes)
    _feed_in_pieces(StreamingVerifier(entries, crcs, "f"), data, cuts)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 2400), max_size=10),
    which=st.integers(0, 7),
    where=st.integers(0, 299),
)
def test_a_flipped_byte_names_its_tensor(sizes, cuts, which, where):
    data, entries, crcs = _layout(sizes)
    victim = entries[which % len(entries)]
    data[victim.begin + where % victim.nbytes] ^= 1
    with pytest.raises(ChecksumError) as info:
        _feed_in_pieces(StreamingVerifier(entries, crcs, "f.safetensors"), data, cuts)
    assert info.value.tensor == victim.name
    assert "f.safetensors" in str(info.value)


def test_unfed_tensor_is_an_error_not_a_pass():
    data, entries, crcs = _layout([10, 10])
    verifier = StreamingVerifier(entries, crcs, "f")
    verifier.feed(0, data.ctypes.data, 10)
    with pytest.raises(AssertionError, match="'t1'"):
        verifier.finish()


def test_tensors_without_a_recorded_crc_are_skipped():
    data, entries, crcs = _layout([10, 10])
    data[15] ^= 1
    del crcs["t1"]
    _feed_in_pieces(StreamingVerifier(entries, crcs, "f"), data, [5, 12])
