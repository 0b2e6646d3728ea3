//! Where a rank's input and output live. The timing loop only sees [`BenchBuffers`], so a GPU
//! backend plugs in by allocating device memory here (and copying in `upload`/`download`).

use allreduce::{
    AllReduceOptions, BackendKind, BufMut, BufRef, Communicator, DType, Error, HostBytes, Result,
    Strategy, Stream,
};

/// One rank's buffers for one row.
pub trait BenchBuffers: Send {
    /// Copy `host` (the rank's input, encoded dtype bytes) into the buffer the call reads: the
    /// input, or the output when in place.
    fn upload(&mut self, host: &[u8]) -> Result<()>;

    /// Copy the output into `host` (already sized to the row's bytes).
    fn download(&mut self, host: &mut [u8]) -> Result<()>;

    /// Views for one call: `(Some(input), output)` out of place, `(None, buffer)` in place.
    fn views(&mut self) -> (Option<BufRef<'_>>, BufMut<'_>);

    /// The stream calls on these buffers are enqueued on (the null stream on the host).
    fn stream(&self) -> Stream {
        Stream::NULL
    }
}

/// Allocates [`BenchBuffers`] for the ranks of a group.
pub trait BufferFactory: Sync {
    /// Buffers of `bytes` (a whole number of `dtype` elements) for the rank `comm`.
    fn alloc(
        &self,
        comm: &Communicator,
        bytes: usize,
        dtype: DType,
        in_place: bool,
    ) -> Result<Box<dyn BenchBuffers>>;
}

/// The factory for a backend.
pub fn factory(backend: BackendKind) -> Result<Box<dyn BufferFactory>> {
    match backend {
        BackendKind::Host => Ok(Box::new(HostFactory)),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => Ok(Box::new(
            gpu::GpuFactory::<allreduce::cuda::CudaRuntime>::new(),
        )),
        #[cfg(feature = "rocm")]
        BackendKind::Rocm => Ok(Box::new(gpu::GpuFactory::<allreduce::rocm::Hip>::new())),
        // Unreachable only when every backend is compiled in.
        #[allow(unreachable_patterns)]
        other => Err(Error::BackendNotBuilt(other.name())),
    }
}

/// Run one all-reduce on `bufs`, in or out of place as they were allocated.
#[inline]
pub fn call(
    comm: &Communicator,
    bufs: &mut dyn BenchBuffers,
    opts: &AllReduceOptions,
) -> Result<Strategy> {
    match bufs.views() {
        (Some(input), output) => comm.all_reduce(input, output, opts),
        (None, buf) => comm.all_reduce_in_place(buf, opts),
    }
}

/// Host memory: what the host backend reduces.
pub struct HostFactory;

struct HostBuffers {
    dtype: DType,
    /// `None` in place.
    input: Option<HostBytes>,
    output: HostBytes,
}

impl BufferFactory for HostFactory {
    fn alloc(
        &self,
        _comm: &Communicator,
        bytes: usize,
        dtype: DType,
        in_place: bool,
    ) -> Result<Box<dyn BenchBuffers>> {
        Ok(Box::new(HostBuffers {
            dtype,
            input: (!in_place).then(|| HostBytes::zeroed(bytes)),
            output: HostBytes::zeroed(bytes),
        }))
    }
}

impl BenchBuffers for HostBuffers {
    fn upload(&mut self, host: &[u8]) -> Result<()> {
        let dst = self.input.as_mut().unwrap_or(&mut self.output);
        dst.as_mut_slice().copy_from_slice(host);
        Ok(())
    }

    fn download(&mut self, host: &mut [u8]) -> Result<()> {
        host.copy_from_slice(self.output.as_slice());
        Ok(())
    }

    fn views(&mut self) -> (Option<BufRef<'_>>, BufMut<'_>) {
        (
            self.input.as_ref().map(|b| b.view(self.dtype)),
            self.output.view_mut(self.dtype),
        )
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
mod gpu {
    //! Device buffers on the rank's GPU, and one non-blocking stream per rank, for any runtime.
    use std::marker::PhantomData;

    use allreduce_gpu::device::{DeviceBuffer, GpuDevice, GpuStream};
    use allreduce_gpu::GpuRuntime;

    use super::*;

    pub struct GpuFactory<R>(PhantomData<fn() -> R>);

    impl<R> GpuFactory<R> {
        pub fn new() -> Self {
            GpuFactory(PhantomData)
        }
    }

    struct GpuBuffers<R: GpuRuntime> {
        dtype: DType,
        device: allreduce::Device,
        input: Option<DeviceBuffer<R>>,
        output: DeviceBuffer<R>,
        stream: GpuStream<R>,
        _dev: GpuDevice<R>,
    }

    impl<R: GpuRuntime> BufferFactory for GpuFactory<R> {
        fn alloc(
            &self,
            comm: &Communicator,
            bytes: usize,
            dtype: DType,
            in_place: bool,
        ) -> Result<Box<dyn BenchBuffers>> {
            let (dev, stream) = crate::gpu::open_rank::<R>(comm)?;
            let input = if in_place {
                None
            } else {
                Some(DeviceBuffer::zeroed(bytes, &stream)?)
            };
            let output = DeviceBuffer::zeroed(bytes, &stream)?;
            Ok(Box::new(GpuBuffers {
                dtype,
                device: comm.device(),
                input,
                output,
                stream,
                _dev: dev,
            }))
        }
    }

    impl<R: GpuRuntime> BenchBuffers for GpuBuffers<R> {
        fn upload(&mut self, host: &[u8]) -> Result<()> {
            let dst = self.input.as_ref().unwrap_or(&self.output);
            dst.upload(host, &self.stream)
        }

        fn download(&mut self, host: &mut [u8]) -> Result<()> {
            self.output.download(host, &self.stream)
        }

        fn views(&mut self) -> (Option<BufRef<'_>>, BufMut<'_>) {
            let n = self.output.len() / self.dtype.size();
            // SAFETY: both buffers hold n elements of dtype and live as long as `self`.
            unsafe {
                (
                    self.input
                        .as_ref()
                        .map(|b| BufRef::from_raw(b.addr(), n, self.dtype, self.device)),
                    BufMut::from_raw(self.output.addr(), n, self.dtype, self.device),
                )
            }
        }

        fn stream(&self) -> Stream {
            self.stream.handle()
        }
    }
}
