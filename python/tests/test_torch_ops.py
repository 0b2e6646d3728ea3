"""The torch custom ops (``torch.ops.allreduce.*``) on CPU tensors and the host backend: called
directly, through ``Communicator.all_reduce`` and inside ``torch.compile(fullgraph=True)``,
each result bit for bit the reference the numpy tests hold the library to; the fake
implementations checked by ``torch.library.opcheck``; refusals raised as this package's
``ValueError``s with the group exact afterwards. Skipped, with the reason, without torch."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch ops are untested")

import ml_dtypes  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

import allreduce  # noqa: E402
from allreduce import Communicator  # noqa: E402
from ranks import TIMEOUT, assert_bitwise, inputs, reference, values  # noqa: E402

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
INTS = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32)}
SHAPE = (8, 125)
ops = allreduce.torch_ops()


def tensor(a):
    """A CPU tensor holding ``a``'s bits (bfloat16 too, which numpy cannot hand torch)."""
    ints, _ = INTS[a.dtype.itemsize]
    return torch.from_numpy(a.view(ints).copy()).view(TORCH_DTYPES[a.dtype.name])


def array(t, dtype):
    _, ints = INTS[t.element_size()]
    return t.contiguous().view(ints).numpy().view(dtype)


@pytest.fixture(scope="module")
def threads():
    """One long-lived thread per rank. torch.compile in a new thread, after another thread
    that compiled a mutating op has exited, crashed torch 2.11 (a segfault in FakeTensorMode);
    threads that live as long as the tests avoid that."""
    pools = [ThreadPoolExecutor(1) for _ in range(4)]

    def run(comms, fn):
        def rank(r):
            try:
                return fn(r)
            except BaseException as e:  # noqa: B036 - handed to the test thread
                return e

        futures = [pools[r].submit(rank, r) for r in range(len(comms))]
        return [f.result(timeout=3 * TIMEOUT + 60) for f in futures]

    yield run
    for p in pools:
        p.shutdown()


def group(world):
    return Communicator.group(world, timeout=TIMEOUT)


def close(comms):
    for c in comms:
        c.close()


def rank_inputs(world, dtype, seed):
    return [inputs(dtype, SHAPE[0] * SHAPE[1], r, seed).reshape(SHAPE) for r in range(world)]


def op_inplace(comm, x):
    ops.all_reduce_inplace(x, comm.key)
    return x


def op_out(comm, x):
    out = torch.empty_like(x)
    ops.all_reduce_out(x, out, comm.key)
    return out


# Each way to call the all-reduce on a tensor: returns where the sum is.
CALLS = {
    "op": lambda comm, x: ops.all_reduce(x, comm.key),
    "op_inplace": op_inplace,
    "op_out": op_out,
    "comm_inplace": lambda comm, x: comm.all_reduce(x),
    "comm_out": lambda comm, x: comm.all_reduce(x, torch.empty_like(x)),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_eager_calls_are_the_reference_bit_for_bit(threads, world, dtype, call):
    comms = group(world)
    try:
        for seed in (1, 2):
            xs = rank_inputs(world, dtype, seed)
            ts = [tensor(x) for x in xs]
            got = values(threads(comms, lambda r: CALLS[call](comms[r], ts[r])))
            want = reference(xs)
            for r, g in enumerate(got):
                assert g.shape == SHAPE and g.dtype == TORCH_DTYPES[dtype.name]
                if call.endswith("inplace"):
                    assert g is ts[r]
                else:
                    assert_bitwise(array(ts[r], dtype), xs[r], f"rank {r}: x was written")
                assert_bitwise(array(g, dtype), want, f"rank {r} {call} {dtype}")
    finally:
        close(comms)


def test_the_ops_are_the_same_bits_as_the_numpy_path(threads):
    comms = group(4)
    try:
        xs = rank_inputs(4, np.dtype(np.float16), 3)
        via_numpy = values(threads(comms, lambda r: comms[r].all_reduce(xs[r].copy())))
        via_torch = values(threads(comms, lambda r: ops.all_reduce(tensor(xs[r]), comms[r].key)))
        for r in range(4):
            assert_bitwise(array(via_torch[r], xs[r].dtype), via_numpy[r], f"rank {r}")
    finally:
        close(comms)


def compiled(comm, backend):
    """One compiled step with all three ops in it; ``out`` is written before ``x`` is summed in
    place, so an order that functionalization got wrong shows in ``out``."""
    def step(x, out):
        y = ops.all_reduce(x * 1, comm.key)
        comm.all_reduce(x, out)
        comm.all_reduce(x)
        return y * 1

    counter = CompileCounterWithBackend(backend)
    return torch.compile(step, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_fullgraph_is_the_reference_bit_for_bit(threads, backend, dtype):
    torch._dynamo.reset()
    comms = group(2)
    try:
        steps = [compiled(c, backend) for c in comms]
        for seed in (4, 5):  # the second runs the graphs compiled by the first
            xs = rank_inputs(2, dtype, seed)
            ts = [tensor(x) for x in xs]
            outs = [torch.empty_like(t) for t in ts]
            ys = values(threads(comms, lambda r: steps[r][0](ts[r], outs[r])))
            want = reference(xs)
            for r in range(2):
                for what, t in (("y", ys[r]), ("out", outs[r]), ("x in place", ts[r])):
                    assert_bitwise(array(t, dtype), want, f"rank {r} {what} seed {seed}")
        for step, counter in steps:
            assert counter.frame_count == 1, "one graph, compiled once"
            code = counter.graphs[0].code
            assert code.count("torch.ops.allreduce.") == 3, code
    finally:
        close(comms)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_the_fake_implementations_pass_opcheck(dtype):
    # One rank: opcheck runs each op several times on its own, which a group of one allows.
    # It compares each fake's output with the real one's: dtype, shape, strides.
    (comm,) = group(1)
    try:
        x = torch.randn(4, 8).to(TORCH_DTYPES[dtype])
        for op, args in [(ops.all_reduce, (x, comm.key)),
                         (ops.all_reduce_inplace, (x.clone(), comm.key, "exact", "oneshot")),
                         (ops.all_reduce_out, (x, torch.empty_like(x), comm.key))]:
            torch.library.opcheck(op, args)
    finally:
        comm.close()


def test_fake_tensors_never_reach_the_library():
    # Under FakeTensorMode only the fake runs: a real call on one rank of two would wait for
    # the peer and time out.
    comms = group(2)
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            x = torch.empty(3, 64, dtype=torch.bfloat16)
            y = ops.all_reduce(x, comms[0].key)
            ops.all_reduce_inplace(x, comms[0].key)
            ops.all_reduce_out(x, torch.empty_like(x), comms[0].key)
        assert (y.shape, y.dtype) == (x.shape, x.dtype)
        assert not any(c._busy.locked() for c in comms)
    finally:
        close(comms)


BAD = {
    "non-contiguous": (lambda t: t.t(), allreduce.InvalidArgument, "contiguous"),
    "float64": (lambda t: t.double(), allreduce.UnsupportedType, "float64"),
    "int32": (lambda t: t.int(), allreduce.UnsupportedType, "int32"),
}


def exact_round(threads, comms, call="op"):
    xs = rank_inputs(len(comms), np.dtype(np.float32), 9)
    got = values(threads(comms, lambda r: CALLS[call](comms[r], tensor(xs[r]))))
    for r, g in enumerate(got):
        assert_bitwise(array(g, xs[r].dtype), reference(xs), f"rank {r} after a refusal")


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("call", sorted(CALLS) + ["compiled"])
def test_bad_tensors_raise_value_errors_and_the_group_stays_exact(threads, bad, call):
    make, exc, text = BAD[bad]
    comms = group(2)
    try:
        if call == "compiled":
            torch._dynamo.reset()
            fns = [torch.compile(lambda x, c=c: c.all_reduce(x), backend="aot_eager",
                                 fullgraph=True) for c in comms]
        else:
            fns = [lambda x, c=c: CALLS[call](c, x) for c in comms]
        xs = [make(torch.ones(4, 16)) for _ in comms]
        for r, e in enumerate(threads(comms, lambda r: fns[r](xs[r]))):
            assert isinstance(e, exc) and isinstance(e, ValueError), (r, e)
            assert text in e.message, (r, e.message)
        exact_round(threads, comms)
        exact_round(threads, comms, "comm_inplace")
    finally:
        close(comms)


def test_one_ranks_refusal_through_the_op_reaches_its_peers(threads):
    comms = group(4)
    try:
        def rank(r):
            x = torch.ones(4, 16)
            return ops.all_reduce(x.int() if r == 2 else x, comms[r].key)

        results = threads(comms, rank)
        for r, e in enumerate(results):
            want = allreduce.UnsupportedType if r == 2 else allreduce.PeerRejected
            assert isinstance(e, want), (r, e)
            # The peers read rank 2's own reason.
            assert results[2].message in e.message, (r, e.message)
        exact_round(threads, comms)
    finally:
        close(comms)


def test_tensors_autograd_tracks_take_the_direct_path_and_are_refused(threads):
    comms = group(2)
    try:
        xs = [torch.ones(16, requires_grad=True) for _ in comms]
        for r, e in enumerate(threads(comms, lambda r: comms[r].all_reduce(xs[r]))):
            assert isinstance(e, allreduce.InvalidArgument) and "read-only" in e.message, e
        exact_round(threads, comms, "comm_inplace")
    finally:
        close(comms)


def test_a_key_with_no_open_communicator_is_refused():
    comms = group(2)
    key = comms[0].key
    close(comms)
    for k in (key, 0, -1):
        with pytest.raises(allreduce.InvalidUsage, match="no open communicator"):
            ops.all_reduce(torch.ones(4), k)


def interpreter(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_allreduce_loads_no_torch_and_after_torch_registers_the_ops():
    assert interpreter("import sys, allreduce; print('torch' in sys.modules)") == "False"
    assert interpreter("import torch, allreduce; print(torch.ops.allreduce.all_reduce)") == \
        "allreduce.all_reduce"


def fused_outputs(x):
    return torch.empty_like(x), torch.empty_like(x)


def fused_op(comm, ws, x, residual, gamma):
    res_out, norm = fused_outputs(x)
    ops.all_reduce_fused(x, comm.key, ws.key, residual, res_out, norm, None, None, gamma, 1e-6,
                         None, None, None, None, 0.0)
    return res_out, norm


def fused_comm(comm, ws, x, residual, gamma):
    res_out, norm = fused_outputs(x)
    comm.all_reduce_fused(ws, x, residual_in=residual, residual_out=res_out, norm_out=norm,
                          rms_gamma=gamma)
    return res_out, norm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_op_is_the_direct_call_bit_for_bit_also_compiled(threads, dtype):
    """``torch.ops.allreduce.all_reduce_fused`` called directly, and the fused call inside
    ``torch.compile(fullgraph=True)`` (one graph, the op in it), give the direct call's bits."""
    torch._dynamo.reset()
    world, tokens, hidden = 2, 4, 64
    tdtype = TORCH_DTYPES[dtype]
    comms = group(world)
    wss = allreduce.FusedWorkspace.group(comms, 8, hidden, tdtype)
    try:
        gen = torch.Generator().manual_seed(3)
        xs = [torch.randn(tokens, hidden, generator=gen).to(tdtype) for _ in range(world)]
        residual = torch.randn(tokens, hidden, generator=gen).to(tdtype)
        gamma = torch.randn(hidden, generator=gen).to(tdtype)

        def compiled(comm, ws):
            def step(x, residual, gamma):
                res_out, norm = fused_outputs(x)
                comm.all_reduce_fused(ws, x, residual_in=residual, residual_out=res_out,
                                      norm_out=norm, rms_gamma=gamma)
                return res_out * 1, norm * 1

            counter = CompileCounterWithBackend("aot_eager")
            return torch.compile(step, backend=counter, fullgraph=True), counter

        steps = [compiled(c, w) for c, w in zip(comms, wss)]
        results = {}
        for how, fn in [("comm", fused_comm), ("op", fused_op)]:
            results[how] = values(threads(comms, lambda r: fn(comms[r], wss[r], xs[r].clone(),
                                                               residual, gamma)))
        results["compiled"] = values(threads(
            comms, lambda r: steps[r][0](xs[r].clone(), residual, gamma)))
        for how in ("op", "compiled"):
            for r in range(world):
                for i, what in enumerate(("residual_out", "norm_out")):
                    got, want = results[how][r][i], results["comm"][r][i]
                    assert torch.equal(got.view(torch.int16 if dtype == "bfloat16"
                                                else torch.int32),
                                       want.view(torch.int16 if dtype == "bfloat16"
                                                 else torch.int32)), (how, r, what)
        assert torch.equal(results["comm"][0][1], results["comm"][1][1])
        for step, counter in steps:
            assert counter.frame_count == 1, "one graph, compiled once"
            assert "torch.ops.allreduce.all_reduce_fused" in counter.graphs[0].code
    finally:
        for w in wss:
            w.close()
        close(comms)


def test_the_fused_fake_passes_opcheck():
    (comm,) = group(1)
    (ws,) = allreduce.FusedWorkspace.group([comm], 4, 32, torch.float32)
    try:
        x = torch.randn(2, 32)
        args = (x.clone(), comm.key, ws.key, torch.randn(2, 32), torch.empty(2, 32),
                torch.empty(2, 32), None, None, torch.randn(32), 1e-6, None, None, None, None,
                0.0)
        torch.library.opcheck(ops.all_reduce_fused, args)
    finally:
        ws.close()
        comm.close()
