"""Checkpoint I/O that overlaps training: ``async_save``, ``async_load`` and their futures.

``async_save`` returns once the tensors are copied ("snapshotted") into page-locked staging
memory, so the caller may change them at once; the disk writes, checksums and the atomic
commit go on in the background, and the returned :class:`SaveFuture` reports how it ended.

Memory cost: a snapshot needs staging memory the size of the checkpoint to return without
waiting for the disk. By default the asynchronous staging pool grows to the largest
checkpoint saved this way and keeps it (page-locked) for the next save, so a training loop
pays for allocation and locking once. ``staging_bytes=`` (or ``FASTCKPT_ASYNC_STAGING_BYTES``)
caps it; a snapshot larger than the cap makes ``async_save`` wait for the disk to free
buffers instead of failing or growing. :func:`release_staging` frees idle buffers.

Errors are never lost: ``result()`` re-raises them; a failed save whose error nobody
retrieved is logged (logger ``"fastckpt"``) when its future is garbage-collected or at
exit; and the interpreter does not exit before pending saves have committed. Ctrl-C is
never eaten: during the call it is raised by the call; while exit waits for pending saves
it cancels them (each removes its temporary file), and a second one quits at once.

Order: saves to one path take effect in call order. Asynchronous saves commit in call
order, and ``fastckpt.save`` to a path waits for the asynchronous saves to that path still
pending (it does not supersede them), so the last call's checkpoint is the one left there.

Example:
    >>> import os, tempfile, torch, fastckpt
    >>> path = os.path.join(tempfile.mkdtemp(), "async.safetensors")
    >>> state = {"w": torch.randn(100)}
    >>> future = fastckpt.async_save(state, path)
    >>> state["w"].zero_()  # safe: the snapshot is already taken
    tensor(...)
    >>> future.result()
    >>> float(fastckpt.load(path)["w"].abs().sum()) > 0
    True
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import threading
import traceback
import weakref
from typing import Any, Callable

from fastckpt import config
from fastckpt.checkpoint import (
    compressed_tensors,
    compressed_writer,
    fence_memory,
    file_snapshot,
    save_order,
    stream_save,
)
from fastckpt.checkpoint.lazy_guard import LazyGuard, write_guarded
from fastckpt.checkpoint.save import (
    StreamWriter,
    _through_page_cache,
    _write_from_tensors,
    plan_and_executor,
)
from fastckpt.format import DEFAULT_ALIGNMENT, DEFAULT_PIECE_SIZE
from fastckpt.io.commit import AtomicFile, check_destination
from fastckpt.io.staging_pool import StagingPool
from fastckpt.storage.file_object import is_file_object

__all__ = [
    "async_save",
    "async_load",
    "SaveFuture",
    "LoadFuture",
    "wait_all",
    "prepare_staging",
    "release_staging",
]

_log = logging.getLogger("fastckpt")
DEFAULT_MAX_PENDING = 2
#: The staging ring of a lazy save when ``staging_bytes`` is not given.
LAZY_RING_BYTES = 256 << 20


class _CheckpointFuture:
    """A future with ``done``, ``result``, ``exception``, ``add_done_callback`` and ``wait``."""

    def __init__(self, path: str):
        self.path = path
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._retrieved = False

    def done(self) -> bool:
        """Whether the operation has finished, successfully or not."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """Waits and returns the result; re-raises the operation's error.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        self._retrieved = True
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{type(self).__name__} for {self.path} not done after {timeout} s"
            ) from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits and returns the operation's error, or None if it succeeded."""
        self._retrieved = True
        try:
            return self._future.exception(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{type(self).__name__} for {self.path} not done after {timeout} s"
            ) from None

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until done (without raising the operation's error); returns ``done()``."""
        concurrent.futures.wait([self._future], timeout)
        return self._future.done()

    def add_done_callback(self, fn: Callable[["_CheckpointFuture"], Any]) -> None:
        """Calls ``fn(self)`` when done (at once if already done), from the finishing thread."""
        self._future.add_done_callback(lambda _: fn(self))

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        if error is None:
            self._future.set_result(value)
        else:
            self._future.set_exception(error)

    def __del__(self) -> None:
        f = getattr(self, "_future", None)
        if f is not None and f.done() and not self._retrieved and f.exception() is not None:
            _report_lost(self, f.exception())

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._future.exception() else "done")
        return f"<{type(self).__name__} {self.path!r} {state}>"


class SaveFuture(_CheckpointFuture):
    """The outcome of :func:`async_save`: ``result()`` returns None once the file is committed."""

    _guard: LazyGuard | None = None
    _reads_tensors = False  # snapshot=False: the tensors are read until the save is done

    def fence(self) -> None:
        """Returns once the saved tensors may be changed: for a lazy save, the tensors not
        yet copied are snapshotted (see ``fence_bytes``) or waited for; for
        ``snapshot=False``, the save is waited for; otherwise at once (the snapshot is
        taken). Call it before changing the state other than through a fenced optimizer.

        Example:
            >>> import os, tempfile, torch, fastckpt
            >>> w = torch.zeros(4)
            >>> future = fastckpt.async_save({"w": w}, os.path.join(tempfile.mkdtemp(), "f.safetensors"), lazy=True)
            >>> future.fence(); _ = w.add_(1)  # an update no optimizer fence covers
            >>> future.result(); float(fastckpt.load(future.path)["w"].sum())
            0.0
        """
        if self._guard is not None:
            self._guard.fence()
        elif self._reads_tensors:
            self.wait()


class LoadFuture(_CheckpointFuture):
    """The outcome of :func:`async_load`: ``result()`` is what ``fastckpt.load`` returns."""


def _report_lost(future: _CheckpointFuture, error: BaseException) -> None:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    # Not "%s failed" with the future: its repr already ends in "failed".
    what = "async save to" if isinstance(future, SaveFuture) else "async load of"
    _log.error("%s %r failed and its error was never retrieved:\n%s", what, future.path, text)


# -- bookkeeping of pending saves -------------------------------------------------------------

_state_lock = threading.Lock()
_pending: "weakref.WeakSet[SaveFuture]" = weakref.WeakSet()
_strong_pending: set[SaveFuture] = set()  # kept alive until done, even when the caller drops them
_last_commit: SaveFuture | None = None  # commits happen in call order
_in_flight = 0
_in_flight_cond = threading.Condition(_state_lock)
_pool: StagingPool | None = None
_ring: StagingPool | None = None  # lazy saves' staging ring
_cancel_at_exit = threading.Event()  # set by a Ctrl-C while exit waits for pending saves


def _async_pool(budget: int | None, needed: int) -> StagingPool:
    """The asynchronous staging pool, grown to ``needed`` bytes unless a budget caps it."""
    global _pool
    if budget is None:
        budget = config.async_staging_bytes()
    with _state_lock:
        if _pool is None:
            _pool = StagingPool(max(budget or 0, 64 << 20))
        target = needed if budget is None else budget
        _pool.grow_to(max(target, 2 * _pool.piece))
        return _pool


def lazy_ring(budget: int | None) -> StagingPool:
    """The staging ring lazy saves stream through (``budget`` bytes, default
    :data:`LAZY_RING_BYTES`): its own pool, so that a lazy save's host memory stays at the
    ring's size whatever snapshots grew the other pool to.

    Example:
        >>> lazy_ring(None).budget == LAZY_RING_BYTES
        True
    """
    global _ring
    with _state_lock:
        size = max(budget or LAZY_RING_BYTES, 8 << 20)
        if _ring is None or (size != _ring.budget and _ring.in_use() == 0):
            _ring = StagingPool(size)  # an idle ring takes the size asked for now
        elif budget:
            _ring.grow_to(size)  # saves are streaming through it: it only grows
        return _ring


def _after_fork_in_child() -> None:
    # Saves pending in the parent are the parent's: the child starts with none.
    global _state_lock, _in_flight_cond, _pool, _ring, _last_commit, _in_flight, _pending
    _state_lock = threading.Lock()
    _in_flight_cond = threading.Condition(_state_lock)
    _pool, _ring, _last_commit, _in_flight = None, None, None, 0
    _pending = weakref.WeakSet()
    _strong_pending.clear()
    _cancel_at_exit.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def prepare_staging(nbytes: int, *, cuda: bool = False) -> int:
    """Allocates the asynchronous staging pool ahead of the first :func:`async_save`, so that
    call blocks only for its snapshot copy: ``nbytes`` (the size of the state to snapshot)
    of page-locked memory, registered with CUDA with ``cuda=True`` (device-to-host copies
    then run at DMA speed). Returns the bytes ready. The pool is kept and reused across
    saves until :func:`release_staging`.

    Example:
        >>> import fastckpt
        >>> fastckpt.prepare_staging(64 << 20) >= 64 << 20
        True
        >>> fastckpt.release_staging()
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    return _async_pool(None, nbytes).prepare(nbytes, cuda=cuda)


def release_staging() -> None:
    """Frees the idle buffers of the asynchronous staging pool (they come back on demand;
    :func:`prepare_staging` allocates them ahead), and the host memory lazy saves' fences
    kept for the next fence (:mod:`~fastckpt.checkpoint.fence_memory`).

    Example:
        >>> import fastckpt
        >>> fastckpt.release_staging()
    """
    with _state_lock:
        for pool in (_pool, _ring):
            if pool is not None:
                pool.trim()
    fence_memory.trim()


def wait_all(timeout: float | None = None) -> None:
    """Waits for every pending ``async_save``; raises the first error among them that was not
    already retrieved with ``result()``/``exception()`` (that error then counts as retrieved).

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> path = os.path.join(tempfile.mkdtemp(), "wait.safetensors")
        >>> _ = fastckpt.async_save({"x": torch.ones(1)}, path)
        >>> fastckpt.wait_all()
    """
    with _state_lock:
        futures = list(_pending)
    first: BaseException | None = None
    for f in futures:
        f.wait(timeout)
        if not f.done():
            raise TimeoutError(f"{f} not done after {timeout} s")
        with _state_lock:
            _pending.discard(f)
        if not f._retrieved:
            error = f.exception()  # marks it retrieved: reported here, not again when collected
            if error is not None and first is None:
                first = error
    if first is not None:
        raise first


def _begin(future: SaveFuture, max_pending: int) -> None:
    global _in_flight
    with _in_flight_cond:
        while _in_flight >= max_pending:
            _in_flight_cond.wait()
        _in_flight += 1
        _pending.add(future)
        _strong_pending.add(future)


def _end(future: SaveFuture) -> None:
    global _in_flight
    with _in_flight_cond:
        _in_flight -= 1
        _strong_pending.discard(future)
        _in_flight_cond.notify_all()


def async_save(
    obj: Any,
    f: str | os.PathLike[str],
    *,
    snapshot: bool = True,
    lazy: bool = False,
    fence: Any = (),
    fence_bytes: int | None = None,
    max_pending: int = DEFAULT_MAX_PENDING,
    staging_bytes: int | None = None,
    metadata: Any = None,
    alignment: int = DEFAULT_ALIGNMENT,
    checksum: bool = True,
    allow_pickle: bool = False,
    piece_size: int = DEFAULT_PIECE_SIZE,
    progress: bool | None = None,
    direct_io: bool | None = None,
    engine: str | None = None,
    block_size: int | None = None,
    queue_depth: int | None = None,
    intra_op_parallelism: int | None = None,
    base: str | os.PathLike[str] | None = None,
    frozen: Any = None,
    compress: bool | str | None = None,
    spare_file: str | None = None,
) -> SaveFuture:
    """Saves like :func:`fastckpt.save`, returning once the tensors are snapshotted.

    Args:
        snapshot: copy the tensors into staging memory before returning (the default). With
            ``snapshot=False`` nothing is copied up front and the background thread reads
            the tensors while writing: the caller must not modify them until the future is
            done, or the file may hold a mix of old and new values (DeepNVMe's contract).
        lazy: return without copying anything; a background thread streams the tensors
            through a ring of ``staging_bytes`` (default 256 MiB) to the file while training
            goes on, guarded as :mod:`fastckpt.checkpoint.lazy_guard` describes: each
            tensor's version counter is checked around its copy (a tensor changed in between
            fails the save, naming it), and ``fence`` holds changes off. Host memory grows
            by the ring, not by the checkpoint. Implied by ``fence``.
        fence: an optimizer (or several) whose next ``step()`` first waits for the lazy
            save: the tensors not yet copied are snapshotted into host memory (CUDA
            tensors: cloned in device memory on the side stream, and the current stream
            made to wait on the clones), so the step goes on at once. Other in-place
            updates call ``future.fence()`` first.
        fence_bytes: cap on the memory one fence may snapshot (host snapshots and device
            clones together; default: no cap); the tensors past it are waited for, at the
            storage's speed.
        max_pending: at most this many saves in flight; a further call waits for the oldest.
        staging_bytes: cap on the asynchronous staging pool (default: the checkpoint's size;
            256 MiB for a lazy save).
        piece_size: bytes per checksummed piece, as :func:`fastckpt.save`'s.
        progress: show a progress bar while snapshotting (with ``snapshot=False``, while
            writing), as :func:`fastckpt.save`'s (default: on a terminal).
        direct_io: as :func:`fastckpt.save`'s: ``True`` writes the staging buffers with
            O_DIRECT (where the file system takes it), ``False`` through the page cache
            (with ``snapshot=False`` and CPU tensors, straight from the tensors' memory on
            every core, with no staging copy). Default: with ``snapshot=False`` chosen as
            :func:`fastckpt.save` chooses; with a snapshot, O_DIRECT where taken.
        base, frozen: an incremental save, as :func:`fastckpt.save`'s. What changed is
            decided in the call (tensors hashed there, unless frozen or unmoved since this
            process saved them to ``base``), so the references are to the call-time state.
        compress: as :func:`fastckpt.save`'s. The snapshot is a copy of the tensors in host
            memory (the checkpoint's raw size), compressed and written in the background;
            not with ``lazy=True`` or ``fence=`` (ValueError).
        spare_file: a spare file (:func:`fastckpt.io.spare_files.retire` made it) in the
            destination's directory, written over instead of a new file when it is there
            (not by a compressed save): on a memory file system the save then allocates no
            pages. :class:`~fastckpt.CheckpointManager`'s fast tier keeps one.
        Other arguments: as :func:`fastckpt.save`.

    Returns:
        A :class:`SaveFuture`; every error (an unsupported object, an unwritable directory,
        a full disk) is raised by its ``result()``. Back-to-back saves commit in call order,
        and a later :func:`fastckpt.save` to the same path waits for this one to commit
        first: the last call's checkpoint is the one left at the path.

    Raises:
        KeyboardInterrupt, SystemExit: raised while the call itself runs (during the
            snapshot, say): the save is abandoned, its temporary file removed, and the
            interrupt raised here, not handed to the future.

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> d = tempfile.mkdtemp()
        >>> futures = [fastckpt.async_save({"step": torch.tensor(i)}, os.path.join(d, f"s{i}.safetensors"))
        ...            for i in range(3)]
        >>> [f.result() for f in futures]
        [None, None, None]
    """
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
    optimizers = fenced_optimizers(fence)
    lazy = lazy or bool(optimizers)
    if lazy and not snapshot:
        raise ValueError("lazy=True (or fence=) and snapshot=False are two different modes")
    if lazy and compressed_tensors.check_compress(compress) is not None:
        raise ValueError(
            "compress= does not take lazy=True or fence=: a compressed save snapshots the "
            "tensors (snapshot=True) or reads them in the background (snapshot=False)"
        )
    if fence_bytes is not None and (isinstance(fence_bytes, bool) or fence_bytes < 0):
        raise ValueError(f"fence_bytes must be None or a non-negative int, got {fence_bytes!r}")
    future = SaveFuture(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))
    if is_file_object(f):
        if lazy or base is not None or frozen is not None or spare_file is not None:
            raise TypeError("f is a file object: lazy=, fence=, base=, frozen= need a path")
        format_options = dict(
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            allow_pickle=allow_pickle,
            piece_size=piece_size,
            compress=compress,
        )
        return _start_into_stream(future, obj, f, max_pending, snapshot, format_options)
    _begin(future, max_pending)
    try:
        path = check_destination(f)
        plan, executor = plan_and_executor(
            obj,
            path,
            metadata=metadata,
            alignment=alignment,
            checksum=checksum,
            allow_pickle=allow_pickle,
            piece_size=piece_size,
            engine=engine,
            block_size=block_size,
            queue_depth=queue_depth,
            intra_op_parallelism=intra_op_parallelism,
            base=base,
            frozen=frozen,
            compress=compress,
        )
        spare = None if plan.frames else spare_file
        out = AtomicFile(path, direct=direct_io is not False, spare=spare, size=plan.file_size)
    except BaseException as exc:  # reported through the future, like every later error
        return _fail_early(future, exc)
    try:
        # Over a spare file's pages on a memory file system, the snapshot is the file itself:
        # writing the tensors into it copies the state once, as a snapshot into staging
        # does, and leaves nothing to write after (no staging memory, no second copy).
        # A caller that keeps spare files (a CheckpointManager's fast tier) writes into the
        # file even before it has a spare: its pages are allocated once, in the call, and
        # kept as spares from then on, instead of staging memory allocated besides them
        # (and the file's new pages allocated in the background all the same).
        # (a compressed save takes no spare: spare is None then)
        in_memory = spare is not None and _through_page_cache(plan, out, direct_io)
        into_file = snapshot and not lazy and in_memory
        lazy_into_file = lazy and in_memory  # read through the fence straight into the file
        if plan.frames or into_file or lazy_into_file:  # (compressed saves: their own copy)
            pool = None
        elif lazy:
            pool = lazy_ring(staging_bytes)
        else:
            pool = _async_pool(staging_bytes, plan.data_size)
    except BaseException as exc:
        out.abort()
        return _fail_early(future, exc)
    try:
        allocated = False
        if not lazy:  # a lazy call returns at once: its thread reserves (~3 ms per GiB)
            allocated = out.reserve(plan.file_size)
        from_tensors = not snapshot and _through_page_cache(plan, out, direct_io)
        guard = (
            LazyGuard(plan.tensors, fence_bytes=fence_bytes, optimizers=optimizers)
            if lazy
            else None
        )
    except BaseException as exc:
        out.abort()
        return _fail_early(future, exc)
    if plan.frames:  # compressed while written (compressed_writer.py)
        return _start_compressed(future, plan, out, path, snapshot=snapshot)
    if into_file:
        return _start_written(future, plan, out, path, progress=progress, allocated=allocated)
    if lazy_into_file:
        assert guard is not None
        return _start_lazy_into_file(future, plan, out, path, guard)
    assert pool is not None  # (only compressed saves go without one)
    writer = StreamWriter(
        plan,
        out.file,
        executor,
        pool,
        progress=progress if snapshot and not lazy else False,
        defer_writes=snapshot and not lazy,
        cancel=_cancel_at_exit,
        guard=guard,
    )
    future._guard, future._reads_tensors = guard, not snapshot
    work: Callable[[], None]
    if guard is not None:

        def work() -> None:
            def fill() -> None:
                out.reserve(plan.file_size)
                writer.fill()

            write_guarded(guard, writer, fill)

    elif from_tensors:

        def work() -> None:
            _write_from_tensors(plan, out.file, progress=progress)

    elif snapshot:
        try:
            writer.fill()  # returns once every byte is in staging memory or on disk
        except BaseException as exc:
            try:
                writer.abort()  # collects the writes started; may raise a second interrupt
            finally:
                out.abort()
            return _fail_early(future, exc)
        work = writer.finish
    else:

        def work() -> None:
            writer.fill()
            writer.finish()

    return _start_in_order(future, path, work, writer, out)


def _start_in_order(
    future: SaveFuture, path: str, work: Callable[[], None], writer: Any, out: AtomicFile
) -> SaveFuture:
    """Runs ``work`` on the save's own thread, committed after every earlier save (of any
    path) and after earlier saves of ``path``; ``writer`` and ``out`` are aborted if no
    thread can be had."""
    global _last_commit
    with _state_lock:
        previous, _last_commit = _last_commit, future
    order = save_order.register(path)
    try:
        threading.Thread(
            target=_finish_in_order,
            args=(future, previous, [work, writer, out], order),
            name=f"fastckpt-save:{os.path.basename(path)}",
            daemon=True,  # waited for at exit by _finish_at_exit, which can also cancel it
        ).start()
    except Exception as exc:  # no thread to be had: nothing runs, nothing may wait for it
        # (An interrupt during start() is not caught: the thread may be running by then,
        # and finishes the save; the interrupt goes on to the caller.)
        save_order.finish(order)
        try:
            writer.abort()
        finally:
            out.abort()
        return _fail_early(future, exc)
    return future


class _StreamOut:
    """The caller's file object as a save's output: written when the save commits (after
    every earlier save, so two saves into one file object never interleave), never
    closed, flushed or removed (it is the caller's)."""

    def __init__(self, f: Any, write: Callable[[], None]):
        self.path = repr(f)
        self._write: Callable[[], None] | None = write

    def commit(self) -> None:
        write, self._write = self._write, None
        if write is not None:
            write()

    def abort(self) -> None:
        self._write = None


def _start_into_stream(
    future: SaveFuture,
    obj: Any,
    f: Any,
    max_pending: int,
    snapshot: bool,
    format_options: dict[str, Any],
) -> SaveFuture:
    """``async_save`` into a writable binary file object (``io.BytesIO``, a socket's file):
    with ``snapshot`` the checkpoint's bytes are made in the call (one copy of the state,
    as the staging pool would hold) and written in the background; without, the
    background thread reads the tensors while writing, as ``snapshot=False`` does."""
    _begin(future, max_pending)
    try:
        stream_save.check_writable(f, "f")
        if snapshot:
            data = memoryview(stream_save.save_bytes(obj, **format_options))
            out = _StreamOut(f, lambda: stream_save.write_all(f, data))
        else:
            future._reads_tensors = True
            out = _StreamOut(f, lambda: stream_save.save_to_stream(obj, f, **format_options))
    except BaseException as exc:
        return _fail_early(future, exc)
    return _start_in_order(future, out.path, lambda: None, _Written(), out)  # type: ignore[arg-type]


class _Written:
    """The writer of a file written in the call: nothing is left to stop."""

    def abort(self) -> None:
        pass


def _start_written(
    future: SaveFuture,
    plan: Any,
    out: AtomicFile,
    path: str,
    *,
    progress: bool | None,
    allocated: bool,
) -> SaveFuture:
    """The rest of an eager ``async_save`` over a spare file on a memory file system: the
    tensors are written into it in the call, which is the snapshot
    (:mod:`~fastckpt.checkpoint.file_snapshot`); the save's thread checksums the file's
    bytes, writes the header and commits, in order."""
    try:
        file_snapshot.write_tensors(plan, out.file, progress=progress, allocated=allocated)
    except BaseException as exc:
        out.abort()
        return _fail_early(future, exc)
    return _start_in_order(
        future, path, lambda: file_snapshot.checksum_and_header(plan, out.file), _Written(), out
    )


def _start_lazy_into_file(
    future: SaveFuture, plan: Any, out: AtomicFile, path: str, guard: LazyGuard
) -> SaveFuture:
    """The rest of a lazy ``async_save`` over a spare file on a memory file system: the
    save's thread copies each tensor through the guard into the file's pages
    (:class:`~fastckpt.checkpoint.file_snapshot.LazyIntoFile`), then commits, in order."""
    writer = file_snapshot.LazyIntoFile(plan, out.file, guard, cancel=_cancel_at_exit)
    future._guard = guard

    def work() -> None:
        write_guarded(guard, writer, lambda: writer.fill(allocated=out.reserve(plan.file_size)))

    return _start_in_order(future, path, work, writer, out)


def _start_compressed(
    future: SaveFuture, plan: Any, out: AtomicFile, path: str, *, snapshot: bool
) -> SaveFuture:
    """The rest of an ``async_save`` with ``compress=``: the tensors copied to host memory
    (``snapshot``), then compressed and written on the save's thread, committed in order."""
    try:
        if snapshot:  # one copy per tensor, tied names keep sharing it
            copies: dict[int, Any] = {}
            plan.tensors = {
                n: copies.setdefault(id(t), t.detach().to("cpu", copy=True))
                for n, t in plan.tensors.items()
            }
        writer = compressed_writer.FrameWriter(
            plan, out.file, progress=False, cancel=_cancel_at_exit
        )
    except BaseException as exc:
        out.abort()
        return _fail_early(future, exc)

    def work() -> None:
        writer.fill()
        writer.finish()

    return _start_in_order(future, path, work, writer, out)


def fenced_optimizers(fence: Any) -> list[Any]:
    """``fence=`` as a list of optimizers (TypeError naming what else it got).

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> fenced_optimizers(optimizer) == [optimizer], fenced_optimizers(None)
        (True, [])
    """
    import torch

    if fence is None:
        return []
    if isinstance(fence, torch.optim.Optimizer):
        return [fence]
    try:
        optimizers = list(fence)
    except TypeError:
        raise TypeError(
            f"fence takes a torch.optim.Optimizer or a list of them, got {type(fence).__name__}"
        ) from None
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "fence takes a torch.optim.Optimizer or a list of them, got a "
                f"{type(optimizer).__name__} in the list"
            )
    return optimizers


def run_pending(
    future: SaveFuture,
    work: Callable[[], None],
    *,
    name: str,
    max_pending: int = DEFAULT_MAX_PENDING,
) -> None:
    """Runs ``work`` on a new (non-daemon) thread as one of the pending saves: it counts
    against ``max_pending``, :func:`wait_all` waits for it, and an error nobody retrieves is
    reported at exit. ``future`` is settled with ``work``'s outcome. Used by savers other
    than the local one (URLs), so that every ``async_save`` behaves alike.

    Example:
        >>> future = SaveFuture("memory://doc/example")
        >>> run_pending(future, lambda: None, name="fastckpt-save:example")
        >>> wait_all(); future.done()
        True
    """
    _begin(future, max_pending)
    job = [work]  # emptied before the future settles (see _finish_in_order)
    del work

    def run() -> None:
        error: BaseException | None = None
        try:
            job.pop()()
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            error = exc
        _end(future)
        future._set(None, error)

    try:
        # A daemon thread, waited for at exit by _finish_at_exit.
        threading.Thread(target=run, name=name, daemon=True).start()
    except BaseException as exc:  # no thread: the save fails, it takes no place
        _fail_early(future, exc)


def _fail_early(future: SaveFuture, error: BaseException) -> SaveFuture:
    """Settles a save that failed before anything was queued (it takes no place in the
    order) and returns its future; an interrupt (Ctrl-C, ``SystemExit``) is raised to the
    caller instead, whose training loop must stop, not go on without its checkpoint."""
    _end(future)
    future._set(None, error)
    if not isinstance(error, Exception):
        future._retrieved = True  # the caller gets it raised: not reported as lost
        raise error
    return future


def _finish_in_order(
    future: SaveFuture,
    previous: SaveFuture | None,
    job: list[Any],
    order: tuple[str, object],
) -> None:
    """Runs the rest of a save (``job``: the work, its writer and its file), commits after
    the previous save, settles the future.

    Everything the save holds (the tensors among it) is let go *before* the future is
    settled: this daemon thread must not free a tensor once the caller may have moved on
    to interpreter exit, where a thread that wants the GIL back is ended by
    ``pthread_exit``, and unwinding through torch's destructors aborts the process."""
    work, writer, out = job
    job.clear()
    error: BaseException | None = None
    try:
        try:
            work()
        except BaseException as exc:
            error = exc
        if previous is not None:
            previous.wait()  # commit in call order: never rename before an earlier save
        if error is None and _cancel_at_exit.is_set():
            error = KeyboardInterrupt(f"save to {out.path} cancelled at exit")
        if error is None:
            try:
                out.commit()
            except BaseException as exc:
                error = exc
        if error is not None:
            try:
                writer.abort()
            except BaseException:  # noqa: BLE001 - the save's own error is the one to report
                pass
            out.abort()
    finally:
        save_order.finish(order)  # a save to the same path waiting for this one goes on
        del work, writer, out  # freed here, while the caller still waits (see above)
        _end(future)
        future._set(None, error)


def async_load(f: str | os.PathLike[str], **load_options: Any) -> LoadFuture:
    """Starts ``fastckpt.load(f, **load_options)`` in the background; returns a :class:`LoadFuture`.

    For prefetching the next checkpoint, or the next layer's tensors (``keys=[...]``),
    while computing.

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> path = os.path.join(tempfile.mkdtemp(), "al.safetensors")
        >>> fastckpt.save({"x": torch.arange(3)}, path)
        >>> fastckpt.async_load(path).result()["x"].tolist()
        [0, 1, 2]
    """
    from fastckpt.checkpoint.load import load

    future = LoadFuture(os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f))

    def run() -> None:
        try:
            value = load(f, **load_options)
        except BaseException as exc:
            future._set(None, exc)
        else:
            future._set(value)

    threading.Thread(target=run, name="fastckpt-load", daemon=False).start()
    return future


def _finish_at_exit() -> None:
    """At exit, waits for the pending saves, then reports errors nobody retrieved.

    Ctrl-C while waiting cancels them: each stops at its next buffer, collects the writes
    it has in flight and removes its temporary file. A further Ctrl-C ends the process at
    once (``os._exit``); the temporary file left then is removed by the next save to that
    path (its writer's lock died with the process). Either way no save thread is still
    inside native code when the interpreter finalizes.
    """
    cancelling = False
    while True:
        with _state_lock:
            futures = list(_strong_pending)
        try:
            if futures and not cancelling:
                _log.warning(
                    "waiting for %d pending checkpoint save(s) to finish (Ctrl-C cancels them)",
                    len(futures),
                )
            for f in futures:
                f.wait()
            with _state_lock:
                if not _strong_pending:
                    break
        except KeyboardInterrupt:
            if cancelling:
                _log.warning("pending checkpoint saves abandoned")
                os._exit(130)
            cancelling = True
            _cancel_at_exit.set()
            _log.warning("cancelling pending checkpoint saves (Ctrl-C again to quit at once)")
    with _state_lock:
        futures = list(_pending)
    for f in futures:
        error = f._future.exception() if f.done() and not f._retrieved else None
        if error is not None:
            f._retrieved = True
            if not (cancelling and isinstance(error, KeyboardInterrupt)):
                _report_lost(f, error)


# Save threads are daemon threads waited for here, rather than joined by the interpreter: a
# Ctrl-C that interrupts the interpreter's own join lets it finalize under threads still in
# native code, which then die mid-call ("terminate called without an active exception").
atexit.register(_finish_at_exit)
