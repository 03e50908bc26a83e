"""The handshake before a checkpoint collective: no collective waits on a rank that is not
coming.

A collective called on some ranks only (``if rank == 0: manager.save(...)``), or by ranks
that disagree on what they call (one saves, another restores; restores of different steps),
would wait for the group's timeout and then fail without saying why. Before each of
fastckpt's collective entry points every rank of the group instead says what it calls,
through the default group's store (the TCP store that ``init_process_group`` set up, not a
collective), and waits a few seconds for the others (``FASTCKPT_HANDSHAKE_TIMEOUT``, 10 s):

- every rank sets its key ``fastckpt/handshake/<group>/<n>/<rank>`` (``n``: the number of
  handshakes this process made on the group) to the operation and the arguments that must
  agree, and waits for the keys of the others;
- a rank that does not come within the timeout is named, with what to do; a rank that came
  with another operation or other arguments is named too, on every rank alike (every rank
  reads the same keys);
- each rank then deletes its key of the handshake before (every rank has read it by then:
  it set its key of this one after), so the store holds at most two per rank and group.

It costs four round trips to the store (set, wait, read, delete) and no collective.

Example (one process: no other rank to wait for):
    >>> handshake("CheckpointManager.save", None, agree_on={"step": 3})
    [None]
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
from collections.abc import Mapping
from typing import Any

import torch

from fastckpt import config
from fastckpt.errors import FastCkptError

__all__ = ["HandshakeError", "handshake"]

_PREFIX = "fastckpt/handshake"
_lock = threading.Lock()
_counts: dict[str, int] = {}  # a group's key prefix -> handshakes this process made on it


class HandshakeError(FastCkptError):
    """The ranks of a group did not all make the same checkpoint call within the handshake's
    timeout: ``missing`` did not come; ``differing`` maps each rank that came with another
    call (or other arguments) to what it called."""

    def __init__(self, message: str, missing: list[int], differing: dict[int, str]):
        super().__init__(message)
        self.missing = missing
        self.differing = differing

    def __reduce__(self) -> Any:  # pickles whole (errors travel between ranks)
        return type(self), (str(self), self.missing, self.differing)


def handshake(
    operation: str,
    group: Any = None,
    *,
    agree_on: Mapping[str, Any] | None = None,
    advice: str | None = None,
    verb: str = "called",
    timeout: float | None = None,
    report: Any = None,
) -> list[Any]:
    """Waits until every rank of ``group`` (None: every rank of the default group) makes
    this same handshake: the same ``operation`` with equal ``agree_on`` values; returns at
    once without a process group of more than one rank.

    Every rank must call it at the same point of its checkpoint calls, from its main thread
    (the handshakes of a group are numbered in the order a process makes them).

    Args:
        operation: what is called, as the user wrote it (``"CheckpointManager.save"``).
        agree_on: the arguments every rank must pass alike (``{"step": step}``).
        advice: what to do when a rank is missing (default: call it on every rank).
        verb: how the message says the call was made (``"created"`` for a constructor).
        timeout: seconds to wait (default: ``FASTCKPT_HANDSHAKE_TIMEOUT``, 10).
        report: a JSON value this rank tells the others, which may differ between ranks
            (what a caller decides from before a collective, at no extra round trip).

    Returns:
        Every rank's ``report``, in rank order (``[report]`` without a process group).

    Raises:
        HandshakeError: a rank did not come within the timeout, or came with another
            operation or other ``agree_on`` values (naming the ranks, and what each called).

    Example:
        >>> handshake("CheckpointManager.restore", None, agree_on={"step": None})
        [None]
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return [report]
    group = dist.group.WORLD if group is None else group
    if dist.get_world_size(group) <= 1:
        return [report]
    ranks = [int(r) for r in dist.get_process_group_ranks(group)]
    seconds = config.handshake_timeout_seconds() if timeout is None else float(timeout)
    store = dist.distributed_c10d._get_default_store()
    scope = f"{_PREFIX}/{_digest(ranks)}"
    with _lock:
        count = _counts.get(scope, 0) + 1
        _counts[scope] = count
    me = dist.get_rank()
    wanted = {k: repr(v) for k, v in (agree_on or {}).items()}
    keys = [f"{scope}/{count}/{rank}" for rank in ranks]
    mine = keys[ranks.index(me)]
    store.set(mine, json.dumps({"operation": operation, "agree_on": wanted, "report": report}))
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception:  # the store's timeout (DistStoreError, a RuntimeError in older torch)
        missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        if missing:
            store.delete_key(mine)  # a rank coming later does not find this call
            with _lock:  # nor did it happen: this rank's next call meets the others' next
                _counts[scope] = count - 1
            raise _missing(operation, verb, ranks, missing, seconds, advice) from None
    if count > 1:  # every rank read it: each set its key of this handshake after
        store.delete_key(f"{scope}/{count - 1}/{me}")
    calls = [json.loads(value) for value in store.multi_get(keys)]
    _check_same(operation, wanted, ranks, calls)
    return [call.get("report") for call in calls]


def _digest(ranks: list[int]) -> str:
    """The key prefix of a group: its ranks (groups over the same ranks share one count)."""
    return hashlib.blake2b(repr(ranks).encode(), digest_size=6).hexdigest()


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _missing(
    operation: str,
    verb: str,
    ranks: list[int],
    missing: list[int],
    seconds: float,
    advice: str | None,
) -> HandshakeError:
    came = [r for r in ranks if r not in missing]
    advice = advice or f"call {operation} on every rank"
    return HandshakeError(
        f"{operation} was {verb} on {_ranks_text(came)} only (ranks {missing} did not join "
        f"within {seconds:g} s; FASTCKPT_HANDSHAKE_TIMEOUT sets how long ranks wait for "
        f"each other): {advice}",
        missing,
        {},
    )


def _check_same(
    operation: str, wanted: dict[str, str], ranks: list[int], calls: list[dict[str, Any]]
) -> None:
    """Raises on every rank alike when the ranks made different calls."""
    shown = {rank: _call_text(call) for rank, call in zip(ranks, calls)}
    operations = {call["operation"] for call in calls}
    if len(operations) > 1:
        listing = "; ".join(f"rank {rank}: {text}" for rank, text in shown.items())
        raise HandshakeError(
            f"the ranks made different checkpoint calls at the same point ({listing}): every "
            "rank must make the same fastckpt calls, in the same order",
            [],
            {r: t for r, t in shown.items() if calls[ranks.index(r)]["operation"] != operation},
        )
    for name in wanted:
        values: dict[str, list[int]] = {}
        for rank, call in zip(ranks, calls):
            values.setdefault(call["agree_on"].get(name, "?"), []).append(rank)
        if len(values) > 1:
            listing = ", ".join(f"{_ranks_text(rs)} {name}={v}" for v, rs in values.items())
            raise HandshakeError(
                f"{operation}: the ranks disagree on {name} ({listing}): every rank must pass "
                f"the same {name}",
                [],
                {r: t for r, t in shown.items() if calls[ranks.index(r)]["agree_on"] != wanted},
            )


def _call_text(call: Mapping[str, Any]) -> str:
    arguments = ", ".join(f"{k}={v}" for k, v in call["agree_on"].items())
    return f"{call['operation']}({arguments})"
