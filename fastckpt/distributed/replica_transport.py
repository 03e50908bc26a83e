"""How a step's files move from one rank to another for replication and recovery.

Control messages (each share's header, and how its bytes will travel) go over the gloo
group; the bulk bytes go over a TCP connection per (sender, receiver) pair: the sender
listens on an ephemeral port and names it, with a random token, in the header it sends over
gloo; the receiver connects and sends the token back (a stranger's connection is closed),
and the sender's ``os.sendfile`` moves each committed file's pages straight from its open
descriptor to the socket: no user-space copy on the sending side, one ``recv_into`` a
reused buffer and one write on the receiving side. Where the receiver cannot connect (a
firewall, another network), both ranks agree on the gloo path for that pair instead: the
files read in :data:`CHUNK` pieces and sent with point-to-point messages.

Whatever the path, bytes are paced to the sender's ``rate`` (all its peers together), a
peer that stops for ``timeout`` seconds or closes its connection early fails the exchange,
naming the rank, the step and the file, and what was received is removed (never a torn
replica: a :class:`Sink` writes into a fresh directory that only a complete share leaves).

Example (the pieces a round is made of; moving bytes needs ranks):
    >>> import os, tempfile
    >>> directory = tempfile.mkdtemp()
    >>> with open(os.path.join(directory, "a.bin"), "wb") as f:
    ...     _ = f.write(b"abc")
    >>> share = open_share(7, 0, 0, directory, ["a.bin"])
    >>> share.header["files"], share.size
    ([['a.bin', 3]], 3)
    >>> share.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import secrets
import select
import socket
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastckpt.distributed.replica_store import plain_name, remove_own_dir

__all__ = ["CHUNK", "TRANSPORTS", "Share", "Sink", "exchange", "open_share"]

_log = logging.getLogger("fastckpt")

#: Bytes per point-to-point message of the gloo path, and per socket call of the TCP path.
CHUNK = 4 << 20
#: ``auto``: TCP for the bytes wherever the receiver can connect, else gloo; ``gloo``: gloo.
TRANSPORTS = ("auto", "gloo")
#: The least a paced sender sends at once, and a receiver wakes for: large socket calls
#: (each wakeup of the Python loop costs as much as copying tens of kilobytes), small bursts.
_PIECE = 1 << 20
_ACK = b"\x06"


@dataclasses.dataclass
class Share:
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


def open_share(step: int, rank: int, node: int, directory: str, names: Sequence[str]) -> Share:
    """Opens ``names`` of ``directory``: a share to send. Each is a plain name and a regular
    file, opened without following a link (``ELOOP``)."""
    fds, files = [], []
    try:
        for name in names:
            path = os.path.join(directory, plain_name(name))
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # (a FIFO: no wait)
            fds.append(fd)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(errno.EINVAL, "not a regular file: not replicated", path)
            files.append([name, info.st_size])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return Share({"step": step, "rank": rank, "node": node, "files": files}, fds)


class Sink:
    """Writes a share's byte stream into its files in a fresh directory (created with
    ``O_EXCL``: nothing there is overwritten or followed)."""

    def __init__(self, directory: str, header: dict[str, Any]):
        self.directory = directory
        self.header = header
        self.files = [(plain_name(name), int(size)) for name, size in header["files"]]
        self.total = sum(size for _, size in self.files)
        self.received = 0
        self._index, self._written, self._fd = 0, 0, -1
        self._next_file()

    @property
    def current(self) -> str:
        """The file being received (for errors)."""
        return self.files[min(self._index, len(self.files) - 1)][0] if self.files else "-"

    def _next_file(self) -> None:
        """Opens the file the next bytes belong to; every file is created, empty ones too."""
        while self._index < len(self.files):
            name, size = self.files[self._index]
            if self._fd < 0:
                path = os.path.join(self.directory, name)
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            if self._written < size:
                return
            os.close(self._fd)
            self._fd = -1
            self._index, self._written = self._index + 1, 0

    def write(self, data: memoryview) -> None:
        while len(data):
            name, size = self.files[self._index]
            done = os.write(self._fd, data[: size - self._written])
            self._written += done
            self.received += done
            data = data[done:]
            self._next_file()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Pacer:
    """Caps the bytes sent, all peers together, at ``rate`` a second (None: no cap)."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self.started = time.perf_counter()
        self.sent = 0

    def allowance(self) -> int:
        """Bytes that may be sent now: none until the sends are back on pace, then a piece
        of at least :data:`_PIECE` (at most :data:`CHUNK`)."""
        if self.rate is None:
            return CHUNK
        due = self.rate * (time.perf_counter() - self.started) - self.sent
        return 0 if due < 0 else min(CHUNK, int(due) + _PIECE)

    def wait(self) -> float:
        """Seconds until a send is allowed again."""
        if self.rate is None:
            return 0.0
        return max(0.0, self.sent / self.rate - (time.perf_counter() - self.started))


def exchange(
    group: Any,
    outgoing: dict[int, Share | None],
    incoming: list[int],
    sink: Callable[[int, dict[str, Any]], Sink],
    rate: float | None,
    *,
    timeout: float,
    transport: str = "auto",
    sent_by: dict[str, int] | None = None,
) -> dict[int, tuple[str | None, dict[str, Any]]]:
    """Sends each share of ``outgoing`` to its rank and receives one share from each rank of
    ``incoming``, concurrently; returns, per source, the directory its files were received
    into (None for an empty share) and its header. Every rank of a pair must call this in
    the same round. A failure removes what was received and raises (naming the peer, the
    step and the file). ``sent_by`` counts the bytes sent by ``"tcp"`` and by ``"gloo"``."""
    listener = _listen() if transport == "auto" and any(outgoing.values()) else None
    tokens = {dst: _Tokens() for dst, share in outgoing.items() if share and listener}
    headers = {dst: _header(share, listener, tokens.get(dst)) for dst, share in outgoing.items()}
    sinks: dict[int, Sink] = {}
    opened: list[socket.socket] = []
    try:
        received: dict[int, tuple[str | None, dict[str, Any]]] = {}
        for src, header in _swap(group, headers, incoming).items():
            received[src] = (None, header)
            if header.get("files") is not None:
                sinks[src] = sink(src, header)
                received[src] = (sinks[src].directory, header)
        sources = _connect_sources(sinks, timeout)
        opened += sources.values()
        sending = {dst: share for dst, share in outgoing.items() if share is not None}
        by_tcp = _swap_ways(group, sending, sinks, sources)
        wanted = {dst: tokens[dst] for dst in sending if by_tcp[dst]}
        destinations = _accept(listener, wanted, timeout)
        opened += destinations.values()
        streams: list[_Outgoing | _Incoming] = [
            _Outgoing(dst, sending[dst], conn) for dst, conn in destinations.items()
        ]
        streams += [_Incoming(src, sinks[src], conn) for src, conn in sources.items()]
        pacer = _Pacer(rate)
        _pump(streams, pacer, timeout)
        by_gloo = {dst: share for dst, share in sending.items() if not by_tcp[dst]}
        rest = {src: s for src, s in sinks.items() if src not in sources}
        _send_over_gloo(group, by_gloo, rest, pacer)
        for s in sinks.values():
            s.close()
            s.header.pop("tcp", None)  # (spent: the replica's marker records no address)
        if sent_by is not None:
            for dst, share in sending.items():
                way = "tcp" if by_tcp[dst] else "gloo"
                sent_by[way] = sent_by.get(way, 0) + share.size
    except BaseException:
        for s in sinks.values():
            s.close()
            remove_own_dir(s.directory)
        raise
    finally:
        for conn in opened:
            conn.close()
        if listener is not None:
            listener.close()
    return received


@dataclasses.dataclass
class _Tokens:
    """Random tokens a pair proves itself with (sent over gloo, so only the group knows
    them): the receiver's first bytes on the connection, then the sender's."""

    receiver: str = dataclasses.field(default_factory=lambda: secrets.token_hex(16))
    sender: str = dataclasses.field(default_factory=lambda: secrets.token_hex(16))


def _header(share: Share | None, listener: socket.socket | None, tokens: _Tokens | None) -> bytes:
    """What the receiver learns first: the files, and where to fetch their bytes by TCP."""
    if share is None:
        return json.dumps({"files": None}).encode()
    header = dict(share.header)
    if listener is not None and tokens is not None:
        host, port = listener.getsockname()[:2]
        header["tcp"] = [host, port, tokens.receiver, tokens.sender]
    return json.dumps(header).encode()


def _swap(group: Any, headers: dict[int, bytes], incoming: list[int]) -> dict[int, Any]:
    """Sends each header to its rank and receives one from each source, over gloo."""
    dist = torch.distributed
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    _wait(
        [
            dist.isend(torch.tensor([len(h)], dtype=torch.int64), d, group)
            for d, h in headers.items()
        ]
        + [dist.irecv(t, src, group) for src, t in lengths.items()]
    )
    raw = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in lengths.items()}
    _wait(
        [
            dist.isend(torch.frombuffer(bytearray(h), dtype=torch.uint8), d, group)
            for d, h in headers.items()
        ]
        + [dist.irecv(t, src, group) for src, t in raw.items()]
    )
    return {src: json.loads(bytes(t.numpy())) for src, t in raw.items()}


def _swap_ways(
    group: Any,
    sending: dict[int, Share],
    sinks: dict[int, Sink],
    connections: dict[int, socket.socket],
) -> dict[int, bool]:
    """Each receiver tells its sender, over gloo, whether it connected (TCP) or not (gloo);
    returns, per destination, whether its bytes go by TCP."""
    dist = torch.distributed
    answers = {dst: torch.zeros(1, dtype=torch.int64) for dst in sending}
    _wait(
        [dist.isend(torch.tensor([int(s in connections)]), s, group) for s in sinks]
        + [dist.irecv(t, dst, group) for dst, t in answers.items()]
    )
    return {dst: bool(t.item()) for dst, t in answers.items()}


def _own_address() -> str:
    """The address this host reaches the group's master from (the interface its peers
    reach it on); loopback for a run on one machine."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, 9))  # (a datagram socket sends nothing on connect)
        return str(probe.getsockname()[0])
    return "127.0.0.1"


def _listen() -> socket.socket | None:
    """A listening socket on an ephemeral port (None where none can be opened: gloo then)."""
    try:
        listener = socket.create_server((_own_address(), 0), backlog=64)
    except OSError as exc:
        _log.warning("replication sends over gloo: no socket to listen on (%s)", exc)
        return None
    return listener


def _connect_sources(sinks: dict[int, Sink], timeout: float) -> dict[int, socket.socket]:
    """Connects to each source that named a TCP address and sends its token; a source that
    cannot be reached is left out (its bytes then come over gloo)."""
    connections: dict[int, socket.socket] = {}
    for src, sink in sinks.items():
        where = sink.header.get("tcp")
        if not where:
            continue
        host, port, token = str(where[0]), int(where[1]), str(where[2])
        try:
            conn = socket.create_connection((host, port), timeout=min(timeout, 10.0))
            conn.sendall(token.encode())  # (the sender's own token is checked as data comes)
        except OSError as exc:
            _log.warning(
                "replication from rank %d goes over gloo: %s:%d cannot be reached (%s)",
                src,
                host,
                port,
                exc,
            )
            continue
        conn.setblocking(False)
        connections[src] = conn
    return connections


def _accept(
    listener: socket.socket | None, tokens: dict[int, _Tokens], timeout: float
) -> dict[int, socket.socket]:
    """The connection of each destination, told by its token (they connected before they
    answered over gloo, so they are waiting), answered with the sender's token; a
    connection with another token is closed."""
    accepted: dict[int, socket.socket] = {}
    if not tokens or listener is None:
        return accepted
    owner = {t.receiver.encode(): dst for dst, t in tokens.items()}
    deadline = time.monotonic() + timeout
    try:
        while len(accepted) < len(tokens):
            listener.settimeout(max(0.0, deadline - time.monotonic()))
            conn, peer = listener.accept()
            conn.settimeout(min(timeout, 10.0))
            try:
                token = _read_exactly(conn, 32)
            except OSError:
                token = b""
            dst = owner.pop(token, None)
            if dst is None:
                _log.warning("replication: a connection from %s without a token was closed", peer)
                conn.close()
                continue
            conn.sendall(tokens[dst].sender.encode())
            conn.setblocking(False)
            accepted[dst] = conn
    except TimeoutError:
        waiting = sorted(owner.values())
        for conn in accepted.values():
            conn.close()
        raise TimeoutError(
            f"ranks {waiting} did not connect for their replication bytes within {timeout:g} s"
        ) from None
    return accepted


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            break
        data += more
    return data


class _Outgoing:
    """A share's files going to one rank over its socket, by ``sendfile`` (no user-space
    copy), then the receiver's one-byte acknowledgement."""

    def __init__(self, rank: int, share: Share, conn: socket.socket):
        self.rank, self.share, self.conn = rank, share, conn
        self.spans = [(fd, int(size)) for fd, (_, size) in zip(share.fds, share.header["files"])]
        self.index, self.offset, self.done = 0, 0, False
        self._skip_empty()

    @property
    def sending(self) -> bool:
        return self.index < len(self.spans)

    def where(self) -> str:
        step, files = self.share.header["step"], self.share.header["files"]
        name = files[min(self.index, len(files) - 1)][0] if files else "-"
        return f"rank {self.rank} (step {step}, file {name})"

    def _skip_empty(self) -> None:
        while self.sending and self.offset == self.spans[self.index][1]:
            self.index, self.offset = self.index + 1, 0

    def send(self, limit: int) -> int:
        """Sends up to ``limit`` bytes; returns how many."""
        fd, size = self.spans[self.index]
        try:
            done = os.sendfile(self.conn.fileno(), fd, self.offset, min(limit, size - self.offset))
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise ConnectionError(
                exc.errno, f"sending to {self.where()} failed after {self.offset} bytes: {exc}"
            ) from exc
        if done == 0:
            raise OSError(f"the file sent to {self.where()} shrank while it was sent")
        self.offset += done
        self._skip_empty()
        return done

    def receive(self) -> None:
        """Reads the acknowledgement, once every byte is sent."""
        try:
            answer = self.conn.recv(1)
        except BlockingIOError:
            return
        except OSError as exc:
            raise ConnectionError(exc.errno, f"{self.where()}: {exc}") from exc
        if answer != _ACK:
            raise ConnectionError(f"{self.where()} closed before confirming its bytes")
        self.done = True


class _Incoming:
    """A share's byte stream from one rank's socket into its :class:`Sink`."""

    def __init__(self, rank: int, sink: Sink, conn: socket.socket):
        self.rank, self.sink, self.conn = rank, sink, conn
        self.buffer = memoryview(bytearray(min(CHUNK, max(sink.total, 64))))
        self.token = str(sink.header["tcp"][3]).encode()  # the sender's, before its bytes
        self.proven = b""
        self.done = self.sending = False
        self.lowat = 0
        self._wake_for_pieces()

    def _wake_for_pieces(self) -> None:
        """Lets poll wake this receiver only once a piece has arrived (or the rest)."""
        rest = len(self.token) - len(self.proven) + self.sink.total - self.sink.received
        lowat = max(1, min(_PIECE, rest))
        if lowat != self.lowat:
            self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self.lowat = lowat

    def where(self) -> str:
        step = self.sink.header.get("step")
        return f"rank {self.rank} (step {step}, file {self.sink.current})"

    def receive(self) -> None:
        proving = len(self.proven) < len(self.token)
        if proving:
            want = len(self.token) - len(self.proven)
        else:
            want = min(len(self.buffer), self.sink.total - self.sink.received)
        try:
            got = self.conn.recv_into(self.buffer, want)
        except BlockingIOError:
            return
        except OSError as exc:
            raise ConnectionError(exc.errno, f"receiving from {self.where()}: {exc}") from exc
        if got == 0:
            raise ConnectionError(
                f"{self.where()} closed its connection after {self.sink.received} of "
                f"{self.sink.total} bytes: the partial replica is removed"
            )
        if proving:
            self.proven += bytes(self.buffer[:got])
            if not self.token.startswith(self.proven):
                raise ConnectionError(f"{self.where()}: the connection is not the sender's")
        else:
            self.sink.write(self.buffer[:got])
        if self.proven == self.token and self.sink.received == self.sink.total:
            self._acknowledge()
            self.done = True
        else:
            self._wake_for_pieces()

    def _acknowledge(self) -> None:
        with contextlib.suppress(OSError):  # (a sender gone now has sent every byte)
            self.conn.setblocking(True)
            self.conn.sendall(_ACK)


def _pump(streams: Sequence[_Outgoing | _Incoming], pacer: _Pacer, timeout: float) -> None:
    """Moves every stream's bytes until all are done: sends where sockets take them and the
    pace allows, receives where bytes wait; raises when none moves for ``timeout`` s."""
    progress = time.monotonic()
    while True:
        active = [s for s in streams if not s.done]
        if not active:
            return
        allowed = pacer.allowance()
        poll = select.poll()
        for s in active:
            writing = s.sending and allowed > 0
            if writing or not s.sending:
                poll.register(s.conn, select.POLLOUT if writing else select.POLLIN)
        pause = 0.2 if allowed > 0 else min(0.2, max(pacer.wait(), 0.001))
        ready = {fd for fd, _ in poll.poll(pause * 1000)}
        for s in active:
            if s.conn.fileno() not in ready:
                continue
            if isinstance(s, _Outgoing) and s.sending:
                sent = s.send(pacer.allowance())
                pacer.sent += sent
            else:
                s.receive()
            progress = time.monotonic()
        if time.monotonic() - progress > timeout:
            stuck = ", ".join(s.where() for s in active)
            raise TimeoutError(f"replication made no progress for {timeout:g} s with {stuck}")


def _send_over_gloo(
    group: Any, outgoing: dict[int, Share], sinks: dict[int, Sink], pacer: _Pacer
) -> None:
    """The gloo path: each share read in :data:`CHUNK` pieces into a reused buffer and sent
    with point-to-point messages (the same share to several ranks is read once a chunk)."""
    dist = torch.distributed
    by_share: dict[int, tuple[Share, list[int]]] = {}
    for dst, share in outgoing.items():
        by_share.setdefault(id(share), (share, []))[1].append(dst)
    readers = [(_Reader(share), dsts) for share, dsts in by_share.values()]
    buffers = {src: torch.empty(CHUNK, dtype=torch.uint8) for src in sinks}
    chunks = max(
        [-(-r.total // CHUNK) for r, _ in readers] + [-(-s.total // CHUNK) for s in sinks.values()],
        default=0,
    )
    for i in range(chunks):
        works, writes = [], []
        for reader, dsts in readers:
            piece = reader.chunk(i)
            if piece is not None:
                works += [dist.isend(piece, dst, group) for dst in dsts]
                pacer.sent += piece.numel() * len(dsts)
        for src, s in sinks.items():
            n = min(CHUNK, s.total - i * CHUNK)
            if n > 0:
                works.append(dist.irecv(buffers[src][:n], src, group))
                writes.append((src, n))
        _wait(works)
        for src, n in writes:
            sinks[src].write(buffers[src].numpy().data[:n])
        time.sleep(pacer.wait())  # paced by what was sent so far, not per chunk


class _Reader:
    """Reads a share's files as one stream, chunk by chunk, into a reused buffer."""

    def __init__(self, share: Share):
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


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()
