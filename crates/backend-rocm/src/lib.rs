//! AMD backend of `allreduce`.
//!
//! Layers, as in cudarc: [`hip`] and [`rccl`] are the vendor libraries, each a `sys` function
//! table opened at run time with libloading (probing the usual sonames; no ROCm is needed to
//! build, and without one every entry point returns `Error::LibraryUnavailable` naming the
//! files tried) and a thin `result` layer. [`Hip`] implements `allreduce_gpu::GpuRuntime`
//! over them, so the group logic ([`Rocm`] = `GpuBackend<Hip>`) is the code every GPU backend
//! shares: workspace layout, flag protocol, strategy choice, launch arguments, and the fused
//! all-reduce + RMSNorm (`allreduce_gpu::fused`, fused.hip's kernels). [`kernels`]
//! holds the code objects build.rs compiled from `kernels-hip/` when it found a HIP compiler;
//! [`select`] is the default `Auto` table (vLLM's ROCm thresholds).
//!
//! State: compiled and unit-tested with no ROCm runtime; never run on AMD hardware.

pub mod hip;
pub mod kernels;
mod loader;
pub mod rccl;
mod runtime;
pub mod select;

use allreduce_gpu::{GpuBackend, GpuComm};

pub use runtime::{
    device_count, init, queue_shortfall, Hip, HipDevice, HipFunction, HipHostMapped, HipMemory,
    HipModule, IpcMapping, RcclComm, DEFAULT_HW_QUEUES,
};

/// The ROCm backend (`Backend::NAME` = "rocm").
pub type Rocm = GpuBackend<Hip>;
/// One rank of a ROCm group.
pub type RocmComm = GpuComm<Hip>;

pub use allreduce_gpu::fused::NormBuffers;
/// The unfused baseline's second kernel (residual add + RMSNorm, + FP8 codes) from fused.hip,
/// for tests and the bench: `RmsNormKernel::load(&device)`.
pub type RmsNormKernel = allreduce_gpu::fused::RmsNormKernel<Hip>;
