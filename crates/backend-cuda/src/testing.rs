//! Device memory and streams for tests and the bench: enough to put host bytes on a GPU,
//! run calls on a stream of one's own, and read the result back.

use std::ffi::c_void;

use allreduce_core::{Result, Stream};
use cudarc::driver::sys;

use crate::driver::{self, check};

/// A GPU's primary context, to bind before using the helpers below on a thread.
///
/// Also stops the device's default memory pool from reusing memory across streams through
/// internal dependencies: with them, an allocation on one rank's stream may be made to wait
/// for a free on another rank's stream, which on virtual ranks (whose kernels wait for each
/// other) closes a cycle and deadlocks until the deadline.
pub fn bind(ordinal: u32) -> Result<driver::Device> {
    let d = driver::Device::open(ordinal)?;
    d.bind()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: a valid device; the attribute values are i32 booleans.
    unsafe {
        check(
            sys::cuDeviceGetDefaultMemPool(&mut pool, d.dev),
            "cuDeviceGetDefaultMemPool",
        )?;
        for attr in [
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
        ] {
            let mut off: i32 = 0;
            check(
                sys::cuMemPoolSetAttribute(pool, attr, &mut off as *mut i32 as *mut c_void),
                "cuMemPoolSetAttribute",
            )?;
        }
        // Never hand freed memory back at a synchronisation: unmapping it can wait for the
        // whole device, the same cycle as above.
        let mut keep = u64::MAX;
        check(
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut c_void,
            ),
            "cuMemPoolSetAttribute",
        )?;
    }
    Ok(d)
}

/// Device memory on the bound device, allocated and freed in stream order.
///
/// Everything here is ordered on a caller's stream, never on the legacy stream, and nothing
/// synchronises the whole device: ranks on one GPU spin on each other's flags, so a device-wide
/// wait (cuMemFree, a synchronous memset or copy) issued by one rank's thread while a peer's
/// kernel waits for that rank's next launch deadlocks them until the deadline.
pub struct Buffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
}

unsafe impl Send for Buffer {}

impl Buffer {
    /// Uninitialised device memory, usable by work enqueued on `stream` from now on.
    pub fn alloc(bytes: usize, stream: &OwnedStream) -> Result<Self> {
        let mut ptr = 0;
        // SAFETY: a context is bound and the stream is valid.
        check(
            unsafe { sys::cuMemAllocAsync(&mut ptr, bytes.max(1), stream.0) },
            "cuMemAllocAsync",
        )?;
        Ok(Buffer {
            ptr,
            bytes,
            stream: stream.0,
        })
    }

    /// Device memory holding `bytes`, copied on `stream`.
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
            check(
                unsafe { sys::cuMemsetD8Async(b.ptr, 0, bytes, stream.0) },
                "cuMemsetD8Async",
            )?;
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

    /// Copy `bytes` in on `stream`. The source may be dropped on return: the driver stages
    /// pageable memory before returning.
    pub fn upload(&self, bytes: &[u8], stream: &OwnedStream) -> Result<()> {
        assert!(bytes.len() <= self.bytes);
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: bounds checked.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.ptr,
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
        assert!(out.len() <= self.bytes);
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: bounds checked; the copy is complete when the stream synchronisation returns.
        unsafe {
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr() as *mut c_void,
                    self.ptr,
                    out.len(),
                    stream.0,
                ),
                "cuMemcpyDtoHAsync",
            )?;
        }
        stream.synchronize()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAllocAsync; freed in the order of its stream, after the
        // work already enqueued there. The stream must outlive the buffer.
        unsafe {
            let _ = sys::cuMemFreeAsync(self.ptr, self.stream);
        }
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

    /// Run an empty kernel on the stream and wait for it. A stream's first kernel launch may
    /// do lazy setup that waits for the device; make it here, before ranks on one GPU start
    /// waiting for each other's launches on these streams.
    pub fn warm(&self) -> Result<()> {
        let k = CopyKernel::load()?;
        let mut n: u64 = 0;
        let mut null: u64 = 0;
        let mut params = [
            &mut null as *mut u64 as *mut c_void,
            &mut null as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
        ];
        // SAFETY: n_vec = 0: the copy kernel touches no memory.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    k.f,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    self.0,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )?;
        self.synchronize()
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

/// The roofline copy kernel (`ar_copy_f32x4`) from the same fatbin as the collectives, for
/// baselines measured in the same run: a plain device copy, and a bare launch.
pub struct CopyKernel {
    f: sys::CUfunction,
    _module: driver::Module,
}

unsafe impl Send for CopyKernel {}

impl CopyKernel {
    /// Load on the bound device.
    pub fn load() -> Result<Self> {
        let module = driver::Module::load(crate::runtime::FATBIN)?;
        let f = module.function(c"ar_copy_f32x4")?;
        Ok(CopyKernel { f, _module: module })
    }

    /// Copy `bytes` (a multiple of 16) from `src` to `dst` on `stream` with `grid` x 512 threads.
    pub fn copy(
        &self,
        src: &Buffer,
        dst: &Buffer,
        bytes: usize,
        grid: u32,
        stream: &OwnedStream,
    ) -> Result<()> {
        assert!(bytes % 16 == 0 && bytes <= src.len() && bytes <= dst.len());
        #[repr(C)]
        struct Args {
            src: u64,
            dst: u64,
            n_vec: u64,
        }
        let args = Args {
            src: src.ptr,
            dst: dst.ptr,
            n_vec: (bytes / 16) as u64,
        };
        let mut params = [
            &args.src as *const u64 as *mut c_void,
            &args.dst as *const u64 as *mut c_void,
            &args.n_vec as *const u64 as *mut c_void,
        ];
        // SAFETY: three pointer-sized parameters as the kernel declares; bounds asserted.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    self.f,
                    grid,
                    1,
                    1,
                    512,
                    1,
                    1,
                    0,
                    stream.0,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

/// The codec segment kernels (`ar_encode_*` / `ar_decode_*`, kernels-common quantized.h): one
/// buffer encoded into one segment of the codec format (docs/codecs.md) and back, for the
/// bit-exactness tests against the Rust reference and the codec benchmark.
pub struct CodecKernels {
    /// `[f32, bf16][codec index in Codec::ALL][encode, decode]`.
    f: [[[sys::CUfunction; 2]; 7]; 2],
    _module: driver::Module,
}

unsafe impl Send for CodecKernels {}

/// Element types the segment kernels are built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodecInput {
    F32,
    Bf16,
}

impl CodecInput {
    pub fn size(self) -> usize {
        match self {
            CodecInput::F32 => 4,
            CodecInput::Bf16 => 2,
        }
    }
}

/// One segment kernel launch: `n` elements of `input` through `codec`, `grid` blocks of 512.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub input: CodecInput,
    pub codec: allreduce_core::Codec,
    pub n: usize,
    pub grid: u32,
}

impl CodecKernels {
    /// Load on the bound device.
    pub fn load() -> Result<Self> {
        let module = driver::Module::load(crate::runtime::FATBIN)?;
        let mut f = [[[std::ptr::null_mut(); 2]; 7]; 2];
        for (t, ty) in ["f32", "bf16"].iter().enumerate() {
            for (c, codec) in allreduce_core::Codec::ALL.iter().enumerate() {
                for (d, dir) in ["encode", "decode"].iter().enumerate() {
                    let name = std::ffi::CString::new(format!("ar_{dir}_{ty}_{}", codec.name()))
                        .expect("no NUL");
                    f[t][c][d] = module.function(&name)?;
                }
            }
        }
        Ok(CodecKernels { f, _module: module })
    }

    fn launch(
        &self,
        job: Segment,
        dir: usize,
        src: usize,
        dst: usize,
        stream: &OwnedStream,
    ) -> Result<()> {
        let c = allreduce_core::Codec::ALL
            .iter()
            .position(|&x| x == job.codec)
            .expect("listed");
        let t = match job.input {
            CodecInput::F32 => 0,
            CodecInput::Bf16 => 1,
        };
        #[repr(C)]
        struct Args {
            src: u64,
            dst: u64,
            n: u64,
        }
        let args = Args {
            src: src as u64,
            dst: dst as u64,
            n: job.n as u64,
        };
        // SAFETY: one 24-byte parameter, kernels-common's CodecArgs; the callers checked the
        // buffer sizes.
        unsafe { driver::launch(self.f[t][c][dir], job.grid, 512, stream.0 as _, &args) }
    }

    /// Encode `job.n` elements of `src` into one segment at `dst`, which must hold
    /// `codec.encoded_len(n)` bytes (padding bytes are left as they were).
    pub fn encode(
        &self,
        job: Segment,
        src: &Buffer,
        dst: &Buffer,
        stream: &OwnedStream,
    ) -> Result<()> {
        assert!(job.n * job.input.size() <= src.len() && job.codec.encoded_len(job.n) <= dst.len());
        self.launch(job, 0, src.addr(), dst.addr(), stream)
    }

    /// Decode one segment of `job.n` elements at `src` into `dst`.
    pub fn decode(
        &self,
        job: Segment,
        src: &Buffer,
        dst: &Buffer,
        stream: &OwnedStream,
    ) -> Result<()> {
        assert!(job.n * job.input.size() <= dst.len() && job.codec.encoded_len(job.n) <= src.len());
        self.launch(job, 1, src.addr(), dst.addr(), stream)
    }
}
