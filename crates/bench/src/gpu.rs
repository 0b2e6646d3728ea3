//! The bench on any GPU backend: the runtime behind each `BackendKind` compiled in, and a
//! rank's device and stream over the device API (`allreduce_gpu::device`). Nothing else in
//! the bench names a vendor.

use allreduce::{BackendKind, Communicator, Device, Error, Result};
use allreduce_gpu::device::{GpuDevice, GpuStream};
use allreduce_gpu::GpuRuntime;

/// A rank's device (current on this thread, set up for virtual ranks) and a stream of its
/// own on it.
pub fn open_rank<R: GpuRuntime>(comm: &Communicator) -> Result<(GpuDevice<R>, GpuStream<R>)> {
    let ordinal = match comm.device() {
        Device::Cuda(o) | Device::Rocm(o) if R::device_tag(o) == comm.device() => o,
        d => {
            return Err(Error::InvalidConfig(format!(
                "a {} rank was expected, not one on {d}",
                R::NAME
            )))
        }
    };
    let dev = GpuDevice::<R>::open(ordinal)?;
    dev.prepare_virtual_ranks()?;
    let stream = GpuStream::new(&dev)?;
    Ok((dev, stream))
}

/// Something to run with the runtime of a GPU backend.
pub trait WithRuntime {
    type Output;
    fn run<R: GpuRuntime>(self) -> Self::Output;
}

/// Run `job` with `backend`'s runtime, or say why there is none in this build.
pub fn with_runtime<J: WithRuntime<Output = std::result::Result<T, E>>, T, E: From<String>>(
    backend: BackendKind,
    what: &str,
    job: J,
) -> std::result::Result<T, E> {
    match backend {
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => job.run::<allreduce::cuda::CudaRuntime>(),
        #[cfg(feature = "rocm")]
        BackendKind::Rocm => job.run::<allreduce::rocm::Hip>(),
        other => {
            let _ = job;
            Err(format!(
                "{what} runs on a GPU backend compiled into this build (--features cuda or \
                 rocm), not {}",
                other.name()
            )
            .into())
        }
    }
}
