"""Which steps a tier keeps.

:func:`kept_bases` and :func:`with_bases` add the steps that kept incremental steps need.

Example:
    >>> policy = Retention(keep_last=2, keep_every=100)
    >>> sorted(policy.kept([50, 100, 150, 200, 250, 300]))
    [100, 200, 250, 300]
    >>> best = Retention(keep_last=1, best=("loss", "min", 1))
    >>> sorted(best.kept([1, 2, 3], {1: {"loss": 0.5}, 2: {"loss": 0.2}, 3: {"loss": 0.9}}))
    [2, 3]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Retention", "kept_bases", "with_bases"]


@dataclasses.dataclass(frozen=True)
class Retention:
    """Keep the ``keep_last`` newest steps, every step divisible by ``keep_every``, and the
    ``best[2]`` steps with the lowest (``"min"``) or highest (``"max"``) metric ``best[0]``.
    The newest step is always kept."""

    keep_last: int | None = 3
    keep_every: int | None = None
    best: tuple[str, str, int] | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        if self.best is not None:
            metric, mode, count = self.best
            if mode not in ("min", "max") or not isinstance(count, int) or count < 1:
                raise ValueError(
                    f"best must be (metric, 'min' or 'max', a positive count), got {self.best!r}"
                )

    def kept(
        self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, float]] | None = None
    ) -> set[int]:
        """The steps of ``steps`` to keep."""
        ordered = sorted(steps)
        if not ordered:
            return set()
        keep = {ordered[-1]}
        if self.keep_last is None:
            keep.update(ordered)
        else:
            keep.update(ordered[-self.keep_last :])
        if self.keep_every:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        if self.best is not None:
            metric, mode, count = self.best
            scored = [s for s in ordered if metric in (metrics or {}).get(s, {})]
            scored.sort(key=lambda s: _rank((metrics or {})[s][metric], mode))
            keep.update(scored[:count])
        return keep


def _rank(value: Any, mode: str) -> tuple[int, float]:
    """A total order for best-k: the best first; NaN, and anything not a number, last.

    Example:
        >>> sorted([0.5, float("nan"), 0.3, 0.9], key=lambda v: _rank(v, "min"))[:2]
        [0.3, 0.5]
        >>> sorted([0.5, float("nan"), 0.9], key=lambda v: _rank(v, "max"))[0]
        0.9
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        return (1, 0.0)
    if math.isnan(number):
        return (1, 0.0)
    return (0, number if mode == "min" else -number)


def with_bases(kept: set[int], needs: Mapping[int, Sequence[int]]) -> dict[int, set[int]]:
    """The steps that ``kept`` steps need besides themselves (``needs``: step -> the steps
    its files refer to), each with the kept steps that need it, followed through bases'
    own needs; steps already in ``kept`` are not listed.

    Example:
        >>> with_bases({5, 6}, {6: [4], 5: [4], 4: [2]})
        {4: {5, 6}, 2: {4}}
    """
    added: dict[int, set[int]] = {}
    todo = sorted(kept, reverse=True)
    while todo:
        step = todo.pop()
        for base in needs.get(step, ()):
            if base in kept:
                continue
            if base not in added:
                todo.append(base)
            added.setdefault(base, set()).add(step)
    return added


def kept_bases(
    kept: set[int], committed: Sequence[int], depends_on: Callable[[int], Sequence[int]]
) -> dict[int, set[int]]:
    """:func:`with_bases` of ``kept``, asking ``depends_on(step)`` (an incremental step's
    marker's ``depends_on``) only for the committed steps kept or needed. Whoever deletes
    steps by a policy keeps these too.

    Example:
        >>> markers = {3: [1], 2: [1], 1: []}
        >>> kept = Retention(keep_last=1).kept([1, 2, 3])
        >>> kept | set(kept_bases(kept, [1, 2, 3], lambda step: markers[step]))
        {1, 3}
    """
    present = set(committed)
    needs: dict[int, list[int]] = {}
    todo = sorted(kept)
    while todo:
        step = todo.pop()
        if step in needs or step not in present:
            continue
        needs[step] = [int(s) for s in depends_on(step)]
        todo += needs[step]
    return with_bases(kept, needs)
