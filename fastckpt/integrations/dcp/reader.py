"""The DCP ``StorageReader`` of checkpoints written by FastCkptWriter: each rank reads only
the byte ranges its load plan asks for, verified piece by piece.

Loads read each rank file's header once, then fetch the checksummed pieces a rank needs
(ranged reads at a URL); a stored shard wanted whole by a plain CPU tensor is read straight
into it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import threading
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from fastckpt.checkpoint.header_view import TensorInfo
from fastckpt.checkpoint.open_readers import ReaderCache
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.config import open_files
from fastckpt.distributed import file_set
from fastckpt.distributed.group_reader import resolve_group
from fastckpt.distributed.read_once import share_reads
from fastckpt.errors import ChecksumError, FastCkptError, HeaderError
from fastckpt.integrations import remote
from fastckpt.integrations.dcp._io_options import engine_options
from fastckpt.integrations.dcp._paths import location
from fastckpt.integrations.dcp.metadata import is_dcp_checkpoint, is_ours, read_dcp_metadata

__all__ = ["FastCkptReader"]

#: First read of a rank file at a URL: its header (of a few KiB for most rank files) without
#: much of the data, which a resharded load may not want.
_HEADER_PROBE = 64 << 10


class FastCkptReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`FastCkptWriter`.

    Each rank reads only the byte ranges its load plan asks for, every request of the plan
    in parallel, and verifies them: a request for a slice along the first dimension of a
    stored shard (how a checkpoint saved by N ranks is resharded for M) reads that slice,
    rounded out to the checksummed pieces that cover it (4 MiB by default); a region of
    another shape reads the span from its first byte to its last and copies the region out.
    A stored shard wanted whole is read straight into its target. Files without piece
    checksums (written before they existed) are read and verified a whole stored shard at
    a time. A damaged piece raises :class:`fastckpt.ChecksumError` naming the file, the
    stored tensor, the piece's byte range and the state-dict key.

    At an fsspec URL the same holds over the network: each rank file's header is read once,
    then each request fetches the checksummed pieces covering its range with ranged reads
    (streamed GETs on S3), all requests in parallel, and checks every piece.

    Args:
        path: the checkpoint directory or URL (``checkpoint_id=`` of ``dcp.load`` replaces it).
        verify: check CRC32Cs (default True); ``False`` reads exactly the regions asked for.
        allow_pickle: unpickle ``.metadata`` without limits. By default only DCP's metadata
            classes, torch dtypes and plain containers are admitted, and a file naming
            anything else raises :class:`fastckpt.errors.UnsafePickleError` before any of
            it runs. (Non-tensor values are unpickled by DCP's load planner, as DCP does.)
        storage_options: for the fsspec file system of a URL; default:
            ``FASTCKPT_STORAGE_OPTIONS``.
        **io: ``engine``, ``block_size``, ``queue_depth``, ``intra_op_parallelism``,
            ``direct_io`` for ``fastckpt.open``; at a URL, ``part_size`` (bytes per ranged
            read) and ``parallel`` (ranged reads in flight per request).

        group: read once across a process group: each stored tensor that any rank's plan
            needs is read whole by one rank (stripes balanced by bytes, verified there) and
            sent to the ranks that need part of it (a ``ProcessGroup``, or True for
            fastckpt's checkpoint group; default None: each rank reads its own ranges).
            Pickled values (``BytesIO`` items) are read by each rank itself.

    Attributes:
        bytes_read: data bytes this reader asked of the rank files since the last
            ``reset`` (this rank's share of the load, checksummed pieces included).

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> from fastckpt.dcp import FastCkptReader, FastCkptWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = dcp.save({"w": torch.arange(4)}, storage_writer=FastCkptWriter(path), no_dist=True)
        >>> out = {"w": torch.zeros(4, dtype=torch.int64)}
        >>> dcp.load(out, storage_reader=FastCkptReader(path), no_dist=True)
        >>> out["w"].tolist()
        [0, 1, 2, 3]
        >>> url = "memory://doc-dcp/reader"
        >>> _ = dcp.save({"w": torch.arange(4)}, storage_writer=FastCkptWriter(url), no_dist=True)
        >>> out = {"w": torch.zeros(4, dtype=torch.int64)}
        >>> dcp.load(out, storage_reader=FastCkptReader(url), no_dist=True)
        >>> out["w"].tolist()
        [0, 1, 2, 3]
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        allow_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
        group: Any = None,
        _metadata: Metadata | None = None,
        **io_options: Any,
    ):
        super().__init__()
        self.group = group
        self._metadata: Metadata | None = None
        # The metadata a caller already planned from (fastckpt's own conversions): read once,
        # so the plan and the data come from one save even while the directory is re-saved.
        self._planned_metadata = _metadata
        if "_extension_registry" in io_options:
            raise TypeError(
                "FastCkptReader does not take _extension_registry: FastCkptWriter stores "
                "tensors untransformed (no ZStandard or other StreamTransformExtension), so "
                "there is nothing to decode; read checkpoints saved with DCP's "
                "FileSystemWriter(_extensions=[...]) with FileSystemReader"
            )
        self.path = location(path)
        self.storage_options = storage_options
        self.verify = verify
        self.allow_pickle = allow_pickle
        self.io_options = io_options
        self.storage_data: dict[MetadataIndex, tuple[str, str]] = {}
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new load (from ``checkpoint_id`` when given)."""
        self.storage_data = {}
        self.bytes_read = 0
        if checkpoint_id and location(checkpoint_id) != self.path:
            self.path = location(checkpoint_id)
            self._planned_metadata = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads ``.metadata``; refuses checkpoints other writers made (say which reader fits)."""
        metadata = self._planned_metadata or read_dcp_metadata(
            self.path, storage_options=self.storage_options, allow_pickle=self.allow_pickle
        )
        if metadata.storage_data and not is_ours(metadata):
            raise HeaderError(
                f"{self.path} was not written by FastCkptWriter; read it with DCP's "
                "FileSystemReader, or `fastckpt convert` it"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keeps the item -> (file, tensor) map of the metadata."""
        self.storage_data = metadata.storage_data or {}
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's tensors (every file in parallel, checksums verified), copies each
        requested region into the tensor the planner resolves, and hands bytes to it."""
        future: Future[None] = Future()
        try:
            self._read(plan, planner)
            future.set_result(None)
        except BaseException as exc:
            # torch annotates the argument as the result type; it takes an exception
            future.set_exception(exc)  # type: ignore[arg-type]
        return future

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        group = resolve_group(self.group)
        if group is not None and self._metadata is not None:
            return self._read_shared(plan, planner, group)
        self._read_alone(plan, planner)

    def _read_alone(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            file_name, _ = self.storage_data[req.storage_index]
            per_file.setdefault(file_name, []).append(req)
        if not per_file:
            return
        # Whole stored tensors wanted whole by one contiguous target are read straight into
        # it; every other request reads only its byte range of the stored tensor.
        direct = _DirectReads(self)
        if remote.is_url(self.path):  # ranged reads fetch whole tensors into targets too
            ranged = per_file
        else:
            ranged = {}
            for file_name, reqs in per_file.items():
                rest = direct.claim(file_name, reqs, planner)
                if rest:
                    ranged[file_name] = rest
        # The direct reads complete before the ranged ones open files: the two together
        # would hold twice the bounded number of descriptors.
        direct.wait()
        if ranged:
            self._read_ranges(ranged, planner)
        direct.verify_and_commit(planner)

    def _read_shared(self, plan: LoadPlan, planner: LoadPlanner, group: Any) -> None:
        """Every rank calls it (``dcp.load`` does): the stored tensors any plan needs are
        read once across the group and each rank copies its regions out of them."""
        assert self._metadata is not None
        tensors = _stored_tensors(self._metadata)
        wanted: dict[str, list[ReadItem]] = {}
        pickled = []
        for req in plan.items:
            file_name, name = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                pickled.append(req)
            else:
                wanted.setdefault(file_set.key(file_name, name), []).append(req)
        files = file_set.FileSet(self.path, tensors, self._open, join=remote.join)

        def deliver(k: str, stored: torch.Tensor) -> None:
            for req in wanted[k]:
                target = planner.resolve_tensor(req).detach()
                region = stored
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    region = region.narrow(dim, start, length)
                target.copy_(region)
                planner.commit_tensor(req, target)

        try:
            share_reads(files, list(wanted), group, deliver=deliver, verify=self.verify)
        finally:
            files.close()
            self._count(files.bytes_read)
        if pickled:
            self._read_alone(LoadPlan(pickled), planner)

    def _read_ranges(self, per_file: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        """Reads every request's range of its stored tensor, all requests in parallel, and
        commits them (on this thread: planners need not be thread-safe)."""
        # Rank files are opened when a request needs them, at most open_files at once
        # (FASTCKPT_OPEN_FILES): a load of a thousand ranks' files meets no descriptor limit.
        readers = ReaderCache(self._open)
        try:
            tasks: list[tuple[str, ReadItem, torch.Tensor | None]] = []
            for file_name, reqs in per_file.items():
                for req in reqs:
                    target = None
                    if req.type != LoadItemType.BYTE_IO:
                        target = planner.resolve_tensor(req).detach()
                    tasks.append((file_name, req, target))

            def run(task: tuple[str, ReadItem, torch.Tensor | None]) -> Any:
                path = remote.join(self.path, task[0])
                return readers.call(path, lambda reader: self._read_request(reader, *task))

            workers = max(1, min(len(tasks), 8))
            with concurrent.futures.ThreadPoolExecutor(workers, "fastckpt-dcp-read") as pool:
                done = list(pool.map(run, tasks))
            for (_, req, target), value in zip(tasks, done):
                if target is None:
                    planner.load_bytes(req, io.BytesIO(value))
                else:
                    planner.commit_tensor(req, target)
        finally:
            readers.close()
            self._count(readers.bytes_read)

    def _open(self, path: str) -> Any:
        """A reader of one rank file: its header read, nothing else (a URL: one request)."""
        if remote.is_url(path):
            return remote.RemoteReader(
                path,
                storage_options=self.storage_options,
                header_probe=_HEADER_PROBE,
                **self.io_options,
            )
        return open_checkpoint(path, **self.io_options)

    def _read_request(
        self, reader: Any, file_name: str, req: ReadItem, target: torch.Tensor | None
    ) -> Any:
        """Reads one request: its bytes (BYTE_IO), or its region into ``target``."""
        name = self.storage_data[req.storage_index][1]
        verify = self.verify and reader.has_checksums
        try:
            if target is None:
                return reader.get_tensors([name], verify=verify)[name].numpy().tobytes()
            info = reader.info(name)
            lo, hi = _byte_span(info, req.storage_offsets, req.lengths)
            if tuple(target.shape) != tuple(req.lengths):
                raise ValueError(
                    f"{reader.path}: {req.storage_index.fqn}: region {tuple(req.lengths)} "
                    f"does not fit target {tuple(target.shape)}"
                )
            if hi == lo:
                return None
            if hi - lo == target.numel() * info.dtype.itemsize and _plain_target(target, info):
                reader.read_range(name, lo, hi, out=target, verify=verify)  # straight into it
                return None
            data = reader.read_range(name, lo, hi, verify=verify)
            target.copy_(_region_of(data, info, req.storage_offsets, req.lengths))
            return None
        except ChecksumError as exc:
            raise ChecksumError(
                f"{exc} (state-dict key {req.storage_index.fqn} of checkpoint {self.path})",
                tensor=exc.tensor,
                filename=reader.path,
            ) from None

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a directory or URL holding a checkpoint written by us
        (storage options of a URL: ``FASTCKPT_STORAGE_OPTIONS``)."""
        try:
            path = location(checkpoint_id)
            return is_dcp_checkpoint(path) and is_ours(read_dcp_metadata(path))
        except (TypeError, ValueError, OSError, FastCkptError):
            return False


def _stored_tensors(metadata: Metadata) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every stored tensor of the checkpoint (key -> dtype and shape), from its metadata:
    the same on every rank, known without opening a rank file."""
    tensors = {}
    for index, (file_name, name) in (metadata.storage_data or {}).items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        offsets = tuple(index.offset or ())
        chunk = next((c for c in md.chunks if tuple(c.offsets) == offsets), None)
        if chunk is not None:
            tensors[file_set.key(file_name, name)] = (md.properties.dtype, tuple(chunk.sizes))
    return tensors


def _byte_span(info: TensorInfo, offsets: Any, lengths: Any) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of the stored tensor from the region's first element to its
    last (exactly the region when it is contiguous, e.g. a slice along dim 0); ``(0, 0)``
    for an empty region."""
    if any(length == 0 for length in lengths):
        return 0, 0
    stride, first, last = 1, 0, 0
    for size, start, length in reversed(list(zip(info.shape, offsets, lengths))):
        first += start * stride
        last += (start + length - 1) * stride
        stride *= size
    itemsize = info.dtype.itemsize
    return first * itemsize, (last + 1) * itemsize


def _region_of(data: torch.Tensor, info: TensorInfo, offsets: Any, lengths: Any) -> Any:
    """The region as a strided view of ``data``, the bytes of its covering span."""
    if data.data_ptr() % info.dtype.itemsize:
        data = data.clone()  # files from other writers may not align tensors to their dtype
    elements = data.view(info.dtype)
    strides: list[int] = []
    stride = 1
    for size in reversed(info.shape):
        strides.insert(0, stride)
        stride *= size
    return elements.as_strided(tuple(lengths), tuple(strides), elements.storage_offset())


def _plain_target(target: torch.Tensor, info: TensorInfo) -> bool:
    """Whether ``target``'s memory can take the stored bytes as they are."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == info.dtype
        and not target.is_conj()
        and not target.is_neg()
    )


class _DirectReads:
    """Reads of whole stored tensors straight into the tensors a load plan fills.

    Used where one request wants a stored tensor whole and its target is a contiguous CPU
    tensor of the same dtype and shape: the engine reads into the target's memory (O_DIRECT
    where the target's address allows it) and the CRC32C is checked from there, which saves
    an arena and a copy of every byte.
    """

    def __init__(self, reader: FastCkptReader):
        self.reader = reader
        self.handle: Any = None
        self.pending: list[tuple[ReadItem, torch.Tensor, str, str, int | None]] = []
        # Each read in flight holds its file open until it completes: waiting once this
        # many are in flight bounds the descriptors of a load of any number of rank files.
        self.in_flight_limit = open_files()
        self.in_flight = 0

    def claim(self, file_name: str, reqs: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Starts the reads it can do for this file; returns the requests left to the caller."""
        storage = self.reader.storage_data
        per_name: dict[str, list[ReadItem]] = {}
        for req in reqs:
            per_name.setdefault(storage[req.storage_index][1], []).append(req)
        path = os.path.join(self.reader.path, file_name)
        candidates = [
            (name, group[0])
            for name, group in per_name.items()
            if len(group) == 1 and group[0].type == LoadItemType.TENSOR
        ]
        if not candidates:
            return reqs
        infos, crcs = _read_header(path)
        if self.reader.verify and crcs is None:
            return reqs  # no checksums: the arena path says so
        if not self.reader.verify:
            crcs = None
        rest = [r for r in reqs if not any(r is req for _, req in candidates)]
        for name, req in candidates:
            info = infos.get(name)
            target = planner.resolve_tensor(req).detach()
            if info is None or not _fits_whole(info, req, target):
                rest.append(req)
                continue
            if self.handle is None:
                from fastckpt.aio import aio_handle
                from fastckpt.config import resolve_io

                # The I/O settings every load of this directory uses (tuned, configured or
                # built in): every rank of a node reads at once, so a deeper private queue
                # per rank only floods the device and lets one rank starve the others.
                io = resolve_io(self.reader.path, engine_options(self.reader.io_options))
                self.handle = aio_handle(**dataclasses.asdict(io))
            if info.nbytes:
                if self.in_flight >= self.in_flight_limit:
                    self.wait()
                self.handle.async_pread(target, path, info.offset)
                self.in_flight += 1
                self.reader._count(info.nbytes)
            self.pending.append((req, target, path, name, None if crcs is None else crcs.get(name)))
        return rest

    def wait(self) -> None:
        if self.handle is not None:
            self.in_flight = 0
            self.handle.wait()

    def verify_and_commit(self, planner: LoadPlanner) -> None:
        from fastckpt import _C

        for req, target, path, name, expected in self.pending:
            if expected is not None:
                nbytes = target.numel() * target.element_size()
                actual = _C.crc32c(target.data_ptr(), nbytes, 0) if nbytes else 0
                if actual != expected:
                    raise ChecksumError(
                        f"tensor {name!r} in {path} is damaged: CRC32C {actual:08x}, expected "
                        f"{expected:08x} (state-dict key {req.storage_index.fqn} of checkpoint "
                        f"{self.reader.path})",
                        tensor=name,
                        filename=path,
                    )
            planner.commit_tensor(req, target)


def _read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, int] | None]:
    """What the header of a rank file says of each tensor, and its CRC32C table (None
    without checksums)."""
    with open_checkpoint(path) as reader:
        infos = {name: reader.info(name) for name in reader.keys()}
        return infos, reader.meta.crcs


def _fits_whole(info: TensorInfo, req: ReadItem, target: torch.Tensor) -> bool:
    """Whether ``req`` wants the stored tensor ``info`` whole into a plain CPU ``target``."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == info.dtype
        and tuple(target.shape) == tuple(info.shape)
        and tuple(req.lengths) == tuple(info.shape)
        and not any(req.storage_offsets)
        and not target.is_conj()
        and not target.is_neg()
    )
