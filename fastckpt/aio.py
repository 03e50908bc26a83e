"""The DeepNVMe API (``aio_handle``, ``gds_handle``, ``aio_read``, ``aio_write``,
``deepspeed_memcpy``), name for name with DeepSpeed's ``async_io`` op, so code written for it
ports by changing one import::

    # from deepspeed.ops.op_builder import AsyncIOBuilder
    # h = AsyncIOBuilder().load().aio_handle()
    from fastckpt.aio import aio_handle
    h = aio_handle()

What differs, on purpose: every completion is checked and failures raise ``OSError``
(errno and file name included) instead of returning -1 or printing; misuse raises
``TypeError``/``ValueError`` naming the argument; any length and offset work.

Example:
    >>> import torch
    >>> from fastckpt.aio import aio_handle
    >>> h = aio_handle()
    >>> t = torch.arange(10, dtype=torch.int64)
    >>> h.sync_pwrite(t, "/tmp/fastckpt-aio-face.bin")
    1
    >>> u = torch.empty_like(t)
    >>> h.sync_pread(u, "/tmp/fastckpt-aio-face.bin")
    1
    >>> bool(torch.equal(t, u))
    True
"""

from fastckpt.deepnvme import (
    aio_handle,
    aio_read,
    aio_write,
    deepspeed_memcpy,
    gds_handle,
    memcpy,
)

__all__ = ["aio_handle", "aio_read", "aio_write", "deepspeed_memcpy", "gds_handle", "memcpy"]
