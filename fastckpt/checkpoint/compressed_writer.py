"""Writing a checkpoint whose tensors are compressed: frames compressed on every core while
the earlier ones are written, in bounded memory.

A compressed tensor's stored size is known only once it is compressed, and the header (which
says where each tensor is) comes first in the file. So the plan reserves room for the header
as it would be were every frame as large as it can get
(:func:`~fastckpt.format.compressed.frame_bound`); the writer writes the uncompressed tensors
at their planned offsets, then each frame after the last one as its chunks come out of the
codec's pool (:func:`fastckpt.codec.frames.compress_stream`: a few chunks per core ahead of
the writes), its head (the table of stored lengths, whose size is known up front) once its
last chunk is written; then the header, padded with spaces to the room reserved
(:func:`~fastckpt.format.compressed.pad_header`), and the file is cut to its real length.
Memory: a few 2 MiB chunks per core, whatever the checkpoint's size; a slow file system
writes one frame while the next ones compress.

Checksums are those of every save: the CRC32C of each frame's stored bytes and of its
pieces (what ``verify=True`` checks), and in the frame table the CRC32C of the tensor's raw
bytes. The recorded XXH3-128 of a compressed tensor is that of its *raw* bytes, so an
incremental save (:mod:`fastckpt.checkpoint.incremental`) compares it with the tensor as it
is in memory, compressed or not in either file.

A sink that takes a stream (a URL, a file object that cannot seek) gets the file from a
temporary file (:class:`Spool`), written as above then streamed: the header goes out first.

Example:
    >>> import os, tempfile, torch, fastckpt
    >>> path = os.path.join(tempfile.mkdtemp(), "c.safetensors")
    >>> w = torch.randn(512, 512).to(torch.bfloat16)
    >>> fastckpt.save({"w": w, "step": torch.tensor(3)}, path, compress=True)
    >>> torch.equal(fastckpt.load(path)["w"], w), os.path.getsize(path) < w.nbytes
    (True, True)
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import xxhash

from fastckpt import _C, format
from fastckpt.checkpoint.digests import TensorDigest
from fastckpt.codec import frames
from fastckpt.format import compressed as layout
from fastckpt.io.checksums import crc32c_combine
from fastckpt.progress import progress_bar

__all__ = ["FrameWriter", "Spool", "write_frames"]

#: Bytes of an uncompressed tensor written (and copied to the host) at a time.
_PLAIN_STEP = 16 << 20


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order, one-dimensional uint8 (on its own device)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()  # rare (transposed views): one temporary copy
    return t.reshape(-1).view(torch.uint8)


def _host(chunk: torch.Tensor) -> np.ndarray:
    return (chunk if chunk.device.type == "cpu" else chunk.cpu()).numpy()


class FrameWriter:
    """Writes a plan with frames (``plan.frames``) into a file-like target that has
    ``pwrite_all(data, offset)``, ``truncate(length)`` and ``pread(nbytes, offset)`` or ``fd``: a
    :class:`~fastckpt.io.files.File` or a :class:`Spool`.

    Same phases as the staging writer: :meth:`fill` writes the data section, :meth:`finish`
    the header; :meth:`abort` has nothing to collect (every write is done when a phase
    returns). The plan's entries and compressed table hold the real sizes once
    :meth:`fill` returns."""

    def __init__(
        self,
        plan: Any,
        file: Any,
        *,
        progress: bool | None = None,
        cancel: threading.Event | None = None,
    ):
        self.plan, self.file, self._progress = plan, file, progress
        self._cancel = cancel  # once set, the next chunk raises KeyboardInterrupt
        self.sums: dict[str, Any] = {}
        self._written: dict[int, tuple[format.TensorEntry, Any, layout.CompressedTensor]] = {}
        self._rotations: dict[int, int] = {}  # id(tensor) -> its byte planes' rotation

    def fill(self) -> None:
        """Writes every tensor: the uncompressed ones where planned, then the frames."""
        plan = self.plan
        plain = [e for e in plan.entries if e.name not in plan.frames]
        cursor = plain[-1].end if plain else 0
        raw_total = sum(job.nbytes for job in plan.frames.values())
        entries = list(plain)
        with progress_bar(raw_total, "compressing", enabled=self._progress) as bar:
            for e in plain:
                self._write_plain(e)
            # One stream of chunks across every frame: the next tensor's chunks compress
            # while this one's are written, and a small tensor does not leave cores idle.
            chunks = frames.ordered_map(_compress_one, self._chunk_jobs())
            try:
                for name, job in plan.frames.items():
                    entry = self._write_frame(name, job, cursor, chunks, bar)
                    entries.append(entry)
                    cursor = entry.end
            finally:
                chunks.close()  # an error: the chunks compressing ahead are let go
        plan.entries = entries

    def _chunk_jobs(self) -> Iterator[tuple[torch.Tensor, int, int, str, int, int]]:
        """``(tensor bytes, lo, hi, codec, itemsize, rotation)`` of every chunk of every
        frame, in file order; a tied tensor's second name has none (its frame is copied).
        A byte-plane frame's rotation is chosen from the tensor's first bytes (or its dtype,
        when it is small) before its first chunk is handed out, and kept for
        :meth:`_write_frame`."""
        seen: set[int] = set()
        for name, job in self.plan.frames.items():
            t = self.plan.tensors[name]
            if id(t) in seen:
                continue
            seen.add(id(t))
            data = _flat_bytes(t)
            rotation = 1
            if frames.CODECS[job.codec] in layout.PLANE_CODECS:

                def head(n: int, data: torch.Tensor = data) -> np.ndarray:
                    return _host(data[:n])

                rotation = frames.tensor_rotation(head, job.nbytes, job.itemsize, job.dtype)
            self._rotations[id(t)] = rotation
            step = frames.chunk_size(frames.DEFAULT_CHUNK_BYTES, job.codec, job.itemsize)
            for lo in range(0, job.nbytes, step):
                yield data, lo, min(job.nbytes, lo + step), job.codec, job.itemsize, rotation

    def _write_plain(self, e: format.TensorEntry) -> None:
        plan = self.plan
        acc = TensorDigest(e.nbytes, plan.piece_size, plan.known_hashes.get(e.name))
        data = _flat_bytes(plan.tensors[e.name])
        for at in range(0, e.nbytes, _PLAIN_STEP):
            chunk = _host(data[at : at + _PLAIN_STEP])
            acc.update(chunk.ctypes.data, chunk.nbytes)
            self.file.pwrite_all(chunk.data, plan.header_size + e.begin + at)
        self.sums[e.name] = acc

    def _write_frame(
        self, name: str, job: Any, begin: int, chunks: Iterator[Any], bar: Any
    ) -> format.TensorEntry:
        """Writes the frame of tensor ``name`` at data offset ``begin`` from its chunks, the
        next ones of ``chunks``; returns its entry."""
        plan = self.plan
        t = plan.tensors[name]
        if id(t) in self._written:  # a tied tensor: the same frame again, copied
            return self._copy_frame(name, begin)
        code = frames.CODECS[job.codec]
        planes = layout.planes_of(code, job.itemsize)
        chunk_bytes = frames.chunk_size(frames.DEFAULT_CHUNK_BYTES, job.codec, job.itemsize)
        count = layout.chunk_count(job.nbytes, chunk_bytes)
        head_bytes = layout.HEAD_BYTES + 4 * count * planes
        known = plan.known_hashes.get(name)
        hasher = None if known is not None else xxhash.xxh3_128()
        at = plan.header_size + begin
        pos = head_bytes  # the head is written last, when the stored lengths are known
        parts: list[tuple[int, int]] = []  # (CRC32C, length) of the bytes after the head
        lengths: list[int] = []
        raw_crc = 0
        for _ in range(count):
            if self._cancel is not None and self._cancel.is_set():
                raise KeyboardInterrupt(f"save to {self.file.path} cancelled")
            raw, stored, crc = next(chunks)
            if hasher is not None:
                hasher.update(raw.data)
            raw_crc = crc32c_combine(raw_crc, crc, raw.nbytes)
            views = [np.frombuffer(p, np.uint8) if isinstance(p, bytes) else p for p in stored]
            lengths += [view.nbytes for view in views]
            # the chunk's planes in one write (a copy of a few MiB costs less than a system
            # call per plane, for the many small tensors of a fine-tune's adapters)
            joined = views[0] if len(views) == 1 else np.concatenate(views)
            self.file.pwrite_all(joined.data, at + pos)
            parts += _piece_parts(joined, pos, plan.piece_size)
            pos += joined.nbytes
            bar.update(raw.nbytes)
        rotation = self._rotations.get(id(t)) if code in layout.PLANE_CODECS else None
        table = layout.frame_table(code, planes, chunk_bytes, job.nbytes, lengths, rotation)
        head = np.frombuffer(layout.encode_frame_head(table), np.uint8)
        if head.nbytes != head_bytes:
            raise AssertionError(f"tensor {name!r}: frame head size changed while writing")
        self.file.pwrite_all(head.data, at)
        acc = TensorDigest(pos, plan.piece_size, known if hasher is None else hasher.hexdigest())
        acc.update_crc(head.ctypes.data, head.nbytes)
        for crc, n in parts:
            acc.add(crc, n)
        self.sums[name] = acc
        entry = format.TensorEntry(name, layout.COMPRESSED_DTYPE, (pos,), begin, begin + pos)
        described = layout.CompressedTensor(job.dtype, job.shape, job.nbytes, raw_crc)
        plan.compressed[name] = described
        self._written[id(t)] = (entry, acc, described)
        return entry

    def _copy_frame(self, name: str, begin: int) -> format.TensorEntry:
        first, acc, described = self._written[id(self.plan.tensors[name])]
        base = self.plan.header_size
        for at in range(0, first.nbytes, _PLAIN_STEP):
            n = min(_PLAIN_STEP, first.nbytes - at)
            self.file.pwrite_all(
                _read_back(self.file, n, base + first.begin + at), base + begin + at
            )
        self.sums[name] = acc  # same bytes, same checksums
        self.plan.compressed[name] = described
        return format.TensorEntry(
            name, layout.COMPRESSED_DTYPE, first.shape, begin, begin + first.nbytes
        )

    def finish(self) -> None:
        """Writes the header into the room the plan reserved, and cuts the file to its size."""
        plan = self.plan
        header = plan.header_from(self.sums)
        self.file.pwrite_all(layout.pad_header(header, plan.header_size), 0)
        self.file.truncate(plan.file_size)

    def abort(self) -> None:
        """Nothing is in flight once a phase returns or raises."""


def _compress_one(
    chunk: tuple[torch.Tensor, int, int, str, int, int],
) -> tuple[Any, list[Any], int]:
    """A chunk's raw bytes (on the host), stored planes and CRC32C (on a pool thread)."""
    data, lo, hi, codec, itemsize, rotation = chunk
    raw = _host(data[lo:hi])
    stored, crc = frames.compress_chunk(raw, codec, itemsize, rotation)
    return raw, stored, crc


def _read_back(file: Any, nbytes: int, offset: int) -> bytes:
    """``nbytes`` already written at ``offset`` of ``file`` (a target with ``pread``, or a
    :class:`~fastckpt.io.files.File`)."""
    if hasattr(file, "pread"):
        return file.pread(nbytes, offset)
    data = os.pread(file.fd, nbytes, offset)
    if len(data) != nbytes:
        raise OSError(f"{file.path}: read {len(data)} of {nbytes} bytes at {offset}")
    return data


def _piece_parts(view: np.ndarray, pos: int, piece_size: int) -> list[tuple[int, int]]:
    """CRC32C and length of ``view``'s bytes (at ``pos`` in its tensor), cut at multiples
    of ``piece_size`` (the pieces whose CRC32Cs the header records)."""
    parts = []
    at, n = 0, view.nbytes
    while at < n:
        take = n - at if not piece_size else min(n - at, piece_size - (pos + at) % piece_size)
        parts.append((_C.crc32c(view.ctypes.data + at, take), take))
        at += take
    return parts


def write_frames(plan: Any, file: Any, *, progress: bool | None = None) -> None:
    """Writes a plan with frames into ``file`` (see :class:`FrameWriter`)."""
    writer = FrameWriter(plan, file, progress=progress)
    writer.fill()
    writer.finish()


class Spool:
    """A temporary file (deleted when closed) that a :class:`FrameWriter` writes into, for
    sinks that take the file as a stream; :meth:`pieces` reads it back in order.

    Example:
        >>> with Spool() as spool:
        ...     spool.pwrite_all(b"abc", 0)
        ...     b"".join(spool.pieces())
        b'abc'
    """

    path = "<spool>"

    def __init__(self, directory: str | None = None):
        self._file = tempfile.TemporaryFile(dir=directory)
        self.fd = self._file.fileno()

    def pwrite_all(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def truncate(self, length: int) -> None:
        os.ftruncate(self.fd, length)

    def pread(self, nbytes: int, offset: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def pieces(self, step: int = _PLAIN_STEP) -> Iterator[bytes]:
        """The file's bytes in order, ``step`` bytes at a time."""
        total, at = self.size(), 0
        while at < total:
            piece = os.pread(self.fd, min(step, total - at), at)
            if not piece:
                raise OSError(f"spool file ended at {at} of {total} bytes")
            yield piece
            at += len(piece)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
