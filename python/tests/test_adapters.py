"""The array adapters other than numpy's, without torch or a GPU: a stand-in ``torch``
module whose CPU tensors share numpy memory (so the torch path runs a real host all-reduce),
and ``__cuda_array_interface__`` objects that describe memory the way CuPy or Numba do."""

import sys
import types

import numpy as np
import pytest

import allreduce
from allreduce import _buffers
from allreduce import Communicator, FusedWorkspace
from ranks import TIMEOUT, on_ranks

try:
    import ml_dtypes

    FP8 = [np.dtype(ml_dtypes.float8_e4m3fn)]
except ImportError:
    FP8 = []



def fake_torch():
    torch = types.ModuleType("torch")
    torch.float32, torch.float16, torch.bfloat16, torch.int32 = (
        "torch.float32", "torch.float16", "torch.bfloat16", "torch.int32")
    torch.uint8, torch.float8_e4m3fn = "torch.uint8", "torch.float8_e4m3fn"
    by_numpy = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                np.dtype(np.int32): torch.int32, np.dtype(np.uint8): torch.uint8}
    if FP8:
        by_numpy[FP8[0]] = torch.float8_e4m3fn
    torch.streams = []

    class Device:
        def __init__(self, type_, index=None):
            self.type, self.index = type_, index

    class Tensor:
        """A view of a numpy array, with the attributes the binding reads."""

        def __init__(self, array, device=Device("cpu"), requires_grad=False):
            self.array, self.device, self.requires_grad = array, device, requires_grad
            self.dtype = by_numpy[array.dtype]
            self.shape = array.shape

        def data_ptr(self):
            return self.array.__array_interface__["data"][0]

        def numel(self):
            return self.array.size

        def is_contiguous(self):
            return self.array.flags.c_contiguous

        def stride(self):
            return tuple(s // self.array.itemsize for s in self.array.strides)

    class Stream:
        cuda_stream = 0x5000

    torch.Tensor, torch.device = Tensor, Device
    torch.is_grad_enabled = lambda: True
    torch.cuda = types.SimpleNamespace(
        is_available=lambda: True, current_device=lambda: 0,
        current_stream=lambda device=None: torch.streams.append(device) or Stream())
    return torch


@pytest.fixture
def torch(monkeypatch):
    t = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", t)
    return t


def test_cpu_tensors_are_summed_on_the_host_backend(torch):
    comms = Communicator.group(2, timeout=TIMEOUT)
    arrays = [np.arange(64, dtype=np.float16) * (r + 1) for r in range(2)]
    tensors = [torch.Tensor(a) for a in arrays]
    got = on_ranks(range(2), lambda r: comms[r].all_reduce(tensors[r]))
    assert got[0] is tensors[0] and got[1] is tensors[1]
    for a in arrays:
        assert (a == np.arange(64, dtype=np.float16) * 3).all()
    assert torch.streams == [], "a CPU tensor has no stream to look up"
    for c in comms:
        c.close()


def test_cpu_tensors_take_the_fused_call_on_the_host_backend(torch):
    """The fused call through torch tensors writes the bits the same call through numpy
    arrays writes (which test_fused_host.py holds to the reference)."""
    comms = Communicator.group(2, timeout=TIMEOUT)
    wss = FusedWorkspace.group(comms, 4, 64, torch.float16)
    assert wss[0].dtype == "float16"
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 64)).astype(np.float16) for _ in range(2)]
    residual = rng.standard_normal((3, 64)).astype(np.float16)
    gamma = rng.uniform(0.5, 2, 64).astype(np.float16)
    results = {}
    for kind in ("numpy", "torch"):
        wrap = torch.Tensor if kind == "torch" else (lambda a: a)
        outs = [{"residual_out": np.empty_like(x), "norm_out": np.empty_like(x),
                 "quant_out": np.empty(x.shape, np.uint8),
                 "scale_out": np.empty(3, np.float32)} for x in xs]
        got = on_ranks(range(2), lambda r: comms[r].all_reduce_fused(
            wss[r], wrap(xs[r]), residual_in=wrap(residual), rms_gamma=wrap(gamma),
            **{k: wrap(v) for k, v in outs[r].items()}))
        assert got == [None, None], got
        results[kind] = outs
    for r in range(2):
        for key, want in results["numpy"][r].items():
            got = results["torch"][r][key]
            assert (got.view(np.uint8) == want.view(np.uint8)).all(), (r, key)
        assert results["torch"][r]["norm_out"].view(np.uint16).any()
    for w in wss:
        w.close()
    for c in comms:
        c.close()


def test_fp8_code_buffers(torch):
    codes = np.zeros(8, np.uint8)
    assert _buffers.describe(torch.Tensor(codes), "quant_out", codes=True).dtype == _buffers.U8
    assert _buffers.describe(codes, "quant_out", codes=True).count == 8
    for fp8 in FP8:
        buf = _buffers.describe(torch.Tensor(np.zeros(8, fp8)), "quant_out", codes=True)
        assert buf.dtype == _buffers.U8
        assert _buffers.describe(np.zeros(8, fp8), "quant_out", codes=True).dtype == _buffers.U8
    cai = _buffers.describe(CudaArray("|u1", shape=(2, 8)), "quant_out", codes=True)
    assert (cai.dtype, cai.count) == (_buffers.U8, 16)
    for bad in (torch.Tensor(np.zeros(8, np.float32)), np.zeros(8, np.int8),
                CudaArray("<f4")):
        with pytest.raises(allreduce.UnsupportedType, match="quant_out"):
            _buffers.describe(bad, "quant_out", codes=True)
    # Bytes are no dtype the library sums.
    with pytest.raises(allreduce.UnsupportedType, match="uint8"):
        _buffers.describe(codes, "x")
    with pytest.raises(allreduce.UnsupportedType, match="uint8"):
        _buffers.describe(torch.Tensor(codes), "x")


def test_tensor_refusals(torch):
    x = np.zeros(8, np.float32)
    with pytest.raises(allreduce.UnsupportedType, match="int32"):
        _buffers.describe(torch.Tensor(np.zeros(8, np.int32)), "x")
    with pytest.raises(allreduce.InvalidArgument, match="contiguous"):
        _buffers.describe(torch.Tensor(x[::2]), "x")
    with pytest.raises(allreduce.UnsupportedType, match="mps"):
        _buffers.describe(torch.Tensor(x, torch.device("mps")), "x")
    assert not _buffers.describe(torch.Tensor(x, requires_grad=True), "x").writable


def test_cuda_tensors_take_torchs_current_stream_of_their_device(torch):
    buf = _buffers.describe(torch.Tensor(np.zeros(8, np.float32), torch.device("cuda", 3)), "x")
    assert (buf.device, buf.stream, buf.dtype) == (3, 0x5000, _buffers.F32)
    assert torch.streams == [3]


def test_cuda_tensors_are_refused_by_a_host_communicator(torch):
    comms = Communicator.group(2, timeout=TIMEOUT)
    cuda = [torch.Tensor(np.zeros(8, np.float32), torch.device("cuda", 0)) for _ in range(2)]
    got = on_ranks(range(2), lambda r: comms[r].all_reduce(cuda[r]))
    for e in got:
        assert isinstance(e, allreduce.WrongDevice) and "GPU memory" in e.message, e
    for c in comms:
        c.close()


class CudaArray:
    """Describes memory as ``__cuda_array_interface__`` version 3 does."""

    def __init__(self, typestr="<f4", shape=(4, 8), strides=None, readonly=False, stream=None,
                 mask=None):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (0x7f0000001000, readonly),
            "strides": strides, "version": 3, "stream": stream, "mask": mask,
        }


def test_cuda_array_interface_objects_are_described_from_the_interface():
    buf = _buffers.describe(CudaArray(stream=2), "x")
    assert (buf.ptr, buf.count, buf.dtype, buf.shape) == (0x7f0000001000, 32, _buffers.F32,
                                                          (4, 8))
    assert (buf.device, buf.writable, buf.stream) == (None, True, 2)
    assert _buffers.describe(CudaArray("<f2", strides=(16, 2)), "x").dtype == _buffers.F16
    # A dimension of one may have any stride.
    assert _buffers.describe(CudaArray(shape=(1, 8), strides=(999, 4)), "x").count == 8
    assert not _buffers.describe(CudaArray(readonly=True), "x").writable


@pytest.mark.parametrize("kwargs,exc", [
    ({"strides": (4, 16)}, allreduce.InvalidArgument),
    ({"strides": (64, 8)}, allreduce.InvalidArgument),
    ({"typestr": "<f8"}, allreduce.UnsupportedType),
    ({"typestr": "<V2"}, allreduce.UnsupportedType),
    ({"mask": object()}, allreduce.InvalidArgument),
])
def test_cuda_array_interface_refusals(kwargs, exc):
    with pytest.raises(exc):
        _buffers.describe(CudaArray(**kwargs), "x")


def test_streams_are_ints_or_stream_objects():
    assert _buffers.stream_handle(7) == 7
    assert _buffers.stream_handle(types.SimpleNamespace(cuda_stream=8)) == 8
    assert _buffers.stream_handle(types.SimpleNamespace(ptr=9)) == 9
    for bad in (True, "0", 1.0, object()):
        with pytest.raises(allreduce.UnsupportedType):
            _buffers.stream_handle(bad)
