"""``fastckpt ls ROOT [--fast DIR] [--verify] [--json]``: the steps of a checkpoint series.

One line per step (ascending): the tiers holding it (``fast``, ``root``; a copy without its
commit marker is marked ``(partial)``: a save, a drain or a deletion in progress or cut
short), its size, whether it is committed in some tier, whether its copies were verified
(``--verify`` reads every byte and checks every CRC32C; otherwise ``-``), and the metrics its
marker records. ``--json`` prints the same as a JSON list.

Reads the tiers without a manager: it runs beside a training job (a step it sees committed
stays complete; one it sees partial may commit a moment later).

Exit status: 0, or 1 when ``--verify`` finds a damaged or unreadable copy; 2 when ROOT or
``--fast`` is not a directory.

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
from typing import TYPE_CHECKING, Any

from fastckpt.cli._common import FAILURE, format_bytes
from fastckpt.cli.series_tiers import StepCopy, tier_copies, tier_location

if TYPE_CHECKING:
    from fastckpt.series.steps import Tier

__all__ = ["add_parser", "list_steps", "run"]

#: Verdicts of --verify, per step (the worst of its committed copies).
VERIFIED, DAMAGED, UNVERIFIABLE, NOT_CHECKED = "yes", "DAMAGED", "no checksums", "-"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``ls`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "ls",
        help="list the steps of a checkpoint series (CheckpointManager directories)",
        description=(
            "Lists the steps of a CheckpointManager series: the tiers each is in, its size, "
            "whether it is committed (its marker written) and verified, and its metrics."
        ),
        epilog="exit status: 0; 1 when --verify finds a damaged copy; 2 when a directory "
        "is missing",
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
    ``verify``, ``damaged`` names each damaged copy and why.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.series.manager import CheckpointManager
        >>> root = tempfile.mkdtemp()
        >>> with CheckpointManager(root) as manager:
        ...     _ = manager.save(3, {"w": torch.ones(2)}, metrics={"loss": 0.5})
        >>> [(s["step"], s["tiers"], s["metrics"]) for s in list_steps(root)]
        [(3, {'root': 'committed'}, {'loss': 0.5})]
    """
    copies: dict[int, list[StepCopy]] = {}
    tiers = [("fast", fast), ("root", root)] if fast is not None else [("root", root)]
    for name, tier in tiers:
        for copy in tier_copies(tier, name):
            copies.setdefault(copy.step, []).append(copy)
    listing = []
    for step in sorted(copies):
        held = copies[step]
        committed = [c for c in held if c.committed]
        shown = committed[0] if committed else max(held, key=lambda c: c.size)
        entry: dict[str, Any] = {
            "step": step,
            "tiers": {c.tier: "committed" if c.committed else "partial" for c in held},
            "size": shown.size,
            "committed": bool(committed),
            "verified": NOT_CHECKED,
            "metrics": shown.metrics,
        }
        if verify and committed:
            entry["verified"], entry["damaged"] = _verify(committed)
        listing.append(entry)
    return listing


def _verify(copies: list[StepCopy]) -> tuple[str, list[str]]:
    """The verdict over a step's committed copies, and what is wrong with each damaged one."""
    from fastckpt.cli.verify import OK, verify_file
    from fastckpt.cli.verify import UNVERIFIABLE as NO_CHECKSUMS

    damaged, unverifiable = [], False
    for copy in copies:
        verdict = verify_file(copy.checkpoint, progress=False)
        if verdict.status == NO_CHECKSUMS:
            unverifiable = True
        elif verdict.status != OK:
            damaged.append(f"{copy.tier}: {verdict.detail}")
    if damaged:
        return DAMAGED, damaged
    return (UNVERIFIABLE if unverifiable else VERIFIED), []


def _tiers_text(tiers: dict[str, str]) -> str:
    return ", ".join(
        name if state == "committed" else f"{name} (partial)" for name, state in tiers.items()
    )


def _metrics_text(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items()))


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt ls``; 1 when ``--verify`` found damage, else 0."""
    root = tier_location("ROOT", args.root)
    fast = None if args.fast is None else tier_location("--fast", args.fast)
    listing = list_steps(root, fast, verify=args.verify)
    if args.json:
        print(json.dumps(listing, indent=1))
    else:
        _print_table(listing)
    return FAILURE if any(s["verified"] == DAMAGED for s in listing) else 0


def _print_table(listing: list[dict[str, Any]]) -> None:
    header = ("STEP", "TIERS", "SIZE", "COMMITTED", "VERIFIED", "METRICS")
    rows = [
        (
            str(s["step"]),
            _tiers_text(s["tiers"]),
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
