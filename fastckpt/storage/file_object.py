"""A checkpoint held by a binary file object or a bytes-like object, read through the
:class:`~fastckpt.storage.base.Storage` interface (what ``fastckpt.load(io.BytesIO(...))``
and ``fastckpt.load_bytes`` read).

A seekable file object is read lazily: the header first, then each span with ``seek`` and
``readinto`` straight into the memory given (one at a time: a file object has one position).
A stream that cannot seek (a pipe, a socket's file) is read whole into memory first. A
bytes-like object is read from where it lies, without a copy of it. There is no O_DIRECT and
no writing here: saves to a file object are written by
:mod:`fastckpt.checkpoint.stream_save`.

Example:
    >>> import io
    >>> s = FileObjectStorage(io.BytesIO(b"hello world"))
    >>> s.size(), s.read_bytes(6, 5)
    (11, b'world')
"""

from __future__ import annotations

import ctypes
import io
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from fastckpt import _C
from fastckpt.io.parallel_io import Span
from fastckpt.storage.base import Progress, Storage

__all__ = ["FileObjectStorage", "is_file_object"]

# A span read in one readinto; large enough that Python's per-call cost does not show.
_SPAN_BYTES = 64 << 20


def is_file_object(f: Any) -> bool:
    """Whether ``f`` is a file object (has ``read`` or ``write``), not a path or URL.

    Example:
        >>> import io
        >>> is_file_object(io.BytesIO()), is_file_object("/tmp/x.safetensors")
        (True, False)
    """
    return not isinstance(f, (str, bytes)) and (hasattr(f, "read") or hasattr(f, "write"))


def _readable(f: Any, argname: str) -> None:
    if not hasattr(f, "read"):
        raise TypeError(f"{argname}: a file object to load from must be readable (no read())")
    mode = getattr(f, "mode", None)
    if isinstance(f, io.TextIOBase) or (isinstance(mode, str) and "b" not in mode):
        raise TypeError(f"{argname}: open the file in binary mode ('rb'), not text mode")
    readable = getattr(f, "readable", None)
    if readable is not None and not readable():
        raise io.UnsupportedOperation(f"{argname}: the file object is not open for reading")


class FileObjectStorage(Storage):
    """The bytes of a readable binary file object, or of a bytes-like object.

    Args:
        source: a binary file object (``open(path, "rb")``, ``io.BytesIO``, ...) or a
            bytes-like object (``bytes``, ``bytearray``, ``memoryview``).
        argname: the caller's parameter name, for error messages.
    """

    # Read like a URL: in order, larger reads better, into host memory (a load to a GPU
    # copies from there), never memory-mapped.
    ranged = True

    def __init__(self, source: Any, *, argname: str = "f"):
        self._lock = threading.Lock()
        self._file: Any = None
        self._data: memoryview | None = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._data = memoryview(source).cast("B")
            self.location = f"<{type(source).__name__} of {self._data.nbytes} bytes>"
            return
        _readable(source, argname)
        name = getattr(source, "name", None)
        self.location = name if isinstance(name, str) else f"<{type(source).__name__}>"
        seekable = getattr(source, "seekable", None)
        if seekable is not None and seekable():
            self._file = source
            self._start = source.tell()  # a checkpoint may follow other bytes in the file
            self._size = source.seek(0, io.SEEK_END) - self._start
        else:  # a stream is read once, in order: keep it whole
            self._data = memoryview(source.read())

    def size(self) -> int:
        return self._data.nbytes if self._data is not None else self._size

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        if offset + nbytes > self.size():
            raise EOFError(f"{self.location}: {nbytes} bytes at {offset} run past its end")
        if self._data is not None:
            return bytes(self._data[offset : offset + nbytes])
        out = bytearray(nbytes)
        self._read_into(offset, memoryview(out))
        return bytes(out)

    def _read_into(self, offset: int, out: memoryview) -> None:
        """Fills ``out`` with the bytes at ``offset``."""
        if self._data is not None:
            out[:] = self._data[offset : offset + out.nbytes]
            return
        with self._lock:
            self._file.seek(self._start + offset)
            done = 0
            while done < out.nbytes:
                got = self._file.readinto(out[done:])
                if not got:
                    raise EOFError(
                        f"{self.location}: ended {out.nbytes - done} bytes early at {offset + done}"
                    )
                done += got

    def read_spans(
        self,
        spans: Sequence[Span],
        *,
        owner: Any,
        mode: str,
        checksum: bool,
        on_progress: Progress | None = None,
    ) -> list[list[int]]:
        del owner, mode  # the caller holds the memory until this returns
        found: list[list[int]] = []
        for span in spans:
            memory = (ctypes.c_char * span.nbytes).from_address(span.address)
            self._read_into(span.file_offset, memoryview(memory).cast("B"))
            crcs: list[int] = []
            if checksum:
                bounds = (0, *span.cuts, span.nbytes)
                crcs = [_C.crc32c(span.address + lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]
            found.append(crcs)
            if on_progress is not None:
                on_progress(span.nbytes)
        return found

    def choose_mode(self, region: tuple[int, int]) -> tuple[str, str]:
        return "buffered", "a file object is read with readinto"

    def span_bytes(self, total: int, mode: str) -> int:
        return _SPAN_BYTES

    def write_atomically(self, pieces: Iterable[Any], total: int) -> None:
        raise io.UnsupportedOperation(
            f"{self.location}: a file object is written by fastckpt.save(obj, f), not here"
        )

    def delete(self) -> None:
        raise io.UnsupportedOperation(f"{self.location}: a file object cannot be deleted")
