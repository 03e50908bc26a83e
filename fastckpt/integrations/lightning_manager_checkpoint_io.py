"""The ``CheckpointIO`` of :class:`FastCkptCheckpoint` on a checkpoint manager: saves
become the manager's steps, and ``ckpt_path="last"``/``"best"`` load its steps."""

from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Any, Callable

import torch

from fastckpt.errors import HeaderError
from fastckpt.integrations.lightning_checkpoint_io import (
    _calling_trainer,
    _check_storage_options,
    _flatten,
    _load,
    _outside_a_run,
)
from fastckpt.integrations.lightning_framework import (
    CheckpointIO,
    pl,
)
from fastckpt.storage.locations import is_url

#: Keys of the ``storage_options`` by which :class:`FastCkptCheckpoint` hands a save's step
#: and metrics to :class:`_ManagerCheckpointIO` through ``Trainer.save_checkpoint``.
_MANAGER_STEP, _MANAGER_METRICS = "fastckpt.manager.step", "fastckpt.manager.metrics"
#: ModelCheckpoint arguments that name files, which a manager's steps replace.
_FILE_ARGUMENTS = ("dirpath", "filename", "save_top_k", "save_last", "enable_version_counter")


def _is_manager(manager: Any) -> bool:
    return getattr(manager, "root", None) is not None and all(
        callable(getattr(manager, name, None)) for name in _MANAGER_METHODS
    )


#: What :class:`FastCkptCheckpoint` calls on a manager.
_MANAGER_METHODS = ("save", "restore", "latest", "wait")


def _check_manager_arguments(manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """TypeError for ``manager`` neither a manager nor a factory of one; ValueError for the
    ``ModelCheckpoint`` arguments that a manager's retention replaces."""
    if not _is_manager(manager) and not callable(manager):
        missing = [n for n in _MANAGER_METHODS if not callable(getattr(manager, n, None))]
        raise TypeError(
            f"manager must be a checkpoint manager (fastckpt.CheckpointManager) or a callable "
            f"that makes one, got {type(manager).__name__} (no {', '.join(missing) or 'root'})"
        )
    given = [name for name in _FILE_ARGUMENTS if name in kwargs] + (["dirpath"] if args else [])
    if given:
        raise ValueError(
            f"FastCkptCheckpoint(manager=...) keeps the manager's steps, so {', '.join(given)} "
            "do not apply: set the retention on the manager (CheckpointManager(root, "
            "keep_last=..., keep_every=..., best=(monitor, mode, save_top_k)))"
        )


#: The recipe for a manager under a multi-process strategy, quoted by the errors.
DDP_RECIPE = (
    "FastCkptCheckpoint(manager=functools.partial(fastckpt.CheckpointManager, root, "
    "keep_last=..., best=...)): the callback then makes the manager in setup(), once the "
    "process group exists, on the rank that saves"
)


def _resume_path(manager: Any, trainer: pl.Trainer) -> str:
    """The local directory that stands for ``manager`` as Lightning's ``"last"`` checkpoint:
    its first local tier, else the Trainer's ``default_root_dir`` (Lightning checks that a
    candidate exists and reads its time, through a file system without the manager's
    storage options). A manager not made yet (or made on another rank) is the latter."""
    tiers = [] if manager is None else [getattr(manager, "fast", None), manager.root]
    local = [os.fspath(t) for t in tiers if t is not None and not is_url(os.fspath(t))]
    if local:
        return local[0]
    directory = os.path.abspath(os.fspath(trainer.default_root_dir))
    os.makedirs(directory, exist_ok=True)
    return directory


#: What follows the stand-in directory in a path that names one step (``best_model_path``),
#: or the best step, resolved by the rank that saves when it loads.
_STEP_MARK, _BEST_MARK = "#step=", "#best"


def _scalar_metrics(candidates: dict[str, Any]) -> dict[str, float]:
    """The logged metrics a step's marker records: every one-element number."""
    metrics = {}
    for name, value in candidates.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            metrics[name] = float(value.detach().cpu().item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[name] = float(value)
    return metrics


def best_metric(manager: Any) -> tuple[str, str, int] | None:
    """The ``best=(metric, mode, count)`` a manager keeps, or None."""
    best = getattr(getattr(manager, "retention", None), "best", None)
    return tuple(best) if best is not None else None


def best_step(manager: Any, metrics_by_step: dict[int, dict[str, float]]) -> int | None:
    """The step with the best value of the manager's ``best`` metric among
    ``metrics_by_step`` (NaN never best; the newest of equal ones), or None."""
    best = best_metric(manager)
    if best is None:
        return None
    metric, mode, _ = best
    scored = [
        (value, step)
        for step, metrics in metrics_by_step.items()
        if isinstance(value := metrics.get(metric), float) and not math.isnan(value)
    ]
    if not scored:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(scored, key=lambda vs: (sign * vs[0], -vs[1]))[1]


class _ManagerCheckpointIO(CheckpointIO):
    """The Trainer's ``CheckpointIO`` while a :class:`FastCkptCheckpoint` saves on a manager:
    saves become the manager's steps, and ``stand_in`` (what ``ckpt_path="last"`` resolves
    to), ``stand_in#step=N`` and ``stand_in#best`` load its newest good step, step N and the
    best step. ``manager`` is None on the ranks that do not save: there the rank that saves
    restores and ``strategy`` broadcasts what it loaded (or its error), so every rank loads
    the same step or raises. Any other path loads as :class:`FastCkptIO` loads it."""

    def __init__(
        self,
        manager: Any,
        stand_in: str,
        *,
        allow_pickle: bool,
        asynchronous: bool,
        strategy: Any = None,
        best: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self.manager = manager
        self.resume_path = stand_in
        self.allow_pickle = allow_pickle
        self.asynchronous = asynchronous
        self.strategy = strategy
        self._best = best
        self.left_out: set[str] = set()
        self._saves: list[concurrent.futures.Future[Any]] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Saves ``checkpoint`` as the manager's step ``global_step`` (other
        ``storage_options`` are not used: the manager has its own)."""
        options = dict(storage_options or {})
        step = options.pop(_MANAGER_STEP, checkpoint.get("global_step"))
        metrics = options.pop(_MANAGER_METRICS, None)
        _check_storage_options(options or None, type(self))
        if not isinstance(step, int):
            raise ValueError(f"a checkpoint saved on a manager needs its global_step, got {step!r}")
        if self.manager is None:
            raise RuntimeError(
                f"step {step}: this rank has no checkpoint manager (the rank that saves, rank 0, "
                "makes it)"
            )
        self._raise_failures()
        flat = _flatten(checkpoint, os.fspath(path), self.allow_pickle, self.left_out)
        future = self.manager.save(step, flat, metrics=metrics)
        self._saves.append(future)
        if not self.asynchronous or _outside_a_run(_calling_trainer()):
            future.result()
        self._raise_failures()

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The manager's step that ``path`` names (``"last"``: the newest good one), else the
        file at ``path``."""
        text = os.fspath(path)
        which = self._step_named(text)
        if which is None:
            return _load(text, map_location, weights_only)
        outcome: tuple[str, Any] | None = None
        if self.manager is not None:
            try:
                outcome = ("ok", self._restore(which, text, map_location, weights_only))
            except Exception as exc:  # every rank raises it, none goes on alone
                outcome = ("error", exc)
        if self.strategy is not None:
            outcome = self.strategy.broadcast(outcome, src=0)
        if outcome is None:
            raise RuntimeError(f"{text}: no rank restored the manager's step")
        kind, value = outcome
        if kind == "error":
            raise value
        return value

    def _step_named(self, path: str) -> int | str | None:
        """``"latest"``, ``"best"``, a step number, or None: not the manager's."""
        if path == self.resume_path:
            return "latest"
        # (a best_model_path read before setup() has no directory in front of its mark)
        base, _, mark = path.rpartition("#")
        if base not in (self.resume_path, ""):
            return None
        if "#" + mark == _BEST_MARK:
            return "best"
        if ("#" + mark).startswith(_STEP_MARK) and mark[len(_STEP_MARK) - 1 :].isdigit():
            return int(mark[len(_STEP_MARK) - 1 :])
        return None

    def _restore(
        self, which: int | str, path: str, map_location: Any, weights_only: bool | None
    ) -> dict[str, Any]:
        self._raise_failures()
        if which == "best":
            if self._best is None:
                raise ValueError(f"{path}: no best step is known here")
            which = self._best()
        step, checkpoint = self.manager.restore(
            None if which == "latest" else which,
            map_location=map_location,
            weights_only=weights_only is not False,
        )
        if not isinstance(checkpoint, dict):
            raise HeaderError(
                f"step {step} of {path} is not a Lightning checkpoint: it holds a "
                f"{type(checkpoint).__name__}, not a dict"
            )
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Nothing: the manager's retention deletes steps."""

    def teardown(self) -> None:
        """Waits for the manager's saves and drains; raises the first error."""
        try:
            self._raise_failures(wait=True)
        finally:
            if self.manager is not None:
                self.manager.wait()

    def _raise_failures(self, wait: bool = False) -> None:
        done = [f for f in self._saves if wait or f.done()]
        self._saves = [f for f in self._saves if f not in done]
        for future in done:
            future.result()
