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

The program's own classes are stored as data once it allows them with
:func:`add_safe_classes` (the counterpart of ``torch.serialization.add_safe_globals``):
dataclasses, named tuples and enums, each stored as its fields (an enum as its value) under
its ``module:qualname``. Loading rebuilds only classes allowed in the loading process, by
calling the class with the saved fields; nothing is imported by a name read from the file
unless ``weights_only=False`` says the file is trusted.

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
import dataclasses
import enum
import importlib
import re
import sys
import threading
from collections.abc import Iterable
from typing import Any

from fastckpt.errors import HeaderError, WeightsOnlyError

__all__ = [
    "CLASSES",
    "RECORD_KINDS",
    "add_safe_classes",
    "class_name",
    "get_safe_classes",
    "rebuild",
    "rebuild_record",
    "record_fields",
    "record_kind",
    "remove_safe_classes",
    "resolver_interpolation",
    "safe_class",
    "safe_class_name",
    "to_plain",
]

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


# --------------------------------------------------------------------------- allowed classes

#: The kinds of class :func:`add_safe_classes` takes, each stored as plain data.
RECORD_KINDS = ("dataclass", "namedtuple", "enum")

# name (module:qualname) -> class, for the classes the program allowed.
_SAFE_CLASSES: dict[str, type] = {}
_SAFE_LOCK = threading.Lock()


def record_kind(cls: type) -> str | None:
    """``"dataclass"``, ``"namedtuple"`` or ``"enum"``: how instances of ``cls`` are stored;
    None for any other class.

    Example:
        >>> import collections, enum
        >>> record_kind(collections.namedtuple("P", "x y")), record_kind(dict)
        ('namedtuple', None)
    """
    if not isinstance(cls, type):
        return None
    if issubclass(cls, enum.Enum):
        return "enum"
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return "namedtuple"
    if dataclasses.is_dataclass(cls):
        return "dataclass"
    return None


def _name_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def add_safe_classes(classes: Iterable[type]) -> None:
    """Allows these classes in checkpoints, as data: what
    ``torch.serialization.add_safe_globals`` is to ``torch.load(weights_only=True)``.

    A save stores an instance of an allowed class as its fields (a dataclass's fields, a
    named tuple's items, an enum member's value) and the class's ``module:qualname``; a load
    with ``weights_only=True`` (the default) rebuilds it by calling the class with those
    fields, only if the loading process allowed the class too. Nothing but the class's own
    constructor runs. An instance of a class not allowed still needs ``allow_pickle=True``
    to be saved. The allowance is process-wide and lasts until the process ends; allowing a
    class again, or a new class of the same name (a module reloaded), replaces it.

    Args:
        classes: dataclasses, named tuples (``collections.namedtuple`` or
            ``typing.NamedTuple``) and ``enum.Enum`` subclasses.

    Raises:
        TypeError: an item is not one of those kinds of class (its name is given).

    Example:
        >>> import dataclasses, torch, fastckpt
        >>> @dataclasses.dataclass
        ... class Cfg:
        ...     lr: float
        ...     widths: tuple = (64, 64)
        >>> fastckpt.add_safe_classes([Cfg])
        >>> fastckpt.save({"cfg": Cfg(0.1), "w": torch.ones(2)}, "/tmp/fastckpt-cfg.safetensors")
        >>> fastckpt.load("/tmp/fastckpt-cfg.safetensors")["cfg"]
        Cfg(lr=0.1, widths=(64, 64))
    """
    if isinstance(classes, type):
        raise TypeError("add_safe_classes takes a list of classes: add_safe_classes([Cfg])")
    chosen = list(classes)
    for cls in chosen:
        if record_kind(cls) is None:
            what = _name_of(cls) if isinstance(cls, type) else repr(cls)[:60]
            raise TypeError(
                f"add_safe_classes: {what} is not a dataclass, named tuple or enum class; "
                "other objects are saved with allow_pickle=True and loaded with "
                "weights_only=False"
            )
    with _SAFE_LOCK:
        for cls in chosen:
            _SAFE_CLASSES[_name_of(cls)] = cls


def get_safe_classes() -> list[type]:
    """The classes :func:`add_safe_classes` allowed, in the order they were allowed.

    Example:
        >>> isinstance(get_safe_classes(), list)
        True
    """
    with _SAFE_LOCK:
        return list(_SAFE_CLASSES.values())


def remove_safe_classes(classes: Iterable[type]) -> None:
    """Withdraws the allowance :func:`add_safe_classes` gave these classes (others are
    ignored).

    Example:
        >>> import enum
        >>> class Mode(enum.Enum):
        ...     A = 1
        >>> add_safe_classes([Mode]); remove_safe_classes([Mode]); Mode in get_safe_classes()
        False
    """
    with _SAFE_LOCK:
        for cls in classes:
            name = _name_of(cls)
            if _SAFE_CLASSES.get(name) is cls:
                del _SAFE_CLASSES[name]


def safe_class_name(cls: type) -> str | None:
    """The name a file records for ``cls`` (``module:qualname``) when the program allowed
    it, else None.

    Example:
        >>> safe_class_name(int) is None
        True
    """
    name = _name_of(cls)
    return name if _SAFE_CLASSES.get(name) is cls else None


def safe_class(name: str, kind: str, *, weights_only: bool, where: str) -> type:
    """The class a file names ``name`` for a record of ``kind``: one the program allowed
    or, with ``weights_only=False`` (a trusted file), imported by its name.

    Raises:
        WeightsOnlyError: ``weights_only`` and the class is not allowed here; the message
            says how to allow it.
        ImportError: ``weights_only=False`` and the class cannot be imported here.
        HeaderError: the class is not a ``kind`` (the file and the program disagree).

    Example:
        >>> safe_class("enum:Enum", "enum", weights_only=True, where="x")
        Traceback (most recent call last):
        ...
        fastckpt.errors.WeightsOnlyError: the checkpoint holds an instance of enum.Enum at x, \
a class this process has not allowed: call fastckpt.add_safe_classes([enum.Enum]) before \
loading (as torch.serialization.add_safe_globals), or pass weights_only=False if you trust \
the file
    """
    cls = _SAFE_CLASSES.get(name)
    if cls is None:
        dotted = name.replace(":", ".")
        if weights_only:
            raise WeightsOnlyError(
                f"the checkpoint holds an instance of {dotted} at {where}, a class this "
                f"process has not allowed: call fastckpt.add_safe_classes([{dotted}]) before "
                "loading (as torch.serialization.add_safe_globals), or pass "
                "weights_only=False if you trust the file"
            )
        cls = _import_class(name, where)
    if record_kind(cls) != kind:
        raise HeaderError(
            f"the checkpoint holds a {kind} of class {name!r} at {where}, but that class is "
            f"a {record_kind(cls) or 'class of another kind'} here"
        )
    return cls


def _import_class(name: str, where: str) -> type:
    """Imports ``module:qualname``; only for files loaded with ``weights_only=False``."""
    module_name, _, qualname = name.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImportError(
            f"the checkpoint holds an instance of {name.replace(':', '.')} at {where}, "
            f"which cannot be imported here: {exc}"
        ) from exc
    if not isinstance(value, type):
        raise HeaderError(f"the checkpoint names {name!r} at {where}, which is not a class")
    return value


def record_fields(value: Any, kind: str) -> tuple[list[str], list[Any]] | Any:
    """What a record stores: ``(field names, values)`` of a dataclass (every field, those
    the constructor does not take included), the items of a named tuple, an enum's value.

    Example:
        >>> import collections
        >>> record_fields(collections.namedtuple("P", "x y")(1, 2), "namedtuple")
        [1, 2]
    """
    if kind == "dataclass":
        names = [f.name for f in dataclasses.fields(value)]
        return names, [getattr(value, name) for name in names]
    if kind == "namedtuple":
        return list(value)
    return value.value


def rebuild_record(cls: type, kind: str, data: Any, where: str) -> Any:
    """The instance of ``cls`` that :func:`record_fields` described, made by its constructor
    (a dataclass's fields the constructor does not take are then set as ``dataclasses.replace``
    would leave them: directly, without running ``__setattr__``).

    Raises:
        HeaderError: the fields do not fit the class, or its constructor refused them.

    Example:
        >>> import enum
        >>> class Mode(enum.Enum):
        ...     A = 1
        >>> rebuild_record(Mode, "enum", 1, "x")
        <Mode.A: 1>
    """
    try:
        if kind == "enum":
            return cls(data)
        if kind == "namedtuple":
            expected = len(getattr(cls, "_fields"))  # noqa: B009 - a named tuple's, not type's
            if len(data) != expected:
                raise ValueError(f"{expected} fields here, {len(data)} in the file")
            return cls(*data)
        names, values = data
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [name for name in names if name not in fields]
        if unknown:
            raise ValueError(f"the class here has no field {unknown[0]!r}")
        given = dict(zip(names, values))
        instance = cls(**{n: v for n, v in given.items() if fields[n].init})
        for name, value in given.items():
            if not fields[name].init:
                object.__setattr__(instance, name, value)
        return instance
    except Exception as exc:  # the class's own checks: the file and the class disagree
        raise HeaderError(
            f"cannot rebuild the {_name_of(cls).replace(':', '.')} at {where}: {exc}"
        ) from exc
