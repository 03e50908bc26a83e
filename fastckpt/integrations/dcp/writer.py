"""The DCP ``StorageWriter``: one fastckpt file per rank, committed atomically, then the
checkpoint published by ``.metadata``.

Commit protocol: every rank writes its file atomically (temporary file, fsync, rename) under
a name not used by any earlier save; only when every rank's file is durable does the
coordinator replace ``.metadata`` (temporary file, fsync, rename, directory fsync), the one
step that publishes the checkpoint, and only then remove the files that neither the
published ``.metadata`` nor a save still running needs (see
:mod:`fastckpt.integrations.dcp._stale_files`). A save that fails or is killed at any point
therefore leaves the previous checkpoint in the directory whole and loadable, and saves
running at once into one directory never remove each other's files.

At an fsspec URL the layout and the protocol are the same, with the remote save's commit in
place of the rename: each rank file is one upload that appears whole or not at all (an S3
multipart upload completes, or is aborted), and ``.metadata`` is written only after every
rank's upload has returned.
"""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
import threading
from collections.abc import Container
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from fastckpt.checkpoint import save as local_save
from fastckpt.checkpoint.asynchronous import lazy_ring
from fastckpt.checkpoint.lazy_guard import write_guarded
from fastckpt.format import DEFAULT_PIECE_SIZE
from fastckpt.integrations import remote
from fastckpt.integrations.dcp._io_options import engine_options
from fastckpt.integrations.dcp._paths import METADATA_FILE, item_name, location, rank_file
from fastckpt.integrations.dcp._stale_files import (
    LiveSave,
    remove_stale_at_url,
    stale_local_files,
    unlink_all,
)
from fastckpt.integrations.dcp._stand_ins import stand_in_structure
from fastckpt.integrations.dcp.lazy_stager import LazyStage, claim_stage
from fastckpt.integrations.dcp.metadata import is_dcp_checkpoint, write_dcp_metadata
from fastckpt.integrations.dcp.storage_item import StoredItem

__all__ = ["FastCkptWriter"]

_MAX_PENDING_SNAPSHOTS = 2


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
        overwrite: replace a checkpoint already at ``path`` (else ``RuntimeError``:
            "Checkpoint already exists ...", as DCP's own writer says).
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
        if "_extensions" in io_options:
            raise TypeError(
                "FastCkptWriter does not take _extensions: DCP's stream transforms (ZStandard "
                "and other StreamTransformExtension) would break the aligned, uncompressed "
                "layout that direct I/O and ranged reads rely on; save with DCP's "
                "FileSystemWriter(path, _extensions=[...]) for transformed streams, or keep "
                "FastCkptWriter and store a smaller dtype (bf16, float8) to shrink the files"
            )
        self.path = location(path)
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
        self._live: LiveSave | None = None  # held by the coordinator from plan to publish

    # -- StorageWriter ---------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Starts a new save (to ``checkpoint_id`` when given)."""
        self._end_save()  # an earlier save that failed before its commit
        if checkpoint_id:
            self.path = location(checkpoint_id)
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
            raise RuntimeError(
                f"Checkpoint already exists at {self.path} and overwrite=False: pass "
                "overwrite=True to replace it, or save to another directory"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Gives every rank its file name, unique to this save (so nothing is overwritten),
        and marks the save as running in the directory before any rank writes its file."""
        if not remote.is_url(self.path):
            self._end_save()
            self._live = LiveSave(self.path, self.save_id)
        return [self.plan_for_rank(p, i) for i, p in enumerate(plans)]

    def plan_for_rank(self, plan: SavePlan, rank: int) -> SavePlan:
        """``plan`` (a plan of an earlier save, reused while the state's structure is the
        same) with the file ``rank`` writes in this save: every rank names it without the
        coordinator's round trip once the ranks share ``save_id``.

        Example:
            >>> writer = FastCkptWriter("/tmp/ckpt")
            >>> writer.save_id = "00000000002a"
            >>> writer.plan_for_rank(SavePlan([]), 3).storage_data
            '__3_00000000002a.safetensors'
        """
        return dataclasses.replace(plan, storage_data=rank_file(rank, self.save_id))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes this rank's items into its fastckpt file; the file is durable on return."""
        future: Future[list[WriteResult]] = Future()
        try:
            future.set_result(self._write(plan, planner))
        except BaseException as exc:
            # torch annotates the argument as the result type; it takes an exception
            future.set_exception(exc)  # type: ignore[arg-type]
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commits the checkpoint: ``.metadata`` replaced atomically, then old files removed."""
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        referenced = {file for file, _ in metadata.storage_data.values()}
        try:
            # Every rank's file is durable (DCP gathered their results): publish, whole or
            # not at all (temp file, fsync, rename, directory fsync; at a URL one upload).
            write_dcp_metadata(self.path, metadata, self.storage_options)
            if remote.is_url(self.path):
                remove_stale_at_url(self.path, referenced, self.storage_options)
            else:
                self._remove_unreferenced()
        finally:
            self._end_save()

    def storage_meta(self) -> StorageMeta | None:
        """Identifies this save (``checkpoint_id`` and ``save_id``) in the metadata."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is something this writer can save to (a path or URL)."""
        try:
            location(checkpoint_id)
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
        self._end_save()
        self.wait_for_cleanup()
        if self._pool is not None:
            self._pool.trim()

    def stage(
        self,
        state_dict: dict[str, Any],
        *,
        reuse: SavePlan | None = None,
        skip: Container[MetadataIndex] | None = None,
    ) -> dict[str, Any]:
        """Copies the tensors of ``state_dict`` into page-locked staging buffers (``async_save``).

        Returns a state dict of the same structure for DCP to plan on; the data it saves
        are those at the time of this call. ``reuse``: this rank's final plan of an earlier
        save of the same structure, which the coming save reuses: only its items are
        copied (a replicated tensor that another rank writes is not). ``skip``: items not
        to copy (replicated items that another rank writes, see
        :mod:`fastckpt.distributed.replicated_items`).
        """
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from fastckpt.io.staging_pool import StagingPool

        keep: list[torch.Tensor] = []
        staged, stand_ins, _ = stand_in_structure(state_dict, keep)
        planner = DefaultSavePlanner()
        planner.set_up_planner(staged, None, False)
        local = planner.create_local_plan()
        flat: dict[str, torch.Tensor] = {}
        names: dict[int, str] = {}
        wanted = None if reuse is None else {item_name(i.index) for i in reuse.items}
        for item in local.items:
            name = item_name(item.index)
            if wanted is not None and name not in wanted:
                continue  # another rank writes it (a replicated item of a reused plan)
            if skip is not None and item.index in skip:
                continue  # another rank writes it (a replicated item it owns)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                flat[name] = _bytes_tensor(data)
                continue
            assert isinstance(data, torch.Tensor)  # DCP resolves a tensor item to a tensor
            key = id(data) if id(data) in stand_ins else id(getattr(data, "_base", None))
            source = stand_ins.get(key)
            if source is None or data.shape != source.shape:
                continue  # not a whole local tensor: resolved again at write time
            flat[name] = source
            names[key] = name
        plan = local_save.plan_save(flat, checksum=self.checksum, piece_size=self.piece_size)
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
        # No file nor executor yet: with deferred writes they are given when the rank file is
        # written (StreamWriter's signature does not say None, hence the ignore)
        writer = local_save.StreamWriter(plan, None, None, pool, progress=False, defer_writes=True)  # type: ignore[arg-type]
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
        file_name = plan.storage_data or rank_file(self.rank, self.save_id)
        path = remote.join(self.path, file_name)
        stage = claim_stage(_staged_values(plan, planner))
        if stage is not None:  # staged by FastCkptLazyStager: streamed from the live tensors
            return self._write_lazily(stage, plan, planner, file_name, path)
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
                # named after this save, so no concurrent save's cleanup takes it for stale
                extra = (
                    file_name.removesuffix(".safetensors") + f"{secrets.token_hex(2)}.safetensors"
                )
                results += self._save_items(rest, planner, extra)
            return results
        return self._save_items(plan.items, planner, file_name)

    def _write_lazily(
        self, stage: LazyStage, plan: SavePlan, planner: SavePlanner, file_name: str, path: str
    ) -> list[WriteResult]:
        """Streams the rank file from the live tensors a lazy stage stands for, through the
        lazy ring, fenced and version-checked by the stage's guard; commits it atomically."""
        guard = stage.guard
        try:
            if stage.ended:
                raise RuntimeError(
                    f"{path}: the FastCkptLazyStager was closed before this save wrote its "
                    "file; close the stager only once the last save's future is done"
                )
            if remote.is_url(path):
                raise ValueError(
                    f"{path}: FastCkptLazyStager streams into local files; at a URL stage "
                    "with the writer itself (dcp.async_save without async_stager=)"
                )
            flat: dict[str, torch.Tensor] = {}
            names: dict[str, str | torch.Tensor] = {}
            pending: list[tuple[WriteItem, str]] = []
            for item in plan.items:
                name = item_name(item.index)
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    flat[name] = _bytes_tensor(data)
                    names[name] = flat[name]
                else:
                    assert isinstance(data, torch.Tensor)  # DCP resolves a tensor item so
                    label = stage.label_of(data)
                    if label is None:
                        raise ValueError(
                            f"write item {name!r} is not a whole tensor of the state that "
                            "FastCkptLazyStager staged (a custom planner?): it streams whole "
                            "local tensors; stage this state with the writer itself"
                        )
                    flat[name], names[name] = data.detach(), label
                pending.append((item, name))
            guard.rebind(names)
            self._stream(flat, path, guard, stage.staging_bytes)
        finally:
            guard.finish()
        return [_result(item, file_name, name, flat[name]) for item, name in pending]

    def _stream(
        self, flat: dict[str, torch.Tensor], path: str, guard: Any, staging_bytes: int | None
    ) -> None:
        from fastckpt.io.commit import AtomicFile

        save_plan = local_save.plan_save(flat, checksum=self.checksum, piece_size=self.piece_size)
        ring = lazy_ring(staging_bytes or self.io_options.get("staging_bytes"))
        executor = local_save.executor_for_destination(path, **engine_options(self.io_options))
        out = AtomicFile(path)
        writer = None
        try:
            out.reserve(save_plan.file_size)
            writer = local_save.StreamWriter(
                save_plan, out.file, executor, ring, progress=False, guard=guard
            )
            write_guarded(guard, writer, writer.fill)
            out.commit()
        except BaseException:
            if writer is not None:
                writer.abort()
            out.abort()
            raise

    def _snapshot_name(self, item: WriteItem, planner: SavePlanner, snap: _Snapshot) -> str | None:
        if item.type == WriteItemType.BYTE_IO:
            return item_name(item.index)
        data = planner.resolve_data(item)
        return snap.names.get(id(data)) or snap.names.get(id(getattr(data, "_base", None)))

    def _commit_snapshot(self, snap: _Snapshot, path: str) -> None:
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
            writer.executor = local_save.executor_for_destination(
                path, **engine_options(self.io_options)
            )
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
            name = item_name(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                flat[name] = _bytes_tensor(data)
            else:
                assert isinstance(data, torch.Tensor)  # DCP resolves a tensor item to a tensor
                tensor = data.detach()
                if tensor.device.type not in ("cpu", "cuda"):
                    tensor = tensor.cpu()
                flat[name] = tensor
            pending.append((item, name))
        if remote.is_url(self.path):
            plan = local_save.plan_save(flat, checksum=self.checksum, piece_size=self.piece_size)
            self._write_plan(plan, remote.join(self.path, file_name))
        else:
            local_save.save(
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
            local_save.save(
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

    def _remove_unreferenced(self) -> None:
        """Removes the rank files of earlier or failed saves (after the commit) that neither
        the published ``.metadata`` nor a save still running needs, and the temporary files
        of writers that are gone (those of live writers are locked, and kept).

        Which files go is decided here; unlinking them runs on a background thread, because
        a file system frees a large file's blocks slowly (ext4: about 0.2 s per GiB, which
        would double the commit of a 4-rank save). Only the files listed now are touched,
        so a later save's files never are; :meth:`close` and the next commit wait for it.
        """
        self.wait_for_cleanup()
        stale = stale_local_files(self.path)
        if stale:
            self._removal = threading.Thread(
                target=unlink_all, args=(stale,), name="fastckpt-dcp-cleanup", daemon=False
            )
            self._removal.start()

    def _end_save(self) -> None:
        """Drops the mark of a running save (published, or failed before it could be)."""
        live, self._live = self._live, None
        if live is not None:
            live.release()

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


def _staged_values(plan: SavePlan, planner: SavePlanner) -> Iterable[Any]:
    """The tensors a rank's write items resolve to, then those of the planner's state dict
    (a rank whose items are all bytes still finds the stage it saves)."""
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO:
            yield planner.resolve_data(item)
    state = getattr(planner, "state_dict", None)
    if isinstance(state, dict):
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _bytes_tensor(data: object) -> torch.Tensor:
    """The bytes DCP resolved a bytes item to (an ``io.BytesIO``), as a uint8 tensor."""
    if not isinstance(data, io.BytesIO):
        raise TypeError(f"the planner resolved a bytes item to {type(data).__name__}, not BytesIO")
    raw = bytearray(data.getbuffer())
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _result(item: WriteItem, file_name: str, name: str, tensor: torch.Tensor) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=tensor.numel() * tensor.element_size(),
        storage_data=StoredItem(file_name, name),
    )
