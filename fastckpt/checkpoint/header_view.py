"""What a checkpoint's header says, for every reader (local files, URLs): the tensor names,
their dtypes, shapes and offsets, the user's metadata, and whether the references inside the
header (aliases, checksums) hold together.

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.ones(2, 3)}, "/tmp/fastckpt-view.safetensors")
    >>> with fastckpt.open("/tmp/fastckpt-view.safetensors") as view:
    ...     view.keys(), view.info("w").shape, view.has_checksums
    (['w'], (2, 3), True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fastckpt import format
from fastckpt.checkpoint import compressed_tensors, dtypes
from fastckpt.errors import HeaderError

__all__ = ["HeaderView", "TensorInfo", "read_header"]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What the header says of one tensor, known without reading it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute file offset of the first byte


def read_header(storage: Any) -> format.Header:
    """Reads and parses the header of the file in ``storage`` (a
    :class:`~fastckpt.storage.Storage`) with :func:`fastckpt.format.read_header_from`.

    The first read takes ``storage.header_probe`` bytes: 8 for a local file (the length, then
    the header in a second read); for a URL 1 MiB, which usually holds the whole header in
    one request (a longer header takes a second).

    Raises:
        HeaderError: not a valid safetensors file; the message names the file.
    """
    return format.read_header_from(
        storage.read_bytes,
        storage.size(),
        where=storage.location,
        probe=storage.header_probe,
    )


class HeaderView:
    """The header-side of a single-file reader. Subclasses set ``path`` and call
    :meth:`_adopt_header`; they are :class:`~fastckpt.Reader` s."""

    path: str
    header: format.Header
    meta: format.FastckptMeta
    #: name -> true dtype, shape and CRC32C of each compressed tensor (compressed_tensors.py)
    compressed: dict[str, format.compressed.CompressedTensor]

    def _adopt_header(self, header: format.Header) -> None:
        """Takes a parsed header, checking what ties its parts together (HeaderError naming
        ``path`` otherwise): aliases point to stored tensors, checksums to existing ones,
        and every dtype is one torch can hold."""
        try:
            meta = format.split_metadata(header.metadata)
        except HeaderError as exc:
            raise HeaderError(f"{self.path}: {exc}") from None
        entries = header.entries
        # tensors held by other files (an incremental checkpoint) count as present here
        referenced = meta.references.tensors if meta.references is not None else {}
        for alias, target in meta.aliases.items():
            if target not in entries and target not in referenced:
                raise HeaderError(
                    f"{self.path}: alias {alias!r} points to missing tensor {target!r}"
                )
            if alias in entries and target in entries:
                _check_stored_copy(self.path, entries[alias], entries[target], meta.crcs)
            elif alias in entries or alias in referenced:
                _check_split_copy(self.path, alias, target, entries, referenced, meta.hashes)
        both = set(referenced) & set(entries)
        if both:
            raise HeaderError(
                f"{self.path}: tensor {sorted(both)[0]!r} is both stored and referenced"
            )
        if meta.hashes is not None:
            unknown = set(meta.hashes) - set(entries)
            if unknown:
                raise HeaderError(
                    f"{self.path}: XXH3-128 for missing tensor {sorted(unknown)[0]!r}"
                )
        if meta.crcs is not None:
            unknown = set(meta.crcs) - set(entries)
            if unknown:
                raise HeaderError(
                    f"{self.path}: checksum for missing tensor {sorted(unknown)[0]!r}"
                )
        if meta.pieces is not None:
            self._check_pieces(meta.pieces, entries)
        # compressed tensors: their true dtypes and shapes are checked with the table
        self.compressed = compressed_tensors.table_of(header, self.path)
        for entry in entries.values():
            if entry.name in self.compressed:
                continue
            # HeaderError for a dtype torch cannot hold, or a shape it cannot hold it in
            dtypes.torch_shape(entry.dtype, entry.shape, tensor=entry.name)
            dtypes.to_torch(entry.dtype)
        self.header, self.meta = header, meta

    def _check_pieces(
        self, table: format.PieceTable, entries: dict[str, format.TensorEntry]
    ) -> None:
        """Every tensor larger than one piece has exactly its number of piece CRCs, and the
        table names no other tensor."""
        for name, digest in table.digests.items():
            entry = entries.get(name)
            if entry is None:
                raise HeaderError(f"{self.path}: piece checksums for missing tensor {name!r}")
            want = format.piece_count(entry.nbytes, table.piece_size)
            if len(digest) // 4 != want:
                raise HeaderError(
                    f"{self.path}: tensor {name!r} ({entry.nbytes} bytes) has {want} pieces of "
                    f"{table.piece_size} bytes, but {format.KEY_PIECE_CRC32C} lists "
                    f"{len(digest) // 4}"
                )
        for name, entry in entries.items():
            if name not in table.digests and format.piece_count(entry.nbytes, table.piece_size):
                raise HeaderError(
                    f"{self.path}: tensor {name!r} ({entry.nbytes} bytes) has no piece "
                    f"checksums in {format.KEY_PIECE_CRC32C}"
                )

    def keys(self) -> list[str]:
        """Every tensor name, sorted as ``safe_open``'s ``keys()``: stored tensors and the
        aliases of tied tensors (those of older files, not stored as copies, included)."""
        return sorted(self.offset_keys())

    def offset_keys(self) -> list[str]:
        """Every tensor name in data order (``safe_open``'s ``offset_keys()``), then the
        aliases of tied tensors that older files do not store as copies."""
        self._check_open()
        entries = self.header.entries  # in data order: the header is parsed so
        return list(entries) + [a for a in self.meta.aliases if a not in entries]

    def _shared_entries(self) -> dict[str, format.TensorEntry]:
        """The entries to read for every tensor: a tied tensor's stored copy is left out,
        since its alias gives the target's tensor (the sharing restored)."""
        aliases = self.meta.aliases
        return {n: e for n, e in self.header.entries.items() if n not in aliases}

    def metadata(self) -> dict[str, str] | None:
        """``__metadata__`` without fastckpt's own ``fastckpt.*`` keys, as ``safe_open`` gives
        it for the same file less those keys: ``{"format": "pt", ...your keys}`` for a file
        ``fastckpt.save`` wrote; None for a file without metadata (as
        ``safetensors.torch.save_file`` writes without ``metadata=``)."""
        self._check_open()
        if not self.header.metadata:
            return None
        return dict(self.meta.user)

    def _check_open(self) -> None:
        """Raises ValueError naming the file once the reader is closed."""
        raise NotImplementedError

    @property
    def has_checksums(self) -> bool:
        """Whether the file records a CRC32C per tensor."""
        return self.meta.crcs is not None

    def _entry(self, name: str) -> format.TensorEntry:
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        try:
            return self.header.entries[self.meta.aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.path}") from None

    def _range_request(
        self, name: str, start: int, stop: int, out: torch.Tensor | None
    ) -> tuple[format.TensorEntry, torch.Tensor | None]:
        """Checks a request for bytes ``[start, stop)`` of tensor ``name``; returns its entry
        and ``out`` as the bytes to fill (None without ``out``)."""
        from fastckpt.checkpoint.range_read import byte_view, check_byte_range

        e = self._entry(name)
        check_byte_range(name, e.nbytes, start, stop, self.path)
        target = None if out is None else byte_view(out, stop - start)
        return e, target

    def info(self, name: str) -> TensorInfo:
        """dtype, shape, size and file offset of a tensor, without reading it."""
        self._check_open()
        e = self._entry(name)
        if e.name in self.compressed:  # its true dtype, shape and (uncompressed) size
            c = self.compressed[e.name]
            shape = dtypes.torch_shape(c.dtype, c.shape, tensor=name)
            offset = self.header.data_offset + e.begin
            return TensorInfo(name, dtypes.to_torch(c.dtype), shape, c.nbytes, offset)
        return TensorInfo(
            name,
            dtypes.to_torch(e.dtype),
            dtypes.torch_shape(e.dtype, e.shape, tensor=name),
            e.nbytes,
            self.header.data_offset + e.begin,
        )


def _check_split_copy(
    path: str,
    alias: str,
    target: str,
    entries: dict[str, format.TensorEntry],
    referenced: dict[str, format.Reference],
    hashes: dict[str, str] | None,
) -> None:
    """A tied tensor whose copy and target are not both stored here (one or both held by
    another file) must still be the same tensor: dtype, shape and XXH3-128."""

    def described(name: str) -> tuple[str, tuple[int, ...], str | None]:
        if name in entries:
            e = entries[name]
            return e.dtype, tuple(e.shape), (hashes or {}).get(name)
        r = referenced[name]
        return r.dtype, r.shape, r.xxh3_128

    copy, original = described(alias), described(target)
    if copy[:2] != original[:2] or (None not in (copy[2], original[2]) and copy[2] != original[2]):
        raise HeaderError(
            f"{path}: tied tensor {alias!r} is not the same tensor as its alias target "
            f"{target!r} (dtype, shape or XXH3-128 differ)"
        )


def _check_stored_copy(
    path: str,
    copy: format.TensorEntry,
    target: format.TensorEntry,
    crcs: dict[str, int] | None,
) -> None:
    """A tied tensor stored under its alias too (so readers that know no aliases see every
    key) must be the same tensor: dtype, shape and, when recorded, CRC32C. Otherwise a
    safetensors reader and fastckpt would see different values under one name."""
    if (copy.dtype, copy.shape) != (target.dtype, target.shape):
        raise HeaderError(
            f"{path}: tied tensor {copy.name!r} is stored as {copy.dtype}{list(copy.shape)} "
            f"but its alias target {target.name!r} is {target.dtype}{list(target.shape)}"
        )
    if crcs is not None and crcs.get(copy.name) != crcs.get(target.name):
        raise HeaderError(
            f"{path}: tied tensor {copy.name!r} is stored with other bytes than its alias "
            f"target {target.name!r} (their CRC32Cs differ)"
        )
