"""The CUDA path with real torch tensors: several ranks on one GPU ("virtual ranks"), each driven
from its own thread on its own stream. Skipped (with the reason) where torch has no CUDA, as in
CI; run on a GPU machine with the library built with ``--features cuda``:

    ALLREDUCE_LIB=.../liballreduce_c.so PYTHONPATH=python python3 python/tests/test_cuda.py

Virtual ranks need their own streams: on one shared stream each rank's kernel would wait
behind the others' while they wait for it.
"""

import threading

try:
    import torch
except ImportError:  # CI installs no torch
    torch = None

import allreduce


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


def _run_ranks(world, body):
    """`body(rank, comm, stream)` on one thread per rank; every exception is re-raised."""
    comms = allreduce.Communicator.group(world, backend="cuda")
    errors = [None] * world
    results = [None] * world

    def run(r):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                results[r] = body(r, comms[r], s)
            s.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported below, per rank
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in comms:
        c.close()
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r}: {e!r}") from e
    return results


def _ints(r, n, dtype):
    # Small integers: every sum is exact in every dtype, whatever the order.
    i = torch.arange(n, device="cuda")
    return (((i * 7 + r * 3) % 11) - 5).to(dtype)


def test_exact_in_and_out_of_place():
    _skip_if_no_cuda()
    for world in (2, 4):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for n in (8, 4096, 1 << 20):
                want = sum(_ints(r, n, torch.float32) for r in range(world)).to(dtype)

                def body(r, comm, s):
                    x = _ints(r, n, dtype)
                    out = torch.empty_like(x)
                    comm.all_reduce(x, out=out)
                    comm.all_reduce(x)  # in place
                    s.synchronize()
                    return out.cpu(), x.cpu()

                for r, (out, x) in enumerate(_run_ranks(world, body)):
                    what = f"world {world} {dtype} n {n} rank {r}"
                    assert torch.equal(out, want.cpu()), f"{what}: out of place"
                    assert torch.equal(x, want.cpu()), f"{what}: in place"


def test_lossy_same_bits_on_every_rank():
    _skip_if_no_cuda()
    world, n = 4, 1 << 16
    gen = torch.Generator(device="cpu").manual_seed(5)
    xs = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(world)]
    exact = sum(x.float() for x in xs)

    def body(r, comm, s):
        x = xs[r].cuda()
        comm.all_reduce(x, precision="q8")
        s.synchronize()
        return x.cpu()

    outs = _run_ranks(world, body)
    for r in range(1, world):
        assert torch.equal(outs[r], outs[0]), f"rank {r} differs from rank 0"
    err = (outs[0].float() - exact).abs().max().item()
    assert 0 < err < 0.05 * exact.abs().max().item(), f"q8 error {err}"


def test_graph_of_three_calls_replayed():
    _skip_if_no_cuda()
    world, n = 2, 4096

    def body(r, comm, s):
        x = _ints(r, n, torch.float32)
        outs = [torch.empty_like(x) for _ in range(3)]
        comm.all_reduce(x, out=outs[0])  # eager first: the group's first call is not captured
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        # Thread-local capture: the other rank's thread captures its own graph meanwhile.
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            for o in outs:
                comm.all_reduce(x, out=o)
        results = []
        for k in range(10):
            for o in outs:
                o.zero_()
            x.copy_(_ints(r, n, torch.float32) * (k + 1))
            g.replay()
            s.synchronize()
            results.append([o.cpu() for o in outs])
        return results

    res = _run_ranks(world, body)
    for k in range(10):
        want = sum(_ints(r, n, torch.float32) for r in range(world)).cpu() * (k + 1)
        for r in range(world):
            for j, o in enumerate(res[r][k]):
                assert torch.equal(o, want), f"replay {k} rank {r} call {j}"


if __name__ == "__main__":
    reason = _skip_reason()
    if reason:
        print(f"skipped: {reason}")
    else:
        for name, f in list(globals().items()):
            if name.startswith("test_") and callable(f):
                f()
                print(f"{name}: ok")
