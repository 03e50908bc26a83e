"""The exception types of fastckpt.

Every failure fastckpt raises is one of these, or an ``OSError`` subclass that
carries ``errno`` and ``filename`` (so ``except FileNotFoundError`` works), or a
``TypeError``/``ValueError`` that names the offending argument.

Example:
    >>> import fastckpt
    >>> try:
    ...     fastckpt.load("/no/such/file.safetensors")
    ... except FileNotFoundError as e:
    ...     print(e.filename)
    /no/such/file.safetensors
"""

from __future__ import annotations

import pickle

__all__ = [
    "FastCkptError",
    "HeaderError",
    "ChecksumError",
    "EngineUnavailableError",
    "WeightsOnlyError",
    "UnsafePickleError",
    "NoChecksumsError",
    "LazySaveError",
    "MissingBaseError",
    "RestoreError",
    "checksum_mismatch",
]


class FastCkptError(Exception):
    """Base class of every fastckpt-specific error."""


class HeaderError(FastCkptError, ValueError):
    """A file is not a valid safetensors/fastckpt file; the message says what and where."""


class ChecksumError(FastCkptError):
    """A tensor's bytes do not match the CRC32C recorded when it was saved.

    Attributes:
        tensor: the name of the damaged tensor.
        filename: the file it was read from.
    """

    def __init__(self, message: str, *, tensor: str | None = None, filename: str | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.filename = filename


class LazySaveError(FastCkptError, RuntimeError):
    """A tensor changed while a lazy ``async_save`` was copying it (its version counter
    moved), so the save was not committed; the message names the tensor and how to fence
    the code that changed it."""


class NoChecksumsError(FastCkptError, ValueError):
    """``verify=True`` was asked of a checkpoint that records no checksums (written with
    ``checksum=False``, or by another safetensors writer). Nothing is damaged: the file
    simply cannot be verified. ``verify=None`` (the default of ``load``) verifies when
    checksums are present and reads without checking otherwise.

    Attributes:
        filename: the file (or directory) that has no checksums.
    """

    def __init__(self, message: str, *, filename: str | None = None):
        super().__init__(message)
        self.filename = filename


def checksum_mismatch(
    tensor: str, filename: str, got: int, expected: int, where: str = ""
) -> ChecksumError:
    """The error for tensor bytes whose CRC32C is ``got`` where ``expected`` was recorded:
    every reader (local files, URLs, shards; CPU and CUDA loads) builds it here, so the
    message is the same wherever the bytes came from. ``where`` narrows the place (a piece).

    Example:
        >>> str(checksum_mismatch("w", "ckpt.safetensors", 0x1234, 0xABCD))
        "tensor 'w' in ckpt.safetensors is damaged: CRC32C 00001234, expected 0000abcd"
    """
    return ChecksumError(
        f"tensor {tensor!r} in {filename} is damaged{where}: "
        f"CRC32C {got:08x}, expected {expected:08x}",
        tensor=tensor,
        filename=filename,
    )


class MissingBaseError(FastCkptError, FileNotFoundError):
    """An incremental checkpoint refers to tensors in an earlier file that is missing; the
    message names the file and a tensor that needs it (``filename`` is the missing file)."""


class RestoreError(FastCkptError, FileNotFoundError):
    """A checkpoint series holds committed steps, but none could be restored (each damaged,
    or missing a file): the message names each step tried, its directory and why;
    ``filename`` is the first file found missing or damaged, when one was named. It is a
    ``FileNotFoundError``, as restoring an empty series raises."""


class EngineUnavailableError(FastCkptError):
    """An I/O engine asked for by name cannot run here; the message says why."""


class WeightsOnlyError(FastCkptError, pickle.UnpicklingError):
    """The checkpoint holds a pickled object and ``weights_only=True`` forbids unpickling.

    It is a ``pickle.UnpicklingError``, as ``torch.load(weights_only=True)`` raises, so code
    written for torch keeps catching it.
    """


class UnsafePickleError(WeightsOnlyError):
    """A pickle from a checkpoint names a global outside what the reader admits (a
    torch.distributed.checkpoint ``.metadata`` file may reference only DCP's metadata classes,
    torch dtypes and plain containers); nothing from the pickle ran.

    Attributes:
        global_name: the refused global, ``"module.name"``.
        filename: the file it came from (None when unknown).

    Example:
        >>> err = UnsafePickleError("refused os.system", global_name="os.system")
        >>> isinstance(err, pickle.UnpicklingError), err.global_name
        (True, 'os.system')
    """

    def __init__(
        self, message: str, *, global_name: str | None = None, filename: str | None = None
    ):
        super().__init__(message)
        self.global_name = global_name
        self.filename = filename
