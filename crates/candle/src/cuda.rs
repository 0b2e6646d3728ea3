//! The ops on candle CUDA tensors: the library's `cudarc` calls on the storage's slice and
//! its device's stream, so candle's own event tracking records the call like one of its
//! kernels.

use std::ops::Range;

use allreduce::CudarcElement;
use candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, Layout};

use crate::{failed, range, AddRmsNorm, AllReduce};

/// The dtypes both libraries carry on the GPU.
pub(crate) trait Element: CudarcElement + CudaDType + ValidAsZeroBits {}
impl Element for f32 {}
impl Element for half::f16 {}
impl Element for half::bf16 {}

pub(crate) fn all_reduce<T: Element>(
    op: &AllReduce<'_>,
    storage: &mut CudaStorage,
    r: Range<usize>,
) -> candle_core::Result<()> {
    let stream = storage.device.cuda_stream();
    let mut view = storage.as_cuda_slice_mut::<T>()?.slice_mut(r);
    op.comm
        .all_reduce_cudarc_in_place(&mut view, &stream, &op.options)
        .map(drop)
        .map_err(failed)
}

pub(crate) fn add_rms_norm<T: Element>(
    op: &AddRmsNorm<'_>,
    (x, lx): (&CudaStorage, &Layout),
    (residual, lr): (&CudaStorage, &Layout),
    (gamma, lg): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    let (tokens, _) = lx.shape().dims2()?;
    let device = x.device.clone();
    let stream = device.cuda_stream();
    let xs = x.as_cuda_slice::<T>()?.slice(range(lx)?);
    let rs = residual.as_cuda_slice::<T>()?.slice(range(lr)?);
    let gs = gamma.as_cuda_slice::<T>()?.slice(range(lg)?);
    // Both outputs in one allocation; every element is written by the call.
    let mut out = device.alloc_zeros::<T>(2 * xs.len())?;
    let (mut residual_out, mut norm_out) = out.split_at_mut(xs.len());
    op.comm
        .all_reduce_add_rms_norm_cudarc(
            op.ws,
            tokens,
            &xs,
            &rs,
            &gs,
            op.eps,
            &mut residual_out,
            &mut norm_out,
            &stream,
        )
        .map_err(failed)?;
    Ok(CudaStorage::wrap_cuda_slice(out, device))
}
