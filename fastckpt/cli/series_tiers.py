"""What the series commands (``ls``, ``clean``, ``prune``) read from a checkpoint series: the
copies of each step in each tier, committed or not, and the lock a manager holds on a tier.

A tier is a local directory or a URL (``s3://bucket/run``; credentials and endpoint from
``FASTCKPT_STORAGE_OPTIONS`` or the environment, as for every URL the command line takes).
It is read without a manager: ``fastckpt ls`` works beside a running training job. The
commands that delete (``clean``, ``prune``) take the tier's manager lock (or lease, at a URL)
first, so they never remove a save or a drain in progress.

Example:
    >>> import tempfile, os
    >>> from fastckpt.series import steps
    >>> tier = tier_location("ROOT", tempfile.mkdtemp())
    >>> os.makedirs(steps.step_dir(tier, 5))
    >>> [(c.step, c.committed) for c in tier_copies(tier, "root")]
    [(5, False)]

A marker is read as data that anyone may have written: one that cannot be read, is not JSON,
or holds fields of unexpected types (files as a list, a size that is not an integer, metrics
that are not numbers, nesting too deep to parse) makes its step a committed copy with a
``problem`` (one line naming the step, the tier and what is wrong), which every command
reports and none deletes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastckpt.cli._common import USAGE, CliError

if TYPE_CHECKING:
    from fastckpt.series.steps import Tier

__all__ = [
    "MarkerError",
    "Outside",
    "StepCopy",
    "held_replicas",
    "locked_tiers",
    "marker_fields",
    "set_aside_copies",
    "tier_copies",
    "tier_location",
]

#: Layouts a marker may name: one ``state.safetensors`` (``steps.FILE_LAYOUT``) or a DCP
#: checkpoint (``fastckpt.series.sharded.DCP_LAYOUT``, spelled here since that module
#: imports torch.distributed).
_LAYOUTS = ("file", "dcp")
#: Where a fast tier holds its peers' replicas (``fastckpt.series.replicas.REPLICA_DIR``,
#: spelled here since that module imports torch.distributed).
_REPLICA_DIR = ".replicas"
#: Sizes and step numbers above this are not ones a file system or a manager writes.
_LARGEST = 2**63 - 1


class MarkerError(ValueError):
    """A commit marker that cannot be used: unreadable, not JSON, or with fields of the
    wrong types; the message names the step, the tier and what is wrong.

    Example:
        >>> str(MarkerError(7, "root", "'files' is a list, not an object"))
        "step 7 in root: bad commit marker: 'files' is a list, not an object"
    """

    def __init__(self, step: int, tier: str, problem: str, *, gone: bool = False):
        super().__init__(f"step {step} in {tier}: bad commit marker: {problem}")
        self.step, self.tier, self.problem = step, tier, problem
        #: the marker is no longer there: the step was deleted after it was listed
        self.gone = gone


@dataclasses.dataclass
class StepCopy:
    """One step's directory in one tier: committed (its marker is there) or a partial save,
    drain or deletion; its size in bytes, its layout (``file``: one ``state.safetensors``;
    ``dcp``: a multi-rank DCP checkpoint) and the metrics its marker records."""

    step: int
    tier: str  # "fast" or "root"
    directory: str
    committed: bool
    size: int
    layout: str = "file"
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    time: str | None = None
    #: the steps an incremental step's files refer to (its marker's ``depends_on``)
    depends_on: list[int] = dataclasses.field(default_factory=list)
    #: why a committed copy's marker cannot be used (None when it can): see MarkerError
    problem: str | None = None

    @property
    def checkpoint(self) -> str:
        """What ``fastckpt verify`` checks: the state file, or the DCP step's directory."""
        from fastckpt.series.steps import FILE_LAYOUT, STATE_FILE, join

        return join(self.directory, STATE_FILE) if self.layout == FILE_LAYOUT else self.directory


def tier_location(option: str, path: str) -> Tier:
    """``path`` as a tier (a local directory made absolute, or a URL), or a usage error
    (status 2) naming ``option`` when a local directory does not exist.

    Example:
        >>> try:
        ...     tier_location("ROOT", "/no/such/run")
        ... except CliError as err:
        ...     print(err.status, err)
        2 ROOT /no/such/run: no such directory
    """
    from fastckpt.series.steps import Tier  # here: `fastckpt --help` loads no I/O engine

    tier = Tier(path)
    if not tier.is_url and not os.path.isdir(tier.location):
        what = "not a directory" if os.path.exists(tier.location) else "no such directory"
        raise CliError(f"{option} {path}: {what}", USAGE)
    return tier


def tier_copies(tier: Tier | str, name: str) -> list[StepCopy]:
    """Every step of ``tier`` with files (committed or not), ascending by step. A committed
    step whose marker cannot be used is listed with its ``problem`` set."""
    from fastckpt.series import steps as layout

    copies = []
    for step in layout.committed_steps(tier):
        try:
            fields = marker_fields(tier, step, name)
        except MarkerError as exc:
            if exc.gone:  # deleted since the listing (a manager's retention): no longer a step
                copies.append(_partial(tier, name, step))
            else:  # committed as far as a manager can tell: reported, never taken for partial
                copies.append(_partial(tier, name, step, committed=True, problem=str(exc)))
            continue
        copies.append(
            StepCopy(
                step=step,
                tier=name,
                directory=layout.step_dir(tier, step),
                committed=True,
                size=sum(fields["files"].values()),
                layout=fields["layout"],
                metrics=fields["metrics"],
                time=fields["time"],
                depends_on=fields["depends_on"],
            )
        )
    copies += [_partial(tier, name, step) for step in layout.uncommitted_steps(tier)]
    return sorted(copies, key=lambda c: c.step)


def marker_fields(tier: Tier | str, step: int, name: str = "root") -> dict[str, Any]:
    """The fields of ``step``'s marker the commands use, checked: ``files`` (name -> size),
    ``layout``, ``metrics`` (name -> float, NaN and infinities kept), ``time`` (str or None)
    and ``depends_on`` (steps). ``name`` names the tier in errors.

    Raises:
        MarkerError: the marker cannot be read or parsed, or a field has the wrong type.

    Example:
        >>> import tempfile, os, json
        >>> from fastckpt.series import steps
        >>> tier = tempfile.mkdtemp()
        >>> os.makedirs(steps.step_dir(tier, 2)); steps.commit(tier, 2, {"loss": 0.5})
        >>> marker_fields(tier, 2)["metrics"]
        {'loss': 0.5}
        >>> marker = os.path.join(steps.step_dir(tier, 2), steps.MARKER)
        >>> with open(marker, "w") as f:
        ...     json.dump({"step": 2, "files": ["state.safetensors"]}, f)
        >>> try:
        ...     marker_fields(tier, 2)
        ... except MarkerError as exc:
        ...     print(str(exc).replace(marker, "<marker>"))
        step 2 in root: bad commit marker: <marker>: its files are not a mapping of names to sizes
    """
    from fastckpt.series import steps as layout

    try:
        document = layout.marker_of(tier, step)
    except FileNotFoundError:
        raise MarkerError(step, name, "it is gone", gone=True) from None
    except OSError as exc:
        raise MarkerError(step, name, f"cannot read it: {exc.strerror or exc}") from None
    except RecursionError:  # json gives up on deep nesting this way, not with ValueError
        raise MarkerError(step, name, "nested too deeply to parse") from None
    except ValueError as exc:  # not JSON, not UTF-8, not an object, another step's marker
        raise MarkerError(step, name, _one_line(str(exc))) from None
    try:
        return {
            "files": _sizes(document.get("files")),
            "layout": _layout(document.get("layout")),
            "metrics": _metrics(document.get("metrics")),
            "time": _optional_text(document.get("time"), "time"),
            "depends_on": _steps(document.get("depends_on")),
        }
    except ValueError as exc:
        raise MarkerError(step, name, str(exc)) from None


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut at ``limit`` characters (a marker's content is not ours)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _kind(value: Any) -> str:
    """How a JSON value is named in messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sizes(value: Any) -> dict[str, int]:
    """A marker's ``files``: file name -> size in bytes (none: an empty step)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"'files' is {_kind(value)}, expected an object of file sizes")
    for file, size in value.items():
        if not _inside_step(file):
            shown = _one_line(repr(file), 100)
            raise ValueError(f"'files' names {shown}, which is not a file inside the step")
        if not _is_int(size) or not 0 <= size <= _LARGEST:
            shown = _one_line(repr(size), 40)
            raise ValueError(f"'files' gives {file[:100]!r} the size {shown}, not a byte count")
    return dict(value)


def _inside_step(name: str) -> bool:
    """Whether ``name`` is a relative path inside a step directory: no empty, ``.`` or
    ``..`` part, not absolute (a marker is no licence to name files elsewhere).

    Example:
        >>> _inside_step("state.safetensors"), _inside_step("../../etc/passwd"), _inside_step("/x")
        (True, False, False)
    """
    return not name.startswith("/") and all(part not in ("", ".", "..") for part in name.split("/"))


def _layout(value: Any) -> str:
    """A marker's ``layout`` (none: one state file)."""
    if value is None:
        return _LAYOUTS[0]
    if value not in _LAYOUTS:
        shown = _one_line(repr(value), 40)
        raise ValueError(f"'layout' is {shown}, expected one of {', '.join(_LAYOUTS)}")
    return str(value)


def _metrics(value: Any) -> dict[str, float]:
    """A marker's ``metrics``: name -> number, as floats (NaN and infinities kept)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"'metrics' is {_kind(value)}, expected an object of numbers")
    metrics = {}
    for metric, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"metric {metric[:100]!r} is {_kind(number)}, not a number")
        try:
            metrics[metric] = float(number)
        except OverflowError:  # an integer beyond any float
            raise ValueError(f"metric {metric[:100]!r} is too large for a float") from None
    return metrics


def _optional_text(value: Any, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{field!r} is {_kind(value)}, expected a string")


def _steps(value: Any) -> list[int]:
    """A marker's ``depends_on``: step numbers (none: a full step)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v <= _LARGEST for v in value):
        raise ValueError(f"'depends_on' is {_kind(value)}, expected a list of step numbers")
    return list(value)


@dataclasses.dataclass
class Outside:
    """A copy of a step that is not one of the series' steps, but that a person may want to
    see: set aside by a manager (``why``: ``unreadable``, ``damaged`` or ``abandoned``;
    ``step-<12 digits>.<why>-<time>`` beside the steps) or a replica a node holds for a
    peer (``why``: ``replica``, ``rank`` the peer; ``<fast>/.replicas``)."""

    step: int
    tier: str  # "fast" or "root"
    why: str
    directory: str
    rank: int | None = None

    def label(self) -> str:
        """How ``ls`` marks the copy.

        Example:
            >>> Outside(7, "fast", "replica", "/x", rank=3).label()
            'fast (replica of rank 3)'
        """
        if self.why == "replica":
            return f"{self.tier} (replica of rank {self.rank})"
        return f"{self.tier} (set aside: {self.why})"


def set_aside_copies(tier: Tier | str, name: str) -> list[Outside]:
    """The steps set aside in ``tier`` (no longer steps of the series; never deleted by a
    manager, so a person may look at them, move them back or remove them).

    Example:
        >>> import tempfile, os
        >>> from fastckpt.series import steps
        >>> tier = tempfile.mkdtemp()
        >>> os.makedirs(steps.step_dir(tier, 4) + ".unreadable-20260101T000000Z")
        >>> [(c.step, c.why) for c in set_aside_copies(tier, "root")]
        [(4, 'unreadable')]
    """
    from fastckpt.series import steps as layout

    return [Outside(step, name, why, where) for step, why, where in layout.set_aside_dirs(tier)]


def held_replicas(fast: Tier | str) -> list[Outside]:
    """The complete replicas a local fast tier holds for its peers (in ``.replicas``), read
    without opening the store (opening one removes receptions in progress: ``ls`` runs
    beside a training job); none for a tier at a URL.

    Example:
        >>> import tempfile
        >>> held_replicas(tempfile.mkdtemp())
        []
    """
    from fastckpt.series.steps import Tier as TierType

    tier = fast if isinstance(fast, TierType) else TierType(os.fspath(fast))
    directory = os.path.join(tier.location, _REPLICA_DIR)
    if tier.is_url or not os.path.isdir(directory) or os.path.islink(directory):
        return []
    from fastckpt.distributed.replica_store import ReplicaStore  # (torch: only when needed)

    store = ReplicaStore.__new__(ReplicaStore)  # read only: no __init__, which cleans up
    store.directory = directory
    try:
        held = store.held()
    except OSError:  # removed meanwhile (the node's manager closed and pruned it)
        return []
    return [
        Outside(step, "fast", "replica", store._dir(rank, step), rank=rank)
        for rank, steps in sorted(held.items())
        for step in steps
    ]


def _partial(
    tier: Tier | str, name: str, step: int, *, committed: bool = False, problem: str | None = None
) -> StepCopy:
    """A step copy known by its files on disk: a partial one, or (``committed``) one whose
    marker cannot be used."""
    from fastckpt.series import steps as layout

    try:
        size = sum(layout.step_files(tier, step).values())
    except OSError:  # removed meanwhile by its manager
        size = 0
    directory = layout.step_dir(tier, step)
    return StepCopy(step, name, directory, committed=committed, size=size, problem=problem)


@contextlib.contextmanager
def locked_tiers(*tiers: Tier) -> Iterator[None]:
    """Holds each tier's manager lock (a ``flock`` locally, the lease object at a URL) for the
    block: a running ``CheckpointManager`` makes this a failure (status 1) instead of a race
    with its saves and drains.

    Example:
        >>> import tempfile
        >>> with locked_tiers(tier_location("ROOT", tempfile.mkdtemp())):
        ...     pass
    """
    from fastckpt.series.lease import LocalLock, UrlLease

    held: list[Any] = []
    try:
        for tier in tiers:
            try:
                if tier.is_url:
                    held.append(UrlLease(tier.location, tier.storage_options))
                else:
                    held.append(LocalLock(tier.location))
            except RuntimeError as exc:
                raise CliError(str(exc)) from None
        yield
    finally:
        for lock in held:
            lock.release()
