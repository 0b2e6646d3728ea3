//! SGLang's custom all-reduce v2 (sglang 0.5.23: `sglang/kernels/jit/csrc/distributed/
//! custom_all_reduce.cuh`, driven by `sglang/srt/distributed/device_communicators/
//! custom_all_reduce_v2.py`): four kernels behind one entry, and the table SGLang tunes the
//! choice between them with.
//!
//! - `1shot_push`: every rank stores its input into every peer's push slot (Lamport: +0.0 is
//!   "not arrived", so payload zeros travel as -0.0), then polls its own slots and reduces.
//! - `2shot_push`: the same push, but each chunk goes to its owner only, which reduces it and
//!   pushes the sum back to everyone.
//! - `1shot_pull`: the input is copied into this rank's pull workspace, a barrier, then every
//!   rank reads every workspace and reduces into its output.
//! - `2shot_pull`: the same copy and barrier; each rank reduces its shard and writes it into
//!   every workspace, then copies its workspace out.
//!
//! In CUDA graphs SGLang's pull kernels skip the copies and read the captured inputs in place,
//! through a device table of every rank's pointer per captured call, filled after the capture
//! (`_register_graph_inputs`); `2shot_pull` then reduces into the inputs themselves.
//!
//! [`SglangConfig::hopper`] restates its Hopper table (`_sm90_configs` in
//! `configs/custom_all_reduce_v2.py`), [`SglangConfig::engine`] the clipping its constructor
//! applies, [`SglangConfig::pick`] its choice (`_pick_config`), and [`SglangLaunch`] the grid
//! and block its host code launches with.

use std::ffi::c_void;

use allreduce_core::DType;

#[cfg(peers_sglang)]
use crate::call;
use crate::dtype_code;

#[cfg(peers_sglang)]
mod ffi {
    use std::ffi::c_void;
    extern "C" {
        pub fn peers_sglang_semaphore_bytes() -> usize;
        pub fn peers_sglang_counter_bytes() -> usize;
        pub fn peers_sglang_create(
            world: i32,
            rank: i32,
            push: *mut *mut c_void,
            counter: *mut c_void,
            push_blocks: i32,
            slot_bytes: i64,
            pull: *mut *mut c_void,
            sems: *mut *mut c_void,
            pull_blocks: i32,
            pull_bytes: i64,
            out: *mut *mut c_void,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_sglang_destroy(h: *mut c_void);
        pub fn peers_sglang_all_reduce(
            h: *mut c_void,
            stream: *mut c_void,
            dtype: i32,
            algo: i32,
            input: *const c_void,
            output: *mut c_void,
            nbytes: i64,
            graph_row: *const *mut c_void,
            threads: i32,
            err: *mut u8,
            len: usize,
        ) -> i32;
    }
}

/// Why SGLang's kernels are unavailable in this build.
pub fn sglang_unavailable() -> Option<String> {
    if let Some(why) = crate::unavailable() {
        return Some(why);
    }
    if cfg!(peers_sglang) {
        None
    } else {
        Some("SGLang's kernels were not fetched: rerun scripts/peers/fetch.sh, then rebuild".into())
    }
}

const KB: usize = 1 << 10;
const MB: usize = 1 << 20;

/// SGLang's four kernels (`AllReduceAlgo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SglangAlgo {
    OneShotPush,
    TwoShotPush,
    OneShotPull,
    TwoShotPull,
}

impl SglangAlgo {
    pub const ALL: [SglangAlgo; 4] = [
        SglangAlgo::OneShotPush,
        SglangAlgo::TwoShotPush,
        SglangAlgo::OneShotPull,
        SglangAlgo::TwoShotPull,
    ];

    /// SGLang's name for it (`algo_name`).
    pub fn name(self) -> &'static str {
        match self {
            SglangAlgo::OneShotPush => "1shot_push",
            SglangAlgo::TwoShotPush => "2shot_push",
            SglangAlgo::OneShotPull => "1shot_pull",
            SglangAlgo::TwoShotPull => "2shot_pull",
        }
    }

    pub fn is_push(self) -> bool {
        matches!(self, SglangAlgo::OneShotPush | SglangAlgo::TwoShotPush)
    }

    /// Whether a captured call of it reads a graph table row (the pull kernels do).
    pub fn uses_graph_table(self) -> bool {
        !self.is_push()
    }

    /// Whether a captured call writes its result into its input (`2shot_pull` from a graph
    /// table: every rank's input ends up holding the sum).
    pub fn graph_in_place(self) -> bool {
        self == SglangAlgo::TwoShotPull
    }

    #[cfg_attr(not(peers_sglang), allow(dead_code))]
    fn code(self) -> i32 {
        match self {
            SglangAlgo::OneShotPush => 0,
            SglangAlgo::TwoShotPush => 1,
            SglangAlgo::OneShotPull => 2,
            SglangAlgo::TwoShotPull => 3,
        }
    }
}

impl std::fmt::Display for SglangAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One dispatch context's crossovers (`Heuristic`): each kernel up to its threshold, tried in
/// the order 1shot_push, 2shot_push, 1shot_pull, multicast 2shot_pull, 2shot_pull; above them
/// all, SGLang calls NCCL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SglangHeuristic {
    pub one_shot_push: usize,
    pub one_shot_pull: usize,
    pub two_shot_pull: usize,
    /// The multicast 2shot_pull's range (min, max); (0, 0): none.
    pub mc: (usize, usize),
    /// 0: 2shot_push off (so on every Hopper row).
    pub two_shot_push: usize,
}

impl SglangHeuristic {
    /// A row of the table: thresholds in the file's units (fractions of a MiB are whole bytes:
    /// `_pack_heuristic` truncates them to int).
    fn row(one_push: usize, one_pull: usize, two_pull: usize, mc: (usize, usize)) -> Self {
        SglangHeuristic {
            one_shot_push: one_push,
            one_shot_pull: one_pull,
            two_shot_pull: two_pull,
            mc,
            two_shot_push: 0,
        }
    }

    /// The per-slot push bytes it needs (`max_push_bytes`).
    fn max_push_bytes(&self, world: usize) -> usize {
        self.one_shot_push
            .max(two_shot_push_slot_bytes(self.two_shot_push, world))
    }

    /// The pull workspace it needs (`max_pull_bytes`).
    fn max_pull_bytes(&self) -> usize {
        self.one_shot_pull.max(self.two_shot_pull).max(self.mc.1)
    }

    /// `Heuristic.clip`: no threshold beyond the workspaces.
    fn clip(self, max_push: usize, max_pull: usize, world: usize) -> Self {
        SglangHeuristic {
            one_shot_push: self.one_shot_push.min(max_push),
            one_shot_pull: self.one_shot_pull.min(max_pull),
            two_shot_pull: self.two_shot_pull.min(max_pull),
            mc: (self.mc.0.min(max_pull), self.mc.1.min(max_pull)),
            two_shot_push: self.two_shot_push.min(world * 16 * (max_push / 32)),
        }
    }
}

/// `two_shot_push_slot_bytes`: a 2shot_push slot holds a partial and a gathered half of one
/// `ceil(bytes / world)` chunk, in 16-byte vectors.
pub fn two_shot_push_slot_bytes(bytes: usize, world: usize) -> usize {
    32 * bytes.div_ceil(16 * world)
}

/// SGLang's tuning for one architecture and world size (`AllReduceConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SglangConfig {
    pub graph: SglangHeuristic,
    pub eager: SglangHeuristic,
    /// The push grid (bound to the epoch counters: one per block).
    pub push_blocks: u32,
    /// The pull grid (one semaphore per block).
    pub pull_blocks: u32,
    /// The multicast 2shot_pull's grid; `None`: no multicast.
    pub mc_blocks: Option<u32>,
}

/// SGLang's default cap on each workspace (`SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB`, 16 MiB).
pub const SGLANG_MAX_SIZE: usize = 16 * MB;
/// The workspaces' alignment (`_ALIGN_BYTES`).
const ALIGN: usize = 1024;

impl SglangConfig {
    /// SGLang's Hopper (sm_90) row for `world` ranks on a GPU of `num_sm` SMs (`_sm90_configs`,
    /// tuned on an H200), or `None` outside its 2 to 8 ranks.
    pub fn hopper(world: usize, num_sm: u32) -> Option<SglangConfig> {
        let h = SglangHeuristic::row;
        let mb = |x: f64| (x * MB as f64) as usize;
        let (graph, eager) = match world {
            2 => (
                h(16 * MB, 128 * MB, 128 * MB, (0, 0)),
                h(32 * MB, 128 * MB, 128 * MB, (0, 0)),
            ),
            3 => (
                h(mb(1.25), mb(1.25), 128 * MB, (0, 0)),
                h(3 * MB, 3 * MB, 16 * MB, (0, 0)),
            ),
            4 => (
                h(384 * KB, 384 * KB, 128 * MB, (0, 0)),
                h(896 * KB, 896 * KB, 32 * MB, (0, 32 * MB)),
            ),
            5 => (
                h(192 * KB, 192 * KB, 32 * MB, (0, 0)),
                h(384 * KB, 384 * KB, 32 * MB, (0, 32 * MB)),
            ),
            6 => (
                h(128 * KB, 128 * KB, 32 * MB, (8 * MB, 32 * MB)),
                h(192 * KB, 192 * KB, 32 * MB, (0, 32 * MB)),
            ),
            7 => (
                h(128 * KB, 128 * KB, 32 * MB, (MB, 32 * MB)),
                h(128 * KB, 128 * KB, 32 * MB, (0, 32 * MB)),
            ),
            8 => (
                h(128 * KB, 128 * KB, 32 * MB, (512 * KB, 128 * MB)),
                h(128 * KB, 128 * KB, 128 * MB, (0, 128 * MB)),
            ),
            _ => return None,
        };
        Some(SglangConfig {
            graph,
            eager,
            push_blocks: num_sm,
            pull_blocks: 64,
            mc_blocks: (world >= 4).then(|| 128 / world as u32),
        })
    }

    /// Per-slot push bytes the table needs at `world` ranks.
    pub fn max_push_bytes(&self, world: usize) -> usize {
        self.graph
            .max_push_bytes(world)
            .max(self.eager.max_push_bytes(world))
    }

    /// Pull workspace bytes the table needs.
    pub fn max_pull_bytes(&self) -> usize {
        self.graph.max_pull_bytes().max(self.eager.max_pull_bytes())
    }

    /// What `CustomAllReduceV2.__init__` makes of the table with `max_size` (its default:
    /// [`SGLANG_MAX_SIZE`]): workspaces of the table's needs capped at `max_size` (at least
    /// and a multiple of 1 KiB), thresholds clipped to them, and multicast off where the
    /// symmetric allocation has none (`num_mc_blocks = None`). Returns the config with the
    /// per-slot push bytes and the pull bytes.
    pub fn engine(self, world: usize, max_size: usize, multicast: bool) -> (Self, usize, usize) {
        let align = |x: usize| x.max(ALIGN).div_ceil(ALIGN) * ALIGN;
        let push = align(self.max_push_bytes(world).min(max_size));
        let pull = align(self.max_pull_bytes().min(max_size));
        let c = SglangConfig {
            graph: self.graph.clip(push, pull, world),
            eager: self.eager.clip(push, pull, world),
            mc_blocks: if multicast { self.mc_blocks } else { None },
            ..self
        };
        (c, push, pull)
    }

    /// SGLang's kernel for a `bytes` all-reduce (`_pick_config`), in a CUDA-graph capture or
    /// eagerly; `None`: it calls NCCL (or the size is not whole 16-byte vectors, which
    /// `should_custom_ar` sends there too). The multicast 2shot_pull is reported as 2shot_pull
    /// with `true`.
    pub fn pick(&self, bytes: usize, graph: bool) -> Option<(SglangAlgo, bool)> {
        if bytes == 0 || bytes % 16 != 0 {
            return None;
        }
        let h = if graph { &self.graph } else { &self.eager };
        if bytes <= h.one_shot_push {
            return Some((SglangAlgo::OneShotPush, false));
        }
        if bytes <= h.two_shot_push {
            return Some((SglangAlgo::TwoShotPush, false));
        }
        if bytes <= h.one_shot_pull {
            return Some((SglangAlgo::OneShotPull, false));
        }
        if self.mc_blocks.is_some() && (h.mc.0..=h.mc.1).contains(&bytes) {
            return Some((SglangAlgo::TwoShotPull, true));
        }
        if bytes <= h.two_shot_pull {
            return Some((SglangAlgo::TwoShotPull, false));
        }
        None
    }
}

/// `choose_block_size` (custom_all_reduce.cuh): the smallest of 128, 256 and 512 threads whose
/// blocks for `threads` work items fit one per SM, else 1024.
pub fn choose_block_size(threads: u32, num_sm: u32) -> u32 {
    for block in [128, 256, 512] {
        if threads.div_ceil(block) <= num_sm {
            return block;
        }
    }
    1024
}

/// The launch SGLang's host code makes for one call: a kernel, its grid (the plane's, fixed)
/// and its block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SglangLaunch {
    pub algo: SglangAlgo,
    pub blocks: u32,
    pub threads: u32,
}

impl SglangLaunch {
    /// `AllReduceKernel::run`'s launch of `algo` for `bytes` at `world` ranks with `config`'s
    /// grids, on a GPU of `num_sm` SMs (what `choose_block_size` counts). The error says why
    /// SGLang's kernels do not take the size.
    pub fn new(
        config: &SglangConfig,
        algo: SglangAlgo,
        world: usize,
        bytes: usize,
        num_sm: u32,
    ) -> Result<SglangLaunch, String> {
        if !(2..=8).contains(&world) {
            return Err(format!(
                "SGLang's kernels are built here for 2 to 8 ranks, not {world}"
            ));
        }
        if bytes == 0 || bytes % 16 != 0 {
            return Err(format!("{bytes} bytes: SGLang takes whole 16-byte vectors"));
        }
        let vecs = u32::try_from(bytes / 16).map_err(|_| format!("{bytes} bytes: too many"))?;
        let w = world as u32;
        let (blocks, threads) = match algo {
            SglangAlgo::OneShotPush => (config.push_blocks, choose_block_size(vecs, num_sm)),
            // At least one warp per peer in all.
            SglangAlgo::TwoShotPush => (
                config.push_blocks,
                choose_block_size(vecs, num_sm).max(32 * (w - 1).div_ceil(config.push_blocks)),
            ),
            SglangAlgo::OneShotPull => (config.pull_blocks, choose_block_size(vecs, num_sm)),
            SglangAlgo::TwoShotPull => (
                config.pull_blocks,
                choose_block_size(vecs.div_ceil(w), num_sm),
            ),
        };
        if blocks == 0 || threads > 1024 {
            return Err(format!("{blocks} blocks x {threads} threads"));
        }
        Ok(SglangLaunch {
            algo,
            blocks,
            threads,
        })
    }
}

/// One rank of SGLang's custom all-reduce v2, without multicast.
///
/// Memory is the caller's, laid out as `CustomAllReduceV2._init_workspace` lays it out: per
/// rank one zeroed slab of `2 * world` push slots, the pull workspace and the pull
/// semaphores ([`Sglang::slab_bytes`]), every rank's slab known to every rank, plus this
/// rank's zeroed push epoch counters ([`Sglang::counter_bytes`]). Its kernels wait for their
/// peers without a deadline, and every rank must make the same calls with the same launches,
/// in order, on one stream.
pub struct Sglang {
    #[cfg_attr(not(peers_sglang), allow(dead_code))]
    handle: *mut c_void,
    world: usize,
    config: SglangConfig,
}

// SAFETY: as for `Vllm`: one rank's thread uses it at a time; the C++ object holds pointers.
unsafe impl Send for Sglang {}

/// Bytes of a pull semaphore (`Semaphore`, one cache line).
const SEMAPHORE_BYTES: usize = 128;
/// Bytes of a push epoch counter.
const COUNTER_BYTES: usize = 4;

impl Sglang {
    /// The layout of one rank's slab: (bytes, offset of the pull workspace, offset of the
    /// semaphores) for push slots of `slot_bytes`, a pull workspace of `pull_bytes` and
    /// `pull_blocks` semaphores.
    pub fn slab_bytes(
        world: usize,
        slot_bytes: usize,
        pull_bytes: usize,
        pull_blocks: u32,
    ) -> (usize, usize, usize) {
        let push = 2 * world * slot_bytes;
        let sems = SEMAPHORE_BYTES * pull_blocks as usize;
        (push + pull_bytes + sems, push, push + pull_bytes)
    }

    /// Bytes of one rank's push epoch counters.
    pub fn counter_bytes(push_blocks: u32) -> usize {
        COUNTER_BYTES * push_blocks as usize
    }

    /// Rank `rank` of `slabs.len()` (2 to 8) over every rank's slab (laid out by
    /// [`Sglang::slab_bytes`] for `slot_bytes` and `pull_bytes`) and this rank's counters,
    /// with `config`'s grids.
    ///
    /// # Safety
    /// The slabs and counters are device buffers of those sizes, all zeroed before any rank's
    /// first call, living as long as every rank's communicator.
    pub unsafe fn new(
        slabs: &[u64],
        counter: u64,
        rank: usize,
        config: SglangConfig,
        slot_bytes: usize,
        pull_bytes: usize,
    ) -> Result<Self, String> {
        if let Some(why) = sglang_unavailable() {
            return Err(why);
        }
        let world = slabs.len();
        if !(2..=8).contains(&world) || rank >= world {
            return Err(format!(
                "SGLang's kernels are built here for 2 to 8 ranks; rank {rank} of {world} asked"
            ));
        }
        #[cfg(peers_sglang)]
        {
            // The shim's layout constants are the header's.
            // SAFETY: constants.
            let (sem, cnt) = unsafe {
                (
                    ffi::peers_sglang_semaphore_bytes(),
                    ffi::peers_sglang_counter_bytes(),
                )
            };
            if (sem, cnt) != (SEMAPHORE_BYTES, COUNTER_BYTES) {
                return Err(format!(
                    "SGLang's semaphore and counter are {sem} and {cnt} bytes, not {SEMAPHORE_BYTES} and {COUNTER_BYTES}"
                ));
            }
            let (_, pull_at, sems_at) =
                Self::slab_bytes(world, slot_bytes, pull_bytes, config.pull_blocks);
            let ptr = |s: u64, off: usize| (s as usize + off) as *mut c_void;
            let mut push: Vec<*mut c_void> = slabs.iter().map(|&s| ptr(s, 0)).collect();
            let mut pull: Vec<*mut c_void> = slabs.iter().map(|&s| ptr(s, pull_at)).collect();
            let mut sems: Vec<*mut c_void> = slabs.iter().map(|&s| ptr(s, sems_at)).collect();
            let mut handle = std::ptr::null_mut();
            call("sglang planes", |e, l| {
                ffi::peers_sglang_create(
                    world as i32,
                    rank as i32,
                    push.as_mut_ptr(),
                    counter as *mut c_void,
                    config.push_blocks as i32,
                    slot_bytes as i64,
                    pull.as_mut_ptr(),
                    sems.as_mut_ptr(),
                    config.pull_blocks as i32,
                    pull_bytes as i64,
                    &mut handle,
                    e,
                    l,
                )
            })?;
            return Ok(Sglang {
                handle,
                world,
                config,
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (counter, config, slot_bytes, pull_bytes);
            unreachable!("sglang_unavailable() covers builds without the shim")
        }
    }

    /// The ranks of its group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The grids it was made with.
    pub fn config(&self) -> &SglangConfig {
        &self.config
    }

    /// Enqueues an all-reduce of `bytes` of `input` into `output` on `stream` (a `CUstream`)
    /// with `launch` (the same on every rank), making the launches SGLang's `run` makes: eager
    /// (`graph_row` `None`) the pull kernels stage `input` through the pull workspace; in a
    /// capture they read the `graph_row` device row of every rank's input pointer, filled
    /// before the graph replays, and 2shot_pull reduces into the inputs (`output` unused).
    ///
    /// # Safety
    /// `input` and `output` are device buffers of `bytes` on the current device, 16-byte
    /// aligned; `graph_row` is device memory of `world` pointers; every rank makes the same
    /// calls.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce(
        &self,
        stream: u64,
        dtype: DType,
        launch: &SglangLaunch,
        input: u64,
        output: u64,
        bytes: usize,
        graph_row: Option<u64>,
    ) -> Result<(), String> {
        if graph_row.is_some() && !launch.algo.uses_graph_table() {
            return Err(format!("{} takes no graph table", launch.algo));
        }
        let d = dtype_code(dtype);
        #[cfg(peers_sglang)]
        {
            return call("sglang all_reduce", |e, l| {
                ffi::peers_sglang_all_reduce(
                    self.handle,
                    stream as *mut c_void,
                    d,
                    launch.algo.code(),
                    input as *const c_void,
                    output as *mut c_void,
                    bytes as i64,
                    graph_row.map_or(std::ptr::null(), |r| r as *const *mut c_void),
                    launch.threads as i32,
                    e,
                    l,
                )
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (stream, d, input, output, bytes);
            Err(sglang_unavailable().unwrap_or_default())
        }
    }
}

impl Drop for Sglang {
    fn drop(&mut self) {
        #[cfg(peers_sglang)]
        // SAFETY: created by peers_sglang_create, dropped once.
        unsafe {
            ffi::peers_sglang_destroy(self.handle)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SglangAlgo::*;

    /// The engine's choice at the thresholds of `_sm90_configs`, read from
    /// configs/custom_all_reduce_v2.py of sglang 0.5.23, after the 16 MiB workspace cap and
    /// without multicast.
    #[test]
    fn hopper_dispatch_follows_sglangs_table() {
        let pick = |world, bytes, graph| {
            let (c, _, _) =
                SglangConfig::hopper(world, 132)
                    .unwrap()
                    .engine(world, SGLANG_MAX_SIZE, false);
            c.pick(bytes, graph).map(|(a, mc)| {
                assert!(!mc);
                a
            })
        };
        // Two ranks: the Lamport push up to the 16 MiB cap (its table says 16 MiB in graphs,
        // 32 MiB eager), NCCL above.
        for graph in [false, true] {
            assert_eq!(pick(2, 16, graph), Some(OneShotPush));
            assert_eq!(pick(2, 16 * MB, graph), Some(OneShotPush));
            assert_eq!(pick(2, 16 * MB + 16, graph), None);
        }
        // Four ranks: push to 384 KiB in graphs and 896 KiB eager, then 2shot_pull (the
        // equal 1shot_pull thresholds leave it no sizes) up to the 16 MiB cap.
        assert_eq!(pick(4, 384 * KB, true), Some(OneShotPush));
        assert_eq!(pick(4, 384 * KB + 16, true), Some(TwoShotPull));
        assert_eq!(pick(4, 384 * KB + 16, false), Some(OneShotPush));
        assert_eq!(pick(4, 896 * KB, false), Some(OneShotPush));
        assert_eq!(pick(4, 896 * KB + 16, false), Some(TwoShotPull));
        assert_eq!(pick(4, 16 * MB, false), Some(TwoShotPull));
        assert_eq!(pick(4, 16 * MB + 16, true), None);
        // Three ranks, eager: push to 3 MiB, 2shot_pull to its own 16 MiB.
        assert_eq!(pick(3, 3 * MB, false), Some(OneShotPush));
        assert_eq!(pick(3, 3 * MB + 16, false), Some(TwoShotPull));
        // 1.25 MiB in graphs is a whole number of bytes.
        assert_eq!(pick(3, 1280 * KB, true), Some(OneShotPush));
        assert_eq!(pick(3, 1280 * KB + 16, true), Some(TwoShotPull));
        // Eight ranks: 128 KiB of push in both contexts.
        for graph in [false, true] {
            assert_eq!(pick(8, 128 * KB, graph), Some(OneShotPush));
            assert_eq!(pick(8, 128 * KB + 16, graph), Some(TwoShotPull));
            assert_eq!(pick(8, 16 * MB, graph), Some(TwoShotPull));
        }
        // Not whole 16-byte vectors: NCCL.
        assert_eq!(pick(8, 8, false), None);
        assert_eq!(pick(8, 24, false), None);
        // No Hopper row beyond 8 ranks.
        assert!(SglangConfig::hopper(9, 132).is_none());
        assert!(SglangConfig::hopper(1, 132).is_none());
    }

    #[test]
    fn multicast_takes_its_range_where_the_table_has_one() {
        let (c, _, _) = SglangConfig::hopper(8, 132)
            .unwrap()
            .engine(8, SGLANG_MAX_SIZE, true);
        assert_eq!(c.mc_blocks, Some(16));
        // Eager 0-128 MiB (clipped to 16): after the push; graphs from 512 KiB.
        assert_eq!(c.pick(128 * KB, false), Some((OneShotPush, false)));
        assert_eq!(c.pick(256 * KB, false), Some((TwoShotPull, true)));
        assert_eq!(c.pick(256 * KB, true), Some((TwoShotPull, false)));
        assert_eq!(c.pick(512 * KB, true), Some((TwoShotPull, true)));
        // Two and three ranks have no multicast grid.
        assert_eq!(SglangConfig::hopper(2, 132).unwrap().mc_blocks, None);
        assert_eq!(SglangConfig::hopper(4, 132).unwrap().mc_blocks, Some(32));
    }

    #[test]
    fn engine_sizes_its_workspaces_as_the_constructor_does() {
        // Eight ranks: push slots of the 128 KiB threshold, the pull workspace capped at 16 MiB.
        let (c, push, pull) =
            SglangConfig::hopper(8, 132)
                .unwrap()
                .engine(8, SGLANG_MAX_SIZE, false);
        assert_eq!((push, pull), (128 * KB, 16 * MB));
        assert_eq!(c.graph.two_shot_pull, 16 * MB);
        assert_eq!(c.eager.two_shot_pull, 16 * MB);
        assert_eq!((c.push_blocks, c.pull_blocks), (132, 64));
        // Four ranks: 896 KiB (eager's push threshold) is a multiple of 1 KiB already.
        let (_, push, _) = SglangConfig::hopper(4, 132)
            .unwrap()
            .engine(4, SGLANG_MAX_SIZE, false);
        assert_eq!(push, 896 * KB);
        // A small cap clips everything, and rounds up to 1 KiB.
        let (c, push, pull) = SglangConfig::hopper(2, 132).unwrap().engine(2, 1000, false);
        assert_eq!((push, pull), (1024, 1024));
        assert_eq!(c.pick(1024, false), Some((OneShotPush, false)));
        assert_eq!(c.pick(1040, false), None);
        assert_eq!(two_shot_push_slot_bytes(8 * MB, 4), 4 * MB);
        assert_eq!(two_shot_push_slot_bytes(16, 4), 32);
    }

    #[test]
    fn launches_follow_sglangs_host_code() {
        let c = SglangConfig::hopper(8, 16).unwrap();
        let l = |algo, bytes| SglangLaunch::new(&c, algo, 8, bytes, 16).unwrap();
        // 128 threads while a block per SM covers the vectors (16 SMs: 2048 vectors).
        assert_eq!(
            l(OneShotPush, 2048 * 16),
            SglangLaunch {
                algo: OneShotPush,
                blocks: 16,
                threads: 128
            }
        );
        assert_eq!(l(OneShotPush, 2049 * 16).threads, 256);
        assert_eq!(l(OneShotPush, 8192 * 16).threads, 512);
        assert_eq!(l(OneShotPush, 8193 * 16).threads, 1024);
        // The pull grid is the table's 64 blocks (here more than the 16-SM share: the bench
        // caps it), and 2shot_pull sizes its block by its shard.
        assert_eq!(l(OneShotPull, 16).blocks, 64);
        assert_eq!(l(TwoShotPull, 8 * 2048 * 16).threads, 128);
        assert_eq!(l(TwoShotPull, 8 * 2048 * 16 + 16 * 8).threads, 256);
        // 2shot_push: a warp per peer at least, over the push grid.
        let one = SglangConfig {
            push_blocks: 1,
            ..c
        };
        let t = SglangLaunch::new(&one, TwoShotPush, 8, 16, 16).unwrap();
        assert_eq!(t.threads, 7 * 32);
        assert_eq!(l(TwoShotPush, 16).threads, 128);
        // Refused: partial vectors, empty, world sizes without kernels here.
        for (world, bytes, why) in [(8, 24, "16-byte"), (8, 0, "16-byte"), (9, 16, "2 to 8")] {
            let e = SglangLaunch::new(&c, OneShotPush, world, bytes, 16).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn slab_layout_is_push_then_pull_then_semaphores() {
        let (bytes, pull_at, sems_at) = Sglang::slab_bytes(4, 1024, 4096, 64);
        assert_eq!(pull_at, 8 * 1024);
        assert_eq!(sems_at, 8 * 1024 + 4096);
        assert_eq!(bytes, 8 * 1024 + 4096 + 64 * 128);
        assert_eq!(Sglang::counter_bytes(132), 528);
    }

    #[test]
    fn refuses_what_it_has_no_kernels_for() {
        let c = SglangConfig::hopper(2, 66).unwrap();
        for (slabs, rank) in [(vec![1u64; 9], 0), (vec![1; 2], 2), (vec![1; 1], 0)] {
            // SAFETY: refused before any pointer is used.
            let e = unsafe { Sglang::new(&slabs, 0, rank, c, 1024, 1024) }
                .err()
                .unwrap();
            assert!(
                e.contains("2 to 8") || e.contains("fetch.sh"),
                "{}: {e}",
                slabs.len()
            );
        }
    }

    /// The restated Hopper table against the fetched file itself (configs/custom_all_reduce_v2.py
    /// in .peers/, from scripts/peers/fetch.sh), so a new pin that retunes it fails here.
    #[test]
    fn hopper_table_matches_the_fetched_config_file() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../.peers/sglang/configs/custom_all_reduce_v2.py");
        let Ok(text) = std::fs::read_to_string(&path) else {
            eprintln!(
                "skipped: {} not fetched (scripts/peers/fetch.sh)",
                path.display()
            );
            return;
        };
        let sm90 = &text[text.find("def _sm90_configs").expect("the Hopper table")..];
        let sm90 = &sm90[..sm90.find("\n@cache").unwrap_or(sm90.len())];
        // One term of a row: "384.0 * KB", "16.00 * MB" or "0"; a row's trailing Range(a, b).
        let term = |t: &str| -> usize {
            let t = t.trim();
            let (x, unit) = match t.split_once('*') {
                Some((x, u)) => (x.trim(), if u.trim() == "MB" { MB } else { KB }),
                None => (t, 1),
            };
            (x.parse::<f64>().unwrap() * unit as f64) as usize
        };
        let row = |line: &str| -> SglangHeuristic {
            let inner = &line[line.find('(').unwrap() + 1..line.rfind(')').unwrap()];
            let (plain, mc) = match inner.find("Range(") {
                Some(i) => {
                    let r = &inner[i + 6..inner.rfind(')').unwrap()];
                    let (a, b) = r.split_once(',').unwrap();
                    (&inner[..i], (term(a), term(b)))
                }
                None => (inner, (0, 0)),
            };
            let v: Vec<usize> = plain
                .split(',')
                .filter(|t| !t.trim().is_empty())
                .map(term)
                .collect();
            SglangHeuristic::row(v[0], v[1], v[2], mc)
        };
        let mut worlds = 0;
        for block in sm90.split("config(\n").skip(1) {
            let world: usize = block.split(',').next().unwrap().trim().parse().unwrap();
            let line = |key: &str| block.lines().find(|l| l.trim().starts_with(key)).unwrap();
            let ours = SglangConfig::hopper(world, 132).unwrap();
            assert_eq!(ours.graph, row(line("graph=")), "{world} ranks, graphs");
            assert_eq!(ours.eager, row(line("eager=")), "{world} ranks, eager");
            worlds += 1;
        }
        assert_eq!(worlds, 7, "the table's rows: 2 to 8 ranks");
        assert!(sm90.contains("num_pull_blocks=64"));
        assert!(sm90.contains("num_mc_blocks=None if world_size < 4 else 128 // world_size"));
    }
}
