"""The exceptions: one class per `ar_result_t` code, so Python callers branch on what C
callers branch on, plus `LibraryNotFound`, which no C call can return."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Type


class Error(Exception):
    """Base of every error this package raises about a call.

    ``code`` is the ``ar_result_t`` value, ``code_name`` its header name (``"AR_TIMEOUT"``) and
    ``message`` the library's ``ar_last_error()`` text (or the binding's own, for arguments it
    refused before calling C). ``rebuild`` is true for the codes after which the header says
    to destroy every rank's communicator and build the group anew; otherwise the group is
    intact and the next valid call is exact.
    """

    code_name = "AR_INTERNAL_ERROR"
    rebuild = False

    def __init__(self, message: str, code: Optional[int] = None,
                 code_name: Optional[str] = None):
        if code_name is not None:
            self.code_name = code_name
        self.code = CODES.get(self.code_name) if code is None else code
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


class InvalidArgument(Error, ValueError):
    """The library or the binding refused an argument (``AR_INVALID_ARGUMENT``)."""
    code_name = "AR_INVALID_ARGUMENT"


class UnsupportedType(InvalidArgument, TypeError):
    """An object that is no supported array, or an array of a dtype the library does not
    sum (f32, f16 and bf16 only). Refused by the binding with ``AR_INVALID_ARGUMENT``'s code;
    also a ``TypeError``."""


class LengthMismatch(InvalidArgument):
    """Input and output lengths differ (``AR_LENGTH_MISMATCH``)."""
    code_name = "AR_LENGTH_MISMATCH"


class DTypeMismatch(InvalidArgument):
    """Input and output dtypes differ (``AR_DTYPE_MISMATCH``)."""
    code_name = "AR_DTYPE_MISMATCH"


class TooLarge(InvalidArgument):
    """The call is larger than the communicator's ``max_bytes`` on a backend that does not
    split calls (``AR_TOO_LARGE``)."""
    code_name = "AR_TOO_LARGE"


class Misaligned(InvalidArgument):
    """A buffer address is not aligned to ``comm.alignment`` bytes (``AR_MISALIGNED``)."""
    code_name = "AR_MISALIGNED"


class WrongDevice(InvalidArgument):
    """A buffer lives on another device than the communicator (``AR_WRONG_DEVICE``)."""
    code_name = "AR_WRONG_DEVICE"


class UnsupportedCodec(InvalidArgument):
    """The precision's codec does not take this dtype (``AR_UNSUPPORTED_CODEC``)."""
    code_name = "AR_UNSUPPORTED_CODEC"


class StrategyUnavailable(Error):
    """The requested strategy cannot run here (``AR_STRATEGY_UNAVAILABLE``)."""
    code_name = "AR_STRATEGY_UNAVAILABLE"


class RankMismatch(Error):
    """The ranks entered the same call with different arguments; nothing was written
    (``AR_RANK_MISMATCH``)."""
    code_name = "AR_RANK_MISMATCH"


class PeerRejected(Error):
    """Another rank refused its own arguments, so this rank's call was abandoned before any
    data moved (``AR_PEER_REJECTED``)."""
    code_name = "AR_PEER_REJECTED"


class Timeout(Error):
    """A peer did not arrive before the deadline (``AR_TIMEOUT``): rebuild the group."""
    code_name = "AR_TIMEOUT"
    rebuild = True


class Aborted(Error):
    """The group is unusable after an earlier failure (``AR_ABORTED``): rebuild it."""
    code_name = "AR_ABORTED"
    rebuild = True


class InvalidConfig(Error, ValueError):
    """A group or workspace configuration was refused; nothing was built
    (``AR_INVALID_CONFIG``)."""
    code_name = "AR_INVALID_CONFIG"


class WorkspaceExceeded(Error):
    """A fused call asked for more than its workspace holds (``AR_WORKSPACE_EXCEEDED``)."""
    code_name = "AR_WORKSPACE_EXCEEDED"


class LibraryUnavailable(Error):
    """A driver or vendor library (libcuda, NCCL, HIP, RCCL) could not be loaded
    (``AR_LIBRARY_UNAVAILABLE``)."""
    code_name = "AR_LIBRARY_UNAVAILABLE"


class Unsupported(Error):
    """The backend or device lacks an optional capability (``AR_UNSUPPORTED``)."""
    code_name = "AR_UNSUPPORTED"


class BackendNotBuilt(Error):
    """The backend is not compiled into the loaded library (``AR_BACKEND_NOT_BUILT``):
    build it with ``--features cuda`` or ``--features rocm``."""
    code_name = "AR_BACKEND_NOT_BUILT"


class DeviceError(Error):
    """The device runtime or vendor library returned an error (``AR_DEVICE_ERROR``):
    rebuild the group."""
    code_name = "AR_DEVICE_ERROR"
    rebuild = True


class BootstrapError(Error):
    """The multi-process rendezvous failed (``AR_BOOTSTRAP_ERROR``)."""
    code_name = "AR_BOOTSTRAP_ERROR"
    rebuild = True


class InvalidUsage(Error):
    """The call reached no communicator: a closed communicator, or a malformed call
    (``AR_INVALID_USAGE``)."""
    code_name = "AR_INVALID_USAGE"


class InternalError(Error):
    """A bug in the library, or a code this package does not know (``AR_INTERNAL_ERROR``):
    rebuild the group."""
    code_name = "AR_INTERNAL_ERROR"
    rebuild = True


class LibraryNotFound(Error):
    """No loadable ``liballreduce_c`` was found. ``tried`` lists each path with the reason it
    was passed over. Raised by the first call that needs the library, never by ``import``."""
    code_name = "AR_LIBRARY_UNAVAILABLE"

    def __init__(self, tried: Sequence[Tuple[str, str]]):
        self.tried = list(tried)
        lines = "\n".join(f"  {path}: {why}" for path, why in self.tried)
        super().__init__(
            "liballreduce_c was not found or could not be loaded; tried, in order:\n"
            f"{lines}\n"
            "Build it with `cargo build --release -p allreduce-capi` (add `--features cuda` "
            "for NVIDIA) and set ALLREDUCE_LIB to the built library's path.")


# The header's `ar_result_t`, value for value. tests/test_errors.py checks this table against
# crates/capi/include/allreduce.h, so a code added there without a class here fails CI.
CODES: Dict[str, int] = {
    "AR_SUCCESS": 0,
    "AR_LENGTH_MISMATCH": 1,
    "AR_DTYPE_MISMATCH": 2,
    "AR_TOO_LARGE": 3,
    "AR_MISALIGNED": 4,
    "AR_WRONG_DEVICE": 5,
    "AR_UNSUPPORTED_CODEC": 6,
    "AR_STRATEGY_UNAVAILABLE": 7,
    "AR_RANK_MISMATCH": 8,
    "AR_PEER_REJECTED": 9,
    "AR_TIMEOUT": 10,
    "AR_ABORTED": 11,
    "AR_INVALID_CONFIG": 12,
    "AR_WORKSPACE_EXCEEDED": 13,
    "AR_INVALID_ARGUMENT": 14,
    "AR_LIBRARY_UNAVAILABLE": 15,
    "AR_UNSUPPORTED": 16,
    "AR_BACKEND_NOT_BUILT": 17,
    "AR_DEVICE_ERROR": 18,
    "AR_BOOTSTRAP_ERROR": 19,
    "AR_INVALID_USAGE": 20,
    "AR_INTERNAL_ERROR": 21,
}

# Every failure code's class. `UnsupportedType` and `LibraryNotFound` are raised by the binding
# itself and are not the class of any code.
CLASSES: Dict[str, Type[Error]] = {
    cls.code_name: cls
    for cls in (
        LengthMismatch, DTypeMismatch, TooLarge, Misaligned, WrongDevice, UnsupportedCodec,
        StrategyUnavailable, RankMismatch, PeerRejected, Timeout, Aborted, InvalidConfig,
        WorkspaceExceeded, InvalidArgument, LibraryUnavailable, Unsupported, BackendNotBuilt,
        DeviceError, BootstrapError, InvalidUsage, InternalError,
    )
}

_NAMES = {value: name for name, value in CODES.items()}


def from_code(code: int, message: str) -> Error:
    """The exception for a non-zero ``ar_result_t``. A code this package does not know (a
    newer library) is an ``InternalError`` that keeps the number, never a silent success."""
    name = _NAMES.get(code)
    if name is None or name == "AR_SUCCESS":
        return InternalError(f"unknown result code {code}: {message}", code=code,
                             code_name=f"AR_UNKNOWN_{code}")
    return CLASSES[name](message, code=code)
