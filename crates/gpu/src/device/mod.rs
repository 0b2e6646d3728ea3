//! Safe handles over [`GpuRuntime`]'s device API, for code that owns device memory and streams
//! of its own: the conformance tests, the bench, and (later) users of the facade. Written once;
//! every backend gets them by implementing the trait.
//!
//! The contract is the trait's (see the device API section of [`GpuRuntime`]): work is
//! ordered on the stream passed, uploads return once the host bytes are consumed, downloads
//! once they have arrived, and nothing waits for the whole device. A [`DeviceBuffer`] keeps
//! the stream it was allocated on alive, since it may be freed in that stream's order.
//!
//! On virtual ranks, allocate and fill every buffer of a sequence before any rank's first
//! call and free them only after every rank is done: an allocation or a free may wait for the
//! device while a peer's kernel waits for this rank's next launch.

mod kernels;

use std::sync::Arc;

use allreduce_core::{Error, Result, Stream};

use crate::{Fill, GpuRuntime};

pub use kernels::{CodecInput, CodecKernels, CopyKernel, Segment};

/// An open device, current on the thread that opened it.
pub struct GpuDevice<R: GpuRuntime> {
    raw: R::Device,
}

impl<R: GpuRuntime> GpuDevice<R> {
    /// Open device `ordinal` and make it current on this thread. A missing runtime or device
    /// is an error value.
    pub fn open(ordinal: u32) -> Result<Self> {
        let raw = R::open(ordinal)?;
        R::bind(&raw)?;
        Ok(GpuDevice { raw })
    }

    /// Make the device current on this thread.
    pub fn bind(&self) -> Result<()> {
        R::bind(&self.raw)
    }

    /// Apply the process-wide settings virtual ranks need ([`GpuRuntime::prepare_virtual_ranks`]).
    pub fn prepare_virtual_ranks(&self) -> Result<()> {
        R::prepare_virtual_ranks(&self.raw)
    }

    pub fn ordinal(&self) -> u32 {
        R::ordinal(&self.raw)
    }

    pub fn raw(&self) -> &R::Device {
        &self.raw
    }
}

/// A stream of one device, destroyed once it and every buffer allocated on it are dropped.
pub struct GpuStream<R: GpuRuntime> {
    raw: Arc<R::Stream>,
}

impl<R: GpuRuntime> GpuStream<R> {
    pub fn new(dev: &GpuDevice<R>) -> Result<Self> {
        Ok(GpuStream {
            raw: Arc::new(R::create_stream(&dev.raw)?),
        })
    }

    /// The handle calls take (`AllReduceOptions::stream`).
    pub fn handle(&self) -> Stream {
        R::stream_handle(&self.raw)
    }

    /// Wait for the work enqueued so far.
    pub fn synchronize(&self) -> Result<()> {
        R::stream_synchronize(&self.raw)
    }

    /// Do the stream's first-use work now ([`GpuRuntime::warm_stream`]), before ranks sharing
    /// a GPU start waiting for each other's launches on it.
    pub fn warm(&self, dev: &GpuDevice<R>) -> Result<()> {
        R::warm_stream(&dev.raw, &self.raw)
    }

    pub fn raw(&self) -> &R::Stream {
        &self.raw
    }
}

/// Device memory for data, on the device of the stream it was allocated on; freed on drop.
pub struct DeviceBuffer<R: GpuRuntime> {
    // Declared first: dropped (freed, maybe in the stream's order) before the stream goes.
    mem: R::Memory,
    bytes: usize,
    _stream: Arc<R::Stream>,
}

impl<R: GpuRuntime> DeviceBuffer<R> {
    /// `bytes` of uninitialised memory, usable by work enqueued on `stream` from now on.
    pub fn alloc(bytes: usize, stream: &GpuStream<R>) -> Result<Self> {
        // SAFETY: the buffer holds the stream until the memory is dropped.
        let mem = unsafe { R::alloc(&stream.raw, bytes)? };
        Ok(DeviceBuffer {
            mem,
            bytes,
            _stream: stream.raw.clone(),
        })
    }

    /// Memory holding `src`, copied on `stream`.
    pub fn from_host(src: &[u8], stream: &GpuStream<R>) -> Result<Self> {
        let b = Self::alloc(src.len(), stream)?;
        b.upload(src, stream)?;
        Ok(b)
    }

    /// Zeroed memory, zeroed on `stream`.
    pub fn zeroed(bytes: usize, stream: &GpuStream<R>) -> Result<Self> {
        let b = Self::alloc(bytes, stream)?;
        b.fill(0, bytes, Fill::U8(0), stream)?;
        Ok(b)
    }

    /// The device address, for buffer views (`BufRef::from_raw`).
    pub fn addr(&self) -> usize {
        R::memory_addr(&self.mem) as usize
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn raw(&self) -> &R::Memory {
        &self.mem
    }

    fn range(&self, what: &str, offset: usize, bytes: usize) -> Result<()> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "{what} of {bytes} bytes at offset {offset} exceeds a device buffer of {} bytes",
                self.bytes
            ))),
        }
    }

    /// Copy `src` in from the start, on `stream`; `src` may be reused on return.
    pub fn upload(&self, src: &[u8], stream: &GpuStream<R>) -> Result<()> {
        self.upload_at(0, src, stream)
    }

    /// Copy `src` in at byte `offset`, on `stream`; `src` may be reused on return.
    pub fn upload_at(&self, offset: usize, src: &[u8], stream: &GpuStream<R>) -> Result<()> {
        self.range("an upload", offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: in bounds; the memory lives until dropped, after (in stream order) the copy.
        unsafe { R::upload(&self.mem, offset, src, &stream.raw) }
    }

    /// Copy the first `dst.len()` bytes out after the work enqueued on `stream` so far.
    pub fn download(&self, dst: &mut [u8], stream: &GpuStream<R>) -> Result<()> {
        self.download_at(0, dst, stream)
    }

    /// Copy `dst.len()` bytes from byte `offset` out after the work enqueued on `stream`.
    pub fn download_at(&self, offset: usize, dst: &mut [u8], stream: &GpuStream<R>) -> Result<()> {
        self.range("a download", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: in bounds.
        unsafe { R::download(&self.mem, offset, dst, &stream.raw) }
    }

    /// Repeat `fill` over `bytes` from byte `offset` (both multiples of its width), on
    /// `stream`.
    pub fn fill(
        &self,
        offset: usize,
        bytes: usize,
        fill: Fill,
        stream: &GpuStream<R>,
    ) -> Result<()> {
        self.range("a fill", offset, bytes)?;
        let w = fill.width();
        if offset % w != 0 || bytes % w != 0 {
            return Err(Error::InvalidArgument(format!(
                "a fill of {w}-byte words needs an offset and length in whole words, got {offset} and {bytes}"
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: in bounds and whole words; the memory outlives the fill in stream order.
        unsafe { R::fill(&self.mem, offset, bytes, fill, &stream.raw) }
    }

    /// Copy `bytes` from `src` at `src_offset` to this buffer at `dst_offset`, on `stream`.
    pub fn copy_from(
        &self,
        dst_offset: usize,
        src: &DeviceBuffer<R>,
        src_offset: usize,
        bytes: usize,
        stream: &GpuStream<R>,
    ) -> Result<()> {
        self.range("a copy's destination", dst_offset, bytes)?;
        src.range("a copy's source", src_offset, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges in bounds; both buffers outlive the copy in stream order.
        unsafe {
            R::copy(
                &self.mem,
                dst_offset,
                &src.mem,
                src_offset,
                bytes,
                &stream.raw,
            )
        }
    }
}

/// A captured graph, instantiated, replayable on a stream.
pub struct GpuGraph<R: GpuRuntime> {
    raw: R::Graph,
}

impl<R: GpuRuntime> GpuGraph<R> {
    /// Capture what `body` enqueues on `stream` from this thread (other ranks' threads may
    /// keep enqueueing eagerly or capture their own). The capture is ended on every path;
    /// `body`'s error comes first.
    pub fn capture(stream: &GpuStream<R>, body: impl FnOnce() -> Result<()>) -> Result<Self> {
        R::begin_capture(&stream.raw)?;
        let r = body();
        let end = R::end_capture(&stream.raw);
        r?;
        Ok(GpuGraph { raw: end? })
    }

    /// Replay the graph on `stream`.
    pub fn launch(&self, stream: &GpuStream<R>) -> Result<()> {
        R::launch_graph(&self.raw, &stream.raw)
    }
}

#[cfg(test)]
mod tests;
