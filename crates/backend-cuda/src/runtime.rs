//! The CUDA driver as a [`GpuRuntime`]: the group logic (workspaces, flags, strategy choice,
//! warm-up, how device-side errors become `Error`s) is `allreduce_gpu`, shared with the
//! ROCm backend; this file is only the dozen device operations it needs, over [`driver`] and
//! [`nccl`]. So every test that runs here on the H200 also runs the ROCm backend's group logic.

use std::ffi::CStr;

use allreduce_core::{Call, Device, Error, Link, Result, Stream};
use allreduce_gpu::{Fill, GpuBackend, GpuComm, GpuRuntime};
use cudarc::driver::sys;

use crate::driver::{self, check, CUfunction};
use crate::nccl;

pub(crate) static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/allreduce.fatbin"));

/// The CUDA backend.
pub type Cuda = GpuBackend<CudaRuntime>;
/// One rank of a CUDA group.
pub type CudaComm = GpuComm<CudaRuntime>;

/// The CUDA driver API (through cudarc's `sys` layer, loaded at run time).
pub struct CudaRuntime;

/// A kernel handle: `CUfunction` is a raw pointer, valid from any thread while its module is
/// loaded.
#[derive(Clone, Copy)]
pub struct Function(CUfunction);
// SAFETY: see above.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

impl GpuRuntime for CudaRuntime {
    const NAME: &'static str = "cuda";

    type Device = driver::Device;
    type Memory = driver::DeviceMem;
    type HostMapped = driver::HostMapped;
    type Module = driver::Module;
    type Function = Function;
    type Vendor = nccl::Comm;

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
        Ok(ptr)
    }

    unsafe fn close_import(dev: &driver::Device, addr: u64) {
        if dev.bind().is_ok() {
            let _ = sys::cuIpcCloseMemHandle(addr);
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
        call: &Call,
    ) -> Result<()> {
        dev.bind()?;
        nccl::all_reduce(
            comm,
            call.input.addr,
            call.output.addr,
            call.len(),
            call.dtype(),
            call.stream,
        )
    }
}
