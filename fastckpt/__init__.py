"""fastckpt: PyTorch checkpoints at the speed of the storage device.

Two faces:

- :func:`save`, :func:`load` and :func:`open`: a drop-in for ``torch.save``/``torch.load``
  writing safetensors-compatible files laid out for direct I/O.
- :mod:`fastckpt.aio`: the DeepNVMe API (``aio_handle``, ``aio_read``, ``aio_write``,
  ``deepspeed_memcpy``) over a native engine (io_uring, Linux AIO or a thread pool).

Example:
    >>> import fastckpt
    >>> fastckpt.engines()["threads"].available
    True
"""

from fastckpt import aio
from fastckpt._engines import EngineInfo, engines
from fastckpt.errors import ChecksumError, EngineUnavailableError, FastCkptError, HeaderError

__all__ = [
    "aio",
    "engines",
    "EngineInfo",
    "FastCkptError",
    "HeaderError",
    "ChecksumError",
    "EngineUnavailableError",
]
__version__ = "0.1.0"
