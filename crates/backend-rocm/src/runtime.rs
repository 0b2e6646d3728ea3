//! [`Hip`]: the HIP runtime as a [`GpuRuntime`], so the ROCm backend runs the group logic the
//! GPU backends share (`allreduce_gpu`): the same workspace layout, flag protocol,
//! strategy choice and launch arguments as the CUDA backend, over HIP calls.
//!
//! What differs from CUDA, and why:
//! - **Workspaces are uncached device memory** (`hipExtMallocWithFlags(hipDeviceMallocUncached)`),
//!   as QuickReduce allocates on MI300: peers' stores to flags and staging must be seen
//!   without relying on cache write-back between GPUs.
//! - **Control blocks are coherent mapped host memory** (`hipHostMallocCoherent`): a kernel's
//!   report must reach the host while the group's other kernels still run.
//! - **Wave64 launch shape**: 512-thread blocks are 8 wavefronts; the code objects declare
//!   `amdgpu_flat_work_group_size(1, 512)`, checked at load. Devices whose wavefront is not 64
//!   (RDNA) are refused at open: the kernels are built for CDNA (gfx90a, gfx942, gfx950).
//! - **The kernels' architecture is found by loading**: each embedded code object is tried
//!   with `hipModuleLoadData` until one loads (no `hipDeviceProp_t`, whose layout changed in
//!   ROCm 6).
//! - **`GPU_MAX_HW_QUEUES` is left alone**: HIP maps streams round-robin onto that many
//!   hardware queues per device (4 by default), so more virtual ranks than queues on one GPU
//!   can put two ranks' kernels on one queue, where the one behind waits for the one in front,
//!   which waits for it (until the deadline). The CUDA backend raises its equivalent
//!   (`CUDA_DEVICE_MAX_CONNECTIONS`) itself; here more queues are reported to slow ordinary
//!   inference on MI300, and one GPU per rank (the deployment case) never needs them, so
//!   [`Hip::prepare_group`] only warns, and the conformance suite sets 16 for its own process.

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

use allreduce_core::{DType, Device, Error, GroupConfig, Result, SelectionTable, Stream};
use allreduce_gpu::{abi::THREADS, Fill, GpuRuntime};

use crate::hip::result::{self as hip, device, graph, memory, module, stream};
use crate::hip::sys;
use crate::{kernels, rccl};

/// Initialise the HIP runtime once per process. A missing libamdhip64 is
/// `Error::LibraryUnavailable` naming the files tried.
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        let version = hip::init()?;
        tracing::debug!(version, "HIP runtime initialised");
        Ok(())
    })
    .clone()
}

/// Devices the HIP runtime reports (0 with a runtime but no GPU).
pub fn device_count() -> Result<usize> {
    init()?;
    Ok(device::count()?)
}

/// The HIP runtime as a [`GpuRuntime`].
pub struct Hip;

/// An open HIP device.
#[derive(Debug)]
pub struct HipDevice {
    pub ordinal: u32,
    pub name: String,
    pub compute_units: u32,
    pub wave_size: u32,
}

/// Device memory, freed on drop.
pub struct HipMemory {
    pub ptr: *mut c_void,
    pub bytes: usize,
}

// SAFETY: a device address, usable from any thread.
unsafe impl Send for HipMemory {}
unsafe impl Sync for HipMemory {}

impl Drop for HipMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by hipExtMallocWithFlags; nothing to report a failure to.
        unsafe {
            let _ = memory::free(self.ptr);
        }
    }
}

impl HipMemory {
    /// An IPC handle another process can open with [`IpcMapping::open`] (groups spanning
    /// processes; in-process groups share one address space and do not need it).
    pub fn ipc_handle(&self) -> Result<[u8; sys::HIP_IPC_HANDLE_SIZE]> {
        // SAFETY: the base of a live allocation.
        let h = unsafe { hip::ipc::get_handle(self.ptr)? };
        Ok(h.reserved.map(|c| c as u8))
    }
}

/// A peer process's device memory mapped into this one; unmapped on drop.
pub struct IpcMapping {
    pub ptr: *mut c_void,
}

unsafe impl Send for IpcMapping {}
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Map the allocation behind `handle` on the current device.
    ///
    /// # Safety
    /// `handle` comes from [`HipMemory::ipc_handle`] in another process whose allocation
    /// outlives this mapping.
    pub unsafe fn open(handle: &[u8; sys::HIP_IPC_HANDLE_SIZE]) -> Result<Self> {
        let h = sys::hipIpcMemHandle_t {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        Ok(IpcMapping {
            ptr: hip::ipc::open_handle(h)?,
        })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: opened by hipIpcOpenMemHandle.
        unsafe {
            let _ = hip::ipc::close_handle(self.ptr);
        }
    }
}

/// Pinned, coherent host memory mapped into the device's address space.
pub struct HipHostMapped {
    pub host: *mut c_void,
    pub dev: *mut c_void,
}

unsafe impl Send for HipHostMapped {}
unsafe impl Sync for HipHostMapped {}

impl Drop for HipHostMapped {
    fn drop(&mut self) {
        // SAFETY: allocated by hipHostMalloc.
        unsafe {
            let _ = memory::host_free(self.host);
        }
    }
}

/// The embedded code object that loaded on a device.
pub struct HipModule {
    pub module: sys::hipModule_t,
    /// Its gfx target.
    pub arch: &'static str,
}

unsafe impl Send for HipModule {}
unsafe impl Sync for HipModule {}

impl Drop for HipModule {
    fn drop(&mut self) {
        // SAFETY: loaded by hipModuleLoadData; the group drops its functions first.
        unsafe {
            let _ = module::unload(self.module);
        }
    }
}

/// A non-blocking stream of the device API, destroyed on drop.
pub struct HipStream(pub sys::hipStream_t);

// SAFETY: a stream handle is usable from any thread of the process.
unsafe impl Send for HipStream {}
unsafe impl Sync for HipStream {}

impl Drop for HipStream {
    fn drop(&mut self) {
        // SAFETY: created by hipStreamCreateWithFlags.
        unsafe {
            let _ = stream::destroy(self.0);
        }
    }
}

/// A captured graph and its executable instance, destroyed on drop.
pub struct HipGraph {
    exec: sys::hipGraphExec_t,
    graph: sys::hipGraph_t,
}

// SAFETY: graph handles are usable from any thread; replays are ordered by their stream.
unsafe impl Send for HipGraph {}
unsafe impl Sync for HipGraph {}

impl Drop for HipGraph {
    fn drop(&mut self) {
        // SAFETY: made by end_capture.
        unsafe {
            let _ = graph::destroy(self.exec, self.graph);
        }
    }
}

/// A kernel of a loaded module.
#[derive(Clone, Copy, Debug)]
pub struct HipFunction(pub sys::hipFunction_t);

// SAFETY: function handles may be used from any thread.
unsafe impl Send for HipFunction {}
unsafe impl Sync for HipFunction {}

/// One rank's RCCL communicator.
pub struct RcclComm(pub rccl::sys::ncclComm_t);

// SAFETY: used from one rank's thread at a time.
unsafe impl Send for RcclComm {}
unsafe impl Sync for RcclComm {}

impl Drop for RcclComm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitAll.
        unsafe {
            let _ = rccl::result::destroy(self.0);
        }
    }
}

/// HIP's default number of hardware queues per device (`GPU_MAX_HW_QUEUES` unset).
pub const DEFAULT_HW_QUEUES: usize = 4;

pub use allreduce_gpu::queue_shortfall;

/// Device memory peers' kernels read and write: uncached where the runtime knows the flag
/// (ROCm 6+), else fine-grained, which is also coherent between GPUs. Uninitialised.
fn alloc_uncached(dev: &HipDevice, bytes: usize) -> Result<HipMemory> {
    Hip::bind(dev)?;
    let ptr = match memory::malloc_with_flags(bytes, sys::hipDeviceMallocUncached) {
        Err(e) if e.code() == Some(sys::hipErrorInvalidValue) => {
            hip::clear_last_error();
            tracing::debug!(device = dev.ordinal, "no uncached memory: fine-grained");
            memory::malloc_with_flags(bytes, sys::hipDeviceMallocFinegrained)?
        }
        other => other?,
    };
    Ok(HipMemory { ptr, bytes })
}

/// Load whichever of `objs` (one per gfx target) the device accepts.
fn load_code_object(
    dev: &HipDevice,
    objs: &'static [(&'static str, &'static [u8])],
) -> Result<HipModule> {
    if objs.is_empty() {
        return Err(Error::LibraryUnavailable {
            library: "allreduce's HIP kernels",
            detail: kernels::missing(),
        });
    }
    Hip::bind(dev)?;
    let mut failures = Vec::new();
    for (arch, image) in objs {
        // SAFETY: a complete code object produced by build-support.
        match unsafe { module::load_data(image) } {
            Ok(m) => {
                tracing::debug!(device = dev.ordinal, arch, "HIP kernels loaded");
                return Ok(HipModule { module: m, arch });
            }
            Err(e) => {
                hip::clear_last_error();
                failures.push(format!("{arch}: {e}"));
            }
        }
    }
    Err(Error::Device {
        api: "hipModuleLoadData",
        detail: format!(
            "none of the embedded code objects loads on ROCm device {} ({}): {}; rebuild \
             with its gfx target in ALLREDUCE_HIP_ARCHS",
            dev.ordinal,
            dev.name,
            failures.join("; ")
        ),
    })
}

impl GpuRuntime for Hip {
    const NAME: &'static str = "rocm";

    fn prepare_group(ordinals: &[u32]) -> Result<()> {
        let queues = std::env::var("GPU_MAX_HW_QUEUES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_HW_QUEUES);
        if let Some((o, n, q)) = queue_shortfall(ordinals, queues) {
            tracing::warn!(
                "{n} ranks share ROCm device {o}, which HIP gives {q} hardware queues: two ranks \
                 on one queue wait for each other until the group's deadline. Set \
                 GPU_MAX_HW_QUEUES={n} or more before HIP initialises"
            );
        }
        Ok(())
    }

    type Device = HipDevice;
    type Memory = HipMemory;
    type HostMapped = HipHostMapped;
    type Module = HipModule;
    type Function = HipFunction;
    type Vendor = RcclComm;
    type VendorWindows = rccl::result::Windows;
    type Stream = HipStream;
    type Graph = HipGraph;

    fn device_tag(ordinal: u32) -> Device {
        Device::Rocm(ordinal)
    }

    fn open(ordinal: u32) -> Result<HipDevice> {
        let count = device_count()?;
        if ordinal as usize >= count {
            return Err(Error::InvalidConfig(format!(
                "ROCm device {ordinal} requested but {count} present"
            )));
        }
        let d = ordinal as i32;
        let wave_size = device::attribute(d, sys::hipDeviceAttributeWarpSize)? as u32;
        let name = device::name(d).unwrap_or_default();
        if wave_size != 64 {
            return Err(Error::InvalidConfig(format!(
                "ROCm device {ordinal} ({name}) runs {wave_size}-wide wavefronts; the kernels are \
                 built for wave64 CDNA GPUs (gfx90a, gfx942, gfx950)"
            )));
        }
        Ok(HipDevice {
            ordinal,
            name,
            compute_units: device::attribute(d, sys::hipDeviceAttributeMultiprocessorCount)? as u32,
            wave_size,
        })
    }

    fn ordinal(dev: &HipDevice) -> u32 {
        dev.ordinal
    }

    fn compute_units(dev: &HipDevice) -> u32 {
        dev.compute_units
    }

    fn bind(dev: &HipDevice) -> Result<()> {
        Ok(device::set(dev.ordinal as i32)?)
    }

    fn can_access_peer(dev: &HipDevice, peer: &HipDevice) -> Result<bool> {
        Ok(device::can_access_peer(
            dev.ordinal as i32,
            peer.ordinal as i32,
        )?)
    }

    fn enable_peer(dev: &HipDevice, peer: &HipDevice) -> Result<()> {
        Self::bind(dev)?;
        Ok(device::enable_peer_access(peer.ordinal as i32)?)
    }

    fn alloc_workspace(dev: &HipDevice, bytes: usize) -> Result<HipMemory> {
        let m = alloc_uncached(dev, bytes)?;
        // SAFETY: the allocation holds at least `bytes`. Synchronous memset, then a device
        // sync: the kernels later run on non-blocking streams that do not order with it.
        unsafe { memory::memset(m.ptr, 0, bytes.max(1))? };
        device::synchronize()?;
        Ok(m)
    }

    fn memory_addr(mem: &HipMemory) -> u64 {
        mem.ptr as u64
    }

    fn alloc_host_mapped(dev: &HipDevice, bytes: usize) -> Result<HipHostMapped> {
        Self::bind(dev)?;
        let flags =
            sys::hipHostMallocMapped | sys::hipHostMallocPortable | sys::hipHostMallocCoherent;
        let host = memory::host_malloc(bytes, flags)?;
        // Owned from here on: a failure below frees it.
        let mut m = HipHostMapped {
            host,
            dev: std::ptr::null_mut(),
        };
        // SAFETY: `bytes` of pinned host memory, zeroed before the device sees it.
        unsafe {
            std::ptr::write_bytes(host as *mut u8, 0, bytes);
            m.dev = memory::host_device_pointer(host)?;
        }
        Ok(m)
    }

    fn host_mapped_ptrs(mem: &HipHostMapped) -> (*mut u8, u64) {
        (mem.host as *mut u8, mem.dev as u64)
    }

    fn load_module(dev: &HipDevice) -> Result<HipModule> {
        load_code_object(dev, kernels::code_objects())
    }

    fn function(m: &HipModule, name: &CStr) -> Result<HipFunction> {
        // SAFETY: a loaded module.
        let f = unsafe { module::get_function(m.module, name)? };
        // The wave64 launch shape: the code object must accept THREADS-thread blocks (its
        // amdgpu_flat_work_group_size). An attribute the runtime cannot report is not fatal.
        // SAFETY: `f` belongs to the live module.
        if let Ok(max) = unsafe { module::max_threads_per_block(f) } {
            if max > 0 && (max as u32) < THREADS {
                return Err(Error::Device {
                    api: "hipFuncGetAttribute",
                    detail: format!(
                        "{name:?} ({}) accepts at most {max} threads per block, the launch uses \
                         {THREADS}",
                        m.arch
                    ),
                });
            }
        } else {
            hip::clear_last_error();
        }
        Ok(HipFunction(f))
    }

    unsafe fn launch<A>(
        f: HipFunction,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        Ok(module::launch(
            f.0,
            grid,
            block,
            stream.as_raw() as sys::hipStream_t,
            args,
        )?)
    }

    fn synchronize_device(dev: &HipDevice) -> Result<()> {
        Self::bind(dev)?;
        Ok(device::synchronize()?)
    }

    fn stream_capturing(dev: &HipDevice, stream: Stream) -> Result<bool> {
        Self::bind(dev)?;
        // SAFETY: the caller's stream (or null).
        Ok(unsafe { graph::is_capturing(stream.as_raw() as sys::hipStream_t) }?)
    }

    fn synchronize_stream(_dev: &HipDevice, stream: Stream) -> Result<()> {
        // SAFETY: the caller's stream (or null); HIP reports a stale handle as an error.
        Ok(unsafe { hip::stream::synchronize(stream.as_raw() as sys::hipStream_t) }?)
    }

    fn vendor_unavailable(ordinals: &[u32]) -> Option<String> {
        if std::env::var_os("ALLREDUCE_DISABLE_RCCL").is_some() {
            return Some("disabled by ALLREDUCE_DISABLE_RCCL".into());
        }
        let mut seen = Vec::new();
        for o in ordinals {
            if seen.contains(o) {
                return Some(format!(
                    "RCCL needs one GPU per rank; this group has several ranks on GPU {o} \
                     (virtual ranks)"
                ));
            }
            seen.push(*o);
        }
        rccl::sys::lib().err()
    }

    fn vendor_init(devices: &[&HipDevice]) -> Result<Vec<RcclComm>> {
        let list: Vec<i32> = devices.iter().map(|d| d.ordinal as i32).collect();
        let comms = rccl::result::init_all(&list)?;
        Ok(comms.into_iter().map(RcclComm).collect())
    }

    fn export_memory(mem: &HipMemory) -> Result<Vec<u8>> {
        Ok(mem.ipc_handle()?.to_vec())
    }

    fn export_address(dev: &HipDevice, addr: u64) -> Result<(Vec<u8>, u64)> {
        Self::bind(dev)?;
        // SAFETY: queries only; the handle is of the live allocation holding `addr`.
        let (base, h) = unsafe {
            let base = hip::ipc::allocation_base(addr as *mut c_void)?;
            (base, hip::ipc::get_handle(base)?)
        };
        Ok((h.reserved.map(|c| c as u8).to_vec(), addr - base as u64))
    }

    unsafe fn import_memory(dev: &HipDevice, handle: &[u8]) -> Result<u64> {
        let bytes: [u8; sys::HIP_IPC_HANDLE_SIZE] =
            handle.try_into().map_err(|_| Error::Bootstrap {
                detail: format!(
                    "a HIP IPC handle is {} bytes, a peer sent {}",
                    sys::HIP_IPC_HANDLE_SIZE,
                    handle.len()
                ),
            })?;
        Self::bind(dev)?;
        // Kept open until close_import: the group owns the mapping.
        let m = IpcMapping::open(&bytes)?;
        let addr = m.ptr as u64;
        std::mem::forget(m);
        Ok(addr)
    }

    unsafe fn close_import(dev: &HipDevice, addr: u64) {
        if Self::bind(dev).is_ok() {
            let _ = hip::ipc::close_handle(addr as *mut std::ffi::c_void);
        }
    }

    unsafe fn vendor_all_reduce(
        comm: &RcclComm,
        _dev: &HipDevice,
        input: usize,
        output: usize,
        n: usize,
        dtype: DType,
        stream: Stream,
    ) -> Result<()> {
        rccl::result::all_reduce(comm.0, input, output, n, dtype, stream.as_raw())
    }

    /// RCCL keeps NCCL's window API where it exports it; no version gate of its own.
    fn vendor_symmetric_unavailable() -> Option<String> {
        rccl::sys::window::lib().err()
    }

    fn vendor_windows_alloc(devices: &[&HipDevice], bytes: usize) -> Result<rccl::result::Windows> {
        let list: Vec<i32> = devices.iter().map(|d| d.ordinal as i32).collect();
        rccl::result::Windows::alloc(&list, bytes)
    }

    fn vendor_windows_register(
        windows: &mut rccl::result::Windows,
        comms: &[RcclComm],
        _devices: &[&HipDevice],
    ) -> Result<()> {
        let raw: Vec<_> = comms.iter().map(|c| c.0).collect();
        windows.register(&raw)
    }

    fn vendor_window_addr(windows: &rccl::result::Windows, i: usize) -> u64 {
        windows.addr(i)
    }

    unsafe fn copy_async(dst: u64, src: u64, bytes: usize, stream: Stream) -> Result<()> {
        Ok(memory::copy_async(
            dst as *mut c_void,
            src as *const c_void,
            bytes,
            sys::hipMemcpyDeviceToDevice,
            stream.as_raw() as sys::hipStream_t,
        )?)
    }

    fn create_fused_group(
        group: allreduce_gpu::GroupView<Hip>,
        config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        allreduce_gpu::fused::create_group(group, config).map(Some)
    }

    /// The instances fused.hip holds: the kernel table's (none: only the generic `_w0`).
    const FUSED_WORLDS: &'static [usize] = allreduce_gpu::kernels::Vendor::Hip.fused_worlds();

    fn load_fused_module(dev: &HipDevice) -> Result<HipModule> {
        load_code_object(dev, kernels::fused_code_objects())
    }

    /// The Lamport buffers are polled by peers like the workspaces, so the same uncached
    /// memory. hipMemsetD16/D32 run on the null stream: the device sync orders them before
    /// the kernels on the caller's non-blocking streams.
    fn alloc_filled(dev: &HipDevice, bytes: usize, fill: Fill) -> Result<HipMemory> {
        let m = alloc_uncached(dev, bytes)?;
        // SAFETY: the allocation holds `bytes`, whole words of the fill's width.
        unsafe {
            match fill {
                Fill::U32(v) => memory::memset_d32(m.ptr, v, bytes / 4)?,
                Fill::U16(v) => memory::memset_d16(m.ptr, v, bytes / 2)?,
                Fill::U8(v) => memory::memset(m.ptr, v, bytes)?,
            }
        }
        device::synchronize()?;
        Ok(m)
    }

    fn default_selection(config: &GroupConfig) -> SelectionTable {
        crate::select::default_table(config.cast_bf16_to_f16)
    }

    fn create_stream(dev: &HipDevice) -> Result<HipStream> {
        Self::bind(dev)?;
        Ok(HipStream(stream::create_non_blocking()?))
    }

    fn stream_handle(s: &HipStream) -> Stream {
        Stream::from_raw(s.0)
    }

    fn stream_synchronize(s: &HipStream) -> Result<()> {
        // SAFETY: our own live stream.
        Ok(unsafe { stream::synchronize(s.0) }?)
    }

    /// A memset on the stream, waited for: creates the stream's hardware queue now.
    fn warm_stream(_dev: &HipDevice, s: &HipStream) -> Result<()> {
        // SAFETY: the stream outlives the memory, freed below after the wait.
        let m = unsafe { Self::alloc(s, 16)? };
        // SAFETY: 16 bytes of live memory.
        unsafe { memory::memset_async(m.ptr, 0, 16, s.0)? };
        Self::stream_synchronize(s)
    }

    /// hipMalloc (freed by hipFree on drop): the stream is not needed.
    unsafe fn alloc(_s: &HipStream, bytes: usize) -> Result<HipMemory> {
        Ok(HipMemory {
            ptr: memory::malloc(bytes)?,
            bytes,
        })
    }

    fn memory_len(mem: &HipMemory) -> usize {
        mem.bytes
    }

    /// Waits for the stream: HIP may read pageable memory after hipMemcpyAsync returns.
    unsafe fn upload(mem: &HipMemory, offset: usize, src: &[u8], s: &HipStream) -> Result<()> {
        memory::copy_async(
            (mem.ptr as *mut u8).add(offset) as *mut c_void,
            src.as_ptr() as *const c_void,
            src.len(),
            sys::hipMemcpyHostToDevice,
            s.0,
        )?;
        Self::stream_synchronize(s)
    }

    unsafe fn download(
        mem: &HipMemory,
        offset: usize,
        dst: &mut [u8],
        s: &HipStream,
    ) -> Result<()> {
        memory::copy_async(
            dst.as_mut_ptr() as *mut c_void,
            (mem.ptr as *const u8).add(offset) as *const c_void,
            dst.len(),
            sys::hipMemcpyDeviceToHost,
            s.0,
        )?;
        Self::stream_synchronize(s)
    }

    unsafe fn fill(
        mem: &HipMemory,
        offset: usize,
        bytes: usize,
        fill: Fill,
        s: &HipStream,
    ) -> Result<()> {
        let at = (mem.ptr as *mut u8).add(offset) as *mut c_void;
        match fill {
            Fill::U8(v) => memory::memset_async(at, v, bytes, s.0)?,
            Fill::U16(v) => memory::memset_d16_async(at, v, bytes / 2, s.0)?,
            Fill::U32(v) => memory::memset_d32_async(at, v, bytes / 4, s.0)?,
        }
        Ok(())
    }

    unsafe fn copy(
        dst: &HipMemory,
        dst_offset: usize,
        src: &HipMemory,
        src_offset: usize,
        bytes: usize,
        s: &HipStream,
    ) -> Result<()> {
        Ok(memory::copy_async(
            (dst.ptr as *mut u8).add(dst_offset) as *mut c_void,
            (src.ptr as *const u8).add(src_offset) as *const c_void,
            bytes,
            sys::hipMemcpyDeviceToDevice,
            s.0,
        )?)
    }

    fn begin_capture(s: &HipStream) -> Result<()> {
        // SAFETY: our own live stream.
        Ok(unsafe { graph::begin_capture(s.0) }?)
    }

    fn end_capture(s: &HipStream) -> Result<HipGraph> {
        // SAFETY: our own live stream; the graph is destroyed with its instance (or below).
        unsafe {
            let g = graph::end_capture(s.0)?;
            match graph::instantiate(g) {
                Ok(exec) => Ok(HipGraph { exec, graph: g }),
                Err(e) => {
                    let _ = graph::destroy(std::ptr::null_mut(), g);
                    Err(e.into())
                }
            }
        }
    }

    fn launch_graph(g: &HipGraph, s: &HipStream) -> Result<()> {
        // SAFETY: an instantiated graph on our own stream.
        Ok(unsafe { graph::launch(g.exec, s.0) }?)
    }

    unsafe fn launch_words(
        f: HipFunction,
        grid: u32,
        block: u32,
        stream: Stream,
        words: &[u64],
    ) -> Result<()> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        Ok(module::launch_packed(
            f.0,
            grid,
            block,
            stream.as_raw() as sys::hipStream_t,
            &bytes,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_virtual_ranks_than_hardware_queues_is_found() {
        assert_eq!(queue_shortfall(&[0, 1, 2, 3, 4, 5, 6, 7], 4), None);
        assert_eq!(queue_shortfall(&[0, 0, 0, 0], 4), None);
        assert_eq!(queue_shortfall(&[0; 8], 4), Some((0, 8, 4)));
        assert_eq!(queue_shortfall(&[1, 0, 1, 1, 1, 1], 4), Some((1, 5, 4)));
        assert_eq!(queue_shortfall(&[0; 8], 16), None);
    }
}
