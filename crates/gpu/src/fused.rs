//! The fused all-reduce + residual + RMSNorm (+ FP8) over any [`GpuRuntime`]: Lamport
//! workspaces for a group, launches of the kernels in `kernels-cuda/fused.cu` and
//! `kernels-hip/fused.hip` (bodies in `kernels-common/include/allreduce/fused.h`, whose
//! `FusedKernelArgs` is [`abi::FusedKernelArgs`]), and the unfused baseline's residual + RMSNorm kernel
//! for tests and the bench. A runtime provides the fused module
//! ([`GpuRuntime::load_fused_module`]) and sentinel-filled memory
//! ([`GpuRuntime::alloc_filled`]), and opts in through [`GpuRuntime::create_fused_group`].
//!
//! Each rank allocates three Lamport buffers of `world + 1` slots of `max_tokens x hidden`
//! elements plus the call tags, pre-filled with -0.0, and 1 KiB of per-block call state
//! (zeroed). The group's existing workspaces provide the abort word, and its Controls the
//! error reports, so a poll that times out shows up in `Communicator::synchronize` like any
//! other timeout; a fused call the ranks disagreed on shows up there as a `RankMismatch` that
//! leaves the group usable (`ERROR_FUSED_MISMATCH`).

use std::sync::Arc;

use crate::abi::{FusedKernelArgs, MAX_WORLD, THREADS};
use crate::kernels::Kernel;
use crate::{Fill, GpuRuntime, GroupView};
use allreduce_core::fused::{MAX_BLOCKS, REJECTED_PATTERN_CODE};
use allreduce_core::{
    DType, Error, FusedCall, FusedComm, FusedConfig, FusedMetadata, FusedPattern, Result, Rule,
    SelectionTable, Strategy, Stream,
};

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// The kernels of the fused module for groups of `world` ranks: one-shot, two-shot and the
/// unfused norm, each for f32, f16 and bf16. A world the module has no instance for
/// (`R::FUSED_WORLDS`) uses the generic one (`_w0`), which reads the world from its arguments.
fn kernel_set<R: GpuRuntime>(world: usize) -> [[Kernel; 3]; 3] {
    let w = instance_world::<R>(world);
    [
        DType::ALL.map(|d| Kernel::FusedOneShot(d, w)),
        DType::ALL.map(|d| Kernel::FusedTwoShot(d, w)),
        DType::ALL.map(Kernel::RmsNorm),
    ]
}

/// The names of [`kernel_set`]'s kernels, as the module exports them.
pub fn kernel_names<R: GpuRuntime>(world: usize) -> [[String; 3]; 3] {
    kernel_set::<R>(world).map(|set| set.map(Kernel::name))
}

/// The world a kernel instance is compiled for: `world` where the module specialises it
/// (`R::FUSED_WORLDS`), else 0, the generic instance.
fn instance_world<R: GpuRuntime>(world: usize) -> usize {
    if R::FUSED_WORLDS.contains(&world) {
        world
    } else {
        0
    }
}

/// The split one-shot (`oneshot_split` in fused.h: a row shared by the blocks of a cluster),
/// f32, f16, bf16; CUDA only.
fn split_kernel_set<R: GpuRuntime>(world: usize) -> [Kernel; 3] {
    let w = instance_world::<R>(world);
    DType::ALL.map(|d| Kernel::FusedOneShotSplit(d, w))
}

/// The names of [`split_kernel_set`]'s kernels.
pub fn split_kernel_names<R: GpuRuntime>(world: usize) -> [String; 3] {
    split_kernel_set::<R>(world).map(Kernel::name)
}

/// The fused module's kernels on one device.
struct Kernels<R: GpuRuntime> {
    oneshot: [R::Function; 3],
    twoshot: [R::Function; 3],
    norm: [R::Function; 3],
    /// Where the device runs clusters ([`GpuRuntime::has_clusters`]).
    split: Option<[R::Function; 3]>,
    _module: R::Module,
}

impl<R: GpuRuntime> Kernels<R> {
    /// Look up (eagerly: see [`GpuRuntime::function`]) the instances for groups of `world`
    /// ranks in a loaded fused module.
    fn from_module(module: R::Module, world: usize, clusters: bool) -> Result<Self> {
        let [oneshot, twoshot, norm] = kernel_set::<R>(world);
        let set = |kernels: [Kernel; 3]| crate::kernels::functions::<R, 3>(&module, kernels);
        Ok(Kernels {
            oneshot: set(oneshot)?,
            twoshot: set(twoshot)?,
            norm: set(norm)?,
            split: if clusters {
                Some(set(split_kernel_set::<R>(world))?)
            } else {
                None
            },
            _module: module,
        })
    }
}

/// What every rank's workspace shares: the group, the per-rank allocations, the kernels.
struct Shared<R: GpuRuntime> {
    group: GroupView<R>,
    /// Blocks per launch, the same on every rank (see [`fused_grid`]).
    grid: u32,
    meta: Vec<FusedMetadata>,
    lamport: Vec<R::Memory>,
    state: Vec<R::Memory>,
    /// Per rank (kernels loaded once per rank's device; ranks on one GPU share a load
    /// through the Arc).
    kernels: Vec<Arc<Kernels<R>>>,
    /// The largest cluster the one-shot may split a row over ([`split_cluster`]); below 2
    /// where any rank's device has no clusters.
    max_cluster: u32,
    /// Launch with PDL ([`GpuRuntime::launch_dependent`]): [`PDL_ENV`], where every rank's
    /// device has it.
    pdl: bool,
}

impl<R: GpuRuntime> Drop for Shared<R> {
    fn drop(&mut self) {
        for l in &self.lamport {
            self.group.forget_fused(R::memory_addr(l));
        }
        // Free each allocation with its own device current.
        while let Some(lamport) = self.lamport.pop() {
            let _ = R::bind(self.group.device(self.lamport.len()));
            drop(lamport);
            self.state.pop();
        }
    }
}

/// One rank's fused workspace.
pub struct GpuFused<R: GpuRuntime> {
    rank: usize,
    shared: Arc<Shared<R>>,
}

/// The -0.0 that marks a Lamport element "not written yet", as a fill of `elem`-byte words.
pub fn sentinel(elem: usize) -> Fill {
    if elem == 4 {
        Fill::U32(0x8000_0000)
    } else {
        Fill::U16(0x8000)
    }
}

/// Allocate and fill every rank's workspace, load the kernels, and run each once per rank
/// with nothing to move (see `Group::warm_up`: a first launch may wait for the whole device,
/// which must not happen while a peer polls). Call it while no collective of the group is in
/// flight.
pub fn create_group<R: GpuRuntime>(
    group: GroupView<R>,
    config: &FusedConfig,
) -> Result<Vec<Box<dyn FusedComm>>> {
    config.validate()?;
    let world = group.world();
    let grid = grid_setting(&group, config)?;
    let pdl = pdl_setting(config)? && (0..world).all(|r| R::has_pdl(group.device(r)));
    let meta: Vec<FusedMetadata> = (0..world)
        .map(|r| FusedMetadata {
            blocks: grid,
            pdl,
            ..FusedMetadata::new(config, r, world)
        })
        .collect();
    let mut lamport = Vec::with_capacity(world);
    let mut state = Vec::with_capacity(world);
    let mut kernels: Vec<Arc<Kernels<R>>> = Vec::with_capacity(world);
    let mut loaded: Vec<(u32, Arc<Kernels<R>>)> = Vec::new();
    for m in &meta {
        let dev = group.device(m.rank);
        R::bind(dev)?;
        lamport.push(R::alloc_filled(
            dev,
            m.lamport_buffer_size,
            sentinel(config.lamport_elem()),
        )?);
        state.push(R::alloc_workspace(dev, m.flag_size)?);
        let ordinal = R::ordinal(dev);
        let k = match loaded.iter().find(|(o, _)| *o == ordinal) {
            Some((_, k)) => k.clone(),
            None => {
                let k = Arc::new(Kernels::from_module(
                    R::load_fused_module(dev)?,
                    world,
                    R::has_clusters(dev),
                )?);
                loaded.push((ordinal, k.clone()));
                k
            }
        };
        kernels.push(k);
    }
    let max_cluster = if kernels.iter().all(|k| k.split.is_some()) {
        max_cluster_setting()?
    } else {
        1
    };
    tracing::debug!(
        backend = R::NAME,
        world,
        max_tokens = config.max_tokens,
        hidden = config.hidden,
        dtype = %config.dtype,
        bytes_per_rank = meta[0].buffer_size,
        grid,
        max_cluster,
        pdl,
        "fused workspace"
    );
    let shared = Arc::new(Shared {
        grid,
        max_cluster,
        pdl,
        group,
        meta,
        lamport,
        state,
        kernels,
    });
    warm_up(&shared, config.dtype)?;
    Ok((0..world)
        .map(|rank| {
            Box::new(GpuFused {
                rank,
                shared: shared.clone(),
            }) as Box<dyn FusedComm>
        })
        .collect())
}

/// Blocks per fused launch: one per SM (CU) for each rank of the busiest GPU, at most 64 (the
/// per-block state's size). More than the exact kernels' 36 when few ranks share a GPU: the
/// fused kernels' phases are latency-bound loops, so more threads means more loads in flight.
/// Every rank's grid still co-resides with room to spare (the kernels fit two 512-thread
/// blocks per SM, and per CU on wave64 AMD, where fused.hip asks for it through
/// `amdgpu_waves_per_eu`; all ranks of a GPU together ask for at most one per SM/CU), which
/// the polls need.
pub fn fused_grid<R: GpuRuntime>(group: &GroupView<R>) -> u32 {
    let (busiest, sms) = ranks_and_sms(group);
    let g = (sms / busiest).clamp(1, MAX_BLOCKS);
    // A multiple of 8 where it can be, so that clusters of up to 8 blocks tile it
    // (split_cluster).
    if g >= 8 {
        g / 8 * 8
    } else {
        g
    }
}

/// The most ranks on one device of the group, and the fewest SMs (CUs) of its devices.
fn ranks_and_sms<R: GpuRuntime>(group: &GroupView<R>) -> (u32, u32) {
    let world = group.world();
    let busiest = (0..world)
        .map(|r| {
            let o = R::ordinal(group.device(r));
            (0..world)
                .filter(|&q| R::ordinal(group.device(q)) == o)
                .count()
        })
        .max()
        .unwrap_or(1) as u32;
    let sms = (0..world)
        .map(|r| R::compute_units(group.device(r)))
        .min()
        .unwrap_or(1);
    (busiest, sms)
}

/// `ALLREDUCE_FUSED_BLOCKS`: blocks per fused launch where the workspace's config names none
/// ([`FusedConfig::blocks`]), a tuning and comparison knob (the grid that suits 8 virtual
/// ranks on one GPU is not the one that suits 8 GPUs).
pub const BLOCKS_ENV: &str = "ALLREDUCE_FUSED_BLOCKS";

/// The grid: the config's, else [`BLOCKS_ENV`]'s, else [`fused_grid`]'s.
fn grid_setting<R: GpuRuntime>(group: &GroupView<R>, config: &FusedConfig) -> Result<u32> {
    let (busiest, sms) = ranks_and_sms(group);
    match (config.blocks, std::env::var(BLOCKS_ENV)) {
        (Some(b), _) => blocks_setting(&b.to_string(), "blocks", busiest, sms),
        (None, Ok(v)) => blocks_setting(&v, BLOCKS_ENV, busiest, sms),
        (None, Err(_)) => Ok(fused_grid(group)),
    }
}

/// A grid `v` (from `source`) checked for `busiest` ranks on a device of `sms` SMs (CUs): at
/// most [`MAX_BLOCKS`], and at most one block per SM for those ranks together. The launch
/// bounds fit two per SM, but a rank that has finished its fused call may already run the
/// group's next collective (an exact all-reduce: up to one block per SM too) while a peer's
/// fused grid still waits for SMs, and both poll: past one per SM for the fused grids the
/// two no longer co-reside, and the polls time out (H100, 8 ranks at 32 blocks,
/// docs/benchmarks.md).
pub(crate) fn blocks_setting(v: &str, source: &str, busiest: u32, sms: u32) -> Result<u32> {
    let most = MAX_BLOCKS.min(sms / busiest.max(1)).max(1);
    match v.trim().parse::<u32>() {
        Ok(g) if (1..=most).contains(&g) => Ok(g),
        _ => Err(Error::InvalidConfig(format!(
            "fused workspace: {source}={v:?}: want 1 to {most} ({busiest} ranks share a device of {sms} SMs: their fused grids together may take one block per SM, and another collective of the group the other)"
        ))),
    }
}

/// `ALLREDUCE_FUSED_PDL`: where the config names none ([`FusedConfig::pdl`]), 0 for ordinary
/// launches of the fused kernels, 1 (the default) for programmatic dependent launch where
/// every device has it. A comparison knob.
pub const PDL_ENV: &str = "ALLREDUCE_FUSED_PDL";

fn pdl_setting(config: &FusedConfig) -> Result<bool> {
    if let Some(yes) = config.pdl {
        return Ok(yes);
    }
    match std::env::var(PDL_ENV) {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            "0" => Ok(false),
            "1" => Ok(true),
            _ => Err(Error::InvalidConfig(format!(
                "{PDL_ENV}={v:?}: want 0 or 1"
            ))),
        },
    }
}

/// `ALLREDUCE_FUSED_CLUSTER`: the largest cluster (2, 4 or 8 blocks) the fused one-shot may
/// share a row among, 1 for never; 8 when unset. A tuning and comparison knob.
pub const MAX_CLUSTER_ENV: &str = "ALLREDUCE_FUSED_CLUSTER";

fn max_cluster_setting() -> Result<u32> {
    match std::env::var(MAX_CLUSTER_ENV) {
        Err(_) => Ok(8),
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(c @ (1 | 2 | 4 | 8)) => Ok(c),
            _ => Err(Error::InvalidConfig(format!(
                "{MAX_CLUSTER_ENV}={v:?}: want 1, 2, 4 or 8"
            ))),
        },
    }
}

/// The cluster size the one-shot shares each row among (fused.h's `oneshot_split`), or
/// `None` for the one-block one-shot: the largest C <= `max` in 8, 4, 2 that divides the grid,
/// gives every row its own cluster (tokens x C <= grid) and each thread at most one vector
/// (a row's 512-vector slots <= C).
pub fn split_cluster(
    grid: u32,
    max: u32,
    tokens: usize,
    hidden: usize,
    dtype: DType,
) -> Option<u32> {
    let slots = (hidden * dtype.size())
        .div_ceil(16)
        .div_ceil(THREADS as usize);
    [8u32, 4, 2].into_iter().find(|&c| {
        c <= max
            && grid % c == 0
            && tokens >= 1
            && tokens * c as usize <= grid as usize
            && slots <= c as usize
    })
}

fn warm_up<R: GpuRuntime>(s: &Shared<R>, dtype: DType) -> Result<()> {
    let d = dtype_index(dtype);
    for rank in 0..s.meta.len() {
        let mut args = s.args(rank, 0, s.meta[rank].hidden, FusedPattern::AllReduce, 0.0);
        // World 1, no rows: each kernel touches only this rank's state, and every rank's call
        // count advances by the same two (three with the split one-shot).
        args.lamport = [0; MAX_WORLD];
        args.lamport[0] = R::memory_addr(&s.lamport[rank]);
        args.ws = [0; MAX_WORLD];
        args.ws[0] = s.group.workspaces()[rank];
        args.rank = 0;
        args.world = 1;
        R::bind(s.group.device(rank))?;
        let k = &s.kernels[rank];
        for f in [k.oneshot[d], k.twoshot[d], k.norm[d]] {
            // SAFETY: tokens = 0 and world = 1: only this rank's state is touched.
            unsafe { R::launch(f, s.grid, THREADS, Stream::NULL, &args)? };
        }
        if let (Some(split), true) = (&k.split, s.max_cluster >= 2 && s.grid % 2 == 0) {
            // SAFETY: as above; a first cluster launch must not wait while a peer polls.
            unsafe { R::launch_cluster(split[d], s.grid, 2, THREADS, Stream::NULL, &args)? };
        }
    }
    for rank in 0..s.meta.len() {
        R::synchronize_device(s.group.device(rank))?;
    }
    Ok(())
}

impl<R: GpuRuntime> Shared<R> {
    /// Launch arguments of `rank` with no buffers.
    fn args(
        &self,
        rank: usize,
        tokens: usize,
        hidden: usize,
        pattern: FusedPattern,
        eps: f32,
    ) -> FusedKernelArgs {
        let m = &self.meta[rank];
        let mut lamport = [0u64; MAX_WORLD];
        for (r, l) in self.lamport.iter().enumerate() {
            lamport[r] = R::memory_addr(l);
        }
        FusedKernelArgs {
            input: 0,
            allreduce_out: 0,
            residual_in: 0,
            residual_out: 0,
            norm_out: 0,
            quant_out: 0,
            scale: 0,
            gamma: 0,
            lamport,
            ws: self.group.workspaces(),
            state: R::memory_addr(&self.state[rank]),
            control: self.group.control(rank),
            comm_bytes: m.lamport_comm_size as u64,
            max_elems: (m.max_tokens * m.hidden) as u64,
            timeout_ns: self.group.timeout_ns(),
            tokens: tokens as u32,
            hidden: hidden as u32,
            rank: rank as u32,
            world: m.world as u32,
            pattern: pattern.code(),
            eps,
            weight_bias: 0.0,
            tail: 0,
        }
    }
}

fn addr(b: Option<allreduce_core::RawBuffer>) -> u64 {
    b.map_or(0, |b| b.addr as u64)
}

impl<R: GpuRuntime> FusedComm for GpuFused<R> {
    fn metadata(&self) -> &FusedMetadata {
        &self.shared.meta[self.rank]
    }

    /// [`allreduce_core::fused::default_table`] with one rule in front: one-shot as long as its
    /// cluster kernel takes the call (every row its own cluster, [`split_cluster`]), where it
    /// beat the two-shot at every size measured (H200, 2/4/8 virtual ranks: at 8 ranks x
    /// hidden 8192 x 8 tokens, 128 KiB, 17.9 against 19.4 us, beyond the byte rule's 64 KiB).
    fn default_table(&self) -> Option<SelectionTable> {
        let s = &*self.shared;
        let m = &s.meta[self.rank];
        let rows = (1..=s.grid as usize / 2)
            .rev()
            .find(|&t| split_cluster(s.grid, s.max_cluster, t, m.hidden, m.dtype).is_some())?;
        let mut table = allreduce_core::fused::default_table();
        table.rules.insert(
            0,
            Rule {
                world: (m.world, m.world),
                min_bytes: 0,
                max_bytes: rows * m.hidden * m.dtype.size(),
                dtype: None,
                lossy: None,
                codec: None,
                topology: None,
                strategy: Strategy::OneShot,
            },
        );
        Some(table)
    }

    fn run(&self, call: &FusedCall) -> Result<()> {
        let s = &*self.shared;
        if let Some(reason) = s.group.aborted() {
            return Err(Error::Aborted { reason });
        }
        let k = &s.kernels[self.rank];
        let d = dtype_index(call.dtype);
        let split = match (call.strategy, &k.split) {
            (Strategy::OneShot, Some(split)) => {
                split_cluster(s.grid, s.max_cluster, call.tokens, call.hidden, call.dtype)
                    .map(|c| (split[d], c))
            }
            _ => None,
        };
        let f = match call.strategy {
            Strategy::OneShot => k.oneshot[d],
            Strategy::TwoShot => k.twoshot[d],
            other => {
                return Err(Error::StrategyUnavailable {
                    strategy: other,
                    reason: "the fused kernels are oneshot and twoshot".into(),
                })
            }
        };
        let mut args = s.args(self.rank, call.tokens, call.hidden, call.pattern, call.eps);
        args.input = call.input.addr as u64;
        args.allreduce_out = addr(call.allreduce_out);
        args.residual_in = addr(call.residual_in);
        args.residual_out = addr(call.residual_out);
        args.norm_out = addr(call.norm_out);
        args.quant_out = call.quant_out.map_or(0, |(a, _)| a as u64);
        // One field for both: per-token scales out, or the static scale in.
        args.scale = addr(call.scale_out.or(call.scale_in));
        args.gamma = addr(call.gamma);
        args.weight_bias = call.weight_bias;
        s.group
            .note_fused(self.rank, args.lamport[self.rank], args.comm_bytes);
        R::bind(s.group.device(self.rank))?;
        // SAFETY: FusedKernelArgs mirrors the kernel's parameter; the workspaces live as long as
        // `shared`, and `prepare_fused` validated the caller's buffers (device, sizes,
        // alignment, overlap).
        unsafe {
            match split {
                Some((f, c)) if s.pdl => {
                    R::launch_dependent(f, s.grid, c, THREADS, call.stream, &args)
                }
                Some((f, c)) => R::launch_cluster(f, s.grid, c, THREADS, call.stream, &args),
                None if s.pdl => R::launch_dependent(f, s.grid, 1, THREADS, call.stream, &args),
                None => R::launch(f, s.grid, THREADS, call.stream, &args),
            }
        }
    }

    /// Take part in the call with no rows and the refusal's pattern code
    /// ([`REJECTED_PATTERN_CODE`]): its call tag differs from every peer's, so every rank
    /// skips the call as it skips one the ranks disagree on (the workspace stays usable: the
    /// next call refills the skipped call's buffer), and the peers report `PeerRejected` at
    /// `synchronize` with the reason recorded here. The kernel does not record the
    /// disagreement on this rank, whose caller has the error already. Enqueued like a call,
    /// so it is captured into a graph like one.
    fn reject(&self, reason: &Error, stream: Stream) {
        let s = &*self.shared;
        if s.group.aborted().is_some() {
            return;
        }
        s.group.record_refusal(self.rank, reason);
        let m = &s.meta[self.rank];
        let mut args = s.args(self.rank, 0, m.hidden, FusedPattern::AllReduce, 0.0);
        args.pattern = REJECTED_PATTERN_CODE as u32;
        s.group
            .note_fused(self.rank, args.lamport[self.rank], args.comm_bytes);
        let f = s.kernels[self.rank].oneshot[dtype_index(m.dtype)];
        // The caller has its own error; a launch that fails here reaches the peers as a
        // timeout.
        if R::bind(s.group.device(self.rank)).is_ok() {
            // SAFETY: as in `run`; tokens = 0, so the null buffers are never touched.
            let _ = unsafe { R::launch(f, s.grid, THREADS, stream, &args) };
        }
    }
}

/// The unfused baseline's second kernel (residual add + RMSNorm, + FP8 codes), for tests and
/// the bench: what a model runs after a plain all-reduce.
pub struct RmsNormKernel<R: GpuRuntime> {
    kernels: Kernels<R>,
}

/// Buffers of one [`RmsNormKernel`] launch (device addresses; 0 for outputs not wanted).
#[derive(Clone, Copy, Debug, Default)]
pub struct NormBuffers {
    pub input: u64,
    pub residual_in: u64,
    pub residual_out: u64,
    pub norm_out: u64,
    pub quant_out: u64,
    pub scale_out: u64,
    /// The static FP8 scale (one f32), for `ResidualRmsNormFp8Static`.
    pub scale_in: u64,
    pub gamma: u64,
    /// Not a buffer: what is added to gamma (`FusedArgs::weight_bias`).
    pub weight_bias: f32,
}

impl<R: GpuRuntime> RmsNormKernel<R> {
    /// The backend's fused module, loaded on `dev` (bound by the caller): where the launches
    /// will run.
    pub fn load(dev: &R::Device) -> Result<Self> {
        Self::from_module(R::load_fused_module(dev)?)
    }

    /// From a fused module loaded on the device the launches will run on.
    pub fn from_module(module: R::Module) -> Result<Self> {
        Ok(RmsNormKernel {
            kernels: Kernels::from_module(module, 0, false)?,
        })
    }

    /// `norm_out = RMSNorm(residual_out = input + residual_in) * gamma` per row, one block of
    /// 512 threads per row up to `max_grid` blocks, on the current device.
    ///
    /// # Safety
    /// Every non-zero address must hold `tokens x hidden` elements of `dtype` (gamma:
    /// `hidden`; quant_out: bytes; scale_out: `tokens` f32; scale_in: one f32, 4-byte
    /// aligned), 16-byte aligned, valid until the
    /// kernel has run on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        dtype: DType,
        pattern: FusedPattern,
        bufs: &NormBuffers,
        tokens: usize,
        hidden: usize,
        eps: f32,
        max_grid: u32,
        stream: Stream,
    ) -> Result<()> {
        let args = norm_args(dtype, pattern, bufs, tokens, hidden, eps)?;
        let grid = (tokens as u32).clamp(1, max_grid.max(1));
        R::launch(
            self.kernels.norm[dtype_index(dtype)],
            grid,
            THREADS,
            stream,
            &args,
        )
    }
}

/// The argument block of an unfused norm launch, or why the row cannot be one.
pub fn norm_args(
    dtype: DType,
    pattern: FusedPattern,
    bufs: &NormBuffers,
    tokens: usize,
    hidden: usize,
    eps: f32,
) -> Result<FusedKernelArgs> {
    if hidden % (16 / dtype.size()) != 0
        || hidden * dtype.size() > allreduce_core::fused::MAX_HIDDEN_BYTES
    {
        return Err(Error::InvalidArgument(format!(
            "hidden {hidden} {dtype} is not a whole number of 16-byte vectors of at most {} \
             bytes",
            allreduce_core::fused::MAX_HIDDEN_BYTES
        )));
    }
    Ok(FusedKernelArgs {
        input: bufs.input,
        allreduce_out: 0,
        residual_in: bufs.residual_in,
        residual_out: bufs.residual_out,
        norm_out: bufs.norm_out,
        quant_out: bufs.quant_out,
        scale: if pattern == FusedPattern::ResidualRmsNormFp8Static {
            bufs.scale_in
        } else {
            bufs.scale_out
        },
        gamma: bufs.gamma,
        lamport: [0; MAX_WORLD],
        ws: [0; MAX_WORLD],
        state: 0,
        control: 0,
        comm_bytes: 0,
        max_elems: 0,
        timeout_ns: 0,
        tokens: tokens as u32,
        hidden: hidden as u32,
        rank: 0,
        world: 1,
        pattern: pattern.code(),
        eps,
        weight_bias: bufs.weight_bias,
        tail: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_cluster_gives_each_row_its_own_cluster() {
        let bf16 = DType::BF16;
        // 2 ranks on one H200 (64 blocks): hidden 8192 bf16 is two 512-vector slots.
        assert_eq!(split_cluster(64, 8, 1, 8192, bf16), Some(8));
        assert_eq!(split_cluster(64, 8, 8, 8192, bf16), Some(8));
        assert_eq!(split_cluster(64, 8, 9, 8192, bf16), Some(4));
        assert_eq!(split_cluster(64, 8, 32, 8192, bf16), Some(2));
        assert_eq!(split_cluster(64, 8, 33, 8192, bf16), None);
        // The cap, and no rows.
        assert_eq!(split_cluster(64, 4, 1, 8192, bf16), Some(4));
        assert_eq!(split_cluster(64, 1, 1, 8192, bf16), None);
        assert_eq!(split_cluster(64, 8, 0, 8192, bf16), None);
        // f32 hidden 8192 is four slots: a thread holds one vector only with C >= 4.
        assert_eq!(split_cluster(64, 8, 16, 8192, DType::F32), Some(4));
        assert_eq!(split_cluster(64, 8, 17, 8192, DType::F32), None);
        // A grid clusters do not tile.
        assert_eq!(split_cluster(33, 8, 1, 4096, bf16), None);
        assert_eq!(split_cluster(12, 8, 1, 4096, bf16), Some(4));
    }
}
