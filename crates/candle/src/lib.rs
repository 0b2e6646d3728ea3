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
//! tensor-parallel model then runs, and is tested, on a machine with no GPU.

use allreduce::{
    AllReduceOptions, BufMut, BufRef, Communicator, FusedArgs, FusedPattern, FusedWorkspace,
    Precision, Strategy,
};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor};

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
/// CPU tensors (a host-backend group); the tensors are read once and the outputs built from
/// what the library wrote.
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
    if !x.device().is_cpu() {
        return Err(candle_core::Error::Msg(
            "allreduce: the fused op takes CPU tensors (a host-backend group) so far".into(),
        ));
    }
    match x.dtype() {
        candle_core::DType::F32 => fused_cpu::<f32>(x, residual, gamma, eps, comm, ws),
        candle_core::DType::F16 => fused_cpu::<half::f16>(x, residual, gamma, eps, comm, ws),
        candle_core::DType::BF16 => fused_cpu::<half::bf16>(x, residual, gamma, eps, comm, ws),
        d => Err(candle_core::Error::UnsupportedDTypeForOp(
            d,
            "allreduce-add-rms-norm",
        )),
    }
}

fn fused_cpu<T>(
    x: &Tensor,
    residual: &Tensor,
    gamma: &Tensor,
    eps: f32,
    comm: &Communicator,
    ws: &FusedWorkspace,
) -> candle_core::Result<(Tensor, Tensor)>
where
    T: allreduce::Element + candle_core::WithDType,
{
    let (tokens, hidden) = x.dims2()?;
    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<T>();
    let (xs, rs, g) = (flat(x)?, flat(residual)?, flat(gamma)?);
    let mut residual_out = xs.clone();
    let mut norm_out = xs.clone();
    let args = FusedArgs::new(
        FusedPattern::ResidualRmsNorm,
        tokens,
        BufRef::from_slice(&xs),
    )
    .residual(
        BufRef::from_slice(&rs),
        Some(BufMut::from_slice(&mut residual_out)),
    )
    .rms_norm(
        BufRef::from_slice(&g),
        eps,
        Some(BufMut::from_slice(&mut norm_out)),
    );
    comm.all_reduce_fused(ws, args).map_err(failed)?;
    let shape = (tokens, hidden);
    Ok((
        Tensor::from_vec(residual_out, shape, x.device())?,
        Tensor::from_vec(norm_out, shape, x.device())?,
    ))
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
}
