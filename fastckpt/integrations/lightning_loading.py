"""``MyModule.load_from_checkpoint`` for fastckpt files: :func:`load_from_checkpoint`,
:class:`FastCkptLoadingMixin`, and the wrapper of Lightning's own class method."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from typing import Any

import torch

from fastckpt.checkpoint import config_objects
from fastckpt.errors import WeightsOnlyError
from fastckpt.format.torch_save import SNIFF_BYTES, torch_save_format
from fastckpt.integrations.lightning_checkpoint_io import _head_of_url, _load
from fastckpt.integrations.lightning_framework import (
    pl,
)
from fastckpt.storage.locations import is_url


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
    hparams_file: str | os.PathLike[str] | None = None,
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
        hparams_file: a ``.yaml``/``.yml`` (or ``.csv``) file whose hyper-parameters replace
            the saved ones, read by Lightning's own reader, as Lightning does.
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
    if hparams_file is not None:
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = _read_hparams_file(hparams_file)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, torch.Tensor)]
    return model.to(tensors[0].device) if tensors else model


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
        """As ``LightningModule.load_from_checkpoint``."""
        return load_from_checkpoint(
            cls,
            checkpoint_path,
            map_location=map_location,
            strict=strict,
            weights_only=weights_only,
            hparams_file=hparams_file,
            **kwargs,
        )


def _read_hparams_file(hparams_file: str | os.PathLike[str]) -> Any:
    """The hyper-parameters in ``hparams_file``, read as Lightning's ``load_from_checkpoint``
    reads them (its own readers: YAML, or the CSV of tags)."""
    saving = importlib.import_module(f"{pl.__name__}.core.saving")
    extension = os.fspath(hparams_file).rsplit(".", 1)[-1].lower()
    if extension in ("yml", "yaml"):
        return saving.load_hparams_from_yaml(os.fspath(hparams_file))
    if extension == "csv":
        return saving.load_hparams_from_tags_csv(os.fspath(hparams_file))
    raise ValueError(f"hparams_file must be a .csv, .yml or .yaml file, got {hparams_file!r}")


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


def _read_fastckpt_files_in_load_from_checkpoint(
    base: type[pl.LightningModule] | type[pl.LightningDataModule],
) -> None:
    """Makes ``MyModule.load_from_checkpoint(path)`` read the files fastckpt writes, for every
    subclass of ``base`` (``LightningModule``, ``LightningDataModule``): a file that starts as
    a safetensors file goes to :func:`load_from_checkpoint`, any other to Lightning's own
    loader, unchanged.

    Lightning has no hook for its loaders, and without one a user who switched to
    :class:`FastCkptCheckpoint` meets torch's "Weights only load failed" advice, which would
    not help. So importing this module wraps that one class method, once per base. Where
    Lightning's method is not the restricted class method this expects, nothing is wrapped
    and :func:`load_from_checkpoint` / :class:`FastCkptLoadingMixin` remain the way.
    """
    descriptor = base.__dict__.get("load_from_checkpoint")
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
    base.load_from_checkpoint = wrapped  # type: ignore[method-assign]


_read_fastckpt_files_in_load_from_checkpoint(pl.LightningModule)
_read_fastckpt_files_in_load_from_checkpoint(pl.LightningDataModule)
