"""GPUDirect Storage: whether it runs here (and in which mode), and ``gds_handle``.

``gds_handle`` is DeepNVMe's handle for CUDA tensors (see :mod:`fastckpt.aio`); loads to
CUDA use cuFile with ``fastckpt.load(..., gds=True)``. cuFile is opened with ``dlopen`` at
run time, so nothing CUDA is needed to install fastckpt; ``FASTCKPT_CUFILE_LIBRARY`` names
the library file to use.

Example:
    >>> import fastckpt.gds
    >>> info = fastckpt.gds.engine_info()
    >>> info.name
    'gds'
    >>> info.available or bool(info.reason)
    True
    >>> fastckpt.gds.mode() in ("gds", "compat", None)
    True
"""

from fastckpt.deepnvme.gds_handle import gds_handle
from fastckpt.io.cufile import CuFileError, library_candidates, mode, transfer
from fastckpt.io.engines import gds_info as engine_info

__all__ = ["CuFileError", "engine_info", "gds_handle", "library_candidates", "mode", "transfer"]
