"""What this process remembers of the tensors it saved, so that the next incremental save
to the same series can tell a changed tensor without hashing it.

After a save to ``P``, each tensor's storage (a weak reference), version counter, data
pointer and layout are kept with the XXH3-128 written for it. A later save with ``base=P``
writes a tensor without hashing it first when it is the same memory and its version counter
has moved since: an in-place op changed it. The counter is never taken as proof that a
tensor did *not* change -- fused and foreach optimizer kernels, BatchNorm's forward pass,
writes through ``tensor.data`` or raw pointers change bytes without moving it -- so a tensor
whose counter has not moved is hashed and compared by content
(:mod:`~fastckpt.checkpoint.incremental`). Guards: the weak reference fails once the storage
is freed (a new tensor at the same address is not mistaken for the old one). Memory: weak
references and a few ints per tensor, for the last :data:`MAX_SERIES` destinations.

Example:
    >>> import torch
    >>> t = torch.ones(3)
    >>> record = SaveRecord("/tmp/fastckpt-rec.safetensors", {"t": t})
    >>> record.hashed({"t": "0" * 32})
    >>> previous("/tmp/fastckpt-rec.safetensors")["t"].written_in_place(t)
    False
    >>> _ = t.add_(1)
    >>> previous("/tmp/fastckpt-rec.safetensors")["t"].written_in_place(t)
    True
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from fastckpt.storage.locations import is_url

__all__ = [
    "MAX_INTACT",
    "MAX_SERIES",
    "SaveRecord",
    "TensorState",
    "forget",
    "previous",
    "remember_intact",
    "seen_intact",
]

#: Destinations whose tensors are remembered (the least recently saved are forgotten).
MAX_SERIES = 16
#: Stored tensors remembered as intact (the least recently seen are forgotten).
MAX_INTACT = 1 << 16

_lock = threading.Lock()
_records: collections.OrderedDict[str, dict[str, TensorState]] = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class TensorState:
    """A tensor as it was when saved, and the XXH3-128 of its bytes then."""

    storage: Any  # weakref.ref to the tensor's UntypedStorage
    version: int
    data_ptr: int
    layout: tuple[Any, ...]
    xxh3_128: str

    def written_in_place(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the same memory (storage, address, layout) written in place
        since: its version counter moved, so its bytes have most likely changed."""
        version = self._version_on_same_memory(t)
        return version is not None and version != self.version

    def _version_on_same_memory(self, t: torch.Tensor) -> int | None:
        """``t``'s version counter when it is this record's memory (storage, address and
        layout), else None."""
        state = _state_of(t)
        if state is None:
            return None
        storage, version, data_ptr, layout = state
        same = self.storage() is storage and self.data_ptr == data_ptr and self.layout == layout
        return version if same else None


def _state_of(t: torch.Tensor) -> tuple[Any, int, int, tuple[Any, ...]] | None:
    try:
        storage = t.untyped_storage()
        version = t._version
    except (RuntimeError, NotImplementedError):  # inference tensors have no version counter
        return None
    layout = (t.device, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
    return storage, version, t.data_ptr(), layout


def _key(path: str) -> str:
    return path if is_url(path) else os.path.realpath(os.path.abspath(path))


class SaveRecord:
    """The state of a save's tensors, taken when it is planned; kept for ``destination``
    once their hashes are known (:meth:`hashed`, called as the header is written)."""

    def __init__(self, destination: str, tensors: Mapping[str, torch.Tensor]):
        self.destination = destination
        self._states: dict[str, tuple[Any, int, int, tuple[Any, ...]]] = {}
        for name, t in tensors.items():
            state = _state_of(t)
            if state is not None:
                self._states[name] = state
        self._hashes: dict[str, str] = {}

    def known(self, hashes: Mapping[str, str]) -> None:
        """Hashes known before writing (tensors referred to, or hashed to compare)."""
        self._hashes.update(hashes)

    def hashed(self, hashes: Mapping[str, str], crcs: Mapping[str, int] | None = None) -> None:
        """The hashes of the tensors written: the record is complete and kept. ``crcs``:
        the CRC32C recorded for each tensor whose hash was computed from the bytes written
        (the two describe the same bytes), remembered with :func:`remember_intact`."""
        key = _key(self.destination)  # once: resolving the name stats each of its folders
        for name, crc in (crcs or {}).items():
            if hashes.get(name):
                _remember(key, name, hashes[name], crc)
        merged = {**self._hashes, **hashes}
        states = {}
        taken, self._states = self._states, {}  # from now on, only weak references
        for name, (storage, version, data_ptr, layout) in taken.items():
            digest = merged.get(name)
            if digest is not None:
                states[name] = TensorState(weakref.ref(storage), version, data_ptr, layout, digest)
        with _lock:
            _records[key] = states
            _records.move_to_end(key)
            while len(_records) > MAX_SERIES:
                _records.popitem(last=False)


# Stored tensors known to hold the bytes both their recorded hashes describe: (file, stored
# name, XXH3-128, CRC32C of the stored bytes). The bytes were written by this process or read
# back and hashed; bytes changed since fail the CRC32C every load checks, and a header
# recording other hashes is another key.
_intact_lock = threading.Lock()
_intact: collections.OrderedDict[tuple[str, str, str, int], None] = collections.OrderedDict()


def remember_intact(file: str, tensor: str, xxh3_128: str, crc32c: int) -> None:
    """Tensor ``tensor`` of ``file`` was seen (written, or read and hashed) to be bytes of
    XXH3-128 ``xxh3_128`` and CRC32C ``crc32c``.

    Example:
        >>> remember_intact("/tmp/fastckpt-seen.safetensors", "w", "0" * 32, 7)
        >>> seen_intact("/tmp/fastckpt-seen.safetensors", "w", "0" * 32, 7)
        True
        >>> seen_intact("/tmp/fastckpt-seen.safetensors", "w", "1" * 32, 7)
        False
    """
    _remember(_key(file), tensor, xxh3_128, crc32c)


def _remember(file_key: str, tensor: str, xxh3_128: str, crc32c: int) -> None:
    """:func:`remember_intact` of the file named ``file_key`` (:func:`_key`'s name)."""
    key = (file_key, tensor, xxh3_128, crc32c)
    with _intact_lock:
        _intact[key] = None
        _intact.move_to_end(key)
        while len(_intact) > MAX_INTACT:
            _intact.popitem(last=False)


def seen_intact(file: str, tensor: str, xxh3_128: str | None, crc32c: int | None) -> bool:
    """Whether :func:`remember_intact` was told these very hashes for ``tensor`` of ``file``."""
    if xxh3_128 is None or crc32c is None:
        return False
    key = (_key(file), tensor, xxh3_128, crc32c)
    with _intact_lock:
        if key not in _intact:
            return False
        _intact.move_to_end(key)
        return True


def previous(path: str) -> dict[str, TensorState]:
    """What the last save of this process to ``path`` recorded (empty when none)."""
    with _lock:
        return dict(_records.get(_key(path), {}))


def forget(path: str | None = None) -> None:
    """Forgets what was recorded for ``path`` (for every destination when None): the next
    incremental save with that base hashes every tensor it is not told is frozen, and reads
    the base's bytes it refers to.

    Example:
        >>> forget("/tmp/fastckpt-rec.safetensors")
        >>> previous("/tmp/fastckpt-rec.safetensors")
        {}
    """
    with _lock:
        if path is None:
            _records.clear()
        else:
            _records.pop(_key(path), None)
    with _intact_lock:
        if path is None:
            _intact.clear()
        else:
            for key in [k for k in _intact if k[0] == _key(path)]:
                del _intact[key]


def _after_fork_in_child() -> None:
    global _lock, _intact_lock
    _lock, _intact_lock = threading.Lock(), threading.Lock()  # a parent's thread may hold one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
