"""Strong content hashes of tensors: XXH3-128 of each tensor's bytes, recorded by every save
(:data:`fastckpt.format.references.KEY_XXH3_128`) and compared by incremental saves.

XXH3-128 was measured at ~14 GB/s on one core here (BLAKE3's Python binding at ~3 GB/s), and
``xxhash`` releases the GIL while it hashes a large buffer, so hashes of several tensors run on
several cores. It is not a cryptographic hash: it tells changed bytes from unchanged ones
(collisions by chance are ~2**-64 likely), not a forgery from an original.

A save hashes each tensor in the pass that computes its CRC32C: :class:`TensorDigest` is the
CRC accumulator every writer already feeds (``update(address, nbytes)`` in file order), with
the hash fed from the same memory while it is in the CPU cache.

Example:
    >>> import torch
    >>> t = torch.arange(4, dtype=torch.int32)
    >>> acc = TensorDigest(t.nbytes, 0)
    >>> acc.update(t.data_ptr(), 8); acc.update(t.data_ptr() + 8, 8)
    >>> acc.strong == hash_tensor(t)
    True
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from fastckpt.io.checksums import PieceCrcs
from fastckpt.io.parallel_io import SharedPool

__all__ = [
    "BufferHasher",
    "TensorDigest",
    "hash_beside",
    "hash_tensor",
    "hash_tensors",
    "memory_at",
]

# Bytes of a device or non-contiguous tensor brought to contiguous host memory at a time.
_CHUNK_BYTES = 64 << 20


def memory_at(address: int, nbytes: int) -> Any:
    """A buffer over ``nbytes`` bytes at ``address`` (memory the caller keeps alive)."""
    return (ctypes.c_char * nbytes).from_address(address)


class TensorDigest(PieceCrcs):
    """A tensor's CRC32Cs (:class:`~fastckpt.io.checksums.PieceCrcs`) and its XXH3-128,
    both from the bytes given to :meth:`update` in order. ``known``: the digest is already
    known (an incremental save hashed the tensor to compare it), so it is not computed again.
    """

    def __init__(self, nbytes: int, piece_size: int, known: str | None = None):
        super().__init__(nbytes, piece_size)
        self._known = known
        self._hasher = None if known is not None else xxhash.xxh3_128()
        self._hashed = 0

    def update(self, address: int, nbytes: int) -> None:
        super().update(address, nbytes)
        self.hash_memory(address, nbytes)

    def update_crc(self, address: int, nbytes: int) -> None:
        """Feeds the CRC32Cs only (the hash is fed elsewhere, by a :class:`BufferHasher`)."""
        super().update(address, nbytes)

    def hash_memory(self, address: int, nbytes: int) -> None:
        """Feeds the hash only (for writers whose CRCs come from the native engine)."""
        if self._hasher is not None and nbytes:
            self._hasher.update(memory_at(address, nbytes))
            self._hashed += nbytes

    @property
    def from_bytes(self) -> bool:
        """Whether :attr:`strong` was computed from the bytes given to :meth:`update` (not
        known beforehand): then it and the CRC32C describe the same bytes."""
        return self._known is None and self.strong is not None

    @property
    def strong(self) -> str | None:
        """The XXH3-128 hex digest, or None when not every byte was hashed."""
        if self._known is not None:
            return self._known
        if self._hasher is None or self._hashed != self.nbytes:
            return None
        return self._hasher.hexdigest()


class BufferHasher:
    """Hashes staging buffers in the background, in the order they are given, while their
    writes are in flight: a buffer is handed over when full, and waited for (:meth:`wait`)
    before it is reused.

    The jobs of one hasher run one after another (each tensor's bytes must reach its hash in
    order), on threads shared by every save of the process: starting a thread per save cost
    more than writing a small state (0.3-1.6 ms against ~1 ms for a 1 MiB save here).

    Example:
        >>> import torch
        >>> t = torch.arange(8, dtype=torch.int32)
        >>> acc = TensorDigest(t.nbytes, 0)
        >>> hasher = BufferHasher()
        >>> hasher.start(1, [(acc, t.data_ptr(), 16)]); hasher.start(2, [(acc, t.data_ptr() + 16, 16)])
        >>> hasher.wait(1); hasher.wait(2); hasher.close()
        >>> acc.strong == hash_tensor(t)
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[concurrent.futures.Future[None], Any]] = (
            collections.deque()
        )
        self._running = False  # a shared thread is draining this hasher's queue
        self._jobs: dict[int, concurrent.futures.Future[None]] = {}

    def start(self, key: int, pieces: list[tuple[Any, int, int]]) -> None:
        """Hashes ``(digest, address, nbytes)`` pieces of the buffer ``key``, in order."""

        def run() -> None:
            for digest, address, nbytes in pieces:
                if isinstance(digest, TensorDigest):
                    digest.hash_memory(address, nbytes)

        job: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._jobs[key] = job
        with self._lock:
            self._queue.append((job, run))
            if self._running:
                return
            self._running = True
        try:
            _shared_pool().submit(self._drain)
        except RuntimeError:  # the interpreter is exiting (pending saves still finish):
            self._drain()  # hash here, in order, after the buffers handed over before

    def _drain(self) -> None:
        """Runs the queued jobs in order until none is left (on a shared thread)."""
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                job, run = self._queue.popleft()
            try:
                run()
            except BaseException as exc:  # the waiter re-raises it
                job.set_exception(exc)
            else:
                job.set_result(None)

    def wait(self, key: int) -> None:
        """Returns once the buffer ``key`` is hashed (at once if it never was handed over)."""
        job = self._jobs.pop(key, None)
        if job is not None:
            job.result()

    def close(self) -> None:
        """Waits for every job (ignoring their errors: the save is failing or done)."""
        concurrent.futures.wait(list(self._jobs.values()))
        self._jobs.clear()


def hash_beside(jobs: list[tuple[TensorDigest, int, int]]) -> concurrent.futures.Future[None]:
    """Feeds each ``(digest, address, nbytes)`` its memory's hash, in order, on a shared
    thread (no thread is started per call); the future is done when all are hashed.

    Example:
        >>> import torch
        >>> t = torch.ones(4)
        >>> acc = TensorDigest(t.nbytes, 0)
        >>> hash_beside([(acc, t.data_ptr(), t.nbytes)]).result()
        >>> acc.strong == hash_tensor(t)
        True
    """

    def run() -> None:
        for digest, address, nbytes in jobs:
            digest.hash_memory(address, nbytes)

    try:
        return _shared_pool().submit(run)
    except RuntimeError:  # the interpreter is exiting: hash here
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        run()
        done.set_result(None)
        return done


# The threads every :class:`BufferHasher` of the process hashes on, started once.
_hash_pool = SharedPool("fastckpt-hash", lambda: max(1, min(8, os.cpu_count() or 1)))


def _shared_pool() -> concurrent.futures.ThreadPoolExecutor:
    return _hash_pool.get()


def _host_chunks(t: torch.Tensor) -> Any:
    """``t``'s bytes in row-major order as contiguous uint8 CPU tensors."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return
    if not t.is_contiguous():
        t = t.contiguous()  # rare (transposed views): one temporary copy
    data = t.reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        yield data
        return
    for start in range(0, data.numel(), _CHUNK_BYTES):
        yield data[start : start + _CHUNK_BYTES].cpu()


def hash_tensor(t: torch.Tensor) -> str:
    """XXH3-128 of ``t``'s bytes in row-major order (what a save writes), as hex.

    Example:
        >>> import torch
        >>> hash_tensor(torch.zeros(0)) == hash_tensor(torch.zeros(0, 3))
        True
        >>> hash_tensor(torch.ones(2)) == hash_tensor(torch.ones(4)[::2])
        True
    """
    hasher = xxhash.xxh3_128()
    for chunk in _host_chunks(t):
        hasher.update(memory_at(chunk.data_ptr(), chunk.numel()))
    return hasher.hexdigest()


def hash_tensors(tensors: Mapping[str, torch.Tensor], workers: int) -> dict[str, str]:
    """:func:`hash_tensor` of each tensor, largest first on ``workers`` threads (the hash
    releases the GIL)."""
    order = sorted(tensors, key=lambda n: -tensors[n].numel() * tensors[n].element_size())
    if workers <= 1 or len(order) <= 1:
        return {n: hash_tensor(tensors[n]) for n in order}
    with concurrent.futures.ThreadPoolExecutor(workers, "fastckpt-hash") as pool:
        return dict(zip(order, pool.map(lambda n: hash_tensor(tensors[n]), order)))
