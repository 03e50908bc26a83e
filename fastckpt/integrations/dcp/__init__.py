"""torch.distributed.checkpoint (DCP) storage on fastckpt files.

DCP plans a distributed save or load (which rank writes which shard, how a checkpoint saved
by N ranks is resharded for M); this package moves the bytes. A checkpoint is a directory
(or an fsspec URL) holding:

- one fastckpt file per rank, ``__<rank>_<save id>.safetensors`` (safetensors-compatible,
  aligned for direct I/O, a CRC32C per tensor and per 4 MiB piece), holding that rank's
  shards under names ``<key>`` or ``<key>@<offsets>`` and non-tensor values as pickled bytes
  (uint8 tensors);
- ``.metadata``: DCP's metadata, pickled, whose ``storage_data`` maps each item to
  ``(file, tensor name)``; written last, it publishes the checkpoint.

Modules, each using only those listed before it:

- ``_paths``, ``_io_options``: names inside a checkpoint, where it lives, engine settings;
- :mod:`~fastckpt.integrations.dcp.metadata`: ``.metadata`` read with a restricted
  unpickler (nothing outside DCP's metadata classes is unpickled unless ``allow_pickle``);
- ``_stale_files``: which files no checkpoint and no running save needs;
- ``_stand_ins``: the state dict a stager hands DCP (stand-ins over the live tensors);
- :mod:`~fastckpt.integrations.dcp.lazy_stager`: ``FastCkptLazyStager``, ``dcp.async_save``
  without a copy (the writer streams the live tensors, fenced and version-checked);
- :mod:`~fastckpt.integrations.dcp.writer`, :mod:`~fastckpt.integrations.dcp.reader`: the
  ``StorageWriter`` and ``StorageReader``;
- :mod:`~fastckpt.integrations.dcp.conversion`: whole checkpoints to and from one file;
- :mod:`~fastckpt.integrations.dcp.describe`: what ``fastckpt inspect`` / ``verify`` print.

Example:
    >>> import os, tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from fastckpt.dcp import FastCkptReader, FastCkptWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "step-1")
    >>> state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
    >>> _ = dcp.save(state, storage_writer=FastCkptWriter(path), no_dist=True)
    >>> target = {"w": torch.zeros(2, 3), "step": 0}
    >>> dcp.load(target, storage_reader=FastCkptReader(path), no_dist=True)
    >>> target["w"][1].tolist(), target["step"]
    ([3.0, 4.0, 5.0], 1)
"""

from fastckpt.errors import UnsafePickleError
from fastckpt.integrations.dcp._paths import METADATA_FILE
from fastckpt.integrations.dcp.conversion import consolidate, load_full, to_dcp
from fastckpt.integrations.dcp.describe import describe_dcp, format_dcp, verify_dcp
from fastckpt.integrations.dcp.lazy_stager import FastCkptLazyStager
from fastckpt.integrations.dcp.metadata import is_dcp_checkpoint, read_dcp_metadata
from fastckpt.integrations.dcp.reader import FastCkptReader
from fastckpt.integrations.dcp.writer import FastCkptWriter

__all__ = [
    "FastCkptWriter",
    "FastCkptReader",
    "FastCkptLazyStager",
    "METADATA_FILE",
    "UnsafePickleError",
    "is_dcp_checkpoint",
    "read_dcp_metadata",
    "consolidate",
    "to_dcp",
    "describe_dcp",
    "format_dcp",
    "load_full",
    "verify_dcp",
]
