"""``fastckpt.save(obj, f)`` for a writable binary file object, and ``save_bytes``.

A file object has one position and no O_DIRECT, so the file is written in order, header
first: the same bytes a saved file holds (the same layout, padding and checksums), written
with ``f.write``. The header holds every tensor's CRC32C, so the tensors are checksummed in
a first pass and written in a second (a CUDA tensor is copied to the host in each, a slab at
a time). Nothing is committed atomically or fsynced: the file object is the caller's, and
so is the decision to flush or close it.

Example:
    >>> import io, torch
    >>> buffer = io.BytesIO()
    >>> save_to_stream({"w": torch.ones(2)}, buffer)
    >>> buffer.getvalue()[8:9]
    b'{'
"""

from __future__ import annotations

import io
from typing import Any, Mapping

import torch

from fastckpt import format
from fastckpt.checkpoint import compressed_writer
from fastckpt.checkpoint.save import SavePlan, byte_chunks, plan_save

__all__ = ["check_writable", "save_to_stream", "save_bytes", "write_all"]

# Bytes of a tensor copied (or moved from a GPU) and written at a time.
_CHUNK_BYTES = 16 << 20


def check_writable(f: Any, argname: str) -> None:
    """Raises unless ``f`` is a writable binary file object (``argname`` names it)."""
    if not hasattr(f, "write"):
        raise TypeError(f"{argname}: a file object to save into must be writable (no write())")
    mode = getattr(f, "mode", None)
    if isinstance(f, io.TextIOBase) or (isinstance(mode, str) and "b" not in mode):
        raise TypeError(f"{argname}: open the file in binary mode ('wb'), not text mode")
    writable = getattr(f, "writable", None)
    if writable is not None and not writable():
        raise io.UnsupportedOperation(f"{argname}: the file object is not open for writing")


def _host_chunks(t: torch.Tensor) -> Any:
    """``t``'s bytes in file order as uint8 CPU tensors of at most :data:`_CHUNK_BYTES`."""
    for chunk in byte_chunks(t, _CHUNK_BYTES):
        yield chunk.cpu() if chunk.device.type != "cpu" else chunk


def write_all(f: Any, data: memoryview) -> None:
    """Writes every byte: a raw (unbuffered) file object may take fewer in one call."""
    while data.nbytes:
        written = f.write(data)
        if written is None:  # a non-blocking raw stream that cannot take bytes now
            raise BlockingIOError(f"{getattr(f, 'name', 'the file object')}: write would block")
        data = data[written:] if isinstance(written, int) and written < data.nbytes else data[:0]


def _header(plan: SavePlan) -> bytes:
    if not plan.checksum:
        return plan.header(None)
    sums = plan.checksummers()
    for e in plan.entries:
        acc = sums[e.name]
        for chunk in _host_chunks(plan.tensors[e.name]):
            acc.update(chunk.data_ptr(), chunk.numel())
    return plan.header_from(sums)


def save_to_stream(
    obj: Any,
    f: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = format.DEFAULT_PIECE_SIZE,
    compress: bool | str | None = None,
    argname: str = "f",
) -> None:
    """Writes ``obj`` as a checkpoint into the writable binary file object ``f``, from its
    current position (the options are :func:`fastckpt.save`'s).

    Raises:
        TypeError: ``f`` is not writable or is a text file; ``obj`` cannot be saved.
        io.UnsupportedOperation: ``f`` is not open for writing.

    Example:
        >>> import io, torch
        >>> buffer = io.BytesIO()
        >>> save_to_stream({"w": torch.arange(3)}, buffer, metadata={"k": "v"})
        >>> from safetensors.torch import load
        >>> load(buffer.getvalue())["w"].tolist()
        [0, 1, 2]
    """
    check_writable(f, argname)
    plan = plan_save(
        obj,
        metadata=metadata,
        alignment=alignment,
        checksum=checksum,
        allow_pickle=allow_pickle,
        piece_size=piece_size,
        compress=compress,
    )
    if plan.frames:  # compressed while written (compressed_writer.py)
        _write_frames(plan, f)
        return
    header = _header(plan)
    if len(header) != plan.header_size:  # the data would not start where the header says
        raise AssertionError("header size changed between planning and writing")
    write_all(f, memoryview(header))
    for e in plan.entries:
        for chunk in _host_chunks(plan.tensors[e.name]):
            write_all(f, memoryview(chunk.numpy()))


class _FileObjectTarget:
    """A seekable file object written at offsets from its position at the start."""

    path = "<file object>"

    def __init__(self, f: Any):
        self.f, self.start = f, f.tell()

    def pwrite_all(self, data: Any, offset: int) -> None:
        self.f.seek(self.start + offset)
        write_all(self.f, memoryview(data).cast("B"))

    def truncate(self, length: int) -> None:
        self.f.seek(self.start + length)  # the stream ends where the file does

    def pread(self, nbytes: int, offset: int) -> bytes:
        self.f.seek(self.start + offset)
        data = self.f.read(nbytes)
        if len(data) != nbytes:
            raise OSError(f"file object: read {len(data)} of {nbytes} bytes at {offset}")
        return data


def _write_frames(plan: Any, f: Any) -> None:
    """Writes a plan with compressed tensors into ``f``: at offsets while they are
    compressed when ``f`` can seek, else through a temporary file, in order."""
    if _seekable(f):
        compressed_writer.write_frames(plan, _FileObjectTarget(f))
        return
    with compressed_writer.Spool() as spool:
        compressed_writer.write_frames(plan, spool)
        for piece in spool.pieces():
            write_all(f, memoryview(piece))


def _seekable(f: Any) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def save_bytes(obj: Any, metadata: Mapping[str, str] | None = None, **options: Any) -> bytes:
    """``obj`` saved as a checkpoint, as bytes (like ``safetensors.torch.save``, which takes
    ``metadata`` second too); the options are :func:`fastckpt.save`'s format options
    (``checksum``, ``alignment``, ``allow_pickle``, ``piece_size``, ``compress``).

    Example:
        >>> import torch
        >>> data = save_bytes({"w": torch.ones(2)})
        >>> len(data), data[8:9]  # an aligned header, then the data
        (4104, b'{')
    """
    buffer = io.BytesIO()
    save_to_stream(obj, buffer, metadata=metadata, **options)
    return buffer.getvalue()
