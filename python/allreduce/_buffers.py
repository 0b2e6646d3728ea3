"""Turning the caller's array into what ``ar_all_reduce`` and ``ar_all_reduce_fused`` take:
an address, an element count, a dtype code, where the memory lives, and the stream a call on it
defaults to.

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
# ncclUint8's value: the fused call's FP8 E4M3 codes (``quant_out``), one byte each. Never a
# dtype the library sums; only `describe(..., codes=True)` gives it.
U8 = 1
DTYPE_NAMES = {F16: "float16", F32: "float32", BF16: "bfloat16", U8: "uint8"}
ITEMSIZE = {F16: 2, F32: 4, BF16: 2, U8: 1}

HOST = -1  # `device` of host memory; ar_comm_device's value on the host backend

_SUPPORTED = "float32, float16 or bfloat16"
_CODES = "uint8 or float8_e4m3fn (one FP8 E4M3 code per element)"


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


def _numpy_codes(dt: Any) -> Optional[int]:
    # ml_dtypes' float8_e4m3fn by name, as bfloat16 above.
    if dt.itemsize == 1 and (dt.kind == "u" or dt.name == "float8_e4m3fn"):
        return U8
    return None


def _from_numpy(x: Any, what: str, codes: bool = False) -> Buffer:
    code = _numpy_codes(x.dtype) if codes else _numpy_dtype(x.dtype)
    if code is None:
        raise UnsupportedType(
            f"{what} has dtype {x.dtype}; it must be {_CODES}" if codes else
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


def _torch_codes(torch: Any) -> dict:
    # float8_e4m3fn is missing from older torch builds.
    table = {getattr(torch, "uint8", None): U8, getattr(torch, "float8_e4m3fn", None): U8}
    table.pop(None, None)
    return table


def _from_torch(x: Any, torch: Any, what: str, codes: bool = False) -> Buffer:
    if codes:
        code = _torch_codes(torch).get(x.dtype)
        if code is None:
            raise UnsupportedType(f"{what} has dtype {x.dtype}; it must be {_CODES}")
    else:
        code = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}.get(x.dtype)
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


def _from_cuda_array_interface(x: Any, cai: Any, what: str, codes: bool = False) -> Buffer:
    typestr = cai.get("typestr", "")
    if codes:
        code = {"|u1": U8}.get(typestr)
        if code is None:
            raise UnsupportedType(
                f"{what} has type {typestr!r} in __cuda_array_interface__; FP8 codes are |u1")
    else:
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
        expected, step = [], ITEMSIZE[code]
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


def describe(x: Any, what: str, codes: bool = False) -> Buffer:
    """The ``Buffer`` of ``x``, or a refusal naming ``what`` (``"x"``, ``"out"``). ``codes``:
    ``x`` holds FP8 E4M3 codes (the fused call's ``quant_out``), one byte each, rather than
    elements the library sums."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _from_torch(x, torch, what, codes)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return _from_numpy(x, what, codes)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cuda_array_interface(x, cai, what, codes)
    raise UnsupportedType(
        f"{what} is a {type(x).__module__}.{type(x).__qualname__}; pass a numpy array, a "
        "torch tensor or an object with __cuda_array_interface__")


_DTYPE_BY_NAME = {"float32": F32, "float16": F16, "bfloat16": BF16}


def dtype_code(dtype: Any, what: str = "dtype") -> int:
    """The ``ar_dtype_t`` of a dtype given as a name (``"float32"``, ``"float16"``,
    ``"bfloat16"``), a numpy dtype or type (bfloat16 through ml_dtypes) or a torch dtype."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_BY_NAME:
        return _DTYPE_BY_NAME[dtype.lower()]
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            code = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}.get(dtype)
        except TypeError:  # unhashable: not a torch dtype
            code = None
        if code is not None:
            return code
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is not None and dt.byteorder != ">":
            code = _numpy_dtype(dt)
            if code is not None:
                return code
    raise UnsupportedType(
        f"{what} {dtype!r} is not {_SUPPORTED} (a name, a numpy dtype or a torch dtype)")


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
