//! Device memory and streams for tests and the bench: enough to put host bytes on an AMD GPU,
//! run calls on a stream of one's own, and read the result back. The twin of the CUDA
//! backend's `testing` module (same names), so harnesses differ only in the import.
//!
//! Everything is allocated before a sequence of calls and freed after it: on virtual ranks
//! (several on one GPU), an allocation or free made while a peer's kernel waits for this
//! rank's next launch can wait for the whole device, a cycle only the deadline breaks.

use std::ffi::c_void;

use allreduce_core::{Result, Stream};

use crate::hip::result::{device, graph, memory, stream};
use crate::hip::sys;
use crate::runtime::{self, Hip, HipDevice};
use allreduce_gpu::GpuRuntime;

/// Open device `ordinal` and make it current on this thread.
pub fn bind(ordinal: u32) -> Result<HipDevice> {
    let d = Hip::open(ordinal)?;
    Hip::bind(&d)?;
    Ok(d)
}

/// Devices present (0 with a runtime but no GPU); `Err` without a runtime.
pub fn device_count() -> Result<usize> {
    runtime::device_count()
}

/// A non-blocking stream on the current device, destroyed on drop.
pub struct OwnedStream(sys::hipStream_t);

unsafe impl Send for OwnedStream {}

impl OwnedStream {
    pub fn new() -> Result<Self> {
        Ok(OwnedStream(stream::create_non_blocking()?))
    }

    pub fn handle(&self) -> Stream {
        Stream::from_raw(self.0)
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: our own live stream.
        Ok(unsafe { stream::synchronize(self.0) }?)
    }

    /// Run a trivial operation so the stream's first-use work (creating its hardware queue)
    /// happens now, not while a peer waits.
    pub fn warm(&self) -> Result<()> {
        let b = Buffer::zeroed(16, self)?;
        self.synchronize()?;
        drop(b);
        Ok(())
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: created by hipStreamCreateWithFlags.
        unsafe {
            let _ = stream::destroy(self.0);
        }
    }
}

/// Device memory on the current device (`hipMalloc`), freed on drop.
pub struct Buffer {
    ptr: *mut c_void,
    bytes: usize,
}

unsafe impl Send for Buffer {}

impl Buffer {
    /// Uninitialised device memory.
    pub fn alloc(bytes: usize, _stream: &OwnedStream) -> Result<Self> {
        Ok(Buffer {
            ptr: memory::malloc(bytes)?,
            bytes,
        })
    }

    /// Device memory holding `bytes` (copied on `stream`; complete on return).
    pub fn from_host(bytes: &[u8], stream: &OwnedStream) -> Result<Self> {
        let b = Self::alloc(bytes.len(), stream)?;
        b.upload(bytes, stream)?;
        Ok(b)
    }

    /// Zeroed device memory, zeroed on `stream`.
    pub fn zeroed(bytes: usize, stream: &OwnedStream) -> Result<Self> {
        let b = Self::alloc(bytes, stream)?;
        if bytes > 0 {
            // SAFETY: the allocation holds `bytes`.
            unsafe { memory::memset_async(b.ptr, 0, bytes, stream.0)? };
        }
        Ok(b)
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copy `bytes` in; waits for the stream (HIP may read pageable memory after returning).
    pub fn upload(&self, bytes: &[u8], s: &OwnedStream) -> Result<()> {
        assert!(bytes.len() <= self.bytes);
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: both ranges hold `bytes.len()`; the wait keeps the source alive long enough.
        unsafe {
            memory::copy_async(
                self.ptr,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
                sys::hipMemcpyHostToDevice,
                s.0,
            )?
        };
        s.synchronize()
    }

    /// Copy out after everything enqueued on `s` (waits for it).
    pub fn download(&self, out: &mut [u8], s: &OwnedStream) -> Result<()> {
        assert!(out.len() <= self.bytes);
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: as in upload.
        unsafe {
            memory::copy_async(
                out.as_mut_ptr() as *mut c_void,
                self.ptr,
                out.len(),
                sys::hipMemcpyDeviceToHost,
                s.0,
            )?
        };
        s.synchronize()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated by hipMalloc.
        unsafe {
            let _ = memory::free(self.ptr);
        }
    }
}

/// A captured HIP graph, instantiated, replayable on a stream.
pub struct Graph {
    exec: sys::hipGraphExec_t,
    graph: sys::hipGraph_t,
}

unsafe impl Send for Graph {}

impl Graph {
    /// Capture what `body` enqueues on `stream` (thread-local capture mode, so other ranks'
    /// threads may keep enqueueing eagerly or capturing their own).
    pub fn capture(s: &OwnedStream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        // SAFETY: our own live stream; the capture is ended on every path.
        unsafe {
            graph::begin_capture(s.0)?;
            let r = body();
            let end = graph::end_capture(s.0);
            r?;
            let g = end?;
            let mut out = Graph {
                exec: std::ptr::null_mut(),
                graph: g,
            };
            out.exec = graph::instantiate(g)?;
            Ok(out)
        }
    }

    pub fn launch(&self, s: &OwnedStream) -> Result<()> {
        // SAFETY: an instantiated graph on our own stream.
        Ok(unsafe { graph::launch(self.exec, s.0) }?)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created in `capture`.
        unsafe {
            let _ = graph::destroy(self.exec, self.graph);
        }
    }
}

/// Wait for all work on the current device.
pub fn synchronize_device() -> Result<()> {
    Ok(device::synchronize()?)
}
