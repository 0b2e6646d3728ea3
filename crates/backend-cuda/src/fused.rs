//! The fused all-reduce + residual + RMSNorm (+ FP8) on CUDA: the kernels of
//! `kernels-cuda/fused.cu`, embedded as a second fatbin. Workspaces, kernel choice, launch
//! arguments and warm-up are `allreduce_gpu::fused`, shared with the ROCm backend;
//! `runtime.rs` gives it the module and the -0.0-filled memory.

use allreduce_gpu::fused as generic;

use crate::runtime::CudaRuntime;

pub(crate) static FUSED_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fused.fatbin"));

/// One rank's fused workspace on CUDA.
pub type CudaFused = generic::GpuFused<CudaRuntime>;

pub use generic::NormBuffers;

/// The unfused baseline's second kernel (residual add + RMSNorm, + FP8 codes), for tests and
/// the bench: what a model runs after a plain all-reduce. `RmsNormKernel::load(&device)`.
pub type RmsNormKernel = generic::RmsNormKernel<CudaRuntime>;
