//! `--peers` (CUDA): our exact all-reduce against the peers' kernels on the same GPU, in the
//! same run, on the same buffers, inputs, streams and method: vLLM's custom all-reduce and
//! FlashInfer's PCIe IPC all-reduce (crates/peers; their code fetched, pinned, by
//! scripts/peers/fetch.sh).
//!
//! Per size, every rank thread runs warm-up calls of each contender, then alternately a timed
//! loop of each, twice, and keeps its faster loop; the row's time is the slowest rank's. Eager:
//! one launch per call. Graph: `GRAPH_CALLS` calls captured into a CUDA graph and replayed.
//! Contenders:
//! - ours: `Communicator::all_reduce` with `Auto`, and one-shot / two-shot forced; in graphs,
//!   `Auto` on the same plain input captured with graph registration on and registered after
//!   the capture (`Communicator::register_graph_buffers`), as an engine captures it;
//! - ours, the push one-shot (`push`: `Strategy::PushOneShot`, Lamport, no barrier) on the
//!   plain input, eager and in graphs, up to the largest call it takes;
//! - ours on a registered input (`ours reg`: `Auto` on memory from
//!   `Communicator::alloc_registered_group`, which the peers read in place), eager and in
//!   graphs (captured after the registration);
//! - vLLM as its engine runs it eagerly: the input copied into its registered buffer, then its
//!   kernel (vLLM's `all_reduce(..., reg_buffer)`);
//! - vLLM on a registered input (no copy: what its graph mode does, and any caller that
//!   allocates from its buffers);
//! - in graphs, vLLM's captured calls on inputs registered after capture, as vLLM does;
//! - FlashInfer's PCIe IPC all-reduce ("flashinfer pcie") on the plain input, eager and in
//!   graphs, with the launch FlashInfer picks untuned (`FlashinferPcie::launch`), no PDL (its
//!   binding refuses it); bf16 and f16 only, and only sizes FlashInfer admits (whole 16-byte
//!   packs, at least one per rank): elsewhere "-", with the reason printed above the table;
//! - SGLang's custom all-reduce v2 ("sglang"): its own choice of kernel by its Hopper table
//!   (eager: its eager row, on the plain input, which its pull kernels copy in and out; graphs:
//!   its graph row, the pull kernels reading the captured input through its pointer table,
//!   filled after the capture as SGLang fills it), with the 16 MiB workspaces it allocates by
//!   default and without multicast (ranks of one GPU have none): "-" where it calls NCCL; and
//!   each of its four kernels forced at every size (as its `override_algo` forces them), with
//!   PDL as SGLang launches them on Hopper. In graphs SGLang's 2shot_pull reduces into its
//!   input, so SGLang's graphs capture their own copy of the input, and each is checked by a
//!   graph of one call replayed on a fresh copy, then timed as a graph of `GRAPH_CALLS` calls.
//!
//! Every rank's grid gets the same share of the GPU: vLLM's block limit is our grid
//! (min(36, SMs / ranks on the GPU)); FlashInfer's grid (at most 16 blocks) is capped at SMs /
//! ranks, so all grids co-reside; SGLang's grids (its push grid is the GPU's SM count, its pull
//! grid 64 blocks) are taken on a GPU of SMs / ranks SMs, which its block-size rule
//! (`choose_block_size`) counts too. Every contender's output is checked against the exact sum
//! of the integer inputs; a wrong one is reported, not timed. "Best peer" is the fastest of
//! vLLM, vLLM on a registered input, flashinfer pcie and sglang (its own choice; its forced
//! kernels are shown, not ranked). The peers' kernels have no deadline: a watchdog ends the
//! process if a row stops progressing.
//!
//! FlashInfer's 16-bit kernels add in the 16-bit type (a rounding per addition, in rank order;
//! at 8 ranks by islands of 4), not in f32 as ours and vLLM do: on real data their sum is not
//! the correctly rounded one. The check stays exact because the integer inputs (|x| <= 11, at
//! most 8 ranks) make every partial sum an integer under 2^8, exact in bf16 and f16 in any
//! order (`integer_sums_are_exact_in_any_order_and_precision` below). Its sentinel protocol
//! publishes +0.0 as -0.0, so a zero sum may come back as -0.0: equal as a value, which is
//! what the check compares. SGLang's push kernels do the same (their Lamport marker is +0.0).

use std::sync::{Barrier, Mutex};
use std::time::Duration;

use allreduce::{
    AllReduceOptions, BufMut, BufRef, Communicator, DType, GroupConfig, HostBytes,
    RegisteredBuffer, Strategy,
};
use allreduce_peers::{
    FlashinferPcie, PcieLaunch, Sglang, SglangAlgo, SglangConfig, SglangLaunch, Vllm,
    SGLANG_MAX_SIZE,
};

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
    /// FlashInfer's PCIe IPC all-reduce on the plain input.
    Pcie,
    /// Ours (Auto) on an input in memory every rank registered.
    OursRegistered,
    /// Ours, the push one-shot (`Strategy::PushOneShot`), on the plain input, up to the
    /// largest call it takes.
    Push,
    /// SGLang's custom all-reduce v2 with its own choice of kernel.
    Sglang,
    /// One of SGLang's kernels, forced.
    SglangKernel(SglangAlgo),
}

/// SGLang's columns after its own choice: its kernels, forced.
const SGLANG_KERNELS: [Who; 4] = [
    Who::SglangKernel(SglangAlgo::OneShotPush),
    Who::SglangKernel(SglangAlgo::TwoShotPush),
    Who::SglangKernel(SglangAlgo::OneShotPull),
    Who::SglangKernel(SglangAlgo::TwoShotPull),
];
const NE: usize = 13;
const NG: usize = 10;
const EAGER: [Who; NE] = [
    Who::Auto,
    Who::OneShot,
    Who::TwoShot,
    Who::Vllm,
    Who::VllmRegistered,
    Who::Pcie,
    Who::OursRegistered,
    Who::Push,
    Who::Sglang,
    SGLANG_KERNELS[0],
    SGLANG_KERNELS[1],
    SGLANG_KERNELS[2],
    SGLANG_KERNELS[3],
];
/// In graphs: ours (Auto), vLLM's captured calls (registered after capture), FlashInfer's
/// PCIe all-reduce, ours on a registered input (captured after registration), the push
/// one-shot on the plain input, and SGLang's (its choice, then its kernels; their graph
/// tables filled after capture).
const GRAPH: [Who; NG] = [
    Who::Auto,
    Who::VllmRegistered,
    Who::Pcie,
    Who::OursRegistered,
    Who::Push,
    Who::Sglang,
    SGLANG_KERNELS[0],
    SGLANG_KERNELS[1],
    SGLANG_KERNELS[2],
    SGLANG_KERNELS[3],
];
/// The peers, in "best peer" (eager: every peer column; graphs: the peers' graph columns).
const PEERS: [Who; 4] = [Who::Vllm, Who::VllmRegistered, Who::Pcie, Who::Sglang];

/// `w`'s column among the eager contenders.
fn eager_col(w: Who) -> usize {
    EAGER
        .iter()
        .position(|&x| x == w)
        .expect("every contender runs eagerly")
}

/// `w`'s column among the graph contenders, if it has one.
fn graph_col(w: Who) -> Option<usize> {
    GRAPH.iter().position(|&x| x == w)
}

/// The fastest peer of a row (NaN: none ran): eager times by [`EAGER`] column, or graph
/// times by [`GRAPH`] column.
fn best_peer(times: &[f64], graphs: bool) -> f64 {
    PEERS
        .iter()
        .filter_map(|&w| {
            if graphs {
                graph_col(w)
            } else {
                Some(eager_col(w))
            }
        })
        .fold(f64::NAN, |best, i| min_nan(best, times[i]))
}

/// One rank's results for one size: eager and graph seconds per call per contender
/// (NaN: not run), and each contender's wrong elements.
#[derive(Clone, Debug, Default)]
struct RowTimes {
    eager: [f64; NE],
    graph: [f64; NG],
    wrong: [usize; NE],
    graph_wrong: [usize; NG],
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
    /// FlashInfer's workspace slab, zeroed (when some size runs it).
    pcie: Option<DeviceBuffer<R>>,
    /// SGLang's buffers (when some size runs it).
    sgl: Option<SglangBufs>,
}

/// One rank's memory for SGLang, as `CustomAllReduceV2` allocates it.
struct SglangBufs {
    /// Push slots, pull workspace and semaphores, zeroed.
    slab: DeviceBuffer<R>,
    /// The push epoch counters, zeroed.
    counter: DeviceBuffer<R>,
    /// The graph pointer table: a row of every rank's input per captured pull call.
    table: DeviceBuffer<R>,
    /// The input its graphs capture (2shot_pull reduces into it): the integer pattern.
    input: DeviceBuffer<R>,
}

/// Rows of SGLang's graph pointer table per rank: enough for every captured pull call of a
/// run (its own table holds 131072).
const SGLANG_TABLE_ROWS: usize = 8192;

/// Addresses every rank must know of every other.
#[derive(Clone, Copy, Default)]
struct Addrs {
    meta: u64,
    staging: u64,
    input: u64,
    /// FlashInfer's slab.
    pcie: u64,
    /// SGLang's slab and graph input.
    sgl_slab: u64,
    sgl_input: u64,
}
type Shared = Mutex<Vec<Addrs>>;

/// SGLang's custom all-reduce for one run: its choice and its kernels' launches per size (or
/// why they do not run), its grids and its workspaces.
struct SglangSetup {
    /// Per size: its choice eager and in graphs, and each kernel's launch ([`SGLANG_KERNELS`]
    /// order).
    plan: Vec<SglangRow>,
    /// Its grids (the table's, on a GPU of the grid share's SMs).
    config: Result<SglangConfig, String>,
    /// Per-slot push bytes and pull bytes: what the engine would allocate, or more, so that
    /// every kernel runs at every size.
    slot_bytes: usize,
    pull_bytes: usize,
}

#[derive(Clone)]
struct SglangRow {
    eager: Result<SglangLaunch, String>,
    graph: Result<SglangLaunch, String>,
    kernels: [Result<SglangLaunch, String>; 4],
}

impl SglangSetup {
    fn new(world: usize, sizes: &[usize], grid_share: u32) -> SglangSetup {
        let config = match allreduce_peers::sglang_unavailable() {
            Some(why) => Err(why),
            None => SglangConfig::hopper(world, grid_share)
                .ok_or_else(|| format!("SGLang's Hopper table has no row for {world} ranks")),
        };
        // The pull grid capped at the share too (the push grid is the share already).
        let config = config.map(|c| SglangConfig {
            pull_blocks: c.pull_blocks.min(grid_share.max(1)),
            ..c
        });
        let plan = sizes
            .iter()
            .map(|&bytes| {
                let launch = |algo| {
                    let c = config.as_ref().map_err(|e| e.clone())?;
                    SglangLaunch::new(c, algo, world, bytes, grid_share)
                };
                let pick = |graph| {
                    let c = config.as_ref().map_err(|e| e.clone())?;
                    let (engine, _, _) = c.engine(world, SGLANG_MAX_SIZE, false);
                    match engine.pick(bytes, graph) {
                        Some((algo, _)) => launch(algo),
                        None => Err("NCCL in SGLang".to_string()),
                    }
                };
                SglangRow {
                    eager: pick(false),
                    graph: pick(true),
                    kernels: SglangAlgo::ALL.map(launch),
                }
            })
            .collect::<Vec<_>>();
        let align = |x: usize| x.max(1024).div_ceil(1024) * 1024;
        let (mut slot, mut pull) = (0, 0);
        for (&bytes, row) in sizes.iter().zip(&plan) {
            if row.kernels.iter().any(|k| k.is_ok()) {
                let two = allreduce_peers::two_shot_push_slot_bytes(bytes, world);
                slot = slot.max(bytes).max(two);
                pull = pull.max(bytes);
            }
        }
        SglangSetup {
            plan,
            config,
            slot_bytes: align(slot),
            pull_bytes: align(pull),
        }
    }

    /// Whether any size runs it.
    fn runs(&self) -> bool {
        self.plan
            .iter()
            .any(|r| r.kernels.iter().any(|k| k.is_ok()))
    }

    /// The `#` lines that say what its choice is at each size, consecutive sizes with the same
    /// choice on one line.
    fn notes(&self, sizes: &[usize]) -> Vec<String> {
        let name = |l: &Result<SglangLaunch, String>| match l {
            Ok(l) => l.algo.name().to_string(),
            Err(why) => format!("- ({why})"),
        };
        let mut out: Vec<(usize, usize, String)> = Vec::new();
        for (&bytes, r) in sizes.iter().zip(&self.plan) {
            let what = format!("eager {}, graphs {}", name(&r.eager), name(&r.graph));
            match out.last_mut() {
                Some((_, to, w)) if *w == what => *to = bytes,
                _ => out.push((bytes, bytes, what)),
            }
        }
        let f = crate::cli::format_size;
        let mut lines: Vec<String> = out
            .into_iter()
            .map(|(from, to, what)| {
                let range = if from == to {
                    f(from)
                } else {
                    format!("{}-{}", f(from), f(to))
                };
                format!("# sglang at {range} B: {what}")
            })
            .collect();
        if let Ok(c) = &self.config {
            lines.insert(
                0,
                format!(
                    "# sglang: its Hopper table, {} MiB workspaces, no multicast; grids: push {} \
                     blocks, pull {}; blocks of 128-1024 threads by its rule over {} SMs; PDL",
                    SGLANG_MAX_SIZE >> 20,
                    c.push_blocks,
                    c.pull_blocks,
                    c.push_blocks
                ),
            );
        }
        lines
    }
}

/// FlashInfer's PCIe all-reduce for one run: its launch per size (or why it does not run
/// that size), and its workspace.
struct PcieSetup {
    plan: Vec<Result<PcieLaunch, String>>,
    /// Elements the workspace holds, and its bytes per rank (Err: not run at any size).
    workspace: Result<(usize, usize), String>,
}

impl PcieSetup {
    fn new(world: usize, dtype: DType, sizes: &[usize], grid_share: u32) -> PcieSetup {
        let m = FlashinferPcie::MAX_BLOCKS;
        let plan: Vec<_> = sizes
            .iter()
            .map(|&b| match allreduce_peers::unavailable() {
                Some(why) => Err(why),
                None => FlashinferPcie::launch(world, b / dtype.size(), dtype, m, grid_share),
            })
            .collect();
        // Sized for the largest call, as a serving engine sizes it for its largest batch.
        let pack = 16 / dtype.size();
        let max_numel = sizes
            .iter()
            .zip(&plan)
            .filter(|(_, p)| p.is_ok())
            .map(|(&b, _)| (b / dtype.size()).div_ceil(pack) * pack)
            .max();
        let workspace = match max_numel {
            None => Err(plan
                .iter()
                .find_map(|p| p.clone().err())
                .unwrap_or_else(|| "no sizes".into())),
            Some(n) => FlashinferPcie::workspace_bytes(world, n, dtype, m).map(|b| (n, b)),
        };
        PcieSetup { plan, workspace }
    }

    /// The `#` lines that say what it runs at each size, consecutive sizes with the same
    /// outcome on one line.
    fn notes(&self, sizes: &[usize]) -> Vec<String> {
        let mut out: Vec<(usize, usize, String)> = Vec::new();
        for (&bytes, p) in sizes.iter().zip(&self.plan) {
            let what = match p {
                Ok(l) => format!(
                    "{} block{} x {} threads, {}",
                    l.blocks,
                    if l.blocks == 1 { "" } else { "s" },
                    l.threads,
                    l.variant
                ),
                Err(why) => format!("- ({why})"),
            };
            match out.last_mut() {
                Some((_, to, w)) if *w == what => *to = bytes,
                _ => out.push((bytes, bytes, what)),
            }
        }
        out.into_iter()
            .map(|(from, to, what)| {
                let f = crate::cli::format_size;
                let range = if from == to {
                    f(from)
                } else {
                    format!("{}-{}", f(from), f(to))
                };
                format!("# flashinfer pcie at {range} B: {what}")
            })
            .collect()
    }
}

#[allow(clippy::too_many_arguments)]
fn rank_loop(
    comms: &[Communicator],
    comm: &Communicator,
    dtype: DType,
    sizes: &[usize],
    block_limit: u32,
    barrier: &Barrier,
    shared: &Shared,
    heartbeat: &Heartbeat,
    expected: &[f32],
    wrongs: &Mutex<Vec<[usize; NE]>>,
    registered: &RegisteredBuffer,
    pcie_setup: &PcieSetup,
    sgl_setup: &SglangSetup,
) -> Result<(Vec<RowTimes>, Option<String>), String> {
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
        // Zeroed as FlashInfer's init zeroes it: its sentinel kernels read +0.0 as "not
        // yet written".
        pcie: match pcie_setup.workspace {
            Ok((_, bytes)) => Some(DeviceBuffer::zeroed(bytes, &stream).map_err(e)?),
            Err(_) => None,
        },
        // Zeroed as SGLang zeroes its slab: its push slots start empty (+0.0) and its
        // semaphores and counters at 0.
        sgl: match (&sgl_setup.config, sgl_setup.runs()) {
            (Ok(c), true) => Some(SglangBufs {
                slab: DeviceBuffer::zeroed(
                    Sglang::slab_bytes(
                        comms.len(),
                        sgl_setup.slot_bytes,
                        sgl_setup.pull_bytes,
                        c.pull_blocks,
                    )
                    .0,
                    &stream,
                )
                .map_err(e)?,
                counter: DeviceBuffer::zeroed(Sglang::counter_bytes(c.push_blocks), &stream)
                    .map_err(e)?,
                table: DeviceBuffer::zeroed(SGLANG_TABLE_ROWS * comms.len() * 8, &stream)
                    .map_err(e)?,
                input: DeviceBuffer::from_host(host.as_slice(), &stream).map_err(e)?,
            }),
            _ => None,
        },
    };
    allreduce_gpu::upload_registered::<R>(registered.memory(), 0, host.as_slice(), &stream)
        .map_err(e)?;
    stream.synchronize().map_err(e)?;
    shared.lock().unwrap()[rank] = Addrs {
        meta: b.meta.addr() as u64,
        staging: b.staging.addr() as u64,
        input: b.input.addr() as u64,
        pcie: b.pcie.as_ref().map_or(0, |s| s.addr() as u64),
        sgl_slab: b.sgl.as_ref().map_or(0, |s| s.slab.addr() as u64),
        sgl_input: b.sgl.as_ref().map_or(0, |s| s.input.addr() as u64),
    };
    barrier.wait();
    let peers: Vec<Addrs> = shared.lock().unwrap().clone();
    let metas: Vec<u64> = peers.iter().map(|p| p.meta).collect();
    let stagings: Vec<u64> = peers.iter().map(|p| p.staging).collect();
    let inputs: Vec<u64> = peers.iter().map(|p| p.input).collect();
    let slabs: Vec<u64> = peers.iter().map(|p| p.pcie).collect();
    // SGLang's graph table row: every rank's graph input, in rank order.
    let sgl_row: Vec<u8> = peers
        .iter()
        .flat_map(|p| p.sgl_input.to_le_bytes())
        .collect();
    // Every rank's slab and counters were zeroed (and synchronized) before the barrier above.
    let sgl = match (&b.sgl, &sgl_setup.config) {
        (Some(s), Ok(c)) => {
            let slabs: Vec<u64> = peers.iter().map(|p| p.sgl_slab).collect();
            // SAFETY: every rank's slab is zeroed and laid out by slab_bytes for these sizes,
            // the counters zeroed, and both live until the end of this function.
            unsafe {
                Sglang::new(
                    &slabs,
                    s.counter.addr() as u64,
                    rank,
                    *c,
                    sgl_setup.slot_bytes,
                    sgl_setup.pull_bytes,
                )
            }
        }
        (_, Err(why)) => Err(why.clone()),
        (None, Ok(_)) => Err("no size runs it".into()),
    };
    // Rows of SGLang's graph table used so far, and those of the capture in progress.
    let sgl_rows = std::cell::Cell::new(0usize);
    let sgl_captured = std::cell::RefCell::new(Vec::<usize>::new());
    // Every rank's slab was zeroed (and synchronized) before the barrier above, as
    // FlashInfer requires before any rank pushes into a peer's.
    let pcie = pcie_setup.workspace.clone().and_then(|(max_numel, _)| {
        // SAFETY: every rank's slab is zeroed, sized by workspace_bytes for these arguments,
        // and lives until the end of this function, after every call that uses it.
        unsafe { FlashinferPcie::new(&slabs, rank, max_numel, dtype, FlashinferPcie::MAX_BLOCKS) }
    });
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
    for ((&bytes, pcie_launch), sgl_plan) in sizes.iter().zip(&pcie_setup.plan).zip(&sgl_setup.plan)
    {
        let n = bytes / dtype.size();
        let mut row = RowTimes {
            eager: [f64::NAN; NE],
            graph: [f64::NAN; NG],
            ..Default::default()
        };
        // SGLang's launch for a column: eager or in graphs (its choice differs between them).
        let sgl_launch = |who: Who, graph: bool| -> Result<SglangLaunch, String> {
            match who {
                Who::Sglang if graph => sgl_plan.graph.clone(),
                Who::Sglang => sgl_plan.eager.clone(),
                Who::SglangKernel(a) => {
                    sgl_plan.kernels[SglangAlgo::ALL.iter().position(|&x| x == a).unwrap()].clone()
                }
                _ => Err("not SGLang".into()),
            }
        };
        // One SGLang call: eager on the plain input; in a capture on its graph input, its
        // pull kernels on the next row of its table (filled after the capture).
        let sgl_call = |l: &SglangLaunch, graph: bool| -> Result<(), String> {
            let s = sgl.as_ref().map_err(|e| e.clone())?;
            let bufs = b.sgl.as_ref().ok_or("no SGLang buffers")?;
            let (input, graph_row) = if graph {
                let row = if l.algo.uses_graph_table() {
                    let i = sgl_rows.get();
                    if i >= SGLANG_TABLE_ROWS {
                        return Err("SGLang's graph table is full".into());
                    }
                    sgl_rows.set(i + 1);
                    sgl_captured.borrow_mut().push(i);
                    Some((bufs.table.addr() + i * sgl_row.len()) as u64)
                } else {
                    None
                };
                (bufs.input.addr() as u64, row)
            } else {
                (b.input.addr() as u64, None)
            };
            // SAFETY: the input and output hold `bytes`; the table row is in the table; every
            // rank makes this call with the same launch (a pure function of the size).
            unsafe {
                s.all_reduce(
                    stream.handle().as_raw() as u64,
                    dtype,
                    l,
                    input,
                    b.output.addr() as u64,
                    bytes,
                    graph_row,
                )
            }
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
                Who::Push => ours(Strategy::PushOneShot),
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
                // SAFETY: the input and output hold n elements; every rank makes this call
                // with the same launch (a pure function of the size).
                Who::Pcie => unsafe {
                    let launch = pcie_launch.as_ref().map_err(|e| e.clone())?;
                    pcie.as_ref().map_err(|e| e.clone())?.all_reduce(
                        stream.handle().as_raw() as u64,
                        dtype,
                        b.input.addr() as u64,
                        b.output.addr() as u64,
                        n,
                        launch,
                    )
                },
                Who::Sglang | Who::SglangKernel(_) => sgl_call(&sgl_launch(who, false)?, false),
            }
        };
        // Which contenders run at this size: vLLM needs a whole number of 16-byte vectors
        // and at least one; every rank decides the same.
        let vllm_ok = vllm.is_ok() && n > 0 && bytes % 16 == 0;
        let pcie_ok = pcie.is_ok() && pcie_launch.is_ok();
        let runs = |w: Who| match w {
            Who::Vllm | Who::VllmRegistered => vllm_ok,
            Who::Pcie => pcie_ok,
            Who::Push => n > 0 && bytes <= Strategy::PUSH_MAX_BYTES,
            Who::Sglang | Who::SglangKernel(_) => sgl.is_ok() && sgl_launch(w, false).is_ok(),
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
            if let Who::Sglang | Who::SglangKernel(_) = w {
                // SGLang's choice in graphs may not be its eager one: a graph column runs
                // where its graph launch exists and the kernel it launches ran right eagerly
                // (its forced column, which runs at every size it takes).
                let Ok(l) = sgl_launch(w, true) else { continue };
                if !timed[eager_col(Who::SglangKernel(l.algo))] {
                    continue;
                }
                let bufs = b.sgl.as_ref().ok_or("no SGLang buffers")?;
                // Captures `calls` calls, then fills the table rows they read (SGLang's
                // `register_peer_mapped_inputs`), before any replay.
                let capture = |calls: usize| -> Result<GpuGraph<R>, String> {
                    barrier.wait();
                    sgl_captured.borrow_mut().clear();
                    let graph = GpuGraph::capture(&stream, || {
                        (0..calls).try_for_each(|_| {
                            sgl_call(&l, true).map_err(allreduce::Error::InvalidConfig)
                        })
                    })
                    .map_err(e)?;
                    for &i in sgl_captured.borrow().iter() {
                        bufs.table
                            .upload_at(i * sgl_row.len(), &sgl_row, &stream)
                            .map_err(e)?;
                    }
                    stream.synchronize().map_err(e)?;
                    Ok(graph)
                };
                // The check: one captured call on a fresh input and a zeroed output.
                bufs.input.upload(host.as_slice(), &stream).map_err(e)?;
                b.output.upload(&zeros, &stream).map_err(e)?;
                let check = capture(1)?;
                barrier.wait();
                check.launch(&stream).map_err(e)?;
                stream.synchronize().map_err(e)?;
                let result = if l.algo.graph_in_place() && l.algo.uses_graph_table() {
                    &bufs.input
                } else {
                    &b.output
                };
                result.download(out.as_mut_slice(), &stream).map_err(e)?;
                row.graph_wrong[g] = count_wrong(dtype, out.as_slice(), expected);
                heartbeat.beat();
                drop(check);
                // The timing: `GRAPH_CALLS` captured calls (in place, 2shot_pull's sums grow
                // from replay to replay; its time does not depend on the values).
                let graph = capture(GRAPH_CALLS)?;
                barrier.wait();
                graph.launch(&stream).map_err(e)?;
                stream.synchronize().map_err(e)?;
                for _ in 0..2 {
                    let t = time(&|| graph.launch(&stream).map_err(e), GRAPH_REPLAYS)?
                        / GRAPH_CALLS as f64;
                    keep_min(&mut row.graph[g], t);
                }
                continue;
            }
            if !timed[eager_col(w)] {
                continue;
            }
            barrier.wait();
            // Ours as an engine captures it, and as vLLM's column runs: plain buffers captured
            // with graph registration on, registered after the capture.
            comm.set_graph_registration(w == Who::Auto).map_err(e)?;
            let graph = GpuGraph::capture(&stream, || {
                (0..GRAPH_CALLS).try_for_each(|_| call(w).map_err(allreduce::Error::InvalidConfig))
            })
            .map_err(e);
            comm.set_graph_registration(false).map_err(e)?;
            let graph = graph?;
            if w == Who::Auto {
                barrier.wait();
                if rank == 0 {
                    Communicator::register_graph_buffers(comms).map_err(e)?;
                }
            }
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
    // Why FlashInfer did not run where its plan said it would (rank 0 speaks for all).
    let pcie_error = match (&pcie_setup.workspace, &pcie) {
        (Ok(_), Err(why)) if rank == 0 => Some(why.clone()),
        _ => None,
    };
    Ok((rows, pcie_error))
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
    // FlashInfer picks its own grid (at most 16 blocks of at most 256 threads, whose registers
    // let several share an SM): capped at SMs / ranks, every rank's grid co-resides too.
    let share = (sms / busiest).max(1);
    let pcie_setup = PcieSetup::new(world, dtype, &sizes, share);
    let sgl_setup = SglangSetup::new(world, &sizes, share);
    let json = args.json;
    if !json {
        println!(
            "# allreduce-bench --peers: {world} ranks (virtual, one GPU unless --devices says \
         otherwise), {dtype}, out of place, integer inputs; us per call, slowest rank; \
         every grid {block_limit} blocks but flashinfer pcie's (its own, at most {share}) and \
         sglang's (its own over {share} SMs)"
        );
        crate::report::print_origin(&comms.iter().map(|c| c.device()).collect::<Vec<_>>());
        match allreduce_peers::versions() {
            Some(v) => println!(
                "# peers: vLLM custom all-reduce, FlashInfer's PCIe IPC all-reduce (untuned \
                 launch, no PDL) and SGLang's custom all-reduce v2 from {v}; best peer: the \
                 fastest of vllm, vllm reg, flashinfer pcie and sglang (its choice)"
            ),
            None => println!(
                "# peers: not built ({})",
                allreduce_peers::unavailable().unwrap_or_default()
            ),
        }
        for line in pcie_setup.notes(&sizes) {
            println!("{line}");
        }
        for line in sgl_setup.notes(&sizes) {
            println!("{line}");
        }
        println!(
        "# {:>10} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>15} | {:>7} | {:>8} {:>8} {:>15} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>8} {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} {:>8} {:>8} | #wrong (auto 1s 2s vllm vllm-reg fi-pcie ours-reg push sglang sgl-1push sgl-2push sgl-1pull sgl-2pull; graphs auto vllm fi-pcie ours-reg push sglang sgl-1push sgl-2push sgl-1pull sgl-2pull)",
        "bytes",
        "auto ran",
        "auto",
        "1shot",
        "2shot",
        "vllm",
        "vllm reg",
        "flashinfer pcie",
        "ratio",
        "graph",
        "vllm",
        "flashinfer pcie",
        "ratio",
        "ours reg",
        "ratio",
        "g.reg",
        "ratio",
        "push",
        "ratio",
        "g.push",
        "ratio",
        "sglang",
        "1push",
        "2push",
        "1pull",
        "2pull",
        "g.sglang",
        "g.1push",
        "g.2push",
        "g.1pull",
        "g.2pull"
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
    let shared: Shared = Mutex::new(vec![Addrs::default(); world]);
    let heartbeat = Heartbeat::default();
    let wrongs = Mutex::new(vec![[0usize; NE]; world]);
    // Collective, before the ranks' threads start (it allocates on every rank's device).
    let registered = Communicator::alloc_registered_group(&comms, max.max(16))?;
    type RankResult = Result<(Vec<RowTimes>, Option<String>), String>;
    let results: Vec<RankResult> = std::thread::scope(|s| {
        // vLLM's and FlashInfer's kernels wait for their peers without a deadline: a row that
        // stops progressing ends the process with a message instead of hanging it.
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
                let (pcie_setup, sgl_setup) = (&pcie_setup, &sgl_setup);
                let comms = &comms[..];
                s.spawn(move || {
                    rank_loop(
                        comms,
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
                        pcie_setup,
                        sgl_setup,
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
    let mut pcie_error = None;
    for r in results {
        let (rows, err) = r?;
        per_rank.push(rows);
        pcie_error = pcie_error.or(err);
    }
    if let (Some(why), false) = (&pcie_error, json) {
        println!("# flashinfer pcie not run: {why}");
    }
    let mut rows_json = Vec::with_capacity(sizes.len());
    // --plot: ours / the best peer per size (log2 bytes), eager and in graphs.
    let mut ratios: Vec<(String, Vec<(f64, f64)>)> = [
        "ours reg / best peer, eager",
        "ours reg / best peer, graphs",
        "ours (staged) / best peer, eager",
    ]
    .iter()
    .map(|l| (l.to_string(), Vec::new()))
    .collect();
    let (ec, gc) = (eager_col, |w| graph_col(w).expect("a graph contender"));
    for (k, &bytes) in sizes.iter().enumerate() {
        let slowest = |f: &dyn Fn(&RowTimes) -> f64| slowest(&per_rank, k, f);
        let eager: Vec<f64> = (0..EAGER.len()).map(|i| slowest(&|r| r.eager[i])).collect();
        let graph: Vec<f64> = (0..GRAPH.len()).map(|i| slowest(&|r| r.graph[i])).collect();
        // Summed over ranks already (the ranks agreed on them), graphs summed here.
        let mut wrong: Vec<usize> = per_rank[0][k].wrong.to_vec();
        let graph_wrong: Vec<usize> = (0..GRAPH.len())
            .map(|g| per_rank.iter().map(|r| r[k].graph_wrong[g]).sum::<usize>())
            .collect();
        wrong.extend(&graph_wrong);
        let peer = best_peer(&eager, false);
        let graph_peer = best_peer(&graph, true);
        let num = |x: f64| (!x.is_nan()).then_some(x * 1e6);
        let (auto, reg) = (eager[ec(Who::Auto)], eager[ec(Who::OursRegistered)]);
        let (g_auto, g_reg) = (graph[gc(Who::Auto)], graph[gc(Who::OursRegistered)]);
        let (push, g_push) = (eager[ec(Who::Push)], graph[gc(Who::Push)]);
        for (line, (a, b)) in
            ratios
                .iter_mut()
                .zip([(reg, peer), (g_reg, graph_peer), (auto, peer)])
        {
            if bytes > 0 && !(a / b).is_nan() {
                line.1.push(((bytes as f64).log2(), a / b));
            }
        }
        let pcie_launch = match &pcie_setup.plan[k] {
            Ok(l) => serde_json::json!({
                "blocks": l.blocks, "threads": l.threads, "variant": l.variant.to_string(),
            }),
            Err(why) => serde_json::json!({ "not_run": why }),
        };
        let eager_json = |w: Who| num(eager[ec(w)]);
        let graph_json = |w: Who| num(graph[gc(w)]);
        let w_eager = |w: Who| wrong[ec(w)];
        let w_graph = |w: Who| graph_wrong[gc(w)];
        let sgl_launch = |l: &Result<SglangLaunch, String>| match l {
            Ok(l) => serde_json::json!({
                "algo": l.algo.name(), "blocks": l.blocks, "threads": l.threads,
            }),
            Err(why) => serde_json::json!({ "not_run": why }),
        };
        let sgl_kernels = |f: &dyn Fn(Who) -> serde_json::Value| {
            serde_json::Value::Object(
                SglangAlgo::ALL
                    .iter()
                    .map(|&a| (a.name().to_string(), f(Who::SglangKernel(a))))
                    .collect(),
            )
        };
        let sgl_plan = &sgl_setup.plan[k];
        rows_json.push(serde_json::json!({
            "bytes": bytes,
            "auto_ran": per_rank[0][k].ran.map(|s| s.to_string()),
            "eager_us": {
                "auto": eager_json(Who::Auto), "oneshot": eager_json(Who::OneShot),
                "twoshot": eager_json(Who::TwoShot), "vllm": eager_json(Who::Vllm),
                "vllm_registered": eager_json(Who::VllmRegistered),
                "flashinfer_pcie": eager_json(Who::Pcie),
                "ours_registered": eager_json(Who::OursRegistered),
                "push_oneshot": eager_json(Who::Push),
                "sglang": eager_json(Who::Sglang),
                "sglang_kernels": sgl_kernels(&|w| serde_json::json!(eager_json(w))),
            },
            "graph_us": {
                "auto": graph_json(Who::Auto), "vllm": graph_json(Who::VllmRegistered),
                "flashinfer_pcie": graph_json(Who::Pcie),
                "ours_registered": graph_json(Who::OursRegistered),
                "push_oneshot": graph_json(Who::Push),
                "sglang": graph_json(Who::Sglang),
                "sglang_kernels": sgl_kernels(&|w| serde_json::json!(graph_json(w))),
            },
            "sglang_launch": {
                "eager": sgl_launch(&sgl_plan.eager), "graph": sgl_launch(&sgl_plan.graph),
                "kernels": serde_json::Value::Object(SglangAlgo::ALL.iter().zip(&sgl_plan.kernels)
                    .map(|(a, l)| (a.name().to_string(), sgl_launch(l))).collect()),
            },
            "best_peer_eager_us": num(peer),
            "best_peer_graph_us": num(graph_peer),
            "flashinfer_pcie_launch": pcie_launch,
            "wrong": {
                "eager": { "auto": w_eager(Who::Auto), "oneshot": w_eager(Who::OneShot),
                           "twoshot": w_eager(Who::TwoShot), "vllm": w_eager(Who::Vllm),
                           "vllm_registered": w_eager(Who::VllmRegistered),
                           "flashinfer_pcie": w_eager(Who::Pcie),
                           "ours_registered": w_eager(Who::OursRegistered),
                           "push_oneshot": w_eager(Who::Push),
                           "sglang": w_eager(Who::Sglang),
                           "sglang_kernels": sgl_kernels(&|w| serde_json::json!(w_eager(w))) },
                "graph": { "auto": w_graph(Who::Auto), "vllm": w_graph(Who::VllmRegistered),
                           "flashinfer_pcie": w_graph(Who::Pcie),
                           "ours_registered": w_graph(Who::OursRegistered),
                           "push_oneshot": w_graph(Who::Push),
                           "sglang": w_graph(Who::Sglang),
                           "sglang_kernels": sgl_kernels(&|w| serde_json::json!(w_graph(w))) },
            },
        }));
        if json {
            continue;
        }
        println!(
            "  {:>10} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8} {:>15} | {:>7} | {:>8} {:>8} {:>15} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>7} | {:>8} {:>8} {:>8} {:>8} {:>8} | {:>8} {:>8} {:>8} {:>8} {:>8} | {:?}",
            bytes,
            per_rank[0][k]
                .ran
                .map_or("-".to_string(), |s| s.to_string()),
            us(auto),
            us(eager[ec(Who::OneShot)]),
            us(eager[ec(Who::TwoShot)]),
            us(eager[ec(Who::Vllm)]),
            us(eager[ec(Who::VllmRegistered)]),
            us(eager[ec(Who::Pcie)]),
            ratio(auto, peer),
            us(g_auto),
            us(graph[gc(Who::VllmRegistered)]),
            us(graph[gc(Who::Pcie)]),
            ratio(g_auto, graph_peer),
            us(reg),
            ratio(reg, peer),
            us(g_reg),
            ratio(g_reg, graph_peer),
            us(push),
            ratio(push, peer),
            us(g_push),
            ratio(g_push, graph_peer),
            us(eager[ec(Who::Sglang)]),
            us(eager[ec(SGLANG_KERNELS[0])]),
            us(eager[ec(SGLANG_KERNELS[1])]),
            us(eager[ec(SGLANG_KERNELS[2])]),
            us(eager[ec(SGLANG_KERNELS[3])]),
            us(graph[gc(Who::Sglang)]),
            us(graph[gc(SGLANG_KERNELS[0])]),
            us(graph[gc(SGLANG_KERNELS[1])]),
            us(graph[gc(SGLANG_KERNELS[2])]),
            us(graph[gc(SGLANG_KERNELS[3])]),
            wrong
        );
    }
    if let Some(path) = &args.plot {
        crate::plot::draw_lines(
            path,
            &format!(
                "allreduce vs vLLM custom all-reduce, FlashInfer PCIe all-reduce and SGLang \
                 custom all-reduce v2, {world} ranks, {dtype}"
            ),
            &crate::plot::Axes {
                x_desc: "message size per rank (bytes, log2 scale)",
                y_desc: "time / the best peer's time (below 1: ours is faster)",
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
            "flashinfer_pcie_grid_cap": share,
            "flashinfer_pcie_error": pcie_error,
            "best_peer": ["vllm", "vllm_registered", "flashinfer_pcie", "sglang"],
            "sglang_grids": sgl_setup.config.as_ref().ok().map(|c| serde_json::json!({
                "push_blocks": c.push_blocks, "pull_blocks": c.pull_blocks,
            })),
            "sglang_max_size": SGLANG_MAX_SIZE,
            "graph_calls": GRAPH_CALLS,
            "rows": rows_json,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What keeps the exact check fair to FlashInfer's 16-bit accumulation: with the integer
    /// inputs, every partial sum in rank order and in its 8-rank island order is exact in
    /// bf16 and f16, so any order and precision gives the exact sum.
    #[test]
    fn integer_sums_are_exact_in_any_order_and_precision() {
        use crate::data::{int_pattern, round_to};
        for dtype in [DType::BF16, DType::F16] {
            let add = |a: f32, b: f32| round_to(dtype, a + b);
            for world in [2usize, 4, 8] {
                // The pattern repeats every 23 elements.
                for i in 0..23 {
                    let v: Vec<f32> = (0..world).map(|r| int_pattern(r, i)).collect();
                    let exact: f32 = v.iter().sum();
                    assert_eq!(v.iter().fold(0.0, |a, &x| add(a, x)), exact);
                    assert_eq!(v.iter().rev().fold(0.0, |a, &x| add(a, x)), exact);
                    if world == 8 {
                        let island = |s: &[f32]| add(add(s[0], s[1]), add(s[2], s[3]));
                        assert_eq!(add(island(&v[..4]), island(&v[4..])), exact);
                    }
                    // Every partial sum stays within the integers both types hold exactly.
                    assert!(v.iter().map(|x| x.abs()).sum::<f32>() <= 256.0);
                }
            }
        }
    }

    #[test]
    fn flashinfer_pcie_is_a_column_in_both_modes_and_in_best_peer() {
        assert!(EAGER.contains(&Who::Pcie) && GRAPH.contains(&Who::Pcie));
        assert!(GRAPH.iter().all(|w| EAGER.contains(w)));
        let mut eager = [f64::NAN; NE];
        eager[eager_col(Who::Vllm)] = 3.0;
        eager[eager_col(Who::VllmRegistered)] = 2.0;
        eager[eager_col(Who::Pcie)] = 1.0;
        eager[eager_col(Who::Auto)] = 0.5;
        assert_eq!(best_peer(&eager, false), 1.0);
        eager[eager_col(Who::Pcie)] = f64::NAN;
        assert_eq!(best_peer(&eager, false), 2.0);
        let mut graph = [f64::NAN; NG];
        assert!(best_peer(&graph, true).is_nan());
        graph[graph_col(Who::Pcie).unwrap()] = 4.0;
        graph[graph_col(Who::OursRegistered).unwrap()] = 1.0;
        assert_eq!(best_peer(&graph, true), 4.0);
        graph[graph_col(Who::VllmRegistered).unwrap()] = 3.0;
        assert_eq!(best_peer(&graph, true), 3.0);
    }

    #[test]
    fn flashinfer_pcie_plan_says_where_it_runs_and_why_not() {
        let sizes = [16, 64, 256, 16 << 10, 64 << 10, 1 << 20];
        let setup = PcieSetup::new(8, DType::BF16, &sizes, 16);
        let notes = setup.notes(&sizes);
        if let Some(why) = allreduce_peers::unavailable() {
            assert_eq!(
                notes,
                vec![format!("# flashinfer pcie at 16-1M B: - ({why})")]
            );
            assert!(setup.workspace.is_err());
            return;
        }
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(notes[0]
            .starts_with("# flashinfer pcie at 16-64 B: - (under one 16-byte pack per rank"));
        assert_eq!(
            notes[1],
            "# flashinfer pcie at 256-16K B: 16 blocks x 256 threads, unstaged"
        );
        assert_eq!(
            notes[2],
            "# flashinfer pcie at 64K B: 1 block x 256 threads, staged-ring"
        );
        assert_eq!(
            notes[3],
            "# flashinfer pcie at 1M B: 4 blocks x 256 threads, staged-ring"
        );
        // f32: one line, no workspace.
        let f32_setup = PcieSetup::new(2, DType::F32, &sizes, 66);
        assert_eq!(f32_setup.notes(&sizes).len(), 1);
        assert!(f32_setup.workspace.is_err());
        // The workspace holds the largest admitted size: two regions of two halves of every
        // rank's copy.
        let (n, bytes) = setup.workspace.clone().unwrap();
        assert_eq!(n, (1 << 20) / 2);
        assert!(bytes > 2 * 2 * 8 * (1 << 20), "{bytes}");
    }

    #[test]
    fn push_is_ours_in_both_modes_beside_sglangs_columns() {
        assert!(EAGER.contains(&Who::Push) && GRAPH.contains(&Who::Push));
        assert!(!PEERS.contains(&Who::Push));
        // Every contender has one column of its own in each mode it runs in.
        for (i, w) in EAGER.iter().enumerate() {
            assert_eq!(eager_col(*w), i);
        }
        for (i, w) in GRAPH.iter().enumerate() {
            assert_eq!(graph_col(*w), Some(i));
        }
        let mut eager = [f64::NAN; NE];
        eager[eager_col(Who::Push)] = 0.5;
        eager[eager_col(Who::Sglang)] = 2.0;
        assert_eq!(best_peer(&eager, false), 2.0);
        let mut graph = [f64::NAN; NG];
        graph[graph_col(Who::Push).unwrap()] = 0.5;
        assert!(best_peer(&graph, true).is_nan());
    }

    #[test]
    fn sglang_is_ranked_by_its_choice_and_its_kernels_are_shown() {
        assert!(EAGER.contains(&Who::Sglang) && GRAPH.contains(&Who::Sglang));
        for k in SGLANG_KERNELS {
            assert!(EAGER.contains(&k) && GRAPH.contains(&k) && !PEERS.contains(&k));
        }
        let mut eager = [f64::NAN; NE];
        eager[eager_col(Who::Vllm)] = 3.0;
        eager[eager_col(Who::Sglang)] = 2.0;
        eager[eager_col(SGLANG_KERNELS[0])] = 1.0;
        assert_eq!(best_peer(&eager, false), 2.0);
        let mut graph = [f64::NAN; NG];
        graph[graph_col(SGLANG_KERNELS[3]).unwrap()] = 1.0;
        assert!(best_peer(&graph, true).is_nan());
        graph[graph_col(Who::Sglang).unwrap()] = 5.0;
        assert_eq!(best_peer(&graph, true), 5.0);
    }

    #[test]
    fn sglang_plan_says_what_it_picks_and_sizes_its_workspaces() {
        let sizes = [16, 64 << 10, 256 << 10, 1 << 20, 32 << 20];
        let setup = SglangSetup::new(8, &sizes, 16);
        let notes = setup.notes(&sizes);
        if let Some(why) = allreduce_peers::sglang_unavailable() {
            assert_eq!(
                notes,
                vec![format!(
                    "# sglang at 16-32M B: eager - ({why}), graphs - ({why})"
                )]
            );
            assert!(!setup.runs());
            return;
        }
        assert!(setup.runs());
        // Eight ranks on an H100's share (132 / 8 SMs): the push to 128 KiB, 2shot_pull to the
        // 16 MiB workspace, NCCL above.
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(notes[0].contains("push 16 blocks, pull 16"), "{}", notes[0]);
        assert_eq!(
            notes[1],
            "# sglang at 16-64K B: eager 1shot_push, graphs 1shot_push"
        );
        assert_eq!(
            notes[2],
            "# sglang at 256K-1M B: eager 2shot_pull, graphs 2shot_pull"
        );
        assert_eq!(
            notes[3],
            "# sglang at 32M B: eager - (NCCL in SGLang), graphs - (NCCL in SGLang)"
        );
        // Its kernels run at every size, so the workspaces hold the largest.
        assert!(setup
            .plan
            .iter()
            .all(|r| r.kernels.iter().all(|k| k.is_ok())));
        assert_eq!((setup.slot_bytes, setup.pull_bytes), (32 << 20, 32 << 20));
        // Not whole 16-byte vectors: nothing runs.
        let odd = SglangSetup::new(2, &[8], 66);
        assert!(!odd.runs());
        // A world size without a Hopper row.
        let nine = SglangSetup::new(9, &[1024], 14);
        assert!(!nine.runs() && nine.config.is_err());
    }
}
