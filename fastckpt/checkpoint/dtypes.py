"""safetensors dtype names <-> torch dtypes.

The byte sizes come from :data:`fastckpt.format.ITEMSIZE` (which stays free of
torch); this module only adds the torch side.

Example:
    >>> import torch
    >>> to_safetensors(torch.bfloat16), to_torch("F8_E4M3"), itemsize("I64")
    ('BF16', torch.float8_e4m3fn, 8)
"""

from __future__ import annotations

import torch

from fastckpt.errors import HeaderError
from fastckpt.format import ITEMSIZE

__all__ = ["itemsize", "to_safetensors", "to_torch"]

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
    "C64": "complex64",
}

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
        raise HeaderError(f"unknown dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype name.

    Raises:
        HeaderError: the name is unknown.

    Example:
        >>> itemsize("F16")
        2
    """
    if name not in _TORCH_BY_NAME:
        raise HeaderError(f"unknown dtype {name!r}")
    return ITEMSIZE[name]
