"""``Communicator``: one rank of a group, over ``ar_comm_*`` and ``ar_all_reduce``."""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import weakref
from typing import Any, List, Optional, Sequence, Tuple

from . import _buffers, _errors, _lib
from ._buffers import HOST
from ._errors import InvalidArgument, InvalidUsage, UnsupportedType
from ._handle import Handle

BACKENDS = {"host": 0, "cuda": 1, "rocm": 2}
_BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}

# `ar_precision_t` and `ar_strategy_t`, by the names the header's comments use.
PRECISIONS = {
    "exact": 0, "fp8": 1, "q8": 2, "q6": 3, "q4": 4, "q8a": 5, "q6a": 6, "q4a": 7,
    "q8v2": 8, "q6v2": 9, "q4v2": 10, "fp4": 11,
}
STRATEGIES = {"auto": 0, "oneshot": 1, "twoshot": 2, "quantized": 3, "hierarchical": 4,
              "vendor": 5, "vendor_symmetric": 6, "push_oneshot": 7}

_AR_SUM = 0
# The codes `ar_reject` takes: those of a refused argument. A refusal of another kind (an
# exception no check of this package raised) is sent as AR_INVALID_ARGUMENT.
_REFUSAL_CODES = frozenset(_errors.CODES[name] for name in (
    "AR_LENGTH_MISMATCH", "AR_DTYPE_MISMATCH", "AR_TOO_LARGE", "AR_MISALIGNED",
    "AR_WRONG_DEVICE", "AR_UNSUPPORTED_CODEC", "AR_STRATEGY_UNAVAILABLE",
    "AR_WORKSPACE_EXCEEDED", "AR_INVALID_ARGUMENT"))

_UINT32_MAX = 2**32 - 1
_INT_MAX = 2**31 - 1


def _name_to_code(table: dict, value: Any, what: str) -> int:
    # "vendor-symmetric" and "vendor_symmetric" alike, as the Rust names parse.
    if isinstance(value, str) and value.lower().replace("-", "_") in table:
        return table[value.lower().replace("-", "_")]
    raise InvalidArgument(f"{what} {value!r} is not one of {', '.join(table)}")


def _config(max_bytes: Optional[int], timeout: Optional[float]) -> _lib.Config:
    config = _lib.Config(size=ctypes.sizeof(_lib.Config))
    # Zero fields mean "the library's default" in ar_config_t, so an explicit 0 would be
    # silently replaced: refuse it instead.
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise _errors.InvalidConfig(f"max_bytes {max_bytes!r} must be a positive int")
        config.max_bytes = max_bytes
    if timeout is not None:
        try:
            seconds = float(timeout)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (seconds > 0 and seconds * 1000 <= _UINT32_MAX):
            raise _errors.InvalidConfig(
                f"timeout {timeout!r} must be a positive number of seconds, at most "
                f"{_UINT32_MAX // 1000}")
        config.timeout_ms = max(1, math.ceil(seconds * 1000))
    return config


def _int_arg(value: Any, what: str) -> int:
    # bool is an int subclass, but True as a rank is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedType(f"{what} is a {type(value).__qualname__}; pass an int")
    return value


def _check_world(world: Any) -> int:
    world = _int_arg(world, "world")
    if not 0 < world <= _INT_MAX:
        raise _errors.InvalidConfig(f"world size {world} must be between 1 and 2**31 - 1")
    return world


def _device_arg(device: Any, backend_code: int) -> int:
    """This process's GPU ordinal: ``device`` (an int or a ``torch.device``), else torch's
    current device when torch is loaded with a GPU, else 0. The host backend ignores it."""
    if device is None:
        if backend_code == BACKENDS["host"]:
            return 0
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
        return 0
    # torch.device("cuda", 1).index == 1; a str's index is a method, not an ordinal.
    index = getattr(device, "index", device)
    if callable(index):
        index = device
    if index is None:
        return _device_arg(None, backend_code)
    index = _int_arg(index, "device")
    if not 0 <= index <= _INT_MAX:
        raise InvalidArgument(f"device {index} must be a GPU ordinal, 0 or more")
    return index


# Every open communicator by its key, for the torch ops, which take ints rather than objects.
# Weak: the registry keeps no rank alive that its owner dropped.
_OPEN: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()


def lookup(key: Any) -> "Communicator":
    """The open communicator whose ``key`` this is; ``InvalidUsage`` if there is none."""
    comm = _OPEN.get(key) if isinstance(key, int) else None
    if comm is None or comm.closed:
        raise InvalidUsage(f"no open communicator has key {key!r}")
    return comm


def torch_with_ops() -> Any:
    """torch, if it is loaded and has ``torch.library.custom_op`` (2.4 and newer); else
    None. Never imports it."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(getattr(torch, "library", None), "custom_op"):
        return None
    return torch


def _through_torch_ops(x: Any, out: Any, precision: Any, strategy: Any, stream: Any) -> bool:
    """Whether ``all_reduce`` goes through the torch ops (``_torch_ops``): torch tensors on
    a torch that has ``torch.library.custom_op``, while ``torch.compile`` traces (so the call
    is one node of its graph). Eager calls, CUDA graph capture included, take the direct
    path: the dispatcher would add about 12 us to each and a captured graph records the
    same kernels either way. Anything the ops' schema or autograd would refuse with torch's
    own error instead of this package's (a non-string option, a stream object, a tensor
    autograd tracks) takes the direct path too, whose refusals reach the peers."""
    tensors = (x,) if out is None else (x, out)
    return (stream is None and isinstance(precision, str) and isinstance(strategy, str)
            and _traced_tensors(tensors))


def _traced_tensors(tensors: Sequence[Any]) -> bool:
    """While ``torch.compile`` traces (on a torch with custom ops): whether ``tensors``
    (``None`` for an optional one left out; the first is always given) are torch tensors that
    autograd does not track, which is what the ops' schemas take."""
    torch = torch_with_ops()
    if torch is None or not _compiling(torch):
        return False
    given = [t for t in tensors if t is not None]
    return (isinstance(tensors[0], torch.Tensor)
            and all(isinstance(t, torch.Tensor) for t in given)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in given)))


def _fused_through_torch_ops(ws: Any, tensors: Sequence[Any], rms_eps: Any, pattern: Any,
                             use_oneshot: Any, stream: Any, weight_bias: Any) -> bool:
    """As :func:`_through_torch_ops`, for ``all_reduce_fused``: while ``torch.compile``
    traces, when every array given is a torch tensor (``x`` always) and every option is of
    the op schema's type; anything else takes the direct path and its own refusals."""
    from . import _fused

    real = (int, float)
    return (isinstance(ws, _fused.FusedWorkspace) and stream is None
            and isinstance(rms_eps, real) and not isinstance(rms_eps, bool)
            and isinstance(weight_bias, real) and not isinstance(weight_bias, bool)
            and (pattern is None or isinstance(pattern, str))
            and (use_oneshot is None or isinstance(use_oneshot, bool))
            and _traced_tensors(tensors))


def _compiling(torch: Any) -> bool:
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def get_unique_id() -> bytes:
    """A new group's id (``ar_get_unique_id``; NCCL's ``ncclGetUniqueId``): make it on one
    process and hand the bytes to every process of the group for
    :meth:`Communicator.init_rank`. The group meets on this host's loopback interface, so
    every rank must run on this host (a group across hosts uses
    :meth:`Communicator.from_env`). The bytes hold the group's secret: give them to the
    group's processes only. Each call makes a new group."""
    uid = _lib.UniqueId()
    _lib.check(_lib.lib().ar_get_unique_id(ctypes.byref(uid)))
    return bytes(uid)


class Communicator(Handle):
    """One rank of an all-reduce group (NCCL's ``ncclComm_t``).

    Build a whole in-process group with :meth:`group`; drive each rank from its own thread
    (the host backend's call blocks until every rank has made the matching call; a GPU
    kernel waits for the peers' kernels). One thread at a time per communicator.

    Attributes, fixed for the communicator's life: ``rank``, ``world_size``, ``backend``
    (``"host"``, ``"cuda"``, ``"rocm"``), ``device`` (GPU ordinal; -1 on the host),
    ``alignment`` (bytes every buffer address must be aligned to: 16), ``max_bytes`` (the
    largest call run in one piece; the host backend refuses larger calls with ``TooLarge``),
    ``key`` (the int that names this rank to the torch ops, ``torch.ops.allreduce.*``).
    """

    def __init__(self, handle: int):
        # Built by `group`; the handle is the library's token for this rank.
        super().__init__(handle)
        self._busy = threading.Lock()
        self.rank = self._query_int("ar_comm_user_rank")
        self.world_size = self._query_int("ar_comm_count")
        self.device = self._query_int("ar_comm_device")
        self.backend = _BACKEND_NAMES.get(self._query_int("ar_comm_backend"), "unknown")
        self.alignment = self._query_size("ar_comm_alignment")
        self.max_bytes = self._query_size("ar_comm_max_bytes")
        # The library's token: never reused in the process, so a stale key finds nothing.
        self.key = int(handle)
        _OPEN[self.key] = self

    @classmethod
    def group(cls, world: int, backend: str = "host", max_bytes: Optional[int] = None,
              timeout: Optional[float] = None,
              devices: Optional[Sequence[int]] = None) -> List["Communicator"]:
        """Every rank of a new group in this process (NCCL's ``ncclCommInitAll``), in rank
        order.

        ``backend``: ``"host"`` (CPU threads as ranks, numpy arrays), ``"cuda"`` or ``"rocm"``
        (a library built with that feature; otherwise ``BackendNotBuilt``). ``max_bytes``:
        the largest call in bytes per rank, which sizes each rank's workspace (default 64 MiB).
        ``timeout``: seconds any wait for a peer may last before the call fails with
        ``Timeout`` (default 60, the library's ``AR_DEFAULT_TIMEOUT_MS``). ``devices``: rank r's GPU ordinal (default 0..world-1; a
        device may repeat, several ranks on one GPU); ignored by the host backend.
        """
        code = _name_to_code(BACKENDS, backend, "backend")
        world = _check_world(world)
        config = _config(max_bytes, timeout)
        devlist = None
        if devices is not None:
            devices = list(devices)
            if len(devices) != world:
                raise _errors.InvalidConfig(f"{len(devices)} devices for {world} ranks")
            devlist = (ctypes.c_int * world)(*devices)
        handles = (_lib.Handle * world)()
        lib = _lib.lib()
        _lib.check(lib.ar_comm_init_all(handles, code, world, devlist, ctypes.byref(config)))
        comms: List[Communicator] = []
        try:
            for h in handles:
                comms.append(cls(h))
        except BaseException:
            for c in comms:
                c.close()
            for h in handles[len(comms):]:
                lib.ar_comm_destroy(h)
            raise
        return comms

    @classmethod
    def _adopt(cls, handle: int) -> "Communicator":
        # A rank built by one of the init functions: released if reading its attributes fails.
        try:
            return cls(handle)
        except BaseException:
            _lib.lib().ar_comm_destroy(handle)
            raise

    @classmethod
    def init_rank(cls, unique_id: bytes, world: int, rank: int, backend: str = "cuda",
                  device: Any = None, max_bytes: Optional[int] = None,
                  timeout: Optional[float] = None) -> "Communicator":
        """This process's rank of a group with one process per rank (``ar_comm_init_rank``;
        NCCL's ``ncclCommInitRank``). Every process of the group calls it at about the same
        time with the same ``unique_id`` (from :func:`allreduce.get_unique_id` on one of them)
        and ``world``, and its own ``rank`` (0 <= rank < world); it returns once all have
        joined, or fails when the rendezvous deadline passes
        (``ALLREDUCE_BOOTSTRAP_TIMEOUT_S`` seconds, 60 by default).

        Backends: ``"cuda"`` and ``"rocm"`` only. The host backend's ranks are threads of one
        process (:meth:`group`): it refuses with ``InvalidConfig`` ("in-process groups only")
        once the rendezvous has met. ``device``: this process's GPU ordinal (an int or a
        ``torch.device``; default torch's current device when torch is loaded, else 0).
        ``max_bytes`` and ``timeout`` (seconds any wait for a peer in a call may last) as in
        :meth:`group`; ``timeout`` does not shorten the rendezvous. A rank that disagrees
        with rank 0 on ``world``, or a ``rank`` given twice, stops the rendezvous at once on
        itself, rank 0 and every rank already joined (``BootstrapError`` with the reason); a
        rank whose peers never arrive, or that holds another group's id, fails at the
        deadline (``Timeout``).

        Arguments are checked before any C call: ``UnsupportedType`` (a ``TypeError``) for a
        wrong type, ``InvalidArgument`` / ``InvalidConfig`` (``ValueError``) for a bad value.
        """
        code = _name_to_code(BACKENDS, backend, "backend")
        if not isinstance(unique_id, (bytes, bytearray)):
            raise UnsupportedType(
                f"unique_id is a {type(unique_id).__qualname__}; pass the bytes "
                "allreduce.get_unique_id() returned")
        if len(unique_id) != _lib.UNIQUE_ID_BYTES:
            raise InvalidArgument(
                f"unique_id has {len(unique_id)} bytes; an id from allreduce.get_unique_id() "
                f"has {_lib.UNIQUE_ID_BYTES}")
        world = _check_world(world)
        rank = _int_arg(rank, "rank")
        if not 0 <= rank < world:
            raise _errors.InvalidConfig(f"rank {rank} is outside 0..{world}")
        dev = _device_arg(device, code)
        config = _config(max_bytes, timeout)
        uid = _lib.UniqueId.from_buffer_copy(bytes(unique_id))
        handle = _lib.Handle()
        _lib.check(_lib.lib().ar_comm_init_rank(
            ctypes.byref(handle), code, world, uid, rank, dev, ctypes.byref(config)))
        return cls._adopt(handle.value)

    @classmethod
    def from_env(cls, backend: str = "cuda", device: Any = None,
                 max_bytes: Optional[int] = None,
                 timeout: Optional[float] = None) -> "Communicator":
        """This process's rank from a torchrun-style environment (``ar_comm_init_env``):
        ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and the group's
        ``ALLREDUCE_BOOTSTRAP_SECRET`` (64 hex digits, the same in every process; torchrun
        does not set it), optionally ``ALLREDUCE_BOOTSTRAP_TIMEOUT_S`` (the rendezvous
        deadline, 60 s by default), ``ALLREDUCE_BOOTSTRAP_PORT`` (instead of ``MASTER_PORT``,
        which torch.distributed's store may already hold) and
        ``ALLREDUCE_BOOTSTRAP_ALLOW_REMOTE=1`` (on every rank, for a group across hosts). A
        missing or malformed variable is ``InvalidConfig`` naming it. Launch mistakes that
        rank 0 refuses (another ``WORLD_SIZE`` or secret, a ``RANK`` given twice, two
        processes with ``RANK=0``) raise ``BootstrapError`` with the reason at once on every
        process that has reached rank 0, not at the deadline.

        Backends: ``"cuda"`` and ``"rocm"`` only; the host backend refuses with
        ``InvalidConfig`` once the rendezvous has met, as in :meth:`init_rank`. ``device``:
        default ``LOCAL_RANK`` (0 if unset). ``max_bytes`` and ``timeout`` as in :meth:`group`.
        """
        code = _name_to_code(BACKENDS, backend, "backend")
        # -1 asks the library for LOCAL_RANK.
        dev = -1 if device is None else _device_arg(device, code)
        config = _config(max_bytes, timeout)
        handle = _lib.Handle()
        _lib.check(_lib.lib().ar_comm_init_env(
            ctypes.byref(handle), code, dev, ctypes.byref(config)))
        return cls._adopt(handle.value)

    @classmethod
    def from_process_group(cls, group: Any = None, backend: str = "cuda", device: Any = None,
                           max_bytes: Optional[int] = None,
                           timeout: Optional[float] = None) -> "Communicator":
        """This process's rank of a group with the ranks of a ``torch.distributed`` process
        group (default: the world), as vLLM's ``PyNcclCommunicator`` is built: the group's
        rank 0 makes the id (:func:`allreduce.get_unique_id`),
        ``torch.distributed.broadcast_object_list`` hands it to the others, and every rank
        calls :meth:`init_rank` with its rank in ``group``. Every rank of ``group`` must call
        it. The id's rendezvous is on loopback, so the group's processes must share a host (a
        group across hosts uses :meth:`from_env`). On an NCCL process group the broadcast runs
        on torch's current device; a gloo group needs no device.

        Backends: ``"cuda"`` and ``"rocm"`` only (the host backend refuses, as in
        :meth:`init_rank`). ``device``: default torch's current device. Raises
        ``InvalidUsage`` if torch is not installed or ``torch.distributed`` is not
        initialized.
        """
        _name_to_code(BACKENDS, backend, "backend")
        try:
            import torch.distributed as dist
        except ImportError as e:
            raise InvalidUsage(
                f"Communicator.from_process_group needs torch.distributed, which cannot be "
                f"imported ({e}); use init_rank or from_env") from e
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidUsage(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group first, or use init_rank or from_env")
        if group is None:
            group = dist.group.WORLD
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        # broadcast_object_list names its source by global rank.
        src = dist.get_process_group_ranks(group)[0]
        box: List[Any] = [None]
        if rank == 0:
            # A failure here is sent too: the peers would otherwise wait in init_rank for a
            # rank 0 that never comes.
            try:
                box[0] = get_unique_id()
            except Exception as e:
                box[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(box, src=src, group=group)
        unique_id = box[0]
        if not isinstance(unique_id, bytes):
            raise _errors.BootstrapError(
                f"the process group's rank 0 could not make the group's id: {unique_id}")
        return cls.init_rank(unique_id, world, rank, backend=backend, device=device,
                             max_bytes=max_bytes, timeout=timeout)

    def set_graph_registration(self, on: bool) -> None:
        """Graph buffers registered after capture, as vLLM's ``capture()``: while on, every
        out-of-place exact one-shot or two-shot call this rank makes on a stream being
        captured into a CUDA/HIP graph is captured to read every rank's input in place,
        from addresses :meth:`register_graph_buffers` supplies after the capture (no staging
        copy). Eager calls are unchanged. Turn it on for the capture on every rank, capture,
        register, then replay; a replay before the registration skips the call on every
        rank and :meth:`synchronize` raises ``InvalidArgument`` (the group stays usable).
        The captured tensors must stay allocated while the graph may replay."""
        if not isinstance(on, bool):
            raise UnsupportedType(f"on is a {type(on).__qualname__}; pass True or False")
        _lib.check(_lib.lib().ar_comm_set_graph_registration(self._live_handle(), int(on)))

    @staticmethod
    def register(comms: Any, buffers: Any) -> int:
        """Register memory the caller has, as vLLM's ``register_buffer``: out-of-place exact
        one-shot and two-shot calls whose input lies in it then read every rank's input in
        place (no staging copy). ``comms`` and ``buffers``: every rank of an in-process group
        (:meth:`group`) in rank order with one array or tensor each, or this process's rank of
        a group of processes with its own (collective: every rank calls it, in the same order
        as its other registrations; CUDA memory from ``cudaMalloc``, such as PyTorch's caching
        allocator's, travels as an IPC handle). One length in bytes for all, 16-byte aligned.
        Every rank must then call with its input at the same offset of its buffer. Returns the
        registration's id, for :meth:`deregister`. Keep the buffers alive until then."""
        group = Communicator._ranks(comms)
        bufs = [buffers] if isinstance(comms, Communicator) else list(buffers)
        if len(bufs) != len(group):
            raise InvalidArgument(
                f"{len(bufs)} buffers for {len(group)} communicators: one per rank")
        described = [_buffers.describe(b, f"buffers[{i}]") for i, b in enumerate(bufs)]
        for c, b, i in zip(group, described, range(len(group))):
            c._check_device(b, f"buffers[{i}]")
        sizes = {b.count * _buffers.ITEMSIZE[b.dtype] for b in described}
        if len(sizes) != 1:
            raise InvalidArgument(f"the buffers must have one length in bytes, not {sorted(sizes)}")
        handles = (_lib.Handle * len(group))(*[c._live_handle() for c in group])
        ptrs = (ctypes.c_void_p * len(group))(*[b.ptr for b in described])
        out = ctypes.c_uint64(0)
        _lib.check(_lib.lib().ar_comm_register(handles, len(group), ptrs, sizes.pop(),
                                                ctypes.byref(out)))
        return out.value

    @staticmethod
    def deregister(comms: Any, registration: int) -> None:
        """Forget a registration made by :meth:`register` (``comms`` as there). Calls that read
        it must have completed; later calls on the memory are staged."""
        group = Communicator._ranks(comms)
        if isinstance(registration, bool) or not isinstance(registration, int):
            raise UnsupportedType(
                f"registration is a {type(registration).__qualname__}; pass register's id")
        handles = (_lib.Handle * len(group))(*[c._live_handle() for c in group])
        _lib.check(_lib.lib().ar_comm_deregister(handles, len(group), registration))

    @staticmethod
    def _ranks(comms: Any) -> List["Communicator"]:
        group = [comms] if isinstance(comms, Communicator) else list(comms)
        if not group or not all(isinstance(c, Communicator) for c in group):
            raise UnsupportedType("comms is a Communicator or a list of a group's Communicators")
        return group

    @staticmethod
    def register_graph_buffers(comms: Any) -> int:
        """Register the inputs of the calls captured with graph registration on since the
        last registration (see :meth:`set_graph_registration`); returns how many calls each
        rank captured. ``comms``: every rank of an in-process group (:meth:`group`), in rank
        order, from one thread; or this process's rank of a group of processes
        (:meth:`init_rank`, :meth:`from_env`, :meth:`from_process_group`), on every rank:
        the inputs then travel as IPC handles over the group's rendezvous. Ranks that
        captured different calls raise ``RankMismatch``. No graph of the group may be
        running."""
        group = Communicator._ranks(comms)
        handles = (_lib.Handle * len(group))(*[c._live_handle() for c in group])
        count = ctypes.c_size_t(0)
        _lib.check(_lib.lib().ar_comm_register_graph_buffers(handles, len(group),
                                                              ctypes.byref(count)))
        return count.value

    def _live_handle(self) -> int:
        handle = self._handle
        if handle is None:
            raise InvalidUsage("this communicator is closed")
        return handle

    def _query_int(self, fn: str) -> int:
        out = ctypes.c_int(0)
        _lib.check(getattr(_lib.lib(), fn)(self._live_handle(), ctypes.byref(out)))
        return out.value

    def vendor_window(self) -> Optional[Tuple[int, int]]:
        """This rank's symmetric window of the vendor library (``strategy="vendor_symmetric"``,
        NCCL 2.27 or later) as ``(device address, bytes)``, or ``None`` where the group has
        none. Tensors in it, at the same offset on every rank, are reduced by NCCL's symmetric
        kernels with no copy; others are copied in and out. It lives as long as the
        communicator."""
        addr, size = ctypes.c_void_p(0), ctypes.c_size_t(0)
        _lib.check(_lib.lib().ar_comm_vendor_window(
            self._live_handle(), ctypes.byref(addr), ctypes.byref(size)))
        return (addr.value, size.value) if addr.value else None

    def _query_size(self, fn: str) -> int:
        out = ctypes.c_size_t(0)
        _lib.check(getattr(_lib.lib(), fn)(self._live_handle(), ctypes.byref(out)))
        return out.value

    _DESTROY = "ar_comm_destroy"

    def abort(self) -> None:
        """Abort the group and release this rank (``ar_comm_abort``, NCCL's
        ``ncclCommAbort``). Callable from any thread, also while another thread's call waits
        for a peer that will never come: every call in flight on any rank leaves at once with
        ``Aborted``, as does every later call; close the other ranks and build a new group.
        This communicator is closed afterwards, even when the abort itself raises."""
        with self._close_lock:
            handle, self._handle = self._handle, None
        if handle is None:
            raise InvalidUsage("this communicator is closed")
        _lib.check(_lib.lib().ar_comm_abort(handle))

    def close(self) -> None:
        """Release this rank (``ar_comm_destroy``); later calls raise ``InvalidUsage``.
        Idempotent. On a GPU, synchronize the streams of this rank's calls first. The group's
        shared resources go when its last rank is closed."""
        self._release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"device={self.device}"
        return (f"<allreduce.Communicator rank {self.rank}/{self.world_size} "
                f"{self.backend} {state}>")

    def _resolve_stream(self, stream: Any, default: Optional[int]) -> int:
        if stream is not None:
            return _buffers.stream_handle(stream)
        if default is not None:
            return default
        if self.backend != "host":
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                return int(torch.cuda.current_stream(self.device).cuda_stream)
        return 0

    def _check_device(self, buf: _buffers.Buffer, what: str) -> None:
        on_host = buf.device == HOST
        if (self.backend == "host") != on_host:
            where = "host memory" if on_host else "GPU memory"
            raise _errors.WrongDevice(
                f"{what} ({buf.kind}) is {where}; a {self.backend} communicator takes "
                f"{'host' if self.backend == 'host' else 'device ' + str(self.device)} memory")
        if not on_host and buf.device is not None and buf.device != self.device:
            raise _errors.WrongDevice(
                f"{what} is on device {buf.device}; this rank runs on device {self.device}")

    def _refusal_stream(self, stream: Any) -> int:
        """The stream of a call refused before ``x`` named one: the caller's, else the one a
        valid call would default to (torch's current stream on a GPU backend), so this rank's
        part of the call stays ordered with its other calls on that stream. A ``stream`` that
        is itself the refused argument falls back to the legacy default stream."""
        try:
            return self._resolve_stream(stream, None)
        except Exception:  # noqa: BLE001 - the refusal being reported is the caller's error
            return 0

    def _reject(self, stream: int, error: BaseException) -> None:
        """Make this rank's part of the call a refusal carrying ``error``'s message
        (``ar_reject``), so the peers' matching call fails at once with ``PeerRejected`` naming
        this rank's reason, instead of waiting for the deadline, and the group stays usable."""
        if isinstance(error, _errors.Error) and error.code in _REFUSAL_CODES:
            code, message = error.code, error.message
        else:
            code = _errors.CODES["AR_INVALID_ARGUMENT"]
            message = f"{type(error).__name__}: {error}"
        # The caller raises its own error; a failure here (a closed handle) reached no peer,
        # whose call then ends at its deadline, as for any rank that never calls.
        _lib.lib().ar_reject(self._handle, code, message.encode("utf-8", "replace"), stream)

    def all_reduce(self, x: Any, out: Any = None, precision: str = "exact",
                   strategy: str = "auto", stream: Any = None) -> Any:
        """Sum ``x`` over every rank of the group (NCCL's ``ncclAllReduce`` with ``ncclSum``).

        ``x``: a numpy array (host backend; float32, float16, or bfloat16 from ml_dtypes), a
        torch tensor (CPU on the host backend, CUDA on the GPU backends; float32, float16,
        bfloat16) or an object with ``__cuda_array_interface__`` (``<f4``, ``<f2``).
        Contiguous, with its address aligned to ``alignment`` bytes (numpy's and torch's own
        allocations are; a view at an offset may not be: ``Misaligned``).

        ``out``: where the sum goes, same dtype and shape as ``x``; ``None`` sums in place,
        into ``x``. Returns ``out`` (or ``x``).

        ``precision``: ``"exact"`` (f32 accumulation in rank order, one rounding into the
        dtype: the same bits on every rank and every backend) or a lossy wire codec for 16-bit
        data, ``"fp8"``, ``"q8"``, ``"q6"``, ``"q4"``, ``"q8a"``, ``"q6a"``, ``"q4a"``,
        ``"q8v2"``, ``"q6v2"``, ``"q4v2"``, ``"fp4"`` (docs/codecs.md; the v2 ones on the host
        backend only); with a codec, ``"auto"`` may still pick an exact path.
        ``strategy``: ``"auto"``, ``"oneshot"``, ``"twoshot"``, ``"quantized"``,
        ``"hierarchical"``, ``"vendor"`` (NCCL/RCCL) or ``"push_oneshot"`` (small calls, by push).

        ``stream``: the ``cudaStream_t`` / ``hipStream_t`` the call is enqueued on, as an int
        or a stream object (``.cuda_stream``, ``.ptr``). Default: torch's current stream for a
        CUDA tensor, the producer's stream of a ``__cuda_array_interface__`` that names one,
        else the legacy default stream. The host backend takes none and returns when the sum
        is complete; on a GPU the call returns once enqueued, and ``x`` and ``out`` must stay
        alive until the stream has run it.

        Every rank must make the matching call (same count, dtype, precision, strategy).
        Arguments refused on one rank (by this binding or by the library) fail there with
        their own error and on the peers with ``PeerRejected``; the group stays usable. Every
        failure raises a subclass of ``allreduce.Error``; ``error.rebuild`` says whether the
        group must be rebuilt.

        Torch tensors go through the custom op ``torch.ops.allreduce.all_reduce_inplace`` (or
        ``all_reduce_out``), so the call traces under ``torch.compile`` and is captured by
        ``torch.cuda.graph`` as one op; an explicit ``stream`` takes the direct path.
        """
        if _through_torch_ops(x, out, precision, strategy, stream):
            from . import _torch_ops

            return _torch_ops.call(self, x, out, precision, strategy)
        return self._all_reduce(x, out, precision, strategy, stream)

    def _all_reduce(self, x: Any, out: Any, precision: Any, strategy: Any, stream: Any) -> Any:
        handle = self._live_handle()
        if not self._busy.acquire(blocking=False):
            raise InvalidUsage(
                f"rank {self.rank} is already in a call on another thread; drive each "
                "communicator from one thread at a time")
        try:
            stream_value = None
            try:
                src = _buffers.describe(x, "x")
                stream_value = self._resolve_stream(stream, src.stream)
                dst = src if out is None else _buffers.describe(out, "out")
                self._check_call(src, dst, out is None)
                p = _name_to_code(PRECISIONS, precision, "precision")
                s = _name_to_code(STRATEGIES, strategy, "strategy")
            except Exception as e:
                if stream_value is None:
                    stream_value = self._refusal_stream(stream)
                self._reject(stream_value, e)
                raise
            _lib.check(_lib.lib().ar_all_reduce(
                src.ptr, dst.ptr, src.count, src.dtype, _AR_SUM, p, s, handle, stream_value))
        finally:
            self._busy.release()
        return x if out is None else out

    def _check_call(self, src: _buffers.Buffer, dst: _buffers.Buffer, in_place: bool) -> None:
        self._check_device(src, "x")
        if in_place:
            if not src.writable:
                raise InvalidArgument("x is read-only; the sum is written into x when out is "
                                      "None")
            return
        self._check_device(dst, "out")
        if not dst.writable:
            raise InvalidArgument("out is read-only")
        if dst.dtype != src.dtype:
            raise _errors.DTypeMismatch(
                f"x is {_buffers.DTYPE_NAMES[src.dtype]}, out is "
                f"{_buffers.DTYPE_NAMES[dst.dtype]}")
        if dst.count != src.count:
            raise _errors.LengthMismatch(
                f"x has {src.count} elements, out has {dst.count}")
        if dst.shape != src.shape:
            raise InvalidArgument(f"x has shape {src.shape}, out has shape {dst.shape}")

    def all_reduce_fused(self, ws: Any, x: Any, residual_in: Any = None,
                         residual_out: Any = None, norm_out: Any = None, quant_out: Any = None,
                         scale_out: Any = None, rms_gamma: Any = None, rms_eps: float = 1e-6,
                         pattern: Optional[str] = None, allreduce_out: Any = None,
                         use_oneshot: Optional[bool] = None, static_scale: Any = None,
                         stream: Any = None, weight_bias: float = 0.0) -> None:
        """The all-reduce fused with the residual add, the RMSNorm and FP8 quantization
        (``ar_all_reduce_fused``; FlashInfer's ``trtllm_allreduce_fusion``, whose argument
        names these are). With ``a = sum over ranks of x`` (exact: f32 in rank order, one
        rounding, and a sum of -0.0 comes out +0.0)::

            allreduce_out = a
            residual_out  = round(a + residual_in)        (r = a without residual_in)
            norm_out      = round(r / sqrt(mean(r**2) + rms_eps) * (rms_gamma + weight_bias))
            quant_out     = FP8 E4M3 codes of norm_out at scale_out (one per token: the row's
                            max |norm_out| / 448) or at static_scale (code = norm_out / scale)

        ``ws``: this rank's :class:`FusedWorkspace`. ``x``, ``residual_in`` and every row
        output: ``(tokens, hidden)`` arrays of the workspace's dtype and hidden, ``tokens`` at
        most its ``max_tokens``; ``rms_gamma``: ``(hidden,)``. ``quant_out``: ``tokens *
        hidden`` uint8 (or float8_e4m3fn) elements; ``scale_out``: ``tokens`` float32.
        ``static_scale``: one float32 element (read when the call runs), or on the host
        backend a number. Arrays as in :meth:`all_reduce` (contiguous, aligned, on this rank's
        device). ``residual_out`` may be ``residual_in`` and ``allreduce_out`` may be ``x``
        (in place); other overlaps are refused.

        ``pattern``: ``"allreduce"``, ``"residual_rmsnorm"``, ``"residual_rmsnorm_fp8"`` (per
        token scales) or ``"residual_rmsnorm_fp8_static"``; ``None`` infers it from what is
        given: ``static_scale`` -> fp8_static; ``quant_out`` or ``scale_out`` -> fp8;
        ``residual_in``, ``residual_out``, ``norm_out`` or ``rms_gamma`` -> residual_rmsnorm;
        else allreduce. A pattern refuses what it lacks (residual_rmsnorm needs ``rms_gamma``
        and ``norm_out``; the FP8 ones ``norm_out`` optional, ``quant_out`` and their scale
        required) and what it would not use. ``residual_in`` is optional (FlashInfer's
        all-reduce + RMSNorm without residual); ``residual_out`` needs it. ``weight_bias``
        (FlashInfer's name; 1.0 for Gemma's ``(1 + gamma)``) is added to every gamma in f32. Pattern allreduce
        without ``allreduce_out`` sums into ``x``; the others write ``allreduce_out`` when it
        is given. ``use_oneshot``: True (one-shot), False (two-shot), None (the workspace's
        choice by size). ``stream`` as in :meth:`all_reduce`. Returns None: the outputs are
        the arrays given.

        Every rank makes the matching call. A refusal (by this binding or by the library) is
        raised on the rank that made it before anything is enqueued and, as with
        :meth:`all_reduce`, the peers are told: their matching fused call raises
        ``PeerRejected`` with the reason (at once on the host backend, at their next
        synchronize on a GPU) instead of waiting for the group's timeout, and the group and
        the workspace stay usable.
        """
        from . import _fused

        tensors = (x, residual_in, residual_out, norm_out, quant_out, scale_out, rms_gamma,
                   allreduce_out, static_scale)
        if _fused_through_torch_ops(ws, tensors, rms_eps, pattern, use_oneshot, stream,
                                    weight_bias):
            from . import _torch_ops

            _torch_ops.call_fused(self, ws, x, residual_in, residual_out, norm_out, quant_out,
                                  scale_out, rms_gamma, rms_eps, pattern, allreduce_out,
                                  use_oneshot, static_scale, weight_bias)
            return
        _fused.all_reduce_fused(self, ws, x, residual_in, residual_out, norm_out, quant_out,
                                scale_out, rms_gamma, rms_eps, pattern, allreduce_out,
                                use_oneshot, static_scale, stream, weight_bias)

    def synchronize(self, stream: Any = None) -> None:
        """Wait for this rank's work on ``stream`` and raise any error the device recorded
        since the last check (a peer past the deadline, an aborted group), as NCCL's
        ``ncclCommGetAsyncError`` after a stream synchronisation. ``stream`` as in
        :meth:`all_reduce`; default: torch's current stream on this rank's device when torch
        is loaded, else the legacy default stream. On the host it only reports an abort."""
        handle = self._live_handle()
        value = self._resolve_stream(stream, None)
        _lib.check(_lib.lib().ar_comm_synchronize(handle, value))
