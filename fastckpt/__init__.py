"""fastckpt: PyTorch checkpoints at the speed of the storage device.

Two faces:

- :func:`save`, :func:`load` and :func:`open`: a drop-in for ``torch.save``/``torch.load``
  writing safetensors-compatible files laid out for direct I/O.
- :mod:`fastckpt.aio`: the DeepNVMe API (``aio_handle``, ``aio_read``, ``aio_write``,
  ``deepspeed_memcpy``, ``gds_handle``) over a native engine (io_uring, Linux AIO, a
  thread pool, or cuFile for GPUDirect Storage).

Example:
    >>> import fastckpt
    >>> fastckpt.engines()["threads"].available
    True
"""

from fastckpt import aio
from fastckpt._engines import EngineInfo, engines
from fastckpt.background import (
    LoadFuture,
    SaveFuture,
    async_load,
    async_save,
    release_staging,
    wait_all,
)
from fastckpt.errors import (
    ChecksumError,
    EngineUnavailableError,
    FastCkptError,
    HeaderError,
    WeightsOnlyError,
)
from fastckpt.gds import CuFileError
from fastckpt.loader import load
from fastckpt.reader import CheckpointReader, TensorInfo
from fastckpt.reader import open_checkpoint as open  # noqa: A001 - the public name, like safe_open
from fastckpt.saver import save

__all__ = [
    "save",
    "load",
    "open",
    "async_save",
    "async_load",
    "SaveFuture",
    "LoadFuture",
    "wait_all",
    "release_staging",
    "CheckpointReader",
    "TensorInfo",
    "aio",
    "engines",
    "EngineInfo",
    "FastCkptError",
    "HeaderError",
    "ChecksumError",
    "EngineUnavailableError",
    "WeightsOnlyError",
    "CuFileError",
]
__version__ = "0.1.0"
