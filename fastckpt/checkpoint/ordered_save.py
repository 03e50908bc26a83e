"""Writing a planned checkpoint in file order, header first, to a storage's atomic sink: how a
checkpoint goes to a place that takes a stream (an object store, any fsspec URL) rather
than writes at offsets.

The plan, the header and the checksums are :mod:`fastckpt.checkpoint.save`'s own
(:func:`~fastckpt.checkpoint.save.plan_save`, :meth:`SavePlan.checksummers`,
:meth:`SavePlan.header_from`). Since the header holds the CRC32Cs and goes out first, they
are computed in a first pass over the tensors in memory (every tensor on its own thread),
then the bytes stream out in pieces: memory stays bounded by the sink's parts.

Example:
    >>> import torch
    >>> from fastckpt.checkpoint.save import plan_save
    >>> from fastckpt.storage import open_storage
    >>> sink = open_storage("memory://doc-ordered/x.safetensors", create=True)
    >>> write_in_order(plan_save({"w": torch.ones(3)}), sink)
    >>> sink.size() > 12
    True
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import torch

from fastckpt.checkpoint import compressed_writer
from fastckpt.checkpoint.save import SavePlan, byte_chunks
from fastckpt.io import parallel_io
from fastckpt.io.checksums import PieceCrcs
from fastckpt.storage.base import Storage

__all__ = ["write_in_order"]

#: Bytes of a tensor handled at once (a device tensor is copied to the host this much at a time).
PIECE_BYTES = 16 << 20


def _tensor_crc(t: torch.Tensor, acc: PieceCrcs, piece: int) -> PieceCrcs:
    for chunk in byte_chunks(t, piece):
        if chunk.device.type != "cpu":
            chunk = chunk.cpu()
        acc.update(chunk.data_ptr(), chunk.numel())
    return acc


def _checksums(plan: SavePlan, piece: int) -> dict[str, PieceCrcs] | None:
    """CRC32C of every tensor and of its pieces, read from memory before anything is written
    (so the header, which holds them, can be written first)."""
    if not plan.checksum:
        return None
    sums = plan.checksummers()
    with concurrent.futures.ThreadPoolExecutor(parallel_io.worker_count()) as pool:
        done = pool.map(lambda n: _tensor_crc(plan.tensors[n], sums[n], piece), list(sums))
        return dict(zip(sums, done))


def _file_bytes(plan: SavePlan, header: bytes, piece: int) -> Iterator[Any]:
    """The checkpoint's bytes in file order: the header, then each tensor in pieces."""
    yield header
    for entry in plan.entries:
        yield from byte_chunks(plan.tensors[entry.name], piece)


def write_in_order(plan: SavePlan, sink: Storage, *, piece_bytes: int = PIECE_BYTES) -> None:
    """Writes ``plan`` to ``sink`` (checksums first, then header and data in file order): the
    file appears whole and durable, or not at all."""
    if plan.frames:  # sizes known once compressed: through a temporary file, header first
        with compressed_writer.Spool() as spool:
            compressed_writer.write_frames(plan, spool)
            sink.write_atomically(spool.pieces(), spool.size())
        return
    sums = _checksums(plan, piece_bytes)
    header = plan.header(None) if sums is None else plan.header_from(sums)
    if len(header) != plan.header_size:
        raise AssertionError("header size changed between planning and writing")
    sink.write_atomically(_file_bytes(plan, header, piece_bytes), plan.file_size)
