"""The order of saves to one path: a save never commits under a later one.

``async_save(step1, p)`` followed by ``save(step2, p)`` must leave step 2 at ``p``: the
background commit of step 1 must not rename its file over step 2's. Asynchronous saves
register here until they have committed (or failed); a save to the same path first waits
for every asynchronous save registered before it (:func:`wait_for_earlier`). Asynchronous
saves among themselves commit in call order (:mod:`fastckpt.checkpoint.asynchronous`).

Paths are compared by their absolute path with the directory's symlinks resolved (the
rename replaces the last component itself, even when it is a symlink); URLs as written.

Example:
    >>> token = register("/tmp/fastckpt-order-doc.safetensors")
    >>> pending_count("/tmp/fastckpt-order-doc.safetensors")
    1
    >>> finish(token)
    >>> wait_for_earlier("/tmp/fastckpt-order-doc.safetensors")  # returns at once
"""

from __future__ import annotations

import os
import threading

from fastckpt.storage.locations import is_url

__all__ = ["register", "finish", "any_pending", "wait_for_earlier", "pending_count", "path_key"]

_cond = threading.Condition()
_pending: dict[str, list[object]] = {}  # path key -> tokens of saves not yet settled


def path_key(path: str | os.PathLike[str]) -> str:
    """The name two saves share when they write the same file (a URL is its own name)."""
    if is_url(path):
        return str(path)
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(os.path.realpath(directory), name)


def register(path: str | os.PathLike[str]) -> tuple[str, object]:
    """Records a save to ``path`` that has not committed yet; returns its token."""
    key, mark = path_key(path), object()
    with _cond:
        _pending.setdefault(key, []).append(mark)
    return key, mark


def finish(token: tuple[str, object]) -> None:
    """The save of ``token`` has committed or failed: later saves may go ahead."""
    key, mark = token
    with _cond:
        marks = _pending.get(key, [])
        if mark in marks:
            marks.remove(mark)
        if not marks:
            _pending.pop(key, None)
        _cond.notify_all()


def pending_count(path: str | os.PathLike[str]) -> int:
    """How many registered saves to ``path`` have not settled."""
    with _cond:
        return len(_pending.get(path_key(path), ()))


def any_pending() -> bool:
    """Whether any save is registered (else :func:`wait_for_earlier` has nothing to wait
    for, whatever the path: a save can skip resolving its path's name)."""
    with _cond:
        return bool(_pending)


def wait_for_earlier(path: str | os.PathLike[str]) -> None:
    """Blocks until every save to ``path`` registered so far has settled. Ctrl-C
    interrupts the wait (the caller has written nothing yet)."""
    key = path_key(path)
    with _cond:
        earlier = set(map(id, _pending.get(key, ())))

        def settled() -> bool:
            return not any(id(m) in earlier for m in _pending.get(key, ()))

        _cond.wait_for(settled)


def _after_fork_in_child() -> None:
    # Saves pending in the parent are the parent's: the child waits for none of them.
    global _cond
    _cond = threading.Condition()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
