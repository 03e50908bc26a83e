"""Nested Python objects <-> named tensors plus a JSON description (the "tree").

A checkpoint is usually a nest of dicts, lists and numbers with tensors at the
leaves (a model's state_dict, an optimizer's, a step counter...). A
safetensors file holds only named tensors and string metadata, so
:func:`flatten` splits such an object into

* ``tensors``: the tensors, each stored once under a name derived from its
  path (``optimizer/state/0/exp_avg``);
* ``aliases``: alias name -> stored name, for a tensor that appears twice
  (tied weights);
* ``tree``: a JSON-able description of everything else, which the file keeps
  in its metadata. A flat ``str -> Tensor`` dict is stored under its own keys,
  so that ``safetensors.torch.load_file`` reads it back; its tree only lists
  the keys in their order (the file's order is the layout's, chosen for
  alignment), and is None for a dict of at most one key.

:func:`unflatten` rebuilds the object from the three, Python types included.

Tree encoding. A node is one of::

    "text"  12  1.5  true  false            str, int (|x| < 2**63), finite float, bool
    [node, ...]                              list
    {"t": "none"}                            None
    {"t": "tuple", "v": [node, ...]}         tuple
    {"t": "dict", "k": [node, ...], "v": [node, ...]}
                                             dict: keys are nodes too (int keys stay ints)
    {"t": "odict", "k": [...], "v": [...], "m": node}
                                             OrderedDict; "m" (optional) is its _metadata
                                             attribute, as module state_dicts carry
    {"t": "counter", "k": [...], "v": [...]} collections.Counter
    {"t": "ddict", "k": [...], "v": [...], "f": "list"}
                                             collections.defaultdict; "f" (optional: None
                                             without) names its default_factory, one of
                                             :data:`DEFAULT_FACTORIES`
    {"t": "set", "v": [node, ...]}           set; elements in an order free of the hash
    {"t": "frozenset", "v": [node, ...]}     seed: numbers by value, then strings, then
                                             the rest by their canonical JSON
    {"t": "tensor", "n": "name", "p": true, "g": true, "f": "channels_last"}
                                             a tensor by name (stored or alias); "p": an
                                             nn.Parameter, "g": requires_grad, "f": its
                                             memory format (all optional)
    {"t": "float", "v": "nan" | "inf" | "-inf"}
    {"t": "int", "v": "-0x1f..."}            an int of 64 bits or more, in hex
    {"t": "complex", "v": [float node, float node]}
                                             complex: real and imaginary parts
    {"t": "dtype", "v": "float32"}           torch.dtype
    {"t": "size", "v": [int, ...]}           torch.Size
    {"t": "device", "v": "cuda:0"}           torch.device
    {"t": "bytes", "v": "<base64>"}          bytes
    {"t": "bytearray", "v": "<base64>"}      bytearray
    {"t": "dataclass", "c": "module:Qual", "k": ["field", ...], "v": [node, ...]}
    {"t": "namedtuple", "c": "module:Qual", "v": [node, ...]}
    {"t": "enum", "c": "module:Qual", "v": node}
                                             an instance of a class the program allowed
                                             (config_objects.add_safe_classes): its fields,
                                             items or value
    {"t": "object", "c": "argparse.Namespace", "v": node}
                                             a configuration object stored as the dict or
                                             list it wraps: argparse.Namespace, Lightning's
                                             AttributeDict, OmegaConf DictConfig/ListConfig
                                             (unresolved; see config_objects)
    {"t": "class", "v": "omegaconf.DictConfig"}
                                             one of those classes (Lightning's hparams_type)
    {"t": "flat", "v": ["name", ...], "f": {"name": "channels_last"}}
                                             a flat str -> Tensor dict: its keys in insertion
                                             order, each a stored tensor's name or an alias;
                                             "f" (optional): memory formats by key
    {"t": "pickle", "v": "<base64>", "type": "module.Class"}
                                             anything else, only with allow_pickle=True

Every JSON object is a tagged node, so plain dicts never clash with tags. The classes of
"object" and "class" nodes come from a fixed table (:data:`config_objects.CLASSES`), those of
records from the classes the loading process allowed; nothing is imported by a name read
from the file (unless ``weights_only=False`` says it is trusted).

A tensor's bytes are always its logical, row-major contiguous ones (what safetensors
readers expect); "f" records that it was ``channels_last`` (4-d) or ``channels_last_3d``
(5-d), and loading gives it that memory format again, as ``torch.load`` keeps strides.
JSON floats keep their exact value, -0.0 included, and stay floats (``1.0``
is not ``1``). Nesting is limited to :data:`MAX_DEPTH` levels, well inside what
Python's JSON module and the interpreter's recursion limit allow.

Example:
    >>> import torch
    >>> w = torch.ones(2)
    >>> flat = flatten({"model": {"w": w, "tied": w}, "step": 3})
    >>> list(flat.tensors), flat.aliases
    (['model/w'], {'model/tied': 'model/w'})
    >>> back = unflatten(flat.tree, flat.tensors, flat.aliases)
    >>> back["step"], back["model"]["tied"] is back["model"]["w"]
    (3, True)
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import pickle
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fastckpt.checkpoint import config_objects, dtypes
from fastckpt.errors import HeaderError, WeightsOnlyError
from fastckpt.format import METADATA_KEY

__all__ = [
    "DEFAULT_FACTORIES",
    "MAX_DEPTH",
    "MEMORY_FORMATS",
    "Flat",
    "WeightsOnlyError",
    "flatten",
    "memory_formats",
    "unflatten",
    "with_memory_format",
]

#: Deepest nesting of containers that flatten writes and unflatten reads.
#: Each level costs two JSON levels and two Python frames, and both the JSON
#: module and the interpreter stop near 1000.
MAX_DEPTH = 200

PICKLE_PROTOCOL = 4
_SMALL_INT = 2**63  # ints in [-2**63, 2**63) are plain JSON numbers
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_NON_FINITE = ("nan", "inf", "-inf")  # float() reads each
# module:qualname of a record's class; "<locals>" in the qualname of a class made in a function
_CLASS_NAME = re.compile(
    r"[^\W\d]\w*(?:\.[^\W\d]\w*)*:(?:[^\W\d]\w*|<locals>)(?:\.(?:[^\W\d]\w*|<locals>))*"
)
_TOP_LEVEL_NAME = "tensor"  # the name of a tensor saved on its own

#: Memory formats a tensor node records (by name in the file); the bytes stay row-major.
MEMORY_FORMATS: dict[str, tuple[torch.memory_format, int]] = {
    "channels_last": (torch.channels_last, 4),
    "channels_last_3d": (torch.channels_last_3d, 5),
}

#: The default_factory values of a defaultdict stored as data, by the name a file gives them.
DEFAULT_FACTORIES: dict[str, type] = {
    kind.__name__: kind
    for kind in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)
}
DEFAULT_FACTORIES.update({"OrderedDict": OrderedDict, "Counter": Counter})
_MAPPING_TAGS = {dict: "dict", OrderedDict: "odict", Counter: "counter", defaultdict: "ddict"}


@dataclass(frozen=True)
class Flat:
    """An object split for storage; see :func:`flatten`.

    Attributes:
        tensors: stored name -> tensor, each distinct tensor once, in the
            order met (the original objects: maybe non-contiguous, maybe CUDA).
        aliases: alias name -> stored name of a tensor met again.
        tree: the JSON-able description; for a flat ``str -> Tensor`` dict only its key
            order (a ``"flat"`` node), or None when it has at most one key.
    """

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    tree: Any = None


class _Attribute:
    """A path step into an attribute (an OrderedDict's ``_metadata``) rather than a key."""

    def __init__(self, name: str):
        self.name = name


Path = tuple  # keys, indices and _Attribute steps from the top-level object


def _format_path(path: Path) -> str:
    """``['optimizer']['state'][0]`` style, for error messages."""
    if not path:
        return "the top level"
    if len(path) > 12:  # deep paths: the ends say where, the middle only repeats
        return _format_path(path[:4]) + "..." + _format_path(path[-6:])
    parts = []
    for step in path:
        parts.append(f".{step.name}" if isinstance(step, _Attribute) else f"[{_safe_repr(step)}]")
    return "".join(parts)


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a pickled key's own __repr__ may fail; the message must not
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _qualname(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


# --------------------------------------------------------------------------- names


def _valid_text(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (lone surrogates cannot)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _segment(step: Any) -> str:
    if type(step) is str:
        return step
    if isinstance(step, _Attribute):
        return step.name
    try:
        return str(step)
    except Exception:
        return type(step).__name__


class _Names:
    """Hands out unique tensor names derived from paths: ``a/b/0``, then ``a/b/0~1``...

    Paths under ``root`` are named relative to it.
    """

    def __init__(self, root: Path = ()) -> None:
        self._root = tuple(root)
        self._used: set[str] = set()
        self._suffix: dict[str, int] = {}

    def claim(self, path: Path) -> str:
        depth = len(self._root)
        if depth and len(path) > depth and _same_steps(path[:depth], self._root):
            path = path[depth:]
        base = "/".join(_segment(step) for step in path) or _TOP_LEVEL_NAME
        if not _valid_text(base):
            base = base.encode("utf-8", "backslashreplace").decode("utf-8")
        name = base
        # First come, first served: the walk order is fixed, so suffixes are too.
        while name in self._used or name == METADATA_KEY:
            self._suffix[base] = self._suffix.get(base, 0) + 1
            name = f"{base}~{self._suffix[base]}"
        self._used.add(name)
        return name


def _same_steps(path: Path, root: Path) -> bool:
    # By type and value: the key 1 is not the key True, nor 1.0.
    return all(type(a) is type(b) and a == b for a, b in zip(path, root))


# --------------------------------------------------------------------------- flatten


def _check_tensor(tensor: torch.Tensor, path: Path) -> None:
    where = _format_path(path)
    if tensor.is_nested:
        raise TypeError(f"nested tensor at {where}: nested tensors cannot be stored")
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{tensor.layout} tensor at {where}: only dense (strided) tensors can be stored"
        )
    if tensor.is_quantized:
        raise TypeError(f"quantized tensor at {where}: quantized tensors cannot be stored")
    if tensor.device.type == "meta":
        raise TypeError(f"meta tensor at {where}: it has no data to store")
    try:
        dtypes.to_safetensors(tensor.dtype)
    except TypeError as exc:
        raise TypeError(f"{exc} (tensor at {where})") from None


def _view_key(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensor objects the same data: one storage, one view of it.

    None when that cannot be told (no storage, or an empty one, whose address
    0 is shared by every empty tensor); such tensors are tied only when they
    are the same object.
    """
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if address == 0:
        return None
    # Type, requires_grad and the conj/neg bits are part of what load returns,
    # so tensors differing there are kept apart even over the same bytes.
    return (
        type(tensor),
        tensor.device,
        address,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.requires_grad,
        tensor.is_conj(),
        tensor.is_neg(),
    )


def _float_node(value: float) -> Any:
    if math.isfinite(value):
        return value
    return {"t": "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _int_node(value: int) -> Any:
    if -_SMALL_INT <= value < _SMALL_INT:
        return value
    # Beyond 64 bits: hex, because json refuses ints of more than 4300 digits
    # and other JSON readers lose precision past 2**53.
    return {"t": "int", "v": hex(value)}


_NO_FACTORY: Any = object()  # a default_factory that cannot be stored as data


def _factory_name(factory: Any) -> Any:
    """The name :data:`DEFAULT_FACTORIES` gives a defaultdict's factory, None for None, or
    :data:`_NO_FACTORY`."""
    if factory is None:
        return None
    for name, kind in DEFAULT_FACTORIES.items():
        if factory is kind:
            return name
    return _NO_FACTORY


def _memory_format(tensor: torch.Tensor) -> str | None:
    """The name of ``tensor``'s memory format when it is channels-last and not also plainly
    contiguous (a tensor with size-1 dimensions can be both); None otherwise."""
    if tensor.is_contiguous():
        return None
    for name, (memory_format, dims) in MEMORY_FORMATS.items():
        if tensor.dim() == dims and tensor.is_contiguous(memory_format=memory_format):
            return name
    return None


def _element_order(pair: tuple[Any, Any]) -> tuple[int, Any, str]:
    """A total order of set elements: numbers by value (NaN aside), then strings, then the
    rest by their node's canonical JSON. ``sorted(set)`` alone is no order for mixed types,
    and a set's own order follows the hash seed."""
    item, node = pair
    kind = type(item)
    if (kind is int or kind is bool or kind is float) and item == item:
        return (0, item, "")
    if kind is str:
        return (1, 0, item)
    return (2, 0, json.dumps(node, sort_keys=True, separators=(",", ":")))


class _Flattener:
    """One walk over an object: collects tensors and aliases, returns tree nodes."""

    def __init__(self, allow_pickle: bool, name_root: Path = ()):
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self._names = _Names(name_root)
        self._by_id: dict[int, str] = {}  # id(tensor) -> stored name
        self._by_view: dict[tuple, str] = {}  # _view_key -> stored name
        self._open: set[int] = set()  # containers on the current path, to catch cycles

    def node(self, value: Any, path: Path, depth: int = 0, in_key: bool = False) -> Any:
        """The tree node of ``value``, which sits at ``path``."""
        if depth > MAX_DEPTH:
            raise ValueError(
                f"object nested deeper than {MAX_DEPTH} levels at {_format_path(path)}"
            )
        kind = type(value)
        if value is None:
            return {"t": "none"}
        if kind is str or kind is bool:
            return value
        if kind is int:
            return _int_node(value)
        if kind is float:
            return _float_node(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if in_key:
                raise TypeError(f"tensor used as a dict key at {_format_path(path)}")
            return self.tensor(value, path)
        if kind in (dict, OrderedDict, Counter, list, tuple):
            return self.container(value, path, depth, in_key)
        if kind is defaultdict and _factory_name(value.default_factory) is not _NO_FACTORY:
            return self.container(value, path, depth, in_key)
        if kind is set or kind is frozenset:
            return self.container(value, path, depth, in_key)
        if kind is complex:
            return {"t": "complex", "v": [_float_node(value.real), _float_node(value.imag)]}
        if kind is torch.Size:
            return {"t": "size", "v": list(value)}
        if kind is torch.dtype:
            return {"t": "dtype", "v": str(value).rpartition(".")[2]}
        if kind is torch.device:
            return {"t": "device", "v": str(value)}
        if kind is bytes or kind is bytearray:
            return {"t": kind.__name__, "v": base64.b64encode(value).decode("ascii")}
        record = config_objects.safe_class_name(kind)
        if record is not None:
            return self.record(value, record, path, depth, in_key)
        if not in_key:
            plain = config_objects.to_plain(value)
            if plain is not None:
                return self.config_object(value, plain, path, depth)
            if isinstance(value, type):
                name = config_objects.class_name(value)
                if name is not None:
                    return {"t": "class", "v": name}
        return self.pickled(value, path, in_key)

    def config_object(self, value: Any, plain: tuple[str, Any], path: Path, depth: int) -> dict:
        if id(value) in self._open:
            raise ValueError(f"the object at {_format_path(path)} contains itself")
        self._open.add(id(value))
        try:
            name, data = plain
            return {"t": "object", "c": name, "v": self.node(data, path, depth + 1)}
        finally:
            self._open.discard(id(value))

    def record(self, value: Any, name: str, path: Path, depth: int, in_key: bool) -> dict:
        """An instance of a class the program allowed: its fields, items or value."""
        kind = config_objects.record_kind(type(value))
        assert kind is not None  # add_safe_classes admits only these kinds
        if id(value) in self._open:
            raise ValueError(f"the object at {_format_path(path)} contains itself")
        self._open.add(id(value))
        try:
            data = config_objects.record_fields(value, kind)
            if kind == "dataclass":
                names, values = data
                children = [
                    self.node(item, path if in_key else (*path, _Attribute(n)), depth + 1, in_key)
                    for n, item in zip(names, values)
                ]
                return {"t": kind, "c": name, "k": names, "v": children}
            if kind == "namedtuple":
                children = [
                    self.node(item, path if in_key else (*path, index), depth + 1, in_key)
                    for index, item in enumerate(data)
                ]
                return {"t": kind, "c": name, "v": children}
            return {"t": kind, "c": name, "v": self.node(data, path, depth + 1, in_key)}
        finally:
            self._open.discard(id(value))

    def elements(self, value: set | frozenset, path: Path, depth: int, in_key: bool) -> dict:
        """A set's elements, in an order that does not depend on the hash seed: numbers by
        value, then strings, then anything else by its node's JSON text."""
        if any(isinstance(item, torch.Tensor) for item in value):
            raise TypeError(
                f"a {type(value).__name__} of tensors at {_format_path(path)}: tensors in a set "
                "have no name or order to store them by; use a list"
            )
        # Elements are hashable, as keys are: the same types are refused in both.
        pairs = [(item, self.node(item, path, depth + 1, in_key=True)) for item in value]
        pairs.sort(key=_element_order)
        return {"t": type(value).__name__, "v": [node for _, node in pairs]}

    def container(self, value: Any, path: Path, depth: int, in_key: bool) -> Any:
        if id(value) in self._open:
            raise ValueError(f"the object at {_format_path(path)} contains itself")
        self._open.add(id(value))
        try:
            if isinstance(value, dict):
                return self.mapping(value, path, depth)
            if isinstance(value, (set, frozenset)):
                return self.elements(value, path, depth, in_key)
            # Elements of a tuple used as a key report the key's path.
            children = [
                self.node(item, path if in_key else (*path, index), depth + 1, in_key)
                for index, item in enumerate(value)
            ]
            return children if type(value) is list else {"t": "tuple", "v": children}
        finally:
            self._open.discard(id(value))

    def mapping(self, value: dict, path: Path, depth: int) -> dict:
        keys = [self.node(key, path, depth + 1, in_key=True) for key in value]
        values = [self.node(item, (*path, key), depth + 1) for key, item in value.items()]
        tag = _MAPPING_TAGS[type(value)]
        if tag != "odict":
            node: dict[str, Any] = {"t": tag, "k": keys, "v": values}
            factory = None
            if isinstance(value, defaultdict):
                factory = _factory_name(value.default_factory)
            if factory is not None:
                node["f"] = factory
            return node
        node = {"t": "odict", "k": keys, "v": values}
        # Module state_dicts carry per-module versions here; load_state_dict reads them.
        # Other instance attributes of an OrderedDict are not kept.
        if "_metadata" in vars(value):
            step = _Attribute("_metadata")
            node["m"] = self.node(vars(value)["_metadata"], (*path, step), depth + 1)
        return node

    def tensor(self, tensor: torch.Tensor, path: Path) -> dict:
        _check_tensor(tensor, path)
        node: dict[str, Any] = {"t": "tensor", "n": self.store(tensor, path)}
        if type(tensor) is torch.nn.Parameter:
            node["p"] = True
        if tensor.requires_grad:
            node["g"] = True
        memory_format = _memory_format(tensor)
        if memory_format is not None:
            node["f"] = memory_format
        return node

    def store(self, tensor: torch.Tensor, path: Path) -> str:
        """Name ``tensor``: stored the first time, an alias when met again."""
        name = self._names.claim(path)
        key = _view_key(tensor)
        target = self._by_id.get(id(tensor))
        if target is None and key is not None:
            target = self._by_view.get(key)
        if target is not None:
            self.aliases[name] = target
            return name
        self.tensors[name] = tensor
        self._by_id[id(tensor)] = name
        if key is not None:
            self._by_view[key] = name
        return name

    def pickled(self, value: Any, path: Path, in_key: bool) -> dict:
        what = "dict key" if in_key else "object"
        kind = _qualname(type(value))
        if not self.allow_pickle:
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
                # torch.save(model) habit: the state dict is what a checkpoint should hold
                raise TypeError(
                    f"cannot save a whole {kind} at {_format_path(path)}: save its "
                    "state dict instead, e.g. fastckpt.save(obj.state_dict(), path), and "
                    "restore it with obj.load_state_dict(fastckpt.load(path)); "
                    "allow_pickle=True would pickle the object, code and all"
                )
            if config_objects.record_kind(type(value)) is not None:
                raise TypeError(
                    f"unsupported {what} of type {kind} at {_format_path(path)}; "
                    f"fastckpt.add_safe_classes([{kind}]) stores it as data (as "
                    "torch.serialization.add_safe_globals allows it), or pass "
                    "allow_pickle=True to store it with pickle"
                )
            raise TypeError(
                f"unsupported {what} of type {kind} at {_format_path(path)}; "
                "pass allow_pickle=True to store it with pickle"
            )
        try:
            data = pickle.dumps(value, protocol=PICKLE_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot pickle {what} of type {kind} at {_format_path(path)}: {exc}"
            ) from exc
        return {"t": "pickle", "v": base64.b64encode(data).decode("ascii"), "type": kind}


def _is_flat_dict(obj: Any) -> bool:
    """A plain ``str -> Tensor`` dict that load_file would return unchanged."""
    if type(obj) is not dict:
        return False
    for key, value in obj.items():
        # An empty key cannot be a tensor name of its own ("" is the name of nothing).
        if type(key) is not str or key in ("", METADATA_KEY) or not _valid_text(key):
            return False
        if type(value) is not torch.Tensor or value.requires_grad:
            return False
    return True


def _flat_node(obj: dict[str, torch.Tensor]) -> dict | None:
    """The tree of a flat dict: its key order, and the memory format of each channels-last
    tensor; None for at most one key and nothing else to say."""
    formats = {}
    for key, tensor in obj.items():
        memory_format = _memory_format(tensor)
        if memory_format is not None:
            formats[key] = memory_format
    if len(obj) <= 1 and not formats:
        return None
    node: dict[str, Any] = {"t": "flat", "v": list(obj)}
    if formats:
        node["f"] = formats
    return node


def flatten(obj: Any, *, allow_pickle: bool = False, name_root: Path = ()) -> Flat:
    """Split ``obj`` into named tensors, aliases and a JSON-able description.

    Supported: dict, OrderedDict, Counter and defaultdict (of a factory in
    :data:`DEFAULT_FACTORIES`; keys: str, int, float, bool, None, tuples of those...),
    list, tuple, set, frozenset, None, bool, int, float (nan, inf, -0.0 included),
    complex, str, bytes, bytearray, torch.Tensor and nn.Parameter (dense, not meta;
    channels-last kept), torch.dtype, torch.Size, torch.device, the configuration
    objects of :mod:`~fastckpt.checkpoint.config_objects` (``argparse.Namespace``,
    Lightning's ``AttributeDict``, OmegaConf containers) and their classes, and
    instances of the classes allowed with ``add_safe_classes``. Two tensors that are
    the same view of one storage are stored once. Anything else raises
    ``TypeError``, or is pickled when ``allow_pickle=True``.

    A :class:`Flat` is returned as it is, so a caller that names tensors its own way
    (``name_root``) hands the result to ``save`` like any object.

    Args:
        obj: what to save.
        allow_pickle: pickle (protocol 4) unsupported objects instead of refusing them.
        name_root: the path of a container whose tensors are named relative to it: with
            ``("state_dict",)`` a checkpoint's weights keep their own keys as names, so
            ``safetensors.torch.load_file`` returns the ``state_dict``'s keys.

    Raises:
        TypeError: an unsupported object or tensor; the message gives its path.
        ValueError: nesting deeper than :data:`MAX_DEPTH`, or a container that
            contains itself.

    Example:
        >>> import torch
        >>> flat = flatten({"state": {0: {"step": torch.tensor(1.0)}}, "lr": 0.1})
        >>> list(flat.tensors)
        ['state/0/step']
        >>> flatten({"w": torch.zeros(1)}).tree is None
        True
        >>> flatten({"w": torch.zeros(1), "b": torch.zeros(1)}).tree
        {'t': 'flat', 'v': ['w', 'b']}
        >>> list(flatten({"state_dict": {"w": torch.zeros(1)}}, name_root=("state_dict",)).tensors)
        ['w']
    """
    if type(obj) is Flat:
        return obj
    walker = _Flattener(allow_pickle, name_root)
    try:
        tree = walker.node(obj, ())
    except RecursionError:
        raise ValueError("object nested too deeply to describe") from None
    if _is_flat_dict(obj):
        # Names equal the keys here, so the file reads back as the same dict; only the
        # order is kept apart, since the layout orders the file for alignment.
        tree = _flat_node(obj)
    return Flat(tensors=walker.tensors, aliases=walker.aliases, tree=tree)


# --------------------------------------------------------------------------- unflatten


_DTYPES_BY_NAME: dict[str, torch.dtype] = {}


def _dtype_by_name(name: str) -> torch.dtype | None:
    # Looked up in a table rather than with getattr(torch, name), which could
    # import arbitrary torch submodules on a hostile name.
    if not _DTYPES_BY_NAME:
        for value in vars(torch).values():
            if isinstance(value, torch.dtype):
                _DTYPES_BY_NAME[str(value).rpartition(".")[2]] = value
    return _DTYPES_BY_NAME.get(name)


class _Unflattener:
    """One walk over an untrusted tree: validates every node, rebuilds the object."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        aliases: Mapping[str, str],
        weights_only: bool,
        unpickle: bool = True,
    ):
        self.tensors = tensors
        self.aliases = aliases
        self.weights_only = weights_only
        self.unpickle = unpickle  # False: check pickled nodes' form, never run pickle
        self._built: dict[str, torch.Tensor] = {}  # stored name -> returned object

    def node(self, node: Any, path: Path, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise HeaderError(f"tree nested deeper than {MAX_DEPTH} levels at {_format_path(path)}")
        kind = type(node)
        if kind is str or kind is bool or kind is int or kind is float:
            return node
        if kind is list:
            return [self.node(child, (*path, index), depth + 1) for index, child in enumerate(node)]
        if kind is dict:
            tag = node.get("t")
            decoder = _DECODERS.get(tag) if type(tag) is str else None
            if decoder is not None:
                return getattr(self, decoder)(node, path, depth)
        raise HeaderError(f"malformed tree node {_safe_repr(node)} at {_format_path(path)}")

    # Each decoder gets a dict whose "t" it handles.

    def none(self, node: dict, path: Path, depth: int) -> None:
        _fields(node, (), (), path)

    def tuple_(self, node: dict, path: Path, depth: int) -> tuple:
        _fields(node, ("v",), (), path)
        items = _typed(node, "v", list, path)
        return tuple(
            self.node(child, (*path, index), depth + 1) for index, child in enumerate(items)
        )

    def mapping(self, node: dict, path: Path, depth: int) -> dict:
        tag = node["t"]
        _fields(node, ("k", "v"), _MAPPING_OPTIONS.get(tag, ()), path)
        keys, values = _typed(node, "k", list, path), _typed(node, "v", list, path)
        if len(keys) != len(values):
            raise HeaderError(
                f"malformed dict at {_format_path(path)}: {len(keys)} keys, {len(values)} values"
            )
        result = self.empty_mapping(node, path)
        for key_node, value_node in zip(keys, values):
            key = self.key(key_node, path, depth + 1)
            if key in result:
                raise HeaderError(
                    f"duplicate key {_safe_repr(key)} in dict at {_format_path(path)}"
                )
            result[key] = self.node(value_node, (*path, key), depth + 1)
        if "m" in node:
            step = _Attribute("_metadata")
            metadata = self.node(node["m"], (*path, step), depth + 1)
            result._metadata = metadata  # type: ignore[attr-defined]
        return result

    def empty_mapping(self, node: dict, path: Path) -> dict:
        """The empty dict, OrderedDict, Counter or defaultdict that a mapping node fills."""
        tag = node["t"]
        if tag == "ddict":
            factory = None
            if "f" in node:
                factory = DEFAULT_FACTORIES.get(_typed(node, "f", str, path))
                if factory is None:
                    raise HeaderError(
                        f"unknown defaultdict factory {_safe_repr(node['f'])} at "
                        f"{_format_path(path)}"
                    )
            return defaultdict(factory)
        return {"dict": dict, "odict": OrderedDict, "counter": Counter}[tag]()

    def elements(self, node: dict, path: Path, depth: int) -> set | frozenset:
        _fields(node, ("v",), (), path)
        items = _typed(node, "v", list, path)
        result = {self.key(child, (*path, index), depth + 1) for index, child in enumerate(items)}
        if len(result) != len(items) and self.unpickle:
            raise HeaderError(f"duplicate elements in the {node['t']} at {_format_path(path)}")
        return result if node["t"] == "set" else frozenset(result)

    def complex_(self, node: dict, path: Path, depth: int) -> complex:
        _fields(node, ("v",), (), path)
        parts = [self.node(child, path, depth + 1) for child in _typed(node, "v", list, path)]
        if len(parts) != 2 or not all(type(part) is float for part in parts):
            raise HeaderError(f"malformed complex {_safe_repr(node['v'])} at {_format_path(path)}")
        return complex(parts[0], parts[1])

    def bytearray_(self, node: dict, path: Path, depth: int) -> bytearray:
        return bytearray(self.bytes_(node, path, depth))

    def record(self, node: dict, path: Path, depth: int) -> Any:
        """An instance of an allowed class: dataclass, namedtuple or enum."""
        kind = node["t"]
        _fields(node, ("c", "k", "v") if kind == "dataclass" else ("c", "v"), (), path)
        name = _typed(node, "c", str, path)
        if not _CLASS_NAME.fullmatch(name):
            raise HeaderError(f"malformed class name {_safe_repr(name)} at {_format_path(path)}")
        if kind == "enum":
            data = self.node(node["v"], path, depth + 1)
        else:
            children = _typed(node, "v", list, path)
            field_names = _typed(node, "k", list, path) if kind == "dataclass" else None
            if field_names is not None and (
                len(field_names) != len(children)
                or not all(type(n) is str for n in field_names)
                or len(set(field_names)) != len(field_names)
            ):
                raise HeaderError(
                    f"malformed dataclass fields {_safe_repr(field_names)} at {_format_path(path)}"
                )
            steps = field_names or range(len(children))
            values = [
                self.node(child, (*path, _Attribute(s) if field_names else s), depth + 1)
                for s, child in zip(steps, children)
            ]
            data = (field_names, values) if field_names is not None else values
        if not self.unpickle:  # validate only: no class looked up, nothing built
            return object()
        where = _format_path(path)
        cls = config_objects.safe_class(name, kind, weights_only=self.weights_only, where=where)
        return config_objects.rebuild_record(cls, kind, data, where)

    def key(self, node: Any, path: Path, depth: int) -> Any:
        key = self.node(node, path, depth)
        if isinstance(key, torch.Tensor) or not _hashable(key):
            raise HeaderError(f"invalid dict key {_safe_repr(node)} at {_format_path(path)}")
        return key

    def tensor(self, node: dict, path: Path, depth: int) -> torch.Tensor:
        _fields(node, ("n",), ("p", "g", "f"), path)
        name = _typed(node, "n", str, path)
        parameter = _typed(node, "p", bool, path) if "p" in node else False
        requires_grad = _typed(node, "g", bool, path) if "g" in node else False
        memory_format = _typed(node, "f", str, path) if "f" in node else None
        stored = self.stored_name(name, path)
        if stored in self._built:  # a tied tensor: the very same object again
            return self._built[stored]
        tensor = self.tensors[stored]
        if memory_format is not None:
            tensor = with_memory_format(tensor, memory_format, name)
        try:
            if parameter:
                tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            elif requires_grad:
                tensor.requires_grad_(True)
        except RuntimeError as exc:  # e.g. requires_grad on an integer tensor
            raise HeaderError(f"tensor {name!r} at {_format_path(path)}: {exc}") from None
        self._built[stored] = tensor
        return tensor

    def stored_name(self, name: str, path: Path) -> str:
        if name in self.tensors:
            if name in self.aliases:
                raise HeaderError(f"{name!r} is both a stored tensor and an alias")
            return name
        target = self.aliases.get(name)
        if target is None:
            raise HeaderError(
                f"tree refers to tensor {_safe_repr(name)} at {_format_path(path)}, "
                "which the file does not hold"
            )
        if target not in self.tensors:
            raise HeaderError(f"alias {name!r} refers to missing tensor {_safe_repr(target)}")
        return target

    def float_(self, node: dict, path: Path, depth: int) -> float:
        _fields(node, ("v",), (), path)
        text = _typed(node, "v", str, path)
        if text not in _NON_FINITE:
            raise HeaderError(f"malformed float {_safe_repr(text)} at {_format_path(path)}")
        # A new object each time: two NaN keys of one dict are two objects (nan != nan),
        # and one shared NaN would make them one key.
        return float(text)

    def int_(self, node: dict, path: Path, depth: int) -> int:
        _fields(node, ("v",), (), path)
        text = _typed(node, "v", str, path)
        if not _HEX_INT.fullmatch(text):
            raise HeaderError(f"malformed int {_safe_repr(text)} at {_format_path(path)}")
        return int(text, 16)  # linear time for hex, whatever the length

    def dtype(self, node: dict, path: Path, depth: int) -> torch.dtype:
        _fields(node, ("v",), (), path)
        dtype = _dtype_by_name(_typed(node, "v", str, path))
        if dtype is None:
            raise HeaderError(f"unknown dtype {_safe_repr(node['v'])} at {_format_path(path)}")
        return dtype

    def size(self, node: dict, path: Path, depth: int) -> torch.Size:
        _fields(node, ("v",), (), path)
        dims = _typed(node, "v", list, path)
        if not all(type(dim) is int for dim in dims):
            raise HeaderError(f"malformed torch.Size {_safe_repr(dims)} at {_format_path(path)}")
        try:
            return torch.Size(dims)
        except (OverflowError, RuntimeError, ValueError) as exc:
            raise HeaderError(f"malformed torch.Size at {_format_path(path)}: {exc}") from None

    def device(self, node: dict, path: Path, depth: int) -> torch.device:
        _fields(node, ("v",), (), path)
        text = _typed(node, "v", str, path)
        try:
            return torch.device(text)
        except (RuntimeError, ValueError) as exc:
            raise HeaderError(
                f"malformed device {_safe_repr(text)} at {_format_path(path)}: {exc}"
            ) from None

    def bytes_(self, node: dict, path: Path, depth: int) -> bytes:
        _fields(node, ("v",), (), path)
        return _base64(_typed(node, "v", str, path), path)

    def config_object(self, node: dict, path: Path, depth: int) -> Any:
        _fields(node, ("c", "v"), (), path)
        name = _typed(node, "c", str, path)
        if name not in config_objects.CLASSES:
            raise HeaderError(f"unknown class {_safe_repr(name)} at {_format_path(path)}")
        data = self.node(node["v"], path, depth + 1)
        if not self.unpickle:  # validate only: no import, no rebuild
            return None
        return config_objects.rebuild(
            name, data, weights_only=self.weights_only, where=_format_path(path)
        )

    def config_class(self, node: dict, path: Path, depth: int) -> Any:
        _fields(node, ("v",), (), path)
        name = _typed(node, "v", str, path)
        if name not in config_objects.CLASSES:
            raise HeaderError(f"unknown class {_safe_repr(name)} at {_format_path(path)}")
        if not self.unpickle:
            return None
        return config_objects.load_class(name, _format_path(path))

    def flat(self, node: dict, path: Path, depth: int) -> dict:
        _fields(node, ("v",), ("f",), path)
        formats = _typed(node, "f", dict, path) if "f" in node else {}
        result: dict[str, torch.Tensor] = {}
        for name in _typed(node, "v", list, path):
            if type(name) is not str:
                raise HeaderError(
                    f"malformed 'flat' node at {_format_path(path)}: "
                    f"key {_safe_repr(name)} is not a str"
                )
            if name in result:
                raise HeaderError(f"duplicate key {name!r} in dict at {_format_path(path)}")
            stored = self.stored_name(name, (*path, name))
            if stored not in self._built:  # tied keys share one converted tensor
                tensor = self.tensors[stored]
                if name in formats:
                    tensor = with_memory_format(tensor, formats[name], name)
                self._built[stored] = tensor
            result[name] = self._built[stored]
        unknown = set(formats) - set(result)
        if unknown:
            raise HeaderError(
                f"malformed 'flat' node at {_format_path(path)}: a memory format for "
                f"{_safe_repr(sorted(unknown)[0])}, which is not a key"
            )
        return result

    def pickled(self, node: dict, path: Path, depth: int) -> Any:
        _fields(node, ("v", "type"), (), path)
        kind = _typed(node, "type", str, path)
        data = _base64(_typed(node, "v", str, path), path)
        if not self.unpickle:
            return None
        if self.weights_only:
            raise WeightsOnlyError(
                f"the checkpoint holds a pickled {_safe_repr(kind)} at {_format_path(path)}; "
                "unpickling can run arbitrary code: pass weights_only=False "
                "if you trust the file"
            )
        try:
            return pickle.loads(data)
        except (ImportError, AttributeError):
            raise  # the class is missing here: the environment's problem, not the file's
        except Exception as exc:
            raise HeaderError(
                f"cannot unpickle the {_safe_repr(kind)} at {_format_path(path)}: {exc}"
            ) from exc


# Tag -> the _Unflattener method that decodes it. Names, not bound methods: a table of
# bound methods in the instance would be a reference cycle holding every loaded tensor
# until the garbage collector runs.
_DECODERS: dict[str, str] = {
    "none": "none",
    "tuple": "tuple_",
    "dict": "mapping",
    "odict": "mapping",
    "tensor": "tensor",
    "float": "float_",
    "int": "int_",
    "dtype": "dtype",
    "size": "size",
    "device": "device",
    "bytes": "bytes_",
    "bytearray": "bytearray_",
    "complex": "complex_",
    "counter": "mapping",
    "ddict": "mapping",
    "set": "elements",
    "frozenset": "elements",
    "dataclass": "record",
    "namedtuple": "record",
    "enum": "record",
    "pickle": "pickled",
    "object": "config_object",
    "class": "config_class",
    "flat": "flat",
}


# The optional fields of each mapping tag.
_MAPPING_OPTIONS = {"odict": ("m",), "ddict": ("f",)}


def with_memory_format(tensor: torch.Tensor, name: Any, tensor_name: str) -> torch.Tensor:
    """``tensor`` (row-major, as read) in the memory format a file names ``name``: one copy
    into channels-last strides, as ``torch.load`` returns such a tensor.

    Raises:
        HeaderError: an unknown format, or one for a tensor of the wrong number of dimensions.

    Example:
        >>> import torch
        >>> with_memory_format(torch.zeros(1, 3, 2, 2), "channels_last", "w").stride()
        (12, 1, 6, 3)
    """
    spec = MEMORY_FORMATS.get(name) if type(name) is str else None
    if spec is None:
        raise HeaderError(f"unknown memory format {_safe_repr(name)} for tensor {tensor_name!r}")
    memory_format, dims = spec
    if tensor.dim() != dims:
        raise HeaderError(
            f"tensor {tensor_name!r} has {tensor.dim()} dimensions; {name} needs {dims}"
        )
    return tensor.contiguous(memory_format=memory_format)


def memory_formats(tree: Any) -> dict[str, str]:
    """Tensor name -> memory format, as a (validated) tree records them; for loads of named
    tensors, which do not rebuild the tree.

    Example:
        >>> memory_formats({"t": "flat", "v": ["a", "b"], "f": {"b": "channels_last"}})
        {'b': 'channels_last'}
    """
    found: dict[str, str] = {}
    pending = [tree]
    while pending:
        node = pending.pop()
        if type(node) is list:
            pending.extend(node)
        elif type(node) is dict:
            tag = node.get("t")
            if tag == "tensor" and type(node.get("f")) is str and type(node.get("n")) is str:
                found[node["n"]] = node["f"]
            elif tag == "flat" and type(node.get("f")) is dict:
                found.update(node["f"])
            else:
                pending.extend(value for key, value in node.items() if key != "t")
    return found


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _fields(node: dict, required: tuple[str, ...], optional: tuple[str, ...], path: Path) -> None:
    """Check that a tagged node has exactly the keys its tag calls for."""
    allowed = {"t", *required, *optional}
    missing = [key for key in required if key not in node]
    extra = [key for key in node if key not in allowed]
    if missing or extra:
        problems = [f"missing {key!r}" for key in missing]
        problems += [f"unexpected {_safe_repr(key)}" for key in extra[:3]]
        raise HeaderError(
            f"malformed {node['t']!r} node at {_format_path(path)}: {', '.join(problems)}"
        )


def _typed(node: dict, key: str, kind: type, path: Path) -> Any:
    value = node[key]
    if type(value) is not kind:
        raise HeaderError(
            f"malformed {node['t']!r} node at {_format_path(path)}: "
            f"{key!r} must be a {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _base64(text: str, path: Path) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HeaderError(f"malformed base64 at {_format_path(path)}: {exc}") from None


def _flat_dict(tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> dict:
    result = dict(tensors)
    for alias, target in aliases.items():
        if alias in tensors:
            raise HeaderError(f"{alias!r} is both a stored tensor and an alias")
        if target not in tensors:
            raise HeaderError(f"alias {alias!r} refers to missing tensor {_safe_repr(target)}")
        result[alias] = tensors[target]
    return result


def unflatten(
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    *,
    weights_only: bool = True,
) -> Any:
    """Rebuild the object that :func:`flatten` split; the tree is untrusted input.

    Args:
        tree: the description (decoded JSON), or None for a flat dict.
        tensors: stored name -> tensor, as read from the file.
        aliases: alias name -> stored name.
        weights_only: refuse pickled objects (the default, as in ``torch.load``).

    Returns:
        The object with its Python types; an alias and its target give the
        very same tensor object. For ``tree=None``: a dict of the tensors in
        the given order, then the aliases.

    Raises:
        HeaderError: a malformed node, a reference to a missing tensor, or
            nesting deeper than :data:`MAX_DEPTH`.
        WeightsOnlyError: a pickled object while ``weights_only=True`` (also a
            ``pickle.UnpicklingError``); pass ``weights_only=False`` for a trusted file.
        ImportError, AttributeError: with ``weights_only=False``, a pickled
            object whose class cannot be found here.

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> tree = {"t": "dict", "k": [1, "b"], "v": [{"t": "tensor", "n": "x"}, [1.5]]}
        >>> unflatten(tree, {"x": t}, {})
        {1: tensor([0., 0.]), 'b': [1.5]}
    """
    if tree is None:
        return _flat_dict(tensors, aliases)
    try:
        return _Unflattener(tensors, aliases, weights_only).node(tree, ())
    except RecursionError:
        raise HeaderError("tree nested too deeply") from None


def validate(tree: Any, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> None:
    """Check that :func:`unflatten` would rebuild ``tree`` from ``tensors``, without
    unpickling anything: every node well formed, every tensor reference resolved.

    ``tensors`` may be ``meta`` tensors of the stored shapes and dtypes (nothing is read).

    Raises:
        HeaderError: what :func:`unflatten` would raise for a malformed tree.

    Example:
        >>> import torch
        >>> validate({"t": "tensor", "n": "x"}, {"x": torch.empty(2, device="meta")}, {})
        >>> validate({"t": "tensor", "n": "y"}, {"x": torch.empty(2, device="meta")}, {})
        Traceback (most recent call last):
        ...
        fastckpt.errors.HeaderError: tree refers to tensor 'y' at the top level, which the file does not hold
    """
    if tree is None:
        _flat_dict(tensors, aliases)
        return
    try:
        _Unflattener(tensors, aliases, weights_only=False, unpickle=False).node(tree, ())
    except RecursionError:
        raise HeaderError("tree nested too deeply") from None
