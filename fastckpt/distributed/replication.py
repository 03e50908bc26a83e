"""Peer replication of a node's fast tier: each rank's committed step is copied, in the
background and under a bandwidth cap, into the memory of ``k`` ranks on other nodes; after
a node is lost, its ranks get their newest step back from a peer instead of the durable
root.

:class:`Replicator` is collective: every rank makes one, in the same order as its other
process groups (it creates two gloo groups of its own: one for the background rounds,
one for recovery in the foreground), and every rank calls :meth:`Replicator.replicate` for
the steps it saves and :meth:`Replicator.recover` at restore.

**Rounds.** :meth:`~Replicator.replicate` opens the step's files at once (so a retention
that deletes or reuses them meanwhile changes nothing the round sends) and queues them. The
background thread runs one round at a time: the ranks agree (one all-reduce) on the newest
step every rank has queued, then each rank sends its files of that step to its peers
(:func:`~fastckpt.distributed.peers.choose_peers`) and receives its sources' files, paced
to ``bytes_per_second``: the headers over the replication group, the bytes by ``sendfile``
over a TCP connection per pair, or over gloo where a peer cannot connect
(:mod:`~fastckpt.distributed.replica_transport`). A rank that lacks that step (its save failed) sends an empty share.
Older queued steps are dropped: replication keeps up with the newest step, not every step.
Received files land in the :class:`~fastckpt.distributed.replica_store.ReplicaStore`,
committed by their own marker only once complete.

**Recovery.** :meth:`~Replicator.recover` gathers from every rank what it holds (its own
committed steps, the steps it can fall back to in the durable root, the replicas it keeps
for others), picks the newest step that every rank can get from somewhere (or the one
asked for), and sends each rank that lacks it in its own fast tier the replica a peer
holds; the receiving rank assembles the files beside its store and renames the directory
into place, with the step's own marker written last, so a step recovered half is never
committed. Every copy is known by its content (its checkpoint header's digest, and the run
that made it), never by its step number alone: a replica is used only where it is the step
its rank committed, and it is verified (every CRC32C) by its holder before it is sent and
by its receiver before it is renamed into place. A copy that fails is left out and the
ranks agree again; whatever fails, every rank raises at once, naming the ranks and copies.

Example (one process: there are no peers, so ``replicas`` must be 0):
    >>> import tempfile
    >>> replicator = Replicator(tempfile.mkdtemp(), replicas=0)
    >>> replicator.targets, replicator.sources
    ([], [])
    >>> replicator.close()
    >>> Replicator(tempfile.mkdtemp(), replicas=1)
    Traceback (most recent call last):
    ...
    ValueError: replicas=1 needs at least 2 nodes (each copy on another node); this run has 1
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from fastckpt import config
from fastckpt.distributed.groups import in_group, node_rank
from fastckpt.distributed.peers import choose_peers, failure_domain
from fastckpt.distributed.recovery_plan import (
    check_same_request,
    choose,
    identities,
    unavailable_newer,
)
from fastckpt.distributed.replica_store import (
    ReplicaStore,
    plain_name,
    remove_own_dir,
    verify_share,
)
from fastckpt.distributed.replica_transport import (
    CHUNK,
    TRANSPORTS,
    Share,
    Sink,
    exchange,
    open_share,
)
from fastckpt.errors import FastCkptError

__all__ = ["CHUNK", "Recovery", "Replicator"]

_log = logging.getLogger("fastckpt")

#: The file in the store that names this rank's newest step its peers hold.
REPLICATED = "REPLICATED"
#: Steps queued beyond the one in flight; older ones are dropped (replication follows the newest).
QUEUED = 2


@dataclasses.dataclass
class Recovery:
    """What :meth:`Replicator.recover` did: the step agreed on (None: nothing anywhere),
    and where each rank gets it from (``"own"``, ``"peer <rank>"``, ``"fallback"``)."""

    step: int | None
    sources: list[str]
    seconds: float = 0.0
    bytes_received: int = 0
    #: Steps newer than ``step`` that not every rank can get: set aside by every rank.
    abandoned: list[int] = dataclasses.field(default_factory=list)


class Replicator:
    """Copies this rank's committed fast-tier steps into ``replicas`` peers' memory and gets
    them back after a node is lost (see the module's description). Collective: every rank
    makes one, in the same order.

    Args:
        store: the directory this rank keeps its peers' replicas in (in the node's memory:
            inside its fast tier, or on /dev/shm).
        replicas: how many other nodes hold a copy of each rank's step (``k``).
        bytes_per_second: cap on the bytes this rank sends per second, all peers together
            (None: no cap).
        timeout_seconds: how long a collective of replication waits for a peer (default:
            ``FASTCKPT_GROUP_TIMEOUT``, 5 minutes unless set).
        run: what names this run (the rank's durable root): recorded with each replica, and
            a replica recorded by another run is never restored.
        transport: how file bytes travel: ``"auto"`` (TCP by ``sendfile`` wherever the
            receiver can connect, else gloo) or ``"gloo"``.

    Raises:
        ValueError: ``replicas`` is negative or not below the number of nodes (naming it),
            ``bytes_per_second`` is not positive, or ``transport`` is not one of those.
    """

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        replicas: int = 1,
        bytes_per_second: float | None = None,
        timeout_seconds: float | None = None,
        run: str = "",
        transport: str = "auto",
    ):
        if bytes_per_second is not None and not bytes_per_second > 0:
            raise ValueError(f"bytes_per_second must be positive, got {bytes_per_second!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.rate = bytes_per_second
        self.run = run
        self.transport = transport
        dist = torch.distributed
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if in_group() else (0, 1)
        self._group = self._recovery_group = None
        nodes, domains = [node_rank()], [failure_domain()]
        if timeout_seconds is None:
            timeout_seconds = config.group_timeout_seconds()
        self.timeout = timeout_seconds
        if in_group():
            timeout = datetime.timedelta(seconds=timeout_seconds)
            # made here, in the foreground, by every rank in the same order (never in a thread)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._recovery_group = dist.new_group(backend="gloo", timeout=timeout)
            every: list[Any] = [None] * self.world
            dist.all_gather_object(every, (node_rank(), failure_domain()), group=self._group)
            nodes, domains = [n for n, _ in every], [d for _, d in every]
        self.nodes = nodes
        domain_of = {n: d for n, d in zip(nodes, domains)} if any(domains) else None
        peers = choose_peers(nodes, replicas, domain_of)
        self.replicas = replicas
        #: The ranks this rank sends its steps to, and the ranks it holds replicas for.
        self.targets: list[int] = peers[self.rank]
        self.sources: list[int] = [r for r, mine in enumerate(peers) if self.rank in mine]
        self.store = ReplicaStore(store)
        #: Called (on the replication thread) with each step this rank's peers now hold.
        self.on_replicated: Callable[[int], None] | None = None
        #: Bytes this rank sent to its peers, the rounds' wall time and the replication
        #: thread's CPU time (sending, receiving, writing what it received).
        self.bytes_sent = 0
        #: Bytes sent (rounds and recoveries) by ``"tcp"`` and by ``"gloo"``.
        self.sent_by: dict[str, int] = {}
        self.seconds_sending = 0.0
        self.cpu_seconds = 0.0
        self._queue: collections.deque[tuple[int, Share, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._wake = threading.Condition()
        self._stopping = False
        self._broken: BaseException | None = None
        self._thread: threading.Thread | None = None
        if replicas and self._group is not None:
            self._thread = threading.Thread(
                target=self._run, name="fastckpt-replication", daemon=True
            )
            self._thread.start()

    # -- replicating -------------------------------------------------------------------------
    def replicate(
        self, step: int, directory: str, names: Sequence[str]
    ) -> concurrent.futures.Future[Any]:
        """Queues this rank's files ``names`` of ``directory`` (a committed step) for
        replication to its peers; returns at once. The files are opened here, so what a round
        sends is what was committed, whatever happens to the directory afterwards.

        The future's result is the number of bytes sent, or None when the step was dropped
        for a newer one; its error says why the round failed (a peer died: replication then
        stops, and the run's restore falls back to what survives).
        """
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._thread is None or self._broken is not None or self._stopping:
            future.set_exception(
                self._broken or RuntimeError(f"rank {self.rank}: replication is not running")
            )
            return future
        share = open_share(step, self.rank, self.nodes[self.rank], directory, names)
        share.header["run"] = self.run
        with self._wake:
            self._queue.append((step, share, future))
            while len(self._queue) > QUEUED:
                _, dropped, superseded = self._queue.popleft()
                dropped.close()
                superseded.set_result(None)
            self._wake.notify()
        return future

    def _run(self) -> None:
        dist = torch.distributed
        while True:
            with self._wake:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                newest = self._queue[-1][0] if self._queue else -1
            agreed = torch.tensor([newest], dtype=torch.int64)
            try:
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self._group)
            except Exception as exc:  # a peer died: the group is gone
                self._stop(exc)
                return
            step = int(agreed.item())
            if step < 0:  # a rank closed: every rank's thread ends together
                self._stop(None)
                return
            share, future = None, None
            with self._wake:
                while self._queue and self._queue[0][0] <= step:
                    queued, opened, waiting = self._queue.popleft()
                    if queued == step:
                        share, future = opened, waiting
                    else:
                        opened.close()
                        waiting.set_result(None)
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                outgoing: dict[int, Share | None] = dict.fromkeys(self.targets, share)
                received = self._exchange(self._group, outgoing, self.sources, self._receive)
                for incoming, info in received.values():
                    if incoming is not None:
                        self.store.commit(incoming, info)
            except Exception as exc:
                _log.error("rank %d: replicating step %d failed: %s", self.rank, step, exc)
                if future is not None:
                    future.set_exception(exc)
                if share is not None:
                    share.close()
                self._stop(exc)
                return
            sent = share.size * len(self.targets) if share is not None else 0
            self.bytes_sent += sent
            self.seconds_sending += time.perf_counter() - started
            self.cpu_seconds += time.thread_time() - cpu
            if share is not None:
                share.close()
                self._record_replicated(step)
            if future is not None:
                future.set_result(sent)

    def last_replicated(self) -> int | None:
        """The newest step of this rank whose replication round completed (kept across
        runs in the store: the owner keeps that step, which its peers can also give back)."""
        try:
            fd = os.open(
                os.path.join(self.store.directory, REPLICATED), os.O_RDONLY | os.O_NOFOLLOW
            )
            try:
                return int(os.read(fd, 64))
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None

    def _record_replicated(self, step: int) -> None:
        path = os.path.join(self.store.directory, REPLICATED)
        # a fresh name (O_EXCL): a link planted under a predictable one is never written through
        fd, temporary = tempfile.mkstemp(prefix=f".{REPLICATED}-", dir=self.store.directory)
        with os.fdopen(fd, "w") as f:
            f.write(str(step))
        os.rename(temporary, path)
        if self.on_replicated is not None:
            self.on_replicated(step)

    def _receive(self, source: int, header: dict[str, Any]) -> Sink:
        return Sink(self.store.incoming(), header)

    def _exchange(
        self,
        group: Any,
        outgoing: dict[int, Share | None],
        incoming: list[int],
        sink: Callable[[int, dict[str, Any]], Sink],
        paced: bool = True,
    ) -> dict[int, tuple[str | None, dict[str, Any]]]:
        rate = self.rate if paced else None
        return exchange(
            group,
            outgoing,
            incoming,
            sink,
            rate,
            timeout=self.timeout,
            transport=self.transport,
            sent_by=self.sent_by,
        )

    def _stop(self, error: BaseException | None) -> None:
        with self._wake:
            self._broken = error
            self._stopping = True
            if error is not None:
                _log.error("rank %d: replication stopped: %s", self.rank, error)
            while self._queue:
                _, share, future = self._queue.popleft()
                share.close()
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

    def close(self, timeout: float | None = None) -> None:
        """Replicates what every rank has queued, then stops the background rounds (a
        collective: the first rank to close ends every rank's rounds)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- recovering ----------------------------------------------------------------------------
    def recover(
        self,
        own: Iterable[int] | Mapping[int, str | None],
        fallback: Iterable[int] | Mapping[int, str | None],
        into: Callable[[int], str],
        *,
        step: int | None = None,
        check_own: Callable[[int], None] | None = None,
        set_aside_own: Callable[[int], None] | None = None,
    ) -> Recovery:
        """Agrees with every rank on the step to restore and brings this rank's share of it
        into ``into(step)`` from a peer's replica when this rank lacks it (collective).

        A replica is identified by its content (:func:`~fastckpt.distributed.replica_store.
        identity`, and the run that made it), never by its step number alone: it is used only
        where it is the step this rank committed (its own tier's or root's copy, when either
        is listed), it is verified (every CRC32C) by the rank that holds it before it is sent
        and by the rank that receives it before it is renamed into place. A copy that fails is
        left out and the ranks agree again: another holder, the root, or an older step.

        Args:
            own: the steps committed in this rank's own fast tier (with their identities).
            fallback: the steps this rank can read from elsewhere (the durable root), ditto.
            into: where a step recovered from a peer goes (a directory that must not exist;
                on the store's file system). It is renamed into place once every file is
                there and verified, the step's marker among them, so it is complete or absent.
            step: the step wanted (None: the newest every rank can get).
            check_own: raises when this rank's own copy of a step is damaged (verification).
            set_aside_own: moves a damaged own copy out of the way (a replica then lands).

        Returns:
            the step agreed on (None when no step is available to every rank), each rank's
            source, and the newer steps not every rank can get (``abandoned``).

        Raises:
            ValueError: the ranks asked for different steps (every rank raises, naming them).
            RuntimeError: no intact copy of the step remains for some rank (every rank raises,
                naming the ranks, the copies and why each failed).
        """
        started = time.perf_counter()
        every = self._gather(
            {
                "asked": step,
                "run": self.run,
                "own": identities(own),
                "fallback": identities(fallback),
                "held": self.store.held_identities(),
            }
        )
        check_same_request(every)
        bad: set[tuple[int, str]] = set()
        reasons: list[str] = []
        while True:
            chosen, plan, expected = choose(every, step, bad)
            if chosen is None:
                if reasons:
                    asked = "the newest step" if step is None else f"step {step}"
                    raise RuntimeError(
                        f"no intact copy of {asked} remains on every rank: " + "; ".join(reasons)
                    )
                return Recovery(None, [], time.perf_counter() - started)
            failed, size = self._bring(chosen, plan, expected, into, check_own, set_aside_own)
            if not failed:
                abandoned = unavailable_newer(every, chosen, bad)
                self._discard_replicas(abandoned)
                return Recovery(chosen, plan, time.perf_counter() - started, size, abandoned)
            for rank, source, text in failed:
                bad.add((rank, source))
                reasons.append(f"rank {rank}'s step {chosen} from {source}: {text}")
                _log.warning(
                    "rank %d: rank %d's copy of step %d (%s) is not used: %s",
                    self.rank,
                    rank,
                    chosen,
                    source,
                    text,
                )

    def agree(self, error: str | None) -> list[str]:
        """Every rank's error (``"rank <r>: <error>"``), gathered on every rank: the ranks
        go on together or fail together (a collective)."""
        return [f"rank {r}: {e}" for r, e in enumerate(self._gather(error)) if e is not None]

    def _gather(self, mine: Any) -> list[Any]:
        if self._recovery_group is None:
            return [mine]
        every: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(every, mine, group=self._recovery_group)
        return every

    def _bring(
        self,
        chosen: int,
        plan: list[str],
        expected: list[str | None],
        into: Callable[[int], str],
        check_own: Callable[[int], None] | None,
        set_aside_own: Callable[[int], None] | None,
    ) -> tuple[list[tuple[int, str, str]], int]:
        """One try at ``plan``: checks this rank's own copy, sends the verified replicas it
        holds, receives and verifies its own; returns every rank's failures (the same list
        on every rank) and the bytes this rank received."""
        failed: list[tuple[int, str, str]] = []
        if plan[self.rank] == "own" and check_own is not None:
            try:
                check_own(chosen)
            except (FastCkptError, OSError, ValueError) as exc:
                failed.append((self.rank, "own", f"{type(exc).__name__}: {exc}"))
                if set_aside_own is not None:
                    set_aside_own(chosen)
        outgoing: dict[int, Share | None] = {}
        for rank, source in enumerate(plan):
            if source == f"peer {self.rank}":
                try:
                    outgoing[rank] = self._verified_replica(rank, chosen, expected[rank])
                except (FastCkptError, OSError, ValueError, KeyError, TypeError) as exc:
                    outgoing[rank] = None  # an empty share: the receiver waits for nothing
                    failed.append((rank, source, f"{type(exc).__name__}: {exc}"))
        incoming = [int(plan[self.rank].split()[1])] if plan[self.rank].startswith("peer") else []
        size = 0
        try:
            try:
                received = self._exchange(
                    self._recovery_group,
                    outgoing,
                    incoming,
                    lambda source, header: Sink(self.store.landing(), header),
                    paced=False,  # a restore waits for it: as fast as the network goes
                )
            except Exception as exc:  # every rank hears of it below, and all go on or raise
                received = {}
                sent = [(r, f"peer {self.rank}") for r, s in outgoing.items() if s is not None]
                mine = [(self.rank, plan[self.rank])] if incoming else []
                failed += [(r, src, f"{type(exc).__name__}: {exc}") for r, src in sent + mine]
            for landed, header in received.values():
                if landed is None:
                    continue  # the holder reports why
                try:
                    self._land(landed, header, chosen, expected[self.rank], into)
                    size += sum(int(s) for _, s in header["files"])
                except (FastCkptError, OSError, ValueError, KeyError, TypeError) as exc:
                    remove_own_dir(landed)
                    failed.append((self.rank, plan[self.rank], f"{type(exc).__name__}: {exc}"))
        finally:
            for share in outgoing.values():
                if share is not None:
                    share.close()
        every = self._gather(failed)
        return [f for mine in every for f in mine], size

    def _verified_replica(self, rank: int, step: int, expected: str | None) -> Share:
        """The replica this rank holds of ``rank``'s ``step``, opened without following a
        link and verified (every CRC32C, and its identity ``expected``)."""
        info, fds = self.store.open_replica(rank, step)
        share = Share(
            {"step": step, "rank": rank, "node": info["node"], "files": info["files"]}, fds
        )
        try:
            if int(info["step"]) != step or int(info["rank"]) != rank:
                raise ValueError(f"its marker names rank {info['rank']}'s step {info['step']}")
            where = os.path.join(self.store.directory, f"from-rank-{rank:05d}", f"step-{step:012d}")
            verify_share([name for name, _ in info["files"]], fds, where, expected)
        except BaseException:
            share.close()
            raise
        return share

    def _land(
        self,
        landed: str,
        header: dict[str, Any],
        step: int,
        expected: str | None,
        into: Callable[[int], str],
    ) -> None:
        """Verifies a received step (data from elsewhere) and renames it into place."""
        if int(header["step"]) != step or int(header["rank"]) != self.rank:
            raise ValueError(f"received rank {header['rank']}'s step {header['step']}")
        names = [plain_name(name) for name, _ in header["files"]]
        fds: list[int] = []
        try:
            for name in names:
                fds.append(os.open(os.path.join(landed, name), os.O_RDONLY | os.O_NOFOLLOW))
            verify_share(names, fds, landed, expected)
        finally:
            for fd in fds:
                os.close(fd)
        os.rename(landed, into(step))

    def _discard_replicas(self, steps: list[int]) -> None:
        """Removes the replicas this rank holds of ``steps`` (set aside by every rank): a
        step number saved again later must never be restored from the old copy."""
        for rank, held in self.store.held().items():
            for step in held:
                if step in steps:
                    self.store.discard(rank, step, f"step {step} was set aside by every rank")
