//! `--peers --fused` (CUDA): our fused all-reduce + residual + RMSNorm (+ FP8) against
//! TensorRT-LLM's all-reduce fusion kernels (crates/peers; FlashInfer's copy of them), on the
//! same GPU, in the same run, on the same inputs, streams and method.
//!
//! Per (hidden, tokens), every rank thread runs each contender once on zeroed outputs and
//! checks them against a host reference, then warm-up calls, then alternately a timed loop of
//! each contender, twice, keeping its faster loop; the row's time is the slowest rank's. Eager:
//! one launch per call. Graph: `GRAPH_CALLS` calls captured and replayed. Contenders:
//! - ours: `Communicator::all_reduce_fused` with `Auto`, and one-shot / two-shot forced;
//! - TensorRT-LLM's Lamport one-shot kernel and its two-shot kernel, each launched by its own
//!   launcher (grid, block and cluster size its library picks) with programmatic dependent
//!   launch and f32 accumulation (its defaults in TensorRT-LLM and vLLM).
//!
//! The same share of the GPU for both: TensorRT-LLM's launcher sizes its grid by the SM count,
//! which it is told is SMs / ranks on the GPU (ours takes at most that many blocks too), so
//! every rank's grid co-resides. Its kernels wait without a deadline: a watchdog ends the
//! process if a row stops progressing.
//!
//! The check, against the specification's host reference: the new residual and the norm within
//! one unit in the last place of T, FP8 values within one E4M3 step; a contender with a wrong
//! element is reported and not timed.

use std::sync::{Barrier, Mutex};
use std::time::Duration;

use allreduce::{
    BufMut, BufRef, Communicator, DType, Fp8BufMut, FusedArgs, FusedConfig, FusedPattern,
    FusedWorkspace, GroupConfig, HostBytes, Strategy,
};
use allreduce_core::codec::e4m3_to_f32;
use allreduce_core::fused::{norm_tolerance, reference as fused_reference, FusedOutputs};
use allreduce_peers::{Trtllm, TrtllmBufs, TrtllmPattern};

use crate::cli::Args;
use crate::fused::fill;
use crate::peer_harness::{
    agree_wrong, keep_min, min_nan, ratio, slowest, time_eager, us, Heartbeat,
};
use allreduce::cuda::CudaRuntime as R;
use allreduce_gpu::device::{DeviceBuffer, GpuDevice, GpuGraph};
use allreduce_gpu::GpuRuntime;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const EPS: f32 = 1e-6;
const STATIC_SCALE: f32 = 0.01;
const GRAPH_CALLS: usize = 20;
const GRAPH_REPLAYS: usize = 10;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    Auto,
    OneShot,
    TwoShot,
    TrtOneShot,
    TrtTwoShot,
}
const ALL: [Who; 5] = [
    Who::Auto,
    Who::OneShot,
    Who::TwoShot,
    Who::TrtOneShot,
    Who::TrtTwoShot,
];
/// In graphs: ours (Auto) and both of TensorRT-LLM's kernels.
const GRAPH: [Who; 3] = [Who::Auto, Who::TrtOneShot, Who::TrtTwoShot];

#[derive(Clone, Debug)]
struct Row {
    tokens: usize,
    eager: [f64; 5],
    graph: [f64; 3],
    wrong: [usize; 5],
    ran: Option<Strategy>,
}

/// What every rank must know of every other: its (comm, barrier, Lamport) buffers.
type Shared = Mutex<Vec<(u64, u64, u64)>>;

/// The host reference (the specification's, `allreduce_core::fused::reference`) for the
/// largest token count: every row count's reference is a prefix of it (rows are independent).
struct Reference {
    out: FusedOutputs,
}

impl Reference {
    fn new(
        dtype: DType,
        pattern: FusedPattern,
        world: usize,
        tokens: usize,
        hidden: usize,
    ) -> Reference {
        let n = tokens * hidden;
        let inputs: Vec<HostBytes> = (0..world).map(|r| fill(dtype, n, r)).collect();
        let views: Vec<&[u8]> = inputs.iter().map(|b| b.as_slice()).collect();
        let out = fused_reference(
            &views,
            dtype,
            tokens,
            hidden,
            Some(fill(dtype, n, 99).as_slice()),
            Some(fill(dtype, hidden, 5).as_slice()),
            EPS,
            pattern,
            Some(STATIC_SCALE),
            0.0,
        );
        Reference { out }
    }
}

/// Wrong elements of one rank's outputs for `tokens` rows against the reference: the new
/// residual and the norm within [`norm_tolerance`] (one unit in the last place of T: the
/// residual is bitwise reproducible in ours, a peer may round differently), FP8 values
/// (code x scale) within one E4M3 step of the reference's.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn count_wrong(
    dtype: DType,
    pattern: FusedPattern,
    hidden: usize,
    tokens: usize,
    reference: &Reference,
    res_out: &[u8],
    norm: &[u8],
    quant: &[u8],
    scales: &[u8],
) -> usize {
    let r = &reference.out;
    let close = |want: f32, got: f32| (got - want).abs() <= norm_tolerance(dtype, want);
    let mut wrong = 0;
    for i in 0..tokens * hidden {
        if !close(dtype.load_f32(&r.residual, i), dtype.load_f32(res_out, i)) {
            wrong += 1;
        }
        let t = i / hidden;
        match pattern {
            FusedPattern::ResidualRmsNorm => {
                if !close(dtype.load_f32(&r.norm, i), dtype.load_f32(norm, i)) {
                    wrong += 1;
                }
            }
            FusedPattern::ResidualRmsNormFp8 | FusedPattern::ResidualRmsNormFp8Static => {
                let (scale, want_scale) = if pattern == FusedPattern::ResidualRmsNormFp8 {
                    let s = f32::from_le_bytes(scales[4 * t..][..4].try_into().unwrap());
                    (s, r.scale[t])
                } else {
                    (STATIC_SCALE, STATIC_SCALE)
                };
                let got = e4m3_to_f32(quant[i]) * scale;
                let want = e4m3_to_f32(r.quant[i]) * want_scale;
                let step = got.abs().max(want.abs()) / 8.0 + scale.max(want_scale) * 2f32.powi(-9);
                if (got - want).abs() > step || got.is_nan() {
                    wrong += 1;
                }
            }
            FusedPattern::AllReduce => {}
        }
    }
    wrong
}

#[allow(clippy::too_many_arguments)]
fn rank_loop(
    comm: &Communicator,
    ws: &FusedWorkspace,
    dtype: DType,
    pattern: FusedPattern,
    hidden: usize,
    tokens: &[usize],
    barrier: &Barrier,
    shared: &Shared,
    heartbeat: &Heartbeat,
    reference: &Reference,
    wrongs: &Mutex<Vec<[usize; 5]>>,
) -> Result<Vec<Row>, String> {
    let e = |e: allreduce::Error| e.to_string();
    let rank = comm.rank();
    let world = comm.world_size();
    let dev = comm.device();
    let (d, stream) = crate::gpu::open_rank::<R>(comm).map_err(e)?;
    stream.warm(&d).map_err(e)?;
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    let max = max_t * hidden;
    let bytes = max * dtype.size();
    let sizes = Trtllm::sizes(world, max_t, hidden, dtype);
    // Every buffer before any rank's first call (virtual ranks: an allocation that waits for
    // the device while a peer's kernel waits for us never ends).
    let z = |n: usize| DeviceBuffer::<R>::zeroed(n.max(16), &stream).map_err(e);
    let input =
        DeviceBuffer::<R>::from_host(fill(dtype, max, rank).as_slice(), &stream).map_err(e)?;
    let residual =
        DeviceBuffer::<R>::from_host(fill(dtype, max, 99).as_slice(), &stream).map_err(e)?;
    let gamma =
        DeviceBuffer::<R>::from_host(fill(dtype, hidden, 5).as_slice(), &stream).map_err(e)?;
    let static_scale =
        DeviceBuffer::<R>::from_host(&STATIC_SCALE.to_le_bytes(), &stream).map_err(e)?;
    let (res_out, norm, quant, scales) = (z(bytes)?, z(bytes)?, z(max)?, z(4 * max_t)?);
    let (t_comm, t_barrier, t_lamport) =
        (z(sizes.comm)?, z(sizes.flags)?, z(3 * sizes.lamport_slot)?);
    let (t_flag, t_table) = (z(sizes.flag_block)?, z(sizes.table)?);
    stream.synchronize().map_err(e)?;
    shared.lock().unwrap()[rank] = (
        t_comm.addr() as u64,
        t_barrier.addr() as u64,
        t_lamport.addr() as u64,
    );
    barrier.wait();
    let peers = shared.lock().unwrap().clone();
    let col = |f: fn(&(u64, u64, u64)) -> u64| peers.iter().map(f).collect::<Vec<u64>>();
    // SAFETY: every rank's workspace buffers are sized by Trtllm::sizes and live until the
    // end of this function, after every call that uses them.
    let trt = unsafe {
        Trtllm::new(
            rank,
            &col(|p| p.0),
            &col(|p| p.1),
            &col(|p| p.2),
            t_flag.addr() as u64,
            t_table.addr() as u64,
            &sizes,
            dtype,
            stream.handle().as_raw() as u64,
        )
    };
    // Every rank's workspace filled before any kernel reads it.
    barrier.wait();
    let fp8 = pattern.has_fp8();
    let per_token = pattern == FusedPattern::ResidualRmsNormFp8;
    let fixed = pattern == FusedPattern::ResidualRmsNormFp8Static;
    let trt_pattern = match pattern {
        FusedPattern::ResidualRmsNormFp8 => TrtllmPattern::ResidualRmsNormFp8PerToken,
        FusedPattern::ResidualRmsNormFp8Static => TrtllmPattern::ResidualRmsNormFp8Static,
        _ => TrtllmPattern::ResidualRmsNorm,
    };
    let mut rows = Vec::new();
    for &t in tokens {
        let n = t * hidden;
        let ran = std::cell::Cell::new(None);
        let ours = |s: Strategy| -> Result<(), String> {
            // SAFETY: prefixes of this rank's live buffers, 16-byte aligned.
            unsafe {
                let mut args =
                    FusedArgs::new(pattern, t, BufRef::from_raw(input.addr(), n, dtype, dev))
                        .residual(
                            BufRef::from_raw(residual.addr(), n, dtype, dev),
                            Some(BufMut::from_raw(res_out.addr(), n, dtype, dev)),
                        )
                        .rms_norm(
                            BufRef::from_raw(gamma.addr(), hidden, dtype, dev),
                            EPS,
                            (!fp8).then(|| BufMut::from_raw(norm.addr(), n, dtype, dev)),
                        )
                        .strategy(s)
                        .stream(stream.handle());
                let q = || Fp8BufMut::from_raw(quant.addr(), n, dev);
                if per_token {
                    args = args.fp8(q(), BufMut::from_raw(scales.addr(), t, DType::F32, dev));
                }
                if fixed {
                    args = args.fp8_static(
                        q(),
                        BufRef::from_raw(static_scale.addr(), 1, DType::F32, dev),
                    );
                }
                comm.all_reduce_fused(ws, args)
            }
            .map(|s| ran.set(Some(s)))
            .map_err(e)
        };
        let trt_call = |oneshot: bool| -> Result<(), String> {
            let a = |b: &DeviceBuffer<R>, yes: bool| if yes { b.addr() as u64 } else { 0 };
            let bufs = TrtllmBufs {
                input: input.addr() as u64,
                residual_in: residual.addr() as u64,
                residual_out: res_out.addr() as u64,
                norm_out: a(&norm, !fp8),
                quant_out: a(&quant, fp8),
                scale_out: a(&scales, per_token),
                gamma: gamma.addr() as u64,
                scale_in: a(&static_scale, fixed),
            };
            let t_ = trt.as_ref().map_err(|e| e.clone())?;
            // SAFETY: the buffers hold `max` elements, the workspace `max_t` tokens.
            unsafe {
                t_.fused(
                    stream.handle().as_raw() as u64,
                    dtype,
                    trt_pattern,
                    t,
                    hidden,
                    &bufs,
                    EPS,
                    oneshot,
                    true,
                )
            }
        };
        let call = |w: Who| match w {
            Who::Auto => ours(Strategy::Auto),
            Who::OneShot => ours(Strategy::OneShot),
            Who::TwoShot => ours(Strategy::TwoShot),
            Who::TrtOneShot => trt_call(true),
            Who::TrtTwoShot => trt_call(false),
        };
        let runs = |w: Who| match w {
            Who::TwoShot | Who::TrtTwoShot => t >= world && (w == Who::TwoShot || trt.is_ok()),
            Who::TrtOneShot => trt.is_ok(),
            _ => true,
        };
        let mut row = Row {
            tokens: t,
            eager: [f64::NAN; 5],
            graph: [f64::NAN; 3],
            wrong: [0; 5],
            ran: None,
        };
        // Correctness first, each contender on zeroed outputs.
        let (mut h_res, mut h_norm) = (
            HostBytes::zeroed(n * dtype.size()),
            HostBytes::zeroed(n * dtype.size()),
        );
        let (mut h_q, mut h_s) = (vec![0u8; n], vec![0u8; 4 * t]);
        for (i, &w) in ALL.iter().enumerate() {
            if !runs(w) {
                continue;
            }
            for b in [&res_out, &norm, &quant, &scales] {
                b.upload(&vec![0u8; b.len()], &stream).map_err(e)?;
            }
            stream.synchronize().map_err(e)?;
            barrier.wait();
            call(w)?;
            stream.synchronize().map_err(e)?;
            res_out
                .download_at(0, h_res.as_mut_slice(), &stream)
                .map_err(e)?;
            norm.download_at(0, h_norm.as_mut_slice(), &stream)
                .map_err(e)?;
            quant.download_at(0, &mut h_q, &stream).map_err(e)?;
            scales.download_at(0, &mut h_s, &stream).map_err(e)?;
            row.wrong[i] = count_wrong(
                dtype,
                pattern,
                hidden,
                t,
                reference,
                h_res.as_slice(),
                h_norm.as_slice(),
                &h_q,
                &h_s,
            );
            if w == Who::Auto {
                row.ran = ran.get();
            }
            heartbeat.beat();
        }
        // Every rank times the same contenders: one wrong on any rank is not timed.
        row.wrong = agree_wrong(rank, row.wrong, wrongs, barrier);
        let timed: Vec<bool> = ALL
            .iter()
            .enumerate()
            .map(|(i, &w)| runs(w) && row.wrong[i] == 0)
            .collect();
        let sync = || stream.synchronize().map_err(e);
        let time = |f: &dyn Fn() -> Result<(), String>, calls: usize| {
            crate::peer_harness::timed(barrier, heartbeat, &sync, f, calls)
        };
        let iters = ((64usize << 20) / (n * dtype.size()).max(1)).clamp(20, 300);
        time_eager(&ALL, &timed, iters, &time, &call, &mut row.eager)?;
        for (g, &w) in GRAPH.iter().enumerate() {
            let i = ALL.iter().position(|&x| x == w).expect("listed");
            if !timed[i] {
                continue;
            }
            barrier.wait();
            let graph = GpuGraph::capture(&stream, || {
                (0..GRAPH_CALLS).try_for_each(|_| call(w).map_err(allreduce::Error::InvalidConfig))
            })
            .map_err(e)?;
            barrier.wait();
            graph.launch(&stream).map_err(e)?;
            stream.synchronize().map_err(e)?;
            for _ in 0..2 {
                let s =
                    time(&|| graph.launch(&stream).map_err(e), GRAPH_REPLAYS)? / GRAPH_CALLS as f64;
                keep_min(&mut row.graph[g], s);
            }
        }
        barrier.wait();
        rows.push(row);
    }
    barrier.wait();
    Ok(rows)
}

pub fn run(args: &Args) -> Result<(), BoxError> {
    let dtype = args.dtype;
    if !args.fused_pattern.residual || args.weight_bias != 0.0 {
        return Err(
            "--peers --fused compares TensorRT-LLM's residual patterns (its fusion \
                    kernels take a residual and no weight bias): pick a residual_ pattern and \
                    no --weight-bias"
                .into(),
        );
    }
    let pattern = args.fused_pattern.pattern;
    if pattern == FusedPattern::AllReduce {
        return Err(
            "--peers --fused compares the patterns with a norm: pick one with --fused-pattern"
                .into(),
        );
    }
    let world = args.ranks;
    let tokens = &args.tokens;
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    let json = args.json;
    let mut out_rows = Vec::new();
    // --plot: ours / the faster TensorRT-LLM kernel per token count, one line per hidden size
    // and mode.
    let mut ratios: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut printed_header = false;
    for &hidden in &args.fused_hidden {
        let comms = Communicator::new_group(
            args.backend,
            GroupConfig::new(world)
                .devices(args.devices.clone())
                .max_bytes(max_t * hidden * dtype.size())
                .timeout(Duration::from_secs_f64(args.timeout)),
        )?;
        let busiest = comms
            .iter()
            .map(|c| comms.iter().filter(|d| d.device() == c.device()).count())
            .max()
            .unwrap_or(1) as u32;
        let allreduce::Device::Cuda(first) = comms[0].device() else {
            return Err("--peers runs on the CUDA backend".into());
        };
        let sms = R::compute_units(GpuDevice::<R>::open(first)?.raw());
        let share = (sms / busiest).max(1);
        Trtllm::set_sm_share(share)?;
        let ws = FusedWorkspace::create_group(&comms, FusedConfig::new(max_t, hidden, dtype))?;
        let meta = ws.first().map(|w| w.metadata());
        if !json && !printed_header {
            printed_header = true;
            println!(
                "# allreduce-bench --peers --fused: {world} ranks (virtual, one GPU unless \
                 --devices says otherwise), {dtype}, {pattern}; us per call, slowest rank; \
                 TensorRT-LLM's launcher sized for {share} SMs per rank (SMs / ranks), PDL on, \
                 f32 accumulation"
            );
            crate::report::print_origin(&comms.iter().map(|c| c.device()).collect::<Vec<_>>());
            match allreduce_peers::versions() {
                Some(v) => println!("# peers: TensorRT-LLM all-reduce fusion from {v}"),
                None => println!(
                    "# peers: not built ({})",
                    allreduce_peers::unavailable().unwrap_or_default()
                ),
            }
            println!(
                "# {:>6} {:>6} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} | {:>7} | {:>8} {:>8} {:>8} {:>7} | #wrong (auto 1s 2s trt-1s trt-2s)",
                "hidden", "tokens", "auto ran", "auto", "1shot", "2shot", "trt 1s", "trt 2s",
                "ratio", "graph", "trt 1s", "trt 2s", "ratio"
            );
        }
        if !json {
            if let Some(m) = meta {
                println!(
                    "# hidden {hidden}: ours {} blocks per fused launch, {}",
                    m.blocks,
                    if m.pdl { "PDL" } else { "ordinary launches" }
                );
            }
        }
        let reference = Reference::new(dtype, pattern, world, max_t, hidden);
        let barrier = Barrier::new(world);
        let shared: Shared = Mutex::new(vec![(0, 0, 0); world]);
        let heartbeat = Heartbeat::default();
        let wrongs = Mutex::new(vec![[0usize; 5]; world]);
        let results: Vec<Result<Vec<Row>, String>> = std::thread::scope(|s| {
            heartbeat.watch(s, "--peers --fused");
            let hs: Vec<_> = comms
                .iter()
                .zip(&ws)
                .map(|(c, w)| {
                    let (barrier, shared, heartbeat, reference, wrongs) =
                        (&barrier, &shared, &heartbeat, &reference, &wrongs);
                    s.spawn(move || {
                        rank_loop(
                            c, w, dtype, pattern, hidden, tokens, barrier, shared, heartbeat,
                            reference, wrongs,
                        )
                    })
                })
                .collect();
            let r = hs
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a rank thread panicked".into()))
                })
                .collect();
            heartbeat.finish();
            r
        });
        let per_rank = results.into_iter().collect::<Result<Vec<_>, String>>()?;
        for k in 0..tokens.len() {
            let slowest = |f: &dyn Fn(&Row) -> f64| slowest(&per_rank, k, f);
            let eager: Vec<f64> = (0..5).map(|i| slowest(&|r| r.eager[i])).collect();
            let graph: Vec<f64> = (0..3).map(|i| slowest(&|r| r.graph[i])).collect();
            let row = &per_rank[0][k];
            let best_eager = min_nan(eager[3], eager[4]);
            let best_graph = min_nan(graph[1], graph[2]);
            let num = |x: f64| (!x.is_nan()).then_some(x * 1e6);
            for (mode, a, b) in [
                ("eager", eager[0], best_eager),
                ("graphs", graph[0], best_graph),
            ] {
                let label = format!("hidden {hidden}, {mode}");
                if !(a / b).is_nan() {
                    let point = ((row.tokens as f64).log2(), a / b);
                    match ratios.iter_mut().find(|(l, _)| *l == label) {
                        Some((_, pts)) => pts.push(point),
                        None => ratios.push((label, vec![point])),
                    }
                }
            }
            out_rows.push(serde_json::json!({
                "hidden": hidden,
                "tokens": row.tokens,
                "auto_ran": row.ran.map(|s| s.to_string()),
                "eager_us": {
                    "auto": num(eager[0]), "oneshot": num(eager[1]), "twoshot": num(eager[2]),
                    "trtllm_oneshot": num(eager[3]), "trtllm_twoshot": num(eager[4]),
                },
                "graph_us": {
                    "auto": num(graph[0]), "trtllm_oneshot": num(graph[1]),
                    "trtllm_twoshot": num(graph[2]),
                },
                "wrong": { "auto": row.wrong[0], "oneshot": row.wrong[1], "twoshot": row.wrong[2],
                           "trtllm_oneshot": row.wrong[3], "trtllm_twoshot": row.wrong[4] },
            }));
            if json {
                continue;
            }
            println!(
                "  {:>6} {:>6} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} | {:>7} | {:>8} {:>8} {:>8} {:>7} | {:?}",
                hidden,
                row.tokens,
                row.ran.map_or("-".to_string(), |s| s.to_string()),
                us(eager[0]),
                us(eager[1]),
                us(eager[2]),
                us(eager[3]),
                us(eager[4]),
                ratio(eager[0], best_eager),
                us(graph[0]),
                us(graph[1]),
                us(graph[2]),
                ratio(graph[0], best_graph),
                row.wrong
            );
        }
    }
    if let Some(path) = &args.plot {
        crate::plot::draw_lines(
            path,
            &format!("allreduce fused vs TensorRT-LLM, {world} ranks, {dtype}, {pattern}"),
            &crate::plot::Axes {
                x_desc: "tokens (log2 scale)",
                y_desc: "time / the peer's time (below 1: ours is faster)",
                x_label: &|x| format!("{}", 2f64.powf(x).round() as usize),
                reference: Some(1.0),
            },
            &ratios,
        )?;
    }
    if json {
        let git = crate::report::Git::detect();
        let doc = serde_json::json!({
            "mode": "peers-fused",
            "git": git.map(|g| g.commit),
            "peers": allreduce_peers::versions(),
            "world": world,
            "dtype": dtype.to_string(),
            "pattern": pattern.to_string(),
            "graph_calls": GRAPH_CALLS,
            "rows": out_rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check passes the reference's own outputs and catches one element two units off.
    #[test]
    fn the_check_accepts_the_reference_and_counts_a_wrong_element() {
        let (dtype, world, tokens, hidden) = (DType::BF16, 4, 3, 256);
        for pattern in [
            FusedPattern::ResidualRmsNorm,
            FusedPattern::ResidualRmsNormFp8,
            FusedPattern::ResidualRmsNormFp8Static,
        ] {
            let r = Reference::new(dtype, pattern, world, tokens, hidden);
            let scales: Vec<u8> = r.out.scale.iter().flat_map(|s| s.to_le_bytes()).collect();
            let norm = if r.out.norm.is_empty() {
                vec![0u8; r.out.residual.len()]
            } else {
                r.out.norm.clone()
            };
            let quant = if r.out.quant.is_empty() {
                vec![0u8; tokens * hidden]
            } else {
                r.out.quant.clone()
            };
            let count = |res: &[u8], norm: &[u8], quant: &[u8]| {
                count_wrong(
                    dtype, pattern, hidden, tokens, &r, res, norm, quant, &scales,
                )
            };
            assert_eq!(count(&r.out.residual, &norm, &quant), 0, "{pattern}");
            let mut res = r.out.residual.clone();
            let v = dtype.load_f32(&res, 7);
            dtype.store_f32(&mut res, 7, v * 1.05 + 0.5);
            assert_eq!(count(&res, &norm, &quant), 1, "{pattern}");
            if pattern.has_fp8() {
                let mut q = quant.clone();
                q[9] ^= 0x08; // the code's exponent's lowest bit: a factor of two
                assert_eq!(count(&r.out.residual, &norm, &q), 1, "{pattern}");
            }
        }
    }
}
