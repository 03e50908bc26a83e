"""The most tensors one file may hold: writers refuse what readers would refuse."""

from __future__ import annotations

import pytest

from fastckpt import format
from fastckpt.format.schema import MAX_TENSORS, MIN_BYTES_PER_TENSOR, SMALL_TENSOR_COUNT


def _zero_size(count: int) -> list[format.TensorEntry]:
    return [format.TensorEntry(str(i), "U8", (0,), 0, 0) for i in range(count)]


def test_limit_is_above_real_models_and_below_the_header_cap():
    assert MAX_TENSORS >= 1_000_000
    assert MAX_TENSORS * MIN_BYTES_PER_TENSOR <= format.HEADER_LIMIT


def test_writer_refuses_more_than_the_limit_naming_it():
    with pytest.raises(ValueError, match=f"more than MAX_TENSORS \\({MAX_TENSORS}\\)"):
        format.encode_header([format.TensorEntry("x", "U8", (0,), 0, 0)] * (MAX_TENSORS + 1))


def test_short_entries_are_padded_so_readers_accept_them():
    # Entries like "7":{"dtype":"U8","shape":[0],"data_offsets":[0,0]} take ~50 bytes, fewer
    # than readers require per tensor beyond SMALL_TENSOR_COUNT: the writer pads the header.
    entries = _zero_size(SMALL_TENSOR_COUNT + 1000)
    header = format.encode_header(entries, alignment=8)
    length = format.parse_header_length(header[:8], len(header))
    parsed = format.parse_header(header[8 : 8 + length], len(header))
    assert len(parsed.entries) == len(entries)


@pytest.mark.slow
def test_more_tensors_than_the_old_limit_save_and_load(tmp_path):
    torch = pytest.importorskip("torch")
    import fastckpt

    state = {str(i): torch.empty(0, dtype=torch.uint8) for i in range((1 << 18) + 1)}
    fastckpt.save(state, tmp_path / "many.safetensors", checksum=False)
    assert len(fastckpt.load(tmp_path / "many.safetensors")) == len(state)
