"""Saving what ``fastckpt tune`` found, per file system, where :mod:`fastckpt.config` reads it.

The file and its format belong to :mod:`fastckpt.config` (:func:`~fastckpt.config.save_tuned`,
:func:`~fastckpt.config.save_tuned_gds`, :func:`~fastckpt.config.tuned_config_path`); this
module decides what of a tuning run goes in: the winning configuration, the conditions it
was measured under and how much of the sweep was measured (:class:`Coverage`, kept inside
the entry's ``measured`` object, which config's readers pass over), once per file system.

A run that measured less than the entry already saved for a file system (a ``--budget``
that ended the sweep early, a smaller ``--io_size``) does not replace it unless asked to
(``replace``): the saved entry is the default of every later save and load there.
:func:`forget` removes entries (``fastckpt tune --reset``).

Example:
    >>> import tempfile
    >>> from fastckpt.cli.tune.sweep import Result
    >>> winner = Result({"queue_depth": 8, "engine": "threads"}, read=[2.0], write=[1.0])
    >>> outcomes = save_winner(winner, [tempfile.gettempdir()], Coverage(4, 4, 1 << 20),
    ...                        loops=1, gpu=False, cache_dropped=False, read=True, write=True)
    >>> import fastckpt.config as config
    >>> outcome, = outcomes
    >>> outcome.saved, config.load_tuned()[outcome.key]["measured"]["read_gbps"]
    (True, 2.0)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastckpt.bench.units import format_bytes
from fastckpt.cli.tune.sweep import Result

__all__ = ["Coverage", "Outcome", "forget", "save_gds_winner", "save_winner"]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """How much a tuning run measured: configurations measured of those in its sweep, and
    the bytes each moved per directory and run.

    Example:
        >>> Coverage(2, 108, 1 << 20).describe()
        '2 of 108 configurations measured, 1.00 MiB each'
        >>> Coverage(2, 108, 1 << 20) < Coverage(4, 4, 1 << 20)
        True
    """

    configurations: int
    total: int
    io_size: int

    @property
    def complete(self) -> bool:
        return self.configurations >= self.total

    def __lt__(self, other: Coverage) -> bool:
        # More configurations measured first, then more bytes per configuration.
        return (self.configurations, self.io_size) < (other.configurations, other.io_size)

    def describe(self) -> str:
        return (
            f"{self.configurations} of {self.total} configurations measured, "
            f"{format_bytes(self.io_size)} each"
        )

    def fields(self) -> dict[str, int]:
        """The keys recorded in the entry's ``measured`` object."""
        return {
            "configurations_measured": self.configurations,
            "configurations_total": self.total,
            "io_size": self.io_size,
        }

    @classmethod
    def of(cls, measured: Mapping[str, Any]) -> Coverage | None:
        """What an entry's ``measured`` object says was measured; None when it does not say
        (entries written before the counts were recorded)."""
        try:
            return cls(
                int(measured["configurations_measured"]),
                int(measured["configurations_total"]),
                int(measured["io_size"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one file system's entry: ``saved``, or kept because it measured more
    (``previous`` and ``previous_time`` describe the entry that was there)."""

    key: str
    path: Path
    saved: bool
    existed: bool
    previous: Coverage | None
    previous_time: str


def _figures(winner: Result, read: bool, write: bool) -> dict[str, float]:
    figures = {}
    if read:
        figures["read_gbps"] = round(winner.read_gbps, 3)
    if write:
        figures["write_gbps"] = round(winner.write_gbps, 3)
    return figures


def _keeps(old: Mapping[str, Any] | None, new: Coverage) -> bool:
    """Whether an existing ``measured`` object outranks ``new``. One that does not say how
    much it measured gives way only to a complete sweep."""
    if old is None:
        return False
    previous = Coverage.of(old)
    if previous is None:
        return not new.complete
    return new < previous


def _save_each(
    dirs: Sequence[str],
    part: str,
    coverage: Coverage,
    replace: bool,
    write: Any,
) -> list[Outcome]:
    from fastckpt.config import filesystem_key, load_tuned, tuned_config_path

    outcomes: list[Outcome] = []
    for key in dict.fromkeys(map(filesystem_key, dirs)):
        entry = load_tuned().get(key)
        old = entry.get(part) if entry is not None else None
        old = old if isinstance(old, dict) and old else None
        time = str((old or {}).get("time") or (entry or {}).get("time", ""))
        keep = not replace and _keeps(old, coverage)
        path = tuned_config_path() if keep else write(key)
        previous = Coverage.of(old) if old is not None else None
        outcomes.append(Outcome(key, Path(path), not keep, old is not None, previous, time))
    return outcomes


def save_winner(
    winner: Result,
    dirs: Sequence[str],
    coverage: Coverage,
    *,
    loops: int,
    gpu: bool,
    cache_dropped: bool,
    read: bool,
    write: bool,
    replace: bool = False,
) -> list[Outcome]:
    """Records ``winner``'s configuration for the file system of each of ``dirs``, with what
    it measured, how, and how much of the sweep (``coverage``). An entry that measured more
    is kept unless ``replace``. Returns one :class:`Outcome` per file system."""
    from fastckpt.config import save_tuned

    measured: dict[str, Any] = {
        "loops": loops,
        "gpu": bool(gpu),
        "dirs": list(dirs),
        "cold_reads": "drop_caches" if cache_dropped else "fadvise",
        **coverage.fields(),
        **_figures(winner, read, write),
    }
    return _save_each(
        dirs, "measured", coverage, replace, lambda key: save_tuned(key, winner.config, measured)
    )


def save_gds_winner(
    winner: Result,
    dirs: Sequence[str],
    coverage: Coverage,
    *,
    read: bool,
    write: bool,
    replace: bool = False,
) -> list[Outcome]:
    """Records GDS's figures per file system: loads to CUDA use GDS there when it read faster
    than the staging pipeline measured by ``fastckpt tune --gpu`` (gds_handle's own settings
    are arguments, so no configuration is saved). Figures that measured more are kept unless
    ``replace``. Returns one :class:`Outcome` per file system."""
    from fastckpt.config import save_tuned_gds

    measured: dict[str, Any] = {
        "intra_op_parallelism": winner.config.get("intra_op_parallelism"),
        **coverage.fields(),
        **_figures(winner, read, write),
    }
    return _save_each(dirs, "gds", coverage, replace, lambda key: save_tuned_gds(key, measured))


def forget(keys: Iterable[str]) -> tuple[Path, list[str]]:
    """Removes the tuned entries of file systems ``keys`` (their GDS figures too); returns the
    file and the keys that were there. Later saves and loads there use the built-in defaults.

    The file is read and written whole, keeping whatever else it holds, and replaced
    atomically.

    Example:
        >>> import tempfile
        >>> from fastckpt.cli.tune.sweep import Result
        >>> d = tempfile.gettempdir()
        >>> (outcome,) = save_winner(Result({"queue_depth": 8}, write=[1.0]), [d],
        ...     Coverage(1, 1, 4096), loops=1, gpu=False, cache_dropped=False, read=False,
        ...     write=True)
        >>> forget([outcome.key])[1] == [outcome.key], forget([outcome.key])[1]
        (True, [])
    """
    from fastckpt.config import tuned_config_path
    from fastckpt.io.commit import write_atomically

    path = tuned_config_path()
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return path, []
    entries = document.get("filesystems") if isinstance(document, dict) else None
    if not isinstance(entries, dict):
        return path, []
    removed = [key for key in dict.fromkeys(keys) if entries.pop(key, None) is not None]
    if removed:
        write_atomically(path, json.dumps(document, indent=2).encode("utf-8"))
    return path, removed
