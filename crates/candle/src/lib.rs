//! candle ops over [`allreduce`]: the all-reduce of a tensor-parallel layer, in place, as a
//! candle [`InplaceOp1`] (no output allocated per call, unlike the `cudarc::nccl` `CustomOp1`
//! the Rust engines use today).
//!
//! ```no_run
//! # fn f(x: &candle_core::Tensor, comm: &allreduce::Communicator) -> candle_core::Result<()> {
//! // After a row-parallel matmul, on every rank (each from its own thread or process):
//! allreduce_candle::all_reduce_(x, comm)?;   // x now holds the sum over the ranks
//! # Ok(()) }
//! ```
//!
//! CPU tensors go through a host-backend communicator (`BackendKind::Host`): the whole
//! tensor-parallel model then runs, and is tested, on a machine with no GPU. CUDA tensors
//! (the `cuda` feature) go through a CUDA group (`Communicator::new_group_cudarc`), the call
//! enqueued on the tensor's device stream.
//!
//! Several ranks on one GPU (virtual ranks, as in the tests) wait in each other's all-reduce,
//! so no rank may block its host thread on the device meanwhile. candle uploads the shapes and
//! strides of non-contiguous operands from pageable memory before their kernels, and such a
//! copy waits for its stream and for the driver's staging buffer, shared by every rank of the
//! GPU. Hold `CudaDevice::enable_cuda_graph_htod_cache()` in each rank's thread and run every
//! shape once before the ranks meet (`examples/tp-minilm` does): the uploads are then made
//! once and kept on the device. One GPU per rank has no such coupling.

use allreduce::{
    AllReduceOptions, BufMut, BufRef, Communicator, FusedArgs, FusedPattern, FusedWorkspace,
    Precision, Strategy,
};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, InplaceOp1, Layout, Shape, Tensor};

#[cfg(feature = "cuda")]
mod cuda;

/// An in-place sum over the ranks of `comm` (`Tensor::inplace_op1`). The tensor must be
/// contiguous, f32, f16 or bf16, on the communicator's device.
pub struct AllReduce<'a> {
    comm: &'a Communicator,
    options: AllReduceOptions,
}

impl<'a> AllReduce<'a> {
    pub fn new(comm: &'a Communicator) -> Self {
        AllReduce {
            comm,
            options: AllReduceOptions::default(),
        }
    }

    /// A lossy codec (`Precision::Lossy`) for bandwidth-bound sizes; exact by default.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.options = self.options.precision(precision);
        self
    }

    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.options = self.options.strategy(strategy);
        self
    }
}

/// Sum `x` over the ranks of `comm`, in place.
pub fn all_reduce_(x: &Tensor, comm: &Communicator) -> candle_core::Result<()> {
    x.inplace_op1(&AllReduce::new(comm))
}

/// The all-reduce fused with the residual add and the RMSNorm, in one library call (what vLLM
/// runs as all-reduce then `fused_add_rms_norm`, and TensorRT-LLM / FlashInfer as one fusion
/// kernel): with `a` the sum over the ranks of `x` (`[tokens, hidden]`),
/// `residual_out = a + residual` and `norm_out = residual_out / rms(residual_out) * gamma`,
/// returned as `(residual_out, norm_out)`. `ws` is this rank's fused workspace
/// (`FusedWorkspace::create_group`), of `x`'s dtype and hidden size.
///
/// Both outputs are views of one new `[2, tokens, hidden]` tensor, so one allocation serves
/// them (CPU tensors: a host-backend group; CUDA tensors with the `cuda` feature: the call is
/// enqueued on the tensor's device stream).
pub fn all_reduce_add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    eps: f32,
    comm: &Communicator,
    ws: &FusedWorkspace,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (_, hidden) = x.dims2()?;
    if residual.dims() != x.dims() || gamma.dims() != [hidden] {
        return Err(candle_core::Error::Msg(format!(
            "allreduce: x {:?}, residual {:?}, gamma {:?}: expected [tokens, hidden] twice and \
             [hidden]",
            x.dims(),
            residual.dims(),
            gamma.dims()
        )));
    }
    let both = x.apply_op3_no_bwd(residual, gamma, &AddRmsNorm { comm, ws, eps })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// [`all_reduce_add_rms_norm`] as a candle op: `x`, `residual`, `gamma` in, the two outputs
/// stacked out.
struct AddRmsNorm<'a> {
    comm: &'a Communicator,
    ws: &'a FusedWorkspace,
    eps: f32,
}

impl AddRmsNorm<'_> {
    fn cpu<T: allreduce::Element>(
        &self,
        x: &[T],
        residual: &[T],
        gamma: &[T],
        tokens: usize,
    ) -> candle_core::Result<Vec<T>> {
        let mut out = [x, x].concat();
        let (residual_out, norm_out) = out.split_at_mut(x.len());
        let args = FusedArgs::new(FusedPattern::ResidualRmsNorm, tokens, BufRef::from_slice(x))
            .residual(
                BufRef::from_slice(residual),
                Some(BufMut::from_slice(residual_out)),
            )
            .rms_norm(
                BufRef::from_slice(gamma),
                self.eps,
                Some(BufMut::from_slice(norm_out)),
            );
        self.comm.all_reduce_fused(self.ws, args).map_err(failed)?;
        Ok(out)
    }
}

impl CustomOp3 for AddRmsNorm<'_> {
    fn name(&self) -> &'static str {
        "allreduce-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (tokens, hidden) = l1.shape().dims2()?;
        let (r1, r2, r3) = (range(l1)?, range(l2)?, range(l3)?);
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(r), CpuStorage::F32(g)) => {
                CpuStorage::F32(self.cpu(&x[r1], &r[r2], &g[r3], tokens)?)
            }
            (CpuStorage::F16(x), CpuStorage::F16(r), CpuStorage::F16(g)) => {
                CpuStorage::F16(self.cpu(&x[r1], &r[r2], &g[r3], tokens)?)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(r), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(self.cpu(&x[r1], &r[r2], &g[r3], tokens)?)
            }
            _ => return Err(mixed(s1.dtype(), s2.dtype(), s3.dtype())),
        };
        Ok((out, Shape::from((2, tokens, hidden))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::DType;
        let (tokens, hidden) = l1.shape().dims2()?;
        let (a, b, c) = ((s1, l1), (s2, l2), (s3, l3));
        let out = match (s1.dtype(), s2.dtype(), s3.dtype()) {
            (DType::F32, DType::F32, DType::F32) => cuda::add_rms_norm::<f32>(self, a, b, c)?,
            (DType::F16, DType::F16, DType::F16) => cuda::add_rms_norm::<half::f16>(self, a, b, c)?,
            (DType::BF16, DType::BF16, DType::BF16) => {
                cuda::add_rms_norm::<half::bf16>(self, a, b, c)?
            }
            (d1, d2, d3) => return Err(mixed(d1, d2, d3)),
        };
        Ok((out, Shape::from((2, tokens, hidden))))
    }
}

fn mixed(d1: DType, d2: DType, d3: DType) -> candle_core::Error {
    if d1 == d2 && d2 == d3 {
        candle_core::Error::UnsupportedDTypeForOp(d1, "allreduce-add-rms-norm")
    } else {
        candle_core::Error::Msg(format!(
            "allreduce: x, residual and gamma are {d1:?}, {d2:?}, {d3:?}: one dtype for all three"
        ))
    }
}

fn failed(e: allreduce::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("allreduce: {e}"))
}

/// The element range a contiguous layout covers.
fn range(layout: &Layout) -> candle_core::Result<std::ops::Range<usize>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(start..end),
        None => Err(candle_core::Error::RequiresContiguous {
            op: "allreduce-all-reduce",
        }),
    }
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "allreduce-all-reduce"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let r = range(layout)?;
        let buf = match storage {
            CpuStorage::F32(v) => BufMut::from_slice(&mut v[r]),
            CpuStorage::F16(v) => BufMut::from_slice(&mut v[r]),
            CpuStorage::BF16(v) => BufMut::from_slice(&mut v[r]),
            other => {
                return Err(candle_core::Error::UnsupportedDTypeForOp(
                    other.dtype(),
                    "allreduce-all-reduce",
                ))
            }
        };
        self.comm
            .all_reduce_in_place(buf, &self.options)
            .map(drop)
            .map_err(failed)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        let r = range(layout)?;
        match storage.dtype() {
            DType::F32 => cuda::all_reduce::<f32>(self, storage, r),
            DType::F16 => cuda::all_reduce::<half::f16>(self, storage, r),
            DType::BF16 => cuda::all_reduce::<half::bf16>(self, storage, r),
            d => Err(candle_core::Error::UnsupportedDTypeForOp(
                d,
                "allreduce-all-reduce",
            )),
        }
    }
}
