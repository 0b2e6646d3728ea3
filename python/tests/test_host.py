"""The package on the host backend: ranks are threads of this process, results are checked
bit for bit against the library's contract (f32 accumulation in rank order from rank 0's
value, one rounding into the dtype), and every refusal is checked for its exception and for
the group computing exactly afterwards."""

import gc
import re
import threading
import time

import numpy as np
import pytest

import allreduce
from allreduce import Communicator, _lib
from ranks import TIMEOUT, assert_bitwise, bits, inputs, on_ranks, reference, values

try:
    import ml_dtypes

    BF16 = [np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # the binding takes bfloat16 only through ml_dtypes
    BF16 = []

MAX_BYTES = 1 << 20


def exact_round(comms, dtype=np.float32, n=1000, in_place=False, strategy="auto", seed=0):
    xs = [inputs(dtype, n, r, seed) for r in range(len(comms))]
    want = reference(xs)
    if in_place:
        got = values(on_ranks(comms, lambda r: comms[r].all_reduce(xs[r], strategy=strategy)))
    else:
        outs = [np.empty_like(x) for x in xs]
        got = values(on_ranks(
            comms, lambda r: comms[r].all_reduce(xs[r], outs[r], strategy=strategy)))
        assert all(g is o for g, o in zip(got, outs)), "all_reduce returns out"
    for r, g in enumerate(got):
        assert_bitwise(g, want, f"rank {r} {np.dtype(dtype)} n={n} {strategy}")


@pytest.fixture
def group4():
    comms = Communicator.group(4, max_bytes=MAX_BYTES, timeout=TIMEOUT)
    yield comms
    for c in comms:
        c.close()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)] + BF16,
                         ids=str)
@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
def test_exact_sum_equals_the_rank_order_reference_bit_for_bit(world, dtype, in_place):
    comms = Communicator.group(world, max_bytes=MAX_BYTES, timeout=TIMEOUT)
    try:
        for n in (1, 1000, 4096):
            for strategy in ("auto", "oneshot", "twoshot"):
                exact_round(comms, dtype, n, in_place, strategy, seed=n)
    finally:
        for c in comms:
            c.close()


def test_the_reference_is_order_sensitive():
    """Guards the test above: a sum in another order would not pass it."""
    xs = [inputs(np.float32, 4096, r, 4096) for r in range(4)]
    assert (bits(reference(xs)) != bits(reference(xs[::-1]))).any()


def test_shapes_keep_their_shape_and_empty_calls_succeed(group4):
    xs = [inputs(np.float16, 8 * 125, r).reshape(8, 125) for r in range(4)]
    want = reference(xs)
    for r, g in enumerate(values(on_ranks(group4, lambda r: group4[r].all_reduce(xs[r])))):
        assert g is xs[r]
        assert_bitwise(g, want, f"rank {r}")
    empty = [np.empty(0, np.float32) for _ in range(4)]
    values(on_ranks(group4, lambda r: group4[r].all_reduce(empty[r])))
    exact_round(group4)


def test_four_ranks_on_four_threads_block_in_the_library_together(group4):
    # Rank 0 enters ar_all_reduce first and waits there for its peers: were the GIL held
    # across the C call, no peer could run and every rank would time out.
    xs = [inputs(np.float32, 4096, r) for r in range(4)]
    start = time.monotonic()

    def rank(r):
        time.sleep(0.05 * r)
        return group4[r].all_reduce(xs[r])

    values(on_ranks(group4, rank))
    assert time.monotonic() - start < TIMEOUT / 2
    want = reference([inputs(np.float32, 4096, r) for r in range(4)])
    for x in xs:
        assert_bitwise(x, want)


def test_queries_describe_the_communicator(group4):
    for r, c in enumerate(group4):
        assert (c.rank, c.world_size, c.backend, c.device) == (r, 4, "host", -1)
        assert (c.alignment, c.max_bytes) == (16, MAX_BYTES)
        assert c.synchronize() is None
        assert "rank %d/4" % r in repr(c)
    assert allreduce.library_version() == 100


# Every rank makes the same mistake: each raises, none reaches a peer that waits.
BAD_CALLS = [
    ("non-contiguous", lambda x, r: (x[::2], None), allreduce.InvalidArgument, "contiguous"),
    ("int32", lambda x, r: (x.astype(np.int32), None), allreduce.UnsupportedType, "int32"),
    ("float64", lambda x, r: (x.astype(np.float64), None), allreduce.UnsupportedType,
     "float64"),
    ("a list", lambda x, r: (list(x), None), allreduce.UnsupportedType, "list"),
    ("out of another size", lambda x, r: (x, np.empty(x.size - 4, x.dtype)),
     allreduce.LengthMismatch, "elements"),
    ("out of another dtype", lambda x, r: (x, np.empty(x.size, np.float16)),
     allreduce.DTypeMismatch, "float16"),
    ("out of another shape", lambda x, r: (x, np.empty((2, x.size // 2), x.dtype)),
     allreduce.InvalidArgument, "shape"),
    ("read-only in place", lambda x, r: (np.frombuffer(x.tobytes(), x.dtype), None),
     allreduce.InvalidArgument, "read-only"),
    # Refused by the library itself: its code, its message.
    ("misaligned", lambda x, r: (np.zeros(x.size + 4, x.dtype)[1:x.size + 1], None),
     allreduce.Misaligned, "not aligned to 16"),
    ("overlapping out", lambda x, r: (lambda b: (b[:x.size], b[4:x.size + 4]))(
        np.zeros(x.size + 4, x.dtype)), allreduce.InvalidArgument, "overlap"),
]


@pytest.mark.parametrize("what,make,exc,text", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_refusals_on_every_rank_raise_and_leave_the_group_exact(group4, what, make, exc, text):
    n = 256
    results = on_ranks(group4, lambda r: group4[r].all_reduce(*make(inputs(np.float32, n, r), r)))
    for r, e in enumerate(results):
        assert isinstance(e, exc), (r, e)
        assert re.search(text, e.message), (r, e.message)
        assert isinstance(e, allreduce.Error) and isinstance(e, ValueError), (r, e)
        assert not e.rebuild
        assert str(e).startswith(e.code_name + ": ")
    exact_round(group4, n=n)


def test_type_refusals_are_also_type_errors(group4):
    def rank(r):
        with pytest.raises(TypeError):
            group4[r].all_reduce(np.arange(16, dtype=np.int32))

    values(on_ranks(group4, rank))
    exact_round(group4)


@pytest.mark.parametrize("kwargs,exc,text", [
    ({"precision": "q3"}, allreduce.InvalidArgument, "precision 'q3'"),
    ({"strategy": "ring"}, allreduce.InvalidArgument, "strategy 'ring'"),
    ({"precision": "q8"}, allreduce.UnsupportedCodec, "q8"),  # codecs take 16-bit data only
    ({"strategy": "vendor"}, allreduce.StrategyUnavailable, "vendor"),
    ({"strategy": "vendor-symmetric"}, allreduce.StrategyUnavailable, "vendor-symmetric"),
    ({"stream": "default"}, allreduce.UnsupportedType, "stream"),
])
def test_option_refusals_raise_and_leave_the_group_exact(group4, kwargs, exc, text):
    def rank(r):
        with pytest.raises(exc, match=text):
            group4[r].all_reduce(inputs(np.float32, 64, r), **kwargs)

    values(on_ranks(group4, rank))
    exact_round(group4)


def test_abort_releases_waiting_ranks_and_closes_the_communicator():
    """A rank that never calls aborts from another thread: its waiting peers raise Aborted
    at once (not at the deadline), later calls too; the aborted rank is closed."""
    comms = allreduce.Communicator.group(3, timeout=10.0)
    errors = [None] * 3

    def wait(r):
        try:
            comms[r].all_reduce(inputs(np.float32, 64, r))
        except allreduce.Aborted as e:
            errors[r] = e

    threads = [threading.Thread(target=wait, args=(r,)) for r in (0, 2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(0.2)
    comms[1].abort()
    for t in threads:
        t.join()
    assert time.monotonic() - start < 3
    assert all("rank 1 aborted" in str(errors[r]) for r in (0, 2)), errors
    with pytest.raises(allreduce.InvalidUsage):
        comms[1].abort()
    with pytest.raises(allreduce.Aborted):
        comms[0].all_reduce(inputs(np.float32, 64, 0))
    comms[0].close()
    comms[2].close()


def test_the_host_backend_has_no_vendor_window(group4):
    assert all(c.vendor_window() is None for c in group4)


def test_one_ranks_refusal_reaches_its_peers_at_once(group4):
    """A refusal on one rank (the binding's or the library's) makes the peers' call fail with
    PeerRejected within the deadline, not time out, and with the refusing rank's own reason;
    the group stays exact."""
    n = 256
    for culprit, bad, exc in [
        (1, lambda x: (x.astype(np.int32), {}), allreduce.UnsupportedType),
        (3, lambda x: (x[::2], {}), allreduce.InvalidArgument),
        (0, lambda x: (x.tolist(), {}), allreduce.UnsupportedType),
        (0, lambda x: (x, {"precision": "q9"}), allreduce.InvalidArgument),
        (2, lambda x: (x, {"out": np.zeros(n, np.float16)}), allreduce.DTypeMismatch),
        (2, lambda x: (np.zeros(n + 4, np.float32)[1:n + 1], {}), allreduce.Misaligned),
    ]:
        start = time.monotonic()

        def rank(r):
            x = inputs(np.float32, n, r)
            x, options = bad(x) if r == culprit else (x, {})
            return group4[r].all_reduce(x, **options)

        results = on_ranks(group4, rank)
        assert time.monotonic() - start < TIMEOUT / 2
        reason = results[culprit]
        assert isinstance(reason, exc), (culprit, reason)
        for r, e in enumerate(results):
            if r != culprit:
                assert isinstance(e, allreduce.PeerRejected), (r, e)
                assert f"rank {culprit} rejected" in e.message, e.message
                # The peers read the culprit's own reason, not a stand-in's.
                assert reason.message in e.message, (reason.message, e.message)
        exact_round(group4, n=n)


def test_ranks_that_disagree_get_rank_mismatch_and_stay_exact(group4):
    def rank(r):
        return group4[r].all_reduce(inputs(np.float32, 250 if r == 2 else 256, r))

    for r, e in enumerate(on_ranks(group4, rank)):
        assert isinstance(e, allreduce.RankMismatch), (r, e)
        assert not e.rebuild
    exact_round(group4, np.float16, 999)


def test_a_call_over_max_bytes_is_too_large_on_the_host():
    comms = Communicator.group(2, max_bytes=4096, timeout=TIMEOUT)
    try:
        def rank(r):
            with pytest.raises(allreduce.TooLarge, match="exceed"):
                comms[r].all_reduce(np.zeros(1025, np.float32))

        values(on_ranks(comms, rank))
        exact_round(comms, n=1024)
    finally:
        for c in comms:
            c.close()


def test_closed_communicators_refuse_calls(group4):
    comms = Communicator.group(2, timeout=TIMEOUT)
    comms[0].close()
    assert comms[0].closed
    comms[0].close()  # idempotent
    x = np.ones(16, np.float32)
    with pytest.raises(allreduce.InvalidUsage, match="closed"):
        comms[0].all_reduce(x)
    with pytest.raises(allreduce.InvalidUsage):
        comms[0].synchronize()
    assert (x == 1).all()
    with comms[1] as c:
        assert c.rank == 1
    assert comms[1].closed
    exact_round(group4)


def test_a_rank_driven_from_two_threads_at_once_refuses_the_second(group4):
    xs = [inputs(np.float32, 64, r) for r in range(4)]
    first = threading.Thread(target=group4[0].all_reduce, args=(xs[0],), daemon=True)
    first.start()
    time.sleep(0.2)  # rank 0 is now waiting in the library for its peers
    with pytest.raises(allreduce.InvalidUsage, match="another thread"):
        group4[0].all_reduce(np.zeros(64, np.float32))
    values(on_ranks(group4[1:], lambda r: group4[r + 1].all_reduce(xs[r + 1])))
    first.join(TIMEOUT)
    assert not first.is_alive()
    want = reference([inputs(np.float32, 64, r) for r in range(4)])
    for x in xs:
        assert_bitwise(x, want)


def test_a_missing_peer_times_out_and_the_group_then_reports_aborted():
    comms = Communicator.group(2, timeout=0.2)
    try:
        with pytest.raises(allreduce.Timeout) as info:
            comms[0].all_reduce(np.ones(8, np.float32))
        assert info.value.rebuild
        with pytest.raises(allreduce.Aborted):
            comms[1].all_reduce(np.ones(8, np.float32))
        with pytest.raises(allreduce.Aborted):
            comms[0].synchronize()
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("kwargs,exc", [
    ({"world": 0}, allreduce.InvalidConfig),
    ({"world": 2, "max_bytes": 0}, allreduce.InvalidConfig),
    ({"world": 2, "timeout": 0}, allreduce.InvalidConfig),
    ({"world": 2, "timeout": float("nan")}, allreduce.InvalidConfig),
    ({"world": 2, "devices": [0]}, allreduce.InvalidConfig),
    ({"world": 2, "backend": "tpu"}, allreduce.InvalidArgument),
    ({"world": 2.0}, allreduce.UnsupportedType),
])
def test_group_refusals(kwargs, exc):
    with pytest.raises(exc):
        Communicator.group(**kwargs)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_a_gpu_backend_not_compiled_in_says_so(backend):
    # The library CI builds has the host backend only; a GPU build on a machine without the
    # driver reports the missing driver instead.
    with pytest.raises((allreduce.BackendNotBuilt, allreduce.LibraryUnavailable)) as info:
        Communicator.group(2, backend=backend)
    assert backend in str(info.value).lower()


def test_host_memory_on_a_gpu_communicator_is_refused_before_the_library():
    # Python's own check: a numpy address handed to a GPU backend would be dereferenced on
    # the device. No GPU group can be built here, so the check is driven on a host group
    # posing as one.
    comms = Communicator.group(2, timeout=TIMEOUT)
    try:
        for c in comms:
            c.backend, c.device = "cuda", 0

        def rank(r):
            with pytest.raises(allreduce.WrongDevice, match="host memory"):
                comms[r].all_reduce(np.ones(16, np.float32))

        values(on_ranks(comms, rank))
    finally:
        for c in comms:
            c.close()


def test_dropped_communicators_release_their_ranks():
    comms = Communicator.group(2, timeout=TIMEOUT)
    del comms
    gc.collect()  # __del__ closed both; nothing raised


# codecs.md, "Error bound": per 32-element block, |out - sum| <= c·(2 + c)·A plus the output
# rounding, with A the sum over ranks of each rank's largest magnitude in the block and c the
# codec's step_bound slope.
CODEC_SLOPE = {"q8": 255 / 16384, "fp8": (1 + 2**-7) / 32}


@pytest.mark.parametrize("precision", sorted(CODEC_SLOPE))
def test_lossy_precision_is_close_to_the_exact_sum_and_the_same_on_every_rank(group4,
                                                                               precision):
    n, block = 8192, 32
    xs = [inputs(np.float16, n, r) for r in range(4)]
    exact = sum(x.astype(np.float64) for x in xs)
    outs = values(on_ranks(group4, lambda r: group4[r].all_reduce(
        xs[r], np.empty_like(xs[r]), precision=precision, strategy="quantized")))
    for r, o in enumerate(outs[1:], 1):
        assert_bitwise(o, outs[0], f"rank {r} differs from rank 0")
    err = np.abs(outs[0].astype(np.float64) - exact)
    c = CODEC_SLOPE[precision]
    per_block = sum(np.abs(x.astype(np.float64)).reshape(-1, block).max(axis=1) for x in xs)
    bound = np.repeat(c * (2 + c) * per_block * 1.001, block) + 2**-11 * (np.abs(exact) + 1e-3)
    worst = np.argmax(err / bound)
    assert (err <= bound).all(), (f"element {worst}: error {err[worst]}, bound {bound[worst]}")
    # A codec ran: an exact path would give the rounded exact sum everywhere.
    assert (bits(outs[0]) != bits(reference(xs))).any()
    # And it is far from nothing: the largest error is a small part of the largest sum.
    assert err.max() < 0.1 * np.abs(exact).max()
    exact_round(group4, np.float16)


def test_graph_registration_on_the_host_has_nothing_to_register():
    comms = Communicator.group(2, timeout=TIMEOUT)
    try:
        for c in comms:
            c.set_graph_registration(True)
        assert Communicator.register_graph_buffers(comms) == 0
        with pytest.raises(allreduce.InvalidArgument, match="every rank of one in-process"):
            Communicator.register_graph_buffers(list(reversed(comms)))
        with pytest.raises(allreduce.UnsupportedType):
            comms[0].set_graph_registration(1)
        with pytest.raises(allreduce.UnsupportedType):
            Communicator.register_graph_buffers([])
        for c in comms:
            c.set_graph_registration(False)
        xs = [np.arange(64, dtype=np.float32) * (r + 1) for r in range(2)]
        values(on_ranks(comms, lambda r: comms[r].all_reduce(xs[r])))
        assert_bitwise(xs[0], np.arange(64, dtype=np.float32) * 3, "after registration")
    finally:
        for c in comms:
            c.close()


def test_registered_buffers_sum_exactly_and_are_checked():
    comms = Communicator.group(2, timeout=TIMEOUT)
    try:
        bufs = [np.zeros(1024, np.float32) for _ in comms]
        for r, b in enumerate(bufs):
            b[:512] = np.arange(512, dtype=np.float32) * (r + 1)
        reg = Communicator.register(comms, bufs)
        assert isinstance(reg, int) and reg > 0
        outs = [np.zeros(512, np.float32) for _ in comms]
        values(on_ranks(comms, lambda r: comms[r].all_reduce(bufs[r][:512], out=outs[r])))
        for o in outs:
            assert_bitwise(o, np.arange(512, dtype=np.float32) * 3, "registered input")
        Communicator.deregister(comms, reg)
        with pytest.raises(allreduce.InvalidArgument, match="not registered"):
            Communicator.deregister(comms, reg)
        with pytest.raises(allreduce.InvalidArgument, match="one length"):
            Communicator.register(comms, [bufs[0], bufs[1][:512]])
        with pytest.raises(allreduce.InvalidArgument, match="one per rank"):
            Communicator.register(comms, bufs[:1])
        with pytest.raises(allreduce.Misaligned):
            Communicator.register(comms, [b[2:514] for b in bufs])
        with pytest.raises(allreduce.UnsupportedType):
            Communicator.deregister(comms, "1")
    finally:
        for c in comms:
            c.close()


def test_a_refusal_before_x_names_a_stream_goes_on_the_calls_default_stream(monkeypatch):
    """A call refused before ``x`` could say its stream (a list) is still refused on the
    stream a valid call would default to (torch's current stream on a GPU), not the legacy
    default stream, so this rank's part stays ordered with its other calls. The host ignores
    streams, so the stream a GPU would get is stood in for and the C call is watched."""
    comms = Communicator.group(2, timeout=TIMEOUT)
    real = _lib.lib()
    streams = []

    class Watched:
        def __getattr__(self, name):
            return getattr(real, name)

        def ar_reject(self, handle, code, message, stream):
            streams.append(stream)
            return real.ar_reject(handle, code, message, stream)

    try:
        monkeypatch.setattr(_lib, "lib", lambda: Watched())
        monkeypatch.setattr(comms[1], "_resolve_stream",
                            lambda stream, default: 77 if default is None else default)

        def rank(r):
            x = inputs(np.float32, 64, r)
            return comms[r].all_reduce(x.tolist() if r == 1 else x)

        results = on_ranks(comms, rank)
        assert isinstance(results[1], allreduce.UnsupportedType), results
        assert isinstance(results[0], allreduce.PeerRejected), results
        assert streams == [77], streams
    finally:
        for c in comms:
            c.close()
