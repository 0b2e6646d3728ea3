"""``FusedWorkspace`` and the fused all-reduce + residual add + RMSNorm (+ FP8) call over
``ar_fused_workspace_create`` / ``ar_fused_workspace_destroy`` / ``ar_all_reduce_fused``, with
FlashInfer's argument names (``trtllm_allreduce_fusion``).

``Communicator.all_reduce_fused`` is the entry point; it calls :func:`all_reduce_fused` here.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import weakref
from typing import Any, Dict, List, Sequence, Tuple

from . import _buffers, _errors, _lib
from ._buffers import F32
from ._comm import STRATEGIES, Communicator, _name_to_code
from ._errors import InvalidArgument, InvalidUsage, UnsupportedType
from ._handle import Handle

# `ar_fused_pattern_t`, by the names the library's Rust API gives them (FlashInfer's
# `AllReduceFusionPattern` 0 to 3: kAllReduce, kARResidualRMSNorm, then the FP8 quantizations
# with per-token and with static scales).
FUSED_PATTERNS = {"allreduce": 0, "residual_rmsnorm": 1, "residual_rmsnorm_fp8": 2,
                  "residual_rmsnorm_fp8_static": 3}

# What each pattern needs besides `x`, by this binding's argument names. `allreduce_out` is
# not among them: pattern allreduce without it sums into `x`, as `all_reduce` does.
_NEEDS = {
    "allreduce": (),
    "residual_rmsnorm": ("rms_gamma", "norm_out"),
    "residual_rmsnorm_fp8": ("rms_gamma", "quant_out", "scale_out"),
    "residual_rmsnorm_fp8_static": ("rms_gamma", "quant_out", "static_scale"),
}
# What each pattern takes at all: anything else given is refused rather than ignored, as the
# library refuses an output its pattern does not write (a caller who passes it expects it to be
# read or written).
_TAKES = {
    "allreduce": ("allreduce_out",),
    "residual_rmsnorm": ("allreduce_out", "residual_in", "residual_out", "rms_gamma",
                         "norm_out"),
    "residual_rmsnorm_fp8": ("allreduce_out", "residual_in", "residual_out", "rms_gamma",
                             "norm_out", "quant_out", "scale_out"),
    "residual_rmsnorm_fp8_static": ("allreduce_out", "residual_in", "residual_out",
                                    "rms_gamma", "norm_out", "quant_out", "static_scale"),
}

_UINT_MAX = 2**64 - 1


def _size_arg(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedType(f"{what} is a {type(value).__qualname__}; pass an int")
    # A negative int would wrap around in size_t; zero is refused by the library.
    if not 0 <= value <= _UINT_MAX:
        raise _errors.InvalidConfig(f"{what} {value} must be a positive int")
    return value


# Open workspaces by key, for the torch op (which takes ints, not objects).
_OPEN_WORKSPACES: "weakref.WeakValueDictionary[int, FusedWorkspace]" = (
    weakref.WeakValueDictionary())


def lookup_workspace(key: Any) -> "FusedWorkspace":
    """The open workspace whose ``key`` this is; ``InvalidUsage`` if there is none."""
    ws = _OPEN_WORKSPACES.get(key) if isinstance(key, int) else None
    if ws is None or ws.closed:
        raise InvalidUsage(f"no open fused workspace has key {key!r}")
    return ws


class FusedWorkspace(Handle):
    """One rank's workspace for the fused call (FlashInfer's
    ``trtllm_create_ipc_workspace_for_all_reduce_fusion``): calls of up to ``max_tokens``
    rows of ``hidden`` elements of ``dtype``. Build every rank's with :meth:`group`.

    Attributes, fixed for its life: ``rank``, ``world_size``, ``max_tokens``, ``hidden``,
    ``dtype`` (``"float32"``, ``"float16"`` or ``"bfloat16"``).

    ``close()`` releases it (idempotent; also a context manager and on garbage collection).
    A call running with it on another thread completes first; on a GPU, synchronize the
    streams of its calls before closing. Closing it and its communicator may happen in
    either order.
    """

    def __init__(self, handle: int, rank: int, world_size: int, max_tokens: int, hidden: int,
                 dtype: int):
        # Built by `group`; the handle is the library's token for this rank's workspace.
        super().__init__(handle)
        self._dtype = dtype
        self.rank = rank
        self.world_size = world_size
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = _buffers.DTYPE_NAMES[dtype]
        # The library's token, as `Communicator.key`: what the torch op names it by.
        self.key = int(handle)
        _OPEN_WORKSPACES[self.key] = self

    @classmethod
    def group(cls, comms: Sequence[Communicator], max_tokens: int, hidden: int,
              dtype: Any) -> List["FusedWorkspace"]:
        """One workspace per rank of an in-process group (``ar_fused_workspace_create``), in
        rank order. ``comms``: every rank's communicator, in rank order, as
        ``Communicator.group`` returned them (groups of one process per rank have no fused
        workspace: ``InvalidConfig``).

        ``max_tokens``: the most rows a call carries. ``hidden``: elements per row, a whole
        number of 16-byte vectors (a multiple of 4 for float32, 8 for 16-bit dtypes) of at
        most 32 KiB. ``dtype``: ``"float32"``, ``"float16"``, ``"bfloat16"``, a numpy dtype
        (bfloat16 through ml_dtypes) or a torch dtype. Sizes the library refuses raise
        ``InvalidConfig``; nothing is built then.

        Collective, like the C call: no rank of the group may be in a call meanwhile (one
        that is, on another thread, makes this raise ``InvalidUsage``).
        """
        code = _buffers.dtype_code(dtype)
        max_tokens = _size_arg(max_tokens, "max_tokens")
        hidden = _size_arg(hidden, "hidden")
        comms = list(comms)
        if not comms:
            raise _errors.InvalidConfig("no communicators: pass every rank's, in rank order")
        for r, c in enumerate(comms):
            if not isinstance(c, Communicator):
                raise UnsupportedType(
                    f"comms[{r}] is a {type(c).__qualname__}; pass allreduce.Communicator "
                    "objects")
        # The C call requires that no rank be in a call; the ranks' own locks make a Python
        # caller that breaks this fail here rather than race in the library.
        held: List[Communicator] = []
        try:
            for c in comms:
                if not c._busy.acquire(blocking=False):
                    raise InvalidUsage(
                        f"rank {c.rank} is in a call on another thread; a fused workspace is "
                        "created while no rank of the group is in a call")
                held.append(c)
            handles = (_lib.Handle * len(comms))(*(c._live_handle() for c in comms))
            out = (_lib.FusedHandle * len(comms))()
            lib = _lib.lib()
            _lib.check(lib.ar_fused_workspace_create(out, handles, len(comms), max_tokens,
                                                     hidden, code))
        finally:
            for c in held:
                c._busy.release()
        return [cls(h, r, len(comms), max_tokens, hidden, code) for r, h in enumerate(out)]

    def _live_handle(self) -> int:
        handle = self._handle
        if handle is None:
            raise InvalidUsage("this fused workspace is closed")
        return handle

    _DESTROY = "ar_fused_workspace_destroy"

    def close(self) -> None:
        """Release this rank's workspace (``ar_fused_workspace_destroy``); later calls with
        it raise ``InvalidUsage``. Idempotent."""
        self._release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.max_tokens} x {self.hidden} {self.dtype}"
        return f"<allreduce.FusedWorkspace rank {self.rank}/{self.world_size} {state}>"


def infer_pattern(given: Dict[str, bool]) -> str:
    """The pattern FlashInfer's callers mean by the arguments they pass: FP8 when a
    quantized output or a scale is given (static with ``static_scale``, per token
    otherwise), else residual + RMSNorm when any of its buffers is given, else the
    all-reduce alone."""
    if given["scale_out"] and given["static_scale"]:
        raise InvalidArgument(
            "scale_out (per-token scales, pattern residual_rmsnorm_fp8) and static_scale "
            "(pattern residual_rmsnorm_fp8_static) exclude each other")
    if given["static_scale"]:
        return "residual_rmsnorm_fp8_static"
    if given["quant_out"] or given["scale_out"]:
        return "residual_rmsnorm_fp8"
    if any(given[k] for k in ("residual_in", "residual_out", "norm_out", "rms_gamma")):
        return "residual_rmsnorm"
    return "allreduce"


def _resolve_pattern(pattern: Any, given: Dict[str, bool]) -> str:
    if pattern is None:
        name, how = infer_pattern(given), " (inferred from the arguments given)"
    else:
        if not (isinstance(pattern, str) and pattern.lower() in FUSED_PATTERNS):
            raise InvalidArgument(
                f"pattern {pattern!r} is not one of {', '.join(FUSED_PATTERNS)}")
        name, how = pattern.lower(), ""
    for need in _NEEDS[name]:
        if not given[need]:
            raise InvalidArgument(f"pattern {name}{how} needs {need}")
    for arg, present in given.items():
        if present and arg not in _TAKES[name]:
            raise InvalidArgument(f"pattern {name}{how} takes no {arg}")
    return name


def _strategy(use_oneshot: Any) -> int:
    if use_oneshot is None:
        return STRATEGIES["auto"]
    if not isinstance(use_oneshot, bool):
        raise UnsupportedType(
            f"use_oneshot is a {type(use_oneshot).__qualname__}; pass True, False or None")
    return _name_to_code(STRATEGIES, "oneshot" if use_oneshot else "twoshot", "strategy")


def _weight_bias(weight_bias: Any) -> float:
    if isinstance(weight_bias, bool) or not isinstance(weight_bias, numbers.Real):
        raise UnsupportedType(
            f"weight_bias is a {type(weight_bias).__qualname__}; pass a float")
    if not math.isfinite(weight_bias):
        raise InvalidArgument(f"weight_bias must be finite, not {weight_bias!r}")
    return float(weight_bias)


def _eps(rms_eps: Any) -> float:
    if rms_eps is None:
        return 1e-6
    if isinstance(rms_eps, bool):
        raise UnsupportedType("rms_eps is a bool; pass a float")
    try:
        eps = float(rms_eps)
    except (TypeError, ValueError):
        raise UnsupportedType(
            f"rms_eps is a {type(rms_eps).__qualname__}; pass a float") from None
    if not (math.isfinite(eps) and eps >= 0):
        raise InvalidArgument(f"rms_eps must be finite and non-negative, not {rms_eps!r}")
    return eps


class _Call:
    """One call's buffers, checked against the workspace and the communicator."""

    def __init__(self, comm: Communicator, ws: FusedWorkspace):
        self.comm, self.ws = comm, ws

    def rows(self, value: Any, what: str, shape: Tuple[int, ...], write: bool) -> int:
        buf = _buffers.describe(value, what)
        self.comm._check_device(buf, what)
        if buf.dtype != self.ws._dtype:
            raise _errors.DTypeMismatch(
                f"{what} is {_buffers.DTYPE_NAMES[buf.dtype]}; the fused workspace is for "
                f"{self.ws.dtype}")
        if buf.shape != shape:
            raise InvalidArgument(f"{what} has shape {buf.shape}, expected {shape}")
        if write and not buf.writable:
            raise InvalidArgument(f"{what} is read-only")
        return buf.ptr

    def codes(self, value: Any, tokens: int) -> int:
        buf = _buffers.describe(value, "quant_out", codes=True)
        self.comm._check_device(buf, "quant_out")
        want = tokens * self.ws.hidden
        if buf.count != want:
            raise InvalidArgument(
                f"quant_out has {buf.count} elements, expected {want} ({tokens} tokens x hidden "
                f"{self.ws.hidden}, one FP8 code each)")
        if not buf.writable:
            raise InvalidArgument("quant_out is read-only")
        return buf.ptr

    def floats(self, value: Any, what: str, count: int, write: bool) -> int:
        buf = _buffers.describe(value, what)
        self.comm._check_device(buf, what)
        if buf.dtype != F32:
            raise _errors.DTypeMismatch(
                f"{what} is {_buffers.DTYPE_NAMES[buf.dtype]}; it holds float32")
        if buf.count != count:
            raise InvalidArgument(f"{what} has {buf.count} elements, expected {count}")
        if write and not buf.writable:
            raise InvalidArgument(f"{what} is read-only")
        return buf.ptr


def all_reduce_fused(comm: Communicator, ws: Any, x: Any, residual_in: Any, residual_out: Any,
                     norm_out: Any, quant_out: Any, scale_out: Any, rms_gamma: Any,
                     rms_eps: Any, pattern: Any, allreduce_out: Any, use_oneshot: Any,
                     static_scale: Any, stream: Any, weight_bias: Any = 0.0) -> None:
    """``Communicator.all_reduce_fused``'s body (documented there)."""
    handle = comm._live_handle()
    if not isinstance(ws, FusedWorkspace):
        raise UnsupportedType(
            f"ws is a {type(ws).__qualname__}; pass this rank's allreduce.FusedWorkspace")
    ws_handle = ws._live_handle()
    if not comm._busy.acquire(blocking=False):
        raise InvalidUsage(
            f"rank {comm.rank} is already in a call on another thread; drive each "
            "communicator from one thread at a time")
    try:
        stream_value = None
        try:
            given = {
                "allreduce_out": allreduce_out is not None,
                "residual_in": residual_in is not None,
                "residual_out": residual_out is not None,
                "rms_gamma": rms_gamma is not None,
                "norm_out": norm_out is not None,
                "quant_out": quant_out is not None,
                "scale_out": scale_out is not None,
                "static_scale": static_scale is not None,
            }
            name = _resolve_pattern(pattern, given)
            strategy = _strategy(use_oneshot)
            eps = _eps(rms_eps)
            bias = _weight_bias(weight_bias)
            if residual_out is not None and residual_in is None:
                raise InvalidArgument(
                    "residual_out needs residual_in (without a residual the norm is of the "
                    "all-reduce output, which allreduce_out holds)")
            if bias != 0.0 and name == "allreduce":
                raise InvalidArgument("pattern allreduce has no norm for a weight_bias")

            call = _Call(comm, ws)
            src = _buffers.describe(x, "x")
            comm._check_device(src, "x")
            if src.dtype != ws._dtype:
                raise _errors.DTypeMismatch(
                    f"x is {_buffers.DTYPE_NAMES[src.dtype]}; the fused workspace is for "
                    f"{ws.dtype}")
            if len(src.shape) != 2 or src.shape[1] != ws.hidden:
                raise InvalidArgument(
                    f"x has shape {src.shape}; expected (tokens, {ws.hidden}), the workspace's "
                    "hidden")
            tokens = src.shape[0]
            if tokens > ws.max_tokens:
                raise _errors.WorkspaceExceeded(
                    f"tokens {tokens} is over the workspace's max_tokens {ws.max_tokens}")
            stream_value = comm._resolve_stream(stream, src.stream)

            args = _lib.FusedArgs(size=ctypes.sizeof(_lib.FusedArgs), pattern=FUSED_PATTERNS[name],
                                  strategy=strategy, tokens=tokens, eps=eps, weight_bias=bias)
            args.input = src.ptr
            if allreduce_out is not None:
                args.allreduce_out = call.rows(allreduce_out, "allreduce_out", src.shape, True)
            elif name == "allreduce":
                # In place, as `all_reduce(x)`: the library takes allreduce_out = input.
                if not src.writable:
                    raise InvalidArgument(
                        "x is read-only; pattern allreduce without allreduce_out sums into x")
                args.allreduce_out = src.ptr
            if residual_in is not None:
                args.residual_in = call.rows(residual_in, "residual_in", src.shape, False)
            if residual_out is not None:
                args.residual_out = call.rows(residual_out, "residual_out", src.shape, True)
            if rms_gamma is not None:
                args.gamma = call.rows(rms_gamma, "rms_gamma", (ws.hidden,), False)
            if norm_out is not None:
                args.norm_out = call.rows(norm_out, "norm_out", src.shape, True)
            if quant_out is not None:
                args.quant_out = call.codes(quant_out, tokens)
            if scale_out is not None:
                args.scale_out = call.floats(scale_out, "scale_out", tokens, True)
            # A number's float, alive (a local) until the call has returned: the host backend reads
            # it during the call.
            scale_holder = None
            if static_scale is not None:
                if isinstance(static_scale, numbers.Real) and not isinstance(static_scale, bool):
                    if comm.backend != "host":
                        # The library reads the scale on the device when the call runs: a host
                        # float's address would be dereferenced there.
                        raise InvalidArgument(
                            "static_scale as a number is taken on the host backend only; pass a "
                            "one-element float32 tensor on this rank's device")
                    scale_holder = ctypes.c_float(static_scale)
                    args.scale_in = ctypes.addressof(scale_holder)
                else:
                    args.scale_in = call.floats(static_scale, "static_scale", 1, False)
        except _errors.Error as e:
            # A refusal of the binding's own: tell the peers as the library tells them of the
            # refusals it finds itself, so their matching fused call raises PeerRejected with
            # this message instead of waiting for the deadline.
            _lib.lib().ar_fused_reject(e.message.encode(), ws_handle, handle, stream_value)
            raise
        _lib.check(_lib.lib().ar_all_reduce_fused(ctypes.byref(args), ws_handle, handle,
                                                  stream_value))
    finally:
        comm._busy.release()
