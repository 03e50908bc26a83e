"""The callback, :class:`FastCkptCheckpoint`: a ``ModelCheckpoint`` writing fastckpt files,
or a checkpoint manager's steps."""

from __future__ import annotations

import importlib
import inspect
import os
import weakref
from typing import Any, Callable

from fastckpt.integrations.lightning_async_checkpoint_io import AsyncFastCkptIO
from fastckpt.integrations.lightning_checkpoint_io import FastCkptIO
from fastckpt.integrations.lightning_framework import (
    ModelCheckpoint,
    TorchCheckpointIO,
    pl,
)
from fastckpt.integrations.lightning_manager_checkpoint_io import (
    _BEST_MARK,
    _MANAGER_METRICS,
    _MANAGER_STEP,
    _STEP_MARK,
    DDP_RECIPE,
    _check_manager_arguments,
    _is_manager,
    _ManagerCheckpointIO,
    _resume_path,
    _scalar_metrics,
    best_metric,
    best_step,
)
from fastckpt.storage.locations import url_to_fs

rank_zero_warn = importlib.import_module(f"{pl.__name__}.utilities").rank_zero_warn


class FastCkptCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` writing fastckpt files, in the background by default.

    Takes ``ModelCheckpoint``'s arguments (``dirpath``, ``filename``, ``monitor``, ``mode``,
    ``save_top_k``, ``save_last``, ``every_n_train_steps``, ``every_n_epochs``,
    ``save_weights_only``...) with its semantics. At setup it makes the Trainer save and
    load through :class:`AsyncFastCkptIO` (or :class:`FastCkptIO` with
    ``asynchronous=False``), so ``trainer.fit(ckpt_path=...)`` reads the files back, and
    other ``ModelCheckpoint`` callbacks of the same Trainer write fastckpt files too. If the
    Trainer already has a fastckpt plugin, that one is used; another custom plugin is an
    error. Files keep Lightning's ``.ckpt`` suffix so ``ckpt_path="last"`` works.

    With ``manager=`` (a :class:`fastckpt.CheckpointManager`), the checkpoints are the
    manager's steps instead of files in ``dirpath``: each save becomes
    ``manager.save(global_step, checkpoint, metrics)`` (the scalar metrics logged so far, so
    ``CheckpointManager(best=(monitor, mode, k))`` keeps the best steps), the manager's
    retention replaces ``save_top_k``/``save_last`` and its fast tier and drain apply;
    ``trainer.fit(model, ckpt_path="last")`` resumes from ``manager.restore()``, the newest
    step that loads verified in either tier. The triggers (``every_n_train_steps``,
    ``every_n_epochs``, ``train_time_interval``, ``monitor``) keep their meaning; ``dirpath``,
    ``filename``, ``save_top_k``, ``save_last`` and ``enable_version_counter`` do not apply and
    are refused. The manager is the caller's (fit waits for its saves and drains at the end but
    does not close it); one process saves (rank 0 of a single-file strategy).

    Args:
        asynchronous: block the training loop only for the snapshot of the tensors.
        allow_pickle: as :class:`FastCkptIO`.
        manager: a checkpoint manager to save into and resume from (any object with
            ``save(step, state, metrics)``, ``restore(**load_options)``, ``latest()``,
            ``wait()`` and a ``root`` directory, as :class:`fastckpt.CheckpointManager`).
        args, kwargs: ``ModelCheckpoint``'s.

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import FastCkptCheckpoint
        >>> trainer = pl.Trainer(
        ...     callbacks=[FastCkptCheckpoint(dirpath="/tmp/fastckpt-ckpts", every_n_train_steps=500)],
        ...     logger=False, enable_progress_bar=False)

        On a manager, resuming from its newest good step:

        >>> import tempfile, fastckpt
        >>> manager = fastckpt.CheckpointManager(tempfile.mkdtemp(), keep_last=2)
        >>> callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=100)
        >>> trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False)
        >>> # trainer.fit(model, ckpt_path="last")  # the newest step, or a fresh start
        >>> manager.close()
    """

    def __init__(
        self,
        *args: Any,
        asynchronous: bool = True,
        allow_pickle: bool = False,
        manager: Any = None,
        **kwargs: Any,
    ) -> None:
        if manager is not None:
            _check_manager_arguments(manager, args, kwargs)
        super().__init__(*args, **kwargs)
        self.asynchronous = asynchronous
        self.allow_pickle = allow_pickle
        #: A manager's factory, called in setup() on the rank that saves (see the recipe).
        self._factory = None if manager is None or _is_manager(manager) else manager
        self.manager = None if self._factory is not None else manager
        self._made_here = False  # the manager came from the factory: closed at teardown
        self._step_metrics: dict[int, dict[str, float]] = {}  # the steps saved, their metrics
        self._last_requested = False  # ckpt_path="last" was resolved to the manager
        #: The Trainer's own CheckpointIO that setup() replaced, and the plugin put in its place.
        self._replaced: tuple[Any, FastCkptIO] | None = None

    @property
    def _on_manager(self) -> bool:
        return self.manager is not None or self._factory is not None

    @property
    def best_model_path(self) -> str:
        """As ``ModelCheckpoint``'s; on a manager, ``<dirpath>#step=N`` for its best step by
        its ``best=`` metric, or ``<dirpath>#best`` while that is not known on this rank:
        ``trainer.test(ckpt_path="best")`` loads it from the manager either way, or says
        what is missing."""
        if not getattr(self, "_on_manager", False):
            return self._best_model_path
        stand_in = os.fspath(self.dirpath or "")
        step = best_step(self.manager, self._step_metrics)
        return f"{stand_in}{_STEP_MARK}{step}" if step is not None else stand_in + _BEST_MARK

    @best_model_path.setter
    def best_model_path(self, value: str) -> None:
        self._best_model_path = value

    def _generate_state_key(self, **kwargs: Any) -> str:
        # ModelCheckpoint's key, so a run started with ModelCheckpoint resumes here (best,
        # top-k and last files) and the other way round.
        return f"{ModelCheckpoint.__qualname__}{kwargs!r}"

    @property
    def _legacy_state_key(self) -> Any:
        # Lightning looks a callback's state up under this key when ``state_key`` finds none:
        # files of earlier fastckpt versions keep it under this class's own name.
        return type(self).__qualname__ + self.state_key[len(ModelCheckpoint.__qualname__) :]

    def file_exists(self, filepath: Any, trainer: pl.Trainer) -> bool:
        """Whether ``filepath`` is taken: on disk, or the name of a save still in flight.

        ``ModelCheckpoint`` picks a new name (``-v1``, ``-v2``...) only for a name taken; a
        background save has not renamed its file into place yet, and would otherwise be
        overwritten by the next checkpoint given the same name.
        """
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncFastCkptIO) and io.in_flight(filepath):
            # Only the rank that saves knows; the reduction is the one every rank makes.
            return trainer.strategy.reduce_boolean_decision(True, all=False)
        return super().file_exists(filepath, trainer)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._on_manager:
            self._setup_on_manager(trainer)
            if self._last_requested and trainer.world_size > 1:
                self._start_fresh_unless_a_step(trainer)
            return
        super().setup(trainer, pl_module, stage)
        current = trainer.strategy.checkpoint_io
        if isinstance(current, FastCkptIO):
            return
        if type(current) is not TorchCheckpointIO:
            raise ValueError(
                f"FastCkptCheckpoint saves through the Trainer's CheckpointIO, which is "
                f"{type(current).__name__} here; remove that plugin, or pass FastCkptIO() / "
                "AsyncFastCkptIO() in Trainer(plugins=...) and use ModelCheckpoint"
            )
        make: Callable[..., FastCkptIO] = AsyncFastCkptIO if self.asynchronous else FastCkptIO
        installed = make(allow_pickle=self.allow_pickle)
        self._replaced = (current, installed)
        trainer.strategy.checkpoint_io = installed

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Saves again, now, a checkpoint of this step whose lazy save was not committed
        (:class:`AsyncFastCkptIO` with ``lazy=True`` and a module that changed its
        parameters outside the optimizer step): the run's last checkpoint is never lost."""
        super().on_train_end(trainer, pl_module)
        io = trainer.strategy.checkpoint_io
        again: list[str] = []
        if isinstance(io, AsyncFastCkptIO):
            io.settle()
            again = [path for path, step in io.dropped.items() if step == trainer.global_step]
        # Only the rank that saves knows; every rank takes part in a save.
        for path in trainer.strategy.broadcast(again, src=0):
            trainer.save_checkpoint(path, self.save_weights_only)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Closes the manager this callback made (its saves and drains are done: the
        Trainer's CheckpointIO waited for them); a later run makes another."""
        super().teardown(trainer, pl_module, stage)
        self._hand_back_in_a_spawned_worker(trainer)
        if self._made_here and self.manager is not None:
            manager, self.manager, self._made_here = self.manager, None, False
            manager.close()

    def _hand_back_in_a_spawned_worker(self, trainer: pl.Trainer) -> None:
        """Under a strategy that starts its processes itself (``ddp_spawn``, ``ddp_fork``,
        ``ddp_notebook``), puts the Trainer's own CheckpointIO back in the worker once its
        saves are done (the strategy's teardown waited for them).

        The main process never ran ``setup()``, so its Trainer still has Lightning's plugin,
        and it reads the weights the worker saves after ``fit`` with that plugin; the worker's
        Trainer ends with the run. Any other Trainer keeps the plugin (a
        ``trainer.save_checkpoint`` after ``fit`` still writes a fastckpt file)."""
        launcher = getattr(trainer.strategy, "launcher", None)
        if self._replaced is None or not hasattr(launcher, "_collect_rank_zero_results"):
            return
        original, installed = self._replaced
        self._replaced = None
        if trainer.strategy.checkpoint_io is installed:
            trainer.strategy.checkpoint_io = original

    # -- on a checkpoint manager -------------------------------------------------------------
    def _setup_on_manager(self, trainer: pl.Trainer) -> None:
        current = trainer.strategy.checkpoint_io
        if not isinstance(current, (FastCkptIO, _ManagerCheckpointIO)) and (
            type(current) is not TorchCheckpointIO
        ):
            raise ValueError(
                f"FastCkptCheckpoint(manager=...) saves through the Trainer's CheckpointIO, "
                f"which is {type(current).__name__} here; remove that plugin"
            )
        if trainer.world_size > 1 and self._factory is None:
            raise ValueError(
                f"FastCkptCheckpoint got a CheckpointManager already made, under a strategy of "
                f"{trainer.world_size} processes: each process runs the script again and makes "
                "its own manager of the same root before the process group exists, which fails "
                f"(another CheckpointManager manages ...). Pass a factory instead: {DDP_RECIPE}"
            )
        self._make_manager(trainer)
        self.dirpath = self._stand_in(trainer)
        self._fs = url_to_fs(self.dirpath)[0]
        if (
            not isinstance(current, _ManagerCheckpointIO)
            or current.manager is not self.manager
            or current.resume_path != self.dirpath
        ):
            trainer.strategy.checkpoint_io = _ManagerCheckpointIO(
                self.manager,
                self.dirpath,
                allow_pickle=self.allow_pickle,
                asynchronous=self.asynchronous,
                strategy=trainer.strategy,
                best=self._resolve_best,
            )

    def _make_manager(self, trainer: pl.Trainer) -> None:
        """Calls the factory on the rank that saves (rank 0), once: with
        ``distributed=False`` where it takes it, since that rank alone saves whole
        checkpoints (the state of a single-file strategy is the same on every rank)."""
        if self.manager is not None or self._factory is None or trainer.global_rank != 0:
            return
        try:
            inspect.signature(self._factory).bind_partial(distributed=False)
            options = {"distributed": False}
        except (TypeError, ValueError):
            options = {}
        manager = self._factory(**options)
        if not _is_manager(manager):
            raise TypeError(
                f"the manager factory of FastCkptCheckpoint made a {type(manager).__name__}, "
                "not a checkpoint manager (fastckpt.CheckpointManager)"
            )
        self.manager, self._made_here = manager, True

    def _stand_in(self, trainer: pl.Trainer) -> str:
        # A factory's manager exists on one rank only: every rank stands in the same way.
        return _resume_path(self.manager if self._factory is None else None, trainer)

    def _resolve_best(self) -> int:
        """The manager's best step among those this callback saved, for ``ckpt_path="best"``
        (on the rank that saves); a ValueError that says what is missing otherwise."""
        best = best_metric(self.manager)
        if best is None:
            raise ValueError(
                'ckpt_path="best" needs the manager to keep a best metric: make it with '
                "CheckpointManager(root, best=(monitor, 'min' or 'max', count)), or pass "
                'ckpt_path="last"'
            )
        step = best_step(self.manager, self._step_metrics)
        if step is None:
            raise ValueError(
                f'ckpt_path="best": no step this callback saved logged {best[0]!r}, the '
                "manager's best= metric"
            )
        return step

    def _start_fresh_unless_a_step(self, trainer: pl.Trainer) -> None:
        """``ckpt_path="last"`` under several processes resolved, before their process group
        existed, to the manager's stand-in. Now the ranks agree whether the manager has a
        step; if it has none, this run starts fresh as Lightning's own ``"last"`` does
        (with its warning) instead of loading."""
        self._last_requested = False
        has_step = self.manager is not None and self.manager.latest() is not None
        if trainer.strategy.broadcast(has_step, src=0):
            return
        connector = trainer._checkpoint_connector
        original, stand_in = connector.resume_start, self.dirpath

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            del connector.resume_start  # once: the class's own method again
            if checkpoint_path is not None and os.fspath(checkpoint_path) == stand_in:
                rank_zero_warn(
                    'ckpt_path="last" is set, but there is no last checkpoint available. No '
                    "checkpoint will be loaded."
                )
                checkpoint_path = None
            original(checkpoint_path, weights_only=weights_only)

        connector.resume_start = resume_start  # type: ignore[method-assign]

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """With a manager, what ``ckpt_path="last"`` resolves to: the manager itself (its
        CheckpointIO restores the newest good step), once it has a step. Under several
        processes this runs before their process group exists: the stand-in is returned,
        and setup() decides once the ranks can agree."""
        if not self._on_manager:
            return super()._find_last_checkpoints(trainer)
        self._last_requested = True
        if trainer.world_size > 1:
            return {self._stand_in(trainer)}
        self._make_manager(trainer)
        assert self.manager is not None  # made just now
        if self.manager.latest() is None:
            return set()
        # Resolved before setup() runs: the Trainer's CheckpointIO is set here too.
        self._setup_on_manager(trainer)
        return {os.fspath(self.dirpath)} if self.dirpath is not None else set()

    def _save_topk_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        if not self._on_manager:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
            return
        # Every trigger saves a step: which steps stay is the manager's retention.
        where = os.fspath(self.dirpath) if self.dirpath else self._stand_in(trainer)
        self._save_checkpoint(trainer, where)

    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        if not self._on_manager:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        # On a manager, the newest step is the last checkpoint.

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if not self._on_manager:
            super()._save_checkpoint(trainer, filepath)
            return
        metrics = _scalar_metrics(self._monitor_candidates(trainer))
        self._step_metrics[trainer.global_step] = metrics
        trainer.save_checkpoint(
            filepath,
            self.save_weights_only,
            storage_options={_MANAGER_STEP: trainer.global_step, _MANAGER_METRICS: metrics},
        )
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(weakref.proxy(self))


def _callback_signature() -> inspect.Signature:
    """``ModelCheckpoint.__init__``'s parameters, then fastckpt's own (keyword-only): what
    ``inspect.signature`` and LightningCLI report for :class:`FastCkptCheckpoint`."""
    base = inspect.signature(ModelCheckpoint.__init__)
    own = [
        inspect.Parameter(
            "asynchronous", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool
        ),
        inspect.Parameter(
            "allow_pickle", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool
        ),
        inspect.Parameter("manager", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any),
    ]
    kept = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return base.replace(parameters=[*kept, *own])


FastCkptCheckpoint.__init__.__signature__ = _callback_signature()  # type: ignore[attr-defined]
