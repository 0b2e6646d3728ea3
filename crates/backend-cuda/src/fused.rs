//! The fused all-reduce + residual + RMSNorm (+ FP8) on CUDA: Lamport workspaces for a group,
//! launches of the kernels in `kernels-cuda/fused.cu` (bodies in
//! `kernels-common/include/allreduce/fused.h`, whose `FusedArgs` and `BlockState` are
//! mirrored here), and the unfused baseline's residual + RMSNorm kernel for tests and the
//! bench.
//!
//! Each rank allocates three Lamport buffers of `world + 1` slots of `max_tokens x hidden`
//! elements, pre-filled with -0.0, and 1 KiB of per-block call state (zeroed). The group's
//! existing workspaces provide the abort word, and its Controls the error reports, so a
//! poll that times out shows up in `Communicator::synchronize` like any other timeout.

use std::sync::Arc;

use allreduce_core::fused::FLAG_BYTES;
use allreduce_core::{
    DType, Error, FusedCall, FusedComm, FusedConfig, FusedMetadata, FusionPattern, Result, Strategy,
};
use cudarc::driver::sys;

use crate::abi::{MAX_WORLD, THREADS};
use crate::runtime::CudaRuntime;

/// The group the fused workspaces belong to.
type GroupHandle = allreduce_core::gpu::GroupView<CudaRuntime>;
use crate::driver::{self, check, CUfunction, DeviceMem, Module};

static FUSED_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fused.fatbin"));

/// `ar::fused::FusedArgs`. Null (0) output pointers are outputs not asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FusedArgs {
    input: u64,
    allreduce_out: u64,
    residual_in: u64,
    residual_out: u64,
    norm_out: u64,
    quant_out: u64,
    scale_out: u64,
    gamma: u64,
    lamport: [u64; MAX_WORLD],
    ws: [u64; MAX_WORLD],
    state: u64,
    control: u64,
    comm_bytes: u64,
    max_elems: u64,
    timeout_ns: u64,
    tokens: u32,
    hidden: u32,
    rank: u32,
    world: u32,
    pattern: u32,
    eps: f32,
}

const _: () = assert!(size_of::<FusedArgs>() == 256);
const _: () = assert!(std::mem::offset_of!(FusedArgs, lamport) == 64);
const _: () = assert!(std::mem::offset_of!(FusedArgs, ws) == 128);
const _: () = assert!(std::mem::offset_of!(FusedArgs, state) == 192);
const _: () = assert!(std::mem::offset_of!(FusedArgs, comm_bytes) == 208);
const _: () = assert!(std::mem::offset_of!(FusedArgs, tokens) == 232);
const _: () = assert!(std::mem::offset_of!(FusedArgs, pattern) == 248);
// `ar::fused::BlockState` is 16 bytes, one per block of at most 64.
const _: () = assert!(FLAG_BYTES == crate::abi::MAX_BLOCKS * 16);

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// The fused fatbin's kernels on one device.
struct Kernels {
    oneshot: [CUfunction; 3],
    twoshot: [CUfunction; 3],
    norm: [CUfunction; 3],
    _module: Module,
}

// SAFETY: CUfunction handles may be used from any thread.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Load on the bound device (eagerly: see `Module::function`) the instances for groups of
    /// `world` ranks: specialised for 2, 4 and 8, generic otherwise.
    fn load(world: usize) -> Result<Self> {
        let module = Module::load(FUSED_FATBIN)?;
        let w = if matches!(world, 2 | 4 | 8) { world } else { 0 };
        let set = |prefix: &str, tail: &str| -> Result<[CUfunction; 3]> {
            let f = |dtype: &str| {
                let name =
                    std::ffi::CString::new(format!("{prefix}_{dtype}{tail}")).expect("no NUL");
                module.function(&name)
            };
            Ok([f("f32")?, f("f16")?, f("bf16")?])
        };
        let tail = format!("_w{w}");
        Ok(Kernels {
            oneshot: set("ar_fused_oneshot", &tail)?,
            twoshot: set("ar_fused_twoshot", &tail)?,
            norm: set("ar_rmsnorm", "")?,
            _module: module,
        })
    }
}

/// What every rank's workspace shares: the group, the per-rank allocations, the kernels.
struct Shared {
    group: GroupHandle,
    /// Blocks per launch, the same on every rank (see `fused_grid`).
    grid: u32,
    meta: Vec<FusedMetadata>,
    lamport: Vec<DeviceMem>,
    state: Vec<DeviceMem>,
    /// Per rank (kernels loaded once per rank's device; ranks on one GPU share a load
    /// through the Arc).
    kernels: Vec<Arc<Kernels>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Free each allocation with its own device's context current.
        while let Some(lamport) = self.lamport.pop() {
            let _ = self.group.device(self.lamport.len()).bind();
            drop(lamport);
            self.state.pop();
        }
    }
}

/// One rank's fused workspace on CUDA.
pub struct CudaFused {
    rank: usize,
    shared: Arc<Shared>,
}

/// Allocate and fill every rank's workspace, load the kernels, and run each once per rank
/// with nothing to move (see `Group::warm_up` in comm.rs: a first launch may wait for the
/// whole device, which must not happen while a peer polls). Call it while no collective of
/// the group is in flight.
pub(crate) fn create_group(
    group: GroupHandle,
    config: &FusedConfig,
) -> Result<Vec<Box<dyn FusedComm>>> {
    config.validate()?;
    let world = group.world();
    let meta: Vec<FusedMetadata> = (0..world)
        .map(|r| FusedMetadata::new(config, r, world))
        .collect();
    let mut lamport = Vec::with_capacity(world);
    let mut state = Vec::with_capacity(world);
    let mut kernels: Vec<Arc<Kernels>> = Vec::with_capacity(world);
    let mut loaded: Vec<(u32, Arc<Kernels>)> = Vec::new();
    for m in &meta {
        let dev = group.device(m.rank);
        dev.bind()?;
        let lam = DeviceMem::alloc(m.lamport_buffer_size)?;
        fill_sentinel(&lam, config.lamport_elem())?;
        lamport.push(lam);
        state.push(DeviceMem::zeroed(m.flag_size)?);
        let k = match loaded.iter().find(|(o, _)| *o == dev.ordinal) {
            Some((_, k)) => k.clone(),
            None => {
                let k = Arc::new(Kernels::load(world)?);
                loaded.push((dev.ordinal, k.clone()));
                k
            }
        };
        kernels.push(k);
    }
    tracing::debug!(
        world,
        max_tokens = config.max_tokens,
        hidden = config.hidden,
        dtype = %config.dtype,
        bytes_per_rank = meta[0].buffer_size,
        grid = fused_grid(&group),
        "cuda fused workspace"
    );
    let grid = fused_grid(&group);
    let shared = Arc::new(Shared {
        grid,
        group,
        meta,
        lamport,
        state,
        kernels,
    });
    warm_up(&shared, config.dtype)?;
    Ok((0..world)
        .map(|rank| {
            Box::new(CudaFused {
                rank,
                shared: shared.clone(),
            }) as Box<dyn FusedComm>
        })
        .collect())
}

/// Blocks per fused launch: one per SM for each rank of the busiest GPU, at most 64 (the
/// per-block state's size). More than the exact kernels' 36 when few ranks share a GPU: the
/// fused kernels' phases are latency-bound loops, so more threads means more loads in flight.
/// Every rank's grid still co-resides with room to spare (the kernels fit two blocks per SM,
/// and all ranks of a GPU together ask for at most one per SM), which the polls need.
fn fused_grid(group: &GroupHandle) -> u32 {
    let world = group.world();
    let busiest = (0..world)
        .map(|r| {
            let o = group.device(r).ordinal;
            (0..world).filter(|&q| group.device(q).ordinal == o).count()
        })
        .max()
        .unwrap_or(1) as u32;
    let sms = (0..world)
        .map(|r| group.device(r).sm_count)
        .min()
        .unwrap_or(1);
    (sms / busiest).clamp(1, crate::abi::MAX_BLOCKS as u32)
}

/// -0.0 in every element (the Lamport "not written yet"), and wait for it.
fn fill_sentinel(m: &DeviceMem, elem: usize) -> Result<()> {
    // SAFETY: the allocation holds `m.bytes`, a multiple of the element size.
    unsafe {
        if elem == 4 {
            check(
                sys::cuMemsetD32_v2(m.ptr, 0x8000_0000, m.bytes / 4),
                "cuMemsetD32",
            )?;
        } else {
            check(
                sys::cuMemsetD16_v2(m.ptr, 0x8000, m.bytes / 2),
                "cuMemsetD16",
            )?;
        }
    }
    driver::context_synchronize()
}

fn warm_up(s: &Shared, dtype: DType) -> Result<()> {
    let d = dtype_index(dtype);
    for rank in 0..s.meta.len() {
        let mut args = s.args(rank, 0, s.meta[rank].hidden, FusionPattern::AllReduce, 0.0);
        // World 1, no rows: each kernel touches only this rank's state, and every rank's call
        // count advances by the same two.
        args.lamport = [0; MAX_WORLD];
        args.lamport[0] = s.lamport[rank].ptr;
        args.ws = [0; MAX_WORLD];
        args.ws[0] = s.group.workspaces()[rank];
        args.rank = 0;
        args.world = 1;
        s.group.device(rank).bind()?;
        let k = &s.kernels[rank];
        for f in [k.oneshot[d], k.twoshot[d], k.norm[d]] {
            // SAFETY: tokens = 0 and world = 1: only this rank's state is touched.
            unsafe { driver::launch(f, s.grid, THREADS, std::ptr::null_mut(), &args)? };
        }
    }
    for rank in 0..s.meta.len() {
        s.group.device(rank).bind()?;
        driver::context_synchronize()?;
    }
    Ok(())
}

impl Shared {
    /// Launch arguments of `rank` with no buffers.
    fn args(
        &self,
        rank: usize,
        tokens: usize,
        hidden: usize,
        pattern: FusionPattern,
        eps: f32,
    ) -> FusedArgs {
        let m = &self.meta[rank];
        let mut lamport = [0u64; MAX_WORLD];
        for (r, l) in self.lamport.iter().enumerate() {
            lamport[r] = l.ptr;
        }
        FusedArgs {
            input: 0,
            allreduce_out: 0,
            residual_in: 0,
            residual_out: 0,
            norm_out: 0,
            quant_out: 0,
            scale_out: 0,
            gamma: 0,
            lamport,
            ws: self.group.workspaces(),
            state: self.state[rank].ptr,
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
        }
    }
}

fn addr(b: Option<allreduce_core::RawBuffer>) -> u64 {
    b.map_or(0, |b| b.addr as u64)
}

impl FusedComm for CudaFused {
    fn metadata(&self) -> &FusedMetadata {
        &self.shared.meta[self.rank]
    }

    fn run(&self, call: &FusedCall) -> Result<()> {
        let s = &*self.shared;
        if let Some(reason) = s.group.aborted() {
            return Err(Error::Aborted { reason });
        }
        let k = &s.kernels[self.rank];
        let d = dtype_index(call.dtype);
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
        args.scale_out = addr(call.scale_out);
        args.gamma = addr(call.gamma);
        s.group.device(self.rank).bind()?;
        // SAFETY: FusedArgs mirrors the kernel's parameter; the workspaces live as long as
        // `shared`, and `prepare_fused` validated the caller's buffers (device, sizes,
        // alignment, overlap).
        unsafe { driver::launch(f, s.grid, THREADS, call.stream.as_raw() as _, &args) }
    }
}

/// The unfused baseline's second kernel (residual add + RMSNorm, + FP8 codes), for tests and
/// the bench: what a model runs after a plain all-reduce. Loaded on the bound device.
pub struct RmsNormKernel {
    kernels: Kernels,
}

// SAFETY: only CUfunction handles and a module, usable from any thread.
unsafe impl Send for RmsNormKernel {}

/// Buffers of one `RmsNormKernel` launch (device addresses; 0 for outputs not wanted).
#[derive(Clone, Copy, Debug, Default)]
pub struct NormBuffers {
    pub input: u64,
    pub residual_in: u64,
    pub residual_out: u64,
    pub norm_out: u64,
    pub quant_out: u64,
    pub scale_out: u64,
    pub gamma: u64,
}

impl RmsNormKernel {
    pub fn load() -> Result<Self> {
        Ok(RmsNormKernel {
            kernels: Kernels::load(0)?,
        })
    }

    /// `norm_out = RMSNorm(residual_out = input + residual_in) * gamma` per row, one block of
    /// 512 threads per row up to `max_grid` blocks.
    ///
    /// # Safety
    /// Every non-zero address must hold `tokens x hidden` elements of `dtype` (gamma:
    /// `hidden`; quant_out: bytes; scale_out: `tokens` f32), 16-byte aligned, valid until the
    /// kernel has run on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        dtype: DType,
        pattern: FusionPattern,
        bufs: &NormBuffers,
        tokens: usize,
        hidden: usize,
        eps: f32,
        max_grid: u32,
        stream: allreduce_core::Stream,
    ) -> Result<()> {
        if hidden % (16 / dtype.size()) != 0
            || hidden * dtype.size() > allreduce_core::fused::MAX_HIDDEN_BYTES
        {
            return Err(Error::InvalidArgument(format!(
                "hidden {hidden} {dtype} is not a whole number of 16-byte vectors of at most \
                 {} bytes",
                allreduce_core::fused::MAX_HIDDEN_BYTES
            )));
        }
        let args = FusedArgs {
            input: bufs.input,
            allreduce_out: 0,
            residual_in: bufs.residual_in,
            residual_out: bufs.residual_out,
            norm_out: bufs.norm_out,
            quant_out: bufs.quant_out,
            scale_out: bufs.scale_out,
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
        };
        let grid = (tokens as u32).clamp(1, max_grid.max(1));
        driver::launch(
            self.kernels.norm[dtype_index(dtype)],
            grid,
            THREADS,
            stream.as_raw() as _,
            &args,
        )
    }
}
