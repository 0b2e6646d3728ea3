"""The fused all-reduce + residual add + RMSNorm (+ FP8) on the host backend, against a numpy
port of the library's contract (the module docs of crates/core/src/fused.rs):

    a     = round(sum over ranks of x, f32 in rank order)      -0.0 comes out +0.0
    r     = round(a + residual)                                residual_out
    inv   = 1 / sqrt(sum_i r[i]^2 / hidden + eps)              f32, squares summed in order
    n     = round((r * inv) * gamma)                           norm_out
    scale = max|n| / 448 (1 when 0);  q = e4m3(n * 448 / max|n|)   scale_out, quant_out

The all-reduce and residual outputs are held bit for bit, the norm to the library's
`norm_tolerance` (one unit in the last place), FP8 codes to one E4M3 step; every output has
the same bits on every rank. Refusals are checked for their exception and for the group
computing exactly afterwards."""

import gc
import re
import time

import numpy as np
import pytest

import allreduce
from allreduce import Communicator, FusedWorkspace
from ranks import TIMEOUT, assert_bitwise, bits, on_ranks, values

try:
    import ml_dtypes

    BF16 = [np.dtype(ml_dtypes.bfloat16)]
    FP8 = [np.dtype(ml_dtypes.float8_e4m3fn)]
except ImportError:  # the binding takes bfloat16 only through ml_dtypes
    BF16, FP8 = [], []

EPS = 1e-6
MAX_TOKENS = 16
DTYPES = [np.dtype(np.float32), np.dtype(np.float16)] + BF16

# `DType::unit_roundoff` and `DType::min_subnormal` of crates/core/src/dtype.rs.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
MIN_SUBNORMAL = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}


def rows(dtype, tokens, hidden, seed):
    """Values over several binades, so sums round and the order of accumulation shows, and
    -0.0 in column 5 of every row on every rank: its plain sum is -0.0, the fused +0.0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)) * np.exp2(rng.integers(-6, 7, (tokens, hidden)))
    x[:, 5] = -0.0
    return x.astype(np.float32).astype(dtype)


def case(world, dtype, tokens, hidden, seed=0):
    """Every rank's x, the residual and gamma of one call."""
    xs = [rows(dtype, tokens, hidden, 100 * seed + r) for r in range(world)]
    residual = rows(dtype, tokens, hidden, 100 * seed + 99)
    gamma = np.random.default_rng(seed + 7).uniform(-2, 2, hidden).astype(dtype)
    return xs, residual, gamma


def e4m3(v):
    """f32 -> FP8 E4M3 code, saturating at +-448, nearest even; a zero is code 0 whatever its
    sign (crates/core/src/codec/fp8.rs `f32_to_e4m3`)."""
    v = np.asarray(v, np.float32)
    a = np.abs(v)
    ab = a.view(np.uint32).astype(np.int64)
    sign = (v.view(np.uint32).astype(np.int64) >> 24) & 0x80
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = np.rint(a.astype(np.float64) * 512).astype(np.int64)  # exact, ties to even
    mag = np.where(a >= 448, 0x7E, np.where(a < 2.0**-6, subnormal, normal))
    code = np.where(mag == 0, 0, sign | mag)
    return np.where(np.isnan(v), 0x7F, code).astype(np.uint8)


def reference(xs, residual=None, gamma=None, eps=EPS, static_scale=None,
              order=None, hidden_divisor=None, weight_bias=0.0):
    """The contract's outputs. ``order`` and ``hidden_divisor`` make deliberately wrong
    references, for the tests that show a wrong answer would fail."""
    dtype = xs[0].dtype
    order = range(len(xs)) if order is None else order
    acc = None
    for r in order:
        acc = xs[r].astype(np.float32) if acc is None else acc + xs[r].astype(np.float32)
    a = acc.astype(dtype)
    a[a == 0] = 0  # -0.0 -> +0.0
    out = {"allreduce": a}
    if gamma is None:
        return out
    r = a if residual is None else (a.astype(np.float32) + residual.astype(np.float32)).astype(dtype)
    rf = r.astype(np.float32)
    tokens, hidden = rf.shape
    sum_sq = np.zeros(tokens, np.float32)
    for i in range(hidden):  # in order, each step rounded to f32, as the reference loop
        sum_sq = sum_sq + rf[:, i] * rf[:, i]
    divisor = np.float32(hidden if hidden_divisor is None else hidden_divisor)
    inv = np.float32(1) / np.sqrt(sum_sq / divisor + np.float32(eps))
    g = gamma.astype(np.float32)
    if weight_bias != 0:  # a zero bias leaves a -0.0 gamma as it is
        g = g + np.float32(weight_bias)
    n = ((rf * inv[:, None]) * g).astype(dtype)
    nf = n.astype(np.float32)
    out.update(residual=r, norm=n)
    if static_scale is not None:
        out["quant"] = e4m3(nf * (np.float32(1) / np.float32(static_scale)))
        return out
    amax = np.abs(nf).max(axis=1)
    ok = (amax > 0) & np.isfinite(amax)
    safe = np.where(ok, amax, np.float32(1))
    out["scale"] = np.where(ok, safe / np.float32(448), np.float32(1)).astype(np.float32)
    mul = np.where(ok, np.float32(448) / safe, np.float32(1)).astype(np.float32)
    out["quant"] = e4m3(nf * mul[:, None])
    return out


def norm_tolerance(dtype, ref):
    """`norm_tolerance` of crates/core/src/fused.rs: one unit in the last place of the dtype
    at the reference value."""
    name = np.dtype(dtype).name
    tol = 2.0 * UNIT_ROUNDOFF[name] * np.abs(ref.astype(np.float64)) + MIN_SUBNORMAL[name]
    return tol.astype(np.float32).astype(np.float64)


def norm_errors(got, want):
    """Elements of ``got`` outside the norm tolerance of ``want``."""
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return np.flatnonzero(err > norm_tolerance(want.dtype, want))


def assert_norm_close(got, want, what=""):
    bad = norm_errors(got, want)
    assert bad.size == 0, (f"{what}: {bad.size} norm elements outside the tolerance, first at "
                           f"{bad[0]}: {got.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}")


def e4m3_steps(got, want):
    """How many E4M3 codes apart each pair is (codes are ordered by magnitude within a sign,
    and code 0 sits between +1 and -1)."""
    def ordinal(c):
        c = c.astype(np.int64)
        return np.where(c & 0x80, -(c & 0x7F), c & 0x7F)

    return np.abs(ordinal(got.view(np.uint8)) - ordinal(want.view(np.uint8)))


def assert_codes_close(got, want, what=""):
    steps = e4m3_steps(got, want).ravel()
    worst = int(np.argmax(steps))
    assert steps[worst] <= 1, f"{what}: code {worst} is {steps[worst]} E4M3 steps off"


def assert_scales_close(got, want, dtype, what=""):
    # A scale is max|norm| / 448: it inherits the norm's one unit in the last place.
    rtol = 2.0 * UNIT_ROUNDOFF[np.dtype(dtype).name] + 2.0**-23
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= rtol * np.abs(want.astype(np.float64))).all(), (what, got, want)


def assert_same_on_every_rank(outs, what=""):
    for r, o in enumerate(outs[1:], 1):
        for key in o:
            assert_bitwise(o[key], outs[0][key], f"{what} rank {r} {key} differs from rank 0")


def run_fused(comms, wss, xs, residual=None, gamma=None, outputs=(), **kwargs):
    """One fused call on every rank, each with its own fresh outputs (named in ``outputs``:
    allreduce_out, residual_out, norm_out, quant_out, scale_out); each rank's outputs."""
    tokens, hidden = xs[0].shape

    def make(name):
        if name == "quant_out":
            return np.full((tokens, hidden), 0xAA, np.uint8)
        if name == "scale_out":
            return np.full(tokens, np.nan, np.float32)
        return np.full_like(xs[0], np.nan)

    outs = [{name: make(name) for name in outputs} for _ in comms]
    inputs = [x.copy() for x in xs]
    if residual is not None:
        kwargs["residual_in"] = residual
    if gamma is not None:
        kwargs["rms_gamma"] = gamma

    def rank(r):
        return comms[r].all_reduce_fused(wss[r], inputs[r], **outs[r], **kwargs)

    assert values(on_ranks(comms, rank)) == [None] * len(comms)
    return outs, inputs


def check_outputs(outs, want, dtype, what):
    for r, o in enumerate(outs):
        w = f"{what} rank {r}"
        if "allreduce_out" in o:
            assert_bitwise(o["allreduce_out"], want["allreduce"], w + " allreduce_out")
        if "residual_out" in o:
            assert_bitwise(o["residual_out"], want["residual"], w + " residual_out")
        if "norm_out" in o:
            assert_norm_close(o["norm_out"], want["norm"], w + " norm_out")
        if "quant_out" in o:
            assert_codes_close(o["quant_out"], want["quant"], w + " quant_out")
        if "scale_out" in o:
            assert_scales_close(o["scale_out"], want["scale"], dtype, w + " scale_out")
    assert_same_on_every_rank(outs, what)


def fused_group(world, hidden, dtype, timeout=TIMEOUT, max_tokens=MAX_TOKENS):
    comms = Communicator.group(world, timeout=timeout)
    return comms, FusedWorkspace.group(comms, max_tokens, hidden, dtype)


def close(comms, wss):
    for w in wss:
        w.close()
    for c in comms:
        c.close()


ALL_OUTPUTS = ("allreduce_out", "residual_out", "norm_out")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 256])
def test_every_pattern_equals_the_reference(world, dtype, hidden):
    comms, wss = fused_group(world, hidden, dtype)
    try:
        for tokens in (1, 3, 16):
            for use_oneshot in (None, True, False):
                seed = 10 * tokens + {None: 0, True: 1, False: 2}[use_oneshot]
                xs, residual, gamma = case(world, dtype, tokens, hidden, seed)
                what = f"{world} ranks {dtype} {tokens}x{hidden} use_oneshot={use_oneshot}"
                want = reference(xs, residual, gamma)

                outs, _ = run_fused(comms, wss, xs, outputs=("allreduce_out",),
                                    use_oneshot=use_oneshot)
                check_outputs(outs, want, dtype, what + " allreduce")

                outs, _ = run_fused(comms, wss, xs, residual, gamma, ALL_OUTPUTS,
                                    use_oneshot=use_oneshot)
                check_outputs(outs, want, dtype, what + " residual_rmsnorm")

                outs, _ = run_fused(comms, wss, xs, residual, gamma,
                                    ALL_OUTPUTS + ("quant_out", "scale_out"),
                                    use_oneshot=use_oneshot)
                check_outputs(outs, want, dtype, what + " fp8")

                # A scale small enough that the largest values saturate at 448.
                static = reference(xs, residual, gamma, static_scale=0.004)
                outs, _ = run_fused(comms, wss, xs, residual, gamma,
                                    ALL_OUTPUTS + ("quant_out",), static_scale=0.004,
                                    use_oneshot=use_oneshot)
                check_outputs(outs, static, dtype, what + " fp8_static")
    finally:
        close(comms, wss)


def test_the_reference_tells_wrong_answers_apart():
    """Guards the test above: each mistake a fused call could make would fail it."""
    xs, residual, gamma = case(4, np.dtype(np.float16), 16, 256, seed=3)
    want = reference(xs, residual, gamma)
    xs32, res32, gamma32 = case(4, np.dtype(np.float32), 16, 256, seed=3)
    want32 = reference(xs32, res32, gamma32)
    # Another order of accumulation (f32 data: a 16-bit sum in f32 is mostly exact).
    other = reference(xs32, res32, gamma32, order=[3, 2, 1, 0])
    assert (bits(other["allreduce"]) != bits(want32["allreduce"])).any()
    # The -0.0 rule: the plain sum keeps -0.0 in column 5, the fused one has +0.0.
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc + x.astype(np.float32)
    assert np.signbit(acc[:, 5]).all() and (acc[:, 5] == 0).all()
    assert not np.signbit(want["allreduce"][:, 5]).any()
    # The residual added to the rounded sum, not to the f32 accumulator.
    unrounded = (acc + residual.astype(np.float32)).astype(np.float16)
    assert (bits(unrounded) != bits(want["residual"])).any()
    # A mean over hidden - 1 elements is outside the norm tolerance (f32 data: the tightest).
    off = reference(xs32, res32, gamma32, hidden_divisor=255)
    assert norm_errors(off["norm"], want32["norm"]).size > 0
    # FP8 codes at twice the scale are more than one step off.
    doubled = e4m3(want["norm"].astype(np.float32) * (np.float32(448) / 2 / want["scale"])[:, None])
    assert e4m3_steps(doubled, want["quant"]).max() > 1
    # The E4M3 encoder itself: exact points, ties to even, saturation, and no -0 code.
    assert list(e4m3([0.0, -0.0, 1.0, -1.0, 448.0, 1e9, -1e9, 2.0**-9, 2.0**-10, 1.0625,
                      1.1875])) == [0, 0, 0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x38, 0x3A]


def test_inferred_and_named_patterns_compute_the_same():
    dtype, hidden, tokens = np.dtype(np.float16), 64, 3
    comms, wss = fused_group(2, hidden, dtype)
    try:
        xs, residual, gamma = case(2, dtype, tokens, hidden, seed=5)
        for name, outputs, extra in [
            ("allreduce", ("allreduce_out",), {}),
            ("residual_rmsnorm", ("residual_out", "norm_out"), {}),
            ("residual_rmsnorm_fp8", ("quant_out", "scale_out"), {}),
            ("residual_rmsnorm_fp8_static", ("quant_out",), {"static_scale": 0.01}),
        ]:
            norm = name != "allreduce"
            args = (residual, gamma) if norm else (None, None)
            inferred, _ = run_fused(comms, wss, xs, *args, outputs, **extra)
            named, _ = run_fused(comms, wss, xs, *args, outputs, pattern=name, **extra)
            for a, b in zip(inferred, named):
                for key in a:
                    assert_bitwise(a[key], b[key], f"{name} {key}")
    finally:
        close(comms, wss)


def test_in_place_allreduce_and_residual_and_other_argument_forms():
    dtype, hidden, tokens = np.dtype(np.float32), 64, 16
    comms, wss = fused_group(2, hidden, "float32")
    try:
        xs, residual, gamma = case(2, dtype, tokens, hidden, seed=6)
        want = reference(xs, residual, gamma)
        # Pattern allreduce without allreduce_out sums into x.
        _, inputs = run_fused(comms, wss, xs)
        for r, x in enumerate(inputs):
            assert_bitwise(x, want["allreduce"], f"rank {r} in place")
        # residual_out = residual_in (vLLM's fused_add_rms_norm) and allreduce_out = x.
        ins = [x.copy() for x in xs]
        res = [residual.copy() for _ in xs]
        norms = [np.empty_like(x) for x in xs]
        values(on_ranks(comms, lambda r: comms[r].all_reduce_fused(
            wss[r], ins[r], residual_in=res[r], residual_out=res[r], norm_out=norms[r],
            allreduce_out=ins[r], rms_gamma=gamma, rms_eps=None)))
        for r in range(2):
            assert_bitwise(ins[r], want["allreduce"], f"rank {r} allreduce_out = x")
            assert_bitwise(res[r], want["residual"], f"rank {r} residual in place")
            assert_norm_close(norms[r], want["norm"], f"rank {r} norm")
        # A static scale as a one-element float32 array; quant_out as float8_e4m3fn.
        static = reference(xs, residual, gamma, static_scale=0.02)
        scale = np.array([0.02], np.float32)
        for code_dtype in [np.dtype(np.uint8)] + FP8:
            quants = [np.empty((tokens, hidden), code_dtype) for _ in xs]
            values(on_ranks(comms, lambda r: comms[r].all_reduce_fused(
                wss[r], xs[r], residual_in=residual, rms_gamma=gamma, quant_out=quants[r],
                static_scale=scale)))
            for r in range(2):
                assert_codes_close(quants[r], static["quant"], f"rank {r} {code_dtype}")
        # Another eps reaches the norm.
        eps = reference(xs, residual * 0, gamma, eps=4.0)
        norms = [np.empty_like(x) for x in xs]
        values(on_ranks(comms, lambda r: comms[r].all_reduce_fused(
            wss[r], xs[r], residual_in=residual * 0, rms_gamma=gamma, norm_out=norms[r],
            rms_eps=4.0)))
        assert_norm_close(norms[0], eps["norm"], "eps 4")
        assert norm_errors(norms[0], reference(xs, residual * 0, gamma)["norm"]).size > 0
    finally:
        close(comms, wss)


@pytest.fixture
def fused2():
    comms, wss = fused_group(2, 64, np.float32)
    yield comms, wss
    close(comms, wss)


def exact_fused_round(comms, wss, tokens=3, seed=1):
    """A valid fused call on every rank: exact against the reference."""
    hidden, dtype = wss[0].hidden, np.dtype(wss[0].dtype)
    xs, residual, gamma = case(len(comms), dtype, tokens, hidden, seed)
    outs, _ = run_fused(comms, wss, xs, residual, gamma, ALL_OUTPUTS + ("quant_out",
                                                                        "scale_out"))
    check_outputs(outs, reference(xs, residual, gamma), dtype, "after")


T, H = 3, 64


def good(**change):
    """A valid residual_rmsnorm call's arguments (f32, 3 x 64) with ``change`` applied."""
    rng = np.random.default_rng(2)
    kwargs = {
        "x": rng.standard_normal((T, H)).astype(np.float32),
        "residual_in": rng.standard_normal((T, H)).astype(np.float32),
        "rms_gamma": np.ones(H, np.float32),
        "norm_out": np.empty((T, H), np.float32),
    }
    for key, value in change.items():
        if value is None:
            kwargs.pop(key)
        else:
            kwargs[key] = value(kwargs) if callable(value) else value
    return kwargs


def f32(*shape):
    return np.zeros(shape, np.float32)


# Every rank makes the same mistake: each raises, none reaches a peer that waits.
BAD_CALLS = [
    ("x of one dimension", good(x=f32(T * H)), allreduce.InvalidArgument, "shape"),
    ("x of another hidden", good(x=f32(T, 32)), allreduce.InvalidArgument, r"\(tokens, 64\)"),
    ("x over max_tokens", good(x=f32(MAX_TOKENS + 1, H)), allreduce.WorkspaceExceeded,
     "max_tokens 16"),
    ("x float64", good(x=np.zeros((T, H))), allreduce.UnsupportedType, "float64"),
    ("x float16", good(x=np.zeros((T, H), np.float16)), allreduce.DTypeMismatch, "float16"),
    ("x not contiguous", good(x=f32(T, 2 * H)[:, ::2]), allreduce.InvalidArgument,
     "contiguous"),
    ("x a list", good(x=[[0.0] * H] * T), allreduce.UnsupportedType, "list"),
    ("residual_in of another shape", good(residual_in=f32(T + 1, H)),
     allreduce.InvalidArgument, "residual_in has shape"),
    ("residual_in float16", good(residual_in=np.zeros((T, H), np.float16)),
     allreduce.DTypeMismatch, "residual_in"),
    ("missing rms_gamma", good(rms_gamma=None), allreduce.InvalidArgument,
     "pattern residual_rmsnorm .inferred.* needs rms_gamma"),
    ("residual_out without residual_in",
     good(residual_in=None, residual_out=np.empty((T, H), np.float32)), allreduce.InvalidArgument,
     "residual_out needs residual_in"),
    ("rms_gamma of rows", good(rms_gamma=f32(T, H)), allreduce.InvalidArgument,
     r"rms_gamma has shape \(3, 64\), expected \(64,\)"),
    ("norm_out read-only", good(norm_out=np.frombuffer(bytes(T * H * 4), np.float32)
                                .reshape(T, H)), allreduce.InvalidArgument, "read-only"),
    ("quant_out float32", good(quant_out=f32(T, H), scale_out=f32(T)),
     allreduce.UnsupportedType, "quant_out has dtype float32"),
    ("quant_out too short", good(quant_out=np.zeros(T * H - 1, np.uint8), scale_out=f32(T)),
     allreduce.InvalidArgument, "quant_out has 191 elements, expected 192"),
    ("scale_out float16", good(quant_out=np.zeros((T, H), np.uint8),
                               scale_out=np.zeros(T, np.float16)),
     allreduce.DTypeMismatch, "scale_out is float16"),
    ("scale_out of another count", good(quant_out=np.zeros((T, H), np.uint8),
                                        scale_out=f32(T + 1)),
     allreduce.InvalidArgument, "scale_out has 4 elements"),
    ("scale_out and static_scale", good(quant_out=np.zeros((T, H), np.uint8),
                                        scale_out=f32(T), static_scale=1.0),
     allreduce.InvalidArgument, "exclude each other"),
    ("static_scale of two", good(quant_out=np.zeros((T, H), np.uint8), static_scale=f32(2)),
     allreduce.InvalidArgument, "static_scale has 2 elements"),
    ("static_scale a string", good(quant_out=np.zeros((T, H), np.uint8), static_scale="1"),
     allreduce.UnsupportedType, "str"),
    ("unknown pattern", good(pattern="rmsnorm"), allreduce.InvalidArgument,
     "pattern 'rmsnorm' is not one of"),
    ("allreduce with residual_in", good(pattern="allreduce"), allreduce.InvalidArgument,
     "pattern allreduce takes no residual_in"),
    ("residual_rmsnorm with quant_out", good(pattern="residual_rmsnorm",
                                             quant_out=np.zeros((T, H), np.uint8)),
     allreduce.InvalidArgument, "takes no quant_out"),
    ("fp8 without scale_out", good(pattern="residual_rmsnorm_fp8",
                                   quant_out=np.zeros((T, H), np.uint8)),
     allreduce.InvalidArgument, "needs scale_out"),
    ("use_oneshot a string", good(use_oneshot="yes"), allreduce.UnsupportedType,
     "use_oneshot"),
    ("negative rms_eps", good(rms_eps=-1.0), allreduce.InvalidArgument, "rms_eps"),
    ("nan rms_eps", good(rms_eps=float("nan")), allreduce.InvalidArgument, "rms_eps"),
    ("a stream of another kind", good(stream="default"), allreduce.UnsupportedType, "stream"),
    # Refused by the library itself: its code, its message.
    ("misaligned x", good(x=lambda k: f32(T * H + 4)[1:T * H + 1].reshape(T, H)),
     allreduce.Misaligned, "not aligned to 16"),
    ("norm_out = residual_out", good(residual_out=lambda k: k["norm_out"]),
     allreduce.InvalidArgument, "overlap"),
]


@pytest.mark.parametrize("what,kwargs,exc,text", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_refusals_on_every_rank_raise_and_leave_the_group_exact(fused2, what, kwargs, exc,
                                                                 text):
    comms, wss = fused2

    def rank(r):
        # Each rank its own outputs (one array given twice stays one array); inputs shared.
        copies = {}
        mine = {k: copies.setdefault(id(v), v.copy())
                if k.endswith("_out") and isinstance(v, np.ndarray) and v.flags.writeable
                else v for k, v in kwargs.items()}
        return comms[r].all_reduce_fused(wss[r], **mine)

    for r, e in enumerate(on_ranks(comms, rank)):
        assert isinstance(e, exc), (r, e)
        assert isinstance(e, allreduce.Error), (r, e)
        assert not e.rebuild
        assert re.search(text, e.message), (r, e.message)
    exact_fused_round(comms, wss)


def test_type_and_value_refusals_are_the_builtin_kinds(fused2):
    comms, wss = fused2

    def rank(r):
        with pytest.raises(TypeError):
            comms[r].all_reduce_fused(wss[r], **good(x=np.zeros((T, H), np.int32)))
        with pytest.raises(ValueError):
            comms[r].all_reduce_fused(wss[r], **good(rms_gamma=None))
        with pytest.raises(TypeError):
            comms[r].all_reduce_fused(object(), **good())

    values(on_ranks(comms, rank))
    exact_fused_round(comms, wss)


def test_another_ranks_workspace_is_refused_by_the_library(fused2):
    comms, wss = fused2
    for r, e in enumerate(on_ranks(comms, lambda r: comms[r].all_reduce_fused(
            wss[1 - r], **good()))):
        assert isinstance(e, allreduce.InvalidArgument), (r, e)
        assert "another group or rank" in e.message
    exact_fused_round(comms, wss)


def test_one_ranks_refusal_reaches_its_peer_at_once():
    """A refusal by the binding (rank 0's x is float16) or by the library (rank 0's x is
    misaligned) is raised on that rank, and its peer's matching call raises PeerRejected
    carrying the reason, long before the deadline; the group stays exact."""
    comms, wss = fused_group(2, 64, np.float32, timeout=5.0)
    try:
        cases = ((np.zeros((T, H), np.float16), allreduce.DTypeMismatch),
                 (f32(T * H + 4)[1:T * H + 1].reshape(T, H), allreduce.Misaligned))
        for bad, exc in cases:
            start = time.monotonic()

            def rank(r):
                return comms[r].all_reduce_fused(wss[r], **good(x=bad if r == 0 else f32(T, H)))

            results = on_ranks(comms, rank)
            assert isinstance(results[0], exc), results[0]
            assert isinstance(results[1], allreduce.PeerRejected), results[1]
            assert not results[1].rebuild
            assert results[0].message in results[1].message, (results[0], results[1])
            assert time.monotonic() - start < 4.0
        exact_fused_round(comms, wss)
    finally:
        close(comms, wss)


def test_workspaces_are_built_for_a_whole_group_and_released_once():
    comms = Communicator.group(2, timeout=TIMEOUT)
    try:
        for dtype in ("float16", np.float16, np.dtype("float16"), "FLOAT16"):
            wss = FusedWorkspace.group(comms, 4, 64, dtype)
            assert [w.dtype for w in wss] == ["float16"] * 2
            assert [(w.rank, w.world_size, w.max_tokens, w.hidden) for w in wss] == [
                (0, 2, 4, 64), (1, 2, 4, 64)]
            for w in wss:
                w.close()
        for bf16 in BF16:
            for w in FusedWorkspace.group(comms, 4, 64, bf16):
                assert w.dtype == "bfloat16"
                w.close()
        for kwargs, exc, text in [
            ({"comms": comms[::-1]}, allreduce.InvalidArgument, "not rank 0"),
            ({"comms": comms[:1]}, allreduce.InvalidConfig, "whole in-process group"),
            ({"comms": []}, allreduce.InvalidConfig, "no communicators"),
            ({"comms": [1, 2]}, allreduce.UnsupportedType, "Communicator"),
            ({"hidden": 60}, allreduce.InvalidConfig, "16-byte vector"),
            ({"max_tokens": 0}, allreduce.InvalidConfig, "positive"),
            ({"max_tokens": -1}, allreduce.InvalidConfig, "positive"),
            ({"max_tokens": 4.0}, allreduce.UnsupportedType, "float"),
            ({"dtype": "float64"}, allreduce.UnsupportedType, "float64"),
            ({"dtype": np.int32}, allreduce.UnsupportedType, "int32"),
        ]:
            args = {"comms": comms, "max_tokens": 4, "hidden": 64, "dtype": "bfloat16"}
            args.update(kwargs)
            with pytest.raises(exc, match=text):
                FusedWorkspace.group(**args)
        # Collective: a rank in a call on another thread makes it refuse.
        assert comms[1]._busy.acquire(blocking=False)
        try:
            with pytest.raises(allreduce.InvalidUsage, match="rank 1 is in a call"):
                FusedWorkspace.group(comms, 4, 64, "float32")
        finally:
            comms[1]._busy.release()

        wss = FusedWorkspace.group(comms, MAX_TOKENS, 64, "float32")
        with wss[0] as w:
            assert w is wss[0] and "rank 0/2 16 x 64 float32" in repr(w)
        assert wss[0].closed and "closed" in repr(wss[0])
        wss[0].close()  # idempotent
        with pytest.raises(allreduce.InvalidUsage, match="workspace is closed"):
            comms[0].all_reduce_fused(wss[0], **good())
        wss[1].close()
        # The group still computes, and a new workspace works.
        wss = FusedWorkspace.group(comms, MAX_TOKENS, 64, "float32")
        exact_fused_round(comms, wss)
        del wss
        gc.collect()  # __del__ released both; nothing raised
    finally:
        for c in comms:
            c.close()


def test_communicators_closed_before_their_workspaces():
    comms, wss = fused_group(2, 64, np.float32)
    exact_fused_round(comms, wss)
    for c in comms:
        c.close()
    with pytest.raises(allreduce.InvalidUsage, match="communicator is closed"):
        comms[0].all_reduce_fused(wss[0], **good())
    for w in wss:
        w.close()


@pytest.mark.parametrize("pattern,outputs,extra", [
    ("residual_rmsnorm", ("allreduce_out", "norm_out"), {}),
    ("residual_rmsnorm_fp8", ("norm_out", "quant_out", "scale_out"), {}),
    ("residual_rmsnorm_fp8_static", ("quant_out",), {"static_scale": 0.004}),
])
@pytest.mark.parametrize("with_residual,weight_bias", [(False, 0.0), (True, 1.0), (False, -0.5)])
def test_norm_without_residual_and_with_weight_bias(pattern, outputs, extra, with_residual,
                                                    weight_bias):
    dtype, tokens, hidden = np.dtype(np.float16), 5, 128
    comms, wss = fused_group(3, hidden, dtype)
    try:
        xs, residual, gamma = case(3, dtype, tokens, hidden, seed=11)
        residual = residual if with_residual else None
        want = reference(xs, residual, gamma, weight_bias=weight_bias,
                         static_scale=extra.get("static_scale"))
        outs, _ = run_fused(comms, wss, xs, residual, gamma, outputs, pattern=pattern,
                            weight_bias=weight_bias, **extra)
        check_outputs(outs, want, dtype, f"{pattern} residual={with_residual} "
                                         f"weight_bias={weight_bias}")
        # A different bias is a different answer (the check above can fail).
        other = reference(xs, residual, gamma, weight_bias=weight_bias + 0.25)
        assert (bits(other["norm"]) != bits(want["norm"])).any()
    finally:
        close(comms, wss)


def test_residual_out_needs_residual_in_and_weight_bias_needs_a_norm():
    dtype, tokens, hidden = np.dtype(np.float16), 2, 64
    comms, wss = fused_group(2, hidden, dtype)
    try:
        xs, residual, gamma = case(2, dtype, tokens, hidden, seed=12)
        def refusals(r):
            # Every rank makes each mistake: each refusal is a call the peers take part in.
            out = np.zeros_like(xs[r])
            with pytest.raises(allreduce.InvalidArgument, match="residual_out needs residual_in"):
                comms[r].all_reduce_fused(wss[r], xs[r], rms_gamma=gamma, norm_out=out,
                                          residual_out=np.zeros_like(out))
            with pytest.raises(allreduce.InvalidArgument, match="no norm for a weight_bias"):
                comms[r].all_reduce_fused(wss[r], xs[r], allreduce_out=out, weight_bias=1.0)
            for bad in (float("nan"), float("inf")):
                with pytest.raises(allreduce.InvalidArgument, match="weight_bias must be finite"):
                    comms[r].all_reduce_fused(wss[r], xs[r], rms_gamma=gamma, norm_out=out,
                                              weight_bias=bad)
            with pytest.raises(allreduce.UnsupportedType, match="weight_bias"):
                comms[r].all_reduce_fused(wss[r], xs[r], rms_gamma=gamma, norm_out=out,
                                          weight_bias="1")

        values(on_ranks(comms, refusals))
        # Refused before anything moved: the group still gives right answers.
        want = reference(xs, residual, gamma)
        outs, _ = run_fused(comms, wss, xs, residual, gamma, ALL_OUTPUTS)
        check_outputs(outs, want, dtype, "after the refusals")
    finally:
        close(comms, wss)
