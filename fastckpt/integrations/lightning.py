"""Lightning checkpoints written and read by fastckpt.

Three ways in, from the most explicit to the shortest:

- :class:`FastCkptIO`: a Lightning ``CheckpointIO`` plugin, ``Trainer(plugins=[FastCkptIO()])``.
  Every checkpoint the Trainer saves becomes a fastckpt (safetensors) file, written with
  direct I/O and committed atomically.
- :class:`AsyncFastCkptIO`: the same, but the training loop waits only for the snapshot of
  the tensors (:func:`fastckpt.async_save`); the write goes on in the background.
- :class:`FastCkptCheckpoint`: a ``ModelCheckpoint`` that installs :class:`AsyncFastCkptIO`
  for its Trainer, ``Trainer(callbacks=[FastCkptCheckpoint(dirpath=..., every_n_train_steps=500)])``.

What is stored, and how (no pickle by default):

- Everything fastckpt's tree expresses is stored exactly: tensors, dicts (also with int
  keys), OrderedDicts with their ``_metadata``, lists, tuples, None, bool, int, float, str,
  bytes, ``torch.dtype``/``Size``/``device``. That covers the model's state_dict, optimizer
  and lr-scheduler states, loops, callbacks' states, precision plugin state and the
  hyper-parameters of ``save_hyperparameters()`` with plain values, so a default
  ``LightningModule`` saves and resumes with ``trainer.fit(ckpt_path=...)`` out of the box.
- A few Lightning-specific containers are stored as plain data and rebuilt on load from a
  table in the file's metadata (``lightning.types``): ``AttributeDict``,
  ``argparse.Namespace``, OmegaConf ``DictConfig``/``ListConfig`` (unresolved, so
  interpolations survive) and the type objects Lightning stores beside OmegaConf
  hyper-parameters (``hparams_type``). Rebuilding never imports anything by a name read
  from the file: the kinds are a fixed list.
- Anything else (a user class in the hyper-parameters, a function...) is refused with a
  ``TypeError`` that names where it sits in the checkpoint. ``allow_pickle=True`` stores
  such objects pickled instead, each marked as such in the file; loading them then needs
  ``weights_only=False`` (``trainer.fit(..., weights_only=False)``), since unpickling can
  run code.
- A checkpoint whose only tensors are the model's weights (``save_weights_only=True``) is
  stored as the flat ``state_dict`` under its own keys, so
  ``safetensors.torch.load_file(path)`` returns the model's ``state_dict``; the rest (epoch,
  global step, hyper-parameters...) sits in the metadata as JSON (``lightning.checkpoint``).

Loading reads fastckpt files and, for a smooth switch, also files written by
``torch.save`` (Lightning's default format), which it hands to ``TorchCheckpointIO``.

Files are plain fastckpt files: ``fastckpt.load(path)`` reads them outside Lightning,
``fastckpt verify`` checks them, every safetensors reader opens them. Paths are local.
Strategies that write sharded checkpoints themselves (FSDP, DeepSpeed) bypass
``CheckpointIO``; these classes serve single-file strategies (single device, DDP, rank 0
writes). The classes derive from ``lightning``'s; the plugins are also registered with the
standalone ``pytorch_lightning`` package, so its ``Trainer`` accepts them too.

Example:
    >>> import lightning.pytorch as pl
    >>> from fastckpt.lightning import AsyncFastCkptIO
    >>> trainer = pl.Trainer(plugins=[AsyncFastCkptIO()], logger=False, enable_progress_bar=False)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import importlib
import json
import os
import sys
from collections import OrderedDict
from typing import Any, Callable

import torch

import fastckpt

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.data import AttributeDict as _FabricAttributeDict
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.parsing import AttributeDict

    _OTHER_CHECKPOINT_IO = "lightning_fabric.plugins.io.checkpoint_io"
except ImportError:
    try:
        import pytorch_lightning as pl
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning_fabric.utilities.data import AttributeDict as _FabricAttributeDict
        from pytorch_lightning.callbacks import ModelCheckpoint
        from pytorch_lightning.utilities.parsing import AttributeDict

        _OTHER_CHECKPOINT_IO = None
    except ImportError as exc:
        raise ImportError(
            "fastckpt.lightning needs Lightning (the 'lightning' or 'pytorch_lightning' "
            "package); install it with: pip install 'fastckpt[lightning]'"
        ) from exc

__all__ = ["FastCkptIO", "AsyncFastCkptIO", "FastCkptCheckpoint", "load_from_checkpoint"]

#: Metadata key: JSON list of ``[path, kind]`` for objects stored as plain data.
TYPES_KEY = "lightning.types"
#: Metadata key of the weights-only layout: the checkpoint without its state_dict, as JSON.
CHECKPOINT_KEY = "lightning.checkpoint"
#: Metadata key of the weights-only layout: the state_dict's ``_metadata`` (module versions).
STATE_DICT_METADATA_KEY = "lightning.state_dict_metadata"
#: Metadata key of the weights-only layout: the state_dict's keys in their order.
STATE_DICT_KEYS_KEY = "lightning.state_dict_keys"

_Path = list  # a list of dict keys (str or int) and list indices from the checkpoint's root


# -- Lightning-specific objects as plain data -------------------------------------------------


def _omegaconf(*, load: bool = False) -> Any:
    """The omegaconf module if imported (OmegaConf objects exist only then), else None.

    Saving only looks in ``sys.modules``: a failed import is not cached, and saving asks once
    per object in the checkpoint. Loading (``load=True``) imports it.
    """
    if not load:
        return sys.modules.get("omegaconf")
    try:
        return importlib.import_module("omegaconf")
    except ImportError:
        return None


def _type_names(*, load: bool = False) -> dict[type, str]:
    """The type objects stored by name; rebuilt from this table only, never imported by name."""
    names: dict[type, str] = {
        dict: "dict",
        AttributeDict: "AttributeDict",
        argparse.Namespace: "argparse.Namespace",
    }
    oc = _omegaconf(load=load)
    if oc is not None:
        names[oc.DictConfig] = "omegaconf.DictConfig"
        names[oc.ListConfig] = "omegaconf.ListConfig"
    return names


def _as_plain(value: Any) -> tuple[str, Any] | None:
    """``(kind, plain data)`` for an object rebuilt on load from plain data, else None."""
    if isinstance(value, _FabricAttributeDict):
        return "AttributeDict", dict(value)
    if type(value) is argparse.Namespace:
        return "argparse.Namespace", dict(vars(value))
    oc = _omegaconf()
    if oc is not None and isinstance(value, (oc.DictConfig, oc.ListConfig)):
        kind = (
            "omegaconf.DictConfig" if isinstance(value, oc.DictConfig) else "omegaconf.ListConfig"
        )
        return kind, oc.OmegaConf.to_container(value, resolve=False)
    if isinstance(value, type):
        name = _type_names().get(value)
        if name is not None:
            return "type", name
    return None


def _nameable_key(key: Any) -> bool:
    # A path step must survive JSON: str and int keys do (bool would come back as an int).
    return type(key) is str or type(key) is int


def _encode(value: Any, path: _Path, table: list) -> Any:
    """``value`` with Lightning-specific objects replaced by plain data, noted in ``table``.

    Containers are copied only where something inside them changed, so tensors and
    untouched sub-trees are passed on as they are.
    """
    plain = _as_plain(value)
    if plain is not None:
        kind, data = plain
        table.append([list(path), kind])
        return data if kind == "type" else _encode_children(data, path, table, force=True)
    return _encode_children(value, path, table, force=False)


def _encode_children(value: Any, path: _Path, table: list, *, force: bool) -> Any:
    kind = type(value)
    if kind in (dict, OrderedDict):
        items, changed = [], force
        for key, item in value.items():
            new = _encode(item, [*path, key], table) if _nameable_key(key) else item
            changed = changed or new is not item
            items.append((key, new))
        if not changed:
            return value
        copy = kind(items)
        if kind is OrderedDict and "_metadata" in vars(value):
            copy._metadata = value._metadata
        return copy
    if kind in (list, tuple):
        items = [_encode(item, [*path, i], table) for i, item in enumerate(value)]
        if not force and all(a is b for a, b in zip(items, value)):
            return value
        return items if kind is list else tuple(items)
    return value


def _rebuild(kind: str, data: Any, where: str) -> Any:
    if kind == "AttributeDict":
        return AttributeDict(data)
    if kind == "argparse.Namespace":
        return argparse.Namespace(**data)
    if kind in ("omegaconf.DictConfig", "omegaconf.ListConfig"):
        oc = _omegaconf(load=True)
        if oc is None:
            raise ImportError(
                f"the checkpoint holds an OmegaConf {kind} at {where}; install omegaconf"
            )
        return oc.OmegaConf.create(data)
    if kind == "type":
        by_name = {name: t for t, name in _type_names(load=True).items()}
        if data not in by_name:
            raise ImportError(
                f"the checkpoint holds the type {data!r} at {where}; install omegaconf"
            )
        return by_name[data]
    raise fastckpt.HeaderError(f"unknown kind {kind!r} at {where} in {TYPES_KEY}")


def _restore(checkpoint: Any, table_text: str, filename: str) -> Any:
    """Rebuilds the objects listed in ``table_text`` (deepest first, so outer ones see inner)."""
    try:
        table = json.loads(table_text)
        entries = [(list(p), str(k)) for p, k in table]
    except (ValueError, TypeError) as exc:
        raise fastckpt.HeaderError(f"malformed {TYPES_KEY} metadata in {filename}: {exc}") from None
    for path, kind in sorted(entries, key=lambda e: len(e[0]), reverse=True):
        where = "checkpoint" + "".join(f"[{step!r}]" for step in path)
        try:
            if not path:
                checkpoint = _rebuild(kind, checkpoint, where)
                continue
            parent = checkpoint
            for step in path[:-1]:
                parent = parent[step]
            parent[path[-1]] = _rebuild(kind, parent[path[-1]], where)
        except (KeyError, IndexError, TypeError) as exc:
            raise fastckpt.HeaderError(
                f"{TYPES_KEY} in {filename} names {where}, which the checkpoint lacks: {exc!r}"
            ) from None
    return checkpoint


# -- file layouts -----------------------------------------------------------------------------


def _json_exact(value: Any) -> str | None:
    """``value`` as JSON when JSON gives it back equal (no tuples, int keys, tensors, NaN)."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return text if json.loads(text) == value else None


def _weights_layout(checkpoint: dict) -> tuple[dict, dict[str, str]] | None:
    """The flat layout of a weights-only checkpoint: ``(state_dict, metadata)``, or None.

    It applies when the model's ``state_dict`` is a ``str -> Tensor`` mapping and the rest of
    the checkpoint is plain JSON data, which is what ``save_weights_only=True`` produces.
    """
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not state:
        return None
    if not all(type(k) is str and type(v) is torch.Tensor for k, v in state.items()):
        return None
    rest = _json_exact({k: v for k, v in checkpoint.items() if k != "state_dict"})
    if rest is None:
        return None
    metadata = {CHECKPOINT_KEY: rest, STATE_DICT_KEYS_KEY: json.dumps(list(state))}
    module_versions = getattr(state, "_metadata", None)
    if module_versions is not None:
        versions = _json_exact(module_versions)
        if versions is None:
            return None
        metadata[STATE_DICT_METADATA_KEY] = versions
    return dict(state), metadata


def _prepare(checkpoint: dict) -> tuple[Any, dict[str, str]]:
    """What to hand to fastckpt for ``checkpoint``: ``(object, metadata)``."""
    table: list = []
    encoded = _encode(checkpoint, [], table)
    metadata: dict[str, str] = {}
    if table:
        metadata[TYPES_KEY] = json.dumps(table)
    flat = _weights_layout(encoded) if isinstance(encoded, dict) else None
    if flat is not None:
        encoded, extra = flat
        metadata.update(extra)
    return encoded, metadata


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


# torch.save's zip archive, or its legacy format (a pickle protocol 2 header, then a long).
# Read as a safetensors header length, either would be far above the 100 MB cap.
_TORCH_MAGICS = (b"PK\x03\x04", b"\x80\x02\x8a\x0a")


def _is_torch_file(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return head in _TORCH_MAGICS


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _check_storage_options(storage_options: Any, cls: type) -> None:
    if storage_options is not None:
        raise TypeError(
            f"storage_options is not supported by {cls.__name__}; pass fastckpt options "
            f"to its constructor instead (got {storage_options!r})"
        )


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

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Writes ``checkpoint`` to ``path`` (atomically: the old file stays until the new one
        is complete)."""
        _check_storage_options(storage_options, type(self))
        path = os.fspath(path)
        obj, metadata = _prepare(checkpoint)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        options = {"progress": False, **self.save_options}
        try:
            fastckpt.save(obj, path, metadata=metadata, allow_pickle=self.allow_pickle, **options)
        except TypeError as exc:
            raise _explain_refusal(exc, path) from exc

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
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "Checkpoint file not found", path)
    if _is_torch_file(path):
        # Onto the CPU unless told otherwise, as TorchCheckpointIO's own default does.
        cpu = map_location if map_location is not None else (lambda storage, loc: storage)
        return TorchCheckpointIO().load_checkpoint(path, cpu, weights_only=weights_only)
    safe = weights_only is not False
    with fastckpt.open(path) as reader:
        metadata = reader.metadata()
    loaded = fastckpt.load(path, map_location, weights_only=safe)
    if CHECKPOINT_KEY in metadata:
        try:
            checkpoint = json.loads(metadata[CHECKPOINT_KEY])
            order = json.loads(metadata.get(STATE_DICT_KEYS_KEY, "null")) or list(loaded)
            state = OrderedDict((key, loaded[key]) for key in order)
            if STATE_DICT_METADATA_KEY in metadata:
                state._metadata = json.loads(metadata[STATE_DICT_METADATA_KEY])
        except (ValueError, KeyError, TypeError) as exc:
            raise fastckpt.HeaderError(f"malformed Lightning metadata in {path}: {exc!r}") from None
        checkpoint["state_dict"] = state
    else:
        checkpoint = loaded
    if TYPES_KEY in metadata:
        checkpoint = _restore(checkpoint, metadata[TYPES_KEY], path)
    return checkpoint


def load_from_checkpoint(
    cls: type,
    checkpoint_path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for fastckpt files.

    ``LightningModule.load_from_checkpoint`` reads with ``torch.load``, which cannot read a
    safetensors file; this builds the module (or ``LightningDataModule``) the same way: from
    the hyper-parameters saved in the checkpoint, updated by ``kwargs``, then its state
    restored (``strict`` as Lightning's). The module is moved to the device of the loaded
    weights, as Lightning does. ``torch.save`` files are read too.

    Args:
        cls: the ``LightningModule`` or ``LightningDataModule`` subclass to build.
        checkpoint_path: a file written by :class:`FastCkptIO` / :class:`FastCkptCheckpoint`.
        map_location: where tensors go, in ``torch.load``'s forms (default: the CPU).
        strict: as ``load_from_checkpoint``'s (default: the module's ``strict_loading``).
        weights_only: ``False`` to load pickled objects (only from a trusted file).
        **kwargs: hyper-parameters that override the saved ones.

    Example:
        >>> import torch, lightning.pytorch as pl
        >>> from fastckpt.lightning import FastCkptIO, load_from_checkpoint
        >>> class Net(pl.LightningModule):
        ...     def __init__(self, width=4):
        ...         super().__init__()
        ...         self.save_hyperparameters()
        ...         self.layer = torch.nn.Linear(width, 1)
        >>> net = Net(width=3)
        >>> FastCkptIO().save_checkpoint(
        ...     {"state_dict": net.state_dict(), "hyper_parameters": dict(net.hparams)},
        ...     "/tmp/fastckpt-net.ckpt")
        >>> back = load_from_checkpoint(Net, "/tmp/fastckpt-net.ckpt")
        >>> back.hparams.width, torch.equal(back.layer.weight, net.layer.weight)
        (3, True)
    """
    # Lightning's own steps after its torch.load: _load_state builds the object from the
    # hyper-parameters and restores its state (the same internal function it calls).
    _load_state = importlib.import_module(f"{pl.__name__}.core.saving")._load_state

    if not (
        isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))
    ):
        raise TypeError(
            f"cls must be a LightningModule or LightningDataModule subclass, got {cls!r}"
        )
    path = os.fspath(checkpoint_path)
    location = map_location if map_location is not None else "cpu"
    checkpoint = _load(path, location, weights_only)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, torch.Tensor)]
    return model.to(tensors[0].device) if tensors else model


class _Removal:
    """A deletion put off until the saves in flight when it was asked for have committed."""

    def __init__(self, path: str, waiting_on: list[fastckpt.SaveFuture]):
        self.path = path
        self.waiting_on = waiting_on
        self.cancelled = False

    def ready(self) -> bool:
        return all(f.done() for f in self.waiting_on)

    def safe(self) -> bool:
        # A save that failed may have been meant to replace this file: keep it.
        return all(f.exception() is None for f in self.waiting_on)


class AsyncFastCkptIO(FastCkptIO):
    """A ``CheckpointIO`` whose saves block the training loop only for the snapshot.

    ``save_checkpoint`` returns once the tensors are copied into staging memory
    (:func:`fastckpt.async_save`); writing, fsync and the atomic rename go on in the
    background, so the model may be changed at once. Guarantees:

    - at most one save in flight per path: saving to a path still being written (``last.ckpt``
      every few steps) first waits for that write;
    - ``remove_checkpoint`` never deletes a file still being written, and puts a deletion
      off until the saves in flight have committed; if one of them fails, the file is kept,
      so a failed save never costs an existing checkpoint (top-k replacement). The deletion
      itself runs in a background thread too: unlinking a large file can take a second;
    - a failed save raises its error from the next ``save_checkpoint``/``remove_checkpoint``
      call, or from ``teardown()``, which waits for every save (Lightning calls it at the end
      of ``fit``). A save refused at once (an unsupported object) raises at once.

    Args:
        allow_pickle: as :class:`FastCkptIO`.
        max_pending: at most this many saves in flight; a further save waits for the oldest.
        save_options: other keyword options of :func:`fastckpt.async_save`.

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import AsyncFastCkptIO
        >>> io = AsyncFastCkptIO()
        >>> trainer = pl.Trainer(plugins=[io], logger=False, enable_progress_bar=False)
        >>> io.teardown()  # waits for pending saves; Lightning calls it after fit()
    """

    def __init__(self, *, allow_pickle: bool = False, max_pending: int = 2, **save_options: Any):
        super().__init__(allow_pickle=allow_pickle, **save_options)
        self.max_pending = max_pending
        self._unsettled: list[fastckpt.SaveFuture] = []  # not yet checked for an error
        self._latest: dict[str, fastckpt.SaveFuture] = {}  # path -> its latest save
        self._removals: list[_Removal] = []
        self._deleter: concurrent.futures.ThreadPoolExecutor | None = None
        self._deletions: dict[str, concurrent.futures.Future] = {}  # path -> its deletion

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Snapshots ``checkpoint`` and writes it to ``path`` in the background."""
        _check_storage_options(storage_options, type(self))
        path = os.fspath(path)
        self._raise_failures()
        previous = self._latest.get(path)
        if previous is not None and not previous.done():
            previous.wait()
            self._raise_failures()
        deleting = self._deletions.pop(path, None)
        if deleting is not None:
            deleting.result()  # an earlier file of this name goes before the new one arrives
        for removal in self._removals:
            if removal.path == path:
                removal.cancelled = True  # this save replaces the file: do not delete it later
        obj, metadata = _prepare(checkpoint)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        future = fastckpt.async_save(
            obj,
            path,
            metadata=metadata,
            allow_pickle=self.allow_pickle,
            max_pending=self.max_pending,
            **self.save_options,
        )
        self._latest[path] = future
        self._unsettled.append(future)
        if future.done() and future.exception() is not None:
            error = future.exception()
            self._unsettled.remove(future)
            if isinstance(error, TypeError):
                raise _explain_refusal(error, path) from error
            raise error
        self._reap()

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes ``path`` once the saves in flight now have committed (at once if none)."""
        path = os.fspath(path)
        self._raise_failures()
        waiting_on = [f for f in self._latest.values() if not f.done()]
        self._removals.append(_Removal(path, waiting_on))
        self._reap()

    def teardown(self) -> None:
        """Waits for every save; raises the first error not yet raised."""
        for future in list(self._latest.values()):
            future.wait()
        self._reap()
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = None
        self._latest.clear()
        self._raise_failures()

    def wait(self) -> None:
        """Waits for every save and pending deletion, like :meth:`teardown`.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().wait()
        """
        self.teardown()

    def _raise_failures(self) -> None:
        """Raises the first error among finished saves not checked yet (each is raised once)."""
        first: BaseException | None = None
        still: list[fastckpt.SaveFuture] = []
        for future in self._unsettled:
            if not future.done():
                still.append(future)
                continue
            error = future.exception()
            if error is not None and first is None:
                first = error
        self._unsettled = still
        for path in [p for p, f in self._latest.items() if f.done()]:
            del self._latest[path]
        for path in [p for p, f in self._deletions.items() if f.done()]:
            error = self._deletions.pop(path).exception()
            if error is not None and first is None:
                first = error
        if first is not None:
            raise first

    def _reap(self) -> None:
        """Starts the deletions whose saves have all finished."""
        pending: list[_Removal] = []
        for removal in self._removals:
            if not removal.ready():
                pending.append(removal)
            elif removal.safe() and not removal.cancelled:
                if self._deleter is None:
                    self._deleter = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="fastckpt-remove"
                    )
                self._deletions[removal.path] = self._deleter.submit(_remove_file, removal.path)
        self._removals = pending


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


# -- callback ---------------------------------------------------------------------------------


class FastCkptCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` writing fastckpt files, in the background by default.

    Takes ``ModelCheckpoint``'s arguments (``dirpath``, ``filename``, ``monitor``, ``mode``,
    ``save_top_k``, ``save_last``, ``every_n_train_steps``, ``every_n_epochs``,
    ``save_weights_only``...) with its semantics. At setup it makes the Trainer save and
    load through :class:`AsyncFastCkptIO` (or :class:`FastCkptIO` with
    ``asynchronous=False``), so ``trainer.fit(ckpt_path=...)`` reads the files back, and
    other ``ModelCheckpoint`` callbacks of the same Trainer write fastckpt files too. If the
    Trainer already has a fastckpt plugin, that one is used; another custom plugin is an
    error. Files keep Lightning's ``.ckpt`` suffix so ``ckpt_path="last"`` works.

    Args:
        asynchronous: block the training loop only for the snapshot of the tensors.
        allow_pickle: as :class:`FastCkptIO`.
        args, kwargs: ``ModelCheckpoint``'s.

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import FastCkptCheckpoint
        >>> trainer = pl.Trainer(
        ...     callbacks=[FastCkptCheckpoint(dirpath="/tmp/fastckpt-ckpts", every_n_train_steps=500)],
        ...     logger=False, enable_progress_bar=False)
    """

    def __init__(
        self, *args: Any, asynchronous: bool = True, allow_pickle: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.asynchronous = asynchronous
        self.allow_pickle = allow_pickle

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        current = trainer.strategy.checkpoint_io
        if isinstance(current, FastCkptIO):
            return
        if type(current) is not TorchCheckpointIO:
            raise ValueError(
                f"FastCkptCheckpoint saves through the Trainer's CheckpointIO, which is "
                f"{type(current).__name__} here; remove that plugin, or pass FastCkptIO() / "
                "AsyncFastCkptIO() in Trainer(plugins=...) and use ModelCheckpoint"
            )
        make: Callable[..., FastCkptIO] = AsyncFastCkptIO if self.asynchronous else FastCkptIO
        trainer.strategy.checkpoint_io = make(allow_pickle=self.allow_pickle)
