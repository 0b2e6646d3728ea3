"""Turning the caller's array into what ``ar_all_reduce`` takes: an address, an element
count, a dtype code, where the memory lives, and the stream a call on it defaults to.

numpy and torch are looked up in ``sys.modules`` rather than imported: an object can only be
an ``ndarray`` or a ``Tensor`` if its module is already loaded, and a host-only user must not
pay for importing torch (nor need it installed).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ._errors import UnsupportedType, InvalidArgument

# `ar_dtype_t`: NCCL's `ncclDataType_t` values.
F16, F32, BF16 = 6, 7, 9
DTYPE_NAMES = {F16: "float16", F32: "float32", BF16: "bfloat16"}

HOST = -1  # `device` of host memory; ar_comm_device's value on the host backend

_SUPPORTED = "float32, float16 or bfloat16"


@dataclass(frozen=True)
class Buffer:
    ptr: int
    count: int
    dtype: int
    shape: Tuple[int, ...]
    # HOST, or a GPU ordinal; None for a GPU buffer whose ordinal the object does not say
    # (``__cuda_array_interface__`` carries none).
    device: Optional[int]
    writable: bool
    # The stream a call on this buffer defaults to: torch's current stream for a CUDA tensor,
    # the producer's stream of a ``__cuda_array_interface__`` (version 3), else None.
    stream: Optional[int]
    kind: str


def _numpy_dtype(dt: Any) -> Optional[int]:
    if dt.kind == "f" and dt.itemsize == 4:
        return F32
    if dt.kind == "f" and dt.itemsize == 2:
        return F16
    # ml_dtypes' bfloat16 (numpy has none); recognised by name so ml_dtypes is never imported.
    if dt.name == "bfloat16" and dt.itemsize == 2:
        return BF16
    return None


def _from_numpy(x: Any, what: str) -> Buffer:
    code = _numpy_dtype(x.dtype)
    if code is None:
        raise UnsupportedType(
            f"{what} has dtype {x.dtype}; the library sums {_SUPPORTED} (bfloat16 through "
            "ml_dtypes)")
    if x.dtype.byteorder == ">":
        raise UnsupportedType(f"{what} is big-endian ({x.dtype.str}); use native byte order")
    if not x.flags.c_contiguous:
        raise InvalidArgument(
            f"{what} is not C-contiguous (strides {x.strides}); pass "
            "numpy.ascontiguousarray(...) and copy the result back")
    return Buffer(
        ptr=x.__array_interface__["data"][0],
        count=int(x.size),
        dtype=code,
        shape=tuple(x.shape),
        device=HOST,
        writable=bool(x.flags.writeable),
        stream=None,
        kind="numpy.ndarray",
    )


def _from_torch(x: Any, torch: Any, what: str) -> Buffer:
    codes = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
    code = codes.get(x.dtype)
    if code is None:
        raise UnsupportedType(f"{what} has dtype {x.dtype}; the library sums {_SUPPORTED}")
    if not x.is_contiguous():
        raise InvalidArgument(
            f"{what} is not contiguous (strides {tuple(x.stride())}); pass .contiguous() and "
            "copy the result back")
    if x.device.type == "cpu":
        device, stream = HOST, None
    elif x.device.type == "cuda":  # also ROCm builds of torch
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device).cuda_stream
    else:
        raise UnsupportedType(f"{what} is on a {x.device.type} device; the library takes host "
                              "and CUDA/ROCm memory")
    return Buffer(
        ptr=int(x.data_ptr()),
        count=int(x.numel()),
        dtype=code,
        shape=tuple(x.shape),
        device=device,
        # Writing through data_ptr() bypasses autograd; a tensor autograd tracks is refused
        # as torch refuses in-place writes to a leaf that requires grad.
        writable=not (x.requires_grad and torch.is_grad_enabled()),
        stream=stream,
        kind="torch.Tensor",
    )


def _from_cuda_array_interface(x: Any, cai: Any, what: str) -> Buffer:
    typestr = cai.get("typestr", "")
    code = {"<f4": F32, "<f2": F16}.get(typestr)
    if code is None:
        # The interface has no type string for bfloat16.
        raise UnsupportedType(
            f"{what} has type {typestr!r} in __cuda_array_interface__; the library sums <f4 "
            "and <f2 there (pass a torch tensor for bfloat16)")
    if cai.get("mask") is not None:
        raise InvalidArgument(f"{what} is a masked array")
    shape = tuple(int(d) for d in cai["shape"])
    count = 1
    for d in shape:
        count *= d
    strides = cai.get("strides")
    if strides is not None and count > 0:
        expected, step = [], 4 if code == F32 else 2
        for d in reversed(shape):
            expected.append(step)
            step *= d
        if any(s != e for s, e, d in zip(strides, reversed(expected), shape) if d > 1):
            raise InvalidArgument(f"{what} is not C-contiguous (strides {tuple(strides)})")
    ptr, readonly = cai["data"]
    return Buffer(
        ptr=int(ptr or 0),
        count=count,
        dtype=code,
        shape=shape,
        device=None,
        writable=not readonly,
        stream=cai.get("stream"),
        kind=type(x).__name__,
    )


def describe(x: Any, what: str) -> Buffer:
    """The ``Buffer`` of ``x``, or a refusal naming ``what`` (``"x"``, ``"out"``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _from_torch(x, torch, what)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return _from_numpy(x, what)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cuda_array_interface(x, cai, what)
    raise UnsupportedType(
        f"{what} is a {type(x).__module__}.{type(x).__qualname__}; pass a numpy array, a "
        "torch tensor or an object with __cuda_array_interface__")


def stream_handle(stream: Any) -> int:
    """A ``cudaStream_t`` / ``hipStream_t`` as an integer: an int, a torch stream
    (``.cuda_stream``) or a CuPy-style stream (``.ptr``)."""
    if isinstance(stream, bool):
        raise UnsupportedType("stream is a bool; pass an int handle or a stream object")
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return handle
    raise UnsupportedType(
        f"stream is a {type(stream).__qualname__}; pass an int handle or an object with "
        ".cuda_stream or .ptr")
