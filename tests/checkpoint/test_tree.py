"""Tests of fastckpt.checkpoint.tree: nested objects <-> named tensors + JSON description."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import pickle
import typing
import warnings
from collections import Counter, OrderedDict, defaultdict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastckpt
from fastckpt import format as fmt
from fastckpt.checkpoint import config_objects
from fastckpt.checkpoint.tree import MAX_DEPTH, Flat, WeightsOnlyError, flatten, unflatten
from fastckpt.errors import FastCkptError, HeaderError


class Opaque:
    """An object the tree cannot describe; module-level so that pickle finds it."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Opaque and other.value == self.value

    def __hash__(self):
        return hash(repr(self.value))


# --------------------------------------------------------------------------- helpers


def store_and_load(flat: Flat) -> tuple[dict, dict, object]:
    """What a save then a load does to a Flat: fresh tensors, metadata through JSON."""
    meta = fmt.split_metadata(fmt.build_metadata(aliases=flat.aliases, tree=flat.tree))
    tensors = {name: t.detach().clone().contiguous() for name, t in flat.tensors.items()}
    return tensors, meta.aliases, meta.tree


def round_trip(obj, **flatten_options):
    flat = flatten(obj, **flatten_options)
    tensors, aliases, tree = store_and_load(flat)
    return unflatten(tree, tensors, aliases, weights_only=not flatten_options.get("allow_pickle"))


def assert_same(a, b, where="obj"):
    """Equal values and identical Python types all the way down."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.requires_grad == b.requires_grad, where
        assert torch.equal(a.detach(), b.detach()), where
    elif isinstance(a, dict):
        assert len(a) == len(b), where
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb, f"{where}: key {ka!r}")  # a NaN key equals no key, itself too
            assert_same(va, vb, f"{where}[{ka!r}]")
        if isinstance(a, OrderedDict):
            assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        if isinstance(a, defaultdict):
            assert a.default_factory is b.default_factory, where
    elif isinstance(a, (set, frozenset)):
        assert a == b, where
    elif isinstance(a, complex):
        assert_same(a.real, b.real, f"{where}.real")
        assert_same(a.imag, b.imag, f"{where}.imag")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), where
    else:
        assert a == b, where


# --------------------------------------------------------------------------- round trips


def test_adamw_state_dict_round_trip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()

    flat = flatten(state)
    assert "state/0/exp_avg" in flat.tensors and "state/0/step" in flat.tensors
    back = round_trip(state)
    assert_same(state, back)
    assert type(back["param_groups"][0]["betas"]) is tuple
    assert back["state"][0]["step"].dim() == 0

    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(back)
    assert fresh.param_groups[0]["lr"] == 1e-3


def test_module_state_dict_round_trip():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    flat = flatten(state)
    # Stored under its own keys: a plain safetensors reader sees the same names.
    assert set(flat.tensors) == set(state)
    assert flat.tree is not None  # OrderedDict and _metadata need the tree
    back = round_trip(state)
    assert type(back) is OrderedDict
    assert back._metadata == state._metadata
    assert_same(state, back)
    torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).load_state_dict(back)


def test_flat_dict_tree_holds_only_its_key_order():
    w = torch.randn(3)
    state = {"w": w, "b": torch.zeros(2), "tied": w}
    flat = flatten(state)
    assert flat.tree == {"t": "flat", "v": ["w", "b", "tied"]}
    assert list(flat.tensors) == ["w", "b"]
    assert flat.aliases == {"tied": "w"}
    back = round_trip(state)
    assert type(back) is dict and list(back) == list(state)
    assert back["tied"] is back["w"]
    assert flatten({}).tree is None and round_trip({}) == {}
    assert flatten({"w": w}).tree is None  # one key has one order


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        math.inf,
        -math.inf,
        -0.0,
        0.0,
        1.0,
        1e300,
        5e-324,
        0.1,
        2**63 - 1,
        -(2**63),
        2**63,
        -(2**63) - 1,
        10**5000,
        -(7**3000),
        True,
        False,
        None,
        "",
        "naïve ✓ \ud800",
        b"\x00\xffbytes",
        torch.float8_e4m3fn,
        torch.complex128,
        torch.Size([2, 0, 3]),
        torch.device("cuda", 1),
        torch.device("cpu"),
    ],
    ids=lambda value: type(value).__name__,
)
def test_scalars_round_trip(value):
    for obj in (value, [value], {"k": value}):
        assert_same(obj, round_trip(obj))


def test_containers_keep_their_types():
    obj = {
        "list": [1, [2, [3]]],
        "tuple": (1, (2,), ()),
        "empty": [{}, [], (), OrderedDict(), {"a": {}}],
        "odict": OrderedDict([("z", 1), ("a", 2)]),
        7: "int key",
        "7": "str key",
        2.5: "float key",
        True: "bool key",
        None: "none key",
        (1, "a", (None,)): "tuple key",
        math.inf: "inf key",
    }
    back = round_trip(obj)
    assert_same(obj, back)
    assert list(back) == list(obj)


def test_top_level_scalars_and_tensor():
    assert round_trip(None) is None
    assert flatten(None).tree is not None  # None is not the "flat dict" marker
    t = torch.arange(4)
    flat = flatten(t)
    assert list(flat.tensors) == ["tensor"]
    assert torch.equal(round_trip(t), t)
    assert round_trip([]) == [] and round_trip(()) == ()


def test_parameters_and_requires_grad():
    p = torch.nn.Parameter(torch.randn(2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    g = torch.randn(3, requires_grad=True)
    back = round_trip({"p": p, "frozen": frozen, "g": g, "plain": torch.ones(1)})
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad
    assert type(back["frozen"]) is torch.nn.Parameter and not back["frozen"].requires_grad
    assert type(back["g"]) is torch.Tensor and back["g"].requires_grad
    assert not back["plain"].requires_grad
    assert flatten({"g": g}).tree is not None  # requires_grad needs the tree


def test_non_contiguous_tensors_are_kept_as_given():
    t = torch.arange(12.0).reshape(3, 4).t()
    flat = flatten({"t": t})
    assert flat.tensors["t"] is t
    assert torch.equal(round_trip({"t": t})["t"], t)


# --------------------------------------------------------------------------- tied tensors


def test_tied_tensors():
    base = torch.arange(10.0)
    view = base[2:6]
    obj = {
        "a": base,
        "same_object": base,
        "same_view": base[:],  # a new object, same storage, offset, shape, stride
        "view": view,
        "same_view_again": base[2:6],
        "overlapping": base[4:8],
        "transposed": base.reshape(2, 5).t(),
        "other_dtype": base.view(torch.int32),
        "nested": {"deep": [view]},
    }
    flat = flatten(obj)
    assert flat.aliases == {
        "same_object": "a",
        "same_view": "a",
        "same_view_again": "view",
        "nested/deep/0": "view",
    }
    assert set(flat.tensors) == {"a", "view", "overlapping", "transposed", "other_dtype"}
    back = round_trip(obj)
    assert back["same_object"] is back["a"] and back["same_view"] is back["a"]
    assert back["nested"]["deep"][0] is back["view"]
    assert back["same_view_again"].data_ptr() == back["view"].data_ptr()
    assert back["overlapping"] is not back["view"]
    assert_same(obj, back)


def test_empty_tensors_are_not_tied_by_address():
    a, b = torch.empty(0), torch.empty(0)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    flat = flatten({"a": a, "b": b, "a2": a})
    assert set(flat.tensors) == {"a", "b"} and flat.aliases == {"a2": "a"}


def test_conjugate_view_is_not_an_alias():
    z = torch.randn(3, dtype=torch.complex64)
    flat = flatten({"z": z, "zc": z.conj()})
    assert set(flat.tensors) == {"z", "zc"}


# --------------------------------------------------------------------------- names


def test_names_follow_paths():
    t1, t2 = torch.ones(1), torch.zeros(1)
    flat = flatten({"model": {"fc.weight": t1}, "optimizer": {"state": {0: {"exp_avg": t2}}}})
    assert list(flat.tensors) == ["model/fc.weight", "optimizer/state/0/exp_avg"]


def test_name_collisions_get_suffixes():
    ts = [torch.full((1,), float(i)) for i in range(6)]
    obj = {"a/b": ts[0], "a": {"b": ts[1]}, 1: ts[2], "1": ts[3], "a/b~1": ts[4]}
    flat = flatten(obj)
    assert list(flat.tensors) == ["a/b", "a/b~1", "1", "1~1", "a/b~1~1"]
    assert_same(obj, round_trip(obj))
    # Deterministic: the same object always gets the same names.
    assert list(flatten(obj).tensors) == list(flat.tensors)


def test_reserved_and_invalid_names():
    t = torch.ones(1)
    flat = flatten({"__metadata__": t})
    assert flat.tree is not None and list(flat.tensors) == ["__metadata__~1"]
    assert_same({"__metadata__": t}, round_trip({"__metadata__": t}))
    flat = flatten({"bad\udc80": t})
    (name,) = flat.tensors
    name.encode("utf-8")  # a valid safetensors key
    assert flat.tree is not None
    assert_same({"bad\udc80": t}, round_trip({"bad\udc80": t}))


# --------------------------------------------------------------------------- refusals


def test_unsupported_object_names_its_path():
    obj = {"optimizer": {"state": {0: {"x": Opaque(1)}}}}
    with pytest.raises(TypeError) as info:
        flatten(obj)
    message = str(info.value)
    assert "['optimizer']['state'][0]['x']" in message
    assert "Opaque" in message and "allow_pickle=True" in message
    with pytest.raises(TypeError, match="dict key"):
        flatten({Opaque(1): 1})
    with pytest.raises(TypeError, match="defaultdict"):
        flatten([defaultdict(lambda: 0)])  # a factory that is no type of the table
    with pytest.raises(TypeError, match=r"tensor used as a dict key at \['k'\]"):
        flatten({"k": {torch.ones(1): 1}})


def _quietly(make):
    """Build a tensor whose constructor warns (beta or deprecated features)."""

    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make()

    return build


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.zeros(3).to_sparse(), "sparse_coo"),
        (_quietly(lambda: torch.eye(2).to_sparse_csr()), "sparse_csr"),
        (
            _quietly(lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8)),
            "quantized",
        ),
        (lambda: torch.zeros(2, device="meta"), "meta"),
        (
            lambda: torch.nested.nested_tensor(
                [torch.zeros(2), torch.zeros(3)], layout=torch.jagged
            ),
            "nested",
        ),
        (lambda: torch.zeros(2, dtype=torch.complex128), "complex128"),
    ],
)
def test_unsupported_tensors_name_their_path(make, match):
    with pytest.raises(TypeError, match=match) as info:
        flatten({"layers": [{"w": make()}]})
    assert "['layers'][0]['w']" in str(info.value)


def test_cycles_and_depth():
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        flatten({"x": loop})
    deep: object = torch.ones(1)
    for _ in range(MAX_DEPTH + 1):
        deep = {"a": deep}
    with pytest.raises(ValueError, match="deeper than"):
        flatten(deep)
    ok: object = 1
    for _ in range(MAX_DEPTH):
        ok = [ok]
    assert_same(ok, round_trip(ok))
    shared = [1]  # shared but not cyclic: fine, stored twice
    assert round_trip([shared, shared]) == [[1], [1]]


# --------------------------------------------------------------------------- pickle


def test_allow_pickle_round_trip_and_weights_only():
    obj = {"model": {"w": torch.ones(2)}, "extra": Opaque([1, 2]), Opaque("k"): defaultdict(int)}
    flat = flatten(obj, allow_pickle=True)
    tensors, aliases, tree = store_and_load(flat)
    back = unflatten(tree, tensors, aliases, weights_only=False)
    assert back["extra"] == Opaque([1, 2]) and back[Opaque("k")] == defaultdict(int)
    assert torch.equal(back["model"]["w"], torch.ones(2))

    with pytest.raises(WeightsOnlyError) as info:
        unflatten(tree, tensors, aliases)
    assert "weights_only=False" in str(info.value) and "['extra']" in str(info.value)
    assert "Opaque" in str(info.value)
    assert isinstance(info.value, FastCkptError)
    assert isinstance(info.value, pickle.UnpicklingError)


# --------------------------------------------------------------------------- hostile trees


T = {"t": "tensor", "n": "x"}
MALFORMED = {
    "null node": [None],
    "unknown tag": {"t": "bogus"},
    "tag not str": {"t": ["dict"]},
    "no tag": {"v": 1},
    "extra field": {"t": "none", "x": 1},
    "dict lengths": {"t": "dict", "k": [1, 2], "v": [1]},
    "dict keys not list": {"t": "dict", "k": "ab", "v": [1, 2]},
    "unhashable key": {"t": "dict", "k": [[1]], "v": [1]},
    "tensor key": {"t": "dict", "k": [T], "v": [1]},
    "duplicate key": {"t": "dict", "k": [1, 1], "v": [1, 2]},
    "missing tensor": {"t": "tensor", "n": "nope"},
    "tensor name not str": {"t": "tensor", "n": 5},
    "tensor flag not bool": {"t": "tensor", "n": "x", "p": 1},
    "grad on int tensor": {"t": "tensor", "n": "i", "g": True},
    "alias to nowhere": {"t": "tensor", "n": "dangling"},
    "alias and stored": {"t": "tensor", "n": "both"},
    "float text": {"t": "float", "v": "1.5"},
    "int decimal": {"t": "int", "v": "12"},
    "int junk": {"t": "int", "v": "0x1_0"},
    "dtype unknown": {"t": "dtype", "v": "float33"},
    "dtype module": {"t": "dtype", "v": "_dynamo"},
    "size floats": {"t": "size", "v": [1.5]},
    "device junk": {"t": "device", "v": "gpu:x"},
    "bytes junk": {"t": "bytes", "v": "!!"},
    "pickle junk": {"t": "pickle", "v": "!!", "type": "x"},
    "pickle no type": {"t": "pickle", "v": ""},
    "pickle corrupt": {"t": "pickle", "v": "AA==", "type": "x"},
    "pickle truncated": {"t": "pickle", "v": "gAR9", "type": "x"},
    "odict metadata junk": {"t": "odict", "k": [], "v": [], "m": {"t": "?"}},
    "deep lists": None,  # built below
}


def _deep(depth):
    node: object = 1
    for _ in range(depth):
        node = [node]
    return node


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_trees_raise_header_error(name):
    tree = _deep(10_000) if name == "deep lists" else MALFORMED[name]
    tensors = {"x": torch.ones(1), "i": torch.arange(2), "both": torch.ones(1)}
    aliases = {"dangling": "gone", "both": "x"}
    with pytest.raises(HeaderError):
        unflatten(tree, tensors, aliases, weights_only=False)


def test_deep_dicts_raise_header_error():
    node: object = 1
    for _ in range(MAX_DEPTH + 5):
        node = {"t": "dict", "k": ["a"], "v": [node]}
    with pytest.raises(HeaderError, match="deeper than"):
        unflatten(node, {}, {})


def test_flat_unflatten_checks_aliases():
    x = torch.ones(1)
    back = unflatten(None, {"x": x}, {"y": "x"})
    assert list(back) == ["x", "y"] and back["y"] is x
    with pytest.raises(HeaderError, match="missing"):
        unflatten(None, {"x": x}, {"y": "z"})
    with pytest.raises(HeaderError, match="both"):
        unflatten(None, {"x": x}, {"x": "x"})


def test_unreferenced_tensors_are_ignored():
    assert unflatten([1], {"x": torch.ones(1)}, {}) == [1]


tags = st.sampled_from(
    [
        "none",
        "tuple",
        "dict",
        "odict",
        "tensor",
        "float",
        "int",
        "dtype",
        "size",
        "device",
        "bytes",
        "pickle",
        "object",
        "class",
        "flat",
        "set",
        "frozenset",
        "complex",
        "bytearray",
        "counter",
        "ddict",
        "dataclass",
        "namedtuple",
        "enum",
        "?",
    ]
)
field_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(["x", "i", "nan", "-0x1f", "float32", "cpu", "AA==", "gAR9lC4=", "cuda:-1"]),
    st.sampled_from(["argparse.Namespace", "omegaconf.DictConfig", "omegaconf.ListConfig"]),
    st.sampled_from(["lightning.AttributeDict", "dict", "os.system", "${oc.env:HOME}", "${x}"]),
    st.sampled_from(["os:system", "builtins:dict", "list", "channels_last", "channels_last_3d"]),
    st.text(max_size=4),
)
json_trees = st.recursive(
    field_values,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.fixed_dictionaries(
            {"t": tags},
            optional={
                "v": children,
                "k": children,
                "n": children,
                "m": children,
                "p": children,
                "g": children,
                "type": children,
                "c": children,
                "f": children,
            },
        ),
    ),
    max_leaves=10,
)


@given(json_trees, st.booleans())
@settings(max_examples=300, deadline=None)
def test_fuzz_trees_raise_only_header_error(tree, weights_only):
    tensors = {"x": torch.ones(1), "i": torch.arange(2)}
    try:
        unflatten(tree, tensors, {"y": "x"}, weights_only=weights_only)
    except HeaderError:
        pass
    except WeightsOnlyError:
        assert weights_only
    except ImportError:  # a trusted file names a class (or pickles one) missing here
        assert not weights_only


# --------------------------------------------------------------------------- property


# NaN keys included: two NaN keys of one dict are two keys (nan != nan).
keys = st.one_of(st.text(max_size=4), st.integers(-5, 5), st.booleans(), st.none(), st.floats())
# A set holds no NaN here: two NaNs are two elements, and no NaN equals another on comparison.
set_elements = st.one_of(
    st.text(max_size=3),
    st.integers(-(2**70), 2**70),
    st.none(),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.tuples(st.integers(-3, 3), st.text(max_size=2)),
    st.binary(max_size=3),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=4),
    st.binary(max_size=4).map(bytearray),
    st.complex_numbers(),
    st.builds(lambda n, f: torch.full((n,), f), st.integers(0, 3), st.floats(-10, 10)),
)
objects = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(st.text(max_size=3), children, max_size=3).map(OrderedDict),
        st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=3).map(Counter),
        st.dictionaries(keys, children, max_size=3).map(lambda d: defaultdict(list, d)),
        st.sets(set_elements, max_size=4),
        st.frozensets(set_elements, max_size=4),
    ),
    max_leaves=12,
)


@given(objects)
@settings(max_examples=150, deadline=None)
def test_random_objects_round_trip(obj):
    assert_same(obj, round_trip(obj))


def test_an_empty_key_round_trips(tmp_path):
    """{"": tensor} is not stored as a flat file (no tensor can be named ""): its key survives."""
    import fastckpt

    path = tmp_path / "empty-key.safetensors"
    fastckpt.save({"": torch.tensor([]), "w": torch.ones(2)}, path)
    back = fastckpt.load(path)
    assert list(back) == ["", "w"] and back[""].numel() == 0


# --------------------------------------------------------------------------- key order, NaN keys


def test_two_nan_keys_round_trip():
    first, second = float("nan"), float("nan")
    obj = {first: torch.ones(1), second: torch.zeros(1), 1.5: "x"}
    back = round_trip(obj)
    assert len(back) == 3
    (a, va), (b, vb), (c, vc) = back.items()
    assert math.isnan(a) and math.isnan(b) and a is not b
    assert torch.equal(va, torch.ones(1)) and torch.equal(vb, torch.zeros(1)) and vc == "x"


def test_a_flat_dict_loads_in_insertion_order(tmp_path):
    """The layout orders the file for alignment; load returns the keys as they were given,
    tied names in their place, and the file stays plain safetensors under the same keys."""
    from safetensors.torch import load_file

    import fastckpt

    big = torch.ones(1024)  # 4096 bytes: laid out first
    state = {"z.bias": torch.zeros(3), "tied": big, "a.weight": big, "b": torch.arange(5)}
    path = tmp_path / "flat.safetensors"
    fastckpt.save(state, path)
    back = fastckpt.load(path)
    assert list(back) == list(state)
    assert back["tied"] is back["a.weight"]
    plain = load_file(path)
    assert set(plain) == set(state)  # the tied "a.weight" is stored as a copy for them
    for name, tensor in plain.items():
        assert torch.equal(tensor, state[name])


def test_name_root_names_a_subtree_by_its_own_keys():
    weights = OrderedDict(w=torch.ones(2), b=torch.zeros(1))
    checkpoint = {"state_dict": weights, "optimizer": {"w": torch.ones(1)}, "epoch": 1}
    flat = flatten(checkpoint, name_root=("state_dict",))
    assert list(flat.tensors) == ["w", "b", "optimizer/w"]
    assert flatten(flat) is flat  # a Flat is handed to save as it is
    assert_same(checkpoint, round_trip(checkpoint, name_root=("state_dict",)))


# --------------------------------------------------------------------------- configuration objects


def test_configuration_objects_and_their_classes_round_trip():
    import argparse

    omegaconf = pytest.importorskip("omegaconf")
    from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
    from lightning.pytorch.utilities.parsing import AttributeDict

    w = torch.ones(2)
    obj = {
        "ns": argparse.Namespace(lr=0.1, layers=[4, 1], w=w),
        "attrs": AttributeDict(x=0.5),
        "fabric": FabricAttributeDict(y=(1, 2)),
        "config": omegaconf.OmegaConf.create({"model": {"width": 8}, "twice": "${model.width}"}),
        "list": omegaconf.OmegaConf.create([1, {"k": "v"}]),
        "types": [omegaconf.DictConfig, omegaconf.ListConfig, AttributeDict, argparse.Namespace],
    }
    flat = flatten(obj)
    assert list(flat.tensors) == ["ns/w"]
    back = round_trip(obj)
    assert type(back["ns"]) is argparse.Namespace
    assert back["ns"].lr == 0.1 and back["ns"].layers == [4, 1] and torch.equal(back["ns"].w, w)
    assert type(back["attrs"]) is AttributeDict and back["attrs"] == {"x": 0.5}
    assert type(back["fabric"]) is FabricAttributeDict and back["fabric"].y == (1, 2)
    assert isinstance(back["config"], omegaconf.DictConfig) and back["config"].twice == 8
    assert isinstance(back["list"], omegaconf.ListConfig) and back["list"][1].k == "v"
    assert back["types"] == obj["types"]


@pytest.fixture
def marker_resolver(tmp_path, monkeypatch):
    """A resolver that leaves a file behind when called, and a secret in the environment."""
    omegaconf = pytest.importorskip("omegaconf")
    marker = tmp_path / "resolver-was-called"

    def touch(*args: object) -> str:
        marker.touch()
        return "touched"

    conf = omegaconf.OmegaConf
    register = getattr(conf, "register_resolver", None) or conf.register_new_resolver
    register("fastckpt_test_touch", touch, replace=True)
    monkeypatch.setenv("FASTCKPT_TEST_SECRET", "hunter2-secret-value")
    yield omegaconf, marker
    omegaconf.OmegaConf.clear_resolver("fastckpt_test_touch")


@pytest.mark.parametrize(
    "value", ["${fastckpt_test_touch:}", "${oc.env:FASTCKPT_TEST_SECRET}", "a ${b.${c}}"]
)
@pytest.mark.parametrize("kind", ["omegaconf.DictConfig", "omegaconf.ListConfig"])
def test_a_safe_load_never_resolves_an_omegaconf_value(tmp_path, marker_resolver, value, kind):
    """A hostile file tags plain data as OmegaConf: the default load refuses it unresolved."""
    import fastckpt

    omegaconf, marker = marker_resolver
    data = {"t": "dict", "k": ["x", "ok"], "v": [value, 1]}
    if kind == "omegaconf.ListConfig":
        data = [value, 1]
    tree = {"t": "dict", "k": ["hyper_parameters"], "v": [{"t": "object", "c": kind, "v": data}]}
    with pytest.raises(WeightsOnlyError, match="resolver") as info:
        unflatten(tree, {}, {})
    assert "hunter2" not in str(info.value)
    # The same through a real file written by save: OmegaConf objects, unresolved.
    config = omegaconf.OmegaConf.create({"x": value} if "Dict" in kind else [value])
    path = tmp_path / "hostile.safetensors"
    fastckpt.save({"hyper_parameters": config}, path)
    with pytest.raises(WeightsOnlyError):
        fastckpt.load(path)
    assert not marker.exists()
    # Trusted: rebuilt as saved; resolution is the reader's own choice, later.
    back = fastckpt.load(path, weights_only=False)["hyper_parameters"]
    assert omegaconf.OmegaConf.to_container(back) == omegaconf.OmegaConf.to_container(config)
    assert not marker.exists()
    if "touch" in value:  # the resolver is live: reading the value calls it
        omegaconf.OmegaConf.to_container(back, resolve=True)
        assert marker.exists()


def test_node_interpolations_load_safely(marker_resolver):
    omegaconf, _ = marker_resolver
    config = omegaconf.OmegaConf.create(
        {"a": {"b": 2}, "c": "${a.b}", "d": "${.c}", "e": "x${a.b}y", "l": [0, "${l[0]}"]}
    )
    back = round_trip({"cfg": config})["cfg"]
    assert back.c == 2 and back.d == 2 and back.e == "x2y" and back.l[1] == 0


HOSTILE_OBJECTS = {
    "unknown class": {"t": "object", "c": "os.system", "v": {"t": "dict", "k": [], "v": []}},
    "class of a name": {"t": "class", "v": "subprocess.Popen"},
    "class not str": {"t": "class", "v": ["dict"]},
    "object fields": {"t": "object", "c": "argparse.Namespace"},
    "object extra field": {"t": "object", "c": "dict", "v": [], "x": 1},
    "namespace of a list": {"t": "object", "c": "argparse.Namespace", "v": [1]},
    "namespace int keys": {
        "t": "object",
        "c": "argparse.Namespace",
        "v": {"t": "dict", "k": [1], "v": [2]},
    },
    "attrdict of a str": {"t": "object", "c": "lightning.AttributeDict", "v": "abc"},
    "dictconfig of a list": {"t": "object", "c": "omegaconf.DictConfig", "v": [1]},
    "dictconfig tensor value": {
        "t": "object",
        "c": "omegaconf.DictConfig",
        "v": {"t": "dict", "k": ["a"], "v": [{"t": "tensor", "n": "x"}]},
    },
    "listconfig of a dict": {"t": "object", "c": "omegaconf.ListConfig", "v": {"t": "none"}},
    "flat not a list": {"t": "flat", "v": "x"},
    "flat int name": {"t": "flat", "v": [1]},
    "flat duplicate": {"t": "flat", "v": ["x", "x"]},
    "flat missing": {"t": "flat", "v": ["x", "gone"]},
    "deep object": None,  # built below
}


@pytest.mark.parametrize("name", HOSTILE_OBJECTS)
def test_hostile_object_nodes_raise_header_error(name):
    pytest.importorskip("omegaconf")
    tree = HOSTILE_OBJECTS[name]
    if name == "deep object":
        tree = 1
        for _ in range(MAX_DEPTH):
            tree = {
                "t": "object",
                "c": "argparse.Namespace",
                "v": {"t": "dict", "k": ["a"], "v": [tree]},
            }
    with pytest.raises(HeaderError) as info:
        unflatten(tree, {"x": torch.ones(1)}, {}, weights_only=False)
    assert "deeper than" in str(info.value) or name != "deep object"


def test_a_loaded_object_is_freed_without_the_garbage_collector(tmp_path):
    """Nothing the load made keeps the tensors alive in a reference cycle: dropping the
    object frees its memory at once, as a training loop that reloads expects."""
    import gc
    import weakref

    path = tmp_path / "x.safetensors"
    fastckpt.save({"model": {"w": torch.ones(1000)}, "opt": [torch.zeros(3)], "step": 3}, path)
    gc.disable()
    try:
        loaded = fastckpt.load(path)
        alive = weakref.ref(loaded["model"]["w"])
        del loaded
        assert alive() is None
    finally:
        gc.enable()


# --------------------------------------------------------------------------- torch.load's types


def _torch_round_trip(obj, path):
    """What torch.save then torch.load(weights_only=True) returns for ``obj``."""
    torch.save(obj, path)
    return torch.load(path, weights_only=True)


def test_the_types_torch_loads_safely_are_stored_as_data(tmp_path):
    """Sets, complex numbers, Counter, OrderedDict, bytes and bytearray: torch.load with
    weights_only=True takes them, so fastckpt stores them with no pickle, types exact."""
    obj = {
        "set": {3, 1, 2},
        "words": {"b", "a", "c"},
        "mixed": {1, "a", None, (2, "b")},
        "complex": 1.5 - 2j,
        "odd complex": complex(float("inf"), -0.0),
        "counter": Counter("abracadabra"),
        "odict": OrderedDict(b=1, a=[2]),
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"\x01\x02"),
        "w": torch.arange(4.0),
        2j: "a complex key",
    }
    path = tmp_path / "types.safetensors"
    fastckpt.save(obj, path)  # no allow_pickle
    ours = fastckpt.load(path)  # weights_only=True
    theirs = _torch_round_trip(obj, tmp_path / "types.pt")
    assert_same(ours, theirs)
    assert_same(ours, obj)
    with fastckpt.open(path) as reader:
        assert '"pickle"' not in json.dumps(reader.structure)


def test_frozenset_and_defaultdict_round_trip_as_data(tmp_path):
    """Beyond what torch.load(weights_only=True) takes: frozensets, and defaultdicts whose
    factory is a type of the table."""
    obj = {
        "fs": frozenset({"x", "y"}),
        "dd": defaultdict(list, {"a": [1]}),
        "none": defaultdict(None, {1: 2}),
        "counts": defaultdict(int),
        frozenset({1, 2}): "a frozenset key",
    }
    path = tmp_path / "more.safetensors"
    fastckpt.save(obj, path)
    back = fastckpt.load(path)
    assert_same(back, obj)
    back["counts"]["new"] += 1  # the factory works
    assert back["counts"] == {"new": 1}


def test_a_set_is_written_alike_whatever_the_hash_seed(tmp_path):
    """Set elements are sorted (or ordered by their JSON), so the file does not depend on
    PYTHONHASHSEED: two processes write the same header."""
    import os
    import subprocess
    import sys

    script = (
        "import sys, fastckpt\n"
        "fastckpt.save({'s': {'pear', 'apple', 'fig', 'kiwi'}, 'm': {1, 'a', None, (2, 'b')},"
        " 'f': frozenset({'x', 'yy', 'zzz'})}, sys.argv[1])\n"
    )
    headers = []
    for seed in ("1", "2"):
        path = tmp_path / f"seed{seed}.safetensors"
        env = {**os.environ, "PYTHONHASHSEED": seed, "FASTCKPT_NO_PROGRESS": "1"}
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env)
        with fastckpt.open(path) as reader:
            headers.append(reader.structure)
    assert headers[0] == headers[1]
    assert headers[0]["v"][0]["v"] == ["apple", "fig", "kiwi", "pear"]


@pytest.mark.parametrize(
    "node, match",
    [
        ({"t": "set", "v": [[1]]}, "invalid dict key"),
        ({"t": "set", "v": [1, 1]}, "duplicate elements"),
        ({"t": "frozenset", "v": "ab"}, "must be a list"),
        ({"t": "set", "v": [T]}, "invalid dict key"),
        ({"t": "complex", "v": [1.0]}, "malformed complex"),
        ({"t": "complex", "v": [1, 2.0]}, "malformed complex"),
        ({"t": "complex", "v": [1.0, "x"]}, "malformed complex"),
        ({"t": "bytearray", "v": "!!"}, "base64"),
        ({"t": "counter", "k": [1], "v": []}, "1 keys, 0 values"),
        ({"t": "ddict", "k": [], "v": [], "f": "os.system"}, "unknown defaultdict factory"),
        ({"t": "ddict", "k": [], "v": [], "f": 1}, "must be a str"),
        ({"t": "tensor", "n": "x", "f": "channels_first"}, "unknown memory format"),
        ({"t": "tensor", "n": "x", "f": "channels_last"}, "needs 4"),
        ({"t": "flat", "v": ["x"], "f": {"y": "channels_last"}}, "not a key"),
        ({"t": "flat", "v": ["x"], "f": {"x": "channels_last_3d"}}, "needs 5"),
        ({"t": "enum", "c": "os.system", "v": 1}, "malformed class name"),
        ({"t": "enum", "c": ".os:system", "v": 1}, "malformed class name"),
        ({"t": "dataclass", "c": "a:B", "k": ["x"], "v": []}, "malformed dataclass fields"),
        ({"t": "dataclass", "c": "a:B", "k": ["x", "x"], "v": [1, 2]}, "malformed dataclass"),
        ({"t": "dataclass", "c": "a:B", "v": []}, "missing 'k'"),
        ({"t": "namedtuple", "c": "a:B", "v": {}}, "must be a list"),
    ],
)
def test_malformed_new_nodes_raise_header_error(node, match):
    tensors = {"x": torch.ones(1)}
    with pytest.raises(HeaderError, match=match):
        unflatten(node, tensors, {}, weights_only=False)


# --------------------------------------------------------------------------- allowed classes


@dataclasses.dataclass
class TrainConfig:
    lr: float
    widths: tuple = (64, 64)
    schedule: dict = dataclasses.field(default_factory=dict)
    steps_done: int = dataclasses.field(default=0, init=False)  # not a constructor argument


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str


class Point(typing.NamedTuple):
    x: float
    y: float


Pair = namedtuple("Pair", "left right")


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Access(enum.Flag):
    READ = 1
    WRITE = 2


SAFE = [TrainConfig, Frozen, Point, Pair, Mode, Access]


@pytest.fixture
def allowed():
    """The test's classes allowed for the test only."""
    fastckpt.add_safe_classes(SAFE)
    yield
    config_objects.remove_safe_classes(SAFE)


def _records():
    config = TrainConfig(0.1, schedule={"warmup": 10, "w": torch.ones(2)})
    config.steps_done = 7
    return {
        "config": config,
        "point": Point(1.0, 2.5),
        "pair": Pair([1], Frozen("f")),
        "mode": Mode.EVAL,
        "access": Access.READ | Access.WRITE,
        Mode.TRAIN: "an enum key",
        Frozen("key"): "a frozen dataclass key",
        "modes": {Mode.TRAIN, Mode.EVAL},
    }


def test_allowed_classes_round_trip_as_torch_load_with_safe_globals(tmp_path, allowed):
    obj = _records()
    path = tmp_path / "records.safetensors"
    fastckpt.save(obj, path)  # no pickle: fields as data
    back = fastckpt.load(path)
    with torch.serialization.safe_globals(SAFE):
        torch.save(obj, tmp_path / "records.pt")
        theirs = torch.load(tmp_path / "records.pt", weights_only=True)
    for key in obj:
        assert type(back[key]) is type(theirs[key]) is type(obj[key]), key
    assert back["config"].steps_done == 7 and back["config"].widths == (64, 64)
    assert torch.equal(back["config"].schedule["w"], torch.ones(2))
    assert back["point"] == theirs["point"] == Point(1.0, 2.5)
    assert back["pair"] == Pair([1], Frozen("f"))
    assert back["mode"] is Mode.EVAL and back["access"] == Access.READ | Access.WRITE
    assert back[Mode.TRAIN] == "an enum key" and back[Frozen("key")] == "a frozen dataclass key"
    assert back["modes"] == {Mode.TRAIN, Mode.EVAL}
    with fastckpt.open(path) as reader:
        tree = reader.structure
    assert '"pickle"' not in json.dumps(tree)
    assert f"{__name__}:TrainConfig" in json.dumps(tree)


def test_a_class_not_allowed_is_refused_on_save_and_on_load(tmp_path, allowed):
    path = tmp_path / "records.safetensors"
    fastckpt.save({"config": TrainConfig(0.5)}, path)
    config_objects.remove_safe_classes([TrainConfig])
    with pytest.raises(WeightsOnlyError) as info:
        fastckpt.load(path)
    message = str(info.value)
    assert "add_safe_classes" in message and "TrainConfig" in message and "['config']" in message
    # a trusted file: the class is imported by the name the file records
    assert fastckpt.load(path, weights_only=False)["config"] == TrainConfig(0.5)
    with pytest.raises(TypeError, match=r"add_safe_classes\(\[.*TrainConfig\]\)"):
        fastckpt.save({"config": TrainConfig(0.5)}, tmp_path / "refused.safetensors")
    with pytest.raises(TypeError, match="not a dataclass, named tuple or enum"):
        fastckpt.add_safe_classes([Opaque])
    with pytest.raises(TypeError, match="list of classes"):
        fastckpt.add_safe_classes(TrainConfig)


def test_a_record_of_a_class_of_another_kind_is_refused(allowed):
    node = {"t": "dataclass", "c": f"{__name__}:Mode", "k": [], "v": []}
    with pytest.raises(HeaderError, match="is a enum here"):
        unflatten(node, {}, {})
    missing = {"t": "dataclass", "c": f"{__name__}:TrainConfig", "k": ["nope"], "v": [1]}
    with pytest.raises(HeaderError, match="no field 'nope'"):
        unflatten(missing, {}, {})
    bad_enum = {"t": "enum", "c": f"{__name__}:Mode", "v": "test"}
    with pytest.raises(HeaderError, match="cannot rebuild"):
        unflatten(bad_enum, {}, {})
    with pytest.raises(ImportError, match="cannot be imported"):
        unflatten(
            {"t": "enum", "c": "no_such_module_here:Mode", "v": 1}, {}, {}, weights_only=False
        )
