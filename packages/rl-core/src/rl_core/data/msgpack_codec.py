"""msgpack encoding for batch data: tensors, numpy arrays and plain Python values, without pickle.

Tensors and arrays travel as msgpack extension types whose payload is
`[dtype name, shape, raw little-endian bytes]`; the raw bytes are the element bits
themselves, so every dtype (bfloat16 included) round-trips bit-exactly. Tensors are decoded
on CPU, contiguous, without autograd history. Tuples come back as lists (msgpack has one
array type). Anything else raises TypeError naming the type.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np
import torch

__all__ = ["decode_msgpack", "encode_msgpack"]

_TENSOR_EXT = 1
_NDARRAY_EXT = 2
_NUMPY_SCALAR_EXT = 3

# Only these names are accepted when decoding, so a payload cannot name an arbitrary attribute.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
_TORCH_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}

# numpy kinds whose bytes are the whole value: bool, ints, floats, complex, fixed-width strings.
_NUMPY_KINDS = "biufcSU"

if sys.byteorder != "little":  # the raw tensor bytes are written in native order
    raise ImportError("rl_core.data.msgpack_codec assumes a little-endian host")


def _tensor_payload(tensor: torch.Tensor) -> bytes:
    if tensor.layout != torch.strided:
        raise TypeError(f"cannot encode a {tensor.layout} tensor; convert it to a dense tensor first")
    name = _TORCH_DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"cannot encode a tensor of dtype {tensor.dtype}")
    source = tensor.detach().to("cpu").resolve_conj().resolve_neg().reshape(-1)
    # A fresh buffer has stride 1 even for one element (a size-1 view may keep any stride,
    # which `view(torch.uint8)` rejects).
    flat = torch.empty(source.numel(), dtype=source.dtype).copy_(source)
    raw = flat.view(torch.uint8).numpy().tobytes()
    return msgpack.packb([name, list(tensor.shape), raw], use_bin_type=True)


def _decode_tensor(payload: bytes) -> torch.Tensor:
    name, shape, raw = msgpack.unpackb(payload, raw=False)
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"msgpack payload names an unsupported tensor dtype {name!r}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    # bytearray: frombuffer needs a writable buffer it may share.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _array_payload(array: np.ndarray) -> bytes:
    if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
        raise TypeError(
            f"cannot encode a numpy array of dtype {array.dtype} (object/structured arrays need pickle)"
        )
    return msgpack.packb(
        [array.dtype.str, list(array.shape), np.ascontiguousarray(array).tobytes()], use_bin_type=True
    )


def _decode_array(payload: bytes) -> np.ndarray:
    dtype_str, shape, raw = msgpack.unpackb(payload, raw=False)
    dtype = np.dtype(dtype_str)
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise ValueError(f"msgpack payload names an unsupported numpy dtype {dtype_str!r}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _encode_ext(value: Any) -> msgpack.ExtType:
    if isinstance(value, torch.Tensor):
        return msgpack.ExtType(_TENSOR_EXT, _tensor_payload(value))
    if isinstance(value, np.ndarray):
        return msgpack.ExtType(_NDARRAY_EXT, _array_payload(value))
    if isinstance(value, np.generic):
        return msgpack.ExtType(_NUMPY_SCALAR_EXT, _array_payload(np.asarray(value)))
    raise TypeError(
        f"cannot encode a value of type {type(value).__module__}.{type(value).__qualname__} with msgpack "
        "(supported: tensors, numpy arrays/scalars, and dict/list/tuple/str/bytes/int/float/bool/None)"
    )


def _decode_ext(code: int, payload: bytes) -> Any:
    if code == _TENSOR_EXT:
        return _decode_tensor(payload)
    if code == _NDARRAY_EXT:
        return _decode_array(payload)
    if code == _NUMPY_SCALAR_EXT:
        return _decode_array(payload)[()]
    raise ValueError(f"unknown msgpack extension type {code}")


def encode_msgpack(value: Any) -> bytes:
    """Encode `value` (nested dicts/lists of tensors, arrays and plain values) as msgpack bytes."""
    return msgpack.packb(value, default=_encode_ext, use_bin_type=True)


def decode_msgpack(data: bytes) -> Any:
    """Decode bytes written by `encode_msgpack`."""
    return msgpack.unpackb(data, ext_hook=_decode_ext, raw=False, strict_map_key=False)
