"""torch.distributed.checkpoint on fastckpt files: ``FastCkptWriter`` and ``FastCkptReader``.

DCP plans multi-rank saves and loads (and reshards between world sizes); these move the
bytes, one aligned, checksummed fastckpt file per rank, committed atomically, in a local
directory or at an fsspec URL (``s3://...``, ``memory://...``; ``storage_options=``).

``FastCkptLazyStager`` makes ``dcp.async_save`` return without copying the state: the
writer streams the live tensors, fenced at the optimizer's next step and checked by their
version counters (see :mod:`fastckpt.integrations.dcp.lazy_stager`).

``.metadata`` is a pickle, as DCP writes it; it is read with an unpickler that admits only
DCP's metadata classes, torch dtypes and plain containers (``UnsafePickleError`` for
anything else), unless ``FastCkptReader(..., allow_pickle=True)``.

Example:
    >>> import os, tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastckpt.dcp import FastCkptReader, FastCkptWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = dcp.save({"w": torch.ones(3)}, storage_writer=FastCkptWriter(path), no_dist=True)
    >>> out = {"w": torch.zeros(3)}
    >>> dcp.load(out, storage_reader=FastCkptReader(path), no_dist=True)
    >>> out["w"].tolist()
    [1.0, 1.0, 1.0]
"""

from fastckpt.integrations.dcp import (
    FastCkptLazyStager,
    FastCkptReader,
    FastCkptWriter,
    UnsafePickleError,
    consolidate,
    is_dcp_checkpoint,
    load_full,
    to_dcp,
)

__all__ = [
    "FastCkptWriter",
    "FastCkptReader",
    "FastCkptLazyStager",
    "consolidate",
    "to_dcp",
    "load_full",
    "is_dcp_checkpoint",
    "UnsafePickleError",
]
