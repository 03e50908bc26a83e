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
(:func:`~fastckpt.distributed.peers.choose_peers`) and receives its sources' files, in
chunks of :data:`CHUNK` bytes with point-to-point sends on the replication group, paced to
``bytes_per_second``. A rank that lacks that step (its save failed) sends an empty share.
Older queued steps are dropped: replication keeps up with the newest step, not every step.
Received files land in the :class:`~fastckpt.distributed.replica_store.ReplicaStore`,
committed by their own marker only once complete.

**Recovery.** :meth:`~Replicator.recover` gathers from every rank what it holds (its own
committed steps, the steps it can fall back to in the durable root, the replicas it keeps
for others), picks the newest step that every rank can get from somewhere (or the one
asked for), and sends each rank that lacks it in its own fast tier the replica a peer
holds; the receiving rank assembles the files beside its store and renames the directory
into place, with the step's own marker written last, so a step recovered half is never
committed.

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
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fastckpt.distributed.groups import in_group, node_rank
from fastckpt.distributed.peers import choose_peers, failure_domain
from fastckpt.distributed.replica_store import ReplicaStore, plain_name, remove_own_dir

__all__ = ["CHUNK", "Recovery", "Replicator"]

_log = logging.getLogger("fastckpt")

#: Bytes per point-to-point message (one per peer in flight at a time).
CHUNK = 4 << 20
#: The file in the store that names this rank's newest step its peers hold.
REPLICATED = "REPLICATED"
#: Steps queued beyond the one in flight; older ones are dropped (replication follows the newest).
QUEUED = 2


@dataclasses.dataclass
class _Share:
    """One rank's files of one step, opened: what a round or a recovery sends."""

    header: dict[str, Any]
    fds: list[int]

    @property
    def size(self) -> int:
        return sum(size for _, size in self.header["files"])

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


@dataclasses.dataclass
class Recovery:
    """What :meth:`Replicator.recover` did: the step agreed on (None: nothing anywhere),
    and where each rank gets it from (``"own"``, ``"peer <rank>"``, ``"fallback"``)."""

    step: int | None
    sources: list[str]
    seconds: float = 0.0
    bytes_received: int = 0


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
        timeout_seconds: how long a collective of replication waits for a peer.

    Raises:
        ValueError: ``replicas`` is negative or not below the number of nodes (naming it),
            or ``bytes_per_second`` is not positive.
    """

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        replicas: int = 1,
        bytes_per_second: float | None = None,
        timeout_seconds: float = 1800.0,
    ):
        if bytes_per_second is not None and not bytes_per_second > 0:
            raise ValueError(f"bytes_per_second must be positive, got {bytes_per_second!r}")
        self.rate = bytes_per_second
        dist = torch.distributed
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if in_group() else (0, 1)
        self._group = self._recovery_group = None
        nodes, domains = [node_rank()], [failure_domain()]
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
        self.seconds_sending = 0.0
        self.cpu_seconds = 0.0
        self._queue: collections.deque[tuple[int, _Share, concurrent.futures.Future[Any]]] = (
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
        share = _open_share(step, self.rank, self.nodes[self.rank], directory, names)
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
                outgoing: dict[int, _Share | None] = dict.fromkeys(self.targets, share)
                received = _exchange(self._group, outgoing, self.sources, self._receive, self.rate)
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
            with open(os.path.join(self.store.directory, REPLICATED)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _record_replicated(self, step: int) -> None:
        path = os.path.join(self.store.directory, REPLICATED)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(str(step))
        os.rename(temporary, path)
        if self.on_replicated is not None:
            self.on_replicated(step)

    def _receive(self, source: int, header: dict[str, Any]) -> _Sink:
        return _Sink(self.store.incoming(), header)

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
        own: Iterable[int],
        fallback: Iterable[int],
        into: Callable[[int], str],
        *,
        step: int | None = None,
    ) -> Recovery:
        """Agrees with every rank on the step to restore and brings this rank's share of it
        into ``into(step)`` from a peer's replica when this rank lacks it (collective).

        Args:
            own: the steps committed in this rank's own fast tier.
            fallback: the steps this rank can read from elsewhere (the durable root).
            into: where a step recovered from a peer goes (a directory that must not exist;
                on the store's file system). It is renamed into place once every file is
                there, the step's marker among them, so it is complete or absent.
            step: the step wanted (None: the newest every rank can get).

        Returns:
            the step agreed on (None when no step is available to every rank) and each
            rank's source.

        Raises:
            RuntimeError: a peer's transfer failed (every rank raises, naming the ranks).
        """
        started = time.perf_counter()
        mine = {"own": sorted(set(own)), "fallback": sorted(set(fallback))}
        mine["held"] = self.store.held()  # type: ignore[assignment]
        every: list[Any] = [mine]
        if self._recovery_group is not None:
            every = [None] * self.world
            torch.distributed.all_gather_object(every, mine, group=self._recovery_group)
        held = [{int(r): set(s) for r, s in e["held"].items()} for e in every]

        def sources_of(candidate: int) -> list[str] | None:
            plan, load = [], collections.Counter[int]()
            for rank, info in enumerate(every):
                if candidate in info["own"]:
                    plan.append("own")
                    continue
                holders = [h for h in range(len(every)) if candidate in held[h].get(rank, ())]
                if holders:  # the least loaded holder sends (spreads a lost node's ranks)
                    holder = min(holders, key=lambda h: (load[h], h))
                    load[holder] += 1
                    plan.append(f"peer {holder}")
                elif candidate in info["fallback"]:
                    plan.append("fallback")
                else:
                    return None
            return plan

        wanted = (
            [step]
            if step is not None
            else sorted(
                {s for e in every for s in (*e["own"], *e["fallback"])}
                | {s for h in held for steps in h.values() for s in steps},
                reverse=True,
            )
        )
        chosen, plan = None, None
        for candidate in wanted:
            plan = sources_of(candidate)
            if plan is not None:
                chosen = candidate
                break
        if chosen is None or plan is None:
            return Recovery(None, [], time.perf_counter() - started)
        outgoing: dict[int, _Share | None] = {}
        for rank, source in enumerate(plan):
            if source == f"peer {self.rank}":
                outgoing[rank] = _replica_share(self.store, rank, chosen)
        incoming = [int(plan[self.rank].split()[1])] if plan[self.rank].startswith("peer") else []
        error: BaseException | None = None
        received: dict[int, tuple[str | None, dict[str, Any]]] = {}
        try:
            received = _exchange(
                self._recovery_group,
                outgoing,
                incoming,
                lambda source, header: _Sink(self.store.landing(), header),
                None,
            )
            for landed, _ in received.values():
                if landed is not None:
                    os.rename(landed, into(chosen))
        except Exception as exc:
            error = exc
        finally:
            for share in outgoing.values():
                if share is not None:
                    share.close()
        failed = [error is not None]
        if self._recovery_group is not None:
            flags: list[Any] = [None] * self.world
            text = f"{type(error).__name__}: {error}" if error is not None else None
            torch.distributed.all_gather_object(flags, text, group=self._recovery_group)
            failures = [f"rank {r}: {t}" for r, t in enumerate(flags) if t is not None]
            failed = [bool(failures)]
            if failures and error is None:
                raise RuntimeError(f"recovering step {chosen} from peers failed: {failures}")
        if error is not None:
            raise error
        assert not failed[0]
        size = sum(sum(s for _, s in info["files"]) for _, info in received.values())
        return Recovery(chosen, plan, time.perf_counter() - started, size)


class _Sink:
    """Writes a share's byte stream into its files in a fresh directory."""

    def __init__(self, directory: str, header: dict[str, Any]):
        self.directory = directory
        self.header = header
        self.files = [(plain_name(name), int(size)) for name, size in header["files"]]
        self._index, self._written, self._fd = 0, 0, -1
        self._next_file()

    def _next_file(self) -> None:
        while self._index < len(self.files) and self._written == self.files[self._index][1]:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
            self._index, self._written = self._index + 1, 0
        if self._index < len(self.files) and self._fd < 0:
            name = self.files[self._index][0]
            self._fd = os.open(
                os.path.join(self.directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
            )
            self._next_file()  # (an empty file is complete once created)

    def write(self, data: memoryview) -> None:
        while len(data):
            name, size = self.files[self._index]
            part = data[: size - self._written]
            done = os.write(self._fd, part)
            self._written += done
            data = data[done:]
            self._next_file()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_share(step: int, rank: int, node: int, directory: str, names: Sequence[str]) -> _Share:
    fds, files = [], []
    try:
        for name in names:
            fd = os.open(os.path.join(directory, plain_name(name)), os.O_RDONLY | os.O_NOFOLLOW)
            fds.append(fd)
            files.append([name, os.fstat(fd).st_size])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return _Share({"step": step, "rank": rank, "node": node, "files": files}, fds)


def _replica_share(store: ReplicaStore, rank: int, step: int) -> _Share:
    info = store.info(rank, step)
    directory = os.path.dirname(store.files(rank, step)[0][1]) if info["files"] else ""
    return _open_share(step, rank, info["node"], directory, [n for n, _ in info["files"]])


def _exchange(
    group: Any,
    outgoing: dict[int, _Share | None],
    incoming: list[int],
    sink: Callable[[int, dict[str, Any]], _Sink],
    rate: float | None,
) -> dict[int, tuple[str | None, dict[str, Any]]]:
    """Sends each share of ``outgoing`` to its rank and receives one share from each rank of
    ``incoming``, concurrently, chunk by chunk; returns, per source, the directory its files
    were received into (None for an empty share) and its header. Every rank of a pair must
    call this in the same round. A failure removes what was received and raises."""
    dist = torch.distributed
    absent = {"files": None}
    headers = {
        dst: json.dumps(share.header if share is not None else absent).encode()
        for dst, share in outgoing.items()
    }
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    _wait(
        [
            dist.isend(torch.tensor([len(h)], dtype=torch.int64), dst, group)
            for dst, h in headers.items()
        ]
        + [dist.irecv(t, src, group) for src, t in lengths.items()]
    )
    raw = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in lengths.items()}
    _wait(
        [
            dist.isend(torch.frombuffer(bytearray(h), dtype=torch.uint8), dst, group)
            for dst, h in headers.items()
        ]
        + [dist.irecv(t, src, group) for src, t in raw.items()]
    )
    received: dict[int, tuple[str | None, dict[str, Any]]] = {}
    sinks: dict[int, _Sink] = {}
    try:
        for src, t in raw.items():
            header = json.loads(bytes(t.numpy()))
            if header.get("files") is None:
                received[src] = (None, header)
            else:
                sinks[src] = sink(src, header)
                received[src] = (sinks[src].directory, header)
        # the same share going to several ranks is read once per chunk
        by_share: dict[int, tuple[_Share, list[int]]] = {}
        for dst, share in outgoing.items():
            if share is not None:
                by_share.setdefault(id(share), (share, []))[1].append(dst)
        readers = [(_Reader(share), dsts) for share, dsts in by_share.values()]
        totals = {src: sum(size for _, size in s.files) for src, s in sinks.items()}
        buffers = {src: torch.empty(CHUNK, dtype=torch.uint8) for src in sinks}
        chunks = max(
            [-(-r.total // CHUNK) for r, _ in readers] + [-(-n // CHUNK) for n in totals.values()],
            default=0,
        )
        started, sent = time.perf_counter(), 0
        for i in range(chunks):
            works, writes = [], []
            for reader, dsts in readers:
                piece = reader.chunk(i)
                if piece is not None:
                    works += [dist.isend(piece, dst, group) for dst in dsts]
                    sent += piece.numel() * len(dsts)
            for src, total in totals.items():
                n = min(CHUNK, total - i * CHUNK)
                if n > 0:
                    works.append(dist.irecv(buffers[src][:n], src, group))
                    writes.append((src, n))
            _wait(works)
            for src, n in writes:
                sinks[src].write(buffers[src].numpy().data[:n])
            if rate is not None:  # paced by what was sent so far, not per chunk
                ahead = sent / rate - (time.perf_counter() - started)
                if ahead > 0:
                    time.sleep(ahead)
        for reader, _ in readers:
            reader.close()
        for s in sinks.values():
            s.close()
    except BaseException:
        for s in sinks.values():
            s.close()
            remove_own_dir(s.directory)
        raise
    return received


class _Reader:
    """Reads a share's files as one stream, chunk by chunk, into a reused buffer."""

    def __init__(self, share: _Share):
        self.share = share
        self.total = share.size
        self.buffer = torch.empty(CHUNK, dtype=torch.uint8)
        self._spans: list[tuple[int, int, int]] = []  # (stream offset, fd, size)
        offset = 0
        for fd, (_, size) in zip(share.fds, share.header["files"]):
            self._spans.append((offset, fd, size))
            offset += size

    def chunk(self, i: int) -> torch.Tensor | None:
        start = i * CHUNK
        end = min(start + CHUNK, self.total)
        if start >= end:
            return None
        view = self.buffer.numpy().data
        for offset, fd, size in self._spans:
            lo, hi = max(start, offset), min(end, offset + size)
            while lo < hi:
                done = os.preadv(fd, [view[lo - start : hi - start]], lo - offset)
                if done == 0:
                    raise OSError(f"file of step {self.share.header['step']} shrank while sent")
                lo += done
        return self.buffer[: end - start]

    def close(self) -> None:
        pass


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()
