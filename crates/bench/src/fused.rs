//! `--fused` (any GPU backend): the fused all-reduce + residual + RMSNorm against the unfused pipeline,
//! our all-reduce (`Strategy::Auto`) followed by the residual + RMSNorm kernel, in the same
//! run, on the same inputs and buffers.
//!
//! Per (hidden, tokens), every rank thread runs warm-up calls, then alternately a timed loop of
//! fused calls and a timed loop of unfused pairs, twice each, and keeps its faster loop of
//! each; the row's time is the slowest rank's. Two modes: eager (one launch per kernel per
//! call, as a framework without graphs runs them) and graph (the loop captured into a CUDA
//! graph of `GRAPH_CALLS` calls and replayed, as vLLM/TRT-LLM decode runs them: no host
//! launch cost).

use std::sync::Barrier;
use std::time::Instant;

use allreduce::{
    AllReduceOptions, BufMut, BufRef, Communicator, DType, Fp8BufMut, FusedArgs, FusedConfig,
    FusedPattern, FusedWorkspace, GroupConfig, HostBytes, Strategy,
};
use allreduce_gpu::device::{DeviceBuffer, GpuGraph};
use allreduce_gpu::fused::{NormBuffers, RmsNormKernel};
use allreduce_gpu::GpuRuntime;

use crate::cli::{Args, BenchPattern};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const EPS: f32 = 1e-6;
const ITERS: usize = 200;
const GRAPH_CALLS: usize = 20;
const GRAPH_REPLAYS: usize = 10;

/// Per tokens: (fused eager, unfused eager, fused graph, unfused graph, fused one-shot eager,
/// fused two-shot eager, fused eager enqueue, unfused eager enqueue) in seconds per call, and
/// the strategy Auto ran. Enqueue: the host's time to issue a timed loop's calls, before it
/// waits for them (near the loop's time: the host, not the GPU, set the eager pace).
type Times = Vec<(usize, [f64; 8], Strategy)>;

struct Bufs<R: GpuRuntime> {
    input: DeviceBuffer<R>,
    residual: DeviceBuffer<R>,
    gamma: DeviceBuffer<R>,
    res_out: DeviceBuffer<R>,
    norm: DeviceBuffer<R>,
    ar: DeviceBuffer<R>,
    /// FP8 codes, per-token scales, the static scale (FP8 patterns).
    quant: DeviceBuffer<R>,
    scales: DeviceBuffer<R>,
    static_scale: DeviceBuffer<R>,
}

pub(crate) fn fill(dtype: DType, n: usize, seed: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let v = ((i * 7 + seed * 13) % 23) as f32 / 8.0 - 1.4;
        dtype.store_f32(b.as_mut_slice(), i, v);
    }
    b
}

#[allow(clippy::too_many_arguments)]
fn rank_loop<R: GpuRuntime>(
    comm: &Communicator,
    ws: &FusedWorkspace,
    dtype: DType,
    hidden: usize,
    tokens: &[usize],
    bench: BenchPattern,
    weight_bias: f32,
    barrier: &Barrier,
) -> Result<Times, String> {
    let pattern = bench.pattern;
    let e = |e: allreduce::Error| e.to_string();
    let dev = comm.device();
    let (d, stream) = crate::gpu::open_rank::<R>(comm).map_err(e)?;
    stream.warm(&d).map_err(e)?;
    let kernel = RmsNormKernel::<R>::load(d.raw()).map_err(e)?;
    let max = tokens.iter().copied().max().unwrap_or(1) * hidden;
    let bytes = max * dtype.size();
    let b = Bufs {
        input: DeviceBuffer::from_host(fill(dtype, max, comm.rank()).as_slice(), &stream)
            .map_err(e)?,
        residual: DeviceBuffer::from_host(fill(dtype, max, 99).as_slice(), &stream).map_err(e)?,
        gamma: DeviceBuffer::from_host(fill(dtype, hidden, 5).as_slice(), &stream).map_err(e)?,
        res_out: DeviceBuffer::zeroed(bytes, &stream).map_err(e)?,
        norm: DeviceBuffer::zeroed(bytes, &stream).map_err(e)?,
        ar: DeviceBuffer::zeroed(bytes, &stream).map_err(e)?,
        quant: DeviceBuffer::zeroed(max, &stream).map_err(e)?,
        scales: DeviceBuffer::zeroed(4 * (max / hidden), &stream).map_err(e)?,
        static_scale: DeviceBuffer::from_host(&0.01f32.to_le_bytes(), &stream).map_err(e)?,
    };
    // FP8 patterns write codes (and scales) instead of norm_out, in both pipelines, as an
    // FP8 model's next GEMM reads them.
    let fp8 = pattern.has_fp8();
    let per_token = pattern == FusedPattern::ResidualRmsNormFp8;
    let fixed = pattern == FusedPattern::ResidualRmsNormFp8Static;
    stream.synchronize().map_err(e)?;
    barrier.wait();
    let mut out = Vec::new();
    for &t in tokens {
        let n = t * hidden;
        let mut strategy = Strategy::Auto;
        // SAFETY (both closures): prefixes of this rank's live buffers, 16-byte aligned.
        let fused_with = |strategy: Strategy| -> allreduce::Result<Strategy> {
            unsafe {
                let mut args =
                    FusedArgs::new(pattern, t, BufRef::from_raw(b.input.addr(), n, dtype, dev))
                        .rms_norm(
                            BufRef::from_raw(b.gamma.addr(), hidden, dtype, dev),
                            EPS,
                            (!fp8).then(|| BufMut::from_raw(b.norm.addr(), n, dtype, dev)),
                        )
                        .weight_bias(weight_bias)
                        .strategy(strategy)
                        .stream(stream.handle());
                if bench.residual {
                    args = args.residual(
                        BufRef::from_raw(b.residual.addr(), n, dtype, dev),
                        Some(BufMut::from_raw(b.res_out.addr(), n, dtype, dev)),
                    );
                }
                let quant = || Fp8BufMut::from_raw(b.quant.addr(), n, dev);
                if per_token {
                    args = args.fp8(
                        quant(),
                        BufMut::from_raw(b.scales.addr(), t, DType::F32, dev),
                    );
                }
                if fixed {
                    args = args.fp8_static(
                        quant(),
                        BufRef::from_raw(b.static_scale.addr(), 1, DType::F32, dev),
                    );
                }
                comm.all_reduce_fused(ws, args)
            }
        };
        let fused = || fused_with(Strategy::Auto);
        let unfused = || -> allreduce::Result<()> {
            unsafe {
                comm.all_reduce(
                    BufRef::from_raw(b.input.addr(), n, dtype, dev),
                    BufMut::from_raw(b.ar.addr(), n, dtype, dev),
                    &AllReduceOptions::default().stream(stream.handle()),
                )?;
                let addr = |b: &DeviceBuffer<R>, yes: bool| if yes { b.addr() as u64 } else { 0 };
                kernel.launch(
                    dtype,
                    pattern,
                    &NormBuffers {
                        input: b.ar.addr() as u64,
                        residual_in: addr(&b.residual, bench.residual),
                        residual_out: addr(&b.res_out, bench.residual),
                        norm_out: addr(&b.norm, !fp8),
                        quant_out: addr(&b.quant, fp8),
                        scale_out: addr(&b.scales, per_token),
                        scale_in: addr(&b.static_scale, fixed),
                        gamma: b.gamma.addr() as u64,
                        weight_bias,
                    },
                    t,
                    hidden,
                    EPS,
                    1024,
                    stream.handle(),
                )
            }
        };
        for _ in 0..10 {
            strategy = fused().map_err(e)?;
            unfused().map_err(e)?;
        }
        comm.synchronize(stream.handle()).map_err(e)?;
        // (seconds per call, of which enqueueing)
        let time_enq =
            |f: &dyn Fn() -> allreduce::Result<()>, calls: usize| -> Result<(f64, f64), String> {
                barrier.wait();
                let start = Instant::now();
                for _ in 0..calls {
                    f().map_err(e)?;
                }
                let enqueued = start.elapsed().as_secs_f64();
                comm.synchronize(stream.handle()).map_err(e)?;
                Ok((
                    start.elapsed().as_secs_f64() / calls as f64,
                    enqueued / calls as f64,
                ))
            };
        let time = |f: &dyn Fn() -> allreduce::Result<()>, calls: usize| {
            time_enq(f, calls).map(|(t, _)| t)
        };
        let fused_unit = || fused().map(|_| ());
        let mut best = [f64::INFINITY; 8];
        for _ in 0..2 {
            // The enqueue time of the faster loop.
            let (f, fe) = time_enq(&fused_unit, ITERS)?;
            if f < best[0] {
                (best[0], best[6]) = (f, fe);
            }
            let (u, ue) = time_enq(&unfused, ITERS)?;
            if u < best[1] {
                (best[1], best[7]) = (u, ue);
            }
        }
        // The two fused kernels forced, for the Auto table (two-shot needs a row per rank).
        let one = || fused_with(Strategy::OneShot).map(|_| ());
        let two = || fused_with(Strategy::TwoShot).map(|_| ());
        best[4] = time(&one, ITERS)?;
        best[5] = if t >= comm.world_size() {
            time(&two, ITERS)?
        } else {
            f64::NAN
        };
        // Graphs of GRAPH_CALLS calls, replayed.
        let gf = GpuGraph::capture(&stream, || (0..GRAPH_CALLS).try_for_each(|_| fused_unit()))
            .map_err(e)?;
        let gu = GpuGraph::capture(&stream, || (0..GRAPH_CALLS).try_for_each(|_| unfused()))
            .map_err(e)?;
        gf.launch(&stream).map_err(e)?;
        gu.launch(&stream).map_err(e)?;
        comm.synchronize(stream.handle()).map_err(e)?;
        let per = GRAPH_CALLS * GRAPH_REPLAYS;
        for _ in 0..2 {
            best[2] = best[2].min(
                time(&|| gf.launch(&stream), GRAPH_REPLAYS)? * GRAPH_REPLAYS as f64 / per as f64,
            );
            best[3] = best[3].min(
                time(&|| gu.launch(&stream), GRAPH_REPLAYS)? * GRAPH_REPLAYS as f64 / per as f64,
            );
        }
        barrier.wait();
        out.push((t, best, strategy));
    }
    barrier.wait();
    Ok(out)
}

pub fn run<R: GpuRuntime>(args: &Args) -> Result<(), BoxError> {
    let dtype = args.dtype;
    let pattern = args.fused_pattern;
    let weight_bias = args.weight_bias;
    let world = args.ranks;
    let max_tokens = args.tokens.iter().copied().max().unwrap_or(1);
    println!(
        "# allreduce-bench --fused: {world} ranks (virtual, one GPU unless the group says \
         otherwise), {dtype}, {pattern}, weight_bias {weight_bias}; us per call, slowest rank; \
         unfused = all_reduce(Auto) + residual/RMSNorm kernel (same pattern)"
    );
    // The group below uses the default devices: every rank on GPU 0.
    crate::report::print_origin(&[R::device_tag(0)]);
    println!(
        "# {:>6} {:>6} {:>8} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>9} {:>9} | {:>9} {:>9}",
        "hidden",
        "tokens",
        "fused",
        "eager",
        "unfused",
        "ratio",
        "graph",
        "unfused",
        "ratio",
        "1shot",
        "2shot",
        "enq fused",
        "unfused"
    );
    for &hidden in &args.fused_hidden {
        let bytes = max_tokens * hidden * dtype.size();
        let comms = Communicator::new_group(
            args.backend,
            GroupConfig::new(world)
                .max_bytes(bytes)
                .timeout(std::time::Duration::from_secs_f64(args.timeout)),
        )?;
        let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(max_tokens, hidden, dtype))?;
        if let Some(w) = ws.first() {
            let m = w.metadata();
            println!(
                "# hidden {hidden}: {} blocks per fused launch, {}",
                m.blocks,
                if m.pdl {
                    "programmatic dependent launch"
                } else {
                    "ordinary launches"
                }
            );
        }
        let barrier = Barrier::new(world);
        let results: Vec<Result<Times, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&ws)
                .map(|(c, w)| {
                    let barrier = &barrier;
                    let tokens = &args.tokens;
                    s.spawn(move || {
                        rank_loop::<R>(c, w, dtype, hidden, tokens, pattern, weight_bias, barrier)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("rank thread panicked".into()))
                })
                .collect()
        });
        let results = results
            .into_iter()
            .collect::<Result<Vec<Times>, String>>()?;
        for (i, &(t, _, strategy)) in results[0].iter().enumerate() {
            let mut worst = [0f64; 8];
            for r in &results {
                for (w, t) in worst.iter_mut().zip(r[i].1) {
                    *w = w.max(t);
                }
            }
            let us = worst.map(|s| s * 1e6);
            println!(
                "  {:>6} {:>6} {:>8} | {:>9.2} {:>9.2} {:>6.3} | {:>9.2} {:>9.2} {:>6.3} | {:>9.2} {:>9.2} | {:>9.2} {:>9.2}",
                hidden,
                t,
                strategy.name(),
                us[0],
                us[1],
                us[0] / us[1],
                us[2],
                us[3],
                us[2] / us[3],
                us[4],
                us[5],
                us[6],
                us[7]
            );
        }
    }
    Ok(())
}
