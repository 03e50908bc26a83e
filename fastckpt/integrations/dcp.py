"""torch.distributed.checkpoint (DCP) storage on fastckpt files.

DCP plans a distributed save or load (which rank writes which shard, how a checkpoint saved
by N ranks is resharded for M); this module moves the bytes. A checkpoint is a directory:

- one fastckpt file per rank, ``__<rank>_<save id>.safetensors`` (safetensors-compatible,
  aligned for direct I/O, a CRC32C per tensor and per 4 MiB piece), holding that rank's shards under names
  ``<key>`` or ``<key>@<offsets>`` and non-tensor values as pickled bytes (uint8 tensors);
- ``.metadata``: DCP's metadata, pickled, whose ``storage_data`` maps each item to
  ``(file, tensor name)``.

Commit protocol: every rank writes its file atomically (temporary file, fsync, rename) under
a name not used by any earlier save; only when every rank's file is durable does the
coordinator replace ``.metadata`` (temporary file, fsync, rename, directory fsync) and then
remove the files no checkpoint refers to any more. A save that fails or is killed at any
point therefore leaves the previous checkpoint in the directory whole and loadable.

At an fsspec URL (``s3://bucket/ckpt``, ``memory://...``) the layout and the protocol are the
same, with the remote save's commit in place of the rename: each rank file is one upload
that appears whole or not at all (an S3 multipart upload completes, or is aborted), and
``.metadata`` is written only after every rank's upload has returned. Loads read each rank
file's header once, then fetch the checksummed pieces a rank needs with ranged reads.

Example:
    >>> import os, tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastckpt.dcp import FastCkptReader, FastCkptWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "step-1")
    >>> state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
    >>> _ = dcp.save(state, storage_writer=FastCkptWriter(path), no_dist=True)
    >>> target = {"w": torch.zeros(2, 3), "step": 0}
    >>> dcp.load(target, storage_reader=FastCkptReader(path), no_dist=True)
    >>> target["w"][1].tolist(), target["step"]
    ([3.0, 4.0, 5.0], 1)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import io
import logging
import os
import pickle
import re
import secrets
import threading
import uuid
import warnings
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

import fastckpt
from fastckpt.errors import ChecksumError, FastCkptError
from fastckpt.format import DEFAULT_PIECE_SIZE
from fastckpt.integrations import remote

_log = logging.getLogger("fastckpt")

__all__ = [
    "FastCkptWriter",
    "FastCkptReader",
    "METADATA_FILE",
    "is_dcp_checkpoint",
    "read_dcp_metadata",
    "consolidate",
    "to_dcp",
    "describe_dcp",
    "format_dcp",
    "load_full",
    "verify_dcp",
]

#: DCP's metadata file name inside a checkpoint directory (the same name DCP's own uses).
METADATA_FILE = ".metadata"
_RANK_FILE = re.compile(r"^__(\d+)_([0-9a-f]+)\.safetensors$")
_MAX_PENDING_SNAPSHOTS = 2
#: First read of a rank file at a URL: its header (of a few KiB for most rank files) without
#: much of the data, which a resharded load may not want.
_HEADER_PROBE = 64 << 10
_STALE_TMP = re.compile(r"^(__\d+_[0-9a-f]+\.safetensors|\.metadata)\.[0-9a-f]+\.tmp$")


# -- names and paths ---------------------------------------------------------------------------


def _item_name(index: MetadataIndex) -> str:
    """The tensor name under which one write item is stored in its rank's file."""
    if index.offset is None or not any(index.offset):
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def _rank_file(rank: int, save_id: str) -> str:
    return f"__{rank}_{save_id}.safetensors"


def _location(checkpoint_id: str | os.PathLike[str]) -> str:
    """A local directory (a plain path, or a ``file://`` URL turned back into one) or an fsspec
    URL (``s3://``, ``memory://``, ...), without a trailing ``/``."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(checkpoint_id).__name__}")
    path = os.fspath(checkpoint_id)
    if remote.is_url(path):
        return path.rstrip("/")
    return remote.local_path(path) if remote.handles(path) else path


def is_dcp_checkpoint(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``path`` is a DCP checkpoint (ours or DCP's own ``FileSystemWriter``): a
    directory, or a URL, holding ``.metadata``.

    Example:
        >>> is_dcp_checkpoint("/no/such/dir"), is_dcp_checkpoint("memory://no/such/ckpt")
        (False, False)
    """
    location = _location(path)
    if remote.is_url(location):
        # Unreachable or unknown storage is "not a checkpoint": reading it says why.
        try:
            fs, inner = remote.url_to_fs(remote.join(location, METADATA_FILE), storage_options)
            return bool(fs.isfile(inner))
        except (ImportError, ValueError, OSError):
            return False
    return os.path.isdir(location) and os.path.isfile(os.path.join(location, METADATA_FILE))


def read_dcp_metadata(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Metadata:
    """DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` of a checkpoint (a
    directory or a URL).

    The file is a pickle (as DCP writes it): read only checkpoints you trust.

    Raises:
        FileNotFoundError: ``path`` holds no ``.metadata``.
        fastckpt.HeaderError: the file is not a DCP metadata pickle.
    """
    location = _location(path)
    meta_path = remote.join(location, METADATA_FILE)
    data = remote.read_bytes(meta_path, storage_options)
    try:
        metadata = pickle.loads(data)
    except Exception as exc:  # any unpickling failure means a damaged file
        raise fastckpt.HeaderError(f"{meta_path}: not a DCP metadata file ({exc})") from None
    if not isinstance(metadata, Metadata):
        raise fastckpt.HeaderError(
            f"{meta_path}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


def _is_ours(metadata: Metadata) -> bool:
    data = metadata.storage_data or {}
    return bool(data) and all(
        isinstance(v, tuple) and len(v) == 2 and all(isinstance(s, str) for s in v)
        for v in data.values()
    )


# -- snapshots for dcp.async_save ---------------------------------------------------------------


@dataclasses.dataclass
class _Snapshot:
    """One rank's tensors copied into fastckpt's pinned staging buffers by ``stage``.

    ``writer`` holds the filled buffers (writes deferred until a file exists), or is None
    for a snapshot taken for a URL, whose ``plan.tensors`` are host copies;
    ``names`` maps the id of each stand-in tensor of the staged state dict to its stored name.
    """

    writer: Any  # fastckpt.checkpoint.save.StreamWriter; None: plan.tensors are copies
    plan: Any  # fastckpt.checkpoint.save.SavePlan
    names: dict[int, str]
    keep: list[Any]  # the stand-ins, so their ids stay unique while registered

    def abort(self) -> None:
        """Gives the staging buffers back (a snapshot of copies just drops them)."""
        if self.writer is not None:
            self.writer.abort()


def _stand_in(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A new tensor object with ``value``'s metadata for DCP to plan on, and its local part.

    Its data are never read: every write item it resolves to is taken from the snapshot.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value._local_tensor.detach()
        twin = DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
        return twin, local
    twin = value.detach()
    return twin, twin


# -- writer -----------------------------------------------------------------------------------


class FastCkptWriter(StorageWriter):
    """A DCP ``StorageWriter`` writing one fastckpt file per rank, committed atomically.

    Use it with ``dcp.save`` and ``dcp.async_save`` (``storage_writer=``). With
    ``async_save`` it also stages: the state dict's tensors are copied once into fastckpt's
    page-locked staging buffers, which the engine then writes to disk directly, so the call
    returns after one memory copy and the caller may change the tensors at once.

    At an fsspec URL (``s3://bucket/ckpt``, ``memory://...``; ``file://`` is a local path)
    each rank streams its file with the remote save's machinery (one multipart upload on
    S3, so the file appears whole or not at all), and the coordinator writes ``.metadata``
    only after every rank's upload completed, then deletes the rank files it no longer
    refers to: a failed save leaves the previous checkpoint at the URL loadable.
    ``async_save`` stages into host memory (a copy of each tensor) and uploads from there.

    Args:
        path: the checkpoint directory (created if missing) or URL. ``checkpoint_id=`` of
            ``dcp.save`` replaces it.
        overwrite: replace a checkpoint already at ``path`` (else ``RuntimeError``).
        checksum: record a CRC32C per tensor and per piece of ``piece_size`` bytes of each
            larger one (verified by :class:`FastCkptReader`, which reads only the pieces
            a rank needs).
        piece_size: bytes per checksummed piece (a multiple of 4 KiB, default 4 MiB): the
            granularity of a resharded load's reads.
        storage_options: for the fsspec file system of a URL (``key``, ``secret``,
            ``endpoint_url``, ...); default: ``FASTCKPT_STORAGE_OPTIONS``.
        **io: ``engine``, ``block_size``, ``queue_depth``, ``intra_op_parallelism``,
            ``staging_bytes`` for ``fastckpt.save``; at a URL, ``part_size`` (bytes per
            uploaded part) and ``parallel`` (parts in flight).

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> from fastckpt.dcp import FastCkptWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = dcp.save({"w": torch.ones(4)}, storage_writer=FastCkptWriter(path), no_dist=True)
        >>> sorted(os.listdir(path))[0]
        '.metadata'
        >>> url = "memory://doc-dcp/writer"
        >>> _ = dcp.save({"w": torch.ones(4)}, storage_writer=FastCkptWriter(url), no_dist=True)
        >>> is_dcp_checkpoint(url)
        True
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        checksum: bool = True,
        piece_size: int = DEFAULT_PIECE_SIZE,
        storage_options: dict[str, Any] | None = None,
        **io_options: Any,
    ):
        super().__init__()
        self.path = _location(path)
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.checksum = checksum
        self.piece_size = piece_size
        self.io_options = io_options
        self.save_id = secrets.token_hex(6)
        self.rank = 0
        self.is_coordinator = True
        self._snapshots: list[_Snapshot] = []
        self._lock = threading.Lock()
        self._pool: Any = None
        self._removal: threading.Thread | None = None  # unlinking an earlier save's files

    # -- StorageWriter ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new save (to ``checkpoint_id`` when given)."""
        if checkpoint_id:
            self.path = _location(checkpoint_id)
        self.save_id = secrets.token_hex(6)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Records this rank's role and number."""
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = int(rank or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Creates the directory; refuses an existing checkpoint unless ``overwrite``."""
        if remote.is_url(self.path):  # object stores have no directories to create
            exists = not self.overwrite and is_dcp_checkpoint(
                self.path, storage_options=self.storage_options
            )
        else:
            os.makedirs(self.path, exist_ok=True)
            exists = os.path.exists(os.path.join(self.path, METADATA_FILE))
        if not self.overwrite and exists:
            raise RuntimeError(f"{self.path} already holds a checkpoint and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Gives every rank its file name, unique to this save (so nothing is overwritten)."""
        return [
            dataclasses.replace(p, storage_data=_rank_file(i, self.save_id))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items into its fastckpt file; the file is durable on return."""
        future: Future[list[WriteResult]] = Future()
        try:
            future.set_result(self._write(plan, planner))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commits the checkpoint: ``.metadata`` replaced atomically, then old files removed."""
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        referenced = {file for file, _ in metadata.storage_data.values()}
        # Every rank's file is durable (DCP gathered their results): publish, whole or not
        # at all (temp file, fsync, rename, directory fsync; on object stores one upload).
        meta_path = remote.join(self.path, METADATA_FILE)
        remote.write_bytes(meta_path, pickle.dumps(metadata), self.storage_options)
        if remote.is_url(self.path):
            self._remove_unreferenced_at_url(referenced)
        else:
            self._remove_unreferenced(referenced)

    def storage_meta(self) -> StorageMeta | None:
        """Identifies this save (``checkpoint_id`` and ``save_id``) in the metadata."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is something this writer can save to (a path or URL)."""
        try:
            _location(checkpoint_id)
        except (TypeError, ValueError):
            return False
        return True

    # -- AsyncStager (dcp.async_save) --------------------------------------------------------
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Frees the staging buffers kept for the next ``async_save`` and waits until the
        files of replaced checkpoints are removed."""
        self.wait_for_cleanup()
        if self._pool is not None:
            self._pool.trim()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copies the tensors of ``state_dict`` into page-locked staging buffers (``async_save``).

        Returns a state dict of the same structure for DCP to plan on; the data it saves
        are those at the time of this call.
        """
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from fastckpt.checkpoint.save import StreamWriter, plan_save
        from fastckpt.io.staging_pool import StagingPool

        keep: list[torch.Tensor] = []
        staged, stand_ins = self._stage_structure(state_dict, keep)
        planner = DefaultSavePlanner()
        planner.set_up_planner(staged, None, False)
        local = planner.create_local_plan()
        flat: dict[str, torch.Tensor] = {}
        names: dict[int, str] = {}
        for item in local.items:
            name = _item_name(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                flat[name] = _bytes_tensor(data)
                continue
            key = id(data) if id(data) in stand_ins else id(getattr(data, "_base", None))
            source = stand_ins.get(key)
            if source is None or data.shape != source.shape:
                continue  # not a whole local tensor: resolved again at write time
            flat[name] = source
            names[key] = name
        plan = plan_save(flat, checksum=self.checksum, piece_size=self.piece_size)
        if remote.is_url(self.path):
            # Uploads stream from host memory: the snapshot is a copy of each tensor.
            plan.tensors = {n: t.detach().to("cpu", copy=True) for n, t in plan.tensors.items()}
            self._keep_snapshot(_Snapshot(None, plan, names, keep))
            return staged
        with self._lock:
            if self._pool is None:
                self._pool = StagingPool(max(plan.data_size, 64 << 20))
            pool = self._pool
            # room for this snapshot beside buffers an earlier save still holds
            pool.grow_to(pool.in_use() * pool.piece + plan.data_size + pool.piece)
        writer = StreamWriter(plan, None, None, pool, progress=False, defer_writes=True)
        try:
            writer.fill()
        except BaseException:
            writer.abort()
            raise
        self._keep_snapshot(_Snapshot(writer, plan, names, keep))
        return staged

    def _keep_snapshot(self, snapshot: _Snapshot) -> None:
        with self._lock:
            # A save that failed before writing never claims its snapshot: keep the newest.
            while len(self._snapshots) >= _MAX_PENDING_SNAPSHOTS:
                self._snapshots.pop(0).abort()
            self._snapshots.append(snapshot)

    def _stage_structure(
        self, obj: Any, keep: list[torch.Tensor]
    ) -> tuple[Any, dict[int, torch.Tensor]]:
        """A copy of ``obj``'s containers with tensors replaced by stand-ins and other values
        deep-copied; id of each stand-in's local tensor -> the live tensor it stands for.
        The stand-ins' local tensors are appended to ``keep`` (their ids stay unique)."""
        stand_ins: dict[int, torch.Tensor] = {}

        def walk(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                twin, local = _stand_in(value)
                live = value._local_tensor if hasattr(value, "_local_tensor") else value
                stand_ins[id(local)] = live
                keep.append(local)
                return twin
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v) for v in value]
            if type(value) is tuple:
                return tuple(walk(v) for v in value)
            return copy.deepcopy(value)

        return walk(obj), stand_ins

    # -- writing -------------------------------------------------------------------------------
    def _take_snapshot(self, plan: SavePlan, planner: SavePlanner) -> _Snapshot | None:
        """The staged snapshot whose stand-ins this plan's tensors resolve to, if any."""
        with self._lock:
            if not self._snapshots:
                return None
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                data = planner.resolve_data(item)
                key = id(data)
                base_key = id(getattr(data, "_base", None))
                for snap in self._snapshots:
                    if key in snap.names or base_key in snap.names:
                        self._snapshots.remove(snap)
                        return snap
                return None
            return self._snapshots.pop(0) if plan.items else None

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        file_name = plan.storage_data or _rank_file(self.rank, self.save_id)
        path = remote.join(self.path, file_name)
        snapshot = self._take_snapshot(plan, planner)
        results: list[WriteResult] = []
        if snapshot is not None:
            stored = set(snapshot.plan.tensors)
            rest: list[WriteItem] = []
            for item in plan.items:
                name = self._snapshot_name(item, planner, snapshot)
                if name is None or name not in stored:
                    rest.append(item)
                else:
                    results.append(_result(item, file_name, name, snapshot.plan.tensors[name]))
            self._commit_snapshot(snapshot, path)
            if rest:  # items the snapshot lacks (a custom planner): written beside it
                extra = _rank_file(self.rank, secrets.token_hex(6))
                results += self._save_items(rest, planner, extra)
            return results
        return self._save_items(plan.items, planner, file_name)

    def _snapshot_name(self, item: WriteItem, planner: SavePlanner, snap: _Snapshot) -> str | None:
        if item.type == WriteItemType.BYTE_IO:
            return _item_name(item.index)
        data = planner.resolve_data(item)
        return snap.names.get(id(data)) or snap.names.get(id(getattr(data, "_base", None)))

    def _commit_snapshot(self, snap: _Snapshot, path: str) -> None:
        from fastckpt.checkpoint.save import executor_for_destination
        from fastckpt.io.commit import AtomicFile

        writer = snap.writer
        if writer is None:  # host copies: written like any state (to a URL or a path)
            self._write_plan(snap.plan, path)
            return
        if remote.is_url(path):
            writer.abort()
            raise ValueError(
                f"{path}: this async save was staged for the local directory the writer had "
                "then; make the FastCkptWriter with the URL so staging prepares an upload"
            )
        try:
            out = AtomicFile(path)
        except BaseException:
            writer.abort()
            raise
        try:
            out.reserve(snap.plan.file_size)
            writer.file = out.file
            writer.executor = executor_for_destination(path, **_engine_options(self.io_options))
            writer.finish()
            out.commit()
        except BaseException:
            writer.abort()
            out.abort()
            raise

    def _save_items(
        self, items: Iterable[WriteItem], planner: SavePlanner, file_name: str
    ) -> list[WriteResult]:
        flat: dict[str, torch.Tensor] = {}
        pending: list[tuple[WriteItem, str]] = []
        for item in items:
            name = _item_name(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                flat[name] = _bytes_tensor(data)
            else:
                tensor = data.detach()
                if tensor.device.type not in ("cpu", "cuda"):
                    tensor = tensor.cpu()
                flat[name] = tensor
            pending.append((item, name))
        if remote.is_url(self.path):
            from fastckpt.checkpoint.save import plan_save

            plan = plan_save(flat, checksum=self.checksum, piece_size=self.piece_size)
            self._write_plan(plan, remote.join(self.path, file_name))
        else:
            fastckpt.save(
                flat,
                os.path.join(self.path, file_name),
                checksum=self.checksum,
                piece_size=self.piece_size,
                **self.io_options,
            )
        return [_result(item, file_name, name, flat[name]) for item, name in pending]

    def _write_plan(self, plan: Any, path: str) -> None:
        """Writes a planned rank file of host tensors: uploaded at a URL (complete or
        absent), else saved atomically like any fastckpt file."""
        if not remote.is_url(path):
            fastckpt.save(
                dict(plan.tensors),
                path,
                checksum=self.checksum,
                piece_size=self.piece_size,
                **self.io_options,
            )
            return
        unknown = sorted(set(self.io_options) - {"part_size", "parallel"})
        if unknown:
            raise TypeError(
                f"{path}: {', '.join(unknown)} apply to local paths; a URL takes part_size "
                "and parallel"
            )
        remote.write_plan(plan, path, storage_options=self.storage_options, **self.io_options)

    def _remove_unreferenced_at_url(self, referenced: set[str]) -> None:
        """Deletes rank files (and temporaries) of earlier or failed saves at the URL; a
        deletion that fails leaves only an unreferenced file, so it is not an error."""
        fs, inner = remote.url_to_fs(self.path, self.storage_options)
        fs.invalidate_cache(inner)  # a listing cached before the ranks' uploads is stale
        with remote._Errors(self.path, "listing"):
            names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(inner, detail=False)]
        stale = [
            f"{inner.rstrip('/')}/{name}"
            for name in names
            if (_RANK_FILE.match(name) and name not in referenced) or _STALE_TMP.match(name)
        ]
        if stale:
            try:
                fs.rm(stale)
            except Exception:  # best effort: the checkpoint is committed either way
                pass
            fs.invalidate_cache(inner)

    def _remove_unreferenced(self, referenced: set[str]) -> None:
        """Removes rank files and temporaries of earlier or failed saves (after the commit).

        Which files go is decided here; unlinking them runs on a background thread, because
        a file system frees a large file's blocks slowly (ext4: about 0.2 s per GiB, which
        would double the commit of a 4-rank save). Only the files listed now are touched,
        so a later save's files never are; :meth:`close` and the next commit wait for it.
        """
        self.wait_for_cleanup()
        stale = [
            os.path.join(self.path, entry)
            for entry in os.listdir(self.path)
            if (_RANK_FILE.match(entry) and entry not in referenced) or _STALE_TMP.match(entry)
        ]
        if stale:
            self._removal = threading.Thread(
                target=_unlink_all, args=(stale,), name="fastckpt-dcp-cleanup", daemon=False
            )
            self._removal.start()

    def wait_for_cleanup(self) -> None:
        """Waits until the files of the checkpoints this writer replaced are removed (they
        are removed on a background thread after each commit).

        Example:
            >>> import os, tempfile, torch, torch.distributed.checkpoint as dcp
            >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
            >>> writer = FastCkptWriter(path)
            >>> for step in range(2):
            ...     _ = dcp.save({"w": torch.full((4,), step)}, storage_writer=writer, no_dist=True)
            >>> writer.wait_for_cleanup()
            >>> len([f for f in os.listdir(path) if f.endswith(".safetensors")])
            1
        """
        if self._removal is not None:
            self._removal.join()
            self._removal = None


def _unlink_all(paths: list[str]) -> None:
    """Removes files that no checkpoint refers to; one already gone is no error, and one
    that cannot be removed stays for the next save's cleanup."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("could not remove %s, left from an earlier save: %s", path, exc)


def _engine_options(options: dict[str, Any]) -> dict[str, Any]:
    keys = ("engine", "block_size", "queue_depth", "intra_op_parallelism")
    return {k: options[k] for k in keys if k in options}


def _bytes_tensor(data: io.BytesIO) -> torch.Tensor:
    raw = bytearray(data.getbuffer())
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _result(item: WriteItem, file_name: str, name: str, tensor: torch.Tensor) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=tensor.numel() * tensor.element_size(),
        storage_data=(file_name, name),
    )


# -- reader -----------------------------------------------------------------------------------


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
        storage_options: for the fsspec file system of a URL; default:
            ``FASTCKPT_STORAGE_OPTIONS``.
        **io: ``engine``, ``block_size``, ``queue_depth``, ``intra_op_parallelism``,
            ``direct_io`` for ``fastckpt.open``; at a URL, ``part_size`` (bytes per ranged
            read) and ``parallel`` (ranged reads in flight per request).

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
        storage_options: dict[str, Any] | None = None,
        **io_options: Any,
    ):
        super().__init__()
        self.path = _location(path)
        self.storage_options = storage_options
        self.verify = verify
        self.io_options = io_options
        self.storage_data: dict[MetadataIndex, tuple[str, str]] = {}
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new load (from ``checkpoint_id`` when given)."""
        self.storage_data = {}
        self.bytes_read = 0
        if checkpoint_id:
            self.path = _location(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads ``.metadata``; refuses checkpoints other writers made (say which reader fits)."""
        metadata = read_dcp_metadata(self.path, storage_options=self.storage_options)
        if metadata.storage_data and not _is_ours(metadata):
            raise fastckpt.HeaderError(
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
            future.set_exception(exc)
        return future

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
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
        try:
            if ranged:
                self._read_ranges(ranged, planner)
        finally:
            direct.wait()
        direct.verify_and_commit(planner)

    def _read_ranges(self, per_file: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        """Reads every request's range of its stored tensor, all requests in parallel, and
        commits them (on this thread: planners need not be thread-safe)."""
        readers: dict[str, Any] = {}
        try:
            tasks: list[tuple[str, ReadItem, torch.Tensor | None]] = []
            for file_name, reqs in per_file.items():
                readers[file_name] = self._open(remote.join(self.path, file_name))
                for req in reqs:
                    target = None
                    if req.type != LoadItemType.BYTE_IO:
                        target = planner.resolve_tensor(req).detach()
                    tasks.append((file_name, req, target))
            workers = max(1, min(len(tasks), 8))
            with concurrent.futures.ThreadPoolExecutor(workers, "fastckpt-dcp-read") as pool:
                done = list(
                    pool.map(lambda task: self._read_request(readers[task[0]], *task), tasks)
                )
            for (_, req, target), value in zip(tasks, done):
                if target is None:
                    planner.load_bytes(req, io.BytesIO(value))
                else:
                    planner.commit_tensor(req, target)
        finally:
            for reader in readers.values():
                self._count(reader.bytes_read)
                reader.close()

    def _open(self, path: str) -> Any:
        """A reader of one rank file: its header read, nothing else (a URL: one request)."""
        if remote.is_url(path):
            return remote.RemoteReader(
                path,
                storage_options=self.storage_options,
                header_probe=_HEADER_PROBE,
                **self.io_options,
            )
        return fastckpt.open(path, **self.io_options)

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
            path = _location(checkpoint_id)
            return is_dcp_checkpoint(path) and _is_ours(read_dcp_metadata(path))
        except (TypeError, ValueError, OSError, FastCkptError):
            return False


def _byte_span(info: fastckpt.TensorInfo, offsets: Any, lengths: Any) -> tuple[int, int]:
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


def _region_of(data: torch.Tensor, info: fastckpt.TensorInfo, offsets: Any, lengths: Any) -> Any:
    """The region as a strided view of ``data``, the bytes of its covering span."""
    if data.data_ptr() % info.dtype.itemsize:
        data = data.clone()  # files from other writers may not align tensors to their dtype
    elements = data.view(info.dtype)
    strides, stride = [], 1
    for size in reversed(info.shape):
        strides.insert(0, stride)
        stride *= size
    return elements.as_strided(tuple(lengths), tuple(strides), elements.storage_offset())


def _plain_target(target: torch.Tensor, info: fastckpt.TensorInfo) -> bool:
    """Whether ``target``'s memory can take the stored bytes as they are."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == info.dtype
        and not target.is_conj()
        and not target.is_neg()
    )


# -- whole-checkpoint tools: consolidation, conversion, inspection, verification ---------------


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silences DCP's warning that a ``no_dist=True`` call runs in one process (it is meant to)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def _reader_for(
    path: str, metadata: Metadata, storage_options: dict[str, Any] | None = None
) -> StorageReader:
    if not metadata.storage_data or _is_ours(metadata):
        return FastCkptReader(path, storage_options=storage_options)
    if remote.is_url(path):
        raise ValueError(
            f"{path} was written by DCP's FileSystemWriter; at a URL only checkpoints "
            "written by FastCkptWriter are read here"
        )
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


def _unflatten(flat: dict[str, Any], mapping: dict[str, Any] | None) -> dict[str, Any]:
    """Rebuilds the nested state dict from DCP's flat keys and its ``planner_data`` paths."""
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = tuple(mapping[fqn]) if mapping and fqn in mapping else (fqn,)
        node: Any = root
        for key, after in zip(path[:-1], path[1:]):
            if isinstance(node, list):
                while len(node) <= key:
                    node.append(None)
                if node[key] is None:
                    node[key] = [] if isinstance(after, int) else {}
                node = node[key]
            else:
                node = node.setdefault(key, [] if isinstance(after, int) else {})
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root


def load_full(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every value of a DCP checkpoint (ours or DCP's own; at a URL, ours), as full tensors,
    in one process.

    Non-tensor values are unpickled (DCP stores them with ``torch.save``): load only
    checkpoints you trust.

    Example:
        >>> import os, tempfile, torch
        >>> import torch.distributed.checkpoint as dcp
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> _ = dcp.save({"m": {"w": torch.ones(2)}, "n": 3}, storage_writer=FastCkptWriter(path), no_dist=True)
        >>> load_full(path)
        {'m': {'w': tensor([1., 1.])}, 'n': 3}
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    path = _location(path)
    metadata = read_dcp_metadata(path, storage_options=storage_options)
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            flat[fqn] = None  # filled with the unpickled value
    with _single_process():
        dcp.load(
            flat,
            storage_reader=_reader_for(path, metadata, storage_options),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
    return _unflatten(flat, metadata.planner_data)


def consolidate(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, allow_pickle: bool = False
) -> None:
    """Writes a DCP checkpoint directory (ours or DCP's own) as one fastckpt/safetensors file
    of full tensors; ``fastckpt.load(dst)`` returns the nested state dict.

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> import torch.distributed.checkpoint as dcp
        >>> d = tempfile.mkdtemp()
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=FastCkptWriter(d + "/ckpt"), no_dist=True)
        >>> consolidate(d + "/ckpt", d + "/full.safetensors")
        >>> fastckpt.load(d + "/full.safetensors")["w"].tolist()
        [1.0, 1.0]
    """
    fastckpt.save(load_full(src), dst, allow_pickle=allow_pickle)


def to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Writes a fastckpt/safetensors file (a dict at the top) as a DCP checkpoint directory
    with :class:`FastCkptWriter`, for ``dcp.load`` with any number of ranks.

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> d = tempfile.mkdtemp()
        >>> fastckpt.save({"w": torch.ones(2), "step": 5}, d + "/full.safetensors")
        >>> to_dcp(d + "/full.safetensors", d + "/ckpt")
        >>> load_full(d + "/ckpt")["step"]
        5
    """
    import torch.distributed.checkpoint as dcp

    state = fastckpt.load(src)
    if not isinstance(state, dict):
        raise TypeError(f"{src}: holds a {type(state).__name__}; a DCP checkpoint needs a dict")
    with _single_process():
        dcp.save(state, storage_writer=FastCkptWriter(dst), no_dist=True)


def describe_dcp(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What ``fastckpt inspect`` reports about a DCP checkpoint directory or URL (JSON-able).

    Keys: ``path``, ``kind`` (``"dcp"``), ``writer`` (``"fastckpt"`` or ``"dcp"``), ``entries``
    (``key, type, dtype, shape, chunks, bytes``), ``files`` (name and size), ``total_bytes``.
    """
    path = _location(path)
    metadata = read_dcp_metadata(path, storage_options=storage_options)
    entries = []
    total = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            nbytes = md.size.numel() * md.properties.dtype.itemsize
            total += nbytes
            entries.append(
                {
                    "key": fqn,
                    "type": "tensor",
                    "dtype": str(md.properties.dtype).removeprefix("torch."),
                    "shape": list(md.size),
                    "chunks": len(md.chunks),
                    "bytes": nbytes,
                }
            )
        else:
            assert isinstance(md, BytesStorageMetadata)
            entries.append(
                {"key": fqn, "type": "bytes", "dtype": "", "shape": [], "chunks": 1, "bytes": 0}
            )
    files = sorted(
        {_file_of(v) for v in (metadata.storage_data or {}).values()} - {None}  # type: ignore[arg-type]
    )
    sizes = _file_sizes(path, storage_options)
    return {
        "path": path,
        "kind": "dcp",
        "writer": "fastckpt" if _is_ours(metadata) else "dcp",
        "entries": entries,
        "files": [{"name": f, "bytes": sizes.get(f)} for f in files],
        "total_bytes": total,
    }


def _file_sizes(path: str, storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """Name -> size of every file directly in the checkpoint directory or URL."""
    if not remote.is_url(path):
        if not os.path.isdir(path):
            return {}
        return {entry.name: entry.stat().st_size for entry in os.scandir(path) if entry.is_file()}
    fs, inner = remote.url_to_fs(path, storage_options)
    with remote._Errors(path, "listing"):
        listing = fs.ls(inner, detail=True)
    return {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
        for e in listing
        if e.get("type") == "file"
    }


def _file_of(storage: Any) -> str | None:
    if isinstance(storage, tuple):
        return storage[0]
    return getattr(storage, "relative_path", None)


def verify_dcp(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> tuple[str, str, list[str]]:
    """Checks a DCP checkpoint directory or URL: its metadata, that every item it names
    exists, and (for ours) every tensor's CRC32C. Returns ``(status, detail, damaged)`` with
    status ``OK``, ``DAMAGED``, ``UNVERIFIABLE`` (DCP's own format has no checksums) or
    ``ERROR``.

    Example:
        >>> verify_dcp("/no/such/dir")[0], verify_dcp("memory://no/such/ckpt")[0]
        ('ERROR', 'ERROR')
    """
    name = _location(path)
    try:
        metadata = read_dcp_metadata(name, storage_options=storage_options)
    except FastCkptError as exc:
        return "DAMAGED", f"{name}: {exc}", []
    except OSError as exc:
        return "ERROR", f"{name}: {exc.strerror or exc}", []
    data = metadata.storage_data or {}
    per_file: dict[str, list[str]] = {}
    for storage in data.values():
        per_file.setdefault(_file_of(storage) or "?", []).append(
            storage[1] if isinstance(storage, tuple) else ""
        )
    try:
        present = _file_sizes(name, storage_options)
    except OSError as exc:
        return "ERROR", f"{name}: {exc.strerror or exc}", []
    missing = [f for f in per_file if f not in present]
    if missing:
        return "DAMAGED", f"{name}: missing files: {', '.join(sorted(missing))}", []
    if not _is_ours(metadata):
        return (
            "UNVERIFIABLE",
            f"{name}: DCP checkpoint of {len(per_file)} files without checksums "
            "(written by DCP's FileSystemWriter); its files are all present",
            [],
        )
    damaged: list[str] = []
    for file_name, names in sorted(per_file.items()):
        file_path = remote.join(name, file_name)
        try:
            with _open_rank_file(file_path, storage_options) as reader:
                absent = sorted(set(names) - set(reader.keys()))
                if absent:
                    damaged += [f"{file_name}:{n} (missing)" for n in absent]
                    continue
                damaged += [f"{file_name}:{n}" for n in reader.verify(sorted(set(names)))]
        except FastCkptError as exc:
            return "DAMAGED", f"{name}: {file_name}: {exc}", damaged
        except OSError as exc:
            return "ERROR", f"{name}: {file_name}: {exc.strerror or exc}", damaged
    if damaged:
        return "DAMAGED", f"{name}: damaged: {', '.join(damaged[:20])}", damaged
    return (
        "OK",
        f"{name} (DCP checkpoint, {len(metadata.state_dict_metadata)} keys, {len(per_file)} files)",
        [],
    )


def _open_rank_file(path: str, storage_options: dict[str, Any] | None) -> Any:
    if remote.is_url(path):
        return remote.RemoteReader(path, storage_options=storage_options)
    return fastckpt.open(path)


def format_dcp(info: dict[str, Any]) -> str:
    """The text ``fastckpt inspect`` prints for :func:`describe_dcp`'s result.

    Example:
        >>> info = {"path": "ckpt", "writer": "fastckpt", "total_bytes": 16, "files": [],
        ...         "entries": [{"key": "w", "type": "tensor", "dtype": "float32",
        ...                      "shape": [4], "chunks": 2, "bytes": 16}]}
        >>> print(format_dcp(info))  # doctest: +NORMALIZE_WHITESPACE
        ckpt: DCP checkpoint written by fastckpt, 1 keys, 16 bytes of tensors in 0 files
          key  type    dtype    shape  chunks  bytes
          w    tensor  float32  [4]         2     16
    """
    lines = [
        f"{info['path']}: DCP checkpoint written by "
        f"{'fastckpt' if info['writer'] == 'fastckpt' else 'DCP FileSystemWriter'}, "
        f"{len(info['entries'])} keys, {info['total_bytes']} bytes of tensors "
        f"in {len(info['files'])} files"
    ]
    rows = [("key", "type", "dtype", "shape", "chunks", "bytes")]
    for e in info["entries"]:
        shape = "[" + ", ".join(map(str, e["shape"])) + "]" if e["type"] == "tensor" else ""
        rows.append((e["key"], e["type"], e["dtype"], shape, str(e["chunks"]), str(e["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for row in rows:
        left = "  ".join(row[i].ljust(widths[i]) for i in range(4))
        right = "  ".join(row[i].rjust(widths[i]) for i in range(4, 6))
        lines.append(f"  {left}  {right}")
    for f in info["files"]:
        size = "missing" if f["bytes"] is None else f"{f['bytes']} bytes"
        lines.append(f"  file {f['name']}: {size}")
    return "\n".join(lines)


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
                io = resolve_io(self.reader.path, _engine_options(self.reader.io_options))
                self.handle = aio_handle(**dataclasses.asdict(io))
            if info.nbytes:
                self.handle.async_pread(target, path, info.offset)
                self.reader._count(info.nbytes)
            self.pending.append((req, target, path, name, None if crcs is None else crcs.get(name)))
        return rest

    def wait(self) -> None:
        if self.handle is not None:
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


def _read_header(path: str) -> tuple[dict[str, fastckpt.TensorInfo], dict[str, int] | None]:
    """What the header of a rank file says of each tensor, and its CRC32C table (None
    without checksums)."""
    from fastckpt import format as fmt

    with fastckpt.open(path) as reader:
        infos = {name: reader.info(name) for name in reader.keys()}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            header = fmt.parse_header(f.read(fmt.parse_header_length(f.read(8), size)), size)
        except fastckpt.HeaderError as exc:
            raise fastckpt.HeaderError(f"{path}: {exc}") from None
    return infos, fmt.split_metadata(header.metadata).crcs


def _fits_whole(info: fastckpt.TensorInfo, req: ReadItem, target: torch.Tensor) -> bool:
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
