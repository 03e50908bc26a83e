"""The storage interface: what the checkpoint layer needs of the place a file's bytes live.

A :class:`Storage` is one checkpoint file, opened: its size, small reads (the header), and
ranged reads of many spans straight into memory the caller gives (checksummed on the way
where the storage can). :meth:`Storage.write_atomically` is the durable, atomic sink: the
file appears whole or not at all. Directories are listed and files deleted with the
functions of :mod:`fastckpt.storage`.

Two implementations: :class:`~fastckpt.storage.local.LocalStorage` (the native engine,
O_DIRECT or the page cache, the commit protocol of :mod:`fastckpt.io.commit`) and
:class:`~fastckpt.storage.url.UrlStorage` (fsspec: ranged reads, streamed uploads).

Example:
    >>> from fastckpt.storage import open_storage
    >>> with open_storage("memory://doc-storage/x.bin", create=True) as s:
    ...     s.write_atomically([b"hello"], 5)
    ...     s.size(), s.read_bytes(1, 3)
    (5, b'ell')
"""

from __future__ import annotations

import abc
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastckpt.io.parallel_io import Span

__all__ = ["Storage", "Progress"]

#: ``on_progress(nbytes)``: told as spans complete, possibly from worker threads.
Progress = Callable[[int], None]


class Storage(abc.ABC):
    """One checkpoint file's bytes, wherever they live (see the module's description).

    ``location`` (the path or URL) names the file in every message.
    """

    location: str
    #: Whether each read is a request to a server (a URL): one larger read beats two small.
    ranged: bool = False
    #: Bytes of the first read of a header (its length, and with a URL usually all of it).
    header_probe: int = 8

    @abc.abstractmethod
    def size(self) -> int:
        """The file's length in bytes."""

    @abc.abstractmethod
    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` from ``offset`` (small reads: the header); ``HeaderError`` is
        the caller's to raise when the file is shorter, so this raises ``EOFError`` then."""

    @abc.abstractmethod
    def read_spans(
        self,
        spans: Sequence[Span],
        *,
        owner: Any,
        mode: str,
        checksum: bool,
        on_progress: Progress | None = None,
    ) -> list[list[int]]:
        """Reads every span into its memory (kept alive by ``owner``), in parallel; returns
        per span the CRC32C of each of its segments (empty lists without ``checksum``).
        ``mode`` is what :meth:`choose_mode` answered for these bytes."""

    @abc.abstractmethod
    def choose_mode(self, region: tuple[int, int]) -> tuple[str, str]:
        """``(mode, why)``: how bytes ``region = (offset, nbytes)`` will be read now."""

    @abc.abstractmethod
    def span_bytes(self, total: int, mode: str) -> int:
        """The most bytes one span should cover when ``total`` bytes are read in ``mode``."""

    @abc.abstractmethod
    def write_atomically(self, pieces: Iterable[Any], total: int) -> None:
        """Writes the file from ``pieces`` (bytes-like objects or uint8 CPU tensors, in file
        order, ``total`` bytes in all): it appears whole and durable, or not at all."""

    @abc.abstractmethod
    def delete(self) -> None:
        """Removes the file (``FileNotFoundError`` naming it when there is none)."""

    def local_file(self) -> Any:
        """The open :class:`~fastckpt.io.files.File` for what only a local file can do
        (memory mapping, GPUDirect reads).

        Raises:
            io.UnsupportedOperation: this storage is not a local file; the message says so.
        """
        raise io.UnsupportedOperation(
            f"{self.location} is not a local file: it cannot be memory-mapped or read "
            "straight into GPU memory (read it with get_tensors instead)"
        )

    def close(self) -> None:  # noqa: B027 - most storages hold nothing open
        """Releases what the storage holds open; closing twice is harmless."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
