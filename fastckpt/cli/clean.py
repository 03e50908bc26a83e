"""``fastckpt clean ROOT [--fast DIR] [--dry-run]``: removes what a series' crashed saves left.

A step directory without its commit marker is a save, a drain or a deletion cut short: it
does not exist for :class:`~fastckpt.series.manager.CheckpointManager` and the next manager
removes it. ``clean`` removes such directories now (to free the space without starting a
run), naming each: ``partial save`` or ``stale drain`` (a partial copy in ROOT of a step
committed in the fast tier: the next manager drains that step again). Committed steps are
never touched. A local fast tier's spare file (a deleted step's file kept for the next save
to write over, removed when its manager closes) left by a killed run goes too: on
``/dev/shm`` it holds memory.

It takes each tier's manager lock first: while a manager runs on a tier, its partial
directories are saves in progress, and ``clean`` refuses (status 1) rather than race them.

A step whose commit marker exists but cannot be used (unreadable, not JSON, fields of the
wrong types) is committed as far as a manager can tell: ``clean`` leaves it in place and
names it, with what is wrong (status 1), for a person to look at.

Exit status: 0; 1 when a tier is in use by a running manager, a removal fails or a marker
cannot be used; 2 when ROOT or ``--fast`` is not a directory.

Example (shell)::

    $ fastckpt clean run/checkpoints --fast /dev/shm/run --dry-run
    would remove run/checkpoints/step-000000000400 (stale drain, 512.00 MiB)
    would remove 1 directory, 512.00 MiB
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import TYPE_CHECKING, Any

from fastckpt.cli._common import FAILURE, format_bytes, spellings
from fastckpt.cli.series_tiers import StepCopy, locked_tiers, tier_copies, tier_location

if TYPE_CHECKING:
    from fastckpt.series.steps import Tier

__all__ = ["add_parser", "leftovers", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``clean`` on the ``fastckpt`` parser."""
    parser = subparsers.add_parser(
        "clean",
        help="remove the partial steps that crashed saves and drains left in a series",
        description=(
            "Removes the step directories of a CheckpointManager series that have no commit "
            "marker (saves, drains or deletions cut short). Committed steps are never touched; "
            "a tier in use by a running manager is refused."
        ),
        epilog="exit status: 0; 1 a tier is in use, a removal failed or a commit marker cannot "
        "be used (that step is left in place); 2 a directory is missing",
    )
    parser.add_argument("root", metavar="ROOT", help="the series' durable directory")
    parser.add_argument("--fast", metavar="DIR", help="the series' fast tier, if it has one")
    parser.add_argument(
        *spellings("--dry-run"), action="store_true", help="say what would go, remove nothing"
    )
    parser.set_defaults(run=run)
    return parser


def leftovers(root: Tier | str, fast: Tier | str | None = None) -> list[tuple[StepCopy, str]]:
    """The uncommitted step directories of the tiers, each with why it is there.

    Example:
        >>> import tempfile, os
        >>> from fastckpt.series import steps
        >>> root = tempfile.mkdtemp()
        >>> os.makedirs(steps.step_dir(root, 9))
        >>> [(c.step, why) for c, why in leftovers(root)]
        [(9, 'partial save')]
    """
    fast_committed = set()
    found = []
    if fast is not None:
        fast_copies = tier_copies(fast, "fast")
        fast_committed = {c.step for c in fast_copies if c.committed}
        found += [(c, "partial save") for c in fast_copies if not c.committed]
    for copy in tier_copies(root, "root"):
        if not copy.committed:
            found.append((copy, "stale drain" if copy.step in fast_committed else "partial save"))
    return found


def _spare_of(fast: Tier | None) -> str | None:
    """The spare file a killed manager left in a local fast tier, if there is one."""
    from fastckpt.series.steps import SPARE_FILE

    if fast is None or fast.is_url:
        return None
    spare = os.path.join(fast.location, SPARE_FILE)
    return spare if os.path.isfile(spare) else None


def run(args: argparse.Namespace) -> int:
    """Runs ``fastckpt clean``; 0 when everything found was removed (or listed, dry)."""
    from fastckpt.series import steps as layout  # here: `fastckpt --help` loads no I/O engine

    root = tier_location("ROOT", args.root)
    fast = None if args.fast is None else tier_location("--fast", args.fast)
    tiers = [root] if fast is None else [fast, root]
    verb = "would remove" if args.dry_run else "removed"
    by_name = {"root": root} if fast is None else {"root": root, "fast": fast}
    failed, freed = 0, 0
    with locked_tiers(*tiers):
        found = leftovers(root, fast)
        bad = _bad_markers(tiers, by_name)
        for copy, why in found:
            if not args.dry_run:
                try:
                    layout.remove_step(by_name[copy.tier], copy.step)
                    _check_removed(by_name[copy.tier], copy.directory)
                except OSError as exc:
                    failed += 1
                    print(f"cannot remove {copy.directory}: {exc.strerror or exc}")
                    continue
            freed += copy.size
            print(f"{verb} {copy.directory} ({why}, {format_bytes(copy.size)})")
        spare = _spare_of(fast)
        if spare is not None:
            size = os.path.getsize(spare)
            if not args.dry_run:
                os.unlink(spare)
            freed += size
            print(f"{verb} {spare} (spare file, {format_bytes(size)})")
    count = len(found) - failed
    noun = "directory" if count == 1 else "directories"
    also = " and a spare file" if spare is not None else ""
    summary = f"{verb} {count} {noun}{also}, {format_bytes(freed)}"
    print(summary if found or spare is not None else "nothing to clean")
    for problem in bad:
        print(f"fastckpt clean: error: {problem}; left in place", file=sys.stderr)
    return FAILURE if failed or bad else 0


def _check_removed(tier: Tier, directory: str) -> None:
    """Raises OSError (EEXIST, naming ``directory``) when a local step directory is still
    there after its removal: a removal that skips what it must not follow (a symbolic
    link) or cannot delete must not be reported as done."""
    if not tier.is_url and os.path.lexists(directory):
        what = "a symbolic link, not followed" if os.path.islink(directory) else "still there"
        raise OSError(errno.EEXIST, f"not removed ({what})", directory)


def _bad_markers(tiers: list[Tier], by_name: dict[str, Tier]) -> list[str]:
    """What is wrong with each committed step whose marker cannot be used, tier by tier."""
    names = {id(tier): name for name, tier in by_name.items()}
    return [
        copy.problem
        for tier in tiers
        for copy in tier_copies(tier, names[id(tier)])
        if copy.problem is not None
    ]
