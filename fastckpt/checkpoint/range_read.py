"""Reading a byte range of one stored tensor, verified piece by piece.

A file records a CRC32C per tensor and, for tensors larger than one piece, a CRC32C per
fixed-size piece (see :data:`fastckpt.format.KEY_PIECE_CRC32C`). A verified range read
therefore reads the pieces covering the range (rounded out to piece boundaries, which keeps
the reads aligned for direct I/O), checks each, and hands back only the range; a tensor
without piece checksums is read and checked whole. Unverified, exactly the range is read.

Pieces lying wholly inside the range are read straight into the destination; only the
partly covered first and last pieces go through a bounce buffer.

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.arange(8, dtype=torch.uint8)}, "/tmp/fastckpt-range.safetensors")
    >>> with fastckpt.open("/tmp/fastckpt-range.safetensors") as r:
    ...     r.read_range("w", 2, 5, verify=True).tolist()
    [2, 3, 4]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fastckpt import format
from fastckpt.checkpoint import dtypes
from fastckpt.checkpoint.tensor_runs import own_bytes, placed
from fastckpt.errors import ChecksumError, checksum_mismatch
from fastckpt.io.aligned_memory import BUFFER_ALIGNMENT, aligned_tensor
from fastckpt.io.checksums import crc32c_combine
from fastckpt.io.parallel_io import Span
from fastckpt.storage.base import Storage

__all__ = [
    "check_byte_range",
    "RangeSource",
    "read_byte_range",
    "TensorSlice",
    "byte_view",
    "covering_regions",
    "damaged_region",
]


@dataclasses.dataclass(frozen=True)
class RangeSource:
    """What a range read needs of its reader: the storage, how to read it (``mode``, as
    :meth:`~fastckpt.storage.Storage.choose_mode` answered), the checksums."""

    storage: Storage
    path: str
    data_offset: int
    crcs: dict[str, int] | None
    pieces: format.PieceTable | None
    mode: str


@dataclasses.dataclass
class _Region:
    """Tensor bytes ``[lo, hi)`` read as one unit and checked against ``expected`` (None:
    not checked); ``piece`` is its index among the tensor's pieces (None: the whole tensor)."""

    lo: int
    hi: int
    expected: int | None
    piece: int | None
    address: int = 0  # where its bytes land
    spans: list[int] = dataclasses.field(default_factory=list)  # lengths of the spans reading it


def covering_regions(
    pieces: format.PieceTable | None,
    crcs: dict[str, int] | None,
    entry: format.TensorEntry,
    start: int,
    stop: int,
    verify: bool,
) -> list[_Region]:
    """The units in which bytes ``[start, stop)`` of tensor ``entry`` are read and checked:
    the checksummed pieces covering the range, the whole tensor when it has no piece
    checksums, or (``verify=False``) exactly the range. Shared by every reader of ranges
    (local files and URLs), so they read and check the same bytes.

    Example:
        >>> entry = format.TensorEntry("w", "U8", (10000,), 0, 10000)
        >>> table = format.PieceTable(4096, {"w": bytes(12)})
        >>> [(r.lo, r.hi, r.piece) for r in covering_regions(table, {"w": 0}, entry, 5000, 9000, True)]
        [(4096, 8192, 1), (8192, 10000, 2)]
    """
    if start == stop:
        return []
    if not verify:
        return [_Region(start, stop, None, None)]
    table = pieces
    if table is not None and entry.name in table.digests:
        size = table.piece_size
        return [
            _Region(i * size, min((i + 1) * size, entry.nbytes), table.crc(entry.name, i), i)
            for i in range(start // size, -(-stop // size))
        ]
    # No piece checksums (an older file, or a tensor of one piece): the whole tensor is one.
    expected = (crcs or {}).get(entry.name)
    return [_Region(0, entry.nbytes, expected, None)]


def _placed(file_offset: int, pos: int) -> int:
    """The first position at or after ``pos`` with the same offset in a page as the file."""
    return placed(pos, file_offset, BUFFER_ALIGNMENT)


def read_byte_range(
    source: RangeSource,
    entry: format.TensorEntry,
    start: int,
    stop: int,
    *,
    out: torch.Tensor | None,
    verify: bool,
    span_bytes: int,
    on_read: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Bytes ``[start, stop)`` of the tensor ``entry`` as a uint8 tensor (``out`` viewed as
    bytes when given); see the module's description. ``span_bytes`` caps one parallel read;
    ``on_read(nbytes)`` is told how many bytes are asked of the file.

    Raises:
        ChecksumError: a piece (or the whole tensor) read does not match its CRC32C; the
            message names the file, the tensor and the piece's byte range.
    """
    base = source.data_offset + entry.begin  # file offset of the tensor's first byte
    regions = covering_regions(source.pieces, source.crcs, entry, start, stop, verify)
    if out is None:
        # One arena over every region; the result is a view of it (no copy).
        lo = regions[0].lo if regions else start
        hi = regions[-1].hi if regions else stop
        first = _placed(base + lo, 0)
        arena = aligned_tensor(first + hi - lo)
        for region in regions:
            region.address = arena.data_ptr() + first + (region.lo - lo)
        result = own_bytes(arena, first + (start - lo), stop - start)
        bounce = None
        keep: Any = arena
    else:
        result = out
        inside = [r for r in regions if start <= r.lo and r.hi <= stop]
        outside = [r for r in regions if not (start <= r.lo and r.hi <= stop)]
        for region in inside:
            region.address = out.data_ptr() + (region.lo - start)
        bounce, pos = None, 0
        if outside:
            places = []
            for region in outside:
                pos = _placed(base + region.lo, pos)
                places.append(pos)
                pos += region.hi - region.lo
            bounce = aligned_tensor(pos)
            for region, at in zip(outside, places):
                region.address = bounce.data_ptr() + at
        keep = (out, bounce)
    spans = _spans(regions, base, span_bytes)
    if on_read is not None:
        on_read(sum(s.nbytes for s in spans))
    checked = verify and any(r.expected is not None for r in regions)
    crcs = source.storage.read_spans(spans, owner=keep, mode=source.mode, checksum=checked)
    if checked:
        _check(source, entry, regions, crcs)
    if out is not None and bounce is not None:  # the partly covered pieces' share of the range
        for region in regions:
            if start <= region.lo and region.hi <= stop:
                continue
            lo, hi = max(region.lo, start), min(region.hi, stop)
            at = region.address - bounce.data_ptr() + (lo - region.lo)
            out[lo - start : hi - start].copy_(bounce[at : at + (hi - lo)])
    return result


def _spans(regions: list[_Region], base: int, span_bytes: int) -> list[Span]:
    """Each region cut into spans of at most ``span_bytes`` (at file offsets that are
    multiples of it, so direct reads stay aligned)."""
    spans = []
    for region in regions:
        at = region.lo
        while at < region.hi:
            stop = min(region.hi, ((base + at) // span_bytes + 1) * span_bytes - base)
            spans.append(Span(base + at, region.address + (at - region.lo), stop - at))
            region.spans.append(stop - at)
            at = stop
    return spans


def _check(
    source: RangeSource,
    entry: format.TensorEntry,
    regions: list[_Region],
    crcs: list[list[int]],
) -> None:
    """Joins each region's span CRCs (spans come in region order) and compares."""
    values = iter(crcs)
    for region in regions:
        got = 0
        for i, length in enumerate(region.spans):
            (value,) = next(values)
            got = crc32c_combine(got, value, length) if i else value
        if region.expected is not None and got != region.expected:
            raise damaged_region(source.path, source.pieces, entry, region, got)


def damaged_region(
    path: str,
    pieces: format.PieceTable | None,
    entry: format.TensorEntry,
    region: _Region,
    got: int,
) -> ChecksumError:
    """The error for a region of :func:`covering_regions` whose CRC32C is ``got``: it names
    the file (or URL), the tensor and, for a piece, its index and byte range."""
    if region.piece is None:
        where = ""
    else:
        count = format.piece_count(entry.nbytes, pieces.piece_size)  # type: ignore[union-attr]
        where = f" in piece {region.piece} of {count} (tensor bytes [{region.lo}, {region.hi}))"
    return checksum_mismatch(entry.name, path, got, region.expected or 0, where)


def check_byte_range(name: str, nbytes: int, start: int, stop: int, where: str) -> None:
    """Refuses a byte range ``[start, stop)`` that is not ints within tensor ``name`` of
    ``nbytes`` bytes (``where``: the file or URL, for the message).

    Example:
        >>> check_byte_range("w", 8, 2, 9, "ckpt.safetensors")
        Traceback (most recent call last):
        ...
        ValueError: byte range [2, 9) is not within tensor 'w' (8 bytes) of ckpt.safetensors
    """
    for what, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= start <= stop <= nbytes:
        raise ValueError(
            f"byte range [{start}, {stop}) is not within tensor {name!r} ({nbytes} bytes) of {where}"
        )


def byte_view(tensor: torch.Tensor, nbytes: int, what: str = "out") -> torch.Tensor:
    """``tensor``'s memory as a flat uint8 tensor of ``nbytes`` (TypeError/ValueError naming
    ``what`` when it is not a contiguous CPU tensor of that many bytes)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{what} must be a contiguous CPU tensor")
    size = tensor.numel() * tensor.element_size()
    if size != nbytes:
        raise ValueError(f"{what} holds {size} bytes, the range has {nbytes}")
    return (
        tensor.reshape(-1).view(torch.uint8) if nbytes else tensor.new_empty(0, dtype=torch.uint8)
    )


class TensorSlice:
    """A stored tensor to be sliced along its first dimension, reading only the rows asked
    for (like ``safetensors``' ``get_slice``). Made by
    :meth:`~fastckpt.checkpoint.read.CheckpointReader.get_slice`.

    ``tensor_slice[a:b]`` reads rows ``a`` to ``b`` (one contiguous byte range); an int
    reads one row; a positive step reads the span of rows from the first to the last asked
    for and keeps every ``step``-th; indices past the first (``[a:b, 2:5]``) are applied in
    memory to the rows read.

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"w": torch.arange(12.0).reshape(4, 3)}, "/tmp/fastckpt-slice.safetensors")
        >>> with fastckpt.open("/tmp/fastckpt-slice.safetensors") as r:
        ...     s = r.get_slice("w")
        ...     s.shape, s[1:3].tolist(), s[-1, 1:].tolist()
        ((4, 3), [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]], [10.0, 11.0])
    """

    def __init__(
        self,
        entry: format.TensorEntry,
        read: Callable[[int, int], torch.Tensor],
    ):
        self._entry = entry
        self._read = read
        # torch's shape (for F4, half the header's last dimension: two values per element)
        self.shape: tuple[int, ...] = dtypes.torch_shape(
            entry.dtype, entry.shape, tensor=entry.name
        )
        self.dtype: torch.dtype = dtypes.to_torch(entry.dtype)

    def get_shape(self) -> list[int]:
        """The stored tensor's shape as its header gives it (as ``safetensors`` does; for
        ``F4`` the last dimension counts 4-bit values, twice torch's)."""
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The stored tensor's safetensors dtype name (``"F32"``, ``"BF16"``, ...)."""
        return self._entry.dtype

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, list) and not all(_is_int(i) for i in index):
            index = tuple(index)  # as safetensors: a list of slices indexes one per dimension
        items: tuple[Any, ...] = index if isinstance(index, tuple) else (index,)
        if not self.shape or not items or items[0] is Ellipsis:
            return self._rows(0, self.shape[0] if self.shape else 1)[items]
        first, rest = items[0], items[1:]
        rows = self.shape[0]
        if isinstance(first, (list, range)):
            return self._gather(list(first), rest)
        if isinstance(first, int) and not isinstance(first, bool):
            row = first + rows if first < 0 else first
            if not 0 <= row < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 of size {rows}")
            in_row = (0, *rest)
            return self._rows(row, row + 1)[in_row]
        if not isinstance(first, slice):
            raise TypeError(
                "the first index must be an int, a slice, a list of ints or ..., got "
                f"{type(first).__name__}"
            )
        lo, hi, step = first.indices(rows)
        if step <= 0:
            raise ValueError(f"slice step must be positive, got {step}")
        if hi <= lo:
            every_row = (slice(None), *rest)
            return self._rows(0, 0)[every_row]
        last = lo + (hi - lo - 1) // step * step
        block = self._rows(lo, last + 1)
        if step == 1 and not rest:
            return block
        stepped = (slice(None, None, step), *rest)
        return block[stepped]

    def _gather(self, wanted: list[Any], rest: tuple[Any, ...]) -> torch.Tensor:
        """Rows picked by a list of ints (in its order, repeats allowed), reading each run of
        consecutive rows once; ``rest`` applies to the rows read."""
        rows = self.shape[0]
        picked = []
        for i in wanted:
            if not _is_int(i):
                raise TypeError(f"a list index holds ints, got {type(i).__name__}")
            if not -rows <= i < rows:
                raise IndexError(f"index {i} is out of bounds for dimension 0 of size {rows}")
            picked.append(i + rows if i < 0 else i)
        every_row = (slice(None), *rest)
        if not picked:
            return self._rows(0, 0)[every_row]
        distinct = sorted(set(picked))
        runs: list[tuple[int, int]] = []  # [lo, hi) of consecutive rows
        for row in distinct:
            if runs and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + 1)
            else:
                runs.append((row, row + 1))
        block = torch.cat([self._rows(lo, hi) for lo, hi in runs])
        position = {row: k for k, row in enumerate(distinct)}
        order = torch.tensor([position[row] for row in picked], dtype=torch.long)
        return block[order][every_row]

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` read into memory, as a tensor (a 0-d tensor is one row)."""
        row_bytes = self._entry.nbytes // self.shape[0] if self.shape and self.shape[0] else 0
        if not self.shape:
            row_bytes = self._entry.nbytes
        raw = self._read(lo * row_bytes, hi * row_bytes)
        if raw.numel() and raw.data_ptr() % self.dtype.itemsize:
            raw = raw.clone()  # files from other writers may not align tensors to their dtype
        shape = (hi - lo, *self.shape[1:]) if self.shape else ()
        return raw.view(self.dtype).view(shape)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
