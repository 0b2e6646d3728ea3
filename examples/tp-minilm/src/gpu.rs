//! The row-parallel sums on the GPU: each rank copies its partial product into a device buffer
//! of its own (allocated before any rank's first call, as virtual ranks need), sums it in place
//! with `Communicator::all_reduce_cudarc_in_place` on its own cudarc stream, and copies the sum
//! back for candle's CPU layers. The copies go through pinned host buffers: a copy from or to
//! pageable memory passes through the driver's staging buffers, which ranks sharing one GPU
//! would share, so one rank's copy back (waiting for its all-reduce, which waits for the
//! peers) could hold up a peer's copy in that the all-reduce needs.

use std::sync::{Arc, Mutex};

use allreduce::{
    AllReduceOptions, Communicator, CudarcElement, DType as ArDType, Precision, Strategy,
};
use candle_core::{Result, Tensor};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PinnedHostSlice, ValidAsZeroBits};
use half::bf16;

/// Rows of 384 the buffers hold: every sentence of the corpus fits.
const MAX_TOKENS: usize = 128;

/// One rank's stream and device buffers.
pub struct GpuSums {
    stream: Arc<CudaStream>,
    f32: Mutex<(CudaSlice<f32>, PinnedHostSlice<f32>)>,
    bf16: Mutex<(CudaSlice<bf16>, PinnedHostSlice<bf16>)>,
}

fn err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl GpuSums {
    /// Every rank's, on GPU 0.
    pub fn for_ranks(ctx: &Arc<CudaContext>, tp: usize) -> Result<Vec<GpuSums>> {
        let n = MAX_TOKENS * crate::HIDDEN;
        (0..tp)
            .map(|_| {
                let stream = ctx.new_stream().map_err(err)?;
                let f32 = stream.alloc_zeros::<f32>(n).map_err(err)?;
                let bf16 = stream.alloc_zeros::<bf16>(n).map_err(err)?;
                // SAFETY: the pinned buffers are written before they are read.
                let (pf32, pbf16) = unsafe {
                    (
                        ctx.alloc_pinned::<f32>(n).map_err(err)?,
                        ctx.alloc_pinned::<bf16>(n).map_err(err)?,
                    )
                };
                stream.synchronize().map_err(err)?;
                Ok(GpuSums {
                    stream,
                    f32: Mutex::new((f32, pf32)),
                    bf16: Mutex::new((bf16, pbf16)),
                })
            })
            .collect()
    }

    /// `partial` (f32, on the CPU) summed over the ranks on the GPU, as `reduce` asks.
    pub fn sum(
        &self,
        partial: &Tensor,
        comm: &Communicator,
        reduce: crate::Reduce,
    ) -> Result<Tensor> {
        let shape = partial.shape().clone();
        let host = partial.flatten_all()?.to_vec1::<f32>()?;
        let mut options = AllReduceOptions::default().precision(reduce.precision);
        if matches!(reduce.precision, Precision::Lossy(_)) {
            options = options.strategy(Strategy::QuantizedTwoShot);
        }
        let out = match reduce.wire {
            None | Some(ArDType::F32) => self.round_trip(&self.f32, &host, comm, &options)?,
            Some(_) => self.round_trip(&self.bf16, &host, comm, &options)?,
        };
        Tensor::from_vec(out, shape, &candle_core::Device::Cpu)
    }

    /// `host` as `T` summed over the ranks on the GPU: into the pinned buffer, to the device,
    /// summed in place there, and back.
    fn round_trip<T: CudarcElement + ValidAsZeroBits>(
        &self,
        bufs: &Mutex<(CudaSlice<T>, PinnedHostSlice<T>)>,
        host: &[f32],
        comm: &Communicator,
        options: &AllReduceOptions,
    ) -> Result<Vec<f32>> {
        let s = &self.stream;
        let n = host.len();
        let mut bufs = bufs.lock().unwrap_or_else(|e| e.into_inner());
        let (dev, pinned) = &mut *bufs;
        for (d, &v) in pinned.as_mut_slice().map_err(err)?[..n]
            .iter_mut()
            .zip(host)
        {
            *d = T::from_f32(v);
        }
        s.memcpy_htod(&*pinned, dev).map_err(err)?;
        comm.all_reduce_cudarc_in_place(&mut dev.slice_mut(..n), s, options)
            .map_err(err)?;
        s.memcpy_dtoh(&*dev, pinned).map_err(err)?;
        Ok(pinned.as_slice().map_err(err)?[..n]
            .iter()
            .map(|v| v.to_f32())
            .collect())
    }
}
