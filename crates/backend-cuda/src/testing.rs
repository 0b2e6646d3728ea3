//! Device memory and streams for tests and the bench: enough to put host bytes on a GPU,
//! run calls on a stream of one's own, and read the result back.

use std::ffi::c_void;

use allreduce_core::{Result, Stream};
use cudarc::driver::sys;

use crate::driver::{self, check, DeviceMem};

/// A GPU's primary context, to bind before using the helpers below on a thread.
pub fn bind(ordinal: u32) -> Result<driver::Device> {
    let d = driver::Device::open(ordinal)?;
    d.bind()?;
    Ok(d)
}

/// Device memory on the bound device. Every transfer is ordered on a caller's stream: the
/// synchronous driver copies and memsets run on the legacy stream, which does not order with
/// the non-blocking streams ranks run on (and must not: a legacy-stream operation waits for
/// every blocking stream, including ranks spinning on each other, and would deadlock them).
pub struct Buffer {
    mem: DeviceMem,
}

impl Buffer {
    /// Uninitialised device memory.
    pub fn alloc(bytes: usize) -> Result<Self> {
        Ok(Buffer {
            mem: DeviceMem::alloc(bytes)?,
        })
    }

    /// Device memory holding `bytes`, copied on `stream`.
    pub fn from_host(bytes: &[u8], stream: &OwnedStream) -> Result<Self> {
        let b = Self::alloc(bytes.len())?;
        b.upload(bytes, stream)?;
        Ok(b)
    }

    /// Zeroed device memory, zeroed on `stream`.
    pub fn zeroed(bytes: usize, stream: &OwnedStream) -> Result<Self> {
        let b = Self::alloc(bytes)?;
        if bytes > 0 {
            // SAFETY: the allocation holds `bytes`.
            check(
                unsafe { sys::cuMemsetD8Async(b.mem.ptr, 0, bytes, stream.0) },
                "cuMemsetD8Async",
            )?;
        }
        Ok(b)
    }

    pub fn addr(&self) -> usize {
        self.mem.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.mem.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.mem.bytes == 0
    }

    /// Copy `bytes` in on `stream`. The source may be dropped on return: the driver stages
    /// pageable memory before returning.
    pub fn upload(&self, bytes: &[u8], stream: &OwnedStream) -> Result<()> {
        assert!(bytes.len() <= self.mem.bytes);
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: bounds checked.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.mem.ptr,
                    bytes.as_ptr() as *const c_void,
                    bytes.len(),
                    stream.0,
                )
            },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Copy out after everything enqueued on `stream` so far (waits for it).
    pub fn download(&self, out: &mut [u8], stream: &OwnedStream) -> Result<()> {
        assert!(out.len() <= self.mem.bytes);
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: bounds checked; the copy is complete when the stream synchronisation returns.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr() as *mut c_void,
                    self.mem.ptr,
                    out.len(),
                    stream.0,
                ),
                "cuMemcpyDtoHAsync",
            )?;
        }
        stream.synchronize()
    }
}

/// A non-blocking stream on the bound device, destroyed on drop.
pub struct OwnedStream(sys::CUstream);

unsafe impl Send for OwnedStream {}
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn new() -> Result<Self> {
        let mut s = std::ptr::null_mut();
        // SAFETY: a context is bound.
        check(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate")?;
        Ok(OwnedStream(s))
    }

    pub fn handle(&self) -> Stream {
        Stream::from_raw(self.0 as *mut c_void)
    }

    pub fn synchronize(&self) -> Result<()> {
        driver::stream_synchronize(self.handle())
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: created by cuStreamCreate.
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.0);
        }
    }
}

/// A captured CUDA graph, instantiated, replayable on a stream.
pub struct Graph {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
}

unsafe impl Send for Graph {}

impl Graph {
    /// Capture what `body` enqueues on `stream` (thread-local capture mode, so other ranks'
    /// threads may keep enqueueing eagerly or capturing their own).
    pub fn capture(stream: &OwnedStream, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        // SAFETY: the stream is valid; capture is ended on every path.
        unsafe {
            check(
                sys::cuStreamBeginCapture_v2(
                    stream.0,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "cuStreamBeginCapture",
            )?;
            let r = body();
            let mut graph = std::ptr::null_mut();
            let end = check(
                sys::cuStreamEndCapture(stream.0, &mut graph),
                "cuStreamEndCapture",
            );
            r?;
            end?;
            let mut exec = std::ptr::null_mut();
            check(
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "cuGraphInstantiate",
            )?;
            Ok(Graph { exec, graph })
        }
    }

    pub fn launch(&self, stream: &OwnedStream) -> Result<()> {
        // SAFETY: an instantiated graph on a valid stream.
        check(
            unsafe { sys::cuGraphLaunch(self.exec, stream.0) },
            "cuGraphLaunch",
        )
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created in `capture`.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}
