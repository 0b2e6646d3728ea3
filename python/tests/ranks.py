"""What the host-backend tests share: ranks driven from threads, their inputs, the reference
sum, and bitwise comparison."""

import threading

import numpy as np

TIMEOUT = 5.0  # seconds: a rank that hangs fails the test in seconds, not CI's limit


def on_ranks(comms, fn):
    """Run ``fn(rank)`` on one thread per rank; return each rank's result or exception."""
    results = [None] * len(comms)

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: B036 - handed to the test thread
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
        assert not t.is_alive(), "a rank never returned"
    return results


def values(results):
    """The results, raising the first rank's exception if any rank failed."""
    for r, v in enumerate(results):
        if isinstance(v, BaseException):
            raise AssertionError(f"rank {r} failed: {v!r}") from v
    return results


def bits(a):
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bitwise(got, want, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = np.flatnonzero(bits(got) != bits(want))
    assert diff.size == 0, (f"{what}: {diff.size} elements differ, first at {diff[0]}: "
                            f"{got.flat[diff[0]]!r} != {want.flat[diff[0]]!r}")


def inputs(dtype, n, rank, seed=0):
    """Rank ``rank``'s input: magnitudes over several binades so the sums round and the order
    of accumulation shows, and some -0.0, whose sum must stay -0.0."""
    rng = np.random.default_rng(1000 * seed + rank)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-6, 7, n))
    x[(np.arange(n) + 3 * rank) % 29 == 0] = -0.0
    return x.astype(np.float32).astype(dtype)


def reference(xs):
    """f32 accumulation in rank order from rank 0's value, one rounding into the dtype."""
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc + x.astype(np.float32)
    return acc.astype(xs[0].dtype)
