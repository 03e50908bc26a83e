"""Steps of a multi-rank run: the step directory holds a DCP checkpoint (fastckpt's DCP
storage: one fastckpt file per rank and ``.metadata``, see :mod:`fastckpt.integrations.dcp`)
instead of ``state.safetensors``, and the ranks follow what rank 0 decides.

:class:`Ranks` says where this process stands (rank, world size, whether collectives run)
and carries rank 0's decisions to the others (:meth:`Ranks.agree`); :func:`save_step` and
:func:`load_step` move a step's state through ``dcp.save`` / ``dcp.load``, which shard and
reshard it (a step saved by N ranks loads on M).

:class:`StepSaver` is the asynchronous form the manager uses: :meth:`StepSaver.capture`
takes this rank's state at the call (copied into the writer's staging pool, or lazily under
a fence), and :meth:`StepSaver.write` then saves it collectively on the checkpoint group
(:func:`fastckpt.distributed.collective_save.save_collectively`), from a background thread,
reusing the previous step's plans while the state's structure stays the same.

Example (one process: DCP's layout without a process group):
    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "step")
    >>> ranks = Ranks(True)
    >>> ranks.rank, ranks.world, ranks.group
    (0, 1, False)
    >>> save_step(path, {"w": torch.arange(4.0), "step": 3}, ranks, None)
    >>> sorted(os.listdir(path))[0]
    '.metadata'
    >>> load_step(path, None, ranks, None)
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
    >>> into = {"w": torch.zeros(4), "step": 0}
    >>> load_step(path, into, ranks, None)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Container, Mapping
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.stateful import Stateful

from fastckpt.distributed.collective_load import load_collectively
from fastckpt.distributed.collective_save import save_collectively
from fastckpt.distributed.collective_save import timings as plan_timings
from fastckpt.distributed.groups import checkpoint_group
from fastckpt.distributed.plan_cache import PlanCache, structure_hash
from fastckpt.distributed.replicated_items import AllBut, assign
from fastckpt.errors import FastCkptError

__all__ = ["DCP_LAYOUT", "Captured", "Ranks", "StepSaver", "load_step", "save_step"]

#: The ``layout`` a step's marker records when the step is a DCP checkpoint.
DCP_LAYOUT = "dcp"
T = TypeVar("T")


class Ranks:
    """This process's place in a run.

    Args:
        distributed: True: steps are DCP checkpoints (in a process group when one is
            initialized, else by this process alone); False: one ``state.safetensors`` per
            step; None: DCP checkpoints when a process group of more than one rank is
            initialized.
    """

    def __init__(self, distributed: bool | None):
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        self.sharded = bool(distributed) if distributed is not None else world > 1
        #: Whether the ranks meet in collectives (a process group runs and steps are sharded).
        self.group = self.sharded and initialized
        self.rank = dist.get_rank() if self.group else 0
        self.world = world if self.group else 1

    @property
    def coordinator(self) -> bool:
        """Whether this is rank 0: the one rank that locks, commits, retains and drains."""
        return self.rank == 0

    def barrier(self) -> None:
        """Waits for every rank (raises when one died)."""
        if self.group:
            torch.distributed.barrier(group=checkpoint_group())

    def agree(self, decide: Callable[[], T]) -> T:
        """Rank 0 runs ``decide``; every rank returns its result, or raises its error (other
        ranks a ``RuntimeError`` quoting it), so no rank goes on while another stopped."""
        if not self.group:
            return decide()
        outcome: list[Any] = [None]
        error: BaseException | None = None
        if self.coordinator:
            try:
                outcome[0] = ("ok", decide())
            except Exception as exc:
                error = exc
                outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
        # on the checkpoint group: bounded by FASTCKPT_GROUP_TIMEOUT, not the training group's
        torch.distributed.broadcast_object_list(outcome, src=0, group=checkpoint_group())
        if error is not None:
            raise error
        kind, value = outcome[0]
        if kind == "error":
            raise RuntimeError(f"rank 0 of the checkpoint manager failed: {value}")
        return value

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        if not self.group:
            return ok
        flag = torch.tensor([0 if ok else 1])
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MAX, group=checkpoint_group()
        )
        return int(flag.item()) == 0


@contextlib.contextmanager
def _one_process(ranks: Ranks) -> Any:
    """DCP warns whenever it runs without a process group, which is meant here."""
    with warnings.catch_warnings():
        if not ranks.group:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def save_step(
    path: str,
    state: Any,
    ranks: Ranks,
    storage_options: Mapping[str, Any] | None,
    **options: Any,
) -> None:
    """Saves this rank's share of ``state`` into the DCP checkpoint at ``path`` (every rank
    calls it); returns once every rank's file is durable and ``.metadata`` written.
    ``options`` go to :class:`~fastckpt.integrations.dcp.FastCkptWriter` (``checksum``,
    ``piece_size``, engine settings)."""
    import torch.distributed.checkpoint as dcp

    from fastckpt.integrations.dcp import FastCkptWriter

    writer = FastCkptWriter(path, storage_options=_options(storage_options), **options)
    try:
        with _one_process(ranks):
            dcp.save(state, storage_writer=writer, no_dist=not ranks.group)
    finally:
        writer.close()


def load_step(
    path: str,
    state: Any,
    ranks: Ranks,
    storage_options: Mapping[str, Any] | None,
    saver: StepSaver | None = None,
    **options: Any,
) -> Any:
    """The DCP checkpoint at ``path`` loaded into ``state`` (in place, resharded to its
    tensors: DTensors or plain ones) and returned; with ``state`` None (one process only)
    every value as full tensors. ``options`` go to
    :class:`~fastckpt.integrations.dcp.FastCkptReader` (which verifies every piece read).
    With ``saver`` the load runs on its checkpoint group and reuses the plan of its
    previous load while the structures stay the same
    (:func:`~fastckpt.distributed.collective_load.load_collectively`); no save of that
    saver may be running.

    Raises:
        FastCkptError: DCP's load failed on some rank (its failures quoted), or a subclass
            (``ChecksumError``, ``HeaderError``) for this rank's damaged file.
    """
    import torch.distributed.checkpoint as dcp

    from fastckpt.integrations.dcp import FastCkptReader, load_full

    if state is None:
        if ranks.group:
            raise ValueError(
                f"{path} was saved by several ranks: restoring it in a process group needs "
                "state=, the state dict to load into (DCP loads in place, resharded to it)"
            )
        return load_full(
            path,
            storage_options=_options(storage_options),
            allow_pickle=bool(options.get("allow_pickle", False)),
        )
    from torch.distributed.checkpoint.api import CheckpointException

    reader = FastCkptReader(path, storage_options=_options(storage_options), **options)
    if saver is not None:
        plain = _state_dicts_of(state)  # Stateful values as their state dicts, as DCP does
        saver.load_outcomes.append(
            load_collectively(plain, reader, saver.load_plans, group=saver.group)
        )
        if plain is not state:  # values loaded into the copy's top level go back
            for key, value in state.items():
                if isinstance(value, Stateful):
                    value.load_state_dict(plain[key])
                else:
                    state[key] = plain[key]
        return state
    try:
        with _one_process(ranks):
            dcp.load(state, storage_reader=reader, no_dist=not ranks.group)
    except CheckpointException as exc:  # a BaseException: restated so callers can catch it
        raise FastCkptError(f"{path}: loading the DCP checkpoint failed: {exc}") from exc
    return state


def _state_dicts_of(state: Any) -> Any:
    """``state`` with each top-level Stateful value (a module, an optimizer) replaced by its
    state dict, as ``dcp.save`` and ``dcp.load`` do."""
    if not isinstance(state, dict):
        return state
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


@dataclasses.dataclass
class Captured:
    """One rank's state as :meth:`StepSaver.capture` took it: the state dict DCP plans on
    (stand-ins over the staged copies, or over the live tensors of a lazy save) and the
    writer that holds the copies; ``items``: the write items copied when only some were
    (those of the plan the save expected to reuse, or all but the replicated items other
    ranks write), None when all were (or the stage is lazy: every item is read under the
    fence)."""

    staged: Any
    writer: Any
    lazy: bool
    items: Container[Any] | None = None


class StepSaver:
    """Saves a manager's steps across ranks: captured in the foreground, written in the
    background on the checkpoint group (see the module's description).

    One writer is kept while the writer options stay the same, so its staging pool (as
    large as this rank's state) is filled again at each step instead of allocated.

    Example (one process):
        >>> import os, tempfile, torch
        >>> saver = StepSaver(Ranks(True))
        >>> path = os.path.join(tempfile.mkdtemp(), "step")
        >>> state = {"w": torch.zeros(4), "step": 1}
        >>> captured = saver.capture(path, state, None, {})
        >>> state["w"] += 1  # after the capture: not saved
        >>> saver.write(captured)
        'planned'
        >>> load_step(path, None, Ranks(True), None)["w"].tolist()
        [0.0, 0.0, 0.0, 0.0]
        >>> saver.close()
    """

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        # made here, in the foreground, on every rank in the same order (a collective)
        self.group = checkpoint_group() if ranks.group else None
        self.plans = PlanCache()
        self.load_plans = PlanCache()
        #: How each load's plan came about: ``"planned"`` or ``"cached"``, in order.
        self.load_outcomes: list[str] = []
        #: How each save's plans came about: ``"planned"`` or ``"cached"``, in order.
        self.outcomes: list[str] = []
        #: Seconds each save spent agreeing and planning before it wrote, in order.
        self.plan_seconds: list[float] = []
        self._writer: Any = None
        self._writer_key: Any = None
        self._assigned: dict[int, Any] = {}  # id(state) -> its assignment, for one capture
        self._stagers: list[Any] = []

    def capture(
        self,
        path: str,
        state: Any,
        storage_options: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> Captured:
        """Takes this rank's ``state`` for a save into ``path``: with ``fence=`` (an optimizer
        or a list) lazily, as :class:`~fastckpt.integrations.dcp.FastCkptLazyStager` (with
        ``fence_bytes=``); else copied into the writer's staging pool. Other ``options`` go
        to :class:`~fastckpt.integrations.dcp.FastCkptWriter`."""
        from fastckpt.integrations.dcp import FastCkptLazyStager, FastCkptWriter

        assigned = self._assigned.pop(id(state), None)  # by replicas_digest(), if it ran
        self._assigned.clear()
        state = _state_dicts_of(state)
        options = dict(options)
        fence = options.pop("fence", None)
        fence_bytes = options.pop("fence_bytes", None)
        key = (repr(sorted(options.items())), repr(storage_options))
        if self._writer is None or self._writer_key != key:
            if self._writer is not None:
                self._writer.close()
            self._writer = FastCkptWriter(
                path, storage_options=_options(storage_options), **options
            )
            self._writer_key = key
        writer = self._writer
        writer.reset(path)
        self._close_stagers()  # the previous save is done: its stage was claimed or ended
        if fence is None:
            # a plan this save will reuse says which items are this rank's to write
            reused = self.plans.plan if self.plans.matches(structure_hash(state)) else None
            items: Container[Any] | None = None
            skip = None
            if reused is not None:
                items = frozenset(i.index for i in reused.items)
            elif self._own_replicas_only():
                replicas = assigned or assign(state, self.ranks.world)
                skip = replicas.others(self.ranks.rank)  # not copied: other ranks write them
                # values saved as bytes are captured all the same (the staged state holds
                # deep copies), so a rank may still write one when the owners do not hold
                items = AllBut(replicas.others_tensors(self.ranks.rank))
            with _one_process(self.ranks):
                staged = writer.stage(state, reuse=reused, skip=skip)
                return Captured(staged, writer, False, items)
        stager = FastCkptLazyStager(
            fence=fence, fence_bytes=fence_bytes, staging_bytes=options.get("staging_bytes")
        )
        self._stagers.append(stager)
        return Captured(stager.stage(state), writer, lazy=True)

    def replicas_digest(self, state: Any) -> int | None:
        """What this rank tells the others before a capture that would copy only its own
        replicated items (None when it copies them all): the digest of the items every rank
        must hold alike for the rule to hold. The ranks compare it in the save's foreground
        handshake and, where any differs, :meth:`replicas_differ` makes every rank copy
        them all, so no value is left uncopied on the first save of a structure."""
        self._assigned.clear()
        plain = _state_dicts_of(state)
        if not self._own_replicas_only() or self.plans.matches(structure_hash(plain)):
            return None
        replicas = assign(plain, self.ranks.world)
        self._assigned[id(state)] = replicas  # the caller's object: capture() gets it again
        return replicas.digest

    def replicas_differ(self) -> None:
        """The ranks' replicated items differ (:meth:`replicas_digest`): this capture, and
        the next ones until the ranks agree again, copy every replicated item."""
        self._assigned.clear()
        self.plans.replicas_differ = True

    def _own_replicas_only(self) -> bool:
        """Whether a capture without a plan to reuse copies, of the replicated items, only
        those this rank writes (:mod:`fastckpt.distributed.replicated_items`): with no
        plans cached (the first save of this saver, or the one after a failure), unless
        the ranks' replicated items differed at the last save. A rank whose structure
        changed since its cached plans copies them all: the other ranks may hold the old
        structure, whose replicated items are not this one's."""
        return self.ranks.world > 1 and self.plans.hash is None and not self.plans.replicas_differ

    def write(
        self,
        captured: Captured | BaseException,
        prepare: Callable[[], None] | None = None,
        commit: Callable[[], None] | None = None,
    ) -> str:
        """Saves what :meth:`capture` took, collectively on the checkpoint group (every rank
        calls it, from any one thread); ``prepare`` and ``commit`` run on rank 0 only, before
        the ranks agree and once every rank's file is durable and ``.metadata`` published.
        Returns ``"cached"`` when the previous step's plans were reused, else ``"planned"``.

        ``captured`` may be the error :meth:`capture` raised on this rank: the rank then
        takes part only to tell the others, and raises it."""
        if isinstance(captured, BaseException):
            outcome = save_collectively(None, None, self.plans, group=self.group, failed=captured)
        else:
            try:
                with _one_process(self.ranks):
                    outcome = save_collectively(
                        captured.staged,
                        captured.writer,
                        self.plans,
                        group=self.group,
                        prepare=prepare,
                        commit=commit,
                        captured=captured.items,
                    )
            finally:
                captured.staged = None  # a lazy stage ends once its stand-ins are gone
        self.outcomes.append(outcome)
        self.plan_seconds.append(plan_timings.get("plan", 0.0))
        return outcome

    def close(self) -> None:
        """Ends lazy stages no save claimed and frees the staging pool."""
        self._close_stagers()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _close_stagers(self) -> None:
        while self._stagers:
            self._stagers.pop().close()


def _options(storage_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if storage_options is None else dict(storage_options)
