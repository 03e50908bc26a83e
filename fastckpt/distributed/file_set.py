"""Stored tensors of many files seen as one checkpoint, for a read shared across ranks
(:func:`~fastckpt.distributed.read_once.share_reads`): the rank files of a distributed
checkpoint, where every rank knows every stored tensor from the checkpoint's metadata but
no rank should open every file.

A tensor's key is its file and its name in that file (:func:`key`). What the ranks agree
on, and plan stripes from, is what the caller says of each key (dtype and shape: DCP's
metadata), so headers are opened only by the ranks that read from a file; files are
opened when a read needs them, at most ``fastckpt.config.open_files`` at once.

Example:
    >>> import os, tempfile, torch
    >>> from fastckpt.checkpoint.read import open_checkpoint
    >>> from fastckpt.checkpoint.save import save
    >>> d = tempfile.mkdtemp()
    >>> save({"x": torch.arange(3)}, os.path.join(d, "a.safetensors"))
    >>> files = FileSet(d, {key("a.safetensors", "x"): (torch.int64, (3,))}, open_checkpoint)
    >>> files.read([key("a.safetensors", "x")])[key("a.safetensors", "x")].tolist()
    [0, 1, 2]
    >>> files.bytes_read
    24
    >>> files.close()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fastckpt.checkpoint.header_view import TensorInfo
from fastckpt.checkpoint.open_readers import ReaderCache
from fastckpt.checkpoint.range_read import TensorSlice
from fastckpt.checkpoint.reader import Reader

__all__ = ["FileSet", "key", "split_key"]

_SEPARATOR = "\0"  # in no file name


def key(file_name: str, tensor: str) -> str:
    """The key of tensor ``tensor`` of file ``file_name``."""
    return f"{file_name}{_SEPARATOR}{tensor}"


def split_key(k: str) -> tuple[str, str]:
    """``(file name, tensor name)`` of a key."""
    file_name, _, tensor = k.partition(_SEPARATOR)
    return file_name, tensor


class FileSet(Reader):
    """The stored tensors ``tensors`` (key -> dtype and shape) of the files under
    ``directory``, each file opened with ``opener(path)`` when a read needs it. A
    :class:`~fastckpt.Reader` as far as a shared read needs one (the header's methods and
    bulk reads); it records no metadata, aliases or structure of its own."""

    def __init__(
        self,
        directory: str,
        tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        opener: Callable[[str], Any],
        join: Callable[[str, str], str] = os.path.join,
    ):
        self.path = directory
        self._join = join
        self._infos = {
            k: TensorInfo(
                split_key(k)[1],
                dtype,
                tuple(shape),
                _numel(shape) * torch.empty(0, dtype=dtype).element_size(),
                0,
            )
            for k, (dtype, shape) in sorted(tensors.items())
        }
        self._readers = ReaderCache(opener)

    def _file(self, k: str) -> tuple[str, str]:
        file_name, tensor = split_key(k)
        return self._join(self.path, file_name), tensor

    def keys(self) -> list[str]:
        return list(self._infos)

    def metadata(self) -> dict[str, str] | None:
        return None

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{self.path}: no stored tensor {split_key(name)}") from None

    @property
    def has_checksums(self) -> bool:
        return True  # each file says for itself when it is read (verify where it has them)

    @property
    def aliases(self) -> dict[str, str]:
        return {}

    @property
    def structure(self) -> Any:
        return None

    @property
    def read_mode(self) -> str:
        return "mixed"

    @property
    def bytes_read(self) -> int:
        return self._readers.bytes_read

    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (keys), one batch of reads per file; ``verify`` checks
        those of the files that record checksums."""
        per_file: dict[str, list[tuple[str, str]]] = {}
        for k in self.keys() if names is None else names:
            path, tensor = self._file(k)
            per_file.setdefault(path, []).append((k, tensor))
        result: dict[str, torch.Tensor] = {}
        for path, wanted in per_file.items():

            def work(reader: Any, wanted: list[tuple[str, str]] = wanted) -> None:
                tensors = reader.read(
                    [t for _, t in wanted],
                    pin_memory=pin_memory,
                    verify=verify and reader.has_checksums,
                    progress=False,
                )
                result.update({k: tensors[t] for k, t in wanted})

            self._readers.call(path, work)
        return result

    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        path, tensor = self._file(name)
        return self._readers.call(
            path,
            lambda r: r.read_range(tensor, start, stop, out=out, verify=verify and r.has_checksums),
        )

    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        path, tensor = self._file(name)
        return self._readers.call(path, lambda r: r.get_slice(tensor, verify=verify))

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        """Nothing: a file set reads when asked."""

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        damaged = []
        for k in self.keys() if names is None else names:
            path, tensor = self._file(k)

            def check(reader: Any, tensor: str = tensor) -> list[str]:
                return reader.verify([tensor], progress=False)

            if self._readers.call(path, check):
                damaged.append(k)
        return damaged

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a file set is read, not mapped")

    def close(self) -> None:
        self._readers.close()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
