//! The fused all-reduce + residual + RMSNorm (+ FP8) on CUDA: the kernels of
//! `kernels-cuda/fused.cu`, embedded as a second fatbin. Workspaces, kernel choice, launch
//! arguments and warm-up are `allreduce_core::gpu::fused`, shared with the ROCm backend;
//! `runtime.rs` gives it the module and the -0.0-filled memory.

use allreduce_core::gpu::fused as generic;
use allreduce_core::{DType, FusionPattern, Result};

use crate::driver::Module;
use crate::runtime::CudaRuntime;

pub(crate) static FUSED_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fused.fatbin"));

/// One rank's fused workspace on CUDA.
pub type CudaFused = generic::GpuFused<CudaRuntime>;

pub use generic::NormBuffers;

/// The unfused baseline's second kernel (residual add + RMSNorm, + FP8 codes), for tests and
/// the bench: what a model runs after a plain all-reduce. Loaded on the bound device.
pub struct RmsNormKernel(generic::RmsNormKernel<CudaRuntime>);

impl RmsNormKernel {
    pub fn load() -> Result<Self> {
        generic::RmsNormKernel::from_module(Module::load(FUSED_FATBIN)?).map(RmsNormKernel)
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
        self.0
            .launch(dtype, pattern, bufs, tokens, hidden, eps, max_grid, stream)
    }
}
