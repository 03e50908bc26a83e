"""The reading of a Hugging Face sharded directory: finding its index (or lone
``model.safetensors``), checking the index, and :class:`ShardedReader`, the one
:class:`~fastckpt.Reader` type over a reader per shard, which ``fastckpt.open(directory)``
returns and ``fastckpt.load(directory)`` reads through.

Example:
    >>> import tempfile, torch
    >>> from fastckpt.integrations.hf_shards import save_sharded
    >>> d = tempfile.mkdtemp()
    >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
    >>> is_sharded(d), load_sharded(d)["b"][0].item()
    (True, 1.0)
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fastckpt import storage
from fastckpt.checkpoint.header_view import TensorInfo
from fastckpt.checkpoint.open_readers import HeaderOnly, ReaderCache
from fastckpt.checkpoint.range_read import TensorSlice
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.reader import Reader, RoutedReads
from fastckpt.errors import HeaderError
from fastckpt.integrations.hf_shards_plan import DEFAULT_PARALLEL, INDEX_NAME, WEIGHTS_NAME, _local
from fastckpt.storage.directory_kinds import directory_kind

__all__ = ["ShardedReader", "is_sharded", "load_sharded", "open_sharded"]


def is_sharded(path: Any) -> bool:
    """Whether ``path`` names a sharded checkpoint: a local directory or an ``*.index.json``.

    A URL counts when it ends with ``.index.json`` or ``/`` (object stores have no cheap
    directory test; :mod:`~fastckpt.integrations.remote` also hands over URLs it finds to
    be directories).

    Example:
        >>> import tempfile
        >>> is_sharded(tempfile.mkdtemp()), is_sharded("s3://b/run/model.safetensors.index.json")
        (True, True)
    """
    if not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    if text.endswith(".index.json"):
        return True
    local = _local(text)
    if local is None:
        return text.endswith("/")
    return os.path.isdir(local)


def _resolve(
    path: str, storage_options: Mapping[str, Any] | None
) -> tuple[str, str | None, str | None]:
    """``(directory, index path or None, single weights file or None)`` for a directory or index."""
    if path.endswith(".index.json"):
        directory = path.rsplit("/", 1)[0] if storage.is_url(path) else os.path.dirname(path)
        return directory, path, None
    directory = path.rstrip("/") if storage.is_url(path) else path
    index = storage.join(directory, INDEX_NAME)
    if storage.exists(index, storage_options):
        return directory, index, None
    single = storage.join(directory, WEIGHTS_NAME)
    if storage.exists(single, storage_options):
        return directory, None, single
    raise FileNotFoundError(errno.ENOENT, _not_hugging_face(path), path)


def _not_hugging_face(path: str) -> str:
    """Why the directory ``path`` is not read as a Hugging Face one: what it is and what reads
    it (a DCP checkpoint, a series or one of its steps), or what it lacks."""
    kind = directory_kind(path)
    missing = f"no {INDEX_NAME} or {WEIGHTS_NAME}"
    if kind is None:
        return f"{path}: {missing} in this directory"
    return f"{path}: {kind.what}, not a Hugging Face directory ({missing}); read it with {kind.read_with}"


def _read_index_document(
    index: str, storage_options: Mapping[str, Any] | None
) -> tuple[dict[str, str], dict[str, str]]:
    """``(weight map, metadata)`` of an index file, checked: a JSON object whose
    ``weight_map`` maps names to plain file names and whose ``metadata`` is an object.

    Raises:
        HeaderError: the index is malformed (the message names it and says how).
    """
    data = storage.read_whole(index, storage_options)
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise HeaderError(f"{index}: not a JSON index: {exc}") from None
    if not isinstance(document, dict):
        raise HeaderError(f"{index}: not a JSON object")
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        raise HeaderError(f"{index}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or not shard
            or "/" in shard
            or "\\" in shard
            or shard in (".", "..")
        ):
            raise HeaderError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name")
    meta = document.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise HeaderError(f"{index}: 'metadata' is not an object")
    return weight_map, {str(k): str(v) for k, v in meta.items()}


def _read_index(index: str, storage_options: Mapping[str, Any] | None) -> dict[str, str]:
    """The weight map of an index file, checked: shard names must be plain file names."""
    return _read_index_document(index, storage_options)[0]


def _index_metadata(index: str | None, storage_options: Mapping[str, Any] | None) -> dict:
    return {} if index is None else _read_index_document(index, storage_options)[1]


def load_sharded(
    path: str | os.PathLike[str],
    map_location: Any = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    **load_options: Any,
) -> dict[str, torch.Tensor]:
    """Loads a sharded directory (or its index file) into one flat dict, shards in parallel:
    the tensors the index names, each from the shard it names (what ``fastckpt.load`` does).

    Args:
        path: the directory, or the path of its ``*.safetensors.index.json``; local or a URL.
        storage_options: for a URL, passed to the fsspec file system.
        parallel: shards read at the same time (and, for a URL, ranges per shard).
        load_options: as :func:`fastckpt.load` (``keys``, ``device``, ``verify``, ...).

    Raises:
        FileNotFoundError: no index or weights file in the directory, or a missing shard.
        HeaderError: a malformed index, or a shard that lacks a tensor its index names.
        KeyError: a name in ``keys`` is not in the index.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.integrations.hf_shards import save_sharded
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> load_sharded(d, keys=["b"])["b"].sum().item()
        1000.0
    """
    from fastckpt.checkpoint.load import check_target, load

    open_options = {k: load_options.pop(k) for k in _OPEN_OPTIONS if k in load_options}
    target = check_target(
        map_location,
        load_options.get("device"),
        keys=load_options.get("keys"),
        mmap=load_options.get("mmap", False),
        pin_memory=load_options.get("pin_memory", False),
    )
    on_cuda = isinstance(target, torch.device) and target.type == "cuda"
    with ShardedReader(
        path,
        storage_options=storage_options,
        parallel=parallel,
        only=load_options.get("keys"),
        device=target if on_cuda else "cpu",
        **open_options,
    ) as reader:
        result = load(reader, map_location, **load_options)
    if not isinstance(result, dict):
        raise HeaderError(f"{path}: a sharded checkpoint holds a flat dict of tensors")
    return result


#: How often a sharded reader opens a set again when a newer save removed a shard of the
#: set it was opening (see :class:`ShardedReader`).
_REPUBLISHED_RETRIES = 2

#: Options of ``fastckpt.load`` that say how shards are opened (the rest, how they are read).
_OPEN_OPTIONS = (
    "gds",
    "direct_io",
    "engine",
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "part_size",
)


class ShardedReader(RoutedReads, Reader):
    """A sharded checkpoint opened for lazy reading: what ``fastckpt.open(directory)`` returns.

    A reader over one :class:`~fastckpt.checkpoint.read.CheckpointReader` per shard: opening
    reads the index and each shard's header; the tensors are those the index names (plus the
    tied names a shard records for them), each read from the shard the index names; a tensor
    a shard holds but the index does not name (left by an earlier save) is not seen.
    ``only`` opens just the shards that hold these indexed names (what ``load(keys=...)`` reads).

    Whatever the number of shards, at most ``open_files`` of them are open at once (default
    64, ``FASTCKPT_OPEN_FILES``; see :mod:`fastckpt.checkpoint.open_readers`): the headers
    are kept in memory, and a shard is opened again when a read needs it, closing the least
    recently used. A prefetch of more shards than that is read again by the shards closed
    since. A shard replaced or removed since the directory was opened raises
    ``FileNotFoundError`` naming it.

    Example:
        >>> import tempfile, torch
        >>> from fastckpt.integrations.hf_shards import save_sharded
        >>> d = tempfile.mkdtemp()
        >>> save_sharded({"a": torch.zeros(1000), "b": torch.ones(1000)}, d, max_shard_size="4KB")
        >>> with open_sharded(d) as r:
        ...     sorted(r.keys()), r.get_tensor("b")[:2].tolist()
        (['a', 'b'], [1.0, 1.0])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        parallel: int = DEFAULT_PARALLEL,
        only: Sequence[str] | None = None,
        open_files: int | None = None,
        **open_options: Any,
    ):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be a positive int, got {parallel!r}")
        text = storage.to_local(path) or os.fspath(path)
        self.path = text
        self._parallel = parallel

        def opener(shard: str) -> Any:
            return open_checkpoint(
                shard, storage_options=storage_options, parallel=parallel, **open_options
            )

        self._open_files = open_files
        self._opener = opener
        self._cache = ReaderCache(opener, open_files)
        self._readers: dict[str, HeaderOnly] = {}  # shard path -> its header
        self._closed = False
        self._owner: dict[str, HeaderOnly] = {}  # stored name -> its shard's header
        self._aliases: dict[str, str] = {}
        # A save that publishes a new set removes the old set's shards once its index is in
        # place: a shard named by the index just read can vanish before it is opened. The
        # new index then names shards that exist, so the set is opened again from it.
        for attempt in range(_REPUBLISHED_RETRIES + 1):
            try:
                self._open_set(text, storage_options, parallel, only, open_options)
                return
            except FileNotFoundError:
                self._readers, self._owner, self._aliases = {}, {}, {}
                self._cache = ReaderCache(self._opener, self._open_files)
                if attempt == _REPUBLISHED_RETRIES:
                    self._closed = True
                    raise

    def _open_set(
        self,
        text: str,
        storage_options: Mapping[str, Any] | None,
        parallel: int,
        only: Sequence[str] | None,
        open_options: dict[str, Any],
    ) -> None:
        """Reads the index and opens every shard it names (those ``only`` needs)."""
        directory, index, single = _resolve(text, storage_options)
        if index is not None:
            weight_map, self._metadata = _read_index_document(index, storage_options)
        else:
            weight_map, self._metadata = {}, {}
        if only is not None and index is not None:  # open only the shards these names need
            for name in only:
                if name not in weight_map:
                    raise KeyError(f"no tensor named {name!r} in {index}")
            weight_map = {n: weight_map[n] for n in weight_map if n in set(only)}
        files = [single] if single else [storage.join(directory, n) for n in weight_map.values()]
        try:
            for shard in dict.fromkeys(files):
                opened = self._opener(shard)
                self._readers[shard] = HeaderOnly(opened, shard)
                self._cache.adopt(shard, opened)  # kept open while few are
            if single is not None:
                reader = self._readers[single]
                self._aliases = reader.aliases
                self._owner = {n: reader for n in reader.header.entries if n not in self._aliases}
                self._structure = reader.structure
                return
            self._structure = None
            for name, file_name in weight_map.items():
                reader = self._readers[storage.join(directory, file_name)]
                if reader.aliases.get(name) in reader.header.entries:  # tied: read once
                    self._aliases[name] = reader.aliases[name]
                    self._owner.setdefault(reader.aliases[name], reader)
                elif name in reader.header.entries:
                    self._owner[name] = reader
                else:
                    raise HeaderError(
                        f"{reader.path}: lacks tensor {name!r} that {index} maps to it"
                    )
            for reader in self._readers.values():  # tied names a shard records (not indexed)
                for alias, stored in reader.aliases.items():
                    if self._owner.get(stored) is reader and alias not in weight_map:
                        self._aliases[alias] = stored
        except BaseException:
            self._cache.close()
            raise

    # -- what the index and headers say ----------------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor name the index gives (in its order), then tied names."""
        self._live()
        return list(self._owner) + [a for a in self._aliases if a not in self._owner]

    def metadata(self) -> dict[str, str] | None:
        """The index's ``metadata`` (``total_size`` and any saved metadata), as strings; for a
        directory of one ``model.safetensors``, that file's metadata."""
        self._live()
        if self._metadata or len(self._readers) != 1:
            return dict(self._metadata)
        return next(iter(self._readers.values())).metadata()

    def _route(self, name: str) -> tuple[Reader, str]:
        raise NotImplementedError  # every routed read is overridden: each leases its shard

    def _reader_of(self, name: str) -> tuple[HeaderOnly, str]:
        self._live()  # a closed reader answers nothing, headers kept or not
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        stored = self._aliases.get(name, name)
        reader = self._owner.get(stored)
        if reader is None:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        return reader, stored

    def info(self, name: str) -> TensorInfo:
        reader, stored = self._reader_of(name)
        return reader.info(stored)

    @property
    def has_checksums(self) -> bool:
        return bool(self._readers) and all(r.has_checksums for r in self._readers.values())

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    @property
    def structure(self) -> Any:
        return self._structure

    @property
    def read_mode(self) -> str:
        modes = {self._cache.call(h.key, lambda r: r.read_mode) for h in self._live()}
        return modes.pop() if len(modes) == 1 else "mixed"

    @property
    def bytes_read(self) -> int:
        return self._cache.bytes_read

    @property
    def open_count(self) -> int:
        """How many shard files are open now (at most ``open_files`` between reads)."""
        return self._cache.open_count

    def shard_headers(self) -> list[HeaderOnly]:
        """The header of each shard file (its ``path``), in the index's order: what ranks
        compare before they share a read of the directory."""
        return self._live()

    def _live(self) -> list[HeaderOnly]:
        if self._closed:
            raise ValueError(f"{self.path}: the reader is closed")
        return list(self._readers.values())

    # -- reading ---------------------------------------------------------------------------
    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        header, stored = self._reader_of(name)
        sliced = self._cache.call(header.key, lambda r: r.get_slice(stored, verify=verify))

        def read(lo: int, hi: int) -> torch.Tensor:  # the shard may be closed by then
            return self._cache.call(
                header.key, lambda r: r.get_slice(stored, verify=verify)._read(lo, hi)
            )

        sliced._read = read
        return sliced

    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        header, stored = self._reader_of(name)
        return self._cache.call(
            header.key, lambda r: r.read_range(stored, start, stop, out=out, verify=verify)
        )

    def _by_shard(self, names: Sequence[str] | None) -> dict[HeaderOnly, list[str]]:
        self._live()
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        groups: dict[HeaderOnly, list[str]] = {}
        for name in list(self._owner) if names is None else names:
            reader, stored = self._reader_of(name)
            groups.setdefault(reader, []).append(stored)
        return groups

    def _each_shard(self, work: Any, groups: dict[HeaderOnly, list[str]]) -> list[Any]:
        """``work(reader, names)`` per shard on its open reader, ``parallel`` shards at once;
        results in order."""

        def on_shard(header: HeaderOnly, names: list[str]) -> Any:
            return self._cache.call(header.key, lambda reader: work(reader, names))

        if len(groups) <= 1:
            return [on_shard(header, names) for header, names in groups.items()]
        with concurrent.futures.ThreadPoolExecutor(min(self._parallel, len(groups))) as pool:
            futures = [pool.submit(on_shard, header, names) for header, names in groups.items()]
            return [f.result() for f in futures]

    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        self.require_checksums(verify)
        groups = self._by_shard(names)

        def work(reader: Any, stored: list[str]) -> dict[str, torch.Tensor]:
            return reader.read(stored, pin_memory=pin_memory, verify=verify, progress=False)

        merged = {k: v for part in self._each_shard(work, groups) for k, v in part.items()}
        wanted = list(self._owner) if names is None else [self._reader_of(n)[1] for n in names]
        return {n: merged[n] for n in wanted}

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        self.require_checksums(verify)
        for header, stored in self._by_shard(names).items():

            def start(reader: Any, stored: list[str] = stored) -> None:
                reader.prefetch(stored, pin_memory=pin_memory, verify=verify)

            self._cache.call(header.key, start)

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        self._live()
        self.require_checksums()
        groups = self._by_shard(names)
        found = self._each_shard(lambda reader, stored: reader.verify(stored), groups)
        return [name for part in found for name in part]

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        self.require_checksums(verify)
        merged: dict[str, torch.Tensor] = {}
        for header, stored in self._by_shard(names).items():

            def mapped(reader: Any, stored: list[str] = stored) -> dict[str, torch.Tensor]:
                return reader.map(stored, verify=verify)

            merged.update(self._cache.call(header.key, mapped))
        return merged

    def close(self) -> None:
        """Closes every shard (each first waits for its reads in flight)."""
        self._closed = True
        self._cache.close()

    def __enter__(self) -> ShardedReader:
        return self


def open_sharded(path: str | os.PathLike[str], **options: Any) -> ShardedReader:
    """Opens a sharded directory (or index) for lazy reading (see :class:`ShardedReader`)."""
    return ShardedReader(path, **options)
