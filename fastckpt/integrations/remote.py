"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...): streamed save, ranged load.

``fastckpt.save``, ``load``, ``open`` and ``async_save`` hand a URL here; a local path (or a
``file://`` URL, which is turned back into one) keeps the native direct-I/O path. A URL is
resolved with ``fsspec.core.url_to_fs(url, **storage_options)``.

Save. The layout is planned before any byte is written (:func:`fastckpt.checkpoint.save.plan_save`), and
the CRC32Cs are computed in a first pass over the tensors in memory, so the header is known up
front and goes out first, followed by the data, in file order. Bytes travel through one
fill buffer of ``part_size`` and at most ``parallel`` parts in flight: the memory used is
bounded whatever the checkpoint's size. On S3 the parts are uploaded in parallel as one
multipart upload; elsewhere they are written in order to one file object.

Commit. A checkpoint at a URL is complete or absent:

* on S3 the object appears only when the multipart upload completes; any failure aborts the
  upload, which leaves nothing behind;
* on other object stores (``gs``, ``az``, ...) the object is created when the file object is
  closed, which happens only after every byte was written; a failure discards the upload;
* on file systems with a rename (``memory://``, ``sftp://``, ``hdfs://``, ...) the bytes go to
  ``<name>.<random>.tmp`` next to the target, which is then moved over it.

Load. The header is read with one or two ranged reads; the tensors' bytes are then fetched
with parallel ranged reads straight into one arena (the returned tensors are views into it),
and every tensor's CRC32C is checked. On S3 each range is one streamed GET whose body is
copied into the arena as it arrives; other stores return ranges whole (``cat_file``), so
their ranges stay at ``part_size``. ``keys=`` fetches only those tensors' bytes.

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.ones(2, 2), "step": 7}, "memory://doc/ckpt.safetensors")
    >>> fastckpt.load("memory://doc/ckpt.safetensors")["step"]
    7
    >>> with fastckpt.open("memory://doc/ckpt.safetensors") as r:
    ...     r.get_tensor("w").sum().item()
    4.0
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fastckpt import _C, config, format
from fastckpt.checkpoint import tree
from fastckpt.checkpoint.asynchronous import run_pending
from fastckpt.checkpoint.header_view import HeaderView
from fastckpt.checkpoint.save import SavePlan, _byte_chunks, plan_save
from fastckpt.checkpoint.tensor_runs import tensor_runs, tensor_view
from fastckpt.errors import ChecksumError, HeaderError
from fastckpt.io import parallel_io
from fastckpt.io.checksums import PieceCrcs
from fastckpt.io.commit import write_atomically

__all__ = [
    "DEFAULT_PART_SIZE",
    "DEFAULT_PARALLEL",
    "RemoteReader",
    "async_save",
    "handles",
    "local_path",
    "is_url",
    "join",
    "load",
    "open_url",
    "read_bytes",
    "save",
    "write_bytes",
    "url_to_fs",
]

#: Bytes per uploaded part and per ranged read (S3 needs parts of at least 5 MiB).
DEFAULT_PART_SIZE = 16 << 20
#: Parts uploaded, or ranges read, at the same time.
DEFAULT_PARALLEL = 8
_S3_MIN_PART = 5 << 20
_S3_MAX_PARTS = 10_000
_HEADER_PROBE = 1 << 20  # first read of a load: the length and, usually, the whole header
_ARENA_ALIGN = 64
_STREAM_CHUNK = (
    1 << 20
)  # bytes taken from a streamed GET at a time  # tensors keep their data-section offset modulo this in the arena
_LOCAL_PROTOCOLS = ("file", "local")
#: Stores where a written object appears only once its upload completes (no rename needed).
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss")


# --------------------------------------------------------------------------- URLs


def _protocol(path: Any) -> str | None:
    if not isinstance(path, str) or "://" not in path:
        return None
    return path.split("://", 1)[0].split("::")[-1].lower()


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL that goes through fsspec (any protocol but ``file``).

    Example:
        >>> is_url("s3://bucket/ckpt.safetensors"), is_url("file:///tmp/x"), is_url("/tmp/x")
        (True, False, False)
    """
    protocol = _protocol(path)
    return protocol is not None and protocol not in _LOCAL_PROTOCOLS


def handles(path: Any) -> bool:
    """Whether this module takes ``path``: any ``scheme://`` string, ``file://`` included.

    ``file://`` URLs are turned back into paths and take the native direct-I/O path.

    Example:
        >>> handles("file:///tmp/x.safetensors"), handles("/tmp/x.safetensors")
        (True, False)
    """
    return _protocol(path) is not None


def local_path(url: str) -> str:
    """The path of a ``file://`` or ``local://`` URL."""
    return url.split("://", 1)[1]


def join(base: str, name: str) -> str:
    """``name`` inside ``base``, a local directory or a URL.

    Example:
        >>> join("s3://bucket/run/", "model.safetensors"), join("/tmp/run", "a")
        ('s3://bucket/run/model.safetensors', '/tmp/run/a')
    """
    return base.rstrip("/") + "/" + name if is_url(base) else os.path.join(base, name)


def url_to_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, path)`` for ``url``, as ``fsspec.core.url_to_fs`` resolves it.

    Raises:
        ImportError: fsspec (or the package of this protocol, such as s3fs) is not installed.
        ValueError: the protocol is unknown.

    Example:
        >>> fs, path = url_to_fs("memory://bucket/x.safetensors")
        >>> type(fs).__name__, path
        ('MemoryFileSystem', '/bucket/x.safetensors')
    """
    try:
        import fsspec.core
    except ImportError:
        raise ImportError(
            f"{url}: URLs need fsspec (pip install 'fastckpt[s3]' for S3, or fsspec)"
        ) from None
    if storage_options is None:
        storage_options = _options_from_environment()
    if not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    return fsspec.core.url_to_fs(url, **dict(storage_options))


def _options_from_environment() -> dict[str, Any]:
    """``FASTCKPT_STORAGE_OPTIONS`` (a JSON object): storage options when a call passes none."""
    text = (config.environment("STORAGE_OPTIONS") or "").strip()
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"FASTCKPT_STORAGE_OPTIONS is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError("FASTCKPT_STORAGE_OPTIONS must be a JSON object")
    return options


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


class _Errors:
    """Context manager that re-raises any failure as an ``OSError`` naming the URL."""

    def __init__(self, url: str, what: str):
        self.url, self.what = url, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        named = _named(self.url, self.what, exc)
        if named is exc:
            return False
        raise named from exc


def _is_s3(fs: Any) -> bool:
    return "s3" in _protocols(fs) and hasattr(fs, "call_s3")


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


# --------------------------------------------------------------------------- save


def _tensor_crc(t: torch.Tensor, acc: PieceCrcs, piece: int) -> PieceCrcs:
    for chunk in _byte_chunks(t, piece):
        if chunk.device.type != "cpu":
            chunk = chunk.cpu()
        acc.update(chunk.data_ptr(), chunk.numel())
    return acc


def _checksums(plan: SavePlan, threads: int) -> dict[str, PieceCrcs] | None:
    """CRC32C of every tensor and of its pieces, read from memory before anything is written
    (so the header, which holds them, can be written first)."""
    if not plan.checksum:
        return None
    sums = plan.checksummers()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        done = pool.map(
            lambda n: _tensor_crc(plan.tensors[n], sums[n], DEFAULT_PART_SIZE), list(sums)
        )
        return dict(zip(sums, done))


def _file_bytes(plan: SavePlan, header: bytes, piece: int) -> Iterator[Any]:
    """The checkpoint's bytes in file order: the header, then each tensor in pieces."""
    yield header
    for entry in plan.entries:
        yield from _byte_chunks(plan.tensors[entry.name], piece)


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
        with _Errors(url, "upload"):
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(memoryview(buf)[:used]))
        return
    with _Errors(url, "starting the multipart upload"):
        upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    ids = dict(Bucket=bucket, Key=key, UploadId=upload_id)
    in_flight = threading.BoundedSemaphore(parallel)
    failed: list[BaseException] = []

    def put(number: int, body: bytes) -> dict[str, Any]:
        try:
            with _Errors(url, f"upload of part {number}"):
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
        with _Errors(url, "completing the multipart upload"):
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
    with _Errors(url, "opening for writing"):
        out = fs.open(target, "wb")
    try:
        with _Errors(url, "write"):
            for buf, used in parts.cut(pieces):
                out.write(memoryview(buf)[:used])
                parts.give_back(buf)
            out.close()  # an object store creates the object here, whole
        if not object_store:
            with _Errors(url, "moving the temporary file into place"):
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


def write_plan(
    plan: SavePlan,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
) -> None:
    """Writes a planned checkpoint to ``url``: checksums first, then header and data, streamed."""
    if part_size < 1 or parallel < 1:
        raise ValueError(f"part_size and parallel must be positive, got {part_size}, {parallel}")
    with _Errors(url, "resolving the URL"):
        fs, path = url_to_fs(url, storage_options)
    sums = _checksums(plan, parallel_io.worker_count())
    header = plan.header(None) if sums is None else plan.header_from(sums)
    if len(header) != plan.header_size:
        raise AssertionError("header size changed between planning and writing")
    pieces = _file_bytes(plan, header, part_size)
    if _is_s3(fs):
        _s3_upload(fs, path, url, pieces, plan.file_size, part_size, parallel)
    else:
        _stream_upload(fs, path, url, pieces, part_size)


def save(
    obj: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    **local_options: Any,
) -> None:
    """Saves ``obj`` at ``url`` (what ``fastckpt.save`` does for a URL).

    Memory: at most ``parallel + 1`` parts of ``part_size`` bytes beyond the tensors (plus the
    HTTP client's copies of the parts in flight).

    Args:
        storage_options: passed to the fsspec file system (``key``, ``secret``,
            ``endpoint_url``, ``client_kwargs``, ...).
        part_size: bytes per uploaded part (S3: at least 5 MiB; grown for huge files).
        parallel: parts uploaded at once (S3).
        local_options: I/O options of the native path, used for ``file://`` URLs.
        Other arguments: as :func:`fastckpt.save`.

    Raises:
        OSError (``FileNotFoundError``, ``PermissionError``, ...): naming the URL, for a
            missing bucket, refused credentials or a failed transfer; nothing is left at
            the URL.

    Example:
        >>> import torch
        >>> save({"x": torch.arange(3)}, "memory://doc/save.safetensors")
        >>> load("memory://doc/save.safetensors")["x"].tolist()
        [0, 1, 2]
    """
    options = dict(metadata=metadata, alignment=alignment, checksum=checksum)
    if not is_url(url):
        import fastckpt

        fastckpt.save(obj, local_path(url), allow_pickle=allow_pickle, **options, **local_options)
        return
    plan = plan_save(obj, allow_pickle=allow_pickle, **options)
    write_plan(plan, url, storage_options=storage_options, part_size=part_size, parallel=parallel)


def async_save(
    obj: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    snapshot: bool = True,
    metadata: Mapping[str, str] | None = None,
    alignment: int = format.DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    **local_options: Any,
) -> Any:
    """Saves like :func:`save` in a background thread; returns a ``fastckpt.SaveFuture``.

    With ``snapshot=True`` (the default) the tensors are copied to host memory first, so the
    caller may change them as soon as this returns.

    Example:
        >>> import torch
        >>> future = async_save({"w": torch.ones(3)}, "memory://doc/async.safetensors")
        >>> future.result()
        >>> load("memory://doc/async.safetensors")["w"].tolist()
        [1.0, 1.0, 1.0]
    """
    import fastckpt

    options = dict(metadata=metadata, alignment=alignment, checksum=checksum)
    if not is_url(url):
        return fastckpt.async_save(
            obj,
            local_path(url),
            snapshot=snapshot,
            allow_pickle=allow_pickle,
            **options,
            **local_options,
        )
    future = fastckpt.SaveFuture(url)
    try:
        plan = plan_save(obj, allow_pickle=allow_pickle, **options)
        if snapshot:
            plan.tensors = {n: t.detach().to("cpu", copy=True) for n, t in plan.tensors.items()}
    except BaseException as exc:
        future._set(None, exc)
        return future

    def work() -> None:
        write_plan(
            plan, url, storage_options=storage_options, part_size=part_size, parallel=parallel
        )

    run_pending(future, work, name="fastckpt-save:url")  # fastckpt.wait_all() waits for it
    return future


def write_bytes(url: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Writes a small object (an index file) whole at a URL, or a local file at a plain path,
    with the same commit rule as :func:`save`.

    Example:
        >>> write_bytes("memory://doc/note.json", b"{}")
        >>> read_bytes("memory://doc/note.json")
        b'{}'
    """
    if not is_url(url):
        write_atomically(url, data)
        return
    with _Errors(url, "resolving the URL"):
        fs, path = url_to_fs(url, storage_options)
    pieces = iter([data]) if data else iter(())
    if _is_s3(fs):
        _s3_upload(fs, path, url, pieces, len(data), DEFAULT_PART_SIZE, 1)
    else:
        _stream_upload(fs, path, url, pieces, max(1, len(data)))


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """Reads a whole small object (an index file) at a URL, or a local file at a plain path;
    errors name the URL or path.

    Example:
        >>> write_bytes("memory://doc/small.json", b"{}")
        >>> read_bytes("memory://doc/small.json")
        b'{}'
    """
    if not is_url(url):
        with open(url, "rb") as f:
            return f.read()
    with _Errors(url, "resolving the URL"):
        fs, path = url_to_fs(url, storage_options)
    with _Errors(url, "read"):
        return fs.cat_file(path)


# --------------------------------------------------------------------------- load


class RemoteReader(HeaderView):
    """A checkpoint at a URL opened for lazy reading: what ``fastckpt.open(url)`` returns.

    Only the header is read on opening (a first read of ``header_probe`` bytes holds the
    header's length and usually the whole header; a longer header takes a second read);
    each :meth:`get_tensors` fetches just the bytes of the tensors asked for, with parallel
    ranged reads into one arena, and :meth:`read_range` just the pieces covering a range.

    Example:
        >>> import torch
        >>> save({"a": torch.ones(2), "b": torch.zeros(3)}, "memory://doc/reader.safetensors")
        >>> with open_url("memory://doc/reader.safetensors") as r:
        ...     sorted(r.keys()), r.get_tensor("b").tolist()
        (['a', 'b'], [0.0, 0.0, 0.0])
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        parallel: int = DEFAULT_PARALLEL,
        header_probe: int = _HEADER_PROBE,
    ):
        if part_size < 1 or parallel < 1:
            raise ValueError(
                f"part_size and parallel must be positive, got {part_size}, {parallel}"
            )
        if header_probe < 8:
            raise ValueError(f"header_probe must be at least 8 bytes, got {header_probe}")
        self.path = url
        self.part_size, self.parallel = part_size, parallel
        self._header_probe = header_probe
        #: data bytes fetched so far (by range reads: the checksummed pieces read)
        self.bytes_read = 0
        self._count_lock = threading.Lock()
        with _Errors(url, "resolving the URL"):
            self._fs, self._path = url_to_fs(url, storage_options)
        self._read_header()

    # -- header ---------------------------------------------------------------------------
    def _cat(self, start: int, end: int, what: str) -> bytes:
        with _Errors(self.path, what):
            data = self._fs.cat_file(self._path, start=start, end=end)
        if len(data) != end - start:
            raise OSError(
                errno.EIO,
                f"{self.path}: {what} returned {len(data)} bytes for range [{start}, {end})"
                " (was the object replaced while being read?)",
                self.path,
            )
        return data

    def _read_header(self) -> None:
        url = self.path
        with _Errors(url, "stat"):
            info = self._fs.info(self._path)
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, f"{url}: is a directory, not a file", url)
        self.size = size = int(info["size"])
        probe = min(size, self._header_probe)
        first = self._cat(0, probe, "reading the header") if size else b""
        try:
            n = format.parse_header_length(first, size)
            raw = first[8 : 8 + n] if len(first) >= 8 + n else self._cat(8, 8 + n, "header")
            header = format.parse_header(raw, size)
        except HeaderError as exc:
            raise HeaderError(f"{url}: {exc}") from None
        self._adopt_header(header)

    # -- reading --------------------------------------------------------------------------
    def read(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        """Fetches stored tensors (all when ``names`` is None); stored name -> view of one arena.

        Raises:
            ChecksumError: ``verify`` and a tensor's bytes do not match its CRC32C.
        """
        wanted = list(self.header.entries) if names is None else names
        entries = {e.name: e for e in map(self._entry, wanted)}
        self.require_checksums(verify)
        runs = tensor_runs(list(entries.values()))
        pos = 0
        for run in runs:  # same offset modulo 64 as in the data section: dtypes stay aligned
            pos = -(-pos // _ARENA_ALIGN) * _ARENA_ALIGN + run.begin % _ARENA_ALIGN
            run.arena_pos = pos
            pos += run.end - run.begin
        arena = torch.empty(pos, dtype=torch.uint8)
        total = sum(run.end - run.begin for run in runs)
        step = self._range_step(total)
        ranges = []  # (data begin, data end, arena position)
        for run in runs:
            for start in range(run.begin, run.end, step):
                stop = min(run.end, start + step)
                ranges.append((start, stop, run.arena_pos + start - run.begin))
        self._fetch_ranges(arena, ranges)
        with self._count_lock:
            self.bytes_read += total
        views = {
            e.name: tensor_view(arena, run.arena_pos + e.begin - run.begin, e)
            for run in runs
            for e in run.entries
        }
        if verify:
            self._verify(views)
        return views

    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        """Bytes ``[start, stop)`` of tensor ``name`` (offsets into the tensor's bytes), fetched
        with parallel ranged reads: a uint8 tensor, or ``out`` (a contiguous CPU tensor of
        ``stop - start`` bytes, any dtype) filled and returned. As the local reader's
        ``read_range``: ``verify=True`` fetches the checksummed pieces covering the range and
        checks each (a tensor without piece checksums is fetched and checked whole).

        Raises:
            ValueError: the range is not within the tensor, or ``out`` does not fit it.
            ChecksumError: a piece fetched does not match its CRC32C (naming the URL, the
                tensor and the piece), or ``verify=True`` and the file has no checksums.

        Example:
            >>> import torch
            >>> save({"w": torch.arange(10, dtype=torch.int32)}, "memory://doc/range.safetensors")
            >>> with open_url("memory://doc/range.safetensors") as r:
            ...     r.read_range("w", 8, 20, verify=True).view(torch.int32).tolist()
            [2, 3, 4]
        """
        from fastckpt.checkpoint.range_read import covering_regions, damaged_region

        e, target = self._range_request(name, start, stop, out, verify)
        regions = covering_regions(self.meta.pieces, self.meta.crcs, e, start, stop, verify)
        if not regions:
            return out if out is not None else torch.empty(0, dtype=torch.uint8)
        lo, hi = regions[0].lo, regions[-1].hi
        # The pieces are fetched into `out` itself when they are exactly the range.
        exact = target is not None and (lo, hi) == (start, stop)
        arena = target if exact else torch.empty(hi - lo, dtype=torch.uint8)
        assert arena is not None
        step = self._range_step(hi - lo)
        ranges = [
            (e.begin + at, e.begin + min(hi, at + step), at - lo) for at in range(lo, hi, step)
        ]
        self._fetch_ranges(arena, ranges)
        with self._count_lock:
            self.bytes_read += hi - lo
        for region in regions:
            if region.expected is None:
                continue
            piece = arena[region.lo - lo : region.hi - lo]
            got = _C.crc32c(piece.data_ptr(), piece.numel()) if piece.numel() else 0
            if got != region.expected:
                raise damaged_region(self.path, self.meta.pieces, e, region, got)
        result = arena[start - lo : stop - lo]
        if target is None:
            return result
        if not exact:
            target.copy_(result)
        return out  # type: ignore[return-value]

    def _range_step(self, total: int) -> int:
        """Bytes per ranged read when fetching ``total`` bytes.

        A streamed S3 GET costs no buffer of its size, so S3 reads take fewer, larger ranges
        (about ``parallel`` of them, never smaller than ``part_size``): fewer requests, as
        many in flight. Other stores return each range whole, so ranges stay at part_size.
        """
        if _is_s3(self._fs):
            return max(self.part_size, -(-total // self.parallel))
        return self.part_size

    def _fetch_ranges(self, arena: torch.Tensor, ranges: list[tuple[int, int, int]]) -> None:
        """Fetches data-section ranges ``(begin, end, arena position)`` into ``arena``."""
        if _is_s3(self._fs):
            self._fetch_streamed(arena, ranges)
        else:
            self._fetch(arena, ranges)

    def _fetch(self, arena: torch.Tensor, ranges: list[tuple[int, int, int]]) -> None:
        base, address = self.header.data_offset, arena.data_ptr()

        def fetch(item: tuple[int, int, int]) -> None:
            start, stop, at = item
            data = self._cat(
                base + start, base + stop, f"ranged read of [{base + start}, {base + stop})"
            )
            ctypes.memmove(address + at, data, len(data))

        _run_parallel(fetch, ranges, self.parallel)

    def _fetch_streamed(self, arena: torch.Tensor, ranges: list[tuple[int, int, int]]) -> None:
        """S3: one GET per range, its body copied into the arena as it arrives (1 MiB at a time),
        ``parallel`` GETs at once on s3fs's event loop."""
        import asyncio

        from fsspec.asyn import sync

        fs, url = self._fs, self.path
        bucket, key, version = fs.split_path(self._path)
        extra = {"VersionId": version} if version else {}
        base, address = self.header.data_offset, arena.data_ptr()

        async def fetch(start: int, stop: int, at: int, gate: asyncio.Semaphore) -> None:
            first, last = base + start, base + stop - 1
            async with gate:
                reply = await fs._call_s3(
                    "get_object", Bucket=bucket, Key=key, Range=f"bytes={first}-{last}", **extra
                )
                body, got = reply["Body"], 0
                try:
                    while got < stop - start:
                        data = await body.read(min(_STREAM_CHUNK, stop - start - got))
                        if not data:
                            break
                        ctypes.memmove(address + at + got, data, len(data))
                        got += len(data)
                finally:
                    body.close()
            if got != stop - start:
                raise OSError(
                    errno.EIO,
                    f"{url}: ranged read of [{first}, {last + 1}) returned {got} bytes"
                    " (was the object replaced while being read?)",
                    url,
                )

        async def fetch_all() -> None:
            gate = asyncio.Semaphore(self.parallel)
            tasks = [asyncio.ensure_future(fetch(*r, gate)) for r in ranges]
            try:
                await asyncio.gather(*tasks)
            finally:  # no read may still write into the arena once this returns
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        with _Errors(url, "ranged read"):
            sync(fs.loop, fetch_all)

    def _verify(self, views: Mapping[str, torch.Tensor]) -> None:
        crcs = self.meta.crcs or {}

        def check(name: str) -> None:
            t = views[name]
            actual = _C.crc32c(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else 0
            expected = crcs.get(name)
            if expected is not None and actual != expected:
                raise ChecksumError(
                    f"tensor {name!r} in {self.path} is damaged: "
                    f"CRC32C {actual:08x}, expected {expected:08x}",
                    tensor=name,
                    filename=self.path,
                )

        _run_parallel(check, list(views), parallel_io.worker_count())

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        """Checks stored CRC32Cs; returns the names of damaged tensors (empty when intact).

        Tensors are fetched one at a time, so memory stays at the largest tensor's size.
        ``progress`` is accepted for symmetry with ``fastckpt.open`` readers (no bar here).
        """
        del progress
        self.require_checksums()
        damaged = []
        for name in list(self.header.entries) if names is None else names:
            try:
                self.read([name], verify=True)
            except ChecksumError as exc:
                damaged.append(exc.tensor)
        return damaged

    def close(self) -> None:
        """Nothing stays open between reads; provided for symmetry with ``fastckpt.open``."""

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def open_url(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    **local_options: Any,
) -> Any:
    """Opens the checkpoint at ``url`` for lazy reading (what ``fastckpt.open(url)`` does).

    Example:
        >>> import torch
        >>> save({"x": torch.arange(4)}, "memory://doc/open.safetensors")
        >>> open_url("memory://doc/open.safetensors").get_tensor("x").tolist()
        [0, 1, 2, 3]
    """
    if not is_url(url):
        import fastckpt

        return fastckpt.open(local_path(url), device=device, **local_options)
    if torch.device(device).type != "cpu":
        raise ValueError(f"{url}: readers of URLs put tensors on the CPU, not {device}")
    return RemoteReader(
        url, storage_options=storage_options, part_size=part_size, parallel=parallel
    )


def load(
    url: str,
    map_location: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    weights_only: bool = True,
    keys: Sequence[str] | None = None,
    verify: bool | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    parallel: int = DEFAULT_PARALLEL,
    **local_options: Any,
) -> Any:
    """Loads the checkpoint at ``url`` (what ``fastckpt.load(url)`` does).

    Args:
        storage_options: passed to the fsspec file system.
        part_size: bytes per ranged read.
        parallel: ranged reads in flight.
        Other arguments: as :func:`fastckpt.load` (tensors are fetched to the CPU, then
            moved to ``map_location``/``device``).

    Example:
        >>> import torch
        >>> save({"a": torch.ones(2), "b": [1, 2]}, "memory://doc/load.safetensors")
        >>> load("memory://doc/load.safetensors", keys=["a"])["a"].tolist()
        [1.0, 1.0]
    """
    if not is_url(url):
        import fastckpt

        return fastckpt.load(
            local_path(url),
            map_location,
            device=device,
            weights_only=weights_only,
            keys=keys,
            verify=verify,
            **local_options,
        )
    from fastckpt.checkpoint.load import resolve_device

    target = resolve_device(map_location, device)
    if keys is not None and (isinstance(keys, str) or not isinstance(keys, Sequence)):
        raise TypeError("keys must be a list of tensor names")
    reader = RemoteReader(
        url, storage_options=storage_options, part_size=part_size, parallel=parallel
    )
    reader.require_checksums(verify)
    check = reader.has_checksums and verify is not False
    stored = reader.read(None if keys is None else list(keys), verify=check)
    if isinstance(target, torch.device):
        if target.type != "cpu":
            stored = {name: t.to(target) for name, t in stored.items()}
    else:
        stored = {name: _map(target, t) for name, t in stored.items()}
    aliases = reader.meta.aliases
    if keys is not None:
        return {k: stored[aliases.get(k, k)] for k in keys}
    return tree.unflatten(reader.meta.tree, stored, aliases, weights_only=weights_only)


def _map(fn: Callable[..., Any], t: torch.Tensor) -> torch.Tensor:
    """``torch.load``'s ``map_location(storage, location)`` applied to one tensor."""
    result = fn(t.untyped_storage(), "cpu")
    if result is None or not hasattr(result, "device") or result.device == t.device:
        return t
    return t.to(result.device)
