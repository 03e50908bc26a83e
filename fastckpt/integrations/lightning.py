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

- The checkpoint goes through fastckpt's tree (:mod:`fastckpt.checkpoint.tree`), one
  encoding for every object: tensors, dicts (also with int keys), OrderedDicts with their
  ``_metadata``, lists, tuples, None, bool, int, float, str, bytes,
  ``torch.dtype``/``Size``/``device``, and the configuration objects hyper-parameters come
  in: ``AttributeDict``, ``argparse.Namespace``, OmegaConf ``DictConfig``/``ListConfig``
  (unresolved, so interpolations survive) and the class Lightning stores beside OmegaConf
  hyper-parameters (``hparams_type``). Rebuilding never imports anything by a name read
  from the file: those classes are a fixed table. A default ``LightningModule`` saves and
  resumes with ``trainer.fit(ckpt_path=...)`` out of the box.
- The model's weights are stored under their own ``state_dict`` keys, so
  ``safetensors.torch.load_file(path)`` returns the ``state_dict`` (tied weights under
  each of their names) and, with ``save_weights_only=True``, nothing else; the rest
  (epoch, global step, hyper-parameters...) is in the tree, in the file's metadata.
- Anything else (a user class in the hyper-parameters, a function...) is refused with a
  ``TypeError`` that names where it sits in the checkpoint. ``allow_pickle=True`` stores
  such objects pickled instead, each marked as such in the file; loading them then needs
  ``weights_only=False`` (``trainer.fit(..., weights_only=False)``), since unpickling can
  run code.
- OmegaConf values resolve ``${...}`` interpolations when read, and a resolver can read
  the environment (``oc.env``) or run any code the program registered. Loading with the
  default ``weights_only`` therefore refuses an OmegaConf value that would call a resolver
  (:class:`~fastckpt.errors.WeightsOnlyError`, as ``torch.load(weights_only=True)`` refuses
  what it cannot load safely), and so does :func:`load_from_checkpoint` for plain
  hyper-parameters that Lightning would turn into a ``DictConfig``; node interpolations
  (``${model.width}``) are kept. ``weights_only=False`` loads them as saved.

Loading reads fastckpt files and, for a smooth switch, also files written by
``torch.save`` (Lightning's default format, any pickle protocol), which it hands to
``TorchCheckpointIO``.

Files are plain fastckpt files: ``fastckpt.load(path)`` reads them outside Lightning (the
same objects, types included), ``fastckpt verify`` checks them, every safetensors reader
opens them. Paths are local files or fsspec URLs (``s3://``, ``memory://``; ``https://`` to
read). ``MyModule.load_from_checkpoint(path)`` reads them once this module is imported (it
recognizes a fastckpt file by its first bytes and leaves every other file to Lightning's own
loader); a Trainer without these plugins, or a process that never imported this module, reads
with ``torch.load`` and cannot: use :func:`load_from_checkpoint`, :class:`FastCkptLoadingMixin`
or the plugins.
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

import concurrent.futures
import errno
import functools
import importlib
import inspect
import os
import sys
import tempfile
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from fastckpt.checkpoint import config_objects, tree
from fastckpt.checkpoint.asynchronous import SaveFuture, async_save, fenced_optimizers
from fastckpt.checkpoint.load import load as load_fastckpt
from fastckpt.checkpoint.read import open_checkpoint
from fastckpt.checkpoint.save import save as save_fastckpt
from fastckpt.errors import HeaderError, WeightsOnlyError
from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format
from fastckpt.integrations import remote
from fastckpt.storage import exists as storage_exists
from fastckpt.storage import open_storage
from fastckpt.storage.locations import is_url, url_to_fs
from fastckpt.storage.url import url_errors

#: The standalone package's CheckpointIO module, where the unified package is the one used.
_OTHER_CHECKPOINT_IO: str | None
if TYPE_CHECKING:  # checked against the unified package; the standalone one has its interface
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
else:
    try:  # the unified package first, then the standalone one
        import lightning.pytorch as pl
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.callbacks import ModelCheckpoint

        _OTHER_CHECKPOINT_IO = "lightning_fabric.plugins.io.checkpoint_io"
    except ImportError:
        try:
            import pytorch_lightning as pl
            from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
            from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
            from pytorch_lightning.callbacks import ModelCheckpoint

            _OTHER_CHECKPOINT_IO = None
        except ImportError as exc:
            raise ImportError(
                "fastckpt.lightning needs Lightning (the 'lightning' or 'pytorch_lightning' "
                "package); install it with: pip install lightning (or, in a clone of fastckpt, pip install '.[lightning]')"
            ) from exc

__all__ = [
    "FastCkptIO",
    "AsyncFastCkptIO",
    "FastCkptCheckpoint",
    "FastCkptLoadingMixin",
    "CheckpointNotFoundError",
    "load_from_checkpoint",
]

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


def _flatten(checkpoint: dict[str, Any], path: str, allow_pickle: bool) -> tree.Flat:
    """``checkpoint`` split for saving, its weights named by their ``state_dict`` keys."""
    try:
        return tree.flatten(checkpoint, allow_pickle=allow_pickle, name_root=_WEIGHTS)
    except TypeError as exc:
        raise _explain_refusal(exc, path) from exc


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
        flat = _flatten(checkpoint, path, self.allow_pickle)
        _make_parent(path)
        if is_url(path):
            remote.save(flat, path, **self.save_options)
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


def _refuse_resolving_hparams(
    cls: type[pl.LightningModule] | type[pl.LightningDataModule],
    checkpoint: dict[str, Any],
    path: str,
) -> None:
    """WeightsOnlyError when Lightning would make the saved hyper-parameters an OmegaConf
    config (``hparams_type``) and one of their strings would then call a resolver."""
    hparams_type = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_TYPE)
    if not isinstance(hparams_type, type):
        return
    if config_objects.class_name(hparams_type) not in (
        "omegaconf.DictConfig",
        "omegaconf.ListConfig",
    ):
        return
    hparams = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY)
    plain = config_objects.to_plain(hparams)
    text = config_objects.resolver_interpolation(hparams if plain is None else plain[1])
    if text is not None:
        raise WeightsOnlyError(
            f"{path}: Lightning would build an OmegaConf config from the hyper-parameters "
            f"(hparams_type), and their value {text[:60]!r} calls a resolver when read "
            "(oc.env reads this process's environment; others run code registered here); "
            "pass weights_only=False if you trust the file"
        )


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
    if weights_only is not False:
        _refuse_resolving_hparams(cls, checkpoint, path)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, torch.Tensor)]
    return model.to(tensors[0].device) if tensors else model


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


class FastCkptLoadingMixin:
    """Makes ``MyModule.load_from_checkpoint(path)`` read fastckpt files, for one class.

    Lightning's ``load_from_checkpoint`` reads with ``torch.load``, which fails on a
    safetensors file with torch's "Weights only load failed" advice (whose
    ``weights_only=False`` would not help either). Put this class first among the bases
    and the class method goes through :func:`load_from_checkpoint` instead, for fastckpt
    and ``torch.save`` files alike; nothing outside the class changes.

    Example:
        >>> import torch, lightning.pytorch as pl
        >>> from fastckpt.lightning import FastCkptIO, FastCkptLoadingMixin
        >>> class Net(FastCkptLoadingMixin, pl.LightningModule):
        ...     def __init__(self, width=4):
        ...         super().__init__()
        ...         self.save_hyperparameters()
        ...         self.layer = torch.nn.Linear(width, 1)
        >>> FastCkptIO().save_checkpoint(
        ...     {"state_dict": Net(3).state_dict(), "hyper_parameters": {"width": 3}},
        ...     "/tmp/fastckpt-mixin.ckpt")
        >>> Net.load_from_checkpoint("/tmp/fastckpt-mixin.ckpt").hparams.width
        3
    """

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | os.PathLike[str],
        map_location: Any = None,
        hparams_file: Any = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """As ``LightningModule.load_from_checkpoint``; ``hparams_file`` is not supported."""
        if hparams_file is not None:
            raise TypeError(
                "hparams_file is not supported with fastckpt files: pass the hyper-parameters "
                "to override as keyword arguments"
            )
        return load_from_checkpoint(
            cls,
            checkpoint_path,
            map_location=map_location,
            strict=strict,
            weights_only=weights_only,
            **kwargs,
        )


def _is_fastckpt_file(path: Any) -> bool:
    """Whether ``path`` (a local file or a URL) starts as a safetensors file does: what
    ``torch.load``, and so Lightning's own loader, cannot read. Anything unreadable (a file
    object, a missing path) is left to Lightning, which says what is wrong with it."""
    try:
        text = os.fspath(path)
        if is_url(text):
            head = _head_of_url(text)
        else:
            with open(text, "rb") as f:
                head = f.read(SNIFF_BYTES)
    except (OSError, TypeError, ValueError):
        return False
    return torch_save_format(head) is None and head[8:9] == b"{"


def _read_fastckpt_files_in_load_from_checkpoint() -> None:
    """Makes ``MyModule.load_from_checkpoint(path)`` read the files fastckpt writes, for every
    ``LightningModule``: a file that starts as a safetensors file goes to
    :func:`load_from_checkpoint`, any other to Lightning's own loader, unchanged.

    Lightning has no hook for its loaders, and without one a user who switched to
    :class:`FastCkptCheckpoint` meets torch's "Weights only load failed" advice, which would
    not help. So importing this module wraps that one class method, once. Where Lightning's
    method is not the restricted class method this expects, nothing is wrapped and
    :func:`load_from_checkpoint` / :class:`FastCkptLoadingMixin` remain the way.
    """
    descriptor = pl.LightningModule.__dict__.get("load_from_checkpoint")
    original = getattr(descriptor, "method", None)
    if original is None or getattr(original, "reads_fastckpt_files", False):
        return
    signature = inspect.signature(original)
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def load_from_checkpoint_reading_fastckpt_files(cls: Any, *args: Any, **kwargs: Any) -> Any:
        given = signature.bind(cls, *args, **kwargs).arguments
        path = given.get("checkpoint_path")
        if not _is_fastckpt_file(path):
            return original(cls, *args, **kwargs)
        # the mixin's checks and call, for this file
        return FastCkptLoadingMixin.load_from_checkpoint.__func__(  # type: ignore[attr-defined]
            cls,
            path,
            map_location=given.get("map_location"),
            hparams_file=given.get("hparams_file"),
            strict=given.get("strict"),
            weights_only=given.get("weights_only"),
            **((given.get(extra) or {}) if extra else {}),
        )

    load_from_checkpoint_reading_fastckpt_files.reads_fastckpt_files = True  # type: ignore[attr-defined]
    wrapped = type(descriptor)(load_from_checkpoint_reading_fastckpt_files)  # type: ignore[misc]
    pl.LightningModule.load_from_checkpoint = wrapped  # type: ignore[method-assign]


_read_fastckpt_files_in_load_from_checkpoint()


class _Removal:
    """A deletion put off until the saves in flight when it was asked for have committed."""

    def __init__(self, path: str, waiting_on: list[SaveFuture]):
        self.path = path
        self.waiting_on = waiting_on
        self.cancelled = False

    def ready(self) -> bool:
        return all(f.done() for f in self.waiting_on)

    def safe(self) -> bool:
        # A save that failed may have been meant to replace this file: keep it.
        return all(f.exception() is None for f in self.waiting_on)


def _has_cuda_tensors(flat: tree.Flat) -> bool:
    return any(t.device.type == "cuda" for t in flat.tensors.values())


class AsyncFastCkptIO(FastCkptIO):
    """A ``CheckpointIO`` whose saves barely block the training loop.

    During a run of a Trainer whose state is on the CPU, ``save_checkpoint`` is lazy by
    default (:func:`fastckpt.async_save` with ``fence=trainer.optimizers``): it copies at
    the call only what the Trainer's optimizers do not change (buffers such as BatchNorm's
    statistics, EMA copies, any other tensor), and a background thread streams the
    parameters and optimizer state through a fixed staging ring to the file while the next
    batch's forward and backward run. The optimizers' next ``step()`` first lets the save
    copy, or snapshot into host memory (up to ``fence_bytes``), what it has not reached, so
    the file holds the state at the save call. The fence comes after the step's closure
    (forward, backward, ``on_before_optimizer_step``) for torch's own optimizers, which
    evaluate the closure before they change anything, and before the step for others. A
    parameter or optimizer tensor changed in place by anything else (a manual update)
    before the step fails that save with :class:`~fastckpt.errors.LazySaveError` (raised by
    the next save or at the end of ``fit``); nothing mixed is committed. Such code calls
    :meth:`fence` first, or the plugin is made with ``lazy=False``.

    Otherwise -- ``lazy=False``, a state with CUDA tensors (unless ``lazy=True`` is asked
    for), a URL, or a plugin used outside a running Trainer (no optimizer is known to fence)
    -- ``save_checkpoint`` returns once the tensors are copied into staging memory (a
    point-in-time snapshot the size of the checkpoint), as Lightning's ``AsyncCheckpointIO``
    does; the write goes on in the background and the model may change at once.

    Either way, writing, fsync and the atomic rename happen in the background. Guarantees:

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
        lazy: stream the parameters and optimizer state while training goes on, fenced at
            the optimizers' steps, rather than snapshot them all before returning. Default
            (None): lazy for a state on the CPU, a snapshot for one with CUDA tensors.
        fence: the optimizers to fence when the plugin is used directly, outside a
            Trainer (which otherwise says which): without them such saves snapshot.
        fence_bytes: cap on the host memory one fence may snapshot (default: no cap); past
            it the step waits for the ring, at the storage's speed.
        save_options: other keyword options of :func:`fastckpt.async_save`.

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import AsyncFastCkptIO
        >>> io = AsyncFastCkptIO()
        >>> trainer = pl.Trainer(plugins=[io], logger=False, enable_progress_bar=False)
        >>> io.teardown()  # waits for pending saves; Lightning calls it after fit()
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        max_pending: int = 2,
        lazy: bool | None = None,
        fence: Any = (),
        fence_bytes: int | None = None,
        **save_options: Any,
    ):
        super().__init__(allow_pickle=allow_pickle, **save_options)
        self.max_pending = max_pending
        self.lazy = lazy
        self.fence_bytes = fence_bytes
        self._fence = fenced_optimizers(fence)
        self._reset_runtime_state()

    def _reset_runtime_state(self) -> None:
        self._unsettled: list[SaveFuture] = []  # not yet checked for an error
        self._latest: dict[str, SaveFuture] = {}  # path -> its latest save
        self._removals: list[_Removal] = []
        self._deleter: concurrent.futures.ThreadPoolExecutor | None = None
        self._deletions: dict[str, concurrent.futures.Future] = {}  # path -> its deletion
        self._threads: list[threading.Thread] = []  # the save threads started here

    def __getstate__(self) -> dict[str, Any]:
        """The options only: futures, locks and threads stay with this process (a Trainer
        is pickled after a ``ddp_spawn`` fit, its plugins with it)."""
        state = dict(self.__dict__)
        for name in ("_unsettled", "_latest", "_removals", "_deleter", "_deletions", "_threads"):
            state.pop(name, None)
        state["_fence"] = []  # optimizers stay with this process too
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime_state()

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
        flat = _flatten(checkpoint, path, self.allow_pickle)
        _make_parent(path)
        trainer = _calling_trainer()
        outside = _outside_a_run(trainer)
        if trainer is None:
            optimizers = self._fence  # used directly: only what the caller said to fence
        else:
            optimizers = [] if outside else list(getattr(trainer, "optimizers", None) or ())
        wanted = not _has_cuda_tensors(flat) if self.lazy is None else self.lazy
        lazy = wanted and bool(optimizers) and not is_url(path)
        before = set(threading.enumerate())
        if lazy:
            options = {"fence": optimizers, "fence_bytes": self.fence_bytes, **self.save_options}
            future = async_save(flat, path, max_pending=self.max_pending, **options)
        else:
            save = remote.async_save if is_url(path) else async_save
            future = save(flat, path, max_pending=self.max_pending, **self.save_options)
        self._threads.extend(
            t
            for t in threading.enumerate()
            if t not in before and t.name.startswith("fastckpt-save")
        )
        self._latest[path] = future
        self._unsettled.append(future)
        error = future.exception() if future.done() else None
        if error is not None:
            self._unsettled.remove(future)
            if isinstance(error, TypeError):
                raise _explain_refusal(error, path) from error
            raise error
        if outside:
            # Trainer.save_checkpoint() after (or before) fit: nothing would wait for this
            # save, and the caller expects the file there when the call returns.
            future.wait()
            self._raise_failures()
        self._reap()

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Reads a checkpoint, first waiting for a save of ``path`` still in flight here (its
        file is not in place until that save commits)."""
        pending = self._latest.get(os.fspath(path))
        if pending is not None:
            pending.wait()
            self._raise_failures()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes ``path`` once the saves in flight now have committed (at once if none)."""
        path = os.fspath(path)
        self._raise_failures()
        waiting_on = [f for f in self._latest.values() if not f.done()]
        self._removals.append(_Removal(path, waiting_on))
        self._reap()

    def teardown(self) -> None:
        """Waits for every save and deletion and joins their threads (none outlives the
        call); raises the first error not yet raised."""
        for future in list(self._latest.values()):
            future.wait()
        self._reap()
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = None
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()  # past its future's result: only the thread's own exit is left
        self._latest.clear()
        self._raise_failures()

    def in_flight(self, path: Any) -> bool:
        """Whether a save to ``path`` is still being written: the file is not there yet,
        but a checkpoint is on its way to that name.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().in_flight("/tmp/none.ckpt")
            False
        """
        future = self._latest.get(os.fspath(path))
        return future is not None and not future.done()

    def fence(self) -> None:
        """Returns once the tensors of every save in flight may be changed: call it before
        changing the model or optimizer state in place other than through an optimizer
        step (an EMA update in a callback, say). At once with ``lazy=False``.

        Example:
            >>> from fastckpt.lightning import AsyncFastCkptIO
            >>> AsyncFastCkptIO().fence()
        """
        for future in list(self._latest.values()):
            future.fence()

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
        still: list[SaveFuture] = []
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
        self._threads = [t for t in self._threads if t.is_alive()]
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

    With ``manager=`` (a :class:`fastckpt.CheckpointManager`), the checkpoints are the
    manager's steps instead of files in ``dirpath``: each save becomes
    ``manager.save(global_step, checkpoint, metrics)`` (the scalar metrics logged so far, so
    ``CheckpointManager(best=(monitor, mode, k))`` keeps the best steps), the manager's
    retention replaces ``save_top_k``/``save_last`` and its fast tier and drain apply;
    ``trainer.fit(model, ckpt_path="last")`` resumes from ``manager.restore()``, the newest
    step that loads verified in either tier. The triggers (``every_n_train_steps``,
    ``every_n_epochs``, ``train_time_interval``, ``monitor``) keep their meaning; ``dirpath``,
    ``filename``, ``save_top_k``, ``save_last`` and ``enable_version_counter`` do not apply and
    are refused. The manager is the caller's (fit waits for its saves and drains at the end but
    does not close it); one process saves (rank 0 of a single-file strategy).

    Args:
        asynchronous: block the training loop only for the snapshot of the tensors.
        allow_pickle: as :class:`FastCkptIO`.
        manager: a checkpoint manager to save into and resume from (any object with
            ``save(step, state, metrics)``, ``restore(**load_options)``, ``latest()``,
            ``wait()`` and a ``root`` directory, as :class:`fastckpt.CheckpointManager`).
        args, kwargs: ``ModelCheckpoint``'s.

    Example:
        >>> import lightning.pytorch as pl
        >>> from fastckpt.lightning import FastCkptCheckpoint
        >>> trainer = pl.Trainer(
        ...     callbacks=[FastCkptCheckpoint(dirpath="/tmp/fastckpt-ckpts", every_n_train_steps=500)],
        ...     logger=False, enable_progress_bar=False)

        On a manager, resuming from its newest good step:

        >>> import tempfile, fastckpt
        >>> manager = fastckpt.CheckpointManager(tempfile.mkdtemp(), keep_last=2)
        >>> callback = FastCkptCheckpoint(manager=manager, every_n_train_steps=100)
        >>> trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False)
        >>> # trainer.fit(model, ckpt_path="last")  # the newest step, or a fresh start
        >>> manager.close()
    """

    def __init__(
        self,
        *args: Any,
        asynchronous: bool = True,
        allow_pickle: bool = False,
        manager: Any = None,
        **kwargs: Any,
    ) -> None:
        if manager is not None:
            _check_manager_arguments(manager, args, kwargs)
        super().__init__(*args, **kwargs)
        self.asynchronous = asynchronous
        self.allow_pickle = allow_pickle
        self.manager = manager

    def _generate_state_key(self, **kwargs: Any) -> str:
        # ModelCheckpoint's key, so a run started with ModelCheckpoint resumes here (best,
        # top-k and last files) and the other way round.
        return f"{ModelCheckpoint.__qualname__}{kwargs!r}"

    @property
    def _legacy_state_key(self) -> Any:
        # Lightning looks a callback's state up under this key when ``state_key`` finds none:
        # files of earlier fastckpt versions keep it under this class's own name.
        return type(self).__qualname__ + self.state_key[len(ModelCheckpoint.__qualname__) :]

    def file_exists(self, filepath: Any, trainer: pl.Trainer) -> bool:
        """Whether ``filepath`` is taken: on disk, or the name of a save still in flight.

        ``ModelCheckpoint`` picks a new name (``-v1``, ``-v2``...) only for a name taken; a
        background save has not renamed its file into place yet, and would otherwise be
        overwritten by the next checkpoint given the same name.
        """
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncFastCkptIO) and io.in_flight(filepath):
            # Only the rank that saves knows; the reduction is the one every rank makes.
            return trainer.strategy.reduce_boolean_decision(True, all=False)
        return super().file_exists(filepath, trainer)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.manager is not None:
            self._setup_on_manager(trainer)
            return
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

    # -- on a checkpoint manager -------------------------------------------------------------
    def _setup_on_manager(self, trainer: pl.Trainer) -> None:
        current = trainer.strategy.checkpoint_io
        if not isinstance(current, (FastCkptIO, _ManagerCheckpointIO)) and (
            type(current) is not TorchCheckpointIO
        ):
            raise ValueError(
                f"FastCkptCheckpoint(manager=...) saves through the Trainer's CheckpointIO, "
                f"which is {type(current).__name__} here; remove that plugin"
            )
        self.dirpath = _resume_path(self.manager, trainer)
        self._fs = url_to_fs(self.dirpath)[0]
        if not isinstance(current, _ManagerCheckpointIO) or current.manager is not self.manager:
            trainer.strategy.checkpoint_io = _ManagerCheckpointIO(
                self.manager,
                self.dirpath,
                allow_pickle=self.allow_pickle,
                asynchronous=self.asynchronous,
            )

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """With a manager, what ``ckpt_path="last"`` resolves to: the manager itself (its
        CheckpointIO restores the newest good step), once it has a step."""
        if self.manager is None:
            return super()._find_last_checkpoints(trainer)
        if self.manager.latest() is None:
            return set()
        # Resolved before setup() runs: the Trainer's CheckpointIO is set here too.
        self._setup_on_manager(trainer)
        return {_resume_path(self.manager, trainer)}

    def _save_topk_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        if self.manager is None:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
            return
        # Every trigger saves a step: which steps stay is the manager's retention.
        where = os.fspath(self.dirpath) if self.dirpath else _resume_path(self.manager, trainer)
        self._save_checkpoint(trainer, where)

    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        if self.manager is None:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        # On a manager, the newest step is the last checkpoint.

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self.manager is None:
            super()._save_checkpoint(trainer, filepath)
            return
        metrics = _scalar_metrics(self._monitor_candidates(trainer))
        trainer.save_checkpoint(
            filepath,
            self.save_weights_only,
            storage_options={_MANAGER_STEP: trainer.global_step, _MANAGER_METRICS: metrics},
        )
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(weakref.proxy(self))


#: Keys of the ``storage_options`` by which :class:`FastCkptCheckpoint` hands a save's step
#: and metrics to :class:`_ManagerCheckpointIO` through ``Trainer.save_checkpoint``.
_MANAGER_STEP, _MANAGER_METRICS = "fastckpt.manager.step", "fastckpt.manager.metrics"
#: ModelCheckpoint arguments that name files, which a manager's steps replace.
_FILE_ARGUMENTS = ("dirpath", "filename", "save_top_k", "save_last", "enable_version_counter")


def _check_manager_arguments(manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    missing = [
        name
        for name in ("save", "restore", "latest", "wait")
        if not callable(getattr(manager, name, None))
    ]
    if missing or getattr(manager, "root", None) is None:
        raise TypeError(
            f"manager must be a checkpoint manager (fastckpt.CheckpointManager), got "
            f"{type(manager).__name__} (no {', '.join(missing) or 'root'})"
        )
    given = [name for name in _FILE_ARGUMENTS if name in kwargs] + (["dirpath"] if args else [])
    if given:
        raise ValueError(
            f"FastCkptCheckpoint(manager=...) keeps the manager's steps, so {', '.join(given)} "
            "do not apply: set the retention on the manager (CheckpointManager(root, "
            "keep_last=..., keep_every=..., best=(monitor, mode, save_top_k)))"
        )


def _resume_path(manager: Any, trainer: pl.Trainer) -> str:
    """The local directory that stands for ``manager`` as Lightning's ``"last"`` checkpoint:
    its first local tier, else the Trainer's ``default_root_dir`` (Lightning checks that a
    candidate exists and reads its time, through a file system without the manager's
    storage options)."""
    tiers = [getattr(manager, "fast", None), manager.root]
    local = [os.fspath(t) for t in tiers if t is not None and not is_url(os.fspath(t))]
    if local:
        return local[0]
    directory = os.path.abspath(os.fspath(trainer.default_root_dir))
    os.makedirs(directory, exist_ok=True)
    return directory


def _scalar_metrics(candidates: dict[str, Any]) -> dict[str, float]:
    """The logged metrics a step's marker records: every one-element number."""
    metrics = {}
    for name, value in candidates.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            metrics[name] = float(value.detach().cpu().item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[name] = float(value)
    return metrics


class _ManagerCheckpointIO(CheckpointIO):
    """The Trainer's ``CheckpointIO`` while a :class:`FastCkptCheckpoint` saves on a manager:
    saves become the manager's steps, and ``resume_path`` (what ``ckpt_path="last"``
    resolves to) loads its newest good step; any other path loads as :class:`FastCkptIO`
    loads it."""

    def __init__(
        self, manager: Any, resume_path: str, *, allow_pickle: bool, asynchronous: bool
    ) -> None:
        super().__init__()
        self.manager = manager
        self.resume_path = resume_path
        self.allow_pickle = allow_pickle
        self.asynchronous = asynchronous
        self._saves: list[concurrent.futures.Future[Any]] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Saves ``checkpoint`` as the manager's step ``global_step``."""
        options = dict(storage_options or {})
        step = options.pop(_MANAGER_STEP, checkpoint.get("global_step"))
        metrics = options.pop(_MANAGER_METRICS, None)
        _check_storage_options(options or None, type(self))
        if not isinstance(step, int):
            raise ValueError(f"a checkpoint saved on a manager needs its global_step, got {step!r}")
        self._raise_failures()
        flat = _flatten(checkpoint, os.fspath(path), self.allow_pickle)
        future = self.manager.save(step, flat, metrics=metrics)
        self._saves.append(future)
        if not self.asynchronous or _outside_a_run(_calling_trainer()):
            future.result()
        self._raise_failures()

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The manager's newest good step when ``path`` is the manager's (``"last"``), else
        the file at ``path``."""
        if os.fspath(path) != self.resume_path:
            return _load(os.fspath(path), map_location, weights_only)
        self._raise_failures()
        step, checkpoint = self.manager.restore(
            map_location=map_location, weights_only=weights_only is not False
        )
        if not isinstance(checkpoint, dict):
            raise HeaderError(
                f"step {step} of {path} is not a Lightning checkpoint: it holds a "
                f"{type(checkpoint).__name__}, not a dict"
            )
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Nothing: the manager's retention deletes steps."""

    def teardown(self) -> None:
        """Waits for the manager's saves and drains; raises the first error."""
        try:
            self._raise_failures(wait=True)
        finally:
            self.manager.wait()

    def _raise_failures(self, wait: bool = False) -> None:
        done = [f for f in self._saves if wait or f.done()]
        self._saves = [f for f in self._saves if f not in done]
        for future in done:
            future.result()


def _callback_signature() -> inspect.Signature:
    """``ModelCheckpoint.__init__``'s parameters, then fastckpt's own (keyword-only): what
    ``inspect.signature`` and LightningCLI report for :class:`FastCkptCheckpoint`."""
    base = inspect.signature(ModelCheckpoint.__init__)
    own = [
        inspect.Parameter(
            "asynchronous", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool
        ),
        inspect.Parameter(
            "allow_pickle", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool
        ),
        inspect.Parameter("manager", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any),
    ]
    kept = [p for p in base.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return base.replace(parameters=[*kept, *own])


FastCkptCheckpoint.__init__.__signature__ = _callback_signature()  # type: ignore[attr-defined]
