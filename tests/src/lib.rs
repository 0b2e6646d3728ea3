//! One conformance suite, run against every backend present.
//!
//! Each test is a function of a [`Harness`]; `tests/conformance.rs` runs the whole list once
//! per backend compiled into the build and found at run time, naming each trial
//! `[backend] test`, the way wgpu's test harness does. A backend that is absent is skipped
//! with the reason printed.

/// `println!` with the backend's name in front (`[cuda] ...`), so every GPU list's lines say
/// which backend ran them.
#[macro_export]
macro_rules! say {
    ($r:ty, $($arg:tt)*) => {
        println!("[{}] {}", <$r as allreduce_gpu::GpuRuntime>::NAME, format_args!($($arg)*))
    };
}

pub mod check;
pub mod codec_data;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod codecs;
pub mod data;
pub mod expect;
mod faults;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod fused;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod graphs;
pub mod harness;
#[cfg(any(feature = "cuda", feature = "rocm"))]
mod harness_gpu;
pub mod push;
pub mod soak;
mod suite;
pub mod tolerance;

use allreduce::{BackendKind, Communicator, Device, Error, Result};
use allreduce_gpu::device::{GpuDevice, GpuStream};
use allreduce_gpu::GpuRuntime;

pub use harness::{FusedOutcome, FusedRankArgs, Harness, HostHarness, RankArgs};
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub use harness_gpu::GpuHarness;
pub use suite::{Test, TESTS};

/// A GPU runtime the suites run on: its device API (`GpuRuntime`) and how the facade names
/// its backend. Every GPU test is generic over it and runs on each as `[backend] name`.
pub trait GpuTestRuntime: GpuRuntime {
    const KIND: BackendKind;
    /// Devices present (0 with a runtime but no GPU); `Err` without a runtime.
    fn device_count() -> Result<usize>;
    /// Process settings to make before the runtime initialises (the first call into it).
    fn before_init() {}
    /// Bytes of device memory in use on `ordinal` (the whole device's), where the runtime
    /// says; for the soak tests.
    fn device_memory_used(_ordinal: u32) -> Option<usize> {
        None
    }
    /// Peers' allocations this process holds mapped by IPC handle, where the backend counts
    /// them; for the soak tests.
    fn open_ipc_mappings() -> Option<usize> {
        None
    }
}

#[cfg(feature = "cuda")]
impl GpuTestRuntime for allreduce::cuda::CudaRuntime {
    const KIND: BackendKind = BackendKind::Cuda;
    fn device_count() -> Result<usize> {
        allreduce::cuda::driver::device_count()
    }
    fn device_memory_used(ordinal: u32) -> Option<usize> {
        allreduce::cuda::driver::memory_in_use(ordinal).ok()
    }
    fn open_ipc_mappings() -> Option<usize> {
        Some(allreduce::cuda::open_ipc_mappings())
    }
}

#[cfg(feature = "rocm")]
impl GpuTestRuntime for allreduce::rocm::Hip {
    const KIND: BackendKind = BackendKind::Rocm;
    fn device_count() -> Result<usize> {
        allreduce::rocm::device_count()
    }
    fn before_init() {
        hip_queues_for_virtual_ranks();
    }
}

/// The conformance harness on CUDA GPUs.
#[cfg(feature = "cuda")]
pub type CudaHarness = GpuHarness<allreduce::cuda::CudaRuntime>;
/// The conformance harness on ROCm GPUs.
#[cfg(feature = "rocm")]
pub type RocmHarness = GpuHarness<allreduce::rocm::Hip>;

/// The ordinal of `comm`'s device, which must be one of `R`'s.
pub fn rank_ordinal<R: GpuTestRuntime>(comm: &Communicator) -> Result<u32> {
    match comm.device() {
        Device::Cuda(o) | Device::Rocm(o) if R::device_tag(o) == comm.device() => Ok(o),
        d => Err(Error::InvalidConfig(format!(
            "a {} test got a rank on {d}",
            R::NAME
        ))),
    }
}

/// A rank's device (current on this thread, set up for virtual ranks) and a stream of its
/// own on it.
pub fn open_rank<R: GpuTestRuntime>(comm: &Communicator) -> Result<(GpuDevice<R>, GpuStream<R>)> {
    let dev = GpuDevice::<R>::open(rank_ordinal::<R>(comm)?)?;
    dev.prepare_virtual_ranks()?;
    let stream = GpuStream::new(&dev)?;
    Ok((dev, stream))
}

/// Whether a GPU test can run on `R`. When not, prints why `what` is skipped (CI has no GPU;
/// the skip must say so, not pass silently).
pub fn gpu_available<R: GpuTestRuntime>(what: &str) -> bool {
    R::before_init();
    gpu_present(R::device_count(), &format!("{}_{what}", R::NAME))
}

/// Whether a GPU test can run: `count` is the backend's device count. When not, prints why
/// `what` is skipped.
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
