"""Finding and loading ``liballreduce_c``, and the ctypes prototype of every function used.

The library is loaded on first use, not at import: ``import allreduce`` must work on a machine
without the library (to read docstrings, to build the package, to report what is missing) and
the failure must name the paths it tried.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path
from typing import List, Optional, Tuple

from . import _errors

# The `AR_VERSION_CODE` of the header these prototypes were written from. A library built
# from another version may lay out `ar_config_t` differently or take other arguments, which
# ctypes cannot detect: such a library is passed over, not called.
VERSION_CODE = 100

ENV_VAR = "ALLREDUCE_LIB"

if sys.platform == "darwin":
    LIB_NAME = "liballreduce_c.dylib"
elif sys.platform == "win32":
    LIB_NAME = "allreduce_c.dll"
else:
    LIB_NAME = "liballreduce_c.so"


# The deadline of every wait for a peer when a group is built with ``timeout=None``, in
# seconds: the header's AR_DEFAULT_TIMEOUT_MS, the library's one default (tests/test_errors.py
# holds the two equal).
DEFAULT_TIMEOUT_S = 60.0


class Config(ctypes.Structure):
    """``ar_config_t``: its first field is its own size, which the library checks."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("max_bytes", ctypes.c_size_t),
        ("timeout_ms", ctypes.c_uint32),
    ]


class FusedArgs(ctypes.Structure):
    """``ar_fused_args_t``: buffers are addresses (None for absent); ``size`` is checked by
    the library as ``ar_config_t``'s is."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("pattern", ctypes.c_int),
        ("strategy", ctypes.c_int),
        ("tokens", ctypes.c_size_t),
        ("input", ctypes.c_void_p),
        ("allreduce_out", ctypes.c_void_p),
        ("residual_in", ctypes.c_void_p),
        ("residual_out", ctypes.c_void_p),
        ("gamma", ctypes.c_void_p),
        ("norm_out", ctypes.c_void_p),
        ("quant_out", ctypes.c_void_p),
        ("scale_out", ctypes.c_void_p),
        ("scale_in", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("weight_bias", ctypes.c_float),
    ]


# The header's `AR_UNIQUE_ID_BYTES`; tests/test_errors.py checks it.
UNIQUE_ID_BYTES = 128


class UniqueId(ctypes.Structure):
    """``ar_unique_id_t``: opaque bytes, passed by value to ``ar_comm_init_rank``."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


Handle = ctypes.c_void_p  # ar_comm_t: an opaque token, never dereferenced
FusedHandle = ctypes.c_void_p  # ar_fused_workspace_t: the same
_int_p = ctypes.POINTER(ctypes.c_int)
_size_p = ctypes.POINTER(ctypes.c_size_t)

# name: (restype, argtypes), from crates/capi/include/allreduce.h.
PROTOTYPES = {
    "ar_get_version": (ctypes.c_int, [_int_p]),
    "ar_get_error_string": (ctypes.c_char_p, [ctypes.c_int]),
    "ar_last_error": (ctypes.c_char_p, []),
    "ar_all_reduce": (ctypes.c_int, [
        ctypes.c_void_p,  # sendbuff
        ctypes.c_void_p,  # recvbuff
        ctypes.c_size_t,  # count
        ctypes.c_int,  # dtype
        ctypes.c_int,  # op
        ctypes.c_int,  # precision
        ctypes.c_int,  # strategy
        Handle,  # comm
        ctypes.c_void_p,  # stream
    ]),
    "ar_reject": (ctypes.c_int, [
        Handle,  # comm
        ctypes.c_int,  # code
        ctypes.c_char_p,  # message
        ctypes.c_void_p,  # stream
    ]),
    "ar_comm_init_all": (ctypes.c_int, [
        ctypes.POINTER(Handle), ctypes.c_int, ctypes.c_int, _int_p, ctypes.POINTER(Config),
    ]),
    "ar_get_unique_id": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    "ar_comm_init_rank": (ctypes.c_int, [
        ctypes.POINTER(Handle),  # comm
        ctypes.c_int,  # backend
        ctypes.c_int,  # nranks
        UniqueId,  # id, by value
        ctypes.c_int,  # rank
        ctypes.c_int,  # device
        ctypes.POINTER(Config),
    ]),
    "ar_comm_init_env": (ctypes.c_int, [
        ctypes.POINTER(Handle), ctypes.c_int, ctypes.c_int, ctypes.POINTER(Config),
    ]),
    "ar_comm_destroy": (ctypes.c_int, [Handle]),
    "ar_comm_synchronize": (ctypes.c_int, [Handle, ctypes.c_void_p]),
    "ar_comm_set_graph_registration": (ctypes.c_int, [Handle, ctypes.c_int]),
    "ar_comm_register": (ctypes.c_int, [
        ctypes.POINTER(Handle), ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_uint64),
    ]),
    "ar_comm_deregister": (ctypes.c_int, [ctypes.POINTER(Handle), ctypes.c_int, ctypes.c_uint64]),
    "ar_comm_register_graph_buffers": (ctypes.c_int, [
        ctypes.POINTER(Handle), ctypes.c_int, _size_p,
    ]),
    "ar_comm_count": (ctypes.c_int, [Handle, _int_p]),
    "ar_comm_user_rank": (ctypes.c_int, [Handle, _int_p]),
    "ar_comm_device": (ctypes.c_int, [Handle, _int_p]),
    "ar_comm_backend": (ctypes.c_int, [Handle, _int_p]),
    "ar_comm_alignment": (ctypes.c_int, [Handle, _size_p]),
    "ar_comm_max_bytes": (ctypes.c_int, [Handle, _size_p]),
    "ar_comm_abort": (ctypes.c_int, [Handle]),
    "ar_comm_vendor_window": (ctypes.c_int, [Handle, ctypes.POINTER(ctypes.c_void_p), _size_p]),
    "ar_fused_workspace_create": (ctypes.c_int, [
        ctypes.POINTER(FusedHandle),  # workspaces
        ctypes.POINTER(Handle),  # comms
        ctypes.c_int,  # nranks
        ctypes.c_size_t,  # max_tokens
        ctypes.c_size_t,  # hidden
        ctypes.c_int,  # dtype
    ]),
    "ar_fused_workspace_destroy": (ctypes.c_int, [FusedHandle]),
    "ar_all_reduce_fused": (ctypes.c_int, [
        ctypes.POINTER(FusedArgs), FusedHandle, Handle, ctypes.c_void_p,
    ]),
    "ar_fused_reject": (ctypes.c_int, [ctypes.c_void_p, FusedHandle, Handle, ctypes.c_void_p]),
}


def candidates() -> List[Path]:
    """Where the library is looked for, in order: ``$ALLREDUCE_LIB`` alone when it is set
    (an explicit choice that fails is an error, not a cue to load some other build), else a
    copy inside this package, then the repository's ``target/release`` and ``target/debug``
    (for a checkout whose package is installed in editable mode or run from source)."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return [Path(explicit)]
    here = Path(__file__).resolve().parent
    repo = here.parent.parent
    return [
        here / LIB_NAME,
        repo / "target" / "release" / LIB_NAME,
        repo / "target" / "debug" / LIB_NAME,
    ]


class _Loaded:
    def __init__(self) -> None:
        self.lib: Optional[ctypes.CDLL] = None
        self.path: Optional[Path] = None
        self.lock = threading.Lock()


_state = _Loaded()


def _open(path: Path) -> Tuple[Optional[ctypes.CDLL], str]:
    if not path.is_file():
        return None, "no such file"
    try:
        # CDLL, not PyDLL: ctypes releases the GIL around each call, so ranks driven from
        # threads of one process can block in ar_all_reduce at the same time.
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"could not be loaded: {e}"
    try:
        for name, (restype, argtypes) in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
    except AttributeError as e:
        return None, f"not this library (missing a symbol: {e})"
    version = ctypes.c_int(0)
    if lib.ar_get_version(ctypes.byref(version)) != 0 or version.value != VERSION_CODE:
        return None, (f"version {version.value}, but this package speaks the C ABI of version "
                      f"{VERSION_CODE}")
    return lib, ""


def lib() -> ctypes.CDLL:
    """The loaded library; loads it on the first call. Raises ``LibraryNotFound``."""
    loaded = _state.lib
    if loaded is not None:
        return loaded
    with _state.lock:
        if _state.lib is None:
            tried = []
            for path in candidates():
                found, why = _open(path)
                if found is not None:
                    _state.lib, _state.path = found, path
                    break
                tried.append((str(path), why))
            else:
                raise _errors.LibraryNotFound(tried)
        return _state.lib


def path() -> Path:
    """The path of the loaded library (loading it if needed)."""
    lib()
    assert _state.path is not None
    return _state.path


def last_error() -> str:
    """This thread's last failure message from the library."""
    raw = lib().ar_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def check(code: int) -> None:
    """Raise the exception for a non-zero ``ar_result_t``, with this thread's message. Must
    run on the thread that made the failing call: the message is per thread."""
    if code != 0:
        raise _errors.from_code(code, last_error())


def version() -> int:
    """The loaded library's version code, ``major * 10000 + minor * 100 + patch``."""
    v = ctypes.c_int(0)
    check(lib().ar_get_version(ctypes.byref(v)))
    return v.value
