//! The CUDA driver as a [`GpuRuntime`]: the group logic (workspaces, flags, strategy choice,
//! warm-up, how device-side errors become `Error`s) is `allreduce_gpu`, shared with the
//! ROCm backend; this file is only the dozen device operations it needs, over [`driver`] and
//! [`nccl`]. So every test that runs here on the H200 also runs the ROCm backend's group logic.

use std::ffi::{c_void, CStr};

use allreduce_core::{DType, Device, Error, Link, Result, Stream};
use allreduce_gpu::{Fill, GpuBackend, GpuComm, GpuRuntime};
use cudarc::driver::sys;

use crate::driver::{self, check, CUfunction, CUstream};
use crate::nccl;

pub(crate) static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/allreduce.fatbin"));

/// The CUDA backend.
pub type Cuda = GpuBackend<CudaRuntime>;
/// One rank of a CUDA group.
pub type CudaComm = GpuComm<CudaRuntime>;

/// The CUDA driver API (through cudarc's `sys` layer, loaded at run time).
pub struct CudaRuntime;

/// Peers' allocations this process has mapped by IPC handle and not yet unmapped: what a
/// group of one process per rank must give back when it is dropped.
static OPEN_IMPORTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many peer allocations this process holds mapped by CUDA IPC handle now (workspaces
/// and registered memory of groups of one process per rank). Every group's are unmapped when
/// it is dropped, so between groups this returns to what it was; soak tests check that.
pub fn open_ipc_mappings() -> usize {
    OPEN_IMPORTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A non-blocking stream of the device API, destroyed on drop.
pub struct OwnedStream(CUstream);

// SAFETY: a stream handle is usable from any thread of the process.
unsafe impl Send for OwnedStream {}
unsafe impl Sync for OwnedStream {}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        // SAFETY: created by cuStreamCreate.
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.0);
        }
    }
}

/// A captured graph and its executable instance, destroyed on drop.
pub struct Graph {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
}

// SAFETY: graph handles are usable from any thread; replays are ordered by their stream.
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: made by end_capture.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A kernel handle: `CUfunction` is a raw pointer, valid from any thread while its module is
/// loaded.
#[derive(Clone, Copy)]
pub struct Function(CUfunction);
// SAFETY: see above.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

/// CUDA's hardware queues per device and process when `CUDA_DEVICE_MAX_CONNECTIONS` is unset.
const DEFAULT_CONNECTIONS: usize = 8;

impl GpuRuntime for CudaRuntime {
    const NAME: &'static str = "cuda";

    type Device = driver::Device;
    type Memory = driver::DeviceMem;
    type HostMapped = driver::HostMapped;
    type Module = driver::Module;
    type Function = Function;
    type Vendor = nccl::Comm;
    type VendorWindows = nccl::Windows;
    type Stream = OwnedStream;
    type Graph = Graph;

    /// CUDA gives a process `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues per device (8 by
    /// default; 1 is what MPS for several processes asks for): virtual ranks beyond that share
    /// a queue and can wait on each other until the deadline.
    fn prepare_group(ordinals: &[u32]) -> Result<()> {
        let queues = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_CONNECTIONS);
        if let Some((o, n, q)) = allreduce_gpu::queue_shortfall(ordinals, queues) {
            tracing::warn!(
                "{n} ranks share CUDA device {o}, which this process reaches through {q} hardware \
                 queues (CUDA_DEVICE_MAX_CONNECTIONS): ranks on one queue can wait for each \
                 other until the group's deadline. Set CUDA_DEVICE_MAX_CONNECTIONS={n} or more \
                 before CUDA initialises"
            );
        }
        Ok(())
    }

    fn device_tag(ordinal: u32) -> Device {
        Device::Cuda(ordinal)
    }

    fn open(ordinal: u32) -> Result<driver::Device> {
        driver::Device::open(ordinal)
    }

    fn ordinal(dev: &driver::Device) -> u32 {
        dev.ordinal
    }

    fn compute_units(dev: &driver::Device) -> u32 {
        dev.sm_count
    }

    fn bind(dev: &driver::Device) -> Result<()> {
        dev.bind()
    }

    fn can_access_peer(dev: &driver::Device, peer: &driver::Device) -> Result<bool> {
        dev.can_access_peer(peer)
    }

    fn enable_peer(dev: &driver::Device, peer: &driver::Device) -> Result<()> {
        dev.enable_peer(peer)
    }

    fn alloc_workspace(dev: &driver::Device, bytes: usize) -> Result<driver::DeviceMem> {
        dev.bind()?;
        driver::DeviceMem::zeroed(bytes)
    }

    fn memory_addr(mem: &driver::DeviceMem) -> u64 {
        mem.ptr
    }

    fn alloc_host_mapped(dev: &driver::Device, bytes: usize) -> Result<driver::HostMapped> {
        dev.bind()?;
        driver::HostMapped::zeroed(bytes)
    }

    fn host_mapped_ptrs(mem: &driver::HostMapped) -> (*mut u8, u64) {
        (mem.host as *mut u8, mem.dev)
    }

    fn load_module(dev: &driver::Device) -> Result<driver::Module> {
        dev.bind()?;
        driver::Module::load(FATBIN)
    }

    fn function(module: &driver::Module, name: &CStr) -> Result<Function> {
        module.function(name).map(Function)
    }

    unsafe fn launch<A>(
        f: Function,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        driver::launch(f.0, grid, block, stream.as_raw() as _, args)
    }

    fn has_clusters(dev: &driver::Device) -> bool {
        dev.cc_major >= 9
    }

    unsafe fn launch_cluster<A>(
        f: Function,
        grid: u32,
        cluster: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        driver::launch_cluster(f.0, grid, cluster, block, stream.as_raw() as _, args)
    }

    fn has_pdl(dev: &driver::Device) -> bool {
        dev.cc_major >= 9
    }

    unsafe fn launch_dependent<A>(
        f: Function,
        grid: u32,
        cluster: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        driver::launch_ex(f.0, grid, cluster, true, block, stream.as_raw() as _, args)
    }

    fn synchronize_device(dev: &driver::Device) -> Result<()> {
        dev.bind()?;
        driver::context_synchronize()
    }

    fn synchronize_stream(dev: &driver::Device, stream: Stream) -> Result<()> {
        dev.bind()?;
        driver::stream_synchronize(stream)
    }

    fn vendor_unavailable(ordinals: &[u32]) -> Option<String> {
        nccl::unavailable(ordinals)
    }

    fn vendor_init(devices: &[&driver::Device]) -> Result<Vec<nccl::Comm>> {
        nccl::init(devices)
    }

    /// Peer access, and NVLink where the driver reports native atomics between the pair:
    /// over PCIe peer atomics are emulated or absent, over NVLink they are native (the same
    /// heuristic as probing NVML's NVLink state, without loading NVML).
    fn link(dev: &driver::Device, peer: &driver::Device) -> Result<Link> {
        if !dev.can_access_peer(peer)? {
            return Ok(Link::None);
        }
        let mut atomics = 0;
        // SAFETY: two valid device handles; the attribute is an int.
        check(
            unsafe {
                sys::cuDeviceGetP2PAttribute(
                    &mut atomics,
                    sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                    dev.dev,
                    peer.dev,
                )
            },
            "cuDeviceGetP2PAttribute",
        )?;
        Ok(if atomics != 0 {
            Link::NvLink
        } else {
            Link::Pcie
        })
    }

    /// From the PCI bus id: /sys/bus/pci/devices/<id>/numa_node (-1 means none).
    fn numa_node(dev: &driver::Device) -> Option<u32> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the buffer is 32 bytes, more than a bus id's 13 and its NUL.
        let r = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 32, dev.dev) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return None;
        }
        // SAFETY: NUL-terminated by the driver.
        let id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .to_ascii_lowercase();
        let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?;
        text.trim()
            .parse::<i64>()
            .ok()
            .and_then(|n| u32::try_from(n).ok())
    }

    fn create_fused_group(
        group: allreduce_gpu::GroupView<CudaRuntime>,
        config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        allreduce_gpu::fused::create_group(group, config).map(Some)
    }

    /// The instances fused.cu holds: the kernel table's.
    const FUSED_WORLDS: &'static [usize] = allreduce_gpu::kernels::Vendor::Cuda.fused_worlds();

    /// On the context the caller made current (no bind of our own).
    fn load_fused_module(_dev: &driver::Device) -> Result<driver::Module> {
        driver::Module::load(crate::fused::FUSED_FATBIN)
    }

    /// cuMemAlloc, a cuMemsetD32/D16 of the whole allocation, and a context synchronise (the
    /// memset runs on the legacy stream; the kernels later run on the caller's).
    fn alloc_filled(_dev: &driver::Device, bytes: usize, fill: Fill) -> Result<driver::DeviceMem> {
        let m = driver::DeviceMem::alloc(bytes)?;
        // SAFETY: the allocation holds `m.bytes`, a multiple of the word size (the caller's
        // Lamport sizes are whole elements).
        unsafe {
            match fill {
                Fill::U32(v) => check(sys::cuMemsetD32_v2(m.ptr, v, m.bytes / 4), "cuMemsetD32")?,
                Fill::U16(v) => check(sys::cuMemsetD16_v2(m.ptr, v, m.bytes / 2), "cuMemsetD16")?,
                Fill::U8(v) => check(sys::cuMemsetD8_v2(m.ptr, v, m.bytes), "cuMemsetD8")?,
            }
        }
        driver::context_synchronize()?;
        Ok(m)
    }

    fn device_id(dev: &driver::Device) -> Vec<u8> {
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: a valid device handle; a failure falls back to the ordinal below.
        let ok =
            unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev.dev) } == sys::CUresult::CUDA_SUCCESS;
        if ok {
            uuid.bytes.iter().map(|&b| b as u8).collect()
        } else {
            dev.ordinal.to_le_bytes().to_vec()
        }
    }

    fn export_memory(mem: &driver::DeviceMem) -> Result<Vec<u8>> {
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: the base of a live cuMemAlloc allocation (IPC needs exactly that).
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut h, mem.ptr) },
            "cuIpcGetMemHandle",
        )?;
        Ok(h.reserved.iter().map(|&b| b as u8).collect())
    }

    fn export_address(dev: &driver::Device, addr: u64) -> Result<(Vec<u8>, u64)> {
        dev.bind()?;
        let (mut base, mut size) = (0, 0);
        // SAFETY: out-pointers to locals; an address no allocation holds is an error return.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) },
            "cuMemGetAddressRange",
        )?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: the base of the live allocation holding `addr`.
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut h, base) },
            "cuIpcGetMemHandle",
        )
        .map_err(|e| Error::Device {
            api: "cuIpcGetMemHandle",
            detail: format!(
                "{e}: only memory from cuMemAlloc/cudaMalloc can be shared with other \
                     processes (not a stream-ordered pool's, nor VMM memory)"
            ),
        })?;
        Ok((h.reserved.iter().map(|&b| b as u8).collect(), addr - base))
    }

    unsafe fn import_memory(dev: &driver::Device, handle: &[u8]) -> Result<u64> {
        let bytes: [u8; 64] = handle.try_into().map_err(|_| Error::Bootstrap {
            detail: format!(
                "a CUDA IPC handle is 64 bytes, a peer sent {}",
                handle.len()
            ),
        })?;
        let h = sys::CUipcMemHandle {
            reserved: bytes.map(|b| b as std::ffi::c_char),
        };
        dev.bind()?;
        let mut ptr = 0;
        // Lazy peer access: the mapping enables it for a peer GPU when first touched, and a
        // mapping of the same GPU (ranks sharing it, under MPS) needs none.
        check(
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            ),
            "cuIpcOpenMemHandle",
        )?;
        OPEN_IMPORTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(ptr)
    }

    unsafe fn close_import(dev: &driver::Device, addr: u64) {
        if dev.bind().is_ok() && sys::cuIpcCloseMemHandle(addr) == sys::CUresult::CUDA_SUCCESS {
            OPEN_IMPORTS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn vendor_unique_id() -> Result<Vec<u8>> {
        nccl::unique_id()
    }

    fn vendor_init_rank(
        dev: &driver::Device,
        id: &[u8],
        rank: usize,
        world: usize,
    ) -> Result<nccl::Comm> {
        dev.bind()?;
        nccl::init_rank(id, rank, world)
    }

    unsafe fn vendor_all_reduce(
        comm: &nccl::Comm,
        dev: &driver::Device,
        input: usize,
        output: usize,
        n: usize,
        dtype: DType,
        stream: Stream,
    ) -> Result<()> {
        dev.bind()?;
        nccl::all_reduce(comm, input, output, n, dtype, stream)
    }

    fn vendor_symmetric_unavailable() -> Option<String> {
        nccl::symmetric_unavailable()
    }

    fn vendor_windows_alloc(devices: &[&driver::Device], bytes: usize) -> Result<nccl::Windows> {
        nccl::Windows::alloc(devices, bytes)
    }

    fn vendor_windows_register(
        windows: &mut nccl::Windows,
        comms: &[nccl::Comm],
        _devices: &[&driver::Device],
    ) -> Result<()> {
        windows.register(comms)
    }

    fn vendor_window_addr(windows: &nccl::Windows, i: usize) -> u64 {
        windows.addr(i)
    }

    unsafe fn copy_async(dst: u64, src: u64, bytes: usize, stream: Stream) -> Result<()> {
        check(
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.as_raw() as _),
            "cuMemcpyDtoDAsync",
        )
    }

    /// Stops the device's default memory pool (what [`GpuRuntime::alloc`] allocates from)
    /// from reusing memory across streams through internal dependencies: with them, an
    /// allocation on one rank's stream may be made to wait for a free on another rank's
    /// stream, which on virtual ranks (whose kernels wait for each other) closes a cycle and
    /// deadlocks until the deadline. And never hands freed memory back at a
    /// synchronisation: unmapping it can wait for the whole device, the same cycle. Affects
    /// every user of the pool in this process.
    fn prepare_virtual_ranks(dev: &driver::Device) -> Result<()> {
        dev.bind()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: a valid device; the attribute values are an i32 boolean and a u64.
        unsafe {
            check(
                sys::cuDeviceGetDefaultMemPool(&mut pool, dev.dev),
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
        Ok(())
    }

    fn create_stream(dev: &driver::Device) -> Result<OwnedStream> {
        dev.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: a context is bound; flag 1 is CU_STREAM_NON_BLOCKING.
        check(unsafe { sys::cuStreamCreate(&mut s, 1) }, "cuStreamCreate")?;
        Ok(OwnedStream(s))
    }

    fn stream_handle(s: &OwnedStream) -> Stream {
        Stream::from_raw(s.0 as *mut c_void)
    }

    fn stream_synchronize(s: &OwnedStream) -> Result<()> {
        driver::stream_synchronize(Self::stream_handle(s))
    }

    /// An empty launch of the copy kernel: a stream's first kernel launch may do lazy setup
    /// that waits for the device.
    fn warm_stream(dev: &driver::Device, s: &OwnedStream) -> Result<()> {
        let module = Self::load_module(dev)?;
        let f = Self::function(&module, c"ar_copy_f32x4")?;
        // SAFETY: n_vec = 0: the copy kernel touches no memory.
        unsafe { driver::launch_words(f.0, 1, 32, s.0, &[0, 0, 0])? };
        Self::stream_synchronize(s)
    }

    /// cuMemAllocAsync, freed by cuMemFreeAsync on the same stream.
    unsafe fn alloc(s: &OwnedStream, bytes: usize) -> Result<driver::DeviceMem> {
        driver::DeviceMem::alloc_async(bytes, s.0)
    }

    fn memory_len(mem: &driver::DeviceMem) -> usize {
        mem.bytes
    }

    /// cuMemcpyHtoDAsync: from pageable memory the driver stages the bytes before returning,
    /// so the source is consumed on return without a wait.
    unsafe fn upload(
        mem: &driver::DeviceMem,
        offset: usize,
        src: &[u8],
        s: &OwnedStream,
    ) -> Result<()> {
        check(
            sys::cuMemcpyHtoDAsync_v2(
                mem.ptr + offset as u64,
                src.as_ptr() as *const c_void,
                src.len(),
                s.0,
            ),
            "cuMemcpyHtoDAsync",
        )
    }

    unsafe fn download(
        mem: &driver::DeviceMem,
        offset: usize,
        dst: &mut [u8],
        s: &OwnedStream,
    ) -> Result<()> {
        check(
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr() as *mut c_void,
                mem.ptr + offset as u64,
                dst.len(),
                s.0,
            ),
            "cuMemcpyDtoHAsync",
        )?;
        Self::stream_synchronize(s)
    }

    unsafe fn fill(
        mem: &driver::DeviceMem,
        offset: usize,
        bytes: usize,
        fill: Fill,
        s: &OwnedStream,
    ) -> Result<()> {
        let at = mem.ptr + offset as u64;
        match fill {
            Fill::U8(v) => check(sys::cuMemsetD8Async(at, v, bytes, s.0), "cuMemsetD8Async"),
            Fill::U16(v) => check(
                sys::cuMemsetD16Async(at, v, bytes / 2, s.0),
                "cuMemsetD16Async",
            ),
            Fill::U32(v) => check(
                sys::cuMemsetD32Async(at, v, bytes / 4, s.0),
                "cuMemsetD32Async",
            ),
        }
    }

    unsafe fn copy(
        dst: &driver::DeviceMem,
        dst_offset: usize,
        src: &driver::DeviceMem,
        src_offset: usize,
        bytes: usize,
        s: &OwnedStream,
    ) -> Result<()> {
        check(
            sys::cuMemcpyDtoDAsync_v2(
                dst.ptr + dst_offset as u64,
                src.ptr + src_offset as u64,
                bytes,
                s.0,
            ),
            "cuMemcpyDtoDAsync",
        )
    }

    fn stream_capturing(dev: &driver::Device, stream: Stream) -> Result<bool> {
        dev.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller's live stream (or the null stream) on this device.
        check(
            unsafe { sys::cuStreamIsCapturing(stream.as_raw() as _, &mut status) },
            "cuStreamIsCapturing",
        )?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn begin_capture(s: &OwnedStream) -> Result<()> {
        // SAFETY: a live stream.
        check(
            unsafe {
                sys::cuStreamBeginCapture_v2(
                    s.0,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            "cuStreamBeginCapture",
        )
    }

    fn end_capture(s: &OwnedStream) -> Result<Graph> {
        let mut graph = std::ptr::null_mut();
        // SAFETY: a live stream; the graph is destroyed with its instance (or below).
        unsafe {
            check(
                sys::cuStreamEndCapture(s.0, &mut graph),
                "cuStreamEndCapture",
            )?;
            let mut exec = std::ptr::null_mut();
            if let Err(e) = check(
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "cuGraphInstantiate",
            ) {
                let _ = sys::cuGraphDestroy(graph);
                return Err(e);
            }
            Ok(Graph { exec, graph })
        }
    }

    fn launch_graph(graph: &Graph, s: &OwnedStream) -> Result<()> {
        // SAFETY: an instantiated graph on a live stream.
        check(
            unsafe { sys::cuGraphLaunch(graph.exec, s.0) },
            "cuGraphLaunch",
        )
    }

    unsafe fn launch_words(
        f: Function,
        grid: u32,
        block: u32,
        stream: Stream,
        words: &[u64],
    ) -> Result<()> {
        driver::launch_words(f.0, grid, block, stream.as_raw() as _, words)
    }
}
