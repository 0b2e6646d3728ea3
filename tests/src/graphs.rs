//! Graph safety on virtual ranks, written once for every GPU backend: graphs holding 1, 2, 3
//! and 4 all-reduces (odd counts matter: a host-side ping-pong flag would be frozen at the wrong
//! parity; QuickReduce's was, and replays silently returned stale data), exact and quantized,
//! each replayed 1000 times with new input between replays, must give the expected results;
//! eager calls between replays must stay in step with them. Then graphs of 1, 2 and 3
//! hierarchical quantized calls on 8 ranks forced into two NUMA groups (`pcie:2x4`). Then
//! graphs whose calls read registered inputs in place (captured after the registration),
//! beside a staged call, with new input written into the registered memory between replays.
//! Then graphs captured on plain memory with graph registration on, whose buffers are
//! registered after capture (vLLM's graph buffers): a replay before the registration must fail
//! on every rank and write nothing; the replays after it must be exact. Then, where the vendor
//! library serves the group (one rank per GPU: a group of one here), graphs of 1, 2 and 3 calls
//! mixing the vendor strategies (symmetric windows, staged through the window and in pieces,
//! and plain) with ours.
//! Then graphs of 1-4 push one-shot calls on 2, 4 and 8 ranks (their buffer rotation lives in
//! device memory, advanced by the kernel). Generic
//! over the runtime; the test binaries (tests/cuda_graphs.rs, tests/rocm_graphs.rs) call
//! [`run`] with theirs.

use allreduce::RegisteredBuffer;
use allreduce::{
    AllReduceOptions, BufMut, BufRef, Codec, Communicator, DType, GroupConfig, HostBytes,
    Precision, Strategy, Topology,
};
use allreduce_gpu::device::{DeviceBuffer, GpuGraph, GpuStream};

use crate::{gpu_available, open_rank, GpuTestRuntime};

const REPLAYS: usize = 1000;

/// Integer data: every sum is exact, so a stale or mixed-up replay cannot hide.
fn input(n: usize, dtype: DType, rank: usize, iteration: usize) -> HostBytes {
    let mut b = HostBytes::zeroed(n * dtype.size());
    for i in 0..n {
        let v = ((rank * 7 + i * 3 + iteration * 5) % 23) as f32 - 11.0;
        dtype.store_f32(b.as_mut_slice(), i, v);
    }
    b
}

fn expected(n: usize, world: usize, iteration: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            (0..world)
                .map(|r| ((r * 7 + i * 3 + iteration * 5) % 23) as f32 - 11.0)
                .sum()
        })
        .collect()
}

/// Which calls a graph holds.
#[derive(Clone, Copy, PartialEq)]
enum Mix {
    /// Ours, exact and quantized.
    Flat,
    /// Hierarchical quantized, on two NUMA groups.
    Hierarchical,
    /// The vendor strategies beside ours.
    Vendor,
    /// The push one-shot, whose receive buffers rotate by threes: graphs of 1-4 of its calls
    /// meet every phase of the rotation at replay.
    Push,
}

/// The calls a graph holds: (length, dtype, strategy, precision).
fn calls(mix: Mix, k: usize) -> Vec<(usize, DType, Strategy, Precision)> {
    if mix == Mix::Vendor {
        let all = [
            // Past the 1 MiB window: two pieces, each copied in and out.
            (
                300_001,
                DType::F32,
                Strategy::VendorSymmetric,
                Precision::Exact,
            ),
            (4097, DType::BF16, Strategy::OneShot, Precision::Exact),
            (70_001, DType::F16, Strategy::Vendor, Precision::Exact),
        ];
        return all[..k].to_vec();
    }
    if mix == Mix::Push {
        let p = Strategy::PushOneShot;
        let all = [
            (70_001, DType::BF16, p, Precision::Exact),
            (5, DType::F32, p, Precision::Exact),
            (1001, DType::F16, p, Precision::Exact),
            (4097, DType::F32, p, Precision::Exact),
        ];
        return all[..k].to_vec();
    }
    if mix == Mix::Hierarchical {
        let h = Strategy::HierarchicalQuantized;
        let all = [
            (70_001, DType::BF16, h, Precision::Lossy(Codec::Fp8E4M3)),
            (4097, DType::F16, h, Precision::Lossy(Codec::Int6Adaptive)),
            (33, DType::BF16, h, Precision::Lossy(Codec::Int4V2)),
        ];
        return all[..k].to_vec();
    }
    let all = [
        (70_001, DType::BF16, Strategy::TwoShot, Precision::Exact),
        (
            4097,
            DType::F16,
            Strategy::QuantizedTwoShot,
            Precision::Lossy(Codec::Int8V2),
        ),
        (5, DType::F32, Strategy::Auto, Precision::Exact),
        (1000, DType::F16, Strategy::OneShot, Precision::Exact),
    ];
    all[..k].to_vec()
}

/// What a call must produce: the exact integer sums, or for the quantized path the
/// format's definition over every rank's input (allreduce_conformance::check).
fn expected_bytes(
    n: usize,
    dtype: DType,
    strategy: Strategy,
    precision: Precision,
    world: usize,
    iteration: usize,
) -> HostBytes {
    match precision {
        Precision::Lossy(codec) if strategy == Strategy::HierarchicalQuantized => {
            let inputs: Vec<HostBytes> =
                (0..world).map(|r| input(n, dtype, r, iteration)).collect();
            crate::check::hierarchical_expected(&inputs, dtype, codec)
        }
        Precision::Exact => {
            let mut b = HostBytes::zeroed(n * dtype.size());
            for (i, v) in expected(n, world, iteration).into_iter().enumerate() {
                dtype.store_f32(b.as_mut_slice(), i, v);
            }
            b
        }
        Precision::Lossy(codec) => {
            let inputs: Vec<HostBytes> =
                (0..world).map(|r| input(n, dtype, r, iteration)).collect();
            crate::check::quantized_expected(&inputs, dtype, codec)
        }
    }
}

/// Replay `graph` `REPLAYS` times, each with new input (`upload(iteration)`) and checked
/// (`check(iteration, what)`); an eager round (`enqueue`) in the middle must agree with the
/// replays around it.
fn replay_and_check<R: GpuTestRuntime>(
    comm: &Communicator,
    stream: &GpuStream<R>,
    graph: &GpuGraph<R>,
    upload: &dyn Fn(usize) -> Result<(), String>,
    enqueue: &dyn Fn() -> allreduce::Result<()>,
    check: &dyn Fn(usize, &str) -> Result<(), String>,
) -> Result<(), String> {
    let e = |e: allreduce::Error| e.to_string();
    for it in 1..=REPLAYS {
        upload(it)?;
        graph.launch(stream).map_err(e)?;
        comm.synchronize(stream.handle()).map_err(e)?;
        check(it, "replay")?;
        if it == REPLAYS / 2 {
            upload(it + 7)?;
            enqueue().map_err(e)?;
            comm.synchronize(stream.handle()).map_err(e)?;
            check(it + 7, "eager between replays")?;
        }
    }
    Ok(())
}

fn run_rank<R: GpuTestRuntime>(comm: &Communicator, mix: Mix, k: usize) -> Result<(), String> {
    let e = |e: allreduce::Error| e.to_string();
    let (_dev, stream) = open_rank::<R>(comm).map_err(e)?;
    let rank = comm.rank();
    let world = comm.world_size();
    let shapes = calls(mix, k);
    let mut bufs = Vec::new();
    for &(n, dtype, _, _) in &shapes {
        let bytes = n * dtype.size();
        bufs.push((
            DeviceBuffer::<R>::zeroed(bytes, &stream).map_err(e)?,
            DeviceBuffer::<R>::zeroed(bytes, &stream).map_err(e)?,
        ));
    }
    let enqueue = || -> allreduce::Result<()> {
        for (&(n, dtype, strategy, precision), (inp, out)) in shapes.iter().zip(&bufs) {
            // SAFETY: the buffers hold n elements and outlive the graph.
            let (iv, ov) = unsafe {
                (
                    BufRef::from_raw(inp.addr(), n, dtype, comm.device()),
                    BufMut::from_raw(out.addr(), n, dtype, comm.device()),
                )
            };
            comm.all_reduce(
                iv,
                ov,
                &AllReduceOptions::default()
                    .strategy(strategy)
                    .precision(precision)
                    .stream(stream.handle()),
            )?;
        }
        Ok(())
    };
    let check = |iteration: usize, what: &str| -> Result<(), String> {
        for (&(n, dtype, strategy, precision), (_, out)) in shapes.iter().zip(&bufs) {
            let mut h = HostBytes::zeroed(n * dtype.size());
            out.download(h.as_mut_slice(), &stream).map_err(e)?;
            let want = expected_bytes(n, dtype, strategy, precision, world, iteration);
            if let Some(i) = (0..n)
                .find(|&i| dtype.load_f32(h.as_slice(), i) != dtype.load_f32(want.as_slice(), i))
            {
                return Err(format!(
                "rank {rank}, {k} calls, {what} {iteration}: element {i} of {n} {dtype} ({precision}) is {} not {}",
                dtype.load_f32(h.as_slice(), i),
                dtype.load_f32(want.as_slice(), i)
            ));
            }
        }
        Ok(())
    };
    let upload = |iteration: usize| -> Result<(), String> {
        for (&(n, dtype, _, _), (inp, _)) in shapes.iter().zip(&bufs) {
            inp.upload(input(n, dtype, rank, iteration).as_slice(), &stream)
                .map_err(e)?;
        }
        Ok(())
    };

    // Eager first, then capture, then replay with new data each time; an eager round in the
    // middle and at the end must agree with the replays around it.
    upload(0)?;
    enqueue().map_err(e)?;
    comm.synchronize(stream.handle()).map_err(e)?;
    check(0, "eager")?;
    let graph = GpuGraph::capture(&stream, enqueue).map_err(e)?;
    replay_and_check(comm, &stream, &graph, &upload, &enqueue, &check)?;
    Ok(())
}

/// The registered graph's calls: (length, dtype, strategy, byte offset in the registered
/// memory, or `None` for a staged input).
const REGISTERED_CALLS: [(usize, DType, Strategy, Option<usize>); 4] = [
    (70_001, DType::BF16, Strategy::TwoShot, Some(0)),
    (1000, DType::F16, Strategy::OneShot, Some(140_032 + 16)),
    (5, DType::F32, Strategy::OneShot, None),
    (4097, DType::F32, Strategy::Auto, Some(160_000)),
];
const REGISTERED_BYTES: usize = 160_000 + 4097 * 4;

fn run_rank_registered<R: GpuTestRuntime>(
    comm: &Communicator,
    reg: &RegisteredBuffer,
) -> Result<(), String> {
    let e = |e: allreduce::Error| e.to_string();
    let (_dev, stream) = open_rank::<R>(comm).map_err(e)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut bufs = Vec::new();
    for &(n, dtype, _, _) in &REGISTERED_CALLS {
        let bytes = n * dtype.size();
        bufs.push((
            DeviceBuffer::<R>::zeroed(bytes, &stream).map_err(e)?,
            DeviceBuffer::<R>::zeroed(bytes, &stream).map_err(e)?,
        ));
    }
    let enqueue = || -> allreduce::Result<()> {
        for (&(n, dtype, strategy, at), (inp, out)) in REGISTERED_CALLS.iter().zip(&bufs) {
            let iv = match at {
                Some(at) => reg.view(at, n, dtype)?,
                // SAFETY: the buffer holds n elements and outlives the graph.
                None => unsafe { BufRef::from_raw(inp.addr(), n, dtype, comm.device()) },
            };
            // SAFETY: as above.
            let ov = unsafe { BufMut::from_raw(out.addr(), n, dtype, comm.device()) };
            let o = AllReduceOptions::default()
                .strategy(strategy)
                .stream(stream.handle());
            comm.all_reduce(iv, ov, &o)?;
        }
        Ok(())
    };
    let upload = |iteration: usize| -> Result<(), String> {
        for (&(n, dtype, _, at), (inp, _)) in REGISTERED_CALLS.iter().zip(&bufs) {
            let data = input(n, dtype, rank, iteration);
            match at {
                Some(at) => allreduce_gpu::upload_registered::<R>(
                    reg.memory(),
                    at,
                    data.as_slice(),
                    &stream,
                )
                .map_err(e)?,
                None => inp.upload(data.as_slice(), &stream).map_err(e)?,
            }
        }
        Ok(())
    };
    let check = |iteration: usize, what: &str| -> Result<(), String> {
        for (&(n, dtype, _, at), (_, out)) in REGISTERED_CALLS.iter().zip(&bufs) {
            let mut h = HostBytes::zeroed(n * dtype.size());
            out.download(h.as_mut_slice(), &stream).map_err(e)?;
            let want = expected(n, world, iteration);
            if let Some(i) = (0..n).find(|&i| dtype.load_f32(h.as_slice(), i) != want[i]) {
                return Err(format!(
                    "rank {rank}, registered graph ({at:?}), {what} {iteration}: element {i} of \
                     {n} {dtype} is {} not {}",
                    dtype.load_f32(h.as_slice(), i),
                    want[i]
                ));
            }
        }
        Ok(())
    };
    upload(0)?;
    enqueue().map_err(e)?;
    comm.synchronize(stream.handle()).map_err(e)?;
    check(0, "eager")?;
    let graph = GpuGraph::capture(&stream, enqueue).map_err(e)?;
    replay_and_check(comm, &stream, &graph, &upload, &enqueue, &check)?;
    Ok(())
}

/// Graphs of registered calls on 2, 4 and 8 ranks (threshold 0: every size registered).
fn run_registered<R: GpuTestRuntime>() {
    for world in [2usize, 4, 8] {
        let config = GroupConfig::new(world)
            .max_bytes(1 << 20)
            .registered_min_bytes(0);
        let comms = Communicator::new_group(R::KIND, config).expect("group");
        let regs =
            Communicator::alloc_registered_group(&comms, REGISTERED_BYTES).expect("registered");
        let start = std::time::Instant::now();
        let results: Vec<Result<(), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&regs)
                .map(|(c, reg)| s.spawn(move || run_rank_registered::<R>(c, reg)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        });
        for r in results {
            r.unwrap();
        }
        println!(
            "{world} ranks, graph of registered calls x {REPLAYS} replays: ok ({:.2} s)",
            start.elapsed().as_secs_f64()
        );
    }
}

/// The calls of a graph whose buffers are registered after capture: (length, dtype,
/// strategy). The first is split into pieces by the 64 KiB workspace.
const GRAPH_BUFFER_CALLS: [(usize, DType, Strategy); 4] = [
    (70_001, DType::BF16, Strategy::TwoShot),
    (1000, DType::F16, Strategy::OneShot),
    (5, DType::F32, Strategy::OneShot),
    (4097, DType::F32, Strategy::Auto),
];

fn run_rank_graph_buffers<R: GpuTestRuntime>(
    comms: &[Communicator],
    rank: usize,
    both: &std::sync::Barrier,
) -> Result<(), String> {
    let e = |e: allreduce::Error| e.to_string();
    let comm = &comms[rank];
    let (_dev, stream) = open_rank::<R>(comm).map_err(e)?;
    let world = comm.world_size();
    let mut bufs = Vec::new();
    for &(n, dtype, _) in &GRAPH_BUFFER_CALLS {
        let bytes = n * dtype.size();
        bufs.push((
            DeviceBuffer::<R>::zeroed(bytes, &stream).map_err(e)?,
            DeviceBuffer::<R>::zeroed(bytes, &stream).map_err(e)?,
        ));
    }
    let enqueue = || -> allreduce::Result<()> {
        for (&(n, dtype, strategy), (inp, out)) in GRAPH_BUFFER_CALLS.iter().zip(&bufs) {
            // SAFETY: the buffers hold n elements and outlive the graph.
            let (iv, ov) = unsafe {
                (
                    BufRef::from_raw(inp.addr(), n, dtype, comm.device()),
                    BufMut::from_raw(out.addr(), n, dtype, comm.device()),
                )
            };
            let o = AllReduceOptions::default()
                .strategy(strategy)
                .stream(stream.handle());
            comm.all_reduce(iv, ov, &o)?;
        }
        Ok(())
    };
    let upload = |iteration: usize| -> Result<(), String> {
        for (&(n, dtype, _), (inp, _)) in GRAPH_BUFFER_CALLS.iter().zip(&bufs) {
            inp.upload(input(n, dtype, rank, iteration).as_slice(), &stream)
                .map_err(e)?;
        }
        Ok(())
    };
    let check = |iteration: usize, what: &str| -> Result<(), String> {
        for (&(n, dtype, _), (_, out)) in GRAPH_BUFFER_CALLS.iter().zip(&bufs) {
            let mut h = HostBytes::zeroed(n * dtype.size());
            out.download(h.as_mut_slice(), &stream).map_err(e)?;
            let want = expected(n, world, iteration);
            if let Some(i) = (0..n).find(|&i| dtype.load_f32(h.as_slice(), i) != want[i]) {
                return Err(format!(
                    "rank {rank}, graph registered after capture, {what} {iteration}: element \
                     {i} of {n} {dtype} is {} not {}",
                    dtype.load_f32(h.as_slice(), i),
                    want[i]
                ));
            }
        }
        Ok(())
    };
    // Every rank reaches both waits whatever happens before them, so a failure cannot leave
    // the others waiting.
    let before = || -> Result<GpuGraph<R>, String> {
        comm.set_graph_registration(true).map_err(e)?;
        // Eager calls stay staged with the mode on.
        upload(0)?;
        enqueue().map_err(e)?;
        comm.synchronize(stream.handle()).map_err(e)?;
        check(0, "eager")?;
        let graph = GpuGraph::capture(&stream, enqueue).map_err(e)?;
        // Too early: every rank skips every call, reports it, and the outputs stay as they were.
        upload(1)?;
        graph.launch(&stream).map_err(e)?;
        match comm.synchronize(stream.handle()) {
            Err(allreduce::Error::InvalidArgument(m)) if m.contains("register_graph_buffers") => {}
            other => return Err(format!("replay before registration gave {other:?}")),
        }
        check(0, "outputs after the refused replay")?;
        Ok(graph)
    };
    let graph = before();
    both.wait();
    let registered = if rank == 0 && graph.is_ok() {
        Communicator::register_graph_buffers(comms).map_err(e)
    } else {
        Ok(GRAPH_BUFFER_CALLS.len())
    };
    both.wait();
    let graph = graph.map_err(|m| format!("rank {rank}: {m}"))?;
    let n = registered?;
    if n != GRAPH_BUFFER_CALLS.len() {
        return Err(format!(
            "registered {n} calls, captured {}",
            GRAPH_BUFFER_CALLS.len()
        ));
    }
    replay_and_check(comm, &stream, &graph, &upload, &enqueue, &check)?;
    comm.set_graph_registration(false).map_err(e)?;
    Ok(())
}

/// Graphs captured on plain memory and registered after capture, on 2, 4 and 8 ranks.
fn run_graph_buffers<R: GpuTestRuntime>() {
    for world in [2usize, 4, 8] {
        let config = GroupConfig::new(world)
            .max_bytes(1 << 16)
            .registered_min_bytes(0);
        let comms = Communicator::new_group(R::KIND, config).expect("group");
        let both = std::sync::Barrier::new(world);
        let start = std::time::Instant::now();
        let results: Vec<Result<(), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (comms, both) = (&comms, &both);
                    s.spawn(move || run_rank_graph_buffers::<R>(comms, rank, both))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        });
        for r in results {
            r.unwrap();
        }
        crate::say!(
            R,
            "{world} ranks, graph registered after capture x {REPLAYS} replays: ok ({:.2} s)",
            start.elapsed().as_secs_f64()
        );
    }
}

/// Panics (a failing test) on the first wrong replay.
pub fn run<R: GpuTestRuntime>() {
    if !gpu_available::<R>("graphs") {
        return;
    }
    let exact_and_flat = [2usize, 4, 8]
        .into_iter()
        .flat_map(|w| (1..=4).map(move |k| (w, k, Mix::Flat)));
    let hierarchical = (1..=3).map(|k| (8usize, k, Mix::Hierarchical));
    let push = [2usize, 4, 8]
        .into_iter()
        .flat_map(|w| (1..=4).map(move |k| (w, k, Mix::Push)));
    // `ALLREDUCE_GRAPH_TESTS=push`: the push one-shot's graphs alone (a short GPU run).
    let only_push = std::env::var("ALLREDUCE_GRAPH_TESTS").is_ok_and(|v| v == "push");
    let all: Vec<(usize, usize, Mix)> = exact_and_flat.chain(hierarchical).chain(push).collect();
    for (world, k, mix) in all
        .into_iter()
        .filter(|&(_, _, m)| !only_push || m == Mix::Push)
    {
        {
            let mut config = GroupConfig::new(world).max_bytes(1 << 20);
            if mix == Mix::Hierarchical {
                config = config.topology(Topology::parse("pcie:2x4", world).expect("spec"));
            }
            let comms = Communicator::new_group(R::KIND, config).expect("group");
            let start = std::time::Instant::now();
            let results: Vec<Result<(), String>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .iter()
                    .map(|c| s.spawn(move || run_rank::<R>(c, mix, k)))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("rank thread"))
                    .collect()
            });
            for r in results {
                r.unwrap();
            }
            let kind = match mix {
                Mix::Hierarchical => "hierarchical ",
                Mix::Push => "push one-shot ",
                _ => "",
            };
            crate::say!(
                R,
                "{world} ranks, graph of {k} {kind}all-reduces x {REPLAYS} replays: ok ({:.2} s)",
                start.elapsed().as_secs_f64()
            );
        }
    }
    if only_push {
        return;
    }
    run_registered::<R>();
    run_graph_buffers::<R>();
    run_vendor::<R>();
}

/// Graphs of 1, 2 and 3 calls mixing the vendor strategies with ours, on a group the vendor
/// library serves: one rank (it needs one GPU per rank); the same code runs at any world.
fn run_vendor<R: GpuTestRuntime>() {
    let comms =
        Communicator::new_group(R::KIND, GroupConfig::new(1).max_bytes(1 << 20)).expect("group");
    for s in [Strategy::Vendor, Strategy::VendorSymmetric] {
        if let Err(why) = comms[0].strategy_available(s, DType::F32, Precision::Exact) {
            crate::say!(R, "vendor graphs skipped: {s} is unavailable: {why}");
            return;
        }
    }
    for k in 1..=3 {
        let start = std::time::Instant::now();
        run_rank::<R>(&comms[0], Mix::Vendor, k).unwrap();
        crate::say!(
            R,
            "1 rank, graph of {k} vendor and own all-reduces x {REPLAYS} replays: ok ({:.2} s)",
            start.elapsed().as_secs_f64()
        );
    }
}
