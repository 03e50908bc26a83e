"""A checkpoint file at an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

Reads are ranged: the header with one or two small reads, the data with parallel ranged
reads straight into the caller's memory. On S3 each range is one streamed GET whose body is
copied into memory as it arrives (so ranges may be large: about ``parallel`` of them, never
smaller than ``part_size``); other stores return ranges whole (``cat_file``), so their ranges
stay at ``part_size``. Checksums are computed from memory once the bytes are in.

Writes (:meth:`UrlStorage.write_atomically`) stream with bounded memory, and a file at a
URL is complete or absent:

* on S3 the object appears only when the multipart upload completes (at most ``parallel``
  parts of ``part_size`` in flight); any failure aborts the upload, which leaves nothing;
* on other object stores (``gs``, ``az``, ...) the object is created when the file object is
  closed, which happens only after every byte was written; a failure discards the upload;
* on file systems with a rename (``memory://``, ``sftp://``, ``hdfs://``, ...) the bytes go
  to ``<name>.<random>.tmp`` next to the target, which is then moved over it.

Every failure is an ``OSError`` naming the URL and the operation (errno kept).

Example:
    >>> with UrlStorage("memory://doc-url/x.bin") as s:
    ...     s.write_atomically([b"0123456789"], 10)
    ...     s.size(), s.read_bytes(3, 4)
    (10, b'3456')
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.io import parallel_io
from fastckpt.io.parallel_io import Span
from fastckpt.storage.base import Progress, Storage
from fastckpt.storage.locations import url_to_fs

__all__ = ["DEFAULT_PARALLEL", "DEFAULT_PART_SIZE", "UrlStorage", "url_errors"]

#: Bytes per uploaded part and per ranged read (S3 needs parts of at least 5 MiB).
DEFAULT_PART_SIZE = 16 << 20
#: Parts uploaded, or ranges read, at the same time.
DEFAULT_PARALLEL = 8
_S3_MIN_PART = 5 << 20
_S3_MAX_PARTS = 10_000
_STREAM_CHUNK = 1 << 20  # bytes taken from a streamed GET at a time
#: The first read of a URL's header: its length and, usually, the whole header (one request).
HEADER_PROBE = 1 << 20
#: Stores where a written object appears only once its upload completes (no rename needed).
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss")

_ERRNO = {
    FileNotFoundError: errno.ENOENT,
    PermissionError: errno.EACCES,
    IsADirectoryError: errno.EISDIR,
    FileExistsError: errno.EEXIST,
}


def _named(url: str, what: str, exc: BaseException) -> BaseException:
    """``exc`` restated to name the URL and the operation, keeping its type and errno."""
    if isinstance(exc, (HeaderError, ChecksumError)):
        return exc
    message = f"{url}: {what} failed: {exc}"
    if isinstance(exc, OSError):
        code = exc.errno if exc.errno is not None else _ERRNO.get(type(exc), errno.EIO)
        try:
            return type(exc)(code, message, url)
        except TypeError:  # an OSError subclass with its own constructor
            return OSError(code, message, url)
    return OSError(errno.EIO, f"{message} ({type(exc).__name__})", url)


class url_errors:  # noqa: N801 - used as a context manager
    """Context manager that re-raises any failure as an ``OSError`` naming the URL."""

    def __init__(self, url: str, what: str):
        self.url, self.what = url, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        named = _named(self.url, self.what, exc)
        if named is exc:
            return
        raise named from exc


def _is_s3(fs: Any) -> bool:
    return "s3" in _protocols(fs) and hasattr(fs, "call_s3")


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


class _Parts:
    """Cuts a stream of byte pieces into parts of ``part_size``, filled into recycled buffers.

    At most ``count`` buffers exist; :meth:`give_back` returns one for reuse. This is the
    memory bound of a save: ``count * part_size`` whatever the checkpoint's size.
    """

    def __init__(self, part_size: int, count: int):
        self.part_size = part_size
        self._free: list[bytearray] = []
        self._made = 0
        self._count = count
        self._cond = threading.Condition()

    def _take(self) -> bytearray:
        with self._cond:
            while not self._free and self._made >= self._count:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return bytearray(self.part_size)

    def give_back(self, buf: bytearray) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def cut(self, pieces: Iterator[Any]) -> Iterator[tuple[bytearray, int]]:
        """Yields ``(buffer, used bytes)``; the consumer gives each buffer back when done."""
        import torch  # uploads only: the storage layer is importable without torch

        buf, used = None, 0
        for piece in pieces:
            if isinstance(piece, bytes):
                piece = torch.frombuffer(bytearray(piece), dtype=torch.uint8)
            done, n = 0, piece.numel()
            while done < n:
                if buf is None:
                    buf, used = self._take(), 0
                take = min(n - done, self.part_size - used)
                target = torch.frombuffer(buf, dtype=torch.uint8, count=take, offset=used)
                target.copy_(piece[done : done + take])
                used += take
                done += take
                if used == self.part_size:
                    yield buf, used
                    buf = None
        if buf is not None:
            yield buf, used


def _s3_part_size(total: int, part_size: int) -> int:
    # S3 takes at most 10,000 parts: grow the parts of a huge checkpoint to fit.
    needed = -(-total // _S3_MAX_PARTS)
    return max(part_size, _S3_MIN_PART, -(-needed // (1 << 20)) * (1 << 20))


def _s3_upload(
    fs: Any, path: str, url: str, pieces: Iterator[Any], total: int, part_size: int, parallel: int
) -> None:
    """One multipart upload with ``parallel`` parts in flight; aborted on any failure."""
    try:
        _s3_upload_parts(fs, path, url, pieces, total, part_size, parallel)
    finally:
        fs.invalidate_cache(path)  # s3fs may hold a listing from before the upload


def _s3_upload_parts(
    fs: Any, path: str, url: str, pieces: Iterator[Any], total: int, part_size: int, parallel: int
) -> None:
    bucket, key, _ = fs.split_path(path)
    part_size = _s3_part_size(total, part_size)
    # One buffer is filled at a time; each full one is copied into the bytes object that
    # botocore sends (it takes neither a memoryview nor, without a warning from aiohttp, a
    # large bytearray), and at most `parallel` of those are in flight.
    parts = _Parts(part_size, 1)
    if total <= part_size:  # one request: the object appears when it completes
        (buf, used), *_ = list(parts.cut(pieces)) or [(bytearray(), 0)]
        with url_errors(url, "upload"):
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(memoryview(buf)[:used]))
        return
    with url_errors(url, "starting the multipart upload"):
        upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    ids = dict(Bucket=bucket, Key=key, UploadId=upload_id)
    in_flight = threading.BoundedSemaphore(parallel)
    failed: list[BaseException] = []

    def put(number: int, body: bytes) -> dict[str, Any]:
        try:
            with url_errors(url, f"upload of part {number}"):
                reply = fs.call_s3("upload_part", PartNumber=number, Body=body, **ids)
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            in_flight.release()
        return {"PartNumber": number, "ETag": reply["ETag"]}

    pool = concurrent.futures.ThreadPoolExecutor(parallel, thread_name_prefix="fastckpt-s3")
    futures: list[concurrent.futures.Future] = []
    try:
        for number, (buf, used) in enumerate(parts.cut(pieces), start=1):
            body = bytes(memoryview(buf)[:used])
            parts.give_back(buf)
            in_flight.acquire()
            if failed:  # stop early when a part failed
                raise failed[0]
            futures.append(pool.submit(put, number, body))
            del body
        done = [f.result() for f in futures]
        with url_errors(url, "completing the multipart upload"):
            fs.call_s3("complete_multipart_upload", MultipartUpload={"Parts": done}, **ids)
    except BaseException:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        try:
            fs.call_s3("abort_multipart_upload", **ids)
        except Exception:  # the original error matters more; an unaborted upload holds no key
            pass
        raise
    finally:
        pool.shutdown(wait=True)


def _stream_upload(fs: Any, path: str, url: str, pieces: Iterator[Any], part_size: int) -> None:
    """Sequential write through ``fs.open``: temp + move where the store has a rename."""
    object_store = any(p in _OBJECT_STORES for p in _protocols(fs))
    target = path if object_store else f"{path}.{secrets.token_hex(4)}.tmp"
    parts = _Parts(part_size, 1)
    with url_errors(url, "opening for writing"):
        out = fs.open(target, "wb")
    try:
        with url_errors(url, "write"):
            for buf, used in parts.cut(pieces):
                out.write(memoryview(buf)[:used])
                parts.give_back(buf)
            out.close()  # an object store creates the object here, whole
        if not object_store:
            with url_errors(url, "moving the temporary file into place"):
                fs.mv(target, path)
    except BaseException:
        _discard(fs, out, target, object_store)
        raise


def _discard(fs: Any, out: Any, target: str, object_store: bool) -> None:
    """Drops a failed upload without committing it (closing would create the object)."""
    try:
        if hasattr(out, "discard"):
            out.discard()
        if object_store:
            out.closed = True  # AbstractBufferedFile: prevents a commit on garbage collection
        else:
            out.close()
            fs.rm(target)
    except Exception:  # best effort: the original error is what the caller needs
        pass


def _run_parallel(fn: Callable[[Any], None], items: Sequence[Any], workers: int) -> None:
    """Calls ``fn`` on every item with ``workers`` threads; the first error is raised."""
    if len(items) <= 1 or workers <= 1:
        for item in items:
            fn(item)
        return
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            for f in concurrent.futures.as_completed(futures):
                f.result()
        finally:
            for f in futures:
                f.cancel()


class UrlStorage(Storage):
    """A file at an fsspec URL (see the module's description).

    Args:
        url: the file's URL.
        storage_options: passed to the fsspec file system (None: ``FASTCKPT_STORAGE_OPTIONS``).
        part_size: bytes per uploaded part and per ranged read.
        parallel: parts uploaded, or ranges read, at the same time.
        header_probe: bytes of the first read of the header (one request for most headers).
    """

    ranged = True

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        parallel: int = DEFAULT_PARALLEL,
        header_probe: int = HEADER_PROBE,
    ):
        for what, value in (("part_size", part_size), ("parallel", parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        self.location = url
        self.part_size, self.parallel = part_size, parallel
        if isinstance(header_probe, bool) or not isinstance(header_probe, int) or header_probe < 8:
            raise ValueError(
                f"header_probe must be an int of at least 8 bytes, got {header_probe!r}"
            )
        self.header_probe = header_probe
        with url_errors(url, "resolving the URL"):
            self.fs, self.path = url_to_fs(url, storage_options)
        self._size: int | None = None

    def size(self) -> int:
        if self._size is None:
            with url_errors(self.location, "stat"):
                info = self.fs.info(self.path)
            if info.get("type") == "directory":
                raise IsADirectoryError(
                    errno.EISDIR, f"{self.location}: is a directory, not a file", self.location
                )
            self._size = int(info["size"])
        return self._size

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        data = self._cat(offset, offset + nbytes, "reading the header")
        return data

    def _cat(self, start: int, end: int, what: str) -> bytes:
        with url_errors(self.location, what):
            data = self.fs.cat_file(self.path, start=start, end=end)
        if len(data) != end - start:
            raise OSError(
                errno.EIO,
                f"{self.location}: {what} returned {len(data)} bytes for range [{start}, {end})"
                " (was the object replaced while being read?)",
                self.location,
            )
        return data

    def choose_mode(self, region: tuple[int, int]) -> tuple[str, str]:
        del region
        return "ranged", f"parallel ranged reads of an fsspec URL ({self.parallel} at once)"

    def span_bytes(self, total: int, mode: str) -> int:
        """A streamed S3 GET costs no buffer of its size, so S3 reads take fewer, larger ranges
        (about ``parallel`` of them, never smaller than ``part_size``); other stores return each
        range whole, so ranges stay at ``part_size``."""
        del mode
        if _is_s3(self.fs):
            return max(self.part_size, -(-total // self.parallel))
        return self.part_size

    def read_spans(
        self,
        spans: Sequence[Span],
        *,
        owner: Any,
        mode: str,
        checksum: bool,
        on_progress: Progress | None = None,
    ) -> list[list[int]]:
        del owner, mode  # the caller keeps the memory alive until this returns
        spans = list(spans)
        if _is_s3(self.fs):
            self._fetch_streamed(spans)
        else:

            def fetch(span: Span) -> None:
                end = span.file_offset + span.nbytes
                data = self._cat(
                    span.file_offset, end, f"ranged read of [{span.file_offset}, {end})"
                )
                ctypes.memmove(span.address, data, len(data))

            _run_parallel(fetch, spans, self.parallel)
        if on_progress is not None:
            on_progress(sum(span.nbytes for span in spans))
        if not checksum:
            return [[] for _ in spans]
        return parallel_io.checksum_memory(spans)

    def _fetch_streamed(self, spans: list[Span]) -> None:
        """S3: one GET per span, its body copied into memory as it arrives (1 MiB at a time),
        ``parallel`` GETs at once on s3fs's event loop."""
        import asyncio

        from fsspec.asyn import sync

        fs, url = self.fs, self.location
        bucket, key, version = fs.split_path(self.path)
        extra = {"VersionId": version} if version else {}

        async def fetch(span: Span, gate: asyncio.Semaphore) -> None:
            first, last = span.file_offset, span.file_offset + span.nbytes - 1
            got = 0
            async with gate:
                reply = await fs._call_s3(
                    "get_object", Bucket=bucket, Key=key, Range=f"bytes={first}-{last}", **extra
                )
                body = reply["Body"]
                try:
                    while got < span.nbytes:
                        data = await body.read(min(_STREAM_CHUNK, span.nbytes - got))
                        if not data:
                            break
                        ctypes.memmove(span.address + got, data, len(data))
                        got += len(data)
                finally:
                    body.close()
            if got != span.nbytes:
                raise OSError(
                    errno.EIO,
                    f"{url}: ranged read of [{first}, {last + 1}) returned {got} bytes"
                    " (was the object replaced while being read?)",
                    url,
                )

        async def fetch_all() -> None:
            gate = asyncio.Semaphore(self.parallel)
            tasks = [asyncio.ensure_future(fetch(span, gate)) for span in spans if span.nbytes]
            try:
                await asyncio.gather(*tasks)
            finally:  # no read may still write into the memory once this returns
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        with url_errors(url, "ranged read"):
            sync(fs.loop, fetch_all)

    def delete(self) -> None:
        with url_errors(self.location, "delete"):
            if not self.fs.isfile(self.path):
                raise FileNotFoundError(errno.ENOENT, "no such file", self.location)
            self.fs.rm(self.path)
        self._size = None

    def write_atomically(self, pieces: Iterable[Any], total: int) -> None:
        if _is_s3(self.fs):
            _s3_upload(
                self.fs,
                self.path,
                self.location,
                iter(pieces),
                total,
                self.part_size,
                self.parallel,
            )
        else:
            _stream_upload(
                self.fs, self.path, self.location, iter(pieces), max(1, min(total, self.part_size))
            )
        self._size = None
