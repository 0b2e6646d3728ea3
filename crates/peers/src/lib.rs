//! The peers' all-reduce kernels, driven from Rust so the bench can time them beside ours with
//! the same buffers, streams and method.
//!
//! Their code is not in this repository: `scripts/peers/fetch.sh` downloads it, pinned, into
//! `.peers/`, and the build compiles a thin shim of ours (shim/) against it. Without that
//! folder the crate still builds, and every constructor returns an error that says so.
//!
//! - [`Vllm`]: vLLM's custom all-reduce (`vllm::CustomAllreduce`, one-stage and two-stage
//!   kernels, its own switch rule and its 36-block limit), as FlashInfer ships it.
//! - [`Trtllm`]: TensorRT-LLM's all-reduce fusion kernels (Lamport one-shot and two-shot, with
//!   residual + RMSNorm and FP8 output), as FlashInfer ships them, with its own launcher.
//! - [`FlashinferPcie`]: FlashInfer's PCIe IPC all-reduce (`flashinfer::comm::pcie_ipc`), with
//!   the launch its Python layer picks when nothing was tuned ([`PcieLaunch::seed`]).
//! - [`Sglang`]: SGLang's custom all-reduce v2 (Lamport push and barrier pull kernels, one- and
//!   two-shot each), with its Hopper dispatch table ([`SglangConfig`]) and launch
//!   ([`SglangLaunch`]).

use std::ffi::c_void;

use allreduce_core::DType;

mod sglang;
pub use sglang::{
    choose_block_size, sglang_unavailable, two_shot_push_slot_bytes, Sglang, SglangAlgo,
    SglangConfig, SglangHeuristic, SglangLaunch, SGLANG_MAX_SIZE,
};

/// The pinned packages the peers were built from, or `None` when they were not fetched.
pub fn versions() -> Option<&'static str> {
    option_env!("ALLREDUCE_PEERS_VERSIONS")
}

/// Why the peers are unavailable in this build.
pub fn unavailable() -> Option<String> {
    if cfg!(peers_built) {
        None
    } else {
        Some("the peer baselines were not built: run scripts/peers/fetch.sh, then rebuild".into())
    }
}

#[cfg(peers_built)]
mod ffi {
    use std::ffi::c_void;
    extern "C" {
        pub fn peers_vllm_signal_bytes() -> usize;
        pub fn peers_vllm_max_blocks() -> i32;
        pub fn peers_vllm_create(
            signals: *mut *mut c_void,
            rank_data: *mut c_void,
            rank_data_bytes: usize,
            rank: i32,
            world: i32,
            full_nvlink: i32,
            out: *mut *mut c_void,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_vllm_destroy(h: *mut c_void);
        pub fn peers_vllm_register(
            h: *mut c_void,
            ptrs: *mut *mut c_void,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_vllm_register_graph(
            h: *mut c_void,
            ptrs: *mut *mut c_void,
            buffers: i32,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_vllm_all_reduce(
            h: *mut c_void,
            stream: *mut c_void,
            dtype: i32,
            input: *mut c_void,
            output: *mut c_void,
            n: i32,
            block_limit: i32,
            threads: i32,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_vllm_all_reduce_staged(
            h: *mut c_void,
            stream: *mut c_void,
            dtype: i32,
            input: *const c_void,
            staging: *mut c_void,
            output: *mut c_void,
            n: i32,
            block_limit: i32,
            threads: i32,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_pcie_workspace_bytes(
            world: i32,
            max_numel: i64,
            elem: i32,
            max_blocks: i32,
            out: *mut i64,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_pcie_create(
            slabs: *mut *mut c_void,
            world: i32,
            rank: i32,
            max_numel: i64,
            elem: i32,
            max_blocks: i32,
            out: *mut *mut c_void,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_pcie_destroy(h: *mut c_void);
        pub fn peers_pcie_all_reduce(
            h: *mut c_void,
            stream: *mut c_void,
            dtype: i32,
            input: *const c_void,
            output: *mut c_void,
            numel: i64,
            blocks: i32,
            threads: i32,
            variant: i32,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_trtllm_sizes(
            world: i32,
            max_tokens: i32,
            hidden: i32,
            elem: i32,
            comm: *mut usize,
            flags: *mut usize,
            lamport_slot: *mut usize,
        );
        pub fn peers_trtllm_flag_bytes() -> usize;
        pub fn peers_trtllm_table_bytes(world: i32) -> usize;
        pub fn peers_trtllm_set_sm_share(sms: i32, err: *mut u8, len: usize) -> i32;
        pub fn peers_trtllm_init_rank(
            world: i32,
            rank: i32,
            comm: *mut *mut c_void,
            barrier: *mut *mut c_void,
            lamport: *mut *mut c_void,
            flag: *mut c_void,
            table: *mut c_void,
            comm_bytes: usize,
            flag_bytes: usize,
            lamport_slot: usize,
            elem: i32,
            stream: *mut c_void,
            err: *mut u8,
            len: usize,
        ) -> i32;
        pub fn peers_trtllm_fusion(
            table: *mut c_void,
            world: i32,
            rank: i32,
            stream: *mut c_void,
            dtype: i32,
            pattern: i32,
            tokens: i32,
            hidden: i32,
            input: *mut c_void,
            residual_in: *mut c_void,
            residual_out: *mut c_void,
            norm_out: *mut c_void,
            quant_out: *mut c_void,
            scale_out: *mut c_void,
            gamma: *mut c_void,
            eps: f32,
            scale_factor: *mut c_void,
            oneshot: i32,
            pdl: i32,
            err: *mut u8,
            len: usize,
        ) -> i32;
    }
}

/// Runs a shim call with a message buffer; its -1 becomes the message.
#[cfg(peers_built)]
fn call(what: &str, f: impl FnOnce(*mut u8, usize) -> i32) -> Result<(), String> {
    let mut err = [0u8; 512];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    Err(format!(
        "{what}: {}",
        String::from_utf8_lossy(&err[..end]).trim()
    ))
}

fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// One rank of vLLM's custom all-reduce.
///
/// Memory is the caller's, as in vLLM: a zeroed meta buffer per rank ([`Vllm::meta_bytes`]:
/// the signal block, then the two-stage kernel's scratch), a device buffer for the registered
/// pointer tables, and inputs registered with every rank's copy before they are used.
pub struct Vllm {
    #[cfg_attr(not(peers_built), allow(dead_code))]
    handle: *mut c_void,
    world: usize,
}

// SAFETY: the handle is used by one rank's thread at a time (the bench's contract); the C++
// object holds only host maps and device pointers.
unsafe impl Send for Vllm {}

impl Vllm {
    /// Threads per block vLLM launches with, and its block-count cap (36).
    pub const THREADS: u32 = 512;

    pub fn max_blocks() -> u32 {
        #[cfg(peers_built)]
        // SAFETY: a constant.
        return unsafe { ffi::peers_vllm_max_blocks() } as u32;
        #[cfg(not(peers_built))]
        36
    }

    /// Bytes of one rank's meta buffer for inputs of up to `max_bytes`.
    pub fn meta_bytes(max_bytes: usize) -> usize {
        #[cfg(peers_built)]
        // SAFETY: a constant.
        let signal = unsafe { ffi::peers_vllm_signal_bytes() };
        #[cfg(not(peers_built))]
        let signal = 0;
        signal + max_bytes
    }

    /// Rank `rank` of `world` (2, 4, 6 or 8: vLLM's instances) over every rank's meta buffer.
    ///
    /// # Safety
    /// `meta[r]` are zeroed device buffers of [`Vllm::meta_bytes`] that live as long as the
    /// communicator; `rank_data` is device memory of `rank_data_bytes`, also that long.
    pub unsafe fn new(
        meta: &[u64],
        rank_data: u64,
        rank_data_bytes: usize,
        rank: usize,
        full_nvlink: bool,
    ) -> Result<Self, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        if !matches!(meta.len(), 2 | 4 | 6 | 8) || rank >= meta.len() {
            return Err(format!(
                "vLLM's custom all-reduce runs 2, 4, 6 or 8 ranks; rank {rank} of {} asked",
                meta.len()
            ));
        }
        #[cfg(peers_built)]
        {
            let mut ptrs: Vec<*mut c_void> = meta.iter().map(|&p| p as *mut c_void).collect();
            let mut handle = std::ptr::null_mut();
            call("vllm::CustomAllreduce", |e, l| {
                ffi::peers_vllm_create(
                    ptrs.as_mut_ptr(),
                    rank_data as *mut c_void,
                    rank_data_bytes,
                    rank as i32,
                    meta.len() as i32,
                    i32::from(full_nvlink),
                    &mut handle,
                    e,
                    l,
                )
            })?;
            return Ok(Vllm {
                handle,
                world: meta.len(),
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (rank_data, rank_data_bytes, full_nvlink);
            unreachable!("unavailable() covers builds without the shim")
        }
    }

    /// Registers one input buffer: `ptrs[r]` is rank r's copy (vLLM's `register_buffer`).
    ///
    /// # Safety
    /// The buffers are device memory that outlives the calls that use them.
    pub unsafe fn register(&self, ptrs: &[u64]) -> Result<(), String> {
        self.check_len(ptrs.len(), 1)?;
        #[cfg(peers_built)]
        {
            let mut p: Vec<*mut c_void> = ptrs.iter().map(|&x| x as *mut c_void).collect();
            return call("register_buffer", |e, l| {
                ffi::peers_vllm_register(self.handle, p.as_mut_ptr(), e, l)
            });
        }
        #[allow(unreachable_code)]
        Ok(())
    }

    /// After a graph capture: every rank's copy of each captured input, in call order
    /// (`ptrs[i * world + r]`), as vLLM's `register_graph_buffers` fills them.
    ///
    /// # Safety
    /// As [`Vllm::register`].
    pub unsafe fn register_graph(&self, ptrs: &[u64]) -> Result<(), String> {
        let buffers = ptrs.len() / self.world.max(1);
        self.check_len(ptrs.len(), buffers)?;
        #[cfg(peers_built)]
        {
            let mut p: Vec<*mut c_void> = ptrs.iter().map(|&x| x as *mut c_void).collect();
            return call("register_graph_buffers", |e, l| {
                ffi::peers_vllm_register_graph(self.handle, p.as_mut_ptr(), buffers as i32, e, l)
            });
        }
        #[allow(unreachable_code)]
        Ok(())
    }

    /// Enqueues an all-reduce of `n` elements of the registered `input` into `output` on
    /// `stream` (a `CUstream`), with vLLM's own choice of kernel. With `staging`, vLLM's eager
    /// path instead: `input` is any buffer, copied into the registered `staging` first.
    ///
    /// # Safety
    /// `input`/`staging`/`output` are device buffers of `n` elements of `dtype` on the
    /// current device; every rank makes the same calls.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce(
        &self,
        stream: u64,
        dtype: DType,
        input: u64,
        staging: Option<u64>,
        output: u64,
        n: usize,
        block_limit: u32,
    ) -> Result<(), String> {
        let n = i32::try_from(n).map_err(|_| format!("{n} elements: vLLM counts in int"))?;
        let d = dtype_code(dtype);
        #[cfg(peers_built)]
        {
            let (s, o) = (stream as *mut c_void, output as *mut c_void);
            let (b, t) = (block_limit as i32, Self::THREADS as i32);
            return call("vllm all_reduce", |e, l| match staging {
                None => ffi::peers_vllm_all_reduce(
                    self.handle,
                    s,
                    d,
                    input as *mut c_void,
                    o,
                    n,
                    b,
                    t,
                    e,
                    l,
                ),
                Some(st) => ffi::peers_vllm_all_reduce_staged(
                    self.handle,
                    s,
                    d,
                    input as *const c_void,
                    st as *mut c_void,
                    o,
                    n,
                    b,
                    t,
                    e,
                    l,
                ),
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (stream, input, staging, output, n, block_limit, d);
            Err(unavailable().unwrap_or_default())
        }
    }

    fn check_len(&self, got: usize, buffers: usize) -> Result<(), String> {
        if buffers == 0 || got != buffers * self.world {
            return Err(format!(
                "{got} pointers for {} ranks: want one per rank per buffer",
                self.world
            ));
        }
        Ok(())
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        #[cfg(peers_built)]
        // SAFETY: created by peers_vllm_create, dropped once.
        unsafe {
            ffi::peers_vllm_destroy(self.handle)
        };
    }
}

/// TensorRT-LLM's fusion patterns the bench runs (FlashInfer's `AllReduceFusionPattern`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrtllmPattern {
    /// The all-reduce alone (`kAllReduce`).
    AllReduce,
    /// + residual + RMSNorm, writing the new residual and the norm (`kARResidualRMSNorm`).
    ResidualRmsNorm,
    /// + residual + RMSNorm + FP8 with one static scale (`kARResidualRMSNormFP8Quant`).
    ResidualRmsNormFp8Static,
    /// + residual + RMSNorm + FP8 with per-token scales (`kARResidualRMSNormDynamicFP8Quant`).
    ResidualRmsNormFp8PerToken,
}

impl TrtllmPattern {
    #[cfg_attr(not(peers_built), allow(dead_code))]
    fn code(self) -> i32 {
        match self {
            TrtllmPattern::AllReduce => 0,
            TrtllmPattern::ResidualRmsNorm => 1,
            TrtllmPattern::ResidualRmsNormFp8Static => 2,
            TrtllmPattern::ResidualRmsNormFp8PerToken => 10,
        }
    }
}

/// Bytes of one rank's part of TensorRT-LLM's fusion workspace, as FlashInfer sizes it.
#[derive(Clone, Copy, Debug)]
pub struct TrtllmSizes {
    /// The two-shot kernel's buffer.
    pub comm: usize,
    /// The two-shot kernel's barrier flags.
    pub flags: usize,
    /// One of the three Lamport slots (the Lamport buffer holds three).
    pub lamport_slot: usize,
    /// The int[5] flag block.
    pub flag_block: usize,
    /// The pointer table (3 x world + 1 pointers).
    pub table: usize,
}

/// Device addresses of one fused call's buffers (0: not used by the pattern).
#[derive(Clone, Copy, Debug, Default)]
pub struct TrtllmBufs {
    pub input: u64,
    pub residual_in: u64,
    pub residual_out: u64,
    pub norm_out: u64,
    pub quant_out: u64,
    /// Per-token f32 scales written (per-token FP8).
    pub scale_out: u64,
    pub gamma: u64,
    /// The static f32 scale read (static FP8): codes are value / scale.
    pub scale_in: u64,
}

/// One rank of TensorRT-LLM's all-reduce fusion (`allreduce_fusion_kernel_launcher`: its own
/// grid, block and cluster choice, with programmatic dependent launch where asked).
///
/// Memory is the caller's, as in FlashInfer's Python layer: per rank a two-shot buffer,
/// barrier flags and a three-slot Lamport buffer that every rank can write, plus this rank's
/// flag block and pointer table ([`Trtllm::sizes`]).
pub struct Trtllm {
    #[cfg_attr(not(peers_built), allow(dead_code))]
    table: u64,
    world: usize,
    #[cfg_attr(not(peers_built), allow(dead_code))]
    rank: usize,
}

impl Trtllm {
    /// Token counts up to this run the Lamport one-shot kernel in TensorRT-LLM's own rule
    /// (`kOneShotMaxToken`); the two-shot kernel needs at least one token per rank.
    pub const ONESHOT_MAX_TOKENS: usize = 128;

    /// The workspace of one rank for up to `max_tokens` x `hidden` elements of `dtype`.
    pub fn sizes(world: usize, max_tokens: usize, hidden: usize, dtype: DType) -> TrtllmSizes {
        #[cfg(peers_built)]
        {
            let (mut comm, mut flags, mut slot) = (0, 0, 0);
            // SAFETY: plain arithmetic into three locals.
            unsafe {
                ffi::peers_trtllm_sizes(
                    world as i32,
                    max_tokens as i32,
                    hidden as i32,
                    dtype.size() as i32,
                    &mut comm,
                    &mut flags,
                    &mut slot,
                );
                return TrtllmSizes {
                    comm,
                    flags,
                    lamport_slot: slot,
                    flag_block: ffi::peers_trtllm_flag_bytes(),
                    table: ffi::peers_trtllm_table_bytes(world as i32),
                };
            }
        }
        #[allow(unreachable_code)]
        let msg = max_tokens * hidden * dtype.size();
        #[allow(unreachable_code)]
        TrtllmSizes {
            comm: world * msg,
            flags: world * 256 * 4,
            lamport_slot: world * msg,
            flag_block: 20,
            table: (3 * world + 1) * 8,
        }
    }

    /// The SM count TensorRT-LLM's launcher sizes its grids by (every rank's grid must
    /// co-reside on virtual ranks: give it the share ours gets). One value per process: the
    /// launcher caches what it read first.
    pub fn set_sm_share(sms: u32) -> Result<(), String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        #[cfg(peers_built)]
        // SAFETY: sets a process-wide int.
        return call("sm share", |e, l| unsafe {
            ffi::peers_trtllm_set_sm_share(sms as i32, e, l)
        });
        #[allow(unreachable_code)]
        {
            let _ = sms;
            Ok(())
        }
    }

    /// Rank `rank` of `comm.len()` (2, 4 or 8): lays out and fills this rank's part of the
    /// workspace on `stream` (a `CUstream`) and waits for it.
    ///
    /// # Safety
    /// `comm[r]`, `barrier[r]`, `lamport[r]` are every rank's device buffers of
    /// `sizes.comm`, `sizes.flags` and 3 x `sizes.lamport_slot` bytes; `flag` and `table` are
    /// this rank's, of `sizes.flag_block` and `sizes.table` bytes; all outlive the calls.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        rank: usize,
        comm: &[u64],
        barrier: &[u64],
        lamport: &[u64],
        flag: u64,
        table: u64,
        sizes: &TrtllmSizes,
        dtype: DType,
        stream: u64,
    ) -> Result<Self, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let world = comm.len();
        if !matches!(world, 2 | 4 | 8) || rank >= world {
            return Err(format!(
                "TensorRT-LLM's fusion kernels run 2, 4 or 8 ranks here; rank {rank} of {world} asked"
            ));
        }
        if barrier.len() != world || lamport.len() != world {
            return Err("one comm, barrier and Lamport buffer per rank".into());
        }
        #[cfg(peers_built)]
        {
            let ptrs = |v: &[u64]| v.iter().map(|&p| p as *mut c_void).collect::<Vec<_>>();
            let (mut c, mut b, mut l) = (ptrs(comm), ptrs(barrier), ptrs(lamport));
            call("TensorRT-LLM workspace", |e, n| {
                ffi::peers_trtllm_init_rank(
                    world as i32,
                    rank as i32,
                    c.as_mut_ptr(),
                    b.as_mut_ptr(),
                    l.as_mut_ptr(),
                    flag as *mut c_void,
                    table as *mut c_void,
                    sizes.comm,
                    sizes.flags,
                    sizes.lamport_slot,
                    dtype.size() as i32,
                    stream as *mut c_void,
                    e,
                    n,
                )
            })?;
        }
        let _ = (flag, sizes, dtype, stream);
        Ok(Trtllm { table, world, rank })
    }

    /// Enqueues one fused call of `tokens` x `hidden` on `stream`: the Lamport one-shot kernel
    /// or the two-shot one, with programmatic dependent launch when `pdl`.
    ///
    /// # Safety
    /// The buffers are device memory of the sizes the pattern reads and writes; every rank
    /// makes the same calls.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fused(
        &self,
        stream: u64,
        dtype: DType,
        pattern: TrtllmPattern,
        tokens: usize,
        hidden: usize,
        bufs: &TrtllmBufs,
        eps: f32,
        oneshot: bool,
        pdl: bool,
    ) -> Result<(), String> {
        if !oneshot && tokens < self.world {
            return Err(format!(
                "the two-shot kernel needs a token per rank: {tokens} tokens, {} ranks",
                self.world
            ));
        }
        tokens
            .checked_mul(hidden)
            .filter(|&n| i32::try_from(n).is_ok())
            .ok_or_else(|| format!("{tokens} x {hidden}: TensorRT-LLM counts in int"))?;
        #[cfg(peers_built)]
        {
            let p = |a: u64| a as *mut c_void;
            return call("trtllm allreduce_fusion", |e, l| {
                ffi::peers_trtllm_fusion(
                    p(self.table),
                    self.world as i32,
                    self.rank as i32,
                    p(stream),
                    dtype_code(dtype),
                    pattern.code(),
                    tokens as i32,
                    hidden as i32,
                    p(bufs.input),
                    p(bufs.residual_in),
                    p(bufs.residual_out),
                    p(bufs.norm_out),
                    p(bufs.quant_out),
                    p(bufs.scale_out),
                    p(bufs.gamma),
                    eps,
                    p(bufs.scale_in),
                    i32::from(oneshot),
                    i32::from(pdl),
                    e,
                    l,
                )
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (stream, dtype, pattern, bufs, eps, pdl);
            Err(unavailable().unwrap_or_default())
        }
    }
}

/// The kernels of FlashInfer's PCIe IPC all-reduce that run on SMs (`pcie_ipc::Variant`; its
/// copy-engine variants are never picked untuned and are not wrapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PcieVariant {
    /// Every rank pushes to every peer at once (at 8 ranks: two islands of 4, no barriers).
    Unstaged,
    /// Reduce-scatter / all-gather (at 8 ranks: island owners, block-partitioned).
    Staged,
    /// Reduce-scatter / all-gather pushing to one neighbour per pass (4 and 8 ranks).
    StagedRing,
    /// [`PcieVariant::Staged`] without the islands (8 ranks).
    FlatStaged,
}

impl PcieVariant {
    #[cfg_attr(not(peers_built), allow(dead_code))]
    fn code(self) -> i32 {
        match self {
            PcieVariant::Unstaged => 0,
            PcieVariant::Staged => 1,
            PcieVariant::StagedRing => 2,
            PcieVariant::FlatStaged => 3,
        }
    }
}

impl std::fmt::Display for PcieVariant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PcieVariant::Unstaged => "unstaged",
            PcieVariant::Staged => "staged",
            PcieVariant::StagedRing => "staged-ring",
            PcieVariant::FlatStaged => "flat-staged",
        })
    }
}

/// One launch of FlashInfer's PCIe all-reduce: grid, block and kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PcieLaunch {
    pub blocks: u32,
    pub threads: u32,
    pub variant: PcieVariant,
}

impl PcieLaunch {
    /// FlashInfer's launch for a shape nothing has tuned: `_seed` in
    /// flashinfer/comm/pcie_ipc_policy.py of flashinfer-python 0.7.2.post1, restated. Its
    /// logic: two ranks push straight to the peer whatever the size; from 32 KiB the
    /// neighbour-ordered reduce-scatter / all-gather, one block per 256 KiB, 1 to 4 blocks;
    /// below that four ranks take the staged kernel on one block (its grid multiplies the
    /// concurrency that collapses a PCIe fabric) and eight the island push on 16.
    pub fn seed(world: usize, bytes: usize, max_blocks: u32) -> PcieLaunch {
        const STAGE_BYTES: usize = 32 << 10;
        const RING_BYTES_PER_BLOCK: usize = 256 << 10;
        const RING_MAX_BLOCKS: usize = 4;
        let launch = |blocks: u32, threads, variant| PcieLaunch {
            blocks,
            threads,
            variant,
        };
        if world == 2 {
            return launch(max_blocks.min(16), 128, PcieVariant::Unstaged);
        }
        if bytes >= STAGE_BYTES {
            let blocks = RING_MAX_BLOCKS
                .min(bytes / RING_BYTES_PER_BLOCK)
                .min(max_blocks as usize)
                .max(1);
            return launch(blocks as u32, 256, PcieVariant::StagedRing);
        }
        if world == 4 {
            return launch(1, 256, PcieVariant::Staged);
        }
        launch(max_blocks.min(16), 256, PcieVariant::Unstaged)
    }
}

/// One rank of FlashInfer's PCIe IPC all-reduce (`flashinfer::comm::pcie_ipc::all_reduce`),
/// bf16 and f16, 2, 4 or 8 ranks, out of place.
///
/// Memory is the caller's, as in FlashInfer: one zeroed slab per rank of
/// [`FlashinferPcie::workspace_bytes`], every rank's slab known to every rank. Its kernels
/// wait for their peers without a deadline and assume every rank makes the same calls with
/// the same launch, in order, on one stream ([`FlashinferPcie::launch`] is a pure function of
/// the shape, so every rank derives the same).
pub struct FlashinferPcie {
    #[cfg_attr(not(peers_built), allow(dead_code))]
    handle: *mut c_void,
    world: usize,
    max_numel: usize,
    max_blocks: u32,
}

// SAFETY: as for `Vllm`: one rank's thread uses it at a time; the C++ object holds pointers.
unsafe impl Send for FlashinferPcie {}

impl FlashinferPcie {
    /// The workspace's block capacity FlashInfer's Python layer defaults to (`AR_MAX_BLOCKS`
    /// in flashinfer/comm/pcie_ipc_collectives/_constants.py, 0.7.2.post1): it sizes the
    /// barrier slots and bounds every launch's grid.
    pub const MAX_BLOCKS: u32 = 128;

    /// Bytes of one rank's slab for calls of up to `max_numel` elements of `dtype`.
    pub fn workspace_bytes(
        world: usize,
        max_numel: usize,
        dtype: DType,
        max_blocks: u32,
    ) -> Result<usize, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        Self::check_dtype(dtype)?;
        #[cfg(peers_built)]
        {
            let mut bytes = 0i64;
            // SAFETY: arithmetic into a local.
            call("pcie_ipc::workspace_size", |e, l| unsafe {
                ffi::peers_pcie_workspace_bytes(
                    world as i32,
                    max_numel as i64,
                    dtype.size() as i32,
                    max_blocks as i32,
                    &mut bytes,
                    e,
                    l,
                )
            })?;
            return Ok(bytes as usize);
        }
        #[allow(unreachable_code)]
        {
            let _ = (world, max_numel, max_blocks);
            Err(unavailable().unwrap_or_default())
        }
    }

    /// The launch FlashInfer would make for `numel` elements of `dtype` at `world` ranks over a
    /// workspace of `max_blocks` (its `get_pcie_ipc_launch_config`: admission, then
    /// [`PcieLaunch::seed`], capped at `max_blocks`), with the grid further capped at
    /// `grid_share` blocks so that every virtual rank's grid co-resides on one GPU. The error
    /// says why FlashInfer would not run the shape.
    pub fn launch(
        world: usize,
        numel: usize,
        dtype: DType,
        max_blocks: u32,
        grid_share: u32,
    ) -> Result<PcieLaunch, String> {
        Self::check_dtype(dtype)?;
        if !matches!(world, 2 | 4 | 8) {
            return Err(format!(
                "FlashInfer's PCIe all-reduce runs 2, 4 or 8 ranks, not {world}"
            ));
        }
        // FlashInfer's `_admits`: whole 16-byte packs, and at least one pack per rank.
        let pack = 16 / dtype.size();
        if numel % pack != 0 {
            return Err(format!(
                "{numel} elements are not a whole number of 16-byte packs"
            ));
        }
        if numel < pack * world {
            return Err(format!(
                "under one 16-byte pack per rank (FlashInfer admits {} elements and up at {world} ranks)",
                pack * world
            ));
        }
        let mut l = PcieLaunch::seed(world, numel * dtype.size(), max_blocks);
        l.blocks = l.blocks.min(max_blocks).min(grid_share.max(1));
        // FlashInfer's `_is_launchable`, for what a cap could break.
        if l.blocks == 0
            || (world == 8 && l.variant == PcieVariant::Staged && l.blocks % 4 != 0)
            || !(world as u32..=1024).contains(&l.threads)
        {
            return Err(format!("{l:?} is not launchable at {world} ranks"));
        }
        Ok(l)
    }

    fn check_dtype(dtype: DType) -> Result<(), String> {
        // Its binding checks for 2-byte elements: the kernels' f32 path is never built.
        if dtype == DType::F32 {
            return Err("FlashInfer's PCIe all-reduce runs bf16 and f16 only".into());
        }
        Ok(())
    }

    /// Rank `rank` of `slabs.len()` (2, 4 or 8) over every rank's slab, for calls of up to
    /// `max_numel` elements (a whole number of 16-byte packs) of `dtype`.
    ///
    /// # Safety
    /// `slabs[r]` are zeroed device buffers of [`FlashinferPcie::workspace_bytes`] for the same
    /// arguments, all zeroed before any rank's first call, living as long as every rank's
    /// communicator.
    pub unsafe fn new(
        slabs: &[u64],
        rank: usize,
        max_numel: usize,
        dtype: DType,
        max_blocks: u32,
    ) -> Result<Self, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        Self::check_dtype(dtype)?;
        let world = slabs.len();
        if !matches!(world, 2 | 4 | 8) || rank >= world {
            return Err(format!(
                "FlashInfer's PCIe all-reduce runs 2, 4 or 8 ranks; rank {rank} of {world} asked"
            ));
        }
        #[cfg(peers_built)]
        {
            let mut ptrs: Vec<*mut c_void> = slabs.iter().map(|&p| p as *mut c_void).collect();
            let mut handle = std::ptr::null_mut();
            call("pcie_ipc init", |e, l| {
                ffi::peers_pcie_create(
                    ptrs.as_mut_ptr(),
                    world as i32,
                    rank as i32,
                    max_numel as i64,
                    dtype.size() as i32,
                    max_blocks as i32,
                    &mut handle,
                    e,
                    l,
                )
            })?;
            return Ok(FlashinferPcie {
                handle,
                world,
                max_numel,
                max_blocks,
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (max_numel, max_blocks);
            unreachable!("unavailable() covers builds without the shim")
        }
    }

    /// The ranks of its group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The workspace's block capacity.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// Enqueues an all-reduce of `n` elements of `input` into `output` on `stream` (a
    /// `CUstream`) with `launch` (from [`FlashinferPcie::launch`], the same on every rank),
    /// without programmatic dependent launch (FlashInfer's binding refuses it).
    ///
    /// # Safety
    /// `input` and `output` are device buffers of `n` elements of `dtype` on the current
    /// device; every rank makes the same calls.
    pub unsafe fn all_reduce(
        &self,
        stream: u64,
        dtype: DType,
        input: u64,
        output: u64,
        n: usize,
        launch: &PcieLaunch,
    ) -> Result<(), String> {
        Self::check_dtype(dtype)?;
        if n > self.max_numel {
            return Err(format!(
                "{n} elements: the workspace holds {}",
                self.max_numel
            ));
        }
        #[cfg(peers_built)]
        {
            return call("pcie_ipc all_reduce", |e, l| {
                ffi::peers_pcie_all_reduce(
                    self.handle,
                    stream as *mut c_void,
                    dtype_code(dtype),
                    input as *const c_void,
                    output as *mut c_void,
                    n as i64,
                    launch.blocks as i32,
                    launch.threads as i32,
                    launch.variant.code(),
                    e,
                    l,
                )
            });
        }
        #[allow(unreachable_code)]
        {
            let _ = (stream, input, output, launch);
            Err(unavailable().unwrap_or_default())
        }
    }
}

impl Drop for FlashinferPcie {
    fn drop(&mut self) {
        #[cfg(peers_built)]
        // SAFETY: created by peers_pcie_create, dropped once.
        unsafe {
            ffi::peers_pcie_destroy(self.handle)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_shim_every_constructor_says_how_to_get_it() {
        if unavailable().is_none() {
            eprintln!("skipped: the peers are built here (.peers/ present)");
            return;
        }
        // SAFETY: refused before any pointer is used.
        let e = unsafe { Vllm::new(&[1, 2], 3, 4, 0, true) }.err().unwrap();
        assert!(e.contains("scripts/peers/fetch.sh"), "{e}");
    }

    #[test]
    fn trtllm_refuses_world_sizes_it_has_no_kernels_for() {
        let sizes = Trtllm::sizes(3, 1, 8, DType::BF16);
        for (n, rank) in [(3usize, 0usize), (2, 2), (16, 0)] {
            let v = vec![1u64; n];
            // SAFETY: refused before any pointer is used.
            let e = unsafe { Trtllm::new(rank, &v, &v, &v, 0, 0, &sizes, DType::BF16, 0) }
                .err()
                .unwrap();
            assert!(
                e.contains("2, 4 or 8") || e.contains("fetch.sh"),
                "{n}: {e}"
            );
        }
    }

    #[test]
    fn trtllm_sizes_follow_flashinfer() {
        let s = Trtllm::sizes(4, 128, 4096, DType::BF16);
        assert_eq!(s.comm, 4 * 128 * 4096 * 2);
        assert_eq!(s.lamport_slot, 4 * 128 * 4096 * 2);
        assert_eq!(s.flags, 4 * 256 * 4);
        assert_eq!(s.table, 13 * 8);
    }

    /// Every branch of FlashInfer's untuned launch (`_seed`), at its boundaries.
    #[test]
    fn pcie_seed_follows_flashinfer() {
        use PcieVariant::*;
        let l = |blocks, threads, variant| PcieLaunch {
            blocks,
            threads,
            variant,
        };
        let m = FlashinferPcie::MAX_BLOCKS;
        // Two ranks: the push to the peer at every size.
        for bytes in [256, 32 << 10, 64 << 20] {
            assert_eq!(PcieLaunch::seed(2, bytes, m), l(16, 128, Unstaged));
        }
        assert_eq!(PcieLaunch::seed(2, 256, 8), l(8, 128, Unstaged));
        // From 32 KiB at 4 and 8 ranks: the ring, one block per 256 KiB, 1 to 4.
        for world in [4, 8] {
            assert_eq!(PcieLaunch::seed(world, 32 << 10, m), l(1, 256, StagedRing));
            assert_eq!(PcieLaunch::seed(world, 512 << 10, m), l(2, 256, StagedRing));
            assert_eq!(PcieLaunch::seed(world, 768 << 10, m), l(3, 256, StagedRing));
            assert_eq!(PcieLaunch::seed(world, 64 << 20, m), l(4, 256, StagedRing));
            assert_eq!(PcieLaunch::seed(world, 64 << 20, 2), l(2, 256, StagedRing));
        }
        // Below 32 KiB: four ranks staged on one block, eight the island push on 16.
        assert_eq!(PcieLaunch::seed(4, (32 << 10) - 16, m), l(1, 256, Staged));
        assert_eq!(PcieLaunch::seed(4, 64, m), l(1, 256, Staged));
        assert_eq!(
            PcieLaunch::seed(8, (32 << 10) - 16, m),
            l(16, 256, Unstaged)
        );
        assert_eq!(PcieLaunch::seed(8, 256, 8), l(8, 256, Unstaged));
    }

    #[test]
    fn pcie_launch_admits_what_flashinfer_admits_and_caps_the_grid() {
        let m = FlashinferPcie::MAX_BLOCKS;
        let launch = |world, numel, dtype| FlashinferPcie::launch(world, numel, dtype, m, m);
        // f32, world sizes without kernels, partial packs, under a pack per rank.
        for (world, numel, dtype, why) in [
            (2, 64, DType::F32, "bf16 and f16 only"),
            (3, 48, DType::BF16, "2, 4 or 8"),
            (6, 48, DType::BF16, "2, 4 or 8"),
            (2, 20, DType::BF16, "16-byte packs"),
            (8, 32, DType::BF16, "64 elements and up at 8 ranks"),
            (2, 8, DType::F16, "16 elements and up at 2 ranks"),
        ] {
            let e = launch(world, numel, dtype).unwrap_err();
            assert!(e.contains(why), "{world} {numel} {dtype}: {e}");
        }
        assert!(launch(8, 64, DType::BF16).is_ok());
        assert!(launch(4, 32, DType::F16).is_ok());
        // The grid share caps FlashInfer's choice (13 SMs per rank: an A100 at 8 ranks).
        let capped = FlashinferPcie::launch(8, 1024, DType::BF16, m, 13).unwrap();
        assert_eq!((capped.blocks, capped.variant), (13, PcieVariant::Unstaged));
        let h100 = FlashinferPcie::launch(8, 1024, DType::BF16, m, 132 / 8).unwrap();
        assert_eq!(h100.blocks, 16);
    }

    #[test]
    fn pcie_refuses_what_it_has_no_kernels_for() {
        for (slabs, rank, dtype) in [
            (vec![1u64; 3], 0, DType::BF16),
            (vec![1; 2], 2, DType::BF16),
            (vec![1; 2], 0, DType::F32),
        ] {
            // SAFETY: refused before any pointer is used.
            let e = unsafe { FlashinferPcie::new(&slabs, rank, 64, dtype, 128) }
                .err()
                .unwrap();
            assert!(
                e.contains("2, 4 or 8") || e.contains("bf16 and f16") || e.contains("fetch.sh"),
                "{}: {e}",
                slabs.len()
            );
        }
    }

    #[test]
    fn vllm_refuses_world_sizes_it_has_no_kernels_for() {
        for (meta, rank) in [(vec![1u64; 3], 0), (vec![1; 2], 2), (vec![1; 9], 0)] {
            // SAFETY: refused before any pointer is used.
            let e = unsafe { Vllm::new(&meta, 0, 0, rank, true) }.err().unwrap();
            assert!(
                e.contains("2, 4, 6 or 8") || e.contains("fetch.sh"),
                "{}: {e}",
                meta.len()
            );
        }
    }
}
