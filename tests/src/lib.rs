//! One conformance suite, run against every backend present.
//!
//! Each test is a function of a [`Harness`]; `tests/conformance.rs` runs the whole list once
//! per backend compiled into the build and found at run time, naming each trial
//! `[backend] test`, the way wgpu's test harness does. A backend that is absent is skipped
//! with the reason printed.

pub mod check;
pub mod data;
mod fused;
mod graphs;
pub mod harness;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod harness_gpu;
mod suite;

pub use harness::{Harness, HostHarness, RankArgs};
#[cfg(feature = "cuda")]
pub use harness_gpu::cuda::CudaHarness;
#[cfg(feature = "rocm")]
pub use harness_gpu::rocm::RocmHarness;
pub use suite::{Test, TESTS};
