//! What a GPU backend is made of, so that every vendor runs the same group logic.
//!
//! A GPU backend is two things: a [`GpuRuntime`] (the dozen device operations the group logic
//! needs, over the vendor's runtime: allocate, map host memory, load the kernels, launch with
//! one by-value [`abi::Args`] block, synchronise, enable peers, and the vendor collective
//! library), and the group logic itself, [`GpuBackend`]/[`GpuComm`], which is written once
//! against the trait: the workspace layout ([`abi`]), the flag protocol's launch arguments,
//! the warm-up, strategy choice, the call descriptors ranks compare in the kernel, and how a
//! device-side timeout or mismatch becomes an [`Error`](allreduce_core::Error).
//!
//! Both GPU backends are built this way: `Cuda = GpuBackend<CudaRuntime>` (allreduce-backend-cuda)
//! and `Rocm = GpuBackend<Hip>` (allreduce-backend-rocm). The fused all-reduce + RMSNorm's
//! host side is [`fused`], over the same trait.
//!
//! Methods are associated functions (`R::bind(&dev)`): a runtime is a type, not a value,
//! because the vendor library behind it is process-global and loaded once.

use std::ffi::CStr;

use allreduce_core::{Call, Device, GroupConfig, Result, SelectionTable, Stream};

pub mod abi;
pub mod fused;
mod group;
pub mod kernels;

pub use group::{GpuBackend, GpuComm, GroupView};

/// A pattern [`GpuRuntime::alloc_filled`] repeats over a whole allocation: one word of the
/// width of the elements the memory will hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    U32(u32),
    U16(u16),
}

/// The device operations the shared group logic needs from a vendor runtime.
///
/// Every method that allocates, loads or launches runs with `dev` (or the device the caller
/// bound last, for [`GpuRuntime::launch`]) current on the calling thread; implementations
/// whose runtime has a per-thread current device bind it themselves where a device is passed.
pub trait GpuRuntime: Sized + Send + Sync + 'static {
    /// The backend's name (`"cuda"`, `"rocm"`): `Backend::NAME`, and in error messages.
    const NAME: &'static str;
    /// Blocks per launch with one rank per GPU (fewer when ranks share a GPU, see
    /// [`GpuRuntime::compute_units`]). vLLM's grid-searched 36 for its one-/two-shot kernels.
    const BLOCKS_PER_RANK: u32 = 36;

    /// An open device (a context retained, attributes read).
    type Device: Send + Sync;
    /// Device memory, freed on drop.
    type Memory: Send + Sync;
    /// Pinned host memory mapped into the device's address space, freed on drop.
    type HostMapped: Send + Sync;
    /// The loaded kernels, unloaded on drop.
    type Module: Send + Sync;
    /// A kernel handle (valid while its module lives).
    type Function: Copy + Send + Sync;
    /// One rank's communicator of the vendor library (NCCL, RCCL), destroyed on drop.
    type Vendor: Send + Sync;

    /// Called first when a group over these device ordinals (one per rank) is built: a
    /// runtime's own checks or warnings about the group's shape.
    fn prepare_group(_ordinals: &[u32]) -> Result<()> {
        Ok(())
    }

    /// How buffers on device `ordinal` are tagged (`Device::Rocm(ordinal)`).
    fn device_tag(ordinal: u32) -> Device;
    /// Open device `ordinal`. A missing runtime library or device is an error value.
    fn open(ordinal: u32) -> Result<Self::Device>;
    fn ordinal(dev: &Self::Device) -> u32;
    /// Streaming multiprocessors (CUDA) or compute units (ROCm): ranks sharing a GPU split
    /// them, since all their blocks must be resident at once.
    fn compute_units(dev: &Self::Device) -> u32;
    /// Make `dev` current on the calling thread.
    fn bind(dev: &Self::Device) -> Result<()>;
    fn can_access_peer(dev: &Self::Device, peer: &Self::Device) -> Result<bool>;
    /// Let `dev` read and write `peer`'s memory (already enabled is not an error).
    fn enable_peer(dev: &Self::Device, peer: &Self::Device) -> Result<()>;

    /// A rank's workspace: zeroed, and visible to peers' kernels without stale caches (on
    /// ROCm: uncached device memory, as QuickReduce allocates it). Complete on return.
    fn alloc_workspace(dev: &Self::Device, bytes: usize) -> Result<Self::Memory>;
    fn memory_addr(mem: &Self::Memory) -> u64;
    /// Zeroed, coherent host memory the device can write (where kernels report errors).
    fn alloc_host_mapped(dev: &Self::Device, bytes: usize) -> Result<Self::HostMapped>;
    /// The host pointer and the device address of the same bytes.
    fn host_mapped_ptrs(mem: &Self::HostMapped) -> (*mut u8, u64);

    /// Load the backend's embedded kernels for `dev`'s architecture.
    fn load_module(dev: &Self::Device) -> Result<Self::Module>;
    /// Look up a kernel by name, loaded eagerly (no lazy first-launch work later).
    fn function(module: &Self::Module, name: &CStr) -> Result<Self::Function>;

    /// Launch `f` on the current device with one by-value argument block.
    ///
    /// # Safety
    /// `A` must match the kernel's parameter layout, and every pointer in it must stay valid
    /// until the kernel has run.
    unsafe fn launch<A>(
        f: Self::Function,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()>;
    /// Wait for all work on `dev`.
    fn synchronize_device(dev: &Self::Device) -> Result<()>;
    /// Wait for the work on `stream` (a stream of `dev`).
    fn synchronize_stream(dev: &Self::Device, stream: Stream) -> Result<()>;

    /// Why the vendor library cannot serve a group over these device ordinals, or `None`.
    fn vendor_unavailable(ordinals: &[u32]) -> Option<String>;
    /// One vendor communicator per rank, `devices[r]` being rank r's (all distinct).
    fn vendor_init(devices: &[&Self::Device]) -> Result<Vec<Self::Vendor>>;
    /// Enqueue `call` on the vendor library (its buffers validated by `prepare`).
    ///
    /// # Safety
    /// The call's buffers must be valid device memory of `dev` until its stream passes it.
    unsafe fn vendor_all_reduce(comm: &Self::Vendor, dev: &Self::Device, call: &Call)
        -> Result<()>;

    /// The table behind `Strategy::Auto` when the caller gives none.
    fn default_selection(_config: &GroupConfig) -> SelectionTable {
        SelectionTable::default_table()
    }

    /// Why `Strategy::QuantizedTwoShot` cannot run, or `None` when the module holds the codec
    /// kernels (`ar_quantized_{f16,bf16}_{codec}`, kernels-common quantized.h).
    fn quantized_unavailable() -> Option<String> {
        None
    }

    /// How `dev` reaches `peer`'s memory (two distinct devices). The default knows only
    /// whether there is peer access at all, and calls it PCIe.
    fn link(dev: &Self::Device, peer: &Self::Device) -> Result<allreduce_core::Link> {
        Ok(if Self::can_access_peer(dev, peer)? {
            allreduce_core::Link::Pcie
        } else {
            allreduce_core::Link::None
        })
    }

    /// The NUMA node of `dev`, where the platform says (Linux sysfs by PCI bus id).
    fn numa_node(_dev: &Self::Device) -> Option<u32> {
        None
    }

    /// Bytes that name the physical device the same way in every process (a UUID): ranks of
    /// a multi-process group with equal ids share one GPU. The default, the ordinal, is only
    /// right when every process sees the same device numbering.
    fn device_id(dev: &Self::Device) -> Vec<u8> {
        Self::ordinal(dev).to_le_bytes().to_vec()
    }

    /// Unmap an address [`GpuRuntime::import_memory`] returned.
    ///
    /// # Safety
    /// `addr` came from `import_memory` on `dev` and is not used afterwards.
    unsafe fn close_import(_dev: &Self::Device, _addr: u64) {}

    /// A vendor-library group id (`ncclGetUniqueId`), made by rank 0 of a multi-process group
    /// and sent to the others over the bootstrap.
    fn vendor_unique_id() -> Result<Vec<u8>> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend has no multi-process vendor library",
            Self::NAME
        )))
    }

    /// This process's communicator of a vendor group spanning processes.
    fn vendor_init_rank(
        _dev: &Self::Device,
        _id: &[u8],
        _rank: usize,
        _world: usize,
    ) -> Result<Self::Vendor> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend has no multi-process vendor library",
            Self::NAME
        )))
    }

    /// Fused all-reduce workspaces for every rank of `group`, or `None` where the runtime has
    /// none: the facade then runs the all-reduce and the epilogue separately. A runtime with
    /// the fused module ([`GpuRuntime::load_fused_module`], [`GpuRuntime::alloc_filled`])
    /// returns [`fused::create_group`]'s.
    fn create_fused_group(
        _group: GroupView<Self>,
        _config: &allreduce_core::FusedConfig,
    ) -> Result<Option<Vec<Box<dyn allreduce_core::FusedComm>>>> {
        Ok(None)
    }

    /// World sizes the fused module has specialised instances for (`ar_fused_*_w2`); other
    /// worlds use the generic `_w0` instance.
    const FUSED_WORLDS: &'static [usize] = &[];

    /// Whether `dev` runs thread-block clusters (CUDA sm_90 and later), which the fused
    /// one-shot's split kernel needs ([`GpuRuntime::launch_cluster`]).
    fn has_clusters(_dev: &Self::Device) -> bool {
        false
    }

    /// As [`GpuRuntime::launch`], in clusters of `cluster` blocks (`grid` a multiple of it).
    ///
    /// # Safety
    /// As [`GpuRuntime::launch`].
    unsafe fn launch_cluster<A>(
        _f: Self::Function,
        _grid: u32,
        _cluster: u32,
        _block: u32,
        _stream: Stream,
        _args: &A,
    ) -> Result<()> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend has no thread-block clusters",
            Self::NAME
        )))
    }

    /// Whether `dev` runs programmatic dependent launches ([`GpuRuntime::launch_dependent`]:
    /// CUDA sm_90 and later).
    fn has_pdl(_dev: &Self::Device) -> bool {
        false
    }

    /// As [`GpuRuntime::launch`] (in clusters of `cluster` blocks where `cluster` > 1, as
    /// [`GpuRuntime::launch_cluster`]), and the kernel may be scheduled before the stream's
    /// previous kernel has completed (programmatic dependent launch), once that kernel lets
    /// it: the kernel must wait for it (`pdl_wait` in shim.h) before its first memory access.
    /// Where [`GpuRuntime::has_pdl`] is false, an ordinary launch.
    ///
    /// # Safety
    /// As [`GpuRuntime::launch`].
    unsafe fn launch_dependent<A>(
        f: Self::Function,
        grid: u32,
        cluster: u32,
        block: u32,
        stream: Stream,
        args: &A,
    ) -> Result<()> {
        if cluster > 1 {
            Self::launch_cluster(f, grid, cluster, block, stream, args)
        } else {
            Self::launch(f, grid, block, stream, args)
        }
    }

    /// Load the fused all-reduce + RMSNorm kernels (a second module, `fused.h`'s) for `dev`,
    /// which the caller has made current.
    fn load_fused_module(_dev: &Self::Device) -> Result<Self::Module> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend has no fused kernels",
            Self::NAME
        )))
    }

    /// Device memory of `bytes` that peers' kernels read and write (as
    /// [`GpuRuntime::alloc_workspace`]'s), every word set to `fill` rather than zero: the
    /// fused kernels' Lamport buffers, whose "not written yet" is -0.0. Runs with `dev`
    /// current (the caller bound it); complete on return.
    fn alloc_filled(_dev: &Self::Device, _bytes: usize, _fill: Fill) -> Result<Self::Memory> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend has no fused kernels",
            Self::NAME
        )))
    }

    /// A handle another process can open to map `mem` (CUDA/HIP IPC handles), for groups
    /// that span processes. Not needed by in-process groups, which share one address space.
    fn export_memory(_mem: &Self::Memory) -> Result<Vec<u8>> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend cannot export memory to other processes yet",
            Self::NAME
        )))
    }

    /// Map a peer process's memory from its [`GpuRuntime::export_memory`] handle; returns
    /// the device address in this process.
    ///
    /// # Safety
    /// `handle` must come from a live allocation of another process of the same group.
    unsafe fn import_memory(_dev: &Self::Device, _handle: &[u8]) -> Result<u64> {
        Err(allreduce_core::Error::InvalidConfig(format!(
            "the {} backend cannot import memory from other processes yet",
            Self::NAME
        )))
    }
}
