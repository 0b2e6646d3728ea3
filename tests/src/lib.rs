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

/// Whether a GPU test can run: `count` is the backend's device count. When not, prints why
/// `what` is skipped (CI has no GPU; the skip must say so, not pass silently). Used by the
/// test macros (`gpu_fused_test!`, `gpu_graph_test!`).
#[doc(hidden)]
pub fn gpu_present<E: std::fmt::Display>(count: Result<usize, E>, what: &str) -> bool {
    match count {
        Ok(n) if n > 0 => true,
        Ok(_) => {
            println!("{what} skipped: the runtime reports no GPU");
            false
        }
        Err(e) => {
            println!("{what} skipped: {e}");
            false
        }
    }
}

/// Before HIP initialises (the first HIP call of the process): give each of up to 8 virtual
/// ranks on one GPU a hardware queue of its own (HIP maps streams round-robin onto
/// `GPU_MAX_HW_QUEUES` queues, 4 by default; backend-rocm leaves the variable alone and says
/// when it is too small). A value the caller set is kept.
#[cfg(feature = "rocm")]
pub fn hip_queues_for_virtual_ranks() {
    if std::env::var_os("GPU_MAX_HW_QUEUES").is_none() {
        std::env::set_var("GPU_MAX_HW_QUEUES", "16");
    }
}
