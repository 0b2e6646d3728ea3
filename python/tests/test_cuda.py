"""The CUDA path with real torch tensors, on one GPU. Skipped (with the reason) where torch has
no CUDA, as in CI; python/run-gpu-tests.sh runs it on a GPU machine against a library built
with ``--features cuda``:

- virtual ranks (an in-process group whose ranks are threads, each on its own stream): exact
  calls bit for bit the rank-order reference, a lossy call bit for bit the host backend's,
  and a CUDA graph of three calls through the torch ops replayed 100 times;
- one process per rank: 2, 4 and 8 processes on the GPU, spawned by torch.multiprocessing,
  each rank built by ``Communicator.from_process_group`` over a gloo group; exact and lossy,
  in place and not, against the same references and torch.distributed's (gloo) sums of the
  same tensors on the CPU;
- examples/python/tp_linear.py with ``--device cuda`` under torchrun.

Rules of virtual ranks (every rank's kernels wait for the others'): a rank's buffers exist
before any rank's first call, and nothing synchronizes the whole device while a peer's
kernel may be waiting for this rank; ``torch.cuda.graph`` synchronizes the device and frees
cached memory when it starts capturing, hence the barriers around the capture. Several
processes on one GPU need MPS and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in every process,
the first included. Needs neither numpy nor pytest: ``python3 python/tests/test_cuda.py``
runs every test.
"""

import os

# Before any CUDA call: under MPS every client's hardware queues count against the server's
# limit, and with the default (8) only 3 clients got a context on an H200.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

try:
    import torch
except ImportError:  # CI's tests without torch
    torch = None

import allreduce  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "tp_linear.py"
TIMEOUT = 30.0  # seconds any wait for a peer in a call may last
MAX_BYTES = 1 << 24  # the same for the GPU and host groups, so both run a call in one piece
REPLAYS = 100
# Each process-per-rank call: (dtype, precision, in place, elements).
PROCESS_CALLS = [
    ("float32", "exact", False, 4097),
    ("bfloat16", "exact", True, 1 << 20),
    ("float16", "exact", False, 70_001),
    ("bfloat16", "q8", False, 1 << 16),
    ("bfloat16", "q8", True, 1 << 16),
]


def _skip_reason():
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def _skip_if_no_cuda():
    reason = _skip_reason()
    if reason:
        import pytest

        pytest.skip(reason)


def _dtype(name):
    return getattr(torch, name)


def _gauss(rank, n, dtype, seed):
    """Rank ``rank``'s input, on the CPU: magnitudes over several binades, so the sums round
    and the order of accumulation shows in the bits."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    scale = torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    return (torch.randn(n, generator=g) * scale).to(dtype)


def _reference(xs):
    """The exact contract: f32 accumulation in rank order from rank 0's value, one rounding."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bitwise(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    diff = (_bits(got) != _bits(want)).nonzero().flatten()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} of {got.numel()} elements differ, "
                               f"first at {diff[0].item()}: {got[diff[0]].item()} != "
                               f"{want[diff[0]].item()}")


def _q8_bound(xs, total):
    """docs/codecs.md's bound ("Error bound", "Composition in the all-reduce") on each element
    of a q8 all-reduce of ``xs`` against ``total``, a float32 sum of them: c (2 + c) A per
    32-element block (c = 255/16384, q8's step bound over the block's largest magnitude; A
    the sum over ranks of each rank's largest magnitude in the block), plus both sums' f32
    roundings and the rounding into bfloat16."""
    c = 255 / 16384
    a = sum(x.float().abs().reshape(-1, 32).amax(dim=1) for x in xs)
    magnitude = sum(x.float().abs() for x in xs)
    return (1.001 * c * (2 + c) * a.repeat_interleave(32) + 1.01 * 2**-8 * total.abs()
            + 2 * len(xs) * 2**-24 * magnitude + 2**-133)


def _on_threads(count, fn):
    """``fn(i)`` on one thread each; the results, re-raising the first failure."""
    results, errors = [None] * count, [None] * count

    def run(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10 * TIMEOUT)
        assert not t.is_alive(), "a rank never returned"
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if failed:
        # Every rank's error: which rank failed first (and how) tells a peer's timeout from
        # its cause.
        raise AssertionError("; ".join(f"rank {i}: {e!r}" for i, e in failed)) from failed[0][1]
    return results


def _host_result(xs, precision, strategy):
    """The host backend's result for the same inputs: every backend's is the same bits."""
    comms = allreduce.Communicator.group(len(xs), max_bytes=MAX_BYTES, timeout=TIMEOUT)
    try:
        outs = [torch.empty_like(x) for x in xs]
        _on_threads(len(xs), lambda r: comms[r].all_reduce(
            xs[r].clone(), out=outs[r], precision=precision, strategy=strategy))
        return outs[0]
    finally:
        for c in comms:
            c.close()


def _run_ranks(world, body, group=None):
    """``body(rank, comm, stream, ready)`` on one thread per rank of a virtual-rank group on
    this GPU, each on its own stream (on one shared stream a rank's kernel would wait behind
    the others' while they wait for it); ``ready`` is a barrier of the ranks. The bodies'
    results, in rank order. ``group``: a list that receives every rank's communicator."""
    dev = torch.cuda.current_device()
    comms = allreduce.Communicator.group(world, backend="cuda", devices=[dev] * world,
                                         max_bytes=MAX_BYTES, timeout=TIMEOUT)
    if group is not None:
        group.extend(comms)
    ready = threading.Barrier(world, timeout=5 * TIMEOUT)

    def rank(r):
        try:
            torch.cuda.set_device(dev)  # the current device is the thread's own
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                # A stream's first kernel launch may wait for the device: done here, before
                # any rank's first call.
                torch.zeros(1, device="cuda")
                s.synchronize()
                result = body(r, comms[r], s, ready)
            s.synchronize()
            return result
        except BaseException:
            ready.abort()  # the peers stop waiting for this rank at the barrier
            raise

    try:
        return _on_threads(world, rank)
    finally:
        for c in comms:
            c.close()


def test_virtual_ranks_exact_in_and_out_of_place():
    _skip_if_no_cuda()
    for world in (2, 4):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for n in (8, 4097, 1 << 20):
                xs = [_gauss(r, n, dtype, seed=n) for r in range(world)]
                want = _reference(xs)

                def body(r, comm, s, ready):
                    x = xs[r].cuda()
                    out = torch.empty_like(x)
                    ready.wait()  # every rank's buffers exist before any rank's first call
                    comm.all_reduce(x, out=out)
                    comm.all_reduce(x)  # in place
                    comm.synchronize(s)  # raises what the device recorded (a timeout)
                    return out.cpu(), x.cpu()

                for r, (out, x) in enumerate(_run_ranks(world, body)):
                    what = f"world {world} {dtype} n {n} rank {r}"
                    _assert_bitwise(out, want, f"{what}: out of place")
                    _assert_bitwise(x, want, f"{what}: in place")


def test_virtual_ranks_a_refusal_of_the_bindings_reaches_the_peers():
    """Rank 1 passes a list, which this binding refuses itself (``ar_reject``, on the rank's
    current stream): rank 0's call fails with PeerRejected naming rank 1 (at synchronize),
    well before the deadline, and the next call of both is exact. On a GPU the reason's text
    does not travel, only the refusal."""
    _skip_if_no_cuda()
    world, n = 2, 4096
    xs = [_gauss(r, n, torch.float32, seed=5) for r in range(world)]
    want = _reference(xs)

    def body(r, comm, s, ready):
        x = xs[r].cuda()
        ready.wait()
        refused = None
        try:
            comm.all_reduce(xs[r].tolist() if r == 1 else x.clone())
            comm.synchronize(s)
        except allreduce.Error as e:
            refused = e
        comm.all_reduce(x)
        comm.synchronize(s)
        return refused, x.cpu()

    start = time.monotonic()
    results = _run_ranks(world, body)
    assert time.monotonic() - start < TIMEOUT / 2, time.monotonic() - start
    (e0, x0), (e1, x1) = results
    assert isinstance(e1, allreduce.UnsupportedType), e1
    assert isinstance(e0, allreduce.PeerRejected) and "rank 1" in e0.message, e0
    _assert_bitwise(x0, want, "rank 0 after the refusal")
    _assert_bitwise(x1, want, "rank 1 after the refusal")


def test_virtual_ranks_lossy_is_the_host_backends_result():
    _skip_if_no_cuda()
    world, n = 4, 1 << 16
    xs = [_gauss(r, n, torch.bfloat16, seed=5) for r in range(world)]

    def body(r, comm, s, ready):
        x = xs[r].cuda()
        ready.wait()
        comm.all_reduce(x, precision="q8", strategy="quantized")
        s.synchronize()
        return x.cpu()

    outs = _run_ranks(world, body)
    want = _host_result(xs, "q8", "quantized")
    for r in range(world):
        _assert_bitwise(outs[r], want, f"rank {r}")
    assert (_bits(want) != _bits(_reference(xs))).any(), "no codec ran"
    exact = _reference([x.float() for x in xs])
    err = (outs[0].float() - exact).abs()
    assert (err <= _q8_bound(xs, exact)).all(), f"q8 error {err.max().item()}"


def test_virtual_ranks_graph_of_three_op_calls_replayed_100_times():
    _skip_if_no_cuda()
    world = 2
    # (dtype, elements) of the graph's calls: out of place, in place on a copy made in the
    # graph, and the op itself with an explicit strategy.
    calls = [(torch.float32, 4097), (torch.bfloat16, 8192), (torch.float16, 1000)]
    # Inputs of the eager round (0) and of each replay, made on the CPU beforehand: nothing
    # allocates on the GPU while a peer's kernel may be waiting.
    inputs = [[[_gauss(r, n, dt, seed=100 * k + j) for j, (dt, n) in enumerate(calls)]
               for r in range(world)] for k in range(REPLAYS + 1)]

    def body(r, comm, s, ready):
        xs = [torch.empty(n, dtype=dt, device="cuda") for dt, n in calls]
        outs = [torch.empty_like(x) for x in xs]

        def enqueue():
            comm.all_reduce(xs[0], out=outs[0])
            outs[1].copy_(xs[1])
            comm.all_reduce(outs[1])
            torch.ops.allreduce.all_reduce_out(xs[2], outs[2], comm.key, "exact", "oneshot")

        def load(k):
            for x, host in zip(xs, inputs[k][r]):
                x.copy_(host)

        # Every kernel of the replay loop runs once here: CUDA loads a kernel on its first
        # launch and may synchronize the device to do so, which would wait for a peer's
        # kernel that waits for this rank.
        for o in outs:
            o.zero_()
        s.synchronize()
        got = []
        ready.wait()
        load(0)
        enqueue()  # eager first: a group's first call is not captured
        s.synchronize()
        got.append([o.cpu() for o in outs])
        ready.wait()  # no rank has work in flight when the captures synchronize the device
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            enqueue()
        ready.wait()  # every rank is out of its capture before any rank replays
        for k in range(1, REPLAYS + 1):
            for o in outs:
                o.zero_()
            load(k)
            g.replay()
            got.append([o.cpu() for o in outs])  # waits for this replay on s
        s.synchronize()
        ready.wait()  # no peer still replays when this rank's graph is destroyed
        del g
        return got

    results = _run_ranks(world, body)
    for k in range(REPLAYS + 1):
        for j in range(len(calls)):
            want = _reference([inputs[k][r][j] for r in range(world)])
            for r in range(world):
                what = f"{'eager' if k == 0 else f'replay {k}'}, call {j}, rank {r}"
                _assert_bitwise(results[r][k][j], want, what)


def test_virtual_ranks_graph_buffers_registered_after_capture():
    """vLLM's graph mode: calls captured on plain tensors with graph registration on read
    every rank's input in place once the graph's buffers are registered; a replay before
    that fails on every rank and writes nothing."""
    _skip_if_no_cuda()
    world, n = 2, 1 << 16
    inputs = [[_gauss(r, n, torch.bfloat16, seed=7 + k) for r in range(world)]
              for k in range(REPLAYS + 1)]
    group = []

    def body(r, comm, s, ready):
        x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        out = torch.zeros_like(x)

        def enqueue():
            comm.all_reduce(x, out=out, strategy="oneshot")

        s.synchronize()
        ready.wait()
        x.copy_(inputs[0][r])
        enqueue()
        s.synchronize()
        got = [out.cpu()]
        comm.set_graph_registration(True)
        ready.wait()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            enqueue()
        comm.set_graph_registration(False)
        ready.wait()
        out.zero_()
        g.replay()
        try:
            comm.synchronize(s)
            early = None
        except allreduce.InvalidArgument as e:
            early = str(e)
        untouched = bool((out == 0).all().item())
        ready.wait()
        if r == 0:
            assert allreduce.Communicator.register_graph_buffers(group) == 1
        ready.wait()
        for k in range(1, REPLAYS + 1):
            x.copy_(inputs[k][r])
            s.synchronize()
            ready.wait()  # every rank's new input is in place before any replay reads it
            g.replay()
            got.append(out.cpu())  # waits for this replay on s
            ready.wait()  # no rank overwrites its input while a peer's replay reads it
        s.synchronize()
        ready.wait()
        del g
        return got, early, untouched

    results = _run_ranks(world, body, group)
    for r, (got, early, untouched) in enumerate(results):
        assert early is not None and "register_graph_buffers" in early, f"rank {r}: {early}"
        assert untouched, f"rank {r}: the refused replay wrote its output"
        for k in range(REPLAYS + 1):
            want = _reference([inputs[k][q] for q in range(world)])
            _assert_bitwise(got[k], want, f"rank {r}, {'eager' if k == 0 else f'replay {k}'}")


def test_virtual_ranks_fused_torch_op_is_the_direct_call_and_the_host_backends():
    """The fused all-reduce + residual + RMSNorm through ``torch.ops.allreduce.all_reduce_fused``
    (what ``torch.compile`` traces) on CUDA tensors gives the direct call's bits, and the
    residual output is the host backend's f32 rank-order sum plus the residual."""
    _skip_if_no_cuda()
    world, tokens, hidden = 2, 8, 1024
    xs = [_gauss(r, tokens * hidden, torch.bfloat16, seed=11).reshape(tokens, hidden)
          for r in range(world)]
    residual = _gauss(9, tokens * hidden, torch.bfloat16, seed=12).reshape(tokens, hidden)
    gamma = _gauss(8, hidden, torch.bfloat16, seed=13)
    # The workspaces are made for the whole group at once, before any rank's call.
    dev = torch.cuda.current_device()
    comms = allreduce.Communicator.group(world, backend="cuda", devices=[dev] * world,
                                         max_bytes=MAX_BYTES, timeout=TIMEOUT)
    wss = allreduce.FusedWorkspace.group(comms, 16, hidden, torch.bfloat16)
    ready = threading.Barrier(world, timeout=5 * TIMEOUT)

    def rank(r):
        torch.cuda.set_device(dev)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = xs[r].cuda()
            res, g = residual.cuda(), gamma.cuda()
            outs = [(torch.empty_like(x), torch.empty_like(x)) for _ in range(2)]
            s.synchronize()
            ready.wait()
            comms[r].all_reduce_fused(wss[r], x, residual_in=res, residual_out=outs[0][0],
                                      norm_out=outs[0][1], rms_gamma=g)
            torch.ops.allreduce.all_reduce_fused(x, comms[r].key, wss[r].key, res, outs[1][0],
                                                 outs[1][1], None, None, g, 1e-6, None, None,
                                                 None, None, 0.0)
            comms[r].synchronize(s)
            s.synchronize()
            ready.wait()
            return [(a.cpu(), b.cpu()) for a, b in outs]

    try:
        results = _on_threads(world, rank)
    finally:
        for w in wss:
            w.close()
        for c in comms:
            c.close()
    want_residual = (_reference(xs).float() + residual.float()).to(torch.bfloat16)
    for r, ((res0, norm0), (res1, norm1)) in enumerate(results):
        _assert_bitwise(res1, res0, f"rank {r}: residual_out, op vs direct")
        _assert_bitwise(norm1, norm0, f"rank {r}: norm_out, op vs direct")
        _assert_bitwise(norm0, results[0][0][1], f"rank {r}: norm_out vs rank 0")
        _assert_bitwise(res0, want_residual, f"rank {r}: residual_out vs the f32 sum")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_rank(rank, world, port, out_dir):
    """One spawned rank: its results and gloo's sums, saved to ``out_dir``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.cuda.set_device(0)
    comm = allreduce.Communicator.from_process_group(backend="cuda", device=0,
                                                     max_bytes=MAX_BYTES, timeout=TIMEOUT)
    hosts = [_gauss(rank, n, _dtype(dt), seed=i)
             for i, (dt, _, _, n) in enumerate(PROCESS_CALLS)]
    gloo = []
    for h in hosts:
        t = h.to(torch.float32, copy=True)  # float() of a float32 tensor is the tensor itself
        dist.all_reduce(t)
        gloo.append(t)
    xs = [h.cuda() for h in hosts]
    outs = [x if in_place else torch.empty_like(x)
            for x, (_, _, in_place, _) in zip(xs, PROCESS_CALLS)]
    torch.cuda.synchronize()
    dist.barrier()
    for x, out, (_, precision, in_place, _) in zip(xs, outs, PROCESS_CALLS):
        strategy = "auto" if precision == "exact" else "quantized"
        comm.all_reduce(x, out=None if in_place else out, precision=precision,
                        strategy=strategy)
    torch.cuda.synchronize()
    torch.save({"ours": [o.cpu() for o in outs], "gloo": gloo},
               os.path.join(out_dir, f"rank{rank}.pt"))
    comm.close()
    dist.barrier()
    dist.destroy_process_group()
    # os._exit, not a return: torch 2.11's gloo worker thread may drop its last tensor while
    # the interpreter shuts down, and then aborts the process.
    sys.stdout.flush()
    os._exit(0)


def _processes(world):
    _skip_if_no_cuda()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_process_rank, args=(world, _free_port(), tmp), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + 300
        try:
            while not ctx.join(timeout=5):
                assert time.monotonic() < deadline, f"{world} processes still running at 300 s"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]

    for i, (dt, precision, in_place, n) in enumerate(PROCESS_CALLS):
        what = f"{world} processes, {dt} {precision} {'in place' if in_place else 'out'} n {n}"
        xs = [_gauss(r, n, _dtype(dt), seed=i) for r in range(world)]
        gloo = results[0]["gloo"][i]
        if precision == "exact":
            want = _reference(xs)
        else:
            want = _host_result(xs, precision, "quantized")
            assert (_bits(want) != _bits(_reference(xs))).any(), f"{what}: no codec ran"
        for r in range(world):
            ours = results[r]["ours"][i]
            _assert_bitwise(ours, want, f"{what}, rank {r}")
            # torch.distributed sums in an order of its own: equal up to the f32 roundings of
            # both sums and the rounding into the dtype (exact), or within the codec's error.
            err = (ours.float() - gloo).abs()
            if precision == "exact":
                unit, tiny = {"float32": (2**-24, 2**-149), "float16": (2**-11, 2**-25),
                              "bfloat16": (2**-8, 2**-133)}[dt]
                magnitude = sum(x.float().abs() for x in xs)
                bound = 1.01 * (2 * world * 2**-24 * magnitude + unit * gloo.abs()) + tiny
                assert (err <= bound).all(), f"{what}, rank {r}: {err.max().item()} from gloo"
            else:
                assert (err <= _q8_bound(xs, gloo)).all(), f"{what}, rank {r}: {err.max()}"


def test_two_processes():
    _processes(2)


def test_four_processes():
    _processes(4)


def test_eight_processes():
    _processes(8)


def test_tp_linear_example_on_the_gpu():
    _skip_if_no_cuda()
    for world, dtype in ((2, "float32"), (4, "bfloat16")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), str(EXAMPLE), "--device", "cuda",
               "--dtype", dtype]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("rank ")]
        assert len(lines) == world and all(ln.endswith("; ok") for ln in lines), out


if __name__ == "__main__":
    reason = _skip_reason()
    if reason:
        print(f"skipped: {reason}")
        sys.exit(0)
    tests = [(name, f) for name, f in list(globals().items())
             if name.startswith("test_") and callable(f)]
    failed = 0
    for name, f in tests:
        start = time.monotonic()
        try:
            f()
            print(f"{name}: ok ({time.monotonic() - start:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001 - reported, then the next test runs
            failed += 1
            traceback.print_exc()
            print(f"{name}: FAILED ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
