"""A checkpoint opened on every rank of a group and read once between them: the
:class:`~fastckpt.Reader` that ``fastckpt.open(f, group=...)`` returns, and the shared forms
of ``load`` and ``load_into`` (:mod:`fastckpt.distributed.read_once` does the reading).

``group=`` takes a ``ProcessGroup``, or True for fastckpt's own checkpoint group
(:func:`~fastckpt.distributed.groups.checkpoint_group`); None, False, or a group of one rank
mean that each rank reads alone (the reader is then returned as it is).

Example (one process: no group, so the reader is not wrapped):
    >>> resolve_group(None), resolve_group(True), resolve_group(False)
    (None, None, None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastckpt.checkpoint.header_view import TensorInfo
from fastckpt.checkpoint.load_into import IncompatibleKeys, match_keys
from fastckpt.checkpoint.range_read import TensorSlice
from fastckpt.checkpoint.reader import Reader
from fastckpt.distributed.agreement import agree, raise_everywhere
from fastckpt.distributed.groups import checkpoint_group
from fastckpt.distributed.handshake import handshake
from fastckpt.distributed.read_once import agree_on_checkpoint, share_reads, stored_names

__all__ = ["GroupReader", "open_shared", "read_into_shared", "resolve_group"]


def resolve_group(group: Any) -> Any:
    """The process group a ``group=`` argument stands for, or None to read alone."""
    if group is None or group is False:
        return None
    if group is True:
        group = checkpoint_group()
        if group is None:
            return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group= needs torch.distributed to be initialized")
    if isinstance(group, bool) or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, True or None, got {type(group).__name__}")
    if "gloo" not in str(dist.get_backend(group)).lower():
        # the bytes travel from host memory: an NCCL-only group cannot carry them
        raise ValueError(
            f"group= needs a group with the gloo backend (host memory), got "
            f"{dist.get_backend(group)!r}; group=True uses fastckpt's own gloo group"
        )
    return group if dist.get_world_size(group) > 1 else None


def open_shared(
    opener: Callable[[], Reader],
    group: Any,
    operation: str = "fastckpt.load, open or load_into with group=",
) -> Reader:
    """Opens the checkpoint on every rank (``opener()``); a failure on any rank raises on
    every rank. Returns a :class:`GroupReader` (or the reader itself without a group).
    First every rank of ``group`` shakes hands (a rank that is not coming is named within
    ``FASTCKPT_HANDSHAKE_TIMEOUT`` seconds instead of holding the others)."""
    if group is not None:
        handshake(operation, group)
    reader = agree(opener, group, "opening the checkpoint")
    return reader if group is None else GroupReader(reader, group)


class GroupReader(Reader):
    """``reader``, opened with the same checkpoint on every rank of ``group``, whose bulk
    reads are collective: :meth:`read`, :meth:`get_tensors`, :meth:`get_tensor` and
    :meth:`verify` must be called by every rank, in the same order (each rank may ask for
    different tensors). The header's methods answer locally; :meth:`get_slice`,
    :meth:`read_range`, :meth:`prefetch` and :meth:`map` read on this rank alone.

    :attr:`bytes_read` is what this rank read from storage; over the group the sum is each
    tensor asked for once.
    """

    def __init__(self, reader: Reader, group: Any):
        self.inner = reader
        self.group = group
        self.path = reader.path
        self.device = getattr(reader, "device", torch.device("cpu"))

    # -- the header: this rank's own copy --------------------------------------------------
    def keys(self) -> list[str]:
        return self.inner.keys()

    def metadata(self) -> dict[str, str] | None:
        return self.inner.metadata()

    def info(self, name: str) -> TensorInfo:
        return self.inner.info(name)

    @property
    def has_checksums(self) -> bool:
        return self.inner.has_checksums

    @property
    def aliases(self) -> dict[str, str]:
        return self.inner.aliases

    @property
    def structure(self) -> Any:
        return self.inner.structure

    @property
    def read_mode(self) -> str:
        return self.inner.read_mode

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    # -- collective reads ------------------------------------------------------------------
    def read(
        self,
        names: Sequence[str] | None = None,
        *,
        pin_memory: bool = False,
        verify: bool = False,
        progress: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """Stored tensors (all when ``names`` is None), keyed by stored name, each read from
        storage by one rank of the group (verified there when ``verify``) and shared."""
        agree(lambda: self.inner.require_checksums(verify), self.group, "reading")
        result: dict[str, torch.Tensor] = {}
        share_reads(
            self.inner,
            names,
            self.group,
            deliver=result.__setitem__,
            verify=verify,
            pin_memory=pin_memory,
        )
        if self.device.type != "cpu":
            result = {name: t.to(self.device) for name, t in result.items()}
        return result

    def verify(
        self, names: Sequence[str] | None = None, *, progress: bool | None = None
    ) -> list[str]:
        """Checks stored CRC32Cs, each rank a stripe of the tensors; every rank returns the
        names of every damaged tensor. The ranks first agree that they opened the same
        checkpoint (``ValueError`` on every rank otherwise, naming the ranks and the file
        that differ): a stripe checked in another rank's file says nothing of this one's."""
        dist = torch.distributed
        me, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        agree_on_checkpoint(self.inner, self.group, "verifying")
        every = stored_names(self.inner, names)
        stripe = every[me::world]
        damaged: list[str] | None = None
        error: BaseException | None = None
        try:
            damaged = self.inner.verify(stripe, progress=progress) if stripe else []
        except Exception as exc:
            error = exc
        raise_everywhere(error, self.group, f"verifying {self.path}")
        found: list[Any] = [None] * world
        dist.all_gather_object(found, damaged, group=self.group)
        bad = {name for part in found for name in part}
        return [name for name in every if name in bad]

    # -- this rank alone -------------------------------------------------------------------
    def get_slice(self, name: str, *, verify: bool = False) -> TensorSlice:
        return self.inner.get_slice(name, verify=verify)

    def read_range(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        out: torch.Tensor | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        return self.inner.read_range(name, start, stop, out=out, verify=verify)

    def prefetch(
        self, names: Sequence[str], *, pin_memory: bool = False, verify: bool = False
    ) -> None:
        self.inner.prefetch(names, pin_memory=pin_memory, verify=verify)

    def map(
        self, names: Sequence[str] | None = None, *, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        return self.inner.map(names, verify=verify)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> GroupReader:
        return self


def read_into_shared(
    model_or_state_dict: Any,
    reader: Reader,
    group: Any,
    *,
    strict: bool = True,
    verify: bool | None = None,
) -> IncompatibleKeys:
    """``fastckpt.load_into`` over a group: keys and shapes are checked on every rank first
    (a mismatch on any rank raises on every rank, nothing read), then each rank reads its
    stripe and every destination is filled from the shared bytes with ``copy_`` (converting
    dtypes and devices as ``load_state_dict`` does)."""
    inner = reader.inner if isinstance(reader, GroupReader) else reader

    def check() -> tuple[dict[str, torch.Tensor], list[str], IncompatibleKeys, bool]:
        dest, shared, keys = match_keys(model_or_state_dict, inner, strict=strict)
        checking = inner.has_checksums if verify is None else verify
        inner.require_checksums(checking)
        return dest, shared, keys, checking

    dest, shared, keys, checking = agree(check, group, "matching the checkpoint's keys")
    aliases = inner.aliases
    targets: dict[str, list[torch.Tensor]] = {}
    for name in shared:
        if dest[name].numel():
            targets.setdefault(aliases.get(name, name), []).append(dest[name])

    def fill(name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            for target in targets[name]:
                target.copy_(tensor)

    share_reads(inner, list(targets), group, deliver=fill, verify=checking)
    return keys
