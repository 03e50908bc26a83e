"""Incremental saves: ``save(obj, path, base=earlier)`` writes only the tensors whose bytes
differ from ``earlier``'s tensor of the same name, and refers to the others.

Deciding what changed, per tensor, by content:

1. ``frozen`` names it (a set of names or a predicate): the caller's promise that it has not
   changed since ``base`` -- referred to with ``base``'s recorded hash, nothing read.
2. This process saved it to ``base`` and its version counter has moved since, on the same
   memory (:mod:`.tensor_records`): it changed, so it is written (and hashed as it is
   written). A counter only ever says "changed": fused and foreach optimizer kernels,
   BatchNorm's forward pass and writes through ``.data`` change a tensor without moving it.
3. Otherwise it is hashed (XXH3-128, on every core) and compared with the hash ``base``
   records for it in its header: equal hashes are the only way to "unchanged".

A recorded hash is a claim, not proof, about the bytes stored beside it: a damaged or hostile
base may record the hash of the tensor in memory over other bytes, and a reference made on
its word would replace the tensor with those bytes on every load. So a tensor is referred to
only once the base's stored bytes are shown to match: they are read, checked against their
CRC32C and hashed again (only the tensors about to be referred to, one at a time). Where they
do not match, the tensor is written in full and a warning on the ``fastckpt`` logger names
the file and the tensor. Not read again: the index of a checkpoint this process saved, with
every header of its chain unchanged since (:mod:`~fastckpt.checkpoint.known_indexes`), and
any tensor this process wrote or read back with the same two recorded hashes
(:func:`~fastckpt.checkpoint.tensor_records.seen_intact`): their hashes were computed from
those bytes, and a byte damaged since fails the CRC32C check of every load. ``frozen`` names
are the caller's word and are not read.

A tensor ``base`` does not hold (or holds with another dtype or shape, or without a hash) is
written. References point to the file that holds the bytes: when ``base`` itself refers to an
earlier file for a tensor, the new file refers to that file directly (so a series of
incremental saves over one full checkpoint depends on that checkpoint and the files holding
the tensors that changed, not on every step between), unless that file lies beyond what a
reference path may reach from the new file; then it refers to ``base`` (a chain).

Example:
    >>> import os, tempfile, torch, fastckpt
    >>> d = tempfile.mkdtemp()
    >>> state = {"frozen": torch.ones(1000), "lora": torch.zeros(10)}
    >>> fastckpt.save(state, os.path.join(d, "0.safetensors"))
    >>> _ = state["lora"].add_(1)
    >>> fastckpt.save(state, os.path.join(d, "1.safetensors"), base=os.path.join(d, "0.safetensors"))
    >>> from safetensors.torch import load_file
    >>> list(load_file(os.path.join(d, "1.safetensors")))  # plain safetensors: what was written
    ['lora']
    >>> sorted(fastckpt.load(os.path.join(d, "1.safetensors")))
    ['frozen', 'lora']
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import posixpath
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

import torch

from fastckpt import format
from fastckpt.checkpoint import known_indexes, save_order
from fastckpt.checkpoint.chained_reader import Location, files_of, locate, resolve_path
from fastckpt.checkpoint.digests import hash_tensor, hash_tensors
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.tensor_records import SaveRecord, previous, remember_intact, seen_intact
from fastckpt.errors import ChecksumError, HeaderError, MissingBaseError
from fastckpt.io import parallel_io
from fastckpt.storage import is_url

__all__ = ["Choice", "Frozen", "IndexDraft", "base_index", "choose", "dependencies"]

#: ``frozen=``: tensor names, or a predicate on a tensor's name.
Frozen = Union[None, Iterable[str], Callable[[str], bool]]

_log = logging.getLogger("fastckpt")


@dataclasses.dataclass
class IndexDraft:
    """The index the file being saved will have (what :func:`base_index` of it would
    find), but for the hashes of what it writes: completed and left in
    :mod:`~fastckpt.checkpoint.known_indexes` once its header is made, so that the next
    incremental save with this file as its base does not parse the chain again."""

    destination: str  # absolute
    written: dict[str, tuple[str, tuple[int, ...]]]  # name -> true dtype and shape
    inherited: dict[str, Location]  # name -> where the base's chain holds it
    aliases: dict[str, str]  # alias -> the tensor it names (read through, as a reader does)
    chain: set[str]  # the files it refers to, directly or not

    def remember(self, header: bytes, hashes: Mapping[str, str]) -> None:
        """The file's ``header`` is made, with the XXH3-128 of each tensor it holds."""
        index = dict(self.inherited)
        for name, (dtype, shape) in self.written.items():
            index[name] = Location(self.destination, name, dtype, shape, hashes.get(name))
        for alias, target in self.aliases.items():
            if target in index:
                index[alias] = index[target]
        known_indexes.remember(self.destination, header, index, self.chain)


@dataclasses.dataclass
class Choice:
    """What an incremental save refers to instead of writing, the hashes already computed
    of what it writes, the record kept for the next save, and the index the file will have
    (None for a save to a URL, or without checksums)."""

    references: format.References | None
    hashes: dict[str, str]
    record: SaveRecord | None
    draft: IndexDraft | None = None


def _frozen_test(frozen: Frozen) -> Callable[[str], bool]:
    if frozen is None:
        return lambda name: False
    if callable(frozen):
        return lambda name: bool(frozen(name))
    if isinstance(frozen, (str, bytes)) or not isinstance(frozen, Iterable):
        raise TypeError(
            f"frozen must be a collection of tensor names or a predicate, got {type(frozen).__name__}"
        )
    names = set(frozen)
    return names.__contains__


def base_index(base: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Location]:
    """Every tensor name of the checkpoint at ``base`` (aliases included) -> where its bytes
    are; opening it checks its own references (see :mod:`.chained_reader`). Only headers
    are read (at a URL: no tensor's bytes are downloaded).

    Raises:
        MissingBaseError: ``base`` is missing (``filename`` names it).
    """
    return _index_and_chain(base, storage_options)[0]


def _index_and_chain(
    base: str, storage_options: Mapping[str, Any] | None
) -> tuple[dict[str, Location], set[str], bool]:
    """:func:`base_index` of ``base``, the files of its chain (itself included), and whether
    its hashes are known to be those of its bytes: True when kept from the save that wrote
    it, its headers unchanged (:mod:`~fastckpt.checkpoint.known_indexes`); False when
    parsed."""
    known = known_indexes.lookup(base)
    if known is not None:
        return (*known, True)
    try:
        reader = open_checkpoint(base, storage_options=storage_options)
    except MissingBaseError:
        raise
    except FileNotFoundError as exc:
        raise MissingBaseError(
            errno.ENOENT, f"base checkpoint {base} of an incremental save is missing", base
        ) from exc
    with reader:
        return {name: locate(reader, name) for name in reader.keys()}, files_of(reader), False


def dependencies(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """The files that the checkpoint at ``path`` needs besides itself, to be loaded: every
    file holding a tensor it refers to, directly or through a chain (absolute paths, or URLs
    for a checkpoint at a URL, read with ``storage_options``; sorted). Retention must keep
    them while it keeps ``path``. A plain checkpoint needs none.

    Raises:
        MissingBaseError: a file it needs is missing (named).
        HeaderError, ChecksumError: a reference is broken (see
            :mod:`fastckpt.checkpoint.chained_reader`).

    Example:
        >>> import os, tempfile, torch, fastckpt
        >>> d = tempfile.mkdtemp()
        >>> fastckpt.save({"a": torch.ones(2), "b": torch.ones(2)}, os.path.join(d, "0.safetensors"))
        >>> fastckpt.save({"a": torch.ones(2), "b": torch.zeros(2)}, os.path.join(d, "1.safetensors"),
        ...               base=os.path.join(d, "0.safetensors"))
        >>> [os.path.basename(p) for p in dependencies(os.path.join(d, "1.safetensors"))]
        ['0.safetensors']
        >>> dependencies(os.path.join(d, "0.safetensors"))
        []
    """
    with open_checkpoint(os.fspath(path), storage_options=storage_options) as reader:
        own = reader.path if is_url(reader.path) else os.path.abspath(reader.path)
        return sorted(files_of(reader) - {own})


def _identity(path: str) -> str:
    """The name two locations share when they are the same file (a URL is its own name)."""
    return path if is_url(path) else os.path.realpath(os.path.abspath(path))


def _relative(target: str, destination: str) -> str | None:
    """``target`` as a reference path from ``destination``'s directory, or None when it is
    out of reach (too far up, another URL scheme, or out of the URL's bucket)."""
    if is_url(destination):
        scheme, _, rest = destination.partition("://")
        other, _, target_rest = target.partition("://")
        if other != scheme:
            return None
        relative = posixpath.relpath(target_rest, posixpath.dirname(rest) or ".")
    else:
        relative = os.path.relpath(target, os.path.dirname(os.path.abspath(destination)))
    try:
        # resolved as a reader resolves it: the same file, or no reference at all
        return relative if resolve_path(destination, relative) == target else None
    except (HeaderError, ValueError):
        return None


def _check_base(base: Any, destination: str | None, checksum: bool) -> str:
    if destination is None:
        raise ValueError("base= needs a destination path (an incremental save of a path)")
    if not isinstance(base, (str, os.PathLike)):
        raise TypeError(f"base must be the path of a checkpoint, got {type(base).__name__}")
    base = os.fspath(base)
    if is_url(base) != is_url(destination):
        local, url = (base, destination) if is_url(destination) else (destination, base)
        raise ValueError(
            f"base={base!r} for a save to {destination!r}: an incremental checkpoint and its "
            f"base must both be local files or both at URLs (local {local!r}, URL {url!r}); "
            "references are paths relative to the new file"
        )
    if not checksum:
        raise ValueError("base= needs checksum=True: references are checked by hashes")
    return base if is_url(base) else os.path.abspath(base)


def choose(
    stored: Mapping[str, torch.Tensor],
    specs: list[tuple[str, str, tuple[int, ...]]],
    base: str | os.PathLike[str] | None,
    destination: str | None,
    *,
    frozen: Frozen = None,
    checksum: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> Choice:
    """Which of ``stored`` (stored name -> tensor; ``specs``: their safetensors dtype and
    shape; ``aliases``: alias -> the stored name it names) to refer to in ``base`` rather
    than write to ``destination``.

    ``base`` and ``destination`` are both local paths or both URLs (``base`` then read
    with ``storage_options``, its header only).

    Raises:
        ValueError: ``base`` is the destination, or one of the files it depends on (the save
            would replace bytes it refers to); a URL for a local destination or the reverse;
            or ``checksum=False``.
        MissingBaseError, HeaderError, ChecksumError: ``base`` cannot be read as it says.
    """
    record = SaveRecord(destination, stored) if destination is not None and checksum else None
    is_frozen = _frozen_test(frozen)
    described = {name: (dtype, tuple(shape)) for name, dtype, shape in specs}

    def draft(
        index: Mapping[str, Location], same: Mapping[str, str], chain: set[str]
    ) -> IndexDraft | None:
        if record is None or destination is None or is_url(destination):
            return None
        return IndexDraft(
            os.path.abspath(destination),
            {name: spec for name, spec in described.items() if name not in same},
            {name: index[name] for name in same},
            dict(aliases or {}),
            chain if same else set(),  # a file that refers to nothing needs no other
        )

    if base is None:
        if frozen is not None:
            raise ValueError("frozen= needs base=: it names tensors unchanged since the base")
        return Choice(None, {}, record, draft({}, {}, set()))
    base_path = _check_base(base, destination, checksum)
    assert destination is not None
    target = _identity(destination)
    save_order.wait_for_earlier(base_path)  # an asynchronous save of the base commits first
    index, chain, trusted = _index_and_chain(base_path, storage_options)
    holders = {loc.file for loc in index.values()} | {base_path}
    files = {_identity(f) for f in holders}
    if target in files:
        raise ValueError(
            f"cannot save to {destination} with base={base_path}: the new file would replace "
            "a file it refers to; save to a new path"
        )
    earlier = previous(base_path)
    same: dict[str, str] = {}  # name -> hash, unchanged since base
    known: dict[str, str] = {}  # name -> hash, changed (written, not hashed again)
    to_hash: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        loc = index.get(name)
        if loc is None or loc.xxh3_128 is None or (loc.dtype, loc.shape) != described[name]:
            continue  # written, hashed as it is written
        if is_frozen(name):
            same[name] = loc.xxh3_128
            continue
        mine = earlier.get(name)
        if mine is not None and mine.written_in_place(t):
            continue  # changed in place since saved: written, and hashed as it is written
        to_hash[name] = t
    for name, digest in hash_tensors(to_hash, parallel_io.worker_count()).items():
        (same if digest == index[name].xxh3_128 else known)[name] = digest
    if not trusted:  # referred to only where the stored bytes are shown to match
        hashed = {name: same[name] for name in to_hash if name in same}
        for name in _not_as_recorded(hashed, index, base_path, storage_options):
            known[name] = same.pop(name)  # written in full; its hash is the one computed
    if record is not None:
        record.known({**same, **known})
    plan = draft(index, same, chain | {base_path})
    if not same:
        return Choice(None, known, record, plan)
    return Choice(_references(same, index, base_path, destination), known, record, plan)


def _not_as_recorded(
    hashed: Mapping[str, str],
    index: Mapping[str, Location],
    base: str,
    storage_options: Mapping[str, Any] | None,
) -> list[str]:
    """The names among ``hashed`` (name -> XXH3-128, equal to the one ``base`` records)
    whose stored bytes are not what the header of the file holding them records: they fail
    their CRC32C, or hash to another XXH3-128. Each is logged (a warning naming the file and
    the tensor). The bytes are read one tensor at a time, each file opened once."""
    by_file: dict[str, list[str]] = {}
    for name in hashed:
        loc = index[name]
        if seen_intact(loc.file, loc.tensor, loc.xxh3_128, loc.crc32c):
            continue  # written by this process, or read and hashed before
        by_file.setdefault(loc.file, []).append(name)
    wrong: list[str] = []
    for file, names in by_file.items():
        with open_checkpoint(file, storage_options=storage_options) as holder:
            for name in names:
                loc = index[name]
                try:
                    stored = hash_tensor(holder.get_tensor(loc.tensor, verify=True))
                    why = None if stored == hashed[name] else f"its bytes hash to {stored}"
                except ChecksumError as exc:
                    why = f"its bytes fail their CRC32C ({exc})"
                if why is None:
                    if loc.crc32c is not None:
                        remember_intact(loc.file, loc.tensor, stored, loc.crc32c)
                    continue
                _log.warning(
                    "incremental save with base=%s: %s records XXH3-128 %s for tensor %r, "
                    "but %s; tensor %r is written in full instead of referred to",
                    base, file, hashed[name], loc.tensor, why, name,
                )  # fmt: skip
                wrong.append(name)
    return wrong


def _references(
    same: Mapping[str, str], index: Mapping[str, Location], base: str, destination: str
) -> format.References:
    via_base = _relative(base, destination)
    files: dict[str, int] = {}
    tensors: dict[str, format.Reference] = {}
    for name, digest in same.items():
        loc = index[name]
        path, tensor = _relative(loc.file, destination), loc.tensor
        if path is None:  # the holder is out of reach: refer to the base, which refers on
            path, tensor = via_base, name
        if path is None:
            raise ValueError(
                f"base={base} cannot be referred to from {destination}: a reference may "
                f"climb at most {format.references.MAX_PARENT_STEPS} directory above the "
                "new file's directory (at a URL: never out of its bucket, the first part of "
                "its path)"
            )
        index_of = files.setdefault(path, len(files))
        tensors[name] = format.Reference(index_of, tensor, loc.dtype, loc.shape, digest)
    return format.References(tuple(files), tensors)
