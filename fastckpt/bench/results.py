"""A benchmark run's results: every round kept, medians and spreads per method.

Example:
    >>> r = Results(quiet=True)
    >>> r.record("load", "a", 0, {"payload_bytes": 1e9, "seconds": 0.5})
    >>> r.stats("load", ["a"])["a"]["gbps"]
    2.0
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastckpt.bench.report import log
from fastckpt.bench.units import MiB, median

__all__ = ["Results", "rate_of", "rotate", "summarize"]


def rate_of(result: Mapping[str, Any]) -> float:
    """GB/s of one measured result: ``payload_bytes / seconds``, or its own ``gbps`` (fio)."""
    if "payload_bytes" in result:
        return result["payload_bytes"] / result["seconds"] / 1e9
    return result["gbps"]


def summarize(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians (and GB/s spread) of one method's rounds; errors and skips collected.

    A round counts when it has neither ``error`` nor ``skipped``; its GB/s is
    ``payload_bytes / seconds`` (or its own ``gbps``).

    Example:
        >>> s = summarize([{"payload_bytes": 2e9, "seconds": 1.0, "cpu_seconds": 0.5},
        ...                {"payload_bytes": 2e9, "seconds": 2.0, "cpu_seconds": 1.5},
        ...                {"error": "boom"}])
        >>> s["n"], s["gbps"], s["cpu_seconds"], s["errors"]
        (2, 1.5, 1.0, ['boom'])
    """
    ok = [r for r in results if "error" not in r and "skipped" not in r]
    errors = [r["error"] for r in results if "error" in r]
    skipped = sorted({r["skipped"] for r in results if "skipped" in r})
    if not ok:
        return {"n": 0, "errors": errors, "skipped": skipped}
    rates = [rate_of(r) for r in ok]
    rss = [r.get("extra_rss") for r in ok]
    return {
        "n": len(ok),
        "gbps": median(rates),
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "seconds": median([r.get("seconds") for r in ok]),
        "cpu_seconds": median([r.get("cpu_seconds") for r in ok]),
        "extra_rss": median(rss) if any(v is not None for v in rss) else None,
        "extra_rss_max": max((v for v in rss if v is not None), default=None),
        # the largest share of the file in the page cache before a cold load (fincore)
        "resident_max": max(
            (r["resident_before"] for r in ok if r.get("resident_before") is not None),
            default=None,
        ),
        "errors": errors,
        "skipped": skipped,
    }


def rotate(items: Sequence[str], k: int) -> list[str]:
    """``items`` started at position ``k``: each round runs the methods in another order."""
    items = list(items)
    k %= len(items)
    return items[k:] + items[:k]


class Results:
    """Every child's result of a benchmark run, tagged (op, method, round, more) and logged.

    Example:
        >>> r = Results(quiet=True)
        >>> r.record("load", "a", 0, {"payload_bytes": 1e9, "seconds": 0.5})
        >>> r.record("load", "a", 1, {"error": "boom"})
        >>> r.stats("load", ["a"])["a"]["gbps"], r.per_round("load", "a", 2)
        (2.0, [2.0, None])
    """

    def __init__(self, quiet: bool = False) -> None:
        self.raw: list[dict[str, Any]] = []
        self.quiet = quiet

    def record(
        self, op: str, method: str, rnd: int, result: Mapping[str, Any], **tags: Any
    ) -> None:
        """Keeps one result; logs it on stderr (round -1: an extra, untimed round)."""
        self.raw.append({**tags, "op": op, "method": method, "round": rnd, **result})
        if self.quiet:
            return
        head = " ".join(str(v) for v in tags.values())
        when = "sampled" if rnd < 0 else f"round {rnd + 1}"
        head = f"{head + ' ' if head else ''}{when}: {op} {method:17s}"
        if "error" in result or "skipped" in result:
            log(f"{head} {result.get('error') or 'skipped: ' + result['skipped']}")
            return
        extra = ""
        if result.get("cpu_seconds") is not None:
            extra += f"  cpu {result['cpu_seconds']:5.2f} s"
        if result.get("extra_rss") is not None:
            extra += f"  +rss {result['extra_rss'] / MiB:6.0f} MiB"
        if result.get("wrong"):
            extra += f"  WRONG BYTES {result['wrong']}"
        log(f"{head} {rate_of(result):6.2f} GB/s{extra}")

    def pick(self, op: str, method: str, *, sampled: bool = False, **tags: Any) -> list[dict]:
        """The results of one method (timed rounds, or with ``sampled`` the extra round)."""
        return [
            r
            for r in self.raw
            if r["op"] == op
            and r["method"] == method
            and (r["round"] < 0) == sampled
            and all(r.get(k) == v for k, v in tags.items())
        ]

    def stats(self, op: str, methods: Iterable[str], **tags: Any) -> dict[str, dict[str, Any]]:
        """:func:`summarize` of each method's timed rounds."""
        return {m: summarize(self.pick(op, m, **tags)) for m in methods}

    def per_round(self, op: str, method: str, rounds: int, **tags: Any) -> list[float | None]:
        """GB/s of each round (None where it failed), so the spread behind a median shows."""
        values: list[float | None] = []
        for rnd in range(rounds):
            r = next((x for x in self.pick(op, method, **tags) if x["round"] == rnd), None)
            if r is None or "error" in r or "skipped" in r:
                values.append(None)
            else:
                values.append(rate_of(r))
        return values

    def dump(self, path: str, **more: Any) -> None:
        """Writes every result (and ``more``) as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**more, "runs": self.raw}, f, indent=2)
        log(f"raw results written to {path}")
