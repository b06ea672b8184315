"""Element types: safetensors names, sizes, and the torch / numpy types they map to.

No torch import at module load: torch types are looked up only when torch is already imported
(a tensor cannot exist otherwise).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["ITEMSIZE", "torch_dtype_name", "numpy_dtype_name", "to_torch_dtype", "to_numpy_dtype"]

#: bytes per element of every safetensors dtype zerostall reads and writes
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "C64": 8, "C128": 16,
}

_TORCH_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64", "complex128": "C128",
}
_TORCH_BY_NAME = {v: k for k, v in _TORCH_NAMES.items()}

_NUMPY_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64", "complex128": "C128",
}
_NUMPY_BY_NAME = {v: k for k, v in _NUMPY_NAMES.items()}


def torch_dtype_name(dtype: Any) -> str | None:
    """The safetensors name of a torch dtype, or None if it has none."""
    return _TORCH_NAMES.get(str(dtype).removeprefix("torch."))


def numpy_dtype_name(dtype: np.dtype[Any]) -> str | None:
    """The safetensors name of a numpy dtype (native byte order only), or None."""
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big"):
        return None
    return _NUMPY_NAMES.get(dtype.name)


def to_torch_dtype(name: str) -> Any:
    import torch

    attr = _TORCH_BY_NAME.get(name)
    dt = getattr(torch, attr, None) if attr else None
    if dt is None:
        raise KeyError(name)
    return dt


def to_numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype for a safetensors name; types numpy lacks (BF16, FP8) map to same-size ints."""
    attr = _NUMPY_BY_NAME.get(name)
    if attr is not None:
        return np.dtype(attr)
    size = ITEMSIZE[name]
    return np.dtype({1: "uint8", 2: "uint16"}[size])
