"""Reading an incremental checkpoint: a file that holds some tensors and refers to the others
in earlier files (:mod:`fastckpt.format.references`), themselves possibly incremental.

:func:`open_chain` turns an opened file with references into a :class:`ChainedReader`: every
file it refers to is opened (headers only) when it is opened, and every reference is checked
then, before any tensor is read: the file exists (else :class:`~fastckpt.errors.MissingBaseError`
naming it and the tensor), holds the tensor with the recorded dtype and shape (else
``HeaderError``), and records the same XXH3-128 for it (else
:class:`~fastckpt.errors.ChecksumError` naming the file and the tensor: the base changed since).
Reads then take each tensor from the file that holds it, where a CRC32C check (on by default,
as for every load) proves the bytes read are the bytes that file recorded. The strong hash
is compared header to header, not re-computed from the bytes at each load: that would add a
pass over every byte and make an incremental restore slower than a full load.

Example:
    >>> import os, tempfile, torch, fastckpt
    >>> d = tempfile.mkdtemp()
    >>> fastckpt.save({"a": torch.ones(2), "b": torch.zeros(2)}, os.path.join(d, "0.safetensors"))
    >>> fastckpt.save({"a": torch.ones(2), "b": torch.ones(2)}, os.path.join(d, "1.safetensors"),
    ...               base=os.path.join(d, "0.safetensors"))
    >>> with fastckpt.open(os.path.join(d, "1.safetensors")) as r:
    ...     r.keys(), r.offset_keys(), r.get_tensor("a").tolist(), r.stored_names()
    (['a', 'b'], ['b', 'a'], [1.0, 1.0], ['b'])
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import posixpath
from collections.abc import Sequence
from typing import Any, Callable

import torch

from fastckpt import format
from fastckpt.checkpoint.header_view import HeaderView, TensorInfo
from fastckpt.checkpoint.reader import Reader, RoutedReads
from fastckpt.errors import ChecksumError, HeaderError, MissingBaseError
from fastckpt.storage import is_url

__all__ = ["ChainedReader", "Location", "files_of", "locate", "open_chain", "resolve_path"]

#: A single-file reader (:class:`fastckpt.checkpoint.read.CheckpointReader`): a Reader with
#: a header (this module is below the module that defines it).
SingleFileReader = Any

#: Longest chain of files followed (a file, its base, the base's base, ...).
MAX_CHAIN = 64


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a tensor's bytes are: ``file`` (a path or URL), under the name ``tensor``."""

    file: str
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    xxh3_128: str | None
    # of its stored bytes, as ``file`` records it: known where the file was parsed, a cache
    # that says nothing of where the bytes are (so not part of a location's equality)
    crc32c: int | None = dataclasses.field(default=None, compare=False)


def resolve_path(referrer: str, relative: str) -> str:
    """The path of a referenced file: ``relative`` (checked) from ``referrer``'s directory.
    At a URL the same protocol, and never out of the referrer's bucket (the first part of
    its path): a ``..`` from a file at the top of a bucket is refused (HeaderError).

    Example:
        >>> resolve_path("/ckpt/step-2/state.safetensors", "../step-1/state.safetensors")
        '/ckpt/step-1/state.safetensors'
        >>> resolve_path("s3://bucket/run/step-2/state.safetensors", "../step-1/state.safetensors")
        's3://bucket/run/step-1/state.safetensors'
    """
    format.references.check_reference_path(relative)
    if is_url(referrer):
        scheme, _, rest = referrer.partition("://")
        directory = posixpath.dirname(rest)
        parts = relative.split("/")
        climbs = next((i for i, part in enumerate(parts) if part != ".."), len(parts))
        depth = len([part for part in directory.split("/") if part])
        if climbs and climbs >= depth:
            raise HeaderError(
                f"reference path {relative!r} leaves the bucket of {referrer}: a reference "
                "at a URL stays under the first part of the URL's path"
            )
        return f"{scheme}://{posixpath.normpath(posixpath.join(directory, relative))}"
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(referrer)), relative))


def _identity(path: str) -> str:
    return path if is_url(path) else os.path.realpath(path)


def locate(reader: Reader, name: str) -> Location:
    """Where tensor ``name`` (an alias is followed) of an opened checkpoint has its bytes."""
    if isinstance(reader, ChainedReader):
        return reader.locate(name)
    if not isinstance(reader, HeaderView):
        raise TypeError(f"cannot locate tensors of a {type(reader).__name__}")
    e = reader._entry(name)
    hashes = reader.meta.hashes or {}
    path = reader.path if is_url(reader.path) else os.path.abspath(reader.path)
    packed = reader.compressed.get(e.name)  # its true dtype and shape; hashed raw
    dtype, shape = (e.dtype, tuple(e.shape)) if packed is None else (packed.dtype, packed.shape)
    crc = (reader.meta.crcs or {}).get(e.name)
    return Location(path, e.name, dtype, shape, hashes.get(e.name), crc)


def open_chain(
    top: SingleFileReader,
    opener: Callable[[str], SingleFileReader],
    _chain: tuple[str, ...] = (),
    _opened: dict[str, Reader] | None = None,
) -> Reader:
    """``top`` itself when it refers to no other file, else a :class:`ChainedReader` over it
    and its bases (opened with ``opener(path)``). ``top`` is closed if this raises.

    Each file of the graph is opened once, however many files refer to it: a file reached
    again along another path shares the reader opened first (a graph of n files, each
    naming the next twice, costs n opens, not 2**n)."""
    refs = top.meta.references
    if refs is None:
        return top
    try:
        opened = {} if _opened is None else _opened
        return ChainedReader(top, opener, (*_chain, _identity(top.path)), opened)
    except BaseException:
        top.close()
        raise


class ChainedReader(RoutedReads, Reader):
    """A :class:`~fastckpt.Reader` over an incremental checkpoint and the files it refers to:
    every method behaves as for a file holding every tensor."""

    def __init__(
        self,
        top: SingleFileReader,
        opener: Callable[[str], SingleFileReader],
        chain: tuple[str, ...],
        opened: dict[str, Reader] | None = None,
    ):
        self.top = top
        self._opened = {} if opened is None else opened  # identity -> reader, graph-wide
        self.path = top.path
        refs = top.meta.references
        self._refs: dict[str, format.Reference] = dict(refs.tensors)
        self._bases: list[Reader] = []
        try:
            for index, relative in enumerate(refs.files):
                self._bases.append(self._open_base(index, relative, opener, chain))
            for name, ref in self._refs.items():
                self._check_reference(name, ref)
        except BaseException:
            for base in self._bases:
                base.close()
            raise

    # -- opening ---------------------------------------------------------------------------
    def _open_base(
        self,
        index: int,
        relative: str,
        opener: Callable[[str], SingleFileReader],
        chain: tuple[str, ...],
    ) -> Reader:
        try:
            path = resolve_path(self.path, relative)
        except HeaderError as exc:
            raise HeaderError(f"{self.path}: {exc}") from None
        users = [n for n, r in self._refs.items() if r.file == index]
        first = repr(users[0]) if users else "no tensor"
        if _identity(path) in chain:
            cycle = " -> ".join([*chain, _identity(path)])
            raise HeaderError(f"{self.path}: reference cycle through {path} ({cycle})")
        if len(chain) >= MAX_CHAIN:
            raise HeaderError(f"{self.path}: chain of bases longer than {MAX_CHAIN} files")
        shared = self._opened.get(_identity(path))
        if shared is not None:  # reached along another path: opened (and checked) once
            return shared
        try:
            base = opener(path)
        except FileNotFoundError as exc:
            raise MissingBaseError(
                errno.ENOENT,
                f"{self.path} refers to tensor {first} in base checkpoint {path}, which is "
                f"missing ({len(users)} tensor(s) need it)",
                path,
            ) from exc
        reader = open_chain(base, opener, chain, self._opened)
        self._opened[_identity(path)] = reader
        return reader

    def _check_reference(self, name: str, ref: format.Reference) -> None:
        base = self._bases[ref.file]
        try:
            where = locate(base, ref.tensor)
        except KeyError:
            raise HeaderError(
                f"{self.path}: tensor {name!r} refers to {ref.tensor!r}, which base "
                f"checkpoint {base.path} does not hold"
            ) from None
        if (where.dtype, where.shape) != (ref.dtype, ref.shape):
            raise HeaderError(
                f"{self.path}: tensor {name!r} refers to {ref.tensor!r} in {base.path} as "
                f"{ref.dtype}{list(ref.shape)}, but it is {where.dtype}{list(where.shape)}"
            )
        if where.xxh3_128 != ref.xxh3_128:
            raise ChecksumError(
                f"base checkpoint {base.path}: tensor {ref.tensor!r} changed since {self.path} "
                f"referred to it as {name!r} (XXH3-128 {where.xxh3_128 or 'not recorded'}, "
                f"expected {ref.xxh3_128})",
                tensor=ref.tensor,
                filename=base.path,
            )

    # -- what the header says --------------------------------------------------------------
    @property
    def meta(self) -> format.FastckptMeta:
        """The decoded metadata of this file (its own hashes and its references)."""
        return self.top.meta

    def stored_names(self) -> list[str]:
        """The tensors this file holds itself (in file order)."""
        return list(self.top.header.entries)

    @property
    def references(self) -> dict[str, format.Reference]:
        """name -> the reference of each tensor held by another file."""
        return dict(self._refs)

    @property
    def bases(self) -> list[Reader]:
        """The opened files this one refers to, in the order of its header."""
        return list(self._bases)

    def locate(self, name: str) -> Location:
        """Where tensor ``name``'s bytes are, following the chain to the file holding them."""
        stored = self._resolve(name)
        ref = self._refs.get(stored)
        if ref is None:
            return locate(self.top, stored)
        return locate(self._bases[ref.file], ref.tensor)

    def keys(self) -> list[str]:
        return sorted(self.offset_keys())

    def offset_keys(self) -> list[str]:
        """This file's tensors in data order, then those held by other files, then aliases."""
        self.top._check_open()
        stored = list(self.top.header.entries)
        aliases = [a for a in self.aliases if a not in self.top.header.entries]
        return stored + [n for n in self._refs if n not in aliases] + aliases

    def metadata(self) -> dict[str, str] | None:
        return self.top.metadata()

    def _resolve(self, name: str) -> str:
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        stored = self.top.meta.aliases.get(name, name)
        if stored not in self.top.header.entries and stored not in self._refs:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        return stored

    def info(self, name: str) -> TensorInfo:
        stored = self._resolve(name)
        ref = self._refs.get(stored)
        if ref is None:
            return self.top.info(stored)
        return dataclasses.replace(self._bases[ref.file].info(ref.tensor), name=name)

    @property
    def has_checksums(self) -> bool:
        return self.top.has_checksums and all(b.has_checksums for b in self._bases)

    @property
    def aliases(self) -> dict[str, str]:
        return self.top.aliases

    @property
    def structure(self) -> Any:
        return self.top.structure

    # -- reading ---------------------------------------------------------------------------
    def _split(self, names: Sequence[str] | None) -> tuple[list[str], list[list[tuple[str, str]]]]:
        """The stored names to read from the top file, and per base (name, base name)."""
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        if names is None:
            aliases = self.top.meta.aliases
            wanted = [n for n in [*self.top.header.entries, *self._refs] if n not in aliases]
        else:
            wanted = list(dict.fromkeys(self._resolve(n) for n in names))
        own: list[str] = []
        per_base: list[list[tuple[str, str]]] = [[] for _ in self._bases]
        for n in wanted:
            ref = self._refs.get(n)
            if ref is None:
                own.append(n)
            else:
                per_base[ref.file].append((n, ref.tensor))
        return own, per_base

    def _gather(
        self, names: Sequence[str] | None, read: Callable[[Reader, list[str]], dict[str, Any]]
    ) -> dict[str, Any]:
        own, per_base = self._split(names)
        jobs: list[tuple[Reader, list[str]]] = [(self.top, own)] if own else []
        jobs += [
            (b, list(dict.fromkeys(x for _, x in w))) for b, w in zip(self._bases, per_base) if w
        ]
        if len(jobs) > 1 and all(_ranged(r) for r, _ in jobs):
            # URLs: each file's reads wait on the network, so the files are read at once
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                done = list(pool.map(lambda job: read(*job), jobs))
        else:
            done = [read(r, wanted) for r, wanted in jobs]
        got = dict(zip((id(r) for r, _ in jobs), done))
        result = got.get(id(self.top), {}) if own else {}
        for base, wanted in zip(self._bases, per_base):
            if wanted:
                from_base = got[id(base)]
                result.update({n: from_base[b] for n, b in wanted})
        return result

    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        def read(reader: Reader, wanted: list[str]) -> dict[str, torch.Tensor]:
            def of(names: list[str] | None) -> dict[str, torch.Tensor]:
                return reader.read(names, pin_memory=pin_memory, verify=verify, progress=progress)

            if not _whole_file_cheaper(reader, wanted):
                return of(wanted)
            got = of(None)
            missing = [n for n in wanted if n not in got]
            if missing:  # names a whole read does not return (an alias spelled otherwise)
                got.update(of(missing))
            return {n: got[n] for n in wanted}

        return self._gather(names, read)

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        return self._gather(names, lambda r, n: r.map(n, verify=verify))

    def _route(self, name: str) -> tuple[Reader, str]:
        stored = self._resolve(name)
        ref = self._refs.get(stored)
        return (self.top, stored) if ref is None else (self._bases[ref.file], ref.tensor)

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        def start(reader: Reader, wanted: list[str]) -> dict[str, Any]:
            reader.prefetch(wanted, pin_memory=pin_memory, verify=verify)
            return {n: None for n in wanted}

        self._gather(names, start)

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        return list(self.verify_failures(names, progress=progress))

    def verify_failures(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> dict[str, str]:
        """Each damaged tensor (by this file's names) and the check it failed, in the file
        that holds its bytes (that file's CRC32C and XXH3-128 of it)."""
        self.require_checksums()
        own, per_base = self._split(names)
        damaged = self.top.verify_failures(own, progress=progress) if own else {}
        for base, wanted in zip(self._bases, per_base):
            if wanted:
                bad = base.verify_failures([b for _, b in wanted], progress=progress)
                damaged.update((n, bad[b]) for n, b in wanted if b in bad)
        return damaged

    @property
    def read_mode(self) -> str:
        modes = {self.top.read_mode, *(b.read_mode for b in self._bases)}
        return modes.pop() if len(modes) == 1 else "mixed"

    @property
    def bytes_read(self) -> int:
        # each file once: a base shared by several files is one reader
        return sum(r.bytes_read for r in _graph(self) if not isinstance(r, ChainedReader))

    def close(self) -> None:
        try:
            self.top.close()
        finally:
            for base in self._bases:
                base.close()

    def __enter__(self) -> ChainedReader:
        return self


def _ranged(reader: Reader) -> bool:
    """Whether a reader reads ranges of a URL (or, for a chain, only of URLs)."""
    if isinstance(reader, ChainedReader):
        return all(_ranged(r) for r in (reader.top, *reader.bases))
    return bool(getattr(getattr(reader, "storage", None), "ranged", False))


def _whole_file_cheaper(reader: Reader, wanted: list[str]) -> bool:
    """Whether to read all of a base at a URL rather than the tensors wanted of it: a base's
    unchanged tensors lie between the ones that changed since, and a ranged read per run of
    them costs a request each (hundreds for a LoRA fine-tune's base); when they are most of
    its bytes, one pass over the data section is much faster and reads less than twice what
    is needed."""
    if not isinstance(reader, HeaderView) or not _ranged(reader):
        return False  # a local file reads runs at disk speed; a chain decides per file
    entries = reader.header.entries
    wanted_bytes = sum(entries[n].nbytes for n in wanted if n in entries)
    return 2 * wanted_bytes >= reader.header.data_size


def _graph(reader: Reader) -> list[Reader]:
    """``reader`` and every reader under it, tops included, each once (bases are shared)."""
    found: dict[int, Reader] = {}
    todo = [reader]
    while todo:
        r = todo.pop()
        if id(r) in found:
            continue
        found[id(r)] = r
        if isinstance(r, ChainedReader):
            todo.append(r.top)
            todo.extend(r.bases)
    return list(found.values())


def _absolute(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def files_of(reader: Reader) -> set[str]:
    """Every file a reader reads from, itself included."""
    return {_absolute(r.path) for r in _graph(reader)}
