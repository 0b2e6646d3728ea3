//! RCCL (AMD's NCCL) behind `Strategy::Vendor`, in the same layers as [`crate::hip`]: [`sys`]
//! (the function table, loaded at run time) and [`result`]. RCCL keeps NCCL's C API, so the
//! signatures and enum values are NCCL's (as cudarc's `nccl::sys` has them), with HIP streams.
//!
//! A missing librccl is not an error of the group: the vendor strategy is then unavailable
//! and says why, and `Auto` skips it.

pub mod result;
#[allow(clippy::missing_safety_doc)]
pub mod sys;
