"""The one reader type: what :func:`fastckpt.open` returns, wherever the checkpoint lives.

A :class:`Reader` reads a checkpoint lazily: the header (names, dtypes, shapes, offsets,
metadata) on opening, tensors when asked for. Its methods behave alike for a local file, a
file at an fsspec URL and a sharded directory; where one cannot apply (memory-mapping an
object in S3) it raises ``io.UnsupportedOperation`` saying why.

Example:
    >>> import torch, fastckpt
    >>> fastckpt.save({"w": torch.ones(2)}, "memory://doc-reader/w.safetensors")
    >>> with fastckpt.open("memory://doc-reader/w.safetensors") as r:
    ...     isinstance(r, fastckpt.Reader), r.keys(), r.get_tensor("w").tolist()
    (True, ['w'], [1.0, 1.0])
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastckpt.checkpoint.header_view import TensorInfo
from fastckpt.checkpoint.range_read import TensorSlice
from fastckpt.errors import NoChecksumsError

__all__ = ["Reader", "check_framework", "open_with"]

#: The ``framework=`` values of ``safetensors.safe_open`` that mean torch tensors.
TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")


def check_framework(framework: Any) -> None:
    """Accepts ``safetensors.safe_open``'s ``framework`` argument when it asks for torch
    tensors, the only kind fastckpt returns; raises ``ValueError`` naming it otherwise.

    Example:
        >>> check_framework("pt")
        >>> check_framework("np")
        Traceback (most recent call last):
        ...
        ValueError: framework='np': fastckpt returns torch tensors (framework='pt'); safetensors.safe_open reads numpy, TensorFlow and Flax arrays
    """
    if framework not in TORCH_FRAMEWORKS:
        raise ValueError(
            f"framework={framework!r}: fastckpt returns torch tensors (framework='pt'); "
            "safetensors.safe_open reads numpy, TensorFlow and Flax arrays"
        )


class _ReaderType(abc.ABCMeta):
    """Calling :class:`Reader` itself opens a checkpoint, as calling ``safetensors.safe_open``
    does; its subclasses are constructed as usual. The opener is :func:`fastckpt.open`, set by
    the layer that defines it (:func:`open_with`)."""

    opener: Callable[..., Reader] | None = None

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not Reader:
            return super().__call__(*args, **kwargs)
        if _ReaderType.opener is None:
            raise TypeError("fastckpt.Reader(f) needs fastckpt.api: call fastckpt.open(f)")
        return _ReaderType.opener(*args, **kwargs)


def open_with(opener: Callable[..., Reader]) -> None:
    """Makes ``Reader(f, ...)`` call ``opener(f, ...)``."""
    _ReaderType.opener = opener


class Reader(abc.ABC, metaclass=_ReaderType):
    """A checkpoint opened for lazy reading; like ``safetensors.safe_open``, and a context
    manager that closes it. ``path`` is where it lives (a path, URL or directory).

    ``fastckpt.open(f)`` returns one, whatever the storage; ``fastckpt.Reader(f, framework="pt",
    device="cpu")`` is the same call, spelled as ``safe_open(f, framework="pt", device="cpu")``.
    (``fastckpt.CheckpointReader`` is another name of this type.)

    Example:
        >>> import torch, fastckpt
        >>> fastckpt.save({"w": torch.ones(2)}, "/tmp/fastckpt-reader.safetensors")
        >>> with fastckpt.Reader("/tmp/fastckpt-reader.safetensors", "pt", device="cpu") as r:
        ...     isinstance(r, fastckpt.Reader), r.get_tensor("w").tolist()
        (True, [1.0, 1.0])
    """

    path: str

    # -- what the header says --------------------------------------------------------------
    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Every tensor name, stored tensors and aliases of tied tensors; sorted for a file
        (``safe_open``'s order), in the index's order for a sharded directory."""

    def offset_keys(self) -> list[str]:
        """Every tensor name in the order its bytes lie in storage, as ``safe_open``'s
        ``offset_keys()``: reading in this order reads the file front to back. A reader of
        several files gives :meth:`keys`'s order. Code of fastckpt that reads everything
        takes names from here, not from :meth:`keys`.

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"a": torch.ones(2), "b": torch.ones(1024)},
            ...               "/tmp/fastckpt-offsets.safetensors")
            >>> with fastckpt.open("/tmp/fastckpt-offsets.safetensors") as r:
            ...     r.keys(), r.offset_keys()  # 4 KiB tensors first, for alignment
            (['a', 'b'], ['b', 'a'])
        """
        return self.keys()

    @abc.abstractmethod
    def metadata(self) -> dict[str, str] | None:
        """The file's ``__metadata__`` without fastckpt's own ``fastckpt.*`` keys: what
        ``safe_open(f).metadata()`` returns for the same file, less those keys. None when the
        file has no ``__metadata__`` (``safetensors.torch.save_file`` without ``metadata=``
        writes none); a file ``fastckpt.save`` wrote always has ``{"format": "pt"}`` in it."""

    @abc.abstractmethod
    def info(self, name: str) -> TensorInfo:
        """dtype, shape, size and file offset of a tensor, without reading it (KeyError
        naming the checkpoint for an unknown name)."""

    @property
    @abc.abstractmethod
    def has_checksums(self) -> bool:
        """Whether every file read records a CRC32C per tensor."""

    @property
    @abc.abstractmethod
    def aliases(self) -> dict[str, str]:
        """Names of tied tensors -> the stored tensor they share."""

    @property
    @abc.abstractmethod
    def structure(self) -> Any:
        """The saved object's nested structure (None: a flat ``name -> tensor`` dict)."""

    def require_checksums(self, verify: bool = True) -> None:
        """Refuses to verify (``verify=True``) a file that records no checksums.

        Raises:
            NoChecksumsError: naming the file (a ``ValueError``: nothing is damaged).

        Example:
            >>> import torch, fastckpt
            >>> fastckpt.save({"w": torch.ones(2)}, "/tmp/fastckpt-nosum.safetensors", checksum=False)
            >>> with fastckpt.open("/tmp/fastckpt-nosum.safetensors") as r:
            ...     r.require_checksums(verify=False)  # nothing to check, nothing asked
            ...     try:
            ...         r.require_checksums()
            ...     except fastckpt.NoChecksumsError as e:  # also a ValueError
            ...         print(str(e)[:70])
            /tmp/fastckpt-nosum.safetensors records no checksums (saved with check
        """
        if verify and not self.has_checksums:
            raise NoChecksumsError(
                f"{self.path} records no checksums (saved with checksum=False or by another "
                "safetensors writer), so verify=True cannot check it; nothing is known to be "
                "damaged. Pass verify=None to verify only checkpoints that have checksums",
                filename=self.path,
            )

    # -- reading ---------------------------------------------------------------------------
    @abc.abstractmethod
    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """Stored tensors (all when ``names`` is None), keyed by stored name (an alias in
        ``names`` is read as its target)."""

    def get_tensor(self, name: str, *, verify: bool = False) -> torch.Tensor:
        """Reads one tensor (by stored name or alias)."""
        return self.get_tensors([name], verify=verify)[name]

    def get_tensors(
        self, names: Sequence[str], *, verify: bool = False, pin_memory: bool = False
    ) -> dict[str, torch.Tensor]:
        """Reads several tensors in one batch of parallel reads; ``name -> tensor``.

        Raises:
            ChecksumError: ``verify=True`` and a tensor is damaged.
            NoChecksumsError: ``verify=True`` and nothing records checksums.
        """
        if isinstance(names, str):
            raise TypeError("names must be a sequence of str, not a str")
        tensors = self.read(list(names), verify=verify, pin_memory=pin_memory)
        aliases = self.aliases
        return {n: tensors[aliases.get(n, n)] for n in names}

    @abc.abstractmethod
    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        """Tensor ``name`` to be sliced along its first dimension, reading only the rows
        asked for."""

    @abc.abstractmethod
    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        """Bytes ``[start, stop)`` of tensor ``name``: a uint8 tensor, or ``out`` filled."""

    @abc.abstractmethod
    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        """Starts reading these tensors in the background and returns at once; a later
        :meth:`get_tensors` waits only for what is still in flight, and verifies then what
        it is asked to verify."""

    @abc.abstractmethod
    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        """Checks stored CRC32Cs (and XXH3-128s where recorded); the names of damaged
        tensors (empty when intact).

        Raises:
            NoChecksumsError: nothing records checksums (the checkpoint cannot be verified).
        """

    def verify_failures(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> dict[str, str]:
        """:meth:`verify`, each damaged tensor with the check it failed (``"CRC32C"``,
        ``"XXH3-128"``, ``"decompressed CRC32C"``); readers that tell them apart say so,
        the others say ``"checksum"``."""
        return dict.fromkeys(self.verify(names, progress=progress), "checksum")

    @abc.abstractmethod
    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        """Stored tensors as views of a copy-on-write memory mapping (local files only)."""

    @property
    @abc.abstractmethod
    def read_mode(self) -> str:
        """How tensors are read now: ``"staged"`` or ``"direct"`` (O_DIRECT, through the
        staging pool or straight into the tensors), ``"buffered"`` (the page cache),
        ``"mapped"``, or ``"ranged"`` (ranged reads of a URL); ``"mixed"`` for shards read
        differently."""

    @property
    @abc.abstractmethod
    def bytes_read(self) -> int:
        """Data bytes asked of storage so far, by every read."""

    # -- lifetime --------------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """Waits for reads in flight, then releases the files; reading afterwards raises
        ``ValueError``. Closing twice is harmless."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RoutedReads:
    """Partial reads of a reader made of other readers (the shards of a directory, the files
    of an incremental chain): each goes to the reader that stores the tensor, under the name
    it is stored there by. A subclass says where with :meth:`_route`."""

    def _route(self, name: str) -> tuple[Reader, str]:
        """The reader that stores ``name``, and the name it stores it under."""
        raise NotImplementedError

    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        reader, stored = self._route(name)
        return reader.get_slice(stored, verify=verify)

    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        reader, stored = self._route(name)
        return reader.read_range(stored, start, stop, out=out, verify=verify)
