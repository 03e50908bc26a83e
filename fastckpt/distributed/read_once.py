"""Read once, share: the ranks of a group read each unique byte of a checkpoint from storage
once between them, and deliver each rank the tensors it asked for over collectives.

A load on N ranks of a replicated model otherwise reads the checkpoint N times: N times the
storage traffic, on the one resource (a shared filer, a node's link) that every rank waits
on. Here the ranks first agree on what is wanted and on what they opened: one
``all_gather_object`` of each rank's names and one digest of the checkpoint's structure and
of the content identity of every file behind it (:func:`files_behind`: each file's CRC32C,
XXH3 and piece tables, or its whole header when it records no checksums). Ranks that opened
different checkpoints (two steps of a run with the same shapes, or a file saved over the
path between their opens) all stop with an error naming the ranks and the file that differ,
instead of exchanging a mix of both. The union is cut into **stripes balanced by
bytes**, one per rank, contiguous in file order (:func:`plan_pieces`); each stripe into
**pieces** of a bounded size. In round ``r`` every rank reads its ``r``-th piece with the
ordinary read path (parallel reads, checksums verified as read), then each piece goes from
its reader to the ranks that need it: one ``broadcast`` when every rank does, point-to-point
sends otherwise (a resharded load). Reads of round ``r + 1`` run on a background thread while
round ``r`` is broadcast, so storage and network overlap; memory in flight is the pieces of
two rounds.

Stripes are made of whole tensors, because checksums are per tensor: every tensor is
verified by the rank that read it, where its bytes came off storage, and the bytes that
travel are the verified ones (gloo runs over TCP, whose own checksum guards the transfer).
A tensor larger than a rank's share of the bytes makes the stripes uneven; it is still
read once.

Before each round's transfers the ranks agree that every read of the round succeeded
(:func:`~fastckpt.distributed.agreement.raise_everywhere`): a damaged tensor raises
``ChecksumError`` naming it on every rank, not only on the one that read it.

Example (the plan: three ranks, tensors of 10, 10, 40 and 20 bytes):
    >>> for p in plan_pieces([("a", 10), ("b", 10), ("c", 40), ("d", 20)], 3, piece_bytes=128):
    ...     p.owner, p.round, p.names, p.offsets
    (0, 0, ('a', 'b'), (0, 64))
    (1, 0, ('c',), (0,))
    (2, 0, ('d',), (0,))
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastckpt.checkpoint import content_identity
from fastckpt.checkpoint.chained_reader import ChainedReader
from fastckpt.checkpoint.header_view import HeaderView
from fastckpt.checkpoint.reader import Reader
from fastckpt.checkpoint.tensor_runs import arena_exporter, own_bytes
from fastckpt.config import staging_bytes
from fastckpt.distributed.agreement import agree, raise_everywhere
from fastckpt.io.aligned_memory import aligned_tensor

__all__ = [
    "FileRecord",
    "Piece",
    "agree_on_checkpoint",
    "files_behind",
    "plan_pieces",
    "piece_size",
    "share_reads",
]

#: Where a tensor starts in a piece: a multiple of this (every dtype's alignment, a cache line).
PLACE_ALIGNMENT = 64
#: Bounds of a piece: small ones pay a collective each, large ones hold memory in flight.
MIN_PIECE = 4 << 20
MAX_PIECE = 64 << 20
#: Tensors of this many bytes or more are read straight into a piece's memory.
DIRECT_READ = 1 << 20

#: ``deliver(stored name, tensor)``: a tensor this rank asked for, in a piece's memory (valid
#: as long as the caller keeps it; the piece is freed with its last tensor).
Deliver = Callable[[str, torch.Tensor], None]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Whole tensors that one rank (``owner``) reads in round ``round`` and sends on;
    ``offsets`` are where each tensor's bytes lie in the piece's ``nbytes`` of memory."""

    owner: int
    round: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: int


def piece_size(world: int) -> int:
    """Bytes per piece: the staging budget shared by the pieces of one round, within
    [4 MiB, 64 MiB].

    Example:
        >>> piece_size(2) <= 64 << 20, piece_size(1024) == 4 << 20
        (True, True)
    """
    return max(MIN_PIECE, min(MAX_PIECE, staging_bytes() // max(world, 1)))


def plan_pieces(
    sizes: Sequence[tuple[str, int]], world: int, *, piece_bytes: int | None = None
) -> list[Piece]:
    """The pieces of tensors ``sizes`` (name, bytes; in the order to read them) over
    ``world`` ranks: rank ``k`` reads the tensors whose middle byte falls in the ``k``-th
    ``1/world`` of all the bytes (a contiguous stripe of about ``total / world`` bytes), cut
    into pieces of at most ``piece_bytes`` (a larger tensor is a piece of its own). Pieces
    are listed by round, then rank.

    Example:
        >>> [(p.owner, p.round, p.names) for p in plan_pieces([("a", 8), ("b", 8)], 1, piece_bytes=8)]
        [(0, 0, ('a',)), (0, 1, ('b',))]
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    limit = piece_size(world) if piece_bytes is None else piece_bytes
    total = sum(n for _, n in sizes)
    stripes: list[list[tuple[str, int]]] = [[] for _ in range(world)]
    start = 0
    for index, (name, nbytes) in enumerate(sizes):
        if total:
            owner = min(world - 1, (2 * start + nbytes) * world // (2 * total))
        else:  # nothing but empty tensors: spread them by count
            owner = index * world // len(sizes)
        stripes[owner].append((name, nbytes))
        start += nbytes
    pieces: list[Piece] = []
    for owner, stripe in enumerate(stripes):
        names: list[str] = []
        offsets: list[int] = []
        end = 0
        for name, nbytes in stripe:
            at = -(-end // PLACE_ALIGNMENT) * PLACE_ALIGNMENT
            if names and at + nbytes > limit:
                pieces.append(_piece(owner, pieces, names, offsets, end))
                names, offsets, at = [], [], 0
            names.append(name)
            offsets.append(at)
            end = at + nbytes
        if names:
            pieces.append(_piece(owner, pieces, names, offsets, end))
    return sorted(pieces, key=lambda p: (p.round, p.owner))


def _piece(owner: int, made: list[Piece], names: list[str], offsets: list[int], end: int) -> Piece:
    rounds = sum(1 for p in made if p.owner == owner)
    return Piece(owner, rounds, tuple(names), tuple(offsets), end)


def stored_names(reader: Reader, names: Sequence[str] | None) -> list[str]:
    """The stored tensors behind ``names`` (all when None), aliases resolved, each once."""
    aliases = reader.aliases
    if names is None:
        return [n for n in reader.offset_keys() if n not in aliases]
    if isinstance(names, str):
        raise TypeError("names must be a sequence of str, not a str")
    return list(dict.fromkeys(aliases.get(n, n) for n in names))


def _fingerprint(reader: Reader, names: Sequence[str]) -> str:
    """The structure: the names, dtypes, shapes and sizes of the tensors, and the aliases."""
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        info = reader.info(name)
        digest.update(f"{name}|{info.dtype}|{info.shape}|{info.nbytes}\n".encode())
    digest.update(repr(sorted(reader.aliases.items())).encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file behind a reader, as the ranks compare it: ``role`` (``"file"``, ``"shard
    model-00002-of-00004.safetensors"``, ``"chain file 2"``), its path, its content identity
    (:mod:`~fastckpt.checkpoint.content_identity`: kind and digest) and, for messages only,
    where it lies on this rank (device, inode and size: copies of one checkpoint differ
    there and still agree)."""

    role: str
    path: str
    kind: str
    digest: str
    where: str


def files_behind(reader: Reader) -> list[FileRecord]:
    """The files whose headers ``reader`` answers from, in an order every rank that opened
    the same checkpoint shares: the file itself; each shard of a sharded directory; each
    file of an incremental chain (the top, then its bases, depth first). A reader that
    opens its files only when it reads them (a DCP checkpoint's rank files) lists none: its
    ranks agree on what its caller describes (the rank files' names carry their save's id).

    Example:
        >>> import os, tempfile, torch
        >>> from fastckpt.checkpoint.read import open_checkpoint
        >>> from fastckpt.checkpoint.save import save
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> save({"w": torch.zeros(3)}, path)
        >>> with open_checkpoint(path) as r:
        ...     [(f.role, f.kind) for f in files_behind(r)]
        [('file', 'checksums')]
    """
    found: list[FileRecord] = []
    _collect(reader, "file", found, set())
    return found


def _collect(reader: Any, role: str, found: list[FileRecord], seen: set[int]) -> None:
    if id(reader) in seen:  # a base reached along two paths: once
        return
    seen.add(id(reader))
    if isinstance(reader, ChainedReader):
        _collect(reader.top, f"chain file {len(found) + 1}", found, seen)
        for base in reader.bases:
            _collect(base, f"chain file {len(found) + 1}", found, seen)
    elif isinstance(reader, HeaderView):
        kind, digest = content_identity.of_view(reader)
        found.append(FileRecord(role, reader.path, kind, digest, _where(reader)))
    elif callable(getattr(reader, "shard_headers", None)):
        for header in reader.shard_headers():
            name = header.path.rstrip("/").rsplit("/", 1)[-1]
            _collect(header, f"shard {name}", found, seen)


def _where(view: Any) -> str:
    """Device, inode and size of the file a local reader holds open, for a message; empty
    for a URL or a header kept after its file was closed (the path may name another file
    by now)."""
    storage = getattr(view, "storage", None)
    if storage is None or getattr(storage, "ranged", True):
        return ""
    try:
        st = os.fstat(storage.local_file().fd)
    except (OSError, ValueError):  # closed meanwhile
        return ""
    return f"device {st.st_dev}, inode {st.st_ino}, {st.st_size} bytes"


def _identity(reader: Reader, files: list[FileRecord]) -> str:
    """One digest of what the ranks must agree on: the structure and each file's content
    identity, in order (not the paths: copies of a checkpoint may lie at other paths)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(_fingerprint(reader, stored_names(reader, None)).encode())
    for f in files:
        digest.update(f"{f.kind}:{f.digest}\n".encode())
    return digest.hexdigest()


def _differing_checkpoints(
    records: list[tuple[str, str, list[FileRecord]]], what: str
) -> ValueError:
    """The error every rank raises when the ranks' identities differ: the ranks that differ
    from rank 0, and for the first of them the file that differs (both ranks' paths, and
    where each lies) or that the structures differ."""
    identity0, path0, files0 = records[0]
    different = [r for r, (identity, _, _) in enumerate(records) if identity != identity0]
    rank = different[0]
    _, path, files = records[rank]
    detail = _first_difference(files0, files, rank)
    if detail is None:
        detail = (
            f"rank 0 opened {path0}, rank {rank} {path}, whose tensors' names, dtypes, shapes, "
            "aliases or files differ"
        )
    return ValueError(
        f"ranks {different} of the group opened a checkpoint that differs from rank 0's "
        f"({what}): {detail}; a shared read needs the same checkpoint on every rank: open it "
        "again on every rank, once any save to its path has completed"
    )


def _first_difference(files0: list[FileRecord], files: list[FileRecord], rank: int) -> str | None:
    """The first file (in order) whose content differs between rank 0 and ``rank``."""
    for a, b in zip(files0, files):
        if (a.kind, a.digest) != (b.kind, b.digest):
            table = "CRC32C/XXH3 tables" if a.kind == "checksums" == b.kind else "headers"
            return (
                f"{a.role}: rank 0 opened {a.path} ({_described(a)}), rank {rank} {b.path} "
                f"({_described(b)}): their {table} differ"
            )
    return None


def _described(f: FileRecord) -> str:
    kind = "checksums" if f.kind == "checksums" else "no checksums: header"
    return f"{f.where}; {kind} {f.digest[:12]}" if f.where else f"{kind} {f.digest[:12]}"


def agree_on_checkpoint(reader: Reader, group: Any, what: str) -> None:
    """A collective: returns on every rank of ``group`` when every rank opened the same
    checkpoint in ``reader`` (the same structure and content identity of every file behind
    it: :func:`files_behind`); else raises ``ValueError`` on every rank, naming the ranks
    that differ and the file where they do (both ranks' paths)."""
    files = agree(lambda: files_behind(reader), group, f"identifying {reader.path}")
    identity = _identity(reader, files)
    summaries: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(summaries, identity, group=group)
    _check_identities(summaries, reader, files, group, what)


def _check_identities(
    summaries: list[str], reader: Reader, files: list[FileRecord], group: Any, what: str
) -> None:
    """Every rank the same ``summaries`` (one digest a rank): returns when all are equal;
    else gathers each rank's files (only then: they may be thousands) and raises on every
    rank the same error."""
    if len(set(summaries)) == 1:
        return
    records: list[Any] = [None] * len(summaries)
    torch.distributed.all_gather_object(
        records, (summaries[torch.distributed.get_rank(group)], reader.path, files), group=group
    )
    raise _differing_checkpoints(records, what)


def _file_order(reader: Reader, names: list[str]) -> list[str]:
    """``names`` in the order their bytes lie in a single file, so each stripe is a few long
    reads; a reader over several files (shards, a chain) keeps its own order of names."""
    if not isinstance(reader, HeaderView):
        return names
    return sorted(names, key=lambda name: reader.info(name).offset)


def share_reads(
    reader: Reader,
    names: Sequence[str] | None,
    group: Any,
    *,
    deliver: Deliver,
    verify: bool = False,
    pin_memory: bool = False,
    piece_bytes: int | None = None,
) -> None:
    """A collective over ``group`` (every rank calls it, with the same checkpoint opened in
    ``reader``): reads this rank's stripe of the tensors that any rank asks for, verifying
    them when ``verify``, and calls ``deliver(name, tensor)`` for every stored tensor behind
    ``names`` (all when None), CPU tensors in memory of their own.

    Raises (on every rank, whichever rank it happened on):
        ChecksumError: a tensor read does not match its CRC32C (naming it and the file).
        OSError: a read failed (errno and file name).
        ValueError: the ranks opened different checkpoints (other tensors, or other
            content: :func:`agree_on_checkpoint`), naming the ranks and the file.
        KeyError: a name is not in the checkpoint.
    """
    dist = torch.distributed
    me, world = dist.get_rank(group), dist.get_world_size(group)
    wanted = stored_names(reader, names)

    def look_up() -> list[FileRecord]:
        for name in wanted:
            reader.info(name)
        return files_behind(reader)

    # an unknown name raises here, on every rank, before any rank starts reading
    files = agree(look_up, group, f"looking up tensors of {reader.path}")
    asked: list[Any] = [None] * world
    identity = _identity(reader, files)
    dist.all_gather_object(asked, (identity, None if names is None else wanted), group=group)
    # every rank sees every rank's identity: all raise together, or none does
    _check_identities([h for h, _ in asked], reader, files, group, "reading")
    everything = stored_names(reader, None)
    needers: dict[str, set[int]] = {}
    for rank, (_, theirs) in enumerate(asked):
        for name in everything if theirs is None else theirs:
            needers.setdefault(name, set()).add(rank)
    order = _file_order(reader, [n for n in everything if n in needers])
    pieces = plan_pieces(
        [(n, reader.info(n).nbytes) for n in order], world, piece_bytes=piece_bytes
    )
    mine = set(wanted)
    own = [p for p in pieces if p.owner == me]
    rounds = 1 + max((p.round for p in pieces), default=-1)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastckpt-read") as pool:
        reads: dict[int, concurrent.futures.Future[torch.Tensor]] = {}
        ahead = iter(own)  # in round order; this round's read and the next's are queued,
        failed: BaseException | None = None  # so storage works while the network does
        try:
            for r in range(rounds):
                while not reads or max(reads) < r + 1:
                    p = next(ahead, None)
                    if p is None:
                        break
                    reads[p.round] = pool.submit(_read_piece, reader, p, verify, pin_memory)
                buffer = None
                if r in reads and failed is None:
                    try:
                        buffer = reads.pop(r).result()
                    except Exception as exc:
                        failed = exc
                # a failed read, or a failed delivery of the previous round: told to every
                # rank before any goes on to the next transfers
                raise_everywhere(failed, group, f"reading {reader.path}")
                this_round = [p for p in pieces if p.round == r]
                received = _exchange(this_round, buffer, needers, me, world, group, pin_memory)
                try:
                    for p, memory in received:
                        _deliver_piece(reader, p, memory, mine, deliver)
                except Exception as exc:
                    failed = exc
            raise_everywhere(failed, group, f"delivering the tensors of {reader.path}")
        finally:
            for future in reads.values():
                future.cancel()


def _buffer(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """A piece's memory: a mapping of its own, returned to the system with its last tensor
    (heap blocks of tens of MiB stay with the process once freed: RSS would grow by a
    checkpoint per load)."""
    return aligned_tensor(nbytes, lock=pin_memory)


def _read_piece(reader: Reader, piece: Piece, verify: bool, pin_memory: bool) -> torch.Tensor:
    """Reads the piece's tensors (verified when asked) into one buffer, ready to be sent:
    large ones straight into their place (a ranged read of the whole tensor, checked piece
    by piece), small ones in one batch of reads and copied (one read per tensor would cost
    more than the copy)."""
    buffer = _buffer(piece.nbytes, pin_memory)
    small = []
    for name, at in zip(piece.names, piece.offsets):
        nbytes = reader.info(name).nbytes
        if nbytes >= DIRECT_READ:
            reader.read_range(name, 0, nbytes, out=buffer[at : at + nbytes], verify=verify)
        elif nbytes:
            small.append((name, at))
    if small:
        tensors = reader.read([name for name, _ in small], verify=verify, progress=False)
        for name, at in small:
            t = tensors.pop(name).contiguous().reshape(-1).view(torch.uint8)
            buffer[at : at + t.numel()].copy_(t)
    return buffer


def _exchange(
    pieces: list[Piece],
    buffer: torch.Tensor | None,
    needers: dict[str, set[int]],
    me: int,
    world: int,
    group: Any,
    pin_memory: bool,
) -> list[tuple[Piece, torch.Tensor]]:
    """Sends this rank's piece of the round to those who need it and receives the pieces
    it needs; all transfers of the round are in flight at once (one per reader)."""
    dist = torch.distributed
    works = []
    received = []
    for p in pieces:
        wanting = set().union(*(needers[n] for n in p.names))
        if p.owner == me:
            assert buffer is not None
            memory: torch.Tensor | None = buffer
        elif me in wanting or len(wanting | {p.owner}) == world:
            memory = _buffer(p.nbytes, pin_memory)
        else:
            memory = None
        if not p.nbytes:
            pass
        elif len(wanting | {p.owner}) == world:  # every rank: one broadcast (a tree)
            assert memory is not None
            works.append(dist.broadcast(memory, group=group, group_src=p.owner, async_op=True))
        elif p.owner == me:
            assert memory is not None
            for rank in sorted(wanting - {me}):
                works.append(dist.isend(memory, group=group, group_dst=rank))
        elif memory is not None:
            works.append(dist.irecv(memory, group=group, group_src=p.owner))
        if memory is not None and me in wanting:
            received.append((p, memory))
    for work in works:
        work.wait()
    return received


def _deliver_piece(
    reader: Reader, piece: Piece, memory: torch.Tensor, mine: set[str], deliver: Deliver
) -> None:
    exporter = arena_exporter(memory)
    for name, at in zip(piece.names, piece.offsets):
        if name not in mine:
            continue
        info = reader.info(name)
        if info.nbytes == 0:
            tensor = torch.empty(info.shape, dtype=info.dtype)
        else:
            tensor = own_bytes(memory, at, info.nbytes, exporter).view(info.dtype)
            tensor = tensor.view(info.shape)
        deliver(name, tensor)
