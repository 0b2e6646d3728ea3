//! The HIP runtime, in cudarc's layers: [`sys`] (the function table, loaded at run time)
//! and [`result`] (one `Result`-returning function per call). The owning types are in
//! `crate::runtime` (what the group needs, and the device API of `allreduce_gpu::device`).

pub mod result;
#[allow(clippy::missing_safety_doc)]
pub mod sys;

pub use result::HipError;
