"""Whether every rank of a multi-rank manager sees the same tiers.

A multi-rank (DCP) step is one directory that every rank writes its file into and rank 0
commits: if a rank's ``root`` (or ``fast``) is another directory than rank 0's (a node-local
path, a typo, a mount missing on one node), every save would succeed and commit a step that
lacks that rank's file, and that cannot be restored. So the ranks check, when the manager is
made: rank 0 writes a token file with a random id into each local tier, every rank reads it
through its own path, and every rank compares what all read; a tier at a URL is compared by
its normalized URL. Any difference fails every rank, naming the ranks and the paths.

Example (one process: nothing to compare):
    >>> import tempfile
    >>> from fastckpt.series.sharded import Ranks
    >>> check_shared_tiers({"root": Tier(tempfile.mkdtemp())}, Ranks(True))
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping

import torch

from fastckpt.distributed.groups import checkpoint_group
from fastckpt.series.sharded import Ranks
from fastckpt.series.steps import Tier

__all__ = ["TOKEN_PREFIX", "check_shared_tiers"]

#: The token file rank 0 writes into a local tier for the check (removed right after).
TOKEN_PREFIX = ".fastckpt-shared-"


def check_shared_tiers(tiers: Mapping[str, Tier | None], ranks: Ranks) -> None:
    """Checks that every rank's ``tiers`` (``{"root": ..., "fast": ...}``, None for a tier
    not set) are the same directories or URLs as rank 0's (a collective in a process group; nothing otherwise).

    Raises:
        ValueError: on every rank, naming each tier that differs, the ranks and their paths,
            and what to do.
    """
    if not ranks.group:
        return
    tokens = ranks.agree(lambda: _write_tokens(tiers))
    try:
        mine = {name: _seen(tier, tokens.get(name)) for name, tier in tiers.items()}
        every: list[object] = [None] * ranks.world
        torch.distributed.all_gather_object(every, mine, group=checkpoint_group())
    finally:
        if ranks.coordinator:
            _remove_tokens(tiers, tokens)
    found = [_difference(name, [e[name] for e in every]) for name in tiers]  # type: ignore[index]
    problems = [p for p in found if p is not None]
    if problems:
        raise ValueError(
            "the ranks of this multi-rank CheckpointManager do not share its tiers: "
            + "; ".join(problems)
            + ". Every rank writes its file of a step into one directory that rank 0 commits, "
            "so the tiers must be one shared file system (or one URL) seen by every rank; "
            "for per-node tiers, give each rank its own root and fast and pass replicas= "
            "(each rank then saves its own steps, distributed=False)"
        )


def _write_tokens(tiers: Mapping[str, Tier | None]) -> dict[str, tuple[str, str]]:
    """Rank 0: a token file ``(name, id)`` written into each local tier."""
    tokens = {}
    for name, tier in tiers.items():
        if tier is None or tier.is_url:
            continue
        token = secrets.token_hex(16)
        path = os.path.join(tier.location, TOKEN_PREFIX + token)
        # O_EXCL: never written through a link, never over a file of someone else's
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, token.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        tokens[name] = (TOKEN_PREFIX + token, token)
    return tokens


def _seen(tier: Tier | None, token: tuple[str, str] | None) -> tuple[str, str]:
    """``(this rank's location, what it found)``: the URL itself for a URL tier; for a local
    one ``"same"`` when rank 0's token reads back, else what was there instead."""
    if tier is None:
        return "none", "no such tier"
    if tier.is_url or token is None:
        return tier.location, f"url {tier.location}" if tier.is_url else "a local directory"
    name, expected = token
    try:
        with open(os.path.join(tier.location, name), "rb") as f:
            found = f.read(256).decode(errors="replace")
    except FileNotFoundError:
        return tier.location, "another directory (rank 0's token file is not there)"
    except OSError as exc:
        return tier.location, f"an unreadable directory ({exc.strerror or exc})"
    return tier.location, "same" if found == expected else "another token"


def _difference(name: str, seen: list[tuple[str, str]]) -> str | None:
    """What differs for tier ``name`` between the ranks (None: nothing)."""
    reference = seen[0]
    if reference[1].startswith(("url ", "no such")):
        odd = [r for r, s in enumerate(seen) if s[1] != reference[1]]
    else:
        odd = [r for r, s in enumerate(seen) if s[1] != "same"]
    if not odd:
        return None
    shown = ", ".join(f"rank {r} has {seen[r][0]} ({seen[r][1]})" for r in odd[:8])
    more = f" and {len(odd) - 8} more ranks" if len(odd) > 8 else ""
    return f"{name} is {reference[0]} on rank 0, but {shown}{more}"


def _remove_tokens(tiers: Mapping[str, Tier | None], tokens: Mapping[str, tuple[str, str]]) -> None:
    """Rank 0: removes the token files it wrote."""
    for name, (file, _) in tokens.items():
        tier = tiers[name]
        if tier is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(tier.location, file))
