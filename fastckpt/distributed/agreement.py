"""Errors that every rank of a group sees: a step that may fail on one rank (opening a file,
reading a stripe) is followed by an agreement, so no rank goes on into a collective that the
failed rank will never join (which would hang until the group's timeout).

:func:`raise_everywhere` costs one all-reduce of an int when nothing failed; when something
did, the failed ranks' errors are gathered and every rank raises: the failed rank its own
error, the others that same error (same type, message and attributes: a ``ChecksumError``
still names its tensor and file, an ``OSError`` its errno and file) with a note naming the
rank it happened on.

Example (one process: no group, the error is raised here as it is):
    >>> agree(lambda: 1 + 1, None, "adding")
    2
    >>> agree(lambda: {}["w"], None, "looking up")
    Traceback (most recent call last):
    ...
    KeyError: 'w'
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

import torch

from fastckpt.errors import FastCkptError

__all__ = ["agree", "raise_everywhere"]

T = TypeVar("T")


def agree(fn: Callable[[], T], group: Any, what: str) -> T:
    """Runs ``fn`` on this rank, then :func:`raise_everywhere` over ``group`` (None: raise
    here only); returns what ``fn`` returned when it succeeded on every rank."""
    try:
        result = fn()
    except Exception as exc:
        if group is None:
            raise
        raise_everywhere(exc, group, what)
        raise  # unreachable: raise_everywhere raises when exc is not None
    if group is not None:
        raise_everywhere(None, group, what)
    return result


def raise_everywhere(error: BaseException | None, group: Any, what: str) -> None:
    """A collective: every rank of ``group`` calls it with its own outcome (None: success);
    returns on every rank only when no rank failed, else raises on every rank (see the
    module's description). ``what`` says what was being done, for the note."""
    dist = torch.distributed
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, group=group)
    if not int(flag.item()):
        return
    records: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, None if error is None else _record(error), group=group)
    if error is not None:
        raise error
    rank, record = next((r, rec) for r, rec in enumerate(records) if rec is not None)
    raise _rebuilt(rank, record, what)


def _record(error: BaseException) -> tuple[str, bytes | None, str]:
    """What travels: the pickled error when it pickles (and unpickles: an exception whose
    constructor needs other arguments does not), else its type's name and message."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        return type(error).__name__, None, str(error)
    return type(error).__name__, data, str(error)


def _rebuilt(rank: int, record: tuple[str, bytes | None, str], what: str) -> BaseException:
    kind, data, message = record
    note = f"raised on rank {rank} of the checkpoint group while {what}"
    if data is None:
        return FastCkptError(f"{kind}: {message} ({note})")
    error: BaseException = pickle.loads(data)
    # BaseException.add_note where it exists (3.11); the same attribute tracebacks show
    error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined,unused-ignore]
    return error
