"""safetensors dtype names <-> torch dtypes, and the shapes each side counts in.

The sizes come from the format layer (which stays free of torch); this module only adds
the torch side. Every dtype safetensors 0.8 knows has its torch dtype here except the
``F6`` types, which torch has none for (such tensors are refused with a ``HeaderError``).

``F4`` is the one dtype whose shapes differ: safetensors counts 4-bit values, torch's
``float4_e2m1fn_x2`` counts bytes of two values, so the last dimension of a file's shape is
twice the tensor's (as ``safetensors.torch`` does).

Example:
    >>> import torch
    >>> to_safetensors(torch.bfloat16), to_torch("F8_E4M3"), itemsize("I64")
    ('BF16', torch.float8_e4m3fn, 8)
    >>> to_safetensors(torch.float4_e2m1fn_x2), stored_shape(torch.float4_e2m1fn_x2, (3, 2))
    ('F4', (3, 4))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastckpt.errors import HeaderError
from fastckpt.format.schema import DTYPES, PACKED_BITS

__all__ = ["itemsize", "stored_shape", "to_safetensors", "to_torch", "torch_shape"]

# safetensors name -> torch attribute. Looked up with getattr so that an older
# torch lacking a float8 or unsigned type simply does not offer that name.
_TORCH_ATTRIBUTES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",  # two F4 values per torch element: see stored_shape
    "C64": "complex64",
}

#: safetensors dtypes whose torch element packs this many of the file's elements.
_PER_TORCH_ELEMENT = {"F4": 2}

_TORCH_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, attribute)
    for name, attribute in _TORCH_ATTRIBUTES.items()
    if isinstance(getattr(torch, attribute, None), torch.dtype)
}
_NAME_BY_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in _TORCH_BY_NAME.items()}


def to_safetensors(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype.

    Raises:
        TypeError: the dtype has no safetensors equivalent (e.g. complex128).

    Example:
        >>> to_safetensors(torch.float32)
        'F32'
    """
    try:
        return _NAME_BY_TORCH[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"dtype {dtype} cannot be stored in a safetensors file") from None


def to_torch(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name.

    Raises:
        HeaderError: the name is unknown (it comes from a file's header).

    Example:
        >>> to_torch("BF16")
        torch.bfloat16
    """
    try:
        return _TORCH_BY_NAME[name]
    except (KeyError, TypeError):
        if isinstance(name, str) and name in DTYPES:
            raise HeaderError(
                f"dtype {name!r} ({PACKED_BITS.get(name, 8)}-bit) has no torch dtype in torch "
                f"{torch.__version__}: its tensors cannot be loaded as torch tensors"
            ) from None
        raise HeaderError(f"unknown dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per torch element of a safetensors dtype name (1 for ``F4``, whose torch
    element holds two values).

    Raises:
        HeaderError: the name is unknown, or torch has no dtype for it.

    Example:
        >>> itemsize("F16"), itemsize("F4")
        (2, 1)
    """
    return to_torch(name).itemsize


def stored_shape(dtype: torch.dtype, shape: Sequence[int], *, name: str = "") -> tuple[int, ...]:
    """The shape a safetensors header gives a tensor of ``dtype`` and torch ``shape``.

    Raises:
        TypeError: a 0-d ``float4_e2m1fn_x2`` tensor (``F4`` counts values along the last
            dimension, so two values need one; ``safetensors`` refuses it too).

    Example:
        >>> stored_shape(torch.float32, (2, 3)), stored_shape(torch.float4_e2m1fn_x2, (2, 3))
        ((2, 3), (2, 6))
    """
    dims = tuple(shape)
    per_element = _PER_TORCH_ELEMENT.get(to_safetensors(dtype), 1)
    if per_element == 1:
        return dims
    if not dims:
        where = f" {name!r}" if name else ""
        raise TypeError(
            f"0-d {dtype} tensor{where} cannot be stored: the safetensors format counts its "
            "values along the last dimension; store it with shape (1,)"
        )
    return (*dims[:-1], dims[-1] * per_element)


def torch_shape(name: str, shape: Sequence[int], *, tensor: str = "") -> tuple[int, ...]:
    """The torch shape of a tensor a header gives as dtype ``name`` and ``shape``.

    Raises:
        HeaderError: an ``F4`` tensor whose last dimension is odd or absent, which torch's
            ``float4_e2m1fn_x2`` (two values per element) cannot hold.

    Example:
        >>> torch_shape("F32", [2, 3]), torch_shape("F4", [2, 6])
        ((2, 3), (2, 3))
    """
    dims = tuple(shape)
    per_element = _PER_TORCH_ELEMENT.get(name, 1)
    if per_element == 1:
        return dims
    if not dims or dims[-1] % per_element:
        where = f"tensor {tensor!r}: " if tensor else ""
        raise HeaderError(
            f"{where}{name} shape {list(dims)} has no last dimension divisible by "
            f"{per_element}: torch's {to_torch(name)} holds {per_element} values per element"
        )
    return (*dims[:-1], dims[-1] // per_element)
