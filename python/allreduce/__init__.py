"""allreduce: one vendor-neutral all-reduce for tensor-parallel LLM inference, from Python.

A ctypes binding of the C ABI (``liballreduce_c``, header ``crates/capi/include/allreduce.h``);
no compiled extension. NCCL-shaped, as vLLM's communicators are::

    import numpy as np, allreduce
    from concurrent.futures import ThreadPoolExecutor
    comms = allreduce.Communicator.group(4)                 # host backend: threads as ranks
    xs = [np.full(1024, r, np.float32) for r in range(4)]
    with ThreadPoolExecutor(4) as pool:                     # one thread per rank
        sums = list(pool.map(lambda c, x: c.all_reduce(x), comms, xs))  # in place: 0+1+2+3

Each rank is driven from its own thread: ctypes releases the GIL for the length of each C
call, so the ranks of an in-process group block in the library together. Every non-zero
result code raises a subclass of :class:`Error` carrying the code's name and the library's
message; nothing fails silently. The fused all-reduce + residual add + RMSNorm (+ FP8) is
``Communicator.all_reduce_fused`` with one :class:`FusedWorkspace` per rank, under FlashInfer's
argument names. One process per rank, as vLLM's pynccl is built, is
``Communicator.from_process_group`` (the id over ``torch.distributed``),
``Communicator.init_rank`` with :func:`get_unique_id`'s bytes, or ``Communicator.from_env``
(torchrun's variables); the GPU backends only, as the host backend's ranks are threads.

The library is found on first use (``import allreduce`` never needs it), in order:
``$ALLREDUCE_LIB`` (alone, when set), a copy inside this package, then the repository's
``target/release`` and ``target/debug``. None loadable raises :class:`LibraryNotFound` with
every path tried. Build it with ``cargo build --release -p allreduce-capi`` (``--features
cuda`` for NVIDIA).

With torch, the all-reduce is also the custom op ``torch.ops.allreduce.all_reduce(x,
comm.key)`` (plus ``all_reduce_inplace`` and ``all_reduce_out``), with a fake implementation,
so it traces under ``torch.compile`` and is captured by ``torch.cuda.graph``;
``comm.all_reduce`` on a tensor goes through it. The ops are registered when this package is
imported after torch, on the first tensor ``comm.all_reduce`` sees, or by :func:`torch_ops`.
torch is never imported by ``import allreduce``.

What this first version does not have yet:

- the fused call as a torch op (eager torch code calls ``all_reduce_fused`` as it is);
- ``ar_comm_select``;
- a wheel that bundles the library; ``pip install ./python`` installs the Python code only.

The CUDA and ROCm paths (torch tensors, ``__cuda_array_interface__``, streams) are written
to the C ABI's contract but have not been run; only the host backend is tested.
"""

from ._comm import PRECISIONS, STRATEGIES, Communicator, get_unique_id
from ._comm import torch_with_ops as _torch_with_ops
from ._fused import FUSED_PATTERNS, FusedWorkspace
from ._errors import (
    Aborted,
    BackendNotBuilt,
    BootstrapError,
    DeviceError,
    DTypeMismatch,
    Error,
    InternalError,
    InvalidArgument,
    InvalidConfig,
    InvalidUsage,
    LengthMismatch,
    LibraryNotFound,
    LibraryUnavailable,
    Misaligned,
    PeerRejected,
    RankMismatch,
    StrategyUnavailable,
    Timeout,
    TooLarge,
    Unsupported,
    UnsupportedCodec,
    UnsupportedType,
    WorkspaceExceeded,
    WrongDevice,
)

__version__ = "0.1.0"

# Registered now only when torch is already loaded: importing it here would cost every
# host-only user its import time, and this package depends on nothing.
if _torch_with_ops() is not None:
    from . import _torch_ops  # noqa: F401


def library_path() -> str:
    """The path of the ``liballreduce_c`` in use (loading it if needed)."""
    from . import _lib

    return str(_lib.path())


def library_version() -> int:
    """The loaded library's version code, ``major * 10000 + minor * 100 + patch``."""
    from . import _lib

    return _lib.version()


def torch_ops():
    """``torch.ops.allreduce``, the all-reduce's torch custom ops, registered if they are not
    yet (this imports torch). Raises ``ImportError`` without torch."""
    from . import _torch_ops

    return _torch_ops.torch.ops.allreduce


__all__ = [
    "Aborted", "BackendNotBuilt", "BootstrapError", "Communicator", "DTypeMismatch",
    "DeviceError", "Error", "FUSED_PATTERNS", "FusedWorkspace", "InternalError",
    "InvalidArgument", "InvalidConfig", "InvalidUsage", "LengthMismatch", "LibraryNotFound",
    "LibraryUnavailable", "Misaligned", "PRECISIONS", "PeerRejected", "RankMismatch",
    "STRATEGIES", "StrategyUnavailable", "Timeout", "TooLarge", "Unsupported",
    "UnsupportedCodec", "UnsupportedType", "WorkspaceExceeded", "WrongDevice", "get_unique_id",
    "library_path", "library_version", "torch_ops",
]
