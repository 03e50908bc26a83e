"""``fastckpt ls ROOT [--fast DIR] [--verify] [--json]``: the steps of a checkpoint series.

One line per step (ascending): the tiers holding it (``fast``, ``root``; a copy without its
commit marker is marked ``(partial)``: a save, a drain or a deletion in progress or cut
short), its size, whether it is committed in some tier, whether its copies were verified
(``--verify`` reads every byte and checks every CRC32C; otherwise ``-``), and the metrics its
marker records. ``--json`` prints the same as a JSON list.

Copies that are no longer steps of the series are shown too, marked: steps a manager set
aside (``root (set aside: damaged)``; ``unreadable``, ``damaged`` or ``abandoned``: a
directory ``step-<12 digits>.<why>-<time>`` beside the steps, kept for a person to look at)
and the replicas a fast tier holds for its peers (``fast (replica of rank 3)``, in
``<fast>/.replicas``). In ``--json`` such a step has ``set_aside`` (``tier``, ``why``,
``directory``) or ``replicas`` (``tier``, ``rank``, ``directory``); a step with only such
copies is not committed.

Reads the tiers without a manager: it runs beside a training job (a step it sees committed
stays complete; one it sees partial may commit a moment later). A step that the manager's
retention removes while ``--verify`` reads it is reported as ``removed``, not as damage: a
copy that fails its check is counted damaged only if its marker is still there, unchanged.

A step whose commit marker cannot be used (unreadable, not JSON, fields of the wrong types)
is listed as committed, and a line on stderr names the step, the tier and what is wrong.
In ``--json``, a metric that is not a finite number is the string ``"nan"``, ``"inf"`` or
``"-inf"`` (JSON has no such numbers).

Exit status: 0, or 1 when ``--verify`` finds a damaged or unreadable copy or a marker
cannot be used; 2 when ROOT or ``--fast`` is not a directory.

Example (shell)::

    $ fastckpt ls run/checkpoints --fast /dev/shm/run
    STEP  TIERS                 SIZE      COMMITTED  VERIFIED  METRICS
    200   root                  1.00 GiB  yes        -         loss=0.21
    300   fast, root            1.00 GiB  yes        -         loss=0.18
    400   fast, root (partial)  1.00 GiB  yes        -         loss=0.17
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastckpt.cli._common import FAILURE, format_bytes
from fastckpt.cli.series_tiers import (
    MarkerError,
    Outside,
    StepCopy,
    held_replicas,
    marker_fields,
    set_aside_copies,
    tier_copies,
    tier_location,
)

if TYPE_CHECKING:
    from fastckpt.series.steps import Tier

__all__ = ["add_parser", "list_steps", "run"]

#: Verdicts of --verify, per step (the worst of its committed copies); REMOVED: every
#: copy went (retention of a running manager) while it was being checked.
VERIFIED, DAMAGED, UNVERIFIABLE, NOT_CHECKED = "yes", "DAMAGED", "no checksums", "-"
REMOVED = "removed"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``ls`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "ls",
        help="list the steps of a checkpoint series (CheckpointManager directories)",
        description=(
            "Lists the steps of a CheckpointManager series: the tiers each is in, its size, "
            "whether it is committed (its marker written) and verified, and its metrics."
        ),
        epilog="exit status: 0; 1 when --verify finds a damaged copy or a commit marker cannot "
        "be used; 2 when a directory is missing",
    )
    parser.add_argument("root", metavar="ROOT", help="the series' durable directory")
    parser.add_argument("--fast", metavar="DIR", help="the series' fast tier, if it has one")
    parser.add_argument(
        "--verify", action="store_true", help="read every copy and check its CRC32Cs"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(run=run)
    return parser


def list_steps(
    root: Tier | str, fast: Tier | str | None = None, *, verify: bool = False
) -> list[dict[str, Any]]:
    """Each step of the series, ascending: ``step``, ``tiers`` (``{"fast": "committed" |
    "partial", "root": ...}``), ``size``, ``committed``, ``verified`` and ``metrics``; with
    ``verify``, ``damaged`` names each damaged copy and why; ``problems`` names each copy
    whose marker cannot be used; ``set_aside`` and ``replicas`` list the step's copies
    outside the series (see the module's description).

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.series.manager import CheckpointManager
        >>> root = tempfile.mkdtemp()
        >>> with CheckpointManager(root) as manager:
        ...     _ = manager.save(3, {"w": torch.ones(2)}, metrics={"loss": 0.5})
        >>> [(s["step"], s["tiers"], s["metrics"]) for s in list_steps(root)]
        [(3, {'root': 'committed'}, {'loss': 0.5})]
    """
    tiers = {"fast": fast, "root": root} if fast is not None else {"root": root}
    copies: dict[int, list[StepCopy]] = {}
    outside: dict[int, list[Outside]] = {}
    for name, tier in tiers.items():
        for copy in tier_copies(tier, name):
            copies.setdefault(copy.step, []).append(copy)
        for aside in set_aside_copies(tier, name):
            outside.setdefault(aside.step, []).append(aside)
    if fast is not None:
        for replica in held_replicas(fast):
            outside.setdefault(replica.step, []).append(replica)
    listing = [
        _entry(step, copies.get(step, []), outside.get(step, []))
        for step in sorted({*copies, *outside})
    ]
    if verify:
        for entry in listing:
            held = copies.get(entry["step"], [])
            usable = [c for c in held if c.committed and c.problem is None]
            if usable:
                entry["verified"], entry["damaged"] = verify_copies(usable, tiers)
    return listing


def _entry(step: int, held: list[StepCopy], outside: list[Outside]) -> dict[str, Any]:
    """What ``ls`` says of one step, from its copies (a usable committed copy preferred) and
    the copies outside the series (set aside, or replicas held for peers)."""
    committed = [c for c in held if c.committed]
    usable = [c for c in committed if c.problem is None]
    shown = (usable or committed or sorted(held, key=lambda c: -c.size))[:1]
    entry: dict[str, Any] = {
        "step": step,
        "tiers": {c.tier: "committed" if c.committed else "partial" for c in held},
        "size": shown[0].size if shown else 0,
        "committed": bool(committed),
        "verified": NOT_CHECKED,
        "metrics": shown[0].metrics if shown else {},
    }
    aside = [o for o in outside if o.why != "replica"]
    if aside:
        entry["set_aside"] = [
            {"tier": o.tier, "why": o.why, "directory": o.directory} for o in aside
        ]
    replicas = [o for o in outside if o.why == "replica"]
    if replicas:
        entry["replicas"] = [
            {"tier": o.tier, "rank": o.rank, "directory": o.directory} for o in replicas
        ]
    problems = [c.problem for c in held if c.problem is not None]
    if problems:
        entry["problems"] = problems
    return entry


def verify_copies(
    copies: list[StepCopy], tiers: Mapping[str, Tier | str | None]
) -> tuple[str, list[str]]:
    """The verdict over a step's committed copies, and what is wrong with each damaged one.

    A copy that fails its check while a manager's retention removes its step (its marker
    gone or rewritten since it was listed) was not damaged: it is left out, and a step
    whose every copy went so is :data:`REMOVED`.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.series.manager import CheckpointManager
        >>> from fastckpt.series import steps
        >>> root = tempfile.mkdtemp()
        >>> with CheckpointManager(root) as manager:
        ...     _ = manager.save(1, {"w": torch.ones(2)})
        >>> listed = tier_copies(root, "root")
        >>> steps.remove_step(root, 1)  # as retention does, after the listing
        >>> verify_copies(listed, {"root": root})
        ('removed', [])
    """
    from fastckpt.cli.verify import OK, verify_file
    from fastckpt.cli.verify import UNVERIFIABLE as NO_CHECKSUMS

    damaged, unverifiable, checked = [], False, 0
    for copy in copies:
        verdict = verify_file(copy.checkpoint, progress=False)
        if verdict.status != OK and _gone(copy, tiers.get(copy.tier)):
            continue
        checked += 1
        if verdict.status == NO_CHECKSUMS:
            unverifiable = True
        elif verdict.status != OK:
            damaged.append(f"{copy.tier}: {verdict.detail}")
    if damaged:
        return DAMAGED, damaged
    if not checked:
        return REMOVED, []
    return (UNVERIFIABLE if unverifiable else VERIFIED), []


def _gone(copy: StepCopy, tier: Tier | str | None) -> bool:
    """Whether ``copy``'s step was removed or saved anew since it was listed: its marker
    is missing or says other files or another time. Retention removes the marker before
    the files, so a check that failed because the files went finds the marker gone."""
    if tier is None:
        return False
    try:
        fields = marker_fields(tier, copy.step, copy.tier)
    except MarkerError:
        return True
    return fields["time"] != copy.time or sum(fields["files"].values()) != copy.size


def _tiers_text(entry: Mapping[str, Any]) -> str:
    """The TIERS cell: each copy's tier, marked when partial, set aside or a peer's replica."""
    shown = [
        name if state == "committed" else f"{name} (partial)"
        for name, state in entry["tiers"].items()
    ]
    shown += [f"{o['tier']} (set aside: {o['why']})" for o in entry.get("set_aside", [])]
    shown += [f"{o['tier']} (replica of rank {o['rank']})" for o in entry.get("replicas", [])]
    return ", ".join(shown)


def _metrics_text(metrics: dict[str, float]) -> str:
    return " ".join(f"{_escaped(k)}={v:.6g}" for k, v in sorted(metrics.items()))


def _escaped(text: str) -> str:
    """``text`` with control characters escaped: names in markers are not ours, and must
    not move the cursor or retitle the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def json_number(value: float) -> float | str:
    """A metric as JSON can hold it: the number, or ``"nan"``, ``"inf"``, ``"-inf"`` (JSON
    has no such numbers, and Python's bare ``NaN`` token is not JSON).

    Example:
        >>> json_number(0.5), json_number(float("nan")), json_number(float("-inf"))
        (0.5, 'nan', '-inf')
    """
    return value if math.isfinite(value) else repr(value)


def as_json(listing: list[dict[str, Any]]) -> str:
    """``listing`` as valid JSON (``allow_nan=False`` keeps it so).

    Example:
        >>> json.loads(as_json([{"step": 1, "metrics": {"loss": float("nan")}}]))
        [{'step': 1, 'metrics': {'loss': 'nan'}}]
    """
    shown = [
        {**s, "metrics": {k: json_number(v) for k, v in s["metrics"].items()}} for s in listing
    ]
    return json.dumps(shown, indent=1, allow_nan=False)


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt ls``; 1 when ``--verify`` found damage or a marker cannot be used,
    else 0."""
    root = tier_location("ROOT", args.root)
    fast = None if args.fast is None else tier_location("--fast", args.fast)
    listing = list_steps(root, fast, verify=args.verify)
    if args.json:
        print(as_json(listing))
    else:
        _print_table(listing)
    problems = [p for s in listing for p in s.get("problems", [])]
    for problem in problems:
        print(f"fastckpt ls: error: {_escaped(problem)}", file=sys.stderr)
    damaged = any(s["verified"] == DAMAGED for s in listing)
    return FAILURE if damaged or problems else 0


def _print_table(listing: list[dict[str, Any]]) -> None:
    header = ("STEP", "TIERS", "SIZE", "COMMITTED", "VERIFIED", "METRICS")
    rows = [
        (
            str(s["step"]),
            _tiers_text(s),
            format_bytes(s["size"]),
            "yes" if s["committed"] else "no",
            s["verified"],
            _metrics_text(s["metrics"]),
        )
        for s in listing
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for s in listing:
        for problem in s.get("damaged", []):
            print(f"step {s['step']}: DAMAGED {problem}")
    if not listing:
        print("(no steps)")
