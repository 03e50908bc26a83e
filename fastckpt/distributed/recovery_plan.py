"""Where each rank gets the step a restore agrees on: pure functions over what every rank
said it holds (its own steps, its fallback's, the replicas it keeps for others, each with
its content's identity and the run that made it).

Example (two ranks; rank 1 lost its step 5, and rank 0 holds its replica):
    >>> every = [
    ...     {"asked": None, "run": "a", "own": {5: "x"}, "fallback": {}, "held": {1: {5: ("y", "a")}}},
    ...     {"asked": None, "run": "a", "own": {}, "fallback": {}, "held": {}},
    ... ]
    >>> choose(every, None, set())
    (5, ['own', 'peer 0'], ['x', 'y'])
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_same_request", "choose", "identities", "unavailable_newer"]


def identities(steps: Iterable[int] | Mapping[int, str | None]) -> dict[int, str | None]:
    """Steps with their content's identity (None: not known)."""
    if isinstance(steps, Mapping):
        return {int(s): i for s, i in steps.items()}
    return dict.fromkeys((int(s) for s in steps), None)


def check_same_request(every: list[dict[str, Any]]) -> None:
    """Raises, on every rank at once, when the ranks asked ``restore()`` for different
    steps: each would restore its own, and the run would go on mixed."""
    asked = [e["asked"] for e in every]
    if len(set(asked)) > 1:
        named = ", ".join(f"rank {r}: step={a}" for r, a in enumerate(asked))
        raise ValueError(
            f"the ranks asked restore() for different steps ({named}): every rank must pass "
            "the same step= (or none)"
        )


def choose(
    every: list[dict[str, Any]], step: int | None, bad: set[tuple[int, str]]
) -> tuple[int | None, list[str], list[str | None]]:
    """The step to restore (``step``, or the newest every rank can get), each rank's source
    and the identity its copy must have; ``(None, [], [])`` when there is none."""
    for candidate in [step] if step is not None else sorted(_listed(every), reverse=True):
        found = _sources_of(every, candidate, bad)
        if found is not None:
            return candidate, found[0], found[1]
    return None, [], []


def _listed(every: list[dict[str, Any]]) -> set[int]:
    steps = {s for e in every for s in (*e["own"], *e["fallback"])}
    return steps | {s for e in every for held in e["held"].values() for s in held}


def unavailable_newer(
    every: list[dict[str, Any]], chosen: int, bad: set[tuple[int, str]]
) -> list[int]:
    return sorted(s for s in _listed(every) if s > chosen and _sources_of(every, s, bad) is None)


def _sources_of(
    every: list[dict[str, Any]], candidate: int, bad: set[tuple[int, str]]
) -> tuple[list[str], list[str | None]] | None:
    """Where each rank gets ``candidate`` (own tier, a peer's replica of the same content,
    the root), or None when some rank cannot get it."""
    plan: list[str] = []
    expected: list[str | None] = []
    load = collections.Counter[int]()
    for rank, info in enumerate(every):
        own, fallback = info["own"], info["fallback"]
        if candidate in own and (rank, "own") not in bad:
            plan.append("own")
            expected.append(own[candidate])
            continue
        known = candidate in own or candidate in fallback
        committed = own[candidate] if candidate in own else fallback.get(candidate)
        copies = {
            holder: held[rank][candidate]
            for holder, held in enumerate(e["held"] for e in every)
            if candidate in held.get(rank, {}) and (rank, f"peer {holder}") not in bad
        }
        usable = [
            holder
            for holder, (identity, run) in copies.items()
            if identity is not None and run == info["run"] and (not known or identity == committed)
        ]
        if not known and len({copies[h][0] for h in usable}) > 1:
            usable = []  # replicas that disagree, and nothing to tell the true one by
        if usable:  # the least loaded holder sends (spreads a lost node's ranks)
            holder = min(usable, key=lambda h: (load[h], h))
            load[holder] += 1
            plan.append(f"peer {holder}")
            expected.append(copies[holder][0])
        elif candidate in fallback and (rank, "fallback") not in bad:
            plan.append("fallback")
            expected.append(fallback[candidate])
        else:
            return None
    return plan, expected
