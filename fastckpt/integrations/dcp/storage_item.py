"""Where ``.metadata`` says an item of a fastckpt DCP checkpoint is stored.

``dcp.load(state, checkpoint_id=path)`` without ``storage_reader`` picks DCP's own
``FileSystemReader`` (DCP chooses among its built-in readers only), which looks up each
item's ``relative_path``, ``offset`` and ``length`` and passes those bytes to
``torch.load``. A fastckpt rank file holds raw tensor bytes, not ``torch.save`` archives,
so that reader cannot read it however the entry is spelled. An entry is therefore a ``(file, tensor name)`` pair that
answers those attribute lookups with an error saying which reader to pass, instead of
``AttributeError: 'tuple' object has no attribute 'relative_path'``.

The class is pickled by reference into ``.metadata``: its module path and name are part of
the file format and must not change.

Example:
    >>> item = StoredItem("__0_0123456789ab.safetensors", "w")
    >>> file, tensor = item
    >>> tensor
    'w'
    >>> try:
    ...     item.relative_path
    ... except TypeError as exc:
    ...     "FastCkptReader" in str(exc)
    True
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["StoredItem", "WRONG_READER"]

#: What DCP's ``FileSystemReader`` (or ``FsspecReader``) is told when it reads an entry.
WRONG_READER = (
    "{file}: this checkpoint was written by fastckpt.dcp.FastCkptWriter, whose rank files "
    "hold raw tensor bytes that DCP's FileSystemReader (the reader dcp.load picks when "
    "given no storage_reader) cannot read; pass "
    "storage_reader=fastckpt.dcp.FastCkptReader(checkpoint_dir), or turn it into one "
    "file with `fastckpt convert`"
)


class StoredItem(NamedTuple):
    """One item of a checkpoint: the rank file holding it and its tensor name there."""

    file: str
    tensor: str

    def _wrong_reader(self) -> Any:
        raise TypeError(WRONG_READER.format(file=self.file))

    # The attributes DCP's FileSystemReader reads from its own storage entries.
    @property
    def relative_path(self) -> Any:
        return self._wrong_reader()

    @property
    def offset(self) -> Any:
        return self._wrong_reader()

    @property
    def length(self) -> Any:
        return self._wrong_reader()

    @property
    def transform_descriptors(self) -> Any:
        return self._wrong_reader()
