//! NVIDIA backend of `allreduce`.
//!
//! Internals: [`driver`] is the slice of the CUDA driver API we use (over cudarc's `sys`
//! layer, loaded at run time and probed first, so a machine without libcuda gets an error
//! value, not a panic); [`abi`] mirrors the kernels' structs; `runtime` is the driver as an
//! `allreduce_gpu::GpuRuntime`, under the group logic shared with the ROCm backend;
//! `nccl` is `Strategy::Vendor` (libnccl loaded at run time; without it the
//! strategy is unavailable, with the reason). The kernels come from `kernels-cuda/` (+ `kernels-common/`), compiled ahead of
//! time by build-support into two fatbins embedded in this crate (`fused` holds the
//! all-reduce fused with residual + RMSNorm, kernels-cuda/fused.cu).

pub mod abi;
pub mod driver;
mod fused;
mod nccl;
mod runtime;

pub use driver::device_description;
pub use fused::{CudaFused, NormBuffers, RmsNormKernel};
pub use runtime::{open_ipc_mappings, Cuda, CudaComm, CudaRuntime};
