//! `--peers` (CUDA): our exact all-reduce against the peers' kernels on the same GPU, in the
//! same run, on the same buffers, inputs, streams and method: vLLM's custom all-reduce
//! (crates/peers; its code fetched, pinned, by scripts/peers/fetch.sh).
//!
//! Per size, every rank thread runs warm-up calls of each contender, then alternately a timed
//! loop of each, twice, and keeps its faster loop; the row's time is the slowest rank's. Eager:
//! one launch per call. Graph: `GRAPH_CALLS` calls captured into a CUDA graph and replayed.
//! Contenders:
//! - ours: `Communicator::all_reduce` with `Auto`, and one-shot / two-shot forced;
//! - ours on a registered input (`ours reg`: `Auto` on memory from
//!   `Communicator::alloc_registered_group`, which the peers read in place), eager and in
//!   graphs (captured after the registration);
//! - vLLM as its engine runs it eagerly: the input copied into its registered buffer, then its
//!   kernel (vLLM's `all_reduce(..., reg_buffer)`);
//! - vLLM on a registered input (no copy: what its graph mode does, and any caller that
//!   allocates from its buffers);
//! - in graphs, vLLM's captured calls on inputs registered after capture, as vLLM does.
//!
//! Every rank's grid gets the same share of the GPU: vLLM's block limit is our grid
//! (min(36, SMs / ranks on the GPU)), so all grids co-reside. Every contender's output is
//! checked against the exact sum of the integer inputs; a wrong one is reported, not timed.
//! vLLM's kernels have no deadline: a watchdog ends the process if a row stops progressing.

use std::sync::{Barrier, Mutex};
use std::time::Duration;

use allreduce::{
    AllReduceOptions, BufMut, BufRef, Communicator, DType, GroupConfig, HostBytes,
    RegisteredBuffer, Strategy,
};
use allreduce_peers::Vllm;

use crate::cli::Args;
use crate::data::{DataSet, Inputs};
use crate::peer_harness::{
    agree_wrong, keep_min, min_nan, ratio, slowest, time_eager, us, Heartbeat,
};
use allreduce::cuda::CudaRuntime as R;
use allreduce_gpu::device::{DeviceBuffer, GpuDevice, GpuGraph};
use allreduce_gpu::GpuRuntime;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const GRAPH_CALLS: usize = 20;
const GRAPH_REPLAYS: usize = 10;
/// vLLM's rank-data buffer (its Python layer allocates 8 MiB).
const RANK_DATA_BYTES: usize = 8 << 20;

/// The contenders, in the order of a row's columns.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Who {
    Auto,
    OneShot,
    TwoShot,
    /// vLLM's eager call: copy into its registered buffer, then its kernel.
    Vllm,
    /// vLLM's kernel on a registered input.
    VllmRegistered,
    /// Ours (Auto) on an input in memory every rank registered.
    OursRegistered,
}

const EAGER: [Who; 6] = [
    Who::Auto,
    Who::OneShot,
    Who::TwoShot,
    Who::Vllm,
    Who::VllmRegistered,
    Who::OursRegistered,
];
/// In graphs: ours (Auto), vLLM's captured calls (registered after capture), and ours on a
/// registered input (captured after registration).
const GRAPH: [Who; 3] = [Who::Auto, Who::VllmRegistered, Who::OursRegistered];

/// One rank's results for one size: eager and graph seconds per call per contender
/// (NaN: not run), and each contender's wrong elements.
#[derive(Clone, Debug, Default)]
struct RowTimes {
    eager: [f64; 6],
    graph: [f64; 3],
    wrong: [usize; 6],
    graph_wrong: [usize; 3],
    ran: Option<Strategy>,
}

struct Bufs {
    /// This rank's input for the largest size (the integer pattern), registered with vLLM.
    input: DeviceBuffer<R>,
    /// vLLM's registered buffer its eager calls copy into.
    staging: DeviceBuffer<R>,
    output: DeviceBuffer<R>,
    meta: DeviceBuffer<R>,
    rank_data: DeviceBuffer<R>,
}

/// Addresses every rank must know of every other: (meta, staging, input).
type Shared = Mutex<Vec<(u64, u64, u64)>>;

#[allow(clippy::too_many_arguments)]
fn rank_loop(
    comm: &Communicator,
    dtype: DType,
    sizes: &[usize],
    block_limit: u32,
    barrier: &Barrier,
    shared: &Shared,
    heartbeat: &Heartbeat,
    expected: &[f32],
    wrongs: &Mutex<Vec<[usize; 6]>>,
    registered: &RegisteredBuffer,
) -> Result<Vec<RowTimes>, String> {
    let e = |e: allreduce::Error| e.to_string();
    let rank = comm.rank();

    let dev = comm.device();
    let (d, stream) = crate::gpu::open_rank::<R>(comm).map_err(e)?;
    stream.warm(&d).map_err(e)?;
    let max = sizes.iter().copied().max().unwrap_or(0);
    let host = Inputs::new(DataSet::Ints, dtype, max).fill(rank);
    // Every buffer before any rank's first call (virtual ranks: an allocation that waits for
    // the device while a peer's kernel waits for us never ends).
    let b = Bufs {
        input: DeviceBuffer::from_host(host.as_slice(), &stream).map_err(e)?,
        staging: DeviceBuffer::zeroed(max.max(16), &stream).map_err(e)?,
        output: DeviceBuffer::zeroed(max.max(16), &stream).map_err(e)?,
        meta: DeviceBuffer::zeroed(Vllm::meta_bytes(max), &stream).map_err(e)?,
        rank_data: DeviceBuffer::zeroed(RANK_DATA_BYTES, &stream).map_err(e)?,
    };
    allreduce_gpu::upload_registered::<R>(registered.memory(), 0, host.as_slice(), &stream)
        .map_err(e)?;
    stream.synchronize().map_err(e)?;
    shared.lock().unwrap()[rank] = (
        b.meta.addr() as u64,
        b.staging.addr() as u64,
        b.input.addr() as u64,
    );
    barrier.wait();
    let peers: Vec<(u64, u64, u64)> = shared.lock().unwrap().clone();
    let metas: Vec<u64> = peers.iter().map(|p| p.0).collect();
    let stagings: Vec<u64> = peers.iter().map(|p| p.1).collect();
    let inputs: Vec<u64> = peers.iter().map(|p| p.2).collect();
    // SAFETY: the meta and rank-data buffers are zeroed, sized as vLLM asks, and outlive it.
    let vllm = unsafe {
        Vllm::new(
            &metas,
            b.rank_data.addr() as u64,
            RANK_DATA_BYTES,
            rank,
            true,
        )
    };
    if let Ok(v) = &vllm {
        // SAFETY: every rank's buffers live until the end of this function.
        unsafe {
            v.register(&stagings)?;
            v.register(&inputs)?;
        }
    }
    // Other ranks may still be registering (host work, no kernels): start together.
    barrier.wait();
    let mut rows = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let n = bytes / dtype.size();
        let mut row = RowTimes {
            eager: [f64::NAN; 6],
            graph: [f64::NAN; 3],
            ..Default::default()
        };
        let opts = |s: Strategy| {
            AllReduceOptions::default()
                .strategy(s)
                .stream(stream.handle())
        };
        let ran = std::cell::Cell::new(None);
        let call = |who: Who| -> Result<(), String> {
            let ours = |s: Strategy| {
                // SAFETY: prefixes of this rank's live buffers, 16-byte aligned.
                unsafe {
                    comm.all_reduce(
                        BufRef::from_raw(b.input.addr(), n, dtype, dev),
                        BufMut::from_raw(b.output.addr(), n, dtype, dev),
                        &opts(s),
                    )
                }
                .map(|r| ran.set(Some(r)))
                .map_err(e)
            };
            let v = || vllm.as_ref().map_err(|e| e.clone());
            // SAFETY: vLLM's buffers are registered, live, and hold n elements.
            match who {
                Who::Auto => ours(Strategy::Auto),
                Who::OneShot => ours(Strategy::OneShot),
                Who::TwoShot => ours(Strategy::TwoShot),
                Who::OursRegistered => {
                    let input = registered.view(0, n, dtype).map_err(e)?;
                    // SAFETY: a prefix of this rank's live output buffer, 16-byte aligned.
                    let output = unsafe { BufMut::from_raw(b.output.addr(), n, dtype, dev) };
                    comm.all_reduce(input, output, &opts(Strategy::Auto))
                        .map(|_| ())
                        .map_err(e)
                }
                Who::Vllm => unsafe {
                    v()?.all_reduce(
                        stream.handle().as_raw() as u64,
                        dtype,
                        b.input.addr() as u64,
                        Some(b.staging.addr() as u64),
                        b.output.addr() as u64,
                        n,
                        block_limit,
                    )
                },
                Who::VllmRegistered => unsafe {
                    v()?.all_reduce(
                        stream.handle().as_raw() as u64,
                        dtype,
                        b.input.addr() as u64,
                        None,
                        b.output.addr() as u64,
                        n,
                        block_limit,
                    )
                },
            }
        };
        // Which contenders run at this size: vLLM needs a whole number of 16-byte vectors
        // and at least one; every rank decides the same.
        let vllm_ok = vllm.is_ok() && n > 0 && bytes % 16 == 0;
        let runs = |w: Who| match w {
            Who::Vllm | Who::VllmRegistered => vllm_ok,
            _ => n > 0,
        };
        // Correctness first, each contender on a zeroed output: a wrong peer is not timed.
        let expected = &expected[..n];
        let mut out = HostBytes::zeroed(bytes);
        let zeros = vec![0u8; b.output.len()];
        for (i, &w) in EAGER.iter().enumerate() {
            if !runs(w) {
                continue;
            }
            b.output.upload(&zeros, &stream).map_err(e)?;
            barrier.wait();
            call(w)?;
            stream.synchronize().map_err(e)?;
            b.output.download(out.as_mut_slice(), &stream).map_err(e)?;
            row.wrong[i] = count_wrong(dtype, out.as_slice(), expected);
            if w == Who::Auto {
                row.ran = ran.get();
            }
            heartbeat.beat();
        }
        // Every rank times the same contenders: one wrong on any rank is not timed.
        row.wrong = agree_wrong(rank, row.wrong, wrongs, barrier);
        let timed: Vec<bool> = EAGER
            .iter()
            .enumerate()
            .map(|(i, &w)| runs(w) && row.wrong[i] == 0)
            .collect();
        let sync = || stream.synchronize().map_err(e);
        let time = |f: &dyn Fn() -> Result<(), String>, calls: usize| {
            crate::peer_harness::timed(barrier, heartbeat, &sync, f, calls)
        };
        // Warm-up, then the same count on every rank: a fixed ladder by size.
        let iters = iters_for(bytes);
        time_eager(&EAGER, &timed, iters, &time, &call, &mut row.eager)?;
        // Graphs.
        for (g, &w) in GRAPH.iter().enumerate() {
            let i = EAGER.iter().position(|&x| x == w).expect("listed");
            if !timed[i] {
                continue;
            }
            barrier.wait();
            let graph = GpuGraph::capture(&stream, || {
                (0..GRAPH_CALLS).try_for_each(|_| call(w).map_err(allreduce::Error::InvalidConfig))
            })
            .map_err(e)?;
            if w == Who::VllmRegistered {
                let ptrs: Vec<u64> = (0..GRAPH_CALLS)
                    .flat_map(|_| inputs.iter().copied())
                    .collect();
                // SAFETY: every rank's input lives until the end of this function; no kernel
                // runs between the capture and this (captures launch nothing).
                unsafe {
                    vllm.as_ref()
                        .map_err(|e| e.clone())?
                        .register_graph(&ptrs)?
                };
            }
            barrier.wait();
            graph.launch(&stream).map_err(e)?;
            stream.synchronize().map_err(e)?;
            // The replays' output, checked like the eager calls' (counted, not used to skip).
            b.output.download(out.as_mut_slice(), &stream).map_err(e)?;
            row.graph_wrong[g] = count_wrong(dtype, out.as_slice(), expected);
            for _ in 0..2 {
                let t =
                    time(&|| graph.launch(&stream).map_err(e), GRAPH_REPLAYS)? / GRAPH_CALLS as f64;
                keep_min(&mut row.graph[g], t);
            }
        }
        barrier.wait();
        rows.push(row);
    }
    barrier.wait();
    Ok(rows)
}

/// Timed calls per loop: about 32 MiB of traffic per rank, 20 to 500 calls.
fn iters_for(bytes: usize) -> usize {
    ((32usize << 20) / bytes.max(1)).clamp(20, 500)
}

/// Elements of `out` (dtype bytes) that differ from the exact sum.
fn count_wrong(dtype: DType, out: &[u8], expected: &[f32]) -> usize {
    (0..expected.len())
        .filter(|&i| dtype.load_f32(out, i) != expected[i])
        .count()
}

pub fn run(args: &Args) -> Result<(), BoxError> {
    let dtype = args.dtype;
    let world = args.ranks;
    let sizes: Vec<usize> =
        crate::cli::sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, dtype.size());
    let max = sizes.iter().copied().max().unwrap_or(0);
    let comms = Communicator::new_group(
        args.backend,
        GroupConfig::new(world)
            .devices(args.devices.clone())
            .max_bytes(max.max(1))
            .timeout(Duration::from_secs_f64(args.timeout)),
    )?;
    // Our grid on this group (min(36, SMs / ranks of the busiest GPU)): vLLM gets the same
    // share of the GPU, so every rank's grid co-resides.
    let busiest = comms
        .iter()
        .map(|c| comms.iter().filter(|d| d.device() == c.device()).count())
        .max()
        .unwrap_or(1) as u32;
    let allreduce::Device::Cuda(first) = comms[0].device() else {
        return Err("--peers runs on the CUDA backend".into());
    };
    let sms = R::compute_units(GpuDevice::<R>::open(first)?.raw());
    let block_limit = (sms / busiest).clamp(1, Vllm::max_blocks());
    let json = args.json;
    if !json {
        println!(
            "# allreduce-bench --peers: {world} ranks (virtual, one GPU unless --devices says \
         otherwise), {dtype}, out of place, integer inputs; us per call, slowest rank; \
         every grid {block_limit} blocks"
        );
        crate::report::print_origin(&comms.iter().map(|c| c.device()).collect::<Vec<_>>());
        match allreduce_peers::versions() {
            Some(v) => println!("# peers: vLLM custom all-reduce from {v}"),
            None => println!(
                "# peers: not built ({})",
                allreduce_peers::unavailable().unwrap_or_default()
            ),
        }
        println!(
        "# {:>10} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} | {:>7} | {:>8} {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>7} | #wrong (auto 1s 2s vllm vllm-reg ours-reg; graphs auto vllm ours-reg)",
        "bytes",
        "auto ran",
        "auto",
        "1shot",
        "2shot",
        "vllm",
        "vllm reg",
        "ratio",
        "graph",
        "vllm",
        "ratio",
        "ours reg",
        "ratio",
        "g.reg",
        "ratio"
    );
    }
    // The exact sum of the integer inputs, once for every rank to check against.
    let expected: Vec<f32> = (0..max / dtype.size())
        .map(|i| {
            (0..world)
                .map(|r| f64::from(crate::data::int_pattern(r, i)))
                .sum::<f64>() as f32
        })
        .collect();
    let barrier = Barrier::new(world);
    let shared: Shared = Mutex::new(vec![(0, 0, 0); world]);
    let heartbeat = Heartbeat::default();
    let wrongs = Mutex::new(vec![[0usize; 6]; world]);
    // Collective, before the ranks' threads start (it allocates on every rank's device).
    let registered = Communicator::alloc_registered_group(&comms, max.max(16))?;
    let results: Vec<Result<Vec<RowTimes>, String>> = std::thread::scope(|s| {
        // vLLM's kernels wait for their peers without a deadline: a row that stops
        // progressing ends the process with a message instead of hanging it.
        heartbeat.watch(s, "--peers");
        let hs: Vec<_> = comms
            .iter()
            .zip(&registered)
            .map(|(c, reg)| {
                let (barrier, shared, heartbeat, sizes, expected, wrongs) = (
                    &barrier,
                    &shared,
                    &heartbeat,
                    &sizes,
                    &expected[..],
                    &wrongs,
                );
                s.spawn(move || {
                    rank_loop(
                        c,
                        dtype,
                        sizes,
                        block_limit,
                        barrier,
                        shared,
                        heartbeat,
                        expected,
                        wrongs,
                        reg,
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
    let mut per_rank = Vec::with_capacity(world);
    for r in results {
        per_rank.push(r?);
    }
    let mut rows_json = Vec::with_capacity(sizes.len());
    // --plot: ours / the best vLLM column per size (log2 bytes), eager and in graphs.
    let mut ratios: Vec<(String, Vec<(f64, f64)>)> = [
        "ours reg / best vLLM, eager",
        "ours reg / vLLM, graphs",
        "ours (staged) / best vLLM, eager",
    ]
    .iter()
    .map(|l| (l.to_string(), Vec::new()))
    .collect();
    for (k, &bytes) in sizes.iter().enumerate() {
        let slowest = |f: &dyn Fn(&RowTimes) -> f64| slowest(&per_rank, k, f);
        let eager: Vec<f64> = (0..6).map(|i| slowest(&|r| r.eager[i])).collect();
        let graph: Vec<f64> = (0..3).map(|i| slowest(&|r| r.graph[i])).collect();
        // Summed over ranks already (the ranks agreed on them), graphs summed here.
        let mut wrong: Vec<usize> = per_rank[0][k].wrong.to_vec();
        wrong.extend((0..3).map(|g| per_rank.iter().map(|r| r[k].graph_wrong[g]).sum::<usize>()));
        let peer = min_nan(eager[3], eager[4]);
        let num = |x: f64| (!x.is_nan()).then_some(x * 1e6);
        for (line, (a, b)) in
            ratios
                .iter_mut()
                .zip([(eager[5], peer), (graph[2], graph[1]), (eager[0], peer)])
        {
            if bytes > 0 && !(a / b).is_nan() {
                line.1.push(((bytes as f64).log2(), a / b));
            }
        }
        rows_json.push(serde_json::json!({
            "bytes": bytes,
            "auto_ran": per_rank[0][k].ran.map(|s| s.to_string()),
            "eager_us": {
                "auto": num(eager[0]), "oneshot": num(eager[1]), "twoshot": num(eager[2]),
                "vllm": num(eager[3]), "vllm_registered": num(eager[4]),
                "ours_registered": num(eager[5]),
            },
            "graph_us": {
                "auto": num(graph[0]), "vllm": num(graph[1]), "ours_registered": num(graph[2]),
            },
            "best_peer_eager_us": num(peer),
            "wrong": {
                "eager": { "auto": wrong[0], "oneshot": wrong[1], "twoshot": wrong[2],
                           "vllm": wrong[3], "vllm_registered": wrong[4],
                           "ours_registered": wrong[5] },
                "graph": { "auto": wrong[6], "vllm": wrong[7], "ours_registered": wrong[8] },
            },
        }));
        if json {
            continue;
        }
        println!(
            "  {:>10} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} | {:>7} | {:>8} {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:?}",
            bytes,
            per_rank[0][k]
                .ran
                .map_or("-".to_string(), |s| s.to_string()),
            us(eager[0]),
            us(eager[1]),
            us(eager[2]),
            us(eager[3]),
            us(eager[4]),
            ratio(eager[0], peer),
            us(graph[0]),
            us(graph[1]),
            ratio(graph[0], graph[1]),
            us(eager[5]),
            ratio(eager[5], peer),
            us(graph[2]),
            ratio(graph[2], graph[1]),
            wrong
        );
    }
    if let Some(path) = &args.plot {
        crate::plot::draw_lines(
            path,
            &format!("allreduce vs vLLM custom all-reduce, {world} ranks, {dtype}"),
            &crate::plot::Axes {
                x_desc: "message size per rank (bytes, log2 scale)",
                y_desc: "time / the peer's time (below 1: ours is faster)",
                x_label: &|x| crate::cli::format_size(2f64.powf(x).round() as usize),
                reference: Some(1.0),
            },
            &ratios,
        )?;
    }
    if json {
        let git = crate::report::Git::detect();
        let devices: Vec<allreduce::Device> = comms.iter().map(|c| c.device()).collect();
        let doc = serde_json::json!({
            "mode": "peers",
            "git": git.map(|g| g.commit),
            "devices": crate::report::device_models(&devices, &crate::report::Machine::detect()),
            "peers": allreduce_peers::versions(),
            "world": world,
            "dtype": dtype.to_string(),
            "grid_blocks": block_limit,
            "graph_calls": GRAPH_CALLS,
            "rows": rows_json,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}
