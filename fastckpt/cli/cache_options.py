"""How ``fastckpt bench`` and ``fastckpt tune`` keep timed reads cold: the options they share.

By default only the files a run reads are evicted from the page cache (written back, then
``posix_fadvise(DONTNEED)``): a benchmark is not a reason to make every other program on the
machine read its files from the disk again. ``--drop-all-caches`` also drops the whole page
cache (``/proc/sys/vm/drop_caches``, as root). ``--no-drop-caches`` is the default, still
accepted.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_cache_options(parser)
    >>> drop_all_caches(parser.parse_args([])), drop_all_caches(parser.parse_args(["--drop-all-caches"]))
    (False, True)
"""

from __future__ import annotations

import argparse

from fastckpt.cli._common import USAGE, CliError, spellings

__all__ = ["add_cache_options", "drop_all_caches"]


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """Adds ``--drop-all-caches`` and ``--no-drop-caches`` (with ``_`` spellings)."""
    parser.add_argument(
        *spellings("--drop-all-caches"),
        dest="drop_all_caches",
        action="store_true",
        help="also drop the whole machine's page cache before every cold read (needs root; "
        "every other program then reads its files from the disk again). By default only the "
        "files read are evicted (fsync, then posix_fadvise DONTNEED)",
    )
    parser.add_argument(
        *spellings("--no-drop-caches"),
        dest="no_drop_caches",
        action="store_true",
        help="never drop the whole page cache: the default (only the files read are evicted)",
    )


def drop_all_caches(args: argparse.Namespace) -> bool:
    """Whether the run asked to drop the whole page cache.

    Raises:
        CliError: (status 2) ``--drop-all-caches`` and ``--no-drop-caches`` together.
    """
    if args.drop_all_caches and args.no_drop_caches:
        raise CliError("--drop-all-caches and --no-drop-caches ask for opposite things", USAGE)
    return bool(args.drop_all_caches)
