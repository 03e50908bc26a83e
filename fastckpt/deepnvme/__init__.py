"""The DeepNVMe API, name for name with DeepSpeed's: ``aio_handle`` for host memory and
``gds_handle`` (GPUDirect Storage) for CUDA tensors, over fastckpt's checked I/O engines.

Users import it as :mod:`fastckpt.aio`. ``gds_handle`` subclasses ``aio_handle``, one way.
"""

from fastckpt.deepnvme.aio_handle import (
    aio_handle,
    aio_read,
    aio_write,
    deepspeed_memcpy,
    memcpy,
)
from fastckpt.deepnvme.gds_handle import gds_handle

__all__ = ["aio_handle", "aio_read", "aio_write", "deepspeed_memcpy", "gds_handle", "memcpy"]
