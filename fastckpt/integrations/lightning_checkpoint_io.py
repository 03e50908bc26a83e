"""The synchronous plugin, :class:`FastCkptIO`, and what every plugin shares: turning a
Lightning checkpoint into fastckpt's tree and back, local files and URLs alike."""

from __future__ import annotations

import errno
import importlib
import os
import sys
import tempfile
import types
import warnings
from collections.abc import Mapping
from typing import Any

from fastckpt.checkpoint import tree
from fastckpt.checkpoint.load import load as load_fastckpt
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.save import save as save_fastckpt
from fastckpt.errors import HeaderError
from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format
from fastckpt.integrations import remote
from fastckpt.integrations.lightning_framework import (
    _OTHER_CHECKPOINT_IO,
    CheckpointIO,
    TorchCheckpointIO,
    pl,
)
from fastckpt.storage import exists as storage_exists
from fastckpt.storage import open_storage
from fastckpt.storage.locations import is_url, url_to_fs
from fastckpt.storage.url import url_errors

#: Where a checkpoint's tensors are named by their own keys rather than by their paths.
_WEIGHTS = ("state_dict",)
#: Metadata of the layout before checkpoints went through the tree alone (a type table,
#: and the JSON of a weights-only checkpoint): refused rather than misread.
_EARLIER_LAYOUT_KEYS = (
    "lightning.types",
    "lightning.checkpoint",
    "lightning.state_dict_keys",
    "lightning.state_dict_metadata",
)


#: Where Lightning puts the hyper-parameters of the module and of the data module.
_HPARAMS_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


def _flatten(
    checkpoint: dict[str, Any], path: str, allow_pickle: bool, left_out: set[str] | None = None
) -> tree.Flat:
    """``checkpoint`` split for saving, its weights named by their ``state_dict`` keys.

    A hyper-parameter that is no data (a file system object, a loss module...) is left out
    of the file when ``left_out`` is given, with one warning per name (``left_out`` holds
    the names warned of): Lightning would pickle it, and a run must not end at its first
    checkpoint for a value that only rebuilding the module needs. Anything else that is
    no data is refused (``TypeError`` naming it)."""
    try:
        return tree.flatten(checkpoint, allow_pickle=allow_pickle, name_root=_WEIGHTS)
    except TypeError as exc:
        if left_out is None or allow_pickle:
            raise _explain_refusal(exc, path) from exc
        refusal = exc
    kept, names = _storable_hparams(checkpoint)
    if not names:
        raise _explain_refusal(refusal, path) from refusal
    new = [n for n in names if n not in left_out]
    left_out.update(new)
    if new:
        warnings.warn(
            f"the hyper-parameters {', '.join(new)} hold objects that are no data and are left "
            f"out of the checkpoint {path} (and of every later one): pass them to "
            "load_from_checkpoint(..., name=value) when rebuilding the module, exclude them "
            "with save_hyperparameters(ignore=[...]), or store them pickled with "
            "allow_pickle=True",
            UserWarning,
            stacklevel=3,
        )
    try:
        return tree.flatten(kept, allow_pickle=False, name_root=_WEIGHTS)
    except TypeError as exc:
        raise _explain_refusal(exc, path) from exc


def _storable_hparams(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``checkpoint`` without the hyper-parameters that are no data, and their names
    (``hyper_parameters.loss``; within a plain dict, ``hyper_parameters.cfg.fs``)."""
    kept = dict(checkpoint)
    names: list[str] = []
    for key in _HPARAMS_KEYS:
        if key in checkpoint:
            kept[key] = _storable(checkpoint[key], key, names)
    return kept, names


def _storable(value: Any, where: str, names: list[str]) -> Any:
    if type(value) is dict or (isinstance(value, dict) and type(value).__name__ == "AttributeDict"):
        parts = {}
        for key, item in value.items():
            inner = _storable(item, f"{where}.{key}", names)
            if inner is not _LEFT_OUT:
                parts[key] = inner
        return type(value)(parts)
    try:
        tree.flatten({"value": value}, allow_pickle=False)
    except TypeError:
        names.append(where)
        return _LEFT_OUT
    return value


#: A hyper-parameter's value that :func:`_storable` leaves out.
_LEFT_OUT = object()


def _explain_refusal(exc: TypeError, path: str) -> TypeError:
    if "allow_pickle=True" not in str(exc):
        return exc
    what = str(exc).split("; pass allow_pickle=True")[0]
    return TypeError(
        f"cannot save the Lightning checkpoint {path} without pickle: {what}. Pass "
        "allow_pickle=True to FastCkptIO / AsyncFastCkptIO / FastCkptCheckpoint to store such "
        "objects pickled; loading them then needs weights_only=False "
        "(trainer.fit(..., weights_only=False))"
    )


def _is_torch_file(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    return torch_save_format(head) is not None


def _head_of_url(url: str) -> bytes:
    """The first bytes of the object at ``url``, asked for as a byte range. A server that
    ignores ranges (a plain HTTP file server) answers with the whole object: so be it, the
    caller then has all of it."""
    with url_errors(url, "read"):
        fs, where = url_to_fs(url)
        return bytes(fs.cat_file(where, start=0, end=SNIFF_BYTES))


def _remove_file(path: str) -> None:
    try:
        if is_url(path):
            open_storage(path, create=True).delete()
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


class CheckpointNotFoundError(FileNotFoundError):
    """A checkpoint that is not there: ``errno``/``filename`` set, and the message
    Lightning's ``TorchCheckpointIO`` gives (``Checkpoint file not found: <path>``), which
    code and tests written for Lightning match on.

    Example:
        >>> str(CheckpointNotFoundError("/tmp/none.ckpt"))
        'Checkpoint file not found: /tmp/none.ckpt'
    """

    def __init__(self, path: str):
        super().__init__(errno.ENOENT, "Checkpoint file not found", path)

    def __str__(self) -> str:
        return f"Checkpoint file not found: {self.filename}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.filename,))


def _make_parent(path: str) -> None:
    """Creates the local directory of ``path``; a URL's store needs none (and a local
    ``memory:/...`` directory must not appear)."""
    if not is_url(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _check_storage_options(storage_options: Any, cls: type) -> dict[str, Any]:
    """The keyword arguments that carry ``Trainer.save_checkpoint(storage_options=...)``:
    for a URL they go to its fsspec file system (``key``, ``secret``,
    ``client_kwargs``...); a local file has no use for them."""
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping):
        raise TypeError(
            f"storage_options of {cls.__name__} must be a mapping of fsspec options, got "
            f"{type(storage_options).__name__}"
        )
    return {"storage_options": dict(storage_options)}


# -- CheckpointIO plugins ---------------------------------------------------------------------


class FastCkptIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes fastckpt files with :func:`fastckpt.save`.

    Saves block until the file is durable (written, fsynced and renamed into place), which
    ``TorchCheckpointIO`` does not wait for, and still take a fraction of its time.

    Args:
        allow_pickle: store objects fastckpt cannot express (a user class in the
            hyper-parameters, say) pickled instead of refusing them; loading such a file
            then needs ``weights_only=False``.
        save_options: other keyword options of :func:`fastckpt.save` (``checksum``,
            ``engine``, ``staging_bytes``...).

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import FastCkptIO
        >>> trainer = pl.Trainer(plugins=[FastCkptIO()], logger=False, enable_progress_bar=False)
        >>> type(trainer.strategy.checkpoint_io).__name__
        'FastCkptIO'
    """

    def __init__(self, *, allow_pickle: bool = False, **save_options: Any) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.save_options = save_options
        #: Hyper-parameters left out of the checkpoints saved here (no data: see below).
        self.left_out: set[str] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Writes ``checkpoint`` to ``path`` (atomically: the old file stays until the new one
        is complete)."""
        options = _check_storage_options(storage_options, type(self))
        path = os.fspath(path)
        flat = _flatten(checkpoint, path, self.allow_pickle, self.left_out)
        _make_parent(path)
        if is_url(path):
            remote.save(flat, path, **options, **self.save_options)
        else:
            save_fastckpt(flat, path, **{"progress": False, **self.save_options})

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Reads a checkpoint written by this plugin (or by ``torch.save``).

        Args:
            map_location: as ``torch.load``'s (default: CPU).
            weights_only: None or True refuse pickled objects (see ``allow_pickle``); pass
                False only for files you trust.
        """
        return _load(os.fspath(path), map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes the checkpoint file (a missing file is not an error)."""
        _remove_file(os.fspath(path))


def _load(path: str, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    if not storage_exists(path):
        raise CheckpointNotFoundError(path)
    if is_url(path):
        return _load_url(path, map_location, weights_only)
    return _load_located(path, map_location, weights_only, _is_torch_file(path))


def _load_url(url: str, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    head = _head_of_url(url)
    if len(head) <= SNIFF_BYTES:
        return _load_located(url, map_location, weights_only, torch_save_format(head) is not None)
    # The server sent the whole object for a range request: it cannot serve the ranged reads
    # of fastckpt's reader either, and the bytes are here already. Read them as a file.
    with tempfile.TemporaryDirectory(prefix="fastckpt-url-") as directory:
        local = os.path.join(directory, os.path.basename(url.split("?", 1)[0]) or "checkpoint")
        with open(local, "wb") as f:
            f.write(head)
        try:
            return _load_located(local, map_location, weights_only, _is_torch_file(local))
        except OSError as exc:
            raise type(exc)(exc.errno, f"{exc.strerror} (read from {url})", url) from exc


def _load_located(
    path: str, map_location: Any, weights_only: bool | None, torch_file: bool
) -> dict[str, Any]:
    if torch_file:
        # Onto the CPU unless told otherwise, as TorchCheckpointIO's own default does.
        cpu = map_location if map_location is not None else (lambda storage, loc: storage)
        return TorchCheckpointIO().load_checkpoint(path, cpu, weights_only=weights_only)
    with open_checkpoint(path) as reader:
        earlier = sorted(set(reader.metadata() or ()) & set(_EARLIER_LAYOUT_KEYS))
    if earlier:
        raise HeaderError(
            f"{path} holds Lightning metadata of an earlier fastckpt layout ({', '.join(earlier)}), "
            "which this version does not read: load it with the version that wrote it and "
            "save it again"
        )
    checkpoint = load_fastckpt(path, map_location, weights_only=weights_only is not False)
    if not isinstance(checkpoint, dict):
        raise HeaderError(
            f"{path} is not a Lightning checkpoint: it holds a {type(checkpoint).__name__}, "
            "not a dict"
        )
    return checkpoint


def _trainer_save_checkpoint_codes() -> tuple[Any, ...]:
    codes = [pl.Trainer.save_checkpoint.__code__]
    for name in ("pytorch_lightning", "lightning.pytorch"):
        module = sys.modules.get(name)
        trainer = getattr(module, "Trainer", None)
        if trainer is not None and trainer.save_checkpoint.__code__ not in codes:
            codes.append(trainer.save_checkpoint.__code__)
    return tuple(codes)


def _calling_trainer() -> pl.Trainer | None:
    """The Trainer whose ``Trainer.save_checkpoint`` called this save, or None.

    The ``CheckpointIO`` interface gives no Trainer; the calling ``Trainer.save_checkpoint``
    frame has it, a few frames up (every ``ModelCheckpoint`` save goes through it).
    """
    codes = _trainer_save_checkpoint_codes()
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        if frame.f_code in codes:
            return frame.f_locals.get("self")
    return None


def _outside_a_run(trainer: Any) -> bool:
    """Whether ``trainer`` (the caller of this save) is not running (no ``fit``/
    ``validate``... whose teardown would wait for the save)."""
    status = getattr(getattr(trainer, "state", None), "status", None)
    return status is not None and str(getattr(status, "value", status)) != "running"


def _register_with_the_standalone_package() -> None:
    """Makes the plugins acceptable to ``pytorch_lightning.Trainer`` as well.

    ``lightning`` installs ``pytorch_lightning`` beside it, with its own ``CheckpointIO``
    class; that class is an ABC, so registering the plugins there is all it takes (the
    interface is the same). The callback, a ``ModelCheckpoint``, stays ``lightning``'s.
    """
    if _OTHER_CHECKPOINT_IO is None:
        return
    try:
        other = importlib.import_module(_OTHER_CHECKPOINT_IO)
    except ImportError:
        return
    other.CheckpointIO.register(FastCkptIO)


_register_with_the_standalone_package()
