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

use allreduce::{AllReduceOptions, BufMut, Communicator, Precision, Strategy};
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
