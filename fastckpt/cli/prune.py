"""``fastckpt prune ROOT --keep-last N [--keep-every K] [--best METRIC:min|max:COUNT]``: applies
a retention policy to a series by hand, as :class:`~fastckpt.series.manager.CheckpointManager`
applies its own after each save (:class:`~fastckpt.series.retention.Retention`: the newest
step is always kept).

Each step removed goes as the manager removes one: its marker first, then its files, so a
crash mid-way never leaves a step that half exists. With ``--fast``, the steps pruned from
ROOT are removed from the fast tier too (a fast step missing from ROOT would be drained back
by the next manager). Takes the tiers' manager locks: a running manager makes it fail.

A committed step whose marker cannot be used (unreadable, not JSON, fields of the wrong
types) stops ``prune`` before it removes anything: its metrics and the steps it depends on
are unknown, so no policy can be applied safely. The error names the step and the tier.

Exit status: 0; 1 a tier is in use by a running manager, or a marker cannot be used; 2
usage errors (a missing directory, a malformed ``--best``).

Example (shell)::

    $ fastckpt prune run/checkpoints --keep-last 2 --dry-run
    would remove step 100 (512.00 MiB)
    would remove 1 step, 512.00 MiB; keeping 200, 300
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from fastckpt.cli._common import CliError, format_bytes, positive_int_arg, spellings
from fastckpt.cli.series_tiers import StepCopy, locked_tiers, tier_copies, tier_location
from fastckpt.series.retention import Retention, kept_bases

if TYPE_CHECKING:
    from fastckpt.series.steps import Tier

__all__ = ["add_parser", "best_arg", "pruned_steps", "run"]


def best_arg(text: str) -> tuple[str, str, int]:
    """argparse type for ``--best METRIC:min|max:COUNT``.

    Example:
        >>> best_arg("loss:min:2")
        ('loss', 'min', 2)
    """
    metric, _, rest = text.rpartition(":")
    metric, _, mode = metric.rpartition(":")
    if not metric or mode not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"expected METRIC:min|max:COUNT, got {text!r}")
    return metric, mode, positive_int_arg(rest)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``prune`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "prune",
        help="delete the steps of a series that a retention policy does not keep",
        description=(
            "Deletes the committed steps of a CheckpointManager series that the policy does not "
            "keep: the --keep-last newest, every step divisible by --keep-every and the --best "
            "by a recorded metric stay (the newest step always stays)."
        ),
        epilog="exit status: 0; 1 a tier is in use by a running manager or a commit marker "
        "cannot be used (then nothing is removed); 2 usage errors",
    )
    parser.add_argument("root", metavar="ROOT", help="the series' durable directory")
    parser.add_argument(
        *spellings("--keep-last"), type=positive_int_arg, required=True, metavar="N",
        help="keep the N newest steps",
    )  # fmt: skip
    parser.add_argument(
        *spellings("--keep-every"), type=positive_int_arg, metavar="K",
        help="also keep every step divisible by K",
    )  # fmt: skip
    parser.add_argument(
        "--best", type=best_arg, metavar="METRIC:min|max:COUNT",
        help="also keep the COUNT best steps by a metric their markers record",
    )  # fmt: skip
    parser.add_argument(
        "--fast", metavar="DIR", help="the series' fast tier: pruned steps go from there too"
    )
    parser.add_argument(
        *spellings("--dry-run"), action="store_true", help="say what would go, remove nothing"
    )
    parser.set_defaults(run=run)
    return parser


def pruned_steps(root: Tier | str, policy: Retention) -> list[int]:
    """The committed steps of ``root`` that ``policy`` does not keep, ascending.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.series.manager import CheckpointManager
        >>> root = tempfile.mkdtemp()
        >>> with CheckpointManager(root, keep_last=None) as manager:
        ...     for step in (1, 2, 3):
        ...         _ = manager.save(step, {"w": torch.ones(1)})
        >>> pruned_steps(root, Retention(keep_last=1))
        [1, 2]
    """
    committed = _usable(tier_copies(root, "root"))
    steps = [c.step for c in committed]
    kept = policy.kept(steps, {c.step: c.metrics for c in committed})
    # an incremental step's bases stay while it does, as the manager's retention keeps them
    depends_on = {c.step: c.depends_on for c in committed}
    kept |= set(kept_bases(kept, steps, depends_on.__getitem__))
    return [c.step for c in committed if c.step not in kept]


def _usable(copies: list[StepCopy]) -> list[StepCopy]:
    """The committed copies, or a failure (status 1) naming the first whose marker cannot
    be used: without its metrics and bases no policy can be applied safely."""
    committed = [c for c in copies if c.committed]
    for copy in committed:
        if copy.problem is not None:
            raise CliError(f"{copy.problem}; nothing was removed (fix or move that step first)")
    return committed


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt prune``."""
    from fastckpt.series import steps as layout  # here: `fastckpt --help` loads no I/O engine

    root = tier_location("ROOT", args.root)
    fast = None if args.fast is None else tier_location("--fast", args.fast)
    policy = Retention(keep_last=args.keep_last, keep_every=args.keep_every, best=args.best)
    verb = "would remove" if args.dry_run else "removed"
    with locked_tiers(*([root] if fast is None else [fast, root])):
        sizes = {c.step: c.size for c in _usable(tier_copies(root, "root"))}
        doomed = pruned_steps(root, policy)
        fast_steps = set(layout.committed_steps(fast)) if fast is not None else set()
        for step in doomed:
            if not args.dry_run:
                layout.remove_step(root, step)
                if step in fast_steps:
                    assert fast is not None
                    layout.remove_step(fast, step)
            where = " (and its fast copy)" if step in fast_steps else ""
            print(f"{verb} step {step}{where} ({format_bytes(sizes[step])})")
    kept = ", ".join(str(s) for s in sorted(set(sizes) - set(doomed))) or "none"
    noun = "step" if len(doomed) == 1 else "steps"
    freed = format_bytes(sum(sizes[s] for s in doomed))
    print(f"{verb} {len(doomed)} {noun}, {freed}; keeping {kept}")
    return 0
