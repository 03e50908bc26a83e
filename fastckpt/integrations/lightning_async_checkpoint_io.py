"""The background plugin, :class:`AsyncFastCkptIO`: saves that barely block the loop."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import warnings
from typing import Any

from fastckpt.checkpoint.asynchronous import SaveFuture, async_save, fenced_optimizers
from fastckpt.errors import LazySaveError
from fastckpt.integrations import remote
from fastckpt.integrations.lightning_checkpoint_io import (
    FastCkptIO,
    _calling_trainer,
    _check_storage_options,
    _explain_refusal,
    _flatten,
    _make_parent,
    _outside_a_run,
    _remove_file,
)
from fastckpt.storage.locations import is_url

#: The names of the threads of one save, which end with it (joined at teardown).
_SAVE_THREAD_NAMES = ("fastckpt-save",)  # (a URL's too: fastckpt-save:url)

#: What lives only in this process (futures, threads): never pickled.
_RUNTIME_STATE = (
    "_unsettled",
    "_latest",
    "_removals",
    "_deleters",
    "_deletions",
    "_threads",
    "_lazy_paths",
    "_step_of",
)


class _Removal:
    """A deletion put off until the saves in flight when it was asked for have committed."""

    def __init__(self, path: str, waiting_on: list[SaveFuture]):
        self.path = path
        self.waiting_on = waiting_on
        self.cancelled = False

    def ready(self) -> bool:
        return all(f.done() for f in self.waiting_on)

    def safe(self) -> bool:
        # A save that failed may have been meant to replace this file: keep it.
        return all(f.exception() is None for f in self.waiting_on)


class AsyncFastCkptIO(FastCkptIO):
    """A ``CheckpointIO`` whose saves barely block the training loop.

    By default ``save_checkpoint`` returns once the tensors are copied into staging memory
    (a point-in-time snapshot the size of the checkpoint), as Lightning's
    ``AsyncCheckpointIO`` does; the write goes on in the background and the model may change
    at once. The file holds the state at the call whatever the module does next: a
    parameter clamped in ``on_train_batch_end`` (WGAN), a projection, a manual EMA or a
    re-initialized unit changes nothing already copied.

    ``lazy=True`` declares that between a save and the next optimizer step nothing but the
    Trainer's optimizers changes the parameters and optimizer state in place. Saves made
    during a Trainer's run are then lazy (:func:`fastckpt.async_save` with
    ``fence=trainer.optimizers``): only what the optimizers do not change (buffers such as
    BatchNorm's statistics, any other tensor) is copied at the call, and a background
    thread streams the parameters and optimizer state through a fixed staging ring while
    the next batch's forward and backward run; the optimizers' next ``step()`` first lets
    the save copy, or snapshot into host memory (up to ``fence_bytes``), what it has not
    reached. The fence comes after the step's closure for torch's own optimizers, which
    evaluate it before they change anything, and before the step for others. Code that
    changes those tensors elsewhere may call :meth:`fence` first. If it does not, the
    declaration was wrong: the save whose tensor changed is not committed (the file keeps
    its earlier content, never a mix), a ``UserWarning`` names the tensor and the file, the
    plugin snapshots every later save, and :class:`FastCkptCheckpoint` saves that step
    again at the end of training if no later save replaced it. The run goes on.

    Saves snapshot whatever ``lazy`` says when there is nothing to fence: a URL, or a plugin
    used outside a running Trainer without ``fence=``.

    Either way, writing, fsync and the atomic rename happen in the background. Guarantees:

    - at most one save in flight per path: saving to a path still being written (``last.ckpt``
      every few steps) first waits for that write;
    - ``remove_checkpoint`` never deletes a file still being written, and puts a deletion
      off until the saves in flight have committed; if one of them fails, the file is kept,
      so a failed save never costs an existing checkpoint (top-k replacement). The deletion
      itself runs in a background thread too: unlinking a large file can take a second;
    - a failed save raises its error from the next ``save_checkpoint``/``remove_checkpoint``
      call, or from ``teardown()``, which waits for every save (Lightning calls it at the end
      of ``fit``). A save refused at once (an unsupported object) raises at once.

    Args:
        allow_pickle: as :class:`FastCkptIO`.
        max_pending: at most this many saves in flight; a further save waits for the oldest.
        lazy: True: stream the parameters and optimizer state while training goes on,
            fenced at the optimizers' steps (see above: only for code that changes them
            through the optimizers alone). False or None (the default): snapshot.
        fence: the optimizers to fence when the plugin is used directly, outside a
            Trainer (which otherwise says which): naming them declares what ``lazy=True``
            does, so such saves are lazy unless ``lazy=False``; without them they snapshot.
        fence_bytes: cap on the host memory one fence may snapshot (default: no cap); past
            it the step waits for the ring, at the storage's speed.
        save_options: other keyword options of :func:`fastckpt.async_save`.

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import AsyncFastCkptIO
        >>> io = AsyncFastCkptIO()
        >>> trainer = pl.Trainer(plugins=[io], logger=False, enable_progress_bar=False)
        >>> io.teardown()  # waits for pending saves; Lightning calls it after fit()
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        max_pending: int = 2,
        lazy: bool | None = None,
        fence: Any = (),
        fence_bytes: int | None = None,
        **save_options: Any,
    ):
        super().__init__(allow_pickle=allow_pickle, **save_options)
        self.max_pending = max_pending
        self.lazy = lazy
        self.fence_bytes = fence_bytes
        self._fence = fenced_optimizers(fence)
        self._withdrawn = False  # a lazy save proved lazy=True wrong: snapshot from now on
        self._reset_runtime_state()

    def _reset_runtime_state(self) -> None:
        self._unsettled: list[SaveFuture] = []  # not yet checked for an error
        self._latest: dict[str, SaveFuture] = {}  # path -> its latest save
        self._removals: list[_Removal] = []
        #: One thread per deletion, ending with it: no idle thread outlives the deletions
        #: (the main process of a ddp_spawn run removes a file after fit, with no teardown).
        self._deleters: list[threading.Thread] = []
        self._deletions: dict[str, concurrent.futures.Future] = {}  # path -> its deletion
        self._threads: list[threading.Thread] = []  # the save threads started here
        self._lazy_paths: dict[SaveFuture, str] = {}  # lazy saves in flight -> their path
        #: Paths whose lazy save was not committed (a tensor changed outside the fence) and
        #: that no later save has written since: :class:`FastCkptCheckpoint` saves them again.
        self.dropped: dict[str, int | None] = {}  # path -> the global step of that save
        self._step_of: dict[SaveFuture, Any] = {}  # saves in flight -> their global step

    def __getstate__(self) -> dict[str, Any]:
        """The options only: futures, locks and threads stay with this process (a Trainer
        is pickled after a ``ddp_spawn`` fit, its plugins with it)."""
        state = dict(self.__dict__)
        for name in (*_RUNTIME_STATE, "dropped"):
            state.pop(name, None)
        state["_fence"] = []  # optimizers stay with this process too
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime_state()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Snapshots ``checkpoint`` (or, with ``lazy=True``, fences it) and writes it to
        ``path`` in the background; ``storage_options`` go to fsspec for a URL."""
        options = _check_storage_options(storage_options, type(self))
        path = os.fspath(path)
        self._raise_failures()
        previous = self._latest.get(path)
        if previous is not None and not previous.done():
            previous.wait()
            self._raise_failures()
        deleting = self._deletions.pop(path, None)
        if deleting is not None:
            deleting.result()  # an earlier file of this name goes before the new one arrives
        for removal in self._removals:
            if removal.path == path:
                removal.cancelled = True  # this save replaces the file: do not delete it later
        flat = _flatten(checkpoint, path, self.allow_pickle, self.left_out)
        _make_parent(path)
        trainer = _calling_trainer()
        outside = _outside_a_run(trainer)
        if trainer is None:
            optimizers = self._fence  # used directly: only what the caller said to fence
        else:
            optimizers = [] if outside else list(getattr(trainer, "optimizers", None) or ())
        # Lazy only where declared (lazy=True; or, used directly, fence= names what to fence
        # and lazy=False does not refuse it), and never again once the declaration proved wrong.
        declared = self.lazy is True or (self.lazy is None and trainer is None and self._fence)
        lazy = bool(declared) and not self._withdrawn and bool(optimizers) and not is_url(path)
        before = set(threading.enumerate())
        if lazy:
            fenced = {"fence": optimizers, "fence_bytes": self.fence_bytes, **self.save_options}
            future = async_save(flat, path, max_pending=self.max_pending, **fenced)
            self._lazy_paths[future] = path
        elif is_url(path):
            future = remote.async_save(
                flat, path, max_pending=self.max_pending, **options, **self.save_options
            )
        else:
            future = async_save(flat, path, max_pending=self.max_pending, **self.save_options)
        # (only a save's own thread, which ends with it: not a pool's, which lives on)
        self._threads.extend(
            t
            for t in threading.enumerate()
            if t not in before and t.name.startswith(_SAVE_THREAD_NAMES)
        )
        self.dropped.pop(path, None)  # this save replaces the one not committed
        self._latest[path] = future
        self._step_of[future] = checkpoint.get("global_step")
        self._unsettled.append(future)
        error = future.exception() if future.done() else None
        if error is not None and not self._fell_back(future, error):
            self._unsettled.remove(future)
            if isinstance(error, TypeError):
                raise _explain_refusal(error, path) from error
            raise error
        if outside:
            # Trainer.save_checkpoint() after (or before) fit: nothing would wait for this
            # save, and the caller expects the file there when the call returns.
            future.wait()
            self._raise_failures()
        self._reap()

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Reads a checkpoint, first waiting for a save of ``path`` still in flight here (its
        file is not in place until that save commits)."""
        pending = self._latest.get(os.fspath(path))
        if pending is not None:
            pending.wait()
            self._raise_failures()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes ``path`` once the saves in flight now have committed (at once if none)."""
        path = os.fspath(path)
        self._raise_failures()
        waiting_on = [f for f in self._latest.values() if not f.done()]
        self._removals.append(_Removal(path, waiting_on))
        self._reap()

    def teardown(self) -> None:
        """Waits for every save and deletion and joins their threads (none outlives the
        call, even when a save failed: its temporary file is gone too); raises the first
        error not yet raised."""
        try:
            self.settle()
        finally:
            for future in list(self._latest.values()):
                future.wait()
            self._removals = []  # (settle started every deletion whose saves finished)
            deleters, self._deleters = self._deleters, []
            for deleter in deleters:
                deleter.join()
            threads, self._threads = self._threads, []
            for thread in threads:
                thread.join()  # past its future's result: only the thread's own exit is left
            self._latest.clear()
        self._raise_failures()

    def settle(self) -> None:
        """Waits for every save in flight and starts the deletions they held back; raises
        the first error not yet raised. A lazy save that a change outside the fence spoiled
        is not an error: it is in :attr:`dropped`, with a warning.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().settle()
        """
        for future in list(self._latest.values()):
            future.wait()
        self._reap()
        self._raise_failures()

    def in_flight(self, path: Any) -> bool:
        """Whether a save to ``path`` is still being written: the file is not there yet,
        but a checkpoint is on its way to that name.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().in_flight("/tmp/none.ckpt")
            False
        """
        future = self._latest.get(os.fspath(path))
        return future is not None and not future.done()

    def fence(self) -> None:
        """Returns once the tensors of every save in flight may be changed: call it before
        changing the model or optimizer state in place other than through an optimizer
        step (an EMA update in a callback, say). At once with ``lazy=False``.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().fence()
        """
        for future in list(self._latest.values()):
            future.fence()

    def wait(self) -> None:
        """Waits for every save and pending deletion, like :meth:`teardown`.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().wait()
        """
        self.teardown()

    def _raise_failures(self) -> None:
        """Raises the first error among finished saves not checked yet (each is raised once)."""
        first: BaseException | None = None
        still: list[SaveFuture] = []
        for future in self._unsettled:
            if not future.done():
                still.append(future)
                continue
            error = future.exception()
            if error is not None and first is None and not self._fell_back(future, error):
                first = error
            self._lazy_paths.pop(future, None)
            self._step_of.pop(future, None)
        self._unsettled = still
        for path in [p for p, f in self._latest.items() if f.done()]:
            del self._latest[path]
        for path in [p for p, f in self._deletions.items() if f.done()]:
            error = self._deletions.pop(path).exception()
            if error is not None and first is None:
                first = error
        if first is not None:
            raise first

    def _fell_back(self, future: SaveFuture, error: BaseException) -> bool:
        """Whether ``error`` ended a lazy save whose tensor changed outside the fence: then
        the file keeps its earlier content, the path goes to :attr:`dropped`, a warning says
        so once, and later saves snapshot. Nothing mixed was committed, and the training
        loop goes on."""
        path = self._lazy_paths.get(future)
        if path is None or not isinstance(error, LazySaveError):
            return False
        if self._latest.get(path, future) is future:  # no later save of that path
            self.dropped[path] = self._step_of.get(future)
        self._withdrawn = True
        warnings.warn(
            f"the lazy save of {path} was not committed: {error} -- lazy=True declares that "
            "only the optimizers change the parameters between steps, and this module does "
            "not; this AsyncFastCkptIO snapshots its saves from now on (lazy=False says so "
            "from the start)",
            UserWarning,
            stacklevel=2,
        )
        return True

    def _reap(self) -> None:
        """Starts the deletions whose saves have all finished."""
        self._threads = [t for t in self._threads if t.is_alive()]
        pending: list[_Removal] = []
        for removal in self._removals:
            if not removal.ready():
                pending.append(removal)
            elif removal.safe() and not removal.cancelled:
                self._deletions[removal.path] = self._delete_in_background(removal.path)
        self._removals = pending

    def _delete_in_background(self, path: str) -> concurrent.futures.Future:
        """Deletes ``path`` on a thread of its own (unlinking a large file takes a while);
        the future holds its error."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def delete() -> None:
            try:
                _remove_file(path)
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)
            else:
                future.set_result(None)

        self._deleters = [t for t in self._deleters if t.is_alive()]
        thread = threading.Thread(target=delete, name="fastckpt-remove")
        thread.start()
        self._deleters.append(thread)
        return future
