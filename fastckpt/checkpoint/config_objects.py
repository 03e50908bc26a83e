"""Configuration objects that the tree stores as plain data: ``argparse.Namespace``,
Lightning's ``AttributeDict``, OmegaConf's ``DictConfig`` and ``ListConfig``, and those
classes themselves.

Training checkpoints carry hyper-parameters in these (Lightning also stores the class of
OmegaConf hyper-parameters, ``hparams_type``). Each object is stored as the dict or list it
wraps plus the name of its class; loading rebuilds only the classes of :data:`CLASSES`,
importing the module that table names, never one named by the file.

OmegaConf values resolve interpolations when they are read: ``${oc.env:NAME}`` reads the
loading process's environment and ``${name:...}`` calls whatever resolver the program has
registered. A checkpoint is untrusted input, so with ``weights_only=True`` (the default of
every load) a ``DictConfig``/``ListConfig`` whose strings hold a resolver interpolation is
refused with :class:`~fastckpt.errors.WeightsOnlyError`, as ``torch.load(weights_only=True)``
refuses what it cannot rebuild safely; ``weights_only=False`` rebuilds it as saved. Node
interpolations (``${model.width}``, ``${..lr}``: another value of the same configuration)
run no code and are kept.

Example:
    >>> import argparse
    >>> name, data = to_plain(argparse.Namespace(lr=0.1))
    >>> name, data
    ('argparse.Namespace', {'lr': 0.1})
    >>> rebuild(name, data, weights_only=True, where="hparams")
    Namespace(lr=0.1)
    >>> resolver_interpolation({"a": "${oc.env:HOME}", "b": "${a}"})
    '${oc.env:HOME}'
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Any

from fastckpt.errors import HeaderError, WeightsOnlyError

__all__ = ["CLASSES", "class_name", "rebuild", "resolver_interpolation", "to_plain"]

#: The classes the tree stores by name: name in the file -> (module, attribute).
CLASSES: dict[str, tuple[str, str]] = {
    "dict": ("builtins", "dict"),
    "argparse.Namespace": ("argparse", "Namespace"),
    "lightning.AttributeDict": ("lightning.pytorch.utilities.parsing", "AttributeDict"),
    "lightning.fabric.AttributeDict": ("lightning.fabric.utilities.data", "AttributeDict"),
    "pytorch_lightning.AttributeDict": ("pytorch_lightning.utilities.parsing", "AttributeDict"),
    "lightning_fabric.AttributeDict": ("lightning_fabric.utilities.data", "AttributeDict"),
    "omegaconf.DictConfig": ("omegaconf", "DictConfig"),
    "omegaconf.ListConfig": ("omegaconf", "ListConfig"),
}
_OMEGACONF = ("omegaconf.DictConfig", "omegaconf.ListConfig")

# A node interpolation: dots (relative levels), then a key path of plain names and [indices].
# No colon can appear, so no resolver is named; anything else with "${" is a resolver call,
# a nested or an escaped interpolation, and is treated as one.
_NODE_INTERPOLATION = re.compile(r"\$\{\.*[\w\-]+(?:\.[\w\-]+|\[[\w\-]+\])*\}")


def class_name(cls: type) -> str | None:
    """The name :data:`CLASSES` gives ``cls``, or None.

    Looks only at modules already imported: an object of a class whose module is not
    imported cannot exist, and saving must not import Lightning or OmegaConf.

    Example:
        >>> import argparse
        >>> class_name(argparse.Namespace), class_name(int)
        ('argparse.Namespace', None)
    """
    for name, (module_name, attribute) in CLASSES.items():
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, attribute, None) is cls:
            return name
    return None


def to_plain(value: Any) -> tuple[str, Any] | None:
    """``(class name, the dict or list it wraps)`` for an object stored as plain data, else None.

    OmegaConf containers are taken unresolved: interpolations stay ``${...}`` strings.

    Example:
        >>> to_plain(3) is None
        True
    """
    kind = type(value)
    if kind is argparse.Namespace:
        return "argparse.Namespace", dict(vars(value))
    name = class_name(kind)
    if name is not None and name.endswith("AttributeDict"):
        return name, dict(value)
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
        name = "omegaconf.DictConfig" if isinstance(value, omegaconf.DictConfig) else _OMEGACONF[1]
        return name, omegaconf.OmegaConf.to_container(value, resolve=False)
    return None


def load_class(name: str, where: str) -> type:
    """The class :data:`CLASSES` names ``name``, importing its module (from the table).

    Raises:
        HeaderError: ``name`` is not in the table.
        ImportError: its package is not installed here.

    Example:
        >>> load_class("argparse.Namespace", "hparams")
        <class 'argparse.Namespace'>
    """
    if name not in CLASSES:
        raise HeaderError(f"unknown class {name!r} at {where}")
    module_name, attribute = CLASSES[name]
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"the checkpoint holds a {name} at {where}, and {module_name}.{attribute} "
            f"cannot be imported here: {exc}"
        ) from exc


def resolver_interpolation(data: Any) -> str | None:
    """The first string in ``data`` (nested dicts, lists and tuples, keys included) that
    would call a resolver when OmegaConf reads it, or None.

    Example:
        >>> resolver_interpolation(["${x}", {"y": "plain"}]) is None
        True
        >>> resolver_interpolation({"k": "a ${my_resolver:1} b"})
        'a ${my_resolver:1} b'
    """
    pending = [data]
    while pending:
        value = pending.pop()
        if type(value) is str:
            if "${" in _NODE_INTERPOLATION.sub("", value):
                return value
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return None


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


def _of_plain_type(name: str, data: Any, where: str) -> Any:
    """``data``, if it is what :func:`to_plain` makes of class ``name``: a list for
    ``ListConfig``, a dict for the others (HeaderError otherwise)."""
    expected = list if name == "omegaconf.ListConfig" else dict
    if type(data) is not expected:
        raise HeaderError(
            f"malformed {name} at {where}: expected a {expected.__name__}, "
            f"got {type(data).__name__}"
        )
    return data


def rebuild(name: str, data: Any, *, weights_only: bool, where: str) -> Any:
    """The object of class ``name`` that :func:`to_plain` turned into ``data``.

    Args:
        name: a key of :data:`CLASSES`.
        data: the decoded plain data (untrusted).
        weights_only: refuse OmegaConf data holding a resolver interpolation.
        where: the object's place in the checkpoint, for messages.

    Raises:
        HeaderError: an unknown class, or data of the wrong shape for it.
        WeightsOnlyError: OmegaConf data that would call a resolver, with ``weights_only``.
        ImportError: the class's package is not installed here.

    Example:
        >>> rebuild("omegaconf.DictConfig", {"a": "${oc.env:HOME}"}, weights_only=True,
        ...         where="hparams")
        Traceback (most recent call last):
        ...
        fastckpt.errors.WeightsOnlyError: the checkpoint holds an omegaconf.DictConfig at hparams \
whose value '${oc.env:HOME}' calls a resolver when read (oc.env reads this process's \
environment; others run code registered here); pass weights_only=False if you trust the file
    """
    cls = load_class(name, where)
    data = _of_plain_type(name, data, where)
    if name == "argparse.Namespace":
        if not all(type(key) is str for key in data):
            raise HeaderError(f"malformed argparse.Namespace at {where}: a key is not a str")
        return cls(**data)
    if name not in _OMEGACONF:
        return cls(data)
    if weights_only:
        text = resolver_interpolation(data)
        if text is not None:
            raise WeightsOnlyError(
                f"the checkpoint holds an {name} at {where} whose value {_short(text)} calls a "
                "resolver when read (oc.env reads this process's environment; others run code "
                "registered here); pass weights_only=False if you trust the file"
            )
    omegaconf = importlib.import_module("omegaconf")
    try:
        return omegaconf.OmegaConf.create(data)
    except Exception as exc:  # OmegaConf's own errors: the data does not fit a config
        raise HeaderError(f"malformed {name} at {where}: {exc}") from None
