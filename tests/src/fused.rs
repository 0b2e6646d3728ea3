//! The fused all-reduce + residual + RMSNorm (+ FP8) on virtual ranks of one GPU, written once
//! for every GPU backend, generic over the runtime (the test binaries tests/cuda_fused.rs and
//! tests/rocm_fused.rs call [`run`] with theirs):
//!
//! - against the host reference (`allreduce::fused::reference`): all-reduce and residual
//!   outputs bit for bit, the norm within `fused::norm_tolerance`, FP8 codes within one step;
//! - against the unfused pipeline on the same GPU (our all-reduce, then the plain residual +
//!   RMSNorm kernel): equal by value (the fused sum turns -0.0 into +0.0);
//! - 2, 4 and 8 ranks; tokens 1..2048; hidden 2048, 4096, 8192; f16 and bf16; one-shot,
//!   two-shot and Auto; inputs holding -0.0 (on every rank at some positions, on some ranks
//!   at others);
//! - the all-reduce output in its own buffer, in place over the input, or not asked for;
//! - CUDA/HIP graphs of 1, 2 and 3 fused calls replayed 1000 times with new inputs.
//!
//! Skips with the reason when no GPU is usable. `ALLREDUCE_FUSED_QUICK=1` runs fewer token counts.

use std::sync::{Barrier, RwLock};
use std::time::{Duration, Instant};

use allreduce::fused::{self as f, FusedOutputs};
use allreduce::{
    AllReduceOptions, BufMut, BufRef, Communicator, DType, Fp8BufMut, FusedArgs, FusedConfig,
    FusedPattern, FusedWorkspace, GroupConfig, HostBytes, Strategy,
};
use allreduce_gpu::device::{DeviceBuffer, GpuGraph, GpuStream};
use allreduce_gpu::fused::{NormBuffers, RmsNormKernel};

use crate::{gpu_available, open_rank, GpuTestRuntime};

const EPS: f32 = 1e-5;
/// The static FP8 pattern's scale: normalized values up to 448 x this (about 3.4) keep
/// unsaturated codes, larger ones saturate (the data has both).
const STATIC_SCALE: f32 = 0.0075;

/// Rank `rank`'s input (rank = usize::MAX: the residual; MAX - 1: gamma) for data set
/// `seed`: values in [-4, 4) with -0.0 on every rank where i % 61 == 0 and on some ranks
/// where (i + rank) % 37 == 0.
fn value(seed: usize, rank: usize, i: usize) -> f32 {
    if rank < 64 && (i % 61 == 0 || (i + rank) % 37 == 0) {
        return -0.0;
    }
    let h = (i as u64)
        .wrapping_mul(2654435761)
        .wrapping_add((seed as u64).wrapping_mul(40503))
        .wrapping_add((rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let h = h ^ (h >> 29);
    let v = ((h >> 7) & 0xffff) as f32 / 8192.0 - 4.0;
    if rank == usize::MAX - 1 {
        0.5 + v.abs() / 4.0
    } else {
        v
    }
}

fn data(dtype: DType, n: usize, seed: usize, rank: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        dtype.store_f32(b.as_mut_slice(), i, value(seed, rank, i));
    }
    b
}

/// Where a case asks for the all-reduce output: its own buffer, in place over the input
/// (which the one-shot must not overwrite before every block has pushed it), or not at
/// all (a norm pattern; what the bench and a model run).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Out {
    Separate,
    InPlace,
    Omitted,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    tokens: usize,
    pattern: FusedPattern,
    strategy: Strategy,
    seed: usize,
    out: Out,
    /// With a residual (else the norm is of the all-reduce output).
    residual: bool,
    /// `FusedArgs::weight_bias`.
    weight_bias: f32,
}

/// Case `c` of a list: without a residual every third case, with Gemma's `(1 + gamma)` every
/// fourth, so every grid and pattern meets both.
fn variant(c: usize) -> (bool, f32) {
    (c % 3 != 2, if c % 4 == 3 { 1.0 } else { 0.0 })
}

/// What every rank checks its outputs against.
struct Expect {
    reference: FusedOutputs,
}

/// One rank's device buffers, sized for the largest case.
struct Bufs<R: GpuTestRuntime> {
    input: DeviceBuffer<R>,
    residual: DeviceBuffer<R>,
    gamma: DeviceBuffer<R>,
    ar: DeviceBuffer<R>,
    res_out: DeviceBuffer<R>,
    norm: DeviceBuffer<R>,
    quant: DeviceBuffer<R>,
    scale: DeviceBuffer<R>,
    /// `STATIC_SCALE`, for the static FP8 pattern (read by both pipelines).
    static_scale: DeviceBuffer<R>,
    // The unfused pipeline's outputs.
    u_ar: DeviceBuffer<R>,
    u_res: DeviceBuffer<R>,
    u_norm: DeviceBuffer<R>,
    u_quant: DeviceBuffer<R>,
    u_scale: DeviceBuffer<R>,
}

impl<R: GpuTestRuntime> Bufs<R> {
    fn new(
        elems: usize,
        tokens: usize,
        hidden: usize,
        dtype: DType,
        s: &GpuStream<R>,
    ) -> allreduce::Result<Self> {
        let t = elems * dtype.size();
        Ok(Bufs {
            input: DeviceBuffer::zeroed(t, s)?,
            residual: DeviceBuffer::zeroed(t, s)?,
            gamma: DeviceBuffer::zeroed(hidden * dtype.size(), s)?,
            ar: DeviceBuffer::zeroed(t, s)?,
            res_out: DeviceBuffer::zeroed(t, s)?,
            norm: DeviceBuffer::zeroed(t, s)?,
            quant: DeviceBuffer::zeroed(elems, s)?,
            scale: DeviceBuffer::zeroed(tokens * 4, s)?,
            static_scale: {
                let b = DeviceBuffer::zeroed(4, s)?;
                b.upload(&STATIC_SCALE.to_le_bytes(), s)?;
                b
            },
            u_ar: DeviceBuffer::zeroed(t, s)?,
            u_res: DeviceBuffer::zeroed(t, s)?,
            u_norm: DeviceBuffer::zeroed(t, s)?,
            u_quant: DeviceBuffer::zeroed(elems, s)?,
            u_scale: DeviceBuffer::zeroed(tokens * 4, s)?,
        })
    }
}

fn down<R: GpuTestRuntime>(b: &DeviceBuffer<R>, bytes: usize, s: &GpuStream<R>) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    b.download(&mut v, s).expect("download");
    v
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// First difference between `got` and the reference, as text.
fn compare(
    what: &str,
    dtype: DType,
    got: &[u8],
    want: &[u8],
    bitwise: bool,
    tol: bool,
) -> Option<String> {
    let n = want.len() / dtype.size();
    for i in 0..n {
        let (g, w) = (dtype.load_f32(got, i), dtype.load_f32(want, i));
        let ok = if bitwise {
            got[i * dtype.size()..(i + 1) * dtype.size()]
                == want[i * dtype.size()..(i + 1) * dtype.size()]
        } else if tol {
            (g - w).abs() <= f::norm_tolerance(dtype, w)
        } else {
            g == w
        };
        if !ok {
            return Some(format!("{what}[{i}] = {g:e}, expected {w:e}"));
        }
    }
    None
}

/// Codes within one E4M3 step; scales within one unit of T in the row's largest value
/// (the norm's tolerance, divided by 448).
#[allow(clippy::too_many_arguments)]
fn compare_fp8(
    what: &str,
    dtype: DType,
    got_q: &[u8],
    got_s: &[f32],
    want_q: &[u8],
    want_s: &[f32],
    hidden: usize,
    exact: bool,
) -> Option<String> {
    for (t, (&g, &w)) in got_s.iter().zip(want_s).enumerate() {
        let tol = (2.0 * dtype.unit_roundoff()) as f32 * w.abs() * 1.01;
        let ok = if exact { g == w } else { (g - w).abs() <= tol };
        if !ok {
            return Some(format!("{what} scale[{t}] = {g:e}, expected {w:e}"));
        }
    }
    for (i, (&g, &w)) in got_q.iter().zip(want_q).enumerate() {
        let (gv, wv) = (
            allreduce::codec::e4m3_to_f32(g),
            allreduce::codec::e4m3_to_f32(w),
        );
        let step = (wv.abs() / 8.0).max(1.0 / 512.0);
        let ok = if exact {
            g == w
        } else {
            (gv - wv).abs() <= step * 1.01
        };
        if !ok {
            return Some(format!(
                "{what} code[{i}] (token {}) = {g:#04x}, expected {w:#04x}",
                i / hidden
            ));
        }
    }
    None
}

/// `world` ranks on device 0.
fn virtual_group<R: GpuTestRuntime>(
    world: usize,
    max_bytes: usize,
    timeout: Duration,
) -> allreduce::Result<Vec<Communicator>> {
    Communicator::new_group(
        R::KIND,
        GroupConfig::new(world)
            .devices(vec![0; world])
            .max_bytes(max_bytes)
            .timeout(timeout),
    )
}

/// One group, one workspace (of `blocks` blocks per launch, or the default grid), every
/// case in order. Returns the failures.
fn run_group<R: GpuTestRuntime>(
    world: usize,
    dtype: DType,
    hidden: usize,
    launch: Launch,
    cases: &[Case],
) -> Vec<String> {
    let max_tokens = cases.iter().map(|c| c.tokens).max().unwrap();
    let elems = max_tokens * hidden;
    let comms =
        virtual_group::<R>(world, elems * dtype.size(), Duration::from_secs(3)).expect("group");
    let mut config = FusedConfig::new(max_tokens, hidden, dtype);
    match launch {
        Launch::Default => {}
        Launch::Blocks(b) => config = config.blocks(b),
        Launch::NoPdl => config = config.pdl(false),
    }
    let ws = FusedWorkspace::create_group(&comms, config).expect("workspace");
    assert!(ws[0].is_fused());
    match launch {
        Launch::Default => {}
        Launch::Blocks(b) => assert_eq!(ws[0].metadata().blocks, b),
        Launch::NoPdl => assert!(!ws[0].metadata().pdl),
    }
    let barrier = Barrier::new(world);
    let expect: RwLock<Option<Expect>> = RwLock::new(None);
    let failures: Vec<Vec<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&ws)
            .map(|(comm, w)| {
                let (barrier, expect) = (&barrier, &expect);
                s.spawn(move || {
                    rank_cases::<R>(
                        comm, w, world, dtype, hidden, max_tokens, cases, barrier, expect,
                    )
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    failures.into_iter().flatten().collect()
}

/// Every token count with Auto, one-shot and two-shot; the pattern of the i-th token
/// count's k-th strategy is `FusedPattern::ALL[pattern(i, k) % 4]`, outputs alternate
/// between their own buffers and in place.
fn mixed_cases(
    tokens: &[usize],
    seed: usize,
    pattern: impl Fn(usize, usize) -> usize,
) -> Vec<Case> {
    let mut cases = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        let strategies = [Strategy::Auto, Strategy::OneShot, Strategy::TwoShot];
        for (k, strategy) in strategies.into_iter().enumerate() {
            let (residual, weight_bias) = variant(cases.len());
            cases.push(Case {
                tokens: t,
                pattern: FusedPattern::ALL[pattern(i, k) % FusedPattern::ALL.len()],
                strategy,
                seed: seed + i,
                out: if (i + k) % 2 == 1 {
                    Out::InPlace
                } else {
                    Out::Separate
                },
                residual,
                weight_bias,
            });
        }
    }
    cases
}

/// Print a group's outcome (the first failures in full) and add it to the totals.
fn tally<R: allreduce_gpu::GpuRuntime>(
    label: &str,
    cases: &[Case],
    f: Vec<String>,
    run: &mut usize,
    failures: &mut Vec<String>,
) {
    crate::say!(R, "{label}: {} cases, {} failures", cases.len(), f.len());
    for m in f.iter().take(5) {
        crate::say!(R, "  FAIL {m}");
    }
    *run += cases.len();
    failures.extend(f);
}

/// How a group's fused kernels are launched: the defaults (PDL where the device has it,
/// the default grid), another grid, or ordinary launches.
#[derive(Clone, Copy)]
enum Launch {
    Default,
    Blocks(u32),
    NoPdl,
}

#[allow(clippy::too_many_arguments)]
fn rank_cases<R: GpuTestRuntime>(
    comm: &Communicator,
    ws: &FusedWorkspace,
    world: usize,
    dtype: DType,
    hidden: usize,
    max_tokens: usize,
    cases: &[Case],
    barrier: &Barrier,
    expect: &RwLock<Option<Expect>>,
) -> Vec<String> {
    let rank = comm.rank();
    let (gpu, stream) = open_rank::<R>(comm).expect("device and stream");
    stream.warm(&gpu).expect("warm");
    let norm_kernel = RmsNormKernel::<R>::load(gpu.raw()).expect("norm kernel");
    let b = Bufs::new(max_tokens * hidden, max_tokens, hidden, dtype, &stream).expect("buffers");
    stream.synchronize().expect("sync");
    let mut failures = Vec::new();
    let dev = comm.device();
    for case in cases {
        let n = case.tokens * hidden;
        let tb = n * dtype.size();
        barrier.wait();
        if rank == 0 {
            let inputs: Vec<HostBytes> = (0..world).map(|r| data(dtype, n, case.seed, r)).collect();
            let refs: Vec<&[u8]> = inputs.iter().map(|x| x.as_slice()).collect();
            let residual = data(dtype, n, case.seed, usize::MAX);
            let gamma = data(dtype, hidden, case.seed, usize::MAX - 1);
            let reference = f::reference(
                &refs,
                dtype,
                case.tokens,
                hidden,
                Some(residual.as_slice()).filter(|_| case.residual),
                Some(gamma.as_slice()),
                EPS,
                case.pattern,
                Some(STATIC_SCALE)
                    .filter(|_| case.pattern == FusedPattern::ResidualRmsNormFp8Static),
                case.weight_bias,
            );
            *expect.write().unwrap() = Some(Expect { reference });
        }
        b.input
            .upload(data(dtype, n, case.seed, rank).as_slice(), &stream)
            .unwrap();
        b.residual
            .upload(data(dtype, n, case.seed, usize::MAX).as_slice(), &stream)
            .unwrap();
        b.gamma
            .upload(
                data(dtype, hidden, case.seed, usize::MAX - 1).as_slice(),
                &stream,
            )
            .unwrap();
        stream.synchronize().unwrap();
        barrier.wait();
        // SAFETY: every view is a prefix of a live buffer of this rank, 16-byte aligned.
        let run = unsafe {
            let r = |b: &DeviceBuffer<R>| BufRef::from_raw(b.addr(), n, dtype, dev);
            let m = |b: &DeviceBuffer<R>| BufMut::from_raw(b.addr(), n, dtype, dev);
            let mut args = FusedArgs::new(case.pattern, case.tokens, r(&b.input))
                .strategy(case.strategy)
                .stream(stream.handle());
            match case.out {
                Out::Separate => args = args.allreduce_out(m(&b.ar)),
                Out::InPlace => args = args.allreduce_out(m(&b.input)),
                Out::Omitted => {}
            }
            if case.pattern.has_norm() {
                if case.residual {
                    args = args.residual(r(&b.residual), Some(m(&b.res_out)));
                }
                args = args
                    .rms_norm(
                        BufRef::from_raw(b.gamma.addr(), hidden, dtype, dev),
                        EPS,
                        Some(m(&b.norm)),
                    )
                    .weight_bias(case.weight_bias);
            }
            if case.pattern == FusedPattern::ResidualRmsNormFp8 {
                args = args.fp8(
                    Fp8BufMut::from_raw(b.quant.addr(), n, dev),
                    BufMut::from_raw(b.scale.addr(), case.tokens, DType::F32, dev),
                );
            }
            if case.pattern == FusedPattern::ResidualRmsNormFp8Static {
                args = args.fp8_static(
                    Fp8BufMut::from_raw(b.quant.addr(), n, dev),
                    BufRef::from_raw(b.static_scale.addr(), 1, DType::F32, dev),
                );
            }
            // The unfused pipeline first (an in-place fused call overwrites the input):
            // our exact all-reduce, then the residual + RMSNorm kernel.
            let unfused = || -> allreduce::Result<()> {
                comm.all_reduce(
                    r(&b.input),
                    m(&b.u_ar),
                    &AllReduceOptions::default().stream(stream.handle()),
                )?;
                if case.pattern.has_norm() {
                    let fp8 = case.pattern.has_fp8();
                    let per_token = case.pattern == FusedPattern::ResidualRmsNormFp8;
                    let fixed = case.pattern == FusedPattern::ResidualRmsNormFp8Static;
                    norm_kernel.launch(
                        dtype,
                        case.pattern,
                        &NormBuffers {
                            input: b.u_ar.addr() as u64,
                            residual_in: if case.residual {
                                b.residual.addr() as u64
                            } else {
                                0
                            },
                            residual_out: if case.residual {
                                b.u_res.addr() as u64
                            } else {
                                0
                            },
                            norm_out: b.u_norm.addr() as u64,
                            quant_out: if fp8 { b.u_quant.addr() as u64 } else { 0 },
                            scale_out: if per_token {
                                b.u_scale.addr() as u64
                            } else {
                                0
                            },
                            scale_in: if fixed {
                                b.static_scale.addr() as u64
                            } else {
                                0
                            },
                            gamma: b.gamma.addr() as u64,
                            weight_bias: case.weight_bias,
                        },
                        case.tokens,
                        hidden,
                        EPS,
                        1024,
                        stream.handle(),
                    )?;
                }
                Ok(())
            };
            unfused()
                .and_then(|_| comm.all_reduce_fused(ws, args))
                .and_then(|_| comm.synchronize(stream.handle()))
        };
        let label = format!(
            "{world} ranks {dtype} hidden {hidden} {} tokens {} {} allreduce_out {:?} residual \
             {} weight_bias {} rank {rank}",
            case.tokens, case.pattern, case.strategy, case.out, case.residual, case.weight_bias
        );
        if let Err(e) = run {
            failures.push(format!("{label}: {e}"));
            barrier.wait();
            continue;
        }
        let guard = expect.read().unwrap();
        let want = &guard.as_ref().unwrap().reference;
        let mut fail = |m: Option<String>| {
            if let Some(m) = m {
                failures.push(format!("{label}: {m}"));
            }
        };
        let ar_buf = match case.out {
            Out::Separate => Some(&b.ar),
            Out::InPlace => Some(&b.input),
            Out::Omitted => None,
        };
        if let Some(ar_buf) = ar_buf {
            let ar = down(ar_buf, tb, &stream);
            fail(compare(
                "allreduce_out",
                dtype,
                &ar,
                &want.allreduce,
                true,
                false,
            ));
            fail(compare(
                "allreduce_out vs unfused",
                dtype,
                &ar,
                &down(&b.u_ar, tb, &stream),
                false,
                false,
            ));
        }
        if case.pattern.has_norm() && case.residual {
            let res = down(&b.res_out, tb, &stream);
            fail(compare(
                "residual_out",
                dtype,
                &res,
                &want.residual,
                true,
                false,
            ));
            fail(compare(
                "residual_out vs unfused",
                dtype,
                &res,
                &down(&b.u_res, tb, &stream),
                false,
                false,
            ));
        }
        if case.pattern.has_norm() {
            let norm = down(&b.norm, tb, &stream);
            fail(compare("norm_out", dtype, &norm, &want.norm, false, true));
            // Same block reduction as the unfused kernel: equal by value.
            fail(compare(
                "norm_out vs unfused",
                dtype,
                &norm,
                &down(&b.u_norm, tb, &stream),
                false,
                false,
            ));
        }
        if case.pattern == FusedPattern::ResidualRmsNormFp8 {
            let q = down(&b.quant, n, &stream);
            let sc = f32s(&down(&b.scale, case.tokens * 4, &stream));
            fail(compare_fp8(
                "fp8",
                dtype,
                &q,
                &sc,
                &want.quant,
                &want.scale,
                hidden,
                false,
            ));
            let uq = down(&b.u_quant, n, &stream);
            let usc = f32s(&down(&b.u_scale, case.tokens * 4, &stream));
            fail(compare_fp8(
                "fp8 vs unfused",
                dtype,
                &q,
                &sc,
                &uq,
                &usc,
                hidden,
                true,
            ));
        }
        if case.pattern == FusedPattern::ResidualRmsNormFp8Static {
            let q = down(&b.quant, n, &stream);
            let norm = down(&b.norm, tb, &stream);
            fail(static_codes_check(
                "fp8 static",
                dtype,
                &q,
                &norm,
                STATIC_SCALE,
            ));
            fail(
                (q != down(&b.u_quant, n, &stream))
                    .then(|| "fp8 static vs unfused: codes differ".to_string()),
            );
        }
        drop(guard);
        barrier.wait();
    }
    failures
}

/// Static FP8 codes against the call's own norm_out, bit for bit: `code = e4m3(norm *
/// (1 / scale))` (norm_out itself is checked against the reference, within its
/// tolerance).
fn static_codes_check(
    what: &str,
    dtype: DType,
    q: &[u8],
    norm: &[u8],
    scale: f32,
) -> Option<String> {
    let mul = 1.0 / scale;
    let bad: Vec<usize> = (0..q.len())
        .filter(|&k| q[k] != allreduce::codec::f32_to_e4m3(dtype.load_f32(norm, k) * mul))
        .collect();
    if let Some(&k) = bad.first() {
        return Some(format!(
            "{what}: {} of {} codes differ from e4m3(norm_out / scale), first at {k}: {:#04x} for {}",
            bad.len(),
            q.len(),
            q[k],
            dtype.load_f32(norm, k)
        ));
    }
    None
}

// ---- Graphs ------------------------------------------------------------------------------

const REPLAYS: usize = 1000;
const DATA_SETS: usize = 5;

/// The calls a graph holds: (tokens, strategy, pattern).
fn graph_calls(k: usize) -> Vec<(usize, Strategy, FusedPattern)> {
    let all = [
        (1, Strategy::OneShot, FusedPattern::ResidualRmsNorm),
        (9, Strategy::TwoShot, FusedPattern::ResidualRmsNormFp8),
        (4, Strategy::Auto, FusedPattern::AllReduce),
        (6, Strategy::OneShot, FusedPattern::ResidualRmsNormFp8Static),
    ];
    all[..k].to_vec()
}

/// Graph call `c`'s (residual, weight_bias): the second call has no residual, the fourth
/// Gemma's `(1 + gamma)`.
fn graph_variant(c: usize) -> (bool, f32) {
    (c != 1, if c == 3 { 1.0 } else { 0.0 })
}

/// The static FP8 scale of data set `d`: uploaded with the inputs before each replay, so
/// a replay that kept the scale of its capture would fail.
fn graph_scale(d: usize) -> f32 {
    STATIC_SCALE * (1.0 + d as f32 / 4.0)
}

fn graph_rank<R: GpuTestRuntime>(
    comm: &Communicator,
    ws: &FusedWorkspace,
    k: usize,
    refs: &[Vec<FusedOutputs>],
    barrier: &Barrier,
) -> Result<(), String> {
    let (dtype, hidden) = (DType::BF16, 2048);
    let e = |e: allreduce::Error| e.to_string();
    let (gpu, stream) = open_rank::<R>(comm).map_err(e)?;
    stream.warm(&gpu).map_err(e)?;
    let rank = comm.rank();
    let dev = comm.device();
    let calls = graph_calls(k);
    let mut bufs = Vec::new();
    for &(tokens, _, _) in &calls {
        bufs.push(Bufs::new(tokens * hidden, tokens, hidden, dtype, &stream).map_err(e)?);
    }
    // Inputs of every data set, uploaded from host memory kept alive here.
    let inputs: Vec<Vec<HostBytes>> = calls
        .iter()
        .map(|&(tokens, _, _)| {
            (0..DATA_SETS)
                .map(|d| data(dtype, tokens * hidden, 100 + d, rank))
                .collect()
        })
        .collect();
    for (c, &(tokens, _, _)) in calls.iter().enumerate() {
        bufs[c]
            .residual
            .upload(
                data(dtype, tokens * hidden, 7, usize::MAX).as_slice(),
                &stream,
            )
            .map_err(e)?;
        bufs[c]
            .gamma
            .upload(data(dtype, hidden, 7, usize::MAX - 1).as_slice(), &stream)
            .map_err(e)?;
    }
    stream.synchronize().map_err(e)?;
    barrier.wait();
    let enqueue = || -> allreduce::Result<()> {
        for (c, (&(tokens, strategy, pattern), b)) in calls.iter().zip(&bufs).enumerate() {
            let n = tokens * hidden;
            let (residual, weight_bias) = graph_variant(c);
            // SAFETY: live buffers of this rank that outlive the graph.
            unsafe {
                let mut args = FusedArgs::new(
                    pattern,
                    tokens,
                    BufRef::from_raw(b.input.addr(), n, dtype, dev),
                )
                .allreduce_out(BufMut::from_raw(b.ar.addr(), n, dtype, dev))
                .strategy(strategy)
                .stream(stream.handle());
                if pattern.has_norm() && residual {
                    args = args.residual(
                        BufRef::from_raw(b.residual.addr(), n, dtype, dev),
                        Some(BufMut::from_raw(b.res_out.addr(), n, dtype, dev)),
                    );
                }
                if pattern.has_norm() {
                    args = args
                        .rms_norm(
                            BufRef::from_raw(b.gamma.addr(), hidden, dtype, dev),
                            EPS,
                            Some(BufMut::from_raw(b.norm.addr(), n, dtype, dev)),
                        )
                        .weight_bias(weight_bias);
                }
                if pattern == FusedPattern::ResidualRmsNormFp8 {
                    args = args.fp8(
                        Fp8BufMut::from_raw(b.quant.addr(), n, dev),
                        BufMut::from_raw(b.scale.addr(), tokens, DType::F32, dev),
                    );
                }
                if pattern == FusedPattern::ResidualRmsNormFp8Static {
                    args = args.fp8_static(
                        Fp8BufMut::from_raw(b.quant.addr(), n, dev),
                        BufRef::from_raw(b.static_scale.addr(), 1, DType::F32, dev),
                    );
                }
                comm.all_reduce_fused(ws, args)?;
            }
        }
        Ok(())
    };
    let upload = |d: usize| -> Result<(), String> {
        for (c, b) in bufs.iter().enumerate() {
            b.input
                .upload(inputs[c][d].as_slice(), &stream)
                .map_err(e)?;
            b.static_scale
                .upload(&graph_scale(d).to_le_bytes(), &stream)
                .map_err(e)?;
        }
        Ok(())
    };
    let check = |d: usize, what: &str| -> Result<(), String> {
        for (c, (&(tokens, _, pattern), b)) in calls.iter().zip(&bufs).enumerate() {
            let tb = tokens * hidden * dtype.size();
            let want = &refs[c][d];
            let label = format!("rank {rank}, {k} calls, {what}, call {c}");
            let mut m = compare(
                "allreduce_out",
                dtype,
                &down(&b.ar, tb, &stream),
                &want.allreduce,
                true,
                false,
            );
            if m.is_none() && pattern.has_norm() && graph_variant(c).0 {
                m = compare(
                    "residual_out",
                    dtype,
                    &down(&b.res_out, tb, &stream),
                    &want.residual,
                    true,
                    false,
                );
            }
            if m.is_none() && pattern.has_norm() {
                m = compare(
                    "norm_out",
                    dtype,
                    &down(&b.norm, tb, &stream),
                    &want.norm,
                    false,
                    true,
                );
            }
            if m.is_none() && pattern == FusedPattern::ResidualRmsNormFp8 {
                let sc = f32s(&down(&b.scale, tokens * 4, &stream));
                m = compare_fp8(
                    "fp8",
                    dtype,
                    &down(&b.quant, tokens * hidden, &stream),
                    &sc,
                    &want.quant,
                    &want.scale,
                    hidden,
                    false,
                );
            }
            if m.is_none() && pattern == FusedPattern::ResidualRmsNormFp8Static {
                m = static_codes_check(
                    "fp8 static",
                    dtype,
                    &down(&b.quant, tokens * hidden, &stream),
                    &down(&b.norm, tb, &stream),
                    graph_scale(d),
                );
            }
            if let Some(m) = m {
                return Err(format!("{label}: {m}"));
            }
        }
        Ok(())
    };
    upload(0)?;
    enqueue().map_err(e)?;
    comm.synchronize(stream.handle()).map_err(e)?;
    check(0, "eager")?;
    let graph = GpuGraph::capture(&stream, enqueue).map_err(e)?;
    for it in 1..=REPLAYS {
        let d = it % DATA_SETS;
        upload(d)?;
        graph.launch(&stream).map_err(e)?;
        comm.synchronize(stream.handle()).map_err(e)?;
        check(d, &format!("replay {it}"))?;
        if it == REPLAYS / 2 {
            let d = (it + 3) % DATA_SETS;
            upload(d)?;
            enqueue().map_err(e)?;
            comm.synchronize(stream.handle()).map_err(e)?;
            check(d, "eager between replays")?;
        }
    }
    Ok(())
}

fn run_graphs<R: GpuTestRuntime>(world: usize, k: usize) -> Result<(), String> {
    let (dtype, hidden) = (DType::BF16, 2048);
    let comms =
        virtual_group::<R>(world, 1 << 20, Duration::from_secs(3)).map_err(|e| e.to_string())?;
    let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(16, hidden, dtype))
        .map_err(|e| e.to_string())?;
    let refs: Vec<Vec<FusedOutputs>> = graph_calls(k)
        .iter()
        .enumerate()
        .map(|(c, &(tokens, _, pattern))| {
            let n = tokens * hidden;
            let (with_residual, weight_bias) = graph_variant(c);
            (0..DATA_SETS)
                .map(|d| {
                    let inputs: Vec<HostBytes> =
                        (0..world).map(|r| data(dtype, n, 100 + d, r)).collect();
                    let refs: Vec<&[u8]> = inputs.iter().map(|x| x.as_slice()).collect();
                    let residual = data(dtype, n, 7, usize::MAX);
                    let gamma = data(dtype, hidden, 7, usize::MAX - 1);
                    f::reference(
                        &refs,
                        dtype,
                        tokens,
                        hidden,
                        Some(residual.as_slice()).filter(|_| with_residual),
                        Some(gamma.as_slice()),
                        EPS,
                        pattern,
                        Some(graph_scale(d))
                            .filter(|_| pattern == FusedPattern::ResidualRmsNormFp8Static),
                        weight_bias,
                    )
                })
                .collect()
        })
        .collect();
    let barrier = Barrier::new(world);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&ws)
            .map(|(c, w)| {
                let (refs, barrier) = (&refs, &barrier);
                s.spawn(move || graph_rank::<R>(c, w, k, refs, barrier))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    results.into_iter().collect()
}

/// Two virtual ranks on GPU 0 with the given deadline, and their workspaces for up to 4
/// rows of `hidden` (the failure tests below).
fn two_ranks<R: GpuTestRuntime>(
    hidden: usize,
    dtype: DType,
    timeout: Duration,
) -> Result<(Vec<Communicator>, Vec<FusedWorkspace>), String> {
    let comms = virtual_group::<R>(2, 1 << 16, timeout).map_err(|e| e.to_string())?;
    let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(4, hidden, dtype))
        .map_err(|e| e.to_string())?;
    Ok((comms, ws))
}

/// Rank 1 never calls: rank 0's polls must give up at the deadline and report it, and the
/// group must refuse further calls.
fn run_timeout<R: GpuTestRuntime>() -> Result<(), String> {
    let (dtype, hidden) = (DType::BF16, 2048);
    let (comms, ws) = two_ranks::<R>(hidden, dtype, Duration::from_millis(500))?;
    let comm = &comms[0];
    let e = |e: allreduce::Error| e.to_string();
    let (gpu, stream) = open_rank::<R>(comm).map_err(e)?;
    stream.warm(&gpu).map_err(e)?;
    let dev = comm.device();
    let (x, out) = (
        DeviceBuffer::zeroed(hidden * 2, &stream).map_err(e)?,
        DeviceBuffer::zeroed(hidden * 2, &stream).map_err(e)?,
    );
    stream.synchronize().map_err(e)?;
    let call = || unsafe {
        // SAFETY: live buffers of `hidden` bf16 elements.
        let args = FusedArgs::new(
            FusedPattern::AllReduce,
            1,
            BufRef::from_raw(x.addr(), hidden, dtype, dev),
        )
        .allreduce_out(BufMut::from_raw(out.addr(), hidden, dtype, dev))
        .stream(stream.handle());
        comm.all_reduce_fused(&ws[0], args)
    };
    let start = Instant::now();
    call().map_err(e)?;
    match comm.synchronize(stream.handle()) {
        Err(allreduce::Error::Timeout { .. }) => {}
        other => return Err(format!("expected a timeout, got {other:?}")),
    }
    let waited = start.elapsed();
    if waited > Duration::from_secs(5) {
        return Err(format!("the timeout took {waited:?} for a 500 ms deadline"));
    }
    match call() {
        Err(allreduce::Error::Aborted { .. }) => Ok(()),
        other => Err(format!("expected Aborted after the timeout, got {other:?}")),
    }
}

/// Rank 0 calls with 1 token, rank 1 with 2: both must report the disagreement (not wait
/// for the deadline, not return a sum of mismatched rows), and the group stays usable: the
/// next three fused calls (the third on the buffer the skipped call's pushes landed in) and a
/// plain all-reduce are exact.
fn run_mismatch<R: GpuTestRuntime>() -> Result<(), String> {
    let (dtype, hidden) = (DType::BF16, 2048);
    let (comms, ws) = two_ranks::<R>(hidden, dtype, Duration::from_secs(3))?;
    let barrier = Barrier::new(2);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&ws)
            .enumerate()
            .map(|(rank, (comm, w))| {
                let barrier = &barrier;
                s.spawn(move || -> Result<(), String> {
                    let e = |e: allreduce::Error| e.to_string();
                    let (gpu, stream) = open_rank::<R>(comm).map_err(e)?;
                    stream.warm(&gpu).map_err(e)?;
                    let dev = comm.device();
                    let n = 2 * hidden;
                    let (x, out) = (
                        DeviceBuffer::zeroed(n * 2, &stream).map_err(e)?,
                        DeviceBuffer::zeroed(n * 2, &stream).map_err(e)?,
                    );
                    stream.synchronize().map_err(e)?;
                    barrier.wait();
                    let call = |tokens: usize| unsafe {
                        // SAFETY: live buffers of 2 rows of `hidden` bf16 elements.
                        let args = FusedArgs::new(
                            FusedPattern::AllReduce,
                            tokens,
                            BufRef::from_raw(x.addr(), tokens * hidden, dtype, dev),
                        )
                        .allreduce_out(BufMut::from_raw(out.addr(), tokens * hidden, dtype, dev))
                        .strategy(Strategy::OneShot)
                        .stream(stream.handle());
                        comm.all_reduce_fused(w, args)
                    };
                    let start = Instant::now();
                    call(1 + rank).map_err(e)?;
                    let got = comm.synchronize(stream.handle());
                    let took = start.elapsed();
                    match &got {
                        Err(allreduce::Error::RankMismatch { detail, .. })
                            if detail.contains("1 tokens") && detail.contains("2 tokens") => {}
                        other => {
                            return Err(format!(
                                "rank {rank}: expected RankMismatch, got {other:?}"
                            ))
                        }
                    }
                    if took > Duration::from_secs(2) {
                        return Err(format!("rank {rank}: the mismatch took {took:?} to report"));
                    }
                    if got.as_ref().unwrap_err().aftermath() != allreduce::Aftermath::Intact {
                        return Err(format!(
                            "rank {rank}: {got:?} does not leave the group intact"
                        ));
                    }
                    // Small integers: every sum is exact in bf16, whatever the order.
                    let int = |r: usize, i: usize| ((i * 7 + r * 3) % 11) as f32 - 5.0;
                    let bf16 = |v: f32| ((v.to_bits() >> 16) as u16).to_le_bytes();
                    let mine: Vec<u8> = (0..n).flat_map(|i| bf16(int(rank, i))).collect();
                    let want: Vec<u8> = (0..n).flat_map(|i| bf16(int(0, i) + int(1, i))).collect();
                    x.upload(&mine, &stream).map_err(e)?;
                    stream.synchronize().map_err(e)?;
                    barrier.wait();
                    let check = |what: &str, tokens: usize| -> Result<(), String> {
                        comm.synchronize(stream.handle())
                            .map_err(|err| format!("{what}: {err}"))?;
                        let got = down(&out, tokens * hidden * 2, &stream);
                        if got != want[..tokens * hidden * 2] {
                            return Err(format!(
                                "rank {rank}: {what} after the mismatch is not exact"
                            ));
                        }
                        Ok(())
                    };
                    // Three calls: the third runs on the buffer the skipped call's pushes
                    // landed in (buffers rotate by three), which the first one refilled.
                    for (what, strategy) in [
                        ("one-shot", Strategy::OneShot),
                        ("two-shot", Strategy::TwoShot),
                        ("one-shot on the skipped call's buffer", Strategy::OneShot),
                    ] {
                        // A call that wrote nothing must not pass on the previous result.
                        out.upload(&vec![0u8; n * 2], &stream).map_err(e)?;
                        // SAFETY: live buffers of 2 rows of `hidden` bf16 elements.
                        unsafe {
                            let args = FusedArgs::new(
                                FusedPattern::AllReduce,
                                2,
                                BufRef::from_raw(x.addr(), n, dtype, dev),
                            )
                            .allreduce_out(BufMut::from_raw(out.addr(), n, dtype, dev))
                            .strategy(strategy)
                            .stream(stream.handle());
                            comm.all_reduce_fused(w, args).map_err(e)?;
                        }
                        check(&format!("a fused {what} call"), 2)?;
                    }
                    out.upload(&vec![0u8; n * 2], &stream).map_err(e)?;
                    // SAFETY: as above.
                    unsafe {
                        comm.all_reduce(
                            BufRef::from_raw(x.addr(), n, dtype, dev),
                            BufMut::from_raw(out.addr(), n, dtype, dev),
                            &AllReduceOptions::default().stream(stream.handle()),
                        )
                        .map_err(e)?;
                    }
                    check("a plain all-reduce", 2)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    results.into_iter().collect()
}

pub fn run<R: GpuTestRuntime>() {
    if !gpu_available::<R>("fused") {
        return;
    }
    let quick = std::env::var_os("ALLREDUCE_FUSED_QUICK").is_some();
    let mut failures = Vec::new();
    let mut cases_run = 0;
    let worlds: &[usize] = &[2, 4, 8];
    for &world in worlds {
        for dtype in [DType::BF16, DType::F16] {
            for hidden in [2048usize, 4096, 8192] {
                let tokens: &[usize] = if quick {
                    &[1, 9, 128]
                } else {
                    &[1, 2, 7, 16, 33, 128, 129, 500, 2048]
                };
                let mut cases = Vec::new();
                for (i, &t) in tokens.iter().enumerate() {
                    let pattern = FusedPattern::ALL[(i + hidden / 2048) % FusedPattern::ALL.len()];
                    let strategies = [Strategy::Auto, Strategy::OneShot, Strategy::TwoShot];
                    for (k, strategy) in strategies.into_iter().enumerate() {
                        // The largest rows are slow to check on the host: Auto only.
                        if t >= 500 && strategy != Strategy::Auto {
                            continue;
                        }
                        let out = match (i + k) % 3 {
                            1 => Out::InPlace,
                            2 if pattern.has_norm() => Out::Omitted,
                            _ => Out::Separate,
                        };
                        let (residual, weight_bias) = variant(cases.len() + i);
                        cases.push(Case {
                            tokens: t,
                            pattern,
                            strategy,
                            seed: i * 3 + world,
                            out,
                            residual,
                            weight_bias,
                        });
                    }
                }
                let start = Instant::now();
                let f = run_group::<R>(world, dtype, hidden, Launch::Default, &cases);
                let label = format!(
                    "{world} ranks {dtype} hidden {hidden} ({:.1} s)",
                    start.elapsed().as_secs_f64()
                );
                tally::<R>(&label, &cases, f, &mut cases_run, &mut failures);
            }
        }
    }
    // 3 ranks: the generic kernels (the world read from the arguments, not compiled in).
    let cases = mixed_cases(&[1, 7, 128], 40, |i, _| i);
    let f = run_group::<R>(3, DType::BF16, 4096, Launch::Default, &cases);
    tally::<R>(
        "3 ranks bf16 hidden 4096",
        &cases,
        f,
        &mut cases_run,
        &mut failures,
    );
    // Grids other than the default (12: clusters of 4 or 2, or none; 9: never a
    // cluster), and ordinary launches where the default is PDL. (The widest grid a device
    // allows, one block per SM for all ranks together, is the default at 8 ranks.)
    for (world, dtype, hidden) in [(8, DType::BF16, 8192), (2, DType::F16, 4096)] {
        for launch in [Launch::Blocks(12), Launch::Blocks(9), Launch::NoPdl] {
            let cases = mixed_cases(&[1, 4, 8, 16, 33, 128], 60, |i, k| i + k);
            let f = run_group::<R>(world, dtype, hidden, launch, &cases);
            let how = match launch {
                Launch::Blocks(b) => format!("{b} blocks"),
                Launch::NoPdl => "no PDL".to_string(),
                Launch::Default => "defaults".to_string(),
            };
            let label = format!("{world} ranks {dtype} hidden {hidden}, {how}");
            tally::<R>(&label, &cases, f, &mut cases_run, &mut failures);
        }
    }
    for &world in worlds {
        for k in 1..=4 {
            let start = Instant::now();
            match run_graphs::<R>(world, k) {
                Ok(()) => crate::say!(
                    R,
                    "{world} ranks, graph of {k} fused calls x {REPLAYS} replays: ok ({:.2} s)",
                    start.elapsed().as_secs_f64()
                ),
                Err(m) => {
                    crate::say!(R, "{world} ranks, graph of {k} fused calls: FAIL {m}");
                    failures.push(m);
                }
            }
        }
    }
    match run_timeout::<R>() {
        Ok(()) => crate::say!(
            R,
            "a missing rank: Timeout at the deadline, then Aborted: ok"
        ),
        Err(m) => {
            crate::say!(R, "a missing rank: FAIL {m}");
            failures.push(m);
        }
    }
    match run_mismatch::<R>() {
        Ok(()) => {
            crate::say!(
                R,
                "ranks disagreeing on tokens: RankMismatch on both, then exact fused and plain calls: ok"
            )
        }
        Err(m) => {
            crate::say!(R, "ranks disagreeing on tokens: FAIL {m}");
            failures.push(m);
        }
    }
    crate::say!(
        R,
        "{}_fused: {} cases, {} failures",
        R::NAME,
        cases_run,
        failures.len()
    );
    assert!(failures.is_empty(), "{} failures", failures.len());
}
