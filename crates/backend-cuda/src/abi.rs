//! The host side of the kernels' ABI (`kernels-common/include/allreduce/abi.h`): one copy for
//! every vendor, in `allreduce_gpu::abi`.

pub use allreduce_gpu::abi::*;
